//! What a replay found: one [`SlotReport`] per dumped slot with its verdict sentence, and
//! [`Finding`]s about the dump as a whole (fingerprints, widths, dtypes, the head).

use serde::Serialize;
use tandem_wiring::TapId;

use crate::candidate::Candidate;
use crate::score::Tolerance;

/// How serious a [`Finding`] is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Level {
    /// Context (tolerances, widths that agree).
    Info,
    /// Numerics may drift; the wiring is right.
    Warning,
    /// A head trained on this dump would not see what serving feeds it.
    Error,
}

/// One sentence about the dump, the target or the head.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Finding {
    /// Error, warning or information.
    pub level: Level,
    /// What it is about: `fingerprint`, `width`, `dtype`, `pattern`, `head`, `tokens`,
    /// `last-hidden`.
    pub topic: &'static str,
    /// The sentence.
    pub message: String,
}

impl Finding {
    pub(crate) fn new(level: Level, topic: &'static str, message: impl Into<String>) -> Self {
        Finding {
            level,
            topic,
            message: message.into(),
        }
    }
}

/// A slot's verdict.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Status {
    /// The slot holds what the manifest promises and serving feeds the head the same tap.
    Match,
    /// Anything else; the verdict sentence says what.
    Mismatch,
}

/// Columns `index * width .. (index + 1) * width` of a tap: one of `of` tensor-parallel shards.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Shard {
    /// Which shard (0-based).
    pub index: usize,
    /// How many shards make the whole tap (T / slot width).
    pub of: usize,
}

/// How closely a dumped slot follows one candidate, over all replayed tokens.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Score {
    /// The recomputed value.
    pub candidate: Candidate,
    /// The column shard compared, when the slot is narrower than the target's hidden size.
    pub shard: Option<Shard>,
    /// Cosine similarity of all tokens' values as one vector.
    pub cosine: f64,
    /// `max |dump - recomputed| / max |recomputed|`.
    pub rel_err: f64,
    /// The worst token's cosine similarity.
    pub min_token_cosine: f64,
}

impl Score {
    /// `block 2 (cos 0.99998, rel 3.1e-3)`.
    pub fn short(&self) -> String {
        let shard = self
            .shard
            .map(|s| format!(" [shard {}/{}]", s.index, s.of))
            .unwrap_or_default();
        format!(
            "{}{shard} (cos {:.5}, rel {:.1e})",
            self.candidate, self.cosine, self.rel_err
        )
    }
}

/// Everything replay says about one dumped slot.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SlotReport {
    /// Slot index in the dump's aux row.
    pub slot: usize,
    /// Values per token in this slot (T unless sharded).
    pub width: usize,
    /// The tap the dump's manifest promises.
    pub manifest_tap: TapId,
    /// The tap serving would feed the head in this slot (`None`: serving feeds fewer slots).
    pub serving_tap: Option<TapId>,
    /// The best-matching candidate (`None` when the width makes comparison impossible).
    pub best: Option<Score>,
    /// The score against the manifest's tap.
    pub manifest_score: Option<Score>,
    /// What the slot holds, when the best candidate is within tolerance.
    pub observed: Option<Candidate>,
    /// The slot holds a normed value (it matches `final` or a normed layer input, or its
    /// per-token norms are flat while it matches nothing).
    pub normed: bool,
    /// Mean per-token L2 norm of the slot.
    pub mean_norm: f64,
    /// Coefficient of variation of the per-token norms.
    pub norm_cv: f64,
    /// Tokens whose row is all zeros.
    pub zero_tokens: usize,
    /// Tokens replayed.
    pub tokens: usize,
    /// Match or mismatch.
    pub status: Status,
    /// `match`, or a sentence naming the fault.
    pub verdict: String,
}

/// Whether `last_hidden` (from which the trainer recomputes target logits) holds the tap the
/// manifest says.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct LastHiddenReport {
    /// `last_hidden_tap` of the manifest (block L-1).
    pub manifest_tap: TapId,
    /// The best-matching candidate.
    pub best: Score,
    /// Match or mismatch.
    pub status: Status,
}

/// The result of `tandem replay`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ReplayReport {
    /// The dump directory.
    pub dump: String,
    /// The target model directory.
    pub model: String,
    /// The head directory, when one was given.
    pub head: Option<String>,
    /// Where the replay ran (`cpu`, `cuda`).
    pub device: String,
    /// Samples replayed.
    pub samples: usize,
    /// Tokens replayed.
    pub tokens: usize,
    /// The target's decoder blocks.
    pub num_layers: usize,
    /// The target's hidden size T.
    pub hidden_size: usize,
    /// What counts as a match.
    pub tolerance: Tolerance,
    /// The dump manifest's taps, slot order.
    pub manifest_taps: Vec<TapId>,
    /// The raw engine ids the dump was requested with, e.g. `sglang-heuristic:1,14,26`.
    pub raw_ids: Option<String>,
    /// What each slot was found to hold.
    pub observed: Vec<Option<Candidate>>,
    /// What serving would feed the head, slot order.
    pub serving_taps: Vec<TapId>,
    /// Where `serving_taps` come from.
    pub serving_basis: String,
    /// Sentences about the whole dump, errors first.
    pub findings: Vec<Finding>,
    /// One report per slot.
    pub slots: Vec<SlotReport>,
    /// The `last_hidden` column, when comparable.
    pub last_hidden: Option<LastHiddenReport>,
    /// Candidates, in the column order of `cosine`.
    pub candidates: Vec<Candidate>,
    /// `cosine[slot][candidate]`: similarity to every candidate (best shard).
    pub cosine: Vec<Vec<f64>>,
}

impl ReplayReport {
    /// Slots whose verdict is a mismatch.
    pub fn mismatched_slots(&self) -> Vec<&SlotReport> {
        self.slots
            .iter()
            .filter(|s| s.status == Status::Mismatch)
            .collect()
    }

    /// Findings at [`Level::Error`].
    pub fn errors(&self) -> Vec<&Finding> {
        self.findings
            .iter()
            .filter(|f| f.level == Level::Error)
            .collect()
    }

    /// No slot mismatch and no error finding: a head trained on this dump sees, when served
    /// on this target, exactly what it was trained on.
    pub fn ok(&self) -> bool {
        self.mismatched_slots().is_empty() && self.errors().is_empty()
    }

    /// Every problem as one sentence: slot verdicts first, then error findings.
    pub fn problems(&self) -> Vec<String> {
        self.mismatched_slots()
            .iter()
            .map(|s| s.verdict.clone())
            .chain(self.errors().iter().map(|f| f.message.clone()))
            .collect()
    }

    /// Pretty JSON.
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).expect("a report always serialises")
    }
}
