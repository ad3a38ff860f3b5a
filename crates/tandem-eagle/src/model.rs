//! The EAGLE-3 draft head as a burn [`Module`]: `fc`, one decoder layer (`midlayer`), the final
//! `norm` and `lm_head`, with the target's embedding as a frozen constant.
//!
//! One layer implementation, [`DecoderLayer::forward`], serves both uses. It takes the
//! attention as an [`AttentionContext`]:
//!
//! - training ([`Eagle3Draft::forward_ttt`]): the unrolled training-time test, where step `i`
//!   attends to step 0's keys at every causally allowed position and to steps `1..=i` at its
//!   own position (SpecForge's `cache_hidden` lists);
//! - serving ([`Eagle3Draft::forward_step`]): a KV cache ([`DraftCache`]) extended over the
//!   accepted tokens, then one draft step at a time.
//!
//! Both compute the same function: for a sequence and a root position `t`, serving
//! "extend over `0..=t`, then steps `1..k` at positions `t+1..`" reproduces every step of the
//! unroll at index `t` (the `train_serve_parity` test).
//!
//! The unroll follows SpecForge (`specforge/modeling/draft/llama3_eagle.py`,
//! `LlamaAttention.forward`, `cache_hidden` branch): step `i` rotates its queries and keys at
//! `position_ids + i`, scores step 0's keys with the causal mask and every later step's key
//! by a per-position dot product, one softmax over all, `attn_weights[..., :n] @ v0 +
//! sum_j w_j * v_j`. Older SpecForge `core/eagle3.py` (and EAGLE's `traineagle3/cnets.py`)
//! also masked one more diagonal of step 0's keys after every step
//! (`attention_mask[:, :, ind0, ind1] = min`), so query `t` at step `i` lost step-0 keys
//! `t-i+1..=t`; serving never drops them, current SpecForge no longer does it for sdpa, and
//! it is reported as a training/serving mismatch (SafeAILab/EAGLE PR #299, SpecForge PR #245).
//! This crate does not shift the mask, so training and serving agree.

use burn::module::{Module, Param};
use burn::prelude::*;
use burn::tensor::TensorData;
use burn::tensor::activation::{silu, softmax};
use rand::{Rng, SeedableRng};
use tandem_model::KvCache;
use tandem_model::StepInput;

use crate::config::DraftSpec;
use crate::error::EagleError;
use crate::vocab::VocabMap;

/// `y = x W` without bias; `W` is stored `[in, out]`, the transpose of the HF `[out, in]`
/// layout, so the forward is one matmul.
#[derive(Module, Debug)]
pub struct Linear<B: Backend> {
    /// `[in, out]`.
    pub weight: Param<Tensor<B, 2>>,
}

impl<B: Backend> Linear<B> {
    /// `x: [batch, width, in]` -> `[batch, width, out]`.
    pub fn forward(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        let [b, n, d_in] = x.dims();
        let w = self.weight.val();
        let d_out = w.dims()[1];
        x.reshape([b * n, d_in]).matmul(w).reshape([b, n, d_out])
    }

    /// From an HF-layout `[out, in]` row-major host matrix.
    pub fn from_hf(values: &[f32], out: usize, inp: usize, device: &B::Device) -> Self {
        Linear {
            weight: Param::from_tensor(Tensor::from_data(
                TensorData::new(transpose(values, out, inp), [inp, out]),
                device,
            )),
        }
    }

    /// The weight in HF layout `[out, in]`, row-major, as f32.
    pub fn to_hf(&self) -> (Vec<f32>, [usize; 2]) {
        let w = self.weight.val();
        let [inp, out] = w.dims();
        let values = w
            .into_data()
            .convert::<f32>()
            .to_vec::<f32>()
            .expect("float weights");
        (transpose(&values, inp, out), [out, inp])
    }
}

/// Transposes a row-major `[rows, cols]` matrix.
fn transpose(values: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let mut out = vec![0.0f32; rows * cols];
    for r in 0..rows {
        for c in 0..cols {
            out[c * rows + r] = values[r * cols + c];
        }
    }
    out
}

/// RMSNorm over the last dimension as HF computes it: `x * rsqrt(mean(x^2) + eps) * w`.
#[derive(Module, Debug)]
pub struct RmsNorm<B: Backend> {
    /// `[dim]`.
    pub weight: Param<Tensor<B, 1>>,
    /// Epsilon inside the square root.
    pub eps: f64,
}

impl<B: Backend> RmsNorm<B> {
    /// Normalises `x: [.., dim]`.
    pub fn forward<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        let variance = x.clone().powi_scalar(2).mean_dim(D - 1);
        let normed = x * (variance + self.eps).sqrt().recip();
        normed * self.weight.val().unsqueeze::<D>()
    }

    /// From host values.
    pub fn from_values(values: &[f32], eps: f64, device: &B::Device) -> Self {
        RmsNorm {
            weight: Param::from_tensor(Tensor::from_data(
                TensorData::new(values.to_vec(), [values.len()]),
                device,
            )),
            eps,
        }
    }

    /// The weight as host f32.
    pub fn to_values(&self) -> Vec<f32> {
        self.weight
            .val()
            .into_data()
            .convert::<f32>()
            .to_vec::<f32>()
            .expect("float weights")
    }
}

/// Attention of the draft layer: q/k/v read the `2H`-wide concatenation [embedding, hidden].
#[derive(Module, Debug)]
pub struct Attention<B: Backend> {
    /// `2H -> heads * head_dim`.
    pub q_proj: Linear<B>,
    /// `2H -> kv_heads * head_dim`.
    pub k_proj: Linear<B>,
    /// `2H -> kv_heads * head_dim`.
    pub v_proj: Linear<B>,
    /// `heads * head_dim -> H`.
    pub o_proj: Linear<B>,
}

/// SwiGLU MLP: `down(silu(gate(x)) * up(x))`.
#[derive(Module, Debug)]
pub struct Mlp<B: Backend> {
    /// `H -> intermediate`.
    pub gate_proj: Linear<B>,
    /// `H -> intermediate`.
    pub up_proj: Linear<B>,
    /// `intermediate -> H`.
    pub down_proj: Linear<B>,
}

/// The one decoder layer of an EAGLE-3 head (`midlayer`).
#[derive(Module, Debug)]
pub struct DecoderLayer<B: Backend> {
    /// Norm of the token embedding.
    pub input_layernorm: RmsNorm<B>,
    /// Norm of the hidden input (`fc` output at step 0, the previous step's output later).
    pub hidden_norm: RmsNorm<B>,
    /// Attention over [embedding, hidden].
    pub self_attn: Attention<B>,
    /// Norm before the MLP.
    pub post_attention_layernorm: RmsNorm<B>,
    /// SwiGLU MLP.
    pub mlp: Mlp<B>,
}

/// RoPE tables for one forward call: `cos`, `sin` are `[rows, 1, width, head_dim]` (rows = 1
/// broadcasts over the batch).
#[derive(Debug, Clone)]
pub struct Rope<B: Backend> {
    cos: Tensor<B, 4>,
    sin: Tensor<B, 4>,
}

impl<B: Backend> Rope<B> {
    /// Tables for `positions` (`[rows * width]`, row-major). The angle is computed in f32 as
    /// `inv_freq (f32) * position (f32)`, as HF and SpecForge do.
    pub fn new(
        inv_freq: &[f64],
        positions: &[usize],
        rows: usize,
        width: usize,
        device: &B::Device,
    ) -> Self {
        let half = inv_freq.len();
        let hd = 2 * half;
        let mut cos = vec![0f32; rows * width * hd];
        let mut sin = vec![0f32; rows * width * hd];
        for (slot, &pos) in positions.iter().enumerate() {
            for (i, freq) in inv_freq.iter().enumerate() {
                let angle = (*freq as f32) * (pos as f32);
                let (s, c) = angle.sin_cos();
                cos[slot * hd + i] = c;
                cos[slot * hd + i + half] = c;
                sin[slot * hd + i] = s;
                sin[slot * hd + i + half] = s;
            }
        }
        Rope {
            cos: Tensor::from_data(TensorData::new(cos, [rows, 1, width, hd]), device),
            sin: Tensor::from_data(TensorData::new(sin, [rows, 1, width, hd]), device),
        }
    }

    /// HF `apply_rotary_pos_emb`: `x * cos + rotate_half(x) * sin`, `x: [b, heads, n, hd]`.
    pub fn apply(&self, x: Tensor<B, 4>) -> Tensor<B, 4> {
        let [b, heads, n, hd] = x.dims();
        let half = hd / 2;
        let x1 = x.clone().slice([0..b, 0..heads, 0..n, 0..half]);
        let x2 = x.clone().slice([0..b, 0..heads, 0..n, half..hd]);
        let rotated = Tensor::cat(vec![x2.neg(), x1], 3);
        x * self.cos.clone() + rotated * self.sin.clone()
    }
}

/// Where the layer's keys and values go and what a query attends to. The only difference
/// between the training unroll and serving.
pub trait AttentionContext<B: Backend> {
    /// `q: [b, heads, n, hd]`, `k`, `v: [b, kv_heads, n, hd]` (RoPE applied) -> attention output
    /// `[b, heads, n, hd]` (before `o_proj`).
    fn attend(&mut self, q: Tensor<B, 4>, k: Tensor<B, 4>, v: Tensor<B, 4>) -> Tensor<B, 4>;
}

impl<B: Backend> DecoderLayer<B> {
    /// The layer: `embeds`, `hidden: [b, n, H]` -> pre-norm output `[b, n, H]`.
    ///
    /// `residual = hidden` (un-normed); attention input = cat[input_layernorm(embeds),
    /// hidden_norm(hidden)] (embedding first, `2H` wide); then post_attention_layernorm and the
    /// SwiGLU MLP with their residual.
    pub fn forward(
        &self,
        spec: &DraftSpec,
        embeds: Tensor<B, 3>,
        hidden: Tensor<B, 3>,
        rope: &Rope<B>,
        attention: &mut dyn AttentionContext<B>,
    ) -> Tensor<B, 3> {
        let [b, n, _] = hidden.dims();
        let (h, kvh, hd) = (spec.num_heads, spec.num_kv_heads, spec.head_dim);
        let residual = hidden.clone();
        let x = Tensor::cat(
            vec![
                self.input_layernorm.forward(embeds),
                self.hidden_norm.forward(hidden),
            ],
            2,
        );
        let heads = |t: Tensor<B, 3>, count: usize| t.reshape([b, n, count, hd]).swap_dims(1, 2);
        let attn = &self.self_attn;
        let q = rope.apply(heads(attn.q_proj.forward(x.clone()), h));
        let k = rope.apply(heads(attn.k_proj.forward(x.clone()), kvh));
        let v = heads(attn.v_proj.forward(x), kvh);
        let out = attention
            .attend(q, k, v)
            .swap_dims(1, 2)
            .reshape([b, n, h * hd]);
        let hidden = residual + attn.o_proj.forward(out);
        let mlp_in = self.post_attention_layernorm.forward(hidden.clone());
        let mlp = &self.mlp;
        let act = silu(mlp.gate_proj.forward(mlp_in.clone())) * mlp.up_proj.forward(mlp_in);
        hidden + mlp.down_proj.forward(act)
    }
}

/// What one draft step produces.
#[derive(Debug, Clone)]
pub struct DraftOutput<B: Backend> {
    /// Pre-norm layer output `[batch, width, H]`: the next step's hidden input.
    pub hidden: Tensor<B, 3>,
    /// `lm_head(norm(hidden))`, `[batch, width, draft_vocab]`.
    pub logits: Tensor<B, 3>,
}

/// The EAGLE-3 draft head.
///
/// Parameters (trained, saved): `fc`, `midlayer`, `norm`, `lm_head`. Not parameters:
/// `embed_tokens` (the target's, frozen, never saved), the resolved `spec` and the draft
/// vocabulary `vocab` (`d2t`/`t2d`, saved as buffers by [`crate::io`]).
#[derive(Module, Debug)]
pub struct Eagle3Draft<B: Backend> {
    /// `num_taps * T -> H`, no bias.
    pub fc: Linear<B>,
    /// The decoder layer.
    pub midlayer: DecoderLayer<B>,
    /// Final norm (its input, pre-norm, is the next step's hidden).
    pub norm: RmsNorm<B>,
    /// `H -> draft_vocab`, no bias.
    pub lm_head: Linear<B>,
    /// `[vocab, H]`: the target's token embedding, a constant.
    pub embed_tokens: Tensor<B, 2>,
    /// Resolved sizes and RoPE.
    #[module(skip)]
    pub spec: DraftSpec,
    /// `d2t` / `t2d`.
    #[module(skip)]
    pub vocab: VocabMap,
}

/// Host copies of every parameter in HF layout (`[out, in]` for linears), keyed by canonical
/// checkpoint name (`fc.weight`, `midlayer.self_attn.q_proj.weight`, ...).
pub type HostWeights = std::collections::BTreeMap<String, (Vec<usize>, Vec<f32>)>;

/// Every parameter of a head: canonical name and HF shape (`[out, in]` for linears).
pub fn parameter_shapes(spec: &DraftSpec) -> Vec<(&'static str, Vec<usize>)> {
    let (h, i) = (spec.hidden_size, spec.intermediate_size);
    let q = spec.num_heads * spec.head_dim;
    let kv = spec.num_kv_heads * spec.head_dim;
    vec![
        ("fc.weight", vec![h, spec.fc_in()]),
        ("midlayer.input_layernorm.weight", vec![h]),
        ("midlayer.hidden_norm.weight", vec![h]),
        ("midlayer.self_attn.q_proj.weight", vec![q, 2 * h]),
        ("midlayer.self_attn.k_proj.weight", vec![kv, 2 * h]),
        ("midlayer.self_attn.v_proj.weight", vec![kv, 2 * h]),
        ("midlayer.self_attn.o_proj.weight", vec![h, q]),
        ("midlayer.post_attention_layernorm.weight", vec![h]),
        ("midlayer.mlp.gate_proj.weight", vec![i, h]),
        ("midlayer.mlp.up_proj.weight", vec![i, h]),
        ("midlayer.mlp.down_proj.weight", vec![h, i]),
        ("norm.weight", vec![h]),
        ("lm_head.weight", vec![spec.draft_vocab_size, h]),
    ]
}

/// Token ids the unroll feeds at TTT step `step`: index `t` of sequence `b` gets token
/// `t + 1 + step` of that sequence, or 0 past its end (SpecForge shifts `input_ids` left once
/// before the loop and once after every step, padding with 0).
///
/// `input_ids: [batch * width]` row-major; `lengths[b] <= width`.
pub fn ttt_step_tokens(
    input_ids: &[u32],
    lengths: &[usize],
    width: usize,
    step: usize,
) -> Vec<u32> {
    let mut out = vec![0u32; lengths.len() * width];
    for (b, &len) in lengths.iter().enumerate() {
        for t in 0..width {
            let src = t + 1 + step;
            if src < len {
                out[b * width + t] = input_ids[b * width + src];
            }
        }
    }
    out
}

impl<B: Backend> Eagle3Draft<B> {
    /// A head with PyTorch's default initialisation (linears uniform in ±1/sqrt(in), norms
    /// 1), seeded, on top of the target embedding `embed_tokens: [vocab, H]`.
    pub fn init(
        spec: DraftSpec,
        vocab: VocabMap,
        embed_tokens: Tensor<B, 2>,
        seed: u64,
        device: &B::Device,
    ) -> Result<Self, EagleError> {
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let mut weights = HostWeights::new();
        for (name, shape) in parameter_shapes(&spec) {
            let n: usize = shape.iter().product();
            let values = if shape.len() == 1 {
                vec![1.0f32; n]
            } else {
                let bound = 1.0 / (shape[1] as f32).sqrt();
                (0..n)
                    .map(|_| (rng.random::<f32>() * 2.0 - 1.0) * bound)
                    .collect()
            };
            weights.insert(name.to_owned(), (shape, values));
        }
        Self::from_host(spec, vocab, &weights, embed_tokens, device)
    }

    /// Builds the head from host weights in HF layout (see [`parameter_shapes`]).
    pub fn from_host(
        spec: DraftSpec,
        vocab: VocabMap,
        weights: &HostWeights,
        embed_tokens: Tensor<B, 2>,
        device: &B::Device,
    ) -> Result<Self, EagleError> {
        let [ev, eh] = embed_tokens.dims();
        if [ev, eh] != [spec.vocab_size, spec.hidden_size] {
            return Err(EagleError::EmbeddingShape {
                expected: [spec.vocab_size, spec.hidden_size],
                actual: [ev, eh],
            });
        }
        if vocab.draft_size() != spec.draft_vocab_size || vocab.target_size() != spec.vocab_size {
            return Err(EagleError::Vocab {
                reason: format!(
                    "d2t has {} entries and t2d {}, the config says draft_vocab_size {} and \
                     vocab_size {}",
                    vocab.draft_size(),
                    vocab.target_size(),
                    spec.draft_vocab_size,
                    spec.vocab_size
                ),
            });
        }
        for (name, shape) in parameter_shapes(&spec) {
            let (actual, values) = weights.get(name).ok_or_else(|| EagleError::Input {
                reason: format!("host weights lack `{name}`"),
            })?;
            if *actual != shape || values.len() != shape.iter().product::<usize>() {
                return Err(EagleError::ShapeMismatch {
                    name: name.to_owned(),
                    expected: shape,
                    actual: actual.clone(),
                });
            }
        }
        let lin = |name: &str| {
            let (shape, values) = &weights[name];
            Linear::from_hf(values, shape[0], shape[1], device)
        };
        let norm = |name: &str| RmsNorm::from_values(&weights[name].1, spec.rms_norm_eps, device);
        Ok(Eagle3Draft {
            fc: lin("fc.weight"),
            midlayer: DecoderLayer {
                input_layernorm: norm("midlayer.input_layernorm.weight"),
                hidden_norm: norm("midlayer.hidden_norm.weight"),
                self_attn: Attention {
                    q_proj: lin("midlayer.self_attn.q_proj.weight"),
                    k_proj: lin("midlayer.self_attn.k_proj.weight"),
                    v_proj: lin("midlayer.self_attn.v_proj.weight"),
                    o_proj: lin("midlayer.self_attn.o_proj.weight"),
                },
                post_attention_layernorm: norm("midlayer.post_attention_layernorm.weight"),
                mlp: Mlp {
                    gate_proj: lin("midlayer.mlp.gate_proj.weight"),
                    up_proj: lin("midlayer.mlp.up_proj.weight"),
                    down_proj: lin("midlayer.mlp.down_proj.weight"),
                },
            },
            norm: norm("norm.weight"),
            lm_head: lin("lm_head.weight"),
            embed_tokens: embed_tokens.to_device(device),
            spec,
            vocab,
        })
    }

    /// Every parameter as host f32 in HF layout, keyed by canonical checkpoint name.
    pub fn to_host(&self) -> HostWeights {
        let mut out = HostWeights::new();
        let mut lin = |name: &str, l: &Linear<B>| {
            let (values, shape) = l.to_hf();
            out.insert(name.to_owned(), (shape.to_vec(), values));
        };
        let m = &self.midlayer;
        lin("fc.weight", &self.fc);
        lin("midlayer.self_attn.q_proj.weight", &m.self_attn.q_proj);
        lin("midlayer.self_attn.k_proj.weight", &m.self_attn.k_proj);
        lin("midlayer.self_attn.v_proj.weight", &m.self_attn.v_proj);
        lin("midlayer.self_attn.o_proj.weight", &m.self_attn.o_proj);
        lin("midlayer.mlp.gate_proj.weight", &m.mlp.gate_proj);
        lin("midlayer.mlp.up_proj.weight", &m.mlp.up_proj);
        lin("midlayer.mlp.down_proj.weight", &m.mlp.down_proj);
        lin("lm_head.weight", &self.lm_head);
        for (name, norm) in [
            ("midlayer.input_layernorm.weight", &m.input_layernorm),
            ("midlayer.hidden_norm.weight", &m.hidden_norm),
            (
                "midlayer.post_attention_layernorm.weight",
                &m.post_attention_layernorm,
            ),
            ("norm.weight", &self.norm),
        ] {
            let values = norm.to_values();
            out.insert(name.to_owned(), (vec![values.len()], values));
        }
        out
    }

    /// Token embeddings `[batch, width, H]` of `tokens: [batch * width]`.
    pub fn embed(
        &self,
        tokens: &[u32],
        batch: usize,
        width: usize,
    ) -> Result<Tensor<B, 3>, EagleError> {
        if tokens.len() != batch * width {
            return Err(EagleError::Input {
                reason: format!("{} token ids for a [{batch}, {width}] step", tokens.len()),
            });
        }
        if let Some(&id) = tokens.iter().find(|&&t| t as usize >= self.spec.vocab_size) {
            return Err(EagleError::Input {
                reason: format!(
                    "token id {id} is outside the target vocabulary (size {})",
                    self.spec.vocab_size
                ),
            });
        }
        let device = self.embed_tokens.device();
        let ids: Vec<i64> = tokens.iter().map(|&t| i64::from(t)).collect();
        let ids = Tensor::<B, 1, Int>::from_data(TensorData::new(ids, [tokens.len()]), &device);
        Ok(self
            .embed_tokens
            .clone()
            .select(0, ids)
            .reshape([batch, width, self.spec.hidden_size]))
    }

    /// `fc` over concatenated aux taps: `[batch, width, num_taps * T]` -> `[batch, width, H]`.
    pub fn project_aux(&self, aux: Tensor<B, 3>) -> Result<Tensor<B, 3>, EagleError> {
        let width = aux.dims()[2];
        if width != self.spec.fc_in() {
            return Err(EagleError::Input {
                reason: format!(
                    "aux hidden states are {width} wide but fc expects {} taps x {} = {}",
                    self.spec.num_taps,
                    self.spec.target_hidden_size,
                    self.spec.fc_in()
                ),
            });
        }
        Ok(self.fc.forward(aux))
    }

    /// `lm_head(norm(hidden))`: `[b, n, H]` -> `[b, n, draft_vocab]`.
    pub fn logits(&self, hidden: Tensor<B, 3>) -> Tensor<B, 3> {
        self.lm_head.forward(self.norm.forward(hidden))
    }

    /// The training unroll (TTT) over full sequences.
    ///
    /// - `aux: [batch, width, num_taps * T]`: the target's aux states, position `t` computed
    ///   from tokens `0..=t`;
    /// - `input_ids: [batch * width]` row-major; `lengths[b]`: real length of sequence `b`
    ///   (right padding; padded positions are never attended to by real ones).
    ///
    /// Step `i` at index `t` reads the embedding of token `t + 1 + i` ([`ttt_step_tokens`]) and
    /// the hidden `fc(aux)[t]` (step 0) or step `i-1`'s pre-norm output at `t`; its query and key
    /// sit at RoPE position `t + i`. It attends to step 0's keys at positions `s <= t` and to the
    /// keys of steps `1..=i` at index `t` (one softmax over all of them). Returns one
    /// [`DraftOutput`] per step; step `i`, index `t` predicts token `t + 2 + i`.
    pub fn forward_ttt(
        &self,
        aux: Tensor<B, 3>,
        input_ids: &[u32],
        lengths: &[usize],
        steps: usize,
    ) -> Result<Vec<DraftOutput<B>>, EagleError> {
        let [batch, width, _] = aux.dims();
        if lengths.len() != batch || input_ids.len() != batch * width {
            return Err(EagleError::Input {
                reason: format!(
                    "aux is [{batch}, {width}, _] but there are {} lengths and {} ids",
                    lengths.len(),
                    input_ids.len()
                ),
            });
        }
        if let Some(&len) = lengths.iter().find(|&&l| l > width) {
            return Err(EagleError::Input {
                reason: format!("a sequence length {len} exceeds the batch width {width}"),
            });
        }
        let device = aux.device();
        let mut hidden = self.project_aux(aux)?;
        let mut context = TttAttention::new(width, self.spec.groups(), self.spec.head_dim, &device);
        let mut outputs = Vec::with_capacity(steps);
        for step in 0..steps {
            let tokens = ttt_step_tokens(input_ids, lengths, width, step);
            let embeds = self.embed(&tokens, batch, width)?;
            let positions: Vec<usize> = (step..step + width).collect();
            let rope = Rope::new(&self.spec.inv_freq, &positions, 1, width, &device);
            let out = self
                .midlayer
                .forward(&self.spec, embeds, hidden, &rope, &mut context);
            let logits = self.logits(out.clone());
            outputs.push(DraftOutput {
                hidden: out.clone(),
                logits,
            });
            hidden = out;
        }
        Ok(outputs)
    }

    /// One serving step over the draft KV cache: `step` says which tokens (and RoPE
    /// positions, and which new slots see each other), `hidden: [batch, width, H]` is the
    /// hidden input of each slot (`fc(aux)` for a draft extend over accepted tokens, see
    /// [`Eagle3Draft::extend`]; the previous step's [`DraftOutput::hidden`] for a draft step).
    /// The new keys/values are appended to `cache`.
    pub fn forward_step(
        &self,
        step: &StepInput,
        hidden: Tensor<B, 3>,
        cache: &mut DraftCache<B>,
    ) -> Result<DraftOutput<B>, EagleError> {
        let [b, w, h] = hidden.dims();
        if [b, w, h] != [step.batch, step.width, self.spec.hidden_size] {
            return Err(EagleError::Input {
                reason: format!(
                    "hidden input is [{b}, {w}, {h}] for a step of [{}, {}] (hidden {})",
                    step.batch, step.width, self.spec.hidden_size
                ),
            });
        }
        cache.reserve(step)?;
        let device = hidden.device();
        let embeds = self.embed(&step.tokens, step.batch, step.width)?;
        let rope = Rope::new(
            &self.spec.inv_freq,
            &step.positions,
            step.batch,
            step.width,
            &device,
        );
        let mask = cache.attention_mask(step, self.spec.groups());
        let total = cache.used() + step.width;
        let mut context = CacheAttention {
            start: cache.used(),
            mask: Tensor::from_data(
                TensorData::new(
                    mask,
                    [step.batch, 1, self.spec.groups() * step.width, total],
                ),
                &device,
            ),
            cache: &mut *cache,
            head_dim: self.spec.head_dim,
        };
        let out = self
            .midlayer
            .forward(&self.spec, embeds, hidden, &rope, &mut context);
        cache.advance(step);
        let logits = self.logits(out.clone());
        Ok(DraftOutput {
            hidden: out,
            logits,
        })
    }

    /// Draft extend: [`Eagle3Draft::forward_step`] with the hidden input `fc(aux)`,
    /// `aux: [batch, width, num_taps * T]`. Slot `t` must pair the target's aux state at
    /// position `p` with the token at `p + 1` (the alignment of facts section 2).
    pub fn extend(
        &self,
        step: &StepInput,
        aux: Tensor<B, 3>,
        cache: &mut DraftCache<B>,
    ) -> Result<DraftOutput<B>, EagleError> {
        let hidden = self.project_aux(aux)?;
        self.forward_step(step, hidden, cache)
    }

    /// An empty serving cache for `batch` sequences of up to `capacity` columns.
    pub fn new_cache(&self, batch: usize, capacity: usize) -> DraftCache<B> {
        KvCache::new(
            1,
            batch,
            self.spec.num_kv_heads,
            self.spec.head_dim,
            capacity,
            &self.embed_tokens.device(),
        )
    }

    /// Target ids of draft ids (through `d2t`).
    pub fn to_target_ids(&self, draft_ids: &[u32]) -> Vec<u32> {
        draft_ids
            .iter()
            .map(|&d| self.vocab.to_target(d as usize))
            .collect()
    }
}

/// The attention of the training unroll (SpecForge `LlamaAttention` with `cache_hidden`):
/// step 0's keys/values in full, later steps' keys/values attended only at the query's own
/// index.
struct TttAttention<B: Backend> {
    keys: Vec<Tensor<B, 4>>,
    values: Vec<Tensor<B, 4>>,
    /// `[1, 1, 1, n, n]`: 0 where key position `s <= t`, -inf elsewhere.
    causal: Tensor<B, 5>,
    groups: usize,
    scale: f64,
}

impl<B: Backend> TttAttention<B> {
    fn new(width: usize, groups: usize, head_dim: usize, device: &B::Device) -> Self {
        let mut mask = vec![0f32; width * width];
        for t in 0..width {
            for s in t + 1..width {
                mask[t * width + s] = f32::NEG_INFINITY;
            }
        }
        TttAttention {
            keys: Vec::new(),
            values: Vec::new(),
            causal: Tensor::from_data(TensorData::new(mask, [1, 1, 1, width, width]), device),
            groups,
            scale: 1.0 / (head_dim as f64).sqrt(),
        }
    }
}

impl<B: Backend> AttentionContext<B> for TttAttention<B> {
    fn attend(&mut self, q: Tensor<B, 4>, k: Tensor<B, 4>, v: Tensor<B, 4>) -> Tensor<B, 4> {
        let [b, h, n, hd] = q.dims();
        let g = self.groups;
        let kvh = h / g;
        self.keys.push(k);
        self.values.push(v);
        let steps = self.keys.len();
        // Query heads of one KV head stacked: head index = kv * groups + g (HF repeat_kv).
        let q5 = q.reshape([b, kvh, g, n, hd]);
        let scores0 = q5
            .clone()
            .reshape([b, kvh, g * n, hd])
            .matmul(self.keys[0].clone().swap_dims(2, 3))
            .reshape([b, kvh, g, n, n])
            * self.scale
            + self.causal.clone();
        let mut parts = vec![scores0];
        for key in &self.keys[1..] {
            // Step j's key at the query's own index: a dot product per position.
            let s = (q5.clone() * key.clone().unsqueeze_dim::<5>(2)).sum_dim(4) * self.scale;
            parts.push(s);
        }
        let probs = softmax(Tensor::cat(parts, 4), 4);
        let p0 = probs
            .clone()
            .slice([0..b, 0..kvh, 0..g, 0..n, 0..n])
            .reshape([b, kvh, g * n, n]);
        let mut out = p0
            .matmul(self.values[0].clone())
            .reshape([b, kvh, g, n, hd]);
        for j in 1..steps {
            let pj = probs
                .clone()
                .slice([0..b, 0..kvh, 0..g, 0..n, n + j - 1..n + j]);
            out = out + pj * self.values[j].clone().unsqueeze_dim::<5>(2);
        }
        out.reshape([b, h, n, hd])
    }
}

/// The attention of a serving step: write the new keys/values into the cache, attend to every
/// valid cached column plus the new slots each slot may see.
struct CacheAttention<'a, B: Backend> {
    cache: &'a mut DraftCache<B>,
    start: usize,
    /// `[batch, 1, groups * width, used + width]`.
    mask: Tensor<B, 4>,
    head_dim: usize,
}

impl<B: Backend> AttentionContext<B> for CacheAttention<'_, B> {
    fn attend(&mut self, q: Tensor<B, 4>, k: Tensor<B, 4>, v: Tensor<B, 4>) -> Tensor<B, 4> {
        let [b, h, n, hd] = q.dims();
        let kvh = k.dims()[1];
        let groups = h / kvh;
        let end = self.start + n;
        let (keys, values) = self.cache.write(0, self.start, k, v);
        let keys = keys.slice([0..b, 0..kvh, 0..end, 0..hd]);
        let values = values.slice([0..b, 0..kvh, 0..end, 0..hd]);
        let q = q.reshape([b, kvh, groups * n, hd]);
        let scale = 1.0 / (self.head_dim as f64).sqrt();
        let scores = q.matmul(keys.swap_dims(2, 3)) * scale + self.mask.clone();
        softmax(scores, 3).matmul(values).reshape([b, h, n, hd])
    }
}

/// The draft's serving KV cache: the target's [`KvCache`] with one layer, so the head shares
/// its column bookkeeping (padding of a shorter sequence and discarded tree branches are
/// invalid columns; sequences join and leave by row; compaction).
pub type DraftCache<B> = KvCache<B>;

#[cfg(test)]
mod tests {
    use super::*;

    /// Hand-worked shift: ids [10, 11, 12, 13] (length 4, width 5). Step 0 feeds the token
    /// after each position, step 1 the one after that; past the end: 0.
    #[test]
    fn ttt_tokens_shift_left_per_step() {
        let ids = [10, 11, 12, 13, 99, 20, 21, 22, 23, 24];
        let lengths = [4, 5];
        assert_eq!(
            ttt_step_tokens(&ids, &lengths, 5, 0),
            vec![11, 12, 13, 0, 0, 21, 22, 23, 24, 0]
        );
        assert_eq!(
            ttt_step_tokens(&ids, &lengths, 5, 1),
            vec![12, 13, 0, 0, 0, 22, 23, 24, 0, 0]
        );
    }

    #[test]
    fn transpose_round_trips() {
        let m = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0];
        let t = transpose(&m, 2, 3);
        assert_eq!(t, vec![1.0, 4.0, 2.0, 5.0, 3.0, 6.0]);
        assert_eq!(transpose(&t, 3, 2), m.to_vec());
    }
}
