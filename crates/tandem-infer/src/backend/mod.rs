//! What the speculative driver ([`crate::driver::Engine`]) needs from a device, and nothing
//! else: the target's step with taps, the head's steps, row gathers, logits read-backs, and the
//! cache bookkeeping. Implemented for burn ([`burn`]: CPU in tests and CI) and for the CUDA
//! fast path ([`cuda`]: serving on the GPU), so admission, rounds, the speculation policy,
//! deferred head extension, making room and retirement are written once.
//!
//! Both backends keep the column bookkeeping of their caches in the shared
//! [`ColumnLayout`], which the driver reads and edits directly (accepted paths, scratch
//! rollback); only moving data (joins, leaves, compaction) goes through the backend.
//!
//! Rows are addressed flat: a `[batch, width, d]` step output has rows `b * width + i`.

pub mod burn;
pub mod cuda;

use tandem_model::{ColumnLayout, LogitsFor, StepInput, TapRequest, Taps};

use crate::engine::InferError;

/// A target model on some device and the EAGLE-3 head type that drafts for it there.
pub trait SpecBackend {
    /// The EAGLE-3 head on the same device.
    type Head;
    /// A KV cache (the target's, or the head's one layer) with its [`ColumnLayout`].
    type Cache;
    /// Device rows `[n, d]`: tap tensors, head hidden states.
    type Rows;
    /// Device logits `[n, vocab]`.
    type Logits;

    fn vocab_size(&self) -> usize;
    fn max_positions(&self) -> usize;

    fn layout(cache: &Self::Cache) -> &ColumnLayout;
    fn layout_mut(cache: &mut Self::Cache) -> &mut ColumnLayout;

    /// An empty target cache for `rows` sequences of up to `capacity` columns.
    fn new_cache(&self, rows: usize, capacity: usize) -> Result<Self::Cache, InferError>;
    /// One target step through the capture hook: the logits `logits_for` asks for and the taps
    /// `taps` names, each `[step.batch * step.width, _]`.
    fn forward(
        &self,
        step: &StepInput,
        cache: &mut Self::Cache,
        taps: &TapRequest,
        logits_for: LogitsFor,
    ) -> Result<(Self::Logits, Taps<Self::Rows>), InferError>;

    /// Rows of `logits`, and the index of each row's largest entry.
    fn logit_rows(logits: &Self::Logits) -> usize;
    fn argmax(&self, logits: &Self::Logits) -> Result<Vec<u32>, InferError>;
    /// `[rows * vocab]` row-major on the host (for sampling).
    fn logits_to_host(&self, logits: &Self::Logits) -> Result<Vec<f32>, InferError>;
    /// The `k` most likely entries of each row with their softmax probabilities, descending:
    /// `(probs, ids)`, each `[rows * k]`.
    fn softmax_topk(
        &self,
        logits: &Self::Logits,
        k: usize,
    ) -> Result<(Vec<f32>, Vec<u32>), InferError>;

    /// `(hidden size, draft vocabulary)` of the head.
    fn head_dims(head: &Self::Head) -> (usize, usize);
    /// The target id of draft id `id` (`d2t`).
    fn to_target(head: &Self::Head, id: u32) -> u32;
    fn new_head_cache(
        &self,
        head: &Self::Head,
        rows: usize,
        capacity: usize,
    ) -> Result<Self::Cache, InferError>;
    /// Draft extend: the head over `step` with hidden input `fc(aux)`, where slot `i` of
    /// sequence `b` reads the aux state of tap row `tap_rows[b * step.width + i]` of `taps`.
    /// Returns every slot's `(hidden, logits)`.
    fn head_extend(
        &self,
        head: &Self::Head,
        cache: &mut Self::Cache,
        step: &StepInput,
        taps: &Taps<Self::Rows>,
        tap_rows: &[usize],
    ) -> Result<(Self::Rows, Self::Logits), InferError>;
    /// One draft step: the head over `step` with `hidden` (`[step.batch * step.width, H]`) as
    /// each slot's hidden input.
    fn head_step(
        &self,
        head: &Self::Head,
        cache: &mut Self::Cache,
        step: &StepInput,
        hidden: Self::Rows,
    ) -> Result<(Self::Rows, Self::Logits), InferError>;

    /// Greedy draft chains: `steps` draft tokens (target ids) for each of the `batch`
    /// sequences, from the roots (`hidden` and `logits`, row `b` sequence `b`): the argmax of
    /// the roots' logits, then `steps - 1` head steps, each fed the previous step's token and
    /// hidden output. The draft steps' keys stay in `cache` (the caller rolls them back).
    ///
    /// This default reads each step's argmax back and builds the next step on the host; a
    /// backend may keep the whole chain on its device and read the tokens back once.
    fn head_chain(
        &self,
        head: &Self::Head,
        cache: &mut Self::Cache,
        hidden: &Self::Rows,
        logits: &Self::Logits,
        batch: usize,
        steps: usize,
    ) -> Result<Vec<Vec<u32>>, InferError>
    where
        Self: Sized,
    {
        host_chain(self, head, cache, hidden, logits, batch, steps)
    }

    /// New rows: `picks[j] = (source, row)` is row `j`.
    fn gather_rows(
        &self,
        sources: &[&Self::Rows],
        picks: &[(usize, usize)],
    ) -> Result<Self::Rows, InferError>;
    /// [`SpecBackend::gather_rows`] of logits.
    fn gather_logits(
        &self,
        sources: &[&Self::Logits],
        picks: &[(usize, usize)],
    ) -> Result<Self::Logits, InferError>;
    /// `[n * d]` row-major on the host.
    fn rows_to_host(&self, rows: &Self::Rows) -> Result<Vec<f32>, InferError>;
    /// Rows from the host, `values: [batch * width * d]` row-major: recorded taps replayed
    /// through the head (`tandem compare` drafts offline from a dump with the serving code).
    fn rows_from_host(
        &self,
        values: &[f32],
        batch: usize,
        width: usize,
        d: usize,
    ) -> Result<Self::Rows, InferError>;
    /// The target's greedy token after each recorded last-block hidden state (`hidden: [rows *
    /// hidden_size]` on the host, a dump's `last_hidden`): its final norm, lm_head and argmax.
    fn last_block_argmax(&self, hidden: &[f32]) -> Result<Vec<u32>, InferError>;
    fn zero_rows(&self, rows: usize, width: usize) -> Result<Self::Rows, InferError>;
    fn zero_logits(&self, rows: usize, vocab: usize) -> Result<Self::Logits, InferError>;
    /// Appends every row of `step` (a target step's taps) to `backlog` after its first `at`
    /// rows, growing it as needed: the deferred taps of plain rounds.
    fn backlog_push(
        &self,
        backlog: &mut Option<Taps<Self::Rows>>,
        at: usize,
        step: &Taps<Self::Rows>,
    ) -> Result<(), InferError>;
    /// Rows in a step's taps (`batch * width`).
    fn tap_rows(taps: &Taps<Self::Rows>) -> usize;

    /// Allocates room for `rows` sequences so joins and leaves up to that many move data in
    /// place (a no-op where buffers do not matter).
    fn reserve(&self, _cache: &mut Self::Cache, _rows: usize) -> Result<(), InferError> {
        Ok(())
    }
    /// Moves `other`'s sequences after `cache`'s.
    fn append(&self, cache: &mut Self::Cache, other: Self::Cache) -> Result<(), InferError>;
    /// Keeps the sequences `keep`, in that order.
    fn retain(&self, cache: &mut Self::Cache, keep: &[usize]) -> Result<(), InferError>;
    /// Moves every sequence's columns to the front (see [`ColumnLayout::compact`]).
    fn compact(&self, cache: &mut Self::Cache) -> Result<(), InferError>;
    /// Waits for the device work queued so far.
    fn synchronize(&self) -> Result<(), InferError> {
        Ok(())
    }
    /// Step graphs captured so far by the target and the head (a round that captured one paid
    /// a one-time cost and is not timed for the policy).
    fn graphs_captured(&self, _head: Option<&Self::Head>) -> usize {
        0
    }
    /// What the step graphs did, for a server's report (`None`: the backend has none).
    fn graph_report(&self, _head: Option<&Self::Head>) -> Option<String> {
        None
    }
}

/// [`SpecBackend::head_chain`] step by step: read each step's argmax back, map it through
/// `d2t` on the host, build and run the next step. The default, and the baseline a backend
/// that drafts on its device is measured against (`TANDEM_CUDA_DEVICE_CHAIN=0`).
pub fn host_chain<T: SpecBackend>(
    backend: &T,
    head: &T::Head,
    cache: &mut T::Cache,
    hidden: &T::Rows,
    logits: &T::Logits,
    batch: usize,
    steps: usize,
) -> Result<Vec<Vec<u32>>, InferError> {
    let mut drafts: Vec<Vec<u32>> = vec![Vec::with_capacity(steps); batch];
    let mut next: Option<(T::Rows, T::Logits)> = None;
    for s in 0..steps {
        let logits = next.as_ref().map_or(logits, |n| &n.1);
        let tokens: Vec<u32> = backend
            .argmax(logits)?
            .into_iter()
            .take(batch)
            .map(|d| T::to_target(head, d))
            .collect();
        for (b, &t) in tokens.iter().enumerate() {
            drafts[b].push(t);
        }
        if s + 1 == steps {
            break;
        }
        let step = T::layout(cache).decode_step(&tokens)?;
        let input = match next.take() {
            Some((hidden, _)) => hidden,
            None => {
                let all: Vec<(usize, usize)> = (0..batch).map(|b| (0, b)).collect();
                backend.gather_rows(&[hidden], &all)?
            }
        };
        next = Some(backend.head_step(head, cache, &step, input)?);
    }
    Ok(drafts)
}
