//! The error type of the dump format. Every variant names the file, directory or row at fault,
//! because these errors end long runs and the message is all a user has.

use std::path::PathBuf;

use tandem_wiring::WiringError;

/// Everything that can go wrong reading or writing a dump directory, or reading a row from any
/// [`crate::SampleSource`].
#[derive(Debug, thiserror::Error)]
pub enum FormatError {
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

    /// A row index past the end of the dump.
    #[error("row {index} is out of range: the dump has {len} rows")]
    RowOutOfRange {
        /// The index asked for.
        index: usize,
        /// Rows in the dump.
        len: usize,
    },

    /// Checking the wiring of a dump (taps, target fingerprints) failed.
    #[error(transparent)]
    Wiring(#[from] WiringError),

    /// A source of rows other than a dump directory (the online capture of `tandem train
    /// --online`) failed to produce a row.
    #[error("{name}: {source}")]
    Source {
        /// The source, for the message.
        name: String,
        /// What went wrong there.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
}

impl FormatError {
    /// `map_err` helper: an I/O error on `path` while doing `action`.
    pub fn io(
        action: &'static str,
        path: impl Into<PathBuf>,
    ) -> impl FnOnce(std::io::Error) -> Self {
        let path = path.into();
        move |source| FormatError::Io {
            action,
            path,
            source,
        }
    }

    /// `map_err` helper: an Arrow error on the shard at `path`.
    pub fn arrow(path: impl Into<PathBuf>) -> impl FnOnce(arrow_schema::ArrowError) -> Self {
        let path = path.into();
        move |source| FormatError::Arrow { path, source }
    }
}
