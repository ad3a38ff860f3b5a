//! The fused small steps' matrix products on the tensor cores (`kernels/rows_mma.cu`):
//! [`Gpu::gemv_rows`], [`Gpu::gemv_norm_rows`], [`Gpu::norm_gate_up_silu`] and
//! [`Gpu::norm_qkv_rope`] for steps of at most [`super::MMA_MAX_ROWS`] rows, one
//! `mma.m16n8k16` per 16 weight rows and 16 input values a row group of
//! [`super::GEMV_MAX_ROWS`] (one block row each), so eight rows (an 8-token tree's
//! verification, a batch-8 decode) cost what one does on the CUDA-core kernels' weight
//! traffic, and 32 (a 3/1/4 verification at batch 8) four blocks a tile instead of cuBLAS.
//! The bits differ from the CUDA-core kernels', and a row's bits must
//! not depend on which kernels a step takes, so the family is chosen once per process
//! (`TANDEM_CUDA_MMA_ROWS`, [`enabled`]) and by the weight's shape only ([`takes`]), never by
//! the row count. Compiled on its own for compute_80 (compute_90 with programmatic dependent
//! launch), on GPUs that have `mma.sync` with bf16; checked on the CPU emulator
//! (`tests/emulated_kernels.rs`) and assembled for sm_80 and sm_90 in CI ([`assemble_mma_rows`]).

use std::sync::atomic::{AtomicUsize, Ordering};

use cudarc::driver::{CudaFunction, CudaSlice, CudaView, LaunchConfig};

use super::{
    AttentionShape, GEMV_MAX_ROWS, GEMV_MAX_SHARED_BYTES, Gpu, KernelArgs, group_rows,
    mma_attention, mma_source,
};
use crate::error::CudaError;

pub(super) const MMA_ROWS_SOURCE: &str = include_str!("../../../../kernels/rows_mma.cu");

/// Chunks of 32 input values a warp loads at once (`MMA_ROWS_CHUNKS`) and the most warps a
/// tile's block splits its k range over (`MMA_ROWS_MAX_SPLIT`).
const CHUNKS_A_WARP: usize = 4;
const MAX_SPLIT: usize = 16;

/// Static shared memory of a block: one f32 partial tile (4 values a lane) per warp.
const PARTIAL_BYTES: usize = MAX_SPLIT * 4 * 32 * 4;

/// The kernels, and the grid order they were compiled for.
pub(super) struct MmaRows {
    pub(super) gemv_rows: CudaFunction,
    pub(super) gemv_norm_rows: CudaFunction,
    pub(super) norm_gate_up_silu: CudaFunction,
    pub(super) norm_qkv_rope: CudaFunction,
    /// A decode step's q|k|v and attention in one launch ([`Gpu::qkv_attention`]), and the
    /// most threads its block was compiled for.
    pub(super) qkv_attention: CudaFunction,
    qkv_attention_threads: usize,
    /// Blocks a (row, head) cluster of `qkv_attention_mma` ([`qkv_attention_cluster`]).
    qkv_attention_cluster: usize,
    /// A fused layer's MLP in one launch ([`Gpu::mlp_partials`]) and its sums added by a
    /// launch of their own ([`Gpu::add_mlp_partials`]).
    pub(super) mlp_partials: CudaFunction,
    pub(super) add_mlp_partials: CudaFunction,
    /// The most blocks a cluster of `mlp_partials_mma` takes ([`mlp_cluster`]; 0: the MLP
    /// takes two launches), and whether clusters exist (compiled for sm_90).
    mlp_cluster: AtomicUsize,
    programmatic: bool,
    groups_in_y: bool,
}

/// Whether the row groups are the grid's y (`TANDEM_CUDA_MMA_GROUPS_IN_Y=1`: the order before
/// session 45, kept for same-binary comparisons) instead of its x, beside each tile's other
/// groups (the default: see "Row groups" in kernels/rows_mma.cu).
pub(super) fn groups_in_y(value: Option<&str>) -> bool {
    value.map(str::trim) == Some("1")
}

/// `kernels/rows_mma.cu` as PTX: compute_80, or compute_90 with `TANDEM_PDL` when the other
/// kernels launch with programmatic dependent launch (and `late`: the trigger after the wait,
/// [`super::pdl_defines`]); `groups_in_y`: [`groups_in_y`].
pub(super) fn compile(
    programmatic: bool,
    groups_in_y: bool,
    late: bool,
    qkv_attention_threads: usize,
) -> Result<cudarc::nvrtc::Ptx, CudaError> {
    let pdl = super::pdl_defines(programmatic, late);
    let order = if groups_in_y {
        "#define MMA_GROUPS_IN_Y 1\n"
    } else {
        ""
    };
    let order = format!("{order}#define QKV_ATTENTION_MAX_THREADS {qkv_attention_threads}\n");
    Ok(cudarc::nvrtc::compile_ptx_with_opts(
        mma_source(MMA_ROWS_SOURCE, "rows_mma.cu", &format!("{pdl}{order}")),
        cudarc::nvrtc::CompileOptions {
            name: Some("rows_mma.cu".into()),
            arch: Some(if programmatic {
                "compute_90"
            } else {
                "compute_80"
            }),
            ..Default::default()
        },
    )?)
}

impl MmaRows {
    /// The kernels compiled for this GPU: `programmatic` and `late` as the GPU's other
    /// kernels were ([`compile`]).
    pub(super) fn load(
        ctx: &std::sync::Arc<cudarc::driver::CudaContext>,
        programmatic: bool,
        late: bool,
    ) -> Result<Self, CudaError> {
        let groups_in_y = groups_in_y(std::env::var("TANDEM_CUDA_MMA_GROUPS_IN_Y").ok().as_deref());
        let qkv_attention_threads = qkv_attention_threads(
            std::env::var("TANDEM_CUDA_QKV_ATTENTION_THREADS")
                .ok()
                .as_deref(),
        );
        let module = ctx.load_module(compile(
            programmatic,
            groups_in_y,
            late,
            qkv_attention_threads,
        )?)?;
        Ok(Self {
            gemv_rows: module.load_function("gemv_rows_mma")?,
            gemv_norm_rows: module.load_function("gemv_norm_rows_mma")?,
            norm_gate_up_silu: module.load_function("norm_gate_up_silu_mma")?,
            norm_qkv_rope: module.load_function("norm_qkv_rope_mma")?,
            qkv_attention: module.load_function("qkv_attention_mma")?,
            qkv_attention_threads,
            qkv_attention_cluster: qkv_attention_cluster(
                programmatic,
                std::env::var("TANDEM_CUDA_QKV_ATTENTION_CLUSTER")
                    .ok()
                    .as_deref(),
            ),
            mlp_partials: module.load_function("mlp_partials_mma")?,
            add_mlp_partials: module.load_function("add_mlp_partials")?,
            mlp_cluster: AtomicUsize::new(mlp_cluster(
                programmatic,
                std::env::var("TANDEM_CUDA_MLP_CLUSTER").ok().as_deref(),
            )),
            programmatic,
            groups_in_y,
        })
    }

    /// [`config`] in the grid order these kernels were compiled for.
    pub(super) fn config(
        &self,
        tiles: usize,
        width: usize,
        shared_bytes: usize,
        rows: usize,
    ) -> LaunchConfig {
        config(tiles, width, shared_bytes, rows, self.groups_in_y)
    }
}

/// The launch of a product over a k range of `width` values with `tiles` tiles (16 weight rows,
/// or 8 output pairs, each) for a step of `rows` rows (a block per tile and row group of
/// [`GEMV_MAX_ROWS`]: the groups as the grid's x, the tiles as its y, or the other way round
/// with `groups_in_y`), `shared_bytes` of staged inputs a block.
pub(super) fn config(
    tiles: usize,
    width: usize,
    shared_bytes: usize,
    rows: usize,
    groups_in_y: bool,
) -> LaunchConfig {
    assert!((1..=super::MMA_MAX_ROWS).contains(&rows), "{rows} rows");
    let groups = rows.div_ceil(GEMV_MAX_ROWS) as u32;
    let tiles = u32::try_from(tiles).expect("tiles fit a grid");
    assert!(
        groups_in_y || tiles <= 65_535,
        "{tiles} tiles exceed a grid's y (65,535)"
    );
    LaunchConfig {
        grid_dim: if groups_in_y {
            (tiles, groups, 1)
        } else {
            (groups, tiles, 1)
        },
        block_dim: (32 * split(width) as u32, 1, 1),
        shared_mem_bytes: shared_bytes as u32,
    }
}

/// Whether the process takes its fused steps' products on the tensor cores: by default on an
/// sm_80+ GPU (session 40, H100: a batch-8 decode 15% faster, an 8-token verification at batch
/// 1 0.905 ms instead of 1.068, a one-row decode 3% slower; BENCHMARKS.md); `TANDEM_CUDA_MMA_ROWS=0`
/// keeps the CUDA-core kernels.
pub(super) fn enabled(value: Option<&str>, compute_major: i32) -> bool {
    compute_major >= 8 && super::switch_on_unless_zero(value)
}

/// Whether the kernels take a product whose k range is `inputs` inputs of `width` values each:
/// widths that are whole 32-value chunks, and the staged rows of a full row group
/// ([`GEMV_MAX_ROWS`], whatever this step's rows: the choice must not depend on them) fitting
/// beside the partial tiles in the 48 KiB a block gets without opting in.
pub(super) fn takes(width: usize, inputs: usize) -> bool {
    width > 0
        && width.is_multiple_of(32)
        && inputs * GEMV_MAX_ROWS * width * 2 + PARTIAL_BYTES <= GEMV_MAX_SHARED_BYTES
}

/// Warps of a tile's block for a k range of `width` values: enough that each loads at most
/// [`CHUNKS_A_WARP`] chunks at once, at most [`MAX_SPLIT`] (wider ranges loop).
pub(super) fn split(width: usize) -> usize {
    (width / 32).div_ceil(CHUNKS_A_WARP).clamp(1, MAX_SPLIT)
}

/// Passes a rank of `qkv_attention_mma` may take: more would stream a head's weights through
/// one block after the wait, which session 47 measured slower than the two launches.
const QKV_ATTENTION_MAX_PASSES: usize = 4;

/// Threads `qkv_attention_mma`'s block may have (`QKV_ATTENTION_MAX_THREADS`): 512 leave each
/// thread 128 registers, what its products need without spilling (`tests/nvrtc.rs` assembles
/// it; at 640, 96 registers, ptxas spilled 20 bytes a thread). SmolLM2 then runs its 12 tiles as
/// 3 groups in 4 passes; `TANDEM_CUDA_QKV_ATTENTION_THREADS=640` compiles 4 groups in 3 passes.
pub const QKV_ATTENTION_THREADS: usize = 512;

/// [`QKV_ATTENTION_THREADS`], or `TANDEM_CUDA_QKV_ATTENTION_THREADS` (whole warps from 64 to
/// 1,024).
fn qkv_attention_threads(value: Option<&str>) -> usize {
    value
        .and_then(|v| v.trim().parse::<usize>().ok())
        .filter(|&n| (64..=1024).contains(&n) && n.is_multiple_of(32))
        .unwrap_or(QKV_ATTENTION_THREADS)
}

/// Bytes of the pair inputs `qkv_attention_mma` keeps a tile row (`QkvPairInputs`).
const PAIR_INPUT_BYTES: usize = 20;

/// Blocks a (row, head) cluster of `qkv_attention_mma` takes: `TANDEM_CUDA_QKV_ATTENTION_CLUSTER`
/// (1 to 8, the portable cluster size), default 6 (SmolLM2's 12 tiles as 6 ranks of 2 groups,
/// one pass each: a batch-1 decode 0.533 ms of device time on an H100, against 0.544 with 4
/// ranks of 3 and 0.580 with the two launches; session 48, BENCHMARKS.md); always 1 where the
/// kernels are not compiled for sm_90 (`programmatic`), the only GPUs with thread-block
/// clusters. A cluster of one block is the one-block kernel session 47 measured slower than the
/// two launches, so it never runs by itself ([`Gpu::qkv_attention_fits`]): `=1` turns the one
/// launch off.
pub const QKV_ATTENTION_CLUSTER: usize = 6;

fn qkv_attention_cluster(programmatic: bool, value: Option<&str>) -> usize {
    if !programmatic {
        return 1;
    }
    value
        .and_then(|v| v.trim().parse::<usize>().ok())
        .filter(|n| (1..=8).contains(n))
        .unwrap_or(QKV_ATTENTION_CLUSTER)
}

/// Activations a block of `mlp_partials_mma` holds (`MLP_SLICE`): one mma's k.
const MLP_SLICE: usize = 16;

/// The most blocks a cluster of `mlp_partials_mma` takes when a fused layer's MLP runs in one
/// launch (its slices' down_proj products are summed inside the cluster, so a layer's output
/// is the residual plus inter / 16 / cluster sums; SmolLM2: 96 slices, clusters of 8, 12 sums,
/// [`mlp_cluster_for`]): `TANDEM_CUDA_MLP_CLUSTER=8` turns it on (2 to 8, the portable size;
/// 0 or 1, or unset: the two launches, the default: on an H100 the one launch made a batch-1
/// decode 0.639 ms of device time against 0.555, session 51, BENCHMARKS.md). Never where
/// the kernels are not compiled for sm_90 (`programmatic`): without clusters every slice would
/// be a sum of its own.
pub const MLP_CLUSTER: usize = 8;

fn mlp_cluster(programmatic: bool, value: Option<&str>) -> usize {
    if !programmatic {
        return 0;
    }
    value
        .and_then(|v| v.trim().parse::<usize>().ok())
        .filter(|n| *n <= 8)
        .unwrap_or(0)
}

/// The cluster of `mlp_partials_mma` for `inter` activations (inter / 16 slices): the most
/// blocks up to `most` that divide the slices, at least 2 (`None`: the two launches). A shape's
/// cluster never changes within a process, so neither do its sums' order and a row's bits.
/// SmolLM2 (96 slices): 8; a 192-wide tiny model (12): 6.
fn mlp_cluster_for(most: usize, inter: usize) -> Option<usize> {
    if !inter.is_multiple_of(MLP_SLICE) {
        return None;
    }
    let slices = inter / MLP_SLICE;
    (2..=most).rev().find(|c| slices.is_multiple_of(*c))
}

/// Dynamic shared memory of `mlp_partials_mma` for a model of hidden size `hidden` with
/// `warps` warps a block: a row group's normed rows (bf16, rounded to 16 bytes), a partial tile
/// a warp, the group's activations (8 rows of 16 bf16).
fn mlp_shared_bytes(hidden: usize, warps: usize) -> usize {
    (GEMV_MAX_ROWS * hidden).next_multiple_of(8) * 2 + warps * 4 * 32 * 4 + GEMV_MAX_ROWS * 16 * 2
}

/// The block of `qkv_attention_mma` for a model of hidden size `hidden` and head size
/// `head_dim`, compiled for at most `max_threads` threads, in clusters of `cluster` blocks:
/// (groups, split), `groups` tiles of `split` warps each at once. With one block a cluster,
/// as many groups as `max_threads` hold (at most the 3 * head_dim / 16 tiles of a head's q, k
/// and v); with more, enough that each rank takes one pass where the threads allow it.
/// `None` where a rank would take more than [`QKV_ATTENTION_MAX_PASSES`] passes or the
/// attention does not take the head size. SmolLM2 (576, 64) at 512 threads: 3 groups of 5
/// warps, four passes over 12 tiles; in clusters of 6 (the default), 2 groups, one pass a rank.
pub(super) fn qkv_attention_block(
    hidden: usize,
    head_dim: usize,
    max_threads: usize,
    cluster: usize,
) -> Option<(usize, usize)> {
    let split = split(hidden);
    let tiles = 3 * head_dim / 16;
    let most = (max_threads / 32 / split).min(tiles);
    let groups = most.min(tiles.div_ceil(cluster.max(1)));
    let fits = [32, 64, 128, 256].contains(&head_dim)
        && groups > 0
        && tiles.div_ceil(groups).div_ceil(cluster.max(1)) <= QKV_ATTENTION_MAX_PASSES;
    fits.then_some((groups, split))
}

/// Dynamic shared memory of `qkv_attention_mma` with `groups` groups of `split` warps for a
/// step of `width` tokens a sequence: each pass's pair inputs (8 a group and token, rounded to
/// 16 bytes), the staged rows (bf16, rounded to 16 bytes), a partial tile a warp, then the
/// attention's partial a warp and the query (f32).
pub(super) fn qkv_attention_shared_bytes(
    hidden: usize,
    head_dim: usize,
    groups: usize,
    split: usize,
    width: usize,
    with_sums: bool,
) -> usize {
    let passes = (3 * head_dim / 16).div_ceil(groups);
    let warps = groups * split;
    let bytes = (passes * groups * 8 * width * PAIR_INPUT_BYTES).next_multiple_of(16)
        + (width * hidden).next_multiple_of(8) * 2
        + warps * 4 * 32 * 4
        + (warps * (head_dim + 2) + head_dim) * 4;
    // With the MLP's sums: the summed rows (f32) at the next 16-byte boundary.
    if with_sums {
        bytes.next_multiple_of(16) + width * hidden * 4
    } else {
        bytes
    }
}

/// The input of a one-launch q|k|v and attention when it is the previous layer's output as
/// the one-launch MLP left it ([`Gpu::mlp_partials`]): `x` (the residual) plus `parts` cluster
/// sums, added in the launch; the sum goes to `out` (the next residual, not `x`) and `tap`.
pub struct MlpSums<'a> {
    pub sums: &'a CudaSlice<f32>,
    pub parts: usize,
    pub out: &'a mut CudaSlice<f32>,
    pub tap: Option<&'a mut CudaSlice<f32>>,
}

impl Gpu {
    /// Whether fused small steps take their products on the tensor cores from now on (compiled
    /// on first use; an error on a GPU before sm_80). A process should decide once, before its
    /// first step: a row's bits differ between the two families (tests switch it to compare
    /// them). CUDA graphs captured before keep the kernels they captured.
    pub fn set_mma_rows(&self, on: bool) -> Result<(), CudaError> {
        if on && self.mma_rows.get().is_none() {
            let (major, _) = self.ctx.compute_capability()?;
            if major < 8 {
                return Err(CudaError::Kernel(format!(
                    "the tensor-core small steps need an sm_80 or later GPU; this one is sm_{major}x"
                )));
            }
            let kernels = MmaRows::load(&self.ctx, self.programmatic, self.pdl_late)?;
            let _ = self.mma_rows.set(kernels);
        }
        self.mma_rows_on.store(on, Ordering::Relaxed);
        Ok(())
    }

    /// Whether fused small steps take their products on the tensor cores now.
    pub fn mma_rows(&self) -> bool {
        self.mma_rows_on.load(Ordering::Relaxed)
    }

    /// The tensor-core kernels, when they are on and take a product whose k range is `inputs`
    /// staged inputs of `width` values (0: the input is read from global memory).
    pub(super) fn mma_rows_for(&self, width: usize, inputs: usize) -> Option<&MmaRows> {
        if !self.mma_rows() {
            return None;
        }
        self.mma_rows.get().filter(|_| takes(width, inputs))
    }

    /// Registers and local (spilled) bytes per thread of `qkv_attention_mma` as the driver
    /// compiled it, the threads its block was compiled for ([`QKV_ATTENTION_THREADS`]) and the
    /// blocks of its clusters ([`QKV_ATTENTION_CLUSTER`]), when the tensor-core kernels are
    /// loaded: what `fast-bench` prints.
    pub fn qkv_attention_resources(&self) -> Result<Option<(i32, i32, usize, usize)>, CudaError> {
        use cudarc::driver::sys::CUfunction_attribute_enum as Attr;
        let Some(kernels) = self.mma_rows.get() else {
            return Ok(None);
        };
        let f = &kernels.qkv_attention;
        Ok(Some((
            f.num_regs()?,
            f.get_attribute(Attr::CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES)?,
            kernels.qkv_attention_threads,
            kernels.qkv_attention_cluster,
        )))
    }

    /// Whether [`Gpu::qkv_attention`] takes a model of these sizes now, for steps of `width`
    /// tokens a sequence: the tensor-core kernels are on and take its q|k|v, it runs in
    /// clusters of more than one block (sm_90), a sequence's tokens are one mma's columns (at
    /// most [`GEMV_MAX_ROWS`]), and a rank's tiles and the attention fit one block.
    /// `with_sums`: the step's input is a layer's output left as the MLP's cluster sums
    /// ([`MlpSums`]), which the launch adds into shared memory first.
    pub fn qkv_attention_fits(
        &self,
        hidden: usize,
        head_dim: usize,
        width: usize,
        with_sums: bool,
    ) -> bool {
        self.mma_rows_for(hidden, 1).is_some_and(|mma| {
            mma.qkv_attention_cluster > 1
                && (1..=GEMV_MAX_ROWS).contains(&width)
                && qkv_attention_block(
                    hidden,
                    head_dim,
                    mma.qkv_attention_threads,
                    mma.qkv_attention_cluster,
                )
                .is_some_and(|(groups, split)| {
                    qkv_attention_shared_bytes(hidden, head_dim, groups, split, width, with_sums)
                        <= GEMV_MAX_SHARED_BYTES
                })
        })
    }

    /// Fused layers' MLPs in one launch from now on, in clusters of at most `most` blocks
    /// ([`MLP_CLUSTER`]; 0: the two launches), where the tensor-core kernels are loaded and
    /// compiled for sm_90 (elsewhere it stays off). A row's bits differ between the two, so a
    /// process decides before its first step (tests switch it to compare them); graphs captured
    /// before keep the launches they captured (their key says which).
    pub fn set_mlp_cluster(&self, most: usize) {
        if let Some(mma) = self.mma_rows.get() {
            let most = if mma.programmatic { most.min(8) } else { 0 };
            mma.mlp_cluster.store(most, Ordering::Relaxed);
        }
    }

    /// The cluster sums a fused layer's MLP leaves when it runs in one launch
    /// ([`Gpu::mlp_partials`]) for a model of these sizes: `inter / 16 / cluster`; `None` where
    /// it does not (no tensor-core kernels, no clusters, or sizes the kernel does not take), and
    /// the MLP takes gate|up and down_proj's two launches.
    pub fn mlp_parts(&self, hidden: usize, inter: usize) -> Option<usize> {
        let mma = self.mma_rows_for(hidden, 1)?;
        let cluster = mlp_cluster_for(mma.mlp_cluster.load(Ordering::Relaxed), inter)?;
        let warps = 2 * split(hidden);
        let fits = hidden.is_multiple_of(16)
            && hidden / 16 <= 4 * warps
            && warps * 32 <= 1024
            && mlp_shared_bytes(hidden, warps) <= GEMV_MAX_SHARED_BYTES;
        fits.then(|| inter / MLP_SLICE / cluster)
    }

    /// f32 values of the scratch [`Gpu::mlp_partials`] needs for a step of `rows` rows: each
    /// slice's products.
    pub fn mlp_scratch_len(rows: usize, hidden: usize, inter: usize) -> usize {
        inter / MLP_SLICE * rows * hidden
    }

    /// A fused layer's MLP in one launch: `act = silu(gate) * up` of `rms_norm(x) * norm_w`
    /// and down_proj's products of each 16-activation slice, summed inside clusters into
    /// `sums` ([`Gpu::mlp_parts`] of them, `[parts, rows, hidden]`); the layer's output is
    /// `x + the sums`, added by its reader (`qkv_attention` with `mlp`, or
    /// [`Gpu::add_mlp_partials`]). See `mlp_partials_mma` in kernels/rows_mma.cu. Only where
    /// [`Gpu::mlp_parts`] is `Some`.
    #[allow(clippy::too_many_arguments)]
    pub fn mlp_partials(
        &self,
        x: &CudaSlice<f32>,
        norm_w: &CudaSlice<u16>,
        gate_up: &CudaSlice<u16>,
        down: &CudaSlice<u16>,
        scratch: &mut CudaSlice<f32>,
        sums: &mut CudaSlice<f32>,
        rows: usize,
        hidden: usize,
        inter: usize,
        eps: f32,
    ) -> Result<(), CudaError> {
        let parts = self
            .mlp_parts(hidden, inter)
            .expect("mlp_parts before mlp_partials");
        let mma = self.mma_rows_for(hidden, 1).expect("mlp_parts");
        let cluster =
            mlp_cluster_for(mma.mlp_cluster.load(Ordering::Relaxed), inter).expect("mlp_parts");
        let warps = 2 * split(hidden);
        assert!((1..=super::MMA_MAX_ROWS).contains(&rows));
        assert!(x.len() >= rows * hidden && norm_w.len() >= hidden);
        assert!(gate_up.len() >= 2 * inter * hidden && down.len() >= hidden * inter);
        assert!(scratch.len() >= Self::mlp_scratch_len(rows, hidden, inter));
        assert!(sums.len() >= parts * rows * hidden);
        let args = KernelArgs::default()
            .buffer(self, x)
            .buffer(self, norm_w)
            .buffer(self, gate_up)
            .buffer(self, down)
            .buffer(self, scratch)
            .buffer(self, sums)
            .optional::<u16>(self, None)
            .int(rows)
            .int(hidden)
            .int(inter)
            .float(eps)
            .int(cluster);
        let cfg = LaunchConfig {
            grid_dim: (
                u32::try_from(inter / MLP_SLICE).expect("slices fit a grid"),
                rows.div_ceil(GEMV_MAX_ROWS) as u32,
                1,
            ),
            block_dim: (32 * warps as u32, 1, 1),
            shared_mem_bytes: mlp_shared_bytes(hidden, warps) as u32,
        };
        // SAFETY: signature (f32*, u16*, u16*, u16*, f32*, f32*, u16*, int, int, int, float,
        // int) of `mlp_partials_mma`; sizes asserted; at most 1,024 threads and 48 KiB of
        // dynamic shared memory as `mlp_shared_bytes` (mlp_parts); the grid's x a whole number
        // of clusters of at most 8 blocks, clusters only where compiled for sm_90
        // (mlp_cluster); hidden / 16 down_proj tiles at most 4 a warp; PDL_WAIT before x.
        unsafe {
            self.launch_programmatic_clusters(
                &mma.mlp_partials,
                cfg,
                args,
                group_rows(rows),
                u32::try_from(cluster).expect("at most 8"),
            )
        }
    }

    /// `out = x + the MLP's cluster sums` ([`Gpu::mlp_partials`]; `x` `None`: `out` itself,
    /// in place) and `tap` the same: a layer's output where its reader does not add the sums
    /// itself (every step but one-sequence ones, and after the last layer), with the bits the
    /// one-launch q|k|v and attention gives it.
    #[allow(clippy::too_many_arguments)]
    pub fn add_mlp_partials(
        &self,
        x: Option<&CudaSlice<f32>>,
        sums: &CudaSlice<f32>,
        parts: usize,
        out: &mut CudaSlice<f32>,
        tap: Option<&mut CudaSlice<f32>>,
        rows: usize,
        hidden: usize,
    ) -> Result<(), CudaError> {
        let mma = self
            .mma_rows_for(hidden, 1)
            .expect("mlp_parts before add_mlp_partials");
        assert!(hidden.is_multiple_of(4) && parts > 0);
        assert!(x.is_none_or(|x| x.len() >= rows * hidden) && out.len() >= rows * hidden);
        assert!(sums.len() >= parts * rows * hidden);
        assert!(tap.as_ref().is_none_or(|t| t.len() >= rows * hidden));
        let args = KernelArgs::default()
            .buffer(self, x.unwrap_or(&*out))
            .buffer(self, sums)
            .int(parts)
            .buffer(self, &*out)
            .optional(self, tap.as_deref())
            .int(rows)
            .int(hidden);
        let threads = 256;
        let cfg = LaunchConfig {
            grid_dim: ((rows * hidden / 4).div_ceil(threads) as u32, 1, 1),
            block_dim: (threads as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: signature (f32*, f32*, int, f32*, f32*, int, int) of `add_mlp_partials`;
        // sizes asserted; one thread a float4 (hidden a multiple of 4); in place when `x` is
        // `out` (each value read and written by one thread); PDL_WAIT before reading.
        unsafe { self.launch_programmatic(&mma.add_mlp_partials, cfg, args, rows) }
    }

    /// A step's q|k|v, bias, RoPE, cache write and attention in one launch, for decode steps
    /// (one new token a sequence) and verifications of up to [`GEMV_MAX_ROWS`] tokens a
    /// sequence (a cluster per sequence and head computes all its tokens, then attends each
    /// token after the cluster barrier): what [`Gpu::norm_qkv_rope`] then [`Gpu::attention`]
    /// with visible lists do, with the same bits (see `qkv_attention_mma` in
    /// kernels/rows_mma.cu). Only where [`Gpu::qkv_attention_fits`] for the step's width.
    #[allow(clippy::too_many_arguments)]
    pub fn qkv_attention(
        &self,
        x: &CudaSlice<f32>,
        norm_w: &CudaSlice<u16>,
        w: &CudaSlice<u16>,
        bias: Option<&CudaSlice<f32>>,
        positions: &CudaView<'_, i32>,
        inv_freq: &CudaSlice<f32>,
        q_out: &mut CudaSlice<f32>,
        k_cache: &mut CudaSlice<u16>,
        v_cache: &mut CudaSlice<u16>,
        mask: &CudaSlice<f32>,
        (list, counts): (&CudaView<'_, i32>, &CudaView<'_, i32>),
        out: &mut CudaSlice<u16>,
        shape: AttentionShape,
        hidden: usize,
        col0: usize,
        total: usize,
        step_scalars: Option<&CudaView<'_, i32>>,
        eps: f32,
        mlp: Option<MlpSums<'_>>,
    ) -> Result<(), CudaError> {
        let s = shape;
        let rows = s.rows();
        let (q_dim, kv_dim) = (s.heads * s.head_dim, s.kv_heads * s.head_dim);
        let mma = self
            .mma_rows_for(hidden, 1)
            .expect("qkv_attention_fits before qkv_attention");
        let cluster = mma.qkv_attention_cluster;
        let (groups, split) =
            qkv_attention_block(hidden, s.head_dim, mma.qkv_attention_threads, cluster)
                .expect("qkv_attention_fits");
        assert!((1..=GEMV_MAX_ROWS).contains(&s.width) && s.heads.is_multiple_of(s.kv_heads));
        assert!(x.len() >= rows * hidden && norm_w.len() >= hidden);
        assert!(w.len() >= (q_dim + 2 * kv_dim) * hidden);
        assert!(bias.is_none_or(|b| b.len() >= q_dim + 2 * kv_dim));
        assert!(positions.len() >= rows && inv_freq.len() >= s.head_dim / 2);
        assert!(q_out.len() >= rows * q_dim && out.len() >= rows * q_dim);
        assert!(col0 < s.capacity && total <= s.capacity && mask.len() >= rows * total);
        assert!(k_cache.len() >= s.batch * kv_dim * s.capacity && v_cache.len() == k_cache.len());
        assert!(list.len() >= rows * s.capacity && counts.len() >= rows);
        let warps = groups * split;
        let shared =
            qkv_attention_shared_bytes(hidden, s.head_dim, groups, split, s.width, mlp.is_some());
        assert!(shared <= GEMV_MAX_SHARED_BYTES);
        if let Some(m) = &mlp {
            assert!(m.parts > 0 && m.sums.len() >= m.parts * rows * hidden);
            assert!(m.out.len() >= rows * hidden);
            assert!(m.tap.as_ref().is_none_or(|t| t.len() >= rows * hidden));
        }
        let args = KernelArgs::default()
            .buffer(self, x)
            .buffer(self, norm_w)
            .buffer(self, w)
            .optional(self, bias)
            .view(self, positions)
            .buffer(self, inv_freq)
            .buffer(self, q_out)
            .buffer(self, k_cache)
            .buffer(self, v_cache)
            .buffer(self, mask)
            .view(self, list)
            .view(self, counts)
            .buffer(self, out)
            .int(hidden)
            .int(s.heads)
            .int(s.kv_heads)
            .int(s.head_dim)
            .int(s.capacity)
            .int(col0)
            .int(total)
            .float(1.0 / (s.head_dim as f32).sqrt())
            .optional_view(self, step_scalars)
            .float(eps)
            .int(groups)
            .int(cluster)
            .int(s.width)
            .optional(self, mlp.as_ref().map(|m| m.sums))
            .int(mlp.as_ref().map_or(0, |m| m.parts))
            .optional(self, mlp.as_ref().map(|m| &*m.out))
            .optional(self, mlp.as_ref().and_then(|m| m.tap.as_deref()));
        let cfg = LaunchConfig {
            grid_dim: (
                u32::try_from(s.batch * s.heads * cluster)
                    .expect("sequences x heads x cluster fit a grid dimension"),
                1,
                1,
            ),
            block_dim: (32 * warps as u32, 1, 1),
            shared_mem_bytes: shared as u32,
        };
        // SAFETY: the argument list matches `qkv_attention_mma`'s signature (13 pointers, seven
        // ints, the scale, step scalars, eps, groups, cluster, width, then the MLP's sums, their
        // count, the new residual and the tap, null and 0 without); sizes asserted above;
        // dynamic shared memory as `qkv_attention_shared_bytes`, at most 48 KiB; `width` new
        // columns a sequence from `col0` (with `step_scalars`, the caller checks each step's); lists hold
        // columns below `total`; PDL_WAIT before reading anything but the weights; the grid a
        // whole number of clusters of at most 8 blocks of at most 512 threads and 48 KiB, and
        // clusters of more than one block only where the kernels were compiled for sm_90.
        unsafe {
            self.launch_programmatic_clusters(
                &mma.qkv_attention,
                cfg,
                args,
                rows,
                u32::try_from(cluster).expect("at most 8"),
            )
        }
    }
}

/// Assembles `kernels/rows_mma.cu` to machine code for `arch` (e.g. `sm_90`): its `mma.sync`
/// is inline PTX, which only ptxas checks (see [`mma_attention::assemble_mma_attention`]).
pub fn assemble_mma_rows(arch: &str) -> Result<mma_attention::Assembly, CudaError> {
    // sm_90 as the GPU compiles it by default: with programmatic launch and the late trigger,
    // so the cluster barrier's PTX is assembled too.
    let defines = if arch == "sm_90" {
        super::pdl_defines(true, true)
    } else {
        ""
    };
    mma_attention::assemble(
        &mma_source(MMA_ROWS_SOURCE, "rows_mma.cu", defines),
        "rows_mma.cu",
        arch,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn row_groups_are_the_grids_x_unless_asked_for_in_y() {
        assert!(!groups_in_y(None));
        assert!(!groups_in_y(Some("0")));
        assert!(groups_in_y(Some(" 1\n")));
    }

    #[test]
    fn the_switch_is_on_unless_turned_off_on_a_gpu_with_bf16_mma() {
        assert!(enabled(None, 9));
        assert!(enabled(Some("1"), 9));
        assert!(enabled(Some(" 1\n"), 8));
        assert!(!enabled(Some("1"), 7));
        assert!(!enabled(None, 7));
        assert!(!enabled(Some("0"), 9));
        assert!(!enabled(Some(" 0\n"), 8));
    }

    #[test]
    fn shapes_are_taken_by_width_never_by_rows() {
        // SmolLM2: hidden 576, inter 1536; its head stages two inputs of 576.
        assert!(takes(576, 1) && takes(1536, 1) && takes(576, 2));
        // Qwen2.5-1.5B's hidden (1,536) fits one input; its head's two do not (48 KiB + partials).
        assert!(takes(1536, 1));
        assert!(!takes(1536, 2));
        // Not whole chunks of 32.
        assert!(!takes(584, 1) && !takes(0, 1));
    }

    #[test]
    fn each_warp_loads_at_most_four_chunks_and_a_block_at_most_sixteen_warps() {
        // (width, warps): SmolLM2's q|k|v / o / gate|up (576: 18 chunks), its down (1,536: 48),
        // its head's q|k|v (two inputs: 1,152), the head's fc (1,728), a narrow and a wide one.
        for (width, warps) in [
            (576, 5),
            (1536, 12),
            (1152, 9),
            (1728, 14),
            (32, 1),
            (128, 1),
            (160, 2),
            (8960, 16),
        ] {
            assert_eq!(split(width), warps, "width {width}");
            let chunks = width / 32;
            assert!(chunks.div_ceil(warps) <= CHUNKS_A_WARP || warps == MAX_SPLIT);
        }
        let c = config(36, 576, 1152, 8, false);
        assert_eq!(
            (
                c.grid_dim.0,
                c.grid_dim.1,
                c.block_dim.0,
                c.shared_mem_bytes
            ),
            (1, 36, 160, 1152)
        );
        // A row group of 8 a block: 9 to 16 rows take two, 32 take four, as the grid's x (or
        // its y in the old order).
        let groups: Vec<u32> = [1, 8, 9, 16, 17, 32]
            .iter()
            .map(|&rows| config(36, 576, 1152, rows, false).grid_dim.0)
            .collect();
        assert_eq!(groups, [1, 1, 2, 2, 3, 4]);
        assert_eq!(config(36, 576, 1152, 32, true).grid_dim, (36, 4, 1));
        // Qwen2.5's 151,936-token vocabulary is 9,496 tiles of 16: within a grid's y.
        assert_eq!(config(9_496, 1536, 0, 32, false).grid_dim, (4, 9_496, 1));
    }

    #[test]
    fn the_one_launch_mlp_takes_the_largest_cluster_dividing_its_slices() {
        // SmolLM2 (1,536: 96 slices) in clusters of 8, 12 sums; the GPU tests' tiny model
        // (192: 12 slices) in 6; Qwen2.5-1.5B (8,960: 560) in 8; 7 slices (112) have no
        // divisor from 2 to 8 but 7; 13 (208) none: the two launches.
        assert_eq!(mlp_cluster_for(8, 1536), Some(8));
        assert_eq!(mlp_cluster_for(8, 192), Some(6));
        assert_eq!(mlp_cluster_for(8, 8960), Some(8));
        assert_eq!(mlp_cluster_for(8, 112), Some(7));
        assert_eq!(mlp_cluster_for(8, 208), None);
        assert_eq!(mlp_cluster_for(8, 1544), None);
        assert_eq!(mlp_cluster_for(4, 1536), Some(4));
        assert_eq!(mlp_cluster_for(1, 1536), None);
        assert_eq!(mlp_cluster_for(0, 1536), None);
        // The switch: off by default, 0 to 8 as asked, never off sm_90.
        assert_eq!(mlp_cluster(true, None), 0);
        assert_eq!(mlp_cluster(true, Some(" 8\n")), MLP_CLUSTER);
        assert_eq!(mlp_cluster(true, Some(" 4\n")), 4);
        assert_eq!(mlp_cluster(true, Some("0")), 0);
        assert_eq!(mlp_cluster(true, Some("9")), 0);
        assert_eq!(mlp_cluster(false, Some("8")), 0);
        // SmolLM2's block: two groups of 5 warps; the staged rows (9,216 bytes), 10 partial
        // tiles, 8 x 16 activations.
        assert_eq!(mlp_shared_bytes(576, 10), 9216 + 10 * 512 + 256);
        // With the MLP's sums the one-launch q|k|v and attention keeps the summed rows (f32)
        // after its own memory, at a 16-byte boundary: SmolLM2's chain of four.
        let plain = qkv_attention_shared_bytes(576, 64, 2, 5, 4, false);
        assert_eq!(
            qkv_attention_shared_bytes(576, 64, 2, 5, 4, true),
            plain.next_multiple_of(16) + 4 * 576 * 4
        );
    }

    #[test]
    fn a_decode_layers_qkv_and_attention_block_holds_a_heads_tiles_in_at_most_four_passes() {
        let block = |hidden, head_dim| qkv_attention_block(hidden, head_dim, 512, 1);
        // SmolLM2 (576, 64): 12 tiles, 3 groups of 5 warps (480 threads), four passes; at 640
        // threads 4 groups, three passes. The emulator's shapes (320, 32) and (160, 64): 5
        // groups of 3 warps, 8 of 2.
        assert_eq!(block(576, 64), Some((3, 5)));
        assert_eq!(qkv_attention_block(576, 64, 640, 1), Some((4, 5)));
        assert_eq!(block(320, 32), Some((5, 3)));
        assert_eq!(block(160, 64), Some((8, 2)));
        // Pair inputs of 3 passes x 4 groups x 8 (1,920 bytes), the row, 20 partial tiles, the
        // attention's 20 partials and query.
        assert_eq!(
            qkv_attention_shared_bytes(576, 64, 4, 5, 1, false),
            1920 + 1152 + 20 * 512 + (20 * 66 + 64) * 4
        );
        // Clusters of 6 (2 groups, 6 passes), an 8-token verification: 96 tile rows' pair
        // inputs for each token, the eight rows, 10 partial tiles, the attention's: 31.8 KiB.
        assert_eq!(
            qkv_attention_shared_bytes(576, 64, 2, 5, 8, false),
            96 * 8 * 20 + 8 * 1152 + 10 * 512 + (10 * 66 + 64) * 4
        );
        // Qwen2.5-1.5B (1,536, 128): 12 warps a tile, one group, 24 passes: the two launches.
        assert_eq!(block(1536, 128), None);
        // Llama-3.2-1B-like (2,048, 64): 16 warps a tile, one group, 12 passes.
        assert_eq!(block(2048, 64), None);
        // A head size the attention does not take.
        assert_eq!(block(576, 48), None);
        for (hidden, head_dim) in [(576, 64), (320, 32), (160, 64)] {
            let (groups, split) = block(hidden, head_dim).expect("fits");
            assert!(groups * split * 32 <= QKV_ATTENTION_THREADS);
            assert!((3 * head_dim / 16).div_ceil(groups) <= QKV_ATTENTION_MAX_PASSES);
        }
        // Clusters: SmolLM2 in 4 ranks of 3 groups (one pass each), 6 of 2 (one pass each), 2
        // of 3 (two passes each); Qwen2.5-1.5B and the 2,048-wide model in clusters of 8, one
        // group of 12 or 16 warps a rank, 3 and 2 passes a rank.
        let clustered =
            |hidden, head_dim, cluster| qkv_attention_block(hidden, head_dim, 512, cluster);
        assert_eq!(clustered(576, 64, 4), Some((3, 5)));
        assert_eq!(clustered(576, 64, 6), Some((2, 5)));
        assert_eq!(clustered(576, 64, 2), Some((3, 5)));
        assert_eq!(clustered(1536, 128, 8), Some((1, 12)));
        assert_eq!(clustered(2048, 64, 8), Some((1, 16)));
        assert_eq!(clustered(576, 48, 4), None);
        // The cluster switch: 1 to 8 blocks, 6 by default, always 1 off sm_90.
        assert_eq!(qkv_attention_cluster(true, None), QKV_ATTENTION_CLUSTER);
        assert_eq!(qkv_attention_cluster(true, Some(" 6\n")), 6);
        assert_eq!(
            qkv_attention_cluster(true, Some("9")),
            QKV_ATTENTION_CLUSTER
        );
        assert_eq!(
            qkv_attention_cluster(true, Some("0")),
            QKV_ATTENTION_CLUSTER
        );
        assert_eq!(qkv_attention_cluster(false, Some("4")), 1);
        // The switch takes whole warps up to a block's 1,024 threads.
        assert_eq!(qkv_attention_threads(None), 512);
        assert_eq!(qkv_attention_threads(Some(" 640\n")), 640);
        assert_eq!(qkv_attention_threads(Some("650")), 512);
        assert_eq!(qkv_attention_threads(Some("2048")), 512);
    }
}
