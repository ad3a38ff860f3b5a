//! Micro-batched execution (the two-batch-overlap pattern of MoE serving engines): a step is
//! split into two micro-batches that run interleaved, layer by layer, so that on a GPU one
//! micro-batch's expert all-to-all can overlap the other's compute.
//!
//! This is the path where SGLang's DeepSeek serving captured 0 of 3 aux layers: its taps were
//! taken by the plain loop only. Here a micro-batch is a lane of the one block loop in
//! [`crate::TargetModel::forward`]: the loop visits every layer once and, inside it, every
//! lane, calling the capture hook per lane with the lane's rows and slots, so the tap of the
//! whole step is reassembled by range exactly where the plain path takes it.

use std::ops::Range;

use burn::prelude::*;

use crate::cache::StepInput;

/// How [`crate::TargetModel::forward`] runs a step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Execution {
    /// Micro-batched for steps of at least two sequences on MoE models (where serving
    /// engines overlap the expert all-to-all), plain otherwise.
    #[default]
    Auto,
    /// One lane: the whole step at once.
    Plain,
    /// Two lanes whenever the step can be split: by sequences when it has two or more, else by
    /// token slots of the single sequence (the two-chunk split of a long prefill).
    MicroBatched,
}

impl std::str::FromStr for Execution {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "auto" => Ok(Self::Auto),
            "plain" => Ok(Self::Plain),
            "micro-batched" => Ok(Self::MicroBatched),
            other => Err(format!(
                "unknown execution {other:?} (auto, plain, micro-batched)"
            )),
        }
    }
}

/// One lane of a step: sequences `rows` (cache rows) and, of each, the step slots `slots`.
/// The lanes of a step partition it along exactly one of the two axes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MicroBatch {
    pub rows: Range<usize>,
    pub slots: Range<usize>,
}

impl MicroBatch {
    /// The whole step as one lane.
    pub fn whole(step: &StepInput) -> Self {
        Self {
            rows: 0..step.batch,
            slots: 0..step.width,
        }
    }

    pub fn covers(&self, batch: usize, width: usize) -> bool {
        self.rows == (0..batch) && self.slots == (0..width)
    }

    /// This lane's part of a step tensor `[batch, width, hidden]`.
    pub fn slice<B: Backend>(&self, t: &Tensor<B, 3>) -> Tensor<B, 3> {
        let [b, w, h] = t.dims();
        if self.covers(b, w) {
            return t.clone();
        }
        t.clone()
            .slice([self.rows.clone(), self.slots.clone(), 0..h])
    }
}

impl Execution {
    /// The lanes of `step`, in the order the block loop runs them at each layer. Later lanes may
    /// attend to earlier ones' cache columns of the same layer (a slot split keeps the earlier
    /// slots first), never the reverse: prefill is causal and tree parents precede children.
    pub fn micro_batches(self, step: &StepInput, moe: bool) -> Vec<MicroBatch> {
        let split = match self {
            Self::Plain => false,
            Self::Auto => moe && step.batch >= 2,
            Self::MicroBatched => true,
        };
        if split && step.batch >= 2 {
            let mid = step.batch.div_ceil(2);
            vec![
                MicroBatch {
                    rows: 0..mid,
                    slots: 0..step.width,
                },
                MicroBatch {
                    rows: mid..step.batch,
                    slots: 0..step.width,
                },
            ]
        } else if split && step.width >= 2 {
            let mid = step.width.div_ceil(2);
            vec![
                MicroBatch {
                    rows: 0..step.batch,
                    slots: 0..mid,
                },
                MicroBatch {
                    rows: 0..step.batch,
                    slots: mid..step.width,
                },
            ]
        } else {
            vec![MicroBatch::whole(step)]
        }
    }
}

/// The lanes' parts `[rows, slots, hidden]` put back together as `[batch, width, hidden]`.
pub fn merge<B: Backend>(lanes: &[MicroBatch], parts: Vec<Tensor<B, 3>>) -> Tensor<B, 3> {
    if parts.len() == 1 {
        return parts.into_iter().next().expect("one part");
    }
    let by_rows = lanes.windows(2).all(|w| w[0].slots == w[1].slots);
    Tensor::cat(parts, if by_rows { 0 } else { 1 })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn step(batch: usize, width: usize) -> StepInput {
        let mut layout = crate::ColumnLayout::new(batch, 64);
        let prompts: Vec<Vec<u32>> = (0..batch).map(|_| vec![1; width]).collect();
        let refs: Vec<&[u32]> = prompts.iter().map(Vec::as_slice).collect();
        let s = layout.prefill_step(&refs).unwrap();
        layout.advance(&s);
        s
    }

    #[test]
    fn auto_splits_only_batches_of_moe_models() {
        assert_eq!(Execution::Auto.micro_batches(&step(3, 4), false).len(), 1);
        assert_eq!(Execution::Auto.micro_batches(&step(1, 4), true).len(), 1);
        let lanes = Execution::Auto.micro_batches(&step(3, 4), true);
        assert_eq!(
            lanes,
            vec![
                MicroBatch {
                    rows: 0..2,
                    slots: 0..4
                },
                MicroBatch {
                    rows: 2..3,
                    slots: 0..4
                }
            ]
        );
    }

    #[test]
    fn forced_split_falls_back_to_slots_then_to_one_lane() {
        let lanes = Execution::MicroBatched.micro_batches(&step(1, 5), false);
        assert_eq!(lanes[0].slots, 0..3);
        assert_eq!(lanes[1].slots, 3..5);
        assert_eq!(
            Execution::MicroBatched.micro_batches(&step(1, 1), true),
            vec![MicroBatch {
                rows: 0..1,
                slots: 0..1
            }]
        );
        assert_eq!(Execution::Plain.micro_batches(&step(4, 2), true).len(), 1);
    }
}
