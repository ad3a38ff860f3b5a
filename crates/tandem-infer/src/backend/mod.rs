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
pub mod scripted;

use tandem_model::{ColumnLayout, LogitsFor, StepInput, TapRequest, Taps};

use crate::engine::InferError;
use crate::tree::{BeamSearch, BeamStep, DraftStep, push_roots};

/// A plain round's taps on their way into the head's backlog
/// ([`SpecBackend::forward_deferring_taps`]).
pub enum DeferredTaps<T: SpecBackend + ?Sized> {
    /// Taps of their own, as [`SpecBackend::forward`] returns them.
    Owned(Taps<T::Rows>),
    /// Taps still where the step wrote them ([`SpecBackend::push_kept_taps`]).
    Kept(T::KeptTaps),
}

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
    /// A replayed step's taps left where the step wrote them
    /// ([`SpecBackend::forward_deferring_taps`]; `Infallible` where a step never keeps any).
    type KeptTaps;

    fn vocab_size(&self) -> usize;
    fn max_positions(&self) -> usize;

    fn layout(cache: &Self::Cache) -> &ColumnLayout;
    fn layout_mut(cache: &mut Self::Cache) -> &mut ColumnLayout;

    /// The cache capacity a batch that needs `columns` columns allocates: more where caches of
    /// one shape are cheaper to reuse (the CUDA path's graphs are keyed by the cache buffers,
    /// which it recycles by shape: `tandem_cuda::cache_columns`).
    fn cache_columns(&self, columns: usize) -> usize {
        columns
    }
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
    /// Every slot's keys and values go to `cache`; returns the `(hidden, logits)` of the slots
    /// `last` names (flat slot indices, row `j` of the result slot `last[j]`): the roots the
    /// next drafts start from, with nothing else copied out.
    fn head_extend(
        &self,
        head: &Self::Head,
        cache: &mut Self::Cache,
        step: &StepInput,
        taps: &Taps<Self::Rows>,
        tap_rows: &[usize],
        last: &[usize],
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

    /// Greedy draft chains where the backend drafted them: the host's tokens, or a device
    /// buffer the verification reads without the host ([`SpecBackend::forward_chains`]).
    type Chains;

    /// Greedy draft chains: `steps` draft tokens (target ids) for each of the `batch`
    /// sequences, from the roots (`hidden` and `logits`, row `b` sequence `b`): the argmax of
    /// the roots' logits, then `steps - 1` head steps, each fed the previous step's token and
    /// hidden output. The draft steps' keys stay in `cache` (the caller rolls them back).
    ///
    /// [`host_chain`] reads each step's argmax back and builds the next step on the host; a
    /// backend may keep the whole chain on its device, leave the tokens there for the
    /// verification, and read them back once, after it.
    fn head_chains(
        &self,
        head: &Self::Head,
        cache: &mut Self::Cache,
        hidden: &Self::Rows,
        logits: &Self::Logits,
        batch: usize,
        steps: usize,
    ) -> Result<Self::Chains, InferError>;
    /// Tree drafting with `topk` > 1 (SGLang's beams, [`BeamSearch`]): `steps` draft steps
    /// from the roots (`hidden` and `logits`, row `b` sequence `b`), each sequence's steps in
    /// SGLang's layout ([`DraftStep`]: scores, target ids, parents), from which the driver
    /// builds its tree. Step 0 is the roots' top-k; each later step runs every beam's path in
    /// one head step ([`BeamStep`]), rolled back, and takes the top-k of each beam's output.
    ///
    /// [`host_beams`] reads each step's top-k back and picks the next beams on the host; a
    /// backend may pick them on its device and read the records back once, at the end. Both
    /// run the same steps of the same shapes, so they record the same bits.
    fn head_beams(
        &self,
        head: &Self::Head,
        cache: &mut Self::Cache,
        hidden: &Self::Rows,
        logits: &Self::Logits,
        batch: usize,
        (steps, topk): (usize, usize),
    ) -> Result<Vec<Vec<DraftStep>>, InferError>
    where
        Self: Sized,
    {
        host_beams(self, head, cache, hidden, logits, batch, (steps, topk))
    }

    /// The chains' tokens on the host, `[batch][steps]` (for a device buffer, one read-back,
    /// which waits for the work queued before it).
    fn chains_to_host(&self, chains: &Self::Chains) -> Result<Vec<Vec<u32>>, InferError>;
    /// [`SpecBackend::forward`] of the verification of `chains`: `step` is the tree step of
    /// each sequence's root followed by its chain, with any tokens in the chain's slots; the
    /// step verifies the tokens of `chains` there.
    fn forward_chains(
        &self,
        step: &StepInput,
        cache: &mut Self::Cache,
        taps: &TapRequest,
        logits_for: LogitsFor,
        chains: &Self::Chains,
    ) -> Result<(Self::Logits, Taps<Self::Rows>), InferError>;

    /// A greedy verification's results on their way to the host: the target's greedy id of
    /// every verified slot and the verified chains' tokens. Queued by
    /// [`SpecBackend::greedy_read_back`], read where they are by
    /// [`SpecBackend::head_extend_greedy`], and waited for by
    /// [`SpecBackend::finish_read_back`], which a backend may let skip the work queued after
    /// the read (the head's extend then overlaps the host's acceptance).
    type ReadBack;
    /// Queues the read-back of the greedy id of every row of `logits` (a verification of
    /// greedy `chains`) and of the chains' tokens.
    fn greedy_read_back(
        &self,
        logits: &Self::Logits,
        chains: &Self::Chains,
    ) -> Result<Self::ReadBack, InferError>;
    /// Queues the read-back of the greedy id of every row of `logits` (a plain round's
    /// verification), for [`SpecBackend::finish_read_back`] (whose chains are then empty):
    /// work queued after it is not waited for.
    fn plain_read_back(&self, logits: &Self::Logits) -> Result<Self::ReadBack, InferError>;
    /// [`SpecBackend::forward`] of a decode step (one token a sequence) whose tokens are the
    /// greedy ids of `previous`, a [`SpecBackend::plain_read_back`] of the step before it (one
    /// row a sequence) that the host has not waited for: a plain round's next step queued while
    /// the device still runs this one (the lookahead of [`crate::Engine::step`]). The step's
    /// own tokens are placeholders.
    fn forward_after_read(
        &self,
        step: &StepInput,
        cache: &mut Self::Cache,
        taps: &TapRequest,
        logits_for: LogitsFor,
        previous: &Self::ReadBack,
    ) -> Result<(Self::Logits, Taps<Self::Rows>), InferError>;
    /// [`SpecBackend::head_extend`] of every slot of `step` (a head step as wide as the
    /// verification `read` came from, one chunk per sequence), slot `s` reading tap row `s` and
    /// the target's greedy id of verified slot `s` as its token, before the host has read
    /// them: for greedy acceptance, the token after every accepted slot is exactly that id (the
    /// next accepted draft, or the bonus token after the last), so the slots that end up
    /// accepted get the inputs an extend over the committed tokens gives them. Returns the
    /// roots, row `b` the `(hidden, logits)` of sequence `b`'s last accepted slot
    /// ([`accepted_slots`], found where the ids are).
    fn head_extend_greedy(
        &self,
        head: &Self::Head,
        cache: &mut Self::Cache,
        step: &StepInput,
        taps: &Taps<Self::Rows>,
        read: &Self::ReadBack,
    ) -> Result<(Self::Rows, Self::Logits), InferError>;
    /// The values of [`SpecBackend::greedy_read_back`]: `(greedy ids, chains)`.
    #[allow(clippy::type_complexity)]
    fn finish_read_back(
        &self,
        read: Self::ReadBack,
    ) -> Result<(Vec<u32>, Vec<Vec<u32>>), InferError>;

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
    /// [`SpecBackend::forward`] of a plain round, whose taps only go into the head's backlog
    /// once the caller has queued its read-back: where the step replayed a CUDA graph its taps
    /// may stay in the graph's buffers ([`DeferredTaps::Kept`], appended by
    /// [`SpecBackend::push_kept_taps`] before the next step) instead of being copied out ahead
    /// of the read-back. By default the taps come back as from `forward`.
    fn forward_deferring_taps(
        &self,
        step: &StepInput,
        cache: &mut Self::Cache,
        taps: &TapRequest,
        logits_for: LogitsFor,
    ) -> Result<(Self::Logits, DeferredTaps<Self>), InferError> {
        let (logits, taps) = self.forward(step, cache, taps, logits_for)?;
        Ok((logits, DeferredTaps::Owned(taps)))
    }
    /// Appends kept taps to `backlog` after its first `at` rows (as
    /// [`SpecBackend::backlog_push`]); returns the rows appended.
    fn push_kept_taps(
        &self,
        backlog: &mut Option<Taps<Self::Rows>>,
        at: usize,
        kept: &Self::KeptTaps,
    ) -> Result<usize, InferError>;

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

/// [`SpecBackend::head_chains`] step by step: read each step's argmax back, map it through
/// `d2t` on the host, build and run the next step. The burn backend's chains, and the baseline
/// a backend that drafts on its device is measured against (`TANDEM_CUDA_DEVICE_CHAIN=0`).
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

/// [`SpecBackend::head_beams`] on the host: each step's top-k read back, the beams picked by
/// [`BeamSearch`], the next step built from their paths ([`BeamStep`]). The burn backend's
/// beams, and the baseline of a backend that picks them on its device.
pub fn host_beams<T: SpecBackend>(
    backend: &T,
    head: &T::Head,
    cache: &mut T::Cache,
    hidden: &T::Rows,
    logits: &T::Logits,
    batch: usize,
    (steps, k): (usize, usize),
) -> Result<Vec<Vec<DraftStep>>, InferError> {
    let base_columns = T::layout(cache).used();
    let to_target =
        |ids: &[u32]| -> Vec<u32> { ids.iter().map(|&d| T::to_target(head, d)).collect() };
    // Outputs of the draft steps so far; source 0 of a gather is the roots' hidden states.
    let mut outputs: Vec<T::Rows> = Vec::with_capacity(steps);
    // Where each beam's output is, `(source, row)`, by node index: its children's hidden input.
    let mut node_at: Vec<Vec<Option<(usize, usize)>>> = vec![Vec::new(); batch];
    let mut searches: Vec<BeamSearch> = (0..batch).map(|_| BeamSearch::new(k)).collect();
    let (probs, ids) = backend.softmax_topk(logits, k)?;
    push_roots(&mut searches, k, &probs, &to_target(&ids));
    for _ in 1..steps {
        let next = BeamStep::new(&searches);
        let width = next.width;
        // A node's hidden input is its parent's output (the root's for depth 0).
        let mut picks = Vec::with_capacity(batch * width);
        for (b, frontier) in next.frontiers.iter().enumerate() {
            for &node in frontier {
                picks.push(match searches[b].parent(node) {
                    Some(p) => node_at[b][p].expect("parents were beams of an earlier step"),
                    None => (0, b),
                });
            }
        }
        let step: StepInput = T::layout(cache).tree_step(&next.trees())?;
        let sources: Vec<&T::Rows> = std::iter::once(hidden).chain(outputs.iter()).collect();
        let input = backend.gather_rows(&sources, &picks)?;
        let (out_hidden, out_logits) = backend.head_step(head, cache, &step, input)?;
        T::layout_mut(cache).rollback(base_columns);

        // The beams' rows: where their outputs are, and their top-k to the tree.
        let source = outputs.len() + 1;
        let mut beam_rows = Vec::new();
        for (b, search) in searches.iter().enumerate() {
            for (j, &beam) in search.beams().iter().enumerate() {
                let row = b * width + next.beam_slot(j);
                if node_at[b].len() <= beam {
                    node_at[b].resize(beam + 1, None);
                }
                node_at[b][beam] = Some((source, row));
                beam_rows.push(row);
            }
        }
        outputs.push(out_hidden);
        let (probs, ids) = backend.softmax_topk(&out_logits, k)?;
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
    Ok(searches.iter().map(|s| s.steps().to_vec()).collect())
}

/// [`SpecBackend::head_extend_greedy`] for a backend whose read-back is already on the host
/// (`ids`, the verification's greedy ids, and the verified `chains`): every slot of `step`
/// extended with the greedy ids as its tokens, each sequence's last accepted slot returned.
/// The burn and scripted backends' extend.
pub fn host_extend_greedy<T: SpecBackend>(
    backend: &T,
    head: &T::Head,
    cache: &mut T::Cache,
    step: &StepInput,
    taps: &Taps<T::Rows>,
    (ids, chains): (&[u32], &[Vec<u32>]),
) -> Result<(T::Rows, T::Logits), InferError> {
    let slots: Vec<usize> = (0..step.batch * step.width).collect();
    let roots = accepted_slots(ids, chains, step.width);
    let step = with_greedy_tokens(step, ids)?;
    backend.head_extend(head, cache, &step, taps, &slots, &roots)
}

/// `step` (a tree step of chains: each sequence's root, then its drafts) with the drafts of
/// `chains[b]` in sequence `b`'s slots 1..: how a backend whose chains are on the host verifies
/// them ([`SpecBackend::forward_chains`]).
pub fn with_chain_tokens(step: &StepInput, chains: &[Vec<u32>]) -> Result<StepInput, InferError> {
    if chains.len() != step.batch || chains.iter().any(|c| c.len() >= step.width) {
        return Err(InferError::Config {
            field: "chains",
            reason: format!(
                "{} chains of lengths {:?} do not fit a step of {} sequences of width {}",
                chains.len(),
                chains.iter().map(Vec::len).collect::<Vec<_>>(),
                step.batch,
                step.width
            ),
        });
    }
    let mut step = step.clone();
    for (b, chain) in chains.iter().enumerate() {
        let at = b * step.width + 1;
        step.tokens[at..at + chain.len()].copy_from_slice(chain);
    }
    Ok(step)
}

/// The flat slot of each sequence's last accepted node when greedy `chains` (`[batch][steps]`)
/// were verified in steps of `width` slots with greedy ids `ids` (`[batch * width]`): the
/// leading drafts equal to the target's id at the slot before them, as
/// [`crate::verify_greedy`] walks a chain.
pub fn accepted_slots(ids: &[u32], chains: &[Vec<u32>], width: usize) -> Vec<usize> {
    chains
        .iter()
        .enumerate()
        .map(|(b, chain)| {
            let accepted = chain
                .iter()
                .zip(&ids[b * width..])
                .take_while(|(draft, id)| draft == id)
                .count();
            b * width + accepted
        })
        .collect()
}

/// `step` with every slot's token replaced by `ids[slot]` (a verification's greedy ids, one
/// per slot of a step as wide as the verification).
pub fn with_greedy_tokens(step: &StepInput, ids: &[u32]) -> Result<StepInput, InferError> {
    let slots = step.batch * step.width;
    if ids.len() < slots {
        return Err(InferError::Config {
            field: "ids",
            reason: format!("{} greedy ids for a step of {slots} slots", ids.len()),
        });
    }
    let mut step = step.clone();
    step.tokens.copy_from_slice(&ids[..slots]);
    Ok(step)
}

#[cfg(test)]
mod tests {
    use tandem_model::ColumnLayout;

    use super::with_chain_tokens;

    #[test]
    fn accepted_slots_walk_each_chain_as_greedy_verification_does() {
        use super::accepted_slots;
        use crate::tree::DraftTree;
        use crate::verify_greedy;
        // Three chains of 3 drafts verified in slots of 4: all accepted, the second rejected,
        // the first rejected (a later draft matching its slot's id does not count).
        let chains = vec![vec![5, 6, 7], vec![8, 1, 9], vec![2, 3, 4]];
        let ids = [5, 6, 7, 11, 8, 2, 9, 12, 0, 3, 4, 13];
        let got = accepted_slots(&ids, &chains, 4);
        assert_eq!(got, vec![3, 5, 8]);
        for (b, chain) in chains.iter().enumerate() {
            let tree = DraftTree::chain(100, chain);
            let acc = verify_greedy(&tree, &ids[b * 4..b * 4 + 4]);
            assert_eq!(got[b], b * 4 + acc.accepted.len(), "chain {b}");
        }
    }

    #[test]
    fn chain_tokens_go_after_each_root_and_misfits_are_refused() {
        let mut layout = ColumnLayout::new(2, 32);
        let prompt = layout.prefill_step(&[&[5, 6, 7], &[8]]).unwrap();
        layout.advance(&prompt);
        // Roots 11 and 12, each with three placeholder drafts.
        let trees: [(&[u32], &[Option<usize>]); 2] = [
            (&[11, 0, 0, 0], &[None, Some(0), Some(1), Some(2)]),
            (&[12, 0, 0, 0], &[None, Some(0), Some(1), Some(2)]),
        ];
        let step = layout.tree_step(&trees).unwrap();
        let filled = with_chain_tokens(&step, &[vec![1, 2, 3], vec![4, 5, 6]]).unwrap();
        assert_eq!(filled.tokens, vec![11, 1, 2, 3, 12, 4, 5, 6]);
        // Everything but the tokens is the step's.
        assert_eq!(filled.positions, step.positions);
        assert_eq!(filled.sees, step.sees);
        // A chain as wide as the step, or a missing sequence, is named.
        let err = with_chain_tokens(&step, &[vec![1, 2, 3, 4], vec![4]]).unwrap_err();
        assert!(err.to_string().contains("lengths [4, 1]"), "{err}");
        assert!(with_chain_tokens(&step, &[vec![1]]).is_err());
    }
}
