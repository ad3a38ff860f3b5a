//! Errors of the replay and compare jobs. Each names the artefact and what is wrong with it;
//! wiring faults are not errors (they are findings of the report).

use std::path::PathBuf;

use tandem_dump::DumpError;
use tandem_eagle::EagleError;
use tandem_infer::InferError;
use tandem_model::ModelError;
use tandem_wiring::WiringError;

/// Why a replay (or compare) could not run to the end.
#[derive(Debug, thiserror::Error)]
pub enum ReplayError {
    /// The dump could not be read.
    #[error(transparent)]
    Format(#[from] tandem_dump::FormatError),
    /// The dump job's target or capture failed.
    #[error(transparent)]
    Dump(#[from] DumpError),
    /// The target model failed (loading, a forward step).
    #[error(transparent)]
    Model(#[from] ModelError),
    /// The head's config or weights could not be used.
    #[error(transparent)]
    Eagle(#[from] EagleError),
    /// The serving engine refused a request.
    #[error(transparent)]
    Infer(#[from] InferError),
    /// A fingerprint or tap conversion failed.
    #[error(transparent)]
    Wiring(#[from] WiringError),
    /// A dumped sample does not have the shape its manifest declares.
    #[error("dump sample {index} ({sample_id:?}): {reason}")]
    BadSample {
        /// Row index in the dump.
        index: usize,
        /// The dataset's id of the sample.
        sample_id: String,
        /// What is wrong.
        reason: String,
    },
    /// The dump has no rows to replay.
    #[error("{}: the dump has no rows to replay", dir.display())]
    EmptyDump {
        /// The dump directory.
        dir: PathBuf,
    },
    /// The head cannot be measured on this target (widths, slots, no data).
    #[error("diagnose: {reason}")]
    HeadMismatch {
        /// What does not fit.
        reason: String,
    },
    /// A report could not be written.
    #[error("cannot write {}: {source}", path.display())]
    Write {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
}
