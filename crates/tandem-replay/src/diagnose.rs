//! `tandem diagnose`: which wiring was a head trained with? The head is teacher-forced on text
//! the target generated itself, once per candidate wiring, and the wiring under which it
//! accepts the most is the one it was trained with. Every other candidate's loss (accept
//! length, acceptance per draft position) is what serving the head that way would cost.
//!
//! The sweep ([`sweep`]) starts from what the head declares ([`declared_readings`]): the taps
//! Tandem / SGLang serve it on (its Tandem manifest, else its `eagle_aux_hidden_state_layer_ids`
//! as SGLang reads them, else the EAGLE-3 default taps), the same ids read in every other
//! convention of `eagle3-facts.md` section 1, and every engine's default ids read by every other
//! engine. Around each of those base wirings it adds: every slot shifted by one block (together
//! and one slot at a time), an `embed` tap in front (and, for wirings that have one, the
//! wiring without it), every slot permutation (all of them up to 3 slots, adjacent swaps
//! above), and normed values instead of the residual stream (`final` in the last slot; every
//! slot through the input norm of the layer it feeds). Candidates are deduplicated, so the
//! sweep stays at a few dozen wirings.
//!
//! Scoring is compare's offline machinery ([`OfflineAcceptance`]): per sample, one prefill of
//! the target through its capture hook with every tap point requested (the hook returns the
//! same tensor for a tap whatever else is requested, so each candidate's `TapRequest` is a
//! selection of these columns; the fault suite checks that), the target's argmax at every
//! position, then per candidate the head's TTT unroll on that candidate's aux states and the
//! chain acceptance per draft position over the generated tokens.
//!
//! The pure parts (the sweep, [`difference`], [`rank`], [`DiagnoseReport::new`]) are unit
//! tested here; [`diagnose`] runs the models.

use std::fmt::Write as _;

use burn::prelude::*;
use serde::Serialize;
use tandem_eagle::{Eagle3Config, Eagle3Draft};
use tandem_model::{GenerateOptions, SamplingParams, TargetModel, generate};
use tandem_wiring::{Convention, RawIds, TapId, default_aux_taps, format_taps};

use crate::candidate::{Candidate, CandidateValues, capture_candidates};
use crate::compare::{OfflineAcceptance, ints, teacher_forced_proposals};
use crate::error::ReplayError;
use crate::explain::{constant_shift, convention_swaps};
use crate::render::{escape, html_page};
use crate::replay::HeadWiring;

/// What each `fc` input slot is fed, in slot order.
pub type Wiring = Vec<Candidate>;

/// `[block 1, block 14, final]`.
pub fn format_wiring(wiring: &[Candidate]) -> String {
    let items: Vec<String> = wiring.iter().map(ToString::to_string).collect();
    format!("[{}]", items.join(", "))
}

fn taps_of(wiring: &[Candidate]) -> Option<Vec<TapId>> {
    wiring.iter().map(Candidate::tap).collect()
}

fn as_wiring(taps: &[TapId]) -> Wiring {
    taps.iter().copied().map(Candidate::Tap).collect()
}

fn names(conventions: &[Convention]) -> String {
    conventions
        .iter()
        .map(|c| c.name())
        .collect::<Vec<_>>()
        .join("/")
}

/// One way of reading what the head declares about its taps.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DeclaredReading {
    /// Where it comes from, as a phrase.
    pub source: String,
    /// The conventions that read the ids this way (empty for the serving reading).
    pub conventions: Vec<Convention>,
    /// The raw ids read, when the reading is of ids.
    pub ids: Option<Vec<i64>>,
    /// The taps, slot order.
    pub taps: Vec<TapId>,
    /// Whether this is what Tandem (and SGLang) serve the head on
    /// (`tandem_infer::wiring::head_taps`).
    pub serving: bool,
}

/// Every reading of the head's declaration: first the serving one (its Tandem manifest, else its
/// ids as SGLang reads them, else the default taps), then its `eagle_aux_hidden_state_layer_ids`
/// (and the manifest's recorded raw ids, when they differ) read in every convention, grouped by
/// the taps they name.
pub fn declared_readings(
    config: &Eagle3Config,
    architecture: &str,
    num_layers: usize,
) -> Result<Vec<DeclaredReading>, ReplayError> {
    let serving = HeadWiring::from_config(config, architecture, num_layers, "head")?;
    let mut out = vec![DeclaredReading {
        source: format!("served by Tandem / SGLang: {}", serving.basis),
        conventions: Vec::new(),
        ids: None,
        taps: serving.taps,
        serving: true,
    }];
    let config_ids = config
        .eagle_config
        .as_ref()
        .and_then(|e| e.eagle_aux_hidden_state_layer_ids.clone());
    let mut lists: Vec<(String, Vec<i64>)> = Vec::new();
    if let Some(ids) = &config_ids {
        lists.push(("eagle_aux_hidden_state_layer_ids".to_owned(), ids.clone()));
    }
    if let Some(raw) = config
        .tandem_wiring
        .as_ref()
        .and_then(|m| m.raw_ids.as_ref())
        && config_ids.as_ref() != Some(&raw.ids)
    {
        lists.push((format!("the manifest's raw ids ({raw})"), raw.ids.clone()));
    }
    for (what, ids) in lists {
        let mut groups: Vec<(Vec<TapId>, Vec<Convention>)> = Vec::new();
        for c in Convention::ALL {
            let Ok(taps) = c.to_canonical(&ids, num_layers) else {
                continue;
            };
            match groups.iter_mut().find(|(t, _)| *t == taps) {
                Some((_, cs)) => cs.push(c),
                None => groups.push((taps, vec![c])),
            }
        }
        for (taps, conventions) in groups {
            out.push(DeclaredReading {
                source: format!("{what} {ids:?} read as {} ids", names(&conventions)),
                conventions,
                ids: Some(ids.clone()),
                taps,
                serving: false,
            });
        }
    }
    Ok(out)
}

/// One wiring of the sweep and every reason it is in it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SweepEntry {
    /// The wiring.
    pub wiring: Wiring,
    /// Why it is swept: `served by Tandem / SGLang: ...`, `slot 1 +1 of [block 1, ...]`, ...
    pub origins: Vec<String>,
}

fn push(out: &mut Vec<SweepEntry>, wiring: Wiring, origin: String, num_layers: usize) {
    let valid = wiring.iter().all(|c| match c {
        Candidate::Tap(TapId::Block(k)) | Candidate::NormedInput(k) => *k < num_layers,
        Candidate::Tap(_) => true,
        // Diagnose sweeps wirings of the serving path's own values.
        Candidate::PartialSum { .. } => false,
    });
    if !valid || wiring.is_empty() {
        return;
    }
    match out.iter_mut().find(|e| e.wiring == wiring) {
        Some(e) => {
            if !e.origins.contains(&origin) {
                e.origins.push(origin);
            }
        }
        None => out.push(SweepEntry {
            wiring,
            origins: vec![origin],
        }),
    }
}

/// `c` moved `delta` points along the residual stream (normed inputs move with the layer).
fn shifted(c: Candidate, delta: i64) -> Option<Candidate> {
    match c {
        Candidate::Tap(t) => {
            let p = t.residual_position()? as i64 + delta;
            (p >= 0).then(|| Candidate::Tap(TapId::from_residual_position(p as usize)))
        }
        Candidate::NormedInput(k) => {
            let k = k as i64 + delta;
            (k >= 0).then_some(Candidate::NormedInput(k as usize))
        }
        Candidate::PartialSum { .. } => None,
    }
}

/// The normed value an engine that reads the wrong tensor would record instead of `c`: the
/// input norm of the layer the residual feeds, or `final` after the last block.
fn normed(c: Candidate, num_layers: usize) -> Candidate {
    match c {
        Candidate::Tap(TapId::Block(k)) if k + 1 >= num_layers => Candidate::Tap(TapId::Final),
        Candidate::Tap(t) => match t.residual_position() {
            Some(p) => Candidate::NormedInput(p),
            None => c,
        },
        normed => normed,
    }
}

fn permutations(n: usize) -> Vec<Vec<usize>> {
    if n == 0 {
        return vec![Vec::new()];
    }
    let mut out = Vec::new();
    for rest in permutations(n - 1) {
        for i in 0..=rest.len() {
            let mut p = rest.clone();
            p.insert(i, n - 1);
            out.push(p);
        }
    }
    out
}

/// Wirings near `base`: shifts, `embed` in front / removed, permutations, normed taps.
fn variants(base: &[Candidate], num_layers: usize) -> Vec<(Wiring, String)> {
    let n = base.len();
    let of = format_wiring(base);
    let mut out: Vec<(Wiring, String)> = Vec::new();
    for delta in [1i64, -1] {
        if let Some(w) = base
            .iter()
            .map(|&c| shifted(c, delta))
            .collect::<Option<Wiring>>()
        {
            out.push((w, format!("every slot {delta:+} of {of}")));
        }
        if n > 1 {
            for i in 0..n {
                if let Some(c) = shifted(base[i], delta) {
                    let mut w = base.to_vec();
                    w[i] = c;
                    out.push((w, format!("slot {i} {delta:+} of {of}")));
                }
            }
        }
    }
    let embed = Candidate::Tap(TapId::Embed);
    match base.iter().position(|c| *c == embed) {
        None => {
            let mut w = vec![embed];
            w.extend_from_slice(&base[..n - 1]);
            out.push((w, format!("embed in front of {of} (last slot dropped)")));
        }
        Some(i) => {
            let mut rest: Wiring = base.to_vec();
            rest.remove(i);
            let mut tails: Vec<Candidate> = Vec::new();
            let last = rest
                .iter()
                .filter_map(|c| c.tap().and_then(|t| t.residual_position()))
                .max();
            if let Some(p) = last {
                tails.push(Candidate::Tap(TapId::from_residual_position(p + 1)));
            }
            if let Ok(defaults) = default_aux_taps(num_layers) {
                tails.extend(defaults.into_iter().map(Candidate::Tap));
            }
            for tail in tails {
                if !rest.contains(&tail) {
                    let mut w = rest.clone();
                    w.push(tail);
                    out.push((w, format!("{of} without embed, {tail} appended")));
                }
            }
        }
    }
    let orders: Vec<Vec<usize>> = if n <= 3 {
        permutations(n)
    } else {
        (0..n - 1)
            .map(|i| {
                let mut p: Vec<usize> = (0..n).collect();
                p.swap(i, i + 1);
                p
            })
            .collect()
    };
    for p in orders {
        let w: Wiring = p.iter().map(|&i| base[i]).collect();
        if w != base {
            out.push((w, format!("{of} with slots in order {p:?}")));
        }
    }
    let mut last_final = base.to_vec();
    last_final[n - 1] = Candidate::Tap(TapId::Final);
    out.push((
        last_final,
        format!("{of} with final (post-norm) in the last slot"),
    ));
    let all_normed: Wiring = base.iter().map(|&c| normed(c, num_layers)).collect();
    out.push((all_normed, format!("{of} with every slot normed")));
    out
}

/// The candidate wirings for a head with `num_taps` slots on a target of `num_layers` blocks:
/// the declared readings of the right width, the default taps, every engine's default ids read
/// by every other engine, and the [`variants`] of each. The first entry is the serving reading.
pub fn sweep(readings: &[DeclaredReading], num_taps: usize, num_layers: usize) -> Vec<SweepEntry> {
    let mut bases: Vec<SweepEntry> = Vec::new();
    for r in readings.iter().filter(|r| r.taps.len() == num_taps) {
        push(&mut bases, as_wiring(&r.taps), r.source.clone(), num_layers);
    }
    if let Ok(defaults) = default_aux_taps(num_layers)
        && defaults.len() == num_taps
    {
        push(
            &mut bases,
            as_wiring(&defaults),
            "the EAGLE-3 default taps [1, L/2-1, L-4]".to_owned(),
            num_layers,
        );
        for writer in Convention::ALL {
            let Ok(ids) = writer.default_raw_ids(num_layers) else {
                continue;
            };
            for reader in Convention::ALL {
                if let Ok(taps) = reader.to_canonical(&ids, num_layers) {
                    push(
                        &mut bases,
                        as_wiring(&taps),
                        format!("{writer}'s default ids {ids:?} read as {reader} ids"),
                        num_layers,
                    );
                }
            }
        }
    }
    let mut out = bases.clone();
    for base in &bases {
        for (w, origin) in variants(&base.wiring, num_layers) {
            push(&mut out, w, origin, num_layers);
        }
    }
    out
}

/// A short name for how `other` differs from `reference` (the trained wiring): `same`,
/// `every slot +1 block`, `slot 2 -1 block`, `slots permuted`, `extra embed tap`, `missing
/// embed tap`, `slot 2 normed`, ..., else `other taps`.
pub fn difference(reference: &[Candidate], other: &[Candidate]) -> String {
    if reference == other {
        return "same".to_owned();
    }
    let n = reference.len();
    if other.len() != n {
        return format!("{} slots instead of {n}", other.len());
    }
    let differing: Vec<usize> = (0..n).filter(|&i| reference[i] != other[i]).collect();
    let unit = |d: i64| if d.abs() == 1 { "block" } else { "blocks" };
    let list = |idx: &[usize]| {
        idx.iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join(", ")
    };
    if differing
        .iter()
        .all(|&i| other[i].is_normed() && !reference[i].is_normed())
    {
        return if differing.len() == n {
            "every slot normed instead of the residual stream".to_owned()
        } else {
            let what: Vec<String> = differing.iter().map(|&i| other[i].to_string()).collect();
            format!(
                "slot{} {} normed ({}) instead of the residual stream",
                if differing.len() > 1 { "s" } else { "" },
                list(&differing),
                what.join(", ")
            )
        };
    }
    if differing
        .iter()
        .all(|&i| reference[i].is_normed() && !other[i].is_normed())
    {
        return format!(
            "residual stream instead of normed values in slot(s) {}",
            list(&differing)
        );
    }
    let (Some(r), Some(o)) = (taps_of(reference), taps_of(other)) else {
        return "other taps".to_owned();
    };
    if let Some(d) = constant_shift(&r, &o) {
        return format!("every slot {d:+} {}", unit(d));
    }
    let mut rs = r.clone();
    let mut os = o.clone();
    rs.sort();
    os.sort();
    if rs == os {
        return "slots permuted".to_owned();
    }
    match (r.contains(&TapId::Embed), o.contains(&TapId::Embed)) {
        (false, true) => {
            return if o[1..] == r[..n - 1] {
                "extra embed tap (slots moved one later)".to_owned()
            } else {
                "extra embed tap".to_owned()
            };
        }
        (true, false) => return "missing embed tap".to_owned(),
        _ => {}
    }
    if let [i] = differing[..]
        && let (Some(a), Some(b)) = (r[i].residual_position(), o[i].residual_position())
    {
        let d = b as i64 - a as i64;
        return format!("slot {i} {d:+} {}", unit(d));
    }
    "other taps".to_owned()
}

/// What one wiring measured: compare's tally, and per chain position the drafts accepted there
/// (the same positions for every wiring, so two wirings compare pair by pair).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Measured {
    /// The offline tally.
    pub counts: OfflineAcceptance,
    /// Accepted drafts at each chain position, in sample and position order.
    pub chain: Vec<u8>,
}

impl Measured {
    /// Nothing measured yet, for `steps` draft steps.
    pub fn new(steps: usize) -> Self {
        Measured {
            counts: OfflineAcceptance::new(steps),
            chain: Vec::new(),
        }
    }

    /// Adds one sample (arguments as [`OfflineAcceptance::add_sample`]).
    pub fn add_sample(&mut self, draft: &[Vec<u32>], argmax: &[u32], loss_mask: &[u8]) {
        self.counts.add_sample(draft, argmax, loss_mask);
        self.chain.extend(chain_accepts(draft, argmax, loss_mask));
    }
}

/// Accepted drafts at every chain position of one sample: positions `t` with the loss mask on
/// and every step defined (`t + steps < n`), counting steps `0..` while step `i` proposes the
/// target's argmax at `t + 1 + i` ([`OfflineAcceptance::add_sample`]'s chain view, per position).
pub fn chain_accepts(draft: &[Vec<u32>], argmax: &[u32], loss_mask: &[u8]) -> Vec<u8> {
    let n = argmax.len();
    let steps = draft.len();
    (0..n)
        .filter(|&t| t + steps < n && loss_mask[t] == 1)
        .map(|t| {
            (0..steps)
                .take_while(|&i| draft[i][t] == argmax[t + 1 + i])
                .count() as u8
        })
        .collect()
}

/// Standard error of the mean of `a[k] - b[k]` (accepted drafts, paired by position): how far
/// apart two wirings' accept lengths may be by chance on these positions. Infinite below two
/// positions.
pub fn paired_se(a: &[u8], b: &[u8]) -> f64 {
    let n = a.len().min(b.len());
    if n < 2 {
        return f64::INFINITY;
    }
    let d: Vec<f64> = a
        .iter()
        .zip(b)
        .map(|(&x, &y)| f64::from(x) - f64::from(y))
        .collect();
    let mean = d.iter().sum::<f64>() / n as f64;
    let var = d.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / (n - 1) as f64;
    (var / n as f64).sqrt()
}

/// Whether a loss of `loss` accept length with standard error `se` is real: at least
/// `min_margin` and at least three standard errors (three, not two: the best wiring is the
/// maximum of a few dozen noisy measurements, which flatters its lead).
pub fn significant(loss: f64, se: f64, min_margin: f64) -> bool {
    loss >= min_margin && loss >= 3.0 * se
}

/// One candidate's measured acceptance, ranked.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct WiringScore {
    /// 1-based rank.
    pub rank: usize,
    /// The wiring.
    pub wiring: Wiring,
    /// Why it was swept.
    pub origins: Vec<String>,
    /// Implied chain accept length (`1 + mean accepted drafts`).
    pub accept_length: f64,
    /// `acc_i` per TTT step.
    pub acc: Vec<f64>,
    /// Conditional acceptance per draft position along a chain.
    pub per_position: Vec<f64>,
    /// Accept length lost against the best wiring (0 for the best).
    pub loss: f64,
    /// Standard error of `loss`, paired by position ([`paired_se`]; 0 for the best).
    pub loss_se: f64,
    /// How this wiring differs from the report's `reference` ([`difference`]).
    pub difference: String,
    /// The raw counts.
    pub counts: OfflineAcceptance,
    /// Accepted drafts per chain position.
    #[serde(skip)]
    pub chain: Vec<u8>,
}

/// Ranks measured wirings: higher accept length first, then higher summed `acc_i`, then sweep
/// order (the serving reading first), and fills in `rank`, `loss`, `loss_se` and `difference`.
pub fn rank(measured: Vec<(SweepEntry, Measured)>) -> Vec<WiringScore> {
    let mut scores: Vec<WiringScore> = measured
        .into_iter()
        .map(|(entry, m)| WiringScore {
            rank: 0,
            wiring: entry.wiring,
            origins: entry.origins,
            accept_length: m.counts.implied_accept_length(),
            acc: m.counts.acc(),
            per_position: m.counts.per_position(),
            loss: 0.0,
            loss_se: 0.0,
            difference: String::new(),
            counts: m.counts,
            chain: m.chain,
        })
        .collect();
    let sum = |v: &[f64]| v.iter().sum::<f64>();
    // Stable: ties keep sweep order.
    scores.sort_by(|a, b| {
        b.accept_length
            .total_cmp(&a.accept_length)
            .then(sum(&b.acc).total_cmp(&sum(&a.acc)))
    });
    let Some((best, best_length, best_chain)) = scores
        .first()
        .map(|s| (s.wiring.clone(), s.accept_length, s.chain.clone()))
    else {
        return scores;
    };
    for (i, s) in scores.iter_mut().enumerate() {
        s.rank = i + 1;
        s.loss = best_length - s.accept_length;
        s.loss_se = if i == 0 {
            0.0
        } else {
            paired_se(&best_chain, &s.chain)
        };
        s.difference = difference(&best, &s.wiring);
    }
    scores
}

/// A declared reading next to what it measures.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ReadingVerdict {
    /// The reading.
    pub reading: DeclaredReading,
    /// Its rank in the sweep (`None`: not measurable, wrong number of slots).
    pub rank: Option<usize>,
    /// Whether it is the best wiring.
    pub agrees: bool,
    /// Its accept length.
    pub accept_length: Option<f64>,
    /// Accept length lost against the best wiring.
    pub loss: Option<f64>,
    /// Standard error of `loss`.
    pub loss_se: Option<f64>,
    /// Whether the loss is real ([`significant`]): serving the head this way costs acceptance.
    pub loses: bool,
    /// How it differs from the best wiring.
    pub difference: String,
}

/// Labels and settings of a diagnosis, for the report.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DiagnoseLabels {
    /// The head directory.
    pub head: String,
    /// The target model directory.
    pub model: String,
    /// The prompt set.
    pub prompts: String,
    /// `cpu` / `cuda`.
    pub device: String,
    /// The target's architecture (`LlamaForCausalLM`, ...): which SGLang convention the fix
    /// line writes ids in. [`diagnose`] fills it from the model.
    pub architecture: String,
}

/// How a diagnosis runs.
#[derive(Debug, Clone, PartialEq)]
pub struct DiagnoseOptions {
    /// Draft steps of the chain measured (TTT unroll depth).
    pub steps: usize,
    /// Smallest accept-length difference that counts (it must also be three standard errors):
    /// between the best wiring and the runner-up for the result to be conclusive, between the
    /// best and the served wiring for a mis-wiring.
    pub min_margin: f64,
    /// Labels for the report.
    pub labels: DiagnoseLabels,
}

/// The result of `tandem diagnose`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DiagnoseReport {
    /// Head, model, prompts, device.
    pub labels: DiagnoseLabels,
    /// Samples the head was teacher-forced on.
    pub samples: usize,
    /// Chain positions measured per wiring (loss mask on, every step defined).
    pub positions: usize,
    /// Draft steps of the chain.
    pub steps: usize,
    /// The target's decoder blocks.
    pub num_layers: usize,
    /// Slots of the head's `fc` input.
    pub num_taps: usize,
    /// The smallest difference that counts.
    pub min_margin: f64,
    /// The wiring the head was trained with (best accept length).
    pub best: Wiring,
    /// Its accept length.
    pub best_accept_length: f64,
    /// The head's accept length with every tap zeroed: what it predicts from the token
    /// embedding alone. Best minus this is what the taps are worth.
    pub zero_taps_accept_length: Option<f64>,
    /// The second-best wiring.
    pub runner_up: Option<Wiring>,
    /// Best minus runner-up accept length.
    pub margin: f64,
    /// Its standard error, paired by position.
    pub margin_se: f64,
    /// Whether the best wiring stands out: the margin is [`significant`].
    pub conclusive: bool,
    /// What Tandem / SGLang serve the head on.
    pub serving: Vec<TapId>,
    /// Whether serving costs no significant acceptance against the best wiring.
    pub consistent: bool,
    /// When serving is mis-wired but the sweep does not single out one wiring: the wiring
    /// within the noise of the best that the priors point at ([`likely_trained`]).
    pub likely_trained: Option<LikelyTrained>,
    /// Each declared reading, measured.
    pub readings: Vec<ReadingVerdict>,
    /// Sentences: the diagnosis, the fault, the fix.
    pub verdict: Vec<String>,
    /// What the `difference` of every score and reading is named against: the best wiring when
    /// the sweep is conclusive, else the served one.
    pub reference: Wiring,
    /// Every wiring swept, ranked.
    pub scores: Vec<WiringScore>,
}

/// A wiring the sweep cannot tell from the best, named by priors ([`likely_trained`]).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct LikelyTrained {
    /// The taps, slot order.
    pub taps: Vec<TapId>,
    /// Why it is the likely one, as phrases.
    pub reasons: Vec<&'static str>,
    /// How many wirings (the best included) are within the noise of the best.
    pub tied: usize,
}

/// `fix: ...`: the ids that make each engine serve `trained`, or why none can.
/// The ids to write for each engine so that it serves `trained`: SGLang in the convention its
/// model code applies to the target's `architecture` (+1 always for Llama/Qwen, the first-id
/// rule for DeepSeek), vLLM, SpecForge.
fn fix_sentence(trained: &[TapId], num_layers: usize, architecture: &str) -> String {
    let fixes: Vec<String> = [
        tandem_wiring::sglang_convention(architecture),
        Convention::Vllm,
        Convention::SpecForge,
    ]
    .iter()
    .filter_map(|c| {
        c.from_canonical(trained, num_layers)
            .ok()
            .map(|ids| format!("{c} {ids:?}"))
    })
    .collect();
    if fixes.is_empty() {
        format!(
            "no engine convention can express {}; only a Tandem manifest can",
            format_taps(trained)
        )
    } else {
        format!(
            "fix: write eagle_aux_hidden_state_layer_ids for the engine that serves it: {}",
            fixes.join(", ")
        )
    }
}

/// When serving is mis-wired but several wirings score within the noise of the best (a head
/// that cannot tell neighbouring blocks apart), the one among them that the head's own
/// declaration and the engines' conventions point at: the served taps in another slot order
/// (the right taps, permuted), a reading of its declared ids under another convention, or the
/// default aux set every engine agrees on (blocks 1, L/2-1, L-4). The candidate with the most
/// such reasons wins, then the better rank; `None` when no tied wiring has a reason.
pub fn likely_trained(
    scores: &[WiringScore],
    readings: &[ReadingVerdict],
    num_layers: usize,
    min_margin: f64,
) -> Option<LikelyTrained> {
    let serving = readings.iter().find(|r| r.reading.serving)?;
    let default = tandem_wiring::default_aux_taps(num_layers).ok();
    let sorted = |taps: &[TapId]| {
        let mut t = taps.to_vec();
        t.sort();
        t
    };
    let tied: Vec<(&WiringScore, Vec<TapId>)> = scores
        .iter()
        .filter(|s| s.rank == 1 || !significant(s.loss, s.loss_se, min_margin))
        .filter_map(|s| taps_of(&s.wiring).map(|t| (s, t)))
        .collect();
    let count = tied.len();
    tied.into_iter()
        .filter(|(_, taps)| *taps != serving.reading.taps)
        .map(|(s, taps)| {
            let mut reasons = Vec::new();
            if sorted(&taps) == sorted(&serving.reading.taps) {
                reasons.push("the served taps in another slot order");
            }
            if readings
                .iter()
                .any(|r| !r.reading.serving && r.reading.taps == taps)
            {
                reasons.push("a reading of the head's declared ids under another convention");
            }
            if default.as_deref() == Some(taps.as_slice()) {
                reasons.push("the engines' default aux set");
            }
            (s.rank, taps, reasons)
        })
        .filter(|(_, _, reasons)| !reasons.is_empty())
        .min_by_key(|(rank, _, reasons)| (std::cmp::Reverse(reasons.len()), *rank))
        .map(|(_, taps, reasons)| LikelyTrained {
            taps,
            reasons,
            tied: count,
        })
}

impl DiagnoseReport {
    /// Puts the ranked sweep next to the head's declared readings and words the diagnosis.
    /// `raw` is the head's ids with the convention serving reads them in, for naming the
    /// convention pair of a mismatch; `zero_taps` the accept length with every tap zeroed.
    pub fn new(
        options: &DiagnoseOptions,
        samples: usize,
        num_layers: usize,
        readings: Vec<DeclaredReading>,
        raw: Option<RawIds>,
        scores: Vec<WiringScore>,
        zero_taps: Option<f64>,
    ) -> Self {
        let min_margin = options.min_margin;
        let best = scores.first().expect("a sweep is never empty");
        let runner_up = scores.get(1);
        let (margin, margin_se) = runner_up.map_or((f64::INFINITY, 0.0), |r| (r.loss, r.loss_se));
        let conclusive = significant(margin, margin_se, min_margin);
        // Differences are named against the trained wiring when the sweep singles it out, else
        // against what serving feeds the head (a best picked by noise names nothing).
        let serving_wiring = readings
            .iter()
            .find(|r| r.serving)
            .map(|r| as_wiring(&r.taps))
            .expect("the serving reading comes first");
        let reference = if conclusive || serving_wiring.len() != best.wiring.len() {
            best.wiring.clone()
        } else {
            serving_wiring
        };
        let mut scores = scores;
        for s in &mut scores {
            s.difference = difference(&reference, &s.wiring);
        }
        let best = &scores[0];
        let runner_up = scores.get(1);
        let find = |taps: &[TapId]| {
            let w = as_wiring(taps);
            scores.iter().find(|s| s.wiring == w)
        };
        let readings: Vec<ReadingVerdict> = readings
            .into_iter()
            .map(|r| {
                let s = find(&r.taps);
                ReadingVerdict {
                    rank: s.map(|s| s.rank),
                    agrees: s.is_some_and(|s| s.rank == 1),
                    accept_length: s.map(|s| s.accept_length),
                    loss: s.map(|s| s.loss),
                    loss_se: s.map(|s| s.loss_se),
                    // A reading that cannot be measured (other slot count) cannot feed the head.
                    loses: s.is_none_or(|s| significant(s.loss, s.loss_se, min_margin)),
                    difference: difference(&reference, &as_wiring(&r.taps)),
                    reading: r,
                }
            })
            .collect();
        let serving_reading = readings
            .iter()
            .find(|r| r.reading.serving)
            .expect("the serving reading comes first");
        let serving = serving_reading.reading.taps.clone();
        let consistent = !serving_reading.loses;
        let likely = (!conclusive && !consistent)
            .then(|| likely_trained(&scores, &readings, num_layers, min_margin))
            .flatten();
        let measured = |r: &ReadingVerdict| match (r.accept_length, r.loss, r.loss_se) {
            (Some(a), Some(l), Some(se)) => {
                format!("accept length {a:.3}, {l:.3} lost (se {se:.3})")
            }
            _ => "not measurable (another number of slots)".to_owned(),
        };
        let mut verdict = Vec::new();
        let acc0 = best.acc.first().copied().unwrap_or(0.0);
        verdict.push(format!(
            "{} {}: accept length {:.3} (acc_0 {:.3}) over {} positions, {}",
            if conclusive {
                "the head was trained on"
            } else {
                "the best wiring measured is"
            },
            format_wiring(&best.wiring),
            best.accept_length,
            acc0,
            best.counts.chain_positions,
            match runner_up {
                Some(r) if conclusive => format!(
                    "{:.3} (se {:.3}) ahead of the runner-up {} ({})",
                    margin,
                    margin_se,
                    format_wiring(&r.wiring),
                    r.difference
                ),
                Some(r) => format!(
                    "but only {:.3} (se {:.3}) ahead of {} ({}): inconclusive, the sweep does not \
                     single out one wiring (measure more samples)",
                    margin,
                    margin_se,
                    format_wiring(&r.wiring),
                    r.difference
                ),
                None => "the only wiring measured".to_owned(),
            }
        ));
        if let Some(zero) = zero_taps {
            let worth = best.accept_length - zero;
            verdict.push(if worth < min_margin {
                format!(
                    "the head barely uses its taps: with every tap zeroed it still reaches accept \
                     length {zero:.3} ({worth:.3} below the best), so no wiring can be told from \
                     another; it was trained too briefly, or on another target"
                )
            } else {
                format!("the taps are worth {worth:.3} accept length (every tap zeroed: {zero:.3})")
            });
        }
        if best.accept_length < 1.05 {
            verdict.push(
                "the head accepts almost nothing under any wiring: it was not trained for this \
                 target (or its d2t / draft vocabulary is wrong, or the chat template differs)"
                    .to_owned(),
            );
        }
        if consistent && serving_reading.agrees && conclusive {
            verdict.push(format!(
                "consistent: Tandem / SGLang serve it on {} ({}), the wiring it was trained with",
                format_taps(&serving),
                serving_reading.reading.source
            ));
        } else if consistent {
            verdict.push(format!(
                "consistent within the noise: Tandem / SGLang serve it on {} ({}), {}: not \
                 significantly below the best",
                format_taps(&serving),
                serving_reading.reading.source,
                measured(serving_reading)
            ));
        } else {
            verdict.push(format!(
                "MIS-WIRED: Tandem / SGLang serve it on {} ({}): {} against the trained wiring, \
                 {}",
                format_taps(&serving),
                serving_reading.reading.source,
                difference(&best.wiring, &as_wiring(&serving)),
                measured(serving_reading)
            ));
            match taps_of(&best.wiring) {
                Some(trained) if conclusive => {
                    for swap in convention_swaps(&serving, &trained, num_layers, raw.as_ref())
                        .iter()
                        .take(2)
                    {
                        verdict.push(format!(
                            "the ids {:?} mean {} in {}, but the head was trained on what they \
                             mean in {}: {}",
                            swap.ids,
                            format_taps(&serving),
                            names(&swap.written_in),
                            names(&swap.read_as),
                            format_taps(&trained)
                        ));
                    }
                    verdict.push(fix_sentence(
                        &trained,
                        num_layers,
                        &options.labels.architecture,
                    ));
                }
                Some(_) => match &likely {
                    Some(likely) => {
                        verdict.push(format!(
                            "the sweep cannot tell the best from {} other wiring(s) within the \
                             noise; of those, {} is {}: most likely the trained wiring (a prior, \
                             not a measurement: its neighbours score the same)",
                            likely.tied - 1,
                            format_taps(&likely.taps),
                            likely.reasons.join(" and ")
                        ));
                        verdict.push(fix_sentence(
                            &likely.taps,
                            num_layers,
                            &options.labels.architecture,
                        ));
                    }
                    None => verdict.push(
                        "the trained wiring is not singled out (see above); measure more \
                         samples before rewriting the ids"
                            .to_owned(),
                    ),
                },
                None => verdict.push(format!(
                    "the head fits normed values best ({}): it was trained on a capture that \
                     read a normed tensor instead of the residual stream, which no engine feeds \
                     it; retrain on residual-stream taps",
                    best.difference_from_residual()
                )),
            }
        }
        for r in readings.iter().filter(|r| !r.reading.serving) {
            verdict.push(if r.agrees {
                format!(
                    "{}: {}, {}",
                    r.reading.source,
                    format_taps(&r.reading.taps),
                    // Rank 1 of an inconclusive sweep is only the best of a tie.
                    if conclusive {
                        "the trained wiring"
                    } else {
                        "the best measured, tied with others within the noise"
                    }
                )
            } else {
                format!(
                    "{}: {}, {} ({}{})",
                    r.reading.source,
                    format_taps(&r.reading.taps),
                    r.difference,
                    measured(r),
                    if r.loses { "" } else { ", within the noise" }
                )
            });
        }
        DiagnoseReport {
            labels: options.labels.clone(),
            samples,
            positions: best.counts.chain_positions,
            steps: options.steps,
            num_layers,
            num_taps: best.wiring.len(),
            min_margin,
            best: best.wiring.clone(),
            best_accept_length: best.accept_length,
            zero_taps_accept_length: zero_taps,
            runner_up: runner_up.map(|r| r.wiring.clone()),
            margin,
            margin_se,
            conclusive,
            serving,
            consistent,
            likely_trained: likely,
            readings,
            verdict,
            reference,
            scores,
        }
    }

    /// The score of `wiring`, if it was swept.
    pub fn score_of(&self, wiring: &[Candidate]) -> Option<&WiringScore> {
        self.scores.iter().find(|s| s.wiring == wiring)
    }

    /// Pretty JSON.
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).expect("a report always serialises")
    }

    /// The declared readings that land on the wiring ranked `rank`: `SERVING` for the one
    /// served, `ids as <conventions>` for the others.
    pub fn reading_tags(&self, rank: usize) -> Vec<String> {
        self.readings
            .iter()
            .filter(|r| r.rank == Some(rank))
            .map(|r| {
                if r.reading.serving {
                    "SERVING".to_owned()
                } else {
                    format!("ids as {}", names(&r.reading.conventions))
                }
            })
            .collect()
    }

    /// Terminal form: the header, the verdict, the declared readings and the `top` best
    /// wirings (plus any declared reading ranked below them).
    pub fn to_table(&self, top: usize) -> String {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "diagnose {} on {} [{}]: {} sample(s) from {}, {} positions, chain of {} drafts, {} \
             wirings swept",
            self.labels.head,
            self.labels.model,
            self.labels.device,
            self.samples,
            self.labels.prompts,
            self.positions,
            self.steps,
            self.scores.len()
        );
        // The table is the polars frame of every wiring, filtered to the `top` best and the
        // declared readings (`shown_wirings`); the export writes the unfiltered frame.
        match self.shown_wirings(top) {
            Ok(shown) => {
                let _ = writeln!(
                    out,
                    "{}\n(loss and se against the best wiring; difference {})",
                    tandem_stats::render(&shown),
                    if self.conclusive {
                        "vs the best"
                    } else {
                        "vs the served wiring"
                    }
                );
                if self.scores.len() > shown.height() {
                    let _ = writeln!(
                        out,
                        "({} more wirings in the JSON / HTML report and the export)",
                        self.scores.len() - shown.height()
                    );
                }
            }
            Err(e) => {
                let _ = writeln!(out, "(the wirings table could not be built: {e})");
            }
        }
        for v in &self.verdict {
            let _ = writeln!(out, "- {v}");
        }
        let _ = writeln!(out, "result: {}", self.outcome().2);
        out
    }

    /// CSS class, badge and sentence of the outcome.
    fn outcome(&self) -> (&'static str, &'static str, &'static str) {
        match (self.consistent, self.conclusive) {
            (true, true) => (
                "ok",
                "consistent",
                "consistent: serving feeds the head the wiring it was trained with",
            ),
            (true, false) => (
                "ok",
                "consistent within the noise",
                "consistent within the noise: serving costs no significant acceptance, but the \
                 sweep does not single out the trained wiring",
            ),
            (false, _) => (
                "bad",
                "mis-wired",
                "MIS-WIRED: serving feeds the head another wiring than it was trained with",
            ),
        }
    }

    /// A self-contained HTML page: badge, verdict, declared readings, and every wiring with a
    /// bar of its accept length and its acceptance per draft position.
    pub fn to_html(&self) -> String {
        let mut b = String::new();
        let (class, badge, _) = self.outcome();
        let _ = write!(
            b,
            "<h1>Tandem diagnose <span class=\"badge {class}\">{badge}</span></h1>\
             <table><tr><th>head</th><td class=mono>{}</td></tr><tr><th>model</th>\
             <td class=mono>{}</td></tr><tr><th>text</th><td>{} greedy continuation(s) of \
             <code>{}</code> prompts, {} positions</td></tr><tr><th>device</th><td>{}</td></tr>\
             <tr><th>measure</th><td>offline chain acceptance of {} drafts (teacher-forced TTT \
             unroll), per wiring</td></tr><tr><th>trained with</th><td><b>{}</b> (accept length \
             {:.3}, margin {:.3}, se {:.3})</td></tr><tr><th>every tap zeroed</th><td>{}</td></tr>\
             <tr><th>served on</th><td>{}</td></tr></table>",
            escape(&self.labels.head),
            escape(&self.labels.model),
            self.samples,
            escape(&self.labels.prompts),
            self.positions,
            escape(&self.labels.device),
            self.steps,
            escape(&format_wiring(&self.best)),
            self.best_accept_length,
            self.margin,
            self.margin_se,
            self.zero_taps_accept_length
                .map_or("-".to_owned(), |z| format!("accept length {z:.3}")),
            escape(&format_taps(&self.serving)),
        );
        b.push_str("<h2>Diagnosis</h2><ul>");
        for v in &self.verdict {
            let class = if v.starts_with("MIS-WIRED") {
                " class=bad"
            } else if v.starts_with("consistent") {
                " class=ok"
            } else {
                ""
            };
            let _ = write!(b, "<li{class}>{}</li>", escape(v));
        }
        b.push_str(
            "</ul><h2>What the head declares</h2><table><tr><th>reading</th><th>taps</th>\
             <th>rank</th><th>accept length</th><th>loss</th><th>difference</th></tr>",
        );
        for r in &self.readings {
            let class = if r.agrees { "ok" } else { "bad" };
            let _ = write!(
                b,
                "<tr><td>{}{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td>\
                 <td class={class}>{}</td></tr>",
                escape(&r.reading.source),
                if r.reading.serving {
                    " <b>(serving)</b>"
                } else {
                    ""
                },
                escape(&format_taps(&r.reading.taps)),
                r.rank.map_or("-".to_owned(), |r| r.to_string()),
                r.accept_length
                    .map_or("-".to_owned(), |a| format!("{a:.3}")),
                r.loss.map_or("-".to_owned(), |l| format!("{l:.3}")),
                escape(&r.difference)
            );
        }
        b.push_str("</table><h2>Every wiring swept</h2><table><tr><th>rank</th><th>wiring</th>");
        b.push_str("<th>accept length</th><th>loss</th>");
        for i in 0..self.steps {
            let _ = write!(b, "<th>pos {i}</th>");
        }
        let _ = write!(
            b,
            "<th>vs {}</th><th>why swept</th></tr>",
            if self.conclusive { "best" } else { "served" }
        );
        let max = self.best_accept_length.max(1.0);
        let serving = as_wiring(&self.serving);
        for s in &self.scores {
            let width = (120.0 * (s.accept_length / max)).clamp(0.0, 120.0);
            let colour = if s.rank == 1 { "#2e7d32" } else { "#90a4ae" };
            let _ = write!(
                b,
                "<tr><td>{}</td><td class=mono>{}{}</td><td><span style=\"display:inline-block;\
                 width:{width:.0}px;height:.8em;background:{colour}\"></span> {:.3}</td>\
                 <td>{:.3} <span class=small>&plusmn; {:.3}</span></td>",
                s.rank,
                escape(&format_wiring(&s.wiring)),
                if s.wiring == serving {
                    " <b>(serving)</b>"
                } else {
                    ""
                },
                s.accept_length,
                s.loss,
                s.loss_se
            );
            for v in &s.per_position {
                let _ = write!(b, "<td>{v:.3}</td>");
            }
            let _ = write!(
                b,
                "<td>{}</td><td class=small>{}</td></tr>",
                escape(&s.difference),
                escape(&s.origins.join("; "))
            );
        }
        b.push_str("</table>");
        html_page("Tandem diagnose", &b)
    }
}

impl WiringScore {
    /// Which slots of this wiring are normed, as a phrase.
    fn difference_from_residual(&self) -> String {
        let normed: Vec<String> = self
            .wiring
            .iter()
            .enumerate()
            .filter(|(_, c)| c.is_normed())
            .map(|(i, c)| format!("slot {i}: {}", c.describe()))
            .collect();
        normed.join("; ")
    }
}

/// One sequence the head is teacher-forced on.
#[derive(Debug, Clone, PartialEq)]
pub struct DiagnoseSample {
    /// Prompt followed by the target's greedy continuation.
    pub input_ids: Vec<u32>,
    /// 1 on generated tokens, 0 on the prompt.
    pub loss_mask: Vec<u8>,
}

/// The target's greedy continuation (up to `max_new_tokens`, stopping at `stop_ids`) of each
/// prompt, as samples whose loss mask covers the generated tokens.
pub fn generate_samples<B: Backend>(
    model: &TargetModel<B>,
    prompts: &[Vec<u32>],
    max_new_tokens: usize,
    stop_ids: &[u32],
) -> Result<Vec<DiagnoseSample>, ReplayError> {
    let options = GenerateOptions {
        max_new_tokens,
        sampling: SamplingParams::greedy(),
        stop_ids: stop_ids.to_vec(),
        seed: 0,
    };
    prompts
        .iter()
        .map(|prompt| {
            let generation = generate(model, prompt, &options)?;
            let mut input_ids = prompt.clone();
            input_ids.extend(&generation.tokens);
            let mut loss_mask = vec![0u8; prompt.len()];
            loss_mask.resize(input_ids.len(), 1);
            Ok(DiagnoseSample {
                input_ids,
                loss_mask,
            })
        })
        .collect()
}

/// The `[tokens, slots * T]` aux row of `wiring` from captured values (slot order).
pub fn assemble_aux(values: &CandidateValues, wiring: &[Candidate]) -> Option<Vec<f32>> {
    let columns: Vec<&[f32]> = wiring
        .iter()
        .map(|&c| values.get(c))
        .collect::<Option<_>>()?;
    let h = values.hidden;
    let mut aux = Vec::with_capacity(values.tokens * h * wiring.len());
    for t in 0..values.tokens {
        for col in &columns {
            aux.extend_from_slice(&col[t * h..(t + 1) * h]);
        }
    }
    Some(aux)
}

/// Runs the sweep: for every sample one capture of every tap point, the target's argmax, then
/// for every wiring of `sweep` the head's TTT unroll and the offline chain tally. The last
/// entry of the result is the control: every tap zeroed.
pub fn measure<B: Backend>(
    model: &TargetModel<B>,
    draft: &Eagle3Draft<B>,
    sweep: &[SweepEntry],
    samples: &[DiagnoseSample],
    steps: usize,
) -> Result<Vec<Measured>, ReplayError> {
    let device = model.device().clone();
    let last = Candidate::Tap(TapId::Block(model.spec.num_layers - 1));
    let mut tallies = vec![Measured::new(steps); sweep.len() + 1];
    for (index, sample) in samples.iter().enumerate() {
        let n = sample.input_ids.len();
        if n < 2 {
            continue;
        }
        let values = capture_candidates(model, &sample.input_ids)?;
        let h = values.hidden;
        let bad = |reason: String| ReplayError::BadSample {
            index,
            sample_id: format!("prompt {index}"),
            reason,
        };
        let last_hidden = values
            .get(last)
            .ok_or_else(|| bad("the capture lacks the last block".to_owned()))?;
        let argmax: Vec<u32> = ints(
            model
                .logits_from_last_block(Tensor::<B, 3>::from_data(
                    TensorData::new(last_hidden.to_vec(), [1, n, h]),
                    &device,
                ))
                .argmax(2),
        );
        let width = draft.spec.fc_in();
        for (i, tally) in tallies.iter_mut().enumerate() {
            let aux = match sweep.get(i) {
                Some(entry) => assemble_aux(&values, &entry.wiring).ok_or_else(|| {
                    bad(format!(
                        "no captured values for {}",
                        format_wiring(&entry.wiring)
                    ))
                })?,
                None => vec![0.0; n * width],
            };
            let aux = Tensor::<B, 3>::from_data(TensorData::new(aux, [1, n, width]), &device);
            let proposals = teacher_forced_proposals(draft, aux, &sample.input_ids, steps)?;
            tally.add_sample(&proposals, &argmax, &sample.loss_mask);
        }
    }
    Ok(tallies)
}

/// The whole diagnosis: the head's declared readings, the sweep around them, each wiring
/// measured on `samples` (target-generated text, [`generate_samples`]), ranked and worded.
pub fn diagnose<B: Backend>(
    model: &TargetModel<B>,
    draft: &Eagle3Draft<B>,
    config: &Eagle3Config,
    samples: &[DiagnoseSample],
    options: &DiagnoseOptions,
) -> Result<DiagnoseReport, ReplayError> {
    let num_layers = model.spec.num_layers;
    let hidden = model.spec.hidden_size;
    if draft.spec.target_hidden_size != hidden {
        return Err(ReplayError::HeadMismatch {
            reason: format!(
                "the head reads taps {} wide (target_hidden_size) but the target's hidden size \
                 is {hidden}",
                draft.spec.target_hidden_size
            ),
        });
    }
    if samples.iter().all(|s| s.input_ids.len() < 2) {
        return Err(ReplayError::HeadMismatch {
            reason: "no sample has two tokens to measure on".to_owned(),
        });
    }
    let readings = declared_readings(config, &model.spec.architecture, num_layers)?;
    let entries = sweep(&readings, draft.spec.num_taps, num_layers);
    if entries.is_empty() {
        return Err(ReplayError::HeadMismatch {
            reason: format!(
                "no candidate wiring has the head's {} slots on a {num_layers}-block target",
                draft.spec.num_taps
            ),
        });
    }
    let mut tallies = measure(model, draft, &entries, samples, options.steps)?;
    let zero_taps = tallies
        .pop()
        .map(|control| control.counts.implied_accept_length());
    let scores = rank(entries.into_iter().zip(tallies).collect());
    let raw = match (&config.tandem_wiring, &config.eagle_config) {
        (Some(m), _) => m.raw_ids.clone(),
        (None, Some(e)) => e.eagle_aux_hidden_state_layer_ids.clone().map(|ids| {
            RawIds::new(
                tandem_wiring::sglang_convention(&model.spec.architecture),
                ids,
            )
        }),
        (None, None) => None,
    };
    // The fix line writes SGLang ids in the convention SGLang applies to this target.
    let options = DiagnoseOptions {
        labels: DiagnoseLabels {
            architecture: model.spec.architecture.clone(),
            ..options.labels.clone()
        },
        ..options.clone()
    };
    Ok(DiagnoseReport::new(
        &options,
        samples.len(),
        num_layers,
        readings,
        raw,
        scores,
        zero_taps,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use tandem_eagle::EagleConfig;
    use tandem_model::testing::tiny_config;

    fn blocks(ks: &[usize]) -> Wiring {
        ks.iter()
            .map(|&k| Candidate::Tap(TapId::Block(k)))
            .collect()
    }

    const LLAMA: &str = "LlamaForCausalLM";

    fn head_config(ids: Option<Vec<i64>>) -> Eagle3Config {
        let mut c = Eagle3Config::for_target(&tiny_config("LlamaForCausalLM", 8), 96, 3);
        c.eagle_config = Some(EagleConfig {
            eagle_aux_hidden_state_layer_ids: ids,
            use_aux_hidden_state: true,
            extra: Default::default(),
        });
        c
    }

    #[test]
    fn readings_of_sglang_ids_and_of_no_ids() {
        let r = declared_readings(&head_config(Some(vec![1, 3, 4])), LLAMA, 8).unwrap();
        assert!(r[0].serving && r[0].taps == [1, 3, 4].map(TapId::Block));
        let vllm = r
            .iter()
            .find(|r| r.conventions.contains(&Convention::Vllm))
            .unwrap();
        assert_eq!(vllm.taps, [0, 2, 3].map(TapId::Block));
        assert!(
            vllm.source.contains("[1, 3, 4] read as hf/vllm/eagle ids"),
            "{}",
            vllm.source
        );
        // A head from elsewhere with no ids: served on the default taps, nothing else declared.
        let r = declared_readings(&head_config(None), LLAMA, 8).unwrap();
        assert_eq!(r.len(), 1);
        assert_eq!(r[0].taps, [1, 3, 4].map(TapId::Block));
        assert!(r[0].source.contains("default"), "{}", r[0].source);
    }

    #[test]
    fn the_sweep_is_bounded_deduplicated_and_covers_the_faults() {
        let readings = declared_readings(&head_config(Some(vec![1, 3, 4])), LLAMA, 8).unwrap();
        let s = sweep(&readings, 3, 8);
        assert_eq!(s[0].wiring, blocks(&[1, 3, 4]));
        assert!(s[0].origins[0].starts_with("served by"));
        assert!(s.len() <= 80, "{} wirings", s.len());
        for (i, a) in s.iter().enumerate() {
            assert!(s[i + 1..].iter().all(|b| b.wiring != a.wiring));
            assert_eq!(a.wiring.len(), 3);
        }
        let has = |w: Wiring| s.iter().any(|e| e.wiring == w);
        assert!(has(blocks(&[0, 2, 3])), "vllm reading");
        assert!(has(blocks(&[2, 4, 5])), "+1");
        assert!(has(blocks(&[1, 4, 4])), "one slot +1");
        assert!(has(blocks(&[3, 1, 4])), "permutation");
        assert!(has(vec![
            Candidate::Tap(TapId::Embed),
            Candidate::Tap(TapId::Block(1)),
            Candidate::Tap(TapId::Block(3))
        ]));
        assert!(has(vec![
            Candidate::Tap(TapId::Block(1)),
            Candidate::Tap(TapId::Block(3)),
            Candidate::Tap(TapId::Final)
        ]));
        assert!(has(vec![
            Candidate::NormedInput(2),
            Candidate::NormedInput(4),
            Candidate::NormedInput(5)
        ]));
        // Nothing past the last block.
        assert!(s.iter().all(|e| e.wiring.iter().all(|c| match c {
            Candidate::Tap(TapId::Block(k)) | Candidate::NormedInput(k) => *k < 8,
            _ => true,
        })));
        // A 2-slot head gets no 3-slot readings.
        assert!(sweep(&readings, 2, 8).iter().all(|e| e.wiring.len() == 2));
    }

    #[test]
    fn permutations_are_all_orders() {
        let p = permutations(3);
        assert_eq!(p.len(), 6);
        assert!(p.contains(&vec![2, 0, 1]));
    }

    #[test]
    fn differences_are_named() {
        let r = blocks(&[1, 3, 4]);
        assert_eq!(difference(&r, &r), "same");
        assert_eq!(difference(&r, &blocks(&[2, 4, 5])), "every slot +1 block");
        assert_eq!(difference(&r, &blocks(&[0, 2, 3])), "every slot -1 block");
        assert_eq!(difference(&r, &blocks(&[1, 3, 6])), "slot 2 +2 blocks");
        assert_eq!(difference(&r, &blocks(&[3, 1, 4])), "slots permuted");
        let embed = vec![
            Candidate::Tap(TapId::Embed),
            Candidate::Tap(TapId::Block(1)),
            Candidate::Tap(TapId::Block(3)),
        ];
        assert_eq!(
            difference(&r, &embed),
            "extra embed tap (slots moved one later)"
        );
        assert_eq!(difference(&embed, &r), "missing embed tap");
        let mut fin = r.clone();
        fin[2] = Candidate::Tap(TapId::Final);
        assert_eq!(
            difference(&r, &fin),
            "slot 2 normed (final) instead of the residual stream"
        );
        assert!(difference(&fin, &r).starts_with("residual stream instead"));
        assert_eq!(difference(&r, &blocks(&[0, 5, 6])), "other taps");
    }

    /// One step; `total` chain positions of which the first `correct_first` accept.
    fn tally(correct_first: usize, total: usize) -> Measured {
        let mut o = OfflineAcceptance::new(1);
        o.chain_positions = total;
        o.reached = vec![total];
        o.accepted = vec![correct_first];
        o.denominators = vec![total];
        o.correct = vec![correct_first];
        Measured {
            counts: o,
            chain: (0..total).map(|i| u8::from(i < correct_first)).collect(),
        }
    }

    /// The chain view per position sums to the tally's accepted drafts (hand-worked example of
    /// `compare::tests::offline_counts_by_hand`: 2, 1, 0 accepted at t = 0, 1, 2).
    #[test]
    fn chain_accepts_agree_with_the_tally() {
        let draft = vec![vec![11, 12, 99, 14, 0], vec![12, 99, 14, 0, 0]];
        let argmax = [10, 11, 12, 13, 14];
        let mut m = Measured::new(2);
        m.add_sample(&draft, &argmax, &[1; 5]);
        assert_eq!(m.chain, vec![2, 1, 0]);
        assert_eq!(
            m.chain.iter().map(|&c| usize::from(c)).sum::<usize>(),
            m.counts.accepted.iter().sum::<usize>()
        );
        assert!((m.counts.implied_accept_length() - 2.0).abs() < 1e-12);
        // Masked positions are left out.
        assert_eq!(chain_accepts(&draft, &argmax, &[0, 1, 1, 1, 1]), vec![1, 0]);
    }

    #[test]
    fn paired_standard_errors_and_significance() {
        assert_eq!(paired_se(&[1, 1], &[1, 1]), 0.0);
        assert!(paired_se(&[1], &[0]).is_infinite());
        // Differences [1, 0, 1, 0]: mean 0.5, sample variance 1/3, se = sqrt(1/12).
        let se = paired_se(&[1, 0, 2, 1], &[0, 0, 1, 1]);
        assert!((se - (1.0f64 / 12.0).sqrt()).abs() < 1e-12);
        assert!(significant(0.5, 0.15, 0.05));
        assert!(
            !significant(0.5, 0.2, 0.05),
            "less than three standard errors"
        );
        assert!(!significant(0.04, 0.0, 0.05), "below the margin");
    }

    fn entry(w: Wiring) -> SweepEntry {
        SweepEntry {
            wiring: w,
            origins: vec!["test".to_owned()],
        }
    }

    #[test]
    fn the_fix_writes_sglang_ids_in_the_targets_convention() {
        let trained = vec![TapId::Block(1), TapId::Block(14), TapId::Block(26)];
        let llama = fix_sentence(&trained, 30, "LlamaForCausalLM");
        assert!(
            llama.contains("sglang-classic [1, 14, 26]") && llama.contains("vllm [2, 15, 27]"),
            "{llama}"
        );
        // DeepSeek's first-id rule: ids starting at 1 get the +1, so [1, 14, 26] too.
        let deepseek = fix_sentence(&trained, 30, "DeepseekV3ForCausalLM");
        assert!(
            deepseek.contains("sglang-heuristic [1, 14, 26]"),
            "{deepseek}"
        );
        // Block 0 first: SGLang's Llama code reads id 0 as block 0.
        let first = vec![TapId::Block(0), TapId::Block(14), TapId::Block(26)];
        let llama0 = fix_sentence(&first, 30, "LlamaForCausalLM");
        assert!(llama0.contains("sglang-classic [0, 14, 26]"), "{llama0}");
    }

    fn options() -> DiagnoseOptions {
        DiagnoseOptions {
            steps: 1,
            min_margin: 0.05,
            labels: DiagnoseLabels {
                head: "h".into(),
                model: "m".into(),
                prompts: "p".into(),
                device: "cpu".into(),
                architecture: "LlamaForCausalLM".into(),
            },
        }
    }

    #[test]
    fn ranking_orders_by_accept_length_and_keeps_sweep_order_on_ties() {
        let ranked = rank(vec![
            (entry(blocks(&[1, 3, 4])), tally(5, 10)),
            (entry(blocks(&[0, 2, 3])), tally(9, 10)),
            (entry(blocks(&[2, 4, 5])), tally(5, 10)),
        ]);
        assert_eq!(ranked[0].wiring, blocks(&[0, 2, 3]));
        assert_eq!(ranked[1].wiring, blocks(&[1, 3, 4]));
        assert_eq!(ranked[2].wiring, blocks(&[2, 4, 5]));
        assert_eq!(ranked.iter().map(|s| s.rank).collect::<Vec<_>>(), [1, 2, 3]);
        assert!((ranked[0].accept_length - 1.9).abs() < 1e-12);
        assert!((ranked[1].loss - 0.4).abs() < 1e-12);
        assert_eq!(ranked[1].difference, "every slot +1 block");
    }

    /// A head trained on [0, 2, 3] whose config says SGLang ids [1, 3, 4]: serving reads them
    /// as [1, 3, 4], one block late; the ids were written for vLLM.
    #[test]
    fn a_mis_wired_head_is_named_with_the_convention_pair_and_the_fix() {
        let config = head_config(Some(vec![1, 3, 4]));
        let readings = declared_readings(&config, LLAMA, 8).unwrap();
        let ranked = rank(vec![
            (entry(blocks(&[1, 3, 4])), tally(2, 10)),
            (entry(blocks(&[0, 2, 3])), tally(9, 10)),
            (entry(blocks(&[2, 4, 5])), tally(1, 10)),
        ]);
        let raw = RawIds::new(Convention::SglangHeuristic, vec![1, 3, 4]);
        let report = DiagnoseReport::new(&options(), 2, 8, readings, Some(raw), ranked, None);
        assert!(!report.consistent && report.conclusive);
        assert_eq!(report.best, blocks(&[0, 2, 3]));
        let text = report.verdict.join("\n");
        assert!(
            text.contains("MIS-WIRED: Tandem / SGLang serve it on [block 1, block 3, block 4]")
                && text.contains("every slot +1 block against the trained wiring")
                && text.contains("accept length 1.200, 0.700 lost"),
            "{text}"
        );
        assert!(
            text.contains("the ids [1, 3, 4] mean [block 1, block 3, block 4] in sglang-heuristic")
                && text.contains("what they mean in hf/vllm/eagle"),
            "{text}"
        );
        assert!(
            text.contains("fix: write eagle_aux_hidden_state_layer_ids")
                && text.contains("vllm [1, 3, 4]"),
            "{text}"
        );
        let vllm = report
            .readings
            .iter()
            .find(|r| r.reading.conventions.contains(&Convention::Vllm))
            .unwrap();
        assert!(vllm.agrees);
        let table = report.to_table(10);
        assert!(
            table.contains("MIS-WIRED") && table.contains("SERVING"),
            "{table}"
        );
        let html = report.to_html();
        assert!(html.contains("mis-wired") && !html.contains("<script"));
        let json: serde_json::Value = serde_json::from_str(&report.to_json()).unwrap();
        assert_eq!(json["best"][0], "block:0");
        assert_eq!(json["consistent"], false);
    }

    #[test]
    fn a_consistent_head_and_an_inconclusive_sweep() {
        let readings = declared_readings(&head_config(Some(vec![1, 3, 4])), LLAMA, 8).unwrap();
        let ranked = rank(vec![
            (entry(blocks(&[1, 3, 4])), tally(8, 10)),
            (entry(blocks(&[0, 2, 3])), tally(2, 10)),
        ]);
        let report = DiagnoseReport::new(&options(), 1, 8, readings.clone(), None, ranked, None);
        assert!(report.consistent && report.conclusive);
        assert!(
            report.verdict[1].starts_with("consistent"),
            "{:?}",
            report.verdict
        );
        let vllm = report
            .readings
            .iter()
            .find(|r| r.reading.conventions.contains(&Convention::Vllm))
            .unwrap();
        assert_eq!(vllm.difference, "every slot -1 block");
        assert!((vllm.loss.unwrap() - 0.6).abs() < 1e-12);

        let ranked = rank(vec![
            (entry(blocks(&[1, 3, 4])), tally(8, 100)),
            (entry(blocks(&[0, 2, 3])), tally(7, 100)),
        ]);
        let report = DiagnoseReport::new(&options(), 1, 8, readings, None, ranked, Some(1.075));
        assert!(!report.conclusive && report.consistent);
        assert!(
            report.verdict[0].contains("inconclusive"),
            "{}",
            report.verdict[0]
        );
        assert!(
            report.verdict[1].starts_with("the head barely uses its taps"),
            "{}",
            report.verdict[1]
        );
        assert!(report.to_table(5).contains("consistent within the noise"));
    }

    /// The H200 case of BENCHMARKS.md (issue #7): the committed head served with its slots
    /// reversed loses clearly, but the head cannot tell neighbouring blocks apart, so the best
    /// measured wiring is a one-block shift of the trained one, tied with it. The diagnosis must
    /// still name the trained wiring: the tied wiring that is the served taps in another order
    /// and the engines' default aux set.
    #[test]
    fn an_inconclusive_sweep_names_the_permutation_of_the_served_taps() {
        let served = vec![TapId::Block(26), TapId::Block(14), TapId::Block(1)];
        let readings = vec![
            DeclaredReading {
                source: "the head's Tandem wiring manifest".into(),
                conventions: vec![],
                ids: None,
                taps: served.clone(),
                serving: true,
            },
            // Another reading that lands on the sweep's rank 1, which is only the best of a tie.
            DeclaredReading {
                source: "another reading".into(),
                conventions: vec![],
                ids: None,
                taps: vec![TapId::Block(0), TapId::Block(13), TapId::Block(25)],
                serving: false,
            },
        ];
        let ranked = rank(vec![
            (entry(blocks(&[26, 14, 1])), tally(40, 400)),
            (entry(blocks(&[0, 13, 25])), tally(101, 400)),
            (entry(blocks(&[2, 15, 27])), tally(100, 400)),
            (entry(blocks(&[1, 14, 26])), tally(100, 400)),
            (entry(blocks(&[5, 9, 20])), tally(50, 400)),
        ]);
        let report = DiagnoseReport::new(&options(), 8, 30, readings, None, ranked, Some(1.1));
        assert!(!report.consistent && !report.conclusive);
        let likely = report.likely_trained.as_ref().expect("a likely wiring");
        assert_eq!(
            likely.taps,
            [TapId::Block(1), TapId::Block(14), TapId::Block(26)]
        );
        assert_eq!(likely.tied, 3, "best and its two ties; [5, 9, 20] loses");
        assert_eq!(
            likely.reasons,
            [
                "the served taps in another slot order",
                "the engines' default aux set"
            ]
        );
        let text = report.verdict.join("\n");
        assert!(
            text.contains("MIS-WIRED")
                && text.contains(
                    "[block 1, block 14, block 26] is the served taps in another slot order"
                )
                && text.contains("most likely the trained wiring")
                && text.contains("fix: write eagle_aux_hidden_state_layer_ids"),
            "{text}"
        );
        assert!(
            text.contains(
                "another reading: [block 0, block 13, block 25], the best measured, tied with \
                 others within the noise"
            ),
            "{text}"
        );
        // Without any prior among the ties, nothing is named.
        let readings = vec![DeclaredReading {
            source: "m".into(),
            conventions: vec![],
            ids: None,
            taps: vec![TapId::Block(5), TapId::Block(9), TapId::Block(20)],
            serving: true,
        }];
        let ranked = rank(vec![
            (entry(blocks(&[5, 9, 20])), tally(40, 400)),
            (entry(blocks(&[0, 13, 25])), tally(101, 400)),
            (entry(blocks(&[2, 15, 27])), tally(100, 400)),
        ]);
        let report = DiagnoseReport::new(&options(), 8, 30, readings, None, ranked, None);
        assert!(report.likely_trained.is_none());
        assert!(report.verdict.join(" ").contains("not singled out"));
    }

    /// The wirings table is a polars frame of every score, in rank order, with the readings
    /// that land on each; the terminal table keeps the `top` best and every declared reading,
    /// and the CSV export holds every wiring with the same numbers.
    #[test]
    fn the_wirings_frame_holds_every_score_and_the_table_keeps_top_and_readings() {
        let readings = vec![DeclaredReading {
            source: "the head's Tandem wiring manifest".into(),
            conventions: vec![],
            ids: None,
            taps: vec![TapId::Block(5), TapId::Block(9), TapId::Block(20)],
            serving: true,
        }];
        let ranked = rank(vec![
            (entry(blocks(&[5, 9, 20])), tally(40, 400)),
            (entry(blocks(&[0, 13, 25])), tally(101, 400)),
            (entry(blocks(&[2, 15, 27])), tally(100, 400)),
            (entry(blocks(&[1, 14, 26])), tally(90, 400)),
        ]);
        let report = DiagnoseReport::new(&options(), 8, 30, readings, None, ranked, None);
        let frame = report.wirings_frame().unwrap();
        assert_eq!(frame.height(), 4);
        let ranks = tandem_stats::column_f64s(&frame, "rank").unwrap();
        assert_eq!(ranks, [1.0, 2.0, 3.0, 4.0]);
        let lengths = tandem_stats::column_f64s(&frame, "accept_length").unwrap();
        let losses = tandem_stats::column_f64s(&frame, "loss").unwrap();
        // tally(c, n): c of n first drafts accepted, so accept length 1 + c / n.
        for (i, c) in [101.0, 100.0, 90.0, 40.0].iter().enumerate() {
            assert!(
                (lengths[i] - (1.0 + c / 400.0)).abs() < 1e-12,
                "{lengths:?}"
            );
            assert!(
                (losses[i] - (101.0 - c) / 400.0).abs() < 1e-12,
                "{losses:?}"
            );
        }
        let pos0 = tandem_stats::column_f64s(&frame, "pos0").unwrap();
        assert!((pos0[0] - 101.0 / 400.0).abs() < 1e-12);
        let tags = tandem_stats::column_strings(&frame, "readings").unwrap();
        assert_eq!(tags, ["", "", "", "SERVING"]);
        assert_eq!(
            tandem_stats::column_strings(&frame, "wiring").unwrap()[0],
            "[block 0, block 13, block 25]"
        );
        // Top 2 and the served wiring (rank 4); `origins` is left to the export.
        let shown = report.shown_wirings(2).unwrap();
        assert_eq!(
            tandem_stats::column_f64s(&shown, "rank").unwrap(),
            [1.0, 2.0, 4.0]
        );
        assert!(shown.column("origins").is_err());
        let table = report.to_table(2);
        assert!(
            table.contains("(1 more wirings") && table.contains("SERVING"),
            "{table}"
        );
        let dir =
            std::env::temp_dir().join(format!("tandem-diagnose-export-{}", std::process::id()));
        let written = tandem_stats::export_tables(&dir, "csv", &report.tables().unwrap()).unwrap();
        assert_eq!(written, [dir.join("diagnose_wirings.csv")]);
        let csv = std::fs::read_to_string(&written[0]).unwrap();
        let mut lines = csv.lines();
        assert!(
            lines
                .next()
                .unwrap()
                .starts_with("rank,wiring,accept_length,loss,se,pos0,difference,readings,origins"),
            "{csv}"
        );
        // The wiring is quoted (it holds commas); accept length 1 + 101/400.
        let first = lines.next().unwrap();
        assert!(
            first.starts_with("1,\"[block 0, block 13, block 25]\",1.2525,0.0,"),
            "{first}"
        );
        assert_eq!(csv.lines().count(), 5, "a header and every wiring: {csv}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
