//! The driver: target prefill with taps, draft extend, draft steps (chain or tree), tree
//! verification by the target, acceptance, cache commit, and draft extend over what was
//! accepted. The proposer reads the target's hidden states only through the capture hook (the
//! `taps` of every target step), so serving taps exactly what the dump job taps.
//!
//! Alignment (facts section 2): the draft slot at position `t` pairs the target's aux state at
//! `t` with the token at `t + 1`; its output predicts the token at `t + 2`.

use std::time::Instant;

use burn::prelude::*;
use burn::tensor::TensorData;
use burn::tensor::activation::softmax;
use rand::SeedableRng;
use serde::Serialize;
use tandem_eagle::{DraftCache, Eagle3Draft};
use tandem_model::sampling::{SamplingParams, distribution, sample_from};
use tandem_model::{KvCache, LogitsFor, TapRequest, TargetModel};

use crate::admission::Admission;
use crate::stats::AcceptanceStats;
use crate::tree::{BeamSearch, BeamStep, DraftTree, push_roots};
use crate::verify::{Acceptance, verify_greedy, verify_sampling};

/// SGLang's speculative knobs plus sampling.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct SpecConfig {
    /// Draft depth (`--speculative-num-steps`).
    pub num_steps: usize,
    /// Branching (`--speculative-eagle-topk`); 1 = chain drafting.
    pub topk: usize,
    /// Tree size verified, root included (`--speculative-num-draft-tokens`).
    pub num_draft_tokens: usize,
    pub sampling: SamplingParams,
    pub seed: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum InferError {
    #[error("invalid speculative setting {field}: {reason}")]
    Config { field: &'static str, reason: String },
    #[error("invalid request: {reason}")]
    Request { reason: String },
    #[error(transparent)]
    Model(#[from] tandem_model::ModelError),
    #[error(transparent)]
    Draft(#[from] tandem_eagle::EagleError),
    #[error(transparent)]
    Tree(#[from] crate::tree::TreeError),
    #[error(transparent)]
    Cuda(#[from] tandem_cuda::CudaError),
}

impl SpecConfig {
    pub fn chain(num_steps: usize) -> Self {
        Self {
            num_steps,
            topk: 1,
            num_draft_tokens: num_steps + 1,
            sampling: SamplingParams::greedy(),
            seed: 0,
        }
    }

    pub fn validate(&self) -> Result<(), InferError> {
        self.sampling.validate()?;
        if self.num_steps == 0 || self.topk == 0 {
            return Err(InferError::Config {
                field: "num_steps/topk",
                reason: "must be at least 1".into(),
            });
        }
        let candidates = self.topk + (self.num_steps - 1) * self.topk * self.topk;
        if self.num_draft_tokens < 2 || self.num_draft_tokens - 1 > candidates {
            return Err(InferError::Config {
                field: "num_draft_tokens",
                reason: format!(
                    "{} must be in 2..={} for num_steps {} and topk {}",
                    self.num_draft_tokens,
                    candidates + 1,
                    self.num_steps,
                    self.topk
                ),
            });
        }
        Ok(())
    }
}

/// Why a sequence stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum Finish {
    Stop,
    Length,
    ContextFull,
}

/// Where the time of a generation went (host wall clock; device work is synchronised by the
/// token read-backs at the end of verification and drafting).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Timings {
    pub prefill_s: f64,
    /// Part of `prefill_s`: allocating the newcomers' target cache and laying out their
    /// prefill (fast path).
    pub prefill_setup_s: f64,
    pub draft_s: f64,
    pub verify_s: f64,
    pub extend_s: f64,
    /// Wall time of whole rounds and admissions (engines that record it; the phases above are
    /// parts of it, the rest is host bookkeeping between them).
    pub rounds_wall_s: f64,
    pub admits_wall_s: f64,
    /// The head's catch-ups over deferred plain rounds (fast path).
    pub catch_up_s: f64,
    /// Making room (compaction, sequences at the context limit) and retiring finished
    /// sequences from the caches (fast path).
    pub housekeeping_s: f64,
    /// Parts of `housekeeping_s`: cache compaction (both caches), the head cache's row
    /// removal and the head roots' gather when sequences leave (fast path).
    pub compact_s: f64,
    pub head_retain_s: f64,
    pub head_roots_s: f64,
}

impl std::ops::AddAssign for Timings {
    fn add_assign(&mut self, other: Self) {
        self.prefill_s += other.prefill_s;
        self.prefill_setup_s += other.prefill_setup_s;
        self.draft_s += other.draft_s;
        self.verify_s += other.verify_s;
        self.extend_s += other.extend_s;
        self.rounds_wall_s += other.rounds_wall_s;
        self.admits_wall_s += other.admits_wall_s;
        self.catch_up_s += other.catch_up_s;
        self.housekeeping_s += other.housekeeping_s;
        self.compact_s += other.compact_s;
        self.head_retain_s += other.head_retain_s;
        self.head_roots_s += other.head_roots_s;
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct SpecOutput {
    pub tokens: Vec<u32>,
    pub finish: Finish,
    pub stats: AcceptanceStats,
    /// Rounds by draft shape (`steps/topk/tokens`; `none` for a round without drafts), filled
    /// by the fast path's engine, whose policy may change the shape per round.
    pub rounds_by_shape: std::collections::BTreeMap<String, u64>,
}

#[derive(Debug, Clone, Serialize)]
pub struct BatchOutput {
    pub sequences: Vec<SpecOutput>,
    pub timings: Timings,
}

/// Per-sequence drafting state between rounds: the draft extend output at the last committed
/// slot, from which the next round's tree is drafted ([`SpecEngine::draft_trees`]).
pub struct DraftRoot<B: Backend> {
    /// The last verified token (the root of the next tree).
    pub token: u32,
    /// `[1, H]` pre-norm draft output at the last committed position.
    hidden: Tensor<B, 2>,
    /// `[draft_vocab]` draft logits there (predicting the token after `token`).
    logits: Tensor<B, 1>,
}

/// The speculative engine over a target and an EAGLE-3 head on the same device. Without a head
/// the same loop is target-only decoding (every round verifies its root alone: a decode step),
/// the baseline the server and the benchmarks compare speculation against.
pub struct SpecEngine<'a, B: Backend> {
    pub target: &'a TargetModel<B>,
    /// The EAGLE-3 head; `None` decodes with the target alone.
    pub draft: Option<&'a Eagle3Draft<B>>,
    /// The serving taps, in slot order (checked against the head's manifest by the caller;
    /// [`TapRequest::none`] without a head).
    pub taps: TapRequest,
    pub config: SpecConfig,
}

fn rows<B: Backend>(t: Tensor<B, 3>, b: usize, i: usize) -> Tensor<B, 2> {
    let [_, _, d] = t.dims();
    t.slice([b..b + 1, i..i + 1, 0..d]).reshape([1, d])
}

fn ints<B: Backend, const D: usize>(t: Tensor<B, D, Int>) -> Vec<i64> {
    t.into_data()
        .convert::<i64>()
        .to_vec::<i64>()
        .expect("ints")
}

fn floats<B: Backend, const D: usize>(t: Tensor<B, D>) -> Vec<f32> {
    t.into_data()
        .convert::<f32>()
        .to_vec::<f32>()
        .expect("floats")
}

/// Speculative generation of a batch of prompts, whatever runs it: the burn [`SpecEngine`] or
/// the CUDA fast path's [`crate::FastSpecEngine`]. Jobs that measure online acceptance
/// (`compare`) take it so they run the engine serving runs on that device.
pub trait SpecGenerate {
    /// See [`SpecEngine::generate`].
    fn generate(
        &self,
        prompts: &[Vec<u32>],
        max_new_tokens: usize,
        stop_ids: &[u32],
    ) -> Result<BatchOutput, InferError>;
    /// The engine's tree settings.
    fn config(&self) -> SpecConfig;
}

impl<B: Backend> SpecGenerate for SpecEngine<'_, B> {
    fn generate(
        &self,
        prompts: &[Vec<u32>],
        max_new_tokens: usize,
        stop_ids: &[u32],
    ) -> Result<BatchOutput, InferError> {
        SpecEngine::generate(self, prompts, max_new_tokens, stop_ids)
    }
    fn config(&self) -> SpecConfig {
        self.config
    }
}

/// What every engine checks of a request before it joins a batch, whatever the batch: valid
/// sampling, a non-empty prompt inside the vocabulary, a budget of at least one token.
pub(crate) fn check_request_alone(r: &Request, vocab: usize) -> Result<(), InferError> {
    r.sampling.validate()?;
    let reason = if r.prompt.is_empty() {
        "the prompt is empty: it must have at least one token".to_owned()
    } else if let Some(&t) = r.prompt.iter().find(|&&t| t as usize >= vocab) {
        format!("prompt token {t} is outside the vocabulary of {vocab}")
    } else if r.max_new_tokens == 0 {
        "max_new_tokens must be at least 1".to_owned()
    } else {
        return Ok(());
    };
    Err(InferError::Request { reason })
}

/// One request to a [`RunningBatch`]: its own prompt, budget, stop tokens and sampling.
#[derive(Debug, Clone, PartialEq)]
pub struct Request {
    /// The caller's handle; unique within the batch.
    pub id: u64,
    pub prompt: Vec<u32>,
    pub max_new_tokens: usize,
    pub stop_ids: Vec<u32>,
    pub sampling: SamplingParams,
    /// Seed of this request's own sampling stream (results do not depend on batch-mates).
    pub seed: u64,
}

impl Request {
    /// One request per prompt, ids `0..`; request `i` samples from its own stream seeded
    /// `seed + i` (the `generate` of every engine).
    pub(crate) fn for_prompts(
        prompts: &[Vec<u32>],
        max_new_tokens: usize,
        stop_ids: &[u32],
        sampling: SamplingParams,
        seed: u64,
    ) -> Vec<Request> {
        prompts
            .iter()
            .enumerate()
            .map(|(i, prompt)| Request {
                id: i as u64,
                prompt: prompt.clone(),
                max_new_tokens,
                stop_ids: stop_ids.to_vec(),
                sampling,
                seed: seed.wrapping_add(i as u64),
            })
            .collect()
    }
}

/// The `generate` loop of every running batch: admits `requests` (ids `0..n`), steps until the
/// batch is empty and returns each request's output in id order.
pub(crate) fn run_to_completion<Batch>(
    batch: &mut Batch,
    requests: Vec<Request>,
    admit: impl FnOnce(&mut Batch, Vec<Request>) -> Result<Vec<Progress>, InferError>,
    mut step: impl FnMut(&mut Batch) -> Result<Vec<Progress>, InferError>,
    is_empty: impl Fn(&Batch) -> bool,
) -> Result<Vec<SpecOutput>, InferError> {
    let mut outputs: Vec<Option<SpecOutput>> = vec![None; requests.len()];
    let mut progress = admit(batch, requests)?;
    loop {
        for p in progress {
            if let Some(out) = p.finished {
                outputs[p.id as usize] = Some(out);
            }
        }
        if is_empty(batch) {
            break;
        }
        progress = step(batch)?;
    }
    Ok(outputs
        .into_iter()
        .map(|o| o.expect("every sequence finishes"))
        .collect())
}

/// What one sequence produced in one [`SpecEngine::admit`] or [`SpecEngine::step`] call.
#[derive(Debug, Clone)]
pub struct Progress {
    pub id: u64,
    /// Tokens committed by this call (a stop token is not included).
    pub tokens: Vec<u32>,
    /// Draft tokens accepted in this round (`None` for the admission's first token).
    pub accepted: Option<usize>,
    /// The whole output once the sequence has finished; it has then left the batch.
    pub finished: Option<SpecOutput>,
}

struct Sequence<B: Backend> {
    request: Request,
    /// The last committed token: the root of the next round's tree.
    last: u32,
    /// The head's state at `last` (`None` without a head).
    root: Option<DraftRoot<B>>,
    output: SpecOutput,
    rng: rand::rngs::StdRng,
    done: bool,
}

/// The sequences decoding together, with their target and draft caches (one row each).
/// Requests join ([`SpecEngine::admit`]) and leave (finish or [`SpecEngine::cancel`]) between
/// rounds; columns freed by rejected drafts and departed sequences are reclaimed by compaction
/// when the cache runs out of room.
pub struct RunningBatch<B: Backend> {
    caches: Option<(KvCache<B>, Option<DraftCache<B>>)>,
    sequences: Vec<Sequence<B>>,
    capacity: usize,
    draft_capacity: usize,
    /// Time spent so far, by phase.
    pub timings: Timings,
    /// Compactions run so far.
    pub compactions: usize,
}

impl<B: Backend> RunningBatch<B> {
    pub fn len(&self) -> usize {
        self.sequences.len()
    }
    pub fn is_empty(&self) -> bool {
        self.sequences.is_empty()
    }
    /// Ids of the running requests, in row order.
    pub fn ids(&self) -> Vec<u64> {
        self.sequences.iter().map(|s| s.request.id).collect()
    }
    /// Token columns of the target cache (the longest context a sequence can reach).
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    fn remove(&mut self, row: usize) -> Sequence<B> {
        if self.sequences.len() == 1 {
            self.caches = None;
        } else if let Some((cache, dcache)) = &mut self.caches {
            cache.remove(row);
            if let Some(dcache) = dcache {
                dcache.remove(row);
            }
        }
        self.sequences.remove(row)
    }
}

impl<B: Backend> SpecEngine<'_, B> {
    /// Extra draft-cache columns a round may use beyond the target's: the scratch of the draft
    /// steps (rolled back every round).
    pub fn draft_scratch(&self) -> usize {
        draft_scratch(&self.config)
    }

    /// Tokens one round verifies per sequence (1 without a head).
    fn round_width(&self) -> usize {
        if self.draft.is_some() {
            self.config.num_draft_tokens
        } else {
            1
        }
    }

    /// The head, for the drafting functions (an error without one).
    fn head(&self) -> Result<&Eagle3Draft<B>, InferError> {
        self.draft.ok_or_else(|| InferError::Config {
            field: "draft",
            reason: "drafting needs a head; this engine decodes with the target alone".into(),
        })
    }

    /// An empty running batch whose sequences may each reach `capacity` tokens.
    pub fn new_batch(&self, capacity: usize) -> RunningBatch<B> {
        RunningBatch {
            caches: None,
            sequences: Vec::new(),
            capacity,
            draft_capacity: capacity + self.draft_scratch(),
            timings: Timings::default(),
            compactions: 0,
        }
    }

    /// The admission rules of `batch` under this engine (shared by every engine).
    pub fn admission(&self, batch: &RunningBatch<B>) -> Admission {
        Admission {
            capacity: batch.capacity,
            max_positions: self.target.spec.max_position_embeddings,
            round_width: self.round_width(),
            vocab: self.target.spec.vocab_size,
        }
    }

    /// Checks a request against the engine and the batch before anything runs.
    pub fn check_request(&self, batch: &RunningBatch<B>, r: &Request) -> Result<(), InferError> {
        self.admission(batch)
            .check(std::slice::from_ref(r), &batch.ids())
    }

    /// The longest prompt `batch` accepts: one speculative round must still fit after it.
    pub fn max_prompt_len(&self, batch: &RunningBatch<B>) -> usize {
        self.admission(batch).max_prompt_len()
    }

    /// Prefills `requests` on their own (target prefill with taps, first token, draft extend)
    /// and moves them into the running batch. Requests are all checked first: one bad request
    /// refuses the call and changes nothing.
    pub fn admit(
        &self,
        batch: &mut RunningBatch<B>,
        requests: Vec<Request>,
    ) -> Result<Vec<Progress>, InferError> {
        self.config.validate()?;
        self.admission(batch).check(&requests, &batch.ids())?;
        if requests.is_empty() {
            return Ok(Vec::new());
        }
        let n = requests.len();
        let t0 = Instant::now();
        let mut cache = self.target.new_cache(n, batch.capacity);
        let refs: Vec<&[u32]> = requests.iter().map(|r| r.prompt.as_slice()).collect();
        let step = cache.prefill_step(&refs)?;
        let out = self
            .target
            .forward(&step, &mut cache, &self.taps, LogitsFor::Last)?;
        let mut rngs: Vec<rand::rngs::StdRng> = requests
            .iter()
            .map(|r| rand::rngs::StdRng::seed_from_u64(r.seed))
            .collect();
        let params: Vec<SamplingParams> = requests.iter().map(|r| r.sampling).collect();
        let first = pick(out.logits.expect("asked for logits"), &params, &mut rngs);
        batch.timings.prefill_s += t0.elapsed().as_secs_f64();

        // Draft extend over the prompt: slot t pairs aux_t with token t+1 (the last slot with
        // the first generated token).
        let t0 = Instant::now();
        let (dcache, roots) = match self.draft {
            Some(draft) => {
                let mut dcache = draft.new_cache(n, batch.draft_capacity);
                let chunks: Vec<Vec<u32>> = requests
                    .iter()
                    .zip(&first)
                    .map(|(r, &f)| r.prompt[1..].iter().copied().chain([f]).collect())
                    .collect();
                let aux = out.taps.concatenated().expect("the engine requests taps");
                let roots = self.draft_extend(&mut dcache, &chunks, aux, &first)?;
                (Some(dcache), roots.into_iter().map(Some).collect())
            }
            None => (None, (0..n).map(|_| None).collect::<Vec<_>>()),
        };
        batch.timings.extend_s += t0.elapsed().as_secs_f64();

        match &mut batch.caches {
            None => batch.caches = Some((cache, dcache)),
            Some((c, d)) => {
                c.append(cache)?;
                if let (Some(d), Some(dcache)) = (d, dcache) {
                    d.append(dcache)?;
                }
            }
        }
        let mut progress = Vec::with_capacity(n);
        for ((request, root), (rng, &token)) in requests
            .into_iter()
            .zip(roots)
            .zip(rngs.into_iter().zip(&first))
        {
            let mut seq = Sequence {
                output: SpecOutput {
                    tokens: Vec::new(),
                    finish: Finish::Length,
                    stats: AcceptanceStats::new(if self.draft.is_some() {
                        self.config.num_steps
                    } else {
                        0
                    }),
                    rounds_by_shape: Default::default(),
                },
                request,
                last: token,
                root,
                rng,
                done: false,
            };
            commit(&mut seq, &[token]);
            progress.push(Progress {
                id: seq.request.id,
                tokens: seq.output.tokens.clone(),
                accepted: None,
                finished: None,
            });
            batch.sequences.push(seq);
        }
        self.retire(batch, &mut progress);
        Ok(progress)
    }

    /// Removes a request from the batch (a client went away); its output so far is returned.
    pub fn cancel(&self, batch: &mut RunningBatch<B>, id: u64) -> Option<SpecOutput> {
        let row = batch.sequences.iter().position(|s| s.request.id == id)?;
        Some(batch.remove(row).output)
    }

    /// Moves finished sequences out of the batch, filling in their `finished` output.
    fn retire(&self, batch: &mut RunningBatch<B>, progress: &mut [Progress]) {
        for row in (0..batch.sequences.len()).rev() {
            if batch.sequences[row].done {
                let seq = batch.remove(row);
                if let Some(p) = progress.iter_mut().find(|p| p.id == seq.request.id) {
                    p.finished = Some(seq.output);
                }
            }
        }
    }

    /// Makes room for one round: compacts both caches when either would overflow, and ends the
    /// sequences that no longer fit even then (`Finish::ContextFull`).
    fn make_room(&self, batch: &mut RunningBatch<B>, progress: &mut Vec<Progress>) {
        let width = self.round_width();
        let scratch = self.draft_scratch();
        let needs_room = |batch: &RunningBatch<B>| match &batch.caches {
            Some((c, d)) => {
                c.used() + width > c.capacity()
                    || d.as_ref()
                        .is_some_and(|d| d.used() + width + scratch > d.capacity())
            }
            None => false,
        };
        if !needs_room(batch) {
            return;
        }
        let t0 = Instant::now();
        if let Some((c, d)) = &mut batch.caches {
            c.compact();
            if let Some(d) = d {
                d.compact();
            }
        }
        batch.compactions += 1;
        let mut full = Vec::new();
        if let Some((c, _)) = &batch.caches {
            for (row, seq) in batch.sequences.iter_mut().enumerate() {
                if c.seq_len(row) + width > c.capacity() {
                    seq.output.finish = Finish::ContextFull;
                    seq.done = true;
                    full.push(seq.request.id);
                }
            }
        }
        for id in full {
            progress.push(Progress {
                id,
                tokens: Vec::new(),
                accepted: None,
                finished: None,
            });
        }
        self.retire(batch, progress);
        batch.timings.extend_s += t0.elapsed().as_secs_f64();
    }

    /// One speculative round for every running sequence: draft, verify with the target (one
    /// tree step for the batch), accept, commit, draft extend over what was accepted.
    /// Sequences that finish leave the batch.
    pub fn step(&self, batch: &mut RunningBatch<B>) -> Result<Vec<Progress>, InferError> {
        let mut progress = Vec::new();
        self.make_room(batch, &mut progress);
        let Some((cache, dcache)) = &mut batch.caches else {
            return Ok(progress);
        };

        // Draft (without a head, each tree is its root alone: a decode step).
        let t0 = Instant::now();
        let trees = match dcache {
            Some(dcache) => {
                let draft_columns = dcache.used();
                let roots: Vec<&DraftRoot<B>> = batch
                    .sequences
                    .iter()
                    .map(|s| s.root.as_ref().expect("a head keeps a root per sequence"))
                    .collect();
                let trees = self.draft_trees(&roots, dcache)?;
                dcache.rollback(draft_columns);
                trees
            }
            None => batch
                .sequences
                .iter()
                .map(|s| DraftTree::chain(s.last, &[]))
                .collect(),
        };
        batch.timings.draft_s += t0.elapsed().as_secs_f64();

        // Verify the trees with the target (one tree step for the whole batch).
        let t0 = Instant::now();
        let tree_refs: Vec<(&[u32], &[Option<usize>])> = trees
            .iter()
            .map(|t| (t.tokens.as_slice(), t.parents.as_slice()))
            .collect();
        let step = cache.tree_step(&tree_refs)?;
        let verify_width = step.width;
        let out = self
            .target
            .forward(&step, cache, &self.taps, LogitsFor::All)?;
        let logits = out.logits.expect("asked for logits");
        let greedy = |s: &Sequence<B>| s.request.sampling.is_greedy();
        let argmax = batch
            .sequences
            .iter()
            .any(greedy)
            .then(|| ints(logits.clone().argmax(2)));
        let host = (!batch.sequences.iter().all(greedy)).then(|| floats(logits));
        let vocab = self.target.spec.vocab_size;
        let acceptances: Vec<Acceptance> = trees
            .iter()
            .zip(batch.sequences.iter_mut())
            .enumerate()
            .map(|(b, (tree, seq))| match (&argmax, &host) {
                (Some(argmax), _) if seq.request.sampling.is_greedy() => {
                    let row: Vec<u32> = argmax[b * verify_width..b * verify_width + tree.len()]
                        .iter()
                        .map(|&i| i as u32)
                        .collect();
                    verify_greedy(tree, &row)
                }
                (_, Some(host)) => {
                    let params = seq.request.sampling;
                    verify_sampling(
                        tree,
                        |node| {
                            let at = (b * verify_width + node) * vocab;
                            distribution(&host[at..at + vocab], &params)
                        },
                        &mut seq.rng,
                    )
                }
                _ => unreachable!("argmax is computed for greedy rows, host logits for the rest"),
            })
            .collect();
        batch.timings.verify_s += t0.elapsed().as_secs_f64();

        // Commit: keep the accepted path in the target cache; record statistics.
        let t0 = Instant::now();
        let rows = trees.len();
        let mut chunks = Vec::with_capacity(rows);
        let mut aux_rows = Vec::with_capacity(rows);
        let mut last_tokens = Vec::with_capacity(rows);
        for (b, ((tree, acc), seq)) in trees
            .iter()
            .zip(&acceptances)
            .zip(batch.sequences.iter_mut())
            .enumerate()
        {
            let path = acc.path_with_root();
            cache.keep_only(b, verify_width, &path);
            let committed = acc.committed_tokens(tree);
            if self.draft.is_some() {
                let depth = tree.depth.iter().copied().max().unwrap_or(0);
                seq.output.stats.record(acc.accepted.len(), depth);
            }
            let before = seq.output.tokens.len();
            commit(seq, &committed);
            progress.push(Progress {
                id: seq.request.id,
                tokens: seq.output.tokens[before..].to_vec(),
                // Target-only rounds draft nothing.
                accepted: self.draft.map(|_| acc.accepted.len()),
                finished: None,
            });
            seq.last = *committed.last().expect("bonus token");
            last_tokens.push(seq.last);
            aux_rows.push(
                path.iter()
                    .map(|&n| b * verify_width + n)
                    .collect::<Vec<_>>(),
            );
            chunks.push(committed);
        }
        if let Some(dcache) = dcache {
            let aux = out.taps.concatenated().expect("the engine requests taps");
            let aux = gather_rows(aux, &aux_rows);
            let roots = self.draft_extend(dcache, &chunks, aux, &last_tokens)?;
            for (seq, root) in batch.sequences.iter_mut().zip(roots) {
                seq.root = Some(root);
            }
        }
        batch.timings.extend_s += t0.elapsed().as_secs_f64();
        self.retire(batch, &mut progress);
        Ok(progress)
    }

    /// Generates up to `max_new_tokens` for each prompt together. Greedy output equals
    /// target-only greedy output; sampled output follows the target distribution exactly.
    /// Sequence `i` samples from its own stream seeded `config.seed + i`.
    pub fn generate(
        &self,
        prompts: &[Vec<u32>],
        max_new_tokens: usize,
        stop_ids: &[u32],
    ) -> Result<BatchOutput, InferError> {
        self.config.validate()?;
        if prompts.is_empty() {
            return Err(InferError::Request {
                reason: "no prompts to generate from".into(),
            });
        }
        let max_prompt = prompts.iter().map(Vec::len).max().unwrap_or(0);
        let limit = self.target.spec.max_position_embeddings;
        if max_prompt + 1 > limit {
            return Err(InferError::Request {
                reason: format!(
                    "a prompt of {max_prompt} tokens does not fit the context of {limit}"
                ),
            });
        }
        // Room for every round without compaction: each round takes at most one tree's width.
        let width = self.round_width();
        let mut batch = self.new_batch(max_prompt + (max_new_tokens + 1) * width + 1);
        let cfg = self.config;
        let requests =
            Request::for_prompts(prompts, max_new_tokens, stop_ids, cfg.sampling, cfg.seed);
        let sequences = run_to_completion(
            &mut batch,
            requests,
            |b, r| self.admit(b, r),
            |b| self.step(b),
            RunningBatch::is_empty,
        )?;
        Ok(BatchOutput {
            sequences,
            timings: batch.timings,
        })
    }

    /// Draft extend over per-sequence chunks (`chunks[b][j]` pairs with `aux[b, j]`), returning
    /// each sequence's new root (its last chunk slot). `aux` may be wider than the longest
    /// chunk (the extra slots are ignored). Public so offline evaluation (`tandem compare`)
    /// drafts from recorded taps through the same code as serving.
    pub fn draft_extend(
        &self,
        dcache: &mut DraftCache<B>,
        chunks: &[Vec<u32>],
        aux: Tensor<B, 3>,
        last_tokens: &[u32],
    ) -> Result<Vec<DraftRoot<B>>, InferError> {
        let refs: Vec<&[u32]> = chunks.iter().map(Vec::as_slice).collect();
        let step = dcache.prefill_step(&refs)?;
        let [_, aux_width, aux_dim] = aux.dims();
        let aux = if aux_width > step.width {
            aux.slice([0..chunks.len(), 0..step.width, 0..aux_dim])
        } else {
            aux
        };
        let out = self.head()?.extend(&step, aux, dcache)?;
        Ok(chunks
            .iter()
            .enumerate()
            .map(|(b, chunk)| {
                let last = chunk.len() - 1;
                let v = out.logits.dims()[2];
                DraftRoot {
                    token: last_tokens[b],
                    hidden: rows(out.hidden.clone(), b, last),
                    logits: rows(out.logits.clone(), b, last).reshape([v]),
                }
            })
            .collect())
    }

    /// Builds each sequence's draft tree from its root (chain for topk 1, SGLang's beam tree
    /// otherwise). Draft-step keys are written to `dcache`; the caller rolls them back.
    pub fn draft_trees(
        &self,
        roots: &[&DraftRoot<B>],
        dcache: &mut DraftCache<B>,
    ) -> Result<Vec<DraftTree>, InferError> {
        if self.config.topk == 1 {
            self.draft_chains(roots, dcache)
        } else {
            self.draft_beams(roots, dcache)
        }
    }

    fn draft_chains(
        &self,
        roots: &[&DraftRoot<B>],
        dcache: &mut DraftCache<B>,
    ) -> Result<Vec<DraftTree>, InferError> {
        let draft = self.head()?;
        let batch = roots.len();
        let h = draft.spec.hidden_size;
        let mut hidden: Tensor<B, 3> =
            Tensor::cat(roots.iter().map(|r| r.hidden.clone()).collect(), 0).reshape([batch, 1, h]);
        let mut logits: Tensor<B, 2> =
            Tensor::stack(roots.iter().map(|r| r.logits.clone()).collect(), 0);
        let mut drafts: Vec<Vec<u32>> = vec![Vec::new(); batch];
        let want = self.config.num_draft_tokens - 1;
        for s in 0..self.config.num_steps.min(want) {
            let ids = ints(logits.clone().argmax(1));
            let tokens: Vec<u32> = ids
                .iter()
                .map(|&d| draft.vocab.to_target(d as usize))
                .collect();
            for (b, &t) in tokens.iter().enumerate() {
                drafts[b].push(t);
            }
            if s + 1 == self.config.num_steps.min(want) {
                break;
            }
            let step = dcache.decode_step(&tokens)?;
            let out = draft.forward_step(&step, hidden, dcache)?;
            let v = out.logits.dims()[2];
            logits = out.logits.reshape([batch, v]);
            hidden = out.hidden;
        }
        Ok(roots
            .iter()
            .zip(drafts)
            .map(|(r, d)| DraftTree::chain(r.token, &d))
            .collect())
    }

    /// Tree drafting with topk > 1 ([`BeamSearch`]): each draft step re-runs the beams with
    /// their ancestor paths in one tree step of the head (a few dozen rows through one layer)
    /// and rolls it back, so every beam attends to exactly its own ancestors.
    fn draft_beams(
        &self,
        roots: &[&DraftRoot<B>],
        dcache: &mut DraftCache<B>,
    ) -> Result<Vec<DraftTree>, InferError> {
        let draft = self.head()?;
        let k = self.config.topk;
        let batch = roots.len();
        let h = draft.spec.hidden_size;
        let device = roots[0].hidden.device();
        let base_columns = dcache.used();
        let mut searches: Vec<BeamSearch> = (0..batch).map(|_| BeamSearch::new(k)).collect();
        // Output `[1, H]` of each evaluated node, by node index.
        let mut outputs: Vec<Vec<Option<Tensor<B, 2>>>> = vec![Vec::new(); batch];
        let to_target = |ids: &[i64]| -> Vec<u32> {
            ids.iter()
                .map(|&d| draft.vocab.to_target(d as usize))
                .collect()
        };
        // Step 0 from the roots' logits.
        let root_logits: Tensor<B, 2> =
            Tensor::stack(roots.iter().map(|r| r.logits.clone()).collect(), 0);
        let (probs, ids) = softmax(root_logits, 1).topk_with_indices(k, 1);
        let (probs, ids) = (floats(probs), ints(ids));
        push_roots(&mut searches, k, &probs, &to_target(&ids));
        for _ in 1..self.config.num_steps {
            let next = BeamStep::new(&searches);
            let width = next.width;
            let mut hidden_rows = Vec::with_capacity(batch * width);
            for (b, frontier) in next.frontiers.iter().enumerate() {
                for i in 0..width {
                    // A node's hidden input is its parent's output (the root's for depth 0).
                    hidden_rows.push(match frontier.get(i) {
                        Some(&n) => match searches[b].parent(n) {
                            None => roots[b].hidden.clone(),
                            Some(p) => outputs[b][p].clone().expect("parents are evaluated first"),
                        },
                        None => Tensor::zeros([1, h], &device),
                    });
                }
            }
            let step = dcache.tree_step(&next.trees())?;
            let hidden = Tensor::cat(hidden_rows, 0).reshape([batch, step.width, h]);
            let out = draft.forward_step(&step, hidden, dcache)?;
            dcache.rollback(base_columns);
            let (probs, ids) = softmax(out.logits, 2).topk_with_indices(k, 2);
            let (probs, ids) = (floats(probs), ints(ids));
            for (b, search) in searches.iter_mut().enumerate() {
                let mut beam_probs = Vec::with_capacity(k);
                let mut beam_tokens = Vec::with_capacity(k);
                for &beam in search.beams() {
                    let slot = next.slot(b, beam);
                    if outputs[b].len() <= beam {
                        outputs[b].resize(beam + 1, None);
                    }
                    outputs[b][beam] = Some(rows(out.hidden.clone(), b, slot));
                    let at = (b * step.width + slot) * k;
                    beam_probs.push(probs[at..at + k].to_vec());
                    beam_tokens.push(to_target(&ids[at..at + k]));
                }
                search.push(&beam_probs, &beam_tokens);
            }
        }
        roots
            .iter()
            .zip(&searches)
            .map(|(r, search)| Ok(search.build(r.token, self.config.num_draft_tokens)?))
            .collect()
    }
}

/// Head-cache columns a round may use beyond the target's: the scratch of the draft steps,
/// rolled back every round.
pub(crate) fn draft_scratch(cfg: &SpecConfig) -> usize {
    2 * cfg.num_draft_tokens + cfg.num_steps * cfg.topk * (cfg.num_steps + 1) + 8
}

/// Appends committed tokens, stopping at a stop token or the length limit.
fn commit<B: Backend>(seq: &mut Sequence<B>, tokens: &[u32]) {
    commit_tokens(&seq.request, &mut seq.output, &mut seq.done, tokens);
}

/// Appends `tokens` to `output` until a stop token (not included) or the request's length
/// limit ends it.
pub(crate) fn commit_tokens(
    request: &Request,
    output: &mut SpecOutput,
    done: &mut bool,
    tokens: &[u32],
) {
    for &t in tokens {
        if *done {
            return;
        }
        if request.stop_ids.contains(&t) {
            output.finish = Finish::Stop;
            *done = true;
            return;
        }
        output.tokens.push(t);
        if output.tokens.len() >= request.max_new_tokens {
            output.finish = Finish::Length;
            *done = true;
        }
    }
}

/// Next token per sequence from `[batch, 1, vocab]` target logits, each with its own sampling
/// parameters and random stream.
pub(crate) fn pick<B: Backend>(
    logits: Tensor<B, 3>,
    params: &[SamplingParams],
    rngs: &mut [rand::rngs::StdRng],
) -> Vec<u32> {
    let [b, _, v] = logits.dims();
    let argmax = ints(logits.clone().argmax(2));
    let host = params
        .iter()
        .any(|p| !p.is_greedy())
        .then(|| floats(logits));
    (0..b)
        .map(|i| match &host {
            Some(host) if !params[i].is_greedy() => sample_from(
                &distribution(&host[i * v..(i + 1) * v], &params[i]),
                &mut rngs[i],
            ) as u32,
            _ => argmax[i] as u32,
        })
        .collect()
}

/// Selects rows of `aux: [batch, width, D]`: `rows[b]` are flat indices `b * width + i`;
/// shorter lists are padded with their first row (padding slots are masked by the draft step).
fn gather_rows<B: Backend>(aux: Tensor<B, 3>, rows: &[Vec<usize>]) -> Tensor<B, 3> {
    let [batch, width, d] = aux.dims();
    let longest = rows.iter().map(Vec::len).max().unwrap_or(1);
    let mut flat = Vec::with_capacity(batch * longest);
    for r in rows {
        for i in 0..longest {
            flat.push(*r.get(i).unwrap_or(&r[0]) as i64);
        }
    }
    let index =
        Tensor::<B, 1, Int>::from_data(TensorData::new(flat, [batch * longest]), &aux.device());
    aux.reshape([batch * width, d])
        .select(0, index)
        .reshape([batch, longest, d])
}

/// Target-only greedy decoding for comparison (what speculative greedy output must equal).
pub fn target_greedy<B: Backend>(
    target: &TargetModel<B>,
    prompt: &[u32],
    max_new_tokens: usize,
    stop_ids: &[u32],
) -> Result<Vec<u32>, InferError> {
    let options = tandem_model::GenerateOptions {
        max_new_tokens,
        sampling: SamplingParams::greedy(),
        stop_ids: stop_ids.to_vec(),
        seed: 0,
    };
    Ok(tandem_model::generate(target, prompt, &options)?.tokens)
}

/// Unused-field guard: the KV cache type is part of the engine's public contract.
pub type TargetCache<B> = KvCache<B>;
