use std::path::PathBuf;

/// Everything that can go wrong loading or running a target model. Variants name the offending
/// file, tensor or field so the message alone tells a user what to fix.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("cannot read {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path} is not valid JSON for this purpose: {source}")]
    Json {
        path: PathBuf,
        source: serde_json::Error,
    },
    #[error("model directory {dir} has no model.safetensors and no model.safetensors.index.json")]
    NoWeights { dir: PathBuf },
    #[error("{path} is not a valid safetensors file (truncated or corrupt?): {reason}")]
    BadSafetensors { path: PathBuf, reason: String },
    #[error("tensor {name} is missing from the weights in {dir}")]
    MissingTensor { name: String, dir: PathBuf },
    #[error("tensor {name} has shape {actual:?} but config.json implies {expected:?}")]
    ShapeMismatch {
        name: String,
        expected: Vec<usize>,
        actual: Vec<usize>,
    },
    #[error("tensor {name} has dtype {dtype}; supported: F32, F16, BF16")]
    UnsupportedDtype { name: String, dtype: String },
    #[error(
        "architecture {architecture} is not supported (supported: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, DeepseekV3ForCausalLM)"
    )]
    UnsupportedArchitecture { architecture: String },
    #[error("config.json field {field} {reason}")]
    InvalidConfig { field: &'static str, reason: String },
    #[error("tokenizer {path}: {reason}")]
    Tokenizer { path: PathBuf, reason: String },
    #[error("chat template: {reason}")]
    ChatTemplate { reason: String },
    #[error(
        "KV cache is full: {needed} columns needed, capacity {capacity}; the sequence ends here"
    )]
    CacheFull { needed: usize, capacity: usize },
    #[error("invalid step input: {reason}")]
    InvalidStep { reason: String },
    #[error("token id {id} is outside the vocabulary (size {vocab_size})")]
    TokenOutOfRange { id: u32, vocab_size: usize },
    #[error("tap {tap} does not exist in a model with {num_layers} layers")]
    TapOutOfRange { tap: String, num_layers: usize },
    #[error("invalid sampling setting {field}: {reason}")]
    InvalidSampling { field: &'static str, reason: String },
}
