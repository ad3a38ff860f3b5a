//! The fast path's forward step: the same modes, inputs and outputs as
//! `tandem_model::TargetModel::forward`, with taps through the same [`CaptureHook`].

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use cudarc::driver::CudaSlice;
use tandem_model::backend::CpuBackend;
use tandem_model::weights::WeightFiles;
use tandem_model::{
    CaptureHook, HfConfig, LogitsFor, ModelError, ModelSpec, StepInput, TapRequest, Taps,
    TargetModel, check_token_ids,
};
use tandem_wiring::TapId;

use crate::cache::{CudaKvCache, HostStep, PeerCache, StepInputs};
use crate::device::{
    AttentionShape, DeviceRows, GEMV_MAX_ROWS, Gpu, MMA_MAX_ROWS, MlpSums, PERSISTENT_TABLE_WORDS,
    PersistentStep, QkvInput,
};
use crate::error::CudaError;
use crate::graphs::{CapturedStep, GraphKey, GraphStats, Graphs};
use crate::host_spans;
use crate::tensor_parallel::{RankSplit, Reducer, TpReduction, unwinding_as_error};
use crate::weights::DeviceWeights;

/// Widest step that replays a CUDA graph: decode (1 token per sequence) and tree verification
/// (up to 64 tokens). Prefill widths change with every prompt, so prefill runs eagerly.
pub const GRAPH_MAX_WIDTH: usize = 64;

/// A Llama-family target on the GPU.
pub struct CudaTarget {
    /// The model's spec (the whole model's, under tensor parallelism too).
    pub spec: ModelSpec,
    /// What this rank computes: `spec`, or under tensor parallelism `spec` with its heads, KV
    /// heads and intermediate size divided by the ranks (`ModelSpec::tensor_parallel_rank`).
    rank_spec: ModelSpec,
    /// This rank's place in a tensor-parallel target (`None`: the whole model on one GPU).
    tp: Option<TensorParallel>,
    /// The injected wiring fault of [`CudaTarget::set_partial_sum_fault`].
    partial_sum_fault: AtomicBool,
    /// The model directory, for the CPU f32 model replay's partial-sum candidates come from.
    source: PathBuf,
    /// That model, loaded on first use ([`CaptureTarget::block_partial_sums`]).
    cpu_model: Mutex<Option<TargetModel<CpuBackend>>>,
    gpu: Arc<Gpu>,
    weights: DeviceWeights,
    inv_freq: CudaSlice<f32>,
    graphs: Graphs<StepBuffers>,
    /// Steps of at most this many rows run the fused small-step kernels (0: none).
    fused_rows: AtomicUsize,
    /// Steps of at most this many rows run the persistent one-launch step (0: none); it takes
    /// precedence over the fused kernels.
    persistent_rows: AtomicUsize,
    /// Fused steps of at most this many sequences take each layer's q|k|v and attention in
    /// one launch (0: none; [`CudaTarget::set_qkv_attention_sequences`]).
    qkv_attention_sequences: AtomicUsize,
    /// ... when they have at most this many tokens a sequence
    /// ([`CudaTarget::set_qkv_attention_width`]).
    qkv_attention_width: AtomicUsize,
    /// The persistent step's grid-barrier counter.
    barrier: CudaSlice<u32>,
    /// Where the persistent step records block 0's clock at each barrier
    /// (`TANDEM_CUDA_PERSISTENT_PROFILE=1`; see [`CudaTarget::persistent_profile`]).
    profile: Option<CudaSlice<u64>>,
}

/// One rank of a tensor-parallel target ([`CudaTarget::load_tensor_parallel`]).
struct TensorParallel {
    split: RankSplit,
    /// This rank's end of the all-reduce after o_proj and after down_proj.
    reducer: Reducer,
    /// On rank 0, ranks 1.. (each on its GPU), which run every step beside it.
    peers: Vec<CudaTarget>,
    /// This rank's GPU, made current again after the peers are dropped.
    home: Arc<Gpu>,
    /// On rank 0: a step failed on some rank over NCCL. The other ranks' all-reduces of that
    /// step may still sit queued on their GPUs and would pair with the next step's, shifting
    /// every later sum by a step, so the target refuses further steps.
    poisoned: AtomicBool,
}

impl Drop for CudaTarget {
    /// The graphs go first, with this GPU current: a graph that captured NCCL all-reduces
    /// holds a reference on the communicator, whose abort (in the `tp` field, dropped before
    /// `graphs`) would otherwise wait for that reference for good.
    fn drop(&mut self) {
        self.gpu.make_current();
        self.graphs.lock().clear();
    }
}

impl Drop for TensorParallel {
    /// Each peer's buffers are freed with its own GPU current (cudarc frees without binding
    /// a context), then this rank's GPU is current again.
    fn drop(&mut self) {
        for peer in self.peers.drain(..) {
            peer.gpu.make_current();
            drop(peer);
        }
        self.home.make_current();
    }
}

/// How a rank runs a step's graph: its own choice (one GPU), or the one rank 0 made for every
/// rank. NCCL requires that an all-reduce be captured (or not) on every rank alike and that
/// each rank replay the graph of the same joint capture; ranks keyed on their own (rank 0's
/// taps and logits, each rank's cache addresses) would choose differently.
#[derive(Clone, Copy)]
enum GraphPlan<'a> {
    Own,
    /// Rank 0's choice: `padded` steps go the graph path (the batch padded to a graph size);
    /// `graph` is the key every rank captures or replays under, `None` an eager step.
    Shared {
        padded: bool,
        graph: Option<&'a GraphKey>,
    },
}

/// Tokens on the device for a step (see [`CudaTarget::forward_chains`] and
/// [`CudaTarget::forward_roots`]): `ids` `[steps, batch]` into each live sequence's slots
/// `first ..= first + steps - 1` (`batch` the live sequences).
#[derive(Clone, Copy)]
struct ChainTokens<'a> {
    ids: &'a CudaSlice<u32>,
    batch: usize,
    steps: usize,
    first: usize,
}

/// Every device buffer of one step: inputs, intermediates, outputs. A graph captured over them
/// replays with the next step's inputs copied into the same buffers.
struct StepBuffers {
    /// Tokens, positions, `[col0, total]` for graph replays and the mask.
    inputs: StepInputs,
    /// `LogitsFor::Last`: the row of each sequence's last real token.
    last: CudaSlice<i32>,
    hidden: CudaSlice<f32>,
    /// The residual's second buffer: a one-launch q|k|v and attention that adds the previous
    /// layer's MLP sums writes the new residual here while its blocks read the old one.
    hidden_alt: CudaSlice<f32>,
    /// The one-launch MLP's per-slice products and cluster sums (`Gpu::mlp_partials`).
    mlp_scratch: CudaSlice<f32>,
    mlp_sums: CudaSlice<f32>,
    normed: CudaSlice<u16>,
    qkv: CudaSlice<f32>,
    q: CudaSlice<f32>,
    attn: CudaSlice<u16>,
    delta: CudaSlice<f32>,
    gate_up: CudaSlice<f32>,
    act: CudaSlice<u16>,
    final_normed: CudaSlice<f32>,
    selected: CudaSlice<u16>,
    logits: Option<CudaSlice<f32>>,
    /// One per tap slot, `[rows, hidden]`.
    taps: Vec<CudaSlice<f32>>,
    /// Each row's visible columns and their counts, for the persistent step and the fused
    /// steps' attention (steps that may take them; one element otherwise).
    visible: CudaSlice<i32>,
    /// The persistent step's table of layer and tap addresses, built for this step's cache
    /// before the step runs or is captured ([`CudaTarget::persistent_table`]).
    persistent_table: Option<CudaSlice<u64>>,
    batch: usize,
    width: usize,
    logits_rows: usize,
    needs_last: bool,
}

impl StepBuffers {
    fn new(
        target: &CudaTarget,
        shape: AttentionShape,
        mask_columns: usize,
        taps: &TapRequest,
        logits_for: LogitsFor,
    ) -> Result<Self, CudaError> {
        let spec = &target.rank_spec;
        let gpu = &*target.gpu;
        let (h, inter) = (spec.hidden_size, spec.intermediate_size);
        let rows = shape.rows();
        let q_dim = spec.num_heads * spec.head_dim;
        let qkv_dim = q_dim + 2 * spec.num_kv_heads * spec.head_dim;
        let logits_rows = match logits_for {
            LogitsFor::None => 0,
            LogitsFor::Last => shape.batch,
            LogitsFor::All => rows,
        };
        let persists = target.persists(rows, taps.taps.len());
        let fuses = target.fuses(rows);
        let mlp_parts = target.mlp_parts(rows);
        let last_rows = if logits_for == LogitsFor::Last {
            shape.batch
        } else {
            0
        };
        Ok(Self {
            inputs: StepInputs::new(gpu, shape, mask_columns)?,
            last: gpu.scratch(last_rows)?,
            hidden: gpu.scratch(rows * h)?,
            hidden_alt: gpu.scratch(if mlp_parts.is_some() { rows * h } else { 1 })?,
            mlp_scratch: gpu.scratch(match mlp_parts {
                Some(_) => Gpu::mlp_scratch_len(rows, h, inter),
                None => 1,
            })?,
            mlp_sums: gpu.scratch(mlp_parts.map_or(1, |parts| parts * rows * h))?,
            normed: gpu.scratch(rows * h)?,
            qkv: gpu.scratch(rows * qkv_dim)?,
            q: gpu.scratch(rows * q_dim)?,
            attn: gpu.scratch(rows * q_dim)?,
            delta: gpu.scratch(rows * h)?,
            gate_up: gpu.scratch(rows * 2 * inter)?,
            act: gpu.scratch(rows * inter)?,
            final_normed: gpu.scratch(rows * h)?,
            selected: gpu.scratch(last_rows * h)?,
            logits: match logits_rows {
                0 => None,
                n => Some(gpu.scratch(n * spec.vocab_size)?),
            },
            taps: (0..taps.taps.len())
                .map(|_| gpu.scratch(rows * h))
                .collect::<Result<_, _>>()?,
            visible: gpu.scratch(if persists || fuses {
                rows * (shape.capacity + 1)
            } else {
                1
            })?,
            persistent_table: None,
            batch: shape.batch,
            width: shape.width,
            logits_rows,
            needs_last: logits_for == LogitsFor::Last,
        })
    }

    /// Copies the step's inputs in (the scalars only matter to a graph, `last` only to
    /// `LogitsFor::Last`).
    fn load(
        &mut self,
        gpu: &Gpu,
        host: &HostStep,
        last: &[i32],
        chain: Option<ChainTokens<'_>>,
    ) -> Result<(), CudaError> {
        self.inputs.load(gpu, host)?;
        if let Some(chain) = chain {
            // The live sequences only: padding rows of a graph batch keep their placeholders.
            gpu.scatter_chain_tokens(
                chain.ids,
                chain.batch,
                (chain.steps, chain.first),
                &mut self.inputs.tokens_mut(),
                self.width,
            )?;
        }
        if self.needs_last {
            gpu.upload_into(last, &mut self.last)?;
        }
        Ok(())
    }

    fn rows(&self, data: CudaSlice<f32>, hidden: usize) -> DeviceRows {
        DeviceRows {
            data,
            batch: self.batch,
            width: self.width,
            hidden,
        }
    }

    /// The outputs of an eager step: its own buffers, moved out.
    fn into_output(
        mut self,
        target: &CudaTarget,
        taps: Vec<TapId>,
        visited: Vec<TapId>,
    ) -> CudaStepOutput {
        let h = target.spec.hidden_size;
        let tensors = std::mem::take(&mut self.taps)
            .into_iter()
            .map(|data| self.rows(data, h))
            .collect();
        let (rows, vocab) = (self.logits_rows, target.spec.vocab_size);
        CudaStepOutput {
            logits: self
                .logits
                .take()
                .map(|data| DeviceLogits::new(data, rows, vocab, target.gpu.clone())),
            taps: Taps {
                taps,
                tensors,
                visited,
            },
            kept: None,
        }
    }

    /// The outputs of a replayed step: copies, since the graph's buffers are reused.
    /// With `kept`, the taps are not copied (none come back): they stay in these buffers, for
    /// [`CudaTarget::push_kept_taps`] to copy once the caller has queued its read-back.
    fn copy_output(
        &self,
        target: &CudaTarget,
        taps: Vec<TapId>,
        visited: Vec<TapId>,
        kept: Option<KeptTaps>,
    ) -> Result<CudaStepOutput, CudaError> {
        let gpu = &*target.gpu;
        let h = target.spec.hidden_size;
        let tensors = match kept {
            Some(_) => Vec::new(),
            None => self
                .taps
                .iter()
                .map(|data| Ok(self.rows(gpu.duplicate(data)?, h)))
                .collect::<Result<_, CudaError>>()?,
        };
        let logits = match &self.logits {
            Some(data) => Some(DeviceLogits::new(
                gpu.duplicate(data)?,
                self.logits_rows,
                target.spec.vocab_size,
                target.gpu.clone(),
            )),
            None => None,
        };
        Ok(CudaStepOutput {
            logits,
            taps: Taps {
                taps,
                tensors,
                visited,
            },
            kept,
        })
    }
}

impl std::fmt::Debug for CudaTarget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "CudaTarget({}, {} layers, {:?})",
            self.spec.architecture, self.spec.num_layers, self.gpu
        )
    }
}

/// Logits of one step on the GPU, `[rows, vocab]` f32.
#[derive(Debug)]
pub struct DeviceLogits {
    pub data: CudaSlice<f32>,
    pub rows: usize,
    pub vocab: usize,
    gpu: Arc<Gpu>,
}

impl DeviceLogits {
    /// Wraps `[rows, vocab]` f32 logits already on `gpu`.
    pub fn new(data: CudaSlice<f32>, rows: usize, vocab: usize, gpu: Arc<Gpu>) -> Self {
        Self {
            data,
            rows,
            vocab,
            gpu,
        }
    }
    pub fn to_host(&self) -> Result<Vec<f32>, CudaError> {
        let mut values = self.gpu.download(&self.data)?;
        values.truncate(self.rows * self.vocab);
        Ok(values)
    }
    /// The greedy token of each row, computed on the GPU (one small read-back).
    pub fn argmax(&self) -> Result<Vec<u32>, CudaError> {
        self.gpu.argmax_rows(&self.data, self.rows, self.vocab)
    }
    /// One token per row drawn on the GPU from softmax(logits / `temperature`) within the
    /// `top_p` nucleus, row `r` with `seeds[r]` (see [`Gpu::sample_rows`]).
    pub fn sample(
        &self,
        temperature: f32,
        top_p: f32,
        seeds: &[u64],
    ) -> Result<Vec<u32>, CudaError> {
        self.gpu
            .sample_rows(&self.data, self.rows, self.vocab, temperature, top_p, seeds)
    }
    /// The `k` most likely entries of each row and their softmax probabilities, computed on
    /// the GPU: `(probs, ids)`, each `[rows * k]`, descending per row.
    pub fn topk(&self, k: usize) -> Result<(Vec<f32>, Vec<u32>), CudaError> {
        self.gpu
            .topk_softmax_rows(&self.data, self.rows, self.vocab, k)
    }
}

/// What a fast-path step returns: logits as chosen by [`LogitsFor`] (`Last`: one row per
/// sequence; `All`: every slot) and the requested taps, each `[batch, width, hidden]`.
#[derive(Debug)]
pub struct CudaStepOutput {
    pub logits: Option<DeviceLogits>,
    pub taps: Taps<DeviceRows>,
    /// From [`CudaTarget::forward_keeping_taps`] when the step replayed a graph: `taps` has no
    /// tensors, the taps are still in the graph's buffers.
    pub kept: Option<KeptTaps>,
}

/// A replayed step's taps left in its graph's buffers ([`CudaTarget::forward_keeping_taps`]):
/// valid until the target's next step, which may replay the same graph.
#[derive(Debug, Clone)]
pub struct KeptTaps {
    key: GraphKey,
    /// Tap rows of the step (`batch * width`, the graph's padding left out).
    pub rows: usize,
    pub taps: Vec<TapId>,
}

impl CudaStepOutput {
    /// Drops the rows of sequences `batch..` (a step padded to a graph's batch size): the data
    /// stays, the row counts every reader goes by shrink.
    fn keep_sequences(&mut self, batch: usize, width: usize, logits_for: LogitsFor) {
        if let Some(logits) = &mut self.logits {
            logits.rows = match logits_for {
                LogitsFor::All => batch * width,
                _ => batch,
            };
        }
        for tap in &mut self.taps.tensors {
            tap.batch = batch;
        }
        if let Some(kept) = &mut self.kept {
            kept.rows = batch * width;
        }
    }
}

/// The cut-off of the fused small-step kernels on targets they are the default for (hidden size
/// at most [`FUSED_DEFAULT_MAX_HIDDEN`]): every step of at most 32 rows (a batch-1 decode, chain
/// and tree verifications, a 3/1/4 verification at batch 8, batches of up to 32) runs them
/// where the tensor-core kernels take every product (`Gpu::fused_max_rows`; 8 rows on the
/// CUDA-core kernels). `TANDEM_CUDA_FUSED=N` sets another cut-off on any target,
/// `TANDEM_CUDA_FUSED=0` turns them off.
///
/// The fused kernels are batch invariant (a row gets the same bits at every step width, and
/// attention groups its keys by their rank among its visible keys). With every step of a
/// batch-1 round fused, greedy speculative output equals target-only output bit for bit (80/80
/// MT-Bench replies, sessions 24 and 25), where a cut-off of 4 (8-row verifications on cuBLAS)
/// left it at near-ties (52/80) and cuBLAS alone at 45-54/80. On SmolLM2 they cost less than
/// cuBLAS at one row and more at 8 (a tree-8 verification 1.36 ms against 1.19), and `tandem
/// serve` with the speculation policy was faster with them than without at every concurrency
/// (1.30x/1.34x/1.14x/1.04x target-only at c1/8/32/64; BENCHMARKS.md, session 24), which made
/// them the default there in session 25. Steps of 9 to 32 rows run fused since session 44 (row
/// groups of the tensor-core kernels, `MMA_MAX_ROWS`).
pub const FUSED_MAX_ROWS: usize = MMA_MAX_ROWS;

/// The largest hidden size the fused kernels are on by default for. Their one-warp-per-output
/// products keep too few loads in flight for wide rows: on a Qwen2.5-1.5B-shaped model (hidden
/// 1,536, intermediate 8,960) a fused batch-1 decode took 2.29 ms against 2.08 on cuBLAS and a
/// batch-8 decode 3.85 against 2.06 (H200, session 25), where SmolLM2 (hidden 576) gains.
pub const FUSED_DEFAULT_MAX_HIDDEN: usize = 1024;

/// Rows of recorded hidden states [`CudaTarget::last_block_argmax`] turns into logits at once
/// (512 rows of a 152K vocabulary are 311 MB of f32 logits).
pub const LAST_BLOCK_ROWS: usize = 512;

/// The fused cut-off for a model of hidden size `hidden`: `TANDEM_CUDA_FUSED=N` (steps of at
/// most N rows fused, N capped at [`FUSED_MAX_ROWS`]; 0, empty or not a number: off), else
/// [`FUSED_MAX_ROWS`] up to [`FUSED_DEFAULT_MAX_HIDDEN`] and off above it.
pub(crate) fn fused_rows_default(hidden: usize) -> usize {
    match std::env::var_os("TANDEM_CUDA_FUSED") {
        Some(_) => rows_from_env("TANDEM_CUDA_FUSED").min(FUSED_MAX_ROWS),
        None if hidden <= FUSED_DEFAULT_MAX_HIDDEN => FUSED_MAX_ROWS,
        None => 0,
    }
}

/// Fused steps of at most this many sequences take q|k|v and attention in one launch a layer
/// by default: one (session 48, H100, clusters of 6: a batch-1 decode 0.568 ms against 0.619,
/// target-only `tandem bench` at batch 1 +11%; two rows 0.676 against 0.638, four 0.821
/// against 0.643, eight 1.10 ms of device time against 0.70: each sequence's blocks load the
/// head's weights again).
pub(crate) const QKV_ATTENTION_DEFAULT_SEQUENCES: usize = 1;

/// `TANDEM_CUDA_QKV_ATTENTION=N` (0 turns it off), else [`QKV_ATTENTION_DEFAULT_SEQUENCES`].
pub(crate) fn qkv_attention_sequences_default() -> usize {
    rows_from_env_or("TANDEM_CUDA_QKV_ATTENTION", QKV_ATTENTION_DEFAULT_SEQUENCES)
        .min(FUSED_MAX_ROWS)
}

/// Steps of at most this many tokens a sequence take the one launch by default (up to
/// [`GEMV_MAX_ROWS`]: a sequence's tokens are one mma's columns). Four (session 50, H100,
/// fast-bench at batch 1: verifying 4 tokens 0.608 ms against 0.648, 1.02 decode steps
/// against 1.10; `tandem bench` 3/1/4 speculative 2,481 tok/s against 2,423), not eight:
/// verifying 8 tokens took 0.769 ms through it against 0.733 (clusters of 8 ranks, each
/// attending one token after the barrier, outlast the row kernels there).
pub(crate) const QKV_ATTENTION_DEFAULT_WIDTH: usize = 4;

/// `TANDEM_CUDA_QKV_ATTENTION_WIDTH=N` (capped at [`GEMV_MAX_ROWS`]), else
/// [`QKV_ATTENTION_DEFAULT_WIDTH`].
pub(crate) fn qkv_attention_width_default() -> usize {
    rows_from_env_or(
        "TANDEM_CUDA_QKV_ATTENTION_WIDTH",
        QKV_ATTENTION_DEFAULT_WIDTH,
    )
    .min(GEMV_MAX_ROWS)
}

/// `TANDEM_CUDA_PERSISTENT=N`: steps of at most N rows (capped at [`GEMV_MAX_ROWS`]) run the
/// persistent one-launch step; 0 (off) without it.
pub(crate) fn persistent_rows_default() -> usize {
    rows_from_env("TANDEM_CUDA_PERSISTENT").min(GEMV_MAX_ROWS)
}

fn rows_from_env(name: &str) -> usize {
    rows_from_env_or(name, 0)
}

/// A row count from the environment variable `name`, `default` where it is unset or not a
/// number.
fn rows_from_env_or(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
        .unwrap_or(default)
}

/// [`CudaTarget::persistent_profile`]: block 0's cycles by phase of one persistent step.
#[derive(Debug, Clone, PartialEq)]
pub struct PersistentProfile {
    /// `(phase, work cycles, barrier-wait cycles)`, phases in step order.
    pub phases: Vec<(&'static str, u64, u64)>,
    /// The final norm and the logits (no barrier after them).
    pub final_cycles: u64,
}

impl PersistentProfile {
    /// Phase names of a layer, in order.
    pub const LAYER_PHASES: [&'static str; 5] = ["qkv", "attention", "o_proj", "gate_up", "down"];

    /// From the clocks the kernel wrote: `[arrive, release]` per barrier, then the end.
    pub fn from_clocks(clocks: &[u64], layers: usize) -> Self {
        let barriers = 5 * layers + 1;
        let mut phases: Vec<(&'static str, u64, u64)> = std::iter::once("embed")
            .chain(Self::LAYER_PHASES)
            .map(|name| (name, 0, 0))
            .collect();
        let mut released = None;
        for i in 0..barriers {
            let (arrive, release) = (clocks[2 * i], clocks[2 * i + 1]);
            let phase = if i == 0 { 0 } else { 1 + (i - 1) % 5 };
            let work = released.map_or(0, |r: u64| arrive.saturating_sub(r));
            phases[phase].1 += work;
            phases[phase].2 += release.saturating_sub(arrive);
            released = Some(release);
        }
        let final_cycles = clocks[2 * barriers].saturating_sub(released.unwrap_or(0));
        Self {
            phases,
            final_cycles,
        }
    }
}

/// A tap point's index in the persistent step's tap table: 0 the embedding, 1 + k block k,
/// `layers + 1` the final norm.
fn persistent_tap_point(tap: TapId, layers: usize) -> u64 {
    match tap {
        TapId::Embed => 0,
        TapId::Block(k) => k as u64 + 1,
        TapId::Final => layers as u64 + 1,
    }
}

/// Batch sizes CUDA graphs are captured for (and multiples of 64 beyond): a graphed step of
/// another size is padded up to the next one the cache has rows for.
pub const GRAPH_BATCHES: [usize; 12] = [1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 56, 64];

/// The batch a graphed step of `batch` sequences runs at, given the rows the cache holds.
pub(crate) fn graph_batch(batch: usize, rows_allocated: usize) -> usize {
    let bucket = GRAPH_BATCHES
        .iter()
        .copied()
        .find(|&b| b >= batch)
        .unwrap_or_else(|| batch.div_ceil(64) * 64);
    if bucket <= rows_allocated {
        bucket
    } else {
        batch
    }
}

impl CudaTarget {
    /// Loads `config.json` and the safetensors weights of an HF model directory onto `gpu`.
    pub fn load(dir: &Path, gpu: Arc<Gpu>) -> Result<Self, CudaError> {
        let spec = HfConfig::load(&dir.join("config.json"))?.resolve()?;
        DeviceWeights::check_supported(&spec)?;
        let files = WeightFiles::open(dir)?;
        Self::load_rank(dir, spec.clone(), spec, &files, gpu, None)
    }

    /// The model of `dir` split over `gpus.len()` tensor-parallel ranks, rank `r` on `gpus[r]`
    /// ([`crate::tensor_parallel`]): the returned target is rank 0 and runs the others beside
    /// it, one thread each, at every step. Its caches hold each rank's KV heads on that rank's
    /// GPU. Its taps and logits come from rank 0 (every rank holds the whole reduced residual
    /// stream, so the hook taps it once). Every step runs the unfused kernels: the fused ones add
    /// o_proj and down_proj straight into the residual, leaving no partial sum to reduce.
    /// Decode-sized steps replay CUDA graphs that hold each rank's NCCL all-reduces, as on one
    /// GPU (each rank captures its own, in its thread); host sums run eagerly. One GPU with
    /// [`TpReduction::Nccl`] runs the split code with a one-rank communicator.
    pub fn load_tensor_parallel(
        dir: &Path,
        gpus: &[Arc<Gpu>],
        reduction: TpReduction,
    ) -> Result<Self, CudaError> {
        let ranks = gpus.len();
        if ranks == 0 {
            return Err(CudaError::Collective(
                "a tensor-parallel target needs at least one GPU".into(),
            ));
        }
        let spec = HfConfig::load(&dir.join("config.json"))?.resolve()?;
        DeviceWeights::check_supported(&spec)?;
        let rank_spec = spec.tensor_parallel_rank(ranks)?;
        let files = WeightFiles::open(dir)?;
        let mut targets = Vec::with_capacity(ranks);
        for (rank, (gpu, reducer)) in gpus
            .iter()
            .zip(Reducer::group(gpus, reduction)?)
            .enumerate()
        {
            let tp = TensorParallel {
                split: RankSplit { rank, ranks },
                reducer,
                peers: Vec::new(),
                home: Arc::clone(gpu),
                poisoned: AtomicBool::new(false),
            };
            targets.push(Self::load_rank(
                dir,
                spec.clone(),
                rank_spec.clone(),
                &files,
                Arc::clone(gpu),
                Some(tp),
            )?);
        }
        let mut first = targets.remove(0);
        first.tp.as_mut().expect("every rank has its place").peers = targets;
        Ok(first)
    }

    /// What `--tp` loads: for one rank, [`CudaTarget::load`] on GPU 0; for more,
    /// [`CudaTarget::load_tensor_parallel`] over GPUs 0..ranks with NCCL, or every rank on GPU
    /// 0 with host sums under `TANDEM_CUDA_TP_SIMULATE=1` ([`TpReduction::from_env`]).
    pub fn load_ranks(dir: &Path, ranks: usize) -> Result<Self, CudaError> {
        Self::load_ranks_from(dir, ranks, 0)
    }

    /// [`CudaTarget::load_ranks`] over GPUs `first..first + ranks` (a data-parallel process
    /// of a launcher that leaves every GPU visible takes its own, from LOCAL_RANK).
    pub fn load_ranks_from(dir: &Path, ranks: usize, first: usize) -> Result<Self, CudaError> {
        if ranks <= 1 {
            return Self::load(dir, Gpu::new(first)?);
        }
        // A split the model does not allow is named before any GPU is touched.
        HfConfig::load(&dir.join("config.json"))?
            .resolve()?
            .check_tensor_parallel(ranks)?;
        let reduction = TpReduction::from_env();
        let gpus = (0..ranks)
            .map(|rank| match reduction {
                TpReduction::Nccl => Gpu::new(first + rank),
                TpReduction::HostSimulation => Gpu::new(first),
            })
            .collect::<Result<Vec<_>, _>>()?;
        Self::load_tensor_parallel(dir, &gpus, reduction)
    }

    /// A wiring fault on purpose, for replay's tests and demonstrations: rank 0 of a
    /// tensor-parallel target takes its block taps before the MLP's all-reduce (the residual
    /// after attention plus its own down_proj product, one rank's partial sum), as a capture
    /// hook placed inside the tensor-parallel MLP would. Nothing else changes: logits and the
    /// other ranks are right, and the taps are wrong. `TANDEM_CUDA_FAULT=tp-partial-sum` turns
    /// it on at load (a `tandem dump --tp N` that records it). No effect on one GPU.
    pub fn set_partial_sum_fault(&self, on: bool) {
        self.partial_sum_fault.store(on, Ordering::Relaxed);
    }

    fn partial_sum_fault(&self) -> bool {
        self.tp.as_ref().is_some_and(|tp| tp.split.ranks > 1)
            && self.partial_sum_fault.load(Ordering::Relaxed)
    }

    /// Runs `f` on the model's CPU f32 copy (burn), loaded from the model directory on first use:
    /// what the fast path has no kernels for (replay's tensor-parallel partial-sum candidates).
    pub(crate) fn with_cpu_model<R>(
        &self,
        f: impl FnOnce(&TargetModel<CpuBackend>) -> Result<R, ModelError>,
    ) -> Result<R, ModelError> {
        let mut slot = self.cpu_model.lock().expect("a CPU model user panicked");
        if slot.is_none() {
            *slot = Some(TargetModel::load(&self.source, &Default::default())?);
        }
        f(slot.as_ref().expect("loaded above"))
    }

    /// The tensor-parallel degree (1: the whole model on one GPU).
    pub fn tensor_parallel(&self) -> usize {
        self.tp.as_ref().map_or(1, |tp| tp.split.ranks)
    }

    /// How a split target's partial sums are added (`None` on one GPU).
    pub fn tensor_parallel_reduction(&self) -> Option<TpReduction> {
        let tp = self.tp.as_ref().filter(|tp| tp.split.ranks > 1)?;
        Some(if tp.reducer.capturable() {
            TpReduction::Nccl
        } else {
            TpReduction::HostSimulation
        })
    }

    /// What jobs print after the device: nothing on one GPU, else the ranks and how their
    /// sums are added (", tensor-parallel over 2 ranks (NCCL)").
    pub fn tensor_parallel_label(&self) -> String {
        match self.tensor_parallel_reduction() {
            None => String::new(),
            Some(TpReduction::Nccl) => {
                format!(
                    ", tensor-parallel over {} ranks (NCCL)",
                    self.tensor_parallel()
                )
            }
            Some(TpReduction::HostSimulation) => format!(
                ", tensor-parallel over {} ranks (host sums on one GPU, a test stand-in)",
                self.tensor_parallel()
            ),
        }
    }

    fn load_rank(
        dir: &Path,
        spec: ModelSpec,
        rank_spec: ModelSpec,
        files: &WeightFiles,
        gpu: Arc<Gpu>,
        tp: Option<TensorParallel>,
    ) -> Result<Self, CudaError> {
        let split = tp
            .as_ref()
            .map_or(RankSplit { rank: 0, ranks: 1 }, |tp| tp.split);
        let weights = DeviceWeights::load_split(&gpu, &spec, files, split)?;
        let inv_freq: Vec<f32> = spec.rope_inv_freq().iter().map(|&f| f as f32).collect();
        let inv_freq = gpu.upload(&inv_freq)?;
        Ok(Self {
            rank_spec,
            tp,
            partial_sum_fault: AtomicBool::new(
                std::env::var("TANDEM_CUDA_FAULT").is_ok_and(|v| v == "tp-partial-sum"),
            ),
            source: dir.to_path_buf(),
            cpu_model: Mutex::new(None),
            graphs: Graphs::new(gpu.graphs_default()),
            fused_rows: AtomicUsize::new(fused_rows_default(spec.hidden_size)),
            persistent_rows: AtomicUsize::new(persistent_rows_default()),
            qkv_attention_sequences: AtomicUsize::new(qkv_attention_sequences_default()),
            qkv_attention_width: AtomicUsize::new(qkv_attention_width_default()),
            barrier: gpu.zeros::<u32>(1)?,
            profile: if std::env::var("TANDEM_CUDA_PERSISTENT_PROFILE").is_ok_and(|v| v == "1") {
                Some(gpu.zeros::<u64>(Gpu::persistent_profile_len(spec.num_layers))?)
            } else {
                None
            },
            spec,
            gpu,
            weights,
            inv_freq,
        })
    }

    /// Steps of at most `rows` rows (capped at [`FUSED_MAX_ROWS`], and at what the kernels
    /// take: `Gpu::fused_max_rows`) run the fused small-step kernels; 0 turns them off: every
    /// step then runs the cuBLAS GEMMs and the separate norm, RoPE and SwiGLU kernels, the
    /// baseline `fast-bench --fused both` measures and the reference the GPU tests compare the
    /// fused kernels with. Default: [`FUSED_MAX_ROWS`] (32) on targets of hidden size up to
    /// [`FUSED_DEFAULT_MAX_HIDDEN`], off above, or `TANDEM_CUDA_FUSED=N`.
    pub fn set_fused_rows(&self, rows: usize) {
        self.fused_rows
            .store(rows.min(FUSED_MAX_ROWS), Ordering::Relaxed);
    }

    pub fn fused_rows(&self) -> usize {
        self.fused_rows.load(Ordering::Relaxed)
    }

    /// Steps of at most `rows` rows (capped at [`GEMV_MAX_ROWS`]) run the persistent step: the
    /// whole step in one launch of one block per SM (`persistent_step` in kernels/llama.cu),
    /// whose rows are batch invariant: a row's logits and taps are the same bits at every step
    /// width it takes. 0 turns it off; default `TANDEM_CUDA_PERSISTENT=N`, else 0.
    pub fn set_persistent_rows(&self, rows: usize) {
        self.persistent_rows
            .store(rows.min(GEMV_MAX_ROWS), Ordering::Relaxed);
    }

    pub fn persistent_rows(&self) -> usize {
        self.persistent_rows.load(Ordering::Relaxed)
    }

    /// Fused steps of at most `sequences` sequences (capped at [`FUSED_MAX_ROWS`]) and at most
    /// [`CudaTarget::qkv_attention_width`] tokens a sequence take each layer's q|k|v and
    /// attention in one launch (`Gpu::qkv_attention`: four launches a layer instead of five),
    /// with the same bits as the two launches; 0 turns it off. Default
    /// `TANDEM_CUDA_QKV_ATTENTION=N`, else [`QKV_ATTENTION_DEFAULT_SEQUENCES`]; only where the
    /// GPU runs it in clusters (`Gpu::qkv_attention_fits`).
    pub fn set_qkv_attention_sequences(&self, sequences: usize) {
        self.qkv_attention_sequences
            .store(sequences.min(FUSED_MAX_ROWS), Ordering::Relaxed);
    }

    pub fn qkv_attention_sequences(&self) -> usize {
        self.qkv_attention_sequences.load(Ordering::Relaxed)
    }

    /// The most tokens a sequence a step may have to take the one launch (1: decode steps
    /// only; up to [`GEMV_MAX_ROWS`]: verifications of up to that many tokens too). Default
    /// `TANDEM_CUDA_QKV_ATTENTION_WIDTH=N`, else [`QKV_ATTENTION_DEFAULT_WIDTH`].
    pub fn set_qkv_attention_width(&self, width: usize) {
        self.qkv_attention_width
            .store(width.min(GEMV_MAX_ROWS), Ordering::Relaxed);
    }

    pub fn qkv_attention_width(&self) -> usize {
        self.qkv_attention_width.load(Ordering::Relaxed)
    }

    /// Whether a fused step of `shape` takes its q|k|v and attention in one launch a layer.
    fn one_launch_attention(&self, shape: AttentionShape) -> bool {
        shape.batch <= self.qkv_attention_sequences()
            && shape.width <= self.qkv_attention_width()
            && self.fuses(shape.rows())
            && self.gpu.qkv_attention_fits(
                self.rank_spec.hidden_size,
                self.rank_spec.head_dim,
                shape.width,
                self.mlp_parts(shape.rows()).is_some(),
            )
    }

    /// The cluster sums each layer's MLP leaves when a fused step of `rows` rows takes it in
    /// one launch (`Gpu::mlp_partials`: gate|up, SwiGLU and down_proj's split-k products, the
    /// layer's output then added by its reader); `None`: two launches (gate|up, down_proj).
    /// Every fused step of a process takes the same (the sums' order is part of a row's bits).
    fn mlp_parts(&self, rows: usize) -> Option<usize> {
        let spec = &self.rank_spec;
        if !self.fuses(rows) || self.partial_sum_fault() {
            return None;
        }
        self.gpu.mlp_parts(spec.hidden_size, spec.intermediate_size)
    }

    /// Where the last persistent step spent block 0's clock cycles, by phase (with
    /// `TANDEM_CUDA_PERSISTENT_PROFILE=1`; `None` otherwise): for the embedding and each of a
    /// layer's five phases (q|k|v, attention, o_proj, gate|up, down_proj; summed over layers)
    /// the cycles its work took and the cycles it then waited at the grid barrier, and the
    /// cycles of the final norm and logits.
    pub fn persistent_profile(&self) -> Result<Option<PersistentProfile>, CudaError> {
        let Some(buffer) = &self.profile else {
            return Ok(None);
        };
        let clocks = self.gpu.download(buffer)?;
        Ok(Some(PersistentProfile::from_clocks(
            &clocks,
            self.spec.num_layers,
        )))
    }

    /// Whether a step of `rows` rows with `tap_slots` taps runs the persistent step: within the
    /// cut-off and its limits, and no per-head q/k norm (not implemented there).
    fn persists(&self, rows: usize, tap_slots: usize) -> bool {
        let spec = &self.rank_spec;
        self.tp.is_none()
            && rows <= self.persistent_rows()
            && !spec.qk_norm
            && Gpu::persistent_fits(
                spec.num_layers,
                rows,
                spec.hidden_size,
                [spec.num_heads, spec.num_kv_heads, spec.head_dim],
                spec.intermediate_size,
                tap_slots,
            )
    }

    /// The persistent step's table for one step's buffers over `cache`: every layer's weight
    /// and cache addresses (`PersistLayer` in kernels/llama.cu), then each tap slot's point and
    /// buffer. Built before a step runs or is captured (an upload must not happen inside a
    /// capture); a graph keyed by the cache's addresses keeps it valid.
    fn persistent_table(
        &self,
        cache: &CudaKvCache,
        taps: &TapRequest,
        tap_buffers: &[CudaSlice<f32>],
    ) -> Result<CudaSlice<u64>, CudaError> {
        let gpu = &*self.gpu;
        let layers = &self.weights.layers;
        let mut words =
            Vec::with_capacity(layers.len() * PERSISTENT_TABLE_WORDS + 2 * taps.taps.len());
        for (k, layer) in layers.iter().enumerate() {
            words.extend([
                gpu.address(&layer.input_norm),
                gpu.address(&layer.qkv),
                layer.qkv_bias.as_ref().map_or(0, |b| gpu.address(b)),
                gpu.address(&layer.o),
                gpu.address(&layer.post_norm),
                gpu.address(&layer.gate_up),
                gpu.address(&layer.down),
                gpu.address(&cache.keys[k]),
                gpu.address(&cache.values[k]),
            ]);
        }
        for (tap, buffer) in taps.taps.iter().zip(tap_buffers) {
            words.push(persistent_tap_point(*tap, layers.len()));
            words.push(gpu.address(buffer));
        }
        gpu.upload(&words)
    }

    /// Whether a step of `rows` rows runs fused: small enough for the matrix-vector kernels,
    /// no per-head q/k norm (Qwen3 norms q and k between the projection and RoPE, which the
    /// fused q|k|v kernel does not), and a head_dim the batch-invariant attention takes.
    fn fuses(&self, rows: usize) -> bool {
        let spec = &self.rank_spec;
        self.tp.is_none()
            && rows <= self.fused_rows()
            && rows
                <= self.gpu.fused_max_rows(
                    spec.hidden_size,
                    spec.num_heads * spec.head_dim,
                    spec.intermediate_size,
                )
            && !spec.qk_norm
            && [32, 64, 128, 256].contains(&spec.head_dim)
            && Gpu::fused_layer_fits(
                rows.min(GEMV_MAX_ROWS),
                1,
                spec.hidden_size,
                spec.num_heads,
                spec.num_kv_heads,
                spec.head_dim,
                spec.intermediate_size,
            )
    }

    pub fn gpu(&self) -> &Arc<Gpu> {
        &self.gpu
    }

    /// Every rank's GPU, rank 0 (this target's) first: one GPU unless the target is split.
    /// Device-wide settings (the memory pool's release threshold) go to each of them.
    pub fn rank_gpus(&self) -> Vec<&Arc<Gpu>> {
        let peers = self.tp.iter().flat_map(|tp| &tp.peers);
        std::iter::once(&self.gpu)
            .chain(peers.map(|peer| &peer.gpu))
            .collect()
    }

    /// The token embedding `[vocab, hidden]` (bf16), which the draft head shares.
    pub fn embedding(&self) -> &CudaSlice<u16> {
        &self.weights.embed
    }

    /// Block `k`'s `input_layernorm` weight on the host, widened from the bf16 the fast path
    /// computes with (replay derives the normed candidates from it).
    pub fn input_norm_weight(&self, k: usize) -> Result<Vec<f32>, CudaError> {
        self.widened(&self.weights.layers[k].input_norm)
    }

    /// The target's greedy token after each row of recorded last-block hidden states
    /// (`hidden: [rows * hidden_size]` f32, the residual stream after the last block, as a
    /// dump's `last_hidden`): the final norm, lm_head and argmax a step runs, in pieces of
    /// [`LAST_BLOCK_ROWS`] rows so the logits of a long sample stay small.
    pub fn last_block_argmax(&self, hidden: &[f32]) -> Result<Vec<u32>, CudaError> {
        let (h, vocab) = (self.spec.hidden_size, self.spec.vocab_size);
        let eps = self.spec.rms_norm_eps as f32;
        if !hidden.len().is_multiple_of(h) {
            return Err(ModelError::InvalidStep {
                reason: format!(
                    "{} last-block values are not whole rows of {h}",
                    hidden.len()
                ),
            }
            .into());
        }
        let mut ids = Vec::with_capacity(hidden.len() / h);
        for piece in hidden.chunks(LAST_BLOCK_ROWS * h) {
            let rows = piece.len() / h;
            let mut x = self.gpu.upload(piece)?;
            let mut normed = self.gpu.scratch::<u16>(rows * h)?;
            self.gpu.add_rms_norm(
                &mut x,
                None,
                &self.weights.final_norm,
                &mut normed,
                None,
                rows,
                h,
                eps,
            )?;
            let mut logits = self.gpu.scratch::<f32>(rows * vocab)?;
            self.gpu
                .linear(&normed, self.weights.lm_head(), &mut logits, rows, h, vocab)?;
            ids.extend(self.gpu.argmax_rows(&logits, rows, vocab)?);
        }
        Ok(ids)
    }

    /// The final norm's weight on the host (replay relates the `final` tap's scale to it).
    pub fn final_norm_weight(&self) -> Result<Vec<f32>, CudaError> {
        self.widened(&self.weights.final_norm)
    }

    fn widened(&self, bf16: &CudaSlice<u16>) -> Result<Vec<f32>, CudaError> {
        let bits = self.gpu.download(bf16)?;
        Ok(bits
            .iter()
            .map(|&b| f32::from_bits(u32::from(b) << 16))
            .collect())
    }

    /// An empty cache for `batch` sequences of up to `capacity` columns.
    /// Under tensor parallelism, each rank's KV heads on its GPU.
    pub fn new_cache(&self, batch: usize, capacity: usize) -> Result<CudaKvCache, CudaError> {
        let spec = &self.rank_spec;
        let cache = CudaKvCache::new(
            &self.gpu,
            spec.num_layers,
            batch,
            spec.num_kv_heads,
            spec.head_dim,
            capacity,
        )?;
        let Some(tp) = &self.tp else {
            return Ok(cache);
        };
        let peers = tp
            .peers
            .iter()
            .map(|peer| {
                Ok(PeerCache {
                    gpu: Arc::clone(&peer.gpu),
                    cache: peer.new_cache(batch, capacity)?,
                })
            })
            .collect::<Result<_, CudaError>>()?;
        // The other ranks' allocations made their GPUs current.
        self.gpu.bind_to_thread()?;
        Ok(cache.with_peers(peers))
    }

    /// One step of any mode over the cache. The block loop ([`CudaTarget::encode`]) is the
    /// fast path's only reader of hidden states, and it hands each tap point to the shared
    /// capture hook. Steps of up to [`GRAPH_MAX_WIDTH`] tokens (decode, tree verification)
    /// replay a CUDA graph of that loop once their shape and cache have run eagerly twice
    /// (see `graphs.rs`); longer steps (prefill) always run eagerly.
    pub fn forward(
        &self,
        step: &StepInput,
        cache: &mut CudaKvCache,
        taps: &TapRequest,
        logits_for: LogitsFor,
    ) -> Result<CudaStepOutput, CudaError> {
        self.forward_with(step, cache, taps, logits_for, None, false)
    }

    /// [`CudaTarget::forward`] of a verification of greedy chains whose drafted tokens are
    /// still on the device: `ids` `[steps, batch]` as [`crate::CudaDraft::draft_chain_ids`]
    /// leaves them, copied into each sequence's slots 1..=steps of `step` (whatever `step`
    /// holds there) after the step's inputs are loaded. Nothing waits for the device: the
    /// verification is queued behind the drafting.
    pub fn forward_chains(
        &self,
        step: &StepInput,
        cache: &mut CudaKvCache,
        taps: &TapRequest,
        logits_for: LogitsFor,
        ids: &CudaSlice<u32>,
        steps: usize,
    ) -> Result<CudaStepOutput, CudaError> {
        if steps >= step.width || ids.len() < steps * step.batch {
            return Err(ModelError::InvalidStep {
                reason: format!(
                    "chains of {steps} drafts for {} sequences do not fit a step of width {} \
                     ({} ids on the device)",
                    step.batch,
                    step.width,
                    ids.len()
                ),
            }
            .into());
        }
        let chain = ChainTokens {
            ids,
            batch: step.batch,
            steps,
            first: 1,
        };
        self.forward_with(step, cache, taps, logits_for, Some(chain), false)
    }

    /// [`CudaTarget::forward`] of a decode step (one token a sequence) whose tokens are still on
    /// the device: `ids[b]` is sequence `b`'s (the previous step's greedy ids, as
    /// `Gpu::argmax_rows_into` leaves them), so a plain round's next step is queued before the
    /// host has read this one's ids. The step's own tokens are placeholders.
    pub fn forward_roots(
        &self,
        step: &StepInput,
        cache: &mut CudaKvCache,
        taps: &TapRequest,
        logits_for: LogitsFor,
        ids: &CudaSlice<u32>,
    ) -> Result<CudaStepOutput, CudaError> {
        if step.width != 1 || ids.len() < step.batch {
            return Err(ModelError::InvalidStep {
                reason: format!(
                    "roots on the device take a decode step (width {}) of at most {} sequences \
                     ({} sequences)",
                    step.width,
                    ids.len(),
                    step.batch
                ),
            }
            .into());
        }
        let roots = ChainTokens {
            ids,
            batch: step.batch,
            steps: 1,
            first: 0,
        };
        self.forward_with(step, cache, taps, logits_for, Some(roots), false)
    }

    /// [`CudaTarget::forward`] for a step whose taps the caller copies elsewhere after queuing
    /// its read-back (a plain round's taps into the head's backlog): a replayed step leaves them
    /// in its graph's buffers (`kept`, copied by [`CudaTarget::push_kept_taps`]) instead of
    /// copying each into a buffer of its own ahead of the read-back; an eager step returns
    /// them as `forward` does.
    pub fn forward_keeping_taps(
        &self,
        step: &StepInput,
        cache: &mut CudaKvCache,
        taps: &TapRequest,
        logits_for: LogitsFor,
    ) -> Result<CudaStepOutput, CudaError> {
        self.forward_with(step, cache, taps, logits_for, None, true)
    }

    /// Copies kept taps (every tap row of the step) into `dsts` (one buffer per tap, in the
    /// request's order) from row `at`, in one launch.
    pub fn push_kept_taps(
        &self,
        kept: &KeptTaps,
        dsts: &mut [&mut CudaSlice<f32>],
        at: usize,
    ) -> Result<(), CudaError> {
        let h = self.spec.hidden_size;
        let graphs = self.graphs.lock();
        let entry = graphs
            .captured
            .get(&kept.key)
            .expect("kept taps are read before the next step");
        assert_eq!(
            entry.buffers.taps.len(),
            dsts.len(),
            "one destination per tap"
        );
        let mut pairs: Vec<(&CudaSlice<f32>, &mut CudaSlice<f32>)> = entry
            .buffers
            .taps
            .iter()
            .zip(dsts.iter_mut())
            .map(|(src, dst)| (src, &mut **dst))
            .collect();
        self.gpu
            .copy_pairs_to_offset(&mut pairs, at * h, kept.rows * h)
    }

    /// Seconds one replay of the step graph replayed last takes when `replays` of them are
    /// queued back to back, with no host work between them (no input uploads, no read-back):
    /// the step's device time, against which a decode loop's wall time a step shows what the
    /// host adds. The replays recompute that step from the inputs it was given (its cache
    /// columns are written again with the same values). `None` when no graph has replayed.
    pub fn time_last_replay(&self, replays: usize) -> Result<Option<f64>, CudaError> {
        let graphs = self.graphs.lock();
        let Some(entry) = graphs.last.as_ref().and_then(|k| graphs.captured.get(k)) else {
            return Ok(None);
        };
        let replays = replays.max(1);
        self.gpu.synchronize()?;
        let started = std::time::Instant::now();
        for _ in 0..replays {
            self.gpu.replay(&entry.graph)?;
        }
        self.gpu.synchronize()?;
        Ok(Some(started.elapsed().as_secs_f64() / replays as f64))
    }

    fn forward_with(
        &self,
        step: &StepInput,
        cache: &mut CudaKvCache,
        taps: &TapRequest,
        logits_for: LogitsFor,
        chain: Option<ChainTokens<'_>>,
        keep_taps: bool,
    ) -> Result<CudaStepOutput, CudaError> {
        match &self.tp {
            Some(tp) if !tp.peers.is_empty() => {
                self.forward_ranks(tp, step, cache, taps, logits_for, chain)
            }
            _ => self.forward_rank(
                step,
                cache,
                taps,
                logits_for,
                chain,
                GraphPlan::Own,
                keep_taps,
            ),
        }
    }

    /// A step of a tensor-parallel target: rank 0 (this target) here, every other rank on a
    /// thread of its own over its cache, all meeting at the all-reduces. Only rank 0 takes taps
    /// and logits. A rank that fails releases the others: host sums are aborted; with NCCL the
    /// step's graphs are dropped and every rank's communicator is aborted (an all-reduce queued
    /// on a partner's GPU would otherwise wait for ever), and the target refuses further steps
    /// until it is loaded again.
    fn forward_ranks(
        &self,
        tp: &TensorParallel,
        step: &StepInput,
        cache: &mut CudaKvCache,
        taps: &TapRequest,
        logits_for: LogitsFor,
        chain: Option<ChainTokens<'_>>,
    ) -> Result<CudaStepOutput, CudaError> {
        if tp.poisoned.load(Ordering::Relaxed) {
            return Err(CudaError::Collective(
                "an earlier step failed on a tensor-parallel rank, and the ranks' NCCL \
                 all-reduces may be out of step since: load the target again"
                    .into(),
            ));
        }
        if cache.peers.len() != tp.peers.len() {
            return Err(ModelError::InvalidStep {
                reason: format!(
                    "a cache of {} ranks given to a target of {}",
                    cache.peers.len() + 1,
                    tp.peers.len() + 1
                ),
            }
            .into());
        }
        // What only rank 0 checks (the others take no taps) fails here, before any rank has
        // queued an all-reduce that its partners would never meet.
        taps.validate(self.rank_spec.num_layers)?;
        cache.check(step)?;
        check_token_ids(&step.tokens, self.rank_spec.vocab_size)?;
        // A host sum aborted by a failed step starts the next one clean (every rank thread of
        // that step has been joined).
        tp.reducer.reset();
        // The other ranks take the step's tokens from the host: drafted chain tokens on rank
        // 0's GPU come back first (one read-back, which waits for the drafting).
        let filled;
        let step = match chain {
            Some(chain) => {
                let ids = self.gpu.download(chain.ids)?;
                let mut with_chain = step.clone();
                for b in 0..chain.batch {
                    for s in 0..chain.steps {
                        with_chain.tokens[b * step.width + chain.first + s] =
                            ids[s * chain.batch + b];
                    }
                }
                filled = with_chain;
                &filled
            }
            None => step,
        };
        cache.sync_peers();
        // One graph decision for every rank, made here on rank 0's graph cache.
        let padded = self.graphs_enabled() && step.width <= GRAPH_MAX_WIDTH;
        let key = padded
            .then(|| self.shared_graph_key(step, cache, taps, logits_for))
            .filter(|key| self.graphs.lock().ready(key));
        let plan = GraphPlan::Shared {
            padded,
            graph: key.as_ref(),
        };
        let mut peer_caches = std::mem::take(&mut cache.peers);
        let none = TapRequest::none();
        let (own, others) = std::thread::scope(|scope| {
            let handles: Vec<_> = tp
                .peers
                .iter()
                .zip(peer_caches.iter_mut())
                .map(|(peer, peer_cache)| {
                    let none = &none;
                    scope.spawn(move || {
                        let out = unwinding_as_error(|| {
                            peer.forward_rank(
                                step,
                                &mut peer_cache.cache,
                                none,
                                LogitsFor::None,
                                None,
                                plan,
                                false,
                            )
                        });
                        if out.is_err() {
                            peer.abort_reductions();
                        }
                        out.map(|_| ())
                    })
                })
                .collect();
            let own = unwinding_as_error(|| {
                self.forward_rank(step, cache, taps, logits_for, None, plan, false)
            });
            if own.is_err() {
                tp.reducer.abort();
            }
            let others: Vec<Result<(), CudaError>> = handles
                .into_iter()
                .enumerate()
                .map(|(i, h)| {
                    h.join().unwrap_or_else(|_| {
                        Err(CudaError::Collective(format!(
                            "tensor-parallel rank {} ended abnormally",
                            i + 1
                        )))
                    })
                })
                .collect();
            (own, others)
        });
        cache.peers = peer_caches;
        if (own.is_err() || others.iter().any(Result::is_err)) && tp.reducer.capturable() {
            tp.poisoned.store(true, Ordering::Relaxed);
            // Release whatever all-reduce still waits on some GPU for a rank that failed
            // before queuing its own: the graphs first (an executable graph in flight is
            // freed when it completes; a communicator's abort would wait on graphs that
            // captured it), then every rank's communicator.
            self.set_graphs(false);
            for peer in &tp.peers {
                if let Some(peer_tp) = &peer.tp {
                    peer.gpu.make_current();
                    peer_tp.reducer.shut_down();
                }
            }
            self.gpu.make_current();
            tp.reducer.shut_down();
        }
        let own = own?;
        for other in others {
            other?;
        }
        Ok(own)
    }

    /// The graph key rank 0 decides a tensor-parallel step by: the key of its own step of the
    /// padded shape, with every rank's cache addresses (a rank whose buffers moved alone must
    /// not replay a graph over the old ones).
    fn shared_graph_key(
        &self,
        step: &StepInput,
        cache: &CudaKvCache,
        taps: &TapRequest,
        logits_for: LogitsFor,
    ) -> GraphKey {
        let spec = &self.rank_spec;
        let shape = AttentionShape {
            batch: graph_batch(step.batch, cache.rows_allocated()),
            width: step.width,
            heads: spec.num_heads,
            kv_heads: spec.num_kv_heads,
            head_dim: spec.head_dim,
            capacity: cache.layout().capacity(),
        };
        let mut key = self.graph_key(shape, cache, taps, logits_for);
        for peer in &cache.peers {
            key.cache.extend(peer.cache.addresses(&peer.gpu));
        }
        key
    }

    /// What a graph of a step of `shape` over `cache` is kept under: the shape, the outputs,
    /// the cache buffers and every switch that changes the launches.
    fn graph_key(
        &self,
        shape: AttentionShape,
        cache: &CudaKvCache,
        taps: &TapRequest,
        logits_for: LogitsFor,
    ) -> GraphKey {
        GraphKey::new(&self.gpu, shape, cache, logits_for as u8, &taps.taps)
            .with_fused(self.fuses(shape.rows()))
            .with_persistent(self.persists(shape.rows(), taps.taps.len()))
            .with_qkv_attention(self.one_launch_attention(shape))
            .with_mlp_partials(self.mlp_parts(shape.rows()).is_some())
            .with_partial_fault(self.partial_sum_fault())
    }

    fn abort_reductions(&self) {
        if let Some(tp) = &self.tp {
            tp.reducer.abort();
        }
    }

    /// Sums `buffer`'s first `n` values over the tensor-parallel ranks (nothing on one GPU).
    fn reduce(&self, buffer: &mut CudaSlice<f32>, n: usize) -> Result<(), CudaError> {
        match &self.tp {
            Some(tp) => tp.reducer.all_reduce(&self.gpu, buffer, n),
            None => Ok(()),
        }
    }

    /// One rank's step over its cache (the whole step on one GPU).
    #[allow(clippy::too_many_arguments)]
    fn forward_rank(
        &self,
        step: &StepInput,
        cache: &mut CudaKvCache,
        taps: &TapRequest,
        logits_for: LogitsFor,
        chain: Option<ChainTokens<'_>>,
        plan: GraphPlan<'_>,
        keep_taps: bool,
    ) -> Result<CudaStepOutput, CudaError> {
        let spec = &self.rank_spec;
        let _step = host_spans::span("target step");
        taps.validate(spec.num_layers)?;
        if self.tp.is_some() {
            self.gpu.bind_to_thread()?;
        }
        let host_inputs = host_spans::span("target step: host inputs");
        let host = cache.step_host(
            step,
            spec.vocab_size,
            [spec.num_heads, spec.num_kv_heads, spec.head_dim],
        )?;
        let mut last: Vec<i32> = step
            .last_real()
            .iter()
            .enumerate()
            .map(|(b, i)| (b * step.width + i.unwrap_or(0)) as i32)
            .collect();
        drop(host_inputs);
        let padded = match plan {
            GraphPlan::Own => self.graphs_enabled() && step.width <= GRAPH_MAX_WIDTH,
            GraphPlan::Shared { padded, .. } => padded,
        };
        let mut output = if padded {
            // A running batch changes size at every join and leave; padded to a few sizes, its
            // steps keep replaying the same graphs.
            let padded = graph_batch(step.batch, cache.rows_allocated());
            let host = host.padded(padded);
            for b in step.batch..padded {
                last.push((b * step.width) as i32 + last[0]);
            }
            self.forward_graphed(
                &host, &last, cache, taps, logits_for, chain, plan, keep_taps,
            )?
        } else {
            self.forward_eager(&host, &last, cache, taps, logits_for, chain)?
        };
        output.keep_sequences(step.batch, step.width, logits_for);
        cache.advance(step);
        Ok(output)
    }

    /// Whether decode-sized steps replay CUDA graphs (on by default; under tensor parallelism
    /// only over NCCL, whose all-reduces a graph captures, not with host sums).
    pub fn graphs_enabled(&self) -> bool {
        self.graphs.enabled() && self.tp.as_ref().is_none_or(|tp| tp.reducer.capturable())
    }

    /// Turns graph replay of decode-sized steps on or off (`fast-bench` measures both; the
    /// outputs are the same either way, which the GPU tests check).
    pub fn set_graphs(&self, on: bool) {
        // Turning graphs off frees each rank's graph buffers: with that rank's GPU current.
        if let Some(tp) = self.tp.as_ref().filter(|tp| !tp.peers.is_empty()) {
            for peer in &tp.peers {
                peer.gpu.make_current();
                peer.set_graphs(on);
            }
            self.gpu.make_current();
        }
        self.graphs.set(on);
    }

    /// Graphs captured so far and steps replayed from them.
    pub fn graph_stats(&self) -> GraphStats {
        self.graphs.stats()
    }

    fn forward_eager(
        &self,
        host: &HostStep,
        last: &[i32],
        cache: &mut CudaKvCache,
        taps: &TapRequest,
        logits_for: LogitsFor,
        chain: Option<ChainTokens<'_>>,
    ) -> Result<CudaStepOutput, CudaError> {
        let gpu = &*self.gpu;
        let mut buffers = StepBuffers::new(self, host.shape, host.total, taps, logits_for)?;
        buffers.load(gpu, host, last, chain)?;
        if self.persists(host.shape.rows(), taps.taps.len()) {
            buffers.persistent_table = Some(self.persistent_table(cache, taps, &buffers.taps)?);
        }
        let mut hook = CaptureHook::new(taps.clone());
        self.encode(&mut buffers, cache, host, None, &mut hook, logits_for)?;
        let captured = hook.finish();
        Ok(buffers.into_output(self, captured.taps, captured.visited))
    }

    #[allow(clippy::too_many_arguments)]
    fn forward_graphed(
        &self,
        host: &HostStep,
        last: &[i32],
        cache: &mut CudaKvCache,
        taps: &TapRequest,
        logits_for: LogitsFor,
        chain: Option<ChainTokens<'_>>,
        plan: GraphPlan<'_>,
        keep_taps: bool,
    ) -> Result<CudaStepOutput, CudaError> {
        let gpu = &*self.gpu;
        // A new shape or cache runs eagerly for its first steps (which also lets cuBLAS pick
        // its kernels outside a capture); the step after them is captured.
        let key = match plan {
            GraphPlan::Own => {
                let key = self.graph_key(host.shape, cache, taps, logits_for);
                if !self.graphs.lock().ready(&key) {
                    return self.forward_eager(host, last, cache, taps, logits_for, chain);
                }
                key
            }
            GraphPlan::Shared { graph: None, .. } => {
                return self.forward_eager(host, last, cache, taps, logits_for, chain);
            }
            GraphPlan::Shared {
                graph: Some(key), ..
            } => key.clone(),
        };
        let mut graphs = self.graphs.lock();
        if !graphs.captured.contains_key(&key) {
            let mut buffers =
                StepBuffers::new(self, host.shape, host.shape.capacity, taps, logits_for)?;
            if key.persistent {
                buffers.persistent_table =
                    Some(self.persistent_table(cache, taps, &buffers.taps)?);
            }
            let mut hook = CaptureHook::new(taps.clone());
            let graph = gpu.capture(|| {
                self.encode(&mut buffers, cache, host, Some(()), &mut hook, logits_for)
            })?;
            let visited = hook.finish().visited;
            graphs.insert(
                key.clone(),
                CapturedStep {
                    buffers,
                    graph,
                    visited,
                },
            );
        }
        graphs.last = Some(key.clone());
        let entry = graphs.captured.get_mut(&key).expect("captured above");
        {
            let _load = host_spans::span("target step: load inputs");
            entry.buffers.load(gpu, host, last, chain)?;
        }
        {
            let _replay = host_spans::span("target step: replay");
            gpu.replay(&entry.graph)?;
        }
        let _outputs = host_spans::span("target step: outputs");
        let kept = (keep_taps && !taps.taps.is_empty()).then(|| KeptTaps {
            key: key.clone(),
            rows: host.shape.rows(),
            taps: taps.taps.clone(),
        });
        let output =
            entry
                .buffers
                .copy_output(self, taps.taps.clone(), entry.visited.clone(), kept);
        graphs.stats.replays += 1;
        output
    }

    /// The block loop, over the buffers of one step: embedding, every block, the final norm,
    /// the requested logits. With `graphed`, the launches read the step's first cache column
    /// and column count from `buffers.inputs.scalars()` (a graph replays them with new values there);
    /// otherwise from `host`.
    fn encode(
        &self,
        b: &mut StepBuffers,
        cache: &mut CudaKvCache,
        host: &HostStep,
        graphed: Option<()>,
        hook: &mut CaptureHook<()>,
        logits_for: LogitsFor,
    ) -> Result<(), CudaError> {
        let spec = &self.rank_spec;
        let gpu = &*self.gpu;
        let (shape, col0, total) = (host.shape, host.col0, host.total);
        let (h, inter) = (spec.hidden_size, spec.intermediate_size);
        let rows = shape.rows();
        let q_dim = spec.num_heads * spec.head_dim;
        let qkv_dim = q_dim + 2 * spec.num_kv_heads * spec.head_dim;
        let eps = spec.rms_norm_eps as f32;
        if graphed.is_some() && crate::cache::graph_mask() {
            b.inputs.build_mask_in_graph(gpu)?;
        }
        if let Some(table) = &b.persistent_table {
            // The whole step in one launch (see `persistent_step` in kernels/llama.cu).
            let inputs = &b.inputs;
            let (tokens, positions) = (inputs.tokens(), inputs.positions());
            let scalars = graphed.map(|()| inputs.scalars());
            gpu.persistent_step(PersistentStep {
                table,
                tap_slots: b.taps.len(),
                embed: &self.weights.embed,
                tokens: &tokens,
                positions: &positions,
                inv_freq: &self.inv_freq,
                mask: &inputs.mask,
                step_scalars: scalars.as_ref(),
                final_norm: &self.weights.final_norm,
                lm_head: self.weights.lm_head(),
                logit_rows: b.needs_last.then_some(&b.last),
                logits: b.logits.as_ref().map(|l| (l, b.logits_rows)),
                hidden: &b.hidden,
                q: &b.q,
                visible: &b.visible,
                attn: &b.attn,
                act: &b.act,
                arrived: &self.barrier,
                profile: self.profile.as_ref(),
                layers: spec.num_layers,
                shape,
                hidden_size: h,
                inter,
                col0,
                total,
                vocab: spec.vocab_size,
                eps,
            })?;
            // The kernel wrote each slot at the point the hook names for it (the table was
            // built from the same request); the hook records the same visits as the loop below.
            let points = std::iter::once(TapId::Embed)
                .chain((0..spec.num_layers).map(TapId::Block))
                .chain(std::iter::once(TapId::Final));
            for tap in points {
                hook.try_observe_with(tap, |_slot| Ok::<(), CudaError>(()))?;
            }
            return Ok(());
        }
        let StepBuffers {
            inputs,
            hidden,
            hidden_alt,
            mlp_scratch,
            mlp_sums,
            normed,
            qkv,
            q,
            attn,
            delta,
            gate_up,
            act,
            final_normed,
            last,
            selected,
            logits,
            taps,
            visible,
            ..
        } = b;
        // `partial`: the injected fault's tap, `rows_of` plus the rank's own down_proj product
        // (`act . down^T`) before the all-reduce ([`CudaTarget::set_partial_sum_fault`]).
        // `written`: the slot the launch computing the tap point already wrote (the fused
        // down_proj writes its output into the first slot asking for it), copied into no more.
        type Partial<'a> = Option<(&'a CudaSlice<u16>, &'a CudaSlice<u16>, usize)>;
        let observe = |hook: &mut CaptureHook<()>,
                       taps: &mut [CudaSlice<f32>],
                       tap: TapId,
                       rows_of: &CudaSlice<f32>,
                       partial: Partial<'_>,
                       written: Option<usize>| {
            hook.try_observe_with(tap, |slot| {
                if written == Some(slot) {
                    return Ok(());
                }
                gpu.copy_into(rows_of, &mut taps[slot], rows * h)?;
                match partial {
                    Some((act, down, inter)) => {
                        gpu.linear_add(act, down, &mut taps[slot], rows, inter, h)
                    }
                    None => Ok(()),
                }
            })
        };
        let partial_fault = self.partial_sum_fault();
        let (tokens, positions) = (inputs.tokens(), inputs.positions());
        let scalars = graphed.map(|()| inputs.scalars());
        let scalars = scalars.as_ref();
        gpu.embed_rows(&self.weights.embed, &tokens, hidden, rows, h)?;
        observe(hook, taps, TapId::Embed, hidden, None, None)?;
        let layers = &self.weights.layers;
        // Small steps may run fused (see the small-step kernels in kernels/llama.cu): five
        // launches a layer, the input norm inside q|k|v with RoPE and the cache write, attention,
        // o_proj added into the residual, the post-attention norm inside gate|up with SwiGLU,
        // down_proj added into the residual. Either way `hidden` holds the block's output after
        // each layer.
        let fused = self.fuses(rows);
        // Fused steps group each row's keys by their order among its visible keys (lists built
        // once a step), so with the fused matrix-vector sums a row's bits do not depend on the
        // step's other rows nor on rejected drafts left in the cache.
        let capacity = shape.capacity;
        let visible = fused.then(|| {
            (
                visible.slice(0..rows * capacity),
                visible.slice(rows * capacity..rows * (capacity + 1)),
            )
        });
        if let Some((list, counts)) = &visible {
            gpu.visible_columns(&inputs.mask, list, counts, rows, total, capacity, scalars)?;
        }
        if !fused {
            gpu.add_rms_norm(
                hidden,
                None,
                &layers[0].input_norm,
                normed,
                None,
                rows,
                h,
                eps,
            )?;
        }
        let one_launch_attention = fused && self.one_launch_attention(shape);
        // Fused steps may take each layer's MLP in one launch (`Gpu::mlp_partials`): the
        // layer's output is then its residual plus the MLP's cluster sums until the next
        // layer's reader adds them (the one-launch q|k|v and attention, or `add_mlp_partials`),
        // and only then is its tap written: `pending` is that layer.
        let mlp_parts = if fused { self.mlp_parts(rows) } else { None };
        let mut pending: Option<usize> = None;
        // The residual (`cur`) and the other buffer: a one-launch q|k|v and attention adding
        // the sums writes the new residual into `other`, as its blocks read the old one, and
        // the two swap. `alt`: whether `cur` is `hidden_alt` now.
        let (mut cur, mut other) = (hidden, hidden_alt);
        let mut alt = false;
        for (k, layer) in layers.iter().enumerate() {
            let mut written = None;
            if let (Some(prev), Some(parts), false) = (pending, mlp_parts, one_launch_attention) {
                // The previous layer's output in place, and its tap.
                let slot = hook.first_slot(TapId::Block(prev));
                let tap = slot.map(|slot| &mut taps[slot]);
                gpu.add_mlp_partials(None, mlp_sums, parts, cur, tap, rows, h)?;
                observe(hook, taps, TapId::Block(prev), cur, None, slot)?;
                pending = None;
            }
            if one_launch_attention {
                let (list, counts) = visible.as_ref().expect("fused steps build visible lists");
                let sums_slot = pending.and_then(|prev| hook.first_slot(TapId::Block(prev)));
                let mlp = match (pending, mlp_parts) {
                    (Some(_), Some(parts)) => Some(MlpSums {
                        sums: mlp_sums,
                        parts,
                        out: &mut *other,
                        tap: sums_slot.map(|slot| &mut taps[slot]),
                    }),
                    _ => None,
                };
                gpu.qkv_attention(
                    cur,
                    &layer.input_norm,
                    &layer.qkv,
                    layer.qkv_bias.as_ref(),
                    &positions,
                    &self.inv_freq,
                    q,
                    &mut cache.keys[k],
                    &mut cache.values[k],
                    &inputs.mask,
                    (list, counts),
                    attn,
                    shape,
                    h,
                    col0,
                    total,
                    scalars,
                    eps,
                    mlp,
                )?;
                if let Some(prev) = pending.take() {
                    std::mem::swap(&mut cur, &mut other);
                    alt = !alt;
                    observe(hook, taps, TapId::Block(prev), cur, None, sums_slot)?;
                }
            } else if fused {
                gpu.norm_qkv_rope(
                    QkvInput::Rows(cur),
                    &layer.input_norm,
                    &layer.qkv,
                    None,
                    layer.qkv_bias.as_ref(),
                    &positions,
                    &self.inv_freq,
                    q,
                    &mut cache.keys[k],
                    &mut cache.values[k],
                    shape,
                    h,
                    col0,
                    scalars,
                    eps,
                )?;
            } else {
                gpu.linear(normed, &layer.qkv, qkv, rows, h, qkv_dim)?;
                if let Some((q_norm, k_norm)) = &layer.qk_norm {
                    gpu.head_rms_norm(
                        qkv,
                        q_norm,
                        k_norm,
                        rows,
                        spec.num_heads,
                        spec.num_kv_heads,
                        spec.head_dim,
                        eps,
                    )?;
                }
                gpu.rope_qkv(
                    qkv,
                    layer.qkv_bias.as_ref(),
                    &positions,
                    &self.inv_freq,
                    q,
                    &mut cache.keys[k],
                    &mut cache.values[k],
                    shape,
                    col0,
                    scalars,
                )?;
            }
            if !one_launch_attention {
                gpu.attention(
                    q,
                    &cache.keys[k],
                    &cache.values[k],
                    &inputs.mask,
                    visible.as_ref().map(|(list, counts)| (list, counts)),
                    attn,
                    shape,
                    total,
                    scalars,
                )?;
            }
            if fused {
                gpu.gemv_rows(attn, &layer.o, cur, rows, q_dim, h, true)?;
                if mlp_parts.is_some() {
                    // The layer's output waits for its reader (see `pending` above).
                    gpu.mlp_partials(
                        cur,
                        &layer.post_norm,
                        &layer.gate_up,
                        &layer.down,
                        mlp_scratch,
                        mlp_sums,
                        rows,
                        h,
                        inter,
                        eps,
                    )?;
                    pending = Some(k);
                } else {
                    gpu.norm_gate_up_silu(
                        cur,
                        &layer.post_norm,
                        &layer.gate_up,
                        act,
                        rows,
                        h,
                        inter,
                        eps,
                    )?;
                    // The block's output goes into its tap slot from the same launch.
                    let slot = hook.first_slot(TapId::Block(k)).filter(|_| !partial_fault);
                    written = slot;
                    let tap = slot.map(|slot| &mut taps[slot]);
                    gpu.gemv_rows_tapped(act, &layer.down, cur, tap, rows, inter, h, true)?;
                }
            } else {
                gpu.linear(attn, &layer.o, delta, rows, q_dim, h)?;
                self.reduce(delta, rows * h)?;
                gpu.add_rms_norm(
                    cur,
                    Some(delta),
                    &layer.post_norm,
                    normed,
                    None,
                    rows,
                    h,
                    eps,
                )?;
                gpu.linear(normed, &layer.gate_up, gate_up, rows, h, 2 * inter)?;
                gpu.silu_mul(gate_up, act, rows, inter)?;
                gpu.linear(act, &layer.down, delta, rows, inter, h)?;
                if partial_fault {
                    // `hidden` holds the residual after attention here.
                    observe(
                        hook,
                        taps,
                        TapId::Block(k),
                        cur,
                        Some((act, &layer.down, inter)),
                        None,
                    )?;
                }
                self.reduce(delta, rows * h)?;
                // The residual add of this block fused with the next norm: the next layer's
                // input norm, or the final norm after the last block (kept in f32 for the
                // `final` tap).
                match layers.get(k + 1) {
                    Some(next) => gpu.add_rms_norm(
                        cur,
                        Some(delta),
                        &next.input_norm,
                        normed,
                        None,
                        rows,
                        h,
                        eps,
                    )?,
                    None => gpu.add_rms_norm(
                        cur,
                        Some(delta),
                        &self.weights.final_norm,
                        normed,
                        Some(final_normed),
                        rows,
                        h,
                        eps,
                    )?,
                }
            }
            if !partial_fault && pending != Some(k) {
                observe(hook, taps, TapId::Block(k), cur, None, written)?;
            }
        }
        if let (Some(prev), Some(parts)) = (pending, mlp_parts) {
            // The last layer's output, into `hidden` (where the step's residual ends).
            let slot = hook.first_slot(TapId::Block(prev));
            let tap = slot.map(|slot| &mut taps[slot]);
            if alt {
                gpu.add_mlp_partials(Some(cur), mlp_sums, parts, other, tap, rows, h)?;
                std::mem::swap(&mut cur, &mut other);
            } else {
                gpu.add_mlp_partials(None, mlp_sums, parts, cur, tap, rows, h)?;
            }
            observe(hook, taps, TapId::Block(prev), cur, None, slot)?;
        }
        let hidden = cur;
        if fused {
            // The residual is complete: the final norm alone.
            gpu.add_rms_norm(
                hidden,
                None,
                &self.weights.final_norm,
                normed,
                Some(final_normed),
                rows,
                h,
                eps,
            )?;
        }
        observe(hook, taps, TapId::Final, final_normed, None, None)?;

        let vocab = spec.vocab_size;
        // Fused steps take the logits from the matrix-vector kernel too (`Gpu::project`).
        let lm_head = self.weights.lm_head();
        match (logits_for, logits.as_mut()) {
            (LogitsFor::All, Some(out)) => {
                gpu.project(fused, normed, lm_head, out, rows, h, vocab)?
            }
            (LogitsFor::Last, Some(out)) => {
                gpu.gather_rows(normed, last, selected, shape.batch, h)?;
                gpu.project(fused, selected, lm_head, out, shape.batch, h, vocab)?;
            }
            _ => {}
        }
        Ok(())
    }
}
