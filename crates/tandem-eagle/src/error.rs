//! The errors of this crate: each variant names the file, tensor, field or value at fault.

use std::path::PathBuf;

/// Everything that can go wrong building, loading, saving or running a draft head.
#[derive(Debug, thiserror::Error)]
pub enum EagleError {
    /// A file could not be read or written.
    #[error("cannot {action} {path}: {source}")]
    Io {
        /// What was being done (`read`, `write`, `create`...).
        action: &'static str,
        /// The file.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },

    /// A JSON file did not parse as what it should be.
    #[error("{path} is not a valid draft config.json: {source}")]
    Json {
        /// The file.
        path: PathBuf,
        /// The parse error (with line and column).
        #[source]
        source: serde_json::Error,
    },

    /// A config field is missing, out of range or contradicts another one.
    #[error("draft config field `{field}` {reason}")]
    Config {
        /// The field at fault.
        field: &'static str,
        /// What is wrong with it.
        reason: String,
    },

    /// `architectures[0]` is not an EAGLE-3 Llama draft.
    #[error(
        "draft architecture {architecture:?} is not supported (expected LlamaForCausalLMEagle3, \
         the EAGLE-3 head SGLang, vLLM and SpecForge load)"
    )]
    UnsupportedArchitecture {
        /// What the config said.
        architecture: String,
    },

    /// A safetensors file is corrupt, truncated or absent.
    #[error("{path}: {reason}")]
    Safetensors {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },

    /// A tensor the head needs is not in the checkpoint.
    #[error("tensor `{name}` is missing from {path} (keys found: {found})")]
    MissingTensor {
        /// Canonical key (`midlayer.` form).
        name: String,
        /// The checkpoint file.
        path: PathBuf,
        /// A short list of the keys that are there, to spot a naming scheme.
        found: String,
    },

    /// A tensor has a shape other than the config implies.
    #[error("tensor `{name}` has shape {actual:?} but the draft config implies {expected:?}")]
    ShapeMismatch {
        /// Canonical key.
        name: String,
        /// Shape implied by the config.
        expected: Vec<usize>,
        /// Shape in the file.
        actual: Vec<usize>,
    },

    /// A tensor is stored in a dtype this loader does not read for that key.
    #[error("tensor `{name}` has dtype {dtype}; expected {expected}")]
    UnsupportedDtype {
        /// Canonical key.
        name: String,
        /// Dtype in the file.
        dtype: String,
        /// What is accepted for this key.
        expected: &'static str,
    },

    /// The draft vocabulary (`d2t`, `t2d`, or a request to build one) is inconsistent.
    #[error("draft vocabulary: {reason}")]
    Vocab {
        /// What is inconsistent.
        reason: String,
    },

    /// The embedding table handed to the head does not fit its config.
    #[error(
        "target embedding has shape {actual:?} but the draft needs [vocab_size, hidden_size] = \
         {expected:?}"
    )]
    EmbeddingShape {
        /// `[vocab_size, hidden_size]` from the draft config.
        expected: [usize; 2],
        /// The table's shape.
        actual: [usize; 2],
    },

    /// Inputs of a forward call have shapes that do not fit together or the config.
    #[error("invalid draft input: {reason}")]
    Input {
        /// What does not fit.
        reason: String,
    },

    /// A target-side error: config resolution of the shared Llama pieces, or the serving
    /// cache's column bookkeeping (shared with the target's cache), e.g. a full cache.
    #[error(transparent)]
    Model(#[from] tandem_model::ModelError),
}
