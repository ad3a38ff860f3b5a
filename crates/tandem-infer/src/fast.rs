//! The CUDA fast path's names for the driver ([`crate::driver::Engine`] over [`CudaTarget`]),
//! and its static-batch target-only baseline.

use tandem_cuda::CudaTarget;
use tandem_model::sampling::SamplingParams;
use tandem_model::{LogitsFor, TapRequest};

use crate::backend::SpecBackend;
use crate::driver::{Engine, Row, RunningBatch, commit, pick};
use crate::engine::{InferError, Request, SpecOutput};

/// The speculative engine on the CUDA fast path.
pub type FastSpecEngine<'a> = Engine<'a, CudaTarget>;
/// A running batch on the CUDA fast path.
pub type FastRunningBatch = RunningBatch<CudaTarget>;

/// Target-only decoding on the fast path for the same prompts (one static batch, greedy or
/// sampled per `sampling`, stream `seed + i` for sequence `i`): the baseline speculative
/// output is compared with and timed against.
pub fn fast_target_generate(
    target: &CudaTarget,
    prompts: &[Vec<u32>],
    max_new_tokens: usize,
    stop_ids: &[u32],
    sampling: SamplingParams,
    seed: u64,
) -> Result<Vec<SpecOutput>, InferError> {
    sampling.validate()?;
    let max_prompt = prompts.iter().map(Vec::len).max().unwrap_or(0);
    let columns = SpecBackend::cache_columns(target, max_prompt + max_new_tokens + 1);
    let mut cache = SpecBackend::new_cache(target, prompts.len(), columns)?;
    let mut rows: Vec<Row> =
        Request::for_prompts(prompts, max_new_tokens, stop_ids, sampling, seed)
            .into_iter()
            .map(|r| Row::new(r, 0))
            .collect();
    let refs: Vec<&[u32]> = prompts.iter().map(Vec::as_slice).collect();
    let mut step = cache.layout().prefill_step(&refs)?;
    let none = TapRequest::none();
    loop {
        let (logits, _) = SpecBackend::forward(target, &step, &mut cache, &none, LogitsFor::Last)?;
        let next = pick(target, &logits, &mut rows)?;
        for (row, &t) in rows.iter_mut().zip(&next) {
            commit(row, &[t]);
        }
        if rows.iter().all(|r| r.done) {
            break;
        }
        step = cache.layout().decode_step(&next)?;
    }
    Ok(rows.into_iter().map(|r| r.output).collect())
}
