//! Target models for Tandem: HF configs, safetensors weights, the Llama-family and DeepSeek-V3
//! forward pass in burn with a KV cache, and the one capture hook every execution path (plain
//! or micro-batched) goes through.

pub mod backend;
pub mod cache;
pub mod capture;
pub mod capture_target;
pub mod config;
pub mod error;
pub mod generate;
pub mod micro_batch;
pub mod model;
pub mod sampling;
pub mod testing;
pub mod tokenizer;
pub mod weights;

pub use burn;
pub use cache::{ColumnLayout, KvCache, MaskParts, StepInput, fill_order};
pub use capture::{CaptureHook, CapturedTaps, TapRequest, Taps};
pub use capture_target::CaptureTarget;
pub use config::{Family, HfConfig, MlaSpec, ModelSpec, MoeSpec};
pub use error::{ModelError, check_token_ids};
pub use generate::{FinishReason, GenerateOptions, Generation, generate};
pub use micro_batch::{Execution, MicroBatch};
pub use model::{LogitsFor, StepOutput, TargetModel};
pub use sampling::SamplingParams;
pub use tokenizer::{ChatMessage, TargetTokenizer};
