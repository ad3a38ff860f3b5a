//! Data-parallel training: how a global batch is shared among the replicas, and the options
//! that place this process among them.
//!
//! Every replica holds the whole corpus and builds the same batch plan from the same seed; at
//! each step rank `r` takes its contiguous share of the global batch's rows, padded to the
//! global batch's width, and averages its loss over the global batch's positions. The sum of
//! the replicas' gradients (NCCL) is then the gradient one process gets on the whole batch
//! (`replica_gradients_sum_to_the_global_batch_gradient` below checks this on burn's
//! autodiff), so clipping and AdamW take the same step on every replica.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

/// This process's place among the data-parallel replicas.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DataParallel {
    /// This replica (0 writes the checkpoints, the export and the metrics in `--out`).
    pub rank: usize,
    /// Replicas in the run.
    pub world_size: usize,
    /// The CUDA device ordinal this process trains on.
    pub device: usize,
    /// The file through which rank 0 hands out the NCCL id (a shared filesystem).
    pub rendezvous: PathBuf,
    /// The launch's tag (`TANDEM_RUN_ID` / `TORCHELASTIC_RUN_ID`): only an id file with this
    /// tag is joined.
    pub run_tag: String,
}

impl DataParallel {
    /// Whether this replica writes the run's files (rank 0).
    pub fn is_primary(&self) -> bool {
        self.rank == 0
    }
}

/// Rank `rank`'s rows of a global batch of `rows` over `world_size` replicas: contiguous
/// shares whose sizes differ by at most one (the first `len % world_size` ranks take one
/// more). A rank may get none when the batch has fewer rows than replicas.
pub fn replica_share(rows: &[usize], rank: usize, world_size: usize) -> &[usize] {
    assert!(rank < world_size, "rank {rank} of {world_size}");
    let (base, extra) = (rows.len() / world_size, rows.len() % world_size);
    let start = rank * base + rank.min(extra);
    let len = base + usize::from(rank < extra);
    &rows[start..start + len]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shares_cover_the_batch_once_in_order() {
        let rows: Vec<usize> = (100..111).collect();
        for world in 1..=13 {
            let shares: Vec<&[usize]> =
                (0..world).map(|r| replica_share(&rows, r, world)).collect();
            let joined: Vec<usize> = shares.iter().flat_map(|s| s.iter().copied()).collect();
            assert_eq!(joined, rows, "world {world}");
            let (min, max) = shares.iter().fold((usize::MAX, 0), |(lo, hi), s| {
                (lo.min(s.len()), hi.max(s.len()))
            });
            assert!(max - min <= 1, "world {world}: shares {min}..{max}");
        }
        // Hand-worked: 11 rows over 3 ranks are 4, 4, 3.
        assert_eq!(replica_share(&rows, 0, 3), &[100, 101, 102, 103]);
        assert_eq!(replica_share(&rows, 2, 3), &[108, 109, 110]);
    }
}

/// The property data-parallel training rests on, on burn's autodiff (f32, CPU): the replicas'
/// losses, each averaged over the global batch's positions, sum to the global batch's loss,
/// and their gradients to its gradient, for uneven shares too. The naive alternative (each
/// replica's own mean, averaged over replicas) is shown to differ.
#[cfg(test)]
mod gradient_tests {
    use burn::prelude::*;
    use burn::tensor::TensorData;

    use super::replica_share;
    use crate::data::Batch;
    use crate::gpu_check::{AB, B, GradientFixture, HIDDEN, gradient_fixture, linear_grad};
    use crate::objective::{BatchTargets, draft_id_tensor, objective};
    use tandem_model::testing::rel_l2;

    /// Rows `rows` of `batch`, kept at its width.
    fn sub_batch(batch: &Batch, rows: &[usize], fc_in: usize) -> Batch {
        let w = batch.width;
        let pick = |v: &[f32], per: usize| -> Vec<f32> {
            rows.iter()
                .flat_map(|&r| v[r * w * per..(r + 1) * w * per].iter().copied())
                .collect()
        };
        Batch {
            rows: rows.to_vec(),
            lengths: rows.iter().map(|&r| batch.lengths[r]).collect(),
            width: w,
            input_ids: rows
                .iter()
                .flat_map(|&r| batch.input_ids[r * w..(r + 1) * w].iter().copied())
                .collect(),
            loss_mask: rows
                .iter()
                .flat_map(|&r| batch.loss_mask[r * w..(r + 1) * w].iter().copied())
                .collect(),
            aux: pick(&batch.aux, fc_in),
            last_hidden: pick(&batch.last_hidden, HIDDEN),
        }
    }

    #[test]
    fn replica_gradients_sum_to_the_global_batch_gradient() {
        let device = Default::default();
        let GradientFixture {
            head,
            vocab,
            model,
            fc_in,
            batch,
        } = gradient_fixture::<B>(&device);
        let (b, w) = (batch.size(), batch.width);
        let steps = 3;
        let draft_ids = draft_id_tensor::<B>(&vocab, &device);
        // Loss, per-step counts and a few gradients of `part`, its loss scaled by `scale`.
        let run = |part: &Batch, scale: f64| {
            let targets = BatchTargets::<B>::compute(&head, part, &draft_ids);
            let aux = Tensor::<AB, 3>::from_data(
                TensorData::new(part.aux.clone(), [part.size(), w, fc_in]),
                &device,
            );
            let outputs = model
                .forward_ttt(aux, &part.input_ids, &part.lengths, steps)
                .unwrap();
            let ad_targets = BatchTargets::<AB> {
                probs: Tensor::from_inner(targets.probs),
                argmax: targets.argmax,
            };
            let (loss, stats) = objective(&outputs, &ad_targets, part, &model.vocab);
            let loss = loss * scale;
            let value = loss.clone().into_scalar() as f64;
            let grads = loss.backward();
            let m = &model.midlayer;
            let g: Vec<f32> = [
                linear_grad(&model.fc, &grads),
                linear_grad(&m.self_attn.q_proj, &grads),
                linear_grad(&m.mlp.down_proj, &grads),
                linear_grad(&model.lm_head, &grads),
            ]
            .concat();
            (value, stats, g)
        };
        let (global_loss, global_stats, global_grad) = run(&batch, 1.0);

        let rows: Vec<usize> = (0..b).collect();
        for world in [2usize, 3] {
            let mut loss = 0.0;
            let mut grad = vec![0f32; global_grad.len()];
            let mut naive = vec![0f32; global_grad.len()];
            let mut correct = vec![0usize; steps];
            let mut denominator = vec![0usize; steps];
            for rank in 0..world {
                let share = replica_share(&rows, rank, world);
                let part = sub_batch(&batch, share, fc_in);
                // Averaged over the global batch's positions, as the GPU replicas do.
                let (l, stats, g) = run(&part, share.len() as f64 / b as f64);
                loss += l;
                grad.iter_mut().zip(&g).for_each(|(a, x)| *a += x);
                for (i, s) in stats.iter().enumerate() {
                    correct[i] += s.correct;
                    denominator[i] += s.denominator;
                }
                let (_, _, own_mean) = run(&part, 1.0 / world as f64);
                naive.iter_mut().zip(&own_mean).for_each(|(a, x)| *a += x);
            }
            assert!(
                (loss - global_loss).abs() <= 1e-5 * global_loss.abs(),
                "world {world}: replicas' loss {loss} vs global {global_loss}"
            );
            let err = rel_l2(&grad, &global_grad);
            assert!(err < 1e-5, "world {world}: gradient rel L2 {err:.2e}");
            for (i, s) in global_stats.iter().enumerate() {
                assert_eq!((correct[i], denominator[i]), (s.correct, s.denominator));
            }
            if world == 3 {
                // Shares of 2, 1 and 1 rows: weighting each replica's mean by 1/3 is wrong.
                let naive_err = rel_l2(&naive, &global_grad);
                assert!(naive_err > 1e-2, "naive averaging err {naive_err:.2e}");
            }
        }
    }
}
