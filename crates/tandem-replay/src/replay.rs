//! The replay job: every dumped sample's `input_ids` through the serving engine's target path
//! (one prefill through `TargetModel::forward` with every tap point requested), each dumped slot
//! compared with every candidate, and a verdict per slot.

use std::path::Path;

use tandem_dump::DumpReader;
use tandem_eagle::Eagle3Config;
use tandem_infer::wiring::{TapSource, read_head_taps};
use tandem_model::TargetTokenizer;
use tandem_wiring::{
    Job, MismatchKind, Producer, TapId, TapPoint, TargetFingerprint, WiringManifest, check,
    format_taps, normalize_dtype,
};

use tandem_model::CaptureTarget;

use crate::candidate::{
    Candidate, all_candidates, capture_candidates, capture_partial_sums, partial_sum_candidates,
    partial_sum_degrees,
};
use crate::error::ReplayError;
use crate::explain::{constant_shift, convention_swaps, describe_pattern};
use crate::report::{
    Finding, LastHiddenReport, Level, ReplayReport, Score, Shard, SlotReport, Status,
};
use crate::score::{Accumulator, SlotStats, Tolerance};

/// Per-token norms whose coefficient of variation is below this look like an RMSNorm output.
const FLAT_NORM_CV: f64 = 0.02;

/// What serving feeds a head: its taps in slot order and where they come from.
#[derive(Debug, Clone, PartialEq)]
pub struct HeadWiring {
    /// The head directory (or another label).
    pub source: String,
    /// The taps serving requests for the head, slot order (`tandem_infer::wiring::head_taps`,
    /// the function `tandem bench` uses).
    pub taps: Vec<TapId>,
    /// Where the taps come from, as a phrase.
    pub basis: String,
    /// The head's Tandem wiring manifest, when its config carries one.
    pub manifest: Option<WiringManifest>,
}

impl HeadWiring {
    /// The serving wiring of a head config, for a target of `architecture` with `num_layers`
    /// blocks (the reading `tandem bench` and `serve` use: `read_head_taps`).
    pub fn from_config(
        config: &Eagle3Config,
        architecture: &str,
        num_layers: usize,
        source: impl Into<String>,
    ) -> Result<Self, ReplayError> {
        let reading = read_head_taps(config, architecture, num_layers, None)?;
        let basis = match &reading.source {
            TapSource::Manifest => "the head's Tandem wiring manifest".to_owned(),
            TapSource::Ids {
                location,
                ids,
                convention,
                ..
            } => format!("{location} {ids:?} read as {convention}"),
            TapSource::Default => "the EAGLE-3 default taps (the head names none)".to_owned(),
        };
        Ok(HeadWiring {
            source: source.into(),
            taps: reading.taps,
            basis,
            manifest: config.tandem_wiring.clone(),
        })
    }

    /// Reads `dir/config.json` of a head.
    pub fn load(dir: &Path, architecture: &str, num_layers: usize) -> Result<Self, ReplayError> {
        let config = Eagle3Config::load(&dir.join("config.json"))?;
        Self::from_config(&config, architecture, num_layers, dir.display().to_string())
    }
}

/// The serving target's fingerprint, taken as `tandem dump` and `tandem bench` take it
/// (config.json, tokenizer.json, the tokenizer's chat template).
pub fn fingerprint_model(model_dir: &Path) -> Result<TargetFingerprint, ReplayError> {
    let tokenizer = TargetTokenizer::load(model_dir)?;
    Ok(TargetFingerprint::from_files(
        &model_dir.join("config.json"),
        &model_dir.join("tokenizer.json"),
        tokenizer.chat_template.as_deref(),
    )?)
}

/// How a replay runs.
#[derive(Debug, Clone)]
pub struct ReplayOptions {
    /// Replay at most this many samples (all when `None`).
    pub max_samples: Option<usize>,
    /// What counts as a match.
    pub tolerance: Tolerance,
    /// Element type serving computes in (`f32` on CPU, `bf16` on CUDA).
    pub serving_dtype: String,
    /// Device label for the report.
    pub device: String,
    /// The model directory, for the report.
    pub model_label: String,
}

impl Default for ReplayOptions {
    fn default() -> Self {
        ReplayOptions {
            max_samples: None,
            tolerance: Tolerance::default(),
            serving_dtype: "f32".to_owned(),
            device: "cpu".to_owned(),
            model_label: String::new(),
        }
    }
}

/// Accumulators of one slot (or `last_hidden`): `[candidate][shard]`, aligned and one token
/// late.
struct SlotAccumulators {
    aligned: Vec<Vec<Accumulator>>,
    late: Vec<Vec<Accumulator>>,
    stats: SlotStats,
}

impl SlotAccumulators {
    fn new(candidates: usize, shards: usize) -> Self {
        SlotAccumulators {
            aligned: vec![vec![Accumulator::default(); shards]; candidates],
            late: vec![vec![Accumulator::default(); shards]; candidates],
            stats: SlotStats::default(),
        }
    }

    /// Adds one sample: `obs(t)` is the slot's row at token t, `values[c]` is `[n, T]`.
    fn add<'a>(
        &mut self,
        n: usize,
        width: usize,
        hidden: usize,
        obs: impl Fn(usize) -> &'a [f32],
        values: &[Vec<f32>],
    ) {
        self.stats.add_sample((0..n).map(&obs));
        for (c, vals) in values.iter().enumerate() {
            for (sh, acc) in self.aligned[c].iter_mut().enumerate() {
                let reference = |t: usize| &vals[t * hidden + sh * width..][..width];
                for t in 0..n {
                    acc.add_row(obs(t), reference(t));
                }
                let late = &mut self.late[c][sh];
                for t in 1..n {
                    late.add_row(obs(t), reference(t - 1));
                }
            }
        }
    }
}

fn score(candidate: Candidate, shard: Option<Shard>, acc: &Accumulator) -> Score {
    Score {
        candidate,
        shard,
        cosine: acc.cosine(),
        rel_err: acc.rel_err(),
        min_token_cosine: acc.min_token_cosine(),
    }
}

/// Higher cosine first, then lower relative error; earlier candidates win exact ties.
fn better(a: &Score, b: &Score) -> bool {
    a.cosine > b.cosine || (a.cosine == b.cosine && a.rel_err < b.rel_err)
}

/// The best score over the shards of one candidate.
fn best_shard(candidate: Candidate, accs: &[Accumulator]) -> Score {
    let of = accs.len();
    let mut best: Option<Score> = None;
    for (index, acc) in accs.iter().enumerate() {
        let shard = (of > 1).then_some(Shard { index, of });
        let s = score(candidate, shard, acc);
        if best.as_ref().is_none_or(|b| better(&s, b)) {
            best = Some(s);
        }
    }
    best.expect("at least one shard")
}

fn best_of(candidates: &[Candidate], table: &[Vec<Accumulator>]) -> Score {
    let mut best: Option<Score> = None;
    for (c, accs) in candidates.iter().zip(table) {
        let s = best_shard(*c, accs);
        if best.as_ref().is_none_or(|b| better(&s, b)) {
            best = Some(s);
        }
    }
    best.expect("at least one candidate")
}

/// Re-runs the dumped samples through `model` and reports, slot by slot, what the dump holds,
/// what its manifest promises and what serving would feed the head.
///
/// `target` is the serving target's fingerprint ([`fingerprint_model`]); `head`, when given,
/// decides the serving taps, otherwise serving is assumed to request the dump's own taps.
/// Wiring faults are findings of the report, never errors; errors are I/O or shape problems
/// that stop the replay.
pub fn replay(
    model: &dyn CaptureTarget,
    target: &TargetFingerprint,
    dump: &DumpReader,
    head: Option<&HeadWiring>,
    options: &ReplayOptions,
) -> Result<ReplayReport, ReplayError> {
    let m = dump.manifest();
    let layers = model.spec().num_layers;
    let hidden = model.spec().hidden_size;
    let vocab = model.spec().vocab_size;
    let slots = m.num_slots;
    let width = m.hidden_size;
    let tolerance = options.tolerance;
    let declared = m.wiring.taps.clone();
    let (serving_taps, serving_basis) = match head {
        Some(h) => (h.taps.clone(), format!("{} ({})", h.basis, h.source)),
        None => (
            declared.clone(),
            "the dump's own taps (no --head given: serving is assumed to request them)".to_owned(),
        ),
    };

    // How many column shards of a tap one slot is: 1 when whole, T/w for a TP shard, 0 when the
    // widths cannot be related (nothing is compared then).
    let shards = if width == hidden {
        1
    } else if width > 0 && width < hidden && hidden.is_multiple_of(width) {
        hidden / width
    } else {
        0
    };
    // Besides every tap point, the tensor-parallel partial sums of the blocks the manifest
    // declares (a capture before the MLP's all-reduce), where the model computes them.
    let declared_blocks: Vec<usize> = declared
        .iter()
        .filter_map(|t| match t {
            TapId::Block(k) => Some(*k),
            _ => None,
        })
        .collect();
    let partials = if model.computes_partial_sums() {
        partial_sum_candidates(
            &declared_blocks,
            &partial_sum_degrees(model.spec().intermediate_size),
        )
    } else {
        Vec::new()
    };
    let mut candidates = all_candidates(layers);
    candidates.extend(partials.iter().copied());
    let mut accs: Vec<SlotAccumulators> = (0..slots)
        .map(|_| SlotAccumulators::new(candidates.len(), shards.max(1)))
        .collect();
    let mut last = SlotAccumulators::new(candidates.len(), 1);
    let mut findings = Vec::new();

    let count = dump.len().min(options.max_samples.unwrap_or(usize::MAX));
    if count == 0 {
        return Err(ReplayError::EmptyDump {
            dir: dump.dir().to_owned(),
        });
    }
    let (mut samples, mut tokens) = (0usize, 0usize);
    for index in 0..count {
        let record = dump.read(index)?;
        let n = record.len();
        let row = slots * width;
        if record.aux_hidden.len() != n * row {
            return Err(ReplayError::BadSample {
                index,
                sample_id: record.sample_id,
                reason: format!(
                    "{n} tokens but {} aux values (expected {n} x {row})",
                    record.aux_hidden.len()
                ),
            });
        }
        if let Some(&id) = record.input_ids.iter().find(|&&id| id as usize >= vocab) {
            // Replaying ids the target cannot embed is impossible; the fingerprint findings say
            // why (another tokenizer / target), so stop here with what was compared so far.
            findings.push(Finding::new(
                Level::Error,
                "tokens",
                format!(
                    "sample {index} ({:?}) holds token id {id} but the model's vocabulary has \
                     {vocab} entries: the dump was tokenised for another target; replay \
                     stopped after {samples} sample(s)",
                    record.sample_id
                ),
            ));
            break;
        }
        if n == 0 {
            continue;
        }
        let mut values = capture_candidates(model, &record.input_ids)?;
        if !partials.is_empty() {
            let parts = capture_partial_sums(model, &values, &partials)?
                .expect("the model computes partial sums (checked above)");
            values.values.extend(parts);
        }
        if shards > 0 {
            for (slot, acc) in accs.iter_mut().enumerate() {
                let aux = &record.aux_hidden;
                acc.add(
                    n,
                    width,
                    hidden,
                    |t| &aux[t * row + slot * width..][..width],
                    &values.values,
                );
            }
        }
        if width == hidden && record.last_hidden.len() == n * hidden {
            let lh = &record.last_hidden;
            last.add(
                n,
                hidden,
                hidden,
                |t| &lh[t * hidden..][..hidden],
                &values.values,
            );
        }
        samples += 1;
        tokens += n;
    }

    // Best candidate per slot, and what each slot is observed to hold.
    let bests: Vec<Option<Score>> = accs
        .iter()
        .map(|a| (shards > 0 && a.stats.tokens() > 0).then(|| best_of(&candidates, &a.aligned)))
        .collect();
    let observed: Vec<Option<Candidate>> = bests
        .iter()
        .map(|b| {
            b.filter(|s| tolerance.accepts(s.cosine, s.rel_err))
                .map(|s| s.candidate)
        })
        .collect();
    let observed_taps: Option<Vec<TapId>> =
        observed.iter().map(|o| o.and_then(|c| c.tap())).collect();
    let swaps = observed_taps
        .as_ref()
        .map(|o| convention_swaps(&declared, o, layers, m.wiring.raw_ids.as_ref()))
        .unwrap_or_default();

    // Whole-dump findings.
    width_finding(slots, width, hidden, shards, &mut findings);
    if let Some(o) = &observed_taps {
        for sentence in describe_pattern(&declared, o, layers, m.wiring.raw_ids.as_ref()) {
            findings.push(Finding::new(
                Level::Error,
                "pattern",
                format!("dump data vs its manifest: {sentence}"),
            ));
        }
    }
    let serving_manifest = WiringManifest::new(
        target.clone(),
        serving_taps.clone(),
        TapPoint::ResidualStream,
        options.serving_dtype.clone(),
        Producer::tandem(Job::Replay, options.device.clone(), "prefill"),
    );
    for mismatch in check(&m.wiring, &serving_manifest) {
        if matches!(
            mismatch.kind,
            MismatchKind::SlotTap | MismatchKind::SlotCount
        ) {
            continue; // the slot verdicts say this, with the data's evidence
        }
        if mismatch.kind == MismatchKind::Dtype {
            continue; // reported below with the tolerance it implies
        }
        let level = if mismatch.is_fatal() {
            Level::Error
        } else {
            Level::Warning
        };
        findings.push(Finding::new(
            level,
            "fingerprint",
            format!("dump vs --model: {mismatch}"),
        ));
    }
    dtype_finding(
        &m.wiring.dtype,
        &options.serving_dtype,
        &tolerance,
        &mut findings,
    );
    if let Some(h) = head {
        head_findings(h, &declared, &serving_manifest, &mut findings);
    }

    // Slot verdicts.
    let final_weight_norm = {
        model
            .final_norm()?
            .iter()
            .map(|&v| f64::from(v) * f64::from(v))
            .sum::<f64>()
            .sqrt()
    };
    let ctx = VerdictContext {
        hidden,
        tolerance,
        swaps_short: swaps.first().map(|s| s.short()),
        head_basis: head.map(|_| serving_basis.clone()),
        final_weight_norm,
    };
    let mut reports = Vec::with_capacity(slots);
    let mut cosine = Vec::with_capacity(slots);
    for (slot, acc) in accs.iter().enumerate() {
        let manifest_tap = declared[slot];
        let serving_tap = serving_taps.get(slot).copied();
        let manifest_score = candidates
            .iter()
            .position(|c| *c == Candidate::Tap(manifest_tap))
            .filter(|_| shards > 0 && acc.stats.tokens() > 0)
            .map(|c| best_shard(candidates[c], &acc.aligned[c]));
        let late_best = (shards > 0 && acc.stats.rows_after_first() > 0)
            .then(|| best_of(&candidates, &acc.late))
            .filter(|s| tolerance.accepts(s.cosine, s.rel_err));
        let (status, verdict, normed) = ctx.verdict(&SlotFacts {
            slot,
            width,
            manifest_tap,
            serving_tap,
            serving_len: serving_taps.len(),
            best: bests[slot],
            observed: observed[slot],
            late: late_best,
            stats: &acc.stats,
        });
        cosine.push(
            candidates
                .iter()
                .enumerate()
                .map(|(c, cand)| {
                    if shards > 0 && acc.stats.tokens() > 0 {
                        best_shard(*cand, &acc.aligned[c]).cosine
                    } else {
                        0.0
                    }
                })
                .collect(),
        );
        reports.push(SlotReport {
            slot,
            width,
            manifest_tap,
            serving_tap,
            best: bests[slot],
            manifest_score,
            observed: observed[slot],
            normed,
            mean_norm: acc.stats.mean_norm(),
            norm_cv: acc.stats.norm_cv(),
            zero_tokens: acc.stats.zero_rows(),
            tokens: acc.stats.tokens(),
            status,
            verdict,
        });
    }

    let last_hidden = (last.stats.tokens() > 0).then(|| {
        let best = best_of(&candidates, &last.aligned);
        let problem = last_hidden_problem(m.last_hidden_tap, &best, &tolerance);
        let ok = problem.is_none();
        if let Some(problem) = problem {
            findings.push(Finding::new(Level::Error, "last-hidden", problem));
        }
        LastHiddenReport {
            manifest_tap: m.last_hidden_tap,
            best,
            status: if ok { Status::Match } else { Status::Mismatch },
        }
    });

    findings.sort_by_key(|f| std::cmp::Reverse(f.level));
    Ok(ReplayReport {
        dump: dump.dir().display().to_string(),
        model: options.model_label.clone(),
        head: head.map(|h| h.source.clone()),
        device: options.device.clone(),
        samples,
        tokens,
        num_layers: layers,
        hidden_size: hidden,
        tolerance,
        manifest_taps: declared,
        raw_ids: m.wiring.raw_ids.as_ref().map(ToString::to_string),
        observed,
        serving_taps,
        serving_basis,
        findings,
        slots: reports,
        last_hidden,
        candidates,
        cosine,
    })
}

/// What is wrong with the dump's `last_hidden` column, if anything: another tap than the
/// manifest's, or the right tap computed differently from the serving path replayed.
fn last_hidden_problem(expected: TapId, best: &Score, tolerance: &Tolerance) -> Option<String> {
    if tolerance.accepts(best.cosine, best.rel_err) && best.candidate == Candidate::Tap(expected) {
        return None;
    }
    Some(if best.candidate == Candidate::Tap(expected) {
        format!(
            "last_hidden holds {expected} as the manifest says, but not the values the serving \
             path computes: {} is outside the tolerance (cosine >= {}, rel err <= {:.0e}); the \
             dump was made by another code path or precision than the one replayed, so the \
             target logits a trainer recomputes from it differ from serving's (dump with the \
             serving path, e.g. --engine of the serving device)",
            best.short(),
            tolerance.min_cosine,
            tolerance.max_rel_err
        )
    } else {
        format!(
            "last_hidden should hold {expected} (target logits are recomputed from it with the \
             final norm and lm_head) but its best match is {}",
            best.short()
        )
    })
}

fn width_finding(slots: usize, width: usize, hidden: usize, shards: usize, out: &mut Vec<Finding>) {
    let aux = slots * width;
    if width == hidden {
        out.push(Finding::new(
            Level::Info,
            "width",
            format!("aux width {aux} = {slots} slots x T = {hidden}"),
        ));
    } else if shards > 1 {
        out.push(Finding::new(
            Level::Error,
            "width",
            format!(
                "aux width {aux} = {slots} x {width}, but {slots} slots x T = {}: each slot is \
                 T/{shards} wide, a tensor-parallel shard of the tap (gather it across the \
                 {shards} ranks before dumping)",
                slots * hidden
            ),
        ));
    } else {
        out.push(Finding::new(
            Level::Error,
            "width",
            format!(
                "aux width {aux} = {slots} x {width}, but {slots} slots x T = {}: a slot of \
                 width {width} is not a tap of this target (hidden size {hidden})",
                slots * hidden
            ),
        ));
    }
}

fn dtype_finding(dump: &str, serving: &str, tol: &Tolerance, out: &mut Vec<Finding>) {
    let (d, s) = (normalize_dtype(dump), normalize_dtype(serving));
    let relation = if d == s {
        "the same precision"
    } else {
        "another precision"
    };
    out.push(Finding::new(
        if d == s { Level::Info } else { Level::Warning },
        "dtype",
        format!(
            "dtype: the dump stores {d}, serving computes in {s} ({relation}); a slot matches \
             when cosine >= {} and relative error <= {:.0e} over all tokens",
            tol.min_cosine, tol.max_rel_err
        ),
    ));
}

fn head_findings(
    head: &HeadWiring,
    declared: &[TapId],
    serving: &WiringManifest,
    out: &mut Vec<Finding>,
) {
    if head.taps.len() != declared.len() {
        out.push(Finding::new(
            Level::Error,
            "head",
            format!(
                "serving would feed the head {} taps {} ({}), but the dump has {} slots {}",
                head.taps.len(),
                format_taps(&head.taps),
                head.basis,
                declared.len(),
                format_taps(declared)
            ),
        ));
    } else if head.taps != declared {
        let shift = constant_shift(declared, &head.taps)
            .map(|d| format!(": every slot off by {d:+}"))
            .unwrap_or_default();
        out.push(Finding::new(
            Level::Error,
            "head",
            format!(
                "serving would feed the head {} ({}), but the dump's manifest says {}{shift}",
                format_taps(&head.taps),
                head.basis,
                format_taps(declared)
            ),
        ));
    }
    if let Some(trained) = &head.manifest {
        for mismatch in check(trained, serving) {
            if matches!(
                mismatch.kind,
                MismatchKind::SlotTap | MismatchKind::SlotCount | MismatchKind::Dtype
            ) {
                continue;
            }
            out.push(Finding::new(
                if mismatch.is_fatal() {
                    Level::Error
                } else {
                    Level::Warning
                },
                "head",
                format!("head manifest vs --model: {mismatch}"),
            ));
        }
    }
}

struct VerdictContext {
    hidden: usize,
    tolerance: Tolerance,
    swaps_short: Option<String>,
    head_basis: Option<String>,
    final_weight_norm: f64,
}

struct SlotFacts<'a> {
    slot: usize,
    width: usize,
    manifest_tap: TapId,
    serving_tap: Option<TapId>,
    serving_len: usize,
    best: Option<Score>,
    observed: Option<Candidate>,
    late: Option<Score>,
    stats: &'a SlotStats,
}

impl VerdictContext {
    /// The verdict of one slot: status, sentence, and whether the slot holds a normed value.
    fn verdict(&self, f: &SlotFacts<'_>) -> (Status, String, bool) {
        let i = f.slot;
        let mismatch = |s: String| (Status::Mismatch, s, false);
        let n = f.stats.tokens();
        let Some(best) = f.best else {
            return mismatch(format!(
                "dump slot {i} is {} wide but the target's hidden size is {}: it is not a tap of \
                 this target",
                f.width, self.hidden
            ));
        };
        if n > 0 && f.stats.zero_rows() == n {
            return mismatch(format!(
                "dump slot {i} is all zeros over {n} tokens, where the manifest says {}: the \
                 execution path skipped the tap (nothing was captured, as SGLang's \
                 two-batch-overlap path captured 0 of 3 layers)",
                f.manifest_tap
            ));
        }
        if let Some(observed) = f.observed {
            if let Some(shard) = best.shard {
                let (a, b) = (shard.index * f.width, (shard.index + 1) * f.width);
                let also = if observed == Candidate::Tap(f.manifest_tap) {
                    String::new()
                } else {
                    format!(" (and the manifest says {})", f.manifest_tap)
                };
                return mismatch(format!(
                    "dump slot {i} is {} wide but the target's hidden size is {}: it holds \
                     columns {a}..{b} of {observed}{also}, shard {} of {} of a tensor-parallel \
                     split (width T/{}); the tap must be gathered across ranks",
                    f.width, self.hidden, shard.index, shard.of, shard.of
                ));
            }
            if let Candidate::PartialSum { rank, tp, .. } = observed {
                return mismatch(format!(
                    "dump slot {i} holds {} where the manifest says {}: the capture was taken \
                     before the all-reduce of a {tp}-way tensor-parallel MLP (one rank's \
                     partial sum, rank {rank}); take the tap after the all-reduce, once, on \
                     rank 0",
                    observed.describe(),
                    f.manifest_tap
                ));
            }
            if observed.is_normed() {
                return (
                    Status::Mismatch,
                    format!(
                        "dump slot {i} holds {} but the manifest says {}: the tap is post-norm \
                         (a normed value instead of the residual stream)",
                        observed.describe(),
                        f.manifest_tap
                    ),
                    true,
                );
            }
            let tap = observed.tap().expect("not normed, so a tap");
            if tap == f.manifest_tap {
                return match f.serving_tap {
                    Some(s) if s == tap => (Status::Match, "match".to_owned(), false),
                    Some(s) => mismatch(format!(
                        "dump slot {i} holds {tap} as its manifest says, but serving would feed \
                         the head {s} in this slot ({}): the head sees other features than it \
                         was trained on",
                        self.head_basis.as_deref().unwrap_or("serving taps")
                    )),
                    None => mismatch(format!(
                        "dump slot {i} holds {tap} as its manifest says, but serving feeds the \
                         head only {} slot(s)",
                        f.serving_len
                    )),
                };
            }
            let mut why = Vec::new();
            match (tap.residual_position(), f.manifest_tap.residual_position()) {
                _ if tap == TapId::Embed => why.push(
                    "an embedding tap where the manifest names none here (missing/extra embed)"
                        .to_owned(),
                ),
                (Some(o), Some(d)) => {
                    let delta = o as i64 - d as i64;
                    let unit = if delta.abs() == 1 { "block" } else { "blocks" };
                    why.push(format!("off by {delta:+} {unit}"));
                }
                _ => {}
            }
            if let Some(s) = &self.swaps_short {
                why.push(format!("({s})"));
            }
            let serving = match f.serving_tap {
                Some(s) if s != tap && self.head_basis.is_some() => {
                    format!("; serving would feed the head {s} here")
                }
                _ => String::new(),
            };
            let why = if why.is_empty() {
                String::new()
            } else {
                format!(": {}", why.join(" "))
            };
            return mismatch(format!(
                "dump slot {i} holds {tap} but the manifest says {}{why}{serving}",
                f.manifest_tap
            ));
        }
        // Nothing matches at the same token.
        let zeros = f.stats.zero_rows();
        if zeros > 0 {
            let (a, b) = f.stats.zero_span().expect("zero rows have a span");
            return mismatch(format!(
                "dump slot {i} is zero for {zeros} of {n} tokens (replayed tokens {a}..={b}) and \
                 matches nothing as a whole (best {}): the tap was captured for only part of \
                 the tokens (micro-batches not merged by token range)",
                best.short()
            ));
        }
        if let Some(late) = f.late {
            return mismatch(format!(
                "dump slot {i} holds {} one token late (token t carries token t-1's value), \
                 where the manifest says {}: a stale capture from the previous step",
                late.candidate, f.manifest_tap
            ));
        }
        if f.stats.rows_after_first() > 0 && f.stats.repeated_rows() == f.stats.rows_after_first() {
            return mismatch(format!(
                "dump slot {i} holds the same values at every token of a sample, where the \
                 manifest says {}: a stale capture reused for the whole sequence",
                f.manifest_tap
            ));
        }
        if f.stats.norm_cv() < FLAT_NORM_CV {
            return (
                Status::Mismatch,
                format!(
                    "dump slot {i} matches no tap point (best {}) but its per-token norms are \
                     flat (mean {:.2}, cv {:.4}; the final RMSNorm's output would have norm \
                     ~sqrt(T) x rms(w) = {:.2}): a normed value where the manifest says {}",
                    best.short(),
                    f.stats.mean_norm(),
                    f.stats.norm_cv(),
                    self.final_weight_norm,
                    f.manifest_tap
                ),
                true,
            );
        }
        mismatch(format!(
            "dump slot {i} matches no tap point of the serving path (best {}, tolerance cosine \
             >= {} and rel err <= {:.0e}), where the manifest says {}: stale or foreign values",
            best.short(),
            self.tolerance.min_cosine,
            self.tolerance.max_rel_err,
            f.manifest_tap
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn last_hidden_names_a_wrong_tap_apart_from_a_numeric_difference() {
        let tolerance = Tolerance::default();
        let score = |candidate, cosine, rel_err| Score {
            candidate,
            shard: None,
            cosine,
            rel_err,
            min_token_cosine: cosine,
        };
        let last = TapId::Block(29);
        assert_eq!(
            last_hidden_problem(
                last,
                &score(Candidate::Tap(last), 0.99999, 5e-3),
                &tolerance
            ),
            None
        );
        let numeric = last_hidden_problem(
            last,
            &score(Candidate::Tap(last), 0.99927, 9e-2),
            &tolerance,
        )
        .unwrap();
        assert!(
            numeric.contains("holds block 29 as the manifest says")
                && numeric.contains("another code path or precision"),
            "{numeric}"
        );
        let wrong = last_hidden_problem(
            last,
            &score(Candidate::Tap(TapId::Block(28)), 1.0, 0.0),
            &tolerance,
        )
        .unwrap();
        assert!(
            wrong.contains("should hold block 29") && wrong.contains("block 28"),
            "{wrong}"
        );
    }
}
