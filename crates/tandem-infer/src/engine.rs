//! What every speculative engine shares, whatever its backend: the settings
//! ([`SpecConfig`]), requests and their progress, outputs, time by phase, the commit rule and
//! the errors. The loop itself is [`crate::driver::Engine`].

use burn::prelude::Backend;
use serde::Serialize;
use tandem_model::TargetModel;
use tandem_model::sampling::SamplingParams;

use crate::stats::AcceptanceStats;

/// SGLang's speculative knobs plus sampling.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct SpecConfig {
    /// Draft depth (`--speculative-num-steps`).
    pub num_steps: usize,
    /// Branching (`--speculative-eagle-topk`); 1 = chain drafting.
    pub topk: usize,
    /// Tree size verified, root included (`--speculative-num-draft-tokens`).
    pub num_draft_tokens: usize,
    pub sampling: SamplingParams,
    pub seed: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum InferError {
    #[error("invalid speculative setting {field}: {reason}")]
    Config { field: &'static str, reason: String },
    #[error("invalid request: {reason}")]
    Request { reason: String },
    #[error(transparent)]
    Model(#[from] tandem_model::ModelError),
    #[error(transparent)]
    Draft(#[from] tandem_eagle::EagleError),
    #[error(transparent)]
    Tree(#[from] crate::tree::TreeError),
    #[error(transparent)]
    Cuda(#[from] tandem_cuda::CudaError),
}

impl SpecConfig {
    pub fn chain(num_steps: usize) -> Self {
        Self {
            num_steps,
            topk: 1,
            num_draft_tokens: num_steps + 1,
            sampling: SamplingParams::greedy(),
            seed: 0,
        }
    }

    pub fn validate(&self) -> Result<(), InferError> {
        self.sampling.validate()?;
        if self.num_steps == 0 || self.topk == 0 {
            return Err(InferError::Config {
                field: "num_steps/topk",
                reason: "must be at least 1".into(),
            });
        }
        let candidates = self.topk + (self.num_steps - 1) * self.topk * self.topk;
        if self.num_draft_tokens < 2 || self.num_draft_tokens - 1 > candidates {
            return Err(InferError::Config {
                field: "num_draft_tokens",
                reason: format!(
                    "{} must be in 2..={} for num_steps {} and topk {}",
                    self.num_draft_tokens,
                    candidates + 1,
                    self.num_steps,
                    self.topk
                ),
            });
        }
        Ok(())
    }
}

/// Why a sequence stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum Finish {
    Stop,
    Length,
    ContextFull,
}

/// Where the time of a generation went (host wall clock). A round waits for the device where
/// it reads results back (the verification's, and the drafts' of tree rounds); with phase
/// timing ([`crate::RunningBatch::phase_timing`]) every phase waits for its own device work.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Timings {
    pub prefill_s: f64,
    /// Part of `prefill_s`: allocating the newcomers' target cache and laying out their
    /// prefill (fast path).
    pub prefill_setup_s: f64,
    /// Drafting. Without phase timing, chains are only queued here (their device time shows
    /// in `verify_s`, whose read-back waits for them).
    pub draft_s: f64,
    pub verify_s: f64,
    /// The head's extend over the accepted tokens. Without phase timing only queued here (its
    /// device time shows where the next round waits).
    pub extend_s: f64,
    /// With phase timing, the host's part of `draft_s`, `verify_s` and `extend_s`: the time
    /// to queue the phase's device work, before waiting for it (0 otherwise). A phase whose
    /// queue time is close to its total leaves the device waiting for the host.
    pub draft_queue_s: f64,
    pub verify_queue_s: f64,
    pub extend_queue_s: f64,
    /// Wall time of whole rounds and admissions (engines that record it; the phases above are
    /// parts of it, the rest is host bookkeeping between them).
    pub rounds_wall_s: f64,
    pub admits_wall_s: f64,
    /// The head's catch-ups over deferred plain rounds (fast path).
    pub catch_up_s: f64,
    /// Making room (compaction, sequences at the context limit) and retiring finished
    /// sequences from the caches (fast path).
    pub housekeeping_s: f64,
    /// Parts of `housekeeping_s`: cache compaction (both caches), the head cache's row
    /// removal and the head roots' gather when sequences leave (fast path).
    pub compact_s: f64,
    pub head_retain_s: f64,
    pub head_roots_s: f64,
}

impl std::ops::AddAssign for Timings {
    fn add_assign(&mut self, other: Self) {
        self.prefill_s += other.prefill_s;
        self.prefill_setup_s += other.prefill_setup_s;
        self.draft_s += other.draft_s;
        self.verify_s += other.verify_s;
        self.extend_s += other.extend_s;
        self.draft_queue_s += other.draft_queue_s;
        self.verify_queue_s += other.verify_queue_s;
        self.extend_queue_s += other.extend_queue_s;
        self.rounds_wall_s += other.rounds_wall_s;
        self.admits_wall_s += other.admits_wall_s;
        self.catch_up_s += other.catch_up_s;
        self.housekeeping_s += other.housekeeping_s;
        self.compact_s += other.compact_s;
        self.head_retain_s += other.head_retain_s;
        self.head_roots_s += other.head_roots_s;
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct SpecOutput {
    pub tokens: Vec<u32>,
    pub finish: Finish,
    pub stats: AcceptanceStats,
    /// Rounds by draft shape (`steps/topk/tokens`; `none` for a round without drafts), filled
    /// by the fast path's engine, whose policy may change the shape per round.
    pub rounds_by_shape: std::collections::BTreeMap<String, u64>,
}

#[derive(Debug, Clone, Serialize)]
pub struct BatchOutput {
    pub sequences: Vec<SpecOutput>,
    pub timings: Timings,
}

/// Speculative generation of a batch of prompts, whatever backend runs it: burn
/// ([`crate::SpecEngine`]) or the CUDA fast path ([`crate::FastSpecEngine`]). Jobs that measure
/// online acceptance (`compare`) take it so they run the engine serving runs on that device.
pub trait SpecGenerate {
    /// See [`crate::driver::Engine::generate`].
    fn generate(
        &self,
        prompts: &[Vec<u32>],
        max_new_tokens: usize,
        stop_ids: &[u32],
    ) -> Result<BatchOutput, InferError>;
    /// The engine's tree settings.
    fn config(&self) -> SpecConfig;
}

/// What every engine checks of a request before it joins a batch, whatever the batch: valid
/// sampling, a non-empty prompt inside the vocabulary, a budget of at least one token.
pub(crate) fn check_request_alone(r: &Request, vocab: usize) -> Result<(), InferError> {
    r.sampling.validate()?;
    let reason = if r.prompt.is_empty() {
        "the prompt is empty: it must have at least one token".to_owned()
    } else if let Some(&t) = r.prompt.iter().find(|&&t| t as usize >= vocab) {
        format!("prompt token {t} is outside the vocabulary of {vocab}")
    } else if r.max_new_tokens == 0 {
        "max_new_tokens must be at least 1".to_owned()
    } else {
        return Ok(());
    };
    Err(InferError::Request { reason })
}

/// One request to a [`crate::driver::RunningBatch`]: its own prompt, budget, stop tokens and
/// sampling.
#[derive(Debug, Clone, PartialEq)]
pub struct Request {
    /// The caller's handle; unique within the batch.
    pub id: u64,
    pub prompt: Vec<u32>,
    pub max_new_tokens: usize,
    pub stop_ids: Vec<u32>,
    pub sampling: SamplingParams,
    /// Seed of this request's own sampling stream (results do not depend on batch-mates).
    pub seed: u64,
}

impl Request {
    /// One request per prompt, ids `0..`; request `i` samples from its own stream seeded
    /// `seed + i` (the `generate` of every engine).
    pub(crate) fn for_prompts(
        prompts: &[Vec<u32>],
        max_new_tokens: usize,
        stop_ids: &[u32],
        sampling: SamplingParams,
        seed: u64,
    ) -> Vec<Request> {
        prompts
            .iter()
            .enumerate()
            .map(|(i, prompt)| Request {
                id: i as u64,
                prompt: prompt.clone(),
                max_new_tokens,
                stop_ids: stop_ids.to_vec(),
                sampling,
                seed: seed.wrapping_add(i as u64),
            })
            .collect()
    }
}

/// The `generate` loop of every running batch: admits `requests` (ids `0..n`), steps until the
/// batch is empty and returns each request's output in id order.
pub(crate) fn run_to_completion<Batch>(
    batch: &mut Batch,
    requests: Vec<Request>,
    admit: impl FnOnce(&mut Batch, Vec<Request>) -> Result<Vec<Progress>, InferError>,
    mut step: impl FnMut(&mut Batch) -> Result<Vec<Progress>, InferError>,
    is_empty: impl Fn(&Batch) -> bool,
) -> Result<Vec<SpecOutput>, InferError> {
    let mut outputs: Vec<Option<SpecOutput>> = vec![None; requests.len()];
    let mut progress = admit(batch, requests)?;
    loop {
        for p in progress {
            if let Some(out) = p.finished {
                outputs[p.id as usize] = Some(out);
            }
        }
        if is_empty(batch) {
            break;
        }
        progress = step(batch)?;
    }
    Ok(outputs
        .into_iter()
        .map(|o| o.expect("every sequence finishes"))
        .collect())
}

/// What one sequence produced in one [`crate::driver::Engine::admit`] or
/// [`crate::driver::Engine::step`] call.
#[derive(Debug, Clone)]
pub struct Progress {
    pub id: u64,
    /// Tokens committed by this call (a stop token is not included).
    pub tokens: Vec<u32>,
    /// Draft tokens accepted in this round (`None` for the admission's first token).
    pub accepted: Option<usize>,
    /// The whole output once the sequence has finished; it has then left the batch.
    pub finished: Option<SpecOutput>,
}

/// Head-cache columns a round may use beyond the target's: the scratch of the draft steps,
/// rolled back every round.
pub(crate) fn draft_scratch(cfg: &SpecConfig) -> usize {
    2 * cfg.num_draft_tokens + cfg.num_steps * cfg.topk * (cfg.num_steps + 1) + 8
}

/// Appends `tokens` to `output` until a stop token (not included) or the request's length
/// limit ends it.
pub(crate) fn commit_tokens(
    request: &Request,
    output: &mut SpecOutput,
    done: &mut bool,
    tokens: &[u32],
) {
    for &t in tokens {
        if *done {
            return;
        }
        if request.stop_ids.contains(&t) {
            output.finish = Finish::Stop;
            *done = true;
            return;
        }
        output.tokens.push(t);
        if output.tokens.len() >= request.max_new_tokens {
            output.finish = Finish::Length;
            *done = true;
        }
    }
}

/// Target-only greedy decoding for comparison (what speculative greedy output must equal).
pub fn target_greedy<B: Backend>(
    target: &TargetModel<B>,
    prompt: &[u32],
    max_new_tokens: usize,
    stop_ids: &[u32],
) -> Result<Vec<u32>, InferError> {
    let options = tandem_model::GenerateOptions {
        max_new_tokens,
        sampling: SamplingParams::greedy(),
        stop_ids: stop_ids.to_vec(),
        seed: 0,
    };
    Ok(tandem_model::generate(target, prompt, &options)?.tokens)
}

/// The speculative engine on burn (the CPU backend in tests and CI).
pub type SpecEngine<'a, B> = crate::driver::Engine<'a, TargetModel<B>>;
