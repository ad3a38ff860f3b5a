//! The CUDA fast path as a [`CaptureTarget`]: the dump, the online capture and replay run the
//! kernels serving runs.

use rand::Rng;
use rand::rngs::StdRng;
use tandem_model::capture_target::{capacity, decode_loop, sample_rows};
use tandem_model::{CaptureTarget, LogitsFor, ModelError, ModelSpec, SamplingParams, TapRequest};

use crate::{CudaError, CudaTarget, DeviceLogits};

/// A fast-path failure, as the model error the capture jobs see (its message unchanged).
impl From<CudaError> for ModelError {
    fn from(e: CudaError) -> Self {
        ModelError::Device(Box::new(e))
    }
}

impl CaptureTarget for CudaTarget {
    fn spec(&self) -> &ModelSpec {
        &self.spec
    }

    /// From the model's CPU f32 copy (the fast path has no single-block kernels for them), so
    /// only where the question arises: a tensor-parallel target (`replay --tp N`), or any with
    /// `TANDEM_REPLAY_PARTIAL_SUMS=1`. A 1.5B target's blocks on the CPU take seconds a sample.
    fn computes_partial_sums(&self) -> bool {
        !self.spec.is_moe()
            && (self.tensor_parallel() > 1
                || std::env::var("TANDEM_REPLAY_PARTIAL_SUMS").is_ok_and(|v| v == "1"))
    }

    fn block_partial_sums(
        &self,
        blocks: &[(usize, &[f32])],
        degrees: &[usize],
    ) -> Result<Option<Vec<(usize, usize, usize, Vec<f32>)>>, ModelError> {
        self.with_cpu_model(|model| model.block_partial_sums(blocks, degrees).map(Some))
    }

    fn capture_taps(&self, ids: &[u32], request: &TapRequest) -> Result<Vec<Vec<f32>>, ModelError> {
        let mut cache = self.new_cache(1, ids.len())?;
        let step = cache.layout().prefill_step(&[ids])?;
        let out = self.forward(&step, &mut cache, request, LogitsFor::None)?;
        Ok(out
            .taps
            .tensors
            .iter()
            .map(|rows| self.gpu().download(&rows.data))
            .collect::<Result<Vec<Vec<f32>>, CudaError>>()?)
    }

    fn generate_batch(
        &self,
        prompts: &[&[u32]],
        budgets: &[usize],
        sampling: &SamplingParams,
        rngs: &mut [StdRng],
        stop_ids: &[u32],
    ) -> Result<Vec<(Vec<u32>, bool)>, ModelError> {
        let mut cache = self.new_cache(prompts.len(), capacity(prompts, budgets))?;
        decode_loop(prompts, budgets, stop_ids, |inputs| {
            let step = cache.layout().prefill_step(inputs)?;
            let out = self.forward(&step, &mut cache, &TapRequest::none(), LogitsFor::Last)?;
            let logits: DeviceLogits = out.logits.expect("asked for logits");
            if sampling.is_greedy() {
                return Ok(logits.argmax()?);
            }
            if sampling.top_k == 0 {
                // Drawn on the GPU: a batch of 256 rows would otherwise read 50 MB of logits
                // back per step and sort every row on the host. Each running sequence takes
                // its seed from its own stream, so its reply still does not depend on the
                // batch; a finished one leaves its stream alone.
                let seeds: Vec<u64> = inputs
                    .iter()
                    .zip(rngs.iter_mut())
                    .map(|(input, rng)| if input.is_empty() { 0 } else { rng.random() })
                    .collect();
                return Ok(logits.sample(sampling.temperature, sampling.top_p, &seeds)?);
            }
            let host = logits.to_host()?;
            Ok(sample_rows(&host, logits.vocab, inputs, sampling, rngs))
        })
    }

    fn input_norm(&self, k: usize) -> Result<Vec<f32>, ModelError> {
        self.input_norm_weight(k).map_err(ModelError::from)
    }

    fn final_norm(&self) -> Result<Vec<f32>, ModelError> {
        self.final_norm_weight().map_err(ModelError::from)
    }
}
