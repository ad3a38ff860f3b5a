//! `tandem train`: trains an EAGLE-3 head ([`tandem_eagle::Eagle3Draft`]) on offline dumps
//! written by `tandem dump`, or online on taps captured through the same hook while training
//! (`tandem_dump::OnlineCapture`, a `tandem_format::SampleSource`), and exports it as a directory SGLang / vLLM load.
//!
//! - [`data`]: dumps as one row space ([`data::SampleSource`], [`data::Dataset`]), the
//!   train/validation split by sample id, seeded shuffling with length bucketing, batches.
//! - [`target`]: the frozen target pieces (embedding, final norm, lm_head) and its
//!   fingerprint; target logits are recomputed from the dumped last-block residual.
//! - [`objective`]: soft cross-entropy against the target distribution renormalised over the
//!   draft vocabulary, masked by `t2d[target argmax] * loss_mask`, `sum 0.8^i loss_i`; acc_i.
//! - [`schedule`]: warm-up + cosine learning rate.
//! - [`trainer`]: the loop (AdamW, global grad-norm clipping, validation, checkpoints with
//!   exact `--resume`, metrics JSONL, progress bar, curves, export).
//! - [`gpu`]: the same run on the hand-written GPU trainer (`tandem_cuda::CudaHeadTrainer`):
//!   the corpus on the GPU, cuBLAS + NVRTC kernels, no host round trip inside a step.
//! - [`metrics`], [`plot`]: `metrics.jsonl` and `curves.html`.

#![warn(missing_docs)]

#[cfg(test)]
mod cpu_backend_tests;
pub mod data;
mod driver;
pub mod error;
pub mod gpu;
pub mod gpu_check;
pub mod metrics;
pub mod objective;
pub mod plot;
pub mod replicas;
pub mod schedule;
pub mod target;
pub mod trainer;

pub use error::TrainError;
pub use gpu::{train_gpu, train_gpu_on};
pub use trainer::{TrainOptions, TrainReport, TrainState, clip_global_norm, train, train_on};
