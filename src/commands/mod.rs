pub mod bench;
pub mod check_device;
pub mod diagnose;
pub mod dump;
pub mod export;
pub mod fast;
pub mod generate;
pub mod import;
pub mod load_test;
pub mod ranks;
pub mod replay;
pub mod serve;
pub mod spec;
pub mod spec_fast;
pub mod taps;
pub mod train;

use std::path::PathBuf;

use clap::Args;
use tandem_model::backend::DeviceKind;
use tandem_model::burn::prelude::Backend;
use tandem_model::{Execution, ModelError, TargetModel};

/// Where the default model lives after `scripts/fetch_smollm2.sh`.
pub const DEFAULT_MODEL_DIR: &str = "models/SmolLM2-135M-Instruct";

/// `--export DIR --format parquet|csv`: a job's polars tables written as files.
#[derive(Args, Debug)]
pub struct ExportArgs {
    /// Also write the report's tables (polars frames) into this directory.
    #[arg(long)]
    pub export: Option<PathBuf>,
    /// Table file format of `--export`.
    #[arg(long, default_value = "parquet", value_parser = ["parquet", "csv"])]
    pub format: String,
}

impl ExportArgs {
    /// Builds the tables and writes them when `--export` was given, naming each file written.
    pub fn write(
        &self,
        tables: impl FnOnce() -> Result<
            Vec<(&'static str, tandem_stats::DataFrame)>,
            tandem_stats::StatsError,
        >,
    ) -> anyhow::Result<()> {
        let Some(dir) = &self.export else {
            return Ok(());
        };
        for path in tandem_stats::export_tables(dir, &self.format, &tables()?)? {
            eprintln!("wrote {}", path.display());
        }
        Ok(())
    }
}

/// Options shared by every job that runs the target model.
#[derive(Args, Debug, Clone)]
pub struct ModelArgs {
    /// HF model directory (config.json, model.safetensors, tokenizer.json).
    #[arg(long, default_value = DEFAULT_MODEL_DIR)]
    pub model: PathBuf,
    /// cpu (ndarray, f32) or cuda (burn-cuda, bf16; needs a build with --features cuda).
    #[arg(long, default_value = "cpu")]
    pub device: DeviceKind,
    /// auto (micro-batched for batches of two or more sequences on MoE models), plain, or
    /// micro-batched (two micro-batches interleaved layer by layer, the two-batch-overlap
    /// pattern; taps go through the same hook either way).
    #[arg(long, default_value = "auto")]
    pub execution: Execution,
    /// Split the target's blocks over N tensor-parallel ranks (q|k|v and gate|up by output
    /// rows, o_proj and down_proj by input columns, the partial products summed before each
    /// residual add). On the CUDA fast path the ranks are GPUs 0..N, one thread each, summed
    /// by NCCL all-reduces (TANDEM_CUDA_TP_SIMULATE=1: every rank on GPU 0 with host sums, for
    /// tests); on burn they share one process and device and are summed in rank order.
    #[arg(long, default_value_t = 1)]
    pub tp: usize,
}

impl ModelArgs {
    /// The target model of `--model`, run as `--execution` says.
    pub fn load<B: Backend>(&self, device: &B::Device) -> Result<TargetModel<B>, ModelError> {
        let mut model = TargetModel::<B>::load(&self.model, device)?;
        model.execution = self.execution;
        model.set_tensor_parallel(self.tp)?;
        Ok(model)
    }
}

/// Runs `$body` with `B` bound to the backend selected by `$device` and `device` to its device.
#[macro_export]
macro_rules! with_backend {
    ($device:expr, |$b:ident, $dev:ident| $body:expr) => {{
        match $device {
            tandem_model::backend::DeviceKind::Cpu => {
                type $b = tandem_model::backend::CpuBackend;
                let $dev = Default::default();
                $body
            }
            #[cfg(feature = "cuda")]
            tandem_model::backend::DeviceKind::Cuda => {
                type $b = tandem_model::backend::CudaBackend;
                let $dev: tandem_model::burn::backend::cuda::CudaDevice = Default::default();
                tandem_model::burn::tensor::set_default_dtypes::<$b>(
                    &$dev,
                    tandem_model::burn::tensor::DType::BF16,
                    tandem_model::burn::tensor::DType::I32,
                )
                .map_err(|e| anyhow::anyhow!("cannot set bf16 as the CUDA default dtype: {e:?}"))?;
                $body
            }
            #[cfg(not(feature = "cuda"))]
            tandem_model::backend::DeviceKind::Cuda => {
                anyhow::bail!("this binary was built without CUDA support; rebuild with `cargo build --release --features cuda`")
            }
        }
    }};
}

/// clap value parser of counts that must be at least 1 (`--max-tokens`, `--samples`): 0 is
/// refused when parsed, naming the option, instead of failing later with another error.
pub(crate) fn at_least_one(value: &str) -> Result<usize, String> {
    match value.parse::<usize>() {
        Ok(0) => Err("0 is not allowed: give at least 1".to_owned()),
        Ok(n) => Ok(n),
        Err(e) => Err(format!("not a count: {e}")),
    }
}
