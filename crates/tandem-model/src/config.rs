//! HF `config.json` for the Llama family and DeepSeek-V3 (Kimi-K2), mirrored field for field,
//! and the resolved runtime spec the model is built from.

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::error::ModelError;

/// `rope_scaling` as HF writes it. The llama3 scheme (Llama family) and yarn (DeepSeek-V3,
/// Kimi-K2) change the frequencies here; `default` / absent means plain RoPE.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RopeScaling {
    #[serde(alias = "type")]
    pub rope_type: String,
    #[serde(default)]
    pub factor: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub low_freq_factor: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub high_freq_factor: Option<f64>,
    #[serde(default)]
    pub original_max_position_embeddings: Option<usize>,
    /// yarn: rotations bounding the interpolation ramp (HF defaults 32 and 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub beta_fast: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub beta_slow: Option<f64>,
    /// yarn: the cos/sin scale, or derived from `factor`, `mscale` and `mscale_all_dim`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attention_factor: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mscale: Option<f64>,
    /// yarn in DeepSeek attention: the softmax scale is multiplied by `yarn_mscale(factor,
    /// mscale_all_dim)^2`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mscale_all_dim: Option<f64>,
    /// yarn: round the ramp bounds outwards (HF default true).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub truncate: Option<bool>,
}

/// The DeepSeek-V3 (and Kimi-K2) fields of `config.json`: multi-head latent attention and the
/// mixture of experts. Absent from Llama-family configs. `None` means the key is absent and
/// HF's `DeepseekV3Config` default applies (see [`DeepseekV3Fields::resolve`]);
/// `q_lora_rank: null` (DeepSeek-V2-Lite style, a plain `q_proj`) is `Some(None)`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct DeepseekV3Fields {
    #[serde(
        default,
        deserialize_with = "present_or_null",
        skip_serializing_if = "Option::is_none"
    )]
    pub q_lora_rank: Option<Option<usize>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_lora_rank: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub qk_nope_head_dim: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub qk_rope_head_dim: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub v_head_dim: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope_interleave: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub first_k_dense_replace: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub moe_layer_freq: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub moe_intermediate_size: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub n_routed_experts: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub n_shared_experts: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub num_experts_per_tok: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub n_group: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub topk_group: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub norm_topk_prob: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub routed_scaling_factor: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scoring_func: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub topk_method: Option<String>,
}

/// Distinguishes an absent key (outer `None`, via `#[serde(default)]`) from an explicit `null`.
fn present_or_null<'de, D: serde::Deserializer<'de>>(
    deserializer: D,
) -> Result<Option<Option<usize>>, D::Error> {
    Option::<usize>::deserialize(deserializer).map(Some)
}

/// The subset of HF `config.json` that the Llama-family architectures share. Field names are
/// HF's own so a `config.json` deserialises directly.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HfConfig {
    #[serde(default)]
    pub architectures: Vec<String>,
    #[serde(default)]
    pub model_type: Option<String>,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    #[serde(default)]
    pub num_key_value_heads: Option<usize>,
    #[serde(default)]
    pub head_dim: Option<usize>,
    pub rms_norm_eps: f64,
    #[serde(default = "default_rope_theta")]
    pub rope_theta: f64,
    #[serde(default)]
    pub rope_scaling: Option<RopeScaling>,
    #[serde(default = "default_max_position_embeddings")]
    pub max_position_embeddings: usize,
    pub vocab_size: usize,
    #[serde(default)]
    pub tie_word_embeddings: bool,
    #[serde(default)]
    pub attention_bias: bool,
    #[serde(default)]
    pub mlp_bias: bool,
    #[serde(default)]
    pub hidden_act: Option<String>,
    #[serde(default)]
    pub sliding_window: Option<usize>,
    #[serde(default)]
    pub bos_token_id: Option<serde_json::Value>,
    #[serde(default)]
    pub eos_token_id: Option<serde_json::Value>,
    /// MLA and MoE fields (DeepSeek-V3 / Kimi-K2 only).
    #[serde(flatten)]
    pub deepseek: DeepseekV3Fields,
}

fn default_rope_theta() -> f64 {
    10_000.0
}
fn default_max_position_embeddings() -> usize {
    2048
}

/// Architectures the target model supports; each differs from plain Llama in one detail.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Family {
    /// `LlamaForCausalLM`
    Llama,
    /// `MistralForCausalLM`: Llama layout; sliding window attention when the context exceeds it.
    Mistral,
    /// `Qwen2ForCausalLM`: bias on q/k/v projections.
    Qwen2,
    /// `Qwen3ForCausalLM`: per-head RMSNorm on q and k before RoPE.
    Qwen3,
    /// `DeepseekV3ForCausalLM` (DeepSeek-V3, Kimi-K2): multi-head latent attention, the first
    /// `first_k_dense_replace` layers dense, the rest mixture-of-experts.
    DeepseekV3,
}

impl Family {
    pub fn from_architecture(name: &str) -> Result<Self, ModelError> {
        match name {
            "LlamaForCausalLM" => Ok(Self::Llama),
            "MistralForCausalLM" => Ok(Self::Mistral),
            "Qwen2ForCausalLM" => Ok(Self::Qwen2),
            "Qwen3ForCausalLM" => Ok(Self::Qwen3),
            "DeepseekV3ForCausalLM" => Ok(Self::DeepseekV3),
            other => Err(ModelError::UnsupportedArchitecture {
                architecture: other.to_string(),
            }),
        }
    }
}

/// Resolved runtime description of a target model (defaults applied, derived sizes computed).
#[derive(Debug, Clone, PartialEq)]
pub struct ModelSpec {
    pub family: Family,
    pub architecture: String,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    pub rope_scaling: Option<RopeScaling>,
    pub max_position_embeddings: usize,
    pub vocab_size: usize,
    pub tie_word_embeddings: bool,
    /// Bias on q/k/v (Qwen2, or `attention_bias: true`).
    pub qkv_bias: bool,
    /// Bias on o_proj (`attention_bias: true` in Llama; Qwen2 has none).
    pub o_bias: bool,
    /// Per-head q/k RMSNorm (Qwen3).
    pub qk_norm: bool,
    pub sliding_window: Option<usize>,
    /// Multi-head latent attention (DeepSeek-V3); `None`: grouped-query attention.
    pub mla: Option<MlaSpec>,
    /// Routed + shared experts (DeepSeek-V3); `None`: every layer has a dense SwiGLU MLP.
    pub moe: Option<MoeSpec>,
}

/// Multi-head latent attention, computed naively (not absorbed): per head, keys are
/// `[nope | rope]` (`qk_nope_head_dim + qk_rope_head_dim` wide) and values `v_head_dim` wide.
/// RoPE covers the rope part only; [`ModelSpec::head_dim`] is the rope width, as in HF.
#[derive(Debug, Clone, PartialEq)]
pub struct MlaSpec {
    /// `None`: a plain `q_proj`; else `q_a_proj` -> `q_a_layernorm` -> `q_b_proj`.
    pub q_lora_rank: Option<usize>,
    pub kv_lora_rank: usize,
    pub qk_nope_head_dim: usize,
    pub qk_rope_head_dim: usize,
    pub v_head_dim: usize,
    /// The rope part is stored as interleaved pairs `(x0, x1), (x2, x3), ..` (DeepSeek's own
    /// layout, HF `rope_interleave`, default true) rather than as two halves.
    pub rope_interleave: bool,
    /// The softmax scale: `qk_head_dim^-0.5`, times `yarn_mscale(factor, mscale_all_dim)^2`
    /// under yarn (HF `yarn_apply_mscale`).
    pub softmax_scale: f64,
}

impl MlaSpec {
    /// Key width per head: `qk_nope_head_dim + qk_rope_head_dim`.
    pub fn qk_head_dim(&self) -> usize {
        self.qk_nope_head_dim + self.qk_rope_head_dim
    }
}

/// DeepSeek-V3's mixture of experts (HF `DeepseekV3MoE` with its `DeepseekV3TopkRouter`).
#[derive(Debug, Clone, PartialEq)]
pub struct MoeSpec {
    /// Layers `0..first_k_dense_replace` have a dense MLP of `intermediate_size`.
    pub first_k_dense_replace: usize,
    pub n_routed_experts: usize,
    /// Width of one routed expert; the shared experts are `n_shared_experts` times as wide.
    pub moe_intermediate_size: usize,
    pub n_shared_experts: usize,
    pub num_experts_per_tok: usize,
    /// Experts form `n_group` groups; a token picks its `topk_group` best groups (each scored by
    /// its two best experts), then its top `num_experts_per_tok` experts within them.
    pub n_group: usize,
    pub topk_group: usize,
    pub norm_topk_prob: bool,
    pub routed_scaling_factor: f64,
}

impl MoeSpec {
    /// Whether layer `index` routes through experts.
    pub fn is_moe_layer(&self, index: usize) -> bool {
        index >= self.first_k_dense_replace
    }
}

impl DeepseekV3Fields {
    /// MLA and MoE sizes with HF `DeepseekV3Config`'s defaults for absent keys, checked.
    fn resolve(&self, config: &HfConfig) -> Result<(MlaSpec, MoeSpec), ModelError> {
        let invalid =
            |field: &'static str, reason: String| ModelError::InvalidConfig { field, reason };
        let mla = MlaSpec {
            q_lora_rank: self.q_lora_rank.unwrap_or(Some(1536)),
            kv_lora_rank: self.kv_lora_rank.unwrap_or(512),
            qk_nope_head_dim: self.qk_nope_head_dim.unwrap_or(128),
            qk_rope_head_dim: self.qk_rope_head_dim.unwrap_or(64),
            v_head_dim: self.v_head_dim.unwrap_or(128),
            rope_interleave: self.rope_interleave.unwrap_or(true),
            softmax_scale: 0.0,
        };
        if mla.qk_rope_head_dim == 0 || !mla.qk_rope_head_dim.is_multiple_of(2) {
            return Err(invalid(
                "qk_rope_head_dim",
                format!(
                    "{} must be positive and even for RoPE",
                    mla.qk_rope_head_dim
                ),
            ));
        }
        if mla.kv_lora_rank == 0 || mla.v_head_dim == 0 || mla.q_lora_rank == Some(0) {
            return Err(invalid(
                "kv_lora_rank/v_head_dim/q_lora_rank",
                "must be positive".into(),
            ));
        }
        let moe = MoeSpec {
            first_k_dense_replace: self.first_k_dense_replace.unwrap_or(3),
            n_routed_experts: self.n_routed_experts.unwrap_or(256),
            moe_intermediate_size: self.moe_intermediate_size.unwrap_or(2048),
            n_shared_experts: self.n_shared_experts.unwrap_or(1),
            num_experts_per_tok: self.num_experts_per_tok.unwrap_or(8),
            n_group: self.n_group.unwrap_or(8),
            topk_group: self.topk_group.unwrap_or(4),
            norm_topk_prob: self.norm_topk_prob.unwrap_or(true),
            routed_scaling_factor: self.routed_scaling_factor.unwrap_or(2.5),
        };
        if let Some(freq) = self.moe_layer_freq
            && freq != 1
        {
            return Err(invalid(
                "moe_layer_freq",
                format!(
                    "is {freq}; HF DeepseekV3 makes every layer after first_k_dense_replace MoE (1)"
                ),
            ));
        }
        if let Some(f) = &self.scoring_func
            && f != "sigmoid"
        {
            return Err(invalid(
                "scoring_func",
                format!("is {f:?}; DeepseekV3 routing scores with sigmoid"),
            ));
        }
        if let Some(m) = &self.topk_method
            && m != "noaux_tc"
        {
            return Err(invalid(
                "topk_method",
                format!(
                    "is {m:?}; DeepseekV3 routes with noaux_tc (group-limited top-k with a correction bias)"
                ),
            ));
        }
        if moe.n_group == 0 || !moe.n_routed_experts.is_multiple_of(moe.n_group) {
            return Err(invalid(
                "n_group",
                format!(
                    "{} does not divide n_routed_experts {}",
                    moe.n_group, moe.n_routed_experts
                ),
            ));
        }
        if moe.n_routed_experts / moe.n_group < 2 {
            return Err(invalid(
                "n_group",
                format!(
                    "{} groups of {} experts: a group is scored by its two best experts, so each needs at least 2",
                    moe.n_group,
                    moe.n_routed_experts / moe.n_group
                ),
            ));
        }
        if moe.topk_group == 0 || moe.topk_group > moe.n_group {
            return Err(invalid(
                "topk_group",
                format!(
                    "{} must be in 1..={} (n_group)",
                    moe.topk_group, moe.n_group
                ),
            ));
        }
        let reachable = moe.topk_group * moe.n_routed_experts / moe.n_group;
        if moe.num_experts_per_tok == 0 || moe.num_experts_per_tok > reachable {
            return Err(invalid(
                "num_experts_per_tok",
                format!(
                    "{} must be in 1..={reachable} (experts in the topk_group best groups)",
                    moe.num_experts_per_tok
                ),
            ));
        }
        if moe.moe_intermediate_size == 0 {
            return Err(invalid("moe_intermediate_size", "must be positive".into()));
        }
        let softmax_scale = (mla.qk_head_dim() as f64).powf(-0.5)
            * match &config.rope_scaling {
                Some(s) if s.rope_type == "yarn" => match s.mscale_all_dim {
                    Some(all) if all != 0.0 => yarn_mscale(s.factor.unwrap_or(1.0), all).powi(2),
                    _ => 1.0,
                },
                _ => 1.0,
            };
        Ok((
            MlaSpec {
                softmax_scale,
                ..mla
            },
            moe,
        ))
    }
}

/// HF `get_mscale` / `yarn_get_mscale`: `0.1 * mscale * ln(scale) + 1`, or 1 for `scale <= 1`.
fn yarn_mscale(scale: f64, mscale: f64) -> f64 {
    if scale <= 1.0 {
        1.0
    } else {
        0.1 * mscale * scale.ln() + 1.0
    }
}

impl HfConfig {
    pub fn load(path: &Path) -> Result<Self, ModelError> {
        let text = std::fs::read_to_string(path).map_err(|source| ModelError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        serde_json::from_str(&text).map_err(|source| ModelError::Json {
            path: path.to_path_buf(),
            source,
        })
    }

    pub fn resolve(&self) -> Result<ModelSpec, ModelError> {
        let architecture =
            self.architectures
                .first()
                .cloned()
                .ok_or_else(|| ModelError::InvalidConfig {
                    field: "architectures",
                    reason: "is empty; cannot tell which model family this is".into(),
                })?;
        let family = Family::from_architecture(&architecture)?;
        if let Some(act) = &self.hidden_act
            && act != "silu"
        {
            return Err(ModelError::InvalidConfig {
                field: "hidden_act",
                reason: format!("is {act:?}; only silu (SwiGLU) is supported"),
            });
        }
        if self.num_attention_heads == 0 || self.hidden_size == 0 || self.num_hidden_layers == 0 {
            return Err(ModelError::InvalidConfig {
                field: "num_attention_heads/hidden_size/num_hidden_layers",
                reason: "must be positive".into(),
            });
        }
        let (mla, moe) = if family == Family::DeepseekV3 {
            let (mla, moe) = self.deepseek.resolve(self)?;
            (Some(mla), Some(moe))
        } else {
            (None, None)
        };
        let num_kv_heads = self.num_key_value_heads.unwrap_or(self.num_attention_heads);
        if num_kv_heads == 0 || !self.num_attention_heads.is_multiple_of(num_kv_heads) {
            return Err(ModelError::InvalidConfig {
                field: "num_key_value_heads",
                reason: format!(
                    "{num_kv_heads} does not divide num_attention_heads {}",
                    self.num_attention_heads
                ),
            });
        }
        if mla.is_some() && num_kv_heads != self.num_attention_heads {
            return Err(ModelError::InvalidConfig {
                field: "num_key_value_heads",
                reason: format!(
                    "is {num_kv_heads}; multi-head latent attention expands keys and values for \
                     all {} heads",
                    self.num_attention_heads
                ),
            });
        }
        // HF's DeepseekV3Config sets head_dim to the rope width: RoPE covers only that part.
        let head_dim = match &mla {
            Some(mla) => mla.qk_rope_head_dim,
            None => self
                .head_dim
                .unwrap_or(self.hidden_size / self.num_attention_heads),
        };
        if !head_dim.is_multiple_of(2) {
            return Err(ModelError::InvalidConfig {
                field: "head_dim",
                reason: format!("{head_dim} is odd; RoPE needs an even head dimension"),
            });
        }
        if let Some(scaling) = &self.rope_scaling {
            let supported: &[&str] = if family == Family::DeepseekV3 {
                &["default", "yarn"]
            } else {
                &["default", "llama3"]
            };
            if !supported.contains(&scaling.rope_type.as_str()) {
                return Err(ModelError::InvalidConfig {
                    field: "rope_scaling",
                    reason: format!(
                        "type {:?} is not supported for {architecture} ({})",
                        scaling.rope_type,
                        supported.join(", ")
                    ),
                });
            }
            if scaling.rope_type == "yarn"
                && (scaling.factor.is_none() || scaling.original_max_position_embeddings.is_none())
            {
                return Err(ModelError::InvalidConfig {
                    field: "rope_scaling",
                    reason: "yarn needs factor and original_max_position_embeddings".into(),
                });
            }
        }
        Ok(ModelSpec {
            family,
            architecture,
            hidden_size: self.hidden_size,
            intermediate_size: self.intermediate_size,
            num_layers: self.num_hidden_layers,
            num_heads: self.num_attention_heads,
            num_kv_heads,
            head_dim,
            rms_norm_eps: self.rms_norm_eps,
            rope_theta: self.rope_theta,
            rope_scaling: self.rope_scaling.clone(),
            max_position_embeddings: self.max_position_embeddings,
            vocab_size: self.vocab_size,
            tie_word_embeddings: self.tie_word_embeddings,
            qkv_bias: family == Family::Qwen2 || self.attention_bias,
            o_bias: self.attention_bias,
            qk_norm: family == Family::Qwen3,
            sliding_window: if family == Family::Mistral {
                self.sliding_window
            } else {
                None
            },
            mla,
            moe,
        })
    }
}

impl ModelSpec {
    /// Inverse frequencies of RoPE, `[head_dim / 2]`, with llama3 scaling applied when configured
    /// (same arithmetic as HF `_compute_llama3_parameters`).
    pub fn rope_inv_freq(&self) -> Vec<f64> {
        let half = self.head_dim / 2;
        let base: Vec<f64> = (0..half)
            .map(|i| 1.0 / self.rope_theta.powf((2 * i) as f64 / self.head_dim as f64))
            .collect();
        let Some(scaling) = &self.rope_scaling else {
            return base;
        };
        if scaling.rope_type == "yarn" {
            return self.yarn_inv_freq(scaling, &base);
        }
        if scaling.rope_type != "llama3" {
            return base;
        }
        let factor = scaling.factor.unwrap_or(8.0);
        let low = scaling.low_freq_factor.unwrap_or(1.0);
        let high = scaling.high_freq_factor.unwrap_or(4.0);
        let old_context = scaling.original_max_position_embeddings.unwrap_or(8192) as f64;
        let low_wavelen = old_context / low;
        let high_wavelen = old_context / high;
        base.into_iter()
            .map(|freq| {
                let wavelen = 2.0 * std::f64::consts::PI / freq;
                if wavelen < high_wavelen {
                    freq
                } else if wavelen > low_wavelen {
                    freq / factor
                } else {
                    let smooth = (old_context / wavelen - low) / (high - low);
                    (1.0 - smooth) * freq / factor + smooth * freq
                }
            })
            .collect()
    }
}

impl ModelSpec {
    /// HF `_compute_yarn_parameters`: frequencies below the correction range are interpolated
    /// (divided by `factor`), those above kept, a linear ramp in between.
    fn yarn_inv_freq(&self, scaling: &RopeScaling, base: &[f64]) -> Vec<f64> {
        let dim = self.head_dim as f64;
        let factor = scaling.factor.unwrap_or(1.0);
        let original = scaling
            .original_max_position_embeddings
            .unwrap_or(self.max_position_embeddings) as f64;
        let theta = self.rope_theta;
        let correction_dim = |rotations: f64| {
            dim * (original / (rotations * 2.0 * std::f64::consts::PI)).ln() / (2.0 * theta.ln())
        };
        let (mut low, mut high) = (
            correction_dim(scaling.beta_fast.unwrap_or(32.0)),
            correction_dim(scaling.beta_slow.unwrap_or(1.0)),
        );
        if scaling.truncate.unwrap_or(true) {
            low = low.floor();
            high = high.ceil();
        }
        let (low, mut high) = (low.max(0.0), high.min(dim - 1.0));
        if low == high {
            high += 0.001; // HF: prevents a division by zero
        }
        base.iter()
            .enumerate()
            .map(|(i, &extrapolated)| {
                let ramp = ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
                let keep = 1.0 - ramp;
                extrapolated / factor * (1.0 - keep) + extrapolated * keep
            })
            .collect()
    }

    /// The factor HF multiplies cos and sin by: 1 except under yarn, where it is
    /// `attention_factor`, else `mscale(factor, mscale) / mscale(factor, mscale_all_dim)` when
    /// both are given, else `mscale(factor, 1)`.
    pub fn rope_attention_factor(&self) -> f64 {
        match &self.rope_scaling {
            Some(s) if s.rope_type == "yarn" => {
                let factor = s.factor.unwrap_or(1.0);
                match (s.attention_factor, s.mscale, s.mscale_all_dim) {
                    (Some(a), _, _) => a,
                    (None, Some(m), Some(all)) if m != 0.0 && all != 0.0 => {
                        yarn_mscale(factor, m) / yarn_mscale(factor, all)
                    }
                    _ => yarn_mscale(factor, 1.0),
                }
            }
            _ => 1.0,
        }
    }

    /// Whether any layer routes through experts (the micro-batched path pays off there).
    pub fn is_moe(&self) -> bool {
        self.moe
            .as_ref()
            .is_some_and(|m| m.first_k_dense_replace < self.num_layers)
    }

    /// Whether the blocks split over `ranks` tensor-parallel ranks the Megatron way (q|k|v and
    /// gate|up by output rows, o_proj and down_proj by input columns): dense grouped-query
    /// layers whose `num_attention_heads`, `num_key_value_heads` and `intermediate_size` divide
    /// by `ranks` (no KV-head replication). The burn target and the CUDA fast path both check
    /// this, so they accept and refuse the same splits.
    pub fn check_tensor_parallel(&self, ranks: usize) -> Result<(), ModelError> {
        let bad = |reason: String| {
            Err(ModelError::InvalidConfig {
                field: "tensor_parallel",
                reason,
            })
        };
        if ranks == 0 {
            return bad("the tensor-parallel degree must be at least 1".to_owned());
        }
        if ranks > 1 && (self.is_moe() || self.mla.is_some()) {
            return bad(format!(
                "tensor parallelism over {ranks} ranks is built for dense grouped-query \
                 layers; this model has {}",
                if self.is_moe() {
                    "experts"
                } else {
                    "latent attention"
                }
            ));
        }
        for (name, count) in [
            ("num_attention_heads", self.num_heads),
            ("num_key_value_heads", self.num_kv_heads),
            ("intermediate_size", self.intermediate_size),
        ] {
            if !count.is_multiple_of(ranks) {
                return bad(format!(
                    "{name} = {count} does not split over {ranks} tensor-parallel ranks"
                ));
            }
        }
        Ok(())
    }

    /// What one of `ranks` tensor-parallel ranks computes ([`ModelSpec::check_tensor_parallel`]):
    /// this spec with its attention heads, KV heads and intermediate size divided by `ranks`.
    pub fn tensor_parallel_rank(&self, ranks: usize) -> Result<ModelSpec, ModelError> {
        self.check_tensor_parallel(ranks)?;
        Ok(ModelSpec {
            num_heads: self.num_heads / ranks,
            num_kv_heads: self.num_kv_heads / ranks,
            intermediate_size: self.intermediate_size / ranks,
            ..self.clone()
        })
    }

    /// `(key width, value width)` per KV head in the cache: `head_dim` both for the Llama
    /// family; `qk_nope + qk_rope` and `v_head_dim` under MLA.
    pub fn cache_widths(&self) -> (usize, usize) {
        match &self.mla {
            Some(mla) => (mla.qk_head_dim(), mla.v_head_dim),
            None => (self.head_dim, self.head_dim),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn llama_json() -> serde_json::Value {
        serde_json::json!({
            "architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
            "num_attention_heads": 9, "num_key_value_heads": 3, "rms_norm_eps": 1e-5,
            "rope_theta": 100000.0, "vocab_size": 49152, "tie_word_embeddings": true
        })
    }

    #[test]
    fn resolves_smollm2_shape() {
        let cfg: HfConfig = serde_json::from_value(llama_json()).unwrap();
        let spec = cfg.resolve().unwrap();
        assert_eq!(spec.head_dim, 64);
        assert_eq!(spec.num_kv_heads, 3);
        assert!(!spec.qkv_bias && !spec.qk_norm);
    }

    #[test]
    fn tensor_parallel_ranks_divide_heads_and_intermediate_or_name_what_does_not() {
        let mut v = llama_json();
        v["num_attention_heads"] = serde_json::json!(8);
        v["num_key_value_heads"] = serde_json::json!(4);
        v["hidden_size"] = serde_json::json!(512);
        let spec = serde_json::from_value::<HfConfig>(v)
            .unwrap()
            .resolve()
            .unwrap();
        let rank = spec.tensor_parallel_rank(2).unwrap();
        assert_eq!(
            (rank.num_heads, rank.num_kv_heads, rank.intermediate_size),
            (4, 2, 768)
        );
        // Everything a rank does not split stays the model's.
        assert_eq!(
            (rank.hidden_size, rank.head_dim, rank.vocab_size),
            (512, 64, 49152)
        );
        assert_eq!(spec.tensor_parallel_rank(1).unwrap(), spec);
        let err = spec.tensor_parallel_rank(8).unwrap_err().to_string();
        assert!(
            err.contains("num_key_value_heads = 4 does not split over 8"),
            "{err}"
        );
        // SmolLM2's 9 heads do not split in two.
        let smol = serde_json::from_value::<HfConfig>(llama_json())
            .unwrap()
            .resolve()
            .unwrap();
        let err = smol.check_tensor_parallel(2).unwrap_err().to_string();
        assert!(err.contains("num_attention_heads = 9"), "{err}");
        assert!(spec.check_tensor_parallel(0).is_err());
    }

    #[test]
    fn refuses_unknown_architecture_by_name() {
        let mut v = llama_json();
        v["architectures"] = serde_json::json!(["GPTNeoXForCausalLM"]);
        let err = serde_json::from_value::<HfConfig>(v)
            .unwrap()
            .resolve()
            .unwrap_err();
        assert!(err.to_string().contains("GPTNeoXForCausalLM"), "{err}");
    }

    #[test]
    fn refuses_kv_heads_that_do_not_divide() {
        let mut v = llama_json();
        v["num_key_value_heads"] = serde_json::json!(4);
        let err = serde_json::from_value::<HfConfig>(v)
            .unwrap()
            .resolve()
            .unwrap_err();
        assert!(err.to_string().contains("num_key_value_heads"), "{err}");
    }

    /// Hand-worked llama3 scaling (HF reference arithmetic): with factor 8, low 1, high 4 and an
    /// 8192 original context, wavelengths above 8192 are divided by 8, below 2048 kept.
    #[test]
    fn llama3_rope_scaling_matches_hand_worked_cases() {
        let mut v = llama_json();
        v["rope_theta"] = serde_json::json!(500000.0);
        v["hidden_size"] = serde_json::json!(4096);
        v["num_attention_heads"] = serde_json::json!(32);
        v["num_key_value_heads"] = serde_json::json!(8);
        v["rope_scaling"] = serde_json::json!({"rope_type": "llama3", "factor": 8.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192});
        let spec = serde_json::from_value::<HfConfig>(v)
            .unwrap()
            .resolve()
            .unwrap();
        let scaled = spec.rope_inv_freq();
        let plain: Vec<f64> = (0..64)
            .map(|i| 1.0 / 500000f64.powf((2 * i) as f64 / 128.0))
            .collect();
        // i = 0: wavelength 2*pi < 2048 -> unchanged.
        assert_eq!(scaled[0], plain[0]);
        // i = 63: wavelength ~ 2*pi*500000^(126/128) >> 8192 -> divided by 8.
        assert!((scaled[63] - plain[63] / 8.0).abs() < 1e-18);
        // Somewhere in between the smooth interpolation lies strictly between the two.
        let mid = (0..64)
            .find(|&i| {
                let w = 2.0 * std::f64::consts::PI / plain[i];
                w > 2048.0 && w < 8192.0
            })
            .unwrap();
        assert!(scaled[mid] < plain[mid] && scaled[mid] > plain[mid] / 8.0);
    }

    fn deepseek_json() -> serde_json::Value {
        serde_json::json!({
            "architectures": ["DeepseekV3ForCausalLM"], "model_type": "kimi_k2",
            "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 3,
            "num_attention_heads": 4, "num_key_value_heads": 4, "rms_norm_eps": 1e-6,
            "vocab_size": 100, "q_lora_rank": null, "kv_lora_rank": 16,
            "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 6,
            "first_k_dense_replace": 1, "n_routed_experts": 8, "n_group": 1, "topk_group": 1,
            "num_experts_per_tok": 2, "moe_intermediate_size": 16
        })
    }

    fn resolve(v: serde_json::Value) -> Result<ModelSpec, ModelError> {
        serde_json::from_value::<HfConfig>(v).unwrap().resolve()
    }

    #[test]
    fn deepseek_resolves_with_hf_defaults_and_explicit_null_q_lora() {
        let spec = resolve(deepseek_json()).unwrap();
        assert_eq!(spec.family, Family::DeepseekV3);
        // HF sets head_dim to the rope width.
        assert_eq!(spec.head_dim, 4);
        assert_eq!(spec.cache_widths(), (12, 6));
        let mla = spec.mla.as_ref().unwrap();
        assert_eq!(mla.q_lora_rank, None);
        assert!(mla.rope_interleave, "HF's default when the key is absent");
        assert!((mla.softmax_scale - 12f64.powf(-0.5)).abs() < 1e-15);
        let moe = spec.moe.as_ref().unwrap();
        assert!(!moe.is_moe_layer(0) && moe.is_moe_layer(2));
        assert!(moe.norm_topk_prob && moe.routed_scaling_factor == 2.5);
        // An absent q_lora_rank is HF's default 1536, not "no LoRA".
        let mut v = deepseek_json();
        v.as_object_mut().unwrap().remove("q_lora_rank");
        assert_eq!(resolve(v).unwrap().mla.unwrap().q_lora_rank, Some(1536));
        // The Llama family is untouched.
        let llama = resolve(llama_json()).unwrap();
        assert!(llama.mla.is_none() && llama.moe.is_none() && !llama.is_moe());
    }

    #[test]
    fn deepseek_refuses_routing_it_does_not_implement_by_field() {
        for (field, value, expect) in [
            ("n_group", serde_json::json!(3), "n_group"),
            ("topk_group", serde_json::json!(2), "topk_group"),
            (
                "num_experts_per_tok",
                serde_json::json!(9),
                "num_experts_per_tok",
            ),
            ("scoring_func", serde_json::json!("softmax"), "sigmoid"),
            ("topk_method", serde_json::json!("greedy"), "noaux_tc"),
            (
                "num_key_value_heads",
                serde_json::json!(2),
                "num_key_value_heads",
            ),
            ("qk_rope_head_dim", serde_json::json!(3), "qk_rope_head_dim"),
        ] {
            let mut v = deepseek_json();
            v[field] = value;
            let err = resolve(v).unwrap_err().to_string();
            assert!(err.contains(expect), "{field}: {err}");
        }
    }

    /// Hand-worked yarn (HF `_compute_yarn_parameters`): rope width 4, theta 500, factor 4,
    /// original context 64: the correction range is [0, 1] after truncation, so frequency 0 is
    /// kept and frequency 1 divided by the factor; mscale 1/1 leaves cos/sin unscaled while the
    /// softmax scale gains (0.1 ln 4 + 1)^2.
    #[test]
    fn yarn_matches_hand_worked_frequencies_and_scales() {
        let mut v = deepseek_json();
        v["rope_theta"] = serde_json::json!(500.0);
        v["rope_scaling"] = serde_json::json!({"type": "yarn", "factor": 4.0,
            "original_max_position_embeddings": 64, "mscale": 1.0, "mscale_all_dim": 1.0});
        let spec = resolve(v).unwrap();
        let inv = spec.rope_inv_freq();
        assert_eq!(inv[0], 1.0);
        assert!((inv[1] - 500f64.powf(-0.5) / 4.0).abs() < 1e-15);
        assert_eq!(spec.rope_attention_factor(), 1.0);
        let mscale = 0.1 * 4f64.ln() + 1.0;
        let expected = 12f64.powf(-0.5) * mscale * mscale;
        assert!((spec.mla.unwrap().softmax_scale - expected).abs() < 1e-15);
        // yarn stays refused for the Llama family, whose attention does not apply it.
        let mut v = llama_json();
        v["rope_scaling"] = serde_json::json!({"type": "yarn", "factor": 4.0,
            "original_max_position_embeddings": 64});
        assert!(resolve(v).unwrap_err().to_string().contains("yarn"));
    }
}
