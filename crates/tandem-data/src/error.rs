//! Errors (the dataset cannot be read at all) and skips (one record is unusable).

use std::fmt;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::SkipReason;

/// Where in a file a record is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Location {
    /// 1-based line of a JSONL file.
    Line(u64),
    /// 1-based element of a JSON array, with the byte offset where it starts (after
    /// decompression), so a bad record can be found with `dd`/`head -c`.
    Record {
        /// 1-based element index.
        index: u64,
        /// Byte offset of the element's first byte.
        offset: u64,
    },
}

impl fmt::Display for Location {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Location::Line(n) => write!(f, "line {n}"),
            Location::Record { index, offset } => write!(f, "record {index} (byte {offset})"),
        }
    }
}

/// The dataset cannot be opened or read as a whole.
#[derive(Debug, thiserror::Error)]
pub enum DataError {
    /// The file cannot be opened or read.
    #[error("{}: {source}", path.display())]
    Io {
        /// File concerned.
        path: PathBuf,
        /// Underlying error.
        source: io::Error,
    },
    /// The spec is neither a registry name nor an existing file.
    #[error("unknown dataset {spec:?}: not a registry name ({known}) and no such file")]
    UnknownDataset {
        /// The spec given.
        spec: String,
        /// Registry names, comma-separated.
        known: String,
    },
    /// A registry dataset whose file has not been downloaded.
    #[error(
        "dataset {name:?} is not fetched: {} is missing (run scripts/fetch_datasets.sh {name})",
        path.display()
    )]
    NotFetched {
        /// Registry name.
        name: String,
        /// Where the file was expected.
        path: PathBuf,
    },
    /// The file is not in a format this crate reads (or not the one the caller asked for).
    #[error("{}: {reason}", path.display())]
    Format {
        /// File concerned.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// A record of a file read strictly (evaluation prompts, where a silently missing prompt
    /// would change the benchmark) is unusable.
    #[error("{}: {location}: {reason}", path.display())]
    Record {
        /// File concerned.
        path: PathBuf,
        /// Where the record is.
        location: Location,
        /// What is wrong.
        reason: String,
    },
    /// `datasets/registry.toml` is invalid (a build-time mistake: a unit test checks it).
    #[error("datasets/registry.toml: {0}")]
    Registry(String),
}

impl DataError {
    pub(crate) fn io(path: &Path, source: io::Error) -> Self {
        DataError::Io {
            path: path.to_owned(),
            source,
        }
    }

    pub(crate) fn format(path: &Path, reason: impl Into<String>) -> Self {
        DataError::Format {
            path: path.to_owned(),
            reason: reason.into(),
        }
    }
}

/// One record the reader passed over; iteration continues after it.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{}: {location}: skipped ({reason}): {detail}", path.display())]
pub struct Skipped {
    /// File the record is in (shared between all skips of one reader).
    pub path: Arc<Path>,
    /// Where the record is.
    pub location: Location,
    /// Category, as counted in [`crate::SkipCounts`].
    pub reason: SkipReason,
    /// Human-readable specifics (parser message, turn number, role name, ...).
    pub detail: String,
}
