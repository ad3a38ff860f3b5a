//! The fast path's KV cache: bf16 keys and values on the GPU, `[batch, kv_heads, capacity,
//! head_dim]` per layer (the burn cache's layout), and the very same host bookkeeping
//! ([`ColumnLayout`]) as the burn cache, so steps, masks, commits and rollbacks are built by
//! one piece of code for both paths.

use cudarc::driver::{CudaSlice, CudaView, CudaViewMut};
use tandem_model::{ColumnLayout, MaskParts, ModelError, StepInput, check_token_ids};

use std::sync::Arc;

use crate::device::{AttentionShape, Gpu, MaskColumns, Word, first_words_mut, words};
use crate::error::CudaError;
use crate::kv_pool::KvPool;

/// A step's inputs on the host: see [`CudaKvCache::step_host`].
pub(crate) struct HostStep {
    pub tokens: Vec<u32>,
    pub positions: Vec<i32>,
    /// The attention mask in compact parts, expanded on the GPU ([`StepInputs::load`]).
    pub mask: MaskParts,
    pub col0: usize,
    pub total: usize,
    pub shape: AttentionShape,
}

impl HostStep {
    /// The step with sequences appended up to `batch`, each a copy of sequence 0's inputs
    /// (tokens, positions, mask): what a graph captured for `batch` sequences runs. Their keys
    /// and values land in cache rows past the live ones (reserved, owned by no sequence), and
    /// their outputs are dropped.
    pub fn padded(mut self, batch: usize) -> Self {
        let live = self.shape.batch;
        if batch <= live {
            return self;
        }
        let width = self.shape.width;
        for _ in live..batch {
            self.tokens.extend_from_within(..width);
            self.positions.extend_from_within(..width);
        }
        self.mask = self.mask.padded(batch);
        self.shape.batch = batch;
        self
    }
}

/// A step's inputs on the device, all in one buffer that one copy fills ([`StepInputs::load`]):
/// the tokens, positions and `[col0, total]` scalars the step's launches read, then the
/// attention mask in compact parts, which `build_mask` expands into `mask`, the `[rows, total]`
/// additive mask the attention kernel reads (the host would otherwise build and upload `rows x
/// total` f32 values: ~40 MB for a 64-sequence step of 256 tokens over 600 columns). Shared by
/// the target's and the head's step buffers.
///
/// One buffer because every pageable copy costs host time: with one buffer per part a step
/// made six, a good part of a batch-1 draft step's host time. Each part has a fixed place (a
/// graph replays its launches with the addresses it captured); the mask parts, which only the
/// eager `build_mask` reads, come last, the variable-length `valid` at the end, so a step
/// copies only what it uses.
pub(crate) struct StepInputs {
    /// Bytes: tokens (u32) then positions (i32) at 4-byte places, then the two scalars, then
    /// `real [rows]`, `sees [rows, width]` and `valid [batch, used]` (u8).
    bytes: CudaSlice<u8>,
    /// The host side of the one copy, kept to reuse its allocation.
    staging: Vec<u8>,
    rows: usize,
    width: usize,
    /// Columns the mask has room for (the capacity, for a graph's buffers).
    mask_columns: usize,
    /// Whether a graph captured over these buffers expands the mask itself
    /// ([`StepInputs::build_mask_in_graph`]); [`StepInputs::load`] then only copies.
    mask_in_graph: bool,
    /// `[rows, total]` of the step, inside room for `[rows, mask_columns]`.
    pub mask: CudaSlice<f32>,
}

/// Whether graphed steps expand their mask inside the graph (`TANDEM_CUDA_GRAPH_MASK=0`: an
/// eager `build_mask` launch before each replay, as before session 56).
pub(crate) fn graph_mask() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("TANDEM_CUDA_GRAPH_MASK").map_or(true, |v| v != "0"))
}

impl StepInputs {
    pub fn new(gpu: &Gpu, shape: AttentionShape, mask_columns: usize) -> Result<Self, CudaError> {
        let rows = shape.rows();
        let fixed = Self::valid_at(rows, shape.width);
        Ok(Self {
            bytes: gpu.scratch(fixed + shape.batch * mask_columns)?,
            staging: Vec::with_capacity(fixed),
            rows,
            width: shape.width,
            mask_columns,
            mask_in_graph: false,
            mask: gpu.scratch(rows * mask_columns)?,
        })
    }

    /// Queues (inside a capture) the mask's expansion from the parts [`StepInputs::load`]
    /// copies in, reading the used columns and the row stride from the scalars: each replay
    /// expands its own step's mask, one eager launch fewer a graphed step. From then on `load`
    /// leaves the mask to the graph.
    pub fn build_mask_in_graph(&mut self, gpu: &Gpu) -> Result<(), CudaError> {
        let (rows, width) = (self.rows, self.width);
        let valid_at = Self::valid_at(rows, width);
        let scalars = words::<i32>(&self.bytes, Self::scalars_at(rows), 2);
        let valid = self.bytes.slice(valid_at..);
        let sees = self.bytes.slice(Self::sees_at(rows)..valid_at);
        let real = self.bytes.slice(Self::real_at(rows)..Self::sees_at(rows));
        let columns = MaskColumns::FromScalars {
            scalars: &scalars,
            capacity: self.mask_columns,
        };
        gpu.build_mask(&valid, &sees, &real, &mut self.mask, (rows, width), columns)?;
        self.mask_in_graph = true;
        Ok(())
    }

    /// Where the scalars, `real`, `sees` and `valid` start (tokens at 0, positions at 4 * rows).
    fn scalars_at(rows: usize) -> usize {
        8 * rows
    }
    fn real_at(rows: usize) -> usize {
        Self::scalars_at(rows) + 8
    }
    fn sees_at(rows: usize) -> usize {
        Self::real_at(rows) + rows
    }
    fn valid_at(rows: usize, width: usize) -> usize {
        Self::sees_at(rows) + rows * width
    }

    fn words<T: Word>(&self, at: usize, n: usize) -> CudaView<'_, T> {
        words(&self.bytes, at, n)
    }

    pub fn tokens(&self) -> CudaView<'_, u32> {
        self.words(0, self.rows)
    }

    /// The tokens for a kernel or copy that writes them on the device, after [`Self::load`]:
    /// a chained draft step's tokens are the previous step's greedy ids, never on the host.
    pub fn tokens_mut(&mut self) -> CudaViewMut<'_, u32> {
        // The tokens are the buffer's first 4 * rows bytes.
        first_words_mut(&mut self.bytes, self.rows)
    }

    pub fn positions(&self) -> CudaView<'_, i32> {
        self.words(4 * self.rows, self.rows)
    }

    /// `[col0, total]` for graph replays (see `rope_qkv` in kernels/llama.cu).
    pub fn scalars(&self) -> CudaView<'_, i32> {
        self.words(Self::scalars_at(self.rows), 2)
    }

    /// Copies the step's inputs in with one copy and expands the mask (unless a graph over these
    /// buffers does: [`StepInputs::build_mask_in_graph`]).
    pub fn load(&mut self, gpu: &Gpu, host: &HostStep) -> Result<(), CudaError> {
        let (rows, width) = (self.rows, self.width);
        let parts = &host.mask;
        assert!(host.tokens.len() <= rows && host.positions.len() <= rows);
        assert!(parts.real.len() <= rows && parts.sees.len() <= rows * width);
        let valid_at = Self::valid_at(rows, width);
        let end = valid_at + parts.valid.len();
        assert!(end <= self.bytes.len());
        let staging = &mut self.staging;
        staging.clear();
        staging.resize(end, 0);
        let mut put =
            |at: usize, values: &[u8]| staging[at..at + values.len()].copy_from_slice(values);
        for (i, t) in host.tokens.iter().enumerate() {
            put(4 * i, &t.to_ne_bytes());
        }
        for (i, p) in host.positions.iter().enumerate() {
            put(4 * (rows + i), &p.to_ne_bytes());
        }
        let scalars_at = Self::scalars_at(rows);
        put(scalars_at, &(host.col0 as i32).to_ne_bytes());
        put(scalars_at + 4, &(host.total as i32).to_ne_bytes());
        put(Self::real_at(rows), &parts.real);
        put(Self::sees_at(rows), &parts.sees);
        put(valid_at, &parts.valid);
        gpu.upload_into(staging, &mut self.bytes)?;
        if self.mask_in_graph {
            return Ok(());
        }
        let at = |from: usize, n: usize| self.bytes.slice(from..from + n);
        gpu.build_mask(
            &at(valid_at, parts.valid.len()),
            &at(Self::sees_at(rows), parts.sees.len()),
            &at(Self::real_at(rows), parts.real.len()),
            &mut self.mask,
            (parts.real.len(), parts.width),
            MaskColumns::Used(parts.used),
        )
    }
}

pub struct CudaKvCache {
    pub(crate) keys: Vec<CudaSlice<u16>>,
    pub(crate) values: Vec<CudaSlice<u16>>,
    kv_heads: usize,
    head_dim: usize,
    layout: ColumnLayout,
    /// Sequences the buffers have room for (at least the batch): joins within it copy only the
    /// newcomers, and the buffers keep their addresses, so captured CUDA graphs stay valid.
    rows_allocated: usize,
    /// Where the buffers go when the cache is dropped or reallocated ([`crate::kv_pool`]).
    pool: Arc<KvPool>,
    /// Under tensor parallelism (on rank 0's cache), the other ranks' caches of their KV heads,
    /// each on its rank's GPU. Their layouts follow this one's: every move copies it to them
    /// first ([`CudaKvCache::sync_peers`]), so the driver edits one layout.
    pub(crate) peers: Vec<PeerCache>,
}

/// Another tensor-parallel rank's cache and the GPU it lives on.
pub(crate) struct PeerCache {
    pub(crate) gpu: Arc<Gpu>,
    pub(crate) cache: CudaKvCache,
}

impl Drop for CudaKvCache {
    fn drop(&mut self) {
        let (keys, values) = (
            std::mem::take(&mut self.keys),
            std::mem::take(&mut self.values),
        );
        self.recycle(keys, values);
        // The other ranks' caches go back to their pools (which may free) with their own GPU
        // current: cudarc frees without binding a context.
        for peer in self.peers.drain(..) {
            peer.gpu.make_current();
            drop(peer);
        }
    }
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
        // Keys then values, one set: a cache of this shape dropped earlier hands back its
        // buffers in this order, so the graphs captured over them replay for this one.
        let mut keys = gpu.kv_buffers(2 * num_layers, n)?;
        let values = keys.split_off(num_layers);
        Ok(Self {
            keys,
            values,
            kv_heads,
            head_dim,
            layout: ColumnLayout::new(batch, capacity),
            rows_allocated: batch,
            pool: gpu.kv_pool(),
            peers: Vec::new(),
        })
    }

    /// This cache with the other tensor-parallel ranks' caches (same batch and capacity).
    pub(crate) fn with_peers(mut self, peers: Vec<PeerCache>) -> Self {
        self.peers = peers;
        self
    }

    /// Makes `gpu` current again after the other ranks' moves (their launches bind their own
    /// GPUs; cuBLAS calls on this one run in the current context).
    fn rebind(&self, gpu: &Gpu) -> Result<(), CudaError> {
        if self.peers.is_empty() {
            return Ok(());
        }
        gpu.bind_to_thread()
    }

    /// Copies this cache's layout (and allocation) to the other ranks' caches.
    pub(crate) fn sync_peers(&mut self) {
        for peer in &mut self.peers {
            peer.cache.layout = self.layout.clone();
            peer.cache.rows_allocated = self.rows_allocated;
        }
    }

    /// Hands a replaced (or the dropped cache's) set of buffers to the pool, keys first.
    fn recycle(&self, mut keys: Vec<CudaSlice<u16>>, values: Vec<CudaSlice<u16>>) {
        keys.extend(values);
        self.pool.put(keys);
    }

    /// Sequences the buffers hold without reallocating.
    pub fn rows_allocated(&self) -> usize {
        self.rows_allocated
    }

    /// Grows the buffers to hold `rows` sequences (one reallocation now; none at later joins up
    /// to that many). Never shrinks.
    pub fn reserve(&mut self, gpu: &Gpu, rows: usize) -> Result<(), CudaError> {
        if rows <= self.rows_allocated {
            return Ok(());
        }
        self.sync_peers();
        for peer in &mut self.peers {
            peer.cache.reserve(&peer.gpu, rows)?;
        }
        self.rebind(gpu)?;
        let own = ColumnMoves::whole_rows(self.batch(), self.layout.used(), 0);
        let (keys, values) = self.moved(gpu, rows, &[(self.buffers(), &own)])?;
        self.replace_buffers(keys, values);
        self.rows_allocated = rows;
        Ok(())
    }

    pub fn batch(&self) -> usize {
        self.layout.batch()
    }

    /// Moves the sequences of `other` (same model and capacity, e.g. newcomers prefilled on
    /// their own) into this batch, after its current rows: what a running batch does when
    /// requests join. Within [`Self::rows_allocated`] only the newcomers' columns are copied, in
    /// place; beyond it every layer gets new buffers. Each sequence keeps its columns.
    pub fn append(&mut self, gpu: &Gpu, mut other: CudaKvCache) -> Result<(), CudaError> {
        if other.keys.len() != self.keys.len()
            || (other.kv_heads, other.head_dim) != (self.kv_heads, self.head_dim)
            || other.peers.len() != self.peers.len()
        {
            return Err(ModelError::InvalidStep {
                reason: "cannot join caches of different models".into(),
            }
            .into());
        }
        self.sync_peers();
        other.sync_peers();
        for (peer, theirs) in self.peers.iter_mut().zip(std::mem::take(&mut other.peers)) {
            peer.cache.append(&peer.gpu, theirs.cache)?;
        }
        self.rebind(gpu)?;
        let (mine, theirs) = (self.batch(), other.batch());
        let own = ColumnMoves::whole_rows(mine, self.layout.used(), 0);
        let joined = ColumnMoves::whole_rows(theirs, other.layout.used(), mine);
        self.layout.append(other.layout.clone())?;
        let batch = mine + theirs;
        if batch <= self.rows_allocated {
            let capacity = self.layout.capacity();
            let (src, dst) = joined.head_rows(self.kv_heads, capacity);
            let (count, src, dst) = (src.len(), gpu.upload(&src)?, gpu.upload(&dst)?);
            let pairs = other
                .keys
                .iter()
                .zip(self.keys.iter_mut())
                .chain(other.values.iter().zip(self.values.iter_mut()));
            gpu.copy_rows_u16_each(pairs, &src, &dst, count, self.head_dim)?;
            return Ok(());
        }
        self.rows_allocated = batch;
        let sources = [(self.buffers(), &own), (other.buffers(), &joined)];
        let (keys, values) = self.moved(gpu, batch, &sources)?;
        self.replace_buffers(keys, values);
        Ok(())
    }

    /// Keeps the sequences `keep` (distinct, in any order: sequence `keep[i]` becomes row `i`)
    /// and drops the others (finished or cancelled), moving only the rows that change place, in
    /// place. Keeping none leaves an empty batch whose buffers wait for the next join. With
    /// [`tandem_model::fill_order`] only the rows that fill a departed row's place move.
    pub fn retain(&mut self, gpu: &Gpu, keep: &[usize]) -> Result<(), CudaError> {
        let mut seen = vec![false; self.batch()];
        for &b in keep {
            assert!(
                b < seen.len() && !seen[b],
                "retain: {keep:?} is not a set of rows"
            );
            seen[b] = true;
        }
        self.sync_peers();
        for peer in &mut self.peers {
            peer.cache.retain(&peer.gpu, keep)?;
        }
        self.rebind(gpu)?;
        let moves = ColumnMoves::kept_rows(keep, self.layout.used());
        self.move_in_place(gpu, &moves)?;
        self.layout.select(keep);
        Ok(())
    }

    /// Moves every sequence's columns to the front ([`ColumnLayout::compaction_plan`]), so
    /// `used` becomes the longest sequence: reclaims the columns of rejected drafts, padding
    /// and departed sequences. Positions are baked into the cached keys, so attention is exact.
    pub fn compact(&mut self, gpu: &Gpu) -> Result<(), CudaError> {
        self.sync_peers();
        for peer in &mut self.peers {
            peer.cache.compact(&peer.gpu)?;
        }
        self.rebind(gpu)?;
        let moves = ColumnMoves::compaction(&self.layout.compaction_plan());
        self.move_in_place(gpu, &moves)?;
        self.layout.compact();
        Ok(())
    }

    /// Carries out `moves` within the buffers (addresses kept): the columns that change place
    /// are gathered into a staging buffer, then scattered to their destinations, so a column
    /// that is both a source and a destination is read before it is overwritten.
    fn move_in_place(&mut self, gpu: &Gpu, moves: &ColumnMoves) -> Result<(), CudaError> {
        let moves = ColumnMoves(
            moves
                .0
                .iter()
                .copied()
                .filter(|&(sb, sc, db, dc)| (sb, sc) != (db, dc))
                .collect(),
        );
        if moves.0.is_empty() {
            return Ok(());
        }
        let (src, dst) = moves.head_rows(self.kv_heads, self.layout.capacity());
        let count = src.len();
        let (src, dst) = (gpu.upload(&src)?, gpu.upload(&dst)?);
        // Every layer's keys and values in two launches (two per buffer before: 120 for
        // SmolLM2, ~0.5 ms per retirement).
        gpu.move_rows_u16(
            self.keys.iter_mut().chain(self.values.iter_mut()),
            &src,
            &dst,
            count,
            self.head_dim,
        )?;
        Ok(())
    }

    /// Moves the cache onto `keys` and `values`, recycling the buffers it leaves.
    fn replace_buffers(&mut self, keys: Vec<CudaSlice<u16>>, values: Vec<CudaSlice<u16>>) {
        let keys = std::mem::replace(&mut self.keys, keys);
        let values = std::mem::replace(&mut self.values, values);
        self.recycle(keys, values);
    }

    /// Every layer's keys, then every layer's values.
    fn buffers(&self) -> Vec<&CudaSlice<u16>> {
        self.keys.iter().chain(&self.values).collect()
    }

    /// New per-layer keys and values for `rows` sequences holding the `moves` of each source
    /// (its [`Self::buffers`]), taken from the pool as one set like a new cache's.
    #[allow(clippy::type_complexity)]
    fn moved(
        &self,
        gpu: &Gpu,
        rows: usize,
        sources: &[(Vec<&CudaSlice<u16>>, &ColumnMoves)],
    ) -> Result<(Vec<CudaSlice<u16>>, Vec<CudaSlice<u16>>), CudaError> {
        let capacity = self.layout.capacity();
        let n = rows * self.kv_heads * capacity * self.head_dim;
        let indices = sources
            .iter()
            .map(|(_, moves)| {
                let (src, dst) = moves.head_rows(self.kv_heads, capacity);
                Ok((src.len(), gpu.upload(&src)?, gpu.upload(&dst)?))
            })
            .collect::<Result<Vec<_>, CudaError>>()?;
        // Keys then values, as the sources list them.
        let mut set = gpu.kv_buffers(2 * self.keys.len(), n)?;
        for (i, buffer) in set.iter_mut().enumerate() {
            for ((buffers, _), (count, src, dst)) in sources.iter().zip(&indices) {
                gpu.copy_rows_u16(buffers[i], src, buffer, dst, *count, self.head_dim)?;
            }
        }
        let values = set.split_off(self.keys.len());
        Ok((set, values))
    }

    /// Every layer's keys and values on the host, `[batch, kv_heads, capacity, head_dim]` bf16
    /// bits each (the live sequences only; for tests and debugging). Under tensor parallelism,
    /// rank 0's KV heads.
    pub fn to_host(&self, gpu: &Gpu) -> Result<HostKv, CudaError> {
        let n = self.batch() * self.kv_heads * self.layout.capacity() * self.head_dim;
        let live = |buffer: &CudaSlice<u16>| -> Result<Vec<u16>, CudaError> {
            let mut host = gpu.download(buffer)?;
            host.truncate(n);
            Ok(host)
        };
        let keys = self.keys.iter().map(live).collect::<Result<_, _>>()?;
        let values = self.values.iter().map(live).collect::<Result<_, _>>()?;
        Ok((keys, values))
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

    /// Checks `step` against this cache and the vocabulary and builds what its kernels read:
    /// token ids, RoPE positions and the `[rows, total]` attention mask (by the same ColumnLayout
    /// code as the burn path's; one group: GQA is resolved in the kernel), for the step's
    /// buffers (a new one per eager step, or the ones a graph was captured over).
    pub(crate) fn step_host(
        &self,
        step: &StepInput,
        vocab_size: usize,
        [heads, kv_heads, head_dim]: [usize; 3],
    ) -> Result<HostStep, CudaError> {
        self.check(step)?;
        check_token_ids(&step.tokens, vocab_size)?;
        Ok(HostStep {
            tokens: step.tokens.clone(),
            positions: step.positions.iter().map(|&p| p as i32).collect(),
            mask: self.layout.mask_parts(step),
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

    /// The device addresses of every layer's key and value buffers: a graph captured over this
    /// cache is valid for exactly these.
    pub(crate) fn addresses(&self, gpu: &Gpu) -> Vec<u64> {
        self.keys
            .iter()
            .chain(&self.values)
            .map(|buffer| gpu.address(buffer))
            .collect()
    }
    pub(crate) fn advance(&mut self, step: &StepInput) {
        self.layout.advance(step)
    }
}

/// Per-layer keys and values on the host ([`CudaKvCache::to_host`]).
pub type HostKv = (Vec<Vec<u16>>, Vec<Vec<u16>>);

/// Cache columns to move: `(source sequence, source column, destination sequence, destination
/// column)`, each for every KV head. Pure bookkeeping, so the index math is unit-tested on the
/// CPU; the GPU copy is one `copy_rows_u16` launch per layer and source.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ColumnMoves(pub Vec<(usize, usize, usize, usize)>);

impl ColumnMoves {
    /// Columns `0..used` of sequences `0..batch`, to sequences `offset..offset + batch`.
    pub fn whole_rows(batch: usize, used: usize, offset: usize) -> Self {
        Self(
            (0..batch)
                .flat_map(|b| (0..used).map(move |c| (b, c, b + offset, c)))
                .collect(),
        )
    }

    /// Columns `0..used` of sequences `keep[i]`, to sequence `i`.
    pub fn kept_rows(keep: &[usize], used: usize) -> Self {
        Self(
            keep.iter()
                .enumerate()
                .flat_map(|(to, &b)| (0..used).map(move |c| (b, c, to, c)))
                .collect(),
        )
    }

    /// `plan[b]`: the columns sequence `b` owns, in order; they move to `0..plan[b].len()`.
    pub fn compaction(plan: &[Vec<usize>]) -> Self {
        Self(
            plan.iter()
                .enumerate()
                .flat_map(|(b, cols)| cols.iter().enumerate().map(move |(to, &c)| (b, c, b, to)))
                .collect(),
        )
    }

    /// Flat row indices (`(sequence * kv_heads + head) * capacity + column`) of every move and
    /// head: `(source rows, destination rows)` for `copy_rows_u16`.
    pub fn head_rows(&self, kv_heads: usize, capacity: usize) -> (Vec<i32>, Vec<i32>) {
        let row = |b: usize, h: usize, c: usize| ((b * kv_heads + h) * capacity + c) as i32;
        let mut src = Vec::with_capacity(self.0.len() * kv_heads);
        let mut dst = Vec::with_capacity(self.0.len() * kv_heads);
        for &(sb, sc, db, dc) in &self.0 {
            for h in 0..kv_heads {
                src.push(row(sb, h, sc));
                dst.push(row(db, h, dc));
            }
        }
        (src, dst)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Hand-worked: 3 sequences of 2 used columns; 2 KV heads, capacity 4.
    #[test]
    fn column_moves_address_every_head_of_every_moved_column() {
        let joined = ColumnMoves::whole_rows(1, 2, 3);
        assert_eq!(joined.0, [(0, 0, 3, 0), (0, 1, 3, 1)]);
        let (src, dst) = joined.head_rows(2, 4);
        // Source sequence 0: heads at rows 0..4 (head 0) and 4..8 (head 1).
        assert_eq!(src, [0, 4, 1, 5]);
        // Destination sequence 3 starts at row (3 * 2) * 4 = 24.
        assert_eq!(dst, [24, 28, 25, 29]);

        let removed = ColumnMoves::kept_rows(&[0, 2], 2);
        assert_eq!(
            removed.0,
            [(0, 0, 0, 0), (0, 1, 0, 1), (2, 0, 1, 0), (2, 1, 1, 1)]
        );

        let compacted = ColumnMoves::compaction(&[vec![0, 2, 3], vec![1]]);
        assert_eq!(
            compacted.0,
            [(0, 0, 0, 0), (0, 2, 0, 1), (0, 3, 0, 2), (1, 1, 1, 0)]
        );
        let (src, dst) = compacted.head_rows(1, 4);
        assert_eq!(src, [0, 2, 3, 5]);
        assert_eq!(dst, [0, 1, 2, 4]);
    }
}
