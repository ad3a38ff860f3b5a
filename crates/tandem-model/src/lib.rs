//! Target models for Tandem: HF configs, safetensors weights, the Llama-family forward pass in
//! burn with a KV cache, and the one capture hook every execution path goes through.

pub mod backend;
pub mod cache;
pub mod capture;
pub mod config;
pub mod error;
pub mod generate;
pub mod model;
pub mod sampling;
pub mod testing;
pub mod tokenizer;
pub mod weights;

pub use burn;
pub use cache::{ColumnLayout, KvCache, StepInput};
pub use capture::{CaptureHook, CapturedTaps, TapRequest, Taps};
pub use config::{Family, HfConfig, ModelSpec};
pub use error::ModelError;
pub use generate::{FinishReason, GenerateOptions, Generation, generate};
pub use model::{LogitsFor, StepOutput, TargetModel};
pub use sampling::SamplingParams;
pub use tokenizer::{ChatMessage, TargetTokenizer};
