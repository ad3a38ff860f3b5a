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

use crate::stats::AcceptanceStats;
use crate::tree::{DraftTree, TreeBuilder};
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
    pub draft_s: f64,
    pub verify_s: f64,
    pub extend_s: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct SpecOutput {
    pub tokens: Vec<u32>,
    pub finish: Finish,
    pub stats: AcceptanceStats,
}

#[derive(Debug, Clone, Serialize)]
pub struct BatchOutput {
    pub sequences: Vec<SpecOutput>,
    pub timings: Timings,
}

/// Per-sequence drafting state between rounds: the extend output at the last committed slot.
struct Root<B: Backend> {
    token: u32,
    /// `[1, H]` pre-norm draft output at the last committed position.
    hidden: Tensor<B, 2>,
    /// `[draft_vocab]` draft logits there (predicting the token after `token`).
    logits: Tensor<B, 1>,
}

/// The speculative engine over a target and an EAGLE-3 head on the same device.
pub struct SpecEngine<'a, B: Backend> {
    pub target: &'a TargetModel<B>,
    pub draft: &'a Eagle3Draft<B>,
    /// The serving taps, in slot order (checked against the head's manifest by the caller).
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

impl<B: Backend> SpecEngine<'_, B> {
    /// Generates up to `max_new_tokens` for each prompt together. Greedy output equals
    /// target-only greedy output; sampled output follows the target distribution exactly.
    pub fn generate(
        &self,
        prompts: &[Vec<u32>],
        max_new_tokens: usize,
        stop_ids: &[u32],
    ) -> Result<BatchOutput, InferError> {
        self.config.validate()?;
        if prompts.is_empty() || prompts.iter().any(|p| p.is_empty()) {
            return Err(InferError::Request {
                reason: "every prompt must have at least one token".into(),
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
        let batch = prompts.len();
        let cfg = self.config;
        let width = cfg.num_draft_tokens;
        let mut rng = rand::rngs::StdRng::seed_from_u64(cfg.seed);
        let mut timings = Timings::default();
        let target_capacity = max_prompt + (max_new_tokens + 1) * width + 1;
        let mut cache = self.target.new_cache(batch, target_capacity);
        let draft_capacity = max_prompt
            + max_new_tokens
            + 2 * width
            + cfg.num_steps * cfg.topk * (cfg.num_steps + 1)
            + 8;
        let mut dcache = self.draft.new_cache(batch, draft_capacity);

        // Target prefill, taps through the hook.
        let t0 = Instant::now();
        let refs: Vec<&[u32]> = prompts.iter().map(Vec::as_slice).collect();
        let step = cache.prefill_step(&refs)?;
        let out = self
            .target
            .forward(&step, &mut cache, &self.taps, LogitsFor::Last)?;
        let first = self.pick(out.logits.expect("asked for logits"), &mut rng);
        timings.prefill_s += t0.elapsed().as_secs_f64();

        let mut outputs: Vec<SpecOutput> = (0..batch)
            .map(|_| SpecOutput {
                tokens: Vec::new(),
                finish: Finish::Length,
                stats: AcceptanceStats::new(cfg.num_steps),
            })
            .collect();
        let mut done = vec![false; batch];
        for b in 0..batch {
            self.commit(
                &mut outputs[b],
                &mut done[b],
                &[first[b]],
                max_new_tokens,
                stop_ids,
            );
        }

        // Draft extend over the prompt: slot t pairs aux_t with token t+1 (the last slot with
        // the first generated token).
        let t0 = Instant::now();
        let chunks: Vec<Vec<u32>> = prompts
            .iter()
            .zip(&first)
            .map(|(p, &f)| p[1..].iter().copied().chain([f]).collect())
            .collect();
        let aux = out.taps.concatenated().expect("the engine requests taps");
        let mut roots = self.extend(&mut dcache, &chunks, aux, &first)?;
        timings.extend_s += t0.elapsed().as_secs_f64();

        while done.iter().any(|d| !d) {
            if cache.used() + width > cache.capacity() {
                for b in 0..batch {
                    if !done[b] {
                        outputs[b].finish = Finish::ContextFull;
                        done[b] = true;
                    }
                }
                break;
            }
            // Draft.
            let t0 = Instant::now();
            let draft_columns = dcache.used();
            let trees = self.draft_trees(&roots, &mut dcache)?;
            dcache.rollback(draft_columns);
            timings.draft_s += t0.elapsed().as_secs_f64();

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
                .forward(&step, &mut cache, &self.taps, LogitsFor::All)?;
            let logits = out.logits.expect("asked for logits");
            let acceptances: Vec<Acceptance> = if cfg.sampling.is_greedy() {
                let argmax = ints(logits.argmax(2));
                trees
                    .iter()
                    .enumerate()
                    .map(|(b, tree)| {
                        let row: Vec<u32> = argmax[b * verify_width..b * verify_width + tree.len()]
                            .iter()
                            .map(|&i| i as u32)
                            .collect();
                        verify_greedy(tree, &row)
                    })
                    .collect()
            } else {
                let host = floats(logits);
                let vocab = self.target.spec.vocab_size;
                trees
                    .iter()
                    .enumerate()
                    .map(|(b, tree)| {
                        verify_sampling(
                            tree,
                            |node| {
                                let at = (b * verify_width + node) * vocab;
                                distribution(&host[at..at + vocab], &cfg.sampling)
                            },
                            &mut rng,
                        )
                    })
                    .collect()
            };
            timings.verify_s += t0.elapsed().as_secs_f64();

            // Commit: keep the accepted path in the target cache; record statistics.
            let t0 = Instant::now();
            let mut chunks = Vec::with_capacity(batch);
            let mut aux_rows = Vec::with_capacity(batch);
            let mut last_tokens = Vec::with_capacity(batch);
            for (b, (tree, acc)) in trees.iter().zip(&acceptances).enumerate() {
                let path = acc.path_with_root();
                cache.keep_only(b, verify_width, &path);
                let committed = acc.committed_tokens(tree);
                if !done[b] {
                    let depth = tree.depth.iter().copied().max().unwrap_or(0);
                    outputs[b].stats.record(acc.accepted.len(), depth);
                    self.commit(
                        &mut outputs[b],
                        &mut done[b],
                        &committed,
                        max_new_tokens,
                        stop_ids,
                    );
                }
                last_tokens.push(*committed.last().expect("bonus token"));
                aux_rows.push(
                    path.iter()
                        .map(|&n| b * verify_width + n)
                        .collect::<Vec<_>>(),
                );
                chunks.push(committed);
            }
            let aux = out.taps.concatenated().expect("the engine requests taps");
            let aux = gather_rows(aux, &aux_rows);
            roots = self.extend(&mut dcache, &chunks, aux, &last_tokens)?;
            timings.extend_s += t0.elapsed().as_secs_f64();
        }
        Ok(BatchOutput {
            sequences: outputs,
            timings,
        })
    }

    /// Appends committed tokens, stopping at a stop token or the length limit.
    fn commit(
        &self,
        out: &mut SpecOutput,
        done: &mut bool,
        tokens: &[u32],
        max_new: usize,
        stop_ids: &[u32],
    ) {
        for &t in tokens {
            if *done {
                return;
            }
            if stop_ids.contains(&t) {
                out.finish = Finish::Stop;
                *done = true;
                return;
            }
            out.tokens.push(t);
            if out.tokens.len() >= max_new {
                out.finish = Finish::Length;
                *done = true;
            }
        }
    }

    /// Next token per sequence from `[batch, 1, vocab]` target logits.
    fn pick(&self, logits: Tensor<B, 3>, rng: &mut rand::rngs::StdRng) -> Vec<u32> {
        if self.config.sampling.is_greedy() {
            ints(logits.argmax(2))
                .into_iter()
                .map(|i| i as u32)
                .collect()
        } else {
            let [b, _, v] = logits.dims();
            let host = floats(logits);
            (0..b)
                .map(|i| {
                    sample_from(
                        &distribution(&host[i * v..(i + 1) * v], &self.config.sampling),
                        rng,
                    ) as u32
                })
                .collect()
        }
    }

    /// Draft extend over per-sequence chunks (`chunks[b][j]` pairs with `aux[b, j]`), returning
    /// each sequence's new root (its last chunk slot).
    fn extend(
        &self,
        dcache: &mut DraftCache<B>,
        chunks: &[Vec<u32>],
        aux: Tensor<B, 3>,
        last_tokens: &[u32],
    ) -> Result<Vec<Root<B>>, InferError> {
        let refs: Vec<&[u32]> = chunks.iter().map(Vec::as_slice).collect();
        let step = dcache.prefill_step(&refs)?;
        let [_, aux_width, aux_dim] = aux.dims();
        let aux = if aux_width > step.width {
            aux.slice([0..chunks.len(), 0..step.width, 0..aux_dim])
        } else {
            aux
        };
        let out = self.draft.extend(&step, aux, dcache)?;
        Ok(chunks
            .iter()
            .enumerate()
            .map(|(b, chunk)| {
                let last = chunk.len() - 1;
                let v = out.logits.dims()[2];
                Root {
                    token: last_tokens[b],
                    hidden: rows(out.hidden.clone(), b, last),
                    logits: rows(out.logits.clone(), b, last).reshape([v]),
                }
            })
            .collect())
    }

    /// Builds each sequence's draft tree from its root (chain for topk 1, SGLang's beam tree
    /// otherwise). Draft-step keys are written to `dcache`; the caller rolls them back.
    fn draft_trees(
        &self,
        roots: &[Root<B>],
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
        roots: &[Root<B>],
        dcache: &mut DraftCache<B>,
    ) -> Result<Vec<DraftTree>, InferError> {
        let batch = roots.len();
        let h = self.draft.spec.hidden_size;
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
                .map(|&d| self.draft.vocab.to_target(d as usize))
                .collect();
            for (b, &t) in tokens.iter().enumerate() {
                drafts[b].push(t);
            }
            if s + 1 == self.config.num_steps.min(want) {
                break;
            }
            let step = dcache.decode_step(&tokens)?;
            let out = self.draft.forward_step(&step, hidden, dcache)?;
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

    /// Tree drafting with topk > 1. Each draft step evaluates the current beams; since the
    /// cache's column validity is per sequence, not per query, the beams' ancestor paths are
    /// re-run in one tree step (a few dozen rows through one layer) and rolled back, so every
    /// beam attends to exactly its own ancestors.
    fn draft_beams(
        &self,
        roots: &[Root<B>],
        dcache: &mut DraftCache<B>,
    ) -> Result<Vec<DraftTree>, InferError> {
        let k = self.config.topk;
        let batch = roots.len();
        let h = self.draft.spec.hidden_size;
        let device = roots[0].hidden.device();
        let base_columns = dcache.used();
        struct Node<B: Backend> {
            token: u32,
            parent: Option<usize>,
            /// Output of this node once evaluated, `[1, H]`.
            output: Option<Tensor<B, 2>>,
        }
        let mut nodes: Vec<Vec<Node<B>>> = (0..batch).map(|_| Vec::new()).collect();
        let mut builders: Vec<TreeBuilder> = (0..batch).map(|_| TreeBuilder::new(k)).collect();
        let mut beams: Vec<Vec<usize>> = vec![Vec::new(); batch];
        // Step 0 from the roots' logits.
        let root_logits: Tensor<B, 2> =
            Tensor::stack(roots.iter().map(|r| r.logits.clone()).collect(), 0);
        let (probs, ids) = softmax(root_logits, 1).topk_with_indices(k, 1);
        let (probs, ids) = (floats(probs), ints(ids));
        for b in 0..batch {
            let p = probs[b * k..(b + 1) * k].to_vec();
            let t: Vec<u32> = ids[b * k..(b + 1) * k]
                .iter()
                .map(|&d| self.draft.vocab.to_target(d as usize))
                .collect();
            for beam in builders[b].push(&[p], &[t]) {
                nodes[b].push(Node {
                    token: beam.token,
                    parent: None,
                    output: None,
                });
                beams[b].push(nodes[b].len() - 1);
            }
        }
        for _ in 1..self.config.num_steps {
            // The beams and their ancestors, parents first.
            let mut paths: Vec<Vec<usize>> = Vec::with_capacity(batch);
            for b in 0..batch {
                let mut set = std::collections::BTreeSet::new();
                for &beam in &beams[b] {
                    let mut cur = Some(beam);
                    while let Some(c) = cur {
                        set.insert(c);
                        cur = nodes[b][c].parent;
                    }
                }
                paths.push(set.into_iter().collect());
            }
            let width = paths.iter().map(Vec::len).max().unwrap_or(0);
            let mut tokens_owned = Vec::with_capacity(batch);
            let mut parents_owned = Vec::with_capacity(batch);
            let mut hidden_rows = Vec::with_capacity(batch * width);
            for b in 0..batch {
                let local: Vec<Option<usize>> = paths[b]
                    .iter()
                    .map(|&n| {
                        nodes[b][n].parent.map(|p| {
                            paths[b]
                                .iter()
                                .position(|&x| x == p)
                                .expect("ancestor in path")
                        })
                    })
                    .collect();
                tokens_owned.push(
                    paths[b]
                        .iter()
                        .map(|&n| nodes[b][n].token)
                        .collect::<Vec<_>>(),
                );
                parents_owned.push(local);
                for i in 0..width {
                    let row = match paths[b].get(i) {
                        Some(&n) => match nodes[b][n].parent {
                            None => roots[b].hidden.clone(),
                            Some(p) => nodes[b][p]
                                .output
                                .clone()
                                .expect("parents are evaluated first"),
                        },
                        None => Tensor::zeros([1, h], &device),
                    };
                    hidden_rows.push(row);
                }
            }
            let trees: Vec<(&[u32], &[Option<usize>])> = tokens_owned
                .iter()
                .zip(&parents_owned)
                .map(|(t, p)| (t.as_slice(), p.as_slice()))
                .collect();
            let step = dcache.tree_step(&trees)?;
            let hidden = Tensor::cat(hidden_rows, 0).reshape([batch, step.width, h]);
            let out = self.draft.forward_step(&step, hidden, dcache)?;
            dcache.rollback(base_columns);
            let (probs, ids) = softmax(out.logits, 2).topk_with_indices(k, 2);
            let (probs, ids) = (floats(probs), ints(ids));
            for b in 0..batch {
                let mut beam_probs = Vec::with_capacity(k);
                let mut beam_tokens = Vec::with_capacity(k);
                for &beam in &beams[b] {
                    let slot = paths[b]
                        .iter()
                        .position(|&x| x == beam)
                        .expect("beam in path");
                    nodes[b][beam].output = Some(rows(out.hidden.clone(), b, slot));
                    let at = (b * step.width + slot) * k;
                    beam_probs.push(probs[at..at + k].to_vec());
                    beam_tokens.push(
                        ids[at..at + k]
                            .iter()
                            .map(|&d| self.draft.vocab.to_target(d as usize))
                            .collect::<Vec<u32>>(),
                    );
                }
                let chosen = builders[b].push(&beam_probs, &beam_tokens);
                let previous = std::mem::take(&mut beams[b]);
                for beam in chosen {
                    nodes[b].push(Node {
                        token: beam.token,
                        parent: Some(previous[beam.from_beam]),
                        output: None,
                    });
                    beams[b].push(nodes[b].len() - 1);
                }
            }
        }
        roots
            .iter()
            .zip(&builders)
            .map(|(r, builder)| Ok(builder.build(r.token, self.config.num_draft_tokens)?))
            .collect()
    }
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
