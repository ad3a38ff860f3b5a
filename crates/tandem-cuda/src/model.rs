//! The fast path's forward step: the same modes, inputs and outputs as
//! `tandem_model::TargetModel::forward`, with taps through the same [`CaptureHook`].

use std::path::Path;
use std::sync::Arc;

use cudarc::driver::CudaSlice;
use tandem_model::weights::WeightFiles;
use tandem_model::{CaptureHook, HfConfig, LogitsFor, ModelSpec, StepInput, TapRequest, Taps};
use tandem_wiring::TapId;

use crate::cache::CudaKvCache;
use crate::device::{DeviceRows, Gpu};
use crate::error::CudaError;
use crate::weights::DeviceWeights;

/// A Llama-family target on the GPU.
pub struct CudaTarget {
    pub spec: ModelSpec,
    gpu: Arc<Gpu>,
    weights: DeviceWeights,
    inv_freq: CudaSlice<f32>,
}

impl std::fmt::Debug for CudaTarget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "CudaTarget({}, {} layers, {:?})",
            self.spec.architecture, self.spec.num_layers, self.gpu
        )
    }
}

/// Logits of one step on the GPU, `[rows, vocab]` f32.
#[derive(Debug)]
pub struct DeviceLogits {
    pub data: CudaSlice<f32>,
    pub rows: usize,
    pub vocab: usize,
    gpu: Arc<Gpu>,
}

impl DeviceLogits {
    /// Wraps `[rows, vocab]` f32 logits already on `gpu`.
    pub fn new(data: CudaSlice<f32>, rows: usize, vocab: usize, gpu: Arc<Gpu>) -> Self {
        Self {
            data,
            rows,
            vocab,
            gpu,
        }
    }
    pub fn to_host(&self) -> Result<Vec<f32>, CudaError> {
        let mut values = self.gpu.download(&self.data)?;
        values.truncate(self.rows * self.vocab);
        Ok(values)
    }
    /// The greedy token of each row, computed on the GPU (one small read-back).
    pub fn argmax(&self) -> Result<Vec<u32>, CudaError> {
        self.gpu.argmax_rows(&self.data, self.rows, self.vocab)
    }
    /// One token per row drawn on the GPU from softmax(logits / `temperature`) within the
    /// `top_p` nucleus, row `r` with `seeds[r]` (see [`Gpu::sample_rows`]).
    pub fn sample(
        &self,
        temperature: f32,
        top_p: f32,
        seeds: &[u64],
    ) -> Result<Vec<u32>, CudaError> {
        self.gpu
            .sample_rows(&self.data, self.rows, self.vocab, temperature, top_p, seeds)
    }
    /// The `k` most likely entries of each row and their softmax probabilities, computed on
    /// the GPU: `(probs, ids)`, each `[rows * k]`, descending per row.
    pub fn topk(&self, k: usize) -> Result<(Vec<f32>, Vec<u32>), CudaError> {
        self.gpu
            .topk_softmax_rows(&self.data, self.rows, self.vocab, k)
    }
}

/// What a fast-path step returns: logits as chosen by [`LogitsFor`] (`Last`: one row per
/// sequence; `All`: every slot) and the requested taps, each `[batch, width, hidden]`.
#[derive(Debug)]
pub struct CudaStepOutput {
    pub logits: Option<DeviceLogits>,
    pub taps: Taps<DeviceRows>,
}

impl CudaTarget {
    /// Loads `config.json` and the safetensors weights of an HF model directory onto `gpu`.
    pub fn load(dir: &Path, gpu: Arc<Gpu>) -> Result<Self, CudaError> {
        let spec = HfConfig::load(&dir.join("config.json"))?.resolve()?;
        DeviceWeights::check_supported(&spec)?;
        let files = WeightFiles::open(dir)?;
        let weights = DeviceWeights::load(&gpu, &spec, &files)?;
        let inv_freq: Vec<f32> = spec.rope_inv_freq().iter().map(|&f| f as f32).collect();
        let inv_freq = gpu.upload(&inv_freq)?;
        Ok(Self {
            spec,
            gpu,
            weights,
            inv_freq,
        })
    }

    pub fn gpu(&self) -> &Arc<Gpu> {
        &self.gpu
    }

    /// The token embedding `[vocab, hidden]` (bf16), which the draft head shares.
    pub fn embedding(&self) -> &CudaSlice<u16> {
        &self.weights.embed
    }

    /// Block `k`'s `input_layernorm` weight on the host, widened from the bf16 the fast path
    /// computes with (replay derives the normed candidates from it).
    pub fn input_norm_weight(&self, k: usize) -> Result<Vec<f32>, CudaError> {
        self.widened(&self.weights.layers[k].input_norm)
    }

    /// The final norm's weight on the host (replay relates the `final` tap's scale to it).
    pub fn final_norm_weight(&self) -> Result<Vec<f32>, CudaError> {
        self.widened(&self.weights.final_norm)
    }

    fn widened(&self, bf16: &CudaSlice<u16>) -> Result<Vec<f32>, CudaError> {
        let bits = self.gpu.download(bf16)?;
        Ok(bits
            .iter()
            .map(|&b| f32::from_bits(u32::from(b) << 16))
            .collect())
    }

    /// An empty cache for `batch` sequences of up to `capacity` columns.
    pub fn new_cache(&self, batch: usize, capacity: usize) -> Result<CudaKvCache, CudaError> {
        CudaKvCache::new(
            &self.gpu,
            self.spec.num_layers,
            batch,
            self.spec.num_kv_heads,
            self.spec.head_dim,
            capacity,
        )
    }

    /// One step of any mode over the cache. The block loop below is the fast path's only
    /// reader of hidden states, and it hands each tap point to the shared capture hook.
    pub fn forward(
        &self,
        step: &StepInput,
        cache: &mut CudaKvCache,
        taps: &TapRequest,
        logits_for: LogitsFor,
    ) -> Result<CudaStepOutput, CudaError> {
        let spec = &self.spec;
        taps.validate(spec.num_layers)?;
        let gpu = &*self.gpu;
        let inputs = cache.step_inputs(
            gpu,
            step,
            spec.vocab_size,
            [spec.num_heads, spec.num_kv_heads, spec.head_dim],
        )?;
        let (shape, col0, total) = (inputs.shape, inputs.col0, inputs.total);
        let (h, inter) = (spec.hidden_size, spec.intermediate_size);
        let rows = step.batch * step.width;
        let q_dim = spec.num_heads * spec.head_dim;
        let qkv_dim = q_dim + 2 * spec.num_kv_heads * spec.head_dim;
        let eps = spec.rms_norm_eps as f32;

        let mut normed = gpu.scratch::<u16>(rows * h)?;
        let mut qkv = gpu.scratch::<f32>(rows * qkv_dim)?;
        let mut q = gpu.scratch::<f32>(rows * q_dim)?;
        let mut attn = gpu.scratch::<u16>(rows * q_dim)?;
        let mut delta = gpu.scratch::<f32>(rows * h)?;
        let mut gate_up = gpu.scratch::<f32>(rows * 2 * inter)?;
        let mut act = gpu.scratch::<u16>(rows * inter)?;
        let mut final_normed = gpu.scratch::<f32>(rows * h)?;

        let mut hook = CaptureHook::new(taps.clone());
        let mut hidden = DeviceRows {
            data: gpu.scratch::<f32>(rows * h)?,
            batch: step.batch,
            width: step.width,
            hidden: h,
        };
        gpu.embed_rows(
            &self.weights.embed,
            &inputs.tokens,
            &mut hidden.data,
            rows,
            h,
        )?;
        hook.observe(TapId::Embed, &hidden);
        let layers = &self.weights.layers;
        gpu.add_rms_norm(
            &mut hidden.data,
            None,
            &layers[0].input_norm,
            &mut normed,
            None,
            rows,
            h,
            eps,
        )?;
        for (k, layer) in layers.iter().enumerate() {
            gpu.linear(&normed, &layer.qkv, &mut qkv, rows, h, qkv_dim)?;
            gpu.rope_qkv(
                &qkv,
                layer.qkv_bias.as_ref(),
                &inputs.positions,
                &self.inv_freq,
                &mut q,
                &mut cache.keys[k],
                &mut cache.values[k],
                shape,
                col0,
            )?;
            gpu.attention(
                &q,
                &cache.keys[k],
                &cache.values[k],
                &inputs.mask,
                &mut attn,
                shape,
                total,
            )?;
            gpu.linear(&attn, &layer.o, &mut delta, rows, q_dim, h)?;
            gpu.add_rms_norm(
                &mut hidden.data,
                Some(&delta),
                &layer.post_norm,
                &mut normed,
                None,
                rows,
                h,
                eps,
            )?;
            gpu.linear(&normed, &layer.gate_up, &mut gate_up, rows, h, 2 * inter)?;
            gpu.silu_mul(&gate_up, &mut act, rows, inter)?;
            gpu.linear(&act, &layer.down, &mut delta, rows, inter, h)?;
            // The residual add of this block fused with the next norm: the next layer's input
            // norm, or the final norm after the last block (kept in f32 for the `final` tap).
            match layers.get(k + 1) {
                Some(next) => gpu.add_rms_norm(
                    &mut hidden.data,
                    Some(&delta),
                    &next.input_norm,
                    &mut normed,
                    None,
                    rows,
                    h,
                    eps,
                )?,
                None => gpu.add_rms_norm(
                    &mut hidden.data,
                    Some(&delta),
                    &self.weights.final_norm,
                    &mut normed,
                    Some(&mut final_normed),
                    rows,
                    h,
                    eps,
                )?,
            }
            hook.observe(TapId::Block(k), &hidden);
        }
        let final_rows = DeviceRows {
            data: final_normed,
            batch: step.batch,
            width: step.width,
            hidden: h,
        };
        hook.observe(TapId::Final, &final_rows);
        cache.advance(step);

        let vocab = spec.vocab_size;
        let logits = match logits_for {
            LogitsFor::None => None,
            LogitsFor::All => {
                let mut out = gpu.scratch::<f32>(rows * vocab)?;
                gpu.linear(&normed, self.weights.lm_head(), &mut out, rows, h, vocab)?;
                Some((out, rows))
            }
            LogitsFor::Last => {
                let last: Vec<i32> = step
                    .last_real()
                    .iter()
                    .enumerate()
                    .map(|(b, i)| (b * step.width + i.unwrap_or(0)) as i32)
                    .collect();
                let last = gpu.upload(&last)?;
                let mut selected = gpu.scratch::<u16>(step.batch * h)?;
                gpu.gather_rows(&normed, &last, &mut selected, step.batch, h)?;
                let mut out = gpu.scratch::<f32>(step.batch * vocab)?;
                gpu.linear(
                    &selected,
                    self.weights.lm_head(),
                    &mut out,
                    step.batch,
                    h,
                    vocab,
                )?;
                Some((out, step.batch))
            }
        };
        Ok(CudaStepOutput {
            logits: logits.map(|(data, rows)| DeviceLogits {
                data,
                rows,
                vocab,
                gpu: self.gpu.clone(),
            }),
            taps: hook.finish(),
        })
    }
}
