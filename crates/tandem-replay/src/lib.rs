//! `tandem replay`: re-runs the samples of a dump through the serving engine's target path and
//! names every way the dump, its manifest, the target and the head disagree. Also `compare`
//! (offline vs online acceptance, [`compare`]) and `diagnose` (which wiring a head was trained
//! with, measured on target-generated text, [`mod@diagnose`]).
//!
//! Each sample's `input_ids` go through one prefill of [`tandem_model::TargetModel::forward`]
//! (the block loop and capture hook the speculative loop uses) with every tap point requested:
//! `embed`, `block 0..L-1`, `final`, plus the normed input of every layer. Every dumped slot is
//! compared with every candidate over all tokens (cosine similarity and relative error, see
//! [`Tolerance`]); the best match is what the slot holds. The verdict of a slot compares that
//! with the tap the dump's manifest promises and the tap serving would feed the head
//! ([`HeadWiring`], from the head's config as `tandem bench` reads it).
//!
//! The report also checks the dump's target fingerprint against the model (tokenizer, chat
//! template, config: `tandem_wiring::check`), the aux width against `slots x T`, and the
//! dtypes. Faults are never errors: they are [`Finding`]s and slot verdicts, and
//! [`ReplayReport::ok`] is false when there is any.
//!
//! ```no_run
//! use std::path::Path;
//! use tandem_model::{TargetModel, backend::CpuBackend};
//! use tandem_replay::{ReplayOptions, fingerprint_model, replay};
//!
//! let model_dir = Path::new("models/SmolLM2-135M-Instruct");
//! let model = TargetModel::<CpuBackend>::load(model_dir, &Default::default())?;
//! let dump = tandem_dump::DumpReader::open(Path::new("runs/dump-sharegpt-20"))?;
//! let report = replay(&model, &fingerprint_model(model_dir)?, &dump, None, &ReplayOptions::default())?;
//! print!("{}", report.to_table());
//! assert!(report.ok(), "{:?}", report.problems());
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

pub mod candidate;
pub mod compare;
pub mod diagnose;
pub mod error;
pub mod explain;
pub mod render;
pub mod replay;
pub mod report;
pub mod score;
pub mod tables;

pub use candidate::{Candidate, CandidateValues, all_candidates, all_taps, capture_candidates};
pub use compare::{
    CompareReport, CompareSetup, DraftedAcceptance, GapTest, OfflineAcceptance, OfflinePositions,
    OnlineAcceptance, accept_length_se, compare_wiring, drafted_acceptance, first_turn,
    next_draft_slot, node_targets, offline_acceptance, online_acceptance,
    online_acceptance_on_dump, position_se, ratio_se, relative_gap, share_se,
    teacher_forced_proposals,
};
pub use diagnose::{
    DeclaredReading, DiagnoseLabels, DiagnoseOptions, DiagnoseReport, DiagnoseSample,
    ReadingVerdict, SweepEntry, WiringScore, declared_readings, diagnose, generate_samples, sweep,
};
pub use error::ReplayError;
pub use explain::{ConventionSwap, constant_shift, convention_swaps, describe_pattern};
pub use render::{escape, html_page};
pub use replay::{HeadWiring, ReplayOptions, fingerprint_model, replay};
pub use report::{
    Finding, LastHiddenReport, Level, ReplayReport, Score, Shard, SlotReport, Status,
};
pub use score::{Accumulator, SlotStats, Tolerance};
