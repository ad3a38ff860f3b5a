//! The target model (Llama family, DeepSeek-V3 / Kimi-K2): weights as burn tensors, one block
//! loop shared by every execution mode, taps taken only through [`CaptureHook`]. Architectures
//! differ inside a block only: a layer's attention is a [`SelfAttention`] variant (grouped-query
//! or multi-head latent) and its feed-forward a [`FeedForward`] variant (dense or experts).

use std::path::Path;

use burn::prelude::*;
use burn::tensor::activation::{silu, softmax};
use burn::tensor::{IndexingUpdateOp, TensorData};
use tandem_wiring::TapId;

use crate::cache::{KvCache, StepInput};
use crate::capture::{CaptureHook, CapturedTaps, TapRequest};
use crate::config::{HfConfig, MlaSpec, ModelSpec, MoeSpec};
use crate::error::ModelError;
use crate::micro_batch::{Execution, MicroBatch, merge};
use crate::weights::{HostTensor, WeightFiles};

/// `y = x W^T + b`. `weight_t` is `W^T`, `[in, out]`, so the forward is one matmul; as loaded
/// it is a transposed view of `W` kept in HF's `[out, in]` layout (see [`upload_transposed`]).
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

    /// `x: [.., in]` -> `[.., out]` for 2-D or 3-D inputs.
    pub fn forward_nd<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        let dims = x.dims();
        let d_in = dims[D - 1];
        let rows = x.shape().num_elements() / d_in.max(1);
        let mut out = dims;
        out[D - 1] = self.weight_t.dims()[1];
        self.forward(x.reshape([1, rows, d_in])).reshape(out)
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

/// The query path of multi-head latent attention.
#[derive(Debug, Clone)]
pub enum MlaQuery<B: Backend> {
    /// `q_proj` (`q_lora_rank: null`).
    Direct { q_proj: Linear<B> },
    /// `q_a_proj` -> `q_a_layernorm` -> `q_b_proj`.
    LowRank {
        q_a_proj: Linear<B>,
        q_a_layernorm: RmsNorm<B>,
        q_b_proj: Linear<B>,
    },
}

/// DeepSeek's multi-head latent attention (HF `DeepseekV3Attention`), run naively: the latent
/// is expanded by `kv_b_proj` into per-head keys and values, which the cache holds.
#[derive(Debug, Clone)]
pub struct MlaAttention<B: Backend> {
    pub query: MlaQuery<B>,
    /// `[hidden] -> [kv_lora_rank + qk_rope_head_dim]`: the latent, then the shared rope key.
    pub kv_a_proj_with_mqa: Linear<B>,
    pub kv_a_layernorm: RmsNorm<B>,
    /// `[kv_lora_rank] -> [heads * (qk_nope_head_dim + v_head_dim)]`.
    pub kv_b_proj: Linear<B>,
    pub o_proj: Linear<B>,
}

/// A layer's attention.
#[derive(Debug, Clone)]
pub enum SelfAttention<B: Backend> {
    /// Llama family: q/k/v projections, grouped-query heads.
    Grouped(Attention<B>),
    /// DeepSeek-V3: multi-head latent attention.
    Latent(MlaAttention<B>),
}

/// SwiGLU: `down(silu(gate(x)) * up(x))`.
#[derive(Debug, Clone)]
pub struct Mlp<B: Backend> {
    pub gate_proj: Linear<B>,
    pub up_proj: Linear<B>,
    pub down_proj: Linear<B>,
}

impl<B: Backend> Mlp<B> {
    pub fn forward<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        self.down_proj.forward_nd(self.activation(x))
    }

    /// `silu(gate(x)) * up(x)`: the input of `down_proj` (what a tensor-parallel rank splits
    /// by columns).
    pub fn activation<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        silu(self.gate_proj.forward_nd(x.clone())) * self.up_proj.forward_nd(x)
    }
}

/// HF `DeepseekV3TopkRouter` (`mlp.gate`): sigmoid scores, the correction bias for the choice
/// only, group-limited top-k.
#[derive(Debug, Clone)]
pub struct Router<B: Backend> {
    /// `[hidden, n_routed_experts]`.
    pub weight_t: Tensor<B, 2>,
    /// `e_score_correction_bias`, `[n_routed_experts]`, kept on the host where the choice is made.
    pub e_score_correction_bias: Vec<f32>,
}

/// HF `DeepseekV3MoE`: routed experts weighted by the router plus always-on shared experts.
#[derive(Debug, Clone)]
pub struct Moe<B: Backend> {
    pub gate: Router<B>,
    pub experts: Vec<Mlp<B>>,
    pub shared_experts: Mlp<B>,
}

/// A layer's feed-forward part.
#[derive(Debug, Clone)]
pub enum FeedForward<B: Backend> {
    Dense(Mlp<B>),
    Experts(Moe<B>),
}

#[derive(Debug, Clone)]
pub struct DecoderLayer<B: Backend> {
    pub input_layernorm: RmsNorm<B>,
    pub self_attn: SelfAttention<B>,
    pub post_attention_layernorm: RmsNorm<B>,
    pub mlp: FeedForward<B>,
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

/// Per-step tensors derived from the step input on the host and uploaded once per step, or
/// one micro-batch's part of them ([`StepContext::lane`]).
struct StepContext<B: Backend> {
    /// `[batch, 1, width, head_dim]`
    cos: Tensor<B, 4>,
    sin: Tensor<B, 4>,
    /// `[batch, 1, groups * width, keys]`: `keys = used + width` for the step, `used +
    /// slots.end` for a lane (columns after its slots are not written yet at this layer).
    mask: Tensor<B, 4>,
    /// First cache row of these sequences.
    row: usize,
    /// Cache column of the first slot.
    start: usize,
}

impl<B: Backend> StepContext<B> {
    /// The part of the step's context that micro-batch `lane` sees: its rows, its slots as
    /// queries, and the cache columns up to its last slot as keys.
    fn lane(&self, lane: &MicroBatch, groups: usize) -> Self {
        let [b, _, gw, total] = self.mask.dims();
        let width = gw / groups;
        if lane.covers(b, width) {
            return Self {
                cos: self.cos.clone(),
                sin: self.sin.clone(),
                mask: self.mask.clone(),
                row: self.row,
                start: self.start,
            };
        }
        let (rows, slots) = (lane.rows.clone(), lane.slots.clone());
        let hd = self.cos.dims()[3];
        let keys = total - width + slots.end;
        let part = |t: &Tensor<B, 4>| t.clone().slice([rows.clone(), 0..1, slots.clone(), 0..hd]);
        let mask = self
            .mask
            .clone()
            .reshape([b, groups, width, total])
            .slice([rows.clone(), 0..groups, slots.clone(), 0..keys])
            .reshape([rows.len(), 1, groups * slots.len(), keys]);
        Self {
            cos: part(&self.cos),
            sin: part(&self.sin),
            mask,
            row: self.row + rows.start,
            start: self.start + slots.start,
        }
    }
}

/// A causal LM (Llama family or DeepSeek-V3) with its weights on device `B`.
#[derive(Debug, Clone)]
pub struct TargetModel<B: Backend> {
    pub spec: ModelSpec,
    /// Plain or micro-batched steps ([`Execution::Auto`] after loading).
    pub execution: Execution,
    /// Tensor-parallel degree of the block arithmetic (1 after loading; set through
    /// [`TargetModel::set_tensor_parallel`]). See [`TargetModel::row_parallel`].
    tensor_parallel: usize,
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

/// `W^T` for a weight `W` read in HF's `[out, in]` layout: the weight stays in that layout and
/// the result is its transposed view (strides swapped, nothing copied), so `x.matmul(W^T)`
/// reads each output's inputs contiguously. On the CPU backend (burn-flex's gemm) a one-row
/// product over SmolLM2's lm_head takes about half the time it takes on a copied `[in, out]`
/// matrix (BENCHMARKS.md, CPU backend), and a tied lm_head shares the embedding's memory.
fn upload_transposed<B: Backend>(w: HostTensor, device: &B::Device) -> Tensor<B, 2> {
    upload::<B, 2>(w, device).transpose()
}

/// Reads modules by their HF names (the tensor names are the module paths).
struct Loader<'a, B: Backend> {
    weights: &'a WeightFiles,
    device: &'a B::Device,
    eps: f64,
}

impl<B: Backend> Loader<'_, B> {
    fn linear(
        &self,
        name: &str,
        d_out: usize,
        d_in: usize,
        bias: bool,
    ) -> Result<Linear<B>, ModelError> {
        let w = self
            .weights
            .read(&format!("{name}.weight"), &[d_out, d_in])?;
        let bias = if bias {
            Some(upload(
                self.weights.read(&format!("{name}.bias"), &[d_out])?,
                self.device,
            ))
        } else {
            None
        };
        Ok(Linear {
            weight_t: upload_transposed(w, self.device),
            bias,
        })
    }

    fn norm(&self, name: &str, dim: usize) -> Result<RmsNorm<B>, ModelError> {
        Ok(RmsNorm {
            weight: upload(
                self.weights.read(&format!("{name}.weight"), &[dim])?,
                self.device,
            ),
            eps: self.eps,
        })
    }

    fn mlp(&self, prefix: &str, hidden: usize, intermediate: usize) -> Result<Mlp<B>, ModelError> {
        Ok(Mlp {
            gate_proj: self.linear(&format!("{prefix}.gate_proj"), intermediate, hidden, false)?,
            up_proj: self.linear(&format!("{prefix}.up_proj"), intermediate, hidden, false)?,
            down_proj: self.linear(&format!("{prefix}.down_proj"), hidden, intermediate, false)?,
        })
    }

    fn grouped_attention(&self, spec: &ModelSpec, p: &str) -> Result<Attention<B>, ModelError> {
        let (h, hd) = (spec.hidden_size, spec.head_dim);
        let q_out = spec.num_heads * hd;
        let kv_out = spec.num_kv_heads * hd;
        let (q_norm, k_norm) = if spec.qk_norm {
            (
                Some(self.norm(&format!("{p}.self_attn.q_norm"), hd)?),
                Some(self.norm(&format!("{p}.self_attn.k_norm"), hd)?),
            )
        } else {
            (None, None)
        };
        Ok(Attention {
            q_proj: self.linear(&format!("{p}.self_attn.q_proj"), q_out, h, spec.qkv_bias)?,
            k_proj: self.linear(&format!("{p}.self_attn.k_proj"), kv_out, h, spec.qkv_bias)?,
            v_proj: self.linear(&format!("{p}.self_attn.v_proj"), kv_out, h, spec.qkv_bias)?,
            o_proj: self.linear(&format!("{p}.self_attn.o_proj"), h, q_out, spec.o_bias)?,
            q_norm,
            k_norm,
        })
    }

    /// HF `DeepseekV3Attention`: `attention_bias` puts biases on `q_a_proj`,
    /// `kv_a_proj_with_mqa` and `o_proj` only.
    fn latent_attention(
        &self,
        spec: &ModelSpec,
        mla: &MlaSpec,
        p: &str,
    ) -> Result<MlaAttention<B>, ModelError> {
        let (h, heads, bias) = (spec.hidden_size, spec.num_heads, spec.o_bias);
        let a = format!("{p}.self_attn");
        let q_out = heads * mla.qk_head_dim();
        let query = match mla.q_lora_rank {
            None => MlaQuery::Direct {
                q_proj: self.linear(&format!("{a}.q_proj"), q_out, h, false)?,
            },
            Some(rank) => MlaQuery::LowRank {
                q_a_proj: self.linear(&format!("{a}.q_a_proj"), rank, h, bias)?,
                q_a_layernorm: self.norm(&format!("{a}.q_a_layernorm"), rank)?,
                q_b_proj: self.linear(&format!("{a}.q_b_proj"), q_out, rank, false)?,
            },
        };
        Ok(MlaAttention {
            query,
            kv_a_proj_with_mqa: self.linear(
                &format!("{a}.kv_a_proj_with_mqa"),
                mla.kv_lora_rank + mla.qk_rope_head_dim,
                h,
                bias,
            )?,
            kv_a_layernorm: self.norm(&format!("{a}.kv_a_layernorm"), mla.kv_lora_rank)?,
            kv_b_proj: self.linear(
                &format!("{a}.kv_b_proj"),
                heads * (mla.qk_nope_head_dim + mla.v_head_dim),
                mla.kv_lora_rank,
                false,
            )?,
            o_proj: self.linear(&format!("{a}.o_proj"), h, heads * mla.v_head_dim, bias)?,
        })
    }

    /// HF hub layout: `mlp.gate.weight`, `mlp.gate.e_score_correction_bias`,
    /// `mlp.experts.{e}.{gate,up,down}_proj.weight`, `mlp.shared_experts.*`.
    fn moe(&self, hidden: usize, moe: &MoeSpec, p: &str) -> Result<Moe<B>, ModelError> {
        let e = moe.n_routed_experts;
        let gate_w = self
            .weights
            .read(&format!("{p}.gate.weight"), &[e, hidden])?;
        let bias = self
            .weights
            .read(&format!("{p}.gate.e_score_correction_bias"), &[e])?;
        let experts = (0..e)
            .map(|i| {
                self.mlp(
                    &format!("{p}.experts.{i}"),
                    hidden,
                    moe.moe_intermediate_size,
                )
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Moe {
            gate: Router {
                weight_t: upload_transposed(gate_w, self.device),
                e_score_correction_bias: bias.values,
            },
            experts,
            shared_experts: self.mlp(
                &format!("{p}.shared_experts"),
                hidden,
                moe.moe_intermediate_size * moe.n_shared_experts,
            )?,
        })
    }
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
        let load = Loader {
            weights,
            device,
            eps: spec.rms_norm_eps,
        };
        let mut layers = Vec::with_capacity(spec.num_layers);
        for i in 0..spec.num_layers {
            let p = format!("model.layers.{i}");
            let self_attn = match &spec.mla {
                None => SelfAttention::Grouped(load.grouped_attention(&spec, &p)?),
                Some(mla) => SelfAttention::Latent(load.latent_attention(&spec, mla, &p)?),
            };
            let mlp = match &spec.moe {
                Some(moe) if moe.is_moe_layer(i) => {
                    FeedForward::Experts(load.moe(h, moe, &format!("{p}.mlp"))?)
                }
                _ => {
                    FeedForward::Dense(load.mlp(&format!("{p}.mlp"), h, spec.intermediate_size)?)
                }
            };
            layers.push(DecoderLayer {
                input_layernorm: load.norm(&format!("{p}.input_layernorm"), h)?,
                self_attn,
                post_attention_layernorm: load.norm(&format!("{p}.post_attention_layernorm"), h)?,
                mlp,
            });
        }
        let embed_tokens: Tensor<B, 2> = upload(
            weights.read("model.embed_tokens.weight", &[spec.vocab_size, h])?,
            device,
        );
        // Tied: the embedding's own memory, seen transposed.
        let lm_head_t = if spec.tie_word_embeddings || !weights.contains("lm_head.weight") {
            embed_tokens.clone().transpose()
        } else {
            upload_transposed(
                weights.read("lm_head.weight", &[spec.vocab_size, h])?,
                device,
            )
        };
        Ok(Self {
            inv_freq: spec.rope_inv_freq(),
            embed_tokens,
            layers,
            norm: load.norm("model.norm", h)?,
            lm_head_t,
            spec,
            execution: Execution::default(),
            tensor_parallel: 1,
            device: device.clone(),
        })
    }

    /// Runs the blocks as `ranks` tensor-parallel ranks would (Megatron's split, as SGLang and
    /// vLLM shard a Llama): q|k|v and gate|up by output columns (heads, intermediate rows),
    /// o_proj and down_proj by input rows, each rank's partial product summed (the
    /// all-reduce) before the residual add. Here the ranks run in one process on one device
    /// and the sum is in rank order; the capture hook still sees the block loop's reduced
    /// residual stream, once. Needs `num_heads`, `num_kv_heads` and `intermediate_size`
    /// divisible by `ranks` (no KV-head replication) and dense grouped-query layers.
    pub fn set_tensor_parallel(&mut self, ranks: usize) -> Result<(), ModelError> {
        self.spec.check_tensor_parallel(ranks)?;
        self.tensor_parallel = ranks;
        Ok(())
    }

    /// The tensor-parallel degree the blocks run at.
    pub fn tensor_parallel(&self) -> usize {
        self.tensor_parallel
    }

    /// A row-parallel linear (o_proj, down_proj) over [`TargetModel::tensor_parallel`] ranks:
    /// rank `r` multiplies its input columns `r*d/n..(r+1)*d/n` (its heads, or its share of
    /// the intermediate activations, which the column-parallel layers before it produced) by
    /// its rows of the weight; the partial products are summed (the all-reduce), and a bias is
    /// added once after it. One rank: the plain linear.
    fn row_parallel(&self, linear: &Linear<B>, x: Tensor<B, 3>) -> Tensor<B, 3> {
        let ranks = self.tensor_parallel;
        if ranks == 1 {
            return linear.forward(x);
        }
        let [b, n, d_in] = x.dims();
        let d_out = linear.weight_t.dims()[1];
        let per = d_in / ranks;
        let x = x.reshape([b * n, d_in]);
        let mut sum: Option<Tensor<B, 2>> = None;
        for r in 0..ranks {
            let cols = r * per..(r + 1) * per;
            let partial = x
                .clone()
                .slice([0..b * n, cols.clone()])
                .matmul(linear.weight_t.clone().slice([cols, 0..d_out]));
            sum = Some(match sum {
                Some(s) => s + partial,
                None => partial,
            });
        }
        let y = sum.expect("at least one rank");
        let y = match &linear.bias {
            Some(bias) => y + bias.clone().unsqueeze_dim(0),
            None => y,
        };
        y.reshape([b, n, d_out])
    }

    pub fn device(&self) -> &B::Device {
        &self.device
    }

    /// An empty KV cache for `batch` sequences of up to `capacity` columns.
    pub fn new_cache(&self, batch: usize, capacity: usize) -> KvCache<B> {
        let (key_width, value_width) = self.spec.cache_widths();
        KvCache::with_widths(
            self.spec.num_layers,
            batch,
            self.spec.num_kv_heads,
            [key_width, value_width],
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
        crate::error::check_token_ids(tokens, self.spec.vocab_size)?;
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
    ///
    /// The step runs as one lane or, micro-batched ([`Execution`]), as two lanes interleaved
    /// layer by layer: at every layer each lane runs the block on its rows and slots, writes
    /// its own cache rows and columns, and passes its part to the hook, which reassembles the
    /// step's taps by range.
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
        let lanes = self.execution.micro_batches(step, self.spec.is_moe());
        let groups = self.spec.num_heads / self.spec.num_kv_heads;
        let lane_ctx: Vec<StepContext<B>> = lanes.iter().map(|l| ctx.lane(l, groups)).collect();
        let shape = [step.batch, step.width];
        let mut hook = CaptureHook::new(taps.clone());

        let embedded = self.embed(&step.tokens, step.batch, step.width)?;
        let mut hidden: Vec<Tensor<B, 3>> = lanes.iter().map(|l| l.slice(&embedded)).collect();
        for (lane, h) in lanes.iter().zip(&hidden) {
            hook.observe_part(TapId::Embed, lane, shape, h);
        }
        for (k, layer) in self.layers.iter().enumerate() {
            for (i, lane) in lanes.iter().enumerate() {
                hidden[i] = self.block(layer, k, hidden[i].clone(), &lane_ctx[i], cache);
                hook.observe_part(TapId::Block(k), lane, shape, &hidden[i]);
            }
        }
        let normed: Vec<Tensor<B, 3>> = hidden.into_iter().map(|h| self.norm.forward(h)).collect();
        for (lane, n) in lanes.iter().zip(&normed) {
            hook.observe_part(TapId::Final, lane, shape, n);
        }
        let normed = merge(&lanes, normed);
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

    /// What a tensor-parallel rank holds where the residual stream should be, when a capture
    /// reads block `k`'s output before the MLP's all-reduce: the residual after the
    /// (all-reduced) attention plus only this rank's share of the MLP, i.e. `down_proj` rows and
    /// `gate`/`up` columns `r*I/tp..(r+1)*I/tp` (Megatron's split, as SGLang and vLLM shard a
    /// dense MLP). One prefill of `ids` for the blocks' inputs, then
    /// [`TargetModel::block_partial_sums`]: per block of `layers`, per degree of `degrees` (each
    /// must divide the intermediate size) and per rank: `(block, tp, rank, [tokens, hidden])`.
    /// Replay compares dumped slots against these; they are not taps (the capture hook stays
    /// the only place taps are taken).
    #[allow(clippy::type_complexity)]
    pub fn mlp_partial_sums(
        &self,
        ids: &[u32],
        layers: &[usize],
        degrees: &[usize],
    ) -> Result<Vec<(usize, usize, usize, Vec<f32>)>, ModelError> {
        // Residual position k is the stream entering block k.
        let taps: Vec<TapId> = layers
            .iter()
            .map(|&k| TapId::from_residual_position(k))
            .collect();
        let inputs = crate::CaptureTarget::capture_taps(self, ids, &TapRequest::new(taps))?;
        let blocks: Vec<(usize, &[f32])> = layers
            .iter()
            .zip(&inputs)
            .map(|(&k, v)| (k, v.as_slice()))
            .collect();
        self.block_partial_sums(&blocks, degrees)
    }

    /// [`TargetModel::mlp_partial_sums`] from the residual stream entering each block (`(k,
    /// [tokens, hidden] row-major)`, e.g. the tap at residual position k, which a capture
    /// already holds), one sequence at positions `0..tokens`: each block runs alone (its
    /// attention over its own input, then the MLP's shares), so replay, which has every tap
    /// from its one prefill, pays one layer per block instead of a second prefill.
    #[allow(clippy::type_complexity)]
    pub fn block_partial_sums(
        &self,
        blocks: &[(usize, &[f32])],
        degrees: &[usize],
    ) -> Result<Vec<(usize, usize, usize, Vec<f32>)>, ModelError> {
        let h = self.spec.hidden_size;
        let mut out = Vec::new();
        // The step (positions, mask) and cache of the last length seen: blocks of one sample
        // share them, each writing only its own layer's keys and values.
        let mut prepared: Option<(usize, KvCache<B>, StepContext<B>)> = None;
        for &(k, input) in blocks {
            let layer = self
                .layers
                .get(k)
                .ok_or_else(|| ModelError::InvalidConfig {
                    field: "num_hidden_layers",
                    reason: format!("no block {k} (the model has {})", self.layers.len()),
                })?;
            let FeedForward::Dense(mlp) = &layer.mlp else {
                continue;
            };
            if input.is_empty() || !input.len().is_multiple_of(h) {
                return Err(ModelError::InvalidConfig {
                    field: "hidden_size",
                    reason: format!(
                        "block {k}'s input has {} values, not a whole number of {h}-wide rows",
                        input.len()
                    ),
                });
            }
            let n = input.len() / h;
            if prepared.as_ref().is_none_or(|(len, ..)| *len != n) {
                // Only the positions matter to the step; the block's input replaces the
                // embedding.
                let cache = self.new_cache(1, n);
                let step = cache.prefill_step(&[&vec![0u32; n]])?;
                cache.reserve(&step)?;
                let ctx = self.step_context(&step, &cache);
                prepared = Some((n, cache, ctx));
            }
            let (_, cache, ctx) = prepared.as_mut().expect("prepared above");
            let hidden: Tensor<B, 3> =
                Tensor::from_data(TensorData::new(input.to_vec(), [1, n, h]), &self.device);
            let mid = self.attention_residual(layer, k, hidden, ctx, cache);
            let act = mlp.activation(layer.post_attention_layernorm.forward(mid.clone()));
            let inter = act.dims()[2];
            for &tp in degrees {
                if tp == 0 || !inter.is_multiple_of(tp) {
                    return Err(ModelError::InvalidConfig {
                        field: "intermediate_size",
                        reason: format!("{inter} is not split evenly over {tp} ranks"),
                    });
                }
                let per = inter / tp;
                for r in 0..tp {
                    let rows = r * per..(r + 1) * per;
                    let share = act.clone().slice([0..1, 0..n, rows.clone()]);
                    let w = mlp.down_proj.weight_t.clone().slice([rows, 0..h]);
                    // A row-parallel bias is added once, after the all-reduce: not in a share.
                    let y = share.reshape([n, per]).matmul(w).reshape([1, n, h]);
                    out.push((k, tp, r, crate::capture_target::to_host(mid.clone() + y)));
                }
            }
        }
        Ok(out)
    }

    fn step_context(&self, step: &StepInput, cache: &KvCache<B>) -> StepContext<B> {
        let half = self.spec.head_dim / 2;
        let hd = self.spec.head_dim;
        let mut cos = vec![0f32; step.batch * step.width * hd];
        let mut sin = vec![0f32; step.batch * step.width * hd];
        let scale = self.spec.rope_attention_factor() as f32;
        for (slot, &pos) in step.positions.iter().enumerate() {
            for (i, freq) in self.inv_freq.iter().enumerate() {
                // HF computes the angle in f32: inv_freq (f32) * position (f32), then scales
                // cos and sin by the rope's attention factor (1 except under yarn).
                let angle = (*freq as f32) * (pos as f32);
                let (s, c) = angle.sin_cos();
                let (s, c) = (s * scale, c * scale);
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
            row: 0,
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
        let hidden = self.attention_residual(layer, index, hidden, ctx, cache);
        let mlp_in = layer.post_attention_layernorm.forward(hidden.clone());
        let mlp_out = match (&layer.mlp, &self.spec.moe) {
            (FeedForward::Dense(mlp), _) if self.tensor_parallel > 1 => {
                // gate|up column-parallel, down_proj row-parallel (an all-reduce).
                self.row_parallel(&mlp.down_proj, mlp.activation(mlp_in))
            }
            (FeedForward::Dense(mlp), _) => mlp.forward(mlp_in),
            (FeedForward::Experts(moe), Some(spec)) => self.experts(moe, spec, mlp_in),
            (FeedForward::Experts(_), None) => {
                unreachable!("experts are only loaded from a MoE spec")
            }
        };
        hidden + mlp_out
    }

    /// The residual stream after layer `index`'s attention (`hidden + attn(norm(hidden))`).
    fn attention_residual(
        &self,
        layer: &DecoderLayer<B>,
        index: usize,
        hidden: Tensor<B, 3>,
        ctx: &StepContext<B>,
        cache: &mut KvCache<B>,
    ) -> Tensor<B, 3> {
        let attn_in = layer.input_layernorm.forward(hidden.clone());
        let attn_out = match (&layer.self_attn, &self.spec.mla) {
            (SelfAttention::Grouped(attn), _) => self.attention(attn, index, attn_in, ctx, cache),
            (SelfAttention::Latent(attn), Some(mla)) => {
                self.latent_attention(attn, mla, index, attn_in, ctx, cache)
            }
            (SelfAttention::Latent(_), None) => {
                unreachable!("latent attention is only loaded from an MLA spec")
            }
        };
        hidden + attn_out
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
        let (keys, values) = cache.write_at(index, ctx.row, ctx.start, k, v);
        let rows = ctx.row..ctx.row + b;
        let keys = keys.slice([rows.clone(), 0..kvh, 0..end, 0..hd]);
        let values = values.slice([rows, 0..kvh, 0..end, 0..hd]);

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
        // Heads are contiguous in `out`, so rank r's heads are its columns r*h/n..: the
        // row-parallel o_proj (an all-reduce under tensor parallelism).
        self.row_parallel(&attn.o_proj, out)
    }

    /// HF `DeepseekV3Attention`, not absorbed: the cache holds every head's key
    /// `[nope | rope]` and value, so attention itself is plain multi-head attention with keys
    /// wider than values.
    fn latent_attention(
        &self,
        attn: &MlaAttention<B>,
        mla: &MlaSpec,
        index: usize,
        x: Tensor<B, 3>,
        ctx: &StepContext<B>,
        cache: &mut KvCache<B>,
    ) -> Tensor<B, 3> {
        let [b, n, _] = x.dims();
        let heads = self.spec.num_heads;
        let (nope, rope_w, v_w) = (mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim);
        let qk = mla.qk_head_dim();
        let q = match &attn.query {
            MlaQuery::Direct { q_proj } => q_proj.forward(x.clone()),
            MlaQuery::LowRank {
                q_a_proj,
                q_a_layernorm,
                q_b_proj,
            } => q_b_proj.forward(q_a_layernorm.forward(q_a_proj.forward(x.clone()))),
        };
        let q = q.reshape([b, n, heads, qk]).swap_dims(1, 2);
        let q_nope = q.clone().slice([0..b, 0..heads, 0..n, 0..nope]);
        let q_rope = q.slice([0..b, 0..heads, 0..n, nope..qk]);

        let kv_a = attn.kv_a_proj_with_mqa.forward(x);
        let rank = mla.kv_lora_rank;
        let latent = attn
            .kv_a_layernorm
            .forward(kv_a.clone().slice([0..b, 0..n, 0..rank]));
        // One rope key shared by all heads: [b, 1, n, rope].
        let k_rope = kv_a
            .slice([0..b, 0..n, rank..rank + rope_w])
            .unsqueeze_dim::<4>(1);
        let kv = attn
            .kv_b_proj
            .forward(latent)
            .reshape([b, n, heads, nope + v_w])
            .swap_dims(1, 2);
        let k_nope = kv.clone().slice([0..b, 0..heads, 0..n, 0..nope]);
        let v = kv.slice([0..b, 0..heads, 0..n, nope..nope + v_w]);

        let (q_rope, k_rope) = if mla.rope_interleave {
            (deinterleave(q_rope), deinterleave(k_rope))
        } else {
            (q_rope, k_rope)
        };
        let q_rope = rope(q_rope, &ctx.cos, &ctx.sin);
        let k_rope = rope(k_rope, &ctx.cos, &ctx.sin).repeat_dim(1, heads);
        let q = Tensor::cat(vec![q_nope, q_rope], 3);
        let k = Tensor::cat(vec![k_nope, k_rope], 3);

        let end = ctx.start + n;
        let (keys, values) = cache.write_at(index, ctx.row, ctx.start, k, v);
        let rows = ctx.row..ctx.row + b;
        let keys = keys.slice([rows.clone(), 0..heads, 0..end, 0..qk]);
        let values = values.slice([rows, 0..heads, 0..end, 0..v_w]);
        let scores = q.matmul(keys.swap_dims(2, 3)) * mla.softmax_scale + ctx.mask.clone();
        let out = softmax(scores, 3)
            .matmul(values)
            .swap_dims(1, 2)
            .reshape([b, n, heads * v_w]);
        attn.o_proj.forward(out)
    }

    /// HF `DeepseekV3MoE`: each token's routed experts (chosen on the host, see [`route`]) run
    /// on the rows routed to them, weighted and summed back in place; the shared experts run
    /// on every row.
    fn experts(&self, moe: &Moe<B>, spec: &MoeSpec, x: Tensor<B, 3>) -> Tensor<B, 3> {
        let [b, n, h] = x.dims();
        let rows = x.reshape([b * n, h]);
        let logits = rows.clone().matmul(moe.gate.weight_t.clone());
        let logits = logits
            .into_data()
            .convert::<f32>()
            .to_vec::<f32>()
            .expect("converted to f32");
        let choices = route(&logits, &moe.gate.e_score_correction_bias, spec);
        let mut out = moe.shared_experts.forward(rows.clone());
        for (expert, picks) in choices.iter().enumerate() {
            if picks.is_empty() {
                continue;
            }
            let index: Vec<i64> = picks.iter().map(|&(row, _)| row as i64).collect();
            let weight: Vec<f32> = picks.iter().map(|&(_, w)| w).collect();
            let index =
                Tensor::<B, 1, Int>::from_data(TensorData::new(index, [picks.len()]), &self.device);
            let weight =
                Tensor::<B, 2>::from_data(TensorData::new(weight, [picks.len(), 1]), &self.device);
            let y = moe.experts[expert].forward(rows.clone().select(0, index.clone())) * weight;
            out = out.select_assign(0, index, y, IndexingUpdateOp::Add);
        }
        out.reshape([b, n, h])
    }
}

/// HF `DeepseekV3TopkRouter` on the host, in f32 as HF computes it: for `logits`
/// (`[tokens, experts]` row-major), per expert the `(token, weight)` pairs routed to it.
///
/// Scores are `sigmoid(logits)`; the choice ranks `score + e_score_correction_bias`: groups by
/// the sum of their two best experts, the best `topk_group` groups kept, then the best
/// `num_experts_per_tok` experts of those. The weights are the chosen experts' scores (without
/// the bias), normalised to sum 1 when `norm_topk_prob`, times `routed_scaling_factor`.
pub fn route(logits: &[f32], correction_bias: &[f32], spec: &MoeSpec) -> Vec<Vec<(usize, f32)>> {
    let experts = spec.n_routed_experts;
    let per_group = experts / spec.n_group;
    let mut routed = vec![Vec::new(); experts];
    for (token, row) in logits.chunks_exact(experts).enumerate() {
        let scores: Vec<f32> = row.iter().map(|&x| 1.0 / (1.0 + (-x).exp())).collect();
        let choice: Vec<f32> = scores
            .iter()
            .zip(correction_bias)
            .map(|(s, b)| s + b)
            .collect();
        let group_score = |g: usize| {
            let mut members: Vec<f32> = choice[g * per_group..(g + 1) * per_group].to_vec();
            members.sort_by(|a, b| b.total_cmp(a));
            members[0] + members[1]
        };
        let mut groups: Vec<(usize, f32)> =
            (0..spec.n_group).map(|g| (g, group_score(g))).collect();
        groups.sort_by(|a, b| b.1.total_cmp(&a.1));
        let mut candidates: Vec<usize> = groups[..spec.topk_group]
            .iter()
            .flat_map(|&(g, _)| g * per_group..(g + 1) * per_group)
            .collect();
        candidates.sort_by(|&a, &b| choice[b].total_cmp(&choice[a]));
        let chosen = &candidates[..spec.num_experts_per_tok];
        let mut weights: Vec<f32> = chosen.iter().map(|&e| scores[e]).collect();
        if spec.norm_topk_prob {
            let denominator = weights.iter().sum::<f32>() + 1e-20;
            weights.iter_mut().for_each(|w| *w /= denominator);
        }
        for (&e, w) in chosen.iter().zip(weights) {
            routed[e].push((token, w * spec.routed_scaling_factor as f32));
        }
    }
    routed
}

/// DeepSeek's interleaved rope layout `(x0, x1), (x2, x3), ..` to halves `[x0, x2, .. | x1,
/// x3, ..]`, after which [`rope`] rotates each pair by its frequency. Queries and keys are
/// both permuted, so their dot products equal those of HF's
/// `apply_rotary_pos_emb_interleave` (whose output has the same halves layout).
fn deinterleave<B: Backend>(x: Tensor<B, 4>) -> Tensor<B, 4> {
    let [b, heads, n, d] = x.dims();
    x.reshape([b * heads * n, d / 2, 2])
        .swap_dims(1, 2)
        .reshape([b, heads, n, d])
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
