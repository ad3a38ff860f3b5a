//! The backends, named in one place. CPU (burn-flex, f32) is the default; the `cuda` feature
//! adds burn-cuda in bf16.

/// CPU backend used by tests, CI and `--device cpu`: burn-flex (f32), whose matmuls go to the
/// `gemm` crate with no copy of the operands. burn-ndarray copies both operands of every matmul
/// (its reshape makes an owned array) and packs the whole right-hand side even for one row, so
/// a SmolLM2 decode step read the 540 MB of f32 weights three times: Flex decodes 5.2x faster on
/// the same two cores with the same greedy tokens (`examples/cpu_backends.rs`, BENCHMARKS.md).
/// The tests that train tiny heads keep `NdArray` (its f64 device is the precision reference).
pub type CpuBackend = burn::backend::Flex;

/// GPU backend for `--device cuda` (bf16 weights and activations).
#[cfg(feature = "cuda")]
pub type CudaBackend = burn::backend::Cuda<half::bf16, i32>;

/// Where a job runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DeviceKind {
    #[default]
    Cpu,
    Cuda,
}

impl std::str::FromStr for DeviceKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "cpu" => Ok(Self::Cpu),
            "cuda" | "gpu" => Ok(Self::Cuda),
            other => Err(format!("unknown device {other:?} (cpu, cuda)")),
        }
    }
}

impl std::fmt::Display for DeviceKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Cpu => "cpu",
            Self::Cuda => "cuda",
        })
    }
}
