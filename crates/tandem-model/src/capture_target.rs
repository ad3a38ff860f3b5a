//! What the jobs that run a target need of it (the dump's capture and regeneration, replay's
//! candidate taps), defined next to the model so each execution path implements it where it
//! lives: the burn model here, the CUDA fast path in `tandem-cuda`. On a GPU the dump and replay
//! take the path serving takes, so the hidden states a head is trained on come from the very
//! kernels that feed it when it serves.

use rand::rngs::StdRng;

use crate::burn::prelude::*;
use crate::sampling::{distribution, sample_from};
use crate::{LogitsFor, ModelError, ModelSpec, SamplingParams, TapRequest, TargetModel};

/// A target the dump, online capture and replay jobs run: one prefill through the capture hook,
/// batched generation, and the norm weights replay needs for its normed candidates.
pub trait CaptureTarget {
    /// The model's dimensions.
    fn spec(&self) -> &ModelSpec;
    /// One prefill of `ids` through the capture hook with `request`'s taps: per tap, in request
    /// order, its `[tokens, hidden]` f32 values on the host. The dump and replay both capture
    /// through this one method.
    fn capture_taps(&self, ids: &[u32], request: &TapRequest) -> Result<Vec<Vec<f32>>, ModelError>;
    /// Generates for a ragged batch of prompts; returns per sequence its tokens (without the
    /// stop token) and whether it stopped on a stop token (false: budget reached).
    fn generate_batch(
        &self,
        prompts: &[&[u32]],
        budgets: &[usize],
        sampling: &SamplingParams,
        rngs: &mut [StdRng],
        stop_ids: &[u32],
    ) -> Result<Vec<(Vec<u32>, bool)>, ModelError>;
    /// Block `k`'s `input_layernorm` weight, on the host.
    fn input_norm(&self, k: usize) -> Result<Vec<f32>, ModelError>;
    /// The final norm's weight, on the host.
    fn final_norm(&self) -> Result<Vec<f32>, ModelError>;
    /// Whether [`CaptureTarget::block_partial_sums`] gives values (a dense model on burn).
    fn computes_partial_sums(&self) -> bool {
        false
    }
    /// Tensor-parallel partial sums of block outputs (`TargetModel::block_partial_sums`), for
    /// replay to name a capture taken before the all-reduce, from the residual stream entering
    /// each block (`(k, [tokens, hidden])`, the taps replay already captured). `None` where the
    /// backend does not compute them (replay then leaves them out of its candidates).
    #[allow(clippy::type_complexity)]
    fn block_partial_sums(
        &self,
        _blocks: &[(usize, &[f32])],
        _degrees: &[usize],
    ) -> Result<Option<Vec<(usize, usize, usize, Vec<f32>)>>, ModelError> {
        Ok(None)
    }
}

/// The decode loop both targets share: `forward(inputs)` runs one step (the prompts first, then
/// one token per running sequence, an empty slice for finished ones) and returns every
/// sequence's next token.
pub fn decode_loop(
    prompts: &[&[u32]],
    budgets: &[usize],
    stop_ids: &[u32],
    mut forward: impl FnMut(&[&[u32]]) -> Result<Vec<u32>, ModelError>,
) -> Result<Vec<(Vec<u32>, bool)>, ModelError> {
    let n = prompts.len();
    let mut next = forward(prompts)?;
    let mut tokens: Vec<Vec<u32>> = vec![Vec::new(); n];
    let mut done = vec![false; n];
    let mut stopped = vec![false; n];
    loop {
        for b in 0..n {
            if done[b] {
                continue;
            }
            if stop_ids.contains(&next[b]) {
                done[b] = true;
                stopped[b] = true;
            } else {
                tokens[b].push(next[b]);
                done[b] = tokens[b].len() >= budgets[b];
            }
        }
        if done.iter().all(|&d| d) {
            break;
        }
        let inputs: Vec<&[u32]> = (0..n)
            .map(|b| {
                if done[b] {
                    &[][..]
                } else {
                    std::slice::from_ref(&next[b])
                }
            })
            .collect();
        next = forward(&inputs)?;
    }
    Ok(tokens.into_iter().zip(stopped).collect())
}

/// Columns a batch generation needs.
pub fn capacity(prompts: &[&[u32]], budgets: &[usize]) -> usize {
    prompts.iter().map(|p| p.len()).max().unwrap_or(0) + budgets.iter().copied().max().unwrap_or(0)
}

impl<B: Backend> CaptureTarget for TargetModel<B> {
    fn spec(&self) -> &ModelSpec {
        &self.spec
    }

    fn computes_partial_sums(&self) -> bool {
        !self.spec.is_moe()
    }

    fn block_partial_sums(
        &self,
        blocks: &[(usize, &[f32])],
        degrees: &[usize],
    ) -> Result<Option<Vec<(usize, usize, usize, Vec<f32>)>>, ModelError> {
        TargetModel::block_partial_sums(self, blocks, degrees).map(Some)
    }

    fn capture_taps(&self, ids: &[u32], request: &TapRequest) -> Result<Vec<Vec<f32>>, ModelError> {
        let mut cache = self.new_cache(1, ids.len());
        let step = cache.prefill_step(&[ids])?;
        let out = self.forward(&step, &mut cache, request, LogitsFor::None)?;
        // The CUDA backend computes in bf16: widen before reading.
        Ok(out.taps.tensors.into_iter().map(to_host).collect())
    }

    fn generate_batch(
        &self,
        prompts: &[&[u32]],
        budgets: &[usize],
        sampling: &SamplingParams,
        rngs: &mut [StdRng],
        stop_ids: &[u32],
    ) -> Result<Vec<(Vec<u32>, bool)>, ModelError> {
        let mut cache = self.new_cache(prompts.len(), capacity(prompts, budgets));
        decode_loop(prompts, budgets, stop_ids, |inputs| {
            let step = cache.prefill_step(inputs)?;
            let out = self.forward(&step, &mut cache, &TapRequest::none(), LogitsFor::Last)?;
            Ok(pick_burn(
                out.logits.expect("asked for logits"),
                inputs,
                sampling,
                rngs,
            ))
        })
    }

    fn input_norm(&self, k: usize) -> Result<Vec<f32>, ModelError> {
        Ok(to_host(self.layers[k].input_layernorm.weight.clone()))
    }

    fn final_norm(&self) -> Result<Vec<f32>, ModelError> {
        Ok(to_host(self.norm.weight.clone()))
    }
}

/// A tensor's values on the host as f32, whatever the backend computes in.
pub(crate) fn to_host<B: Backend, const D: usize>(t: Tensor<B, D>) -> Vec<f32> {
    t.into_data()
        .convert::<f32>()
        .to_vec::<f32>()
        .expect("converted to f32")
}

/// Next token of every sequence from `logits: [batch, 1, vocab]`. Greedy runs the argmax on
/// the device; sampling reads the rows back ([`sample_rows`]).
fn pick_burn<B: Backend>(
    logits: Tensor<B, 3>,
    inputs: &[&[u32]],
    sampling: &SamplingParams,
    rngs: &mut [StdRng],
) -> Vec<u32> {
    let vocab = logits.dims()[2];
    if sampling.is_greedy() {
        let ids = logits.argmax(2).into_data().convert::<i64>();
        ids.as_slice::<i64>()
            .expect("argmax returns integers")
            .iter()
            .map(|&i| i as u32)
            .collect()
    } else {
        let rows = logits.into_data().convert::<f32>();
        let rows = rows.as_slice::<f32>().expect("logits are floats");
        sample_rows(rows, vocab, inputs, sampling, rngs)
    }
}

/// Draws each running sequence's next token from its row of `host: [batch, vocab]` with the
/// sequence's own stream. A finished sequence (empty input) reads a padding row: nothing to
/// draw from, its token is 0 and its stream is left alone.
pub fn sample_rows(
    host: &[f32],
    vocab: usize,
    inputs: &[&[u32]],
    sampling: &SamplingParams,
    rngs: &mut [StdRng],
) -> Vec<u32> {
    (0..inputs.len())
        .map(|b| {
            if inputs[b].is_empty() {
                return 0;
            }
            let probs = distribution(&host[b * vocab..(b + 1) * vocab], sampling);
            sample_from(&probs, &mut rngs[b]) as u32
        })
        .collect()
}
