//! The Llama-family target model: weights as burn tensors, one block loop shared by every
//! execution mode, taps taken only through [`CaptureHook`].

use std::path::Path;

use burn::prelude::*;
use burn::tensor::TensorData;
use burn::tensor::activation::{silu, softmax};
use tandem_wiring::TapId;

use crate::cache::{KvCache, StepInput};
use crate::capture::{CaptureHook, CapturedTaps, TapRequest};
use crate::config::{HfConfig, ModelSpec};
use crate::error::ModelError;
use crate::weights::{HostTensor, WeightFiles};

/// `y = x W^T + b`, with `W^T` stored `[in, out]` so the forward is one matmul.
#[derive(Debug, Clone)]
pub struct Linear<B: Backend> {
    pub weight_t: Tensor<B, 2>,
    pub bias: Option<Tensor<B, 1>>,
}

impl<B: Backend> Linear<B> {
    /// `x: [batch, width, in]` -> `[batch, width, out]`.
    pub fn forward(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        let [b, n, d_in] = x.dims();
        let d_out = self.weight_t.dims()[1];
        let y = x.reshape([b * n, d_in]).matmul(self.weight_t.clone());
        let y = match &self.bias {
            Some(bias) => y + bias.clone().unsqueeze_dim(0),
            None => y,
        };
        y.reshape([b, n, d_out])
    }
}

/// RMSNorm over the last dimension, computed as HF does: `x * rsqrt(mean(x^2) + eps) * w`.
#[derive(Debug, Clone)]
pub struct RmsNorm<B: Backend> {
    pub weight: Tensor<B, 1>,
    pub eps: f64,
}

impl<B: Backend> RmsNorm<B> {
    pub fn forward<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        let variance = x.clone().powi_scalar(2).mean_dim(D - 1);
        let normed = x * (variance + self.eps).sqrt().recip();
        normed * self.weight.clone().unsqueeze::<D>()
    }
}

#[derive(Debug, Clone)]
pub struct Attention<B: Backend> {
    pub q_proj: Linear<B>,
    pub k_proj: Linear<B>,
    pub v_proj: Linear<B>,
    pub o_proj: Linear<B>,
    pub q_norm: Option<RmsNorm<B>>,
    pub k_norm: Option<RmsNorm<B>>,
}

#[derive(Debug, Clone)]
pub struct Mlp<B: Backend> {
    pub gate_proj: Linear<B>,
    pub up_proj: Linear<B>,
    pub down_proj: Linear<B>,
}

#[derive(Debug, Clone)]
pub struct DecoderLayer<B: Backend> {
    pub input_layernorm: RmsNorm<B>,
    pub self_attn: Attention<B>,
    pub post_attention_layernorm: RmsNorm<B>,
    pub mlp: Mlp<B>,
}

/// What a forward step returns.
#[derive(Debug, Clone)]
pub struct StepOutput<B: Backend> {
    /// `[batch, rows, vocab]`, rows as chosen by [`LogitsFor`].
    pub logits: Option<Tensor<B, 3>>,
    pub taps: CapturedTaps<B>,
}

/// Which positions of a step need logits (the lm_head over the vocabulary is the largest
/// matmul of a small model, so prefill asks only for the last one).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogitsFor {
    None,
    /// The last real token of each sequence: `[batch, 1, vocab]`.
    Last,
    /// Every slot of the step: `[batch, width, vocab]`.
    All,
}

/// Per-step tensors derived from the step input on the host and uploaded once per step.
struct StepContext<B: Backend> {
    /// `[batch, 1, width, head_dim]`
    cos: Tensor<B, 4>,
    sin: Tensor<B, 4>,
    /// `[batch, 1, groups * width, used + width]`
    mask: Tensor<B, 4>,
    start: usize,
}

/// A Llama-family causal LM with its weights on device `B`.
#[derive(Debug, Clone)]
pub struct TargetModel<B: Backend> {
    pub spec: ModelSpec,
    pub embed_tokens: Tensor<B, 2>,
    pub layers: Vec<DecoderLayer<B>>,
    pub norm: RmsNorm<B>,
    /// `[hidden, vocab]`; the embedding's transpose when tied.
    pub lm_head_t: Tensor<B, 2>,
    inv_freq: Vec<f64>,
    device: B::Device,
}

fn upload<B: Backend, const D: usize>(t: HostTensor, device: &B::Device) -> Tensor<B, D> {
    Tensor::from_data(TensorData::new(t.values, t.shape), device)
}

impl<B: Backend> TargetModel<B> {
    /// Loads `config.json` and the safetensors weights of an HF model directory.
    pub fn load(dir: &Path, device: &B::Device) -> Result<Self, ModelError> {
        let config = HfConfig::load(&dir.join("config.json"))?;
        let spec = config.resolve()?;
        let weights = WeightFiles::open(dir)?;
        Self::from_weights(spec, &weights, device)
    }

    pub fn from_weights(
        spec: ModelSpec,
        weights: &WeightFiles,
        device: &B::Device,
    ) -> Result<Self, ModelError> {
        let h = spec.hidden_size;
        let hd = spec.head_dim;
        let q_out = spec.num_heads * hd;
        let kv_out = spec.num_kv_heads * hd;
        let linear =
            |name: &str, d_out: usize, d_in: usize, bias: bool| -> Result<Linear<B>, ModelError> {
                let w = weights.read(&format!("{name}.weight"), &[d_out, d_in])?;
                let bias = if bias {
                    Some(upload(
                        weights.read(&format!("{name}.bias"), &[d_out])?,
                        device,
                    ))
                } else {
                    None
                };
                Ok(Linear {
                    weight_t: upload(w.transposed(), device),
                    bias,
                })
            };
        let norm = |name: &str, dim: usize| -> Result<RmsNorm<B>, ModelError> {
            Ok(RmsNorm {
                weight: upload(weights.read(&format!("{name}.weight"), &[dim])?, device),
                eps: spec.rms_norm_eps,
            })
        };
        let mut layers = Vec::with_capacity(spec.num_layers);
        for i in 0..spec.num_layers {
            let p = format!("model.layers.{i}");
            let (q_norm, k_norm) = if spec.qk_norm {
                (
                    Some(norm(&format!("{p}.self_attn.q_norm"), hd)?),
                    Some(norm(&format!("{p}.self_attn.k_norm"), hd)?),
                )
            } else {
                (None, None)
            };
            layers.push(DecoderLayer {
                input_layernorm: norm(&format!("{p}.input_layernorm"), h)?,
                self_attn: Attention {
                    q_proj: linear(&format!("{p}.self_attn.q_proj"), q_out, h, spec.qkv_bias)?,
                    k_proj: linear(&format!("{p}.self_attn.k_proj"), kv_out, h, spec.qkv_bias)?,
                    v_proj: linear(&format!("{p}.self_attn.v_proj"), kv_out, h, spec.qkv_bias)?,
                    o_proj: linear(&format!("{p}.self_attn.o_proj"), h, q_out, spec.o_bias)?,
                    q_norm,
                    k_norm,
                },
                post_attention_layernorm: norm(&format!("{p}.post_attention_layernorm"), h)?,
                mlp: Mlp {
                    gate_proj: linear(
                        &format!("{p}.mlp.gate_proj"),
                        spec.intermediate_size,
                        h,
                        false,
                    )?,
                    up_proj: linear(
                        &format!("{p}.mlp.up_proj"),
                        spec.intermediate_size,
                        h,
                        false,
                    )?,
                    down_proj: linear(
                        &format!("{p}.mlp.down_proj"),
                        h,
                        spec.intermediate_size,
                        false,
                    )?,
                },
            });
        }
        let embed = weights.read("model.embed_tokens.weight", &[spec.vocab_size, h])?;
        let lm_head = if spec.tie_word_embeddings || !weights.contains("lm_head.weight") {
            embed.transposed()
        } else {
            weights
                .read("lm_head.weight", &[spec.vocab_size, h])?
                .transposed()
        };
        Ok(Self {
            inv_freq: spec.rope_inv_freq(),
            embed_tokens: upload(embed, device),
            layers,
            norm: norm("model.norm", h)?,
            lm_head_t: upload(lm_head, device),
            spec,
            device: device.clone(),
        })
    }

    pub fn device(&self) -> &B::Device {
        &self.device
    }

    /// An empty KV cache for `batch` sequences of up to `capacity` columns.
    pub fn new_cache(&self, batch: usize, capacity: usize) -> KvCache<B> {
        KvCache::new(
            self.spec.num_layers,
            batch,
            self.spec.num_kv_heads,
            self.spec.head_dim,
            capacity,
            &self.device,
        )
    }

    /// Token embeddings, `[batch, width, hidden]` (the `embed` tap point).
    pub fn embed(
        &self,
        tokens: &[u32],
        batch: usize,
        width: usize,
    ) -> Result<Tensor<B, 3>, ModelError> {
        if let Some(&id) = tokens.iter().find(|&&t| t as usize >= self.spec.vocab_size) {
            return Err(ModelError::TokenOutOfRange {
                id,
                vocab_size: self.spec.vocab_size,
            });
        }
        let ids: Vec<i64> = tokens.iter().map(|&t| i64::from(t)).collect();
        let ids =
            Tensor::<B, 1, Int>::from_data(TensorData::new(ids, [tokens.len()]), &self.device);
        Ok(self
            .embed_tokens
            .clone()
            .select(0, ids)
            .reshape([batch, width, self.spec.hidden_size]))
    }

    /// The final norm followed by the lm_head: hidden `[batch, rows, hidden]` (residual stream
    /// leaving the last block) to logits `[batch, rows, vocab]`.
    pub fn logits_from_last_block(&self, hidden: Tensor<B, 3>) -> Tensor<B, 3> {
        self.lm_head(self.norm.forward(hidden))
    }

    fn lm_head(&self, normed: Tensor<B, 3>) -> Tensor<B, 3> {
        let [b, n, h] = normed.dims();
        normed
            .reshape([b * n, h])
            .matmul(self.lm_head_t.clone())
            .reshape([b, n, self.spec.vocab_size])
    }

    /// Runs one step of any mode (prefill, chunk, decode, tree verification) over the cache.
    /// This is the single block loop of the crate and the only caller of the capture hook.
    pub fn forward(
        &self,
        step: &StepInput,
        cache: &mut KvCache<B>,
        taps: &TapRequest,
        logits_for: LogitsFor,
    ) -> Result<StepOutput<B>, ModelError> {
        taps.validate(self.spec.num_layers)?;
        cache.reserve(step)?;
        let ctx = self.step_context(step, cache);
        let mut hook = CaptureHook::new(taps.clone());

        let mut hidden = self.embed(&step.tokens, step.batch, step.width)?;
        hook.observe(TapId::Embed, &hidden);
        for (k, layer) in self.layers.iter().enumerate() {
            hidden = self.block(layer, k, hidden, &ctx, cache);
            hook.observe(TapId::Block(k), &hidden);
        }
        let normed = self.norm.forward(hidden);
        hook.observe(TapId::Final, &normed);
        cache.advance(step);

        let logits = match logits_for {
            LogitsFor::None => None,
            LogitsFor::All => Some(self.lm_head(normed)),
            LogitsFor::Last => {
                let rows: Vec<i64> = step
                    .last_real()
                    .iter()
                    .enumerate()
                    .map(|(b, i)| (b * step.width + i.unwrap_or(0)) as i64)
                    .collect();
                let rows = Tensor::<B, 1, Int>::from_data(
                    TensorData::new(rows, [step.batch]),
                    &self.device,
                );
                let last = normed
                    .reshape([step.batch * step.width, self.spec.hidden_size])
                    .select(0, rows)
                    .reshape([step.batch, 1, self.spec.hidden_size]);
                Some(self.lm_head(last))
            }
        };
        Ok(StepOutput {
            logits,
            taps: hook.finish(),
        })
    }

    fn step_context(&self, step: &StepInput, cache: &KvCache<B>) -> StepContext<B> {
        let half = self.spec.head_dim / 2;
        let hd = self.spec.head_dim;
        let mut cos = vec![0f32; step.batch * step.width * hd];
        let mut sin = vec![0f32; step.batch * step.width * hd];
        for (slot, &pos) in step.positions.iter().enumerate() {
            for (i, freq) in self.inv_freq.iter().enumerate() {
                // HF computes the angle in f32: inv_freq (f32) * position (f32).
                let angle = (*freq as f32) * (pos as f32);
                let (s, c) = angle.sin_cos();
                cos[slot * hd + i] = c;
                cos[slot * hd + i + half] = c;
                sin[slot * hd + i] = s;
                sin[slot * hd + i + half] = s;
            }
        }
        let groups = self.spec.num_heads / self.spec.num_kv_heads;
        let total = cache.used() + step.width;
        let mask = cache.attention_mask(step, groups);
        let d = &self.device;
        StepContext {
            cos: Tensor::from_data(TensorData::new(cos, [step.batch, 1, step.width, hd]), d),
            sin: Tensor::from_data(TensorData::new(sin, [step.batch, 1, step.width, hd]), d),
            mask: Tensor::from_data(
                TensorData::new(mask, [step.batch, 1, groups * step.width, total]),
                d,
            ),
            start: cache.used(),
        }
    }

    fn block(
        &self,
        layer: &DecoderLayer<B>,
        index: usize,
        hidden: Tensor<B, 3>,
        ctx: &StepContext<B>,
        cache: &mut KvCache<B>,
    ) -> Tensor<B, 3> {
        let attn_in = layer.input_layernorm.forward(hidden.clone());
        let attn_out = self.attention(&layer.self_attn, index, attn_in, ctx, cache);
        let hidden = hidden + attn_out;
        let mlp_in = layer.post_attention_layernorm.forward(hidden.clone());
        let mlp = &layer.mlp;
        let act = silu(mlp.gate_proj.forward(mlp_in.clone())) * mlp.up_proj.forward(mlp_in);
        hidden + mlp.down_proj.forward(act)
    }

    fn attention(
        &self,
        attn: &Attention<B>,
        index: usize,
        x: Tensor<B, 3>,
        ctx: &StepContext<B>,
        cache: &mut KvCache<B>,
    ) -> Tensor<B, 3> {
        let [b, n, _] = x.dims();
        let (h, kvh, hd) = (
            self.spec.num_heads,
            self.spec.num_kv_heads,
            self.spec.head_dim,
        );
        let groups = h / kvh;
        let heads = |t: Tensor<B, 3>, count: usize| t.reshape([b, n, count, hd]).swap_dims(1, 2);
        let mut q = heads(attn.q_proj.forward(x.clone()), h);
        let mut k = heads(attn.k_proj.forward(x.clone()), kvh);
        let v = heads(attn.v_proj.forward(x), kvh);
        if let (Some(qn), Some(kn)) = (&attn.q_norm, &attn.k_norm) {
            q = qn.forward(q);
            k = kn.forward(k);
        }
        let q = rope(q, &ctx.cos, &ctx.sin);
        let k = rope(k, &ctx.cos, &ctx.sin);

        let end = ctx.start + n;
        let (keys, values) = cache.write(index, ctx.start, k, v);
        let keys = keys.slice([0..b, 0..kvh, 0..end, 0..hd]);
        let values = values.slice([0..b, 0..kvh, 0..end, 0..hd]);

        // Grouped-query attention without copying K/V: query heads of one KV head are stacked
        // along the row axis, [b, kvh, groups * n, hd].
        let q = q.reshape([b, kvh, groups * n, hd]);
        let scale = 1.0 / (hd as f64).sqrt();
        let scores = q.matmul(keys.swap_dims(2, 3)) * scale + ctx.mask.clone();
        let probs = softmax(scores, 3);
        let out = probs
            .matmul(values)
            .reshape([b, h, n, hd])
            .swap_dims(1, 2)
            .reshape([b, n, h * hd]);
        attn.o_proj.forward(out)
    }
}

/// HF `apply_rotary_pos_emb`: `x * cos + rotate_half(x) * sin`, `x: [b, heads, n, hd]`.
fn rope<B: Backend>(x: Tensor<B, 4>, cos: &Tensor<B, 4>, sin: &Tensor<B, 4>) -> Tensor<B, 4> {
    let [b, heads, n, hd] = x.dims();
    let half = hd / 2;
    let x1 = x.clone().slice([0..b, 0..heads, 0..n, 0..half]);
    let x2 = x.clone().slice([0..b, 0..heads, 0..n, half..hd]);
    let rotated = Tensor::cat(vec![x2.neg(), x1], 3);
    x * cos.clone() + rotated * sin.clone()
}
