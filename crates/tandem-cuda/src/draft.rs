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

use cudarc::driver::CudaSlice;
use tandem_eagle::{DraftSpec, HostWeights, VocabMap};
use tandem_model::{ModelError, StepInput, Taps};

use crate::cache::CudaKvCache;
use crate::device::{DeviceRows, Gpu};
use crate::error::CudaError;
use crate::model::{CudaTarget, DeviceLogits};
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
            spec,
            vocab,
            gpu,
        })
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
        let t = self.spec.target_hidden_size;
        let width = self.spec.fc_in();
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
        let index = self.gpu.upload(rows)?;
        let mut out = self.gpu.scratch::<u16>(rows.len() * width)?;
        for (slot, tap) in taps.tensors.iter().enumerate() {
            self.gpu
                .rows_to_bf16(&tap.data, &index, &mut out, rows.len(), t, width, slot * t)?;
        }
        Ok(out)
    }

    /// Draft extend: `hidden = fc(aux)` then [`CudaDraft::forward_step`]. `aux` is
    /// [`CudaDraft::fc_input`] for the step's `batch * width` slots.
    pub fn extend(
        &self,
        step: &StepInput,
        aux: &CudaSlice<u16>,
        cache: &mut CudaKvCache,
    ) -> Result<DraftStepOutput, CudaError> {
        let rows = step.batch * step.width;
        let h = self.spec.hidden_size;
        if aux.len() < rows * self.spec.fc_in() {
            return Err(ModelError::InvalidStep {
                reason: format!(
                    "the fc input holds {} values, the step needs {rows} rows of {}",
                    aux.len(),
                    self.spec.fc_in()
                ),
            }
            .into());
        }
        let mut hidden = self.gpu.scratch::<f32>(rows * h)?;
        self.gpu
            .linear(aux, &self.fc, &mut hidden, rows, self.spec.fc_in(), h)?;
        self.forward_step(step, hidden, cache)
    }

    /// One step of the decoder layer over the cache. `hidden: [batch * width, H]` f32 is each
    /// slot's hidden input (`fc(aux)` for an extend, the previous output for a draft step); it
    /// becomes the residual stream, so it is taken by value.
    pub fn forward_step(
        &self,
        step: &StepInput,
        mut hidden: CudaSlice<f32>,
        cache: &mut CudaKvCache,
    ) -> Result<DraftStepOutput, CudaError> {
        let spec = &self.spec;
        let gpu = &*self.gpu;
        let inputs = cache.step_inputs(
            gpu,
            step,
            spec.vocab_size,
            [spec.num_heads, spec.num_kv_heads, spec.head_dim],
        )?;
        let (shape, col0, total) = (inputs.shape, inputs.col0, inputs.total);
        let rows = step.batch * step.width;
        let (h, inter) = (spec.hidden_size, spec.intermediate_size);
        if hidden.len() < rows * h {
            return Err(ModelError::InvalidStep {
                reason: format!(
                    "the hidden input holds {} values, the step needs {rows} rows of {h}",
                    hidden.len()
                ),
            }
            .into());
        }
        let q_dim = spec.num_heads * spec.head_dim;
        let qkv_dim = q_dim + 2 * spec.num_kv_heads * spec.head_dim;
        let eps = spec.rms_norm_eps as f32;

        let mut embeds = gpu.scratch::<f32>(rows * h)?;
        gpu.embed_rows(&self.embed, &inputs.tokens, &mut embeds, rows, h)?;
        let mut normed_embeds = gpu.scratch::<u16>(rows * h)?;
        gpu.add_rms_norm(
            &mut embeds,
            None,
            &self.input_norm,
            &mut normed_embeds,
            None,
            rows,
            h,
            eps,
        )?;
        let mut normed = gpu.scratch::<u16>(rows * h)?;
        gpu.add_rms_norm(
            &mut hidden,
            None,
            &self.hidden_norm,
            &mut normed,
            None,
            rows,
            h,
            eps,
        )?;
        let mut qkv = gpu.scratch::<f32>(rows * qkv_dim)?;
        gpu.linear(&normed_embeds, &self.qkv_embed, &mut qkv, rows, h, qkv_dim)?;
        gpu.linear_add(&normed, &self.qkv_hidden, &mut qkv, rows, h, qkv_dim)?;
        let mut q = gpu.scratch::<f32>(rows * q_dim)?;
        gpu.rope_qkv(
            &qkv,
            None,
            &inputs.positions,
            &self.inv_freq,
            &mut q,
            &mut cache.keys[0],
            &mut cache.values[0],
            shape,
            col0,
            None,
        )?;
        let mut attn = gpu.scratch::<u16>(rows * q_dim)?;
        gpu.attention(
            &q,
            &cache.keys[0],
            &cache.values[0],
            &inputs.mask,
            &mut attn,
            shape,
            total,
            None,
        )?;
        let mut delta = gpu.scratch::<f32>(rows * h)?;
        gpu.linear(&attn, &self.o, &mut delta, rows, q_dim, h)?;
        gpu.add_rms_norm(
            &mut hidden,
            Some(&delta),
            &self.post_norm,
            &mut normed,
            None,
            rows,
            h,
            eps,
        )?;
        let mut gate_up = gpu.scratch::<f32>(rows * 2 * inter)?;
        gpu.linear(&normed, &self.gate_up, &mut gate_up, rows, h, 2 * inter)?;
        let mut act = gpu.scratch::<u16>(rows * inter)?;
        gpu.silu_mul(&gate_up, &mut act, rows, inter)?;
        gpu.linear(&act, &self.down, &mut delta, rows, inter, h)?;
        gpu.add_rms_norm(
            &mut hidden,
            Some(&delta),
            &self.norm,
            &mut normed,
            None,
            rows,
            h,
            eps,
        )?;
        let vocab = spec.draft_vocab_size;
        let mut logits = gpu.scratch::<f32>(rows * vocab)?;
        gpu.linear(&normed, &self.lm_head, &mut logits, rows, h, vocab)?;
        cache.advance(step);
        Ok(DraftStepOutput {
            hidden: DeviceRows {
                data: hidden,
                batch: step.batch,
                width: step.width,
                hidden: h,
            },
            logits: DeviceLogits::new(logits, rows, vocab, self.gpu.clone()),
        })
    }
}
