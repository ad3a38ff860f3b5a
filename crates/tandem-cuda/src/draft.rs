//! The EAGLE-3 draft head on the fast path: the same function as
//! `tandem_eagle::Eagle3Draft::forward_step` / `extend` (fc over the concatenated taps, one
//! decoder layer over `[input_layernorm(embed), hidden_norm(hidden)]`, final norm, draft
//! lm_head), built from the target's kernels: cuBLAS matmuls and the NVRTC norm, RoPE + cache
//! write, attention and SwiGLU kernels. Its KV cache is a one-layer [`CudaKvCache`] with the
//! shared [`tandem_model::ColumnLayout`] bookkeeping, like the burn head's.
//!
//! The head reads the target's hidden states only as the [`Taps`] the target's capture hook
//! produced ([`CudaDraft::fc_input`]), so serving feeds it exactly what the dump job tapped.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use cudarc::driver::{CudaSlice, CudaView, CudaViewMut};
use tandem_eagle::{DraftSpec, HostWeights, VocabMap};
use tandem_model::{ModelError, StepInput, Taps};

use crate::cache::{CudaKvCache, HostStep, StepInputs};
use crate::device::{AttentionShape, DeviceRows, GEMV_MAX_ROWS, Gpu, QkvInput};
use crate::error::CudaError;
use crate::graphs::{CapturedStep, GraphKey, GraphStats, Graphs};
use crate::host_spans;
use crate::model::{CudaTarget, DeviceLogits, GRAPH_MAX_WIDTH, fused_rows_default, graph_batch};
use crate::weights::to_bf16_bits;

/// An EAGLE-3 head in bf16 on the GPU, on top of a copy of the target's embedding.
pub struct CudaDraft {
    pub spec: DraftSpec,
    /// `d2t` / `t2d`: draft ids to target ids.
    pub vocab: VocabMap,
    gpu: Arc<Gpu>,
    embed: CudaSlice<u16>,
    /// `[H, num_taps * T]`.
    fc: CudaSlice<u16>,
    input_norm: CudaSlice<u16>,
    hidden_norm: CudaSlice<u16>,
    /// `[q | k | v, H]`: the columns of q/k/v_proj that read the normed embedding (the first
    /// half of the `2H` attention input) ...
    qkv_embed: CudaSlice<u16>,
    /// ... and those that read the normed hidden state (the second half). Two accumulating
    /// matmuls replace the concatenation.
    qkv_hidden: CudaSlice<u16>,
    o: CudaSlice<u16>,
    post_norm: CudaSlice<u16>,
    /// `[2 * intermediate, H]`: gate_proj then up_proj.
    gate_up: CudaSlice<u16>,
    down: CudaSlice<u16>,
    norm: CudaSlice<u16>,
    /// `[draft_vocab, H]`.
    lm_head: CudaSlice<u16>,
    inv_freq: CudaSlice<f32>,
    graphs: Graphs<DraftBuffers>,
    /// Steps of at most this many rows run the fused small-step kernels (as the target's).
    fused_rows: AtomicUsize,
    /// `[draft_vocab]`: the target id of each draft id (`d2t` applied), for chains drafted on
    /// the device.
    draft_to_target: CudaSlice<u32>,
    /// Whether fused steps take the draft logits from `gemv_rows` (else cuBLAS, as unfused
    /// steps do); see [`lm_head_gemv_default`].
    lm_head_gemv: bool,
    /// Whether fused steps fold the embedding into the q|k|v kernel and the final norm into
    /// the logits (two launches fewer a step); see [`head_fold_default`].
    fold: bool,
    /// Whether tree drafting picks its beams on the device ([`CudaDraft::draft_beams`]): on by
    /// default (session 40, H100: 3/4/8's draft 0.200 ms a round with them and the tensor-core
    /// small steps, 0.233 with neither; the two were measured together);
    /// `TANDEM_CUDA_DEVICE_BEAMS=0`, or [`CudaDraft::set_device_beams`], picks them on the host.
    device_beams: std::sync::atomic::AtomicBool,
    /// [`CudaDraft::draft_beams`]' device buffers for the last (batch, topk, steps) it drafted,
    /// kept between rounds: allocating, uploading and freeing them every round was about 40
    /// driver calls, which made 3/4/8's draft host bound (0.197 of its 0.200 ms a round was
    /// host queue time, session 40).
    beam_workspace: std::sync::Mutex<Option<BeamWorkspace>>,
}

/// The buffers of one tree draft of `batch` sequences, `topk` beams and `steps` steps
/// ([`CudaDraft::draft_beams`]): the hidden bank (the roots, then each later step's beam
/// outputs), the identity row list, each step's beam slots, the top-k, the double-buffered beam
/// state, the next step's tokens and hidden rows, and the record read back at the end. Every
/// use is ordered on the GPU's one stream, so a round reuses what the round before read.
struct BeamWorkspace {
    key: (usize, usize, usize),
    bank: CudaSlice<f32>,
    counting: CudaSlice<i32>,
    /// `beam_slots[s - 1]`: step s's beam outputs (each beam's path's last slot).
    beam_slots: Vec<CudaSlice<i32>>,
    topk: CudaSlice<u32>,
    scores: [CudaSlice<f32>; 2],
    paths: [CudaSlice<u32>; 2],
    hrows: [CudaSlice<i32>; 2],
    next_tokens: CudaSlice<u32>,
    next_hrows: CudaSlice<i32>,
    record: CudaSlice<u32>,
    /// Per step, the record's length.
    sizes: Vec<usize>,
}

impl BeamWorkspace {
    fn new(
        gpu: &Gpu,
        h: usize,
        (batch, k, steps): (usize, usize, usize),
    ) -> Result<Self, CudaError> {
        let beams = batch * k;
        let bank_rows = batch + (steps - 1) * beams;
        let widest = beams * steps.saturating_sub(1).max(1);
        let counting: Vec<i32> = (0..bank_rows.max(widest) as i32).collect();
        let beam_slots = (1..steps)
            .map(|s| {
                let slots: Vec<i32> = (0..beams).map(|r| (r * s + s - 1) as i32).collect();
                gpu.upload(&slots)
            })
            .collect::<Result<Vec<_>, _>>()?;
        let sizes: Vec<usize> = (0..steps)
            .map(|s| {
                let n = if s == 0 { k } else { k * k };
                2 * batch * n + if s == 0 { 0 } else { beams }
            })
            .collect();
        Ok(Self {
            key: (batch, k, steps),
            bank: gpu.scratch::<f32>(bank_rows * h)?,
            counting: gpu.upload(&counting)?,
            beam_slots,
            topk: gpu.scratch::<u32>(2 * beams * k)?,
            scores: [gpu.scratch::<f32>(beams)?, gpu.scratch::<f32>(beams)?],
            paths: [
                gpu.scratch::<u32>(beams * steps)?,
                gpu.scratch::<u32>(beams * steps)?,
            ],
            hrows: [
                gpu.scratch::<i32>(beams * steps)?,
                gpu.scratch::<i32>(beams * steps)?,
            ],
            next_tokens: gpu.scratch::<u32>(widest)?,
            next_hrows: gpu.scratch::<i32>(widest)?,
            record: gpu.scratch::<u32>(sizes.iter().sum())?,
            sizes,
        })
    }
}

/// `TANDEM_CUDA_DRAFT_LM_HEAD`: `gemv` (the default) takes a fused step's draft logits from
/// `gemv_rows`, `cublas` from cuBLAS, for same-binary comparisons on the GPU.
fn lm_head_gemv_default() -> bool {
    std::env::var("TANDEM_CUDA_DRAFT_LM_HEAD").map_or(true, |v| v != "cublas")
}

/// `TANDEM_CUDA_HEAD_FOLD=0` runs a fused head step as nine launches (the embedding through
/// `embed_rows`, the final norm through `add_rms_norm`) instead of seven, the same-binary
/// baseline of the fold. The embedding fold is exact; the norm fold stages the normed row in
/// the logits kernel with the fused kernels' one-warp-a-row sum, so its bf16 row may differ in
/// the last bit from `add_rms_norm`'s block-wide sum.
fn head_fold_default() -> bool {
    std::env::var("TANDEM_CUDA_HEAD_FOLD").map_or(true, |v| v != "0")
}

impl std::fmt::Debug for CudaDraft {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "CudaDraft(hidden {}, draft vocab {}, {:?})",
            self.spec.hidden_size, self.spec.draft_vocab_size, self.gpu
        )
    }
}

/// What one draft step returns: the pre-norm layer output (the next step's hidden input) and
/// the draft logits, both `[rows, _]` f32 with rows = `batch * width` of the step.
#[derive(Debug)]
pub struct DraftStepOutput {
    pub hidden: DeviceRows,
    pub logits: DeviceLogits,
}

/// One draft step of one sequence's tree drafting as [`CudaDraft::draft_beams`] records it, in
/// SGLang's layout (`tandem_infer::DraftStep`): the candidates' cumulative scores and target
/// ids (`topk` at step 0, `topk * topk` beam-major after) and, after step 0, the flat indices of
/// the candidates chosen as the next beams (step 0's are `[-1, 0, .., topk - 1]`).
#[derive(Debug, Clone, PartialEq)]
pub struct BeamRecord {
    pub scores: Vec<f32>,
    pub tokens: Vec<u32>,
    pub parents: Vec<i64>,
}

/// Each sequence's [`BeamRecord`]s from the read-back of [`CudaDraft::draft_beams`]: per step,
/// `[batch * n]` score bits, `[batch * n]` ids, then (after step 0) `[batch * k]` parents.
fn beam_records(values: &[u32], batch: usize, k: usize, steps: usize) -> Vec<Vec<BeamRecord>> {
    let mut out: Vec<Vec<BeamRecord>> = vec![Vec::with_capacity(steps); batch];
    let mut at = 0;
    for s in 0..steps {
        let n = if s == 0 { k } else { k * k };
        let (scores, rest) = values[at..].split_at(batch * n);
        let (tokens, rest) = rest.split_at(batch * n);
        for (b, steps_of_b) in out.iter_mut().enumerate() {
            let parents = if s == 0 {
                std::iter::once(-1).chain(0..k as i64).collect()
            } else {
                rest[b * k..(b + 1) * k]
                    .iter()
                    .map(|&p| i64::from(p))
                    .collect()
            };
            steps_of_b.push(BeamRecord {
                scores: scores[b * n..(b + 1) * n]
                    .iter()
                    .map(|&v| f32::from_bits(v))
                    .collect(),
                tokens: tokens[b * n..(b + 1) * n].to_vec(),
                parents,
            });
        }
        at += 2 * batch * n + if s == 0 { 0 } else { batch * k };
    }
    out
}

/// Columns `[from, to)` of every row of a row-major `[rows, cols]` host matrix.
fn columns(values: &[f32], cols: usize, from: usize, to: usize) -> Vec<f32> {
    values
        .chunks(cols)
        .flat_map(|row| row[from..to].iter().copied())
        .collect()
}

impl CudaDraft {
    /// Uploads a head given as host weights in HF layout (`tandem_eagle::load_host`), on top of
    /// `target`'s embedding.
    pub fn new(
        target: &CudaTarget,
        spec: DraftSpec,
        vocab: VocabMap,
        weights: &HostWeights,
    ) -> Result<Self, CudaError> {
        let gpu = target.gpu().clone();
        let unsupported = |what: String| CudaError::Unsupported {
            what,
            architecture: "EAGLE-3 head".into(),
        };
        if spec.hidden_size != target.spec.hidden_size || spec.vocab_size != target.spec.vocab_size
        {
            return Err(unsupported(format!(
                "a head of hidden {} / vocab {} on a target of hidden {} / vocab {} (the fast \
                 path shares the target's embedding)",
                spec.hidden_size, spec.vocab_size, target.spec.hidden_size, target.spec.vocab_size
            )));
        }
        if !spec.head_dim.is_multiple_of(32) || spec.head_dim > 256 {
            return Err(unsupported(format!(
                "head_dim {} (needs a multiple of 32, at most 256)",
                spec.head_dim
            )));
        }
        let h = spec.hidden_size;
        let get = |name: &str| -> Result<&Vec<f32>, CudaError> {
            let shapes = tandem_eagle::parameter_shapes(&spec);
            let expected = shapes
                .iter()
                .find(|(n, _)| *n == name)
                .map(|(_, s)| s.clone())
                .unwrap_or_default();
            match weights.get(name) {
                Some((shape, values)) if *shape == expected => Ok(values),
                Some((shape, _)) => Err(ModelError::ShapeMismatch {
                    name: name.into(),
                    expected,
                    actual: shape.clone(),
                }
                .into()),
                None => Err(ModelError::InvalidStep {
                    reason: format!("the head's host weights lack `{name}`"),
                }
                .into()),
            }
        };
        let bf16 = |values: &[f32]| gpu.upload(&to_bf16_bits(values));
        let mut qkv = get("midlayer.self_attn.q_proj.weight")?.clone();
        qkv.extend(get("midlayer.self_attn.k_proj.weight")?);
        qkv.extend(get("midlayer.self_attn.v_proj.weight")?);
        let mut gate_up = get("midlayer.mlp.gate_proj.weight")?.clone();
        gate_up.extend(get("midlayer.mlp.up_proj.weight")?);
        let inv_freq: Vec<f32> = spec.inv_freq.iter().map(|&f| f as f32).collect();
        let draft_to_target: Vec<u32> = (0..vocab.draft_size())
            .map(|d| vocab.to_target(d))
            .collect();
        Ok(Self {
            embed: target.embedding().clone(),
            fc: bf16(get("fc.weight")?)?,
            input_norm: bf16(get("midlayer.input_layernorm.weight")?)?,
            hidden_norm: bf16(get("midlayer.hidden_norm.weight")?)?,
            qkv_embed: bf16(&columns(&qkv, 2 * h, 0, h))?,
            qkv_hidden: bf16(&columns(&qkv, 2 * h, h, 2 * h))?,
            o: bf16(get("midlayer.self_attn.o_proj.weight")?)?,
            post_norm: bf16(get("midlayer.post_attention_layernorm.weight")?)?,
            gate_up: bf16(&gate_up)?,
            down: bf16(get("midlayer.mlp.down_proj.weight")?)?,
            norm: bf16(get("norm.weight")?)?,
            lm_head: bf16(get("lm_head.weight")?)?,
            inv_freq: gpu.upload(&inv_freq)?,
            graphs: Graphs::new(gpu.graphs_default()),
            fused_rows: AtomicUsize::new(fused_rows_default(spec.hidden_size)),
            draft_to_target: gpu.upload(&draft_to_target)?,
            lm_head_gemv: lm_head_gemv_default(),
            fold: head_fold_default(),
            device_beams: std::sync::atomic::AtomicBool::new(
                std::env::var("TANDEM_CUDA_DEVICE_BEAMS").map_or(true, |v| v.trim() != "0"),
            ),
            beam_workspace: std::sync::Mutex::new(None),
            spec,
            vocab,
            gpu,
        })
    }

    /// Which steps run the fused small-step kernels (see [`CudaTarget::set_fused_rows`]).
    pub fn set_fused_rows(&self, rows: usize) {
        self.fused_rows
            .store(rows.min(GEMV_MAX_ROWS), Ordering::Relaxed);
    }

    /// Whether fused steps read the embedding inside the q|k|v kernel and take the final norm
    /// inside the logits kernel (seven launches a step, the default) or launch `embed_rows` and
    /// `add_rms_norm` for them (nine; `TANDEM_CUDA_HEAD_FOLD=0`).
    pub fn set_fold(&mut self, on: bool) {
        self.fold = on;
    }

    /// Whether a step of `rows` rows runs fused (both halves of the attention input staged in
    /// shared memory).
    fn fuses(&self, rows: usize) -> bool {
        let spec = &self.spec;
        rows <= self.fused_rows.load(Ordering::Relaxed)
            && Gpu::fused_layer_fits(
                rows,
                2,
                spec.hidden_size,
                spec.num_heads,
                spec.num_kv_heads,
                spec.head_dim,
                spec.intermediate_size,
            )
    }

    pub fn gpu(&self) -> &Arc<Gpu> {
        &self.gpu
    }

    /// An empty one-layer cache for `batch` sequences of up to `capacity` columns.
    pub fn new_cache(&self, batch: usize, capacity: usize) -> Result<CudaKvCache, CudaError> {
        CudaKvCache::new(
            &self.gpu,
            1,
            batch,
            self.spec.num_kv_heads,
            self.spec.head_dim,
            capacity,
        )
    }

    /// The `fc` input for `rows` (flat slot indices of the step that produced `taps`): each
    /// tap's row converted to bf16 and placed in its slot's columns, `[rows.len(), num_taps *
    /// T]`. Refuses taps whose count or width differ from what the head was built for.
    pub fn fc_input(
        &self,
        taps: &Taps<DeviceRows>,
        rows: &[i32],
    ) -> Result<CudaSlice<u16>, CudaError> {
        self.check_taps(taps, rows)?;
        let index = self.gpu.upload(rows)?;
        self.fc_input_at(taps, &index.slice(..), rows.len())
    }

    /// [`CudaDraft::fc_input`] for `count` rows whose indices are already on the device.
    fn fc_input_at(
        &self,
        taps: &Taps<DeviceRows>,
        index: &CudaView<'_, i32>,
        count: usize,
    ) -> Result<CudaSlice<u16>, CudaError> {
        let (t, width) = (self.spec.target_hidden_size, self.spec.fc_in());
        let mut out = self.gpu.scratch::<u16>(count * width)?;
        let sources: Vec<&CudaSlice<f32>> = taps.tensors.iter().map(|tap| &tap.data).collect();
        self.gpu
            .taps_to_bf16(&sources, index, &mut out, count, t, width)?;
        Ok(out)
    }

    /// Checks that `taps` are what the head's fc reads and that `rows` are inside them.
    fn check_taps(&self, taps: &Taps<DeviceRows>, rows: &[i32]) -> Result<(), CudaError> {
        let t = self.spec.target_hidden_size;
        let widths: Vec<usize> = taps.tensors.iter().map(|r| r.hidden).collect();
        if taps.tensors.len() != self.spec.num_taps || widths.iter().any(|&w| w != t) {
            return Err(ModelError::InvalidStep {
                reason: format!(
                    "the head's fc reads {} taps of width {t}, the target step captured {} of \
                     widths {widths:?} ({:?})",
                    self.spec.num_taps,
                    taps.tensors.len(),
                    taps.taps
                ),
            }
            .into());
        }
        let available = taps.tensors.first().map_or(0, |r| r.batch * r.width);
        if let Some(&bad) = rows.iter().find(|&&r| r < 0 || r as usize >= available) {
            return Err(ModelError::InvalidStep {
                reason: format!("tap row {bad} is outside the {available} rows of the step"),
            }
            .into());
        }
        Ok(())
    }

    /// Draft extend: `hidden = fc(aux)` then [`CudaDraft::forward_step`]. `aux` is
    /// [`CudaDraft::fc_input`] for the step's `batch * width` slots.
    pub fn extend(
        &self,
        step: &StepInput,
        aux: &CudaSlice<u16>,
        cache: &mut CudaKvCache,
    ) -> Result<DraftStepOutput, CudaError> {
        let hidden = self.fc(aux, step.batch * step.width)?;
        self.forward_step(step, hidden, cache)
    }

    /// The extend a round runs after its verification: the fc input gathered from `taps` at
    /// `tap_rows` (one per slot of `step`, as [`CudaDraft::fc_input`]), [`CudaDraft::extend`],
    /// and only the slots `last` names returned (row `j` of the output is slot `last[j]`,
    /// `[last.len(), _]`): the roots the next drafts start from. Both index lists go to the
    /// device in one copy; a replayed step's fc writes straight into the graph's hidden input,
    /// and the roots are gathered out of the graph's buffers. Each of those was a device call
    /// of its own on the host's path before (an upload, a copy, an allocation).
    pub fn extend_taps(
        &self,
        step: &StepInput,
        taps: &Taps<DeviceRows>,
        tap_rows: &[i32],
        cache: &mut CudaKvCache,
        last: &[i32],
    ) -> Result<DraftStepOutput, CudaError> {
        self.extend_taps_with(step, taps, tap_rows, cache, last, None)
    }

    /// [`CudaDraft::extend_taps`] of every slot of whole verified greedy chains, the slots'
    /// tokens read on the device from the verification's greedy `ids` (`[step.batch *
    /// step.width]`, over whatever `step.tokens` holds), returning only each sequence's root
    /// for the next chain: the row of its last accepted slot, found on the device from those
    /// ids and the verified `chain` (`[steps, batch]` target ids, as
    /// [`CudaDraft::draft_chain_ids`] leaves them). Nothing here waits for the host, so the
    /// extend and the roots are queued before the verification is read.
    pub fn extend_verified_chains(
        &self,
        step: &StepInput,
        taps: &Taps<DeviceRows>,
        cache: &mut CudaKvCache,
        ids: &CudaView<'_, u32>,
        chain: &CudaView<'_, u32>,
        steps: usize,
    ) -> Result<DraftStepOutput, CudaError> {
        let rows = step.batch * step.width;
        if ids.len() < rows || chain.len() < steps * step.batch || steps >= step.width {
            return Err(ModelError::InvalidStep {
                reason: format!(
                    "{} greedy ids and {} chain tokens do not fit chains of {steps} drafts \
                     verified in {} sequences of {} slots",
                    ids.len(),
                    chain.len(),
                    step.batch,
                    step.width
                ),
            }
            .into());
        }
        let slots: Vec<i32> = (0..rows as i32).collect();
        let accepted = Kept::Accepted {
            ids: ids.slice(..rows),
            chain: chain.slice(..steps * step.batch),
            batch: step.batch,
            steps,
            width: step.width,
        };
        self.extend_taps_with(step, taps, &slots, cache, &[], Some(&accepted))
    }

    /// The two public extends: the slots `last` back (tokens from the host), or `roots` (a
    /// [`Kept::Accepted`], whose greedy ids are also the slots' tokens on the device).
    fn extend_taps_with(
        &self,
        step: &StepInput,
        taps: &Taps<DeviceRows>,
        tap_rows: &[i32],
        cache: &mut CudaKvCache,
        last: &[i32],
        roots: Option<&Kept<'_>>,
    ) -> Result<DraftStepOutput, CudaError> {
        let rows = step.batch * step.width;
        if tap_rows.len() != rows {
            return Err(ModelError::InvalidStep {
                reason: format!("{} tap rows for an extend of {rows} slots", tap_rows.len()),
            }
            .into());
        }
        if let Some(&bad) = last.iter().find(|&&r| r < 0 || r as usize >= rows) {
            return Err(ModelError::InvalidStep {
                reason: format!("extend output row {bad} is outside the step's {rows} slots"),
            }
            .into());
        }
        let _extend = host_spans::span("head extend");
        self.check_taps(taps, tap_rows)?;
        let n = last.len();
        // Tap rows, then the kept slots, then their destinations 0..n.
        let index: Vec<i32> = tap_rows
            .iter()
            .chain(last)
            .copied()
            .chain(0..n as i32)
            .collect();
        let (index, aux) = {
            let _fc_input = host_spans::span("head extend: index upload, fc input");
            let index = self.gpu.upload(&index)?;
            let aux = self.fc_input_at(taps, &index.slice(..rows), rows)?;
            (index, aux)
        };
        let rows_kept = Kept::Rows {
            from: index.slice(rows..rows + n),
            to: index.slice(rows + n..rows + 2 * n),
            count: n,
        };
        let keep = roots.unwrap_or(&rows_kept);
        let host = {
            let _host = host_spans::span("head extend: host inputs");
            self.step_host(cache, step)?
        };
        let tokens = keep.device_tokens();
        self.forward_host_step(step, host, StepHidden::Fc(&aux), cache, tokens, Some(keep))
    }

    /// `fc(aux)` for `rows` rows, f32 `[rows, H]`, in a new buffer ([`CudaDraft::fc_into`]).
    fn fc(&self, aux: &CudaSlice<u16>, rows: usize) -> Result<CudaSlice<f32>, CudaError> {
        let mut hidden = self.gpu.scratch::<f32>(rows * self.spec.hidden_size)?;
        self.fc_into(aux, rows, &mut hidden)?;
        Ok(hidden)
    }

    /// `fc(aux)` for `rows` rows into the first `rows` rows of `hidden`: through `gemv_rows` on
    /// steps the fused kernels take (one launch, no cuBLAS call on the host's path), cuBLAS
    /// otherwise. An eager extend's buffer and a replayed graph's hidden input get the same
    /// launch, so the same bits.
    fn fc_into(
        &self,
        aux: &CudaSlice<u16>,
        rows: usize,
        hidden: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        let (h, fc_in) = (self.spec.hidden_size, self.spec.fc_in());
        if aux.len() < rows * fc_in {
            return Err(ModelError::InvalidStep {
                reason: format!(
                    "the fc input holds {} values, the step needs {rows} rows of {fc_in}",
                    aux.len()
                ),
            }
            .into());
        }
        self.gpu
            .project(self.fuses(rows), aux, &self.fc, hidden, rows, fc_in, h)
    }

    /// One step of the decoder layer over the cache. `hidden: [batch * width, H]` f32 is each
    /// slot's hidden input (`fc(aux)` for an extend, the previous output for a draft step); it
    /// becomes the residual stream, so it is taken by value. Steps of up to
    /// [`GRAPH_MAX_WIDTH`] tokens per sequence replay a CUDA graph of the same launches once
    /// their shape and cache have run eagerly twice, like the target's.
    pub fn forward_step(
        &self,
        step: &StepInput,
        hidden: CudaSlice<f32>,
        cache: &mut CudaKvCache,
    ) -> Result<DraftStepOutput, CudaError> {
        self.forward_step_kept(step, hidden, cache, None, None)
    }

    /// Greedy draft chains drafted on the device: for each of the `batch` sequences, the
    /// argmax of its root logits (`logits` row `b`, `[batch, draft_vocab]`), then `steps - 1`
    /// head steps, each fed the previous step's token and hidden output (`hidden` row `b`, `[batch,
    /// H]`, for the first). Every step's greedy id goes through `d2t` on the device into the
    /// next step's input tokens, so the chain never waits for the host between its steps (the
    /// loop of `tandem_infer`'s `host_chain` reads each argmax back and builds the next step
    /// from it); the tokens come back once, `[batch][steps]` target ids. The steps' keys stay
    /// in `cache` (the caller rolls them back), as with [`CudaDraft::forward_step`].
    pub fn draft_chain(
        &self,
        cache: &mut CudaKvCache,
        hidden: &CudaSlice<f32>,
        logits: &CudaSlice<f32>,
        batch: usize,
        steps: usize,
    ) -> Result<Vec<Vec<u32>>, CudaError> {
        let ids = self.draft_chain_ids(cache, hidden, logits, batch, steps)?;
        chain_ids_to_host(&self.gpu, &ids, batch, steps)
    }

    /// [`CudaDraft::draft_chain`] without the read-back: the target ids stay on the device,
    /// `[steps, batch]` (step `s` of sequence `b` at `s * batch + b`), for a verification that
    /// reads them there ([`crate::CudaTarget::forward_chains`]) before the host sees them
    /// ([`chain_ids_to_host`]). Nothing here waits for the device.
    pub fn draft_chain_ids(
        &self,
        cache: &mut CudaKvCache,
        hidden: &CudaSlice<f32>,
        logits: &CudaSlice<f32>,
        batch: usize,
        steps: usize,
    ) -> Result<CudaSlice<u32>, CudaError> {
        let gpu = &*self.gpu;
        let (h, vocab) = (self.spec.hidden_size, self.spec.draft_vocab_size);
        if hidden.len() < batch * h || logits.len() < batch * vocab {
            return Err(ModelError::InvalidStep {
                reason: format!(
                    "a chain of {batch} sequences needs {batch} root rows of {h} hidden values \
                     and {vocab} logits; got {} and {} values",
                    hidden.len(),
                    logits.len()
                ),
            }
            .into());
        }
        // Step s's target ids at [s * batch, (s + 1) * batch).
        let mut ids = gpu.scratch::<u32>(steps * batch)?;
        if steps == 0 || batch == 0 {
            return Ok(ids);
        }
        let map = Some(&self.draft_to_target);
        gpu.argmax_rows_into(logits, batch, vocab, map, &mut ids.slice_mut(0..batch))?;
        // Placeholder tokens for the host-side bookkeeping; the device writes the real ones.
        let placeholder = vec![0u32; batch];
        // The previous step's hidden output when it came out of the general path (`None`
        // after a step replayed in place: it is still in that graph's buffers).
        let mut carried: Option<CudaSlice<f32>> = None;
        let mut in_place: Option<GraphKey> = None;
        for s in 1..steps {
            let step = cache.layout().decode_step(&placeholder)?;
            let (done, mut rest) = ids.split_at_mut(s * batch);
            let previous = done.slice((s - 1) * batch..s * batch);
            let mut next = rest.slice_mut(0..batch);
            let input = if s == 1 {
                Some(hidden)
            } else {
                carried.as_ref()
            };
            let Some(host) =
                self.chain_step_in_place(&step, cache, &previous, input, &mut in_place, &mut next)?
            else {
                carried = None;
                continue;
            };
            let input = match (s, carried.take()) {
                (_, Some(h)) => h,
                // The roots stay the caller's: the first step's residual is a copy.
                (1, None) => {
                    let mut copy = gpu.scratch::<f32>(batch * h)?;
                    gpu.copy_into(hidden, &mut copy, batch * h)?;
                    copy
                }
                _ => {
                    return Err(ModelError::InvalidStep {
                        reason: "a draft chain's graph left the cache between its steps".into(),
                    }
                    .into());
                }
            };
            let out = self.forward_host_step(
                &step,
                host,
                StepHidden::Rows(input),
                cache,
                Some(&previous),
                None,
            )?;
            gpu.argmax_rows_into(&out.logits.data, batch, vocab, map, &mut next)?;
            carried = Some(out.hidden.data);
            in_place = None;
        }
        Ok(ids)
    }

    /// Tree drafting on the device (SGLang's beams, what `tandem_infer::host_beams` does with a
    /// read-back and host beam search at every step): `steps` draft steps of `k` beams for each
    /// of the `batch` sequences, from the roots (`hidden` `[batch, H]`, `logits` `[batch,
    /// draft_vocab]`, row `b` sequence `b`). Step 0 is the roots' top-k; each later step runs
    /// every beam's path (`k` paths of the beams' depth a sequence, the layout of
    /// `tandem_infer::BeamStep`) in one head step, rolled back, keeping only the beams' output
    /// rows, whose top-k the `beam_select` kernel turns into the next beams, the next step's
    /// tokens and the rows of its hidden inputs in a bank of the roots and every kept output.
    /// Nothing waits for the device until the records of every step come back in one read:
    /// each sequence's steps in SGLang's layout ([`BeamRecord`]), which the host turns into
    /// the tree to verify.
    pub fn draft_beams(
        &self,
        cache: &mut CudaKvCache,
        hidden: &CudaSlice<f32>,
        logits: &CudaSlice<f32>,
        batch: usize,
        (steps, k): (usize, usize),
    ) -> Result<Vec<Vec<BeamRecord>>, CudaError> {
        let gpu = &*self.gpu;
        let (h, vocab) = (self.spec.hidden_size, self.spec.draft_vocab_size);
        if hidden.len() < batch * h || logits.len() < batch * vocab {
            return Err(ModelError::InvalidStep {
                reason: format!(
                    "beams of {batch} sequences need {batch} root rows of {h} hidden values and \
                     {vocab} logits; got {} and {} values",
                    hidden.len(),
                    logits.len()
                ),
            }
            .into());
        }
        if !(1..=8).contains(&k) || steps == 0 {
            return Err(ModelError::InvalidStep {
                reason: format!(
                    "device beams take topk 1 to 8 and at least one step; got topk {k}, {steps} steps"
                ),
            }
            .into());
        }
        if batch == 0 {
            return Ok(Vec::new());
        }
        let beams = batch * k;
        let mut held = self
            .beam_workspace
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if held.as_ref().map(|w| w.key) != Some((batch, k, steps)) {
            *held = None; // freed before the new shape's buffers are taken
            *held = Some(BeamWorkspace::new(gpu, h, (batch, k, steps))?);
        }
        let BeamWorkspace {
            bank,
            counting,
            beam_slots,
            topk,
            scores,
            paths,
            hrows,
            next_tokens,
            next_hrows,
            record,
            sizes,
            ..
        } = held.as_mut().expect("made above");
        // The hidden bank: the roots, then each later step's beam outputs.
        gpu.copy_into(hidden, bank, batch * h)?;
        let base_columns = cache.layout().used();
        let map = &self.draft_to_target;
        let mut at = 0;
        for (s, &size) in sizes.iter().enumerate() {
            let out_row0 = batch + s.saturating_sub(1) * beams;
            if s == 0 {
                gpu.topk_softmax_rows_into(logits, batch, vocab, k, topk)?;
            } else {
                // Every beam's path: slot (b, j, d) at (b * k + j) * s + d; beam j's own output
                // (its path's last slot) is kept, as output row b * k + j.
                let width = k * s;
                let trees: Vec<(Vec<u32>, Vec<Option<usize>>)> = (0..batch)
                    .map(|_| {
                        let parents = (0..width).map(|i| (i % s > 0).then(|| i - 1)).collect();
                        (vec![0; width], parents)
                    })
                    .collect();
                let trees: Vec<(&[u32], &[Option<usize>])> = trees
                    .iter()
                    .map(|(t, p)| (t.as_slice(), p.as_slice()))
                    .collect();
                let step = cache.layout().tree_step(&trees)?;
                let rows = batch * width;
                let keep = Kept::Rows {
                    from: beam_slots[s - 1].slice(0..beams),
                    to: counting.slice(0..beams),
                    count: beams,
                };
                let tokens = next_tokens.slice(0..rows);
                let host = self.step_host(cache, &step)?;
                // The step's hidden input rows gathered from the bank straight into the
                // step's buffers.
                let input = StepHidden::Gather {
                    from: bank,
                    rows: next_hrows.slice(0..rows),
                    to: counting.slice(0..rows),
                };
                let out =
                    self.forward_host_step(&step, host, input, cache, Some(&tokens), Some(&keep))?;
                cache.layout_mut().rollback(base_columns);
                gpu.copy_rows(
                    &out.hidden.data,
                    &counting.slice(0..beams),
                    bank,
                    &counting.slice(out_row0..out_row0 + beams),
                    beams,
                    h,
                )?;
                gpu.topk_softmax_rows_into(&out.logits.data, beams, vocab, k, topk)?;
            }
            // The beams double-buffered: each step reads [0] and writes [1], then they swap.
            let [score_in, score_out] = scores;
            let [path_in, path_out] = paths;
            let [hrow_in, hrow_out] = hrows;
            gpu.beam_select(
                topk,
                map,
                (batch, k, s, steps),
                (&*score_in, &*path_in, &*hrow_in),
                (score_out, path_out, hrow_out),
                &mut record.slice_mut(at..at + size),
                (&mut *next_tokens, &mut *next_hrows),
                out_row0,
            )?;
            scores.swap(0, 1);
            paths.swap(0, 1);
            hrows.swap(0, 1);
            at += size;
        }
        let host = gpu.download(record)?;
        Ok(beam_records(&host, batch, k, steps))
    }

    /// One step of a greedy draft chain on a graph already captured for it, with nothing
    /// copied out: the step's tokens from `tokens` (the previous step's ids), its hidden input
    /// copied into the graph's buffers from `hidden`, or with `None` left there (the previous
    /// chain step's output in the same graph, whose key `in_place` holds), and its greedy ids
    /// through `d2t` into `ids`. A chain step otherwise copies its hidden output and logits out
    /// of the graph and copies the hidden output back in at the next step: five device calls
    /// the host pays for at every step. Where no captured graph takes the step in place, it
    /// does nothing and returns the step's host inputs for the general path.
    fn chain_step_in_place(
        &self,
        step: &StepInput,
        cache: &mut CudaKvCache,
        tokens: &CudaView<'_, u32>,
        hidden: Option<&CudaSlice<f32>>,
        in_place: &mut Option<GraphKey>,
        ids: &mut CudaViewMut<'_, u32>,
    ) -> Result<Option<HostStep>, CudaError> {
        let gpu = &*self.gpu;
        let spec = &self.spec;
        let _step = host_spans::span("chain step");
        let host_inputs = host_spans::span("chain step: host inputs, graph lookup");
        let host = self.step_host(cache, step)?;
        if !self.graphs.enabled() || step.width > GRAPH_MAX_WIDTH {
            return Ok(Some(host));
        }
        // The key `step_graphed` would replay the step under.
        let padded = graph_batch(step.batch, cache.rows_allocated());
        let key = self.graph_key(host.shape, padded, cache);
        let mut graphs = self.graphs.lock();
        let resident = in_place.as_ref() == Some(&key);
        if !graphs.captured.contains_key(&key) || (hidden.is_none() && !resident) {
            return Ok(Some(host));
        }
        let host = host.padded(padded);
        drop(host_inputs);
        let entry = graphs.captured.get_mut(&key).expect("checked above");
        {
            let _load = host_spans::span("chain step: load inputs");
            entry.buffers.load(gpu, &host, Some(tokens))?;
            if let Some(hidden) = hidden {
                let n = step.batch * spec.hidden_size;
                gpu.copy_into(hidden, &mut entry.buffers.hidden, n)?;
            }
        }
        {
            let _replay = host_spans::span("chain step: replay");
            gpu.replay(&entry.graph)?;
        }
        let _argmax = host_spans::span("chain step: argmax");
        let map = Some(&self.draft_to_target);
        gpu.argmax_rows_into(
            &entry.buffers.logits,
            step.batch,
            spec.draft_vocab_size,
            map,
            ids,
        )?;
        graphs.stats.replays += 1;
        drop(graphs);
        cache.advance(step);
        *in_place = Some(key);
        Ok(None)
    }

    /// [`CudaDraft::forward_step`], with the step's tokens taken from the device when
    /// `tokens` is given (`[batch]`, over whatever `step.tokens` holds), returning only the
    /// rows `keep` names when given.
    fn forward_step_kept(
        &self,
        step: &StepInput,
        hidden: CudaSlice<f32>,
        cache: &mut CudaKvCache,
        tokens: Option<&CudaView<'_, u32>>,
        keep: Option<&Kept<'_>>,
    ) -> Result<DraftStepOutput, CudaError> {
        let host = self.step_host(cache, step)?;
        self.forward_host_step(step, host, StepHidden::Rows(hidden), cache, tokens, keep)
    }

    /// The host side of a step over `cache`: tokens, positions, mask parts and shape.
    fn step_host(&self, cache: &CudaKvCache, step: &StepInput) -> Result<HostStep, CudaError> {
        let spec = &self.spec;
        cache.step_host(
            step,
            spec.vocab_size,
            [spec.num_heads, spec.num_kv_heads, spec.head_dim],
        )
    }

    /// The graph a step of `shape` over `cache` replays under, padded to `padded` sequences.
    fn graph_key(&self, shape: AttentionShape, padded: usize, cache: &CudaKvCache) -> GraphKey {
        let shape = AttentionShape {
            batch: padded.max(shape.batch),
            ..shape
        };
        GraphKey::new(&self.gpu, shape, cache, 0, &[]).with_fused(self.fuses(shape.rows()))
    }

    /// [`CudaDraft::forward_step_kept`] with the step's host inputs already built.
    fn forward_host_step(
        &self,
        step: &StepInput,
        host: HostStep,
        hidden: StepHidden<'_>,
        cache: &mut CudaKvCache,
        tokens: Option<&CudaView<'_, u32>>,
        keep: Option<&Kept<'_>>,
    ) -> Result<DraftStepOutput, CudaError> {
        let _step = host_spans::span("head step");
        let rows = step.batch * step.width;
        let (h, fc_in) = (self.spec.hidden_size, self.spec.fc_in());
        let (held, wanted, what) = match &hidden {
            StepHidden::Rows(data) => (data.len(), rows * h, "hidden input"),
            StepHidden::Fc(aux) => (aux.len(), rows * fc_in, "fc input"),
            StepHidden::Gather { rows: gathered, .. } => {
                (gathered.len() * h, rows * h, "gathered input")
            }
        };
        if held < wanted {
            return Err(ModelError::InvalidStep {
                reason: format!(
                    "the {what} holds {held} values, the step needs {wanted} ({rows} rows)"
                ),
            }
            .into());
        }
        let mut output = if self.graphs.enabled() && step.width <= GRAPH_MAX_WIDTH {
            // Padded to a graph batch size, as the target's steps are.
            let padded = graph_batch(step.batch, cache.rows_allocated());
            self.step_graphed(host, padded, hidden, cache, tokens, keep)?
        } else {
            self.step_eager(&host, hidden, cache, tokens, keep)?
        };
        if keep.is_none() {
            output.hidden.batch = step.batch;
            output.logits.rows = rows;
        }
        cache.advance(step);
        Ok(output)
    }

    fn step_eager(
        &self,
        host: &HostStep,
        hidden: StepHidden<'_>,
        cache: &mut CudaKvCache,
        tokens: Option<&CudaView<'_, u32>>,
        keep: Option<&Kept<'_>>,
    ) -> Result<DraftStepOutput, CudaError> {
        let hidden = match hidden {
            StepHidden::Rows(data) => data,
            StepHidden::Fc(aux) => self.fc(aux, host.shape.rows())?,
            StepHidden::Gather { from, rows, to } => {
                let n = host.shape.rows();
                let h = self.spec.hidden_size;
                let mut data = self.gpu.scratch::<f32>(n * h)?;
                self.gpu.copy_rows(from, &rows, &mut data, &to, n, h)?;
                data
            }
        };
        let mut buffers = DraftBuffers::new(self, host.shape, host.total, Some(hidden))?;
        buffers.load(&self.gpu, host, tokens)?;
        self.encode(&mut buffers, cache, host, false)?;
        match keep {
            Some(keep) => buffers.kept_output(self, keep),
            None => Ok(buffers.into_output(self)),
        }
    }

    /// Whether tree drafting picks its beams on the device ([`CudaDraft::draft_beams`]) rather
    /// than on the host after a read-back at every step.
    pub fn device_beams(&self) -> bool {
        self.device_beams.load(Ordering::Relaxed)
    }

    /// Turns [`CudaDraft::device_beams`] on or off.
    pub fn set_device_beams(&self, on: bool) {
        self.device_beams.store(on, Ordering::Relaxed);
    }

    /// Turns graph replay of the head's decode-sized steps on or off.
    pub fn set_graphs(&self, on: bool) {
        self.graphs.set(on);
    }

    /// Graphs captured so far and steps replayed from them.
    pub fn graph_stats(&self) -> GraphStats {
        self.graphs.stats()
    }

    /// A step from a graph captured for `padded` sequences (the live ones first; the spare
    /// rows' hidden inputs are whatever the buffers last held, and their outputs are dropped).
    fn step_graphed(
        &self,
        host: HostStep,
        padded: usize,
        hidden: StepHidden<'_>,
        cache: &mut CudaKvCache,
        tokens: Option<&CudaView<'_, u32>>,
        keep: Option<&Kept<'_>>,
    ) -> Result<DraftStepOutput, CudaError> {
        let gpu = &*self.gpu;
        let rows = host.shape.rows();
        let lookup = host_spans::span("head step: graph lookup");
        let key = self.graph_key(host.shape, padded, cache);
        let mut graphs = self.graphs.lock();
        drop(lookup);
        if !graphs.ready(&key) {
            // A new shape or cache runs eagerly (unpadded) for its first steps; the next one is
            // captured.
            drop(graphs);
            return self.step_eager(&host, hidden, cache, tokens, keep);
        }
        let host = host.padded(padded);
        if !graphs.captured.contains_key(&key) {
            let mut buffers = DraftBuffers::new(self, host.shape, host.shape.capacity, None)?;
            let graph = gpu.capture(|| self.encode(&mut buffers, cache, &host, true))?;
            graphs.insert(
                key.clone(),
                CapturedStep {
                    buffers,
                    graph,
                    visited: Vec::new(),
                },
            );
        }
        let entry = graphs.captured.get_mut(&key).expect("captured above");
        {
            let _load = host_spans::span("head step: load inputs");
            entry.buffers.load(gpu, &host, tokens)?;
        }
        {
            let _hidden = host_spans::span("head step: hidden input");
            let h = self.spec.hidden_size;
            match hidden {
                StepHidden::Rows(data) => {
                    gpu.copy_into(&data, &mut entry.buffers.hidden, rows * h)?
                }
                // The live rows' fc output lands in the graph's input rows.
                StepHidden::Fc(aux) => self.fc_into(aux, rows, &mut entry.buffers.hidden)?,
                StepHidden::Gather {
                    from,
                    rows: src,
                    to,
                } => gpu.copy_rows(from, &src, &mut entry.buffers.hidden, &to, rows, h)?,
            }
        }
        {
            let _replay = host_spans::span("head step: replay");
            gpu.replay(&entry.graph)?;
        }
        let _outputs = host_spans::span("head step: outputs");
        let output = match keep {
            Some(keep) => entry.buffers.kept_output(self, keep),
            None => entry.buffers.copy_output(self),
        };
        graphs.stats.replays += 1;
        output
    }

    /// The decoder layer's launches over the buffers of one step. With `graphed`, the launches
    /// read the first cache column and the column count from `b.inputs.scalars()`.
    fn encode(
        &self,
        b: &mut DraftBuffers,
        cache: &mut CudaKvCache,
        host: &HostStep,
        graphed: bool,
    ) -> Result<(), CudaError> {
        let spec = &self.spec;
        let gpu = &*self.gpu;
        let (shape, col0, total) = (host.shape, host.col0, host.total);
        let rows = shape.rows();
        let (h, inter) = (spec.hidden_size, spec.intermediate_size);
        let q_dim = spec.num_heads * spec.head_dim;
        let qkv_dim = q_dim + 2 * spec.num_kv_heads * spec.head_dim;
        let eps = spec.rms_norm_eps as f32;
        if graphed && crate::cache::graph_mask() {
            b.inputs.build_mask_in_graph(gpu)?;
        }
        let (tokens, positions) = (b.inputs.tokens(), b.inputs.positions());
        let scalars = graphed.then(|| b.inputs.scalars());
        let scalars = scalars.as_ref();
        // Small steps may run the target's small-step kernels (see `CudaTarget::encode`): both
        // normed halves of the attention input staged by the q|k|v kernel, o_proj and down_proj
        // added into the residual; eight launches instead of fourteen, and seven with the
        // embedding read inside the q|k|v kernel and the final norm inside the logits kernel.
        let fused = self.fuses(rows);
        let fold = fused && self.fold;
        if !fold {
            gpu.embed_rows(&self.embed, &tokens, &mut b.embeds, rows, h)?;
        }
        if fused {
            let first = if fold {
                QkvInput::Embedding {
                    table: &self.embed,
                    tokens: &tokens,
                }
            } else {
                QkvInput::Rows(&b.embeds)
            };
            gpu.norm_qkv_rope(
                first,
                &self.input_norm,
                &self.qkv_embed,
                Some((&b.hidden, &self.hidden_norm, &self.qkv_hidden)),
                None,
                &positions,
                &self.inv_freq,
                &mut b.q,
                &mut cache.keys[0],
                &mut cache.values[0],
                shape,
                h,
                col0,
                scalars,
                eps,
            )?;
        } else {
            gpu.add_rms_norm(
                &mut b.embeds,
                None,
                &self.input_norm,
                &mut b.normed_embeds,
                None,
                rows,
                h,
                eps,
            )?;
            gpu.add_rms_norm(
                &mut b.hidden,
                None,
                &self.hidden_norm,
                &mut b.normed,
                None,
                rows,
                h,
                eps,
            )?;
            gpu.linear(
                &b.normed_embeds,
                &self.qkv_embed,
                &mut b.qkv,
                rows,
                h,
                qkv_dim,
            )?;
            gpu.linear_add(&b.normed, &self.qkv_hidden, &mut b.qkv, rows, h, qkv_dim)?;
            gpu.rope_qkv(
                &b.qkv,
                None,
                &positions,
                &self.inv_freq,
                &mut b.q,
                &mut cache.keys[0],
                &mut cache.values[0],
                shape,
                col0,
                scalars,
            )?;
        }
        gpu.attention(
            &b.q,
            &cache.keys[0],
            &cache.values[0],
            &b.inputs.mask,
            None,
            &mut b.attn,
            shape,
            total,
            scalars,
        )?;
        if fused {
            gpu.gemv_rows(&b.attn, &self.o, &mut b.hidden, rows, q_dim, h, true)?;
            gpu.norm_gate_up_silu(
                &b.hidden,
                &self.post_norm,
                &self.gate_up,
                &mut b.act,
                rows,
                h,
                inter,
                eps,
            )?;
            gpu.gemv_rows(&b.act, &self.down, &mut b.hidden, rows, inter, h, true)?;
        } else {
            gpu.linear(&b.attn, &self.o, &mut b.delta, rows, q_dim, h)?;
            gpu.add_rms_norm(
                &mut b.hidden,
                Some(&b.delta),
                &self.post_norm,
                &mut b.normed,
                None,
                rows,
                h,
                eps,
            )?;
            gpu.linear(&b.normed, &self.gate_up, &mut b.gate_up, rows, h, 2 * inter)?;
            gpu.silu_mul(&b.gate_up, &mut b.act, rows, inter)?;
            gpu.linear(&b.act, &self.down, &mut b.delta, rows, inter, h)?;
        }
        let vocab = spec.draft_vocab_size;
        if fold && self.lm_head_gemv {
            return gpu.gemv_norm_rows(
                &b.hidden,
                &self.norm,
                &self.lm_head,
                &mut b.logits,
                rows,
                h,
                vocab,
                eps,
            );
        }
        // The final norm, with the pending residual add of down_proj when unfused.
        gpu.add_rms_norm(
            &mut b.hidden,
            (!fused).then_some(&b.delta),
            &self.norm,
            &mut b.normed,
            None,
            rows,
            h,
            eps,
        )?;
        // Fused steps take the draft logits from the matrix-vector kernel, as the target's
        // logits (`Gpu::project`).
        let gemv = fused && self.lm_head_gemv;
        gpu.project(
            gemv,
            &b.normed,
            &self.lm_head,
            &mut b.logits,
            rows,
            h,
            vocab,
        )?;
        Ok(())
    }
}

/// What a draft step's residual stream starts from: hidden rows (`[rows, H]` f32: a chain
/// step's previous output), or the fc input of an extend (`[rows, fc_in]` bf16), projected
/// straight into the step's buffers.
enum StepHidden<'a> {
    Rows(CudaSlice<f32>),
    Fc(&'a CudaSlice<u16>),
    /// Rows `rows` of `from` (`[*, H]` f32) as the step's rows `to` (`0..rows`): a tree draft
    /// step's beam inputs, gathered from its bank straight into the step's buffers.
    Gather {
        from: &'a CudaSlice<f32>,
        rows: CudaView<'a, i32>,
        to: CudaView<'a, i32>,
    },
}

/// The slots of a step to return.
enum Kept<'a> {
    /// The slots `from` (flat slot indices) into the output rows `to` (`0..count`), both
    /// already on the device.
    Rows {
        from: CudaView<'a, i32>,
        to: CudaView<'a, i32>,
        count: usize,
    },
    /// One row per sequence of an extend over whole verified greedy chains: its last accepted
    /// slot, found on the device from the verification's greedy `ids` (`[batch * width]`) and
    /// the drafted `chain` (`[steps, batch]`) ([`Gpu::gather_accepted_roots`]).
    Accepted {
        ids: CudaView<'a, u32>,
        chain: CudaView<'a, u32>,
        batch: usize,
        steps: usize,
        width: usize,
    },
}

impl Kept<'_> {
    /// The step's tokens where they are on the device: the greedy ids of [`Kept::Accepted`]
    /// (the token after each verified slot), none for [`Kept::Rows`] (the host's).
    fn device_tokens(&self) -> Option<&CudaView<'_, u32>> {
        match self {
            Kept::Rows { .. } => None,
            Kept::Accepted { ids, .. } => Some(ids),
        }
    }
}

/// Every device buffer of one draft step (see the target's `StepBuffers`).
struct DraftBuffers {
    /// Tokens, positions, `[col0, total]` for graph replays and the mask.
    inputs: StepInputs,
    /// The residual stream: the step's hidden input, its output after the step.
    hidden: CudaSlice<f32>,
    embeds: CudaSlice<f32>,
    normed_embeds: CudaSlice<u16>,
    normed: CudaSlice<u16>,
    qkv: CudaSlice<f32>,
    q: CudaSlice<f32>,
    attn: CudaSlice<u16>,
    delta: CudaSlice<f32>,
    gate_up: CudaSlice<f32>,
    act: CudaSlice<u16>,
    logits: CudaSlice<f32>,
    batch: usize,
    width: usize,
}

impl DraftBuffers {
    /// Buffers for a step of `shape`, with room for a `[rows, mask_columns]` mask; `hidden`
    /// is the eager step's input (a graph gets its own).
    fn new(
        draft: &CudaDraft,
        shape: AttentionShape,
        mask_columns: usize,
        hidden: Option<CudaSlice<f32>>,
    ) -> Result<Self, CudaError> {
        let spec = &draft.spec;
        let gpu = &*draft.gpu;
        let rows = shape.rows();
        let (h, inter) = (spec.hidden_size, spec.intermediate_size);
        let q_dim = spec.num_heads * spec.head_dim;
        let qkv_dim = q_dim + 2 * spec.num_kv_heads * spec.head_dim;
        Ok(Self {
            inputs: StepInputs::new(gpu, shape, mask_columns)?,
            hidden: match hidden {
                Some(hidden) => hidden,
                // Zeros: the spare rows of a padded graph read them until a step writes them.
                None => gpu.zeros(rows * h)?,
            },
            embeds: gpu.scratch(rows * h)?,
            normed_embeds: gpu.scratch(rows * h)?,
            normed: gpu.scratch(rows * h)?,
            qkv: gpu.scratch(rows * qkv_dim)?,
            q: gpu.scratch(rows * q_dim)?,
            attn: gpu.scratch(rows * q_dim)?,
            delta: gpu.scratch(rows * h)?,
            gate_up: gpu.scratch(rows * 2 * inter)?,
            act: gpu.scratch(rows * inter)?,
            logits: gpu.scratch(rows * spec.draft_vocab_size)?,
            batch: shape.batch,
            width: shape.width,
        })
    }

    /// The step's inputs, with the tokens copied over from the device when given (after the
    /// host's placeholders, on the same stream).
    fn load(
        &mut self,
        gpu: &Gpu,
        host: &HostStep,
        tokens: Option<&CudaView<'_, u32>>,
    ) -> Result<(), CudaError> {
        self.inputs.load(gpu, host)?;
        if let Some(tokens) = tokens {
            gpu.copy_view_into(tokens, &mut self.inputs.tokens_mut())?;
        }
        Ok(())
    }

    fn into_output(self, draft: &CudaDraft) -> DraftStepOutput {
        let rows = self.batch * self.width;
        DraftStepOutput {
            hidden: DeviceRows {
                data: self.hidden,
                batch: self.batch,
                width: self.width,
                hidden: draft.spec.hidden_size,
            },
            logits: DeviceLogits::new(
                self.logits,
                rows,
                draft.spec.draft_vocab_size,
                draft.gpu.clone(),
            ),
        }
    }

    /// The kept rows of the step's hidden output and logits ([`Kept`]; slot indices checked by
    /// the caller) in new `[n, _]` buffers: two row copies, or one launch that finds each
    /// sequence's accepted slot and copies both of its rows.
    fn kept_output(
        &self,
        draft: &CudaDraft,
        keep: &Kept<'_>,
    ) -> Result<DraftStepOutput, CudaError> {
        let gpu = &*draft.gpu;
        let (h, vocab) = (draft.spec.hidden_size, draft.spec.draft_vocab_size);
        let n = match keep {
            Kept::Rows { count, .. } => *count,
            Kept::Accepted { batch, .. } => *batch,
        };
        let mut hidden = gpu.scratch::<f32>(n * h)?;
        let mut logits = gpu.scratch::<f32>(n * vocab)?;
        match keep {
            Kept::Rows { from, to, .. } => {
                gpu.copy_rows(&self.hidden, from, &mut hidden, to, n, h)?;
                gpu.copy_rows(&self.logits, from, &mut logits, to, n, vocab)?;
            }
            Kept::Accepted {
                ids,
                chain,
                batch,
                steps,
                width,
            } => gpu.gather_accepted_roots(
                ids,
                chain,
                (*batch, *steps, *width),
                &self.hidden,
                &self.logits,
                (h, vocab),
                &mut hidden,
                &mut logits,
            )?,
        }
        Ok(DraftStepOutput {
            hidden: DeviceRows {
                data: hidden,
                batch: n,
                width: 1,
                hidden: h,
            },
            logits: DeviceLogits::new(logits, n, vocab, draft.gpu.clone()),
        })
    }

    fn copy_output(&self, draft: &CudaDraft) -> Result<DraftStepOutput, CudaError> {
        let gpu = &*draft.gpu;
        let rows = self.batch * self.width;
        let h = draft.spec.hidden_size;
        let mut hidden = gpu.scratch::<f32>(rows * h)?;
        gpu.copy_into(&self.hidden, &mut hidden, rows * h)?;
        Ok(DraftStepOutput {
            hidden: DeviceRows {
                data: hidden,
                batch: self.batch,
                width: self.width,
                hidden: h,
            },
            logits: DeviceLogits::new(
                gpu.duplicate(&self.logits)?,
                rows,
                draft.spec.draft_vocab_size,
                draft.gpu.clone(),
            ),
        })
    }
}

/// The tokens of [`CudaDraft::draft_chain_ids`] on the host, `[batch][steps]` (one read-back,
/// which waits for everything queued before it).
pub fn chain_ids_to_host(
    gpu: &Gpu,
    ids: &CudaSlice<u32>,
    batch: usize,
    steps: usize,
) -> Result<Vec<Vec<u32>>, CudaError> {
    if steps == 0 || batch == 0 {
        return Ok(vec![Vec::new(); batch]);
    }
    let ids = gpu.download(ids)?;
    Ok(chains_from_step_major(&ids, batch, steps))
}

/// Greedy chains `[batch][steps]` from their device layout, `[steps, batch]` (step `s` of
/// sequence `b` at `s * batch + b`, as [`CudaDraft::draft_chain_ids`] leaves them).
pub fn chains_from_step_major(ids: &[u32], batch: usize, steps: usize) -> Vec<Vec<u32>> {
    (0..batch)
        .map(|b| (0..steps).map(|s| ids[s * batch + b]).collect())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two sequences, topk 2, two steps, laid out as `beam_select` writes the read-back: step 0
    /// (2 scores and ids a sequence, no parents), then step 1 (4 each, then 2 parents).
    #[test]
    fn beam_records_split_the_read_back_by_step_and_sequence() {
        let f = |v: f32| v.to_bits();
        let mut values = vec![f(0.6), f(0.4), f(0.7), f(0.3), 10, 11, 20, 21];
        values.extend([f(0.3), f(0.3), f(0.36), f(0.04)]);
        values.extend([f(0.5), f(0.1), f(0.2), f(0.1)]);
        values.extend([100, 101, 102, 103, 200, 201, 202, 203]);
        values.extend([4, 2, 2, 4]);
        let records = beam_records(&values, 2, 2, 2);
        assert_eq!(records.len(), 2);
        assert_eq!(
            records[0][0],
            BeamRecord {
                scores: vec![0.6, 0.4],
                tokens: vec![10, 11],
                parents: vec![-1, 0, 1]
            }
        );
        assert_eq!(records[1][0].tokens, [20, 21]);
        assert_eq!(
            records[1][1],
            BeamRecord {
                scores: vec![0.5, 0.1, 0.2, 0.1],
                tokens: vec![200, 201, 202, 203],
                parents: vec![2, 4]
            }
        );
        assert_eq!(records[0][1].parents, [4, 2]);
        assert_eq!(records[0][1].scores[2], 0.36);
    }
}
