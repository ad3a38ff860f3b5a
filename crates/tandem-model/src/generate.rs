//! Target-only generation (no drafting): prefill, then one decode step per token. The
//! speculative engine is measured against this.

use std::time::Instant;

use burn::prelude::*;
use rand::SeedableRng;

use crate::capture::TapRequest;
use crate::error::ModelError;
use crate::model::{LogitsFor, TargetModel};
use crate::sampling::{SamplingParams, distribution, sample_from};

#[derive(Debug, Clone)]
pub struct GenerateOptions {
    pub max_new_tokens: usize,
    pub sampling: SamplingParams,
    /// Token ids that end the sequence (not included in the output).
    pub stop_ids: Vec<u32>,
    pub seed: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// A stop token was produced.
    Stop,
    /// `max_new_tokens` reached.
    Length,
    /// The KV cache (context) is full.
    ContextFull,
}

#[derive(Debug, Clone)]
pub struct Generation {
    pub tokens: Vec<u32>,
    pub finish_reason: FinishReason,
    /// Seconds from the start of prefill to the first new token on the host.
    pub time_to_first_token: f64,
    /// Seconds spent in decode steps after the first token.
    pub decode_seconds: f64,
}

impl Generation {
    /// Tokens per second of the decode phase (tokens after the first).
    pub fn decode_tokens_per_second(&self) -> f64 {
        let n = self.tokens.len().saturating_sub(1);
        if self.decode_seconds > 0.0 {
            n as f64 / self.decode_seconds
        } else {
            0.0
        }
    }
}

/// Picks the next token from `logits: [1, 1, vocab]`. Greedy argmax runs on the device and
/// reads back one id; sampling reads the row to the host.
pub fn pick_next<B: Backend>(
    logits: Tensor<B, 3>,
    sampling: &SamplingParams,
    rng: &mut rand::rngs::StdRng,
) -> u32 {
    if sampling.is_greedy() {
        let id = logits.argmax(2).into_data().convert::<i64>();
        id.as_slice::<i64>().expect("argmax returns integers")[0] as u32
    } else {
        let row = logits.into_data().convert::<f32>();
        let row = row.as_slice::<f32>().expect("logits are floats");
        sample_from(&distribution(row, sampling), rng) as u32
    }
}

/// Generates up to `max_new_tokens` after `prompt` for one sequence.
pub fn generate<B: Backend>(
    model: &TargetModel<B>,
    prompt: &[u32],
    options: &GenerateOptions,
) -> Result<Generation, ModelError> {
    options.sampling.validate()?;
    if prompt.is_empty() {
        return Err(ModelError::InvalidStep {
            reason: "the prompt is empty".into(),
        });
    }
    let capacity = (prompt.len() + options.max_new_tokens).min(model.spec.max_position_embeddings);
    if prompt.len() >= capacity {
        return Err(ModelError::CacheFull {
            needed: prompt.len() + 1,
            capacity: model.spec.max_position_embeddings,
        });
    }
    let mut rng = rand::rngs::StdRng::seed_from_u64(options.seed);
    let mut cache = model.new_cache(1, capacity);
    let start = Instant::now();
    let step = cache.prefill_step(&[prompt])?;
    let out = model.forward(&step, &mut cache, &TapRequest::none(), LogitsFor::Last)?;
    let mut next = pick_next(
        out.logits.expect("asked for logits"),
        &options.sampling,
        &mut rng,
    );
    let time_to_first_token = start.elapsed().as_secs_f64();
    let decode_start = Instant::now();
    let mut tokens = Vec::new();
    let finish_reason = loop {
        if options.stop_ids.contains(&next) {
            break FinishReason::Stop;
        }
        tokens.push(next);
        if tokens.len() >= options.max_new_tokens {
            break FinishReason::Length;
        }
        if cache.used() >= cache.capacity() {
            break FinishReason::ContextFull;
        }
        let step = cache.decode_step(&[next])?;
        let out = model.forward(&step, &mut cache, &TapRequest::none(), LogitsFor::Last)?;
        next = pick_next(
            out.logits.expect("asked for logits"),
            &options.sampling,
            &mut rng,
        );
    };
    Ok(Generation {
        tokens,
        finish_reason,
        time_to_first_token,
        decode_seconds: decode_start.elapsed().as_secs_f64(),
    })
}
