//! The fast path's KV cache: bf16 keys and values on the GPU, `[batch, kv_heads, capacity,
//! head_dim]` per layer (the burn cache's layout), and the very same host bookkeeping
//! ([`ColumnLayout`]) as the burn cache, so steps, masks, commits and rollbacks are built by
//! one piece of code for both paths.

use cudarc::driver::CudaSlice;
use tandem_model::{ColumnLayout, ModelError, StepInput};

use crate::device::Gpu;
use crate::error::CudaError;

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

    pub fn layout(&self) -> &ColumnLayout {
        &self.layout
    }
    pub fn batch(&self) -> usize {
        self.layout.batch()
    }
    pub fn capacity(&self) -> usize {
        self.layout.capacity()
    }
    pub fn used(&self) -> usize {
        self.layout.used()
    }
    pub fn seq_len(&self, b: usize) -> usize {
        self.layout.seq_len(b)
    }
    pub fn prefill_step(&self, prompts: &[&[u32]]) -> Result<StepInput, ModelError> {
        self.layout.prefill_step(prompts)
    }
    pub fn decode_step(&self, tokens: &[u32]) -> Result<StepInput, ModelError> {
        self.layout.decode_step(tokens)
    }
    pub fn tree_step(&self, trees: &[(&[u32], &[Option<usize>])]) -> Result<StepInput, ModelError> {
        self.layout.tree_step(trees)
    }
    /// See [`ColumnLayout::keep_only`]: committing a tree path moves no data.
    pub fn keep_only(&mut self, b: usize, step_width: usize, accepted: &[usize]) {
        self.layout.keep_only(b, step_width, accepted)
    }
    /// See [`ColumnLayout::rollback`].
    pub fn rollback(&mut self, columns: usize) {
        self.layout.rollback(columns)
    }
    pub(crate) fn check(&self, step: &StepInput) -> Result<(), ModelError> {
        self.layout.check_step(step)
    }
    pub(crate) fn advance(&mut self, step: &StepInput) {
        self.layout.advance(step)
    }
}
