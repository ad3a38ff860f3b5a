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
    #[error(
        "tensor {name} has dtype {dtype}; supported: F32, F16, BF16, and F8_E4M3 / F8_E5M2 with a `_scale_inv` block scale"
    )]
    UnsupportedDtype { name: String, dtype: String },
    #[error(
        "tensor {name} is {dtype} but its block scale {name}_scale_inv is missing from the weights in {dir}; FP8 weights are read only with their per-block inverse scale"
    )]
    Fp8MissingScale {
        name: String,
        dtype: String,
        dir: PathBuf,
    },
    #[error(
        "FP8 tensor {name} of shape {shape:?} in blocks of {block:?} needs its scale {name}_scale_inv of shape {expected:?}, found {actual:?} (block size: quantization_config.weight_block_size in config.json)"
    )]
    Fp8ScaleShape {
        name: String,
        shape: [usize; 2],
        block: [usize; 2],
        expected: [usize; 2],
        actual: Vec<usize>,
    },
    #[error(
        "FP8 tensor {name} ({dtype}) has shape {shape:?}; only 2-D block-scaled FP8 weights are supported"
    )]
    Fp8Layout {
        name: String,
        dtype: String,
        shape: Vec<usize>,
    },
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
    /// An execution path outside this crate (the CUDA fast path) failed.
    #[error(transparent)]
    Device(Box<dyn std::error::Error + Send + Sync>),
}

/// Fails on the first token id at or past `vocab_size` (an embedding row that does not exist).
/// Every forward path checks its tokens with this before it writes anything: the burn model, the
/// CUDA cache's step, and a tensor-parallel step before any rank queues an all-reduce.
pub fn check_token_ids(tokens: &[u32], vocab_size: usize) -> Result<(), ModelError> {
    match tokens.iter().find(|&&t| t as usize >= vocab_size) {
        Some(&id) => Err(ModelError::TokenOutOfRange { id, vocab_size }),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_ids_are_checked_against_the_vocabulary_and_the_first_bad_one_is_named() {
        assert!(check_token_ids(&[0, 5, 9], 10).is_ok());
        assert!(check_token_ids(&[], 10).is_ok());
        let err = check_token_ids(&[3, 10, 12], 10).unwrap_err();
        assert!(matches!(
            err,
            ModelError::TokenOutOfRange {
                id: 10,
                vocab_size: 10
            }
        ));
        assert_eq!(
            err.to_string(),
            "token id 10 is outside the vocabulary (size 10)"
        );
    }
}
