//! The error type of the dump crate. Every variant names the file, directory or setting at
//! fault, because these errors end long runs and the message is all a user has.

use std::path::PathBuf;

use tandem_data::DataError;
use tandem_model::ModelError;
use tandem_wiring::WiringError;

/// Everything that can end a dump, a resume or a read of a dump directory.
#[derive(Debug, thiserror::Error)]
pub enum DumpError {
    /// A file or directory could not be created, read, written, synced or renamed.
    #[error("cannot {action} {}: {source}", path.display())]
    Io {
        /// "create directory", "write", "rename", ...
        action: &'static str,
        /// The file or directory.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },

    /// Writing a shard failed part-way (full disk, vanished directory, ...). The shards
    /// completed before it are intact and a re-run of the same command resumes after them.
    #[error(
        "cannot write shard {}: {source}. The {completed_shards} completed shard(s) \
         ({completed_rows} rows) in {} are valid; fix the cause and re-run the same command \
         to resume",
        path.display(),
        dir.display()
    )]
    ShardWrite {
        /// The temporary shard being written (removed again when possible).
        path: PathBuf,
        /// The dump directory.
        dir: PathBuf,
        /// Shards completed before the failure.
        completed_shards: usize,
        /// Rows in those shards.
        completed_rows: u64,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },

    /// An Arrow IPC file could not be encoded or decoded.
    #[error("{}: Arrow IPC: {source}", path.display())]
    Arrow {
        /// The shard.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: arrow_schema::ArrowError,
    },

    /// A JSON file (manifest.json, metadata) is not what it should be.
    #[error("{}: invalid JSON: {source}", path.display())]
    Json {
        /// The file (or `shard: metadata key`).
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: serde_json::Error,
    },

    /// The directory is not a dump (no manifest.json), or its files contradict each other.
    #[error("{} is not a valid tandem dump: {reason}", path.display())]
    NotADump {
        /// The directory or file.
        path: PathBuf,
        /// What is missing or inconsistent.
        reason: String,
    },

    /// A shard does not have the layout this build reads.
    #[error("shard {}: {reason}", path.display())]
    BadShard {
        /// The shard.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },

    /// The output directory holds a dump made with other settings; mixing the two would give
    /// the trainer samples wired differently.
    #[error(
        "{} already holds a dump made with different settings; refusing to add to it \
         (use another --out, or delete it):\n  - {}",
        dir.display(),
        differences.join("\n  - ")
    )]
    ManifestMismatch {
        /// The output directory.
        dir: PathBuf,
        /// One sentence per difference (the wiring check's sentences first).
        differences: Vec<String>,
    },

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

    /// A row index past the end of the dump.
    #[error("row {index} is out of range: the dump has {len} rows")]
    RowOutOfRange {
        /// The index asked for.
        index: usize,
        /// Rows in the dump.
        len: usize,
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

impl DumpError {
    pub(crate) fn io(
        action: &'static str,
        path: impl Into<PathBuf>,
    ) -> impl FnOnce(std::io::Error) -> Self {
        let path = path.into();
        move |source| DumpError::Io {
            action,
            path,
            source,
        }
    }

    pub(crate) fn arrow(path: impl Into<PathBuf>) -> impl FnOnce(arrow_schema::ArrowError) -> Self {
        let path = path.into();
        move |source| DumpError::Arrow { path, source }
    }
}
