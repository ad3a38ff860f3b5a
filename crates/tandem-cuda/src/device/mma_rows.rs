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

use std::sync::atomic::Ordering;

use cudarc::driver::{CudaFunction, LaunchConfig};

use super::{GEMV_MAX_ROWS, GEMV_MAX_SHARED_BYTES, Gpu, mma_attention, mma_source};
use crate::error::CudaError;

pub(super) const MMA_ROWS_SOURCE: &str = include_str!("../../../../kernels/rows_mma.cu");

/// Chunks of 32 input values a warp loads at once (`MMA_ROWS_CHUNKS`) and the most warps a
/// tile's block splits its k range over (`MMA_ROWS_MAX_SPLIT`).
const CHUNKS_A_WARP: usize = 4;
const MAX_SPLIT: usize = 16;

/// Static shared memory of a block: one f32 partial tile (4 values a lane) per warp.
const PARTIAL_BYTES: usize = MAX_SPLIT * 4 * 32 * 4;

/// The four kernels, and the grid order they were compiled for.
pub(super) struct MmaRows {
    pub(super) gemv_rows: CudaFunction,
    pub(super) gemv_norm_rows: CudaFunction,
    pub(super) norm_gate_up_silu: CudaFunction,
    pub(super) norm_qkv_rope: CudaFunction,
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
) -> Result<cudarc::nvrtc::Ptx, CudaError> {
    let pdl = super::pdl_defines(programmatic, late);
    let order = if groups_in_y {
        "#define MMA_GROUPS_IN_Y 1\n"
    } else {
        ""
    };
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
        let module = ctx.load_module(compile(programmatic, groups_in_y, late)?)?;
        Ok(Self {
            gemv_rows: module.load_function("gemv_rows_mma")?,
            gemv_norm_rows: module.load_function("gemv_norm_rows_mma")?,
            norm_gate_up_silu: module.load_function("norm_gate_up_silu_mma")?,
            norm_qkv_rope: module.load_function("norm_qkv_rope_mma")?,
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
    compute_major >= 8 && value.map(str::trim) != Some("0")
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
}

/// Assembles `kernels/rows_mma.cu` to machine code for `arch` (e.g. `sm_90`): its `mma.sync`
/// is inline PTX, which only ptxas checks (see [`mma_attention::assemble_mma_attention`]).
pub fn assemble_mma_rows(arch: &str) -> Result<mma_attention::Assembly, CudaError> {
    mma_attention::assemble(
        &mma_source(MMA_ROWS_SOURCE, "rows_mma.cu", ""),
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
}
