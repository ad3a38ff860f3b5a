//! The speculative driver, written once over a [`SpecBackend`]: admission (target prefill with
//! taps, first token, head extend over the prompt), rounds (draft a tree per sequence, verify
//! all trees in one target step, accept, commit, extend the head over what was accepted),
//! the speculation policy's plain rounds and the deferred head extension they leave behind,
//! making room (compaction, the context limit), retirement and cancellation. Everything that
//! decides correctness is shared host code: the SGLang tree ([`crate::tree::BeamSearch`],
//! [`DraftTree`]), greedy and rejection-sampling verification ([`verify_greedy`],
//! [`verify_sampling`]), acceptance statistics and the commit rule. Without a head the same
//! loop is target-only decoding (every round verifies its root alone: a decode step), the
//! baseline `tandem serve --no-draft` and the benchmarks run.
//!
//! The head reads the target's hidden states only through the capture hook's taps of each
//! target step (prefill and tree verification), like the dump job.
//!
//! Alignment (facts section 2): the draft slot at position `t` pairs the target's aux state at
//! `t` with the token at `t + 1`; its output predicts the token at `t + 2`.
//!
//! Batching is continuous: requests join ([`Engine::admit`], prefilled on their own and
//! appended) and leave (finished or cancelled) between rounds, and the caches are compacted
//! when they run out of columns or mostly hold waste. The backends are burn
//! ([`crate::SpecEngine`]) and the CUDA fast path ([`crate::FastSpecEngine`]).

use std::time::Instant;

use rand::SeedableRng;
use tandem_model::sampling::{SamplingParams, distribution, sample_from};
use tandem_model::{ColumnLayout, LogitsFor, TapRequest, Taps};

use crate::admission::Admission;
use crate::backend::{DeferredTaps, SpecBackend};
use crate::engine::{
    BatchOutput, Finish, InferError, Progress, Request, SpecConfig, SpecGenerate, SpecOutput,
    Timings, commit_tokens, draft_scratch, run_to_completion,
};
use crate::policy::{CATCH_UP_PIECE, Choice, CostTable, Shape, SpeculationPolicy, catch_up_pieces};
use crate::stats::AcceptanceStats;
use crate::trace::RoundRecord;
use crate::tree::{DraftTree, build_tree};
use crate::verify::{Acceptance, verify_greedy, verify_sampling};

/// The head's state of each row between rounds: its output at the row's last committed slot
/// (`hidden: [rows, H]`, `logits: [rows, draft_vocab]`), from which the next round drafts.
pub struct Roots<T: SpecBackend> {
    pub hidden: T::Rows,
    pub logits: T::Logits,
}

/// What a round chose, for its [`RoundRecord`].
struct Chosen {
    rows: usize,
    label: String,
    committed: usize,
    /// The policy's predicted seconds of the choice and of a plain round.
    predicted: (f64, f64),
}

/// The speculative engine over a target and an EAGLE-3 head on the same device. Without a head
/// the same loop is target-only decoding.
pub struct Engine<'a, T: SpecBackend> {
    pub target: &'a T,
    /// The EAGLE-3 head; `None` decodes with the target alone.
    pub draft: Option<&'a T::Head>,
    /// The serving taps, in slot order (checked against the head's manifest by the caller;
    /// [`TapRequest::none`] without a head).
    pub taps: TapRequest,
    pub config: SpecConfig,
}

pub(crate) struct Row {
    pub(crate) request: Request,
    pub(crate) output: SpecOutput,
    rng: rand::rngs::StdRng,
    pub(crate) done: bool,
    /// The last committed token: the root of the next round's tree.
    last: u32,
    /// Tokens the head has not been extended over yet (committed by plain rounds, or the
    /// prompt of a request that joined during plain rounds), each with its tap row in
    /// `RunningBatch::backlog`.
    behind: Vec<(u32, usize)>,
}

impl Row {
    pub(crate) fn new(request: Request, draft_steps: usize) -> Self {
        Row {
            rng: rand::rngs::StdRng::seed_from_u64(request.seed),
            request,
            output: SpecOutput {
                tokens: Vec::new(),
                finish: Finish::Length,
                stats: AcceptanceStats::new(draft_steps),
                rounds_by_shape: Default::default(),
            },
            done: false,
            last: 0,
            behind: Vec::new(),
        }
    }
}

/// The target's cache, and the head's cache and roots, for the rows of a batch.
struct Caches<T: SpecBackend> {
    target: T::Cache,
    head: Option<(T::Cache, Roots<T>)>,
    /// Rows the head's cache and roots still have to be cut down to (row `j` of the batch is
    /// their row `head_keep[j]`): with [`RunningBatch::lazy_head`], a retirement moves the
    /// target's rows at once and the head's only when it is next read
    /// ([`Engine::settle_head`]), so plain rounds never pay for a cache they do not use.
    head_keep: Option<Vec<usize>>,
}

/// The sequences decoding together (one row each in every cache).
pub struct RunningBatch<T: SpecBackend> {
    caches: Option<Caches<T>>,
    rows: Vec<Row>,
    capacity: usize,
    draft_capacity: usize,
    /// Which shape each round drafts with, or none.
    pub policy: SpeculationPolicy,
    /// Sequences the caches are allocated for when they are created (0: as many as join), so
    /// that joins, leaves and compactions up to that many move data in place, the cache buffers
    /// keep their addresses and the CUDA graphs captured over them keep replaying (a server
    /// sets its largest batch).
    pub reserve_rows: usize,
    /// The taps of the target steps whose head extension is deferred (see `Row::behind`).
    backlog: TapBacklog<T>,
    /// Deferred tokens of the row furthest behind (default 512) after which each row keeps only
    /// its last [`RunningBatch::deferred_keep`] (default 128) and forgets the older ones:
    /// the head's cache then has a gap there (its positions lag the target's; verification
    /// keeps the output exact, acceptance right after a switch may be lower). A long plain run
    /// used to be caught up every 256 steps instead, 8 ms at c=32 each time for a head no
    /// round drafted with (session 17: the one catch-up of a 64-request run at c=32), and a
    /// switch after a long plain run now costs at most this many tokens per row.
    pub max_deferred: usize,
    pub deferred_keep: usize,
    /// Deferred tokens per row a catch-up extends the head over: the last ones (default
    /// [`CATCH_UP_TAIL`], `TANDEM_CATCH_UP_TAIL=K` or `all`), or all of them (`None`). The
    /// head's cache then has a gap before them, as after [`RunningBatch::max_deferred`];
    /// verification keeps the output exact. A full catch-up after a plain run cost 4-20 ms at
    /// c=8 (session 42: a probe's whole price), while the head's attention needs little of
    /// the skipped context (session 15: the same acceptance at c=32 with a tail of 16).
    pub catch_up_tail: Option<usize>,
    /// Time spent so far, by phase.
    pub timings: Timings,
    /// Compactions run so far.
    pub compactions: usize,
    /// Times finished sequences were removed from the caches (one per round in which any
    /// finished).
    pub retirements: usize,
    /// Every round and admission since [`RunningBatch::record_rounds`] (off: `None`).
    trace: Option<(Instant, Vec<RoundRecord>)>,
    /// Each phase of a round (draft, verify, extend) and each admission waits for its device
    /// work, so that [`RunningBatch::timings`] and the round records split time by device
    /// work. Off (the default), rounds overlap the host's work with the device's and wait for
    /// it only where they read results back.
    pub phase_timing: bool,
    /// Greedy chain rounds queue the head's extend over the whole verified chain right behind
    /// the verification, with the target's greedy ids as its tokens, before the host reads the
    /// results ([`SpecBackend::head_extend_greedy`]): the device runs the extend while the host
    /// accepts, instead of waiting for the host to build an extend over the accepted tokens.
    /// The accepted slots get the same inputs either way. On by default: on an H100 (session
    /// 35) it took the batch-1 MT-Bench bench from 1.465x/1.459x to 1.517x/1.528x target-only
    /// (interleaved, se 0.03); `TANDEM_EARLY_EXTEND=0` turns it off. Phase-timed batches never
    /// use it (their phases wait for the device one by one).
    pub early_extend: bool,
    /// A join of several prompts is prefilled in groups of similar length
    /// ([`crate::admission::prefill_groups`], with this fixed cost of a prefill in padded slots)
    /// instead of one step padded to its longest prompt. On by default
    /// ([`crate::admission::DEFAULT_PREFILL_GROUP_SLOTS`]; `TANDEM_PREFILL_GROUPS=N` sets the
    /// slots, `=0` gives one prefill a join): with held joins it took speculative serving at
    /// c=32 from 0.875x to 0.998x target-only on an H100 (BENCHMARKS.md, session 36).
    pub prefill_group_slots: Option<usize>,
    /// Plain rounds cost what target-only rounds cost: their greedy ids are read back before
    /// the deferred taps' copy into the backlog is queued (the host waits for the ids only,
    /// and queues the copy while the device runs the step), and retirements move the head's
    /// rows only when the head is next read (`Caches::head_keep`). Session 36 measured plain
    /// rounds of a server with a head 2.9% (c=32) and 3.5% (c=64) dearer than target-only's,
    /// from exactly these two; session 37 (H100, BENCHMARKS.md) took what a head adds after a
    /// plain round's step from +0.027-0.063 ms to +0.007-0.020 ms, and speculative serving at
    /// c=32/64 from 0.939x/0.988x to 0.986x/1.003x target-only (20 repeats, totals). On by
    /// default; `TANDEM_LAZY_HEAD=0` turns it off (the A/B).
    pub lazy_head: bool,
    /// Greedy plain rounds queue up to this many decode steps back to back, each taking the
    /// previous step's greedy ids on the device as its tokens
    /// ([`SpecBackend::forward_after_read`]), and read their ids once the last is queued: the
    /// host's work between two steps (read-back, commit, the next step's inputs and launch)
    /// overlaps the device's instead of leaving it idle, as an overlap scheduler does. A row that
    /// stops inside the round has its later steps' tokens dropped (it leaves the batch); the
    /// round never runs past a row's `max_new_tokens` or the cache. 1 (the default until
    /// measured on a GPU) runs one step a plain round; `TANDEM_PLAIN_LOOKAHEAD=N` sets it.
    pub plain_lookahead: usize,
}

/// [`RunningBatch::plain_lookahead`]'s default: `TANDEM_PLAIN_LOOKAHEAD=N` (at least 1), else 1.
pub fn plain_lookahead_default() -> usize {
    std::env::var("TANDEM_PLAIN_LOOKAHEAD")
        .ok()
        .and_then(|v| v.trim().parse::<usize>().ok())
        .unwrap_or(1)
        .max(1)
}

/// [`RunningBatch::lazy_head`]'s default: on unless `TANDEM_LAZY_HEAD=0`.
pub fn lazy_head_default() -> bool {
    std::env::var("TANDEM_LAZY_HEAD").map_or(true, |v| v.trim() != "0")
}

/// [`RunningBatch::early_extend`]'s default: on unless `TANDEM_EARLY_EXTEND=0`.
pub fn early_extend_default() -> bool {
    std::env::var("TANDEM_EARLY_EXTEND").map_or(true, |v| v.trim() != "0")
}

impl<T: SpecBackend> RunningBatch<T> {
    pub fn len(&self) -> usize {
        self.rows.len()
    }
    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }
    /// Ids of the running requests, in row order.
    pub fn ids(&self) -> Vec<u64> {
        self.rows.iter().map(|r| r.request.id).collect()
    }
    /// Token columns of the target cache (the longest context a sequence can reach).
    pub fn capacity(&self) -> usize {
        self.capacity
    }
    /// Tokens whose head extension is still deferred, at most over the rows (plain rounds, and
    /// the prompts that joined during them).
    pub fn deferred_rounds(&self) -> usize {
        self.rows.iter().map(|r| r.behind.len()).max().unwrap_or(0)
    }

    /// Tokens of the row furthest behind that the next catch-up extends the head over (at most
    /// [`RunningBatch::catch_up_tail`]): what a switch from plain rounds to drafting costs.
    pub fn catch_up_rounds(&self) -> usize {
        let deferred = self.deferred_rounds();
        self.catch_up_tail
            .map_or(deferred, |tail| deferred.min(tail))
    }

    /// Whether rows have left since the head was last read, its cache and roots not yet cut
    /// down to the batch's rows ([`RunningBatch::lazy_head`]).
    pub fn head_retire_pending(&self) -> bool {
        self.caches.as_ref().is_some_and(|c| c.head_keep.is_some())
    }

    /// Starts (again) recording every round and admission ([`RoundRecord`]).
    pub fn record_rounds(&mut self) {
        self.trace = Some((Instant::now(), Vec::new()));
    }

    /// The rounds and admissions recorded so far (empty when not recording).
    pub fn round_records(&self) -> &[RoundRecord] {
        self.trace.as_ref().map_or(&[], |(_, r)| r.as_slice())
    }

    fn record(&mut self, started: Instant, record: impl FnOnce(f64) -> RoundRecord) {
        if let Some((origin, records)) = &mut self.trace {
            records.push(record((started - *origin).as_secs_f64()));
        }
    }

    /// Columns of the head's cache in use (0 without a head).
    pub fn head_columns(&self) -> usize {
        self.columns().2
    }

    /// Used target columns, the longest sequence and used head columns (zeros without caches).
    fn columns(&self) -> (usize, usize, usize) {
        let Some(caches) = &self.caches else {
            return (0, 0, 0);
        };
        let layout = T::layout(&caches.target);
        let head = caches.head.as_ref().map_or(0, |(d, _)| T::layout(d).used());
        (layout.used(), layout.longest(), head)
    }
}

/// The taps of deferred target steps (plain rounds, prompts joining during them), appended
/// step after step to one buffer per tap ([`SpecBackend::backlog_push`]): a catch-up then
/// gathers the head's fc input with one call per piece.
struct TapBacklog<T: SpecBackend> {
    /// One `[capacity, hidden]` buffer per tap.
    taps: Option<Taps<T::Rows>>,
    /// Rows written since the last catch-up.
    rows: usize,
    /// Target steps deferred since the last catch-up.
    steps: usize,
}

impl<T: SpecBackend> TapBacklog<T> {
    fn new() -> Self {
        Self {
            taps: None,
            rows: 0,
            steps: 0,
        }
    }

    /// Appends every row of `step_taps` (all slots of the step, padding included); returns the
    /// backlog row of the step's row 0.
    fn push(&mut self, target: &T, step_taps: &Taps<T::Rows>) -> Result<usize, InferError> {
        target.backlog_push(&mut self.taps, self.rows, step_taps)?;
        let first = self.rows;
        self.rows += T::tap_rows(step_taps);
        self.steps += 1;
        Ok(first)
    }

    /// [`TapBacklog::push`] of a plain round's taps, also when the step kept them where it
    /// wrote them ([`SpecBackend::forward_deferring_taps`]).
    fn push_deferred(&mut self, target: &T, taps: DeferredTaps<T>) -> Result<usize, InferError> {
        match taps {
            DeferredTaps::Owned(taps) => self.push(target, &taps),
            DeferredTaps::Kept(kept) => {
                let first = self.rows;
                self.rows += target.push_kept_taps(&mut self.taps, self.rows, &kept)?;
                self.steps += 1;
                Ok(first)
            }
        }
    }

    /// Forgets what was deferred (the buffers stay).
    fn clear(&mut self) {
        self.rows = 0;
        self.steps = 0;
    }
}

/// Deferred tokens of the row furthest behind (plain rounds, deferred prompts) after which the
/// oldest deferred tokens are forgotten ([`RunningBatch::max_deferred`])...
const MAX_DEFERRED: usize = 512;
/// ...and deferred tap rows (tokens, padding included) after which they are too.
const MAX_DEFERRED_TAP_ROWS: usize = 1 << 16;
/// Deferred tokens each row keeps when the oldest are forgotten
/// ([`RunningBatch::deferred_keep`]).
const DEFERRED_KEEP: usize = 128;

/// Deferred tokens per row a catch-up extends the head over by default (the last ones; see
/// [`RunningBatch::catch_up_tail`]).
pub const CATCH_UP_TAIL: usize = 16;

/// [`RunningBatch::catch_up_tail`]'s default: `TANDEM_CATCH_UP_TAIL` read once.
fn catch_up_tail() -> Option<usize> {
    static TAIL: std::sync::OnceLock<Option<usize>> = std::sync::OnceLock::new();
    *TAIL.get_or_init(|| catch_up_tail_from(std::env::var("TANDEM_CATCH_UP_TAIL").ok().as_deref()))
}

/// `TANDEM_CATCH_UP_TAIL`'s value as a tail: `all` for every deferred token, a positive count
/// for that many, [`CATCH_UP_TAIL`] when unset or unreadable.
fn catch_up_tail_from(value: Option<&str>) -> Option<usize> {
    match value.map(str::trim) {
        Some("all") => None,
        Some(v) => Some(
            v.parse::<usize>()
                .ok()
                .filter(|k| *k > 0)
                .unwrap_or(CATCH_UP_TAIL),
        ),
        None => Some(CATCH_UP_TAIL),
    }
}

/// Rounds run before timing a choice in [`Engine::calibrate`] (the CUDA graphs of a
/// step shape are captured at its third run) and rounds timed.
const CALIBRATION_WARM: usize = 3;
/// Tokens of each calibration prompt at the two contexts measured (at most an eighth and a
/// quarter of the context): serving contexts span them, and costs are linear in between.
const CALIBRATION_PROMPTS: [usize; 2] = [128, 512];
const CALIBRATION_TIMED: usize = 5;

impl<T: SpecBackend> Engine<'_, T> {
    /// Tokens the widest round of `batch` verifies per sequence (1 without a head).
    fn round_width(&self, batch: &RunningBatch<T>) -> usize {
        if self.draft.is_some() {
            batch.policy.max_tokens()
        } else {
            1
        }
    }

    fn draft_steps(&self, batch: &RunningBatch<T>) -> usize {
        if self.draft.is_some() {
            batch.policy.max_steps()
        } else {
            0
        }
    }

    /// Step graphs the target and the head have captured so far.
    fn graphs_captured(&self) -> usize {
        self.target.graphs_captured(self.draft)
    }

    /// Extra head-cache columns a round of the engine's configured shape may use beyond the
    /// target's: the scratch of the draft steps (rolled back every round).
    pub fn draft_scratch(&self) -> usize {
        draft_scratch(&self.config)
    }

    /// The head's hidden state at each row's last extended slot, `[rows, hidden]` row-major
    /// (`None` without a head): what the next round drafts from.
    pub fn head_roots(&self, batch: &RunningBatch<T>) -> Result<Option<Vec<f32>>, InferError> {
        let Some(caches) = batch.caches.as_ref() else {
            return Ok(None);
        };
        let Some((_, roots)) = caches.head.as_ref() else {
            return Ok(None);
        };
        match &caches.head_keep {
            None => Ok(Some(self.target.rows_to_host(&roots.hidden)?)),
            Some(keep) => {
                let picks: Vec<(usize, usize)> = keep.iter().map(|&r| (0, r)).collect();
                let kept = self.target.gather_rows(&[&roots.hidden], &picks)?;
                Ok(Some(self.target.rows_to_host(&kept)?))
            }
        }
    }

    /// Head cache columns the largest draft of `policy` uses beyond the committed tokens.
    fn scratch(&self, policy: &SpeculationPolicy) -> usize {
        policy
            .shapes()
            .iter()
            .map(|s| draft_scratch(&s.apply(self.config)))
            .max()
            .unwrap_or(0)
    }

    /// An empty running batch whose sequences may each reach `capacity` tokens; every round
    /// drafts with the engine's configured shape.
    pub fn new_batch(&self, capacity: usize) -> RunningBatch<T> {
        self.new_batch_with_policy(capacity, SpeculationPolicy::fixed(Shape::of(&self.config)))
    }

    /// An empty running batch whose rounds are chosen by `policy`.
    pub fn new_batch_with_policy(
        &self,
        capacity: usize,
        policy: SpeculationPolicy,
    ) -> RunningBatch<T> {
        RunningBatch {
            caches: None,
            rows: Vec::new(),
            capacity,
            draft_capacity: capacity + self.scratch(&policy),
            policy,
            reserve_rows: 0,
            backlog: TapBacklog::new(),
            max_deferred: MAX_DEFERRED,
            deferred_keep: DEFERRED_KEEP,
            catch_up_tail: catch_up_tail(),
            timings: Timings::default(),
            compactions: 0,
            retirements: 0,
            trace: None,
            phase_timing: false,
            early_extend: early_extend_default(),
            lazy_head: lazy_head_default(),
            plain_lookahead: plain_lookahead_default(),
            prefill_group_slots: crate::admission::prefill_group_slots(
                std::env::var("TANDEM_PREFILL_GROUPS").ok().as_deref(),
            ),
        }
    }

    /// Seconds per round of each choice of `batch`'s policy (plain, then each shape) at each
    /// batch size in `batches` and two contexts, measured on this GPU with `batch`'s own caches
    /// (so the CUDA graphs captured on the way are the ones its serving replays): that many
    /// pseudo-random prompts of [`CALIBRATION_PROMPTS`] tokens join, run [`CALIBRATION_WARM`]
    /// rounds of a choice, then the median of [`CALIBRATION_TIMED`] timed rounds is kept with
    /// the mean used columns they ran at; then they leave. `batch` must be empty; its policy is
    /// left as it was. The start-up table of [`SpeculationPolicy::adaptive`].
    pub fn calibrate(
        &self,
        batch: &mut RunningBatch<T>,
        batches: &[usize],
    ) -> Result<CostTable, InferError> {
        let refuse = |reason: String| InferError::Config {
            field: "policy",
            reason,
        };
        if self.draft.is_none() {
            return Err(refuse("calibrating draft shapes needs a head".into()));
        }
        if !batch.is_empty() {
            return Err(refuse("calibration needs an empty batch".into()));
        }
        let shapes = batch.policy.shapes().to_vec();
        let saved = std::mem::replace(
            &mut batch.policy,
            SpeculationPolicy::forced(shapes.clone(), Choice::Plain),
        );
        let result = self.measure_choices(batch, &shapes, batches);
        // Whatever happened, the batch is left empty with its own policy, and what it reports
        // (time by phase, compactions) starts from serving.
        self.cancel_all(batch)?;
        batch.policy = saved;
        batch.timings = Timings::default();
        batch.compactions = 0;
        if batch.trace.is_some() {
            batch.record_rounds();
        }
        result
    }

    /// Ends every sequence of `batch` at once (one move of the caches, not one per row).
    fn cancel_all(&self, batch: &mut RunningBatch<T>) -> Result<(), InferError> {
        for row in &mut batch.rows {
            row.done = true;
        }
        self.remove_done(batch)?;
        Ok(())
    }

    fn measure_choices(
        &self,
        batch: &mut RunningBatch<T>,
        shapes: &[Shape],
        batches: &[usize],
    ) -> Result<CostTable, InferError> {
        let capacity = batch.capacity;
        // Attention reads every used column, so costs grow with the context, the wide steps'
        // fastest: two contexts (leaving room for the rounds), or one when the cache is small.
        let low = CALIBRATION_PROMPTS[0].min(capacity / 8).max(1);
        let high = CALIBRATION_PROMPTS[1].min(capacity / 4);
        let mut switches = Vec::new();
        let (low_seconds, low_columns) =
            self.measure_at(batch, shapes, batches, low, &mut switches)?;
        let mut table = if high < 2 * low {
            CostTable::flat(batches.to_vec(), low_seconds)
        } else {
            let (high_seconds, high_columns) =
                self.measure_at(batch, shapes, batches, high, &mut switches)?;
            CostTable::from_two_contexts(
                batches.to_vec(),
                (&low_seconds, &low_columns),
                (&high_seconds, &high_columns),
            )
        };
        // The medians over batch sizes and contexts: a catch-up's cost per step falls with the
        // steps deferred (each piece has a fixed part), so the short runs measured here price
        // long ones high per step; the price per piece bounds that (`switch_seconds`), and the
        // policy's own switches correct both.
        let median = |mut xs: Vec<f64>| {
            xs.sort_by(f64::total_cmp);
            xs.get(xs.len() / 2).copied()
        };
        table.switch_per_step = median(switches.iter().map(|&(s, d)| s / d as f64).collect());
        table.switch_per_piece = median(
            switches
                .iter()
                .map(|&(s, d)| s / catch_up_pieces(d) as f64)
                .collect(),
        );
        Ok(table)
    }

    /// [`Self::measure_choices`] at prompts of `prompt_len` tokens: seconds per round and the
    /// mean used target columns, each `[choice][batch size]` (row 0 plain); the seconds per
    /// the catch-up after each size's plain rounds took, with the steps it caught up on, are
    /// pushed to `switches`.
    #[allow(clippy::type_complexity)]
    fn measure_at(
        &self,
        batch: &mut RunningBatch<T>,
        shapes: &[Shape],
        batches: &[usize],
        prompt_len: usize,
        switches: &mut Vec<(f64, usize)>,
    ) -> Result<(Vec<Vec<f64>>, Vec<Vec<f64>>), InferError> {
        let vocab = self.target.vocab_size() as u64;
        let capacity = batch.capacity;
        let prompt_len = prompt_len as u64;
        let choices: Vec<Choice> = (0..shapes.len())
            .map(Choice::Draft)
            .chain([Choice::Plain])
            .collect();
        let mut seconds = vec![vec![0.0; batches.len()]; shapes.len() + 1];
        let mut columns = vec![vec![0.0; batches.len()]; shapes.len() + 1];
        for (k, &b) in batches.iter().enumerate() {
            let requests = (0..b as u64)
                .map(|id| Request {
                    id,
                    // A fixed pseudo-random prompt per row (costs do not depend on content).
                    prompt: (0..prompt_len)
                        .map(|i| ((id * 7919 + i * 104_729 + 13) % (vocab - 1) + 1) as u32)
                        .collect(),
                    max_new_tokens: capacity,
                    stop_ids: Vec::new(),
                    sampling: SamplingParams::greedy(),
                    seed: id,
                })
                .collect();
            self.admit(batch, requests)?;
            for (c, &choice) in choices.iter().enumerate() {
                batch.policy.force(choice);
                let mut times = Vec::with_capacity(CALIBRATION_TIMED);
                let mut used = 0.0;
                for round in 0..CALIBRATION_WARM + CALIBRATION_TIMED {
                    let before = batch.columns().0;
                    let tokens_before = batch.rows[0].output.tokens.len();
                    let t0 = Instant::now();
                    self.step(batch)?;
                    if round >= CALIBRATION_WARM {
                        // The table prices one plain decode step: a plain round with a
                        // lookahead runs several, and the policy observes it step by step.
                        let steps = match choice {
                            Choice::Plain => {
                                (batch.rows[0].output.tokens.len() - tokens_before).max(1)
                            }
                            Choice::Draft(_) => 1,
                        };
                        times.push(t0.elapsed().as_secs_f64() / steps as f64);
                        used += before as f64 / CALIBRATION_TIMED as f64;
                    }
                }
                if batch.len() != b {
                    return Err(InferError::Config {
                        field: "policy",
                        reason: format!(
                            "calibration at batch {b} lost rows ({} left): the context {capacity} \
                             is too short to calibrate",
                            batch.len()
                        ),
                    });
                }
                times.sort_by(f64::total_cmp);
                let row = if c + 1 == choices.len() { 0 } else { c + 1 };
                seconds[row][k] = times[times.len() / 2];
                columns[row][k] = used;
            }
            // The plain rounds (measured last) left the head behind: what catching up costs.
            let deferred = batch.catch_up_rounds();
            if deferred > 0 {
                let t0 = Instant::now();
                self.catch_up(batch)?;
                switches.push((t0.elapsed().as_secs_f64(), deferred));
            }
            self.cancel_all(batch)?;
        }
        Ok((seconds, columns))
    }

    /// The admission rules of `batch` under this engine (shared by every engine).
    pub fn admission(&self, batch: &RunningBatch<T>) -> Admission {
        Admission {
            capacity: batch.capacity,
            max_positions: self.target.max_positions(),
            round_width: self.round_width(batch),
            vocab: self.target.vocab_size(),
        }
    }

    /// The longest prompt `batch` accepts: one round must still fit after it, in the cache and
    /// in the model's positions.
    pub fn max_prompt_len(&self, batch: &RunningBatch<T>) -> usize {
        self.admission(batch).max_prompt_len()
    }

    /// Checks a request against the engine and the batch before anything runs.
    pub fn check_request(&self, batch: &RunningBatch<T>, r: &Request) -> Result<(), InferError> {
        self.admission(batch)
            .check(std::slice::from_ref(r), &batch.ids())
    }

    /// Prefills `requests` on their own (target prefill with taps, first token, draft extend)
    /// and moves them into the running batch. Requests are all checked first: one bad request
    /// refuses the call and changes nothing. With [`RunningBatch::prefill_group_slots`] the
    /// prompts are prefilled in groups of similar length (one admission each, longest group
    /// first); the progress comes back in the requests' order either way.
    pub fn admit(
        &self,
        batch: &mut RunningBatch<T>,
        requests: Vec<Request>,
    ) -> Result<Vec<Progress>, InferError> {
        let groups = match batch.prefill_group_slots {
            Some(fixed) if requests.len() > 1 => {
                let lengths: Vec<usize> = requests.iter().map(|r| r.prompt.len()).collect();
                crate::admission::prefill_groups(&lengths, fixed)
            }
            _ => Vec::new(),
        };
        if groups.len() <= 1 {
            return self.admit_group(batch, requests);
        }
        self.config.validate()?;
        self.admission(batch).check(&requests, &batch.ids())?;
        let order: Vec<u64> = requests.iter().map(|r| r.id).collect();
        let mut waiting: Vec<Option<Request>> = requests.into_iter().map(Some).collect();
        let mut progress = Vec::with_capacity(order.len());
        for group in groups {
            let part: Vec<Request> = group
                .iter()
                .map(|&i| waiting[i].take().expect("each request is in one group"))
                .collect();
            match self.admit_group(batch, part) {
                Ok(admitted) => progress.extend(admitted),
                Err(e) => {
                    // The call changes nothing: the groups it admitted leave again.
                    for p in &progress {
                        self.cancel(batch, p.id)?;
                    }
                    return Err(e);
                }
            }
        }
        progress.sort_by_key(|p| order.iter().position(|&id| id == p.id));
        Ok(progress)
    }

    /// [`Engine::admit`] of one prefill group, recorded as one admission.
    fn admit_group(
        &self,
        batch: &mut RunningBatch<T>,
        requests: Vec<Request>,
    ) -> Result<Vec<Progress>, InferError> {
        let wall = Instant::now();
        let queued_s = self.drain_when_timing(batch)?;
        let (rows, tokens) = (
            requests.len(),
            requests.iter().map(|r| r.prompt.len()).sum::<usize>(),
        );
        let before = (batch.timings, batch.columns(), self.graphs_captured());
        let deferred = self.defers_joins(batch, &requests);
        let result = self.admit_timed(batch, requests, deferred);
        let seconds = wall.elapsed().as_secs_f64();
        batch.timings.admits_wall_s += seconds;
        let (t, (target_columns, longest, head_columns), captured) = before;
        let after = batch.timings;
        let captured = self.graphs_captured() - captured;
        batch.record(wall, |at_s| RoundRecord {
            at_s,
            kind: "admit",
            rows,
            target_columns,
            longest,
            head_columns,
            choice: if deferred { "deferred" } else { "extended" }.into(),
            tokens,
            draft_s: 0.0,
            verify_s: after.prefill_s - t.prefill_s,
            extend_s: after.extend_s - t.extend_s,
            catch_up_s: 0.0,
            housekeeping_s: after.housekeeping_s - t.housekeeping_s,
            wall_s: seconds,
            queued_s,
            setup_s: after.prefill_setup_s - t.prefill_setup_s,
            captured,
            predicted_s: f64::NAN,
            predicted_plain_s: f64::NAN,
        });
        result
    }

    /// With [`RunningBatch::phase_timing`], waits for the device work queued before this call
    /// and says how long that took (0 otherwise: serving keeps its overlap).
    fn drain_when_timing(&self, batch: &RunningBatch<T>) -> Result<f64, InferError> {
        if !batch.phase_timing {
            return Ok(0.0);
        }
        let t0 = Instant::now();
        self.target.synchronize()?;
        Ok(t0.elapsed().as_secs_f64())
    }

    /// Whether `requests` joining `batch` defer their head extension: during a run of plain
    /// rounds (target-only serving pays only the prefill), and when the policy expects the
    /// batch they make to run plain rounds (at c=32 the first wave's extension, 9-17 ms over
    /// ~2,600-4,900 prompt tokens, preceded nothing but plain rounds). A drafted round catches
    /// them up first, so deferring is never wrong, only a guess about when to pay.
    fn defers_joins(&self, batch: &RunningBatch<T>, requests: &[Request]) -> bool {
        if self.draft.is_none() {
            return false;
        }
        let longest = requests.iter().map(|r| r.prompt.len()).max().unwrap_or(0);
        let columns = batch.columns().0.max(longest);
        batch.policy.in_plain_run()
            || batch.policy.expects_plain(
                batch.rows.len() + requests.len(),
                columns,
                batch.catch_up_rounds(),
            )
    }

    fn admit_timed(
        &self,
        batch: &mut RunningBatch<T>,
        requests: Vec<Request>,
        defer: bool,
    ) -> Result<Vec<Progress>, InferError> {
        self.config.validate()?;
        self.admission(batch).check(&requests, &batch.ids())?;
        if requests.is_empty() {
            return Ok(Vec::new());
        }
        let n = requests.len();
        let mut rows: Vec<Row> = requests
            .into_iter()
            .map(|r| Row::new(r, self.draft_steps(batch)))
            .collect();

        // Target prefill (with taps when there is a head), first token.
        let t0 = Instant::now();
        let mut cache = self.target.new_cache(n, batch.capacity)?;
        let refs: Vec<&[u32]> = rows.iter().map(|r| r.request.prompt.as_slice()).collect();
        let step = T::layout(&cache).prefill_step(&refs)?;
        batch.timings.prefill_setup_s += t0.elapsed().as_secs_f64();
        let (logits, step_taps) =
            self.target
                .forward(&step, &mut cache, &self.taps, LogitsFor::Last)?;
        let first = pick(self.target, &logits, &mut rows)?;
        batch.timings.prefill_s += t0.elapsed().as_secs_f64();

        // Draft extend over the prompt: slot t pairs aux_t with token t+1 (the last slot with
        // the first generated token). The chunks have the prompts' lengths, so the prefill's
        // slots line up with the extend's one for one. When plain rounds run or are expected
        // ([`Self::defers_joins`]) the extension is deferred like theirs: the newcomers join
        // the head's cache empty and catch up with the rest before the next drafted round.
        let t0 = Instant::now();
        let mut deferred_taps = None;
        let backlog_row = batch.backlog.rows;
        let head = match self.draft {
            Some(draft) if defer => {
                let dcache = self.target.new_head_cache(draft, n, batch.draft_capacity)?;
                let (hidden, vocab) = T::head_dims(draft);
                let roots = Roots {
                    hidden: self.target.zero_rows(n, hidden)?,
                    logits: self.target.zero_logits(n, vocab)?,
                };
                for (j, (row, &f)) in rows.iter_mut().zip(&first).enumerate() {
                    let tokens = row.request.prompt[1..].iter().copied().chain([f]);
                    row.behind = tokens
                        .enumerate()
                        .map(|(slot, t)| (t, backlog_row + j * step.width + slot))
                        .collect();
                }
                deferred_taps = Some(step_taps);
                Some((dcache, roots))
            }
            Some(draft) => {
                let mut dcache = self.target.new_head_cache(draft, n, batch.draft_capacity)?;
                let chunks: Vec<Vec<u32>> = rows
                    .iter()
                    .zip(&first)
                    .map(|(r, &f)| r.request.prompt[1..].iter().copied().chain([f]).collect())
                    .collect();
                let slots: Vec<Vec<usize>> = rows
                    .iter()
                    .map(|r| (0..r.request.prompt.len()).collect())
                    .collect();
                let roots =
                    self.draft_extend(draft, &mut dcache, &chunks, &step_taps, step.width, &slots)?;
                Some((dcache, roots))
            }
            None => None,
        };
        let joined = Caches::<T> {
            target: cache,
            head,
            head_keep: None,
        };
        match &mut batch.caches {
            None => {
                let mut joined = joined;
                self.target
                    .reserve(&mut joined.target, batch.reserve_rows)?;
                if let Some((dcache, _)) = &mut joined.head {
                    self.target.reserve(dcache, batch.reserve_rows)?;
                }
                batch.caches = Some(joined)
            }
            Some(caches) => self.append(caches, joined, &mut batch.timings)?,
        }
        if let Some(taps) = deferred_taps {
            let at = batch.backlog.push(self.target, &taps)?;
            debug_assert_eq!(at, backlog_row);
        }
        self.target.synchronize()?;
        batch.timings.extend_s += t0.elapsed().as_secs_f64();

        let mut progress = Vec::with_capacity(n);
        for (mut row, &token) in rows.into_iter().zip(&first) {
            row.last = token;
            commit(&mut row, &[token]);
            progress.push(Progress {
                id: row.request.id,
                tokens: row.output.tokens.clone(),
                accepted: None,
                finished: None,
            });
            batch.rows.push(row);
        }
        self.retire(batch, &mut progress)?;
        Ok(progress)
    }

    /// Removes a request from the batch (a client went away); its output so far is returned.
    pub fn cancel(
        &self,
        batch: &mut RunningBatch<T>,
        id: u64,
    ) -> Result<Option<SpecOutput>, InferError> {
        let Some(row) = batch.rows.iter().position(|r| r.request.id == id) else {
            return Ok(None);
        };
        batch.rows[row].done = true;
        let mut gone = self.remove_done(batch)?;
        Ok(gone.pop().map(|r| r.output))
    }

    /// Moves `joined`'s rows after `caches`' rows.
    fn append(
        &self,
        caches: &mut Caches<T>,
        joined: Caches<T>,
        timings: &mut Timings,
    ) -> Result<(), InferError> {
        self.settle_head(caches, timings)?;
        self.target.append(&mut caches.target, joined.target)?;
        if let (Some((dcache, roots)), Some((jcache, jroots))) = (&mut caches.head, joined.head) {
            let (mine, theirs) = (T::layout(dcache).batch(), T::layout(&jcache).batch());
            self.target.append(dcache, jcache)?;
            let picks: Vec<(usize, usize)> = (0..mine)
                .map(|r| (0, r))
                .chain((0..theirs).map(|r| (1, r)))
                .collect();
            *roots = self.gather_roots(&[&*roots, &jroots], &picks)?;
        }
        Ok(())
    }

    /// New roots, row `j` being row `picks[j].1` of `sources[picks[j].0]`.
    fn gather_roots(
        &self,
        sources: &[&Roots<T>],
        picks: &[(usize, usize)],
    ) -> Result<Roots<T>, InferError> {
        let hidden: Vec<&T::Rows> = sources.iter().map(|r| &r.hidden).collect();
        let logits: Vec<&T::Logits> = sources.iter().map(|r| &r.logits).collect();
        Ok(Roots {
            hidden: self.target.gather_rows(&hidden, picks)?,
            logits: self.target.gather_logits(&logits, picks)?,
        })
    }

    /// Takes the rows marked done out of the batch (and its caches), in row order.
    fn remove_done(&self, batch: &mut RunningBatch<T>) -> Result<Vec<Row>, InferError> {
        if !batch.rows.iter().any(|r| r.done) {
            return Ok(Vec::new());
        }
        batch.retirements += 1;
        // Departed rows are refilled from the end of the batch, so only those rows move in the
        // caches (keeping the order moved every row after the first departure: at c=64 the
        // adaptive server, whose sequences finish in different rounds, spent 0.7 s doing so).
        let gone: Vec<bool> = batch.rows.iter().map(|r| r.done).collect();
        let keep = tandem_model::fill_order(gone.len(), &gone);
        if keep.is_empty() && batch.reserve_rows == 0 {
            batch.caches = None;
        } else if let Some(caches) = &mut batch.caches {
            self.target.retain(&mut caches.target, &keep)?;
            if caches.head.is_some() {
                caches.head_keep = Some(match caches.head_keep.take() {
                    Some(pending) => keep.iter().map(|&r| pending[r]).collect(),
                    None => keep.clone(),
                });
                if !batch.lazy_head {
                    self.settle_head(caches, &mut batch.timings)?;
                }
            }
        }
        let mut rows: Vec<Option<Row>> = std::mem::take(&mut batch.rows)
            .into_iter()
            .map(Some)
            .collect();
        batch.rows = keep
            .iter()
            .map(|&b| rows[b].take().expect("keep names each row once"))
            .collect();
        let gone: Vec<Row> = rows.into_iter().flatten().collect();
        if batch.rows.is_empty() {
            batch.backlog.clear();
        }
        Ok(gone)
    }

    /// Cuts the head's cache and roots down to the batch's rows (`Caches::head_keep`), before
    /// anything reads, extends or compacts them.
    fn settle_head(&self, caches: &mut Caches<T>, timings: &mut Timings) -> Result<(), InferError> {
        let (Some(keep), Some((dcache, roots))) = (caches.head_keep.take(), &mut caches.head)
        else {
            return Ok(());
        };
        let t0 = Instant::now();
        self.target.retain(dcache, &keep)?;
        let t1 = Instant::now();
        let picks: Vec<(usize, usize)> = keep.iter().map(|&r| (0, r)).collect();
        *roots = self.gather_roots(&[&*roots], &picks)?;
        timings.head_retain_s += (t1 - t0).as_secs_f64();
        timings.head_roots_s += t1.elapsed().as_secs_f64();
        Ok(())
    }

    /// Moves finished sequences out of the batch, filling in their `finished` output.
    fn retire(
        &self,
        batch: &mut RunningBatch<T>,
        progress: &mut [Progress],
    ) -> Result<(), InferError> {
        for row in self.remove_done(batch)? {
            if let Some(p) = progress.iter_mut().find(|p| p.id == row.request.id) {
                p.finished = Some(row.output);
            }
        }
        Ok(())
    }

    /// Makes room for one round: compacts the caches when either would overflow, and ends the
    /// sequences that no longer fit the cache or the model's positions (`Finish::ContextFull`).
    fn make_room(
        &self,
        batch: &mut RunningBatch<T>,
        progress: &mut Vec<Progress>,
    ) -> Result<(), InferError> {
        let width = self.round_width(batch);
        let scratch = self.scratch(&batch.policy);
        let Some(caches) = &mut batch.caches else {
            return Ok(());
        };
        let target = T::layout(&caches.target);
        let head = caches.head.as_ref().map(|(d, _)| T::layout(d));
        let needs_room = target.used() + width > target.capacity()
            || head.is_some_and(|d| d.used() + width + scratch > d.capacity())
            // Attention scans every used column, so columns of rejected drafts, padding and
            // departed sequences cost every round until they are reclaimed; reclaiming them
            // moves each live column once.
            || mostly_waste(target)
            || head.is_some_and(mostly_waste);
        // A plain run after drafted rounds keeps the target's waste (rejected drafts) for all
        // its rounds, which add none: reclaimed at once, it stops costing (session 16 at c=32:
        // plain rounds at 418 used columns against target-only's 297, 1.59 vs 1.50 ms). The
        // head's cache is not read during a plain run.
        let plain_waste = self.draft.is_some()
            && batch.policy.in_plain_run()
            && some_waste(T::layout(&caches.target));
        let t0 = Instant::now();
        if needs_room || plain_waste {
            self.target.compact(&mut caches.target)?;
            if needs_room {
                self.settle_head(caches, &mut batch.timings)?;
                if let Some((dcache, _)) = &mut caches.head {
                    self.target.compact(dcache)?;
                }
            }
            batch.compactions += 1;
            batch.timings.compact_s += t0.elapsed().as_secs_f64();
        }
        let limit = batch.capacity.min(self.target.max_positions());
        for (b, row) in batch.rows.iter_mut().enumerate() {
            if T::layout(&caches.target).seq_len(b) + width > limit {
                row.output.finish = Finish::ContextFull;
                row.done = true;
                progress.push(Progress {
                    id: row.request.id,
                    tokens: Vec::new(),
                    accepted: None,
                    finished: None,
                });
            }
        }
        self.retire(batch, progress)?;
        batch.timings.housekeeping_s += t0.elapsed().as_secs_f64();
        Ok(())
    }

    /// One round for every running sequence: draft, verify with the target (one tree step for
    /// the batch), accept, commit, draft extend over what was accepted. Sequences that finish
    /// leave the batch.
    pub fn step(&self, batch: &mut RunningBatch<T>) -> Result<Vec<Progress>, InferError> {
        let wall = Instant::now();
        let queued_s = self.drain_when_timing(batch)?;
        let before = (batch.timings, batch.columns(), self.graphs_captured());
        let mut chosen = None;
        let result = self.round(batch, &mut chosen);
        let seconds = wall.elapsed().as_secs_f64();
        batch.timings.rounds_wall_s += seconds;
        if let Some(chosen) = chosen {
            let (t, (target_columns, longest, head_columns), captured) = before;
            let after = batch.timings;
            let captured = self.graphs_captured() - captured;
            batch.record(wall, |at_s| RoundRecord {
                at_s,
                kind: "round",
                rows: chosen.rows,
                target_columns,
                longest,
                head_columns,
                choice: chosen.label,
                tokens: chosen.committed,
                draft_s: after.draft_s - t.draft_s,
                verify_s: after.verify_s - t.verify_s,
                extend_s: after.extend_s - t.extend_s,
                catch_up_s: after.catch_up_s - t.catch_up_s,
                housekeeping_s: after.housekeeping_s - t.housekeeping_s,
                wall_s: seconds,
                queued_s,
                setup_s: 0.0,
                captured,
                predicted_s: chosen.predicted.0,
                predicted_plain_s: chosen.predicted.1,
            });
        }
        result
    }

    fn round(
        &self,
        batch: &mut RunningBatch<T>,
        chosen: &mut Option<Chosen>,
    ) -> Result<Vec<Progress>, InferError> {
        let mut progress = Vec::new();
        self.make_room(batch, &mut progress)?;
        if batch.caches.is_none() || batch.rows.is_empty() {
            return Ok(progress);
        }
        // Every row's attention reads every used column of the target's cache: the context the
        // round is priced at.
        let columns = batch.columns().0;
        let deferred = batch.catch_up_rounds();
        // The most any row still has to generate bounds the drafted rounds a switch from plain
        // rounds pays for.
        let tokens_left = batch
            .rows
            .iter()
            .map(|r| {
                r.request
                    .max_new_tokens
                    .saturating_sub(r.output.tokens.len())
            })
            .max()
            .unwrap_or(0);
        let choice = match self.draft {
            Some(_) => batch.policy.choose_with_tokens_left(
                batch.rows.len(),
                columns,
                deferred,
                tokens_left,
            ),
            None => Choice::Plain,
        };
        let predicted = batch.policy.costs().map_or((f64::NAN, f64::NAN), |c| {
            let b = batch.rows.len();
            (c.at(choice.index(), b, columns), c.at(0, b, columns))
        });
        let shape = batch.policy.shape(choice);
        if shape.is_none() {
            let steps = self.lookahead_steps(batch);
            if steps > 1 {
                return self.plain_lookahead(
                    batch,
                    chosen,
                    (choice, predicted, columns),
                    steps,
                    progress,
                );
            }
        }
        // The catch-up after plain rounds is what switching to drafting costs, paid once per
        // switch: the policy books it apart from the drafted round's own cost.
        if shape.is_some() && batch.backlog.steps > 0 {
            let t0 = Instant::now();
            let captures_before = self.graphs_captured();
            self.catch_up(batch)?;
            if self.graphs_captured() == captures_before {
                batch
                    .policy
                    .observe_switch(t0.elapsed().as_secs_f64(), deferred);
            }
        }
        let round_start = Instant::now();
        let captures_before = self.graphs_captured();
        let timing = batch.phase_timing;
        let caches = batch.caches.as_mut().expect("checked above");
        if shape.is_some() {
            self.settle_head(caches, &mut batch.timings)?;
        }
        let rows = &mut batch.rows;
        let roots: Vec<u32> = rows.iter().map(|r| r.last).collect();

        // Draft (the head's scratch columns are rolled back afterwards). Chains stay where the
        // backend drafted them until the verification has been queued.
        let t0 = Instant::now();
        let drafted = match (self.draft, &mut caches.head, shape) {
            (Some(draft), Some((dcache, head_roots)), Some(shape)) => {
                let draft_columns = T::layout(dcache).used();
                let drafted = if shape.topk == 1 {
                    let steps = chain_steps(shape);
                    let chains = self.target.head_chains(
                        draft,
                        dcache,
                        &head_roots.hidden,
                        &head_roots.logits,
                        roots.len(),
                        steps,
                    )?;
                    Drafted::Chains(chains, steps)
                } else {
                    Drafted::Trees(self.draft_beams(draft, shape, &roots, head_roots, dcache)?)
                };
                T::layout_mut(dcache).rollback(draft_columns);
                drafted
            }
            _ => Drafted::Trees(roots.iter().map(|&t| DraftTree::chain(t, &[])).collect()),
        };
        // Phase-timed rounds wait here so that the draft's device time is in its own column.
        if timing {
            batch.timings.draft_queue_s += t0.elapsed().as_secs_f64();
            self.target.synchronize()?;
        }
        batch.timings.draft_s += t0.elapsed().as_secs_f64();

        // Verify all trees in one target step. Chains on the device are verified before the
        // host has seen them: their tokens come back after the verification's results, in the
        // same wait.
        let t0 = Instant::now();
        // Drafted trees go in as they are; device chains are laid out with placeholder tokens
        // (a chain's tree shape does not depend on its tokens) and read back after the
        // verification's results.
        let all_greedy = rows.iter().all(|r| r.request.sampling.is_greedy());
        let defers_taps = self.draft.is_some() && caches.head.is_some() && shape.is_none();
        // A plain round of a batch with a head waits for its ids only (below): its taps, wanted
        // only in the backlog, may stay where the step wrote them until the read-back is queued
        // (copied out ahead of it they cost c=8's plain rounds ~11 us, session 42).
        let reads_ids_first = defers_taps && batch.lazy_head && all_greedy;
        let mut deferred_taps = None;
        let (trees, device_chains, step, (logits, step_taps)) = match drafted {
            Drafted::Trees(trees) => {
                let step = T::layout(&caches.target).tree_step(&tree_refs(&trees))?;
                let out = if reads_ids_first {
                    let (logits, taps) = self.target.forward_deferring_taps(
                        &step,
                        &mut caches.target,
                        &self.taps,
                        LogitsFor::All,
                    )?;
                    deferred_taps = Some(taps);
                    let none = Taps {
                        taps: Vec::new(),
                        tensors: Vec::new(),
                        visited: Vec::new(),
                    };
                    (logits, none)
                } else {
                    self.target
                        .forward(&step, &mut caches.target, &self.taps, LogitsFor::All)?
                };
                (trees, None, step, out)
            }
            Drafted::Chains(chains, steps) => {
                let placeholders: Vec<DraftTree> = roots
                    .iter()
                    .map(|&t| DraftTree::chain(t, &vec![0; steps]))
                    .collect();
                let step = T::layout(&caches.target).tree_step(&tree_refs(&placeholders))?;
                let out = self.target.forward_chains(
                    &step,
                    &mut caches.target,
                    &self.taps,
                    LogitsFor::All,
                    &chains,
                )?;
                (placeholders, Some(chains), step, out)
            }
        };
        if timing {
            batch.timings.verify_queue_s += t0.elapsed().as_secs_f64();
        }
        let early = batch.early_extend && !timing && all_greedy;
        let mut early_extend = None;
        // The backlog row of this step's row 0, should the round be plain.
        let backlog_row = batch.backlog.rows;
        let mut taps_deferred = false;
        let (reads, drafted_chains) = match (device_chains, self.draft, &mut caches.head) {
            (Some(chains), Some(draft), Some((dcache, _))) if early => {
                let read = self.target.greedy_read_back(&logits, &chains)?;
                let t_extend = Instant::now();
                let placeholders = vec![vec![0u32; step.width]; rows.len()];
                let refs: Vec<&[u32]> = placeholders.iter().map(Vec::as_slice).collect();
                let extend_step = T::layout(dcache).prefill_step(&refs)?;
                early_extend = Some(self.target.head_extend_greedy(
                    draft,
                    dcache,
                    &extend_step,
                    &step_taps,
                    &read,
                )?);
                let queued = t_extend.elapsed();
                let (argmax, chains) = self.target.finish_read_back(read)?;
                // The extend's enqueueing is its own phase, not the verification's wait.
                batch.timings.extend_s += queued.as_secs_f64();
                let reads = VerifyReads {
                    argmax: Some(argmax),
                    host: None,
                };
                (reads, Some(chains))
            }
            // A plain round of a batch with a head waits for its ids only: the deferred taps'
            // copy is queued behind their read-back, while the device still runs the step.
            // (Without a head the round reads its ids as it always has: target-only serving,
            // the baseline, keeps its code path.)
            (None, _, _) if reads_ids_first => {
                let read = self.target.plain_read_back(&logits)?;
                match deferred_taps.take() {
                    Some(taps) => batch.backlog.push_deferred(self.target, taps)?,
                    None => batch.backlog.push(self.target, &step_taps)?,
                };
                taps_deferred = true;
                let (argmax, _) = self.target.finish_read_back(read)?;
                let reads = VerifyReads {
                    argmax: Some(argmax),
                    host: None,
                };
                (reads, None)
            }
            (chains, _, _) => {
                let reads = VerifyReads::of(self.target, &logits, rows)?;
                let chains = chains.map(|c| self.target.chains_to_host(&c)).transpose()?;
                (reads, chains)
            }
        };
        let trees = match drafted_chains {
            None => trees,
            Some(chains) => roots
                .iter()
                .zip(chains)
                .map(|(&t, d)| DraftTree::chain(t, &d))
                .collect(),
        };
        let verify_width = step.width;
        let acceptances = reads.accept(self.target, &trees, verify_width, rows);
        batch.timings.verify_s += t0.elapsed().as_secs_f64();

        // Commit the accepted path in the target cache, record statistics, and extend the
        // head over the committed tokens with the taps of the verification step (after a
        // plain round: later, with the next drafted round's).
        let t0 = Instant::now();
        let label = shape.map_or_else(|| "none".to_owned(), |s| s.to_string());
        let mut chunks = Vec::with_capacity(rows.len());
        let mut slots = Vec::with_capacity(rows.len());
        let mut committed_total = 0;
        for (b, ((tree, acc), row)) in trees
            .iter()
            .zip(&acceptances)
            .zip(rows.iter_mut())
            .enumerate()
        {
            let path = acc.path_with_root();
            T::layout_mut(&mut caches.target).keep_only(b, verify_width, &path);
            let committed = acc.committed_tokens(tree);
            committed_total += committed.len();
            if self.draft.is_some() {
                if shape.is_some() {
                    let depth = tree.depth.iter().copied().max().unwrap_or(0);
                    row.output.stats.record(acc.accepted.len(), depth);
                } else {
                    row.behind
                        .push((committed[0], backlog_row + b * verify_width));
                }
                count_round(row, &label);
            }
            let before = row.output.tokens.len();
            commit(row, &committed);
            progress.push(Progress {
                id: row.request.id,
                tokens: row.output.tokens[before..].to_vec(),
                // Rounds without drafts report none (as the target-only baseline does).
                accepted: shape.map(|_| acc.accepted.len()),
                finished: None,
            });
            row.last = *committed.last().expect("bonus token");
            slots.push(path);
            chunks.push(committed);
        }
        match (self.draft, &mut caches.head, shape) {
            (Some(_), Some((dcache, head_roots)), Some(_)) if early_extend.is_some() => {
                // The extend ran over every verified slot and left the roots at the last
                // accepted ones: keep each sequence's accepted slots.
                let (hidden, logits) = early_extend.take().expect("checked above");
                let layout = T::layout_mut(dcache);
                for (b, path) in slots.iter().enumerate() {
                    layout.keep_only(b, verify_width, path);
                }
                layout.forget_invisible_tail();
                *head_roots = Roots { hidden, logits };
            }
            (Some(draft), Some((dcache, head_roots)), Some(_)) => {
                *head_roots =
                    self.draft_extend(draft, dcache, &chunks, &step_taps, verify_width, &slots)?;
            }
            (Some(_), Some(_), None) if !taps_deferred => {
                batch.backlog.push(self.target, &step_taps)?;
            }
            _ => {}
        }
        // The extend's launches are left queued: the next round's host work (policy, draft
        // step building) overlaps them, and the verification's read-back waits for them. Only
        // a phase-timed run waits here, so that its extend column holds the extend's device time.
        if timing {
            batch.timings.extend_queue_s += t0.elapsed().as_secs_f64();
        }
        self.drain_when_timing(batch)?;
        batch.timings.extend_s += t0.elapsed().as_secs_f64();
        // A round that captured a CUDA graph paid a one-time cost: its time says nothing about
        // the next rounds.
        let round_seconds = (self.graphs_captured() == captures_before)
            .then(|| round_start.elapsed().as_secs_f64());
        *chosen = Some(Chosen {
            rows: batch.rows.len(),
            label,
            committed: committed_total,
            predicted,
        });
        batch.policy.observe(
            choice,
            batch.rows.len(),
            columns,
            committed_total,
            round_seconds,
        );
        self.end_round(batch, progress)
    }

    /// What every round ends with: the oldest deferred tokens forgotten once the deferral
    /// reaches its bounds, then the finished rows retired (their outputs into `progress`).
    fn end_round(
        &self,
        batch: &mut RunningBatch<T>,
        mut progress: Vec<Progress>,
    ) -> Result<Vec<Progress>, InferError> {
        if batch.deferred_rounds() >= batch.max_deferred
            || batch.backlog.rows >= MAX_DEFERRED_TAP_ROWS
        {
            self.forget_oldest_deferred(batch)?;
        }
        let t0 = Instant::now();
        self.retire(batch, &mut progress)?;
        batch.timings.housekeeping_s += t0.elapsed().as_secs_f64();
        Ok(progress)
    }

    /// Decode steps the next plain round queues back to back ([`RunningBatch::plain_lookahead`]):
    /// 1 unless every row is greedy and the batch is not phase-timed, and never more than the
    /// cache's free columns, any row's room before its context limit, or the fewest tokens a
    /// row has left to generate (so no row runs past `max_new_tokens`).
    fn lookahead_steps(&self, batch: &RunningBatch<T>) -> usize {
        let wanted = batch.plain_lookahead;
        let Some(caches) = &batch.caches else {
            return 1;
        };
        if wanted < 2
            || batch.phase_timing
            || batch.rows.iter().any(|r| !r.request.sampling.is_greedy())
        {
            return 1;
        }
        let layout = T::layout(&caches.target);
        let limit = batch.capacity.min(self.target.max_positions());
        let free = layout.capacity().saturating_sub(layout.used());
        let context = (0..batch.rows.len())
            .map(|b| limit.saturating_sub(layout.seq_len(b)))
            .min()
            .unwrap_or(0);
        let left = batch
            .rows
            .iter()
            .map(|r| {
                r.request
                    .max_new_tokens
                    .saturating_sub(r.output.tokens.len())
            })
            .min()
            .unwrap_or(0);
        wanted.min(free).min(context).min(left).max(1)
    }

    /// A plain round of `steps` greedy decode steps ([`RunningBatch::plain_lookahead`]): step
    /// 0 from the rows' last tokens, each later step from the previous step's greedy ids still
    /// on the device, every step's ids read back once the last step is queued. Each step is
    /// what a one-step plain round runs (the same tree step of the rows' roots, the same
    /// logits and taps, its taps into the head's backlog), so the tokens are the same; a row
    /// that stops at step i keeps none after it (the later columns leave with the row). The
    /// policy sees `steps` plain rounds, each a `steps`-th of the round's time.
    fn plain_lookahead(
        &self,
        batch: &mut RunningBatch<T>,
        chosen: &mut Option<Chosen>,
        (choice, predicted, columns): (Choice, (f64, f64), usize),
        steps: usize,
        mut progress: Vec<Progress>,
    ) -> Result<Vec<Progress>, InferError> {
        let round_start = Instant::now();
        let captures_before = self.graphs_captured();
        let caches = batch.caches.as_mut().expect("checked by round");
        let rows = &mut batch.rows;
        let n = rows.len();
        let pushes_taps = self.draft.is_some() && caches.head.is_some();
        let roots: Vec<DraftTree> = rows.iter().map(|r| DraftTree::chain(r.last, &[])).collect();
        // Later steps' tokens come from the device; these only shape the step.
        let placeholders: Vec<DraftTree> = (0..n).map(|_| DraftTree::chain(0, &[])).collect();
        let mut reads = Vec::with_capacity(steps);
        // The backlog row of each step's row 0.
        let mut backlog_rows = Vec::with_capacity(steps);
        for i in 0..steps {
            let trees = if i == 0 { &roots } else { &placeholders };
            let step = T::layout(&caches.target).tree_step(&tree_refs(trees))?;
            let (logits, step_taps) = match reads.last() {
                None => {
                    self.target
                        .forward(&step, &mut caches.target, &self.taps, LogitsFor::All)?
                }
                Some(previous) => self.target.forward_after_read(
                    &step,
                    &mut caches.target,
                    &self.taps,
                    LogitsFor::All,
                    previous,
                )?,
            };
            let layout = T::layout_mut(&mut caches.target);
            for b in 0..n {
                layout.keep_only(b, 1, &[0]);
            }
            reads.push(self.target.plain_read_back(&logits)?);
            backlog_rows.push(batch.backlog.rows);
            if pushes_taps {
                // Copied out now: the next step replays the same graph buffers.
                batch.backlog.push(self.target, &step_taps)?;
            }
        }
        let mut ids = Vec::with_capacity(steps);
        for read in reads {
            ids.push(self.target.finish_read_back(read)?.0);
        }
        let label = "none";
        let mut committed_by_step = vec![0usize; steps];
        for (b, row) in rows.iter_mut().enumerate() {
            let before = row.output.tokens.len();
            for (i, step_ids) in ids.iter().enumerate() {
                if row.done {
                    break;
                }
                let token = step_ids[b];
                if self.draft.is_some() {
                    row.behind.push((token, backlog_rows[i] + b));
                    count_round(row, label);
                }
                commit(row, &[token]);
                row.last = token;
                committed_by_step[i] += 1;
            }
            progress.push(Progress {
                id: row.request.id,
                tokens: row.output.tokens[before..].to_vec(),
                accepted: None,
                finished: None,
            });
        }
        let elapsed = round_start.elapsed().as_secs_f64();
        batch.timings.verify_s += elapsed;
        let committed_total = committed_by_step.iter().sum();
        *chosen = Some(Chosen {
            rows: n,
            label: label.to_owned(),
            committed: committed_total,
            predicted,
        });
        // A round that captured a CUDA graph paid a one-time cost: its time says nothing about
        // the next rounds.
        let step_seconds =
            (self.graphs_captured() == captures_before).then_some(elapsed / steps as f64);
        for (i, &committed) in committed_by_step.iter().enumerate() {
            batch
                .policy
                .observe(choice, n, columns + i, committed, step_seconds);
        }
        self.end_round(batch, progress)
    }

    /// Keeps each row's last [`RunningBatch::deferred_keep`] deferred tokens, their taps moved
    /// to the front of a new backlog, and forgets the rest (see [`RunningBatch::max_deferred`]).
    fn forget_oldest_deferred(&self, batch: &mut RunningBatch<T>) -> Result<(), InferError> {
        let keep = batch
            .deferred_keep
            .min(batch.max_deferred.saturating_sub(1));
        let Some(old) = batch.backlog.taps.take() else {
            return Ok(());
        };
        let mut picks = Vec::new();
        for row in &mut batch.rows {
            let skip = row.behind.len().saturating_sub(keep);
            row.behind.drain(..skip);
            for entry in &mut row.behind {
                picks.push((0, entry.1));
                entry.1 = picks.len() - 1;
            }
        }
        batch.backlog.clear();
        if picks.is_empty() {
            batch.backlog.taps = Some(old);
            return Ok(());
        }
        let tensors = old
            .tensors
            .iter()
            .map(|tap| self.target.gather_rows(&[tap], &picks))
            .collect::<Result<Vec<_>, _>>()?;
        batch.backlog.taps = Some(Taps {
            taps: old.taps,
            tensors,
            visited: Vec::new(),
        });
        batch.backlog.rows = picks.len();
        batch.backlog.steps = batch.deferred_rounds();
        Ok(())
    }

    /// Extends the head over the tokens it is behind on (plain rounds since its last extension,
    /// prompts that joined during them), each row over its own tokens with their recorded taps,
    /// in batched steps of at most [`CATCH_UP_PIECE`] columns (compacting the head's cache when
    /// a piece would not fit), and replaces the roots of those rows. Rows with nothing deferred
    /// keep their roots. A drafted round does this first by itself.
    pub fn catch_up(&self, batch: &mut RunningBatch<T>) -> Result<(), InferError> {
        // Each row over its last `catch_up_tail` deferred tokens only (by default): the head's
        // cache then has a gap and its positions lag the target's; outputs stay exact
        // (verification decides), and a switch from plain rounds costs one piece of that many
        // columns instead of the whole run.
        let tail = batch.catch_up_tail;
        let behind: Vec<&[(u32, usize)]> = batch
            .rows
            .iter()
            .map(|r| {
                let skip = tail.map_or(0, |k| r.behind.len().saturating_sub(k));
                &r.behind[skip..]
            })
            .collect();
        let longest = behind.iter().map(|b| b.len()).max().unwrap_or(0);
        let (Some(draft), Some(caches)) = (self.draft, &mut batch.caches) else {
            return Ok(());
        };
        self.settle_head(caches, &mut batch.timings)?;
        let Some((dcache, roots)) = &mut caches.head else {
            return Ok(());
        };
        let t0 = Instant::now();
        let mut done = 0;
        while done < longest {
            let wanted = (longest - done).min(CATCH_UP_PIECE);
            if T::layout(dcache).used() + wanted > T::layout(dcache).capacity() {
                self.target.compact(dcache)?;
            }
            let room = T::layout(dcache).capacity() - T::layout(dcache).used();
            let width = wanted.min(room);
            if width == 0 {
                return Err(InferError::Config {
                    field: "context",
                    reason: format!(
                        "the head's cache ({} columns) has no room to catch up on deferred \
                         tokens even after compaction",
                        T::layout(dcache).capacity()
                    ),
                });
            }
            let pieces: Vec<&[(u32, usize)]> = behind
                .iter()
                .map(|b| &b[done.min(b.len())..(done + width).min(b.len())])
                .collect();
            let backlog = batch.backlog.taps.as_ref().expect("rows are behind");
            self.extend_deferred(draft, dcache, roots, &pieces, backlog)?;
            done += width;
        }
        self.target.synchronize()?;
        for row in &mut batch.rows {
            row.behind.clear();
        }
        batch.backlog.clear();
        batch.timings.catch_up_s += t0.elapsed().as_secs_f64();
        Ok(())
    }

    /// One step of [`Self::catch_up`]: the head extended over `pieces[b]` for each row `b`
    /// (possibly none), the fc input of each slot gathered from the backlog row it names; the
    /// roots of the rows with a piece become their output at its last token.
    fn extend_deferred(
        &self,
        draft: &T::Head,
        dcache: &mut T::Cache,
        roots: &mut Roots<T>,
        pieces: &[&[(u32, usize)]],
        backlog: &Taps<T::Rows>,
    ) -> Result<(), InferError> {
        let chunks: Vec<Vec<u32>> = pieces
            .iter()
            .map(|p| p.iter().map(|e| e.0).collect())
            .collect();
        let refs: Vec<&[u32]> = chunks.iter().map(Vec::as_slice).collect();
        let step = T::layout(dcache).prefill_step(&refs)?;
        // The backlog row of every slot; padding slots read the first entry of the piece (they
        // are masked out of attention).
        let fallback = pieces
            .iter()
            .find_map(|p| p.first())
            .map(|e| e.1)
            .expect("some row has a piece");
        let tap_rows: Vec<usize> = pieces
            .iter()
            .flat_map(|piece| {
                (0..step.width).map(move |slot| piece.get(slot).map_or(fallback, |e| e.1))
            })
            .collect();
        // Each row's output at the last token of its piece (row b of the result; rows without
        // a piece read any slot and keep their old root below).
        let last: Vec<usize> = chunks
            .iter()
            .enumerate()
            .map(|(b, c)| b * step.width + c.len().max(1) - 1)
            .collect();
        let (hidden, logits) = self
            .target
            .head_extend(draft, dcache, &step, backlog, &tap_rows, &last)?;
        // New roots: each row's output at the last token of its piece, or its old root.
        let picks: Vec<(usize, usize)> = chunks
            .iter()
            .enumerate()
            .map(|(b, c)| if c.is_empty() { (0, b) } else { (1, b) })
            .collect();
        let out = Roots { hidden, logits };
        *roots = self.gather_roots(&[&*roots, &out], &picks)?;
        Ok(())
    }

    /// Generates up to `max_new_tokens` for each prompt: all admitted at once, then rounds until
    /// every sequence has finished (finished ones leave the batch). Greedy output equals
    /// target-only greedy output (up to bf16 near-ties on the fast path); sampled output
    /// follows the target distribution exactly. Sequence `i` samples from its own stream seeded
    /// `config.seed + i`.
    pub fn generate(
        &self,
        prompts: &[Vec<u32>],
        max_new_tokens: usize,
        stop_ids: &[u32],
    ) -> Result<BatchOutput, InferError> {
        self.generate_with(prompts, max_new_tokens, stop_ids, false)
    }

    /// [`Engine::generate`]; with `phase_timing`, every phase of a round (draft, verify,
    /// extend) waits for its device work, so that [`BatchOutput::timings`] splits a round by
    /// device time. The rounds are then slower by those waits: time throughput without it.
    pub fn generate_with(
        &self,
        prompts: &[Vec<u32>],
        max_new_tokens: usize,
        stop_ids: &[u32],
        phase_timing: bool,
    ) -> Result<BatchOutput, InferError> {
        let cfg = self.config;
        cfg.validate()?;
        if prompts.is_empty() {
            return Err(InferError::Request {
                reason: "no prompts to generate from".into(),
            });
        }
        let max_prompt = prompts.iter().map(Vec::len).max().unwrap_or(0);
        let limit = self.target.max_positions();
        if max_prompt + 1 > limit {
            return Err(InferError::Request {
                reason: format!(
                    "a prompt of {max_prompt} tokens does not fit the context of {limit}"
                ),
            });
        }
        // Every round commits at least one token, so this many columns never need compaction.
        // The backend rounds it up, so that one call after another gets caches of one shape
        // (on CUDA: the recycled buffers its graphs were captured over).
        let width = if self.draft.is_some() {
            cfg.num_draft_tokens
        } else {
            1
        };
        let capacity = self
            .target
            .cache_columns(max_prompt + (max_new_tokens + 1) * width + 1);
        let mut batch = self.new_batch(capacity);
        batch.phase_timing = phase_timing;
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

    /// Draft extend over per-sequence chunks: `chunks[b][j]` pairs with the tap row
    /// `b * step_width + slots[b][j]` of the target step that produced `taps`. Returns each
    /// sequence's root (the head's output at its last chunk slot). Public so offline
    /// evaluation (`tandem compare`) drafts from recorded taps through the code serving runs.
    pub fn draft_extend(
        &self,
        draft: &T::Head,
        dcache: &mut T::Cache,
        chunks: &[Vec<u32>],
        taps: &Taps<T::Rows>,
        step_width: usize,
        slots: &[Vec<usize>],
    ) -> Result<Roots<T>, InferError> {
        let refs: Vec<&[u32]> = chunks.iter().map(Vec::as_slice).collect();
        let step = T::layout(dcache).prefill_step(&refs)?;
        // Padding slots read their sequence's first row (they are masked out of attention).
        let mut tap_rows = Vec::with_capacity(step.batch * step.width);
        for (b, s) in slots.iter().enumerate() {
            for i in 0..step.width {
                tap_rows.push(b * step_width + *s.get(i).unwrap_or(&s[0]));
            }
        }
        let last: Vec<usize> = chunks
            .iter()
            .enumerate()
            .map(|(b, c)| b * step.width + c.len() - 1)
            .collect();
        let (hidden, logits) = self
            .target
            .head_extend(draft, dcache, &step, taps, &tap_rows, &last)?;
        Ok(Roots { hidden, logits })
    }

    /// Each sequence's draft tree from its root (`tokens[b]`, the head's state `roots` row
    /// `b`): a chain for topk 1, SGLang's beam tree otherwise. Draft-step keys are written to
    /// `dcache`; the caller rolls them back.
    pub fn draft_trees(
        &self,
        draft: &T::Head,
        shape: Shape,
        tokens: &[u32],
        roots: &Roots<T>,
        dcache: &mut T::Cache,
    ) -> Result<Vec<DraftTree>, InferError> {
        if shape.topk == 1 {
            self.draft_chains(draft, shape, tokens, roots, dcache)
        } else {
            self.draft_beams(draft, shape, tokens, roots, dcache)
        }
    }

    fn draft_chains(
        &self,
        draft: &T::Head,
        shape: Shape,
        root_tokens: &[u32],
        roots: &Roots<T>,
        dcache: &mut T::Cache,
    ) -> Result<Vec<DraftTree>, InferError> {
        let chains = self.target.head_chains(
            draft,
            dcache,
            &roots.hidden,
            &roots.logits,
            root_tokens.len(),
            chain_steps(shape),
        )?;
        let drafts = self.target.chains_to_host(&chains)?;
        Ok(root_tokens
            .iter()
            .zip(drafts)
            .map(|(&r, d)| DraftTree::chain(r, &d))
            .collect())
    }

    /// Tree drafting with topk > 1 ([`SpecBackend::head_beams`]: SGLang's beams, each draft
    /// step running every beam's path in one head step), then each sequence's tree from its
    /// recorded steps ([`build_tree`]).
    fn draft_beams(
        &self,
        draft: &T::Head,
        shape: Shape,
        tokens: &[u32],
        roots: &Roots<T>,
        dcache: &mut T::Cache,
    ) -> Result<Vec<DraftTree>, InferError> {
        let steps = self.target.head_beams(
            draft,
            dcache,
            &roots.hidden,
            &roots.logits,
            tokens.len(),
            (shape.steps, shape.topk),
        )?;
        tokens
            .iter()
            .zip(&steps)
            .map(|(&root, steps)| Ok(build_tree(root, steps, shape.topk, shape.tokens)?))
            .collect()
    }
}

/// Whether a cache's used columns run past its longest sequence by `1 / fraction` of it and
/// at least `floor` columns.
fn waste_past(layout: &ColumnLayout, fraction: usize, floor: usize) -> bool {
    let longest = layout.longest();
    layout.batch() > 0 && layout.used() >= longest + (longest / fraction).max(floor)
}

/// Whether a cache's used columns run well past its longest sequence (by a quarter, and at
/// least 64 columns): the point where compacting costs less than the rounds it speeds up.
fn mostly_waste(layout: &ColumnLayout) -> bool {
    waste_past(layout, 4, 64)
}

/// Whether a cache holds waste worth reclaiming before a run of rounds that adds none (an
/// eighth of its longest sequence, and at least 16 columns).
fn some_waste(layout: &ColumnLayout) -> bool {
    waste_past(layout, 8, 16)
}

/// One more round of shape `label` for `row`'s statistics. Counted without a new key but for a
/// row's first round of a shape: a plain round of 32 rows would otherwise allocate 32 label
/// copies after its wait.
fn count_round(row: &mut Row, label: &str) {
    match row.output.rounds_by_shape.get_mut(label) {
        Some(rounds) => *rounds += 1,
        None => {
            row.output.rounds_by_shape.insert(label.to_owned(), 1);
        }
    }
}

pub(crate) fn commit(row: &mut Row, tokens: &[u32]) {
    commit_tokens(&row.request, &mut row.output, &mut row.done, tokens);
}

/// The first token of each row from target logits `[batch, vocab]`: argmax on the device for
/// greedy rows, the row's own sampling stream otherwise.
pub(crate) fn pick<T: SpecBackend>(
    target: &T,
    logits: &T::Logits,
    rows: &mut [Row],
) -> Result<Vec<u32>, InferError> {
    let argmax = target.argmax(logits)?;
    let host = rows
        .iter()
        .any(|r| !r.request.sampling.is_greedy())
        .then(|| target.logits_to_host(logits))
        .transpose()?;
    let v = target.vocab_size();
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

/// What a round drafted: trees on the host, or greedy chains of `steps` drafts where the
/// backend left them ([`SpecBackend::head_chains`]).
enum Drafted<C> {
    Trees(Vec<DraftTree>),
    Chains(C, usize),
}

/// Drafts a chain of `shape` holds (its tree has one more node, the root).
fn chain_steps(shape: Shape) -> usize {
    shape.steps.min(shape.tokens - 1)
}

fn tree_refs(trees: &[DraftTree]) -> Vec<(&[u32], &[Option<usize>])> {
    trees
        .iter()
        .map(|t| (t.tokens.as_slice(), t.parents.as_slice()))
        .collect()
}

/// The verification logits `[batch * width, vocab]` as the host reads them: their argmax for
/// greedy rows, the logits themselves for sampled rows. Reading them is the round's wait for
/// the device.
struct VerifyReads {
    argmax: Option<Vec<u32>>,
    host: Option<Vec<f32>>,
}

impl VerifyReads {
    fn of<T: SpecBackend>(
        target: &T,
        logits: &T::Logits,
        rows: &[Row],
    ) -> Result<Self, InferError> {
        let greedy = |r: &Row| r.request.sampling.is_greedy();
        Ok(Self {
            argmax: rows
                .iter()
                .any(greedy)
                .then(|| target.argmax(logits))
                .transpose()?,
            host: (!rows.iter().all(greedy))
                .then(|| target.logits_to_host(logits))
                .transpose()?,
        })
    }

    /// Acceptance of each row's tree.
    fn accept<T: SpecBackend>(
        &self,
        target: &T,
        trees: &[DraftTree],
        width: usize,
        rows: &mut [Row],
    ) -> Vec<Acceptance> {
        let vocab = target.vocab_size();
        trees
            .iter()
            .zip(rows.iter_mut())
            .enumerate()
            .map(|(b, (tree, row))| match (&self.argmax, &self.host) {
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
                _ => unreachable!("argmax is read for greedy rows, host logits for the rest"),
            })
            .collect()
    }
}

impl<T: SpecBackend> SpecGenerate for Engine<'_, T> {
    fn generate(
        &self,
        prompts: &[Vec<u32>],
        max_new_tokens: usize,
        stop_ids: &[u32],
    ) -> Result<BatchOutput, InferError> {
        Engine::generate(self, prompts, max_new_tokens, stop_ids)
    }
    fn config(&self) -> SpecConfig {
        self.config
    }
}

#[cfg(test)]
mod tests {
    use super::{CATCH_UP_TAIL, catch_up_tail_from};

    #[test]
    fn the_catch_up_tail_switch_reads_all_counts_and_falls_back_to_the_default() {
        assert_eq!(catch_up_tail_from(None), Some(CATCH_UP_TAIL));
        assert_eq!(catch_up_tail_from(Some("all")), None);
        assert_eq!(catch_up_tail_from(Some(" 64 ")), Some(64));
        assert_eq!(catch_up_tail_from(Some("0")), Some(CATCH_UP_TAIL));
        assert_eq!(catch_up_tail_from(Some("many")), Some(CATCH_UP_TAIL));
    }
}
