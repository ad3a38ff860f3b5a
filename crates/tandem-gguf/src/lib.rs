//! GGUF reader, dequantisation to f32, and import of GGUF Llama/Qwen2 models into a Hugging Face
//! model directory.
//!
//! * [`GgufFile`] parses a GGUF v2/v3 file (memory-mapped): [`Metadata`], [`TensorInfo`]s and
//!   tensor data, with [`GgufFile::dequantize`] for F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q4_K, Q6_K.
//! * [`import_gguf`] writes `config.json`, `model.safetensors` (f32, Hugging Face names, llama.cpp's
//!   q/k row permutation undone), `tokenizer.json`, `tokenizer_config.json`,
//!   `generation_config.json` and a `tandem_import.json` provenance record.
//!
//! GGUF lists dimensions fastest-varying first: a tensor with `dims = [in, out]` is the
//! row-major PyTorch matrix `[out, in]` ([`TensorInfo::torch_shape`]).

mod config;
mod dequant;
mod error;
mod ggml_type;
mod import;
mod metadata;
mod names;
mod reader;
pub mod rope;
mod tokenizer;

#[cfg(test)]
mod test_gguf;

pub use config::{Architecture, Hyperparameters, SpecialTokenIds};
pub use dequant::{DequantError, dequantize_into};
pub use error::GgufError;
pub use ggml_type::{GgmlType, QK_K};
pub use import::{ImportReport, ImportedTensor, import_gguf};
pub use metadata::{Metadata, MetadataValue, ValueType};
pub use names::{HfTensorName, RopeRows, hf_tensor_name};
pub use reader::{GgufFile, TensorInfo};
pub use tokenizer::pre_tokenizer;
