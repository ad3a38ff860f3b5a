//! The GPU handles (context, one stream, cuBLAS, the compiled kernels) and one typed wrapper per
//! kernel of `kernels/llama.cu`. Every `unsafe` of the crate is here: a kernel launch is unsafe
//! because the compiler cannot check the argument list against the CUDA signature, so each
//! wrapper states the sizes it relies on and the callers pass buffers of those sizes.
#![allow(unsafe_code)]

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::cublas::CudaBlas;
use cudarc::cublas::result::gemm_ex;
use cudarc::cublas::sys::{
    cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t, cudaDataType_t,
};
use cudarc::driver::sys::{
    CUdevice_attribute, CUgraphInstantiate_flags, CUmemPool_attribute, CUmemoryPool,
    CUstreamCaptureMode,
};
use cudarc::driver::{
    CudaContext, CudaEvent, CudaFunction, CudaGraph, CudaModule, CudaSlice, CudaStream, CudaView,
    CudaViewMut, DevicePtr, DevicePtrMut, DeviceRepr, LaunchConfig, PinnedHostSlice, PushKernelArg,
    ValidAsZeroBits,
};
use cudarc::nvrtc::{CompileOptions, Ptx, compile_ptx_with_opts};

use crate::error::CudaError;
use crate::kv_pool::KvPool;

mod mma_attention;
mod mma_rows;
use mma_attention::MmaAttention;
pub use mma_attention::{
    Assembly, DEFAULT_MMA_MIN_WIDTH, MMA_MIN_QUERY_ROWS, assemble_mma_attention,
};
use mma_rows::MmaRows;
pub use mma_rows::{MLP_CLUSTER, MlpSums, assemble_mma_rows};

const KERNEL_SOURCE: &str = include_str!("../../../kernels/llama.cu");

/// The helpers every kernel source uses (bf16 conversions, block reductions, block argmax).
const COMMON_SOURCE: &str = include_str!("../../../kernels/common.cuh");
/// The tensor-core helpers (`mma.sync`) of the sources compiled for sm_80+.
const MMA_HELPERS: &str = include_str!("../../../kernels/mma.cuh");

/// Compiles a kernel source with NVRTC (`name` labels its messages), as every GPU path does at
/// start-up: `kernels/common.cuh` first (NVRTC gets no include path), then a `#line` directive
/// so that messages give the line numbers of the source itself.
pub(crate) fn compile_source(source: &str, name: &str) -> Result<Ptx, CudaError> {
    compile_source_for(source, name, false, false, "")
}

/// [`compile_source`], with `programmatic` for a GPU that has programmatic dependent launch
/// (sm_90 and later): `TANDEM_PDL` defined (see kernels/common.cuh, and `late`:
/// [`pdl_defines`]) and PTX for compute_90. `defines`: more `#define` lines in front of the
/// source.
fn compile_source_for(
    source: &str,
    name: &str,
    programmatic: bool,
    late: bool,
    defines: &str,
) -> Result<Ptx, CudaError> {
    Ok(compile_ptx_with_opts(
        full_source(
            source,
            name,
            &format!("{}{defines}", pdl_defines(programmatic, late)),
        ),
        CompileOptions {
            name: Some(name.into()),
            arch: programmatic.then_some("compute_90"),
            ..Default::default()
        },
    )?)
}

/// The defines of a programmatic-launch build: `TANDEM_PDL`, and with `late` also
/// `TANDEM_PDL_LATE` (each kernel lets the next launch once it has passed its own wait; see
/// kernels/common.cuh). Nothing without `programmatic`.
pub(crate) fn pdl_defines(programmatic: bool, late: bool) -> &'static str {
    match (programmatic, late) {
        (false, _) => "",
        (true, false) => "#define TANDEM_PDL 1\n",
        (true, true) => "#define TANDEM_PDL 1\n#define TANDEM_PDL_LATE 1\n",
    }
}

/// The late trigger of [`pdl_defines`]: on unless `TANDEM_CUDA_PDL_LATE=0` (the default since
/// session 47, with the attention in the chain: [`attention_pdl`]), read once when a GPU is
/// opened (`Gpu`'s `pdl_late`), so that every module it compiles agrees.
fn pdl_late() -> bool {
    switch_on_unless_zero(std::env::var("TANDEM_CUDA_PDL_LATE").ok().as_deref())
}

/// Whether the fused steps' attention joins the programmatic launch chain: on unless
/// `TANDEM_CUDA_PDL_ATTENTION=0`. With the late trigger (session 47, H100, one binary and run,
/// each step's graph replayed back to back, defaults measured before and after): a batch-8
/// decode 0.706 ms against 0.745 / 0.752, an 8-token verification at batch 1 0.700 against
/// 0.756 / 0.745, a 4-token one 0.613 against 0.633 / 0.634, batch-1 and batch-32 decodes the
/// same (0.579 against 0.580 / 0.596; 1.103 against 1.100 / 1.107); the late trigger alone
/// 0.716 and 0.716. Without the late trigger the attention in the chain was slower (session 42:
/// batch-1 decode 0.662 ms against 0.635), every launch up to it resident at once.
fn attention_pdl() -> bool {
    switch_on_unless_zero(std::env::var("TANDEM_CUDA_PDL_ATTENTION").ok().as_deref())
}

/// A default-on switch's value: off only for `0` (surrounding blanks ignored).
fn switch_on_unless_zero(value: Option<&str>) -> bool {
    value.map(str::trim) != Some("0")
}

/// What NVRTC compiles for `source`: the launch shapes the kernels assume, from the constants
/// the launchers use, so the two cannot drift apart (llama.cu refuses to compile without them),
/// then `defines`, `kernels/common.cuh` and the source after a `#line` directive.
fn full_source(source: &str, name: &str, defines: &str) -> String {
    format!(
        "#define GEMV_MAX_ROWS {GEMV_MAX_ROWS}\n#define GEMV_BLOCK_WARPS {}\n{defines}\
         {COMMON_SOURCE}\n#line 1 \"{name}\"\n{source}",
        GEMV_THREADS / 32
    )
}

/// [`full_source`] of a source that uses the tensor cores: `kernels/mma.cuh` between
/// `common.cuh` and the source, whose line numbers still start at 1.
fn mma_source(source: &str, name: &str, defines: &str) -> String {
    full_source(
        &format!("#line 1 \"mma.cuh\"\n{MMA_HELPERS}\n#line 1 \"{name}\"\n{source}"),
        name,
        defines,
    )
}

/// Whether libnvrtc can be loaded. Compiling the kernels needs it; a GPU it does not.
pub fn nvrtc_present() -> bool {
    // SAFETY: only tries to dlopen the library.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

/// Compiles every kernel source of the crate (`kernels/llama.cu`, `kernels/train.cu`, each after
/// `kernels/common.cuh`) with
/// NVRTC and the options the GPU paths use, without a GPU: CI runs it (with the libnvrtc of
/// the `nvidia-cuda-nvrtc` wheel) so that a kernel that does not compile is caught before a
/// GPU session. Returns the sources compiled.
pub fn compile_all_kernels() -> Result<Vec<&'static str>, CudaError> {
    if !nvrtc_present() {
        return Err(CudaError::MissingLibrary(
            "libnvrtc (CUDA runtime compiler)",
        ));
    }
    compile_source(KERNEL_SOURCE, "llama.cu")?;
    compile_source_for(KERNEL_SOURCE, "llama.cu", true, false, "")?;
    compile_source_for(KERNEL_SOURCE, "llama.cu", true, true, "")?;
    compile_source_for(
        KERNEL_SOURCE,
        "llama.cu",
        false,
        false,
        "#define PERSIST_THREADS 256\n",
    )?;
    compile_source(crate::train::KERNEL_SOURCE, "train.cu")?;
    mma_attention::compile()?;
    let threads = mma_rows::QKV_ATTENTION_THREADS;
    mma_rows::compile(false, false, false, threads)?;
    mma_rows::compile(true, false, false, threads)?;
    mma_rows::compile(true, true, false, threads)?;
    mma_rows::compile(true, false, true, threads)?;
    mma_rows::compile(true, false, false, 640)?;
    Ok(vec![
        "kernels/llama.cu",
        "kernels/train.cu",
        "kernels/attention_mma.cu",
        "kernels/rows_mma.cu",
    ])
}

/// Threads per block of the attention kernel (8 warps, each taking 32 cache columns at a time).
const ATTENTION_THREADS: u32 = 256;

/// Most rows a fused small step takes (`GEMV_MAX_ROWS` in kernels/llama.cu): decode and tree
/// verification at small batch, where a projection is a matrix-vector product.
pub const GEMV_MAX_ROWS: usize = 8;

/// Most rows a fused small step takes on the tensor-core kernels (`kernels/rows_mma.cu`): row
/// groups of [`GEMV_MAX_ROWS`], one block row each, so that a row's bits and a block's shared
/// memory are those of an 8-row step. A chain 3/1/4 verification at batch 8 (32 rows) then runs
/// fused and batch invariant instead of on cuBLAS.
pub const MMA_MAX_ROWS: usize = 32;

/// Rows of the row group a tensor-core small-step block takes (all of a step's up to 8).
fn group_rows(rows: usize) -> usize {
    rows.min(GEMV_MAX_ROWS)
}

/// Rows a fused small-step block stages and multiplies: its row group's on the tensor cores,
/// the whole step's on the CUDA cores.
fn block_rows(tensor_cores: bool, rows: usize) -> usize {
    if tensor_cores { group_rows(rows) } else { rows }
}

/// Threads per block of the fused small-step kernels (4 warps, one output row or pair each).
const GEMV_THREADS: u32 = 128;

/// How many warps of a `gemv_rows` block share one output's dot product (each over its own
/// slice of the input, added in slice order): 4 for the narrow projections of a small model
/// (SmolLM2's o_proj and down_proj have 576 outputs: four warps an SM otherwise), 2 up to 4,095
/// outputs, 1 for wide ones (the logits). A function of the output width only, so a row's bits
/// do not depend on how many rows the step has.
pub(crate) fn gemv_split(out: usize) -> usize {
    match out {
        0..1024 => 4,
        1024..4096 => 2,
        _ => 1,
    }
}

/// The `gemv_rows` row bucket of a step of `rows` rows: the smallest of 1, 2, 4 and 8 that
/// holds them. Buckets differ in registers and in outputs a warp, never in a row's bits.
pub(crate) fn gemv_bucket(rows: usize) -> usize {
    rows.next_power_of_two()
}

/// Outputs a warp of `gemv_rows` for row buckets 1, 2, 4 and 8 (one input chunk loaded serves
/// that many weight rows, which pays once the rows multiply the input loads; more outputs also
/// mean fewer warps). The fastest of six settings swept on the H200 over SmolLM2's 4- and 8-row
/// steps (BENCHMARKS.md, session 26 run 4: 1,1,1,2 and 1,1,2,2 within 0.3%, 1,1,2,4 3% slower,
/// 1,1,1,1 6%).
pub const GEMV_OUTPUTS: [usize; 4] = [1, 1, 1, 2];

/// `"a,b,c,d"` (each 1, 2 or 4) as outputs a warp for the four row buckets; `None` otherwise.
pub fn parse_gemv_outputs(text: &str) -> Option<[usize; 4]> {
    let values: Vec<usize> = text
        .split(',')
        .map(|v| v.trim().parse().ok().filter(|n| [1, 2, 4].contains(n)))
        .collect::<Option<_>>()?;
    values.try_into().ok()
}

/// Logits a block of `argmax_rows_split` scans at most: 256 threads, eight values each, all
/// loads in flight at once.
const ARGMAX_SPAN: usize = 2048;

/// Threads per block of `argmax_rows_split` (a multiple of which every part's span is, so that a
/// part's loads stay coalesced).
const ARGMAX_SPLIT_THREADS: usize = 256;

/// How `argmax_rows_split` cuts `rows` rows of `vocab` logits on a GPU of `sm_count` SMs:
/// `(parts a row, values a part)`, or `None` for `argmax_rows`' block a row. Split while the
/// rows alone leave SMs idle (fewer rows than SMs) and a row has at least two spans: parts of
/// [`ARGMAX_SPAN`] values, or fewer and longer ones where that would make more than about two
/// blocks an SM. `rows * parts` stays under `3 * sm_count` (the parts' scratch).
pub(crate) fn argmax_split(rows: usize, vocab: usize, sm_count: usize) -> Option<(usize, usize)> {
    if rows == 0 || rows >= sm_count || vocab < 2 * ARGMAX_SPAN {
        return None;
    }
    let parts = vocab
        .div_ceil(ARGMAX_SPAN)
        .min((2 * sm_count).div_ceil(rows));
    if parts < 2 {
        return None;
    }
    let span = vocab.div_ceil(parts).next_multiple_of(ARGMAX_SPLIT_THREADS);
    let parts = vocab.div_ceil(span);
    (parts >= 2).then_some((parts, span))
}

/// The cached columns a mask's rows have ([`Gpu::build_mask`]): known on the host (an eager
/// step), or read at run time from a graphed step's `[col0, total]` scalars, so each replay
/// expands its own step's mask (the buffers hold `capacity` columns).
pub enum MaskColumns<'a> {
    Used(usize),
    FromScalars {
        scalars: &'a CudaView<'a, i32>,
        capacity: usize,
    },
}

/// The scratch of `argmax_rows_split`: each part's best value and index (`3 * sm_count` slots)
/// and a count of finished parts a row (`sm_count`, zero between launches: the last part of a
/// row sets it back).
struct ArgmaxParts {
    value: CudaSlice<f32>,
    index: CudaSlice<i32>,
    done: CudaSlice<u32>,
}

/// Blocks a sequence of `gather_accepted_roots` (each copies its share of the root's logits
/// row): one per 2,048 logits, at most 32.
pub(crate) fn gather_parts(vocab: usize) -> usize {
    vocab.div_ceil(2048).clamp(1, 32)
}

/// Warps per block of `persistent_step` (PERSIST_WARPS in kernels/llama.cu), the most it is
/// compiled with (shared memory is sized for it).
const PERSISTENT_WARPS: usize = 16;

/// Most layers `persistent_step` takes (PERSIST_MAX_LAYERS: its layer table is in shared
/// memory).
pub const PERSISTENT_MAX_LAYERS: usize = 128;

/// `persistent_step`'s static shared memory: the layer table and the tap slots.
const PERSISTENT_STATIC_SHARED_BYTES: usize =
    PERSISTENT_MAX_LAYERS * PERSISTENT_TABLE_WORDS * 8 + PERSISTENT_MAX_TAPS * (4 + 8);

/// Tap slots `persistent_step` writes (PERSIST_MAX_TAPS).
pub const PERSISTENT_MAX_TAPS: usize = 8;

/// Device addresses per layer in `persistent_step`'s table (`PersistLayer`): input norm,
/// q|k|v, q|k|v bias (0 without), o, post-attention norm, gate|up, down, keys, values.
pub const PERSISTENT_TABLE_WORDS: usize = 9;

/// The buffers and sizes of one [`Gpu::persistent_step`] launch.
pub(crate) struct PersistentStep<'a> {
    /// Per layer [`PERSISTENT_TABLE_WORDS`] addresses, then (tap point, address) per tap slot.
    pub table: &'a CudaSlice<u64>,
    pub tap_slots: usize,
    pub embed: &'a CudaSlice<u16>,
    pub tokens: &'a CudaView<'a, u32>,
    pub positions: &'a CudaView<'a, i32>,
    pub inv_freq: &'a CudaSlice<f32>,
    pub mask: &'a CudaSlice<f32>,
    pub step_scalars: Option<&'a CudaView<'a, i32>>,
    pub final_norm: &'a CudaSlice<u16>,
    pub lm_head: &'a CudaSlice<u16>,
    /// The row of each logit row (`LogitsFor::Last`); `None`: rows 0.. in order.
    pub logit_rows: Option<&'a CudaSlice<i32>>,
    /// The logits buffer and its rows; `None`: no logits.
    pub logits: Option<(&'a CudaSlice<f32>, usize)>,
    pub hidden: &'a CudaSlice<f32>,
    pub q: &'a CudaSlice<f32>,
    /// Each row's visible columns, then their counts: `[rows, capacity]` then `[rows]`.
    pub visible: &'a CudaSlice<i32>,
    /// The attention output, `[rows, heads * head_dim]` bf16.
    pub attn: &'a CudaSlice<u16>,
    pub act: &'a CudaSlice<u16>,
    /// The grid barrier's counter (one u32, zero before the first launch).
    pub arrived: &'a CudaSlice<u32>,
    /// Block 0's clocks at each barrier ([`Gpu::persistent_profile_len`]), when profiling.
    pub profile: Option<&'a CudaSlice<u64>>,
    pub layers: usize,
    pub shape: AttentionShape,
    pub hidden_size: usize,
    pub inter: usize,
    pub col0: usize,
    pub total: usize,
    pub vocab: usize,
    pub eps: f32,
}

/// Which steps launch their small-step kernels (and the plain attention kernel) with
/// programmatic dependent launch, by row count: `TANDEM_CUDA_PDL_ROWS=N` (steps of at most N
/// rows; 0: none), or `TANDEM_CUDA_PDL=1` (every step, as before N existed). Unset: every fused
/// step ([`GEMV_MAX_ROWS`]) where the tensor-core small steps run (`TANDEM_CUDA_MMA_ROWS` not
/// 0), none otherwise. A PDL launch may start while the kernel before it runs and load its
/// weights before waiting for its inputs (`PDL_WAIT` in the kernels). With the CUDA-core
/// kernels that made 1- and 2-row steps faster and 4- and 8-row steps slower (BENCHMARKS.md,
/// session 30); with the tensor-core ones every fused step from 1 to 8 rows is 11-15% faster
/// (session 41, H100: a batch-1 decode 0.724 -> 0.625 ms, an 8-token verification 0.836 ->
/// 0.739), and every GPU suite passes with it.
fn pdl_rows_from_env(compute_major: i32) -> usize {
    let tensor_core_steps = mma_rows::enabled(
        std::env::var("TANDEM_CUDA_MMA_ROWS").ok().as_deref(),
        compute_major,
    );
    pdl_rows(
        std::env::var("TANDEM_CUDA_PDL_ROWS").ok().as_deref(),
        std::env::var("TANDEM_CUDA_PDL").ok().as_deref(),
        if tensor_core_steps { GEMV_MAX_ROWS } else { 0 },
    )
}

/// [`pdl_rows_from_env`] of the two variables' values and the default when neither is set:
/// `TANDEM_CUDA_PDL_ROWS` wins when set (a value that is not a number turns PDL off rather
/// than on); `TANDEM_CUDA_PDL` set to anything but 1 turns it off.
fn pdl_rows(rows: Option<&str>, every_step: Option<&str>, default: usize) -> usize {
    match (rows, every_step) {
        (Some(rows), _) => rows.trim().parse().unwrap_or(0),
        (None, Some("1")) => usize::MAX,
        (None, Some(_)) => 0,
        (None, None) => default,
    }
}

/// The first input of [`Gpu::norm_qkv_rope`].
#[derive(Clone, Copy)]
pub enum QkvInput<'a, 'b> {
    /// `[rows, hidden]` f32 rows (a target layer's residual stream).
    Rows(&'a CudaSlice<f32>),
    /// Row `tokens[r]` of a `[vocab, hidden]` bf16 embedding table.
    Embedding {
        table: &'a CudaSlice<u16>,
        tokens: &'a CudaView<'b, u32>,
    },
}

/// Shared memory a fused kernel may stage its normed input rows in (bf16) without opting in to
/// more than the default 48 KiB.
pub const GEMV_MAX_SHARED_BYTES: usize = 48 << 10;

/// Bytes of the cuBLAS workspace the GPU sets once. cuBLAS would otherwise size and allocate
/// workspace on its own, which a stream capture (a CUDA graph) must not see happen.
const BLAS_WORKSPACE_BYTES: usize = 32 << 20;

struct Kernels {
    embed_rows: CudaFunction,
    add_rms_norm: CudaFunction,
    build_mask: CudaFunction,
    rope_qkv: CudaFunction,
    head_rms_norm: CudaFunction,
    attention: CudaFunction,
    silu_mul: CudaFunction,
    gather_rows: CudaFunction,
    argmax_rows: CudaFunction,
    argmax_rows_split: CudaFunction,
    scatter_chain_tokens: CudaFunction,
    gather_accepted_roots: CudaFunction,
    beam_select: CudaFunction,
    sample_rows: CudaFunction,
    copy_rows: CudaFunction,
    copy_rows_u16: CudaFunction,
    move_rows_u16: CudaFunction,
    taps_to_bf16: CudaFunction,
    copy_f32_pairs: CudaFunction,
    topk_softmax: CudaFunction,
    /// `gemv_rows_r{R}_o{N}`: `[bucket][outputs]` for row buckets 1, 2, 4, 8 ([`gemv_bucket`])
    /// and 1, 2, 4 outputs a warp.
    gemv_rows: [[CudaFunction; 3]; 4],
    /// `gemv_norm_rows_r{R}_o{N}`, indexed as `gemv_rows`.
    gemv_norm_rows: [[CudaFunction; 3]; 4],
    norm_gate_up_silu: CudaFunction,
    norm_qkv_rope: CudaFunction,
    persistent_step: CudaFunction,
    visible_columns: CudaFunction,
    attention_invariant: CudaFunction,
}

/// One GPU: its context, the stream every launch goes to, cuBLAS bound to that stream, and the
/// kernels compiled once by NVRTC.
pub struct Gpu {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    blas: CudaBlas,
    /// cuBLAS's workspace: owned here so it outlives every graph that captured a matmul.
    _blas_workspace: CudaSlice<u8>,
    kernels: Kernels,
    /// Whether models on this GPU start with CUDA graphs on (`TANDEM_CUDA_GRAPHS=0`: off).
    graphs_default: bool,
    /// Whether the kernels were compiled for programmatic dependent launch: an sm_90+ GPU and
    /// [`pdl_rows_from_env`] above 0.
    programmatic: bool,
    /// Whether they were compiled with the late trigger (on unless `TANDEM_CUDA_PDL_LATE=0`,
    /// [`pdl_defines`]); the tensor-core small steps, compiled later, take the same.
    pdl_late: bool,
    /// The most rows a step may have for its kernels to launch with programmatic dependent
    /// launch ([`pdl_rows_from_env`]; 0 when `programmatic` is off).
    pdl_rows: usize,
    /// Whether the fused steps' attention (`attention_invariant`) joins the programmatic launch
    /// chain ([`attention_pdl`]: on unless `TANDEM_CUDA_PDL_ATTENTION=0`, since session 47).
    attention_pdl: bool,
    /// Streaming multiprocessors: the persistent step runs one block on each.
    sm_count: usize,
    /// Warps per block of the persistent step (PERSIST_THREADS / 32 as compiled).
    persistent_warps: usize,
    /// Whether the persistent step launches cooperatively (the driver then guarantees that
    /// every block is resident, which its grid barriers need); `TANDEM_CUDA_COOPERATIVE=0`
    /// launches it plainly (one block per SM is resident in practice).
    cooperative: bool,
    /// Outputs a warp of `gemv_rows` for row buckets 1, 2, 4 and 8: [`GEMV_OUTPUTS`], or
    /// TANDEM_CUDA_GEMV_OUTPUTS="a,b,c,d" (each 1, 2 or 4; a speed knob: bits never change).
    gemv_outputs: [usize; 4],
    /// Idle KV-cache buffers, so that a new cache of a shape seen before gets the addresses
    /// the graphs were captured over ([`crate::kv_pool`]).
    kv_pool: Arc<KvPool>,
    /// Page-locked host buffers with their events, reused by [`Gpu::read_back`].
    read_backs: Mutex<Vec<ReadBackBuffer>>,
    /// The tensor-core attention of wide steps (`kernels/attention_mma.cu`), compiled when
    /// first switched on ([`Gpu::set_mma_attention`]) on an sm_80+ GPU.
    mma_attention: OnceLock<MmaAttention>,
    /// The narrowest step (slots a sequence) it takes; 0: none.
    mma_attention_width: AtomicUsize,
    /// The fewest (slot, query head) rows of a step it takes.
    mma_attention_rows: AtomicUsize,
    /// The fused small steps' products on the tensor cores (`kernels/rows_mma.cu`), compiled
    /// when first switched on ([`Gpu::set_mma_rows`]) on an sm_80+ GPU.
    mma_rows: OnceLock<MmaRows>,
    /// Whether fused steps take them (on sm_80+ unless `TANDEM_CUDA_MMA_ROWS=0`; see
    /// [`mma_rows::enabled`]).
    mma_rows_on: AtomicBool,
    /// Whether the greedy ids of fewer rows than SMs come from `argmax_rows_split` ([`argmax_split`];
    /// on unless `TANDEM_CUDA_ARGMAX_SPLIT=0`, [`Gpu::set_argmax_split`]). Same ids either way.
    argmax_split_on: AtomicBool,
    argmax_parts: ArgmaxParts,
}

/// A page-locked host buffer and the event recorded after the last copy into it.
struct ReadBackBuffer {
    host: PinnedHostSlice<u32>,
    event: CudaEvent,
}

/// A copy to the host queued by [`Gpu::read_back`]: [`PendingRead::wait`] waits for that copy
/// (and the work queued before it) only, not for what was queued on the stream after it.
pub struct PendingRead {
    gpu: Arc<Gpu>,
    buffer: Option<ReadBackBuffer>,
    len: usize,
}

impl PendingRead {
    /// The values, once the copy has landed.
    pub fn wait(mut self) -> Result<Vec<u32>, CudaError> {
        let buffer = self
            .buffer
            .take()
            .expect("a pending read is waited for once");
        let waited = buffer.event.synchronize();
        let values = waited
            .map_err(CudaError::from)
            .and_then(|()| Ok(buffer.host.as_slice()?[..self.len].to_vec()));
        self.gpu.recycle_read_back(buffer);
        values
    }
}

impl Drop for PendingRead {
    fn drop(&mut self) {
        // Not waited for (an error between queueing and reading): the copy may still be
        // writing the buffer, so it is waited for before the buffer can be reused.
        if let Some(buffer) = self.buffer.take() {
            let _ = buffer.event.synchronize();
            self.gpu.recycle_read_back(buffer);
        }
    }
}

impl std::fmt::Debug for PendingRead {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PendingRead({} values)", self.len)
    }
}

impl std::fmt::Debug for Gpu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Gpu(ordinal {})", self.ctx.ordinal())
    }
}

/// A null device pointer for optional kernel arguments.
const NULL: u64 = 0;

/// Kernel arguments for [`Gpu::launch_programmatic`], one 8-byte slot each: a device address,
/// or an `i32` / `f32` in the low bytes (CUDA reads each parameter's own size from its slot).
#[derive(Default)]
struct KernelArgs(Vec<u64>);

impl KernelArgs {
    fn buffer<T>(mut self, gpu: &Gpu, buffer: &CudaSlice<T>) -> Self {
        self.0.push(gpu.address(buffer));
        self
    }
    fn optional<T>(mut self, gpu: &Gpu, buffer: Option<&CudaSlice<T>>) -> Self {
        self.0.push(buffer.map_or(NULL, |b| gpu.address(b)));
        self
    }
    fn view<T>(mut self, gpu: &Gpu, view: &CudaView<'_, T>) -> Self {
        self.0.push(gpu.view_address(view));
        self
    }
    fn optional_view<T>(mut self, gpu: &Gpu, view: Option<&CudaView<'_, T>>) -> Self {
        self.0.push(view.map_or(NULL, |v| gpu.view_address(v)));
        self
    }
    fn int(mut self, value: usize) -> Self {
        self.0.push(u64::from(
            i32::try_from(value).expect("kernel argument fits i32") as u32,
        ));
        self
    }
    fn float(mut self, value: f32) -> Self {
        self.0.push(u64::from(value.to_bits()));
        self
    }
}

impl Gpu {
    /// Opens GPU `ordinal`, compiles the kernels and creates the cuBLAS handle.
    pub fn new(ordinal: usize) -> Result<Arc<Self>, CudaError> {
        // cudarc panics when a library cannot be loaded; ask first so a machine without CUDA
        // gets an error naming what is missing.
        // SAFETY: these only try to dlopen the libraries.
        let present = unsafe {
            [
                (
                    "libcuda (the NVIDIA driver)",
                    cudarc::driver::sys::is_culib_present(),
                ),
                (
                    "libnvrtc (CUDA runtime compiler)",
                    cudarc::nvrtc::sys::is_culib_present(),
                ),
                ("libcublas", cudarc::cublas::sys::is_culib_present()),
            ]
        };
        if let Some((name, _)) = present.iter().find(|(_, ok)| !ok) {
            return Err(CudaError::MissingLibrary(name));
        }
        let ctx = CudaContext::new(ordinal).map_err(CudaError::NoDevice)?;
        // One stream does all the work, so cudarc's per-buffer events (made for multi-stream
        // programs) are pure overhead: two event calls per argument per launch.
        // SAFETY: no buffer of this context is ever used from a second stream.
        unsafe { ctx.disable_event_tracking() };
        // A stream of its own, not the legacy default stream: only such a stream can be
        // captured into a CUDA graph (`Gpu::capture`).
        let stream = ctx.new_stream()?;
        let blas = CudaBlas::new(stream.clone())?;
        let mut blas_workspace = stream.alloc_zeros::<u8>(BLAS_WORKSPACE_BYTES)?;
        {
            let (ptr, _record) = blas_workspace.device_ptr_mut(&stream);
            // SAFETY: the handle is live and bound to `stream`; the workspace is a device
            // allocation of BLAS_WORKSPACE_BYTES that `Gpu` keeps alive as long as the handle.
            let status = unsafe {
                cudarc::cublas::sys::cublasSetWorkspace_v2(
                    *blas.handle(),
                    ptr as *mut std::ffi::c_void,
                    BLAS_WORKSPACE_BYTES,
                )
            };
            status.result()?;
        }
        let (major, _) = ctx.compute_capability()?;
        let pdl_rows = if major >= 9 {
            pdl_rows_from_env(major)
        } else {
            0
        };
        let programmatic = pdl_rows > 0;
        let pdl_late = programmatic && pdl_late();
        // The persistent step's block: 16 warps, or 8 with TANDEM_CUDA_PERSISTENT_WARPS=8
        // (twice the registers per thread).
        let persistent_warps = match std::env::var("TANDEM_CUDA_PERSISTENT_WARPS").as_deref() {
            Ok("8") => 8,
            _ => PERSISTENT_WARPS,
        };
        let ptx = compile_source_for(
            KERNEL_SOURCE,
            "llama.cu",
            programmatic,
            pdl_late,
            &format!("#define PERSIST_THREADS {}\n", persistent_warps * 32),
        )?;
        let module = ctx.load_module(ptx)?;
        let kernels = Kernels {
            embed_rows: module.load_function("embed_rows")?,
            add_rms_norm: module.load_function("add_rms_norm")?,
            build_mask: module.load_function("build_mask")?,
            rope_qkv: module.load_function("rope_qkv")?,
            head_rms_norm: module.load_function("head_rms_norm")?,
            attention: module.load_function("attention")?,
            silu_mul: module.load_function("silu_mul")?,
            gather_rows: module.load_function("gather_rows")?,
            argmax_rows: module.load_function("argmax_rows")?,
            argmax_rows_split: module.load_function("argmax_rows_split")?,
            scatter_chain_tokens: module.load_function("scatter_chain_tokens")?,
            gather_accepted_roots: module.load_function("gather_accepted_roots")?,
            beam_select: module.load_function("beam_select")?,
            sample_rows: module.load_function("sample_rows")?,
            copy_rows: module.load_function("copy_rows")?,
            copy_rows_u16: module.load_function("copy_rows_u16")?,
            move_rows_u16: module.load_function("move_rows_u16")?,
            taps_to_bf16: module.load_function("taps_to_bf16")?,
            copy_f32_pairs: module.load_function("copy_f32_pairs")?,
            topk_softmax: module.load_function("topk_softmax")?,
            gemv_rows: Self::gemv_kernels(&module, "gemv_rows")?,
            gemv_norm_rows: Self::gemv_kernels(&module, "gemv_norm_rows")?,
            norm_gate_up_silu: module.load_function("norm_gate_up_silu")?,
            norm_qkv_rope: module.load_function("norm_qkv_rope")?,
            persistent_step: module.load_function("persistent_step")?,
            visible_columns: module.load_function("visible_columns")?,
            attention_invariant: module.load_function("attention_invariant")?,
        };
        let sm_count = usize::try_from(
            ctx.attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?,
        )
        .unwrap_or(1);
        let argmax_parts = ArgmaxParts {
            value: stream.alloc_zeros::<f32>(3 * sm_count)?,
            index: stream.alloc_zeros::<i32>(3 * sm_count)?,
            done: stream.alloc_zeros::<u32>(sm_count)?,
        };
        let gpu = Self {
            ctx,
            stream,
            blas,
            _blas_workspace: blas_workspace,
            kernels,
            graphs_default: std::env::var("TANDEM_CUDA_GRAPHS").map_or(true, |v| v != "0"),
            programmatic,
            pdl_late,
            pdl_rows,
            attention_pdl: attention_pdl(),
            sm_count,
            persistent_warps,
            cooperative: std::env::var("TANDEM_CUDA_COOPERATIVE").map_or(true, |v| v != "0"),
            gemv_outputs: std::env::var("TANDEM_CUDA_GEMV_OUTPUTS")
                .ok()
                .and_then(|v| parse_gemv_outputs(&v))
                .unwrap_or(GEMV_OUTPUTS),
            kv_pool: Arc::new(KvPool::from_env()),
            read_backs: Mutex::new(Vec::new()),
            mma_attention: OnceLock::new(),
            mma_attention_width: AtomicUsize::new(0),
            mma_attention_rows: AtomicUsize::new(mma_attention::MMA_MIN_QUERY_ROWS),
            mma_rows: OnceLock::new(),
            mma_rows_on: AtomicBool::new(false),
            argmax_split_on: AtomicBool::new(
                std::env::var("TANDEM_CUDA_ARGMAX_SPLIT").map_or(true, |v| v != "0"),
            ),
            argmax_parts,
        };
        gpu.set_pool_release_threshold(u64::MAX)?;
        let (compute_major, _) = gpu.ctx.compute_capability()?;
        gpu.set_mma_attention(
            mma_attention::min_width(
                std::env::var("TANDEM_CUDA_MMA_ATTENTION").ok().as_deref(),
                compute_major,
            ),
            mma_attention::MMA_MIN_QUERY_ROWS,
        )?;
        gpu.set_mma_rows(mma_rows::enabled(
            std::env::var("TANDEM_CUDA_MMA_ROWS").ok().as_deref(),
            compute_major,
        ))?;
        Ok(Arc::new(gpu))
    }

    fn pool_of(ctx: &Arc<CudaContext>) -> Result<CUmemoryPool, CudaError> {
        // SAFETY: the device handle comes from a live context.
        Ok(unsafe { cudarc::driver::result::device::get_mem_pool(ctx.cu_device()) }?)
    }

    /// How much freed memory the device's stream-ordered pool may keep across
    /// synchronisations. Every scratch buffer of a step is allocated from that pool, and every
    /// step ends with a token read-back that synchronises; with CUDA's default threshold (0)
    /// the pool may hand freed memory back to the driver there. `Gpu::new` keeps everything
    /// (`u64::MAX`) so that steps never wait on re-mapping; `fast-bench
    /// --pool-release-threshold 0` measures the default. On the H200 the two were within noise
    /// (BENCHMARKS.md, issue #6): the step is launch-bound, not allocation-bound.
    pub fn set_pool_release_threshold(&self, bytes: u64) -> Result<(), CudaError> {
        let pool = Self::pool_of(&self.ctx)?;
        let mut value = bytes;
        // SAFETY: the pool belongs to this context's device; the attribute takes a u64.
        unsafe {
            cudarc::driver::result::mem_pool::set_attribute(
                pool,
                CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                (&mut value) as *mut u64 as *mut std::ffi::c_void,
            )
        }?;
        Ok(())
    }

    /// Hands the stream-ordered pool's unused memory back to the driver once the stream's work
    /// is done, and returns how many bytes the pool held before and after. The pool keeps its
    /// peak otherwise (`set_pool_release_threshold(u64::MAX)`), so the scratch of a server's
    /// start-up measurement of every draft shape would stay reserved for good, out of reach of
    /// other processes on the GPU (on the H200 at max batch 32: 0.78 GiB of 9.97).
    pub fn release_unused_memory(&self) -> Result<(u64, u64), CudaError> {
        self.synchronize()?;
        let pool = Self::pool_of(&self.ctx)?;
        let reserved = || -> Result<u64, CudaError> {
            let mut value = 0u64;
            // SAFETY: the pool belongs to this context's device; the attribute is a u64.
            unsafe {
                cudarc::driver::result::mem_pool::get_attribute(
                    pool,
                    CUmemPool_attribute::CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT,
                    (&mut value) as *mut u64 as *mut std::ffi::c_void,
                )
            }?;
            Ok(value)
        };
        let before = reserved()?;
        // SAFETY: the pool belongs to this context's device; trimming frees only memory no
        // allocation holds.
        unsafe { cudarc::driver::result::mem_pool::trim_to(pool, 0) }?;
        Ok((before, reserved()?))
    }

    /// Lets `peer` read and write every buffer this GPU's stream-ordered pool hands out. NCCL
    /// connects the GPUs of one process by direct pointers and, for large messages, its
    /// kernels on one GPU read and write the other's user buffer; peer access enabled by
    /// `cuCtxEnablePeerAccess` (which NCCL does) does not cover memory from `cuMemAllocAsync`
    /// pools, which needs `cuMemPoolSetAccess` (PyTorch's cudaMallocAsync backend and XLA do
    /// the same). Without it a tensor-parallel all-reduce of a long prefill is an illegal
    /// address. Returns whether the GPUs can reach each other at all (if not, NCCL goes
    /// through its own buffers and nothing is needed).
    pub(crate) fn share_pool_with(&self, peer: &Gpu) -> Result<bool, CudaError> {
        use cudarc::driver::sys;
        let (own, other) = (self.ctx.cu_device(), peer.ctx.cu_device());
        if own == other {
            return Ok(false);
        }
        let mut reachable: std::ffi::c_int = 0;
        // SAFETY: both device handles come from live contexts; the out-pointer is a local.
        unsafe { sys::cuDeviceCanAccessPeer(&mut reachable, other, own) }.result()?;
        if reachable == 0 {
            return Ok(false);
        }
        let access = sys::CUmemAccessDesc {
            location: sys::CUmemLocation {
                type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
                id: peer.ordinal() as std::ffi::c_int,
            },
            flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        };
        let pool = Self::pool_of(&self.ctx)?;
        // SAFETY: the pool is this device's default pool; one descriptor, read during the call.
        unsafe { sys::cuMemPoolSetAccess(pool, &access, 1) }.result()?;
        Ok(true)
    }

    /// Whether models loaded on this GPU replay CUDA graphs for decode-sized steps unless told
    /// otherwise: yes, except with the environment variable `TANDEM_CUDA_GRAPHS=0` (every
    /// kernel launched eagerly, the baseline of the graphs' benchmarks).
    pub fn graphs_default(&self) -> bool {
        self.graphs_default
    }

    /// The context, for modules compiled beside `llama.cu` (the trainer's kernels).
    pub(crate) fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The one stream every launch goes to.
    pub(crate) fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// cuBLAS, bound to [`Gpu::stream`].
    pub(crate) fn blas(&self) -> &CudaBlas {
        &self.blas
    }

    pub fn name(&self) -> String {
        self.ctx.name().unwrap_or_else(|_| "CUDA device".into())
    }

    /// The CUDA device ordinal.
    pub fn ordinal(&self) -> usize {
        self.ctx.ordinal()
    }

    /// Makes this GPU's context current on the calling thread (cuBLAS calls run in the
    /// current context; a tensor-parallel rank's thread binds its GPU before its step).
    pub fn bind_to_thread(&self) -> Result<(), CudaError> {
        Ok(self.ctx.bind_to_thread()?)
    }

    /// Makes this GPU's context current even after an error was recorded on it (cudarc's
    /// bind returns that error, clearing it, without binding): for freeing and aborting
    /// after a failed step, where such an error is likely.
    pub(crate) fn make_current(&self) {
        if self.ctx.bind_to_thread().is_err() {
            let _ = self.ctx.bind_to_thread();
        }
    }

    pub fn synchronize(&self) -> Result<(), CudaError> {
        Ok(self.stream.synchronize()?)
    }

    pub fn upload<T: DeviceRepr>(&self, host: &[T]) -> Result<CudaSlice<T>, CudaError> {
        Ok(self.stream.clone_htod(host)?)
    }

    /// Copies `host` into the front of an existing buffer (a graph's input, which must keep
    /// its address).
    pub fn upload_into<T: DeviceRepr>(
        &self,
        host: &[T],
        device: &mut CudaSlice<T>,
    ) -> Result<(), CudaError> {
        assert!(device.len() >= host.len());
        if !host.is_empty() {
            self.stream
                .memcpy_htod(host, &mut device.slice_mut(0..host.len()))?;
        }
        Ok(())
    }

    /// `dst[..n] = src[..n]` on the GPU (captured into a graph like a launch).
    pub fn copy_into<T: DeviceRepr>(
        &self,
        src: &CudaSlice<T>,
        dst: &mut CudaSlice<T>,
        n: usize,
    ) -> Result<(), CudaError> {
        assert!(src.len() >= n && dst.len() >= n);
        Ok(self
            .stream
            .memcpy_dtod(&src.slice(0..n), &mut dst.slice_mut(0..n))?)
    }

    /// `dst[..src.len()] = src` on the GPU, views of buffers.
    pub fn copy_view_into<T: DeviceRepr>(
        &self,
        src: &CudaView<'_, T>,
        dst: &mut CudaViewMut<'_, T>,
    ) -> Result<(), CudaError> {
        let n = src.len();
        assert!(dst.len() >= n);
        if n == 0 {
            return Ok(());
        }
        Ok(self.stream.memcpy_dtod(src, &mut dst.slice_mut(0..n))?)
    }

    /// `dst[at..at + n] = src[..n]` for every (source, destination) pair, four pairs a launch
    /// (`copy_f32_pairs` in kernels/llama.cu): one launch instead of one copy per pair.
    pub fn copy_pairs_to_offset(
        &self,
        pairs: &mut [(&CudaSlice<f32>, &mut CudaSlice<f32>)],
        at: usize,
        n: usize,
    ) -> Result<(), CudaError> {
        assert!(pairs.iter().all(|(s, d)| s.len() >= n && d.len() >= at + n));
        if n == 0 {
            return Ok(());
        }
        let bytes_at = (at * std::mem::size_of::<f32>()) as u64;
        for group in pairs.chunks_mut(4) {
            let mut args = KernelArgs::default();
            for y in 0..4 {
                args = args.optional(self, group.get(y).map(|(s, _)| &**s));
            }
            for y in 0..4 {
                args.0.push(
                    group
                        .get(y)
                        .map_or(NULL, |(_, d)| self.address(d) + bytes_at),
                );
            }
            args.0.push(n as u64);
            let cfg = LaunchConfig {
                grid_dim: (n.div_ceil(256).min(64) as u32, group.len() as u32, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: signature (4 x const f32*, 4 x f32* (null past the group), long long);
            // block row y < group.len() reads n values of source y and writes n values from
            // offset `at` of destination y; sizes asserted.
            unsafe { self.launch_ex(&self.kernels.copy_f32_pairs, cfg, args, None) }?;
        }
        Ok(())
    }

    /// The device address of `buffer` (identifies the buffers a graph was captured over).
    pub(crate) fn address<T>(&self, buffer: &CudaSlice<T>) -> u64 {
        let (ptr, _record) = buffer.device_ptr(&self.stream);
        ptr
    }

    /// The device address of the first element of `view`.
    pub(crate) fn view_address<T>(&self, view: &CudaView<'_, T>) -> u64 {
        let (ptr, _record) = view.device_ptr(&self.stream);
        ptr
    }

    /// A new buffer holding a copy of `src`.
    pub fn duplicate<T: DeviceRepr>(&self, src: &CudaSlice<T>) -> Result<CudaSlice<T>, CudaError> {
        Ok(self.stream.clone_dtod(src)?)
    }

    /// Records the launches `record` issues on the stream as a CUDA graph, without running
    /// them, and instantiates it. Every buffer `record` touches must outlive the graph and keep
    /// its address: a replay runs the same launches with the same arguments.
    pub fn capture(
        &self,
        record: impl FnOnce() -> Result<(), CudaError>,
    ) -> Result<StepGraph, CudaError> {
        self.stream
            .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)?;
        // The capture always ends, also when recording failed or panicked, so the stream stays
        // usable (and an unfinished graph holding NCCL all-reduces cannot keep a
        // communicator's abort waiting for good). cudarc's end_capture binds the context
        // first, which fails on an error recorded earlier: that check clears it.
        let recorded = std::panic::catch_unwind(std::panic::AssertUnwindSafe(record));
        let stale = self.ctx.check_err();
        let graph = self.stream.end_capture(CUgraphInstantiate_flags(0));
        let recorded = recorded.unwrap_or_else(|panic| std::panic::resume_unwind(panic));
        recorded?;
        stale?;
        let graph = graph?.ok_or_else(|| CudaError::Unsupported {
            what: "an empty graph capture".into(),
            architecture: "-".into(),
        })?;
        graph.upload()?;
        Ok(StepGraph { graph })
    }

    /// Runs a captured graph on the stream (asynchronously, like a launch).
    pub fn replay(&self, graph: &StepGraph) -> Result<(), CudaError> {
        Ok(graph.graph.launch()?)
    }

    pub fn download<T: DeviceRepr + Default + Clone>(
        &self,
        device: &CudaSlice<T>,
    ) -> Result<Vec<T>, CudaError> {
        Ok(self.stream.clone_dtoh(device)?)
    }

    /// Queues a copy of `src` into page-locked host memory and an event after it, without
    /// waiting: the host can queue more work (e.g. the head's extend after a verification) and
    /// then wait for these values alone ([`PendingRead::wait`]). A `Vec` read-back
    /// ([`Gpu::download`]) waits for the whole stream instead.
    pub fn read_back(self: &Arc<Self>, src: &CudaView<'_, u32>) -> Result<PendingRead, CudaError> {
        let len = src.len();
        let reusable = {
            let mut pool = self.read_backs.lock().unwrap_or_else(|e| e.into_inner());
            pool.iter()
                .position(|b| b.host.len() >= len)
                .map(|i| pool.swap_remove(i))
        };
        let mut buffer = match reusable {
            Some(buffer) => buffer,
            None => ReadBackBuffer {
                // Cached (not write-combined) memory: the host reads it.
                // SAFETY: only the first `len` values are read, after the copy that writes
                // them has completed.
                host: unsafe { self.ctx.alloc_pinned_with_flags::<u32>(len.max(64), 0) }?,
                event: self.ctx.new_event(None)?,
            },
        };
        // cudarc's `memcpy_dtoh` copies as many values as the destination holds (it only
        // asserts that the source is not longer), so the copy is issued for `len` values here.
        let queued = buffer.host.as_mut_slice().and_then(|host| {
            let (src_ptr, _record) = src.device_ptr(&self.stream);
            // SAFETY: `host[..len]` is page-locked memory that stays allocated (in the pool or
            // the pending read) until the event after the copy has completed; `src` holds
            // `len` values on this stream's context.
            unsafe {
                cudarc::driver::result::memcpy_dtoh_async(
                    &mut host[..len],
                    src_ptr,
                    self.stream.cu_stream(),
                )
            }
        });
        let queued = queued.and_then(|()| buffer.event.record(&self.stream));
        let pending = PendingRead {
            gpu: self.clone(),
            buffer: Some(buffer),
            len,
        };
        queued?;
        Ok(pending)
    }

    fn recycle_read_back(&self, buffer: ReadBackBuffer) {
        self.read_backs
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(buffer);
    }

    pub fn zeros<T: DeviceRepr + ValidAsZeroBits>(
        &self,
        n: usize,
    ) -> Result<CudaSlice<T>, CudaError> {
        Ok(self.stream.alloc_zeros(n.max(1))?)
    }

    /// `count` zeroed bf16 buffers of `n` values for a KV cache: an idle set of that shape from
    /// the pool when there is one (the same buffers in the same order), new ones otherwise.
    pub(crate) fn kv_buffers(
        &self,
        count: usize,
        n: usize,
    ) -> Result<Vec<CudaSlice<u16>>, CudaError> {
        let n = n.max(1);
        match self.kv_pool.take(count, n) {
            Some(mut set) => {
                for buffer in &mut set {
                    self.stream.memset_zeros(buffer)?;
                }
                Ok(set)
            }
            None => (0..count).map(|_| self.zeros::<u16>(n)).collect(),
        }
    }

    /// The pool KV caches on this GPU recycle their buffers through.
    pub(crate) fn kv_pool(&self) -> Arc<KvPool> {
        self.kv_pool.clone()
    }

    /// Idle KV-cache buffer sets held for reuse.
    pub fn idle_kv_sets(&self) -> usize {
        self.kv_pool.idle_sets()
    }

    /// An uninitialised buffer of `n` values that the next kernel overwrites completely.
    pub fn scratch<T: DeviceRepr>(&self, n: usize) -> Result<CudaSlice<T>, CudaError> {
        // SAFETY: callers write every element before any read (each use below fills the whole
        // buffer: a matmul output, or a kernel that writes every row it is launched over).
        Ok(unsafe { self.stream.alloc(n.max(1)) }?)
    }

    /// [`Gpu::linear`] without accumulation, through [`Gpu::gemv_rows`] on `fused` steps:
    /// cuBLAS picks its kernel by the number of rows, which would give a row other bits in a
    /// wider step, while `gemv_rows` gives a row the same bits at every width (the logits and
    /// the head's fc and logits of the fused small steps).
    #[allow(clippy::too_many_arguments)]
    pub fn project(
        &self,
        fused: bool,
        x: &CudaSlice<u16>,
        w: &CudaSlice<u16>,
        y: &mut CudaSlice<f32>,
        rows: usize,
        inp: usize,
        out: usize,
    ) -> Result<(), CudaError> {
        if fused {
            self.gemv_rows(x, w, y, rows, inp, out, false)
        } else {
            self.linear(x, w, y, rows, inp, out)
        }
    }

    /// `y[rows, out] (f32) = x[rows, inp] (bf16) . w[out, inp]^T (bf16)`, f32 accumulation.
    /// cuBLAS is column-major: row-major `w [out, inp]` is the column-major `[inp, out]`
    /// matrix, so `y^T = w . x^T` is `gemm(T, N, m = out, n = rows, k = inp)`.
    pub fn linear(
        &self,
        x: &CudaSlice<u16>,
        w: &CudaSlice<u16>,
        y: &mut CudaSlice<f32>,
        rows: usize,
        inp: usize,
        out: usize,
    ) -> Result<(), CudaError> {
        self.gemm(x, w, y, rows, inp, out, false)
    }

    /// `y += x . w^T`: [`Gpu::linear`] accumulating into `y` (cuBLAS beta = 1), so a projection
    /// of concatenated inputs runs as one matmul per part without building the concatenation.
    pub fn linear_add(
        &self,
        x: &CudaSlice<u16>,
        w: &CudaSlice<u16>,
        y: &mut CudaSlice<f32>,
        rows: usize,
        inp: usize,
        out: usize,
    ) -> Result<(), CudaError> {
        self.gemm(x, w, y, rows, inp, out, true)
    }

    #[allow(clippy::too_many_arguments)]
    fn gemm(
        &self,
        x: &CudaSlice<u16>,
        w: &CudaSlice<u16>,
        y: &mut CudaSlice<f32>,
        rows: usize,
        inp: usize,
        out: usize,
        accumulate: bool,
    ) -> Result<(), CudaError> {
        assert!(x.len() >= rows * inp && w.len() >= out * inp && y.len() >= rows * out);
        // cuBLAS runs in the current context, and cudarc binds one only for its own calls:
        // after another GPU's work on this thread (a tensor-parallel peer's cache or graphs
        // freed), this GPU's must be current again. Kernel launches bind the same way.
        self.ctx.bind_to_thread()?;
        let alpha = 1.0f32;
        let beta = if accumulate { 1.0f32 } else { 0.0f32 };
        let (xp, _x) = x.device_ptr(&self.stream);
        let (wp, _w) = w.device_ptr(&self.stream);
        let (yp, _y) = y.device_ptr_mut(&self.stream);
        // SAFETY: the assert above bounds every access of the three matrices.
        unsafe {
            gemm_ex(
                *self.blas.handle(),
                cublasOperation_t::CUBLAS_OP_T,
                cublasOperation_t::CUBLAS_OP_N,
                out as i32,
                rows as i32,
                inp as i32,
                (&alpha) as *const f32 as *const _,
                wp as *const _,
                cudaDataType_t::CUDA_R_16BF,
                inp as i32,
                xp as *const _,
                cudaDataType_t::CUDA_R_16BF,
                inp as i32,
                (&beta) as *const f32 as *const _,
                yp as *mut _,
                cudaDataType_t::CUDA_R_32F,
                out as i32,
                cublasComputeType_t::CUBLAS_COMPUTE_32F,
                cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )?;
        }
        Ok(())
    }

    fn rows_config(rows: usize, threads: u32) -> LaunchConfig {
        LaunchConfig {
            grid_dim: (rows as u32, 1, 1),
            block_dim: (threads, 1, 1),
            shared_mem_bytes: 0,
        }
    }

    /// `out[r] = f32(table[tokens[r]])`; `out` holds `tokens.len() * hidden`.
    pub fn embed_rows(
        &self,
        table: &CudaSlice<u16>,
        tokens: &CudaView<'_, u32>,
        out: &mut CudaSlice<f32>,
        rows: usize,
        hidden: usize,
    ) -> Result<(), CudaError> {
        assert!(tokens.len() >= rows && out.len() >= rows * hidden);
        let hidden_i = hidden as i32;
        let mut launch = self.stream.launch_builder(&self.kernels.embed_rows);
        launch.arg(table).arg(tokens).arg(out).arg(&hidden_i);
        // SAFETY: signature (u16*, u32*, f32*, int); sizes asserted; token ids were checked
        // against the vocabulary on the host.
        unsafe { launch.launch(Self::rows_config(rows, 256)) }?;
        Ok(())
    }

    /// `x += delta` (when given), then `out = rms_norm(x) * w` in bf16, and in f32 into
    /// `out_f32` when given.
    #[allow(clippy::too_many_arguments)]
    pub fn add_rms_norm(
        &self,
        x: &mut CudaSlice<f32>,
        delta: Option<&CudaSlice<f32>>,
        w: &CudaSlice<u16>,
        out: &mut CudaSlice<u16>,
        out_f32: Option<&mut CudaSlice<f32>>,
        rows: usize,
        hidden: usize,
        eps: f32,
    ) -> Result<(), CudaError> {
        assert!(x.len() >= rows * hidden && out.len() >= rows * hidden && w.len() >= hidden);
        assert!(delta.is_none_or(|d| d.len() >= rows * hidden));
        assert!(out_f32.as_ref().is_none_or(|o| o.len() >= rows * hidden));
        let args = KernelArgs::default()
            .buffer(self, x)
            .optional(self, delta)
            .buffer(self, w)
            .buffer(self, out)
            .optional(self, out_f32.as_deref())
            .int(hidden)
            .float(eps);
        // SAFETY: signature (f32*, const f32* or null, u16*, u16*, f32* or null, int, float);
        // sizes asserted; the kernel waits (PDL_WAIT) before reading anything, so a small
        // step's final norm may launch while the last down_proj runs.
        unsafe {
            self.launch_programmatic(
                &self.kernels.add_rms_norm,
                Self::rows_config(rows, 256),
                args,
                rows,
            )
        }
    }

    /// See `rope_qkv` in kernels/llama.cu.
    #[allow(clippy::too_many_arguments)]
    pub fn rope_qkv(
        &self,
        qkv: &CudaSlice<f32>,
        bias: Option<&CudaSlice<f32>>,
        positions: &CudaView<'_, i32>,
        inv_freq: &CudaSlice<f32>,
        q_out: &mut CudaSlice<f32>,
        k_cache: &mut CudaSlice<u16>,
        v_cache: &mut CudaSlice<u16>,
        shape: AttentionShape,
        col0: usize,
        step_scalars: Option<&CudaView<'_, i32>>,
    ) -> Result<(), CudaError> {
        let s = shape;
        let q_dim = s.heads * s.head_dim;
        let kv_dim = s.kv_heads * s.head_dim;
        assert!(qkv.len() >= s.rows() * (q_dim + 2 * kv_dim) && q_out.len() >= s.rows() * q_dim);
        assert!(positions.len() >= s.rows() && inv_freq.len() >= s.head_dim / 2);
        assert!(col0 + s.width <= s.capacity);
        assert!(k_cache.len() >= s.batch * kv_dim * s.capacity && v_cache.len() == k_cache.len());
        let (width, heads, kv_heads, head_dim, capacity, col0) = (
            s.width as i32,
            s.heads as i32,
            s.kv_heads as i32,
            s.head_dim as i32,
            s.capacity as i32,
            col0 as i32,
        );
        let mut launch = self.stream.launch_builder(&self.kernels.rope_qkv);
        launch.arg(qkv);
        match bias {
            Some(b) => launch.arg(b),
            None => launch.arg(&NULL),
        };
        launch
            .arg(positions)
            .arg(inv_freq)
            .arg(q_out)
            .arg(k_cache)
            .arg(v_cache)
            .arg(&width)
            .arg(&heads)
            .arg(&kv_heads)
            .arg(&head_dim)
            .arg(&capacity)
            .arg(&col0);
        match step_scalars {
            Some(scalars) => launch.arg(scalars),
            None => launch.arg(&NULL),
        };
        // SAFETY: sizes asserted above; the cache column col0 + i < capacity (with
        // `step_scalars`, the caller checks each step's column before it replays the launch).
        unsafe { launch.launch(Self::rows_config(s.rows(), 128)) }?;
        Ok(())
    }

    /// Qwen3's per-head q/k RMSNorm, in place in the fused `[rows, (heads + 2 * kv_heads) *
    /// head_dim]` f32 projection (see `head_rms_norm` in kernels/llama.cu).
    #[allow(clippy::too_many_arguments)]
    pub fn head_rms_norm(
        &self,
        qkv: &mut CudaSlice<f32>,
        q_norm: &CudaSlice<u16>,
        k_norm: &CudaSlice<u16>,
        rows: usize,
        heads: usize,
        kv_heads: usize,
        head_dim: usize,
        eps: f32,
    ) -> Result<(), CudaError> {
        assert!(
            head_dim.is_multiple_of(32) && head_dim <= 256,
            "head_dim {head_dim}"
        );
        assert!(qkv.len() >= rows * (heads + 2 * kv_heads) * head_dim);
        assert!(q_norm.len() >= head_dim && k_norm.len() >= head_dim);
        let (heads_i, kv_i, dim_i) = (heads as i32, kv_heads as i32, head_dim as i32);
        let mut launch = self.stream.launch_builder(&self.kernels.head_rms_norm);
        launch
            .arg(qkv)
            .arg(q_norm)
            .arg(k_norm)
            .arg(&heads_i)
            .arg(&kv_i)
            .arg(&dim_i)
            .arg(&eps);
        let cfg = LaunchConfig {
            grid_dim: (rows as u32, (heads + kv_heads) as u32, 1),
            block_dim: (head_dim as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: sizes asserted above; one thread per element of a head.
        unsafe { launch.launch(cfg) }?;
        Ok(())
    }

    /// Expands a step's compact mask parts (already on the device: `valid [batch, used]`,
    /// `sees [rows, width]`, `real [rows]`) into the `[rows, used + width]` additive mask the
    /// attention kernel reads, `used` as `columns` gives it. See `build_mask` in
    /// kernels/llama.cu.
    pub fn build_mask(
        &self,
        valid: &CudaView<'_, u8>,
        sees: &CudaView<'_, u8>,
        real: &CudaView<'_, u8>,
        mask: &mut CudaSlice<f32>,
        (rows, width): (usize, usize),
        columns: MaskColumns<'_>,
    ) -> Result<(), CudaError> {
        assert!(rows.is_multiple_of(width.max(1)));
        assert!(sees.len() >= rows * width && real.len() >= rows);
        let batch = rows / width.max(1);
        let (used, scalars) = match columns {
            MaskColumns::Used(used) => {
                assert!(valid.len() >= batch * used && mask.len() >= rows * (used + width));
                (used, None)
            }
            MaskColumns::FromScalars { scalars, capacity } => {
                assert!(valid.len() >= batch * capacity.saturating_sub(width));
                assert!(mask.len() >= rows * capacity && scalars.len() >= 2);
                (0, Some(scalars))
            }
        };
        let total = used + width;
        let (width_i, used_i, total_i) = (width as i32, used as i32, total as i32);
        let mut launch = self.stream.launch_builder(&self.kernels.build_mask);
        launch
            .arg(valid)
            .arg(sees)
            .arg(real)
            .arg(mask)
            .arg(&width_i)
            .arg(&used_i)
            .arg(&total_i);
        match scalars {
            Some(s) => launch.arg(s),
            None => launch.arg(&NULL),
        };
        // SAFETY: signature (const u8*, const u8*, const u8*, f32*, int, int, int, const int*
        // or null); one block per mask row, threads stride its `total` columns; sizes asserted
        // above (with scalars, for the largest step the buffers take).
        unsafe { launch.launch(Self::rows_config(rows, 256)) }?;
        Ok(())
    }

    /// Masked GQA attention of a step's queries over the cache (`mask` is `[rows, total]`).
    /// With `visible` (`list` and `counts` from [`Gpu::visible_columns`]) every row's keys are
    /// grouped by their order among its visible keys, so a row's output has the same bits
    /// whatever else the step holds and wherever its keys sit in the cache
    /// (`attention_invariant` in kernels/llama.cu; head_dim 32, 64, 128 or 256); without, the
    /// plain kernel (`attention`; head_dim a multiple of 32 up to 256).
    #[allow(clippy::too_many_arguments)]
    pub fn attention(
        &self,
        q: &CudaSlice<f32>,
        k_cache: &CudaSlice<u16>,
        v_cache: &CudaSlice<u16>,
        mask: &CudaSlice<f32>,
        visible: Option<(&CudaView<'_, i32>, &CudaView<'_, i32>)>,
        out: &mut CudaSlice<u16>,
        shape: AttentionShape,
        total: usize,
        step_scalars: Option<&CudaView<'_, i32>>,
    ) -> Result<(), CudaError> {
        let s = shape;
        let head_dim_ok = match visible {
            Some(_) => [32, 64, 128, 256].contains(&s.head_dim),
            None => s.head_dim.is_multiple_of(32) && s.head_dim <= 256,
        };
        assert!(head_dim_ok, "head_dim {}", s.head_dim);
        assert!(s.heads.is_multiple_of(s.kv_heads) && total <= s.capacity);
        assert!(
            q.len() >= s.rows() * s.heads * s.head_dim
                && out.len() >= s.rows() * s.heads * s.head_dim
        );
        assert!(mask.len() >= s.rows() * total);
        assert!(k_cache.len() >= s.batch * s.kv_heads * s.capacity * s.head_dim);
        if visible.is_none()
            && let Some(kernels) = self.mma_attention_for(&s)
        {
            return self.attention_mma(
                kernels,
                q,
                k_cache,
                v_cache,
                mask,
                out,
                s,
                total,
                step_scalars,
            );
        }
        let mut args = KernelArgs::default()
            .buffer(self, q)
            .buffer(self, k_cache)
            .buffer(self, v_cache)
            .buffer(self, mask);
        if let Some((list, counts)) = visible {
            assert!(list.len() >= s.rows() * s.capacity && counts.len() >= s.rows());
            args = args.view(self, list).view(self, counts);
        }
        let args = args
            .buffer(self, out)
            .int(s.width)
            .int(s.heads)
            .int(s.kv_heads)
            .int(s.head_dim)
            .int(s.capacity)
            .int(total)
            .float(1.0 / (s.head_dim as f32).sqrt())
            .optional_view(self, step_scalars);
        let warps = ATTENTION_THREADS / 32;
        let head_dim = s.head_dim as u32;
        let cfg = LaunchConfig {
            // Block r * heads + h: a KV head's query heads run as neighbours (kernels/llama.cu).
            grid_dim: (
                u32::try_from(s.rows() * s.heads).expect("rows x heads fit a grid dimension"),
                1,
                1,
            ),
            block_dim: (ATTENTION_THREADS, 1, 1),
            // `attention_invariant`: one partial (head_dim + 2 floats) per warp and the query;
            // `attention`: (warps + 1) * head_dim floats.
            shared_mem_bytes: match visible {
                Some(_) => (warps * (head_dim + 2) + head_dim) * 4,
                None => (warps + 1) * head_dim * 4,
            },
        };
        // SAFETY: the argument list matches the kernel's signature (q, caches, mask, [list,
        // counts,] out, seven scalars, step scalars); sizes asserted above; dynamic shared memory
        // as each kernel declares; the caches are whole allocations, so key rows are 16-byte
        // aligned (head_dim % 32 == 0); lists hold columns below `total`; both kernels wait
        // (PDL_WAIT) before reading anything.
        unsafe {
            match visible {
                Some(_) if self.attention_pdl => {
                    self.launch_programmatic(&self.kernels.attention_invariant, cfg, args, s.rows())
                }
                Some(_) => self.launch_ex(&self.kernels.attention_invariant, cfg, args, None),
                None => self.launch_programmatic(&self.kernels.attention, cfg, args, s.rows()),
            }
        }
    }

    /// Each row's visible cache columns in order (`list`, `[rows, capacity]`) and their number
    /// (`counts`, `[rows]`), from the step's mask: what [`Gpu::attention`] reads with `visible`
    /// (see `visible_columns` in kernels/llama.cu).
    #[allow(clippy::too_many_arguments)]
    pub fn visible_columns(
        &self,
        mask: &CudaSlice<f32>,
        list: &CudaView<'_, i32>,
        counts: &CudaView<'_, i32>,
        rows: usize,
        total: usize,
        capacity: usize,
        step_scalars: Option<&CudaView<'_, i32>>,
    ) -> Result<(), CudaError> {
        assert!(total <= capacity && mask.len() >= rows * total);
        assert!(list.len() >= rows * capacity && counts.len() >= rows);
        let args = KernelArgs::default()
            .buffer(self, mask)
            .view(self, list)
            .view(self, counts)
            .int(total)
            .int(capacity)
            .optional_view(self, step_scalars);
        let cfg = LaunchConfig {
            grid_dim: (rows as u32, 1, 1),
            block_dim: (32, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: the signature of `visible_columns`; sizes asserted (with `step_scalars` the
        // caller sized the mask and list for the capacity).
        unsafe { self.launch_ex(&self.kernels.visible_columns, cfg, args, None) }
    }

    /// Launches `func` on the stream with the programmatic-stream-serialization attribute (when
    /// `TANDEM_CUDA_PDL=1`, or `TANDEM_CUDA_PDL_ROWS=N` and a launch of at most N rows, on an
    /// sm_90+ GPU; the row cap goes by the launch's rows, so a wide step's logits of `batch`
    /// rows may take it): the kernel may start while the one before it
    /// still runs, and waits for it with `PDL_WAIT` (kernels/common.cuh) before reading its outputs, so a small
    /// step's weight loads and launch overlap the previous kernel. CUDA graphs capture the
    /// relaxed dependency. Only kernels that call `PDL_WAIT` before touching anything their
    /// predecessor writes may be launched this way.
    ///
    /// # Safety
    /// `args` must match the kernel's parameter list (types, order, buffer sizes).
    unsafe fn launch_programmatic(
        &self,
        func: &CudaFunction,
        cfg: LaunchConfig,
        args: KernelArgs,
        rows: usize,
    ) -> Result<(), CudaError> {
        // SAFETY: forwarded from the caller; a cluster of one block is a plain launch.
        unsafe { self.launch_programmatic_clusters(func, cfg, args, rows, 1) }
    }

    /// [`Gpu::launch_programmatic`] for a grid of thread-block clusters of `cluster` blocks
    /// along x (sm_90; `cluster` 1 is a plain launch).
    ///
    /// # Safety
    /// As [`Gpu::launch_programmatic`]; the grid's x a multiple of `cluster`, and a cluster's
    /// blocks fit the GPU at once (at most 8, the portable size, with the block's resources).
    unsafe fn launch_programmatic_clusters(
        &self,
        func: &CudaFunction,
        cfg: LaunchConfig,
        args: KernelArgs,
        rows: usize,
        cluster: u32,
    ) -> Result<(), CudaError> {
        use cudarc::driver::sys;
        assert!(cluster >= 1 && cfg.grid_dim.0.is_multiple_of(cluster));
        let mut attributes = Vec::with_capacity(2);
        if self.programmatic && rows <= self.pdl_rows {
            // SAFETY: a plain C struct for which all-zero bytes are a valid value.
            let mut attribute: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
            attribute.id =
                sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
            attribute.value.programmaticStreamSerializationAllowed = 1;
            attributes.push(attribute);
        }
        if cluster > 1 {
            // SAFETY: as above.
            let mut attribute: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
            attribute.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
            attribute.value.clusterDim.x = cluster;
            attribute.value.clusterDim.y = 1;
            attribute.value.clusterDim.z = 1;
            attributes.push(attribute);
        }
        // SAFETY: forwarded from the caller.
        unsafe { self.launch_with_attributes(func, cfg, args, &mut attributes) }
    }

    /// Launches `func` on the stream through `cuLaunchKernelEx` with one optional launch
    /// attribute.
    ///
    /// # Safety
    /// `args` must match the kernel's parameter list (types, order, buffer sizes).
    unsafe fn launch_ex(
        &self,
        func: &CudaFunction,
        cfg: LaunchConfig,
        args: KernelArgs,
        attribute: Option<cudarc::driver::sys::CUlaunchAttribute>,
    ) -> Result<(), CudaError> {
        let mut attributes: Vec<_> = attribute.into_iter().collect();
        // SAFETY: forwarded from the caller.
        unsafe { self.launch_with_attributes(func, cfg, args, &mut attributes) }
    }

    /// Launches `func` on the stream through `cuLaunchKernelEx` with `attributes`.
    ///
    /// # Safety
    /// `args` must match the kernel's parameter list (types, order, buffer sizes), and the
    /// attributes be ones the kernel and the GPU take.
    unsafe fn launch_with_attributes(
        &self,
        func: &CudaFunction,
        cfg: LaunchConfig,
        args: KernelArgs,
        attributes: &mut [cudarc::driver::sys::CUlaunchAttribute],
    ) -> Result<(), CudaError> {
        use cudarc::driver::sys;
        let mut slots = args.0;
        let mut params: Vec<*mut std::ffi::c_void> = slots
            .iter_mut()
            .map(|slot| (slot as *mut u64).cast())
            .collect();
        let config = sys::CUlaunchConfig {
            gridDimX: cfg.grid_dim.0,
            gridDimY: cfg.grid_dim.1,
            gridDimZ: cfg.grid_dim.2,
            blockDimX: cfg.block_dim.0,
            blockDimY: cfg.block_dim.1,
            blockDimZ: cfg.block_dim.2,
            sharedMemBytes: cfg.shared_mem_bytes,
            hStream: self.stream.cu_stream(),
            attrs: if attributes.is_empty() {
                std::ptr::null_mut()
            } else {
                attributes.as_mut_ptr()
            },
            numAttrs: u32::try_from(attributes.len()).expect("a few attributes"),
        };
        self.ctx.bind_to_thread()?;
        // SAFETY: `params` points at one 8-byte slot per kernel parameter (the caller matched
        // them to the signature) and `attrs` at `numAttrs` attributes, alive until the call
        // returns; the function belongs to this context and the stream to this GPU.
        unsafe {
            sys::cuLaunchKernelEx(
                &config,
                func.cu_function(),
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        }
        .result()?;
        Ok(())
    }

    /// `{name}_r{R}_o{N}` for row buckets 1, 2, 4, 8 and 1, 2, 4 outputs a warp.
    fn gemv_kernels(
        module: &Arc<CudaModule>,
        name: &str,
    ) -> Result<[[CudaFunction; 3]; 4], CudaError> {
        let load = |rows: usize| -> Result<[CudaFunction; 3], CudaError> {
            Ok([
                module.load_function(&format!("{name}_r{rows}_o1"))?,
                module.load_function(&format!("{name}_r{rows}_o2"))?,
                module.load_function(&format!("{name}_r{rows}_o4"))?,
            ])
        };
        Ok([load(1)?, load(2)?, load(4)?, load(8)?])
    }

    fn gemv_config(units: usize, shared_bytes: usize) -> LaunchConfig {
        let warps = (GEMV_THREADS / 32) as usize;
        LaunchConfig {
            grid_dim: (units.div_ceil(warps) as u32, 1, 1),
            block_dim: (GEMV_THREADS, 1, 1),
            shared_mem_bytes: shared_bytes as u32,
        }
    }

    /// Whether the fused small-step kernels take `rows` rows of these widths: at most
    /// [`GEMV_MAX_ROWS`], every width a multiple of 8 (16-byte vectors), and the normed input
    /// rows within [`GEMV_MAX_SHARED_BYTES`].
    pub fn gemv_fits(rows: usize, hidden: usize, widths: &[usize]) -> bool {
        (1..=GEMV_MAX_ROWS).contains(&rows)
            && rows * hidden * 2 <= GEMV_MAX_SHARED_BYTES
            && std::iter::once(hidden)
                .chain(widths.iter().copied())
                .all(|w| w.is_multiple_of(8))
    }

    /// [`Gpu::gemv_fits`] for the family a product takes: on the CUDA cores as it is, on the
    /// tensor cores up to [`MMA_MAX_ROWS`] rows, a block staging its row group's (at most
    /// [`GEMV_MAX_ROWS`]).
    fn small_step_fits(tensor_cores: bool, rows: usize, hidden: usize, widths: &[usize]) -> bool {
        let most = if tensor_cores {
            MMA_MAX_ROWS
        } else {
            GEMV_MAX_ROWS
        };
        rows <= most && Self::gemv_fits(block_rows(tensor_cores, rows), hidden, widths)
    }

    /// Most rows of a fused step of a decoder of these widths (the target's: one staged input):
    /// [`MMA_MAX_ROWS`] when the tensor-core kernels are on and take every product of its
    /// layers and its logits (a product they refuse falls back to a CUDA-core kernel, which
    /// takes [`GEMV_MAX_ROWS`]), [`GEMV_MAX_ROWS`] otherwise.
    pub fn fused_max_rows(&self, hidden: usize, q_dim: usize, inter: usize) -> usize {
        let all_mma = self.mma_rows_for(hidden, 1).is_some()
            && self.mma_rows_for(hidden, 0).is_some()
            && self.mma_rows_for(q_dim, 0).is_some()
            && self.mma_rows_for(inter, 0).is_some();
        if all_mma { MMA_MAX_ROWS } else { GEMV_MAX_ROWS }
    }

    /// Whether the fused small-step kernels take a decoder layer of these dimensions at `rows`
    /// rows, with `inputs` normed inputs staged per row (the target one, the draft head two).
    pub(crate) fn fused_layer_fits(
        rows: usize,
        inputs: usize,
        hidden: usize,
        heads: usize,
        kv_heads: usize,
        head_dim: usize,
        inter: usize,
    ) -> bool {
        let q_dim = heads * head_dim;
        let qkv_dim = q_dim + 2 * kv_heads * head_dim;
        inputs * rows * hidden * 2 <= GEMV_MAX_SHARED_BYTES
            && Self::gemv_fits(rows, hidden, &[q_dim, qkv_dim, inter])
    }

    /// `y[rows, out] = x[rows, inp] . w[out, inp]^T` (or `y +=` with `accumulate`) for at most
    /// [`GEMV_MAX_ROWS`] rows: see `gemv_rows` in kernels/llama.cu.
    #[allow(clippy::too_many_arguments)]
    pub fn gemv_rows(
        &self,
        x: &CudaSlice<u16>,
        w: &CudaSlice<u16>,
        y: &mut CudaSlice<f32>,
        rows: usize,
        inp: usize,
        out: usize,
        accumulate: bool,
    ) -> Result<(), CudaError> {
        self.gemv_rows_tapped(x, w, y, None, rows, inp, out, accumulate)
    }

    /// [`Gpu::gemv_rows`] that also leaves `y`'s first `rows * out` values in `tap` (a capture
    /// slot). The tensor-core kernel writes both from one launch (no copy node in the step's
    /// graph, which would also end its chain of dependent launches); the CUDA-core kernels
    /// copy after the product. Either way `tap` gets `y`'s bits.
    #[allow(clippy::too_many_arguments)]
    pub fn gemv_rows_tapped(
        &self,
        x: &CudaSlice<u16>,
        w: &CudaSlice<u16>,
        y: &mut CudaSlice<f32>,
        tap: Option<&mut CudaSlice<f32>>,
        rows: usize,
        inp: usize,
        out: usize,
        accumulate: bool,
    ) -> Result<(), CudaError> {
        assert!(
            tap.as_ref().is_none_or(|t| t.len() >= rows * out),
            "tap of {rows} x {out}"
        );
        if let Some(mma) = self.mma_rows_for(inp, 0) {
            assert!(
                Self::small_step_fits(true, rows, 8, &[inp]),
                "gemv of {rows} x {inp}"
            );
            assert!(x.len() >= rows * inp && w.len() >= out * inp && y.len() >= rows * out);
            let args = KernelArgs::default()
                .buffer(self, x)
                .buffer(self, w)
                .buffer(self, y)
                .optional(self, tap.as_deref())
                .int(rows)
                .int(inp)
                .int(out)
                .int(usize::from(accumulate));
            let cfg = mma.config(out.div_ceil(16), inp, 0, rows);
            // SAFETY: signature (u16*, u16*, f32*, f32* or null, int, int, int, int) of
            // `gemv_rows_mma`; sizes asserted (the tap's too); inp a multiple of 32
            // (`mma_rows::takes`), so every 16-byte load is aligned; outputs past `out` load a
            // valid row and write nothing; a block row per row group, each within `rows`;
            // PDL_WAIT before reading x or y.
            return unsafe {
                self.launch_programmatic(&mma.gemv_rows, cfg, args, group_rows(rows))
            };
        }
        let bucket = gemv_bucket(rows);
        let outputs = self.gemv_outputs[bucket.trailing_zeros() as usize];
        self.gemv_rows_by(x, w, y, rows, inp, out, accumulate, bucket, outputs)?;
        match tap {
            Some(tap) => self.copy_into(y, tap, rows * out),
            None => Ok(()),
        }
    }

    /// [`Gpu::gemv_rows`] with the kernel of row bucket `bucket` (1, 2, 4 or 8, at least
    /// `rows`) and `outputs` (1, 2 or 4) outputs a warp instead of the defaults: the same bits
    /// whichever it is (a GPU test holds it to that).
    #[allow(clippy::too_many_arguments)]
    pub fn gemv_rows_by(
        &self,
        x: &CudaSlice<u16>,
        w: &CudaSlice<u16>,
        y: &mut CudaSlice<f32>,
        rows: usize,
        inp: usize,
        out: usize,
        accumulate: bool,
        bucket: usize,
        outputs: usize,
    ) -> Result<(), CudaError> {
        assert!(Self::gemv_fits(rows, 8, &[inp]), "gemv of {rows} x {inp}");
        assert!(x.len() >= rows * inp && w.len() >= out * inp && y.len() >= rows * out);
        assert!(
            bucket.is_power_of_two() && (rows..=GEMV_MAX_ROWS).contains(&bucket),
            "row bucket {bucket} for {rows} rows"
        );
        let split = gemv_split(out);
        assert!([1, 2, 4].contains(&outputs), "{outputs} outputs a warp");
        let func = &self.kernels.gemv_rows[bucket.trailing_zeros() as usize]
            [outputs.trailing_zeros() as usize];
        let args = KernelArgs::default()
            .buffer(self, x)
            .buffer(self, w)
            .buffer(self, y)
            .int(rows)
            .int(inp)
            .int(out)
            .int(usize::from(accumulate))
            .int(split);
        let cfg = Self::gemv_rows_config(out, split, outputs, 0);
        // SAFETY: signature (u16*, u16*, f32*, int, int, int, int, int); sizes asserted; rows of
        // x and w start on 16-byte boundaries (whole allocations, inp a multiple of 8); `split`
        // divides the block's four warps; outputs past `out` are guarded in the kernel, which
        // waits (PDL_WAIT) before reading x or y.
        unsafe { self.launch_programmatic(func, cfg, args, rows) }
    }

    /// The grid of a `gemv_rows`-family kernel: `out` outputs, `split` warps sharing an output
    /// and `outputs` outputs a warp, blocks of [`GEMV_THREADS`].
    fn gemv_rows_config(
        out: usize,
        split: usize,
        outputs: usize,
        shared_bytes: usize,
    ) -> LaunchConfig {
        let per_block = (GEMV_THREADS as usize / 32) / split * outputs;
        LaunchConfig {
            grid_dim: (out.div_ceil(per_block) as u32, 1, 1),
            block_dim: (GEMV_THREADS, 1, 1),
            shared_mem_bytes: shared_bytes as u32,
        }
    }

    /// `y[rows, out] = (rms_norm(x[r]) * norm_w) . w[out, inp]^T`, the normed rows rounded to
    /// bf16 as the fused kernels stage them (a one-warp sum of squares: a value may differ in
    /// the last bit from [`Gpu::add_rms_norm`]'s): a final norm and [`Gpu::gemv_rows`] in one
    /// launch (`gemv_norm_rows` in kernels/llama.cu), for at most [`GEMV_MAX_ROWS`] rows. The
    /// same row bucket, outputs a warp and split as `gemv_rows`, so a row's bits do not depend
    /// on the step's width either.
    #[allow(clippy::too_many_arguments)]
    pub fn gemv_norm_rows(
        &self,
        x: &CudaSlice<f32>,
        norm_w: &CudaSlice<u16>,
        w: &CudaSlice<u16>,
        y: &mut CudaSlice<f32>,
        rows: usize,
        inp: usize,
        out: usize,
        eps: f32,
    ) -> Result<(), CudaError> {
        let mma = self.mma_rows_for(inp, 1);
        assert!(
            Self::small_step_fits(mma.is_some(), rows, inp, &[]),
            "normed gemv of {rows} x {inp}"
        );
        assert!(x.len() >= rows * inp && norm_w.len() >= inp);
        assert!(w.len() >= out * inp && y.len() >= rows * out);
        if let Some(mma) = mma {
            let args = KernelArgs::default()
                .buffer(self, x)
                .buffer(self, norm_w)
                .buffer(self, w)
                .buffer(self, y)
                .int(rows)
                .int(inp)
                .int(out)
                .float(eps);
            let cfg = mma.config(out.div_ceil(16), inp, group_rows(rows) * inp * 2, rows);
            // SAFETY: signature (f32*, u16*, u16*, f32*, int, int, int, float) of
            // `gemv_norm_rows_mma`; sizes asserted; a row group's staged rows and the partial
            // tiles fit the block's shared memory (`mma_rows::takes`); PDL_WAIT before reading x.
            return unsafe {
                self.launch_programmatic(&mma.gemv_norm_rows, cfg, args, group_rows(rows))
            };
        }
        let bucket = gemv_bucket(rows);
        let outputs = self.gemv_outputs[bucket.trailing_zeros() as usize];
        let split = gemv_split(out);
        let func = &self.kernels.gemv_norm_rows[bucket.trailing_zeros() as usize]
            [outputs.trailing_zeros() as usize];
        let args = KernelArgs::default()
            .buffer(self, x)
            .buffer(self, norm_w)
            .buffer(self, w)
            .buffer(self, y)
            .int(rows)
            .int(inp)
            .int(out)
            .int(split)
            .float(eps);
        let cfg = Self::gemv_rows_config(out, split, outputs, rows * inp * 2);
        // SAFETY: signature (f32*, u16*, u16*, f32*, int, int, int, int, float); sizes
        // asserted; dynamic shared memory holds rows * inp bf16 (within GEMV_MAX_SHARED_BYTES
        // by gemv_fits); rows of w start on 16-byte boundaries (inp a multiple of 8); the
        // kernel waits (PDL_WAIT) before reading x.
        unsafe { self.launch_programmatic(func, cfg, args, rows) }
    }

    /// `act[r, j] = silu(gate) * up` of the gate|up projection of `rms_norm(x[r]) * norm_w`
    /// (see `norm_gate_up_silu` in kernels/llama.cu).
    #[allow(clippy::too_many_arguments)]
    pub fn norm_gate_up_silu(
        &self,
        x: &CudaSlice<f32>,
        norm_w: &CudaSlice<u16>,
        w: &CudaSlice<u16>,
        act: &mut CudaSlice<u16>,
        rows: usize,
        hidden: usize,
        inter: usize,
        eps: f32,
    ) -> Result<(), CudaError> {
        let mma = self.mma_rows_for(hidden, 1);
        assert!(Self::small_step_fits(mma.is_some(), rows, hidden, &[inter]));
        let staged = block_rows(mma.is_some(), rows) * hidden * 2;
        assert!(x.len() >= rows * hidden && norm_w.len() >= hidden);
        assert!(w.len() >= 2 * inter * hidden && act.len() >= rows * inter);
        let args = KernelArgs::default()
            .buffer(self, x)
            .buffer(self, norm_w)
            .buffer(self, w)
            .buffer(self, act)
            .int(rows)
            .int(hidden)
            .int(inter)
            .float(eps);
        let (func, cfg) = match mma {
            Some(mma) => (
                &mma.norm_gate_up_silu,
                mma.config(inter.div_ceil(8), hidden, staged, rows),
            ),
            None => (
                &self.kernels.norm_gate_up_silu,
                Self::gemv_config(inter, staged),
            ),
        };
        // SAFETY: signature (f32*, u16*, u16*, u16*, int, int, int, float) of
        // `norm_gate_up_silu` and `norm_gate_up_silu_mma`; sizes asserted; dynamic shared
        // memory holds a block's rows (the step's, or its row group's) * hidden bf16 (beside
        // the partial tiles: `mma_rows::takes`); PDL_WAIT before reading x.
        unsafe { self.launch_programmatic(func, cfg, args, group_rows(rows)) }
    }

    /// q|k|v of `rms_norm(x[r]) * norm_w`, the bias, RoPE and the cache write in one launch: what
    /// [`Gpu::add_rms_norm`], [`Gpu::linear`] and [`Gpu::rope_qkv`] do for a small step (see
    /// `norm_qkv_rope` in kernels/llama.cu). `second`: another input `(x2, norm_w2, w2)` whose
    /// normed rows go through their own weight into the same projection (the draft head). `x`:
    /// f32 rows (a target layer's residual stream), or the embedding rows of the step's tokens
    /// read straight from the table (the head's attention input, which nothing else reads: no
    /// `embed_rows` launch).
    #[allow(clippy::too_many_arguments)]
    pub fn norm_qkv_rope(
        &self,
        x: QkvInput<'_, '_>,
        norm_w: &CudaSlice<u16>,
        w: &CudaSlice<u16>,
        second: Option<(&CudaSlice<f32>, &CudaSlice<u16>, &CudaSlice<u16>)>,
        bias: Option<&CudaSlice<f32>>,
        positions: &CudaView<'_, i32>,
        inv_freq: &CudaSlice<f32>,
        q_out: &mut CudaSlice<f32>,
        k_cache: &mut CudaSlice<u16>,
        v_cache: &mut CudaSlice<u16>,
        shape: AttentionShape,
        hidden: usize,
        col0: usize,
        step_scalars: Option<&CudaView<'_, i32>>,
        eps: f32,
    ) -> Result<(), CudaError> {
        let s = shape;
        let rows = s.rows();
        let q_dim = s.heads * s.head_dim;
        let kv_dim = s.kv_heads * s.head_dim;
        let qkv_dim = q_dim + 2 * kv_dim;
        let inputs = if second.is_some() { 2 } else { 1 };
        let mma = self.mma_rows_for(hidden, inputs);
        assert!(
            Self::small_step_fits(mma.is_some(), rows, hidden, &[qkv_dim])
                && s.head_dim.is_multiple_of(2)
        );
        assert!(norm_w.len() >= hidden && w.len() >= qkv_dim * hidden);
        let (rows_in, embed) = match x {
            QkvInput::Rows(x) => {
                assert!(x.len() >= rows * hidden);
                (Some(x), None)
            }
            QkvInput::Embedding { table, tokens } => {
                // Token ids were checked against the vocabulary on the host.
                assert!(table.len().is_multiple_of(hidden) && tokens.len() >= rows);
                (None, Some((table, tokens)))
            }
        };
        assert!(bias.is_none_or(|b| b.len() >= qkv_dim));
        assert!(positions.len() >= rows && inv_freq.len() >= s.head_dim / 2);
        assert!(q_out.len() >= rows * q_dim && col0 + s.width <= s.capacity);
        assert!(k_cache.len() >= s.batch * kv_dim * s.capacity && v_cache.len() == k_cache.len());
        if let Some((x2, norm_w2, w2)) = second {
            assert!(x2.len() >= rows * hidden && norm_w2.len() >= hidden);
            assert!(w2.len() >= qkv_dim * hidden);
        }
        let pairs = (s.heads + 2 * s.kv_heads) * s.head_dim / 2;
        let block_rows = block_rows(mma.is_some(), rows);
        assert!(inputs * block_rows * hidden * 2 <= GEMV_MAX_SHARED_BYTES);
        let args = KernelArgs::default()
            .optional(self, rows_in)
            .buffer(self, norm_w)
            .buffer(self, w)
            .optional(self, second.map(|(x2, _, _)| x2))
            .optional(self, second.map(|(_, n, _)| n))
            .optional(self, second.map(|(_, _, w2)| w2))
            .optional(self, bias)
            .view(self, positions)
            .buffer(self, inv_freq)
            .buffer(self, q_out)
            .buffer(self, k_cache)
            .buffer(self, v_cache)
            .int(rows)
            .int(hidden)
            .int(s.width)
            .int(s.heads)
            .int(s.kv_heads)
            .int(s.head_dim)
            .int(s.capacity)
            .int(col0)
            .optional_view(self, step_scalars)
            .float(eps)
            .optional(self, embed.map(|(table, _)| table))
            .optional_view(self, embed.map(|(_, tokens)| tokens));
        let shared = inputs * block_rows * hidden * 2;
        let (func, cfg) = match mma {
            Some(mma) => (
                &mma.norm_qkv_rope,
                mma.config(pairs.div_ceil(8), inputs * hidden, shared, rows),
            ),
            None => (
                &self.kernels.norm_qkv_rope,
                Self::gemv_config(pairs, shared),
            ),
        };
        // SAFETY: the signature of `norm_qkv_rope` (which `norm_qkv_rope_mma` shares); sizes
        // asserted; dynamic shared memory holds `inputs` * a block's rows * hidden bf16 (beside
        // the partial tiles: `mma_rows::takes`); cache columns as in `rope_qkv` (with
        // `step_scalars`, the caller checks each step's column); PDL_WAIT before reading any
        // input but the weights.
        unsafe { self.launch_programmatic(func, cfg, args, block_rows) }
    }

    /// Dynamic shared memory of `persistent_step` at `rows` rows: the staged bf16 normed rows,
    /// then one attention partial per warp and a query (f32).
    pub fn persistent_shared_bytes(rows: usize, hidden: usize, head_dim: usize) -> usize {
        rows * hidden * 2 + (PERSISTENT_WARPS * (head_dim + 2) + head_dim) * 4
    }

    /// Entries of the persistent step's profile (`TANDEM_CUDA_PERSISTENT_PROFILE=1`): block 0's
    /// clock at the arrival at and release from each of its `5 * layers + 1` barriers, then at
    /// its end.
    pub fn persistent_profile_len(layers: usize) -> usize {
        2 * (5 * layers + 1) + 1
    }

    /// Whether `persistent_step` takes a step of `rows` rows of a model of these dimensions
    /// of `layers` layers with `tap_slots` taps: the fused kernels' limits (rows, 16-byte vectors), head_dim 32,
    /// 64, 128 or 256 (a lane's share of a value row is one vector), and its shared memory
    /// within the default 48 KiB.
    pub(crate) fn persistent_fits(
        layers: usize,
        rows: usize,
        hidden: usize,
        [heads, kv_heads, head_dim]: [usize; 3],
        inter: usize,
        tap_slots: usize,
    ) -> bool {
        Self::fused_layer_fits(rows, 1, hidden, heads, kv_heads, head_dim, inter)
            && [32, 64, 128, 256].contains(&head_dim)
            && tap_slots <= PERSISTENT_MAX_TAPS
            && layers <= PERSISTENT_MAX_LAYERS
            && Self::persistent_shared_bytes(rows, hidden, head_dim)
                + PERSISTENT_STATIC_SHARED_BYTES
                <= GEMV_MAX_SHARED_BYTES
    }

    /// Registers per thread and local (spilled) bytes per thread of the persistent step as the
    /// driver compiled it, the SMs it runs one block on and the warps of that block: what
    /// `fast-bench` prints next to its times.
    pub fn persistent_resources(&self) -> Result<(i32, i32, usize, usize), CudaError> {
        use cudarc::driver::sys::CUfunction_attribute_enum as Attr;
        let f = &self.kernels.persistent_step;
        Ok((
            f.num_regs()?,
            f.get_attribute(Attr::CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES)?,
            self.sm_count,
            self.persistent_warps,
        ))
    }

    /// A whole step of at most [`GEMV_MAX_ROWS`] rows in one launch: see `persistent_step` in
    /// kernels/llama.cu. One block per SM, launched cooperatively (every block resident, which
    /// the kernel's grid barriers need) unless `TANDEM_CUDA_COOPERATIVE=0`.
    pub(crate) fn persistent_step(&self, step: PersistentStep<'_>) -> Result<(), CudaError> {
        let s = step.shape;
        let rows = s.rows();
        let q_dim = s.heads * s.head_dim;
        let qkv_dim = q_dim + 2 * s.kv_heads * s.head_dim;
        let (h, inter, vocab) = (step.hidden_size, step.inter, step.vocab);
        assert!(Self::persistent_fits(
            step.layers,
            rows,
            h,
            [s.heads, s.kv_heads, s.head_dim],
            inter,
            step.tap_slots
        ));
        assert!(s.heads.is_multiple_of(s.kv_heads) && step.total <= s.capacity);
        assert!(step.col0 + s.width <= s.capacity);
        assert!(step.table.len() >= step.layers * PERSISTENT_TABLE_WORDS + 2 * step.tap_slots);
        assert!(step.tokens.len() >= rows && step.positions.len() >= rows);
        assert!(step.mask.len() >= rows * step.total && step.inv_freq.len() >= s.head_dim / 2);
        assert!(step.hidden.len() >= rows * h && step.q.len() >= rows * q_dim);
        assert!(step.visible.len() >= rows * (s.capacity + 1));
        assert!(step.attn.len() >= rows * q_dim);
        assert!(
            step.profile
                .is_none_or(|p| p.len() >= Self::persistent_profile_len(step.layers))
        );
        assert!(step.act.len() >= rows * inter && step.embed.len() >= vocab * h);
        assert!(step.lm_head.len() >= vocab * h && step.final_norm.len() >= h);
        assert!(qkv_dim.is_multiple_of(2));
        let n_logit_rows = match step.logits {
            Some((logits, n)) => {
                assert!(n <= rows && logits.len() >= n * vocab);
                assert!(step.logit_rows.is_none_or(|l| l.len() >= n));
                n
            }
            None => 0,
        };
        let args = KernelArgs::default()
            .buffer(self, step.table)
            .int(step.tap_slots)
            .buffer(self, step.embed)
            .view(self, step.tokens)
            .view(self, step.positions)
            .buffer(self, step.inv_freq)
            .buffer(self, step.mask)
            .optional_view(self, step.step_scalars)
            .buffer(self, step.final_norm)
            .buffer(self, step.lm_head)
            .optional(self, step.logit_rows)
            .int(n_logit_rows)
            .buffer(self, step.hidden)
            .buffer(self, step.q)
            .buffer(self, step.visible)
            .buffer(self, step.attn)
            .buffer(self, step.act)
            .optional(self, step.logits.map(|(l, _)| l))
            .buffer(self, step.arrived)
            .optional(self, step.profile)
            .int(step.layers)
            .int(rows)
            .int(s.width)
            .int(h)
            .int(s.heads)
            .int(s.kv_heads)
            .int(s.head_dim)
            .int(inter)
            .int(s.capacity)
            .int(step.col0)
            .int(step.total)
            .int(vocab)
            .float(step.eps)
            .float(1.0 / (s.head_dim as f32).sqrt());
        let cfg = LaunchConfig {
            grid_dim: (self.sm_count as u32, 1, 1),
            block_dim: (self.persistent_warps as u32 * 32, 1, 1),
            shared_mem_bytes: Self::persistent_shared_bytes(rows, h, s.head_dim) as u32,
        };
        let attribute = self.cooperative.then(|| {
            use cudarc::driver::sys;
            // SAFETY: a plain C struct for which all-zero bytes are a valid value.
            let mut attribute: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
            attribute.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_COOPERATIVE;
            attribute.value.cooperative = 1;
            attribute
        });
        // SAFETY: the signature of `persistent_step`; sizes asserted above; the table holds
        // `layers` entries of PERSISTENT_TABLE_WORDS device addresses of live buffers of the
        // model and cache, then `tap_slots` (point, address) pairs of live [rows, hidden] f32
        // buffers (built by the model for this step's buffers and cache); dynamic shared memory
        // as the kernel's comment states; one block per SM, so every block is resident.
        unsafe { self.launch_ex(&self.kernels.persistent_step, cfg, args, attribute) }
    }

    /// `out[r, i] = silu(gate_up[r, i]) * gate_up[r, inter + i]`.
    pub fn silu_mul(
        &self,
        gate_up: &CudaSlice<f32>,
        out: &mut CudaSlice<u16>,
        rows: usize,
        inter: usize,
    ) -> Result<(), CudaError> {
        assert!(gate_up.len() >= rows * 2 * inter && out.len() >= rows * inter);
        let (inter_i, rows_i) = (inter as i32, rows as i32);
        let blocks = (rows * inter).div_ceil(256).min(65_535) as u32;
        let mut launch = self.stream.launch_builder(&self.kernels.silu_mul);
        launch.arg(gate_up).arg(out).arg(&inter_i).arg(&rows_i);
        // SAFETY: grid-stride loop bounded by rows * inter; sizes asserted.
        unsafe {
            launch.launch(LaunchConfig {
                grid_dim: (blocks, 1, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            })
        }?;
        Ok(())
    }

    /// `dst[k] = src[rows[k]]` for bf16 rows of `hidden` values.
    pub fn gather_rows(
        &self,
        src: &CudaSlice<u16>,
        rows: &CudaSlice<i32>,
        dst: &mut CudaSlice<u16>,
        count: usize,
        hidden: usize,
    ) -> Result<(), CudaError> {
        assert!(rows.len() >= count && dst.len() >= count * hidden);
        let hidden_i = hidden as i32;
        let mut launch = self.stream.launch_builder(&self.kernels.gather_rows);
        launch.arg(src).arg(rows).arg(dst).arg(&hidden_i);
        // SAFETY: row indices come from the step's own slots (< rows of `src`); sizes asserted.
        unsafe { launch.launch(Self::rows_config(count, 256)) }?;
        Ok(())
    }

    /// `dst[dst_rows[k]] = src[src_rows[k]]` for f32 rows of `hidden` values. The row indices
    /// are views, so that one upload can hold the indices of several calls (a gather from
    /// several sources: `tandem-infer`'s CUDA backend).
    pub fn copy_rows(
        &self,
        src: &CudaSlice<f32>,
        src_rows: &CudaView<'_, i32>,
        dst: &mut CudaSlice<f32>,
        dst_rows: &CudaView<'_, i32>,
        count: usize,
        hidden: usize,
    ) -> Result<(), CudaError> {
        assert!(src_rows.len() >= count && dst_rows.len() >= count);
        if count == 0 {
            return Ok(());
        }
        let hidden_i = hidden as i32;
        let mut launch = self.stream.launch_builder(&self.kernels.copy_rows);
        launch
            .arg(src)
            .arg(src_rows)
            .arg(dst)
            .arg(dst_rows)
            .arg(&hidden_i);
        // SAFETY: callers pass row indices below the row counts of `src` and `dst` (the draft
        // driver builds them from its own node table); index array sizes asserted.
        unsafe { launch.launch(Self::rows_config(count, 256)) }?;
        Ok(())
    }

    /// `dst[dst_rows[k]] = src[src_rows[k]]` for bf16 rows of `width` values (KV-cache moves).
    pub fn copy_rows_u16(
        &self,
        src: &CudaSlice<u16>,
        src_rows: &CudaSlice<i32>,
        dst: &mut CudaSlice<u16>,
        dst_rows: &CudaSlice<i32>,
        count: usize,
        width: usize,
    ) -> Result<(), CudaError> {
        assert!(src_rows.len() >= count && dst_rows.len() >= count);
        if count == 0 {
            return Ok(());
        }
        let width_i = width as i32;
        let mut launch = self.stream.launch_builder(&self.kernels.copy_rows_u16);
        launch
            .arg(src)
            .arg(src_rows)
            .arg(dst)
            .arg(dst_rows)
            .arg(&width_i);
        // SAFETY: the cache moves build the row indices from both caches' shapes
        // (`cache::row_moves`, unit-tested); index array sizes asserted.
        unsafe { launch.launch(Self::rows_config(count, 64)) }?;
        Ok(())
    }

    /// Moves rows `src_rows[k] -> dst_rows[k]` (`width` values each) inside every buffer of
    /// `buffers` (each long enough for every row index, as `copy_rows_u16` asks), all in two
    /// launches through a staging buffer, so sources are read before any destination is
    /// written (moves may overlap: compaction shifts columns within a row).
    pub fn move_rows_u16<'a>(
        &self,
        buffers: impl IntoIterator<Item = &'a mut CudaSlice<u16>>,
        src_rows: &CudaSlice<i32>,
        dst_rows: &CudaSlice<i32>,
        count: usize,
        width: usize,
    ) -> Result<(), CudaError> {
        let buffers: Vec<&'a mut CudaSlice<u16>> = buffers.into_iter().collect();
        let addresses: Vec<u64> = buffers.iter().map(|b| self.address(&**b)).collect();
        self.launch_row_moves(&addresses, &addresses, src_rows, dst_rows, count, width)?;
        drop(buffers);
        Ok(())
    }

    /// Copies rows `sources[i][src_rows[k]] -> destinations[i][dst_rows[k]]` for every pair of
    /// buffers `i` (each long enough for every row index), all in two launches.
    pub fn copy_rows_u16_each<'a>(
        &self,
        pairs: impl IntoIterator<Item = (&'a CudaSlice<u16>, &'a mut CudaSlice<u16>)>,
        src_rows: &CudaSlice<i32>,
        dst_rows: &CudaSlice<i32>,
        count: usize,
        width: usize,
    ) -> Result<(), CudaError> {
        let pairs: Vec<(&'a CudaSlice<u16>, &'a mut CudaSlice<u16>)> = pairs.into_iter().collect();
        let sources: Vec<u64> = pairs.iter().map(|(s, _)| self.address(*s)).collect();
        let destinations: Vec<u64> = pairs.iter().map(|(_, d)| self.address(&**d)).collect();
        self.launch_row_moves(&sources, &destinations, src_rows, dst_rows, count, width)?;
        drop(pairs);
        Ok(())
    }

    /// The two launches of `move_rows_u16` (kernels/llama.cu) over buffer addresses.
    fn launch_row_moves(
        &self,
        sources: &[u64],
        destinations: &[u64],
        src_rows: &CudaSlice<i32>,
        dst_rows: &CudaSlice<i32>,
        count: usize,
        width: usize,
    ) -> Result<(), CudaError> {
        assert!(src_rows.len() >= count && dst_rows.len() >= count);
        assert_eq!(sources.len(), destinations.len());
        if count == 0 || sources.is_empty() {
            return Ok(());
        }
        let (sources_dev, destinations_dev) = (self.upload(sources)?, self.upload(destinations)?);
        let mut staging = self.scratch::<u16>(sources.len() * count * width)?;
        let (count_i, width_i) = (count as i32, width as i32);
        for phase in [0i32, 1] {
            let mut launch = self.stream.launch_builder(&self.kernels.move_rows_u16);
            launch
                .arg(&sources_dev)
                .arg(&destinations_dev)
                .arg(src_rows)
                .arg(dst_rows)
                .arg(&mut staging)
                .arg(&count_i)
                .arg(&width_i)
                .arg(&phase);
            let cfg = LaunchConfig {
                grid_dim: (count as u32, sources.len() as u32, 1),
                block_dim: (64, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: the addresses are of live buffers of this stream, which the public
            // wrappers borrow (destinations mutably) until the launches are queued (stream order
            // keeps later work behind them); the row indices come from the cache's moves
            // (`ColumnMoves::head_rows`, unit-tested) over the buffers' own shape; the staging
            // buffer holds buffers * count * width values.
            unsafe { launch.launch(cfg) }?;
        }
        Ok(())
    }

    /// `dst[k, t * hidden..(t + 1) * hidden] = bf16(sources[t][rows[k], ..])` for every tap `t`
    /// (`[count, stride]` bf16, `stride >= sources.len() * hidden`): the draft head's `fc`
    /// input, four taps a launch.
    pub fn taps_to_bf16(
        &self,
        sources: &[&CudaSlice<f32>],
        rows: &CudaView<'_, i32>,
        dst: &mut CudaSlice<u16>,
        count: usize,
        hidden: usize,
        stride: usize,
    ) -> Result<(), CudaError> {
        assert!(rows.len() >= count && sources.len() * hidden <= stride);
        assert!(dst.len() >= count * stride);
        assert!(sources.iter().all(|s| s.len() >= hidden));
        if count == 0 {
            return Ok(());
        }
        let (hidden_i, stride_i) = (hidden as i32, stride as i32);
        for (chunk, group) in sources.chunks(4).enumerate() {
            let first = (4 * chunk) as i32;
            let mut launch = self.stream.launch_builder(&self.kernels.taps_to_bf16);
            for y in 0..4 {
                match group.get(y) {
                    Some(src) => launch.arg(*src),
                    None => launch.arg(&NULL),
                };
            }
            launch
                .arg(rows)
                .arg(&mut *dst)
                .arg(&hidden_i)
                .arg(&stride_i)
                .arg(&first);
            let config = LaunchConfig {
                grid_dim: (count as u32, group.len() as u32, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: signature (4 x const f32* (null past the group), const int*, u16*, int,
            // int, int); block (k, y) reads row rows[k] of source y < group.len() (row indices
            // are the step's own slots, below the rows of every tap) and writes columns [(first
            // + y) * hidden, +hidden) < stride of dst row k; sizes asserted.
            unsafe { launch.launch(config) }?;
        }
        Ok(())
    }

    /// Greedy token per row of `[rows, vocab]` f32 logits.
    pub fn argmax_rows(
        &self,
        logits: &CudaSlice<f32>,
        rows: usize,
        vocab: usize,
    ) -> Result<Vec<u32>, CudaError> {
        let mut out = self.scratch::<u32>(rows)?;
        self.argmax_rows_into(logits, rows, vocab, None, &mut out.slice_mut(..))?;
        let mut host = self.download(&out)?;
        host.truncate(rows);
        Ok(host)
    }

    /// The greedy token of each of `rows` logits rows, mapped through `map` when given (a
    /// draft head's draft id -> target id table), written into `out` on the device.
    pub fn argmax_rows_into(
        &self,
        logits: &CudaSlice<f32>,
        rows: usize,
        vocab: usize,
        map: Option<&CudaSlice<u32>>,
        out: &mut CudaViewMut<'_, u32>,
    ) -> Result<(), CudaError> {
        assert!(logits.len() >= rows * vocab && out.len() >= rows);
        assert!(map.is_none_or(|m| m.len() >= vocab));
        let vocab_i = vocab as i32;
        let split = self
            .argmax_split_on
            .load(Ordering::Relaxed)
            .then(|| argmax_split(rows, vocab, self.sm_count))
            .flatten();
        if let Some((parts, span)) = split {
            let span_i = span as i32;
            let scratch = &self.argmax_parts;
            assert!(rows * parts <= scratch.value.len() && rows <= scratch.done.len());
            let mut launch = self.stream.launch_builder(&self.kernels.argmax_rows_split);
            launch.arg(logits).arg(&vocab_i).arg(&span_i);
            match map {
                Some(m) => launch.arg(m),
                None => launch.arg(&NULL),
            };
            launch
                .arg(out)
                .arg(&scratch.value)
                .arg(&scratch.index)
                .arg(&scratch.done);
            // SAFETY: signature (const f32*, int, int, const u32* or null, u32*, f32*, int*,
            // u32*); block (p, r) reads values [p * span, (p + 1) * span) of row r < rows (and
            // one `map` entry) and writes slot r * parts + p < 3 * sm_count of the parts
            // (argmax_split) and count r < sm_count, which the row's last block sets back to 0;
            // every launch on this GPU's one stream, so no two use the scratch at once; sizes
            // asserted.
            unsafe {
                launch.launch(LaunchConfig {
                    grid_dim: (parts as u32, rows as u32, 1),
                    block_dim: (ARGMAX_SPLIT_THREADS as u32, 1, 1),
                    shared_mem_bytes: 0,
                })
            }?;
            return Ok(());
        }
        let mut launch = self.stream.launch_builder(&self.kernels.argmax_rows);
        launch.arg(logits).arg(&vocab_i);
        match map {
            Some(m) => launch.arg(m),
            None => launch.arg(&NULL),
        };
        launch.arg(out);
        // SAFETY: signature (const f32*, int, const u32* or null, u32*); one block per row,
        // each reads `vocab` values (and one `map` entry) and writes its row's id; sizes
        // asserted.
        unsafe { launch.launch(Self::rows_config(rows, 1024)) }?;
        Ok(())
    }

    /// Turns `argmax_rows_split` on or off for this GPU's greedy ids (benchmarks and the GPU
    /// tests compare both; the ids are the same).
    pub fn set_argmax_split(&self, on: bool) {
        self.argmax_split_on.store(on, Ordering::Relaxed);
    }

    /// The next chains' roots from a head extend over whole verified greedy chains
    /// (`gather_accepted_roots` in kernels/llama.cu): for each of `batch` sequences, its
    /// accepted length from the verification's greedy `ids` (`[batch * width]`) and the chain's
    /// drafts (`chain`, `[steps, batch]`), then that slot's row of `hidden` (`[_, h]`) and
    /// `logits` (`[_, vocab]`) into row `b` of `out_hidden` / `out_logits`.
    #[allow(clippy::too_many_arguments)]
    pub fn gather_accepted_roots(
        &self,
        ids: &CudaView<'_, u32>,
        chain: &CudaView<'_, u32>,
        (batch, steps, width): (usize, usize, usize),
        hidden: &CudaSlice<f32>,
        logits: &CudaSlice<f32>,
        (h, vocab): (usize, usize),
        out_hidden: &mut CudaSlice<f32>,
        out_logits: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        assert!(
            steps < width,
            "a chain verification holds its root and every draft"
        );
        assert!(ids.len() >= batch * width && chain.len() >= batch * steps);
        assert!(hidden.len() >= batch * width * h && logits.len() >= batch * width * vocab);
        assert!(out_hidden.len() >= batch * h && out_logits.len() >= batch * vocab);
        if batch == 0 {
            return Ok(());
        }
        let (batch_i, steps_i, width_i) = (batch as i32, steps as i32, width as i32);
        let (h_i, vocab_i) = (h as i32, vocab as i32);
        let mut launch = self
            .stream
            .launch_builder(&self.kernels.gather_accepted_roots);
        launch
            .arg(ids)
            .arg(chain)
            .arg(&batch_i)
            .arg(&steps_i)
            .arg(&width_i)
            .arg(hidden)
            .arg(&h_i)
            .arg(logits)
            .arg(&vocab_i)
            .arg(out_hidden)
            .arg(out_logits);
        // SAFETY: signature (const u32*, const u32*, int, int, int, const f32*, int, const
        // f32*, int, f32*, f32*); block (b, p) reads `steps` chain and id entries of sequence
        // b and its share of one row of each input, and writes that share of its output rows;
        // sizes asserted.
        unsafe {
            launch.launch(LaunchConfig {
                grid_dim: (batch as u32, gather_parts(vocab) as u32, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            })
        }?;
        Ok(())
    }

    /// Greedy chains' drafted tokens into a verification step's tokens: `ids` `[steps,
    /// batch]` (as [`crate::CudaDraft::draft_chain_ids`] leaves them) to `tokens[b * width +
    /// first + s]`: `first` 1 after each sequence's root slot, 0 for the roots themselves (one
    /// step: a decode step's tokens from the previous step's greedy ids). `first + steps` must
    /// not exceed `width`.
    pub fn scatter_chain_tokens(
        &self,
        ids: &CudaSlice<u32>,
        batch: usize,
        (steps, first): (usize, usize),
        tokens: &mut CudaViewMut<'_, u32>,
        width: usize,
    ) -> Result<(), CudaError> {
        assert!(
            first + steps <= width,
            "{steps} tokens from slot {first} need a step wider than {}",
            first + steps - 1
        );
        assert!(ids.len() >= batch * steps && tokens.len() >= batch * width);
        let n = batch * steps;
        if n == 0 {
            return Ok(());
        }
        let (batch_i, steps_i, first_i, width_i) =
            (batch as i32, steps as i32, first as i32, width as i32);
        let mut launch = self
            .stream
            .launch_builder(&self.kernels.scatter_chain_tokens);
        launch
            .arg(ids)
            .arg(&batch_i)
            .arg(&steps_i)
            .arg(&first_i)
            .arg(tokens)
            .arg(&width_i);
        // SAFETY: signature (const u32*, int, int, int, u32*, int); thread i < batch * steps
        // reads ids[i] and writes tokens[b * width + first + s] with first + s < width, b <
        // batch; sizes asserted.
        unsafe { launch.launch(LaunchConfig::for_num_elems(n as u32)) }?;
        Ok(())
    }

    /// One token per row of `[rows, vocab]` f32 logits drawn from softmax(logits /
    /// `temperature`) restricted to the `top_p` nucleus (`top_p >= 1`: all tokens), on the GPU
    /// (`sample_rows` in kernels/llama.cu: bisection for the nucleus cut, then Gumbel-max with
    /// uniforms hashed from `seeds[row]` and the token id). Same seed, same logits: same token.
    pub fn sample_rows(
        &self,
        logits: &CudaSlice<f32>,
        rows: usize,
        vocab: usize,
        temperature: f32,
        top_p: f32,
        seeds: &[u64],
    ) -> Result<Vec<u32>, CudaError> {
        assert!(logits.len() >= rows * vocab && seeds.len() >= rows);
        assert!(
            temperature > 0.0,
            "sample_rows draws; greedy rows use argmax_rows"
        );
        let seeds = self.upload(&seeds[..rows])?;
        let mut out = self.scratch::<u32>(rows)?;
        let (vocab_i, inv_temperature) = (vocab as i32, 1.0 / temperature);
        {
            let mut launch = self.stream.launch_builder(&self.kernels.sample_rows);
            launch
                .arg(logits)
                .arg(&vocab_i)
                .arg(&inv_temperature)
                .arg(&top_p)
                .arg(&seeds)
                .arg(&mut out);
            // SAFETY: one block per row, each reads `vocab` values and one seed; sizes asserted.
            unsafe { launch.launch(Self::rows_config(rows, 1024)) }?;
        }
        let mut host = self.download(&out)?;
        host.truncate(rows);
        Ok(host)
    }
}

impl Gpu {
    /// The `k` most likely entries of each row of `[rows, vocab]` f32 logits with their
    /// softmax probabilities, computed on the GPU (one small read-back): `(probs, ids)`, each
    /// `[rows * k]`, descending per row, ties to the lower index. `k` is at most 32.
    pub fn topk_softmax_rows(
        &self,
        logits: &CudaSlice<f32>,
        rows: usize,
        vocab: usize,
        k: usize,
    ) -> Result<(Vec<f32>, Vec<u32>), CudaError> {
        assert!(logits.len() >= rows * vocab && (1..=32).contains(&k) && k <= vocab);
        // Probabilities (as f32 bits) and ids in one buffer: every draft step reads its top-k
        // back, and each read-back is a synchronisation plus a copy, each buffer an allocation
        // and a free.
        let mut out = self.scratch::<u32>(2 * rows * k)?;
        self.topk_softmax_rows_into(logits, rows, vocab, k, &mut out)?;
        let mut host = self.download(&out)?;
        host.truncate(2 * rows * k);
        let ids = host.split_off(rows * k);
        let probs = host.into_iter().map(f32::from_bits).collect();
        Ok((probs, ids))
    }
}

impl Gpu {
    /// [`Gpu::topk_softmax_rows`] left on the device: `out` gets the `rows * k` probabilities
    /// (f32 bits, row after row, descending) and then the `rows * k` ids.
    pub fn topk_softmax_rows_into(
        &self,
        logits: &CudaSlice<f32>,
        rows: usize,
        vocab: usize,
        k: usize,
        out: &mut CudaSlice<u32>,
    ) -> Result<(), CudaError> {
        assert!(logits.len() >= rows * vocab && (1..=32).contains(&k) && k <= vocab);
        assert!(out.len() >= 2 * rows * k);
        if rows == 0 {
            return Ok(());
        }
        let (vocab_i, k_i) = (vocab as i32, k as i32);
        let mut launch = self.stream.launch_builder(&self.kernels.topk_softmax);
        launch.arg(logits).arg(&vocab_i).arg(&k_i).arg(out);
        // SAFETY: one block per row reads `vocab` values and writes `k` probabilities and `k`
        // ids into `out` (rows * k each, the grid being rows); sizes asserted.
        unsafe { launch.launch(Self::rows_config(rows, 1024)) }?;
        Ok(())
    }

    /// One draft step's beam choice for tree drafting on the device (`beam_select` in
    /// kernels/llama.cu: what the host's beam search does, one warp per sequence): `topk` the
    /// step's top-k ([`Gpu::topk_softmax_rows_into`] of the roots at step 0, of each sequence's
    /// `k` beam rows after), `d2t` the head's id map, `state_in` / `state_out` the beams'
    /// scores, paths and hidden-input rows, `record` this step's scores, target ids and
    /// parents, `next` the next step's slot tokens and hidden-input rows, `out_row0` the hidden
    /// bank row of this step's first beam output.
    #[allow(clippy::too_many_arguments)]
    pub fn beam_select(
        &self,
        topk: &CudaSlice<u32>,
        d2t: &CudaSlice<u32>,
        (batch, k, s, steps): (usize, usize, usize, usize),
        state_in: (&CudaSlice<f32>, &CudaSlice<u32>, &CudaSlice<i32>),
        state_out: (
            &mut CudaSlice<f32>,
            &mut CudaSlice<u32>,
            &mut CudaSlice<i32>,
        ),
        record: &mut CudaViewMut<'_, u32>,
        next: (&mut CudaSlice<u32>, &mut CudaSlice<i32>),
        out_row0: usize,
    ) -> Result<(), CudaError> {
        assert!(
            (1..=8).contains(&k) && s < steps,
            "beam step {s} of {steps}, topk {k}"
        );
        let rows = if s == 0 { batch } else { batch * k };
        let n = if s == 0 { k } else { k * k };
        let beams = batch * k;
        assert!(topk.len() >= 2 * rows * k);
        assert!(record.len() >= 2 * batch * n + if s > 0 { beams } else { 0 });
        assert!(state_in.0.len() >= beams && state_out.0.len() >= beams);
        assert!(state_in.1.len() >= beams * steps && state_out.1.len() >= beams * steps);
        assert!(state_in.2.len() >= beams * steps && state_out.2.len() >= beams * steps);
        assert!(
            s + 1 == steps || (next.0.len() >= beams * (s + 1) && next.1.len() >= beams * (s + 1))
        );
        if batch == 0 {
            return Ok(());
        }
        let ints = [rows, k, s, steps, out_row0].map(|v| i32::try_from(v).expect("fits i32"));
        let mut launch = self.stream.launch_builder(&self.kernels.beam_select);
        launch
            .arg(topk)
            .arg(&ints[0])
            .arg(d2t)
            .arg(&ints[1])
            .arg(&ints[2])
            .arg(&ints[3])
            .arg(state_in.0)
            .arg(state_in.1)
            .arg(state_in.2)
            .arg(state_out.0)
            .arg(state_out.1)
            .arg(state_out.2)
            .arg(record)
            .arg(next.0)
            .arg(next.1)
            .arg(&ints[4]);
        // SAFETY: signature (const u32*, int, const u32*, int, int, int, const f32*, const u32*,
        // const i32*, f32*, u32*, i32*, u32*, u32*, i32*, int); block b (one warp) reads its
        // sequence's top-k rows and beams and writes its own beams, record entries and slots;
        // sizes asserted; d2t holds every id the top-k gives (the head's draft vocabulary).
        unsafe {
            launch.launch(LaunchConfig {
                grid_dim: (batch as u32, 1, 1),
                block_dim: (32, 1, 1),
                shared_mem_bytes: 0,
            })
        }?;
        Ok(())
    }
}

/// The 4-byte integer types a byte buffer may be read as ([`words`]): every bit pattern is a
/// value.
pub(crate) trait Word: DeviceRepr {}
impl Word for u32 {}
impl Word for i32 {}

/// `n` values of `T` at byte `at` of `bytes`, `at` a multiple of 4 (allocations are aligned
/// far beyond that), so that one buffer filled by one copy can hold a step's integer inputs
/// and its byte-sized mask parts.
pub(crate) fn words<T: Word>(bytes: &CudaSlice<u8>, at: usize, n: usize) -> CudaView<'_, T> {
    assert!(at.is_multiple_of(4) && std::mem::size_of::<T>() == 4);
    // SAFETY: `T` takes any bit pattern (`Word`); the range lies inside the buffer (`slice`
    // panics otherwise) and starts 4-byte aligned.
    unsafe { bytes.slice(at..at + 4 * n).transmute::<T>(n) }.expect("the range holds n values")
}

/// The first `n` values of `T` of `bytes`, writable ([`words`] at byte 0).
pub(crate) fn first_words_mut<T: Word>(bytes: &mut CudaSlice<u8>, n: usize) -> CudaViewMut<'_, T> {
    assert!(std::mem::size_of::<T>() == 4);
    // SAFETY: `T` takes any bit pattern (`Word`); `transmute_mut` checks that the buffer holds
    // `n` values.
    unsafe { bytes.transmute_mut::<T>(n) }.expect("the buffer holds n values")
}

/// The attention geometry of one step.
#[derive(Debug, Clone, Copy)]
pub struct AttentionShape {
    pub batch: usize,
    pub width: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub capacity: usize,
}

impl AttentionShape {
    pub fn rows(&self) -> usize {
        self.batch * self.width
    }
}

/// A CUDA graph captured by [`Gpu::capture`].
pub struct StepGraph {
    graph: CudaGraph,
}

// SAFETY: a graph has no thread affinity; CUDA only asks that calls on one graph be serialised,
// which `&mut`/`Mutex` ownership of the `StepGraph` guarantees (it is never shared by reference
// across threads: `Sync` is not implemented).
unsafe impl Send for StepGraph {}

impl std::fmt::Debug for StepGraph {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("StepGraph")
    }
}

/// Hidden states of one step on the GPU, `[batch, width, hidden]` f32 (the residual stream or
/// the final norm's output): what the capture hook stores for the fast path. Cloning copies the
/// buffer on the device, which is exactly the copy a tap needs since the loop then overwrites
/// the residual in place.
#[derive(Debug, Clone)]
pub struct DeviceRows {
    pub data: CudaSlice<f32>,
    pub batch: usize,
    pub width: usize,
    pub hidden: usize,
}

impl DeviceRows {
    /// Reads the rows back, `[batch * width * hidden]` row-major.
    pub fn to_host(&self) -> Result<Vec<f32>, CudaError> {
        let mut values = self.data.stream().clone_dtoh(&self.data)?;
        values.truncate(self.batch * self.width * self.hidden);
        Ok(values)
    }
}

#[cfg(test)]
mod tests {
    /// The split covers each row exactly (parts of whole spans, the last one short), keeps
    /// spans a multiple of the block and at most ARGMAX_SPAN unless the cap of about two blocks
    /// an SM makes them longer, stays inside the parts' scratch, and is off where a block a row
    /// already fills the GPU or a row is short.
    #[test]
    fn argmax_split_covers_each_row_once_inside_its_scratch() {
        use super::{ARGMAX_SPAN, ARGMAX_SPLIT_THREADS, argmax_split};
        for sm in [1, 2, 66, 108, 132] {
            for rows in [1, 2, 3, 4, 5, 8, 16, 31, 32, 64, 131, 132, 200] {
                for vocab in [1, 100, 2048, 4095, 4096, 32_000, 49_152, 151_936, 128_256] {
                    let Some((parts, span)) = argmax_split(rows, vocab, sm) else {
                        assert!(
                            rows >= sm || vocab < 2 * ARGMAX_SPAN || sm < 2 * rows,
                            "{rows} rows of {vocab} on {sm} SMs not split"
                        );
                        continue;
                    };
                    assert!(rows < sm && parts >= 2, "{rows} rows, {vocab}, {sm} SMs");
                    assert_eq!(span % ARGMAX_SPLIT_THREADS, 0);
                    // Longer than a span only as far as the cap of about two blocks an SM needs.
                    let capped = vocab
                        .div_ceil((2 * sm).div_ceil(rows))
                        .next_multiple_of(ARGMAX_SPLIT_THREADS);
                    assert!(span <= ARGMAX_SPAN.max(capped), "{span} values a block");
                    assert!((parts - 1) * span < vocab && parts * span >= vocab);
                    assert!(rows * parts < 3 * sm, "{rows} x {parts} parts on {sm} SMs");
                }
            }
        }
        // SmolLM2's target (49,152) and head (32,000) vocabularies on an H100 (132 SMs): a
        // decode's one row in 24 parts, a 3/1/4 verification's four rows in 24 each.
        assert_eq!(argmax_split(1, 49_152, 132), Some((24, 2048)));
        assert_eq!(argmax_split(1, 32_000, 132), Some((16, 2048)));
        assert_eq!(argmax_split(4, 49_152, 132), Some((24, 2048)));
        // 32 rows: nine parts a row (about two blocks an SM), each scanning more.
        assert_eq!(argmax_split(32, 49_152, 132), Some((9, 5632)));
        assert_eq!(argmax_split(132, 49_152, 132), None);
    }

    #[test]
    fn gather_parts_give_each_block_at_most_2048_logits_up_to_32_blocks() {
        use super::gather_parts;
        assert_eq!(gather_parts(1), 1);
        assert_eq!(gather_parts(2048), 1);
        assert_eq!(gather_parts(2049), 2);
        assert_eq!(gather_parts(32_000), 16);
        assert_eq!(gather_parts(151_936), 32);
    }

    #[test]
    fn pdl_rows_take_the_row_cap_first_and_every_step_only_for_1() {
        use super::pdl_rows;
        assert_eq!(pdl_rows(None, None, 0), 0);
        assert_eq!(pdl_rows(None, None, 8), 8, "unset: the default");
        assert_eq!(pdl_rows(Some("2"), None, 8), 2);
        assert_eq!(pdl_rows(Some(" 8 "), Some("1"), 0), 8);
        assert_eq!(pdl_rows(Some("0"), Some("1"), 8), 0, "the row cap wins");
        assert_eq!(pdl_rows(Some("two"), None, 8), 0, "not a number: off");
        assert_eq!(pdl_rows(None, Some("1"), 0), usize::MAX);
        assert_eq!(pdl_rows(None, Some("0"), 8), 0);
        assert_eq!(pdl_rows(None, Some("yes"), 8), 0);
    }

    use super::*;

    #[test]
    fn the_late_trigger_and_the_chained_attention_are_on_unless_set_to_zero() {
        assert!(switch_on_unless_zero(None));
        assert!(switch_on_unless_zero(Some("1")));
        assert!(switch_on_unless_zero(Some("")));
        assert!(!switch_on_unless_zero(Some("0")));
        assert!(!switch_on_unless_zero(Some(" 0\n")));
        // The late build defines both macros, the early one only TANDEM_PDL; no PDL, none.
        assert!(pdl_defines(true, true).contains("TANDEM_PDL_LATE 1"));
        assert!(!pdl_defines(true, false).contains("LATE"));
        assert_eq!(pdl_defines(false, true), "");
    }

    #[test]
    fn gemv_buckets_splits_and_outputs_parse_as_documented() {
        let buckets: Vec<usize> = (1..=8).map(gemv_bucket).collect();
        assert_eq!(buckets, [1, 2, 4, 4, 8, 8, 8, 8]);
        // SmolLM2's o_proj/down_proj (576), Qwen2.5-1.5B's (1,536), the logits (49,152).
        assert_eq!(
            [576, 1023, 1024, 1536, 4095, 4096, 49152].map(gemv_split),
            [4, 4, 2, 2, 2, 1, 1]
        );
        assert_eq!(parse_gemv_outputs("1,1,2,4"), Some([1, 1, 2, 4]));
        assert_eq!(parse_gemv_outputs(" 4, 4,1 ,2"), Some([4, 4, 1, 2]));
        assert_eq!(parse_gemv_outputs("1,1,3,4"), None);
        assert_eq!(parse_gemv_outputs("1,1,2"), None);
        assert_eq!(parse_gemv_outputs("1,1,2,4,4"), None);
        assert_eq!(parse_gemv_outputs(""), None);
    }
}
