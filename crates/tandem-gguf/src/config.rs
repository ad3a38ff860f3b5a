//! Model hyperparameters read from GGUF metadata, and the Hugging Face `config.json` built
//! from them.

use serde_json::{Value, json};

use crate::{GgufError, GgufFile};

/// A model family the importer can convert.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Architecture {
    Llama,
    Qwen2,
}

impl Architecture {
    /// The architecture named by `general.architecture`, or an error naming it.
    pub fn from_gguf_name(name: &str) -> Result<Self, GgufError> {
        match name {
            "llama" => Ok(Self::Llama),
            "qwen2" => Ok(Self::Qwen2),
            other => Err(GgufError::UnsupportedArchitecture {
                architecture: other.to_owned(),
            }),
        }
    }

    /// The GGUF name, which is also the prefix of its metadata keys (`llama.block_count`).
    pub fn gguf_name(self) -> &'static str {
        match self {
            Self::Llama => "llama",
            Self::Qwen2 => "qwen2",
        }
    }

    /// llama.cpp's converter permutes q/k rows for Llama (see [`crate::rope`]) but stores Qwen2
    /// in Hugging Face order, since llama.cpp runs Qwen2 with NeoX-style rotation.
    pub fn has_permuted_rope_rows(self) -> bool {
        matches!(self, Self::Llama)
    }

    /// Qwen2 always has q/k/v biases; Llama never does in models this importer accepts.
    pub fn has_qkv_bias(self) -> bool {
        matches!(self, Self::Qwen2)
    }
}

/// Token ids from `tokenizer.ggml.*_token_id`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SpecialTokenIds {
    pub bos: Option<u32>,
    pub eos: Option<u32>,
    pub pad: Option<u32>,
    pub unk: Option<u32>,
    /// End-of-turn token, when it differs from `eos` a second stop token for generation.
    pub eot: Option<u32>,
}

impl SpecialTokenIds {
    fn read(file: &GgufFile) -> Result<Self, GgufError> {
        let id = |key: &str| -> Result<Option<u32>, GgufError> {
            file.metadata()
                .get_u64(key)?
                .map(|id| {
                    u32::try_from(id).map_err(|_| GgufError::InvalidMetadata {
                        key: key.to_owned(),
                        problem: format!("token id {id} does not fit in u32"),
                    })
                })
                .transpose()
        };
        Ok(Self {
            bos: id("tokenizer.ggml.bos_token_id")?,
            eos: id("tokenizer.ggml.eos_token_id")?,
            pad: id("tokenizer.ggml.padding_token_id")?,
            unk: id("tokenizer.ggml.unknown_token_id")?,
            eot: id("tokenizer.ggml.eot_token_id")?,
        })
    }
}

/// Everything `config.json` needs, in Hugging Face terms.
#[derive(Clone, Debug, PartialEq)]
pub struct Hyperparameters {
    pub architecture: Architecture,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    /// GGUF stores an f32; this is that value widened exactly (e.g. 9.999999747378752e-06).
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    /// Hugging Face `rope_scaling` object, or `None` for plain RoPE.
    pub rope_scaling: Option<Value>,
    /// `{arch}.context_length`.
    pub max_position_embeddings: usize,
    /// Rows of `token_embd.weight`.
    pub vocab_size: usize,
    /// True when the file has no `output.weight`: the LM head reuses the embedding.
    pub tie_word_embeddings: bool,
    pub special_tokens: SpecialTokenIds,
}

impl Hyperparameters {
    /// Reads and cross-checks the hyperparameters of `file`.
    pub fn read(file: &GgufFile) -> Result<Self, GgufError> {
        let architecture = Architecture::from_gguf_name(file.architecture()?)?;
        let metadata = file.metadata();
        let key = |suffix: &str| format!("{}.{suffix}", architecture.gguf_name());

        let hidden_size = metadata.require_usize(&key("embedding_length"))?;
        let num_attention_heads = metadata.require_usize(&key("attention.head_count"))?;
        let num_key_value_heads = metadata
            .get_usize(&key("attention.head_count_kv"))?
            .unwrap_or(num_attention_heads);
        if num_attention_heads == 0
            || num_key_value_heads == 0
            || !num_attention_heads.is_multiple_of(num_key_value_heads)
        {
            return Err(GgufError::InvalidMetadata {
                key: key("attention.head_count_kv"),
                problem: format!(
                    "{num_key_value_heads} key/value heads do not divide {num_attention_heads} attention heads"
                ),
            });
        }
        let head_dim = match metadata.get_usize(&key("attention.key_length"))? {
            Some(head_dim) => head_dim,
            None if hidden_size.is_multiple_of(num_attention_heads) => {
                hidden_size / num_attention_heads
            }
            None => {
                return Err(GgufError::InvalidMetadata {
                    key: key("attention.head_count"),
                    problem: format!(
                        "{num_attention_heads} heads do not divide hidden size {hidden_size}"
                    ),
                });
            }
        };
        if let Some(value_length) = metadata.get_usize(&key("attention.value_length"))?
            && value_length != head_dim
        {
            return Err(GgufError::UnsupportedModel(format!(
                "value head size {value_length} differs from key head size {head_dim}"
            )));
        }
        if let Some(rope_dims) = metadata.get_usize(&key("rope.dimension_count"))?
            && rope_dims != head_dim
        {
            return Err(GgufError::UnsupportedModel(format!(
                "partial rotary embeddings ({rope_dims} of {head_dim} head dimensions) are not supported"
            )));
        }
        if file.tensor("rope_freqs.weight").is_some() {
            return Err(GgufError::UnsupportedModel(
                "rope_freqs.weight (Llama 3.1-style frequency scaling) cannot be expressed as a \
                 Hugging Face rope_scaling yet"
                    .into(),
            ));
        }

        let token_embd =
            file.tensor("token_embd.weight")
                .ok_or_else(|| GgufError::MissingTensor {
                    tensor: "token_embd.weight".into(),
                })?;
        let vocab_size = token_embd.torch_shape().first().copied().unwrap_or(0);
        if let Some(declared) = metadata.get_usize(&key("vocab_size"))?
            && declared != vocab_size
        {
            return Err(GgufError::InvalidMetadata {
                key: key("vocab_size"),
                problem: format!("says {declared} but token_embd.weight has {vocab_size} rows"),
            });
        }

        Ok(Self {
            architecture,
            hidden_size,
            intermediate_size: metadata.require_usize(&key("feed_forward_length"))?,
            num_hidden_layers: metadata.require_usize(&key("block_count"))?,
            num_attention_heads,
            num_key_value_heads,
            head_dim,
            rms_norm_eps: metadata
                .get_f64(&key("attention.layer_norm_rms_epsilon"))?
                .ok_or_else(|| GgufError::MissingMetadata {
                    key: key("attention.layer_norm_rms_epsilon"),
                })?,
            rope_theta: metadata
                .get_f64(&key("rope.freq_base"))?
                .unwrap_or(10_000.0),
            rope_scaling: rope_scaling(file, &key)?,
            max_position_embeddings: metadata.require_usize(&key("context_length"))?,
            vocab_size,
            tie_word_embeddings: file.tensor("output.weight").is_none(),
            special_tokens: SpecialTokenIds::read(file)?,
        })
    }

    /// The Hugging Face shape (slowest dimension first) every mapped tensor must have.
    pub fn expected_hf_shape(&self, hf_name: &str) -> Option<Vec<usize>> {
        let q_rows = self.num_attention_heads * self.head_dim;
        let kv_rows = self.num_key_value_heads * self.head_dim;
        let (hidden, inter) = (self.hidden_size, self.intermediate_size);
        let suffix = hf_name
            .strip_prefix("model.layers.")
            .and_then(|rest| rest.split_once('.'))
            .map_or(hf_name, |(_, suffix)| suffix);
        Some(match suffix {
            "model.embed_tokens.weight" | "lm_head.weight" => vec![self.vocab_size, hidden],
            "model.norm.weight" | "input_layernorm.weight" | "post_attention_layernorm.weight" => {
                vec![hidden]
            }
            "self_attn.q_proj.weight" => vec![q_rows, hidden],
            "self_attn.k_proj.weight" | "self_attn.v_proj.weight" => vec![kv_rows, hidden],
            "self_attn.q_proj.bias" => vec![q_rows],
            "self_attn.k_proj.bias" | "self_attn.v_proj.bias" => vec![kv_rows],
            "self_attn.o_proj.weight" => vec![hidden, q_rows],
            "mlp.gate_proj.weight" | "mlp.up_proj.weight" => vec![inter, hidden],
            "mlp.down_proj.weight" => vec![hidden, inter],
            _ => return None,
        })
    }

    /// `config.json` with Hugging Face `LlamaConfig` / `Qwen2Config` field names, weights in f32.
    pub fn hf_config(&self) -> Value {
        let mut config = json!({
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "max_position_embeddings": self.max_position_embeddings,
            "vocab_size": self.vocab_size,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.special_tokens.bos,
            "eos_token_id": self.special_tokens.eos,
            "torch_dtype": "float32",
            "hidden_act": "silu",
            "attention_dropout": 0.0,
            "initializer_range": 0.02,
            "use_cache": true,
        });
        let fields = config.as_object_mut().expect("json! object");
        if let Some(pad) = self.special_tokens.pad {
            fields.insert("pad_token_id".into(), pad.into());
        }
        match self.architecture {
            Architecture::Llama => {
                fields.insert("architectures".into(), json!(["LlamaForCausalLM"]));
                fields.insert("model_type".into(), "llama".into());
                fields.insert("attention_bias".into(), false.into());
                fields.insert("mlp_bias".into(), false.into());
                fields.insert("pretraining_tp".into(), 1.into());
            }
            Architecture::Qwen2 => {
                fields.insert("architectures".into(), json!(["Qwen2ForCausalLM"]));
                fields.insert("model_type".into(), "qwen2".into());
                fields.insert("use_sliding_window".into(), false.into());
                fields.insert("sliding_window".into(), Value::Null);
                fields.insert("max_window_layers".into(), self.num_hidden_layers.into());
            }
        }
        config
    }
}

/// `{arch}.rope.scaling.*` (or the older `{arch}.rope.scale_linear`) as a Hugging Face
/// `rope_scaling` object.
fn rope_scaling(file: &GgufFile, key: &dyn Fn(&str) -> String) -> Result<Option<Value>, GgufError> {
    let metadata = file.metadata();
    let factor = metadata.get_f64(&key("rope.scaling.factor"))?;
    let scaling_type = match metadata.get_str(&key("rope.scaling.type"))? {
        Some(scaling_type) => scaling_type,
        None => {
            return Ok(metadata
                .get_f64(&key("rope.scale_linear"))?
                .filter(|&factor| factor != 1.0)
                .map(|factor| json!({"type": "linear", "rope_type": "linear", "factor": factor})));
        }
    };
    let require_factor = || {
        factor.ok_or_else(|| GgufError::MissingMetadata {
            key: key("rope.scaling.factor"),
        })
    };
    match scaling_type {
        "none" => Ok(None),
        "linear" => Ok(Some(
            json!({"type": "linear", "rope_type": "linear", "factor": require_factor()?}),
        )),
        "yarn" => {
            let original = metadata.require_usize(&key("rope.scaling.original_context_length"))?;
            Ok(Some(json!({
                "type": "yarn",
                "rope_type": "yarn",
                "factor": require_factor()?,
                "original_max_position_embeddings": original,
            })))
        }
        other => Err(GgufError::UnsupportedModel(format!(
            "rope scaling type {other:?} ({}) is not supported",
            key("rope.scaling.type")
        ))),
    }
}
