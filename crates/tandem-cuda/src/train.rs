//! The EAGLE-3 head trainer on the GPU: the training unroll (TTT) of
//! `tandem_eagle::Eagle3Draft::forward_ttt`, the objective of `tandem_train::objective`, its
//! backward pass written out by hand, global-norm clipping and AdamW, with cuBLAS for every
//! matmul (bf16 operands, f32 accumulation and results) and the NVRTC kernels of
//! `kernels/train.cu` for everything between them.
//!
//! Why by hand: burn-cuda reached 13K tokens/s on this head where eager PyTorch reaches 350K
//! (BENCHMARKS.md, issue #15): its bf16 matmuls run at ~22% of cuBLAS, and autodiff over
//! hundreds of small ops per step is launch bound. A training step here is 21 cuBLAS calls and
//! ~25 kernels per TTT step, no host round trip inside a step (the host waits once per
//! optimizer step, for the loss statistics and the gradient norm that clipping needs), and the
//! training data lives on the GPU (bf16) for the whole run.
//!
//! What guards it: the GPU test `cuda_trainer_matches_burn_autodiff` (tandem-train) runs the
//! same batch through this trainer and through burn's autodiff on the CPU (f32) and compares
//! the loss, the accuracies and every parameter's gradient.
//!
//! Precision (as torch autocast bf16): master weights, Adam moments, gradients, the residual
//! stream, norms, softmaxes and the loss in f32; matmul operands (weights, activations, the
//! gradients fed to matmuls, attention probabilities) in bf16.
#![allow(unsafe_code)]

use std::sync::Arc;

use cudarc::cublas::result::gemm_strided_batched_ex;
use cudarc::cublas::sys::{
    cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t, cudaDataType_t,
};
use cudarc::driver::{
    CudaFunction, CudaSlice, CudaStream, DevicePtr, DeviceRepr, LaunchConfig, PinnedHostSlice,
    PushKernelArg, ValidAsZeroBits,
};
use tandem_eagle::{DraftSpec, HostWeights, parameter_shapes, ttt_step_tokens};

use crate::device::{Gpu, compile_source};
use crate::error::CudaError;

pub(crate) const KERNEL_SOURCE: &str = include_str!("../../../kernels/train.cu");
/// Threads of the row kernels.
const ROW_THREADS: u32 = 256;
/// Threads of the attention softmax kernels (one block per query row).
const SOFTMAX_THREADS: u32 = 128;
/// Rows summed per block by the norm weight-gradient kernel before its atomic add.
const NORM_GRAD_ROWS: usize = 64;
/// Target-logit rows per chunk when the corpus' target argmax is computed (bounds the
/// `[rows, vocab]` f32 scratch to ~800 MB for a 49K vocabulary).
const ARGMAX_CHUNK: usize = 4096;
/// The softmax kernel keeps the diagonal (later-step) scores in an array of 8.
pub const MAX_TTT_STEPS: usize = 9;

struct Kernels {
    gather_rows_bf16: CudaFunction,
    gather_u32: CudaFunction,
    rms_norm_fwd: CudaFunction,
    rms_norm_bwd: CudaFunction,
    rms_norm_weight_grad: CudaFunction,
    rope_scatter: CudaFunction,
    rope_gather_bwd: CudaFunction,
    ttt_softmax_fwd: CudaFunction,
    ttt_softmax_bwd: CudaFunction,
    heads_to_rows: CudaFunction,
    rows_to_heads: CudaFunction,
    swiglu_fwd: CudaFunction,
    swiglu_bwd: CudaFunction,
    f32_to_bf16_n: CudaFunction,
    add_f32: CudaFunction,
    softmax_rows: CudaFunction,
    argmax_rows_u32: CudaFunction,
    draft_loss: CudaFunction,
    sum_squares: CudaFunction,
    adamw: CudaFunction,
}

/// A null device pointer for optional kernel arguments.
const NULL: u64 = 0;

/// Launches `$kernel` of `$self.kernels` with `$cfg` and the listed arguments (device pointers
/// as `u64`, sizes as `i32`/`i64`, scalars as `f32`).
macro_rules! launch {
    ($self:expr, $kernel:ident, $cfg:expr, $($arg:expr),+ $(,)?) => {{
        let mut builder = $self.stream.launch_builder(&$self.kernels.$kernel);
        $( let value = $arg; builder.arg(&value); )+
        // SAFETY: every wrapper below passes arguments in the order and types of the kernel's
        // signature in kernels/train.cu, and buffers of the sizes its comment states.
        unsafe { builder.launch($cfg) }.map(|_| ()).map_err(CudaError::from)
    }};
}

fn rows_cfg(rows: usize, threads: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (rows.max(1) as u32, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    }
}

fn stride_cfg(n: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (n.div_ceil(256).clamp(1, 4096) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Where each parameter lives in the flat parameter buffer. q|k|v and gate|up are adjacent, so
/// each pair is one fused matmul weight.
#[derive(Debug, Clone)]
struct ParamLayout {
    entries: Vec<(&'static str, Vec<usize>, usize)>,
    total: usize,
}

impl ParamLayout {
    fn new(spec: &DraftSpec) -> Self {
        let shapes = parameter_shapes(spec);
        let find = |name: &str| {
            shapes
                .iter()
                .find(|(n, _)| *n == name)
                .cloned()
                .expect("parameter_shapes lists every parameter")
        };
        // Groups start 64-element aligned (128-byte bf16 rows for cuBLAS); members of a fused
        // group are packed.
        let groups: [&[&str]; 10] = [
            &["fc.weight"],
            &[
                "midlayer.self_attn.q_proj.weight",
                "midlayer.self_attn.k_proj.weight",
                "midlayer.self_attn.v_proj.weight",
            ],
            &["midlayer.self_attn.o_proj.weight"],
            &[
                "midlayer.mlp.gate_proj.weight",
                "midlayer.mlp.up_proj.weight",
            ],
            &["midlayer.mlp.down_proj.weight"],
            &["lm_head.weight"],
            &["midlayer.input_layernorm.weight"],
            &["midlayer.hidden_norm.weight"],
            &["midlayer.post_attention_layernorm.weight"],
            &["norm.weight"],
        ];
        let mut entries = Vec::new();
        let mut offset = 0usize;
        for group in groups {
            offset = offset.div_ceil(64) * 64;
            for name in group {
                let (name, shape) = find(name);
                let n: usize = shape.iter().product();
                entries.push((name, shape, offset));
                offset += n;
            }
        }
        debug_assert_eq!(entries.len(), shapes.len());
        ParamLayout {
            entries,
            total: offset,
        }
    }

    fn offset(&self, name: &str) -> usize {
        self.entries
            .iter()
            .find(|(n, _, _)| *n == name)
            .map(|e| e.2)
            .expect("known parameter")
    }
}

/// One batch, as rows of the corpus on the GPU: sequence `b` is corpus tokens
/// `starts[b]..starts[b] + lengths[b]`, right-padded to `width`.
#[derive(Debug, Clone)]
pub struct CorpusBatch {
    /// Corpus token offset of each sequence.
    pub starts: Vec<usize>,
    /// Real length of each sequence (after `--max-len`).
    pub lengths: Vec<usize>,
    /// Padded width.
    pub width: usize,
    /// `[batch * width]` token ids (0 past each length).
    pub input_ids: Vec<u32>,
    /// `[batch * width]` loss mask (0 past each length).
    pub loss_mask: Vec<u8>,
}

impl CorpusBatch {
    pub fn size(&self) -> usize {
        self.lengths.len()
    }
}

/// Loss and accuracy counts of one TTT step over a batch (the sums the burn trainer's
/// `StepStats` holds).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StepCounts {
    /// loss_i (the mean over `batch * width` positions, before the 0.8^i weight).
    pub loss: f64,
    /// Positions where the draft's mapped argmax is the target's argmax.
    pub correct: usize,
    /// Positions counted (the shifted loss mask).
    pub denominator: usize,
}

/// What one optimizer step reports.
#[derive(Debug, Clone, PartialEq)]
pub struct TrainStepReport {
    /// sum_i 0.8^i loss_i.
    pub loss: f64,
    /// Per TTT step.
    pub steps: Vec<StepCounts>,
    /// Global gradient L2 norm before clipping.
    pub grad_norm: f64,
}

/// Hyper-parameters of one optimizer step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWStep {
    pub lr: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
    /// Global-norm clip (0 = off), as `torch.nn.utils.clip_grad_norm_`.
    pub max_grad_norm: f64,
}

/// A data-parallel replica's view of a step: the communicator of all replicas and the
/// positions (`batch * width`) of the global batch, over which the loss is averaged.
#[derive(Debug, Clone, Copy)]
pub struct Replicas<'a> {
    pub collective: &'a crate::collective::Collective,
    pub global_positions: usize,
}

/// The frozen target pieces the trainer needs, as host values.
#[derive(Debug, Clone)]
pub struct TargetPieces<'a> {
    /// `[vocab, H]` token embedding.
    pub embed_tokens: &'a [f32],
    /// `[T]` final norm weight.
    pub norm: &'a [f32],
    /// `[vocab, T]` lm_head in HF layout (the embedding when tied).
    pub lm_head: &'a [f32],
    /// Target id of each draft id (ascending), `[draft_vocab]`.
    pub draft_ids: &'a [u32],
}

/// The training corpus on the GPU: aux taps `[tokens, fc_in]` and the last block's residual
/// `[tokens, T]` in bf16, and the target's argmax after each token (full vocabulary), computed
/// once when the corpus is complete.
struct Corpus {
    aux: CudaSlice<u16>,
    last: CudaSlice<u16>,
    argmax: CudaSlice<u32>,
    tokens: usize,
    filled: usize,
    /// The upload's host side (page-locked where the host allows it).
    staging: PinnedUpload,
}

/// Values in each of [`PinnedUpload`]'s two page-locked buffers (128 MB of bf16 each).
pub const STAGING_VALUES: usize = 64 << 20;

/// The corpus upload's host side: two page-locked buffers filled in turn, so the host copies
/// the next piece while the DMA engine moves the last. A pageable copy goes through the
/// driver's own small bounce buffer a piece at a time, on the calling thread: session 23's
/// 30 GB corpus took 40 s to set up and upload (~0.75 GB/s), two thirds of the trainer's load.
pub struct PinnedUpload {
    /// `None` where the host would not lock them: every copy is then a plain (pageable) one.
    buffers: Option<[PinnedHostSlice<u16>; 2]>,
    next: usize,
}

impl PinnedUpload {
    pub fn new(gpu: &Gpu) -> Self {
        let ctx = gpu.stream().context();
        // SAFETY: every value is written (copy_from_slice below) before a copy reads it.
        let pinned = || unsafe { ctx.alloc_pinned::<u16>(STAGING_VALUES) }.ok();
        let buffers = pinned().and_then(|a| Some([a, pinned()?]));
        PinnedUpload { buffers, next: 0 }
    }

    /// Whether the page-locked buffers exist.
    pub fn is_pinned(&self) -> bool {
        self.buffers.is_some()
    }

    /// `dst[at..at + src.len()] = src`: whole buffers through the page-locked pair (each
    /// waits for its previous copy before it is refilled), the tail (everything, without the
    /// pair) as a plain copy.
    pub fn upload(
        &mut self,
        gpu: &Gpu,
        src: &[u16],
        dst: &mut CudaSlice<u16>,
        at: usize,
    ) -> Result<(), CudaError> {
        let stream = gpu.stream();
        let mut done = 0;
        while let Some(buffers) = &mut self.buffers
            && src.len() - done >= STAGING_VALUES
        {
            let buffer = &mut buffers[self.next];
            self.next ^= 1;
            buffer
                .as_mut_slice()?
                .copy_from_slice(&src[done..done + STAGING_VALUES]);
            let to = at + done;
            stream.memcpy_htod(&*buffer, &mut dst.slice_mut(to..to + STAGING_VALUES))?;
            done += STAGING_VALUES;
        }
        if done < src.len() {
            stream.memcpy_htod(&src[done..], &mut dst.slice_mut(at + done..at + src.len()))?;
        }
        Ok(())
    }
}

/// The trainer: parameters (f32 master + bf16 copy), gradients, AdamW moments, the frozen
/// target pieces and the corpus, all on one GPU.
pub struct CudaHeadTrainer {
    gpu: Arc<Gpu>,
    stream: Arc<CudaStream>,
    kernels: Kernels,
    spec: DraftSpec,
    layout: ParamLayout,
    params: CudaSlice<f32>,
    params_bf16: CudaSlice<u16>,
    grads: CudaSlice<f32>,
    moment1: CudaSlice<f32>,
    moment2: CudaSlice<f32>,
    adam_steps: u64,
    embed: CudaSlice<u16>,
    target_norm: CudaSlice<f32>,
    target_lm_full: CudaSlice<u16>,
    target_lm_draft: CudaSlice<u16>,
    in_draft: CudaSlice<u8>,
    draft_to_target: CudaSlice<u32>,
    inv_freq: CudaSlice<f32>,
    corpus: Option<Corpus>,
}

impl std::fmt::Debug for CudaHeadTrainer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaHeadTrainer")
            .field("parameters", &self.layout.total)
            .field("adam_steps", &self.adam_steps)
            .finish()
    }
}

fn bf16_bits(values: &[f32]) -> Vec<u16> {
    values
        .iter()
        .map(|&v| half::bf16::from_f32(v).to_bits())
        .collect()
}

/// Row-major `C = alpha op(A) op(B) + beta C` (bf16 A, B; f32 C), batched with strides: the
/// column-major cuBLAS call computes `C^T = op(B)^T op(A)^T`, so the operands swap and each
/// keeps its own transpose flag; `ld*` are the row lengths of the matrices as stored.
#[derive(Clone, Copy)]
struct Gemm {
    ta: bool,
    tb: bool,
    m: usize,
    n: usize,
    k: usize,
    alpha: f32,
    beta: f32,
    batch: usize,
    strides: [i64; 3],
}

impl Gemm {
    fn new(ta: bool, tb: bool, m: usize, n: usize, k: usize) -> Self {
        Gemm {
            ta,
            tb,
            m,
            n,
            k,
            alpha: 1.0,
            beta: 0.0,
            batch: 1,
            strides: [0; 3],
        }
    }
    fn alpha(mut self, alpha: f32) -> Self {
        self.alpha = alpha;
        self
    }
    fn accumulate(mut self) -> Self {
        self.beta = 1.0;
        self
    }
    fn batched(mut self, batch: usize, a: usize, b: usize, c: usize) -> Self {
        self.batch = batch;
        self.strides = [a as i64, b as i64, c as i64];
        self
    }
}

impl CudaHeadTrainer {
    /// A trainer for a head of `spec` starting from `weights` (HF layout, as
    /// `Eagle3Draft::to_host` gives them).
    pub fn new(
        gpu: Arc<Gpu>,
        spec: DraftSpec,
        weights: &HostWeights,
        target: &TargetPieces<'_>,
    ) -> Result<Self, CudaError> {
        let unsupported = |what: String| {
            CudaError::Trainer(format!("the GPU head trainer does not support {what}"))
        };
        if spec.target_hidden_size != spec.hidden_size {
            return Err(unsupported(format!(
                "a head {} wide over a target {} wide",
                spec.hidden_size, spec.target_hidden_size
            )));
        }
        if !spec.num_heads.is_multiple_of(spec.num_kv_heads) || !spec.head_dim.is_multiple_of(2) {
            return Err(unsupported(format!(
                "{} heads over {} KV heads of width {}",
                spec.num_heads, spec.num_kv_heads, spec.head_dim
            )));
        }
        let (h, v, dv) = (spec.hidden_size, spec.vocab_size, spec.draft_vocab_size);
        assert_eq!(target.embed_tokens.len(), v * h, "embedding [vocab, H]");
        assert_eq!(target.lm_head.len(), v * h, "lm_head [vocab, T]");
        assert_eq!(target.norm.len(), h, "final norm [T]");
        assert_eq!(target.draft_ids.len(), dv, "one target id per draft id");
        let stream = gpu.stream().clone();
        let ptx = compile_source(KERNEL_SOURCE, "train.cu")?;
        let module = gpu.context().load_module(ptx)?;
        let f = |name: &str| module.load_function(name);
        let kernels = Kernels {
            gather_rows_bf16: f("gather_rows_bf16")?,
            gather_u32: f("gather_u32")?,
            rms_norm_fwd: f("rms_norm_fwd")?,
            rms_norm_bwd: f("rms_norm_bwd")?,
            rms_norm_weight_grad: f("rms_norm_weight_grad")?,
            rope_scatter: f("rope_scatter")?,
            rope_gather_bwd: f("rope_gather_bwd")?,
            ttt_softmax_fwd: f("ttt_softmax_fwd")?,
            ttt_softmax_bwd: f("ttt_softmax_bwd")?,
            heads_to_rows: f("heads_to_rows")?,
            rows_to_heads: f("rows_to_heads")?,
            swiglu_fwd: f("swiglu_fwd")?,
            swiglu_bwd: f("swiglu_bwd")?,
            f32_to_bf16_n: f("f32_to_bf16_n")?,
            add_f32: f("add_f32")?,
            softmax_rows: f("softmax_rows")?,
            argmax_rows_u32: f("argmax_rows_u32")?,
            draft_loss: f("draft_loss")?,
            sum_squares: f("sum_squares")?,
            adamw: f("adamw")?,
        };
        let layout = ParamLayout::new(&spec);
        let mut host = vec![0f32; layout.total];
        for (name, shape, offset) in &layout.entries {
            let (actual, values) = weights
                .get(*name)
                .ok_or_else(|| unsupported(format!("initial weights without `{name}`")))?;
            if actual != shape {
                return Err(unsupported(format!(
                    "`{name}` of shape {actual:?} where the spec says {shape:?}"
                )));
            }
            host[*offset..*offset + values.len()].copy_from_slice(values);
        }
        let mut lm_draft = Vec::with_capacity(dv * h);
        let mut in_draft = vec![0u8; v];
        for &id in target.draft_ids {
            let id = id as usize;
            lm_draft.extend_from_slice(&target.lm_head[id * h..(id + 1) * h]);
            in_draft[id] = 1;
        }
        let inv_freq: Vec<f32> = spec.inv_freq.iter().map(|&x| x as f32).collect();
        let n = layout.total;
        let trainer = CudaHeadTrainer {
            params: stream.clone_htod(&host)?,
            params_bf16: stream.clone_htod(&bf16_bits(&host))?,
            grads: stream.alloc_zeros(n)?,
            moment1: stream.alloc_zeros(n)?,
            moment2: stream.alloc_zeros(n)?,
            adam_steps: 0,
            embed: stream.clone_htod(&bf16_bits(target.embed_tokens))?,
            target_norm: stream.clone_htod(target.norm)?,
            target_lm_full: stream.clone_htod(&bf16_bits(target.lm_head))?,
            target_lm_draft: stream.clone_htod(&bf16_bits(&lm_draft))?,
            in_draft: stream.clone_htod(&in_draft)?,
            draft_to_target: stream.clone_htod(target.draft_ids)?,
            inv_freq: stream.clone_htod(&inv_freq)?,
            corpus: None,
            kernels,
            layout,
            spec,
            stream,
            gpu,
        };
        Ok(trainer)
    }

    /// The resolved head this trainer trains.
    pub fn spec(&self) -> &DraftSpec {
        &self.spec
    }

    fn ptr<T>(&self, s: &CudaSlice<T>) -> u64 {
        let (p, _sync) = s.device_ptr(&self.stream);
        p
    }

    fn alloc<T: DeviceRepr + ValidAsZeroBits>(&self, n: usize) -> Result<CudaSlice<T>, CudaError> {
        Ok(self.stream.alloc_zeros(n.max(1))?)
    }

    /// An uninitialised buffer: only for buffers the next kernels overwrite completely
    /// (zeroing the step's ~GBs of activations would cost milliseconds per step).
    fn scratch<T: DeviceRepr>(&self, n: usize) -> Result<CudaSlice<T>, CudaError> {
        // SAFETY: callers write every element before any read (see each use in `run`).
        Ok(unsafe { self.stream.alloc(n.max(1)) }?)
    }

    fn gemm(&self, g: Gemm, a: u64, b: u64, c: u64) -> Result<(), CudaError> {
        let op = |t: bool| {
            if t {
                cublasOperation_t::CUBLAS_OP_T
            } else {
                cublasOperation_t::CUBLAS_OP_N
            }
        };
        let lda = if g.ta { g.m } else { g.k } as i32;
        let ldb = if g.tb { g.k } else { g.n } as i32;
        // SAFETY: callers pass device pointers to matrices of the sizes the dimensions and
        // strides describe (checked by the buffer sizes they allocate).
        unsafe {
            gemm_strided_batched_ex(
                *self.gpu.blas().handle(),
                op(g.tb),
                op(g.ta),
                g.n as i32,
                g.m as i32,
                g.k as i32,
                (&g.alpha) as *const f32 as *const _,
                b as *const _,
                cudaDataType_t::CUDA_R_16BF,
                ldb,
                g.strides[1],
                a as *const _,
                cudaDataType_t::CUDA_R_16BF,
                lda,
                g.strides[0],
                (&g.beta) as *const f32 as *const _,
                c as *mut _,
                cudaDataType_t::CUDA_R_32F,
                g.n as i32,
                g.strides[2],
                g.batch as i32,
                cublasComputeType_t::CUBLAS_COMPUTE_32F,
                cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )?;
        }
        Ok(())
    }

    /// Device pointer of parameter `name` in the f32 master buffer (`bf16 = false`), the bf16
    /// copy, or (`grad`) the gradient buffer.
    fn param(&self, name: &str, which: Which) -> u64 {
        let offset = self.layout.offset(name) as u64;
        match which {
            Which::Master => self.ptr(&self.params) + 4 * offset,
            Which::Bf16 => self.ptr(&self.params_bf16) + 2 * offset,
            Which::Grad => self.ptr(&self.grads) + 4 * offset,
        }
    }

    /// Reserves the corpus: `tokens` rows of aux taps and last-block residuals.
    pub fn reserve_corpus(&mut self, tokens: usize) -> Result<(), CudaError> {
        let (f, h) = (self.spec.fc_in(), self.spec.hidden_size);
        self.corpus = None;
        let too_big = |e: CudaError| {
            CudaError::Trainer(format!(
                "a corpus of {tokens} tokens ({:.1} GiB of bf16 taps on the GPU): {e}; train on \
                 fewer or shorter rows (--max-len) or split the dumps",
                (tokens * (f + h) * 2 + tokens * 4) as f64 / (1u64 << 30) as f64
            ))
        };
        self.corpus = Some(Corpus {
            aux: self.alloc(tokens * f).map_err(too_big)?,
            last: self.alloc(tokens * h).map_err(too_big)?,
            argmax: self.alloc(tokens).map_err(too_big)?,
            tokens,
            filled: 0,
            staging: PinnedUpload::new(&self.gpu),
        });
        Ok(())
    }

    /// Appends rows to the corpus (bf16 bit patterns): `aux: [n, fc_in]`, `last: [n, T]`.
    /// Returns the corpus offset of the first appended row.
    pub fn append_corpus(&mut self, aux: &[u16], last: &[u16]) -> Result<usize, CudaError> {
        let (f, h) = (self.spec.fc_in(), self.spec.hidden_size);
        let n = last.len() / h;
        assert_eq!(aux.len(), n * f, "aux rows [n, fc_in]");
        assert_eq!(last.len(), n * h, "last rows [n, T]");
        let corpus = self.corpus.as_mut().expect("reserve_corpus first");
        let start = corpus.filled;
        if start + n > corpus.tokens {
            return Err(CudaError::Trainer(format!(
                "{} corpus tokens where {} were reserved",
                start + n,
                corpus.tokens
            )));
        }
        corpus
            .staging
            .upload(&self.gpu, aux, &mut corpus.aux, start * f)?;
        corpus
            .staging
            .upload(&self.gpu, last, &mut corpus.last, start * h)?;
        corpus.filled += n;
        Ok(start)
    }

    /// Computes the target's argmax (full vocabulary) after every corpus token: final norm and
    /// lm_head over the dumped last-block residual, in chunks.
    pub fn finish_corpus(&mut self) -> Result<(), CudaError> {
        let (h, v) = (self.spec.hidden_size, self.spec.vocab_size);
        let eps = self.spec.rms_norm_eps as f32;
        let corpus = self.corpus.as_mut().expect("reserve_corpus first");
        // The upload is over: the page-locked buffers go (their drop waits for their copies).
        corpus.staging.buffers = None;
        let filled = corpus.filled;
        let normed: CudaSlice<u16> = self.alloc(ARGMAX_CHUNK * h)?;
        let logits: CudaSlice<f32> = self.alloc(ARGMAX_CHUNK * v)?;
        let corpus = self.corpus.as_ref().expect("reserved");
        let (last, argmax) = (self.ptr(&corpus.last), self.ptr(&corpus.argmax));
        let mut start = 0;
        while start < filled {
            let rows = ARGMAX_CHUNK.min(filled - start);
            launch!(
                self,
                rms_norm_fwd,
                rows_cfg(rows, ROW_THREADS),
                NULL,
                last + 2 * (start * h) as u64,
                NULL,
                NULL,
                self.ptr(&self.target_norm),
                self.ptr(&normed),
                h as i32,
                NULL,
                h as i32,
                eps
            )?;
            self.gemm(
                Gemm::new(false, true, rows, v, h),
                self.ptr(&normed),
                self.ptr(&self.target_lm_full),
                self.ptr(&logits),
            )?;
            launch!(
                self,
                argmax_rows_u32,
                rows_cfg(rows, ROW_THREADS),
                self.ptr(&logits),
                v as i32,
                argmax + 4 * start as u64
            )?;
            start += rows;
        }
        self.stream.synchronize()?;
        Ok(())
    }

    /// Tokens in the corpus.
    pub fn corpus_tokens(&self) -> usize {
        self.corpus.as_ref().map_or(0, |c| c.filled)
    }

    /// The corpus' target argmax (for tests).
    pub fn corpus_argmax(&self) -> Result<Vec<u32>, CudaError> {
        let corpus = self.corpus.as_ref().expect("reserve_corpus first");
        let all = self.stream.clone_dtoh(&corpus.argmax)?;
        Ok(all[..corpus.filled].to_vec())
    }

    /// One optimizer step on `batch`: forward, loss, backward, clipping, AdamW.
    pub fn train_step(
        &mut self,
        batch: &CorpusBatch,
        steps: usize,
        hp: &AdamWStep,
    ) -> Result<TrainStepReport, CudaError> {
        self.step_replicated(batch, steps, hp, None)
    }

    /// One optimizer step of a data-parallel replica: `batch` is this rank's share of a
    /// global batch (padded to the global batch's width), the loss is averaged over
    /// `replicas.global_positions` (the global batch's `batch * width`), and the gradients and
    /// statistics are summed over the ranks by NCCL before the norm, the clip and AdamW, so
    /// every replica takes the step one process would take on the whole batch.
    pub fn train_step_replica(
        &mut self,
        batch: &CorpusBatch,
        steps: usize,
        hp: &AdamWStep,
        replicas: &Replicas<'_>,
    ) -> Result<TrainStepReport, CudaError> {
        self.step_replicated(batch, steps, hp, Some(replicas))
    }

    fn step_replicated(
        &mut self,
        batch: &CorpusBatch,
        steps: usize,
        hp: &AdamWStep,
        replicas: Option<&Replicas<'_>>,
    ) -> Result<TrainStepReport, CudaError> {
        self.stream.memset_zeros(&mut self.grads)?;
        let positions = replicas.map_or(batch.size() * batch.width, |r| r.global_positions);
        let mut stats = self.run(batch, steps, true, positions)?;
        if let Some(r) = replicas {
            r.collective.all_reduce_sum(&mut self.grads)?;
            r.collective.all_reduce_sum(&mut stats)?;
        }
        let norm_sq: CudaSlice<f64> = self.alloc(1)?;
        let n = self.layout.total;
        launch!(
            self,
            sum_squares,
            stride_cfg(n),
            self.ptr(&self.grads),
            n as i64,
            self.ptr(&norm_sq)
        )?;
        // Both read-backs after the last kernel of the step: the host waits for the GPU once.
        let counts = self.download_stats(&stats, positions, steps)?;
        let grad_norm = self.stream.clone_dtoh(&norm_sq)?[0].sqrt();
        let scale = if hp.max_grad_norm > 0.0 && grad_norm > hp.max_grad_norm {
            hp.max_grad_norm / (grad_norm + 1e-6)
        } else {
            1.0
        };
        self.adam_steps += 1;
        let t = self.adam_steps as i32;
        let bc1 = 1.0 - hp.beta1.powi(t);
        let bc2 = 1.0 - hp.beta2.powi(t);
        launch!(
            self,
            adamw,
            stride_cfg(n),
            self.ptr(&self.params),
            self.ptr(&self.grads),
            self.ptr(&self.moment1),
            self.ptr(&self.moment2),
            self.ptr(&self.params_bf16),
            n as i64,
            hp.lr as f32,
            hp.beta1 as f32,
            hp.beta2 as f32,
            hp.eps as f32,
            hp.weight_decay as f32,
            bc1 as f32,
            bc2 as f32,
            scale as f32
        )?;
        let loss = counts
            .iter()
            .enumerate()
            .map(|(i, c)| c.loss * 0.8f64.powi(i as i32))
            .sum();
        Ok(TrainStepReport {
            loss,
            steps: counts,
            grad_norm,
        })
    }

    /// Loss and accuracy counts of `batch` without gradients (validation).
    pub fn evaluate(
        &mut self,
        batch: &CorpusBatch,
        steps: usize,
    ) -> Result<Vec<StepCounts>, CudaError> {
        let positions = batch.size() * batch.width;
        let stats = self.run(batch, steps, false, positions)?;
        self.download_stats(&stats, positions, steps)
    }

    /// [`CudaHeadTrainer::evaluate`] of a replica's share of a global batch: the counts of the
    /// whole batch, summed over the ranks.
    pub fn evaluate_replica(
        &mut self,
        batch: &CorpusBatch,
        steps: usize,
        replicas: &Replicas<'_>,
    ) -> Result<Vec<StepCounts>, CudaError> {
        let mut stats = self.run(batch, steps, false, replicas.global_positions)?;
        replicas.collective.all_reduce_sum(&mut stats)?;
        self.download_stats(&stats, replicas.global_positions, steps)
    }

    /// Loss and gradients of `batch` without an optimizer step: `(counts, gradients in HF
    /// layout)`. For the parity test against burn's autodiff.
    pub fn gradients(
        &mut self,
        batch: &CorpusBatch,
        steps: usize,
    ) -> Result<(Vec<StepCounts>, HostWeights), CudaError> {
        self.stream.memset_zeros(&mut self.grads)?;
        let positions = batch.size() * batch.width;
        let stats = self.run(batch, steps, true, positions)?;
        let counts = self.download_stats(&stats, positions, steps)?;
        let grads = self.stream.clone_dtoh(&self.grads)?;
        Ok((counts, self.unflatten(&grads)))
    }

    fn download_stats(
        &self,
        stats: &CudaSlice<f64>,
        positions: usize,
        steps: usize,
    ) -> Result<Vec<StepCounts>, CudaError> {
        let host = self.stream.clone_dtoh(stats)?;
        let positions = positions.max(1) as f64;
        Ok((0..steps)
            .map(|i| StepCounts {
                loss: host[3 * i] / positions,
                correct: host[3 * i + 1].round() as usize,
                denominator: host[3 * i + 2].round() as usize,
            })
            .collect())
    }

    fn unflatten(&self, flat: &[f32]) -> HostWeights {
        let mut out = HostWeights::new();
        for (name, shape, offset) in &self.layout.entries {
            let n: usize = shape.iter().product();
            out.insert(
                (*name).to_owned(),
                (shape.clone(), flat[*offset..*offset + n].to_vec()),
            );
        }
        out
    }

    /// The current weights (f32 master copy) in HF layout.
    pub fn weights(&self) -> Result<HostWeights, CudaError> {
        let flat = self.stream.clone_dtoh(&self.params)?;
        Ok(self.unflatten(&flat))
    }

    /// AdamW state: (first moments, second moments, steps taken), flat.
    pub fn optimizer_state(&self) -> Result<(Vec<f32>, Vec<f32>, u64), CudaError> {
        Ok((
            self.stream.clone_dtoh(&self.moment1)?,
            self.stream.clone_dtoh(&self.moment2)?,
            self.adam_steps,
        ))
    }

    /// Restores [`CudaHeadTrainer::optimizer_state`] (a resumed run).
    pub fn load_optimizer_state(
        &mut self,
        moment1: &[f32],
        moment2: &[f32],
        steps: u64,
    ) -> Result<(), CudaError> {
        if moment1.len() != self.layout.total || moment2.len() != self.layout.total {
            return Err(CudaError::Trainer(format!(
                "optimizer state of {} / {} values for {} parameters",
                moment1.len(),
                moment2.len(),
                self.layout.total
            )));
        }
        self.stream.memcpy_htod(moment1, &mut self.moment1)?;
        self.stream.memcpy_htod(moment2, &mut self.moment2)?;
        self.adam_steps = steps;
        Ok(())
    }

    /// The forward unroll with the loss of every step and, when `train`, the backward pass
    /// accumulating into `self.grads`. Returns the `[steps, 3]` statistics (loss sum, correct,
    /// counted) still on the device.
    fn run(
        &mut self,
        batch: &CorpusBatch,
        steps: usize,
        train: bool,
        loss_positions: usize,
    ) -> Result<CudaSlice<f64>, CudaError> {
        let s = &self.spec;
        let (bsz, w) = (batch.size(), batch.width);
        assert!(
            (1..=MAX_TTT_STEPS).contains(&steps),
            "TTT steps must be 1..={MAX_TTT_STEPS}"
        );
        assert!(batch.lengths.iter().all(|&l| l <= w));
        assert_eq!(batch.input_ids.len(), bsz * w);
        assert_eq!(batch.loss_mask.len(), bsz * w);
        let n = bsz * w;
        if n == 0 {
            // A replica with no rows in this step: it adds nothing to the sums it joins.
            return self.alloc(steps * 3);
        }
        let (h, f, inter, dv) = (
            s.hidden_size,
            s.fc_in(),
            s.intermediate_size,
            s.draft_vocab_size,
        );
        let (heads, kvh, hd) = (s.num_heads, s.num_kv_heads, s.head_dim);
        let groups = heads / kvh;
        let (qd, kd) = (heads * hd, kvh * hd);
        let qkv_w = qd + 2 * kd;
        let eps = s.rms_norm_eps as f32;
        let scale = 1.0 / (hd as f32).sqrt();
        let corpus = self.corpus.as_ref().expect("reserve_corpus first");
        let (corpus_aux, corpus_last, corpus_argmax) = (
            self.ptr(&corpus.aux),
            self.ptr(&corpus.last),
            self.ptr(&corpus.argmax),
        );

        // Host-side indices of the batch.
        let mut index = vec![-1i64; n];
        for (b, (&start, &len)) in batch.starts.iter().zip(&batch.lengths).enumerate() {
            for t in 0..len {
                index[b * w + t] = (start + t) as i64;
            }
        }
        let lengths_i32: Vec<i32> = batch.lengths.iter().map(|&l| l as i32).collect();
        let mut step_tokens = Vec::with_capacity(steps * n);
        for i in 0..steps {
            step_tokens.extend(ttt_step_tokens(&batch.input_ids, &batch.lengths, w, i));
        }
        let st = &self.stream;
        let d_index = st.clone_htod(&index)?;
        let d_lengths = st.clone_htod(&lengths_i32)?;
        let d_mask = st.clone_htod(&batch.loss_mask)?;
        let d_tokens = st.clone_htod(&step_tokens)?;
        let tokens_at = |i: usize| self.ptr(&d_tokens) + 4 * (i * n) as u64;

        // The batch's rows of the corpus.
        let aux: CudaSlice<u16> = self.scratch(n * f)?;
        let last: CudaSlice<u16> = self.scratch(n * h)?;
        let tgt_argmax: CudaSlice<u32> = self.scratch(n)?;
        launch!(
            self,
            gather_rows_bf16,
            rows_cfg(n, ROW_THREADS),
            corpus_aux,
            self.ptr(&d_index),
            self.ptr(&aux),
            f as i32
        )?;
        launch!(
            self,
            gather_rows_bf16,
            rows_cfg(n, ROW_THREADS),
            corpus_last,
            self.ptr(&d_index),
            self.ptr(&last),
            h as i32
        )?;
        launch!(
            self,
            gather_u32,
            LaunchConfig {
                grid_dim: (n.div_ceil(256) as u32, 1, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0
            },
            corpus_argmax,
            self.ptr(&d_index),
            self.ptr(&tgt_argmax),
            n as i32
        )?;

        // Target distributions over the draft vocabulary: softmax of the target logits
        // restricted to it.
        let normed: CudaSlice<u16> = self.scratch(n * h)?;
        let tprobs: CudaSlice<f32> = self.scratch(n * dv)?;
        launch!(
            self,
            rms_norm_fwd,
            rows_cfg(n, ROW_THREADS),
            NULL,
            self.ptr(&last),
            NULL,
            NULL,
            self.ptr(&self.target_norm),
            self.ptr(&normed),
            h as i32,
            NULL,
            h as i32,
            eps
        )?;
        self.gemm(
            Gemm::new(false, true, n, dv, h),
            self.ptr(&normed),
            self.ptr(&self.target_lm_draft),
            self.ptr(&tprobs),
        )?;
        launch!(
            self,
            softmax_rows,
            rows_cfg(n, ROW_THREADS),
            self.ptr(&tprobs),
            dv as i32
        )?;

        // fc: hidden input of step 0.
        let h0: CudaSlice<f32> = self.scratch(n * h)?;
        self.gemm(
            Gemm::new(false, true, n, h, f),
            self.ptr(&aux),
            self.param("fc.weight", Which::Bf16),
            self.ptr(&h0),
        )?;

        // Saved activations, one slice per step.
        let x: CudaSlice<u16> = self.scratch(steps * n * 2 * h)?;
        let rstd_e: CudaSlice<f32> = self.scratch(steps * n)?;
        let rstd_h: CudaSlice<f32> = self.scratch(steps * n)?;
        let rstd_p: CudaSlice<f32> = self.scratch(steps * n)?;
        let rstd_f: CudaSlice<f32> = self.scratch(steps * n)?;
        let q_all: CudaSlice<u16> = self.scratch(steps * n * qd)?;
        let k_all: CudaSlice<u16> = self.scratch(steps * n * kd)?;
        let v_all: CudaSlice<u16> = self.scratch(steps * n * kd)?;
        let p0_all: CudaSlice<u16> = self.scratch(steps * bsz * heads * w * w)?;
        let pd_all: CudaSlice<f32> = self.scratch(steps * n * heads * 8)?;
        let attn_rows: CudaSlice<u16> = self.scratch(steps * n * qd)?;
        let h1_all: CudaSlice<f32> = self.scratch(steps * n * h)?;
        let mlp_in: CudaSlice<u16> = self.scratch(steps * n * h)?;
        let gu_all: CudaSlice<f32> = self.scratch(steps * n * 2 * inter)?;
        let act_all: CudaSlice<u16> = self.scratch(steps * n * inter)?;
        let out_all: CudaSlice<f32> = self.scratch(steps * n * h)?;
        let d_logit_branch: CudaSlice<f32> = self.scratch(if train { steps * n * h } else { 1 })?;
        // Scratch.
        let qkv: CudaSlice<f32> = self.scratch(n * qkv_w)?;
        let scores: CudaSlice<f32> = self.scratch(bsz * heads * w * w)?;
        let o_heads: CudaSlice<f32> = self.scratch(n * qd)?;
        let logits: CudaSlice<f32> = self.scratch(n * dv)?;
        let dlogits: CudaSlice<u16> = self.scratch(if train { n * dv } else { 1 })?;
        let d_normed: CudaSlice<f32> = self.scratch(n * h)?;
        let stats: CudaSlice<f64> = self.alloc(steps * 3)?;

        let b16 = |s: &CudaSlice<u16>, off: usize| self.ptr(s) + 2 * off as u64;
        let b32 = |s: &CudaSlice<f32>, off: usize| self.ptr(s) + 4 * off as u64;
        let hidden_in = |i: usize| {
            if i == 0 {
                b32(&h0, 0)
            } else {
                b32(&out_all, (i - 1) * n * h)
            }
        };
        let kv_step = (n * kd) as i64;
        let bh = bsz * kvh;
        let (gw, ww) = (groups * w, w * w);

        for i in 0..steps {
            let xi = b16(&x, i * n * 2 * h);
            let (qi, ki, vi) = (
                b16(&q_all, i * n * qd),
                b16(&k_all, i * n * kd),
                b16(&v_all, i * n * kd),
            );
            let p0i = b16(&p0_all, i * bsz * heads * ww);
            let pdi = b32(&pd_all, i * n * heads * 8);
            let h1i = b32(&h1_all, i * n * h);
            let outi = b32(&out_all, i * n * h);
            // Attention input: [input_layernorm(embed), hidden_norm(hidden)].
            launch!(
                self,
                rms_norm_fwd,
                rows_cfg(n, ROW_THREADS),
                NULL,
                NULL,
                self.ptr(&self.embed),
                tokens_at(i),
                self.param("midlayer.input_layernorm.weight", Which::Master),
                xi,
                (2 * h) as i32,
                b32(&rstd_e, i * n),
                h as i32,
                eps
            )?;
            launch!(
                self,
                rms_norm_fwd,
                rows_cfg(n, ROW_THREADS),
                hidden_in(i),
                NULL,
                NULL,
                NULL,
                self.param("midlayer.hidden_norm.weight", Which::Master),
                xi + 2 * h as u64,
                (2 * h) as i32,
                b32(&rstd_h, i * n),
                h as i32,
                eps
            )?;
            self.gemm(
                Gemm::new(false, true, n, qkv_w, 2 * h),
                xi,
                self.param("midlayer.self_attn.q_proj.weight", Which::Bf16),
                self.ptr(&qkv),
            )?;
            launch!(
                self,
                rope_scatter,
                rows_cfg(n, 128),
                self.ptr(&qkv),
                self.ptr(&self.inv_freq),
                i as i32,
                qi,
                ki,
                vi,
                w as i32,
                heads as i32,
                kvh as i32,
                hd as i32
            )?;
            // Step 0's keys: scaled scores by cuBLAS, then the softmax over them and the
            // diagonal keys of steps 1..=i.
            self.gemm(
                Gemm::new(false, true, gw, w, hd)
                    .alpha(scale)
                    .batched(bh, gw * hd, w * hd, gw * w),
                qi,
                b16(&k_all, 0),
                self.ptr(&scores),
            )?;
            launch!(
                self,
                ttt_softmax_fwd,
                LaunchConfig {
                    grid_dim: (w as u32, heads as u32, bsz as u32),
                    block_dim: (SOFTMAX_THREADS, 1, 1),
                    shared_mem_bytes: 0
                },
                self.ptr(&scores),
                qi,
                b16(&k_all, 0),
                b16(&v_all, 0),
                kv_step,
                i as i32,
                scale,
                p0i,
                pdi,
                self.ptr(&o_heads),
                w as i32,
                heads as i32,
                kvh as i32,
                hd as i32
            )?;
            self.gemm(
                Gemm::new(false, false, gw, hd, w).accumulate().batched(
                    bh,
                    gw * w,
                    w * hd,
                    gw * hd,
                ),
                p0i,
                b16(&v_all, 0),
                self.ptr(&o_heads),
            )?;
            launch!(
                self,
                heads_to_rows,
                rows_cfg(n, ROW_THREADS),
                self.ptr(&o_heads),
                b16(&attn_rows, i * n * qd),
                w as i32,
                heads as i32,
                hd as i32
            )?;
            // h1 = hidden + o_proj(attn); out = h1 + down(swiglu(gate|up(norm(h1)))).
            self.copy_f32(hidden_in(i), h1i, n * h)?;
            self.gemm(
                Gemm::new(false, true, n, h, qd).accumulate(),
                b16(&attn_rows, i * n * qd),
                self.param("midlayer.self_attn.o_proj.weight", Which::Bf16),
                h1i,
            )?;
            launch!(
                self,
                rms_norm_fwd,
                rows_cfg(n, ROW_THREADS),
                h1i,
                NULL,
                NULL,
                NULL,
                self.param("midlayer.post_attention_layernorm.weight", Which::Master),
                b16(&mlp_in, i * n * h),
                h as i32,
                b32(&rstd_p, i * n),
                h as i32,
                eps
            )?;
            self.gemm(
                Gemm::new(false, true, n, 2 * inter, h),
                b16(&mlp_in, i * n * h),
                self.param("midlayer.mlp.gate_proj.weight", Which::Bf16),
                b32(&gu_all, i * n * 2 * inter),
            )?;
            launch!(
                self,
                swiglu_fwd,
                rows_cfg(n, ROW_THREADS),
                b32(&gu_all, i * n * 2 * inter),
                b16(&act_all, i * n * inter),
                inter as i32
            )?;
            self.copy_f32(h1i, outi, n * h)?;
            self.gemm(
                Gemm::new(false, true, n, h, inter).accumulate(),
                b16(&act_all, i * n * inter),
                self.param("midlayer.mlp.down_proj.weight", Which::Bf16),
                outi,
            )?;
            // Logits, loss and (training) the logit branch's gradient right away.
            launch!(
                self,
                rms_norm_fwd,
                rows_cfg(n, ROW_THREADS),
                outi,
                NULL,
                NULL,
                NULL,
                self.param("norm.weight", Which::Master),
                self.ptr(&normed),
                h as i32,
                b32(&rstd_f, i * n),
                h as i32,
                eps
            )?;
            self.gemm(
                Gemm::new(false, true, n, dv, h),
                self.ptr(&normed),
                self.param("lm_head.weight", Which::Bf16),
                self.ptr(&logits),
            )?;
            // The loss is a mean over the positions of the whole (global) batch.
            let coef = (0.8f64.powi(i as i32) / loss_positions as f64) as f32;
            launch!(
                self,
                draft_loss,
                rows_cfg(n, ROW_THREADS),
                self.ptr(&logits),
                self.ptr(&tprobs),
                self.ptr(&tgt_argmax),
                self.ptr(&self.in_draft),
                self.ptr(&self.draft_to_target),
                self.ptr(&d_mask),
                self.ptr(&d_lengths),
                w as i32,
                dv as i32,
                i as i32,
                coef,
                if train { self.ptr(&dlogits) } else { NULL },
                self.ptr(&stats) + 8 * (3 * i) as u64
            )?;
            if train {
                self.gemm(
                    Gemm::new(true, false, dv, h, n).accumulate(),
                    self.ptr(&dlogits),
                    self.ptr(&normed),
                    self.param("lm_head.weight", Which::Grad),
                )?;
                self.gemm(
                    Gemm::new(false, false, n, h, dv),
                    self.ptr(&dlogits),
                    self.param("lm_head.weight", Which::Bf16),
                    self.ptr(&d_normed),
                )?;
                self.norm_weight_grad(
                    self.ptr(&d_normed),
                    h,
                    outi,
                    NULL,
                    NULL,
                    b32(&rstd_f, i * n),
                    self.param("norm.weight", Which::Grad),
                    n,
                )?;
                launch!(
                    self,
                    rms_norm_bwd,
                    rows_cfg(n, ROW_THREADS),
                    self.ptr(&d_normed),
                    h as i32,
                    outi,
                    self.param("norm.weight", Which::Master),
                    b32(&rstd_f, i * n),
                    b32(&d_logit_branch, i * n * h),
                    0i32,
                    h as i32
                )?;
            }
        }
        if !train {
            return Ok(stats);
        }

        // Backward, last step first: a step's keys and values get their gradients from every
        // later step, so they are complete when the step itself is reached.
        let d_res: CudaSlice<f32> = self.scratch(n * h)?;
        let d_res_bf: CudaSlice<u16> = self.scratch(n * h)?;
        let d_act: CudaSlice<f32> = self.scratch(n * inter)?;
        let dgu: CudaSlice<u16> = self.scratch(n * 2 * inter)?;
        let d_mlp_in: CudaSlice<f32> = self.scratch(n * h)?;
        let d_attn: CudaSlice<f32> = self.scratch(n * qd)?;
        let d_o: CudaSlice<u16> = self.scratch(n * qd)?;
        let ds0: CudaSlice<u16> = self.scratch(bsz * heads * ww)?;
        let dq: CudaSlice<f32> = self.scratch(n * qd)?;
        let dk_all: CudaSlice<f32> = self.alloc(steps * n * kd)?;
        let dv_all: CudaSlice<f32> = self.alloc(steps * n * kd)?;
        let dqkv: CudaSlice<u16> = self.scratch(n * qkv_w)?;
        let d_x: CudaSlice<f32> = self.scratch(n * 2 * h)?;
        for i in (0..steps).rev() {
            let xi = b16(&x, i * n * 2 * h);
            let (qi, p0i, pdi) = (
                b16(&q_all, i * n * qd),
                b16(&p0_all, i * bsz * heads * ww),
                b32(&pd_all, i * n * heads * 8),
            );
            let h1i = b32(&h1_all, i * n * h);
            let dlb = b32(&d_logit_branch, i * n * h);
            if i == steps - 1 {
                self.copy_f32(dlb, self.ptr(&d_res), n * h)?;
            } else {
                launch!(
                    self,
                    add_f32,
                    stride_cfg(n * h),
                    dlb,
                    self.ptr(&d_res),
                    (n * h) as i64
                )?;
            }
            // MLP.
            self.to_bf16(self.ptr(&d_res), self.ptr(&d_res_bf), n * h)?;
            self.gemm(
                Gemm::new(true, false, h, inter, n).accumulate(),
                self.ptr(&d_res_bf),
                b16(&act_all, i * n * inter),
                self.param("midlayer.mlp.down_proj.weight", Which::Grad),
            )?;
            self.gemm(
                Gemm::new(false, false, n, inter, h),
                self.ptr(&d_res_bf),
                self.param("midlayer.mlp.down_proj.weight", Which::Bf16),
                self.ptr(&d_act),
            )?;
            launch!(
                self,
                swiglu_bwd,
                rows_cfg(n, ROW_THREADS),
                b32(&gu_all, i * n * 2 * inter),
                self.ptr(&d_act),
                self.ptr(&dgu),
                inter as i32
            )?;
            self.gemm(
                Gemm::new(true, false, 2 * inter, h, n).accumulate(),
                self.ptr(&dgu),
                b16(&mlp_in, i * n * h),
                self.param("midlayer.mlp.gate_proj.weight", Which::Grad),
            )?;
            self.gemm(
                Gemm::new(false, false, n, h, 2 * inter),
                self.ptr(&dgu),
                self.param("midlayer.mlp.gate_proj.weight", Which::Bf16),
                self.ptr(&d_mlp_in),
            )?;
            self.norm_weight_grad(
                self.ptr(&d_mlp_in),
                h,
                h1i,
                NULL,
                NULL,
                b32(&rstd_p, i * n),
                self.param("midlayer.post_attention_layernorm.weight", Which::Grad),
                n,
            )?;
            launch!(
                self,
                rms_norm_bwd,
                rows_cfg(n, ROW_THREADS),
                self.ptr(&d_mlp_in),
                h as i32,
                h1i,
                self.param("midlayer.post_attention_layernorm.weight", Which::Master),
                b32(&rstd_p, i * n),
                self.ptr(&d_res),
                1i32,
                h as i32
            )?;
            // o_proj.
            self.to_bf16(self.ptr(&d_res), self.ptr(&d_res_bf), n * h)?;
            self.gemm(
                Gemm::new(true, false, h, qd, n).accumulate(),
                self.ptr(&d_res_bf),
                b16(&attn_rows, i * n * qd),
                self.param("midlayer.self_attn.o_proj.weight", Which::Grad),
            )?;
            self.gemm(
                Gemm::new(false, false, n, qd, h),
                self.ptr(&d_res_bf),
                self.param("midlayer.self_attn.o_proj.weight", Which::Bf16),
                self.ptr(&d_attn),
            )?;
            launch!(
                self,
                rows_to_heads,
                rows_cfg(n, ROW_THREADS),
                self.ptr(&d_attn),
                self.ptr(&d_o),
                w as i32,
                heads as i32,
                hd as i32
            )?;
            // Attention: dP0 = dO V0^T (into `scores`), dV0 += P0^T dO, the softmax backward
            // (diagonal parts included), dQ += scale dS0 K0, dK0 += scale dS0^T Q.
            self.gemm(
                Gemm::new(false, true, gw, w, hd).batched(bh, gw * hd, w * hd, gw * w),
                self.ptr(&d_o),
                b16(&v_all, 0),
                self.ptr(&scores),
            )?;
            self.gemm(
                Gemm::new(true, false, w, hd, gw)
                    .accumulate()
                    .batched(bh, gw * w, gw * hd, w * hd),
                p0i,
                self.ptr(&d_o),
                b32(&dv_all, 0),
            )?;
            launch!(
                self,
                ttt_softmax_bwd,
                LaunchConfig {
                    grid_dim: (w as u32, kvh as u32, bsz as u32),
                    block_dim: (SOFTMAX_THREADS, 1, 1),
                    shared_mem_bytes: 0
                },
                self.ptr(&scores),
                p0i,
                pdi,
                self.ptr(&d_o),
                qi,
                b16(&k_all, 0),
                b16(&v_all, 0),
                kv_step,
                b32(&dk_all, 0),
                b32(&dv_all, 0),
                kv_step,
                i as i32,
                scale,
                self.ptr(&ds0),
                self.ptr(&dq),
                w as i32,
                heads as i32,
                kvh as i32,
                hd as i32
            )?;
            self.gemm(
                Gemm::new(false, false, gw, hd, w)
                    .alpha(scale)
                    .accumulate()
                    .batched(bh, gw * w, w * hd, gw * hd),
                self.ptr(&ds0),
                b16(&k_all, 0),
                self.ptr(&dq),
            )?;
            self.gemm(
                Gemm::new(true, false, w, hd, gw)
                    .alpha(scale)
                    .accumulate()
                    .batched(bh, gw * w, gw * hd, w * hd),
                self.ptr(&ds0),
                qi,
                b32(&dk_all, 0),
            )?;
            // q|k|v projections (step i's keys/values are complete now).
            launch!(
                self,
                rope_gather_bwd,
                rows_cfg(n, 128),
                self.ptr(&dq),
                b32(&dk_all, i * n * kd),
                b32(&dv_all, i * n * kd),
                self.ptr(&self.inv_freq),
                i as i32,
                self.ptr(&dqkv),
                w as i32,
                heads as i32,
                kvh as i32,
                hd as i32
            )?;
            self.gemm(
                Gemm::new(true, false, qkv_w, 2 * h, n).accumulate(),
                self.ptr(&dqkv),
                xi,
                self.param("midlayer.self_attn.q_proj.weight", Which::Grad),
            )?;
            self.gemm(
                Gemm::new(false, false, n, 2 * h, qkv_w),
                self.ptr(&dqkv),
                self.param("midlayer.self_attn.q_proj.weight", Which::Bf16),
                self.ptr(&d_x),
            )?;
            // The two input norms: weights, and the hidden input's gradient (the embedding is
            // frozen).
            self.norm_weight_grad(
                self.ptr(&d_x),
                2 * h,
                NULL,
                self.ptr(&self.embed),
                tokens_at(i),
                b32(&rstd_e, i * n),
                self.param("midlayer.input_layernorm.weight", Which::Grad),
                n,
            )?;
            self.norm_weight_grad(
                self.ptr(&d_x) + 4 * h as u64,
                2 * h,
                hidden_in(i),
                NULL,
                NULL,
                b32(&rstd_h, i * n),
                self.param("midlayer.hidden_norm.weight", Which::Grad),
                n,
            )?;
            launch!(
                self,
                rms_norm_bwd,
                rows_cfg(n, ROW_THREADS),
                self.ptr(&d_x) + 4 * h as u64,
                (2 * h) as i32,
                hidden_in(i),
                self.param("midlayer.hidden_norm.weight", Which::Master),
                b32(&rstd_h, i * n),
                self.ptr(&d_res),
                1i32,
                h as i32
            )?;
        }
        // fc.
        self.to_bf16(self.ptr(&d_res), self.ptr(&d_res_bf), n * h)?;
        self.gemm(
            Gemm::new(true, false, h, f, n).accumulate(),
            self.ptr(&d_res_bf),
            self.ptr(&aux),
            self.param("fc.weight", Which::Grad),
        )?;
        Ok(stats)
    }

    #[allow(clippy::too_many_arguments)]
    fn norm_weight_grad(
        &self,
        dy: u64,
        dy_stride: usize,
        x: u64,
        table: u64,
        tokens: u64,
        rstd: u64,
        dw: u64,
        rows: usize,
    ) -> Result<(), CudaError> {
        let h = self.spec.hidden_size;
        launch!(
            self,
            rms_norm_weight_grad,
            rows_cfg(rows.div_ceil(NORM_GRAD_ROWS), ROW_THREADS),
            dy,
            dy_stride as i32,
            x,
            table,
            tokens,
            rstd,
            dw,
            rows as i32,
            NORM_GRAD_ROWS as i32,
            h as i32
        )
    }

    fn copy_f32(&self, src: u64, dst: u64, n: usize) -> Result<(), CudaError> {
        // SAFETY: both ranges are `n` f32 inside live buffers of this trainer.
        unsafe {
            cudarc::driver::result::memcpy_dtod_async(dst, src, 4 * n, self.stream.cu_stream())
        }?;
        Ok(())
    }

    fn to_bf16(&self, src: u64, dst: u64, n: usize) -> Result<(), CudaError> {
        launch!(self, f32_to_bf16_n, stride_cfg(n), src, dst, n as i64)
    }
}

#[derive(Debug, Clone, Copy)]
enum Which {
    Master,
    Bf16,
    Grad,
}

#[cfg(test)]
mod tests {
    use super::*;
    use tandem_eagle::Eagle3Config;

    fn spec() -> DraftSpec {
        let target: tandem_model::HfConfig = serde_json::from_value(serde_json::json!({
            "architectures": ["LlamaForCausalLM"], "hidden_size": 576, "intermediate_size": 1536,
            "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
            "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "vocab_size": 49152,
            "max_position_embeddings": 8192, "tie_word_embeddings": true
        }))
        .unwrap();
        Eagle3Config::for_target(&target, 8192, 3)
            .resolve()
            .unwrap()
    }

    /// The flat layout the kernels rely on: every parameter exactly once, no overlaps,
    /// q|k|v and gate|up packed back to back (one fused matmul weight each), groups aligned.
    #[test]
    fn parameter_layout_packs_fused_weights_and_covers_every_parameter() {
        let spec = spec();
        let layout = ParamLayout::new(&spec);
        let shapes = parameter_shapes(&spec);
        assert_eq!(layout.entries.len(), shapes.len());
        let mut spans: Vec<(usize, usize)> = layout
            .entries
            .iter()
            .map(|(_, shape, offset)| (*offset, offset + shape.iter().product::<usize>()))
            .collect();
        spans.sort();
        for pair in spans.windows(2) {
            assert!(pair[0].1 <= pair[1].0, "overlapping parameters: {pair:?}");
        }
        assert_eq!(spans.last().unwrap().1, layout.total);
        let end = |name: &str| {
            let (_, shape, offset) = layout.entries.iter().find(|e| e.0 == name).unwrap();
            offset + shape.iter().product::<usize>()
        };
        let q = "midlayer.self_attn.q_proj.weight";
        let k = "midlayer.self_attn.k_proj.weight";
        let v = "midlayer.self_attn.v_proj.weight";
        assert_eq!(end(q), layout.offset(k));
        assert_eq!(end(k), layout.offset(v));
        let (gate, up) = (
            "midlayer.mlp.gate_proj.weight",
            "midlayer.mlp.up_proj.weight",
        );
        assert_eq!(end(gate), layout.offset(up));
        for name in ["fc.weight", q, gate, "lm_head.weight", "norm.weight"] {
            assert_eq!(layout.offset(name) % 64, 0, "{name} starts unaligned");
        }
        // The fused q|k|v weight is [(heads + 2 kv_heads) * head_dim, 2H] row-major.
        assert_eq!(
            end(v) - layout.offset(q),
            (spec.num_heads + 2 * spec.num_kv_heads) * spec.head_dim * 2 * spec.hidden_size
        );
    }
}
