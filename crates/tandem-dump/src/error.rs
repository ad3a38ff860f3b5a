//! The error type of the dump job. Every variant names the file, dataset or setting at fault,
//! because these errors end long runs and the message is all a user has. Reading and writing
//! the files themselves fails with [`FormatError`] (the format crate's), carried here as is.

use tandem_data::DataError;
use tandem_format::FormatError;
use tandem_model::ModelError;
use tandem_wiring::WiringError;

/// Everything that can end a dump, a resume or an online capture.
#[derive(Debug, thiserror::Error)]
pub enum DumpError {
    /// Reading or writing the dump directory (files, shards, manifest) failed.
    #[error(transparent)]
    Format(#[from] FormatError),

    /// The chat template is not prefix-stable, so assistant spans cannot be derived from
    /// renders of conversation prefixes.
    #[error(
        "chat template (sha256 {template_sha256}) is not prefix-stable: {reason}; the loss \
         mask cannot be derived from prefix renders of this template"
    )]
    TemplateNotPrefixStable {
        /// SHA-256 of the template text.
        template_sha256: String,
        /// Which render did not start the full render.
        reason: String,
    },

    /// The dataset is an evaluation set; dumping it as training data would inflate measured
    /// acceptance on it.
    #[error(
        "dataset {dataset:?} is an evaluation set (split eval); training on it inflates the \
         acceptance measured on it. Pass --allow-eval to dump it anyway"
    )]
    EvalDataset {
        /// The dataset asked for.
        dataset: String,
    },

    /// An option has a value the job cannot work with.
    #[error("invalid option {option}: {reason}")]
    InvalidOption {
        /// The option, as on the command line.
        option: &'static str,
        /// Why.
        reason: String,
    },

    /// Loading or running the target model failed.
    #[error(transparent)]
    Model(#[from] ModelError),
    /// The CUDA fast path failed (a kernel launch, a copy, GPU memory).
    #[error(transparent)]
    Cuda(#[from] tandem_cuda::CudaError),

    /// Resolving taps or fingerprinting the target failed.
    #[error(transparent)]
    Wiring(#[from] WiringError),

    /// The dataset cannot be opened.
    #[error(transparent)]
    Data(#[from] DataError),
}
