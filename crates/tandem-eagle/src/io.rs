//! Draft checkpoints on disk: `config.json` + `model.safetensors` with the exact keys SGLang,
//! vLLM and SpecForge load.
//!
//! Saved keys (canonical, SGLang/SpecForge/EAGLE spelling): `fc.weight`,
//! `midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight`,
//! `midlayer.self_attn.{q,k,v,o}_proj.weight`, `midlayer.mlp.{gate,up,down}_proj.weight`,
//! `norm.weight`, `lm_head.weight` (f32 or bf16, HF `[out, in]` layout), `d2t` (int64 offsets)
//! and `t2d` (bool). The target's embedding is never saved.
//!
//! Loading accepts vLLM's `layers.0.` for `midlayer.`, a leading `model.`, and ignores an
//! `embed_tokens.weight` some SpecForge exports carry (the target's embedding is used instead).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use burn::prelude::*;
use safetensors::{Dtype, SafeTensors, serialize_to_file, tensor::TensorView};

use crate::config::{DraftSpec, Eagle3Config};
use crate::error::EagleError;
use crate::model::{Eagle3Draft, HostWeights, parameter_shapes};
use crate::vocab::VocabMap;

/// The weights file of a head directory.
pub const WEIGHTS_FILE: &str = "model.safetensors";
/// The config file of a head directory.
pub const CONFIG_FILE: &str = "config.json";

/// Element type of the saved parameters (buffers are always int64 / bool).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum WeightDtype {
    /// 32-bit float (`torch_dtype: float32`).
    #[default]
    F32,
    /// bfloat16 (`torch_dtype: bfloat16`), what heads are usually published in.
    Bf16,
}

impl WeightDtype {
    /// The safetensors dtype.
    pub fn safetensors(self) -> Dtype {
        match self {
            WeightDtype::F32 => Dtype::F32,
            WeightDtype::Bf16 => Dtype::BF16,
        }
    }
    /// The `torch_dtype` string of config.json.
    pub fn torch_dtype(self) -> &'static str {
        match self {
            WeightDtype::F32 => "float32",
            WeightDtype::Bf16 => "bfloat16",
        }
    }
}

/// Every tensor a checkpoint of `spec` holds: canonical key, shape, dtype, in file order.
pub fn checkpoint_layout(spec: &DraftSpec, dtype: WeightDtype) -> Vec<(String, Vec<usize>, Dtype)> {
    let mut out: Vec<(String, Vec<usize>, Dtype)> = parameter_shapes(spec)
        .into_iter()
        .map(|(name, shape)| (name.to_owned(), shape, dtype.safetensors()))
        .collect();
    out.push(("d2t".to_owned(), vec![spec.draft_vocab_size], Dtype::I64));
    out.push(("t2d".to_owned(), vec![spec.vocab_size], Dtype::BOOL));
    out
}

/// Maps a key found in a checkpoint to the canonical key, or `None` for keys that are not
/// part of the head (the target's embedding).
pub fn canonical_key(raw: &str) -> Option<String> {
    let key = raw.strip_prefix("model.").unwrap_or(raw);
    let key = match key.strip_prefix("layers.0.") {
        Some(rest) => format!("midlayer.{rest}"),
        None => key.to_owned(),
    };
    if key == "embed_tokens.weight" {
        return None;
    }
    Some(key)
}

/// What [`read_checkpoint`] found besides the weights.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LoadReport {
    /// Keys that were renamed (`raw -> canonical`), e.g. vLLM's `layers.0.`.
    pub renamed: Vec<(String, String)>,
    /// Keys ignored on purpose (`embed_tokens.weight`).
    pub ignored: Vec<String>,
    /// Keys that are not part of an EAGLE-3 head.
    pub unknown: Vec<String>,
}

/// The parameters, vocabulary buffers and load report of one checkpoint file.
#[derive(Debug, Clone)]
pub struct Checkpoint {
    /// Every parameter in HF layout, f32.
    pub weights: HostWeights,
    /// `d2t` / `t2d` when present (a head without them uses the full target vocabulary).
    pub vocab: Option<VocabMap>,
    /// Renamed / ignored / unknown keys.
    pub report: LoadReport,
}

fn io_err(action: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> EagleError {
    let path = path.to_owned();
    move |source| EagleError::Io {
        action,
        path,
        source,
    }
}

/// Reads a head's safetensors file against `spec`: every parameter present with its shape,
/// `d2t`/`t2d` validated as offsets + mask when present.
pub fn read_checkpoint(path: &Path, spec: &DraftSpec) -> Result<Checkpoint, EagleError> {
    if !path.exists() {
        let bin = path.with_file_name("pytorch_model.bin");
        let reason = if bin.exists() {
            format!(
                "no {WEIGHTS_FILE} (there is a pytorch_model.bin, which this loader cannot \
                 read: convert it to safetensors)"
            )
        } else {
            format!("no {WEIGHTS_FILE}")
        };
        return Err(EagleError::Safetensors {
            path: path.to_owned(),
            reason,
        });
    }
    let bytes = std::fs::read(path).map_err(io_err("read", path))?;
    let st = SafeTensors::deserialize(&bytes).map_err(|e| EagleError::Safetensors {
        path: path.to_owned(),
        reason: format!("not a valid safetensors file: {e}"),
    })?;
    let mut report = LoadReport::default();
    let mut by_key: BTreeMap<String, String> = BTreeMap::new();
    let expected: BTreeMap<&str, Vec<usize>> = parameter_shapes(spec).into_iter().collect();
    for raw in st.names() {
        match canonical_key(raw) {
            None => report.ignored.push(raw.to_owned()),
            Some(key) => {
                if key != *raw {
                    report.renamed.push((raw.to_owned(), key.clone()));
                }
                if expected.contains_key(key.as_str()) || key == "d2t" || key == "t2d" {
                    by_key.insert(key, raw.to_owned());
                } else {
                    report.unknown.push(raw.to_owned());
                }
            }
        }
    }
    report.renamed.sort();
    report.ignored.sort();
    report.unknown.sort();
    let found = || {
        let mut names: Vec<&str> = st.names();
        names.sort_unstable();
        let shown: Vec<&str> = names.iter().take(8).copied().collect();
        let more = names.len().saturating_sub(shown.len());
        if more > 0 {
            format!("{}, ... {more} more", shown.join(", "))
        } else {
            shown.join(", ")
        }
    };
    let mut weights = HostWeights::new();
    for (name, shape) in &expected {
        let raw = by_key.get(*name).ok_or_else(|| EagleError::MissingTensor {
            name: (*name).to_owned(),
            path: path.to_owned(),
            found: found(),
        })?;
        let view = st.tensor(raw).map_err(|e| EagleError::Safetensors {
            path: path.to_owned(),
            reason: e.to_string(),
        })?;
        if view.shape() != shape.as_slice() {
            return Err(EagleError::ShapeMismatch {
                name: (*name).to_owned(),
                expected: shape.clone(),
                actual: view.shape().to_vec(),
            });
        }
        let values = floats(name, view.dtype(), view.data())?;
        weights.insert((*name).to_owned(), (shape.clone(), values));
    }
    let vocab = match (by_key.get("d2t"), by_key.get("t2d")) {
        (None, None) => None,
        (Some(d), Some(t)) => {
            let tensor = |raw: &String| {
                st.tensor(raw).map_err(|e| EagleError::Safetensors {
                    path: path.to_owned(),
                    reason: e.to_string(),
                })
            };
            let (d, t) = (tensor(d)?, tensor(t)?);
            for (name, view, len) in [
                ("d2t", &d, spec.draft_vocab_size),
                ("t2d", &t, spec.vocab_size),
            ] {
                if view.shape() != [len] {
                    return Err(EagleError::ShapeMismatch {
                        name: name.to_owned(),
                        expected: vec![len],
                        actual: view.shape().to_vec(),
                    });
                }
            }
            let d2t = ints("d2t", d.dtype(), d.data())?;
            let t2d = ints("t2d", t.dtype(), t.data())?
                .into_iter()
                .map(|v| v != 0)
                .collect();
            Some(VocabMap::from_buffers(d2t, t2d)?)
        }
        (Some(_), None) | (None, Some(_)) => {
            return Err(EagleError::Vocab {
                reason: format!(
                    "{} has only one of d2t and t2d; both are needed to map draft ids",
                    path.display()
                ),
            });
        }
    };
    Ok(Checkpoint {
        weights,
        vocab,
        report,
    })
}

fn floats(name: &str, dtype: Dtype, bytes: &[u8]) -> Result<Vec<f32>, EagleError> {
    tandem_model::weights::decode_floats(dtype, bytes).ok_or_else(|| EagleError::UnsupportedDtype {
        name: name.to_owned(),
        dtype: format!("{dtype:?}"),
        expected: "F32, F16 or BF16",
    })
}

fn ints(name: &str, dtype: Dtype, bytes: &[u8]) -> Result<Vec<i64>, EagleError> {
    Ok(match dtype {
        Dtype::I64 => bytes
            .chunks_exact(8)
            .map(|b| i64::from_le_bytes(b.try_into().expect("8 bytes")))
            .collect(),
        Dtype::I32 => bytes
            .chunks_exact(4)
            .map(|b| i64::from(i32::from_le_bytes(b.try_into().expect("4 bytes"))))
            .collect(),
        Dtype::BOOL | Dtype::U8 => bytes.iter().map(|&b| i64::from(b)).collect(),
        other => {
            return Err(EagleError::UnsupportedDtype {
                name: name.to_owned(),
                dtype: format!("{other:?}"),
                expected: "I64, I32, BOOL or U8",
            });
        }
    })
}

/// Writes the head's `model.safetensors`: parameters in `dtype`, `d2t` int64, `t2d` bool, keys
/// as in [`checkpoint_layout`], metadata `{"format": "pt"}` (what transformers expects).
pub fn save_safetensors<B: Backend>(
    draft: &Eagle3Draft<B>,
    path: &Path,
    dtype: WeightDtype,
) -> Result<(), EagleError> {
    let host = draft.to_host();
    write_weights(&draft.spec, &draft.vocab, &host, path, dtype, |name| {
        name.to_owned()
    })
}

/// The weights of a head (`spec`, `vocab`, parameters in HF layout) as `model.safetensors`,
/// each key written as `key_name(canonical key)` (the speculators layout names the decoder
/// layer `layers.0.` instead of `midlayer.`).
fn write_weights(
    spec: &DraftSpec,
    vocab: &VocabMap,
    host: &HostWeights,
    path: &Path,
    dtype: WeightDtype,
    key_name: impl Fn(&str) -> String,
) -> Result<(), EagleError> {
    let mut buffers: Vec<(String, Vec<usize>, Dtype, Vec<u8>)> = Vec::new();
    for (name, shape, st_dtype) in checkpoint_layout(spec, dtype) {
        let bytes: Vec<u8> = match name.as_str() {
            "d2t" => vocab.d2t.iter().flat_map(|v| v.to_le_bytes()).collect(),
            "t2d" => vocab.t2d.iter().map(|&b| u8::from(b)).collect(),
            _ => {
                let (_, values) = &host[&name];
                match dtype {
                    WeightDtype::F32 => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
                    WeightDtype::Bf16 => values
                        .iter()
                        .flat_map(|v| half::bf16::from_f32(*v).to_le_bytes())
                        .collect(),
                }
            }
        };
        buffers.push((key_name(&name), shape, st_dtype, bytes));
    }
    let views = buffers
        .iter()
        .map(|(name, shape, dt, bytes)| {
            TensorView::new(*dt, shape.clone(), bytes)
                .map(|v| (name.clone(), v))
                .map_err(|e| EagleError::Safetensors {
                    path: path.to_owned(),
                    reason: format!("tensor {name}: {e}"),
                })
        })
        .collect::<Result<Vec<_>, _>>()?;
    let metadata = Some(
        [("format".to_owned(), "pt".to_owned())]
            .into_iter()
            .collect(),
    );
    serialize_to_file(views, metadata, path).map_err(|e| EagleError::Safetensors {
        path: path.to_owned(),
        reason: format!("cannot write: {e}"),
    })
}

/// Writes a head directory: `config.json` (with `torch_dtype` set to `dtype`) and
/// `model.safetensors`.
pub fn save_pretrained<B: Backend>(
    draft: &Eagle3Draft<B>,
    config: &Eagle3Config,
    dir: &Path,
    dtype: WeightDtype,
) -> Result<(), EagleError> {
    std::fs::create_dir_all(dir).map_err(io_err("create", dir))?;
    let spec = config.resolve()?;
    if spec != draft.spec {
        return Err(EagleError::Config {
            field: "config",
            reason: "does not describe the head being saved (sizes or RoPE differ)".to_owned(),
        });
    }
    let mut config = config.clone();
    config.torch_dtype = Some(dtype.torch_dtype().to_owned());
    config.save(&dir.join(CONFIG_FILE))?;
    save_safetensors(draft, &dir.join(WEIGHTS_FILE), dtype)
}

/// Writes a head directory in the `speculators` format (vLLM loads it natively; see
/// [`Eagle3Config::to_speculators`]): `config.json` with `speculators_config` and the layer
/// config nested under `transformer_layer_config`, weights keyed `layers.0.` as speculators
/// checkpoints are. A conversion of a head read by [`load_host`]; [`load_pretrained`] reads
/// the result back.
pub fn save_speculators(
    head: &HostHead,
    dir: &Path,
    dtype: WeightDtype,
    verifier: &crate::config::Verifier,
) -> Result<(), EagleError> {
    std::fs::create_dir_all(dir).map_err(io_err("create", dir))?;
    let mut config = head.config.clone();
    config.torch_dtype = Some(dtype.torch_dtype().to_owned());
    let value = config.to_speculators(verifier)?;
    let path = dir.join(CONFIG_FILE);
    let mut json = serde_json::to_string_pretty(&value).map_err(|source| EagleError::Json {
        path: path.clone(),
        source,
    })?;
    json.push('\n');
    std::fs::write(&path, json).map_err(io_err("write", &path))?;
    let path = dir.join(WEIGHTS_FILE);
    write_weights(
        &head.spec,
        &head.vocab,
        &head.weights,
        &path,
        dtype,
        |name| match name.strip_prefix("midlayer.") {
            Some(rest) => format!("layers.0.{rest}"),
            None => name.to_owned(),
        },
    )
}

/// A head directory loaded: the model, its config and what the loader renamed or ignored.
#[derive(Debug)]
pub struct LoadedHead<B: Backend> {
    /// The head, on the device of `embed_tokens`.
    pub draft: Eagle3Draft<B>,
    /// Its config.json.
    pub config: Eagle3Config,
    /// Renamed / ignored / unknown keys.
    pub report: LoadReport,
}

/// A head directory read into host memory, before it is built on a device: what both the burn
/// head ([`load_pretrained`]) and the CUDA fast path's head are made from.
#[derive(Debug, Clone)]
pub struct HostHead {
    /// Its config.json.
    pub config: Eagle3Config,
    /// The config resolved.
    pub spec: DraftSpec,
    /// `d2t` / `t2d` (the identity when the checkpoint has none and the vocabularies agree).
    pub vocab: VocabMap,
    /// Every parameter in HF layout, f32.
    pub weights: HostWeights,
    /// Renamed / ignored / unknown keys.
    pub report: LoadReport,
}

/// Reads a head directory (`config.json` + `model.safetensors`, SGLang/vLLM/SpecForge/EAGLE or
/// Tandem layout) into host memory. A checkpoint without `d2t`/`t2d` must have
/// `draft_vocab_size == vocab_size` and gets the identity map.
pub fn load_host(dir: &Path) -> Result<HostHead, EagleError> {
    let config = Eagle3Config::load(&dir.join(CONFIG_FILE))?;
    let spec = config.resolve()?;
    let checkpoint = read_checkpoint(&dir.join(WEIGHTS_FILE), &spec)?;
    let vocab = match checkpoint.vocab {
        Some(v) => v,
        None if spec.draft_vocab_size == spec.vocab_size => VocabMap::identity(spec.vocab_size),
        None => {
            return Err(EagleError::Vocab {
                reason: format!(
                    "{} has no d2t/t2d but draft_vocab_size {} < vocab_size {}: the draft ids \
                     cannot be mapped to target ids",
                    dir.join(WEIGHTS_FILE).display(),
                    spec.draft_vocab_size,
                    spec.vocab_size
                ),
            });
        }
    };
    Ok(HostHead {
        config,
        spec,
        vocab,
        weights: checkpoint.weights,
        report: checkpoint.report,
    })
}

/// Loads a head directory ([`load_host`]) on top of the target embedding `embed_tokens:
/// [vocab, H]`.
pub fn load_pretrained<B: Backend>(
    dir: &Path,
    embed_tokens: Tensor<B, 2>,
    device: &B::Device,
) -> Result<LoadedHead<B>, EagleError> {
    let host = load_host(dir)?;
    let draft = Eagle3Draft::from_host(host.spec, host.vocab, &host.weights, embed_tokens, device)?;
    Ok(LoadedHead {
        draft,
        config: host.config,
        report: host.report,
    })
}

/// `dir/model.safetensors`.
pub fn weights_path(dir: &Path) -> PathBuf {
    dir.join(WEIGHTS_FILE)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn canonical_keys_accept_vllm_and_prefixed_names() {
        assert_eq!(
            canonical_key("layers.0.self_attn.q_proj.weight").as_deref(),
            Some("midlayer.self_attn.q_proj.weight")
        );
        assert_eq!(
            canonical_key("model.layers.0.hidden_norm.weight").as_deref(),
            Some("midlayer.hidden_norm.weight")
        );
        assert_eq!(canonical_key("fc.weight").as_deref(), Some("fc.weight"));
        assert_eq!(canonical_key("embed_tokens.weight"), None);
        assert_eq!(canonical_key("model.embed_tokens.weight"), None);
    }
}
