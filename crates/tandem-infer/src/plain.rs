//! Target-only decoding with the same running-batch interface as the speculative engine
//! (requests join and leave between steps, columns are reclaimed by compaction): the baseline
//! the server and the benchmarks compare speculation against. The target runs through the same
//! block loop and capture hook (with nothing tapped).

use std::time::Instant;

use burn::prelude::*;
use rand::SeedableRng;
use tandem_model::sampling::SamplingParams;
use tandem_model::{KvCache, LogitsFor, TapRequest, TargetModel};

use crate::admission::Admission;
use crate::engine::{
    Finish, InferError, Progress, Request, SpecOutput, Timings, commit_tokens, pick,
};
use crate::stats::AcceptanceStats;

/// The target alone, one token per sequence per step.
pub struct PlainEngine<'a, B: Backend> {
    pub target: &'a TargetModel<B>,
}

struct PlainSequence {
    request: Request,
    /// The last committed token, fed at the next step.
    next: u32,
    output: SpecOutput,
    rng: rand::rngs::StdRng,
    done: bool,
}

/// The sequences of a [`PlainEngine`] decoding together.
pub struct PlainBatch<B: Backend> {
    cache: Option<KvCache<B>>,
    sequences: Vec<PlainSequence>,
    capacity: usize,
    pub timings: Timings,
    pub compactions: usize,
}

impl<B: Backend> PlainBatch<B> {
    pub fn len(&self) -> usize {
        self.sequences.len()
    }
    pub fn is_empty(&self) -> bool {
        self.sequences.is_empty()
    }
    pub fn ids(&self) -> Vec<u64> {
        self.sequences.iter().map(|s| s.request.id).collect()
    }
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    fn remove(&mut self, row: usize) -> PlainSequence {
        if self.sequences.len() == 1 {
            self.cache = None;
        } else if let Some(cache) = &mut self.cache {
            cache.remove(row);
        }
        self.sequences.remove(row)
    }

    fn retire(&mut self, progress: &mut [Progress]) {
        for row in (0..self.sequences.len()).rev() {
            if self.sequences[row].done {
                let seq = self.remove(row);
                if let Some(p) = progress.iter_mut().find(|p| p.id == seq.request.id) {
                    p.finished = Some(seq.output);
                }
            }
        }
    }
}

impl<B: Backend> PlainEngine<'_, B> {
    pub fn new_batch(&self, capacity: usize) -> PlainBatch<B> {
        PlainBatch {
            cache: None,
            sequences: Vec::new(),
            capacity,
            timings: Timings::default(),
            compactions: 0,
        }
    }

    /// The admission rules of `batch` (shared by every engine): a round is one decode step.
    pub fn admission(&self, batch: &PlainBatch<B>) -> Admission {
        Admission {
            capacity: batch.capacity,
            max_positions: self.target.spec.max_position_embeddings,
            round_width: 1,
            vocab: self.target.spec.vocab_size,
        }
    }

    /// The longest prompt `batch` accepts (one decode step must still fit after it).
    pub fn max_prompt_len(&self, batch: &PlainBatch<B>) -> usize {
        self.admission(batch).max_prompt_len()
    }

    /// Checks a request before anything runs (the rules every engine shares).
    pub fn check_request(&self, batch: &PlainBatch<B>, r: &Request) -> Result<(), InferError> {
        self.admission(batch)
            .check(std::slice::from_ref(r), &batch.ids())
    }

    /// Prefills `requests` on their own and moves them into the batch.
    pub fn admit(
        &self,
        batch: &mut PlainBatch<B>,
        requests: Vec<Request>,
    ) -> Result<Vec<Progress>, InferError> {
        self.admission(batch).check(&requests, &batch.ids())?;
        if requests.is_empty() {
            return Ok(Vec::new());
        }
        let t0 = Instant::now();
        let mut cache = self.target.new_cache(requests.len(), batch.capacity);
        let refs: Vec<&[u32]> = requests.iter().map(|r| r.prompt.as_slice()).collect();
        let step = cache.prefill_step(&refs)?;
        let out = self
            .target
            .forward(&step, &mut cache, &TapRequest::none(), LogitsFor::Last)?;
        let mut rngs: Vec<rand::rngs::StdRng> = requests
            .iter()
            .map(|r| rand::rngs::StdRng::seed_from_u64(r.seed))
            .collect();
        let params: Vec<SamplingParams> = requests.iter().map(|r| r.sampling).collect();
        let first = pick(out.logits.expect("asked for logits"), &params, &mut rngs);
        match &mut batch.cache {
            None => batch.cache = Some(cache),
            Some(c) => c.append(cache)?,
        }
        let mut progress = Vec::with_capacity(requests.len());
        for ((request, rng), &token) in requests.into_iter().zip(rngs).zip(&first) {
            let mut seq = PlainSequence {
                request,
                next: token,
                output: SpecOutput {
                    tokens: Vec::new(),
                    finish: Finish::Length,
                    stats: AcceptanceStats::new(0),
                    rounds_by_shape: Default::default(),
                },
                rng,
                done: false,
            };
            commit_tokens(&seq.request, &mut seq.output, &mut seq.done, &[token]);
            progress.push(Progress {
                id: seq.request.id,
                tokens: seq.output.tokens.clone(),
                accepted: None,
                finished: None,
            });
            batch.sequences.push(seq);
        }
        batch.timings.prefill_s += t0.elapsed().as_secs_f64();
        batch.retire(&mut progress);
        Ok(progress)
    }

    /// Removes a request (its client went away); its output so far is returned.
    pub fn cancel(&self, batch: &mut PlainBatch<B>, id: u64) -> Option<SpecOutput> {
        let row = batch.sequences.iter().position(|s| s.request.id == id)?;
        Some(batch.remove(row).output)
    }

    /// One decode step for every running sequence.
    pub fn step(&self, batch: &mut PlainBatch<B>) -> Result<Vec<Progress>, InferError> {
        let mut progress = Vec::new();
        let needs_room = batch
            .cache
            .as_ref()
            .is_some_and(|c| c.used() + 1 > c.capacity());
        if needs_room {
            let cache = batch.cache.as_mut().expect("checked");
            cache.compact();
            batch.compactions += 1;
            for (row, seq) in batch.sequences.iter_mut().enumerate() {
                if cache.seq_len(row) + 1 > cache.capacity() {
                    seq.output.finish = Finish::ContextFull;
                    seq.done = true;
                    progress.push(Progress {
                        id: seq.request.id,
                        tokens: Vec::new(),
                        accepted: None,
                        finished: None,
                    });
                }
            }
            batch.retire(&mut progress);
        }
        let Some(cache) = &mut batch.cache else {
            return Ok(progress);
        };
        let t0 = Instant::now();
        let tokens: Vec<u32> = batch.sequences.iter().map(|s| s.next).collect();
        let step = cache.decode_step(&tokens)?;
        let out = self
            .target
            .forward(&step, cache, &TapRequest::none(), LogitsFor::Last)?;
        let params: Vec<SamplingParams> =
            batch.sequences.iter().map(|s| s.request.sampling).collect();
        let mut rngs: Vec<rand::rngs::StdRng> = batch
            .sequences
            .iter_mut()
            .map(|s| std::mem::replace(&mut s.rng, rand::rngs::StdRng::seed_from_u64(0)))
            .collect();
        let next = pick(out.logits.expect("asked for logits"), &params, &mut rngs);
        for ((seq, rng), token) in batch.sequences.iter_mut().zip(rngs).zip(next) {
            seq.rng = rng;
            seq.next = token;
            let before = seq.output.tokens.len();
            commit_tokens(&seq.request, &mut seq.output, &mut seq.done, &[token]);
            progress.push(Progress {
                id: seq.request.id,
                tokens: seq.output.tokens[before..].to_vec(),
                accepted: None,
                finished: None,
            });
        }
        batch.timings.verify_s += t0.elapsed().as_secs_f64();
        batch.retire(&mut progress);
        Ok(progress)
    }
}
