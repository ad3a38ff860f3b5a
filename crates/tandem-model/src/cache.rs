//! KV cache with per-sequence column validity, and the step inputs every forward mode is made of.
//!
//! All sequences of a batch write their new keys/values to the same cache columns; a column a
//! sequence does not own (padding of a shorter prompt, a rejected tree branch) is simply marked
//! invalid for that sequence and masked out of attention. This makes ragged prefill, decode and
//! tree verification one code path, and committing an accepted tree path costs no copy.

use burn::prelude::*;

use crate::error::ModelError;

/// Per-layer key and value tensors, `[batch, kv_heads, capacity, head_dim]` each, plus the host
/// bookkeeping that decides what each sequence may attend to.
#[derive(Debug, Clone)]
pub struct KvCache<B: Backend> {
    pub(crate) keys: Vec<Tensor<B, 4>>,
    pub(crate) values: Vec<Tensor<B, 4>>,
    capacity: usize,
    /// Columns written so far (shared by the batch).
    used: usize,
    /// `valid[b][col]`: sequence `b` may attend to cache column `col`.
    valid: Vec<Vec<bool>>,
    /// Next RoPE position of each sequence = number of tokens it has committed.
    next_position: Vec<usize>,
}

/// One forward step for a batch: `batch * width` new tokens, laid out row-major by sequence.
#[derive(Debug, Clone, PartialEq)]
pub struct StepInput {
    pub batch: usize,
    pub width: usize,
    /// `[batch * width]` token ids (padding slots hold any valid id, conventionally 0).
    pub tokens: Vec<u32>,
    /// `[batch * width]` RoPE positions.
    pub positions: Vec<usize>,
    /// `[batch * width * width]`: new token `i` of a sequence may see new token `j` of the same
    /// sequence. Causal for prefill, ancestor-or-self for a tree.
    pub sees: Vec<bool>,
    /// `[batch * width]`: slot holds a real token (false for padding of ragged batches).
    pub real: Vec<bool>,
}

impl<B: Backend> KvCache<B> {
    pub fn new(
        num_layers: usize,
        batch: usize,
        num_kv_heads: usize,
        head_dim: usize,
        capacity: usize,
        device: &B::Device,
    ) -> Self {
        let zeros = || Tensor::<B, 4>::zeros([batch, num_kv_heads, capacity, head_dim], device);
        Self {
            keys: (0..num_layers).map(|_| zeros()).collect(),
            values: (0..num_layers).map(|_| zeros()).collect(),
            capacity,
            used: 0,
            valid: vec![Vec::new(); batch],
            next_position: vec![0; batch],
        }
    }

    /// Writes `k`, `v` (`[batch, kv_heads, width, head_dim]`) of layer `layer` at column
    /// `start` and returns the updated cache tensors. The cache tensor is moved out before the
    /// write so it is uniquely owned and the backend can update it in place instead of copying
    /// the whole cache every layer.
    pub(crate) fn write(
        &mut self,
        layer: usize,
        start: usize,
        k: Tensor<B, 4>,
        v: Tensor<B, 4>,
    ) -> (Tensor<B, 4>, Tensor<B, 4>) {
        let [b, kvh, n, hd] = k.dims();
        let range = [0..b, 0..kvh, start..start + n, 0..hd];
        let device = k.device();
        let placeholder = || Tensor::<B, 4>::empty([0, 0, 0, 0], &device);
        let keys =
            std::mem::replace(&mut self.keys[layer], placeholder()).slice_assign(range.clone(), k);
        let values =
            std::mem::replace(&mut self.values[layer], placeholder()).slice_assign(range, v);
        self.keys[layer] = keys.clone();
        self.values[layer] = values.clone();
        (keys, values)
    }

    pub fn batch(&self) -> usize {
        self.next_position.len()
    }
    pub fn capacity(&self) -> usize {
        self.capacity
    }
    /// Columns written so far.
    pub fn used(&self) -> usize {
        self.used
    }
    /// Committed length (= next position) of sequence `b`.
    pub fn seq_len(&self, b: usize) -> usize {
        self.next_position[b]
    }

    /// A prefill step for ragged prompts (one slice per sequence; an empty slice adds nothing
    /// to that sequence). Works as a chunk after earlier steps too.
    pub fn prefill_step(&self, prompts: &[&[u32]]) -> Result<StepInput, ModelError> {
        self.check_batch(prompts.len())?;
        let width = prompts.iter().map(|p| p.len()).max().unwrap_or(0);
        if width == 0 {
            return Err(ModelError::InvalidStep {
                reason: "every prompt in the step is empty".into(),
            });
        }
        let mut step = StepInput::empty(prompts.len(), width);
        for (b, prompt) in prompts.iter().enumerate() {
            for (i, &token) in prompt.iter().enumerate() {
                let slot = b * width + i;
                step.tokens[slot] = token;
                step.positions[slot] = self.next_position[b] + i;
                step.real[slot] = true;
                for j in 0..=i {
                    step.sees[slot * width + j] = true;
                }
            }
        }
        Ok(step)
    }

    /// A decode step: one new token per sequence.
    pub fn decode_step(&self, tokens: &[u32]) -> Result<StepInput, ModelError> {
        let prompts: Vec<&[u32]> = tokens.iter().map(std::slice::from_ref).collect();
        self.prefill_step(&prompts)
    }

    /// A tree-verification step. For each sequence, `tokens[i]` has parent `parents[i]`
    /// (`None` = child of the committed prefix); parents must precede children. Each node sees
    /// the prefix, its ancestors and itself; its position is prefix length + depth.
    pub fn tree_step(&self, trees: &[(&[u32], &[Option<usize>])]) -> Result<StepInput, ModelError> {
        self.check_batch(trees.len())?;
        let width = trees.iter().map(|(t, _)| t.len()).max().unwrap_or(0);
        if width == 0 {
            return Err(ModelError::InvalidStep {
                reason: "every tree in the step is empty".into(),
            });
        }
        let mut step = StepInput::empty(trees.len(), width);
        for (b, (tokens, parents)) in trees.iter().enumerate() {
            if tokens.len() != parents.len() {
                return Err(ModelError::InvalidStep {
                    reason: format!(
                        "tree {b}: {} tokens but {} parent entries",
                        tokens.len(),
                        parents.len()
                    ),
                });
            }
            let mut depth = vec![0usize; tokens.len()];
            for i in 0..tokens.len() {
                let slot = b * width + i;
                step.tokens[slot] = tokens[i];
                step.real[slot] = true;
                step.sees[slot * width + i] = true;
                if let Some(p) = parents[i] {
                    if p >= i {
                        return Err(ModelError::InvalidStep {
                            reason: format!(
                                "tree {b}: node {i} has parent {p}, which does not precede it"
                            ),
                        });
                    }
                    depth[i] = depth[p] + 1;
                    // Ancestors of the parent are ancestors of the node.
                    for j in 0..i {
                        if step.sees[(b * width + p) * width + j] {
                            step.sees[slot * width + j] = true;
                        }
                    }
                }
                step.positions[slot] = self.next_position[b] + depth[i];
            }
        }
        Ok(step)
    }

    fn check_batch(&self, got: usize) -> Result<(), ModelError> {
        if got != self.batch() {
            return Err(ModelError::InvalidStep {
                reason: format!("step has {got} sequences, the cache {}", self.batch()),
            });
        }
        Ok(())
    }

    /// Additive attention mask for `step`, `[batch * groups * width * (used + width)]` laid out
    /// as `[batch, 1, groups * width, used + width]`: 0 where visible, -inf elsewhere. The mask
    /// is repeated per query group so grouped-query attention needs no K/V copy.
    pub(crate) fn attention_mask(&self, step: &StepInput, groups: usize) -> Vec<f32> {
        let total = self.used + step.width;
        let mut mask = vec![f32::NEG_INFINITY; step.batch * groups * step.width * total];
        for b in 0..step.batch {
            for i in 0..step.width {
                let slot = b * step.width + i;
                let mut row = vec![f32::NEG_INFINITY; total];
                if step.real[slot] {
                    for (col, &ok) in self.valid[b].iter().enumerate() {
                        if ok {
                            row[col] = 0.0;
                        }
                    }
                    for j in 0..step.width {
                        if step.sees[slot * step.width + j] {
                            row[self.used + j] = 0.0;
                        }
                    }
                } else {
                    // Padding attends to itself only, so its softmax stays finite; its output
                    // is never read.
                    row[self.used + i] = 0.0;
                }
                for g in 0..groups {
                    let start = ((b * groups + g) * step.width + i) * total;
                    mask[start..start + total].copy_from_slice(&row);
                }
            }
        }
        mask
    }

    /// Checks there is room for `step` before any tensor is written.
    pub(crate) fn reserve(&self, step: &StepInput) -> Result<(), ModelError> {
        let needed = self.used + step.width;
        if needed > self.capacity {
            return Err(ModelError::CacheFull {
                needed,
                capacity: self.capacity,
            });
        }
        Ok(())
    }

    /// Records that `step` has been written at columns `used .. used + width`: real tokens become
    /// valid, padding stays invalid.
    pub(crate) fn advance(&mut self, step: &StepInput) {
        for b in 0..step.batch {
            let mut committed = 0;
            for i in 0..step.width {
                let real = step.real[b * step.width + i];
                self.valid[b].push(real);
                committed += usize::from(real);
            }
            self.next_position[b] += committed;
        }
        self.used += step.width;
    }

    /// After a tree step: keep only the nodes in `accepted` (indices into that step's tree) for
    /// sequence `b`; the other columns of the step become invisible to later steps. The
    /// accepted nodes must form a root-to-leaf path so their positions stay consecutive.
    pub fn keep_only(&mut self, b: usize, step_width: usize, accepted: &[usize]) {
        let start = self.used - step_width;
        for i in 0..step_width {
            if !accepted.contains(&i) {
                self.valid[b][start + i] = false;
            }
        }
        // Invariant: a sequence's committed length is its number of valid columns.
        self.next_position[b] = self.valid[b].iter().filter(|v| **v).count();
    }
}

impl StepInput {
    fn empty(batch: usize, width: usize) -> Self {
        Self {
            batch,
            width,
            tokens: vec![0; batch * width],
            positions: vec![0; batch * width],
            sees: vec![false; batch * width * width],
            real: vec![false; batch * width],
        }
    }

    /// Index of the last real token of each sequence within the step (`None` if it has none).
    pub fn last_real(&self) -> Vec<Option<usize>> {
        (0..self.batch)
            .map(|b| {
                (0..self.width)
                    .rev()
                    .find(|&i| self.real[b * self.width + i])
            })
            .collect()
    }
}
