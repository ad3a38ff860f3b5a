//! The tensor-core attention of wide steps (`kernels/attention_mma.cu`): prefills, wide tree
//! verifications and (from width 4) the unfused verifications of batches past the fused
//! kernels' 8 rows, where the row kernel (`attention`, one block per query row and head) reads
//! every visible key row once per query row and head; here once per 64 (slot, query head)
//! rows of a KV head. Compiled on its own for compute_80 (its
//! `mma.sync` needs sm_80), on GPUs that have it, and used for steps of at least N slots a
//! sequence ([`Gpu::set_mma_attention`], `TANDEM_CUDA_MMA_ATTENTION=N`, 0 off; by default
//! [`DEFAULT_MMA_MIN_WIDTH`]). Its indexing is checked on the CPU by an emulator
//! (`tests/emulated_kernels.rs`); its PTX is assembled for sm_80 and sm_90 in CI
//! ([`assemble_mma_attention`]).

use std::ffi::{CStr, CString};
use std::sync::atomic::Ordering;

use cudarc::driver::{CudaFunction, CudaSlice, CudaView, LaunchConfig};

use super::{AttentionShape, Gpu, KernelArgs, mma_source};
use crate::error::CudaError;

pub(super) const MMA_ATTENTION_SOURCE: &str = include_str!("../../../../kernels/attention_mma.cu");

/// Query rows a block takes and cache columns a tile (`MMA_TILE_ROWS`, `MMA_TILE_KEYS`).
const TILE_ROWS: usize = 64;
const TILE_KEYS: usize = 64;
/// Threads a block (`MMA_WARPS` warps of 16 query rows).
const THREADS: u32 = 128;

/// The kernels for head_dim 64 and 128.
pub(super) struct MmaAttention {
    head_dim_64: CudaFunction,
    head_dim_128: CudaFunction,
}

/// `kernels/attention_mma.cu` as PTX for compute_80 (what the GPU loads, and what CI compiles
/// in `compile_all_kernels`).
pub(super) fn compile() -> Result<cudarc::nvrtc::Ptx, CudaError> {
    Ok(cudarc::nvrtc::compile_ptx_with_opts(
        mma_source(MMA_ATTENTION_SOURCE, "attention_mma.cu", ""),
        cudarc::nvrtc::CompileOptions {
            name: Some("attention_mma.cu".into()),
            arch: Some("compute_80"),
            ..Default::default()
        },
    )?)
}

impl MmaAttention {
    pub(super) fn load(
        ctx: &std::sync::Arc<cudarc::driver::CudaContext>,
    ) -> Result<Self, CudaError> {
        let module = ctx.load_module(compile()?)?;
        Ok(Self {
            head_dim_64: module.load_function("attention_mma_64")?,
            head_dim_128: module.load_function("attention_mma_128")?,
        })
    }
}

/// The narrowest step (slots a sequence) the tensor-core kernel takes by default; it also needs
/// [`MMA_MIN_QUERY_ROWS`].
pub const DEFAULT_MMA_MIN_WIDTH: usize = 4;

/// The fewest (slot, query head) rows a step must have for the tensor-core kernel: a block takes
/// 64 rows of one sequence and one KV head, so a small step leaves most SMs idle, while the row
/// kernel spreads one block per row. Measured on an H100 (session 35, `fast-bench`, 512-token
/// context, SmolLM2's 9 heads), tensor cores over the row kernel by rows: 288 (verify 4 at
/// batch 8; verify 32 at batch 1) 0.52-0.56x, 576 (verify 8 at batch 8) 0.71x, 1,152 (verify 4
/// at batch 32) 0.97x, 2,304 (verify 8 at batch 32, verify 32 at batch 8) 1.50-1.60x, 4,608 and
/// up (prefills of 512 tokens at batch 1-32, verify 32 at batch 32) 3-4.7x.
pub const MMA_MIN_QUERY_ROWS: usize = 2048;

/// Whether a step of this shape goes to the tensor cores, with `min_width` the narrowest step
/// allowed (0: never) and `min_rows` the fewest (slot, query head) rows.
pub(super) fn prefers_tensor_cores(
    shape: &AttentionShape,
    min_width: usize,
    min_rows: usize,
) -> bool {
    min_width > 0
        && shape.width >= min_width
        && shape.rows() * shape.heads >= min_rows
        && takes(shape)
}

/// `TANDEM_CUDA_MMA_ATTENTION`'s value as the narrowest step (slots a sequence) the tensor-core
/// kernel takes (with [`MMA_MIN_QUERY_ROWS`]): unset, [`DEFAULT_MMA_MIN_WIDTH`] on GPUs that
/// have the tensor-core `mma.sync` (sm_80 on, `compute_major` >= 8) and off before; a whole
/// number: that width (0: off); anything else: off.
pub(super) fn min_width(value: Option<&str>, compute_major: i32) -> usize {
    match value {
        None if compute_major >= 8 => DEFAULT_MMA_MIN_WIDTH,
        None => 0,
        Some(v) => v.trim().parse().unwrap_or(0),
    }
}

/// Whether the tensor-core kernel can take a step of this shape: head_dim 64 or 128 (what it is
/// compiled for) and whole query-head groups.
pub(super) fn takes(shape: &AttentionShape) -> bool {
    matches!(shape.head_dim, 64 | 128)
        && shape.kv_heads > 0
        && shape.heads.is_multiple_of(shape.kv_heads)
}

impl Gpu {
    /// Steps of at least `min_width` slots a sequence (0: none) and `min_query_rows` (slot,
    /// query head) rows ([`MMA_MIN_QUERY_ROWS`] by default) run the tensor-core attention from
    /// now on (compiled on first use; an error on a GPU before sm_80). CUDA graphs captured
    /// before keep the kernel they captured.
    pub fn set_mma_attention(
        &self,
        min_width: usize,
        min_query_rows: usize,
    ) -> Result<(), CudaError> {
        if min_width > 0 && self.mma_attention.get().is_none() {
            let (major, _) = self.ctx.compute_capability()?;
            if major < 8 {
                return Err(CudaError::Kernel(format!(
                    "the tensor-core attention needs an sm_80 or later GPU; this one is sm_{major}x"
                )));
            }
            let kernels = MmaAttention::load(&self.ctx)?;
            let _ = self.mma_attention.set(kernels);
        }
        self.mma_attention_width.store(min_width, Ordering::Relaxed);
        self.mma_attention_rows
            .store(min_query_rows, Ordering::Relaxed);
        Ok(())
    }

    /// Whether [`Gpu::attention`] gives a step of this shape (no visible-column lists) to the
    /// tensor-core kernel.
    pub(super) fn mma_attention_for(&self, shape: &AttentionShape) -> Option<&MmaAttention> {
        let min_width = self.mma_attention_width.load(Ordering::Relaxed);
        let min_rows = self.mma_attention_rows.load(Ordering::Relaxed);
        let kernels = self.mma_attention.get()?;
        prefers_tensor_cores(shape, min_width, min_rows).then_some(kernels)
    }

    /// [`Gpu::attention`] on the tensor cores (kernels/attention_mma.cu), whatever the step's
    /// width; the caller checked the sizes and [`takes`].
    #[allow(clippy::too_many_arguments)]
    pub(super) fn attention_mma(
        &self,
        kernels: &MmaAttention,
        q: &CudaSlice<f32>,
        k_cache: &CudaSlice<u16>,
        v_cache: &CudaSlice<u16>,
        mask: &CudaSlice<f32>,
        out: &mut CudaSlice<u16>,
        shape: AttentionShape,
        total: usize,
        step_scalars: Option<&CudaView<'_, i32>>,
    ) -> Result<(), CudaError> {
        let s = shape;
        let func = match s.head_dim {
            64 => &kernels.head_dim_64,
            128 => &kernels.head_dim_128,
            other => unreachable!("takes() admits head_dim 64 and 128, not {other}"),
        };
        // A block's rows are (slot, query head) pairs under one KV head.
        let row_tiles = (s.width * (s.heads / s.kv_heads)).div_ceil(TILE_ROWS);
        let blocks = s.batch * s.kv_heads * row_tiles;
        let args = KernelArgs::default()
            .buffer(self, q)
            .buffer(self, k_cache)
            .buffer(self, v_cache)
            .buffer(self, mask)
            .buffer(self, out)
            .int(s.width)
            .int(s.heads)
            .int(s.kv_heads)
            .int(s.capacity)
            .int(total)
            .float(1.0 / (s.head_dim as f32).sqrt())
            .optional_view(self, step_scalars);
        let cfg = LaunchConfig {
            grid_dim: (
                u32::try_from(blocks).expect("blocks fit a grid dimension"),
                1,
                1,
            ),
            block_dim: (THREADS, 1, 1),
            // The key and value tiles, rows padded by 8 bf16.
            shared_mem_bytes: (2 * TILE_KEYS * (s.head_dim + 8) * 2) as u32,
        };
        // SAFETY: the argument list matches `attention_mma_{64,128}` (q, caches, mask, out, five
        // ints, the scale, step scalars); the caller asserted the buffer sizes as for
        // `attention`; key rows are 16-byte aligned (head_dim a multiple of 8, whole
        // allocations); the shared memory is what the kernel indexes (below the 48 KiB a block
        // gets without opting in: 34,816 bytes at head_dim 128).
        unsafe { self.launch_ex(func, cfg, args, None) }
    }
}

/// Assembles `kernels/attention_mma.cu` to machine code for `arch` (e.g. `sm_90`) with NVRTC,
/// which runs ptxas: the PTX text of its `mma.sync` is checked only there (NVRTC's PTX output
/// carries inline PTX unchecked), so CI assembles it without a GPU.
pub fn assemble_mma_attention(arch: &str) -> Result<Assembly, CudaError> {
    assemble(
        &mma_source(MMA_ATTENTION_SOURCE, "attention_mma.cu", ""),
        "attention_mma.cu",
        arch,
    )
}

/// Machine code NVRTC assembled: its size and what ptxas said of each kernel (`-v`: registers,
/// stack frame, spill stores and loads).
#[derive(Debug, Clone)]
pub struct Assembly {
    pub cubin_bytes: usize,
    pub ptxas_log: String,
}

impl Assembly {
    /// The kernels whose registers spill to local memory, with ptxas's line for each (`N bytes
    /// spill stores, N bytes spill loads`). A spill in a latency-bound small-step kernel is a
    /// trip to memory in its inner loop.
    pub fn spills(&self) -> Vec<String> {
        let mut kernel = "";
        let mut out = Vec::new();
        for line in self.ptxas_log.lines() {
            if let Some(at) = line.find("Function properties for ") {
                kernel = line[at + "Function properties for ".len()..].trim();
            } else if line.contains("spill stores")
                && !line.contains(" 0 bytes spill stores, 0 bytes spill loads")
            {
                out.push(format!("{kernel}: {}", line.trim()));
            }
        }
        out
    }
}

/// Assembles `full` (a kernel source as NVRTC gets it, named `file`) to machine code for
/// `arch` with NVRTC, ptxas reporting on each kernel.
pub(super) fn assemble(full: &str, file: &str, arch: &str) -> Result<Assembly, CudaError> {
    use cudarc::nvrtc::{result, sys};
    if !super::nvrtc_present() {
        return Err(CudaError::MissingLibrary(
            "libnvrtc (CUDA runtime compiler)",
        ));
    }
    let failed = |what: String| CudaError::Kernel(format!("{what} (for {arch})"));
    let source = CString::new(full).expect("kernel sources hold no NUL");
    let name = CString::new(file).expect("no NUL");
    let program = result::create_program(&source, Some(&name))
        .map_err(|e| failed(format!("nvrtcCreateProgram: {e:?}")))?;
    // SAFETY: `program` was just created and is destroyed once below; the buffers handed to
    // NVRTC are sized by its own size queries.
    unsafe {
        let compiled = result::compile_program(
            program,
            &[
                format!("--gpu-architecture={arch}"),
                "--ptxas-options=-v".to_string(),
            ],
        );
        let log = result::get_program_log(program)
            .map(|raw| CStr::from_ptr(raw.as_ptr()).to_string_lossy().into_owned())
            .unwrap_or_default();
        let outcome = match compiled {
            Ok(()) => {
                let mut size = 0usize;
                sys::nvrtcGetCUBINSize(program, &mut size)
                    .result()
                    .map(|()| Assembly {
                        cubin_bytes: size,
                        ptxas_log: log,
                    })
                    .map_err(|e| failed(format!("nvrtcGetCUBINSize: {e:?}")))
            }
            Err(e) => Err(failed(format!("assembling kernels/{file} ({e:?}): {log}"))),
        };
        let _ = result::destroy_program(program);
        outcome
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wide_steps_with_many_rows_go_to_the_tensor_cores_as_measured() {
        let smollm2 = |batch, width| AttentionShape {
            batch,
            width,
            heads: 9,
            kv_heads: 3,
            head_dim: 64,
            capacity: 1024,
        };
        let w = DEFAULT_MMA_MIN_WIDTH;
        // Session 35's H100 winners (see MMA_MIN_QUERY_ROWS): (batch, width, tensor cores won).
        for (batch, width, won) in [
            (1, 512, true),
            (32, 512, true),
            (32, 32, true),
            (8, 32, true),
            (32, 8, true),
            (32, 4, false),
            (8, 8, false),
            (8, 4, false),
            (1, 32, false),
            (64, 1, false),
        ] {
            assert_eq!(
                prefers_tensor_cores(&smollm2(batch, width), w, MMA_MIN_QUERY_ROWS),
                won,
                "{batch} x {width}"
            );
        }
        // Off, narrower than asked, or a head size the kernel is not compiled for.
        assert!(!prefers_tensor_cores(
            &smollm2(1, 512),
            0,
            MMA_MIN_QUERY_ROWS
        ));
        assert!(!prefers_tensor_cores(
            &smollm2(32, 8),
            16,
            MMA_MIN_QUERY_ROWS
        ));
        let odd = AttentionShape {
            head_dim: 96,
            ..smollm2(1, 512)
        };
        assert!(!prefers_tensor_cores(&odd, w, MMA_MIN_QUERY_ROWS));
        // Without the row floor (the GPU test's setting) any step of the width goes.
        assert!(prefers_tensor_cores(&smollm2(1, 8), 1, 0));
    }

    #[test]
    fn the_width_switch_reads_whole_numbers_and_is_off_otherwise() {
        assert_eq!(min_width(None, 9), DEFAULT_MMA_MIN_WIDTH);
        assert_eq!(min_width(None, 8), DEFAULT_MMA_MIN_WIDTH);
        assert_eq!(min_width(None, 7), 0);
        assert_eq!(min_width(Some("16"), 9), 16);
        assert_eq!(min_width(Some(" 32\n"), 9), 32);
        assert_eq!(min_width(Some("0"), 9), 0);
        assert_eq!(min_width(Some("on"), 9), 0);
        assert_eq!(min_width(Some("-4"), 9), 0);
    }

    #[test]
    fn only_head_dims_64_and_128_in_whole_groups_are_taken() {
        let shape = |head_dim, heads, kv_heads| AttentionShape {
            batch: 1,
            width: 32,
            heads,
            kv_heads,
            head_dim,
            capacity: 64,
        };
        assert!(takes(&shape(64, 9, 3)));
        assert!(takes(&shape(128, 12, 2)));
        assert!(!takes(&shape(96, 8, 8)));
        assert!(!takes(&shape(256, 8, 8)));
        assert!(!takes(&shape(64, 9, 2)));
    }
}
