//! KV cache with per-sequence column validity, and the step inputs every forward mode is made of.
//!
//! All sequences of a batch write their new keys/values to the same cache columns; a column a
//! sequence does not own (padding of a shorter prompt, a rejected tree branch) is simply marked
//! invalid for that sequence and masked out of attention. This makes ragged prefill, decode and
//! tree verification one code path, and committing an accepted tree path costs no copy.

use burn::prelude::*;
use burn::tensor::TensorData;

use crate::error::ModelError;

/// Per-layer key and value tensors, `[batch, kv_heads, capacity, key_width]` and
/// `[batch, kv_heads, capacity, value_width]` (equal widths for the Llama family; multi-head
/// latent attention has keys wider than values), plus the host bookkeeping ([`ColumnLayout`])
/// that decides what each sequence may attend to.
#[derive(Debug, Clone)]
pub struct KvCache<B: Backend> {
    pub(crate) keys: Vec<Tensor<B, 4>>,
    pub(crate) values: Vec<Tensor<B, 4>>,
    layout: ColumnLayout,
}

/// Which cache columns each sequence owns, and each sequence's next RoPE position. Shared by
/// the target's [`KvCache`] and the draft head's cache, so both build steps, masks, commits and
/// row moves (a sequence joining or leaving a running batch) with the same code.
#[derive(Debug, Clone, PartialEq)]
pub struct ColumnLayout {
    capacity: usize,
    /// Columns written so far (shared by the batch).
    used: usize,
    /// `valid[b][col]` for `col < used`: sequence `b` may attend to cache column `col`.
    valid: Vec<Vec<bool>>,
    /// Next RoPE position of each sequence = number of tokens it has committed.
    next_position: Vec<usize>,
}

/// The order in which a batch keeps its rows when the rows `gone` leave: every departed row
/// that is not at the end is refilled by the last surviving row, so at most `gone.len()` rows
/// change place (instead of every row after the first departure, as keeping the order would).
/// Returns `keep` for a retain: the row that moves into place `i` is `keep[i]`.
pub fn fill_order(rows: usize, gone: &[bool]) -> Vec<usize> {
    assert_eq!(gone.len(), rows);
    let mut keep: Vec<usize> = (0..rows).collect();
    let mut end = rows;
    let mut i = 0;
    while i < end {
        if gone[keep[i]] {
            // Take the last row; if it is gone too, drop it and look again.
            end -= 1;
            keep.swap(i, end);
        } else {
            i += 1;
        }
    }
    keep.truncate(end);
    keep
}

/// The attention mask of one step in compact parts ([`ColumnLayout::mask_parts`]): which cached
/// columns each sequence owns, which of the step's own columns each slot sees, and which slots
/// are real tokens. Row `r = b * width + i` of the full mask sees cached column `c < used` when
/// `valid[b * used + c]`, step column `j` when `sees[r * width + j]`; a padding slot sees only
/// its own column.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MaskParts {
    pub used: usize,
    pub width: usize,
    /// `[batch, used]`, 1 = visible.
    pub valid: Vec<u8>,
    /// `[rows, width]`.
    pub sees: Vec<u8>,
    /// `[rows]`.
    pub real: Vec<u8>,
}

impl MaskParts {
    /// The full additive mask, `[rows, used + width]`: 0 visible, -inf hidden (what
    /// [`ColumnLayout::attention_mask`] builds with one group).
    pub fn expand(&self) -> Vec<f32> {
        let total = self.used + self.width;
        let rows = self.real.len();
        let mut mask = Vec::with_capacity(rows * total);
        for r in 0..rows {
            let (b, i) = (r / self.width, r % self.width);
            for j in 0..total {
                let visible = if self.real[r] == 0 {
                    j == self.used + i
                } else if j < self.used {
                    self.valid[b * self.used + j] != 0
                } else {
                    self.sees[r * self.width + j - self.used] != 0
                };
                mask.push(if visible { 0.0 } else { f32::NEG_INFINITY });
            }
        }
        mask
    }

    /// The parts with sequences appended up to `batch`, each a copy of sequence 0's.
    pub fn padded(mut self, batch: usize) -> Self {
        let live = self.real.len() / self.width.max(1);
        let (used, width) = (self.used, self.width);
        for _ in live..batch {
            self.valid.extend_from_within(..used);
            self.sees.extend_from_within(..width * width);
            self.real.extend_from_within(..width);
        }
        self
    }
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

impl ColumnLayout {
    pub fn new(batch: usize, capacity: usize) -> Self {
        Self {
            capacity,
            used: 0,
            valid: vec![Vec::new(); batch],
            next_position: vec![0; batch],
        }
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

    /// The longest sequence's length (0 for an empty batch): where compaction leaves `used`.
    pub fn longest(&self) -> usize {
        self.next_position.iter().copied().max().unwrap_or(0)
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

    /// Checks, before any tensor is written, that `step` is well formed for this batch and that
    /// there is room for it.
    pub fn check_step(&self, step: &StepInput) -> Result<(), ModelError> {
        self.check_batch(step.batch)?;
        let n = step.batch * step.width;
        if step.tokens.len() != n
            || step.positions.len() != n
            || step.real.len() != n
            || step.sees.len() != n * step.width
        {
            return Err(ModelError::InvalidStep {
                reason: "step input vectors do not match its batch and width".into(),
            });
        }
        let needed = self.used + step.width;
        if needed > self.capacity {
            return Err(ModelError::CacheFull {
                needed,
                capacity: self.capacity,
            });
        }
        Ok(())
    }

    /// The attention mask of `step` (one group) in compact parts, for a device to expand
    /// ([`MaskParts::expand`] is the reference): `rows x (used + width)` f32 values grow with the
    /// square of a wide step, these with its width.
    pub fn mask_parts(&self, step: &StepInput) -> MaskParts {
        let mut valid = Vec::with_capacity(step.batch * self.used);
        for b in 0..step.batch {
            let owned = &self.valid[b][..self.valid[b].len().min(self.used)];
            valid.extend(owned.iter().map(|&ok| u8::from(ok)));
            valid.resize((b + 1) * self.used, 0);
        }
        MaskParts {
            used: self.used,
            width: step.width,
            valid,
            sees: step.sees.iter().map(|&s| u8::from(s)).collect(),
            real: step.real.iter().map(|&r| u8::from(r)).collect(),
        }
    }

    /// Additive attention mask for `step`, `[batch * groups * width * (used + width)]` laid out
    /// as `[batch, 1, groups * width, used + width]`: 0 where visible, -inf elsewhere. The mask
    /// is repeated per query group so grouped-query attention needs no K/V copy.
    pub fn attention_mask(&self, step: &StepInput, groups: usize) -> Vec<f32> {
        // Written once, row after row (no fill then overwrite): wide steps at large batches (a
        // head catching up over hundreds of deferred tokens for 64 sequences) build tens of
        // megabytes here, on the host, before every such step.
        let total = self.used + step.width;
        let mut mask = Vec::with_capacity(step.batch * groups * step.width * total);
        let hidden = |ok: bool| if ok { 0.0 } else { f32::NEG_INFINITY };
        let mut cached: Vec<f32> = Vec::with_capacity(self.used);
        let mut row: Vec<f32> = vec![f32::NEG_INFINITY; step.width];
        for b in 0..step.batch {
            // The cached columns this sequence sees, shared by its slots.
            cached.clear();
            cached.extend(self.valid[b].iter().map(|&ok| hidden(ok)));
            cached.resize(self.used, f32::NEG_INFINITY);
            for _ in 0..groups {
                for i in 0..step.width {
                    let slot = b * step.width + i;
                    if step.real[slot] {
                        mask.extend_from_slice(&cached);
                        let sees = &step.sees[slot * step.width..(slot + 1) * step.width];
                        for (r, &s) in row.iter_mut().zip(sees) {
                            *r = hidden(s);
                        }
                        mask.extend_from_slice(&row);
                    } else {
                        // Padding attends to itself only, so its softmax stays finite; its
                        // output is never read.
                        mask.extend(std::iter::repeat_n(f32::NEG_INFINITY, self.used + i));
                        mask.push(0.0);
                        mask.extend(std::iter::repeat_n(f32::NEG_INFINITY, step.width - i - 1));
                    }
                }
            }
        }
        debug_assert_eq!(mask.len(), step.batch * groups * step.width * total);
        mask
    }

    /// Records that `step` has been written at columns `used .. used + width`: real tokens become
    /// valid, padding stays invalid.
    pub fn advance(&mut self, step: &StepInput) {
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

    /// Forgets every column from `columns` on (e.g. the draft steps of a round). Lengths become
    /// the valid columns left.
    pub fn rollback(&mut self, columns: usize) {
        let columns = columns.min(self.used);
        self.used = columns;
        for (b, valid) in self.valid.iter_mut().enumerate() {
            valid.truncate(columns);
            self.next_position[b] = valid.iter().filter(|v| **v).count();
        }
    }

    /// Forgets the trailing columns no sequence sees, e.g. the rejected tail of a head extend
    /// run over a whole verified chain before its acceptance was known: afterwards the layout
    /// is the one an extend over only the kept slots (padded to the longest) would have left.
    pub fn forget_invisible_tail(&mut self) {
        let seen = self
            .valid
            .iter()
            .filter_map(|v| v.iter().rposition(|&ok| ok))
            .max()
            .map_or(0, |last| last + 1);
        self.rollback(seen);
    }

    /// Appends the sequences of `other` (same capacity) after this batch's. Each keeps the
    /// columns it owns; columns past the shorter layout's `used` are invalid for its rows.
    pub fn append(&mut self, other: ColumnLayout) -> Result<(), ModelError> {
        if other.capacity != self.capacity {
            return Err(ModelError::InvalidStep {
                reason: format!(
                    "cannot join caches of {} and {} columns",
                    self.capacity, other.capacity
                ),
            });
        }
        self.used = self.used.max(other.used);
        self.valid.extend(other.valid);
        self.next_position.extend(other.next_position);
        for valid in &mut self.valid {
            valid.resize(self.used, false);
        }
        Ok(())
    }

    /// Keeps the sequences `keep` (distinct), sequence `keep[i]` becoming row `i`.
    pub fn select(&mut self, keep: &[usize]) {
        self.valid = keep
            .iter()
            .map(|&b| std::mem::take(&mut self.valid[b]))
            .collect();
        self.next_position = keep.iter().map(|&b| self.next_position[b]).collect();
        if self.valid.is_empty() {
            self.used = 0;
        }
    }

    /// Drops sequence `b`; the rows after it move up by one.
    pub fn remove(&mut self, b: usize) {
        self.valid.remove(b);
        self.next_position.remove(b);
        if self.valid.is_empty() {
            self.used = 0;
        }
    }

    /// For each sequence, the columns it owns, in order: where [`compact_columns`] moves them
    /// (to `0..len`). Positions are baked into the cached keys, so moving columns keeps
    /// attention exact.
    pub fn compaction_plan(&self) -> Vec<Vec<usize>> {
        self.valid
            .iter()
            .map(|valid| (0..valid.len()).filter(|&c| valid[c]).collect())
            .collect()
    }

    /// The bookkeeping after [`compact_columns`] moved every sequence to the front.
    pub fn compact(&mut self) {
        self.used = self.longest();
        for (valid, &len) in self.valid.iter_mut().zip(&self.next_position) {
            *valid = (0..self.used).map(|c| c < len).collect();
        }
    }
}

/// Writes `new` (`[rows, heads, width, head_dim]`) into `cache` at row `row` and column
/// `start` and returns the updated tensor (also left in `cache`). The cache tensor is moved out
/// before the write so it is uniquely owned and the backend can update it in place instead of
/// copying it.
fn write_columns<B: Backend>(
    cache: &mut Tensor<B, 4>,
    row: usize,
    start: usize,
    new: Tensor<B, 4>,
) -> Tensor<B, 4> {
    let [b, h, n, d] = new.dims();
    let placeholder = Tensor::<B, 4>::empty([0, 0, 0, 0], &new.device());
    let updated = std::mem::replace(cache, placeholder)
        .slice_assign([row..row + b, 0..h, start..start + n, 0..d], new);
    *cache = updated.clone();
    updated
}

/// Rows of `a` then rows of `b` (`[batch, kv_heads, capacity, head_dim]` both).
fn append_rows<B: Backend>(a: Tensor<B, 4>, b: Tensor<B, 4>) -> Tensor<B, 4> {
    Tensor::cat(vec![a, b], 0)
}

/// `t` without row `row` (the batch must keep at least one row).
fn remove_row<B: Backend>(t: Tensor<B, 4>, row: usize) -> Tensor<B, 4> {
    let [batch, h, c, d] = t.dims();
    let mut parts = Vec::with_capacity(2);
    if row > 0 {
        parts.push(t.clone().slice([0..row, 0..h, 0..c, 0..d]));
    }
    if row + 1 < batch {
        parts.push(t.slice([row + 1..batch, 0..h, 0..c, 0..d]));
    }
    Tensor::cat(parts, 0)
}

/// Moves each row's columns `plan[b]` to the front (`0..plan[b].len()`), one gather for the
/// whole tensor; the columns after them hold stale values the layout marks invalid.
fn compact_columns<B: Backend>(t: Tensor<B, 4>, plan: &[Vec<usize>]) -> Tensor<B, 4> {
    let [batch, h, c, d] = t.dims();
    let mut index = Vec::with_capacity(batch * c);
    for (b, cols) in plan.iter().enumerate() {
        for j in 0..c {
            index.push((b * c + cols.get(j).copied().unwrap_or(j)) as i64);
        }
    }
    let index = Tensor::<B, 1, Int>::from_data(TensorData::new(index, [batch * c]), &t.device());
    t.swap_dims(1, 2)
        .reshape([batch * c, h * d])
        .select(0, index)
        .reshape([batch, c, h, d])
        .swap_dims(1, 2)
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
        Self::with_widths(
            num_layers,
            batch,
            num_kv_heads,
            [head_dim, head_dim],
            capacity,
            device,
        )
    }

    /// A cache whose keys are `key_width` and values `value_width` wide per head.
    pub fn with_widths(
        num_layers: usize,
        batch: usize,
        num_kv_heads: usize,
        [key_width, value_width]: [usize; 2],
        capacity: usize,
        device: &B::Device,
    ) -> Self {
        let zeros = |width| Tensor::<B, 4>::zeros([batch, num_kv_heads, capacity, width], device);
        Self {
            keys: (0..num_layers).map(|_| zeros(key_width)).collect(),
            values: (0..num_layers).map(|_| zeros(value_width)).collect(),
            layout: ColumnLayout::new(batch, capacity),
        }
    }

    /// Writes `k`, `v` (`[batch, kv_heads, width, head_dim]`) of layer `layer` at column
    /// `start` and returns the updated cache tensors (see [`write_columns`]). Public, with
    /// [`KvCache::reserve`], [`KvCache::attention_mask`] and [`KvCache::advance`], for the
    /// models that keep their keys here besides the target (the draft head).
    pub fn write(
        &mut self,
        layer: usize,
        start: usize,
        k: Tensor<B, 4>,
        v: Tensor<B, 4>,
    ) -> (Tensor<B, 4>, Tensor<B, 4>) {
        self.write_at(layer, 0, start, k, v)
    }

    /// [`KvCache::write`] for the sequences from cache row `row` on (`k`, `v` hold as many
    /// rows as they write): how one micro-batch of a step addresses its own rows.
    pub fn write_at(
        &mut self,
        layer: usize,
        row: usize,
        start: usize,
        k: Tensor<B, 4>,
        v: Tensor<B, 4>,
    ) -> (Tensor<B, 4>, Tensor<B, 4>) {
        (
            write_columns(&mut self.keys[layer], row, start, k),
            write_columns(&mut self.values[layer], row, start, v),
        )
    }

    /// The column bookkeeping (what each sequence owns).
    pub fn layout(&self) -> &ColumnLayout {
        &self.layout
    }
    /// The bookkeeping, for callers that mark accepted paths and roll back scratch columns
    /// themselves (the speculative driver does so for every backend's caches).
    pub fn layout_mut(&mut self) -> &mut ColumnLayout {
        &mut self.layout
    }
    pub fn batch(&self) -> usize {
        self.layout.batch()
    }
    pub fn capacity(&self) -> usize {
        self.layout.capacity()
    }
    /// Columns written so far.
    pub fn used(&self) -> usize {
        self.layout.used()
    }
    /// Committed length (= next position) of sequence `b`.
    pub fn seq_len(&self, b: usize) -> usize {
        self.layout.seq_len(b)
    }
    /// See [`ColumnLayout::prefill_step`].
    pub fn prefill_step(&self, prompts: &[&[u32]]) -> Result<StepInput, ModelError> {
        self.layout.prefill_step(prompts)
    }
    /// See [`ColumnLayout::decode_step`].
    pub fn decode_step(&self, tokens: &[u32]) -> Result<StepInput, ModelError> {
        self.layout.decode_step(tokens)
    }
    /// See [`ColumnLayout::tree_step`].
    pub fn tree_step(&self, trees: &[(&[u32], &[Option<usize>])]) -> Result<StepInput, ModelError> {
        self.layout.tree_step(trees)
    }
    /// See [`ColumnLayout::attention_mask`].
    pub fn attention_mask(&self, step: &StepInput, groups: usize) -> Vec<f32> {
        self.layout.attention_mask(step, groups)
    }
    /// Checks the step and that there is room for it before any tensor is written.
    pub fn reserve(&self, step: &StepInput) -> Result<(), ModelError> {
        self.layout.check_step(step)
    }
    /// See [`ColumnLayout::advance`].
    pub fn advance(&mut self, step: &StepInput) {
        self.layout.advance(step)
    }
    /// See [`ColumnLayout::rollback`].
    pub fn rollback(&mut self, columns: usize) {
        self.layout.rollback(columns)
    }
    /// See [`ColumnLayout::keep_only`].
    pub fn keep_only(&mut self, b: usize, step_width: usize, accepted: &[usize]) {
        self.layout.keep_only(b, step_width, accepted)
    }

    /// Moves the sequences of `other` (same model and capacity, e.g. newcomers prefilled on
    /// their own) into this batch, after its current rows.
    pub fn append(&mut self, other: KvCache<B>) -> Result<(), ModelError> {
        if other.keys.len() != self.keys.len() {
            return Err(ModelError::InvalidStep {
                reason: "cannot join caches of different models".into(),
            });
        }
        self.layout.append(other.layout)?;
        for (mine, theirs) in self.keys.iter_mut().zip(other.keys) {
            *mine = append_rows(mine.clone(), theirs);
        }
        for (mine, theirs) in self.values.iter_mut().zip(other.values) {
            *mine = append_rows(mine.clone(), theirs);
        }
        Ok(())
    }

    /// Drops sequence `b` (a finished or cancelled request); later rows move up. The last
    /// sequence cannot be removed: drop the cache instead.
    pub fn remove(&mut self, b: usize) {
        assert!(
            self.batch() > 1,
            "remove the last sequence by dropping the cache"
        );
        self.layout.remove(b);
        for t in self.keys.iter_mut().chain(self.values.iter_mut()) {
            *t = remove_row(t.clone(), b);
        }
    }

    /// Keeps the sequences `keep` (distinct, at least one), sequence `keep[i]` becoming row `i`.
    pub fn retain(&mut self, keep: &[usize]) {
        assert!(
            !keep.is_empty(),
            "drop the cache instead of keeping no sequence"
        );
        self.layout.select(keep);
        let index: Vec<i64> = keep.iter().map(|&b| b as i64).collect();
        for t in self.keys.iter_mut().chain(self.values.iter_mut()) {
            let rows = Tensor::<B, 1, Int>::from_data(
                TensorData::new(index.clone(), [index.len()]),
                &t.device(),
            );
            *t = t.clone().select(0, rows);
        }
    }

    /// Moves every sequence's columns to the front so `used` becomes the longest sequence:
    /// reclaims the columns of rejected drafts, padding and departed sequences.
    pub fn compact(&mut self) {
        let plan = self.layout.compaction_plan();
        for t in self.keys.iter_mut().chain(self.values.iter_mut()) {
            *t = compact_columns(t.clone(), &plan);
        }
        self.layout.compact();
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The mask as first written (one fill, then each slot's row built and copied per group):
    /// the reference the faster builder must reproduce.
    fn reference_mask(layout: &ColumnLayout, step: &StepInput, groups: usize) -> Vec<f32> {
        let total = layout.used + step.width;
        let mut mask = vec![f32::NEG_INFINITY; step.batch * groups * step.width * total];
        for b in 0..step.batch {
            for i in 0..step.width {
                let slot = b * step.width + i;
                let mut row = vec![f32::NEG_INFINITY; total];
                if step.real[slot] {
                    for (col, &ok) in layout.valid[b].iter().enumerate() {
                        if ok {
                            row[col] = 0.0;
                        }
                    }
                    for j in 0..step.width {
                        if step.sees[slot * step.width + j] {
                            row[layout.used + j] = 0.0;
                        }
                    }
                } else {
                    row[layout.used + i] = 0.0;
                }
                for g in 0..groups {
                    let start = ((b * groups + g) * step.width + i) * total;
                    mask[start..start + total].copy_from_slice(&row);
                }
            }
        }
        mask
    }

    #[test]
    fn forgetting_the_invisible_tail_leaves_what_an_extend_of_the_kept_slots_leaves() {
        // A head extend over two whole verified chains of 4, then acceptance keeps 2 and 3
        // slots: the layout must equal an extend of those slots alone (ragged: padding).
        let mut early = ColumnLayout::new(2, 32);
        let mut exact = ColumnLayout::new(2, 32);
        for layout in [&mut early, &mut exact] {
            let prompt = layout.prefill_step(&[&[1, 2, 3], &[4, 5]]).unwrap();
            layout.advance(&prompt);
        }
        let chains = early
            .prefill_step(&[&[7, 8, 9, 10], &[11, 12, 13, 14]])
            .unwrap();
        early.advance(&chains);
        early.keep_only(0, 4, &[0, 1]);
        early.keep_only(1, 4, &[0, 1, 2]);
        early.forget_invisible_tail();
        let kept = exact.prefill_step(&[&[7, 8], &[11, 12, 13]]).unwrap();
        exact.advance(&kept);
        assert_eq!(early.used(), exact.used());
        assert_eq!(early.valid, exact.valid);
        assert_eq!(early.next_position, exact.next_position);
        // Nothing visible at the end: nothing forgotten.
        let before = early.clone();
        early.forget_invisible_tail();
        assert_eq!(early.valid, before.valid);
        // Every sequence rejected everything: back to where the extend started.
        let all = early.prefill_step(&[&[1, 1], &[2, 2]]).unwrap();
        early.advance(&all);
        early.keep_only(0, 2, &[]);
        early.keep_only(1, 2, &[]);
        early.forget_invisible_tail();
        assert_eq!(early.used(), before.used());
    }

    #[test]
    fn the_attention_mask_matches_the_reference_for_ragged_prefills_trees_and_padding() {
        let mut layout = ColumnLayout::new(3, 64);
        let same = |layout: &ColumnLayout, step: &StepInput| {
            assert!(
                layout.mask_parts(step).expand() == layout.attention_mask(step, 1),
                "the compact parts expand to another mask"
            );
            for groups in [1, 3] {
                let got = layout.attention_mask(step, groups);
                let want = reference_mask(layout, step, groups);
                assert_eq!(got.len(), want.len());
                // NEG_INFINITY == NEG_INFINITY, so plain equality compares the patterns.
                assert!(got == want, "groups {groups}: masks differ");
            }
        };
        // A ragged prefill (sequence 1 shorter: padding slots), from an empty cache.
        let step = layout
            .prefill_step(&[&[1, 2, 3, 4], &[5, 6], &[7, 8, 9]])
            .unwrap();
        same(&layout, &step);
        layout.advance(&step);
        // A tree step with branching, then a rollback-free decode and a chunk with one
        // sequence idle (an empty chunk: all padding).
        let parents: Vec<Option<usize>> = vec![None, Some(0), Some(0), Some(1)];
        let trees: Vec<(&[u32], &[Option<usize>])> = vec![
            (&[1, 2, 3, 4], &parents),
            (&[5, 6], &parents[..2]),
            (&[7], &parents[..1]),
        ];
        let step = layout.tree_step(&trees).unwrap();
        same(&layout, &step);
        layout.advance(&step);
        let step = layout.prefill_step(&[&[3], &[], &[4, 5]]).unwrap();
        same(&layout, &step);
        // Padded to 5 sequences: the two spare ones repeat sequence 0's rows.
        let parts = layout.mask_parts(&step);
        let full = parts.expand();
        let padded = parts.padded(5).expand();
        let per_sequence = step.width * (layout.used() + step.width);
        assert_eq!(padded.len(), 5 * per_sequence);
        assert!(padded[..full.len()] == full[..]);
        for spare in 3..5 {
            let rows = &padded[spare * per_sequence..(spare + 1) * per_sequence];
            assert!(rows == &full[..per_sequence], "spare sequence {spare}");
        }
    }

    /// Departed rows are refilled from the end; survivors before the first departure keep
    /// their place, and `select` carries each survivor's columns and position along.
    #[test]
    fn fill_order_moves_only_rows_that_refill_departed_places() {
        let order = |gone: &[bool]| fill_order(gone.len(), gone);
        assert_eq!(order(&[false, true, false, false, false]), [0, 4, 2, 3]);
        assert_eq!(order(&[false, true, false, false, true]), [0, 3, 2]);
        assert_eq!(order(&[true, true, false]), [2]);
        assert_eq!(order(&[false, false, true]), [0, 1]);
        assert_eq!(order(&[true, true]), Vec::<usize>::new());
        assert_eq!(order(&[false, false]), [0, 1]);
        // Every survivor exactly once, and a survivor moves only into a departed place.
        let gone = [true, false, true, false, false, true, false, true];
        let keep = order(&gone);
        let mut sorted = keep.clone();
        sorted.sort();
        assert_eq!(sorted, [1, 3, 4, 6]);
        for (i, &b) in keep.iter().enumerate() {
            assert!(
                b == i || gone[i],
                "row {b} moved into place {i}, which was live"
            );
        }
        let mut layout = ColumnLayout::new(4, 16);
        let prompts: [&[u32]; 4] = [&[1], &[1, 2], &[1, 2, 3], &[1, 2, 3, 4]];
        let step = layout.prefill_step(&prompts).unwrap();
        layout.advance(&step);
        let keep = fill_order(4, &[false, true, false, false]);
        layout.select(&keep);
        assert_eq!(layout.batch(), 3);
        assert_eq!(
            (0..3).map(|b| layout.seq_len(b)).collect::<Vec<_>>(),
            [1, 4, 3],
            "the fourth sequence now sits in the second row"
        );
    }
}
