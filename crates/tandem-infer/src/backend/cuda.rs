//! The CUDA fast path as a [`SpecBackend`]: [`CudaTarget`] verifies, [`CudaDraft`] drafts,
//! rows are f32 device matrices, gathers are `copy_rows` launches (one per source), greedy
//! tokens and the head's top-k are computed on the GPU and only they come back.

use tandem_cuda::host_spans;
use tandem_cuda::{
    CudaDraft, CudaKvCache, CudaSlice, CudaStepOutput, CudaTarget, DeviceLogits, DeviceRows, Gpu,
    KeptTaps, PendingRead, chain_ids_to_host, chains_from_step_major,
};
use tandem_model::{ColumnLayout, LogitsFor, StepInput, TapRequest, Taps};

use super::{DeferredTaps, SpecBackend, host_beams, host_chain, with_chain_tokens};
use crate::engine::InferError;
use crate::tree::DraftStep;

/// Rows `picks[j] = (source, row)` of `[_, cols]` f32 device matrices, as a new
/// `[picks.len(), cols]` matrix: one `copy_rows` launch per source used.
fn gather_f32(
    gpu: &Gpu,
    sources: &[&CudaSlice<f32>],
    picks: &[(usize, usize)],
    cols: usize,
) -> Result<CudaSlice<f32>, InferError> {
    let mut out = gpu.scratch::<f32>(picks.len().max(1) * cols)?;
    // Every source's row indices, its source rows then its destination rows, in one upload:
    // a draft step gathers from up to `steps` sources, and each upload is an allocation and a
    // pageable copy.
    let mut index = Vec::with_capacity(2 * picks.len());
    let mut ranges = Vec::with_capacity(sources.len());
    for s in 0..sources.len() {
        let at = index.len();
        let mine = || picks.iter().enumerate().filter(|(_, p)| p.0 == s);
        index.extend(mine().map(|(_, p)| p.1 as i32));
        index.extend(mine().map(|(j, _)| j as i32));
        ranges.push((at, (index.len() - at) / 2));
    }
    if index.is_empty() {
        return Ok(out);
    }
    let index = gpu.upload(&index)?;
    for (data, &(at, n)) in sources.iter().zip(&ranges) {
        if n == 0 {
            continue;
        }
        gpu.copy_rows(
            data,
            &index.slice(at..at + n),
            &mut out,
            &index.slice(at + n..at + 2 * n),
            n,
            cols,
        )?;
    }
    Ok(out)
}

/// A target step's logits and taps (the driver's steps always ask for logits).
fn with_logits(out: CudaStepOutput) -> Result<(DeviceLogits, Taps<DeviceRows>), InferError> {
    let logits = out.logits.ok_or_else(|| InferError::Config {
        field: "logits",
        reason: "the driver's target steps ask for logits".into(),
    })?;
    Ok((logits, out.taps))
}

/// The backlog with room for `needed` rows of every tap (`hidden` wide): grown to at least
/// twice its size when short, its first `kept` rows copied over.
fn grown_backlog<'a>(
    gpu: &Gpu,
    backlog: &'a mut Option<Taps<DeviceRows>>,
    taps: &[tandem_wiring::TapId],
    hidden: usize,
    kept: usize,
    needed: usize,
) -> Result<&'a mut Taps<DeviceRows>, InferError> {
    let capacity = backlog.as_ref().map_or(0, |t| t.tensors[0].batch);
    if needed > capacity {
        let grown = needed.max(2 * capacity).max(1024);
        let mut tensors = Vec::with_capacity(taps.len());
        for i in 0..taps.len() {
            let mut data = gpu.scratch::<f32>(grown * hidden)?;
            if let Some(old) = backlog.as_ref() {
                gpu.copy_into(&old.tensors[i].data, &mut data, kept * hidden)?;
            }
            tensors.push(DeviceRows {
                data,
                batch: grown,
                width: 1,
                hidden,
            });
        }
        *backlog = Some(Taps {
            taps: taps.to_vec(),
            tensors,
            visited: Vec::new(),
        });
    }
    Ok(backlog.as_mut().expect("allocated above"))
}

impl SpecBackend for CudaTarget {
    type Head = CudaDraft;
    type Cache = CudaKvCache;
    type Rows = DeviceRows;
    type Logits = DeviceLogits;
    type KeptTaps = KeptTaps;

    fn vocab_size(&self) -> usize {
        self.spec.vocab_size
    }
    fn max_positions(&self) -> usize {
        self.spec.max_position_embeddings
    }
    fn layout(cache: &CudaKvCache) -> &ColumnLayout {
        cache.layout()
    }
    fn layout_mut(cache: &mut CudaKvCache) -> &mut ColumnLayout {
        cache.layout_mut()
    }
    fn cache_columns(&self, columns: usize) -> usize {
        tandem_cuda::cache_columns(columns)
    }
    fn new_cache(&self, rows: usize, capacity: usize) -> Result<CudaKvCache, InferError> {
        Ok(CudaTarget::new_cache(self, rows, capacity)?)
    }
    fn forward(
        &self,
        step: &StepInput,
        cache: &mut CudaKvCache,
        taps: &TapRequest,
        logits_for: LogitsFor,
    ) -> Result<(DeviceLogits, Taps<DeviceRows>), InferError> {
        with_logits(CudaTarget::forward(self, step, cache, taps, logits_for)?)
    }

    fn logit_rows(logits: &DeviceLogits) -> usize {
        logits.rows
    }
    fn argmax(&self, logits: &DeviceLogits) -> Result<Vec<u32>, InferError> {
        Ok(logits.argmax()?)
    }
    fn logits_to_host(&self, logits: &DeviceLogits) -> Result<Vec<f32>, InferError> {
        Ok(logits.to_host()?)
    }
    fn softmax_topk(
        &self,
        logits: &DeviceLogits,
        k: usize,
    ) -> Result<(Vec<f32>, Vec<u32>), InferError> {
        Ok(logits.topk(k)?)
    }

    fn head_dims(head: &CudaDraft) -> (usize, usize) {
        (head.spec.hidden_size, head.vocab.draft_size())
    }
    fn to_target(head: &CudaDraft, id: u32) -> u32 {
        head.vocab.to_target(id as usize)
    }
    fn new_head_cache(
        &self,
        head: &CudaDraft,
        rows: usize,
        capacity: usize,
    ) -> Result<CudaKvCache, InferError> {
        Ok(head.new_cache(rows, capacity)?)
    }
    fn head_extend(
        &self,
        head: &CudaDraft,
        cache: &mut CudaKvCache,
        step: &StepInput,
        taps: &Taps<DeviceRows>,
        tap_rows: &[usize],
        last: &[usize],
    ) -> Result<(DeviceRows, DeviceLogits), InferError> {
        let rows: Vec<i32> = tap_rows.iter().map(|&r| r as i32).collect();
        let last: Vec<i32> = last.iter().map(|&r| r as i32).collect();
        let out = head.extend_taps(step, taps, &rows, cache, &last)?;
        Ok((out.hidden, out.logits))
    }
    fn head_step(
        &self,
        head: &CudaDraft,
        cache: &mut CudaKvCache,
        step: &StepInput,
        hidden: DeviceRows,
    ) -> Result<(DeviceRows, DeviceLogits), InferError> {
        let out = head.forward_step(step, hidden.data, cache)?;
        Ok((out.hidden, out.logits))
    }

    /// Tree drafting picks its beams on the GPU ([`CudaDraft::draft_beams`]: one read-back at
    /// the end instead of one per step, for topk up to 8) when the head says so (the default;
    /// `TANDEM_CUDA_DEVICE_BEAMS=0` or [`CudaDraft::set_device_beams`] for the host's beams,
    /// [`host_beams`]); both record the
    /// same bits (`device_beams_record_what_the_host_beams_record`).
    fn head_beams(
        &self,
        head: &CudaDraft,
        cache: &mut CudaKvCache,
        hidden: &DeviceRows,
        logits: &DeviceLogits,
        batch: usize,
        (steps, topk): (usize, usize),
    ) -> Result<Vec<Vec<DraftStep>>, InferError> {
        // The kernel takes up to 64 candidates a sequence (topk 8).
        if !head.device_beams() || topk > 8 {
            return host_beams(self, head, cache, hidden, logits, batch, (steps, topk));
        }
        let records = head.draft_beams(cache, &hidden.data, &logits.data, batch, (steps, topk))?;
        Ok(records
            .into_iter()
            .map(|steps| {
                steps
                    .into_iter()
                    .map(|r| DraftStep {
                        scores: r.scores,
                        tokens: r.tokens,
                        parents: r.parents,
                    })
                    .collect()
            })
            .collect())
    }

    /// The chain stays on the GPU ([`CudaDraft::draft_chain_ids`]) and so do its tokens: the
    /// verification reads them there, and the host reads them once, after the verification's
    /// own results (one wait for the device a round, not one per draft step plus one before
    /// verifying). `TANDEM_CUDA_DEVICE_CHAIN=0` drafts step by step through the host instead
    /// ([`host_chain`], the same-run baseline).
    type Chains = CudaChains;
    fn head_chains(
        &self,
        head: &CudaDraft,
        cache: &mut CudaKvCache,
        hidden: &DeviceRows,
        logits: &DeviceLogits,
        batch: usize,
        steps: usize,
    ) -> Result<CudaChains, InferError> {
        if !device_chain() {
            let host = host_chain(self, head, cache, hidden, logits, batch, steps)?;
            return Ok(CudaChains::Host(host));
        }
        let _chain = host_spans::span("draft chain");
        let ids = head.draft_chain_ids(cache, &hidden.data, &logits.data, batch, steps)?;
        Ok(CudaChains::Device { ids, batch, steps })
    }
    fn chains_to_host(&self, chains: &CudaChains) -> Result<Vec<Vec<u32>>, InferError> {
        match chains {
            CudaChains::Host(host) => Ok(host.clone()),
            CudaChains::Device { ids, batch, steps } => {
                Ok(chain_ids_to_host(self.gpu(), ids, *batch, *steps)?)
            }
        }
    }
    fn forward_chains(
        &self,
        step: &StepInput,
        cache: &mut CudaKvCache,
        taps: &TapRequest,
        logits_for: LogitsFor,
        chains: &CudaChains,
    ) -> Result<(DeviceLogits, Taps<DeviceRows>), InferError> {
        let out = match chains {
            CudaChains::Host(host) => {
                let step = with_chain_tokens(step, host)?;
                CudaTarget::forward(self, &step, cache, taps, logits_for)?
            }
            CudaChains::Device { ids, batch, steps } => {
                if *batch != step.batch {
                    return Err(InferError::Config {
                        field: "chains",
                        reason: format!(
                            "{batch} chains for a verification of {} sequences",
                            step.batch
                        ),
                    });
                }
                CudaTarget::forward_chains(self, step, cache, taps, logits_for, ids, *steps)?
            }
        };
        with_logits(out)
    }

    /// The greedy ids stay on the GPU for the head's extend, and go to the host through
    /// page-locked memory with an event of their own ([`Gpu::read_back`]), with the chain's
    /// tokens after them: the extend queued behind the read does not delay it.
    type ReadBack = CudaReadBack;
    fn greedy_read_back(
        &self,
        logits: &DeviceLogits,
        chains: &CudaChains,
    ) -> Result<CudaReadBack, InferError> {
        let _queue = host_spans::span("read-back: queue");
        let gpu = self.gpu();
        let rows = logits.rows;
        let (drafts, chain_len) = match chains {
            CudaChains::Host(host) => (ReadDrafts::Host(host.clone()), 0),
            CudaChains::Device { batch, steps, .. } => (
                ReadDrafts::Device {
                    batch: *batch,
                    steps: *steps,
                },
                batch * steps,
            ),
        };
        let mut ids = gpu.scratch::<u32>(rows + chain_len)?;
        gpu.argmax_rows_into(
            &logits.data,
            rows,
            logits.vocab,
            None,
            &mut ids.slice_mut(..rows),
        )?;
        if let CudaChains::Device { ids: chain, .. } = chains {
            gpu.copy_view_into(&chain.slice(..chain_len), &mut ids.slice_mut(rows..))?;
        }
        let pending = gpu.read_back(&ids.slice(..rows + chain_len))?;
        Ok(CudaReadBack {
            ids,
            rows,
            pending,
            drafts,
        })
    }
    fn plain_read_back(&self, logits: &DeviceLogits) -> Result<CudaReadBack, InferError> {
        self.greedy_read_back(logits, &CudaChains::Host(Vec::new()))
    }
    fn forward_after_read(
        &self,
        step: &StepInput,
        cache: &mut CudaKvCache,
        taps: &TapRequest,
        logits_for: LogitsFor,
        previous: &CudaReadBack,
    ) -> Result<(DeviceLogits, Taps<DeviceRows>), InferError> {
        if previous.rows != step.batch {
            return Err(InferError::Config {
                field: "previous",
                reason: format!(
                    "{} greedy ids for a decode step of {} sequences",
                    previous.rows, step.batch
                ),
            });
        }
        with_logits(CudaTarget::forward_roots(
            self,
            step,
            cache,
            taps,
            logits_for,
            &previous.ids,
        )?)
    }
    fn head_extend_greedy(
        &self,
        head: &CudaDraft,
        cache: &mut CudaKvCache,
        step: &StepInput,
        taps: &Taps<DeviceRows>,
        read: &CudaReadBack,
    ) -> Result<(DeviceRows, DeviceLogits), InferError> {
        let _extend = host_spans::span("extend (greedy, queued before the read-back)");
        let ids = read.ids.slice(..read.rows);
        let out = match &read.drafts {
            // Each sequence's root is found on the GPU from the ids and the drafts there.
            ReadDrafts::Device { steps, .. } => {
                let chain = read.ids.slice(read.rows..);
                head.extend_verified_chains(step, taps, cache, &ids, &chain, *steps)?
            }
            // Chains drafted through the host go to the GPU in the device chain's layout.
            ReadDrafts::Host(host) => {
                let steps = host.first().map_or(0, Vec::len);
                let flat: Vec<u32> = (0..steps)
                    .flat_map(|s| host.iter().map(move |c| c[s]))
                    .collect();
                let chain = self.gpu().upload(&flat)?;
                head.extend_verified_chains(step, taps, cache, &ids, &chain.slice(..), steps)?
            }
        };
        Ok((out.hidden, out.logits))
    }
    fn finish_read_back(
        &self,
        read: CudaReadBack,
    ) -> Result<(Vec<u32>, Vec<Vec<u32>>), InferError> {
        let values = {
            let _wait = host_spans::span("read-back: wait");
            read.pending.wait()?
        };
        let (ids, chain) = values.split_at(read.rows);
        let chains = match read.drafts {
            ReadDrafts::Host(host) => host,
            ReadDrafts::Device { batch, steps } => chains_from_step_major(chain, batch, steps),
        };
        Ok((ids.to_vec(), chains))
    }

    fn gather_rows(
        &self,
        sources: &[&DeviceRows],
        picks: &[(usize, usize)],
    ) -> Result<DeviceRows, InferError> {
        let hidden = sources[0].hidden;
        let data: Vec<&CudaSlice<f32>> = sources.iter().map(|r| &r.data).collect();
        Ok(DeviceRows {
            data: gather_f32(self.gpu(), &data, picks, hidden)?,
            batch: picks.len(),
            width: 1,
            hidden,
        })
    }
    fn gather_logits(
        &self,
        sources: &[&DeviceLogits],
        picks: &[(usize, usize)],
    ) -> Result<DeviceLogits, InferError> {
        let vocab = sources[0].vocab;
        let data: Vec<&CudaSlice<f32>> = sources.iter().map(|l| &l.data).collect();
        Ok(DeviceLogits::new(
            gather_f32(self.gpu(), &data, picks, vocab)?,
            picks.len(),
            vocab,
            self.gpu().clone(),
        ))
    }
    fn rows_to_host(&self, rows: &DeviceRows) -> Result<Vec<f32>, InferError> {
        Ok(rows.to_host()?)
    }
    fn rows_from_host(
        &self,
        values: &[f32],
        batch: usize,
        width: usize,
        d: usize,
    ) -> Result<DeviceRows, InferError> {
        Ok(DeviceRows {
            data: self.gpu().upload(&values[..batch * width * d])?,
            batch,
            width,
            hidden: d,
        })
    }
    fn last_block_argmax(&self, hidden: &[f32]) -> Result<Vec<u32>, InferError> {
        Ok(CudaTarget::last_block_argmax(self, hidden)?)
    }
    fn zero_rows(&self, rows: usize, width: usize) -> Result<DeviceRows, InferError> {
        Ok(DeviceRows {
            data: self.gpu().zeros::<f32>(rows * width)?,
            batch: rows,
            width: 1,
            hidden: width,
        })
    }
    fn zero_logits(&self, rows: usize, vocab: usize) -> Result<DeviceLogits, InferError> {
        Ok(DeviceLogits::new(
            self.gpu().zeros::<f32>(rows * vocab)?,
            rows,
            vocab,
            self.gpu().clone(),
        ))
    }
    /// One buffer per tap, grown by doubling (at least 1,024 rows) and kept across catch-ups:
    /// deferring a round costs one device copy per tap.
    fn backlog_push(
        &self,
        backlog: &mut Option<Taps<DeviceRows>>,
        at: usize,
        step: &Taps<DeviceRows>,
    ) -> Result<(), InferError> {
        let gpu = self.gpu();
        let incoming = Self::tap_rows(step);
        let hidden = step.tensors.first().map_or(0, |t| t.hidden);
        assert!(step.tensors.iter().all(|t| t.hidden == hidden));
        let buffers = grown_backlog(gpu, backlog, &step.taps, hidden, at, at + incoming)?;
        // Every tap in one launch: a plain round with a head pays for it before the next
        // round's step (three copies cost that round ~11 us at c=8, session 42).
        let mut pairs: Vec<_> = step
            .tensors
            .iter()
            .zip(buffers.tensors.iter_mut())
            .map(|(src, dst)| (&src.data, &mut dst.data))
            .collect();
        gpu.copy_pairs_to_offset(&mut pairs, at * hidden, incoming * hidden)?;
        Ok(())
    }
    fn forward_deferring_taps(
        &self,
        step: &StepInput,
        cache: &mut CudaKvCache,
        taps: &TapRequest,
        logits_for: LogitsFor,
    ) -> Result<(DeviceLogits, DeferredTaps<Self>), InferError> {
        let mut out = CudaTarget::forward_keeping_taps(self, step, cache, taps, logits_for)?;
        let kept = out.kept.take();
        let (logits, taps) = with_logits(out)?;
        Ok((
            logits,
            match kept {
                Some(kept) => DeferredTaps::Kept(kept),
                None => DeferredTaps::Owned(taps),
            },
        ))
    }
    fn push_kept_taps(
        &self,
        backlog: &mut Option<Taps<DeviceRows>>,
        at: usize,
        kept: &KeptTaps,
    ) -> Result<usize, InferError> {
        let hidden = self.spec.hidden_size;
        let buffers = grown_backlog(self.gpu(), backlog, &kept.taps, hidden, at, at + kept.rows)?;
        let mut dsts: Vec<&mut CudaSlice<f32>> =
            buffers.tensors.iter_mut().map(|t| &mut t.data).collect();
        CudaTarget::push_kept_taps(self, kept, &mut dsts, at)?;
        Ok(kept.rows)
    }
    fn tap_rows(taps: &Taps<DeviceRows>) -> usize {
        taps.tensors.first().map_or(0, |r| r.batch * r.width)
    }

    fn reserve(&self, cache: &mut CudaKvCache, rows: usize) -> Result<(), InferError> {
        Ok(cache.reserve(self.gpu(), rows)?)
    }
    fn append(&self, cache: &mut CudaKvCache, other: CudaKvCache) -> Result<(), InferError> {
        Ok(cache.append(self.gpu(), other)?)
    }
    fn retain(&self, cache: &mut CudaKvCache, keep: &[usize]) -> Result<(), InferError> {
        Ok(cache.retain(self.gpu(), keep)?)
    }
    fn compact(&self, cache: &mut CudaKvCache) -> Result<(), InferError> {
        Ok(cache.compact(self.gpu())?)
    }
    fn synchronize(&self) -> Result<(), InferError> {
        Ok(self.gpu().synchronize()?)
    }
    fn graphs_captured(&self, head: Option<&CudaDraft>) -> usize {
        self.graph_stats().captured + head.map_or(0, |d| d.graph_stats().captured)
    }
    fn graph_report(&self, head: Option<&CudaDraft>) -> Option<String> {
        let target = self.graph_stats();
        let mut text = format!(
            "target CUDA graphs: {} captured, {} replays",
            target.captured, target.replays
        );
        if let Some(head) = head {
            let head = head.graph_stats();
            text.push_str(&format!(
                "; head: {} captured, {} replays",
                head.captured, head.replays
            ));
        }
        Some(text)
    }
}

/// Greedy chains drafted for a verification: on the device (`ids` `[steps, batch]`, see
/// [`CudaDraft::draft_chain_ids`]) or, with `TANDEM_CUDA_DEVICE_CHAIN=0`, on the host.
pub enum CudaChains {
    Device {
        ids: CudaSlice<u32>,
        batch: usize,
        steps: usize,
    },
    Host(Vec<Vec<u32>>),
}

/// A greedy verification's ids (then its device chain's tokens, `[steps, batch]`) on the GPU,
/// and their copy to the host under way.
pub struct CudaReadBack {
    ids: CudaSlice<u32>,
    rows: usize,
    pending: PendingRead,
    drafts: ReadDrafts,
}

/// Where a read-back's verified drafts are: after the ids in its buffer (device chains), or
/// already on the host (`TANDEM_CUDA_DEVICE_CHAIN=0`).
enum ReadDrafts {
    Device { batch: usize, steps: usize },
    Host(Vec<Vec<u32>>),
}

/// Whether greedy chains are drafted on the GPU (`TANDEM_CUDA_DEVICE_CHAIN=0` turns it off).
fn device_chain() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("TANDEM_CUDA_DEVICE_CHAIN").map_or(true, |v| v != "0"))
}
