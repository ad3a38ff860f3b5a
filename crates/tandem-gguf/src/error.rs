//! Every way reading, dequantising or importing a GGUF file can fail.

use std::path::PathBuf;

use crate::GgmlType;

/// An error from the GGUF reader, the dequantiser or the Hugging Face importer.
///
/// Messages name the offending key, tensor or byte range so that a user can tell a damaged
/// download from an unsupported model without a debugger.
#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },

    #[error("cannot write {path}: {source}")]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },

    #[error("not a GGUF file: it starts with bytes {found:02x?}, expected \"GGUF\" (47 47 55 46)")]
    BadMagic { found: Vec<u8> },

    #[error(
        "GGUF version {version} is not supported (this reader handles versions 2 and 3{hint})",
        hint = if *version > 0xFFFF { "; a byte-swapped version suggests a big-endian file" } else { "" }
    )]
    UnsupportedVersion { version: u32 },

    #[error(
        "truncated GGUF file: {what} needs bytes {start}..{end}, but the file has {file_len} bytes"
    )]
    Truncated {
        what: String,
        start: u64,
        end: u64,
        file_len: u64,
    },

    #[error(
        "truncated GGUF file: tensor {tensor} needs bytes {start}..{end}, but the file has {file_len} bytes"
    )]
    TruncatedTensor {
        tensor: String,
        start: u64,
        end: u64,
        file_len: u64,
    },

    #[error("{what}: string is not valid UTF-8 ({source})")]
    InvalidUtf8 {
        what: String,
        source: std::string::FromUtf8Error,
    },

    #[error("metadata key {key}: unknown value type {type_id}")]
    UnknownValueType { key: String, type_id: u32 },

    #[error("metadata key {key}: {problem}")]
    InvalidMetadata { key: String, problem: String },

    #[error("required metadata key {key} is missing")]
    MissingMetadata { key: String },

    #[error("tensor {tensor}: unknown ggml type {type_id}{}", name.map(|name| format!(" ({name}, not supported by this reader)")).unwrap_or_default())]
    UnknownGgmlType {
        tensor: String,
        type_id: u32,
        name: Option<&'static str>,
    },

    #[error(
        "tensor {tensor}: ggml type {ggml_type} cannot be dequantised yet \
         (supported: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q4_K, Q6_K)"
    )]
    UnsupportedGgmlType { tensor: String, ggml_type: GgmlType },

    #[error("tensor {tensor}: {problem}")]
    InvalidTensor { tensor: String, problem: String },

    #[error("required tensor {tensor} is missing")]
    MissingTensor { tensor: String },

    #[error("{architecture} is not supported by the importer yet (supported: llama, qwen2)")]
    UnsupportedArchitecture { architecture: String },

    #[error("{0}")]
    UnsupportedModel(String),

    #[error("tokenizer cannot be imported: {0}")]
    UnsupportedTokenizer(String),

    #[error("cannot write safetensors file {path}: {source}")]
    Safetensors {
        path: PathBuf,
        source: safetensors::SafeTensorError,
    },

    #[error("cannot serialise {what} as JSON: {source}")]
    Json {
        what: String,
        source: serde_json::Error,
    },
}
