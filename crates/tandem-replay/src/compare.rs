//! `tandem compare`: offline acceptance (the head on a dump's recorded taps) next to online
//! acceptance (the speculative engine on prompts), per draft position, for the serving tree
//! settings (steps, topk, num_draft_tokens; topk 1 is a chain). A large gap between the two is
//! itself the symptom of a wiring fault (facts 6.9: offline accuracy 0.8-0.9 with an online
//! accept length of ~1.5).
//!
//! Offline comes in two views:
//!
//! - drafted ([`drafted_acceptance`]), the one compared with online: the engine's own draft
//!   extend and tree drafting ([`Engine::draft_extend`], [`Engine::draft_trees`], the driver's code on every backend) fed
//!   the recorded aux states up to slot `t` instead of live taps, each tree walked by the
//!   engine's [`verify_greedy`] with the target's greedy tokens ([`node_targets`]), at the
//!   positions serving's rounds would start from ([`next_draft_slot`]). On the target's own
//!   greedy text of the online prompts this reproduces the online rounds exactly;
//! - teacher-forced ([`offline_acceptance`]), the trainer's view (below).
//!
//! Teacher-forced, for a sample of `n` tokens and TTT step `i` at index `t` (step `i` at `t` predicts
//! token `t + 2 + i`, see `Eagle3Draft::forward_ttt`):
//!
//! - the target's argmax at `t + 1 + i` comes from the dumped `last_hidden` through the
//!   target's final norm and lm_head (as the trainer recomputes it);
//! - `correct_i(t)` = the draft argmax mapped through `d2t` equals that argmax;
//! - `acc_i` = share of correct positions over positions with `loss_mask[t + i] == 1` and
//!   `t + 1 + i < n` (the training denominator);
//! - the chain view: at positions `t` where every step is defined and `loss_mask[t] == 1`,
//!   draft position `i` is "reached" when steps `0..i` were all correct and "accepted" when
//!   step `i` is too: the per-position acceptance of a chain drafter fed these exact hidden
//!   states, comparable to the engine's `AcceptanceStats::per_position`; the implied accept
//!   length is `1 + mean(accepted drafts)`.

use std::fmt::Write as _;

use burn::prelude::*;
use serde::Serialize;
use tandem_dump::DumpReader;
use tandem_eagle::Eagle3Draft;
use tandem_infer::{
    AcceptanceStats, DraftTree, Engine, Roots, Shape, SpecBackend, SpecGenerate, verify_greedy,
};
use tandem_model::{Taps, TargetModel};
// The standard errors live with the acceptance statistics; compare's API keeps offering them.
pub use tandem_infer::stats::{accept_length_se, position_se, ratio_se, share_se};
use tandem_wiring::{WiringManifest, check};

use crate::error::ReplayError;
use crate::render::{escape, html_page};

/// Offline acceptance counts over a dump.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct OfflineAcceptance {
    /// Samples used.
    pub samples: usize,
    /// Per step: positions counted for `acc_i`.
    pub denominators: Vec<usize>,
    /// Per step: correct positions.
    pub correct: Vec<usize>,
    /// Chain positions (every step defined, loss mask on).
    pub chain_positions: usize,
    /// Per draft position: chain positions that reached it.
    pub reached: Vec<usize>,
    /// Per draft position: chain positions that accepted it.
    pub accepted: Vec<usize>,
}

impl OfflineAcceptance {
    /// An empty tally for `steps` draft steps.
    pub fn new(steps: usize) -> Self {
        OfflineAcceptance {
            denominators: vec![0; steps],
            correct: vec![0; steps],
            reached: vec![0; steps],
            accepted: vec![0; steps],
            ..Default::default()
        }
    }

    /// Adds one sample. `draft[i][t]`: the target id step `i` proposes at index `t` (draft
    /// argmax through `d2t`); `argmax[u]`: the target's argmax after tokens `0..=u`.
    pub fn add_sample(&mut self, draft: &[Vec<u32>], argmax: &[u32], loss_mask: &[u8]) {
        let n = argmax.len();
        let steps = self.correct.len();
        let correct = |i: usize, t: usize| draft[i][t] == argmax[t + 1 + i];
        for i in 0..steps {
            for t in 0..n {
                let u = t + i;
                if u + 1 >= n || loss_mask[u] == 0 {
                    continue;
                }
                self.denominators[i] += 1;
                self.correct[i] += usize::from(correct(i, t));
            }
        }
        for (t, &mask) in loss_mask.iter().enumerate().take(n) {
            if t + steps >= n || mask == 0 {
                continue;
            }
            self.chain_positions += 1;
            for i in 0..steps {
                self.reached[i] += 1;
                if !correct(i, t) {
                    break;
                }
                self.accepted[i] += 1;
            }
        }
        self.samples += 1;
    }

    /// `acc_i` per step.
    pub fn acc(&self) -> Vec<f64> {
        ratio(&self.correct, &self.denominators)
    }

    /// Conditional acceptance per draft position along a chain.
    pub fn per_position(&self) -> Vec<f64> {
        ratio(&self.accepted, &self.reached)
    }

    /// `1 + mean accepted drafts` over chain positions.
    pub fn implied_accept_length(&self) -> f64 {
        if self.chain_positions == 0 {
            return 0.0;
        }
        1.0 + self.accepted.iter().sum::<usize>() as f64 / self.chain_positions as f64
    }
}

fn ratio(a: &[usize], b: &[usize]) -> Vec<f64> {
    a.iter()
        .zip(b)
        .map(|(&a, &b)| if b == 0 { 0.0 } else { a as f64 / b as f64 })
        .collect()
}

/// Runs the head teacher-forced on the first `max_samples` samples of `dump`.
pub fn offline_acceptance<B: Backend>(
    model: &TargetModel<B>,
    draft: &Eagle3Draft<B>,
    dump: &DumpReader,
    steps: usize,
    max_samples: Option<usize>,
) -> Result<OfflineAcceptance, ReplayError> {
    let m = dump.manifest();
    let (t_width, aux_width) = (m.hidden_size, m.aux_width());
    let device = model.device().clone();
    let mut out = OfflineAcceptance::new(steps);
    let count = dump.len().min(max_samples.unwrap_or(usize::MAX));
    if count == 0 {
        return Err(ReplayError::EmptyDump {
            dir: dump.dir().to_owned(),
        });
    }
    for index in 0..count {
        let record = dump.read(index)?;
        let n = record.len();
        if n < 2 {
            continue;
        }
        let last = Tensor::<B, 3>::from_data(
            TensorData::new(record.last_hidden.clone(), [1, n, t_width]),
            &device,
        );
        let argmax: Vec<u32> = ints(model.logits_from_last_block(last).argmax(2));
        let aux = Tensor::<B, 3>::from_data(
            TensorData::new(record.aux_hidden.clone(), [1, n, aux_width]),
            &device,
        );
        let proposals = teacher_forced_proposals(draft, aux, &record.input_ids, steps)?;
        out.add_sample(&proposals, &argmax, &record.loss_mask);
    }
    Ok(out)
}

/// The head teacher-forced on one sequence: `aux: [1, n, num_taps * T]`, `input_ids: [n]`.
/// `out[i][t]` is the target id TTT step `i` proposes at index `t` (draft argmax through
/// `d2t`), the `draft` argument of [`OfflineAcceptance::add_sample`].
pub fn teacher_forced_proposals<B: Backend>(
    draft: &Eagle3Draft<B>,
    aux: Tensor<B, 3>,
    input_ids: &[u32],
    steps: usize,
) -> Result<Vec<Vec<u32>>, ReplayError> {
    let n = input_ids.len();
    let outputs = draft.forward_ttt(aux, input_ids, &[n], steps)?;
    Ok(outputs
        .into_iter()
        .map(|o| draft.to_target_ids(&ints(o.logits.argmax(2))))
        .collect())
}

pub(crate) fn ints<B: Backend>(t: Tensor<B, 3, Int>) -> Vec<u32> {
    t.into_data()
        .convert::<i64>()
        .to_vec::<i64>()
        .expect("ints")
        .into_iter()
        .map(|v| v as u32)
        .collect()
}

/// Which positions of a dumped sample the engine's drafting is evaluated at.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum OfflinePositions {
    /// The rounds serving would run over the sample's assistant turns: the first root is the
    /// turn's first token, each next root follows the accepted drafts and the bonus token. The
    /// accept length is then a mean over rounds, as the engine's is. (A mean over every
    /// position weighs easy stretches more than rounds do, since serving crosses an easy
    /// stretch in few rounds, and overstates the online accept length.)
    Rounds,
    /// Every position of the chain view of [`OfflineAcceptance`] (loss mask on, every step
    /// defined). With topk 1 on the target's own greedy text this reproduces the
    /// teacher-forced chain counts exactly.
    Every,
}

impl std::str::FromStr for OfflinePositions {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "rounds" => Ok(OfflinePositions::Rounds),
            "every" => Ok(OfflinePositions::Every),
            other => Err(format!(
                "unknown offline positions {other:?} (rounds, every)"
            )),
        }
    }
}

/// The next slot at which a tree is drafted, for a sample with `loss_mask` (its length is the
/// sample's). Slot `t` pairs the recorded aux state at `t` with token `t + 1`, the root of
/// the tree (the last verified token); the tree's depth-`d` nodes propose token `t + 1 + d`.
/// `after`: the previous round's slot and the drafts it accepted (`None` for the first).
/// A slot qualifies when the walk of a `steps`-deep tree is defined (`t + steps < n`) and:
///
/// - `Rounds`: the root and the first proposed token are both assistant tokens
///   (`loss_mask[t + 1] == loss_mask[t + 2] == 1`); the search starts where serving's next
///   round would (`t + accepted + 1`), so at a turn's end it moves on to the next turn's first
///   token, which serving's prefill would produce;
/// - `Every`: `loss_mask[t] == 1` (the chain view's positions), from `t + 1`.
pub fn next_draft_slot(
    loss_mask: &[u8],
    steps: usize,
    positions: OfflinePositions,
    after: Option<(usize, usize)>,
) -> Option<usize> {
    let n = loss_mask.len();
    let on = |i: usize| loss_mask.get(i).is_some_and(|&m| m != 0);
    let (start, qualifies): (usize, &dyn Fn(usize) -> bool) = match positions {
        OfflinePositions::Rounds => (after.map_or(0, |(t, accepted)| t + accepted + 1), &|t| {
            on(t + 1) && on(t + 2)
        }),
        OfflinePositions::Every => (after.map_or(0, |(t, _)| t + 1), &|t| on(t)),
    };
    (start..n).find(|&t| t + steps < n && qualifies(t))
}

/// The target's greedy token after each node of a tree drafted at slot `t`: the node at depth
/// `d` extends the verified prefix `0..=t+1` by `d` tokens, so the target's choice there is
/// `argmax[t + 1 + d]`. That is exact while the accepted path equals the dumped tokens, which
/// holds on the target's own greedy text. Past the sample's end there is no target token
/// (`u32::MAX`, no draft token equals it); [`next_draft_slot`] only picks slots where every
/// node that can be accepted has one.
pub fn node_targets(tree: &DraftTree, argmax: &[u32], t: usize) -> Vec<u32> {
    tree.depth
        .iter()
        .map(|d| argmax.get(t + 1 + d).copied().unwrap_or(u32::MAX))
        .collect()
}

/// Offline acceptance of the engine's own drafting fed recorded taps.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DraftedAcceptance {
    /// Where trees were drafted.
    pub positions: OfflinePositions,
    /// Samples that had at least one qualifying slot.
    pub samples: usize,
    /// Rounds, accepted drafts and per-position counts, as the engine records them.
    pub stats: AcceptanceStats,
    /// Assistant tokens (after the first of a turn) compared with the target's argmax.
    pub greedy_checked: usize,
    /// Of those, tokens equal to the target's argmax: all of them when the dump is the
    /// target's own greedy text, which makes the offline walk exact.
    pub greedy_equal: usize,
    /// Per sample walked, its own statistics: for the standard errors over samples.
    pub per_sample: Vec<AcceptanceStats>,
}

impl DraftedAcceptance {
    /// Share of the dump's assistant tokens that are the target's greedy choice.
    pub fn greedy_share(&self) -> f64 {
        if self.greedy_checked == 0 {
            return 0.0;
        }
        self.greedy_equal as f64 / self.greedy_checked as f64
    }
}

/// One dumped sample being walked.
struct Walk {
    ids: Vec<u32>,
    loss_mask: Vec<u8>,
    argmax: Vec<u32>,
    /// `[n, aux_width]` recorded aux states.
    aux: Vec<f32>,
    /// Slots `0..extended` are in the draft cache.
    extended: usize,
    /// The slot of the next tree.
    slot: usize,
    /// Its rounds so far.
    stats: AcceptanceStats,
}

/// Drafts trees with `engine`'s own code ([`tandem_infer::Engine::draft_extend`],
/// [`tandem_infer::Engine::draft_trees`], its `config`: steps, topk, num_draft_tokens) from the head fed
/// the dump's recorded aux states instead of live taps, on the first `max_samples` samples,
/// and walks each tree with the target's greedy tokens ([`node_targets`], the argmax of the
/// target's logits recomputed from the dumped last hidden state) through the engine's
/// [`verify_greedy`]. `batch` samples are drafted together, as the engine batches requests.
pub fn drafted_acceptance<T: SpecBackend>(
    engine: &Engine<'_, T>,
    dump: &DumpReader,
    max_samples: Option<usize>,
    positions: OfflinePositions,
    batch: usize,
) -> Result<DraftedAcceptance, ReplayError> {
    engine.config.validate()?;
    let steps = engine.config.num_steps;
    let count = dump.len().min(max_samples.unwrap_or(usize::MAX));
    if count == 0 {
        return Err(ReplayError::EmptyDump {
            dir: dump.dir().to_owned(),
        });
    }
    let manifest = dump.manifest();
    let (t_width, aux_width) = (manifest.hidden_size, manifest.aux_width());
    let mut out = DraftedAcceptance {
        positions,
        samples: 0,
        stats: AcceptanceStats::new(steps),
        greedy_checked: 0,
        greedy_equal: 0,
        per_sample: Vec::new(),
    };
    let indices: Vec<usize> = (0..count).collect();
    for group in indices.chunks(batch.max(1)) {
        let mut walks = Vec::with_capacity(group.len());
        for &index in group {
            let record = dump.read(index)?;
            let n = record.len();
            if record.aux_hidden.len() != n * aux_width || record.last_hidden.len() != n * t_width {
                return Err(ReplayError::BadSample {
                    index,
                    sample_id: record.sample_id.clone(),
                    reason: format!(
                        "{n} tokens but {} aux values ({aux_width} per token expected) and {} \
                         last-hidden values ({t_width} per token)",
                        record.aux_hidden.len(),
                        record.last_hidden.len()
                    ),
                });
            }
            let Some(slot) = next_draft_slot(&record.loss_mask, steps, positions, None) else {
                continue;
            };
            let argmax = engine.target.last_block_argmax(&record.last_hidden)?;
            for u in 1..n {
                if record.loss_mask[u] != 0 && record.loss_mask[u - 1] != 0 {
                    out.greedy_checked += 1;
                    out.greedy_equal += usize::from(record.input_ids[u] == argmax[u - 1]);
                }
            }
            walks.push(Walk {
                ids: record.input_ids,
                loss_mask: record.loss_mask,
                argmax,
                aux: record.aux_hidden,
                extended: 0,
                slot,
                stats: AcceptanceStats::new(steps),
            });
        }
        out.samples += walks.len();
        if !walks.is_empty() {
            walk_group(
                engine,
                &mut walks,
                positions,
                (manifest.num_slots, t_width),
                &mut out.stats,
                &mut out.per_sample,
            )?;
        }
    }
    Ok(out)
}

/// Runs the rounds of a group of samples to the end of each.
fn walk_group<T: SpecBackend>(
    engine: &Engine<'_, T>,
    walks: &mut Vec<Walk>,
    positions: OfflinePositions,
    slots: (usize, usize),
    stats: &mut AcceptanceStats,
    per_sample: &mut Vec<AcceptanceStats>,
) -> Result<(), ReplayError> {
    let steps = engine.config.num_steps;
    let longest = walks.iter().map(|w| w.ids.len()).max().unwrap_or(0);
    let scratch = engine.draft_scratch();
    // Room for the longest sample plus one extend of any width; compaction reclaims the
    // padding of ragged extends when it runs out.
    let head = engine.draft.ok_or_else(|| ReplayError::HeadMismatch {
        reason: "compare drafts offline and needs the engine's head".into(),
    })?;
    let mut dcache = engine
        .target
        .new_head_cache(head, walks.len(), 2 * longest + scratch + 1)?;
    let shape = Shape::of(&engine.config);
    let mut roots = extend_walks(engine, head, &mut dcache, walks, slots, scratch)?;
    loop {
        let before = T::layout(&dcache).used();
        let tokens: Vec<u32> = walks.iter().map(|w| w.ids[w.slot + 1]).collect();
        let trees = engine.draft_trees(head, shape, &tokens, &roots, &mut dcache)?;
        T::layout_mut(&mut dcache).rollback(before);
        let mut finished = Vec::new();
        for (row, (walk, tree)) in walks.iter_mut().zip(&trees).enumerate() {
            let acceptance = verify_greedy(tree, &node_targets(tree, &walk.argmax, walk.slot));
            let depth = tree.depth.iter().copied().max().unwrap_or(0);
            stats.record(acceptance.accepted.len(), depth);
            walk.stats.record(acceptance.accepted.len(), depth);
            match next_draft_slot(
                &walk.loss_mask,
                steps,
                positions,
                Some((walk.slot, acceptance.accepted.len())),
            ) {
                Some(slot) => walk.slot = slot,
                None => finished.push(row),
            }
        }
        if finished.len() == walks.len() {
            per_sample.extend(walks.iter().map(|w| w.stats.clone()));
            return Ok(());
        }
        let keep: Vec<usize> = (0..walks.len())
            .filter(|row| !finished.contains(row))
            .collect();
        engine.target.retain(&mut dcache, &keep)?;
        for &row in finished.iter().rev() {
            let walk = walks.remove(row);
            per_sample.push(walk.stats);
        }
        roots = extend_walks(engine, head, &mut dcache, walks, slots, scratch)?;
    }
}

/// Draft extend of every walk over its slots `extended..=slot` (recorded aux state at `s`
/// paired with token `s + 1`, as the engine pairs live taps); returns the new roots.
/// `(num_slots, t_width)`: the recorded aux state of a token is `num_slots` taps of `t_width`.
fn extend_walks<T: SpecBackend>(
    engine: &Engine<'_, T>,
    head: &T::Head,
    dcache: &mut T::Cache,
    walks: &mut [Walk],
    (num_slots, t_width): (usize, usize),
    scratch: usize,
) -> Result<Roots<T>, ReplayError> {
    let chunks: Vec<Vec<u32>> = walks
        .iter()
        .map(|w| w.ids[w.extended + 1..=w.slot + 1].to_vec())
        .collect();
    let width = chunks.iter().map(Vec::len).max().unwrap_or(1);
    let layout = T::layout(dcache);
    if layout.used() + width + scratch > layout.capacity() {
        engine.target.compact(dcache)?;
    }
    // The recorded aux states stand in for a target step's taps: one `[walks, width, T]`
    // tensor per tap, as a live step captures them (a token's record is its taps side by side).
    let aux_width = num_slots * t_width;
    let mut tensors = Vec::with_capacity(num_slots);
    for slot in 0..num_slots {
        let mut values = vec![0f32; walks.len() * width * t_width];
        for (row, walk) in walks.iter().enumerate() {
            for (i, s) in (walk.extended..=walk.slot).enumerate() {
                let from = s * aux_width + slot * t_width;
                values[(row * width + i) * t_width..][..t_width]
                    .copy_from_slice(&walk.aux[from..from + t_width]);
            }
        }
        tensors.push(
            engine
                .target
                .rows_from_host(&values, walks.len(), width, t_width)?,
        );
    }
    let taps = Taps {
        taps: Vec::new(),
        tensors,
        visited: Vec::new(),
    };
    let slots: Vec<Vec<usize>> = chunks.iter().map(|c| (0..c.len()).collect()).collect();
    let roots = engine.draft_extend(head, dcache, &chunks, &taps, width, &slots)?;
    for walk in walks.iter_mut() {
        walk.extended = walk.slot + 1;
    }
    Ok(roots)
}

/// Online acceptance of the speculative engine (greedy) over prompts.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct OnlineAcceptance {
    /// Prompts run.
    pub prompts: usize,
    /// Tokens generated.
    pub tokens: usize,
    /// The engine's statistics.
    pub stats: AcceptanceStats,
    /// Per prompt, its own statistics: for the standard errors over prompts.
    pub per_prompt: Vec<AcceptanceStats>,
}

/// Runs `prompts` one at a time through [`SpecEngine`] with `config` (steps, topk,
/// num_draft_tokens; greedy) and the serving taps `taps`.
/// The first exchange of a dumped conversation as a serving request: the tokens before the
/// first assistant token (the prompt, chat template included) and the length of that first
/// assistant run (its content and end-of-turn token). Run online with that budget and greedy
/// decoding, a dump regenerated by the target is re-generated token for token, so online and
/// offline acceptance measure the same text (`tandem compare --prompts dump`).
pub fn first_turn(input_ids: &[u32], loss_mask: &[u8]) -> Option<(Vec<u32>, usize)> {
    let start = loss_mask.iter().position(|&m| m == 1)?;
    let len = loss_mask[start..].iter().take_while(|&&m| m == 1).count();
    (start > 0).then(|| (input_ids[..start].to_vec(), len))
}

/// Online acceptance on the dump's own first exchanges (see [`first_turn`]): each sample's
/// prompt generated with its own token budget, by `engine` (the burn engine, or the CUDA fast
/// path's on `--device cuda`).
pub fn online_acceptance_on_dump(
    engine: &dyn SpecGenerate,
    dump: &DumpReader,
    max_samples: usize,
    stop_ids: &[u32],
) -> Result<OnlineAcceptance, ReplayError> {
    let mut total = OnlineAcceptance {
        prompts: 0,
        tokens: 0,
        stats: AcceptanceStats::new(engine.config().num_steps),
        per_prompt: Vec::new(),
    };
    for index in 0..dump.len().min(max_samples) {
        let record = dump.read(index)?;
        let Some((prompt, budget)) = first_turn(&record.input_ids, &record.loss_mask) else {
            continue;
        };
        let one = online_acceptance(engine, std::slice::from_ref(&prompt), budget, stop_ids)?;
        total.prompts += one.prompts;
        total.tokens += one.tokens;
        total.stats.merge(&one.stats);
        total.per_prompt.extend(one.per_prompt);
    }
    Ok(total)
}

/// Online acceptance of `engine` on `prompts` (one at a time, greedy as configured).
pub fn online_acceptance(
    engine: &dyn SpecGenerate,
    prompts: &[Vec<u32>],
    max_new_tokens: usize,
    stop_ids: &[u32],
) -> Result<OnlineAcceptance, ReplayError> {
    let mut stats = AcceptanceStats::new(engine.config().num_steps);
    let mut tokens = 0;
    let mut per_prompt = Vec::with_capacity(prompts.len());
    for prompt in prompts {
        let out = engine.generate(std::slice::from_ref(prompt), max_new_tokens, stop_ids)?;
        for seq in out.sequences {
            tokens += seq.tokens.len();
            stats.merge(&seq.stats);
            per_prompt.push(seq.stats.clone());
        }
    }
    Ok(OnlineAcceptance {
        prompts: prompts.len(),
        tokens,
        stats,
        per_prompt,
    })
}

/// What is compared: the dump, the head, the prompts, and the serving tree settings.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CompareSetup {
    /// The dump.
    pub dump: String,
    /// The head.
    pub head: String,
    /// The prompt set.
    pub prompts: String,
    /// Draft depth (SGLang `--speculative-num-steps`).
    pub steps: usize,
    /// Branching (`--speculative-eagle-topk`); 1 = chain.
    pub topk: usize,
    /// Tree size verified, root included (`--speculative-num-draft-tokens`).
    pub num_draft_tokens: usize,
}

impl CompareSetup {
    /// `chain of 3 drafts` or `tree steps 3, topk 4, 8 draft tokens`.
    pub fn describe(&self) -> String {
        if self.topk == 1 {
            format!(
                "chain of {} drafts",
                self.steps.min(self.num_draft_tokens - 1)
            )
        } else {
            format!(
                "tree steps {}, topk {}, {} draft tokens",
                self.steps, self.topk, self.num_draft_tokens
            )
        }
    }
}

/// When a gap is flagged: offline above online by more than `z` standard errors of the gap.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct GapTest {
    /// Standard errors of the gap above which it is flagged (one-sided: offline higher).
    pub z: f64,
}

impl Default for GapTest {
    /// Three standard errors: a real gap of a few percent (a one-block shift) stands out once
    /// enough rounds are measured, and noise alone trips it about once in 700 comparisons.
    fn default() -> Self {
        GapTest { z: 3.0 }
    }
}

/// The inputs of `tandem compare` checked against the head before anything is measured:
/// offline feeds the head the dump's recorded taps and online feeds it serving's, so both must
/// be what the head was trained on (`trained`: its Tandem manifest, or for a foreign head the
/// taps its ids are read as). Returns the fatal mismatches of [`check`] as sentences, each
/// naming the pair that disagrees; advisories (a dtype change) are left out.
pub fn compare_wiring(
    trained: &WiringManifest,
    dump: &WiringManifest,
    serving: &WiringManifest,
) -> Vec<String> {
    let pairs = [
        ("the dump (offline) against the head", dump),
        ("serving (online) against the head", serving),
    ];
    let mut out = Vec::new();
    for (pair, actual) in pairs {
        for m in check(trained, actual).iter().filter(|m| m.is_fatal()) {
            // The mismatch's Display carries its hint (the pattern behind it).
            out.push(format!("{pair}: {m}"));
        }
    }
    out
}

/// Offline next to online acceptance, and whether the gap is beyond the sampling error.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CompareReport {
    /// What was compared.
    pub setup: CompareSetup,
    /// Teacher-forced (TTT) counts, the trainer's view (`None` where the head ran on the CUDA
    /// fast path, which has no training-time-test forward: drafted and online are then both
    /// measured with the fast path's head).
    pub offline: Option<OfflineAcceptance>,
    /// `acc_i` per step (teacher-forced; empty without it).
    pub offline_acc: Vec<f64>,
    /// Teacher-forced chain: conditional acceptance per draft position (empty without it).
    pub offline_per_position: Vec<f64>,
    /// Teacher-forced chain: implied accept length.
    pub offline_accept_length: Option<f64>,
    /// The engine's drafting with the serving settings on the recorded taps.
    pub drafted: DraftedAcceptance,
    /// Its conditional acceptance per draft position.
    pub drafted_per_position: Vec<f64>,
    /// Its accept length.
    pub drafted_accept_length: f64,
    /// Its standard error (over rounds and over samples, the larger).
    pub drafted_accept_length_se: Option<f64>,
    /// Online statistics.
    pub online: OnlineAcceptance,
    /// Online conditional acceptance per draft position.
    pub online_per_position: Vec<f64>,
    /// Online accept length.
    pub online_accept_length: f64,
    /// Its standard error (over rounds and over prompts, the larger).
    pub online_accept_length_se: Option<f64>,
    /// `drafted_per_position - online_per_position`.
    pub gap: Vec<f64>,
    /// Standard error of each position's gap (`None`: a side never reached it).
    pub gap_se: Vec<Option<f64>>,
    /// `drafted_accept_length - online_accept_length`.
    pub accept_length_gap: f64,
    /// Its standard error (`None`: too few rounds or prompts to estimate it).
    pub accept_length_gap_se: Option<f64>,
    /// `(drafted - online) / drafted` accept length.
    pub relative_gap: f64,
    /// The flagging rule.
    pub test: GapTest,
    /// Positions whose gap is flagged.
    pub flagged_positions: Vec<bool>,
    /// Whether the accept-length gap is flagged.
    pub accept_length_flagged: bool,
    /// Whether any gap is flagged (or the inputs' wiring disagreed, see
    /// [`CompareReport::with_wiring_mismatches`]).
    pub flagged: bool,
    /// One sentence per flagged finding, or a sentence saying the two agree; notes follow.
    pub verdict: Vec<String>,
}

impl CompareReport {
    /// Puts offline and online side by side and flags each draft position, and the accept
    /// length, whose offline (drafted) value exceeds the online one by more than `test.z`
    /// standard errors of the gap (the two sides' errors combined as independent).
    pub fn new(
        setup: CompareSetup,
        offline: Option<OfflineAcceptance>,
        drafted: DraftedAcceptance,
        online: OnlineAcceptance,
        test: GapTest,
    ) -> Self {
        let steps = setup.steps;
        let mut drafted_per_position = drafted.stats.per_position();
        drafted_per_position.resize(steps, 0.0);
        let mut online_per_position = online.stats.per_position();
        online_per_position.resize(steps, 0.0);
        let gap: Vec<f64> = drafted_per_position
            .iter()
            .zip(&online_per_position)
            .map(|(a, b)| a - b)
            .collect();
        let gap_se: Vec<Option<f64>> = (0..steps)
            .map(|i| {
                let d = position_se(&drafted.stats, &drafted.per_sample, i)?;
                let o = position_se(&online.stats, &online.per_prompt, i)?;
                Some(d.hypot(o))
            })
            .collect();
        let drafted_accept_length = drafted.stats.accept_length();
        let online_accept_length = online.stats.accept_length();
        let drafted_accept_length_se = accept_length_se(&drafted.stats, &drafted.per_sample);
        let online_accept_length_se = accept_length_se(&online.stats, &online.per_prompt);
        let accept_length_gap = drafted_accept_length - online_accept_length;
        let accept_length_gap_se = match (drafted_accept_length_se, online_accept_length_se) {
            (Some(d), Some(o)) => Some(d.hypot(o)),
            _ => None,
        };
        let relative_gap = relative_gap(drafted_accept_length, online_accept_length);
        let beyond = |gap: f64, se: Option<f64>| se.is_some_and(|se| gap > test.z * se);
        let flagged_positions: Vec<bool> = (0..steps).map(|i| beyond(gap[i], gap_se[i])).collect();
        let accept_length_flagged = beyond(accept_length_gap, accept_length_gap_se);
        let pointer = format!(
            "the head is served something other than it was trained on (taps, template or \
             tokenizer); run `tandem replay --dump {} --head {}` and `tandem diagnose --head {}`",
            setup.dump, setup.head, setup.head
        );
        let sigmas = |gap: f64, se: f64| if se > 0.0 { gap / se } else { f64::INFINITY };
        let mut verdict = Vec::new();
        for i in 0..steps {
            if flagged_positions[i] {
                let se = gap_se[i].expect("flagged gaps have one");
                verdict.push(format!(
                    "draft position {i}: offline acceptance {:.3} but online {:.3}: {:.3} lower, \
                     {:.1} standard errors (se {se:.3}; flagged above {}): {pointer}",
                    drafted_per_position[i],
                    online_per_position[i],
                    gap[i],
                    sigmas(gap[i], se),
                    test.z
                ));
            }
        }
        if accept_length_flagged {
            let se = accept_length_gap_se.expect("a flagged gap has one");
            verdict.push(format!(
                "accept length: offline {drafted_accept_length:.3} but online \
                 {online_accept_length:.3} ({:.1}% lower, {:.1} standard errors, se {se:.3}; \
                 flagged above {}): {pointer}",
                100.0 * relative_gap,
                sigmas(accept_length_gap, se),
                test.z
            ));
        }
        let flagged = !verdict.is_empty();
        if !flagged {
            verdict.push(match accept_length_gap_se {
                Some(se) => format!(
                    "offline and online acceptance agree within the sampling error: accept \
                     length offline {drafted_accept_length:.3}, online {online_accept_length:.3} \
                     (online {:+.1}% of offline; gap {accept_length_gap:+.3}, se {se:.3}, \
                     {:+.1} standard errors; flagged above {})",
                    -100.0 * relative_gap,
                    if se > 0.0 {
                        accept_length_gap / se
                    } else {
                        0.0
                    },
                    test.z
                ),
                None => format!(
                    "accept length offline {drafted_accept_length:.3}, online \
                     {online_accept_length:.3} (online {:+.1}% of offline): too few rounds or \
                     prompts to estimate the sampling error, so nothing is flagged",
                    -100.0 * relative_gap
                ),
            });
        }
        if drafted.greedy_checked > 0 && drafted.greedy_share() < 0.99 {
            verdict.push(format!(
                "note: {:.1}% of the dump's assistant tokens are not the target's greedy choice \
                 (not regenerated by this target, or sampled): past such a token the offline \
                 walk follows the target's argmax on the dumped prefix, an approximation",
                100.0 * (1.0 - drafted.greedy_share())
            ));
        }
        CompareReport {
            setup,
            offline_acc: offline.as_ref().map(|o| o.acc()).unwrap_or_default(),
            offline_per_position: offline
                .as_ref()
                .map(|o| o.per_position())
                .unwrap_or_default(),
            offline_accept_length: offline.as_ref().map(|o| o.implied_accept_length()),
            offline,
            drafted_per_position,
            drafted_accept_length,
            drafted_accept_length_se,
            drafted,
            online_accept_length,
            online_accept_length_se,
            online_per_position,
            online,
            gap,
            gap_se,
            accept_length_gap,
            accept_length_gap_se,
            relative_gap,
            test,
            flagged_positions,
            accept_length_flagged,
            flagged,
            verdict,
        }
    }

    /// Measured although the inputs' wiring disagreed (`tandem compare --allow-mismatch`): the
    /// mismatch sentences lead the verdict and the report is flagged, whatever the gap.
    pub fn with_wiring_mismatches(mut self, sentences: Vec<String>) -> Self {
        if sentences.is_empty() {
            return self;
        }
        let mut verdict: Vec<String> = sentences
            .into_iter()
            .map(|s| format!("wiring mismatch (measured anyway): {s}"))
            .collect();
        verdict.append(&mut self.verdict);
        self.verdict = verdict;
        self.flagged = true;
        self
    }

    /// Terminal table.
    pub fn to_table(&self) -> String {
        let s = &self.setup;
        let mut out = String::new();
        let _ = writeln!(
            out,
            "compare {} ({}) on {} ({} samples, {} offline rounds at {}) vs {} ({} prompts, {} \
             tokens, {} online rounds)",
            s.head,
            s.describe(),
            s.dump,
            self.drafted.samples,
            self.drafted.stats.rounds,
            positions_label(self.drafted.positions),
            s.prompts,
            self.online.prompts,
            self.online.tokens,
            self.online.stats.rounds
        );
        // The per-position table is the report's polars frame (`positions_frame`), as exported.
        match self.positions_frame() {
            Ok(frame) => {
                let _ = writeln!(out, "{}", tandem_stats::render(&frame));
            }
            Err(e) => {
                let _ = writeln!(out, "(the per-position table could not be built: {e})");
            }
        }
        let _ = writeln!(
            out,
            "accept length: offline {:.3} (se {}), online {:.3} (se {}): online {:+.1}% of offline; TTT chain implied {}",
            self.drafted_accept_length,
            fmt_opt(self.drafted_accept_length_se.as_ref()),
            self.online_accept_length,
            fmt_opt(self.online_accept_length_se.as_ref()),
            -100.0 * self.relative_gap,
            fmt_opt(self.offline_accept_length.as_ref())
        );
        for v in &self.verdict {
            let label = if v.starts_with("note:") {
                "note"
            } else if self.flagged {
                "FLAG"
            } else {
                "ok"
            };
            let _ = writeln!(out, "{label}: {}", v.trim_start_matches("note: "));
        }
        out
    }

    /// Self-contained HTML with an inline SVG plot of acceptance per position.
    pub fn to_html(&self) -> String {
        let s = &self.setup;
        let mut b = String::new();
        let _ = write!(
            b,
            "<h1>Tandem compare <span class=\"badge {}\">{}</span></h1><p>Head <code>{}</code>, \
             {}. Offline: the engine's drafting fed the recorded taps of dump <code>{}</code> \
             ({} samples, {} rounds at {}), walked with the target's greedy tokens. Online: the \
             speculative engine on prompts <code>{}</code> ({} prompts, {} tokens, {} rounds, \
             greedy).</p>",
            if self.flagged { "bad" } else { "ok" },
            if self.flagged {
                "gap flagged"
            } else {
                "consistent"
            },
            escape(&s.head),
            escape(&s.describe()),
            escape(&s.dump),
            self.drafted.samples,
            self.drafted.stats.rounds,
            positions_label(self.drafted.positions),
            escape(&s.prompts),
            self.online.prompts,
            self.online.tokens,
            self.online.stats.rounds
        );
        b.push_str(&self.svg());
        b.push_str(
            "<table><tr><th>position</th><th>TTT acc_i</th><th>TTT chain</th>\
             <th>offline</th><th>online</th><th>gap</th></tr>",
        );
        for i in 0..s.steps {
            let class = if self.flagged_positions[i] {
                "bad"
            } else {
                "ok"
            };
            let _ = write!(
                b,
                "<tr><td>{i}</td><td>{}</td><td>{}</td><td>{:.3}</td><td>{:.3}</td>\
                 <td class={class}>{:+.3}</td></tr>",
                fmt_opt(self.offline_acc.get(i)),
                fmt_opt(self.offline_per_position.get(i)),
                self.drafted_per_position[i],
                self.online_per_position[i],
                self.gap[i]
            );
        }
        let class = if self.accept_length_flagged {
            "bad"
        } else {
            "ok"
        };
        let _ = write!(
            b,
            "</table><p>Accept length: offline {:.3}, online {:.3}, online \
             <span class={class}>{:+.1}%</span> of offline; teacher-forced chain (implied) \
             {}.</p><ul>",
            self.drafted_accept_length,
            self.online_accept_length,
            -100.0 * self.relative_gap,
            fmt_opt(self.offline_accept_length.as_ref())
        );
        for v in &self.verdict {
            let _ = write!(b, "<li>{}</li>", escape(v));
        }
        b.push_str("</ul>");
        html_page("Tandem compare", &b)
    }

    fn svg(&self) -> String {
        let (w, h, pad) = (520.0, 260.0, 40.0);
        let n = self.setup.steps.max(1);
        let x = |i: usize| {
            if n == 1 {
                pad + (w - 2.0 * pad) / 2.0
            } else {
                pad + (w - 2.0 * pad) * i as f64 / (n - 1) as f64
            }
        };
        let y = |v: f64| h - pad - (h - 2.0 * pad) * v.clamp(0.0, 1.0);
        let mut s = format!(
            "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" \
             viewBox=\"0 0 {w} {h}\" role=\"img\"><rect width=\"{w}\" height=\"{h}\" \
             fill=\"#fff\"/>"
        );
        for k in 0..=4 {
            let v = f64::from(k) / 4.0;
            let _ = write!(
                s,
                "<line x1=\"{pad}\" x2=\"{}\" y1=\"{y0}\" y2=\"{y0}\" stroke=\"#e3e6ee\"/>\
                 <text x=\"6\" y=\"{}\" font-size=\"11\">{v:.2}</text>",
                w - pad,
                y(v) + 4.0,
                y0 = y(v)
            );
        }
        for i in 0..self.setup.steps {
            let _ = write!(
                s,
                "<text x=\"{}\" y=\"{}\" font-size=\"11\" text-anchor=\"middle\">{i}</text>",
                x(i),
                h - pad + 16.0
            );
        }
        let ttt: Vec<f64> = self
            .offline_per_position
            .iter()
            .copied()
            .take(self.setup.steps)
            .collect();
        for (values, colour, label, dy, dash) in [
            (
                &ttt,
                "#9e9e9e",
                "TTT chain",
                0.0,
                " stroke-dasharray=\"4 3\"",
            ),
            (
                &self.drafted_per_position,
                "#1565c0",
                "offline (drafted)",
                14.0,
                "",
            ),
            (&self.online_per_position, "#c62828", "online", 28.0, ""),
        ] {
            let points: Vec<String> = values
                .iter()
                .enumerate()
                .map(|(i, v)| format!("{:.1},{:.1}", x(i), y(*v)))
                .collect();
            let _ = write!(
                s,
                "<polyline fill=\"none\" stroke=\"{colour}\" stroke-width=\"2\"{dash} \
                 points=\"{}\"/>",
                points.join(" ")
            );
            for (i, v) in values.iter().enumerate() {
                let _ = write!(
                    s,
                    "<circle cx=\"{:.1}\" cy=\"{:.1}\" r=\"3\" fill=\"{colour}\"/>",
                    x(i),
                    y(*v)
                );
            }
            let _ = write!(
                s,
                "<text x=\"{}\" y=\"{}\" font-size=\"12\" fill=\"{colour}\">{label}</text>",
                w - pad - 120.0,
                pad - 22.0 + dy
            );
        }
        let _ = write!(
            s,
            "<text x=\"{}\" y=\"{}\" font-size=\"11\" text-anchor=\"middle\">draft position</text></svg>",
            w / 2.0,
            h - 6.0
        );
        s
    }
}

/// `(offline - online) / offline`, 0 when there is no offline accept length.
pub fn relative_gap(offline: f64, online: f64) -> f64 {
    if offline <= 0.0 {
        0.0
    } else {
        (offline - online) / offline
    }
}

fn positions_label(positions: OfflinePositions) -> &'static str {
    match positions {
        OfflinePositions::Rounds => "serving's round positions",
        OfflinePositions::Every => "every position",
    }
}

fn fmt_opt(v: Option<&f64>) -> String {
    v.map_or_else(|| "-".to_owned(), |v| format!("{v:.3}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;
    use tandem_wiring::TapId;

    /// Hand-worked: n = 5, 2 steps, loss mask all on. argmax = [a0..a4] = [10, 11, 12, 13, 14].
    /// Step 0 at t predicts argmax[t+1]: proposals [11, 12, 99, 14, x] -> correct at t = 0, 1, 3
    /// (t = 4 has no next token) -> acc_0 = 3/4. Step 1 at t predicts argmax[t+2]: proposals
    /// [12, 99, 14, x, x] -> correct at t = 0, 2 of t = 0..2 -> acc_1 = 2/3.
    /// Chain positions t with t + 2 < 5: t = 0, 1, 2. t = 0: both correct (2 accepted);
    /// t = 1: step 0 correct, step 1 wrong (1); t = 2: step 0 wrong (0).
    /// reached = [3, 2], accepted = [2, 1]; implied tau = 1 + 3/3 = 2.
    #[test]
    fn offline_counts_by_hand() {
        let mut o = OfflineAcceptance::new(2);
        let draft = vec![vec![11, 12, 99, 14, 0], vec![12, 99, 14, 0, 0]];
        o.add_sample(&draft, &[10, 11, 12, 13, 14], &[1; 5]);
        assert_eq!(
            (o.correct.clone(), o.denominators.clone()),
            (vec![3, 2], vec![4, 3])
        );
        assert_eq!(
            (o.reached.clone(), o.accepted.clone()),
            (vec![3, 2], vec![2, 1])
        );
        assert_eq!(o.chain_positions, 3);
        assert!((o.implied_accept_length() - 2.0).abs() < 1e-12);
        assert_eq!(o.per_position(), vec![2.0 / 3.0, 0.5]);
    }

    /// A prompt of 3 tokens (mask 0) and an assistant turn of 7 (mask 1), n = 10, 3 steps.
    /// Rounds: the first root is the turn's first token 3, so slot 2; accepting 2 drafts moves
    /// the root to token 3 + 3 = 6 (slot 5); accepting none there moves it one token (slot 6,
    /// where 6 + 3 < 10 still holds); slot 7 fails it, so the sample ends.
    #[test]
    fn rounds_start_at_the_turn_and_follow_the_accepted_drafts() {
        let mask = [0, 0, 0, 1, 1, 1, 1, 1, 1, 1];
        let r = OfflinePositions::Rounds;
        assert_eq!(next_draft_slot(&mask, 3, r, None), Some(2));
        assert_eq!(next_draft_slot(&mask, 3, r, Some((2, 2))), Some(5));
        assert_eq!(next_draft_slot(&mask, 3, r, Some((5, 0))), Some(6));
        assert_eq!(next_draft_slot(&mask, 3, r, Some((6, 0))), None);
        // Every: slots with mask on and t + 3 < 10: 3..=6.
        let e = OfflinePositions::Every;
        let mut slots = vec![next_draft_slot(&mask, 3, e, None).unwrap()];
        while let Some(t) = next_draft_slot(&mask, 3, e, Some((*slots.last().unwrap(), 2))) {
            slots.push(t);
        }
        assert_eq!(slots, vec![3, 4, 5, 6]);
    }

    /// Two turns: [user 0..2][assistant 2..5][user 5..7][assistant 7..12]. A round accepting
    /// past the first turn's end continues at the second turn's first token (slot 6), which
    /// serving's prefill of the next turn would produce; a one-token turn has no round.
    #[test]
    fn rounds_move_on_to_the_next_turn() {
        let mask = [0, 0, 1, 1, 1, 0, 0, 1, 1, 1, 1, 1, 0, 0, 0];
        let r = OfflinePositions::Rounds;
        assert_eq!(next_draft_slot(&mask, 2, r, None), Some(1));
        assert_eq!(next_draft_slot(&mask, 2, r, Some((1, 1))), Some(6));
        assert_eq!(next_draft_slot(&mask, 2, r, Some((6, 3))), None);
        assert_eq!(next_draft_slot(&[0, 1, 0, 0, 0], 1, r, None), None);
    }

    /// The walk of a hand-made tree drafted at slot 4: root (token 9) -> {a = 5, b = 6},
    /// a -> {c = 7}. The target's argmax after the prefix 0..=5 is argmax[5] = 6, so b is
    /// accepted and a, c are not; after b (depth 1) the target wants argmax[6] = 1, which b
    /// has no child for: one draft accepted.
    #[test]
    fn the_offline_walk_reads_the_target_argmax_by_depth() {
        let tree = DraftTree::from_parents(vec![9, 5, 6, 7], vec![None, Some(0), Some(0), Some(1)]);
        let argmax = [0, 0, 0, 0, 0, 6, 1, 2];
        let targets = node_targets(&tree, &argmax, 4);
        assert_eq!(targets, vec![6, 1, 1, 2]);
        let acc = verify_greedy(&tree, &targets);
        assert_eq!(acc.accepted, vec![2]);
        // Past the sample's end there is no target token.
        assert_eq!(
            node_targets(&tree, &argmax, 6),
            vec![2, u32::MAX, u32::MAX, u32::MAX]
        );
        assert!(
            verify_greedy(&tree, &node_targets(&tree, &argmax, 7))
                .accepted
                .is_empty()
        );
    }

    fn online(accepted: &[usize], depth: usize) -> OnlineAcceptance {
        let mut stats = AcceptanceStats::new(depth);
        for &a in accepted {
            stats.record(a, depth);
        }
        OnlineAcceptance {
            prompts: 1,
            tokens: accepted.iter().map(|a| a + 1).sum(),
            per_prompt: vec![stats.clone()],
            stats,
        }
    }

    fn drafted(accepted: &[usize], depth: usize) -> DraftedAcceptance {
        let online = online(accepted, depth);
        DraftedAcceptance {
            positions: OfflinePositions::Rounds,
            samples: 1,
            per_sample: online.per_prompt,
            stats: online.stats,
            greedy_checked: 10,
            greedy_equal: 10,
        }
    }

    fn setup(steps: usize, topk: usize, num_draft_tokens: usize) -> CompareSetup {
        CompareSetup {
            dump: "d".into(),
            head: "h".into(),
            prompts: "p".into(),
            steps,
            topk,
            num_draft_tokens,
        }
    }

    #[test]
    fn a_large_gap_is_flagged() {
        let r = CompareReport::new(
            setup(2, 1, 3),
            Some(OfflineAcceptance::new(2)),
            drafted(&[2; 10], 2),
            online(&[0; 10], 2),
            GapTest::default(),
        );
        assert!(r.flagged);
        assert!(
            r.verdict[0].starts_with(
                "draft position 0: offline acceptance 1.000 but online 0.000: 1.000 lower"
            ),
            "{:?}",
            r.verdict
        );
        // 3 vs 1 tokens per round: two thirds lower.
        assert!((r.relative_gap - 2.0 / 3.0).abs() < 1e-12);
        assert!(
            r.verdict.iter().any(
                |v| v.starts_with("accept length: offline 3.000 but online 1.000 (66.7% lower")
            ),
            "{:?}",
            r.verdict
        );
        assert!(r.to_html().contains("<svg"));
    }

    /// The same 22.5% shortfall (offline: every round accepts 3 drafts, tau 4; online: 6 of 3,
    /// 1 of 2, 1 of 1, 2 of 0, tau 3.1) is within the noise over 10 rounds (se 0.407: 2.2
    /// standard errors) and flagged over 100 (se 0.123: 7.3): the verdict follows the sampling
    /// error, not a fixed tolerance.
    #[test]
    fn a_gap_is_flagged_only_beyond_its_sampling_error() {
        let far = [3, 3, 3, 3, 3, 3, 2, 1, 0, 0];
        let r = CompareReport::new(
            setup(4, 4, 8),
            Some(OfflineAcceptance::new(4)),
            drafted(&[3; 10], 4),
            online(&far, 4),
            GapTest::default(),
        );
        assert!((r.relative_gap - 0.225).abs() < 1e-12);
        let se = r.accept_length_gap_se.unwrap();
        assert!((se - (1.49f64 / 9.0).sqrt()).abs() < 1e-9, "{se}");
        assert!(!r.flagged, "{:?}", r.verdict);
        assert!(
            r.verdict[0].starts_with(
                "offline and online acceptance agree within the sampling error: accept length \
                 offline 4.000, online 3.100 (online -22.5% of offline; gap +0.900, se 0.407"
            ),
            "{:?}",
            r.verdict
        );
        assert!(r.to_table().contains("online -22.5% of offline"));
        assert!(
            r.to_table()
                .contains("tree steps 4, topk 4, 8 draft tokens")
        );
        let many: Vec<usize> = far.iter().cycle().take(100).copied().collect();
        let r = CompareReport::new(
            setup(4, 4, 8),
            Some(OfflineAcceptance::new(4)),
            drafted(&[3; 100], 4),
            online(&many, 4),
            GapTest::default(),
        );
        assert!(r.flagged);
        assert!(r.accept_length_flagged);
        assert!(r.flagged_positions[0], "0.200 lower at 4.9 standard errors");
        let line = r
            .verdict
            .iter()
            .find(|v| v.starts_with("accept length:"))
            .unwrap();
        assert!(
            line.starts_with(
                "accept length: offline 4.000 but online 3.100 (22.5% lower, 7.3 standard errors"
            ),
            "{line}"
        );
    }

    /// Online above offline is reported with the same sign in the verdict and the table (the
    /// old report printed -1.4% in one and +1.4% in the other).
    #[test]
    fn the_gap_has_one_sign_everywhere() {
        let r = CompareReport::new(
            setup(2, 1, 3),
            Some(OfflineAcceptance::new(2)),
            drafted(&[1, 0, 1, 0, 1, 0, 1, 0], 2),
            online(&[1, 1, 1, 0, 1, 1, 1, 0], 2),
            GapTest::default(),
        );
        assert!(!r.flagged);
        assert!(
            r.verdict[0].contains("online +16.7% of offline"),
            "{:?}",
            r.verdict
        );
        assert!(r.to_table().contains("online +16.7% of offline"));
        assert!(r.to_html().contains("+16.7%</span> of offline"));
    }

    /// The committed head's own manifest against a dump captured with `embed` in slot 0 (the
    /// case `compare` used to call "ok"): one fatal sentence, naming the pair and slot 0; a
    /// serving manifest that differs only in dtype passes.
    #[test]
    fn compare_wiring_names_the_slot_a_dump_disagrees_on() {
        let config = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../heads/smollm2-135m-eagle3/config.json");
        let config: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(config).unwrap()).unwrap();
        let trained: WiringManifest =
            serde_json::from_value(config["tandem_wiring"].clone()).unwrap();
        assert_eq!(
            trained.taps,
            vec![TapId::Block(1), TapId::Block(14), TapId::Block(26)]
        );
        let mut dump = trained.clone();
        dump.taps[0] = TapId::Embed;
        let mut serving = trained.clone();
        serving.dtype = "f32".to_owned();
        let sentences = compare_wiring(&trained, &dump, &serving);
        assert_eq!(sentences.len(), 1, "{sentences:?}");
        assert!(
            sentences[0].starts_with(
                "the dump (offline) against the head: slot 0: trained on block 1, served embed"
            ),
            "{sentences:?}"
        );
        assert!(compare_wiring(&trained, &trained, &serving).is_empty());
        let mut shifted = trained.clone();
        shifted.taps = vec![TapId::Block(0), TapId::Block(13), TapId::Block(25)];
        let sentences = compare_wiring(&trained, &trained, &shifted);
        assert_eq!(sentences.len(), 3, "{sentences:?}");
        assert!(sentences[0].starts_with("serving (online) against the head: slot 0"));
        assert!(
            sentences[0].contains("every slot is off by -1 block"),
            "{sentences:?}"
        );
    }

    #[test]
    fn a_wiring_mismatch_measured_anyway_leads_the_verdict_and_flags() {
        let r = CompareReport::new(
            setup(2, 1, 3),
            Some(OfflineAcceptance::new(2)),
            drafted(&[1; 8], 2),
            online(&[1; 8], 2),
            GapTest::default(),
        );
        assert!(!r.flagged);
        let r = r.with_wiring_mismatches(vec!["slot 0: trained on block 1, dump has embed".into()]);
        assert!(r.flagged);
        assert!(r.verdict[0].starts_with("wiring mismatch (measured anyway): slot 0"));
    }

    #[test]
    fn first_turn_is_the_prompt_before_the_first_assistant_run() {
        let ids = [1, 2, 3, 10, 11, 12, 4, 5, 20, 21];
        let mask = [0, 0, 0, 1, 1, 1, 0, 0, 1, 1];
        assert_eq!(first_turn(&ids, &mask), Some((vec![1, 2, 3], 3)));
        assert_eq!(first_turn(&ids, &[0; 10]), None, "no assistant token");
        assert_eq!(first_turn(&ids, &[1; 10]), None, "no prompt before it");
    }

    /// The report's tables are polars frames holding its numbers: drafted every round 2 of 2
    /// (per position 1, 1; accept length 3) against online 2,2,2,2,2,1,1,0,0,0 (position 0:
    /// 7 of 10, position 1: 5 of 7; accept length 2.2); both export as CSV and Parquet.
    #[test]
    fn the_tables_are_frames_of_the_reports_numbers() {
        let r = CompareReport::new(
            setup(2, 1, 3),
            Some(OfflineAcceptance::new(2)),
            drafted(&[2; 10], 2),
            online(&[2, 2, 2, 2, 2, 1, 1, 0, 0, 0], 2),
            GapTest::default(),
        );
        let positions = r.positions_frame().unwrap();
        let column = |name| tandem_stats::column_f64s(&positions, name).unwrap();
        assert_eq!(column("position"), [0.0, 1.0]);
        assert_eq!(column("offline"), [1.0, 1.0]);
        let online = column("online");
        assert!((online[0] - 0.7).abs() < 1e-12 && (online[1] - 5.0 / 7.0).abs() < 1e-12);
        let gap = column("gap");
        assert!((gap[0] - 0.3).abs() < 1e-12 && (gap[1] - 2.0 / 7.0).abs() < 1e-12);
        let (se, z) = (column("gap_se"), column("z"));
        for i in 0..2 {
            assert_eq!(se[i], r.gap_se[i].unwrap());
            assert!((z[i] - gap[i] / se[i]).abs() < 1e-12);
        }
        let lengths = r.accept_length_frame().unwrap();
        let length = tandem_stats::column_f64s(&lengths, "accept_length").unwrap();
        assert_eq!(
            tandem_stats::column_strings(&lengths, "measure").unwrap(),
            ["offline", "online", "gap", "ttt_chain"]
        );
        assert!((length[0] - 3.0).abs() < 1e-12 && (length[1] - 2.2).abs() < 1e-12);
        assert!((length[2] - 0.8).abs() < 1e-12);
        let rounds = tandem_stats::column_f64s(&lengths, "rounds").unwrap();
        assert_eq!(&rounds[..2], [10.0, 10.0]);
        assert!(rounds[2].is_nan(), "the gap has no rounds: null");
        // The terminal table prints the frame.
        let table = r.to_table();
        assert!(
            table.contains("position  ttt_acc  ttt_chain  offline  online    gap"),
            "{table}"
        );
        let dir =
            std::env::temp_dir().join(format!("tandem-compare-export-{}", std::process::id()));
        for format in ["csv", "parquet"] {
            let written = tandem_stats::export_tables(&dir, format, &r.tables().unwrap()).unwrap();
            assert_eq!(
                written,
                [
                    dir.join(format!("compare_positions.{format}")),
                    dir.join(format!("compare_accept_length.{format}"))
                ]
            );
        }
        let csv = std::fs::read_to_string(dir.join("compare_accept_length.csv")).unwrap();
        assert!(
            csv.starts_with("measure,accept_length,se,z,rounds,units,flagged\noffline,3.0,"),
            "{csv}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
