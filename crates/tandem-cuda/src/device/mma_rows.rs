//! The fused small steps' matrix products on the tensor cores (`kernels/rows_mma.cu`):
//! [`Gpu::gemv_rows`], [`Gpu::gemv_norm_rows`], [`Gpu::norm_gate_up_silu`] and
//! [`Gpu::norm_qkv_rope`] for steps of at most [`super::GEMV_MAX_ROWS`] rows, one
//! `mma.m16n8k16` per 16 weight rows and 16 input values whatever the row count, so eight rows
//! (an 8-token tree's verification, a batch-8 decode) cost what one does on the CUDA-core
//! kernels' weight traffic. The bits differ from the CUDA-core kernels', and a row's bits must
//! not depend on which kernels a step takes, so the family is chosen once per process
//! (`TANDEM_CUDA_MMA_ROWS`, [`enabled`]) and by the weight's shape only ([`takes`]), never by
//! the row count. Compiled on its own for compute_80 (compute_90 with programmatic dependent
//! launch), on GPUs that have `mma.sync` with bf16; checked on the CPU emulator
//! (`tests/emulated_kernels.rs`) and assembled for sm_80 and sm_90 in CI ([`assemble_mma_rows`]).

use std::sync::atomic::Ordering;

use cudarc::driver::{CudaFunction, CudaSlice, CudaView, LaunchConfig};

use super::{
    GEMV_MAX_ROWS, GEMV_MAX_SHARED_BYTES, Gpu, mma_attention, mma_source, with_attention_block,
};
use crate::error::CudaError;

pub(super) const MMA_ROWS_SOURCE: &str = include_str!("../../../../kernels/rows_mma.cu");

/// kernels/rows_mma.cu behind the attention block its `attention_o_proj_mma` runs.
fn rows_mma_source() -> String {
    with_attention_block(MMA_ROWS_SOURCE, "rows_mma.cu")
}

/// Chunks of 32 input values a warp loads at once (`MMA_ROWS_CHUNKS`) and the most warps a
/// tile's block splits its k range over (`MMA_ROWS_MAX_SPLIT`).
const CHUNKS_A_WARP: usize = 4;
const MAX_SPLIT: usize = 16;

/// Static shared memory of a block: one f32 partial tile (4 values a lane) per warp.
const PARTIAL_BYTES: usize = MAX_SPLIT * 4 * 32 * 4;

/// The five kernels.
pub(super) struct MmaRows {
    pub(super) gemv_rows: CudaFunction,
    pub(super) gemv_norm_rows: CudaFunction,
    pub(super) norm_gate_up_silu: CudaFunction,
    pub(super) norm_qkv_rope: CudaFunction,
    pub(super) attention_o_proj: CudaFunction,
}

/// `kernels/rows_mma.cu` as PTX: compute_80, or compute_90 with `TANDEM_PDL` when the other
/// kernels launch with programmatic dependent launch.
pub(super) fn compile(programmatic: bool) -> Result<cudarc::nvrtc::Ptx, CudaError> {
    let pdl = if programmatic {
        "#define TANDEM_PDL 1\n"
    } else {
        ""
    };
    Ok(cudarc::nvrtc::compile_ptx_with_opts(
        mma_source(&rows_mma_source(), "rows_mma.cu", pdl),
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
    pub(super) fn load(
        ctx: &std::sync::Arc<cudarc::driver::CudaContext>,
        programmatic: bool,
    ) -> Result<Self, CudaError> {
        let module = ctx.load_module(compile(programmatic)?)?;
        Ok(Self {
            gemv_rows: module.load_function("gemv_rows_mma")?,
            gemv_norm_rows: module.load_function("gemv_norm_rows_mma")?,
            norm_gate_up_silu: module.load_function("norm_gate_up_silu_mma")?,
            norm_qkv_rope: module.load_function("norm_qkv_rope_mma")?,
            attention_o_proj: module.load_function("attention_o_proj_mma")?,
        })
    }
}

/// Whether the process takes its fused steps' products on the tensor cores: by default on an
/// sm_80+ GPU (session 40, H100: a batch-8 decode 15% faster, an 8-token verification at batch
/// 1 0.905 ms instead of 1.068, a one-row decode 3% slower; BENCHMARKS.md); `TANDEM_CUDA_MMA_ROWS=0`
/// keeps the CUDA-core kernels.
pub(super) fn enabled(value: Option<&str>, compute_major: i32) -> bool {
    compute_major >= 8 && value.map(str::trim) != Some("0")
}

/// Whether the kernels take a product whose k range is `inputs` inputs of `width` values each:
/// widths that are whole 32-value chunks, and the staged rows of a full step
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

/// The launch of a product over a k range of `width` values with `tiles` tiles (16 weight
/// rows, or 8 output pairs, each) and `shared_bytes` of staged inputs.
pub(super) fn config(tiles: usize, width: usize, shared_bytes: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (u32::try_from(tiles).expect("tiles fit a grid"), 1, 1),
        block_dim: (32 * split(width) as u32, 1, 1),
        shared_mem_bytes: shared_bytes as u32,
    }
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
            let kernels = MmaRows::load(&self.ctx, self.programmatic)?;
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
}

/// Warps of an `attention_o_proj_mma` block, each multiplying one 16-row tile of o_proj at a
/// time.
const ATTENTION_O_PROJ_WARPS: usize = super::ATTENTION_THREADS as usize / 32;

/// Blocks of `attention_o_proj_mma` for each row and head (its grid's y): as many as the
/// output tiles (16 rows of `hidden` each) need at one tile a warp, fewer once the step's rows
/// x heads blocks would pass `sm_count` (warps then take several tiles; every block repeats its
/// row and head's attention, so more blocks than SMs would run it in waves). SmolLM2 (hidden
/// 576: 36 tiles, 9 heads) on 132 SMs: 5 at one or two rows, 3 at four, 1 at eight. The bits
/// do not depend on it: a tile's sums and the residual's are the same whichever block does them.
pub(super) fn attention_o_proj_splits(
    hidden: usize,
    rows: usize,
    heads: usize,
    sm_count: usize,
) -> usize {
    let most = hidden.div_ceil(16).div_ceil(ATTENTION_O_PROJ_WARPS);
    (sm_count / (rows * heads).max(1)).clamp(1, most.max(1))
}

impl Gpu {
    /// Whether fused steps take [`Gpu::attention_o_proj`] (one launch for attention and
    /// o_proj) where it applies: on unless `TANDEM_CUDA_ATTENTION_O_PROJ=0`, and only with the
    /// tensor-core kernels. Like the family, a process decides once: o_proj's sums are
    /// grouped by head, so a row's bits differ from `gemv_rows`'s.
    pub fn attention_o_proj_on(&self) -> bool {
        self.attention_o_proj_on.load(Ordering::Relaxed) && self.mma_rows()
    }

    /// Switches [`Gpu::attention_o_proj_on`] (tests compare the two paths).
    pub fn set_attention_o_proj(&self, on: bool) {
        self.attention_o_proj_on.store(on, Ordering::Relaxed);
    }

    /// Blocks a row and head of [`Gpu::attention_o_proj`] for a step of `rows` rows: what its
    /// `arrivals` needs `rows` times.
    pub fn attention_o_proj_splits(&self, hidden: usize, rows: usize, heads: usize) -> usize {
        attention_o_proj_splits(hidden, rows, heads, self.sm_count)
    }

    /// Attention of a small step's rows over their visible keys (as [`Gpu::attention`] with
    /// `visible`: the same bits) and o_proj added into the residual `y` (`[rows, hidden]`) in
    /// the same launch (`attention_o_proj_mma` in kernels/rows_mma.cu): each (row, head) block
    /// writes its head's share of o_proj into `partials` (`[rows, heads, hidden]`), and the
    /// last of a row's head blocks to count itself in `arrivals` (`[rows *
    /// attention_o_proj_splits]`, zeros, left zeros) adds them in head order. A fused layer is
    /// four launches instead of five; o_proj's sums are grouped by head, so a row's bits
    /// differ from `gemv_rows`'s but not with the step's width.
    #[allow(clippy::too_many_arguments)]
    pub fn attention_o_proj(
        &self,
        q: &CudaSlice<f32>,
        k_cache: &CudaSlice<u16>,
        v_cache: &CudaSlice<u16>,
        mask: &CudaSlice<f32>,
        visible: (&CudaView<'_, i32>, &CudaView<'_, i32>),
        w_o: &CudaSlice<u16>,
        partials: &mut CudaSlice<f32>,
        y: &mut CudaSlice<f32>,
        arrivals: &mut CudaSlice<u32>,
        shape: super::AttentionShape,
        hidden: usize,
        total: usize,
        step_scalars: Option<&CudaView<'_, i32>>,
    ) -> Result<(), CudaError> {
        let s = shape;
        let rows = s.rows();
        let q_dim = s.heads * s.head_dim;
        let mma = self
            .mma_rows
            .get()
            .filter(|_| self.attention_o_proj_on())
            .expect("attention_o_proj needs the tensor-core small steps");
        assert!(
            [32, 64, 128, 256].contains(&s.head_dim),
            "head_dim {}",
            s.head_dim
        );
        assert!(s.heads.is_multiple_of(s.kv_heads) && total <= s.capacity);
        assert!(hidden > 0 && rows <= GEMV_MAX_ROWS);
        assert!(q.len() >= rows * q_dim && mask.len() >= rows * total);
        assert!(k_cache.len() >= s.batch * s.kv_heads * s.capacity * s.head_dim);
        assert!(v_cache.len() >= s.batch * s.kv_heads * s.capacity * s.head_dim);
        assert!(w_o.len() >= hidden * q_dim && partials.len() >= rows * s.heads * hidden);
        assert!(y.len() >= rows * hidden);
        let splits = self.attention_o_proj_splits(hidden, rows, s.heads);
        assert!(
            arrivals.len() >= rows * splits,
            "arrivals of {rows} x {splits}"
        );
        let (list, counts) = visible;
        assert!(list.len() >= rows * s.capacity && counts.len() >= rows);
        let args = super::KernelArgs::default()
            .buffer(self, q)
            .buffer(self, k_cache)
            .buffer(self, v_cache)
            .buffer(self, mask)
            .view(self, list)
            .view(self, counts)
            .buffer(self, w_o)
            .buffer(self, partials)
            .buffer(self, y)
            .buffer(self, arrivals)
            .int(s.width)
            .int(s.heads)
            .int(s.kv_heads)
            .int(s.head_dim)
            .int(s.capacity)
            .int(total)
            .float(1.0 / (s.head_dim as f32).sqrt())
            .optional_view(self, step_scalars)
            .int(hidden);
        let warps = super::ATTENTION_THREADS / 32;
        let head_dim = s.head_dim as u32;
        let cfg = LaunchConfig {
            grid_dim: (
                u32::try_from(rows * s.heads).expect("rows x heads fit a grid dimension"),
                u32::try_from(splits).expect("splits fit"),
                1,
            ),
            block_dim: (super::ATTENTION_THREADS, 1, 1),
            // attention_block's partials and query, then the row's head output (bf16).
            shared_mem_bytes: (warps * (head_dim + 2) + head_dim) * 4 + head_dim * 2,
        };
        // SAFETY: the argument list matches `attention_o_proj_mma`'s signature (q, caches,
        // mask, list, counts, w_o, partials, y, arrivals, seven scalars, step scalars,
        // hidden); sizes asserted; the caches and w_o are whole allocations with rows of whole
        // 32-value chunks (head_dim % 32 == 0), so every 16-byte load is aligned; output rows
        // past `hidden` load a valid row and write nothing; lists hold columns below `total`;
        // `arrivals` holds zeros and is left so; the kernel waits (PDL_WAIT) before reading
        // anything but w_o.
        unsafe {
            if self.attention_pdl {
                self.launch_programmatic(&mma.attention_o_proj, cfg, args, rows)
            } else {
                self.launch_ex(&mma.attention_o_proj, cfg, args, None)
            }
        }
    }
}

/// Assembles `kernels/rows_mma.cu` to machine code for `arch` (e.g. `sm_90`): its `mma.sync`
/// is inline PTX, which only ptxas checks (see [`mma_attention::assemble_mma_attention`]).
pub fn assemble_mma_rows(arch: &str) -> Result<mma_attention::Assembly, CudaError> {
    mma_attention::assemble(
        &mma_source(&rows_mma_source(), "rows_mma.cu", ""),
        "rows_mma.cu",
        arch,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

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
    fn attention_o_proj_blocks_cover_every_tile_and_stay_within_the_sms() {
        // (hidden, rows, heads, SMs, blocks a row and head): SmolLM2 (576: 36 tiles, 9 heads)
        // on an H100's 132 SMs at 1, 2, 4 and 8 rows; the emulator test's 160; one tile;
        // a GPU smaller than one block per row and head.
        for (hidden, rows, heads, sms, splits) in [
            (576, 1, 9, 132, 5),
            (576, 2, 9, 132, 5),
            (576, 4, 9, 132, 3),
            (576, 8, 9, 132, 1),
            (160, 1, 3, 132, 2),
            (16, 1, 9, 132, 1),
            (576, 8, 9, 16, 1),
        ] {
            let got = attention_o_proj_splits(hidden, rows, heads, sms);
            assert_eq!(got, splits, "hidden {hidden}, {rows} rows, {sms} SMs");
            let tiles = hidden.div_ceil(16);
            let per = tiles.div_ceil(got);
            assert!(
                per * got >= tiles && (got - 1) * per < tiles,
                "no empty block"
            );
            assert!(
                rows * heads * got <= sms.max(rows * heads),
                "within the SMs"
            );
        }
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
        let c = config(36, 576, 1152);
        assert_eq!(
            (c.grid_dim.0, c.block_dim.0, c.shared_mem_bytes),
            (36, 160, 1152)
        );
    }
}
