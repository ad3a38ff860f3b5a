//! HF `config.json` for the Llama family, mirrored field for field, and the resolved
//! runtime spec the model is built from.

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::error::ModelError;

/// `rope_scaling` as HF writes it. Only the llama3 scheme changes the frequencies here;
/// `default` / absent means plain RoPE.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RopeScaling {
    #[serde(alias = "type")]
    pub rope_type: String,
    #[serde(default)]
    pub factor: Option<f64>,
    #[serde(default)]
    pub low_freq_factor: Option<f64>,
    #[serde(default)]
    pub high_freq_factor: Option<f64>,
    #[serde(default)]
    pub original_max_position_embeddings: Option<usize>,
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
}

impl Family {
    pub fn from_architecture(name: &str) -> Result<Self, ModelError> {
        match name {
            "LlamaForCausalLM" => Ok(Self::Llama),
            "MistralForCausalLM" => Ok(Self::Mistral),
            "Qwen2ForCausalLM" => Ok(Self::Qwen2),
            "Qwen3ForCausalLM" => Ok(Self::Qwen3),
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
        let head_dim = self
            .head_dim
            .unwrap_or(self.hidden_size / self.num_attention_heads);
        if !head_dim.is_multiple_of(2) {
            return Err(ModelError::InvalidConfig {
                field: "head_dim",
                reason: format!("{head_dim} is odd; RoPE needs an even head dimension"),
            });
        }
        if let Some(scaling) = &self.rope_scaling
            && !matches!(scaling.rope_type.as_str(), "default" | "llama3")
        {
            return Err(ModelError::InvalidConfig {
                field: "rope_scaling",
                reason: format!(
                    "type {:?} is not supported (default, llama3)",
                    scaling.rope_type
                ),
            });
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
}
