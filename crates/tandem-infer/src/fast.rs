//! The speculative loop on the CUDA fast path (crate `tandem-cuda`): the target
//! ([`CudaTarget`]) verifies, the EAGLE-3 head ([`CudaDraft`]) drafts, and everything that
//! decides correctness is the host code [`crate::engine::SpecEngine`] uses too: the SGLang tree
//! ([`TreeBuilder`]), greedy and rejection-sampling verification ([`verify_greedy`],
//! [`verify_sampling`]), acceptance statistics and the commit rule. The caches are the fast
//! path's, with the shared `ColumnLayout` bookkeeping: the accepted path is kept by marking
//! columns (no recomputation), rejected branches and draft scratch are dropped.
//!
//! The head reads the target's hidden states only from the capture hook's taps of each target
//! step (prefill and tree verification), like the burn engine and the dump job.
//!
//! A batch is static: sequences that finish keep their row (their further output is
//! discarded) until every sequence of the batch is done. Continuous batching (requests joining
//! and leaving between rounds) is the burn engine's [`crate::RunningBatch`].

use std::time::Instant;

use rand::SeedableRng;
use tandem_cuda::{CudaDraft, CudaKvCache, CudaSlice, CudaTarget, DeviceLogits, DeviceRows};
use tandem_model::sampling::{SamplingParams, distribution, sample_from};
use tandem_model::{LogitsFor, StepInput, TapRequest};

use crate::engine::{
    BatchOutput, Finish, InferError, Request, SpecConfig, SpecOutput, Timings, commit_tokens,
    draft_scratch,
};
use crate::stats::AcceptanceStats;
use crate::tree::{BeamSearch, BeamStep, DraftTree, push_roots};
use crate::verify::{Acceptance, verify_greedy, verify_sampling};

/// The draft state of a batch between rounds: per row, the head's output at the last
/// committed slot (`hidden: [batch, H]`, `logits: [batch, draft_vocab]`) and the last token.
struct Roots {
    tokens: Vec<u32>,
    hidden: DeviceRows,
    logits: DeviceLogits,
}

/// The speculative engine over the fast path's target and head (same GPU).
pub struct FastSpecEngine<'a> {
    pub target: &'a CudaTarget,
    pub draft: &'a CudaDraft,
    /// The serving taps, in slot order (checked against the head's manifest by the caller).
    pub taps: TapRequest,
    pub config: SpecConfig,
}

struct Row {
    request: Request,
    output: SpecOutput,
    rng: rand::rngs::StdRng,
    done: bool,
}

impl Row {
    /// One row per prompt; row `i` samples from its own stream seeded `seed + i` and records
    /// acceptance over `draft_steps` positions.
    fn batch(
        prompts: &[Vec<u32>],
        max_new_tokens: usize,
        stop_ids: &[u32],
        sampling: SamplingParams,
        seed: u64,
        draft_steps: usize,
    ) -> Vec<Self> {
        prompts
            .iter()
            .enumerate()
            .map(|(i, prompt)| {
                let seed = seed.wrapping_add(i as u64);
                Row {
                    request: Request {
                        id: i as u64,
                        prompt: prompt.clone(),
                        max_new_tokens,
                        stop_ids: stop_ids.to_vec(),
                        sampling,
                        seed,
                    },
                    output: SpecOutput {
                        tokens: Vec::new(),
                        finish: Finish::Length,
                        stats: AcceptanceStats::new(draft_steps),
                    },
                    rng: rand::rngs::StdRng::seed_from_u64(seed),
                    done: false,
                }
            })
            .collect()
    }
}

impl FastSpecEngine<'_> {
    /// Generates up to `max_new_tokens` for each prompt together (one static batch). Greedy
    /// output equals target-only greedy output up to bf16 near-ties; sampled output follows
    /// the target distribution exactly. Sequence `i` samples from its own stream seeded
    /// `config.seed + i`.
    pub fn generate(
        &self,
        prompts: &[Vec<u32>],
        max_new_tokens: usize,
        stop_ids: &[u32],
    ) -> Result<BatchOutput, InferError> {
        let cfg = self.config;
        cfg.validate()?;
        if prompts.is_empty() {
            return Err(InferError::Request {
                reason: "no prompts to generate from".into(),
            });
        }
        let spec = &self.target.spec;
        for (i, p) in prompts.iter().enumerate() {
            if p.is_empty() {
                return Err(InferError::Request {
                    reason: format!("prompt {i} is empty: it must have at least one token"),
                });
            }
            if let Some(&t) = p.iter().find(|&&t| t as usize >= spec.vocab_size) {
                return Err(InferError::Request {
                    reason: format!(
                        "prompt {i}: token {t} is outside the vocabulary of {}",
                        spec.vocab_size
                    ),
                });
            }
        }
        if max_new_tokens == 0 {
            return Err(InferError::Request {
                reason: "max_new_tokens must be at least 1".into(),
            });
        }
        let max_prompt = prompts.iter().map(Vec::len).max().unwrap_or(0);
        let width = cfg.num_draft_tokens;
        // Every round commits at least one token, so this many rounds end every sequence.
        let capacity = max_prompt + (max_new_tokens + 1) * width + 1;
        if max_prompt + 1 > spec.max_position_embeddings {
            return Err(InferError::Request {
                reason: format!(
                    "a prompt of {max_prompt} tokens does not fit the context of {}",
                    spec.max_position_embeddings
                ),
            });
        }
        let batch = prompts.len();
        let mut timings = Timings::default();
        let mut rows = Row::batch(
            prompts,
            max_new_tokens,
            stop_ids,
            cfg.sampling,
            cfg.seed,
            cfg.num_steps,
        );

        // Target prefill with taps, first token.
        let t0 = Instant::now();
        let mut cache = self.target.new_cache(batch, capacity)?;
        let mut dcache = self
            .draft
            .new_cache(batch, capacity + draft_scratch(&cfg))?;
        let refs: Vec<&[u32]> = prompts.iter().map(Vec::as_slice).collect();
        let step = cache.layout().prefill_step(&refs)?;
        let out = self
            .target
            .forward(&step, &mut cache, &self.taps, LogitsFor::Last)?;
        let logits = out.logits.expect("asked for logits");
        let first = pick(&logits, &mut rows)?;
        timings.prefill_s += t0.elapsed().as_secs_f64();

        // Draft extend over the prompt: slot t pairs aux_t with token t+1 (the last slot with
        // the first generated token). The chunks have the prompts' lengths, so the prefill's
        // slots line up with the extend's one for one.
        let t0 = Instant::now();
        let chunks: Vec<Vec<u32>> = prompts
            .iter()
            .zip(&first)
            .map(|(p, &f)| p[1..].iter().copied().chain([f]).collect())
            .collect();
        let slots: Vec<Vec<usize>> = prompts.iter().map(|p| (0..p.len()).collect()).collect();
        let mut roots = self.draft_extend(&mut dcache, &chunks, &out.taps, step.width, &slots)?;
        roots.tokens = first.clone();
        for (row, &token) in rows.iter_mut().zip(&first) {
            commit(row, &[token]);
        }
        self.draft.gpu().synchronize()?;
        timings.extend_s += t0.elapsed().as_secs_f64();

        let context = spec.max_position_embeddings;
        loop {
            // A sequence whose next round could pass the model's context ends here, cleanly.
            for (b, row) in rows.iter_mut().enumerate() {
                if !row.done && cache.layout().seq_len(b) + width > context {
                    row.output.finish = Finish::ContextFull;
                    row.done = true;
                }
            }
            if rows.iter().all(|r| r.done) {
                break;
            }
            // Draft (the head's scratch columns are rolled back afterwards).
            let t0 = Instant::now();
            let draft_columns = dcache.layout().used();
            let trees = self.draft_trees(&roots, &mut dcache)?;
            dcache.layout_mut().rollback(draft_columns);
            timings.draft_s += t0.elapsed().as_secs_f64();

            // Verify all trees in one target step.
            let t0 = Instant::now();
            let tree_refs: Vec<(&[u32], &[Option<usize>])> = trees
                .iter()
                .map(|t| (t.tokens.as_slice(), t.parents.as_slice()))
                .collect();
            let step = cache.layout().tree_step(&tree_refs)?;
            let verify_width = step.width;
            let out = self
                .target
                .forward(&step, &mut cache, &self.taps, LogitsFor::All)?;
            let logits = out.logits.as_ref().expect("asked for logits");
            let acceptances = verify_rows(&trees, logits, verify_width, &mut rows)?;
            timings.verify_s += t0.elapsed().as_secs_f64();

            // Commit the accepted path in the target cache, record statistics, and extend the
            // head over the committed tokens with the taps of the verification step.
            let t0 = Instant::now();
            let mut chunks = Vec::with_capacity(batch);
            let mut slots = Vec::with_capacity(batch);
            let mut last_tokens = Vec::with_capacity(batch);
            for (b, ((tree, acc), row)) in trees
                .iter()
                .zip(&acceptances)
                .zip(rows.iter_mut())
                .enumerate()
            {
                let path = acc.path_with_root();
                cache.layout_mut().keep_only(b, verify_width, &path);
                let committed = acc.committed_tokens(tree);
                if !row.done {
                    let depth = tree.depth.iter().copied().max().unwrap_or(0);
                    row.output.stats.record(acc.accepted.len(), depth);
                }
                commit(row, &committed);
                last_tokens.push(*committed.last().expect("bonus token"));
                slots.push(path);
                chunks.push(committed);
            }
            if rows.iter().all(|r| r.done) {
                timings.extend_s += t0.elapsed().as_secs_f64();
                break;
            }
            roots = self.draft_extend(&mut dcache, &chunks, &out.taps, verify_width, &slots)?;
            roots.tokens = last_tokens;
            self.draft.gpu().synchronize()?;
            timings.extend_s += t0.elapsed().as_secs_f64();
        }
        Ok(BatchOutput {
            sequences: rows.into_iter().map(|r| r.output).collect(),
            timings,
        })
    }

    /// Draft extend over per-sequence chunks: `chunks[b][j]` pairs with the tap row
    /// `b * step_width + slots[b][j]` of the target step that produced `taps`. Returns each
    /// sequence's root (the head's output at its last chunk slot); `tokens` is left empty.
    fn draft_extend(
        &self,
        dcache: &mut CudaKvCache,
        chunks: &[Vec<u32>],
        taps: &tandem_model::Taps<DeviceRows>,
        step_width: usize,
        slots: &[Vec<usize>],
    ) -> Result<Roots, InferError> {
        let refs: Vec<&[u32]> = chunks.iter().map(Vec::as_slice).collect();
        let step = dcache.layout().prefill_step(&refs)?;
        // Padding slots read their sequence's first row (they are masked out of attention).
        let mut tap_rows = Vec::with_capacity(step.batch * step.width);
        for (b, s) in slots.iter().enumerate() {
            for i in 0..step.width {
                tap_rows.push((b * step_width + *s.get(i).unwrap_or(&s[0])) as i32);
            }
        }
        let aux = self.draft.fc_input(taps, &tap_rows)?;
        let out = self.draft.extend(&step, &aux, dcache)?;
        let last: Vec<usize> = chunks
            .iter()
            .enumerate()
            .map(|(b, c)| b * step.width + c.len() - 1)
            .collect();
        Ok(Roots {
            tokens: Vec::new(),
            hidden: self.select_rows(&out.hidden, &last)?,
            logits: self.select_logits(&out.logits, &last)?,
        })
    }

    /// Rows `pick` of a `[_, cols]` f32 device matrix, gathered into a new `[pick.len(), cols]`.
    fn gather(
        &self,
        data: &CudaSlice<f32>,
        cols: usize,
        pick: &[usize],
    ) -> Result<CudaSlice<f32>, InferError> {
        let gpu = self.draft.gpu();
        let src: Vec<i32> = pick.iter().map(|&r| r as i32).collect();
        let dst: Vec<i32> = (0..pick.len() as i32).collect();
        let mut out = gpu.scratch::<f32>(pick.len() * cols)?;
        gpu.copy_rows(
            data,
            &gpu.upload(&src)?,
            &mut out,
            &gpu.upload(&dst)?,
            pick.len(),
            cols,
        )?;
        Ok(out)
    }

    fn select_rows(&self, rows: &DeviceRows, pick: &[usize]) -> Result<DeviceRows, InferError> {
        Ok(DeviceRows {
            data: self.gather(&rows.data, rows.hidden, pick)?,
            batch: pick.len(),
            width: 1,
            hidden: rows.hidden,
        })
    }

    fn select_logits(
        &self,
        logits: &DeviceLogits,
        pick: &[usize],
    ) -> Result<DeviceLogits, InferError> {
        Ok(DeviceLogits::new(
            self.gather(&logits.data, logits.vocab, pick)?,
            pick.len(),
            logits.vocab,
            self.draft.gpu().clone(),
        ))
    }

    /// Each sequence's draft tree from its root: a chain for topk 1, SGLang's beam tree
    /// otherwise. Draft-step keys are written to `dcache`; the caller rolls them back.
    fn draft_trees(
        &self,
        roots: &Roots,
        dcache: &mut CudaKvCache,
    ) -> Result<Vec<DraftTree>, InferError> {
        if self.config.topk == 1 {
            self.draft_chains(roots, dcache)
        } else {
            self.draft_beams(roots, dcache)
        }
    }

    fn draft_chains(
        &self,
        roots: &Roots,
        dcache: &mut CudaKvCache,
    ) -> Result<Vec<DraftTree>, InferError> {
        let batch = roots.tokens.len();
        let steps = self.config.num_steps.min(self.config.num_draft_tokens - 1);
        let mut drafts: Vec<Vec<u32>> = vec![Vec::new(); batch];
        let mut hidden = roots.hidden.data.clone();
        let mut next: Option<DeviceLogits> = None;
        for s in 0..steps {
            let logits = next.as_ref().unwrap_or(&roots.logits);
            let ids = logits.argmax()?;
            let tokens: Vec<u32> = ids
                .iter()
                .map(|&d| self.draft.vocab.to_target(d as usize))
                .collect();
            for (b, &t) in tokens.iter().enumerate() {
                drafts[b].push(t);
            }
            if s + 1 == steps {
                break;
            }
            let step = dcache.layout().decode_step(&tokens)?;
            let out = self.draft.forward_step(&step, hidden, dcache)?;
            hidden = out.hidden.data;
            next = Some(out.logits);
        }
        Ok(roots
            .tokens
            .iter()
            .zip(drafts)
            .map(|(&r, d)| DraftTree::chain(r, &d))
            .collect())
    }

    /// Tree drafting with topk > 1 ([`BeamSearch`], as the burn engine drafts): each draft step
    /// re-runs the beams with their ancestors in one tree step of the head (rolled back).
    /// Evaluated nodes keep their hidden output in a node store on the GPU; the top-k of each
    /// row is computed on the GPU (`topk_softmax` in kernels/llama.cu) and only `k`
    /// probabilities and ids per row come back to the host.
    fn draft_beams(
        &self,
        roots: &Roots,
        dcache: &mut CudaKvCache,
    ) -> Result<Vec<DraftTree>, InferError> {
        let gpu = self.draft.gpu();
        let k = self.config.topk;
        let batch = roots.tokens.len();
        let h = self.draft.spec.hidden_size;
        let base_columns = dcache.layout().used();
        let to_target = |ids: &[u32]| -> Vec<u32> {
            ids.iter()
                .map(|&d| self.draft.vocab.to_target(d as usize))
                .collect()
        };
        // The store: rows 0..batch are the roots' hidden states, then evaluated beams.
        let store_rows = batch * (1 + k * self.config.num_steps);
        let mut store = gpu.scratch::<f32>(store_rows * h)?;
        let identity: Vec<i32> = (0..batch as i32).collect();
        let identity = gpu.upload(&identity)?;
        gpu.copy_rows(
            &roots.hidden.data,
            &identity,
            &mut store,
            &identity,
            batch,
            h,
        )?;
        let mut stored = batch;
        // Store row of each evaluated node, by node index.
        let mut store_row: Vec<Vec<Option<usize>>> = vec![Vec::new(); batch];

        let mut searches: Vec<BeamSearch> = (0..batch).map(|_| BeamSearch::new(k)).collect();
        let (probs, ids) = roots.logits.topk(k)?;
        push_roots(&mut searches, k, &probs, &to_target(&ids));
        for _ in 1..self.config.num_steps {
            let next = BeamStep::new(&searches);
            let width = next.width;
            // A node's hidden input is its parent's output (the root's for depth 0); padding
            // slots read the root (masked).
            let mut hidden_src = Vec::with_capacity(batch * width);
            for (b, frontier) in next.frontiers.iter().enumerate() {
                for i in 0..width {
                    let row = match frontier.get(i).and_then(|&n| searches[b].parent(n)) {
                        Some(p) => store_row[b][p].expect("parents are evaluated first"),
                        None => b,
                    };
                    hidden_src.push(row as i32);
                }
            }
            let step: StepInput = dcache.layout().tree_step(&next.trees())?;
            let rows = step.batch * step.width;
            let mut hidden = gpu.scratch::<f32>(rows * h)?;
            let dst: Vec<i32> = (0..rows as i32).collect();
            gpu.copy_rows(
                &store,
                &gpu.upload(&hidden_src)?,
                &mut hidden,
                &gpu.upload(&dst)?,
                rows,
                h,
            )?;
            let out = self.draft.forward_step(&step, hidden, dcache)?;
            dcache.layout_mut().rollback(base_columns);

            // The beams' rows: their outputs into the store, their top-k to the tree.
            let mut beam_rows = Vec::new();
            for (b, search) in searches.iter().enumerate() {
                for &beam in search.beams() {
                    let slot = next.slot(b, beam);
                    if store_row[b].len() <= beam {
                        store_row[b].resize(beam + 1, None);
                    }
                    store_row[b][beam] = Some(stored + beam_rows.len());
                    beam_rows.push(b * step.width + slot);
                }
            }
            let src: Vec<i32> = beam_rows.iter().map(|&r| r as i32).collect();
            let dst: Vec<i32> = (stored..stored + beam_rows.len())
                .map(|r| r as i32)
                .collect();
            gpu.copy_rows(
                &out.hidden.data,
                &gpu.upload(&src)?,
                &mut store,
                &gpu.upload(&dst)?,
                beam_rows.len(),
                h,
            )?;
            stored += beam_rows.len();
            let (probs, ids) = out.logits.topk(k)?;
            let mut at = 0;
            for search in searches.iter_mut() {
                let n = search.beams().len();
                let rows = &beam_rows[at..at + n];
                let beam_probs: Vec<Vec<f32>> = rows
                    .iter()
                    .map(|&r| probs[r * k..(r + 1) * k].to_vec())
                    .collect();
                let beam_tokens: Vec<Vec<u32>> = rows
                    .iter()
                    .map(|&r| to_target(&ids[r * k..(r + 1) * k]))
                    .collect();
                search.push(&beam_probs, &beam_tokens);
                at += n;
            }
        }
        roots
            .tokens
            .iter()
            .zip(&searches)
            .map(|(&r, search)| Ok(search.build(r, self.config.num_draft_tokens)?))
            .collect()
    }
}

fn commit(row: &mut Row, tokens: &[u32]) {
    commit_tokens(&row.request, &mut row.output, &mut row.done, tokens);
}

/// The first token of each row from `[batch, vocab]` logits: argmax on the GPU for greedy
/// rows, the row's own sampling stream otherwise.
fn pick(logits: &DeviceLogits, rows: &mut [Row]) -> Result<Vec<u32>, InferError> {
    let argmax = logits.argmax()?;
    let host = rows
        .iter()
        .any(|r| !r.request.sampling.is_greedy())
        .then(|| logits.to_host())
        .transpose()?;
    let v = logits.vocab;
    Ok(rows
        .iter_mut()
        .enumerate()
        .map(|(i, row)| match &host {
            Some(host) if !row.request.sampling.is_greedy() => sample_from(
                &distribution(&host[i * v..(i + 1) * v], &row.request.sampling),
                &mut row.rng,
            ) as u32,
            _ => argmax[i],
        })
        .collect())
}

/// Acceptance of each row's tree from the verification logits `[batch * width, vocab]`.
fn verify_rows(
    trees: &[DraftTree],
    logits: &DeviceLogits,
    width: usize,
    rows: &mut [Row],
) -> Result<Vec<Acceptance>, InferError> {
    let greedy = |r: &Row| r.request.sampling.is_greedy();
    let argmax = rows
        .iter()
        .any(greedy)
        .then(|| logits.argmax())
        .transpose()?;
    let host = (!rows.iter().all(greedy))
        .then(|| logits.to_host())
        .transpose()?;
    let vocab = logits.vocab;
    Ok(trees
        .iter()
        .zip(rows.iter_mut())
        .enumerate()
        .map(|(b, (tree, row))| match (&argmax, &host) {
            (Some(argmax), _) if row.request.sampling.is_greedy() => {
                verify_greedy(tree, &argmax[b * width..b * width + tree.len()])
            }
            (_, Some(host)) => {
                let params: SamplingParams = row.request.sampling;
                verify_sampling(
                    tree,
                    |node| {
                        let at = (b * width + node) * vocab;
                        distribution(&host[at..at + vocab], &params)
                    },
                    &mut row.rng,
                )
            }
            _ => unreachable!("argmax is computed for greedy rows, host logits for the rest"),
        })
        .collect())
}

/// Target-only decoding on the fast path for the same prompts (one static batch, greedy or
/// sampled per `sampling`, stream `seed + i` for sequence `i`): the baseline speculative
/// output is compared with and timed against.
pub fn fast_target_generate(
    target: &CudaTarget,
    prompts: &[Vec<u32>],
    max_new_tokens: usize,
    stop_ids: &[u32],
    sampling: SamplingParams,
    seed: u64,
) -> Result<Vec<SpecOutput>, InferError> {
    sampling.validate()?;
    let max_prompt = prompts.iter().map(Vec::len).max().unwrap_or(0);
    let mut cache = target.new_cache(prompts.len(), max_prompt + max_new_tokens + 1)?;
    let mut rows = Row::batch(prompts, max_new_tokens, stop_ids, sampling, seed, 0);
    let refs: Vec<&[u32]> = prompts.iter().map(Vec::as_slice).collect();
    let mut step = cache.layout().prefill_step(&refs)?;
    let none = TapRequest::none();
    loop {
        let out = target.forward(&step, &mut cache, &none, LogitsFor::Last)?;
        let next = pick(out.logits.as_ref().expect("asked for logits"), &mut rows)?;
        for (row, &t) in rows.iter_mut().zip(&next) {
            commit(row, &[t]);
        }
        if rows.iter().all(|r| r.done) {
            break;
        }
        step = cache.layout().decode_step(&next)?;
    }
    Ok(rows.into_iter().map(|r| r.output).collect())
}
