//! A [`SpecBackend`] with no device and no model: the target's greedy continuation of a token is
//! a fixed hash of it, and the head guesses that continuation right for a set share of tokens.
//! Its steps cost next to nothing, so the driver's own host time per round (admission,
//! the policy's choice, the steps' inputs, acceptance, commit, cache bookkeeping) is what a run
//! over it measures (`cargo run --release -p tandem-infer --example driver_host_time`): on a
//! GPU that time sits between the read-back of one round and the launches of the next.
//!
//! The cache keeps the real [`ColumnLayout`] (the driver reads and edits it directly), so every
//! step is checked against the layout as a real backend's is; rows and logits keep only their
//! shapes and, for logits, each row's greedy id.

use tandem_model::{ColumnLayout, LogitsFor, StepInput, TapRequest, Taps};

use super::{SpecBackend, host_chain, host_extend_greedy, with_chain_tokens, with_greedy_tokens};
use crate::engine::InferError;

/// The target: `vocab` tokens, greedy continuation [`ScriptedTarget::next`].
#[derive(Debug, Clone)]
pub struct ScriptedTarget {
    pub vocab: usize,
    pub max_positions: usize,
    /// Width of the rows a tap holds (only its shape is kept).
    pub hidden: usize,
}

/// The head: drafts [`ScriptedHead::draft`], which is the target's continuation for a share
/// `accept_per_mille / 1000` of tokens (fixed per token) and another token otherwise.
#[derive(Debug, Clone)]
pub struct ScriptedHead {
    pub vocab: usize,
    pub hidden: usize,
    pub accept_per_mille: u64,
}

/// A KV cache's column bookkeeping without the keys and values.
#[derive(Debug, Clone)]
pub struct ScriptedCache {
    layout: ColumnLayout,
}

/// Rows `[n, d]`: the shape only.
#[derive(Debug, Clone, PartialEq)]
pub struct ScriptedRows {
    pub n: usize,
    pub d: usize,
}

/// Logits: each row's greedy id (the row is one-hot there when read back).
#[derive(Debug, Clone, PartialEq)]
pub struct ScriptedLogits {
    pub ids: Vec<u32>,
    pub vocab: usize,
}

/// splitmix64: a fixed, well-mixed function of a token.
fn mix(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl ScriptedTarget {
    /// The target's greedy token after `token`.
    pub fn next(&self, token: u32) -> u32 {
        (mix(u64::from(token)) % self.vocab as u64) as u32
    }

    fn logits(&self, step: &StepInput, logits_for: LogitsFor) -> ScriptedLogits {
        let ids = match logits_for {
            LogitsFor::All => step.tokens.iter().map(|&t| self.next(t)).collect(),
            LogitsFor::Last => step
                .last_real()
                .iter()
                .enumerate()
                .map(|(b, i)| self.next(step.tokens[b * step.width + i.unwrap_or(0)]))
                .collect(),
            LogitsFor::None => Vec::new(),
        };
        ScriptedLogits {
            ids,
            vocab: self.vocab,
        }
    }

    fn taps(&self, request: &TapRequest, rows: usize) -> Taps<ScriptedRows> {
        Taps {
            taps: request.taps.clone(),
            tensors: vec![
                ScriptedRows {
                    n: rows,
                    d: self.hidden,
                };
                request.taps.len()
            ],
            visited: request.taps.clone(),
        }
    }
}

impl ScriptedHead {
    /// Whether the head guesses the continuation of `token` right.
    pub fn guesses(&self, token: u32) -> bool {
        mix(u64::from(token) ^ 0x5EED) % 1000 < self.accept_per_mille
    }

    /// The head's draft after `token`, for a target whose continuation is `next`.
    pub fn draft(&self, target_next: u32, token: u32) -> u32 {
        if self.guesses(token) {
            target_next
        } else {
            (target_next + 1) % self.vocab as u32
        }
    }

    fn logits(&self, target: &ScriptedTarget, tokens: impl Iterator<Item = u32>) -> ScriptedLogits {
        ScriptedLogits {
            ids: tokens.map(|t| self.draft(target.next(t), t)).collect(),
            vocab: self.vocab,
        }
    }
}

impl ScriptedCache {
    /// Checks `step` against the layout and takes its columns, as a real step's cache write.
    fn write(&mut self, step: &StepInput) -> Result<(), InferError> {
        self.layout.check_step(step)?;
        self.layout.advance(step);
        Ok(())
    }
}

impl SpecBackend for ScriptedTarget {
    type Head = ScriptedHead;
    type Cache = ScriptedCache;
    type Rows = ScriptedRows;
    type Logits = ScriptedLogits;
    type KeptTaps = std::convert::Infallible;

    fn vocab_size(&self) -> usize {
        self.vocab
    }
    fn max_positions(&self) -> usize {
        self.max_positions
    }
    fn layout(cache: &ScriptedCache) -> &ColumnLayout {
        &cache.layout
    }
    fn layout_mut(cache: &mut ScriptedCache) -> &mut ColumnLayout {
        &mut cache.layout
    }
    fn new_cache(&self, rows: usize, capacity: usize) -> Result<ScriptedCache, InferError> {
        Ok(ScriptedCache {
            layout: ColumnLayout::new(rows, capacity),
        })
    }
    fn forward(
        &self,
        step: &StepInput,
        cache: &mut ScriptedCache,
        taps: &TapRequest,
        logits_for: LogitsFor,
    ) -> Result<(ScriptedLogits, Taps<ScriptedRows>), InferError> {
        cache.write(step)?;
        Ok((
            self.logits(step, logits_for),
            self.taps(taps, step.batch * step.width),
        ))
    }

    fn logit_rows(logits: &ScriptedLogits) -> usize {
        logits.ids.len()
    }
    fn argmax(&self, logits: &ScriptedLogits) -> Result<Vec<u32>, InferError> {
        Ok(logits.ids.clone())
    }
    fn logits_to_host(&self, logits: &ScriptedLogits) -> Result<Vec<f32>, InferError> {
        let mut values = vec![0.0; logits.ids.len() * logits.vocab];
        for (r, &id) in logits.ids.iter().enumerate() {
            values[r * logits.vocab + id as usize] = 30.0;
        }
        Ok(values)
    }
    /// The greedy id first, then the ids after it, with probabilities halving from 1/2.
    fn softmax_topk(
        &self,
        logits: &ScriptedLogits,
        k: usize,
    ) -> Result<(Vec<f32>, Vec<u32>), InferError> {
        let mut probs = Vec::with_capacity(logits.ids.len() * k);
        let mut ids = Vec::with_capacity(logits.ids.len() * k);
        for &id in &logits.ids {
            for j in 0..k {
                probs.push(0.5f32.powi(j as i32 + 1));
                ids.push(((id as usize + j) % logits.vocab) as u32);
            }
        }
        Ok((probs, ids))
    }

    fn head_dims(head: &ScriptedHead) -> (usize, usize) {
        (head.hidden, head.vocab)
    }
    fn to_target(_: &ScriptedHead, id: u32) -> u32 {
        id
    }
    fn new_head_cache(
        &self,
        _: &ScriptedHead,
        rows: usize,
        capacity: usize,
    ) -> Result<ScriptedCache, InferError> {
        self.new_cache(rows, capacity)
    }
    fn head_extend(
        &self,
        head: &ScriptedHead,
        cache: &mut ScriptedCache,
        step: &StepInput,
        _: &Taps<ScriptedRows>,
        tap_rows: &[usize],
        last: &[usize],
    ) -> Result<(ScriptedRows, ScriptedLogits), InferError> {
        if tap_rows.len() != step.batch * step.width {
            return Err(InferError::Config {
                field: "tap_rows",
                reason: format!(
                    "{} tap rows for an extend of {} slots",
                    tap_rows.len(),
                    step.batch * step.width
                ),
            });
        }
        cache.write(step)?;
        let rows = ScriptedRows {
            n: last.len(),
            d: head.hidden,
        };
        Ok((
            rows,
            head.logits(self, last.iter().map(|&r| step.tokens[r])),
        ))
    }
    fn head_step(
        &self,
        head: &ScriptedHead,
        cache: &mut ScriptedCache,
        step: &StepInput,
        hidden: ScriptedRows,
    ) -> Result<(ScriptedRows, ScriptedLogits), InferError> {
        if hidden.n != step.batch * step.width {
            return Err(InferError::Config {
                field: "hidden",
                reason: format!(
                    "{} hidden rows for a head step of {} slots",
                    hidden.n,
                    step.batch * step.width
                ),
            });
        }
        cache.write(step)?;
        Ok((hidden, head.logits(self, step.tokens.iter().copied())))
    }

    type Chains = Vec<Vec<u32>>;
    fn head_chains(
        &self,
        head: &ScriptedHead,
        cache: &mut ScriptedCache,
        hidden: &ScriptedRows,
        logits: &ScriptedLogits,
        batch: usize,
        steps: usize,
    ) -> Result<Vec<Vec<u32>>, InferError> {
        host_chain(self, head, cache, hidden, logits, batch, steps)
    }
    fn chains_to_host(&self, chains: &Vec<Vec<u32>>) -> Result<Vec<Vec<u32>>, InferError> {
        Ok(chains.clone())
    }
    fn forward_chains(
        &self,
        step: &StepInput,
        cache: &mut ScriptedCache,
        taps: &TapRequest,
        logits_for: LogitsFor,
        chains: &Vec<Vec<u32>>,
    ) -> Result<(ScriptedLogits, Taps<ScriptedRows>), InferError> {
        let step = with_chain_tokens(step, chains)?;
        SpecBackend::forward(self, &step, cache, taps, logits_for)
    }

    type ReadBack = (Vec<u32>, Vec<Vec<u32>>);
    fn greedy_read_back(
        &self,
        logits: &ScriptedLogits,
        chains: &Vec<Vec<u32>>,
    ) -> Result<Self::ReadBack, InferError> {
        Ok((logits.ids.clone(), chains.clone()))
    }
    fn plain_read_back(&self, logits: &ScriptedLogits) -> Result<Self::ReadBack, InferError> {
        Ok((logits.ids.clone(), Vec::new()))
    }
    fn forward_after_read(
        &self,
        step: &StepInput,
        cache: &mut ScriptedCache,
        taps: &TapRequest,
        logits_for: LogitsFor,
        previous: &Self::ReadBack,
    ) -> Result<(ScriptedLogits, Taps<ScriptedRows>), InferError> {
        let step = with_greedy_tokens(step, &previous.0)?;
        SpecBackend::forward(self, &step, cache, taps, logits_for)
    }
    fn head_extend_greedy(
        &self,
        head: &ScriptedHead,
        cache: &mut ScriptedCache,
        step: &StepInput,
        taps: &Taps<ScriptedRows>,
        read: &Self::ReadBack,
    ) -> Result<(ScriptedRows, ScriptedLogits), InferError> {
        host_extend_greedy(self, head, cache, step, taps, (&read.0, &read.1))
    }
    fn finish_read_back(
        &self,
        read: Self::ReadBack,
    ) -> Result<(Vec<u32>, Vec<Vec<u32>>), InferError> {
        Ok(read)
    }

    fn gather_rows(
        &self,
        sources: &[&ScriptedRows],
        picks: &[(usize, usize)],
    ) -> Result<ScriptedRows, InferError> {
        if let Some(&(s, r)) = picks
            .iter()
            .find(|&&(s, r)| s >= sources.len() || r >= sources[s].n)
        {
            return Err(InferError::Config {
                field: "picks",
                reason: format!("row {r} of source {s} is not there"),
            });
        }
        Ok(ScriptedRows {
            n: picks.len(),
            d: sources.first().map_or(0, |s| s.d),
        })
    }
    fn gather_logits(
        &self,
        sources: &[&ScriptedLogits],
        picks: &[(usize, usize)],
    ) -> Result<ScriptedLogits, InferError> {
        let ids = picks
            .iter()
            .map(|&(s, r)| {
                sources
                    .get(s)
                    .and_then(|l| l.ids.get(r))
                    .copied()
                    .ok_or_else(|| InferError::Config {
                        field: "picks",
                        reason: format!("logits row {r} of source {s} is not there"),
                    })
            })
            .collect::<Result<_, _>>()?;
        Ok(ScriptedLogits {
            ids,
            vocab: sources.first().map_or(self.vocab, |l| l.vocab),
        })
    }
    fn rows_to_host(&self, rows: &ScriptedRows) -> Result<Vec<f32>, InferError> {
        Ok(vec![0.0; rows.n * rows.d])
    }
    fn rows_from_host(
        &self,
        values: &[f32],
        batch: usize,
        width: usize,
        d: usize,
    ) -> Result<ScriptedRows, InferError> {
        if values.len() < batch * width * d {
            return Err(InferError::Config {
                field: "values",
                reason: format!("{} values for {batch} x {width} rows of {d}", values.len()),
            });
        }
        Ok(ScriptedRows {
            n: batch * width,
            d,
        })
    }
    fn last_block_argmax(&self, _: &[f32]) -> Result<Vec<u32>, InferError> {
        Err(InferError::Config {
            field: "hidden",
            reason: "the scripted target has no hidden states to take an argmax over".into(),
        })
    }
    fn zero_rows(&self, rows: usize, width: usize) -> Result<ScriptedRows, InferError> {
        Ok(ScriptedRows { n: rows, d: width })
    }
    fn zero_logits(&self, rows: usize, vocab: usize) -> Result<ScriptedLogits, InferError> {
        Ok(ScriptedLogits {
            ids: vec![0; rows],
            vocab,
        })
    }
    fn backlog_push(
        &self,
        backlog: &mut Option<Taps<ScriptedRows>>,
        at: usize,
        step: &Taps<ScriptedRows>,
    ) -> Result<(), InferError> {
        let incoming = Self::tap_rows(step);
        let tensors = step
            .tensors
            .iter()
            .map(|t| ScriptedRows {
                n: at + incoming,
                d: t.d,
            })
            .collect();
        *backlog = Some(Taps {
            taps: step.taps.clone(),
            tensors,
            visited: Vec::new(),
        });
        Ok(())
    }
    fn push_kept_taps(
        &self,
        _: &mut Option<Taps<ScriptedRows>>,
        _: usize,
        kept: &std::convert::Infallible,
    ) -> Result<usize, InferError> {
        match *kept {}
    }
    fn tap_rows(taps: &Taps<ScriptedRows>) -> usize {
        taps.tensors.first().map_or(0, |t| t.n)
    }

    fn append(&self, cache: &mut ScriptedCache, other: ScriptedCache) -> Result<(), InferError> {
        Ok(cache.layout.append(other.layout)?)
    }
    fn retain(&self, cache: &mut ScriptedCache, keep: &[usize]) -> Result<(), InferError> {
        cache.layout.select(keep);
        Ok(())
    }
    fn compact(&self, cache: &mut ScriptedCache) -> Result<(), InferError> {
        cache.layout.compact();
        Ok(())
    }
}
