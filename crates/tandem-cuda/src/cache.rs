//! The fast path's KV cache: bf16 keys and values on the GPU, `[batch, kv_heads, capacity,
//! head_dim]` per layer (the burn cache's layout), and the very same host bookkeeping
//! ([`ColumnLayout`]) as the burn cache, so steps, masks, commits and rollbacks are built by
//! one piece of code for both paths.

use cudarc::driver::CudaSlice;
use tandem_model::{ColumnLayout, ModelError, StepInput};

use crate::device::{AttentionShape, Gpu};
use crate::error::CudaError;

/// One step's inputs on the GPU ([`CudaKvCache::step_inputs`]).
pub(crate) struct StepInputs {
    pub tokens: CudaSlice<u32>,
    pub positions: CudaSlice<i32>,
    pub mask: CudaSlice<f32>,
    /// The first cache column the step writes.
    pub col0: usize,
    /// Columns the step attends over (`col0 + width`).
    pub total: usize,
    pub shape: AttentionShape,
}

pub struct CudaKvCache {
    pub(crate) keys: Vec<CudaSlice<u16>>,
    pub(crate) values: Vec<CudaSlice<u16>>,
    layout: ColumnLayout,
}

impl std::fmt::Debug for CudaKvCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaKvCache")
            .field("layers", &self.keys.len())
            .field("layout", &self.layout)
            .finish()
    }
}

impl CudaKvCache {
    pub fn new(
        gpu: &Gpu,
        num_layers: usize,
        batch: usize,
        kv_heads: usize,
        head_dim: usize,
        capacity: usize,
    ) -> Result<Self, CudaError> {
        let n = batch * kv_heads * capacity * head_dim;
        let mut keys = Vec::with_capacity(num_layers);
        let mut values = Vec::with_capacity(num_layers);
        for _ in 0..num_layers {
            keys.push(gpu.zeros::<u16>(n)?);
            values.push(gpu.zeros::<u16>(n)?);
        }
        Ok(Self {
            keys,
            values,
            layout: ColumnLayout::new(batch, capacity),
        })
    }

    /// The column bookkeeping, shared with the burn cache: step builders (`prefill_step`,
    /// `decode_step`, `tree_step`), lengths, and the attention mask.
    pub fn layout(&self) -> &ColumnLayout {
        &self.layout
    }
    /// For commits after a tree step (`keep_only`: no data moves) and rollbacks.
    pub fn layout_mut(&mut self) -> &mut ColumnLayout {
        &mut self.layout
    }
    pub(crate) fn check(&self, step: &StepInput) -> Result<(), ModelError> {
        self.layout.check_step(step)
    }

    /// Checks `step` against this cache and the vocabulary, then uploads what its kernels read:
    /// token ids, RoPE positions and the `[rows, total]` attention mask (built by the same
    /// ColumnLayout code as the burn path's; one group: GQA is resolved in the kernel).
    pub(crate) fn step_inputs(
        &self,
        gpu: &Gpu,
        step: &StepInput,
        vocab_size: usize,
        [heads, kv_heads, head_dim]: [usize; 3],
    ) -> Result<StepInputs, CudaError> {
        self.check(step)?;
        if let Some(&id) = step.tokens.iter().find(|&&t| t as usize >= vocab_size) {
            return Err(ModelError::TokenOutOfRange { id, vocab_size }.into());
        }
        let positions: Vec<i32> = step.positions.iter().map(|&p| p as i32).collect();
        Ok(StepInputs {
            tokens: gpu.upload(&step.tokens)?,
            positions: gpu.upload(&positions)?,
            mask: gpu.upload(&self.layout.attention_mask(step, 1))?,
            col0: self.layout.used(),
            total: self.layout.used() + step.width,
            shape: AttentionShape {
                batch: step.batch,
                width: step.width,
                heads,
                kv_heads,
                head_dim,
                capacity: self.layout.capacity(),
            },
        })
    }
    pub(crate) fn advance(&mut self, step: &StepInput) {
        self.layout.advance(step)
    }
}
