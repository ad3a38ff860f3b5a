//! The GPU fast path of the target model. The burn decoder is launch bound on the H200 (about
//! 1.2 ms of host work per layer per step, BENCHMARKS.md); this crate runs the same Llama-family
//! forward as `tandem_model::TargetModel::forward` with ~9 launches per layer: cuBLAS for the
//! four matmuls (fused q|k|v and gate|up weights, bf16 operands, f32 results) and the NVRTC
//! kernels of `kernels/llama.cu` for everything between them.
//!
//! It takes its taps through the same [`tandem_model::CaptureHook`] as the burn path, after the
//! embedding, after every block and after the final norm, in every mode (prefill, decode, tree
//! verification): `fast-check` and the tests prove the taps and logits equal the reference's.
//! Steps of up to [`GRAPH_MAX_WIDTH`] tokens per sequence (decode, tree verification, the
//! head's draft steps) replay CUDA graphs of that same code ([`graphs`]).
//!
//! Past one GPU: [`tensor_parallel`] splits the target over several GPUs (NCCL all-reduces,
//! taps on rank 0 after them), [`collective`] bootstraps NCCL across processes for the
//! data-parallel trainer.

mod cache;
mod capture;
pub mod check;
pub mod collective;
mod device;
mod draft;
mod error;
mod graphs;
pub mod host_spans;
mod kv_pool;
mod model;
pub mod reference;
pub mod tensor_parallel;
mod train;
mod weights;

pub use cache::{ColumnMoves, CudaKvCache, HostKv};
pub use collective::{Collective, NcclId, ProcessGroup};
pub use cudarc::driver::{CudaSlice, CudaView};
pub use device::{
    Assembly, AttentionShape, DEFAULT_MMA_MIN_WIDTH, DeviceRows, GEMV_MAX_ROWS, Gpu, MLP_CLUSTER,
    MMA_MIN_QUERY_ROWS, MaskColumns, PendingRead, QkvInput, assemble_mma_attention,
    assemble_mma_rows, compile_all_kernels, nvrtc_present,
};
pub use draft::{
    BeamRecord, CudaDraft, DraftStepOutput, chain_ids_to_host, chains_from_step_major,
};
pub use error::CudaError;
pub use graphs::GraphStats;
pub use kv_pool::{CACHE_COLUMNS_STEP, cache_columns};
pub use model::{
    CudaStepOutput, CudaTarget, DeviceLogits, FUSED_MAX_ROWS, GRAPH_BATCHES, GRAPH_MAX_WIDTH,
    KeptTaps, PersistentProfile,
};
pub use tensor_parallel::TpReduction;
pub use train::{
    AdamWStep, CorpusBatch, CudaHeadTrainer, MAX_TTT_STEPS, PinnedUpload, Replicas, STAGING_VALUES,
    StepCounts, TargetPieces, TrainStepReport,
};
