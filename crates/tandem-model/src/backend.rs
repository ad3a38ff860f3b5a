//! The backends, named in one place. CPU (ndarray, f32) is the default; the `cuda` feature adds
//! burn-cuda in bf16.

/// CPU backend used by tests, CI and `--device cpu`.
pub type CpuBackend = burn::backend::NdArray<f32>;

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
