//! The training objective and its metrics, aligned as SpecForge aligns them
//! (`specforge/core/eagle3.py`, `OfflineEagle3Model.forward` and `_compute_target_p_padded`;
//! the offline dataset's `process_data` shifts target and input ids once and zeroes the last
//! loss-mask entry).
//!
//! With `logits_T[u]` the target's logits after tokens `0..=u` (recomputed from the dumped
//! last-block residual), TTT step `i` at index `t`:
//!
//! - predicts token `t + 2 + i`, so its target distribution is `softmax(logits_T[t + 1 + i])`
//!   restricted to the draft vocabulary (renormalised over it);
//! - counts where `loss_mask[t + i] == 1` (the loss mask shifted `i` times, its last real
//!   entry zeroed) and the target's argmax at `t + 1 + i` is in the draft vocabulary
//!   (`t2d[argmax]`): the position mask;
//! - loss_i = -sum(position_mask * sum_v p_v log q_v) / (batch * width) (SpecForge's mean over
//!   all positions); total = sum_i 0.8^i loss_i;
//! - acc_i = #(position mask and d2t-mapped draft argmax == target argmax) / #(shifted loss
//!   mask).
//!
//! Precision: the target logits restricted to the draft vocabulary and the draft logits are
//! upcast to f32 before the softmax / log-softmax, and the loss is reduced in f32, whatever the
//! backend's float type (bf16 on CUDA). A bf16 softmax over 8K-32K entries rounds the small
//! probabilities that make up most of the soft target and sums the row in bf16. On the CPU
//! (ndarray, f32) the casts are no-ops (`Tensor::cast` returns the tensor unchanged when the
//! dtype already matches), so CPU results are bit-for-bit what they were.

use burn::prelude::*;
use burn::tensor::activation::{log_softmax, softmax};
use burn::tensor::{FloatDType, TensorData};
use tandem_eagle::{DraftOutput, VocabMap};

use crate::data::Batch;
use crate::target::TargetHead;

/// The target id of each draft id (`d2t` applied), as the index tensor that selects the draft
/// columns of the target logits.
pub fn draft_id_tensor<B: Backend>(vocab: &VocabMap, device: &B::Device) -> Tensor<B, 1, Int> {
    let ids: Vec<i64> = vocab.target_ids().into_iter().map(i64::from).collect();
    let n = ids.len();
    Tensor::from_data(TensorData::new(ids, [n]), device)
}

/// Weight of step `i` in the total loss: `0.8^i`.
pub fn step_weight(step: usize) -> f64 {
    0.8f64.powi(step as i32)
}

/// Position mask and accuracy denominator of TTT step `step` for a padded batch (see the module
/// docs). `loss_mask`, `argmax`: `[batch * width]`; returns `([batch * width] mask, denominator)`.
pub fn position_mask(
    loss_mask: &[u8],
    lengths: &[usize],
    width: usize,
    argmax: &[u32],
    vocab: &VocabMap,
    step: usize,
) -> (Vec<bool>, usize) {
    let mut mask = vec![false; lengths.len() * width];
    let mut denominator = 0;
    for (b, &len) in lengths.iter().enumerate() {
        for t in 0..width {
            let u = t + step;
            // The last real position has no next token (SpecForge zeroes its loss mask).
            if u + 1 >= len || loss_mask[b * width + u] == 0 {
                continue;
            }
            denominator += 1;
            mask[b * width + t] = vocab.contains(argmax[b * width + u + 1]);
        }
    }
    (mask, denominator)
}

/// The target side of one batch: the target distribution over the draft vocabulary at every
/// position, and the target's argmax over the full vocabulary.
#[derive(Debug, Clone)]
pub struct BatchTargets<B: Backend> {
    /// `[batch, width, draft_vocab]`, f32 on every backend: row `u` = softmax of `logits_T[u]`
    /// over the draft ids.
    pub probs: Tensor<B, 3>,
    /// `[batch * width]`: argmax of `logits_T[u]` (target ids).
    pub argmax: Vec<u32>,
}

impl<B: Backend> BatchTargets<B> {
    /// Recomputes the target logits of `batch` with `head` and derives the targets.
    /// `draft_ids: [draft_vocab]` target id of each draft id (ascending).
    pub fn compute(head: &TargetHead<B>, batch: &Batch, draft_ids: &Tensor<B, 1, Int>) -> Self {
        let device = head.lm_head_t.device();
        let (b, w, t) = (batch.size(), batch.width, head.spec.hidden_size);
        let last = Tensor::<B, 3>::from_data(
            TensorData::new(batch.last_hidden.clone(), [b, w, t]),
            &device,
        );
        let logits = head.logits(last);
        let argmax = logits
            .clone()
            .argmax(2)
            .into_data()
            .convert::<i64>()
            .to_vec::<i64>()
            .expect("int argmax")
            .into_iter()
            .map(|v| v as u32)
            .collect();
        // Select first (the draft vocabulary is a fraction of the target's), then upcast: the
        // softmax runs in f32 even when the backend computes the logits in bf16.
        let draft_logits = logits.select(2, draft_ids.clone()).cast(FloatDType::F32);
        let probs = softmax(draft_logits, 2);
        BatchTargets { probs, argmax }
    }

    /// The distributions step `step` is trained on: rows shifted up by `1 + step`, the rows
    /// past the end filled with the uniform distribution (SpecForge's padding value; masked).
    pub fn shifted(&self, step: usize) -> Tensor<B, 3> {
        let [b, w, n] = self.probs.dims();
        let shift = (1 + step).min(w);
        let device = self.probs.device();
        let pad = Tensor::<B, 3>::ones([b, shift, n], &device).cast(self.probs.dtype()) / n as f64;
        if shift == w {
            return pad;
        }
        Tensor::cat(
            vec![self.probs.clone().slice([0..b, shift..w, 0..n]), pad],
            1,
        )
    }
}

/// Loss and accuracy counts of one TTT step on one batch.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StepStats {
    /// loss_i (before the 0.8^i weight).
    pub loss: f64,
    /// Positions where the mapped draft argmax equals the target argmax (and the mask is on).
    pub correct: usize,
    /// The accuracy denominator (shifted loss mask).
    pub denominator: usize,
}

/// The weighted total loss (a scalar tensor `[1]` in f32, differentiable on an autodiff
/// backend; gradients flow back to the draft logits in their own dtype) and per-step stats of
/// a batch. `targets` must live on the same backend as `outputs`.
pub fn objective<B: Backend>(
    outputs: &[DraftOutput<B>],
    targets: &BatchTargets<B>,
    batch: &Batch,
    vocab: &VocabMap,
) -> (Tensor<B, 1>, Vec<StepStats>) {
    let (b, w) = (batch.size(), batch.width);
    let device = targets.probs.device();
    let mut total: Option<Tensor<B, 1>> = None;
    let mut stats = Vec::with_capacity(outputs.len());
    for (i, out) in outputs.iter().enumerate() {
        let (mask, denominator) = position_mask(
            &batch.loss_mask,
            &batch.lengths,
            w,
            &targets.argmax,
            vocab,
            i,
        );
        let mask_values: Vec<f32> = mask.iter().map(|&m| f32::from(u8::from(m))).collect();
        let mask_t = Tensor::<B, 3>::from_data(TensorData::new(mask_values, [b, w, 1]), &device)
            .cast(FloatDType::F32);
        let logp = log_softmax(out.logits.clone().cast(FloatDType::F32), 2);
        let plogp = (targets.shifted(i).cast(FloatDType::F32) * logp).sum_dim(2);
        let loss = (plogp * mask_t).sum().neg() / (b * w) as f64;
        let loss_value = loss
            .clone()
            .into_data()
            .convert::<f64>()
            .to_vec::<f64>()
            .expect("float loss")[0];
        let draft_argmax: Vec<i64> = out
            .logits
            .clone()
            .argmax(2)
            .into_data()
            .convert::<i64>()
            .to_vec::<i64>()
            .expect("int argmax");
        let mut correct = 0;
        for (k, &d) in draft_argmax.iter().enumerate() {
            if !mask[k] {
                continue;
            }
            let (row, t) = (k / w, k % w);
            let target = targets.argmax[row * w + t + 1 + i];
            if vocab.to_target(d as usize) == target {
                correct += 1;
            }
        }
        stats.push(StepStats {
            loss: loss_value,
            correct,
            denominator,
        });
        let weighted = loss * step_weight(i);
        total = Some(match total {
            Some(t) => t + weighted,
            None => weighted,
        });
    }
    let total = total.unwrap_or_else(|| Tensor::<B, 1>::zeros([1], &device).cast(FloatDType::F32));
    (total, stats)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tandem_eagle::build_vocab_map;

    /// Hand-worked: one sequence of length 5 (width 6), loss mask [0, 1, 1, 1, 1, pad], draft
    /// vocab {2, 3} of 5 ids, target argmax per position [9, 2, 4, 3, 2, pad] (9 stands for an
    /// id outside the map; use 0 which is outside too).
    ///
    /// Step 0, index t uses loss_mask[t] and argmax[t + 1]: t = 1: mask 1, argmax[2] = 4 not in
    /// draft -> off; t = 2: argmax[3] = 3 -> on; t = 3: argmax[4] = 2 -> on; t = 4: last real
    /// position -> not counted. Denominator 3 (t = 1, 2, 3).
    /// Step 1 uses loss_mask[t + 1], argmax[t + 2]: t = 0: argmax[2] = 4 off (counted);
    /// t = 1: argmax[3] on; t = 2: argmax[4] on; t = 3: u = 4 is the last position. Denominator 3.
    #[test]
    fn position_masks_follow_specforge_alignment() {
        let vocab = build_vocab_map(&[0, 0, 1, 1, 0], 2, 5).unwrap();
        let loss_mask = [0, 1, 1, 1, 1, 0];
        let argmax = [0, 2, 4, 3, 2, 0];
        let (m0, d0) = position_mask(&loss_mask, &[5], 6, &argmax, &vocab, 0);
        assert_eq!(m0, vec![false, false, true, true, false, false]);
        assert_eq!(d0, 3);
        let (m1, d1) = position_mask(&loss_mask, &[5], 6, &argmax, &vocab, 1);
        assert_eq!(m1, vec![false, true, true, false, false, false]);
        assert_eq!(d1, 3);
        let (m3, d3) = position_mask(&loss_mask, &[5], 6, &argmax, &vocab, 3);
        assert_eq!(m3, vec![true, false, false, false, false, false]);
        assert_eq!(d3, 1);
    }

    #[test]
    fn step_weights() {
        assert_eq!(step_weight(0), 1.0);
        assert!((step_weight(2) - 0.64).abs() < 1e-12);
    }
}
