//! The one error type of this crate.
//!
//! Every variant carries the offending values, because these errors are usually read by a
//! person trying to work out why a drafter was wired to the wrong layers.

use std::path::{Path, PathBuf};

use crate::convention::Convention;
use crate::taps::TapId;

/// Result alias used throughout the crate.
pub type Result<T, E = WiringError> = std::result::Result<T, E>;

/// Everything that can go wrong while converting, parsing, hashing or loading wiring data.
#[derive(Debug, thiserror::Error)]
pub enum WiringError {
    /// A raw id is outside what `convention` can mean for a model of `num_layers` blocks.
    #[error(
        "{convention} layer id {id} is out of range for a {num_layers}-layer model \
         (valid {convention} ids here: {min}..={max})"
    )]
    LayerIdOutOfRange {
        /// Convention the id was read in.
        convention: Convention,
        /// The offending id.
        id: i64,
        /// Decoder block count of the target.
        num_layers: usize,
        /// Smallest valid id in this reading.
        min: i64,
        /// Largest valid id in this reading.
        max: i64,
    },

    /// A canonical tap has no id in `convention` (e.g. `embed` in SGLang).
    #[error("{tap} cannot be expressed as a {convention} layer id: {reason}")]
    NotExpressible {
        /// Convention asked for.
        convention: Convention,
        /// The tap that has no id there.
        tap: TapId,
        /// Why, in terms of the engine's capture loop.
        reason: String,
    },

    /// The convention requires a fixed number of ids (SpecForge: exactly 3).
    #[error("{convention} requires exactly {expected} layer ids, got {got}")]
    WrongIdCount {
        /// Convention that imposes the count.
        convention: Convention,
        /// Required count.
        expected: usize,
        /// Count given.
        got: usize,
    },

    /// A canonical tap names a block the model does not have.
    #[error(
        "{tap} does not exist in a {num_layers}-layer model (blocks are 0..={})",
        num_layers.saturating_sub(1)
    )]
    TapOutOfRange {
        /// The offending tap.
        tap: TapId,
        /// Decoder block count of the target.
        num_layers: usize,
    },

    /// The model is too shallow for the requested operation.
    #[error("a {num_layers}-layer model is too shallow: {what} needs at least {min} layers")]
    TooFewLayers {
        /// Decoder block count given.
        num_layers: usize,
        /// Minimum needed.
        min: usize,
        /// What needed them.
        what: &'static str,
    },

    /// A string (tap id, convention, tap spec, ...) could not be parsed.
    #[error("cannot parse {input:?}: {reason}")]
    Parse {
        /// The input as given.
        input: String,
        /// What was expected.
        reason: String,
    },

    /// A file could not be read or written.
    #[error("cannot {action} {}: {source}", path.display())]
    Io {
        /// "read", "write", "rename", ...
        action: &'static str,
        /// The file.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },

    /// A file is not the JSON we expected.
    #[error("{}: invalid JSON: {source}", path.display())]
    Json {
        /// The file (or a description of an in-memory buffer).
        path: PathBuf,
        /// The underlying error, with line and column.
        #[source]
        source: serde_json::Error,
    },

    /// A model config lacks a field the fingerprint needs, or has it with the wrong type.
    #[error("{}: field `{field}` {reason}", path.display())]
    ConfigField {
        /// The config file.
        path: PathBuf,
        /// The field looked for.
        field: &'static str,
        /// What was wrong with it.
        reason: String,
    },

    /// A manifest was written by a newer (or older) schema than this build understands.
    #[error(
        "{}: wiring manifest schema_version {found} is not supported (this build reads {supported})",
        path.display()
    )]
    UnsupportedSchema {
        /// The manifest file.
        path: PathBuf,
        /// Version in the file.
        found: u32,
        /// Version this build reads.
        supported: u32,
    },

    /// A manifest parsed but contradicts itself (taps outside the model, raw ids that do not
    /// resolve to the recorded taps, ...).
    #[error("invalid wiring manifest{}: {reason}", in_file(path.as_deref()))]
    InvalidManifest {
        /// The manifest file, when it came from one.
        path: Option<PathBuf>,
        /// What is inconsistent.
        reason: String,
    },
}

fn in_file(path: Option<&Path>) -> String {
    path.map(|p| format!(" {}", p.display()))
        .unwrap_or_default()
}
