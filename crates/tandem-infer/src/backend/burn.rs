//! burn as a [`SpecBackend`] (the ndarray CPU backend in tests and CI, any burn backend
//! otherwise): [`TargetModel`] verifies, [`Eagle3Draft`] drafts. Rows and logits are
//! `[batch, width, d]` tensors read flat (`b * width + i`); gathers are one `select`.

use burn::prelude::*;
use burn::tensor::TensorData;
use burn::tensor::activation::softmax;
use tandem_eagle::Eagle3Draft;
use tandem_model::{ColumnLayout, KvCache, LogitsFor, StepInput, TapRequest, Taps, TargetModel};

use super::{SpecBackend, host_chain, with_chain_tokens};
use crate::engine::InferError;

/// `t: [b, w, d]` as `[b * w, d]`.
fn flat<B: Backend>(t: &Tensor<B, 3>) -> Tensor<B, 2> {
    let [b, w, d] = t.dims();
    t.clone().reshape([b * w, d])
}

fn index<B: Backend>(rows: &[usize], device: &B::Device) -> Tensor<B, 1, Int> {
    let values: Vec<i64> = rows.iter().map(|&r| r as i64).collect();
    Tensor::from_data(TensorData::new(values, [rows.len()]), device)
}

/// Rows `picks[j] = (source, row)` of flat `[_, d]` sources, as `[picks.len(), 1, d]`.
fn gather<B: Backend>(sources: &[&Tensor<B, 3>], picks: &[(usize, usize)]) -> Tensor<B, 3> {
    let mut offsets = Vec::with_capacity(sources.len());
    let mut at = 0;
    for s in sources {
        offsets.push(at);
        let [b, w, _] = s.dims();
        at += b * w;
    }
    let all = Tensor::cat(sources.iter().map(|s| flat(s)).collect(), 0);
    let d = all.dims()[1];
    let rows: Vec<usize> = picks.iter().map(|&(s, r)| offsets[s] + r).collect();
    let device = all.device();
    all.select(0, index::<B>(&rows, &device))
        .reshape([picks.len(), 1, d])
}

fn ints<B: Backend, const D: usize>(t: Tensor<B, D, Int>) -> Vec<u32> {
    t.into_data()
        .convert::<i64>()
        .to_vec::<i64>()
        .expect("ints")
        .into_iter()
        .map(|v| v as u32)
        .collect()
}

fn floats<B: Backend, const D: usize>(t: Tensor<B, D>) -> Vec<f32> {
    t.into_data()
        .convert::<f32>()
        .to_vec::<f32>()
        .expect("floats")
}

impl<B: Backend> SpecBackend for TargetModel<B> {
    type Head = Eagle3Draft<B>;
    type Cache = KvCache<B>;
    type Rows = Tensor<B, 3>;
    type Logits = Tensor<B, 3>;
    type KeptTaps = std::convert::Infallible;

    fn vocab_size(&self) -> usize {
        self.spec.vocab_size
    }
    fn max_positions(&self) -> usize {
        self.spec.max_position_embeddings
    }
    fn layout(cache: &KvCache<B>) -> &ColumnLayout {
        cache.layout()
    }
    fn layout_mut(cache: &mut KvCache<B>) -> &mut ColumnLayout {
        cache.layout_mut()
    }
    fn new_cache(&self, rows: usize, capacity: usize) -> Result<KvCache<B>, InferError> {
        Ok(TargetModel::new_cache(self, rows, capacity))
    }
    fn forward(
        &self,
        step: &StepInput,
        cache: &mut KvCache<B>,
        taps: &TapRequest,
        logits_for: LogitsFor,
    ) -> Result<(Tensor<B, 3>, Taps<Tensor<B, 3>>), InferError> {
        let out = TargetModel::forward(self, step, cache, taps, logits_for)?;
        let logits = out.logits.ok_or_else(|| InferError::Config {
            field: "logits",
            reason: "the driver's target steps ask for logits".into(),
        })?;
        Ok((logits, out.taps))
    }

    fn logit_rows(logits: &Tensor<B, 3>) -> usize {
        let [b, w, _] = logits.dims();
        b * w
    }
    fn argmax(&self, logits: &Tensor<B, 3>) -> Result<Vec<u32>, InferError> {
        Ok(ints(flat(logits).argmax(1)))
    }
    fn logits_to_host(&self, logits: &Tensor<B, 3>) -> Result<Vec<f32>, InferError> {
        Ok(floats(logits.clone()))
    }
    fn softmax_topk(
        &self,
        logits: &Tensor<B, 3>,
        k: usize,
    ) -> Result<(Vec<f32>, Vec<u32>), InferError> {
        let (probs, ids) = softmax(flat(logits), 1).topk_with_indices(k, 1);
        Ok((floats(probs), ints(ids)))
    }

    fn head_dims(head: &Eagle3Draft<B>) -> (usize, usize) {
        (head.spec.hidden_size, head.vocab.draft_size())
    }
    fn to_target(head: &Eagle3Draft<B>, id: u32) -> u32 {
        head.vocab.to_target(id as usize)
    }
    fn new_head_cache(
        &self,
        head: &Eagle3Draft<B>,
        rows: usize,
        capacity: usize,
    ) -> Result<KvCache<B>, InferError> {
        Ok(head.new_cache(rows, capacity))
    }
    fn head_extend(
        &self,
        head: &Eagle3Draft<B>,
        cache: &mut KvCache<B>,
        step: &StepInput,
        taps: &Taps<Tensor<B, 3>>,
        tap_rows: &[usize],
        last: &[usize],
    ) -> Result<(Tensor<B, 3>, Tensor<B, 3>), InferError> {
        let aux = taps.concatenated().ok_or_else(|| InferError::Config {
            field: "taps",
            reason: "draft extend needs the target's taps; the step captured none".into(),
        })?;
        let aux = flat(&aux);
        let d = aux.dims()[1];
        let device = aux.device();
        let aux = aux
            .select(0, index::<B>(tap_rows, &device))
            .reshape([step.batch, step.width, d]);
        let out = head.extend(step, aux, cache)?;
        let picks: Vec<(usize, usize)> = last.iter().map(|&r| (0, r)).collect();
        Ok((
            gather(&[&out.hidden], &picks),
            gather(&[&out.logits], &picks),
        ))
    }
    fn head_step(
        &self,
        head: &Eagle3Draft<B>,
        cache: &mut KvCache<B>,
        step: &StepInput,
        hidden: Tensor<B, 3>,
    ) -> Result<(Tensor<B, 3>, Tensor<B, 3>), InferError> {
        let h = hidden.dims()[2];
        let hidden = hidden.reshape([step.batch, step.width, h]);
        let out = head.forward_step(step, hidden, cache)?;
        Ok((out.hidden, out.logits))
    }

    /// Chains are drafted step by step through the host ([`host_chain`]).
    type Chains = Vec<Vec<u32>>;
    fn head_chains(
        &self,
        head: &Eagle3Draft<B>,
        cache: &mut KvCache<B>,
        hidden: &Tensor<B, 3>,
        logits: &Tensor<B, 3>,
        batch: usize,
        steps: usize,
    ) -> Result<Vec<Vec<u32>>, InferError> {
        host_chain(self, head, cache, hidden, logits, batch, steps)
    }
    fn chains_to_host(&self, chains: &Vec<Vec<u32>>) -> Result<Vec<Vec<u32>>, InferError> {
        Ok(chains.clone())
    }
    /// Read at once: the CPU has no queue to overlap.
    type ReadBack = (Vec<u32>, Vec<Vec<u32>>);
    fn greedy_read_back(
        &self,
        logits: &Tensor<B, 3>,
        chains: &Vec<Vec<u32>>,
    ) -> Result<Self::ReadBack, InferError> {
        Ok((self.argmax(logits)?, chains.clone()))
    }
    fn plain_read_back(&self, logits: &Tensor<B, 3>) -> Result<Self::ReadBack, InferError> {
        Ok((self.argmax(logits)?, Vec::new()))
    }
    fn head_extend_greedy(
        &self,
        head: &Eagle3Draft<B>,
        cache: &mut KvCache<B>,
        step: &StepInput,
        taps: &Taps<Tensor<B, 3>>,
        read: &Self::ReadBack,
    ) -> Result<(Tensor<B, 3>, Tensor<B, 3>), InferError> {
        super::host_extend_greedy(self, head, cache, step, taps, (&read.0, &read.1))
    }
    fn finish_read_back(
        &self,
        read: Self::ReadBack,
    ) -> Result<(Vec<u32>, Vec<Vec<u32>>), InferError> {
        Ok(read)
    }
    fn forward_after_read(
        &self,
        step: &StepInput,
        cache: &mut KvCache<B>,
        taps: &TapRequest,
        logits_for: LogitsFor,
        previous: &Self::ReadBack,
    ) -> Result<(Tensor<B, 3>, Taps<Tensor<B, 3>>), InferError> {
        let step = super::with_greedy_tokens(step, &previous.0)?;
        SpecBackend::forward(self, &step, cache, taps, logits_for)
    }
    fn forward_chains(
        &self,
        step: &StepInput,
        cache: &mut KvCache<B>,
        taps: &TapRequest,
        logits_for: LogitsFor,
        chains: &Vec<Vec<u32>>,
    ) -> Result<(Tensor<B, 3>, Taps<Tensor<B, 3>>), InferError> {
        let step = with_chain_tokens(step, chains)?;
        SpecBackend::forward(self, &step, cache, taps, logits_for)
    }

    fn gather_rows(
        &self,
        sources: &[&Tensor<B, 3>],
        picks: &[(usize, usize)],
    ) -> Result<Tensor<B, 3>, InferError> {
        Ok(gather(sources, picks))
    }
    fn gather_logits(
        &self,
        sources: &[&Tensor<B, 3>],
        picks: &[(usize, usize)],
    ) -> Result<Tensor<B, 3>, InferError> {
        Ok(gather(sources, picks))
    }
    fn rows_to_host(&self, rows: &Tensor<B, 3>) -> Result<Vec<f32>, InferError> {
        Ok(floats(rows.clone()))
    }
    fn rows_from_host(
        &self,
        values: &[f32],
        batch: usize,
        width: usize,
        d: usize,
    ) -> Result<Tensor<B, 3>, InferError> {
        Ok(Tensor::from_data(
            TensorData::new(values.to_vec(), [batch, width, d]),
            self.device(),
        ))
    }
    fn last_block_argmax(&self, hidden: &[f32]) -> Result<Vec<u32>, InferError> {
        let h = self.spec.hidden_size;
        let last = self.rows_from_host(hidden, 1, hidden.len() / h, h)?;
        Ok(ints(self.logits_from_last_block(last).argmax(2)))
    }
    fn zero_rows(&self, rows: usize, width: usize) -> Result<Tensor<B, 3>, InferError> {
        Ok(Tensor::zeros([rows, 1, width], self.device()))
    }
    fn zero_logits(&self, rows: usize, vocab: usize) -> Result<Tensor<B, 3>, InferError> {
        Ok(Tensor::zeros([rows, 1, vocab], self.device()))
    }
    fn backlog_push(
        &self,
        backlog: &mut Option<Taps<Tensor<B, 3>>>,
        at: usize,
        step: &Taps<Tensor<B, 3>>,
    ) -> Result<(), InferError> {
        let tensors = step
            .tensors
            .iter()
            .enumerate()
            .map(|(i, tap)| {
                let [b, w, d] = tap.dims();
                let new = tap.clone().reshape([b * w, 1, d]);
                match backlog.as_ref() {
                    Some(old) if at > 0 => Tensor::cat(
                        vec![old.tensors[i].clone().slice([0..at, 0..1, 0..d]), new],
                        0,
                    ),
                    _ => new,
                }
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
        _: &mut Option<Taps<Tensor<B, 3>>>,
        _: usize,
        kept: &std::convert::Infallible,
    ) -> Result<usize, InferError> {
        match *kept {}
    }
    fn tap_rows(taps: &Taps<Tensor<B, 3>>) -> usize {
        taps.tensors.first().map_or(0, |t| {
            let [b, w, _] = t.dims();
            b * w
        })
    }

    fn append(&self, cache: &mut KvCache<B>, other: KvCache<B>) -> Result<(), InferError> {
        Ok(cache.append(other)?)
    }
    fn retain(&self, cache: &mut KvCache<B>, keep: &[usize]) -> Result<(), InferError> {
        cache.retain(keep);
        Ok(())
    }
    fn compact(&self, cache: &mut KvCache<B>) -> Result<(), InferError> {
        cache.compact();
        Ok(())
    }
}
