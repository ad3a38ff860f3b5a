//! The errors of `tandem train`, each naming the file, option or mismatch at fault.

use std::path::PathBuf;

/// Everything that stops a training run.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    /// A file or directory could not be read or written.
    #[error("cannot {action} {}: {source}", path.display())]
    Io {
        /// What was being done.
        action: &'static str,
        /// The path.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },

    /// A JSON file (state, options, metrics) did not parse.
    #[error("{}: invalid JSON: {source}", path.display())]
    Json {
        /// The file.
        path: PathBuf,
        /// The parse error.
        #[source]
        source: serde_json::Error,
    },

    /// The GPU trainer failed (no device, a CUDA or cuBLAS error, too little memory).
    #[error("GPU trainer: {reason}")]
    Gpu {
        /// What went wrong, from the CUDA layer.
        reason: String,
    },

    /// An option is out of range or contradicts another one.
    #[error("--{option}: {reason}")]
    InvalidOption {
        /// The option, without dashes.
        option: &'static str,
        /// What is wrong.
        reason: String,
    },

    /// The dump was captured from another target than `--model`, or two dumps disagree. One
    /// sentence per mismatch, from `tandem_wiring::check`.
    #[error("{what}:\n  - {}", sentences.join("\n  - "))]
    WiringMismatch {
        /// Which two artefacts were compared.
        what: String,
        /// The check's sentences.
        sentences: Vec<String>,
    },

    /// The dump holds evaluation data, which must stay out of training.
    #[error(
        "{} was dumped from an evaluation split ({dataset}); evaluation data must stay out of \
         training",
        path.display()
    )]
    EvalData {
        /// The dump directory.
        path: PathBuf,
        /// Its dataset.
        dataset: String,
    },

    /// A sample cannot be trained on as stored.
    #[error("sample {index} ({sample_id}): {reason}")]
    BadSample {
        /// Global row index.
        index: usize,
        /// The dataset's id.
        sample_id: String,
        /// What is wrong.
        reason: String,
    },

    /// Nothing to train on (after the split, or all samples too short).
    #[error("no training data: {reason}")]
    NoData {
        /// Why.
        reason: String,
    },

    /// `--resume` cannot continue the run in `--out`.
    #[error("cannot resume from {}: {reason}", path.display())]
    Resume {
        /// The output directory.
        path: PathBuf,
        /// Why.
        reason: String,
    },

    /// A burn recorder (checkpoint of parameters / optimizer state) failed.
    #[error("{}: checkpoint record: {reason}", path.display())]
    Record {
        /// The record file.
        path: PathBuf,
        /// The recorder's message.
        reason: String,
    },

    /// Training diverged.
    #[error("step {step}: the loss is {loss}; training diverged (lower --lr?)")]
    Diverged {
        /// The step.
        step: usize,
        /// The non-finite loss.
        loss: f64,
    },

    /// A dump (or another source of rows) could not be read.
    #[error(transparent)]
    Format(#[from] tandem_format::FormatError),

    /// The head could not be built, loaded, run or saved.
    #[error(transparent)]
    Eagle(#[from] tandem_eagle::EagleError),

    /// The target's config or weights could not be read.
    #[error(transparent)]
    Model(#[from] tandem_model::ModelError),

    /// A wiring manifest could not be built or read.
    #[error(transparent)]
    Wiring(#[from] tandem_wiring::WiringError),
}

impl TrainError {
    pub(crate) fn io(
        action: &'static str,
        path: &std::path::Path,
    ) -> impl FnOnce(std::io::Error) -> Self {
        let path = path.to_owned();
        move |source| TrainError::Io {
            action,
            path,
            source,
        }
    }
}
