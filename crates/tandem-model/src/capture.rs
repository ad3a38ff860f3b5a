//! The one capture hook. The target's block loop (`TargetModel::forward`) calls
//! [`CaptureHook::observe`] after the embedding, after every block and after the final norm,
//! and nowhere else in the crate reads hidden states. Every execution path (prefill, chunked
//! prefill, decode, tree verification) runs that loop, so a tap cannot be skipped by a path.
//! The micro-batched path is lanes of the same loop: it calls [`CaptureHook::observe_part`]
//! per lane, which reassembles the step's tap by row and slot range.

use burn::prelude::*;
use tandem_wiring::TapId;

use crate::error::ModelError;
use crate::micro_batch::MicroBatch;

/// Which taps a forward step should keep, in slot order.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct TapRequest {
    pub taps: Vec<TapId>,
}

impl TapRequest {
    pub fn none() -> Self {
        Self::default()
    }
    pub fn new(taps: Vec<TapId>) -> Self {
        Self { taps }
    }
    /// Refuses taps that do not exist in a model of `num_layers` blocks.
    pub fn validate(&self, num_layers: usize) -> Result<(), ModelError> {
        for tap in &self.taps {
            if let TapId::Block(k) = tap
                && *k >= num_layers
            {
                return Err(ModelError::TapOutOfRange {
                    tap: tap.to_string(),
                    num_layers,
                });
            }
        }
        Ok(())
    }
}

/// Collects the requested taps of one forward step. Each entry is `[batch, width, hidden]`,
/// in the order of the request (a tap requested twice is stored twice).
#[derive(Debug)]
pub struct CaptureHook<B: Backend> {
    request: TapRequest,
    captured: Vec<Option<Tensor<B, 3>>>,
    /// Every tap point the loop passed through, in order (once per micro-batch): lets tests
    /// prove that no path skips the hook.
    visited: Vec<TapId>,
}

impl<B: Backend> CaptureHook<B> {
    pub(crate) fn new(request: TapRequest) -> Self {
        let slots = request.taps.len();
        Self {
            request,
            captured: vec![None; slots],
            visited: Vec::new(),
        }
    }

    /// Called by the block loop, and only there.
    pub(crate) fn observe(&mut self, tap: TapId, hidden: &Tensor<B, 3>) {
        self.visited.push(tap);
        for (slot, wanted) in self.request.taps.iter().enumerate() {
            if *wanted == tap {
                self.captured[slot] = Some(hidden.clone());
            }
        }
    }

    /// Called by the block loop for one micro-batch of a step of `[batch, width]` tokens: `part`
    /// holds its rows and slots. Each requested slot is assembled by range into the step's
    /// `[batch, width, hidden]` tensor, so the lanes together leave what the plain path leaves.
    pub(crate) fn observe_part(
        &mut self,
        tap: TapId,
        lane: &MicroBatch,
        [batch, width]: [usize; 2],
        part: &Tensor<B, 3>,
    ) {
        if lane.covers(batch, width) {
            return self.observe(tap, part);
        }
        self.visited.push(tap);
        let hidden = part.dims()[2];
        for (slot, wanted) in self.request.taps.iter().enumerate() {
            if *wanted == tap {
                let whole = self.captured[slot]
                    .take()
                    .unwrap_or_else(|| Tensor::zeros([batch, width, hidden], &part.device()));
                self.captured[slot] = Some(whole.slice_assign(
                    [lane.rows.clone(), lane.slots.clone(), 0..hidden],
                    part.clone(),
                ));
            }
        }
    }

    pub(crate) fn finish(self) -> CapturedTaps<B> {
        CapturedTaps {
            taps: self.request.taps,
            tensors: self
                .captured
                .into_iter()
                .map(|t| t.expect("the block loop observes every tap point"))
                .collect(),
            visited: self.visited,
        }
    }
}

/// The taps of one step, in request order, each `[batch, width, hidden]`.
#[derive(Debug, Clone)]
pub struct CapturedTaps<B: Backend> {
    pub taps: Vec<TapId>,
    pub tensors: Vec<Tensor<B, 3>>,
    /// The tap points the block loop passed, in order (embed, block 0.., final), each once per
    /// micro-batch when the step ran micro-batched.
    pub visited: Vec<TapId>,
}

impl<B: Backend> CapturedTaps<B> {
    /// All taps of a token concatenated in slot order, `[batch, width, slots * hidden]`, the
    /// layout SGLang and SpecForge feed to the EAGLE-3 `fc` layer.
    pub fn concatenated(&self) -> Option<Tensor<B, 3>> {
        if self.tensors.is_empty() {
            None
        } else {
            Some(Tensor::cat(self.tensors.clone(), 2))
        }
    }

    pub fn get(&self, tap: TapId) -> Option<&Tensor<B, 3>> {
        self.taps
            .iter()
            .position(|t| *t == tap)
            .map(|i| &self.tensors[i])
    }
}
