//! The draft head's `config.json`, mirrored field for field as SGLang, vLLM and SpecForge read
//! and write it, and the resolved runtime description ([`DraftSpec`]) the head is built from.

use std::path::Path;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use tandem_model::config::{HfConfig, RopeScaling};
use tandem_wiring::WiringManifest;

use crate::error::EagleError;

/// `architectures[0]` of every EAGLE-3 Llama draft (SGLang `LlamaForCausalLMEagle3`, vLLM
/// `Eagle3LlamaForCausalLM` registered under the same name, SpecForge's class name).
pub const ARCHITECTURE: &str = "LlamaForCausalLMEagle3";

/// Other spellings accepted on load.
const ARCHITECTURE_ALIASES: [&str; 2] = [ARCHITECTURE, "Eagle3LlamaForCausalLM"];

/// The key under which Tandem stores the canonical wiring manifest in `config.json`.
pub const WIRING_KEY: &str = "tandem_wiring";

/// The key that marks a `speculators`-format config (`"eagle3"` for EAGLE-3 heads).
pub const SPECULATORS_TYPE_KEY: &str = "speculators_model_type";

/// The keys of a speculators config that describe the draft's decoder layer
/// (`transformer_layer_config`); every other key stays at the top level.
const LAYER_KEYS: [&str; 15] = [
    "model_type",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_act",
    "vocab_size",
    "rms_norm_eps",
    "rope_theta",
    "rope_scaling",
    "max_position_embeddings",
    "tie_word_embeddings",
    "attention_bias",
];

/// The verifier (target) a speculators export names in `speculators_config.verifier`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verifier {
    /// HF id or path of the target (`HuggingFaceTB/SmolLM2-135M-Instruct`).
    pub name_or_path: String,
    /// The target's `architectures[0]` (`LlamaForCausalLM`).
    pub architecture: String,
    /// Draft tokens proposed per round (`proposal_methods[0].speculative_tokens`), which vLLM
    /// uses as its default `num_speculative_tokens`.
    pub speculative_tokens: usize,
}

/// `eagle_config` in a draft's config.json: where SGLang and vLLM read the aux tap ids.
///
/// SGLang reads the ids in its own convention (see `tandem_wiring::Convention`); a head with no
/// ids here is served on the engine's default taps, silently.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EagleConfig {
    /// Aux tap ids in SGLang's convention, slot order = order of the `fc` input.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eagle_aux_hidden_state_layer_ids: Option<Vec<i64>>,
    /// Always `true` for EAGLE-3 (the head consumes aux hidden states).
    #[serde(default = "default_true")]
    pub use_aux_hidden_state: bool,
    /// Keys this build does not interpret, kept on a round trip.
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

fn default_true() -> bool {
    true
}

/// config.json of an EAGLE-3 draft head. Field names are HF's own so the file deserialises
/// directly; unknown keys are kept in `extra` and written back.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Eagle3Config {
    /// `["LlamaForCausalLMEagle3"]`.
    pub architectures: Vec<String>,
    /// `llama`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model_type: Option<String>,
    /// Width of the draft layer, H (= the target's hidden size: the token embedding is the
    /// target's and is concatenated with the hidden input).
    pub hidden_size: usize,
    /// Width of the SwiGLU MLP.
    pub intermediate_size: usize,
    /// Always 1 for EAGLE-3.
    #[serde(default = "one")]
    pub num_hidden_layers: usize,
    /// Query heads.
    pub num_attention_heads: usize,
    /// KV heads (grouped-query attention); defaults to `num_attention_heads`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub num_key_value_heads: Option<usize>,
    /// Head width; defaults to `hidden_size / num_attention_heads`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub head_dim: Option<usize>,
    /// `silu` (SwiGLU).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hidden_act: Option<String>,
    /// The target's vocabulary size (length of `t2d`).
    pub vocab_size: usize,
    /// Rows of `lm_head` (length of `d2t`); defaults to `vocab_size`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub draft_vocab_size: Option<usize>,
    /// RMSNorm epsilon of every norm of the head.
    pub rms_norm_eps: f64,
    /// RoPE base.
    #[serde(default = "default_rope_theta")]
    pub rope_theta: f64,
    /// RoPE scaling as HF writes it (`null` = plain RoPE).
    #[serde(default)]
    pub rope_scaling: Option<RopeScaling>,
    /// Longest position the head is meant for.
    #[serde(default = "default_max_position_embeddings")]
    pub max_position_embeddings: usize,
    /// Always `false`: `lm_head` is the draft's own (over the draft vocabulary).
    #[serde(default)]
    pub tie_word_embeddings: bool,
    /// Width T of one target tap, when it differs from `hidden_size`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target_hidden_size: Option<usize>,
    /// Aux tap ids for the engines.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eagle_config: Option<EagleConfig>,
    /// Dtype of the saved weights (`float32`, `bfloat16`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub torch_dtype: Option<String>,
    /// Tandem's canonical wiring manifest (job `train`): the taps the head was trained on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tandem_wiring: Option<WiringManifest>,
    /// Keys this build does not interpret (`bos_token_id`, ...), kept on a round trip.
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

fn one() -> usize {
    1
}
fn default_rope_theta() -> f64 {
    10_000.0
}
fn default_max_position_embeddings() -> usize {
    2048
}

/// Resolved runtime description of a draft head (defaults applied, sizes derived).
#[derive(Debug, Clone, PartialEq)]
pub struct DraftSpec {
    /// H: width of the layer, of the embedding and of the hidden input/output.
    pub hidden_size: usize,
    /// SwiGLU width.
    pub intermediate_size: usize,
    /// Query heads.
    pub num_heads: usize,
    /// KV heads.
    pub num_kv_heads: usize,
    /// Head width.
    pub head_dim: usize,
    /// Target vocabulary (rows of the embedding, length of `t2d`).
    pub vocab_size: usize,
    /// Draft vocabulary (rows of `lm_head`, length of `d2t`).
    pub draft_vocab_size: usize,
    /// T: width of one target tap.
    pub target_hidden_size: usize,
    /// Number of taps concatenated at the `fc` input (3 for EAGLE-3).
    pub num_taps: usize,
    /// RMSNorm epsilon.
    pub rms_norm_eps: f64,
    /// RoPE inverse frequencies, `[head_dim / 2]` (scaling applied).
    pub inv_freq: Vec<f64>,
}

impl DraftSpec {
    /// Input width of `fc`: `num_taps * target_hidden_size`.
    pub fn fc_in(&self) -> usize {
        self.num_taps * self.target_hidden_size
    }
    /// Query heads per KV head.
    pub fn groups(&self) -> usize {
        self.num_heads / self.num_kv_heads
    }
}

impl Eagle3Config {
    /// Reads a draft `config.json`: SGLang / vLLM / SpecForge / EAGLE / Tandem layout, or the
    /// `speculators` format ([`Eagle3Config::from_speculators`]).
    pub fn load(path: &Path) -> Result<Self, EagleError> {
        let bytes = std::fs::read(path).map_err(|source| EagleError::Io {
            action: "read",
            path: path.to_owned(),
            source,
        })?;
        let json_err = |source| EagleError::Json {
            path: path.to_owned(),
            source,
        };
        let value: Value = serde_json::from_slice(&bytes).map_err(json_err)?;
        if value.get(SPECULATORS_TYPE_KEY).is_some() {
            return Self::from_speculators(&value);
        }
        serde_json::from_value(value).map_err(json_err)
    }

    /// Reads a `speculators`-format EAGLE-3 config the way vLLM does
    /// (`vllm/transformers_utils/configs/speculators/base.py` and `algos.py`, `update_eagle3`):
    /// `transformer_layer_config` is the layer, `draft_vocab_size`, `target_hidden_size` and
    /// the top-level `eagle_aux_hidden_state_layer_ids` (vLLM's convention) come from the top
    /// level. `norm_before_residual` (vLLM's default when absent: true) must be false: this
    /// head, like SGLang's and SpecForge's, keeps the residual before `hidden_norm`.
    pub fn from_speculators(value: &Value) -> Result<Self, EagleError> {
        let kind = value.get(SPECULATORS_TYPE_KEY).and_then(Value::as_str);
        if kind != Some("eagle3") {
            return Err(EagleError::Config {
                field: "speculators_model_type",
                reason: format!("is {kind:?}; only \"eagle3\" speculators are EAGLE-3 heads"),
            });
        }
        let norm_first = value
            .get("norm_before_residual")
            .and_then(Value::as_bool)
            .unwrap_or(true);
        if norm_first {
            return Err(EagleError::Config {
                field: "norm_before_residual",
                reason: "is true (or absent, which vLLM reads as true): that head normalises \
                         the hidden input before its residual branch, a different layer than \
                         the EAGLE-3 head this build runs (residual before hidden_norm)"
                    .to_owned(),
            });
        }
        let mut flat = match value.get("transformer_layer_config") {
            Some(Value::Object(layer)) => layer.clone(),
            _ => {
                return Err(EagleError::Config {
                    field: "transformer_layer_config",
                    reason: "is missing or not an object in a speculators config".to_owned(),
                });
            }
        };
        flat.insert("architectures".to_owned(), Value::from(vec![ARCHITECTURE]));
        for key in [
            "draft_vocab_size",
            "target_hidden_size",
            tandem_wiring::AUX_IDS_KEY,
            WIRING_KEY,
            "torch_dtype",
        ] {
            if let Some(v) = value.get(key) {
                flat.insert(key.to_owned(), v.clone());
            }
        }
        serde_json::from_value(Value::Object(flat)).map_err(|source| EagleError::Config {
            field: "transformer_layer_config",
            reason: format!("does not describe a draft layer: {source}"),
        })
    }

    /// This config in the `speculators` format that vLLM loads natively: the layer under
    /// `transformer_layer_config`, `speculators_model_type: eagle3`, `norm_before_residual:
    /// false`, the aux ids at the top level in vLLM's convention (the only place vLLM reads
    /// them), `speculators_config` naming the verifier, and the Tandem manifest kept.
    pub fn to_speculators(&self, verifier: &Verifier) -> Result<Value, EagleError> {
        let ser = |source| EagleError::Config {
            field: "config",
            reason: format!("cannot be serialised: {source}"),
        };
        let Value::Object(all) = serde_json::to_value(self).map_err(ser)? else {
            unreachable!("a struct serialises to an object")
        };
        if all.get(tandem_wiring::AUX_IDS_KEY).is_none() {
            return Err(EagleError::Config {
                field: tandem_wiring::AUX_IDS_KEY,
                reason: "is missing at the top level: vLLM would serve the head on its default \
                         taps; export it with Tandem's trainer (or add the vLLM ids) first"
                    .to_owned(),
            });
        }
        let mut layer = Map::new();
        let mut top = Map::new();
        for (key, value) in all {
            if LAYER_KEYS.contains(&key.as_str()) {
                layer.insert(key, value);
            } else if !matches!(key.as_str(), "architectures" | "eagle_config") {
                top.insert(key, value);
            }
        }
        layer.insert(
            "architectures".to_owned(),
            Value::from(vec![verifier.architecture.clone()]),
        );
        top.insert(
            "architectures".to_owned(),
            Value::from(vec!["Eagle3Speculator"]),
        );
        top.insert(SPECULATORS_TYPE_KEY.to_owned(), Value::from("eagle3"));
        top.insert("norm_before_residual".to_owned(), Value::from(false));
        top.insert("transformer_layer_config".to_owned(), Value::Object(layer));
        top.insert(
            "speculators_config".to_owned(),
            serde_json::json!({
                "algorithm": "eagle3",
                "proposal_methods": [{
                    "proposal_type": "greedy",
                    "speculative_tokens": verifier.speculative_tokens,
                }],
                "default_proposal_method": "greedy",
                "verifier": {
                    "name_or_path": verifier.name_or_path,
                    "architectures": [verifier.architecture],
                },
            }),
        );
        Ok(Value::Object(top))
    }

    /// Writes pretty JSON (trailing newline).
    pub fn save(&self, path: &Path) -> Result<(), EagleError> {
        let mut json = serde_json::to_string_pretty(self).map_err(|source| EagleError::Json {
            path: path.to_owned(),
            source,
        })?;
        json.push('\n');
        std::fs::write(path, json).map_err(|source| EagleError::Io {
            action: "write",
            path: path.to_owned(),
            source,
        })
    }

    /// A config for a head on top of a Llama-family target: the layer copies the target's
    /// widths, heads and RoPE (what SpecForge's shipped draft configs do), `num_taps` taps of
    /// width `target.hidden_size` feed `fc`.
    pub fn for_target(target: &HfConfig, draft_vocab_size: usize, num_taps: usize) -> Self {
        let mut extra = Map::new();
        for (key, value) in [
            ("bos_token_id", &target.bos_token_id),
            ("eos_token_id", &target.eos_token_id),
        ] {
            if let Some(v) = value {
                extra.insert(key.to_owned(), v.clone());
            }
        }
        Eagle3Config {
            architectures: vec![ARCHITECTURE.to_owned()],
            model_type: Some("llama".to_owned()),
            hidden_size: target.hidden_size,
            intermediate_size: target.intermediate_size,
            num_hidden_layers: 1,
            num_attention_heads: target.num_attention_heads,
            num_key_value_heads: target.num_key_value_heads,
            head_dim: target.head_dim,
            hidden_act: Some("silu".to_owned()),
            vocab_size: target.vocab_size,
            draft_vocab_size: Some(draft_vocab_size),
            rms_norm_eps: target.rms_norm_eps,
            rope_theta: target.rope_theta,
            rope_scaling: target.rope_scaling.clone(),
            max_position_embeddings: target.max_position_embeddings,
            tie_word_embeddings: false,
            target_hidden_size: Some(target.hidden_size),
            eagle_config: Some(EagleConfig {
                eagle_aux_hidden_state_layer_ids: None,
                use_aux_hidden_state: true,
                extra: Map::new(),
            }),
            torch_dtype: Some("float32".to_owned()),
            tandem_wiring: None,
            extra: {
                let mut e = extra;
                if num_taps != 3 {
                    // Not an HF field: only written when it differs from EAGLE-3's 3 taps.
                    e.insert("num_aux_taps".to_owned(), Value::from(num_taps));
                }
                e
            },
        }
    }

    /// Number of taps at the `fc` input: the Tandem manifest's taps, else the length of
    /// `eagle_aux_hidden_state_layer_ids`, else Tandem's `num_aux_taps`, else 3.
    pub fn num_taps(&self) -> usize {
        if let Some(m) = &self.tandem_wiring {
            return m.taps.len();
        }
        if let Some(ids) = self
            .eagle_config
            .as_ref()
            .and_then(|e| e.eagle_aux_hidden_state_layer_ids.as_ref())
        {
            return ids.len();
        }
        self.extra
            .get("num_aux_taps")
            .and_then(Value::as_u64)
            .map(|n| n as usize)
            .unwrap_or(3)
    }

    /// The Llama view of the single layer, used to validate heads and compute RoPE exactly as
    /// the target does.
    fn llama_view(&self) -> HfConfig {
        HfConfig {
            architectures: vec!["LlamaForCausalLM".to_owned()],
            model_type: Some("llama".to_owned()),
            hidden_size: self.hidden_size,
            intermediate_size: self.intermediate_size,
            num_hidden_layers: 1,
            num_attention_heads: self.num_attention_heads,
            num_key_value_heads: self.num_key_value_heads,
            head_dim: self.head_dim,
            rms_norm_eps: self.rms_norm_eps,
            rope_theta: self.rope_theta,
            rope_scaling: self.rope_scaling.clone(),
            max_position_embeddings: self.max_position_embeddings,
            vocab_size: self.vocab_size,
            tie_word_embeddings: false,
            attention_bias: false,
            mlp_bias: false,
            hidden_act: self.hidden_act.clone(),
            sliding_window: None,
            bos_token_id: None,
            eos_token_id: None,
            deepseek: Default::default(),
        }
    }

    /// The embedded manifest must be valid, describe a target of `target_hidden_size`, and
    /// name the same taps as `eagle_aux_hidden_state_layer_ids` read the way SGLang reads them
    /// (ids edited by hand after training are how a head ends up served on other taps).
    fn check_wiring(&self, m: &WiringManifest) -> Result<(), EagleError> {
        m.validate().map_err(|e| EagleError::Config {
            field: "tandem_wiring",
            reason: e.to_string(),
        })?;
        if let Some(t) = self.target_hidden_size
            && m.target.hidden_size != t
        {
            return Err(EagleError::Config {
                field: "target_hidden_size",
                reason: format!(
                    "is {t} but the wiring manifest's target has hidden size {}",
                    m.target.hidden_size
                ),
            });
        }
        if let Some(ids) = self
            .eagle_config
            .as_ref()
            .and_then(|e| e.eagle_aux_hidden_state_layer_ids.as_ref())
        {
            // As SGLang's model code for the target's family reads them.
            let convention = tandem_wiring::sglang_convention(&m.target.architecture);
            let read = convention.to_canonical(ids, m.target.num_layers);
            if read.as_ref().ok() != Some(&m.taps) {
                let read = match read {
                    Ok(taps) => tandem_wiring::format_taps(&taps),
                    Err(e) => format!("nothing valid ({e})"),
                };
                return Err(EagleError::Config {
                    field: "eagle_config.eagle_aux_hidden_state_layer_ids",
                    reason: format!(
                        "is {ids:?}, which SGLang reads as {read}, but the head was trained on \
                         {} (tandem_wiring)",
                        tandem_wiring::format_taps(&m.taps)
                    ),
                });
            }
        }
        // vLLM reads only the top-level key, in its own convention.
        if let Some(value) = self.extra.get(tandem_wiring::AUX_IDS_KEY) {
            let ids: Option<Vec<i64>> = value
                .as_array()
                .and_then(|a| a.iter().map(serde_json::Value::as_i64).collect());
            let read = ids
                .as_ref()
                .map(|ids| tandem_wiring::Convention::Vllm.to_canonical(ids, m.target.num_layers));
            if !matches!(&read, Some(Ok(taps)) if *taps == m.taps) {
                let read = match read {
                    Some(Ok(taps)) => tandem_wiring::format_taps(&taps),
                    Some(Err(e)) => format!("nothing valid ({e})"),
                    None => "nothing (not a list of integers)".to_owned(),
                };
                return Err(EagleError::Config {
                    field: "eagle_aux_hidden_state_layer_ids",
                    reason: format!(
                        "(top level) is {value}, which vLLM reads as {read}, but the head was \
                         trained on {} (tandem_wiring)",
                        tandem_wiring::format_taps(&m.taps)
                    ),
                });
            }
        }
        Ok(())
    }

    /// Validates the config and derives the runtime spec.
    pub fn resolve(&self) -> Result<DraftSpec, EagleError> {
        let arch = self
            .architectures
            .first()
            .ok_or_else(|| EagleError::Config {
                field: "architectures",
                reason: "is empty; cannot tell this is an EAGLE-3 head".to_owned(),
            })?;
        if !ARCHITECTURE_ALIASES.contains(&arch.as_str()) {
            return Err(EagleError::UnsupportedArchitecture {
                architecture: arch.clone(),
            });
        }
        if self.num_hidden_layers != 1 {
            return Err(EagleError::Config {
                field: "num_hidden_layers",
                reason: format!(
                    "is {}; an EAGLE-3 head has exactly one decoder layer (`midlayer`)",
                    self.num_hidden_layers
                ),
            });
        }
        if self.tie_word_embeddings {
            return Err(EagleError::Config {
                field: "tie_word_embeddings",
                reason: "is true; an EAGLE-3 head has its own lm_head over the draft vocabulary"
                    .to_owned(),
            });
        }
        let draft_vocab_size = self.draft_vocab_size.unwrap_or(self.vocab_size);
        if draft_vocab_size == 0 || draft_vocab_size > self.vocab_size {
            return Err(EagleError::Config {
                field: "draft_vocab_size",
                reason: format!(
                    "is {draft_vocab_size}; it must be in 1..={} (vocab_size)",
                    self.vocab_size
                ),
            });
        }
        let num_taps = self.num_taps();
        if num_taps == 0 {
            return Err(EagleError::Config {
                field: "eagle_config.eagle_aux_hidden_state_layer_ids",
                reason: "is empty; the head needs at least one tap".to_owned(),
            });
        }
        let llama = self.llama_view().resolve()?;
        if let Some(m) = &self.tandem_wiring {
            self.check_wiring(m)?;
        }
        Ok(DraftSpec {
            hidden_size: llama.hidden_size,
            intermediate_size: llama.intermediate_size,
            num_heads: llama.num_heads,
            num_kv_heads: llama.num_kv_heads,
            head_dim: llama.head_dim,
            vocab_size: self.vocab_size,
            draft_vocab_size,
            target_hidden_size: self.target_hidden_size.unwrap_or(self.hidden_size),
            num_taps,
            rms_norm_eps: self.rms_norm_eps,
            inv_freq: llama.rope_inv_freq(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A config as SpecForge ships for Llama-3.1-8B (fields and values from its
    /// `configs/llama3-8B-eagle3.json`), plus eagle_config.
    fn specforge_json() -> Value {
        serde_json::json!({
            "architectures": ["LlamaForCausalLMEagle3"], "attention_bias": false,
            "attention_dropout": 0.0, "bos_token_id": 128000, "eos_token_id": 128001,
            "head_dim": 128, "hidden_act": "silu", "hidden_size": 4096,
            "initializer_range": 0.02, "intermediate_size": 14336,
            "max_position_embeddings": 2048, "model_type": "llama", "num_attention_heads": 32,
            "num_key_value_heads": 8, "num_hidden_layers": 1, "pad_token_id": 0,
            "rms_norm_eps": 1e-05, "rope_scaling": null, "rope_theta": 500000.0,
            "tie_word_embeddings": false, "torch_dtype": "float16",
            "transformers_version": "4.28.1", "use_cache": true, "vocab_size": 128256,
            "draft_vocab_size": 32000,
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 15, 28],
                             "use_aux_hidden_state": true}
        })
    }

    #[test]
    fn reads_a_specforge_config_and_keeps_unknown_keys() {
        let cfg: Eagle3Config = serde_json::from_value(specforge_json()).unwrap();
        let spec = cfg.resolve().unwrap();
        assert_eq!(spec.fc_in(), 3 * 4096);
        assert_eq!(
            (spec.num_heads, spec.num_kv_heads, spec.head_dim),
            (32, 8, 128)
        );
        assert_eq!(spec.draft_vocab_size, 32000);
        let back = serde_json::to_value(&cfg).unwrap();
        assert_eq!(back["pad_token_id"], 0);
        assert_eq!(back["transformers_version"], "4.28.1");
        assert_eq!(
            back["eagle_config"]["eagle_aux_hidden_state_layer_ids"],
            serde_json::json!([1, 15, 28])
        );
    }

    #[test]
    fn refuses_other_architectures_and_layer_counts() {
        let mut v = specforge_json();
        v["architectures"] = serde_json::json!(["LlamaForCausalLM"]);
        let err = serde_json::from_value::<Eagle3Config>(v)
            .unwrap()
            .resolve()
            .unwrap_err();
        assert!(err.to_string().contains("LlamaForCausalLM\""), "{err}");
        let mut v = specforge_json();
        v["num_hidden_layers"] = serde_json::json!(2);
        let err = serde_json::from_value::<Eagle3Config>(v)
            .unwrap()
            .resolve()
            .unwrap_err();
        assert!(err.to_string().contains("num_hidden_layers"), "{err}");
    }

    /// A head whose `eagle_config` ids were edited after training no longer names the taps in
    /// its manifest: refused with both readings in the sentence.
    #[test]
    fn edited_layer_ids_disagreeing_with_the_manifest_are_refused() {
        use tandem_wiring::{Job, Producer, TapId, TapPoint, TargetFingerprint};
        let target = TargetFingerprint {
            architecture: "LlamaForCausalLM".into(),
            model_type: "llama".into(),
            num_layers: 32,
            hidden_size: 4096,
            vocab_size: 128256,
            config_sha256: "a".repeat(64),
            tokenizer_sha256: "b".repeat(64),
            chat_template_sha256: None,
        };
        let manifest = WiringManifest::new(
            target,
            vec![TapId::Block(1), TapId::Block(15), TapId::Block(28)],
            TapPoint::ResidualStream,
            "bf16",
            Producer::tandem(Job::Train, "cpu", "train"),
        );
        let mut cfg: Eagle3Config = serde_json::from_value(specforge_json()).unwrap();
        cfg.tandem_wiring = Some(manifest);
        cfg.target_hidden_size = Some(4096);
        assert!(
            cfg.resolve().is_ok(),
            "ids [1, 15, 28] are blocks 1, 15, 28 in SGLang"
        );
        cfg.eagle_config
            .as_mut()
            .unwrap()
            .eagle_aux_hidden_state_layer_ids = Some(vec![1, 16, 29]);
        let err = cfg.resolve().unwrap_err().to_string();
        assert!(
            err.contains("SGLang reads as [block 1, block 16, block 29]")
                && err.contains("trained on [block 1, block 15, block 28]"),
            "{err}"
        );
        // vLLM's top-level ids are checked in vLLM's convention: [2, 16, 29] is right,
        // [1, 15, 28] (SGLang's ids copied to the top level) is one block early.
        cfg.eagle_config
            .as_mut()
            .unwrap()
            .eagle_aux_hidden_state_layer_ids = Some(vec![1, 15, 28]);
        cfg.extra.insert(
            tandem_wiring::AUX_IDS_KEY.to_owned(),
            serde_json::json!([2, 16, 29]),
        );
        assert!(cfg.resolve().is_ok());
        cfg.extra.insert(
            tandem_wiring::AUX_IDS_KEY.to_owned(),
            serde_json::json!([1, 15, 28]),
        );
        let err = cfg.resolve().unwrap_err().to_string();
        assert!(
            err.contains("vLLM reads as [block 0, block 14, block 27]"),
            "{err}"
        );
    }

    #[test]
    fn draft_vocab_defaults_to_the_target_vocab() {
        let mut v = specforge_json();
        v.as_object_mut().unwrap().remove("draft_vocab_size");
        let spec = serde_json::from_value::<Eagle3Config>(v)
            .unwrap()
            .resolve()
            .unwrap();
        assert_eq!(spec.draft_vocab_size, 128256);
    }
}
