//! The one capture hook. The target's block loop (`TargetModel::forward`) calls
//! [`CaptureHook::observe`] after the embedding, after every block and after the final norm,
//! and nowhere else in the crate reads hidden states. Every execution path (prefill, chunked
//! prefill, decode, tree verification) runs that loop, so a tap cannot be skipped by a path.
//!
//! The hook is generic over what a hidden state is, so the CUDA fast path (`tandem-cuda`, whose
//! hidden states are raw device buffers, not burn tensors) takes its taps through this same
//! type and the same slot logic; a test there proves its taps equal this crate's.
//!
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
    /// Every tap point of a model of `num_layers` blocks, in loop order: `embed`, `block 0..`,
    /// `final` (what parity checks compare).
    pub fn all(num_layers: usize) -> Self {
        let mut taps = Vec::with_capacity(num_layers + 2);
        taps.push(TapId::Embed);
        taps.extend((0..num_layers).map(TapId::Block));
        taps.push(TapId::Final);
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
/// in the order of the request (a tap requested twice is stored twice). `T` is the hidden state
/// of the execution path: a burn tensor here, a device buffer in the CUDA fast path.
#[derive(Debug)]
pub struct CaptureHook<T> {
    request: TapRequest,
    captured: Vec<Option<T>>,
    /// Every tap point the loop passed through, in order (once per micro-batch): lets tests
    /// prove that no path skips the hook.
    visited: Vec<TapId>,
}

impl<T: Clone> CaptureHook<T> {
    pub fn new(request: TapRequest) -> Self {
        let slots = request.taps.len();
        Self {
            request,
            captured: vec![None; slots],
            visited: Vec::new(),
        }
    }

    /// Called by a block loop (this crate's, or the CUDA fast path's), and only there. Copies
    /// `hidden` only when a slot asks for `tap`.
    pub fn observe(&mut self, tap: TapId, hidden: &T) {
        self.try_observe_with(tap, |_| Ok::<T, std::convert::Infallible>(hidden.clone()))
            .unwrap_or_else(|never| match never {});
    }

    /// [`CaptureHook::observe`] for a block loop that writes taps into buffers of its own (the
    /// CUDA fast path's graphs, which must not allocate): `capture(slot)` is called for each
    /// slot that asks for `tap`, copies the hidden states where that slot keeps them and
    /// returns what the hook stores for the slot.
    pub fn try_observe_with<E>(
        &mut self,
        tap: TapId,
        mut capture: impl FnMut(usize) -> Result<T, E>,
    ) -> Result<(), E> {
        self.visited.push(tap);
        for (slot, wanted) in self.request.taps.iter().enumerate() {
            if *wanted == tap {
                self.captured[slot] = Some(capture(slot)?);
            }
        }
        Ok(())
    }

    /// The first slot that asks for `tap`, if any, without recording a visit: a block loop
    /// that writes a tap from the launch computing it (the CUDA fast path's fused down_proj)
    /// hands that slot's buffer to the launch, then records the visit with
    /// [`CaptureHook::try_observe_with`] as every other tap point does.
    pub fn first_slot(&self, tap: TapId) -> Option<usize> {
        self.request.taps.iter().position(|wanted| *wanted == tap)
    }

    pub fn finish(self) -> Taps<T> {
        Taps {
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

impl<B: Backend> CaptureHook<Tensor<B, 3>> {
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
}

/// The taps of one step, in request order, each `[batch, width, hidden]`.
#[derive(Debug, Clone)]
pub struct Taps<T> {
    pub taps: Vec<TapId>,
    pub tensors: Vec<T>,
    /// The tap points the block loop passed, in order (embed, block 0.., final), each once per
    /// micro-batch when the step ran micro-batched.
    pub visited: Vec<TapId>,
}

impl<T> Taps<T> {
    pub fn get(&self, tap: TapId) -> Option<&T> {
        self.taps
            .iter()
            .position(|t| *t == tap)
            .map(|i| &self.tensors[i])
    }
}

/// The taps of one step of the burn model.
pub type CapturedTaps<B> = Taps<Tensor<B, 3>>;

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
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A loop that writes a tap point's first slot from the launch computing it and copies the
    /// rest: `first_slot` names that slot before the visit, records nothing, and the hook ends
    /// with every slot filled and the visit in order.
    #[test]
    fn first_slot_names_the_launchs_slot_and_leaves_the_rest_to_the_visit() {
        let request = TapRequest::new(vec![TapId::Block(2), TapId::Block(0), TapId::Block(2)]);
        let mut hook = CaptureHook::<u32>::new(request);
        assert_eq!(hook.first_slot(TapId::Block(2)), Some(0));
        assert_eq!(hook.first_slot(TapId::Block(0)), Some(1));
        assert_eq!(hook.first_slot(TapId::Block(1)), None);
        assert_eq!(hook.first_slot(TapId::Embed), None);
        assert!(hook.visited.is_empty(), "a query is not a visit");
        let mut copied = Vec::new();
        for k in 0..3 {
            let written = hook.first_slot(TapId::Block(k));
            hook.try_observe_with(TapId::Block(k), |slot| {
                if written != Some(slot) {
                    copied.push(slot);
                }
                Ok::<u32, ()>(10 * k as u32 + slot as u32)
            })
            .unwrap();
        }
        assert_eq!(copied, vec![2], "only the second slot of block 2 is copied");
        let taps = hook.finish();
        assert_eq!(taps.tensors, vec![20, 1, 22]);
        assert_eq!(
            taps.visited,
            vec![TapId::Block(0), TapId::Block(1), TapId::Block(2)]
        );
    }
}
