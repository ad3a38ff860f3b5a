//! The wiring check where a head meets the serving engine: which taps the head was trained on,
//! which taps serving will feed it, and every difference as a sentence.

use std::path::Path;

use tandem_eagle::Eagle3Config;
use tandem_model::TargetTokenizer;
use tandem_wiring::{
    AUX_IDS_KEY, Convention, Job, Mismatch, Producer, TapId, TapPoint, TargetFingerprint,
    WiringManifest, check, default_aux_taps, format_taps, reinterpretations, sglang_convention,
};

use crate::engine::InferError;

/// Where a head's taps came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TapSource {
    /// The head's Tandem wiring manifest (`tandem_wiring`): the taps it was trained on.
    Manifest,
    /// Raw `eagle_aux_hidden_state_layer_ids` read in a convention.
    Ids {
        /// Where the ids were found (`eagle_config....` or the top level).
        location: &'static str,
        /// The ids as written.
        ids: Vec<i64>,
        /// How they were read.
        convention: Convention,
        /// Why this convention: `--convention`, or the engine that reads this place.
        reason: String,
    },
    /// No ids anywhere: the EAGLE-3 default taps, as SGLang and vLLM default.
    Default,
}

/// The taps a head is served, with where they came from (said out loud when the head is
/// loaded: a foreign head names no convention, and guessing one silently is how heads end up
/// served one block off).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeadTaps {
    /// The taps, in slot order.
    pub taps: Vec<TapId>,
    /// Where they came from.
    pub source: TapSource,
}

impl HeadTaps {
    /// Lines for the terminal: the reading, and for raw ids what every other convention would
    /// read from them, so a user can see at once what a wrong guess would serve.
    pub fn describe(&self, num_layers: usize) -> Vec<String> {
        match &self.source {
            TapSource::Manifest => vec![format!(
                "head taps {} from its Tandem wiring manifest (the taps it was trained on)",
                format_taps(&self.taps)
            )],
            TapSource::Default => vec![format!(
                "head taps {}: the head has no Tandem manifest and names no ids, so the EAGLE-3 \
                 default taps are served (SGLang and vLLM default to the same)",
                format_taps(&self.taps)
            )],
            TapSource::Ids {
                location,
                ids,
                convention,
                reason,
            } => {
                let mut lines = vec![format!(
                    "head taps {}: no Tandem manifest; {location} = {ids:?} read as {convention} \
                     ({reason}: {})",
                    format_taps(&self.taps),
                    convention.meaning()
                )];
                for (other, read) in reinterpretations(ids, num_layers) {
                    if other == *convention {
                        continue;
                    }
                    let read = match read {
                        Ok(taps) if taps == self.taps => {
                            format!("{} (the same)", format_taps(&taps))
                        }
                        Ok(taps) => format_taps(&taps),
                        Err(e) => format!("nothing ({e})"),
                    };
                    lines.push(format!("  read as {other}: {read}"));
                }
                lines.push(
                    "  pass --convention to read the ids another way; `tandem diagnose` measures \
                     which wiring the head was trained on"
                        .to_owned(),
                );
                lines
            }
        }
    }
}

/// The taps a head expects, in slot order, for a target of `architecture` with `num_layers`
/// blocks: its Tandem manifest when it has one; else its ids read the way the engine that reads
/// them there does (`eagle_config` as SGLang's model code for this family, the top level as
/// vLLM), or in `convention` when the user names one; else the EAGLE-3 default set. Ids in
/// both places that the two engines read differently are an error: the head is served wrong by
/// one of them, and which one the trainer meant cannot be guessed.
pub fn read_head_taps(
    config: &Eagle3Config,
    architecture: &str,
    num_layers: usize,
    convention: Option<Convention>,
) -> Result<HeadTaps, InferError> {
    if let Some(m) = &config.tandem_wiring {
        return Ok(HeadTaps {
            taps: m.taps.clone(),
            source: TapSource::Manifest,
        });
    }
    let config_error = |field: &'static str, e: tandem_wiring::WiringError| InferError::Config {
        field,
        reason: e.to_string(),
    };
    const NESTED: &str = "eagle_config.eagle_aux_hidden_state_layer_ids";
    const TOP: &str = "eagle_aux_hidden_state_layer_ids (top level)";
    let nested = config
        .eagle_config
        .as_ref()
        .and_then(|e| e.eagle_aux_hidden_state_layer_ids.clone());
    let top: Option<Vec<i64>> = match config.extra.get(AUX_IDS_KEY) {
        None => None,
        Some(value) => Some(tandem_wiring::engines::parse_aux_ids(value).ok_or_else(|| {
            InferError::Config {
                field: "eagle_aux_hidden_state_layer_ids",
                reason: format!("(top level) is {value}, not a list of integers"),
            }
        })?),
    };
    let read = |location: &'static str, ids: Vec<i64>, convention: Convention, reason: String| {
        let taps = convention
            .to_canonical(&ids, num_layers)
            .map_err(|e| config_error("eagle_aux_hidden_state_layer_ids", e))?;
        Ok::<_, InferError>(HeadTaps {
            taps,
            source: TapSource::Ids {
                location,
                ids,
                convention,
                reason,
            },
        })
    };
    let sglang = sglang_convention(architecture);
    let sglang_reason = format!("SGLang reads this key so for {architecture}");
    let vllm_reason = "vLLM reads this key, and only this one, so".to_owned();
    if let Some(chosen) = convention {
        // The user's convention, on the ids of the place its engine reads (vLLM: the top level),
        // else on whichever ids the head has.
        let (location, ids) = match (chosen, nested, top) {
            (Convention::Vllm, _, Some(top)) => (TOP, top),
            (_, Some(nested), _) => (NESTED, nested),
            (_, None, Some(top)) => (TOP, top),
            (_, None, None) => {
                return Err(InferError::Config {
                    field: "--convention",
                    reason: format!(
                        "{chosen} was given but the head names no \
                         eagle_aux_hidden_state_layer_ids to read"
                    ),
                });
            }
        };
        return read(location, ids, chosen, "--convention".to_owned());
    }
    match (nested, top) {
        (None, None) => Ok(HeadTaps {
            taps: default_aux_taps(num_layers).map_err(|e| config_error("num_hidden_layers", e))?,
            source: TapSource::Default,
        }),
        (None, Some(top)) => read(TOP, top, Convention::Vllm, vllm_reason),
        (Some(nested), None) => read(NESTED, nested, sglang, sglang_reason),
        (Some(nested), Some(top)) => {
            let by_sglang = read(NESTED, nested.clone(), sglang, sglang_reason)?;
            let by_vllm = read(TOP, top.clone(), Convention::Vllm, vllm_reason)?;
            if by_sglang.taps != by_vllm.taps {
                return Err(InferError::Config {
                    field: "eagle_aux_hidden_state_layer_ids",
                    reason: format!(
                        "the head names ids in both places and the engines read them differently: \
                         eagle_config {nested:?} is {} for SGLang ({sglang}), the top-level \
                         {top:?} is {} for vLLM; one engine serves this head on the wrong taps. \
                         Pass --convention to say which reading is the trained one",
                        format_taps(&by_sglang.taps),
                        format_taps(&by_vllm.taps)
                    ),
                });
            }
            Ok(by_sglang)
        }
    }
}

/// The taps a head is served (see [`read_head_taps`]; no user convention).
pub fn head_taps(
    config: &Eagle3Config,
    architecture: &str,
    num_layers: usize,
) -> Result<Vec<TapId>, InferError> {
    Ok(read_head_taps(config, architecture, num_layers, None)?.taps)
}

/// The manifest of what serving feeds the head: the target in `model_dir`, fingerprinted as
/// `tandem dump` fingerprints it, and the serving taps.
pub fn serving_manifest(
    model_dir: &Path,
    taps: Vec<TapId>,
    dtype: &str,
    device: &str,
) -> Result<WiringManifest, InferError> {
    let tokenizer = TargetTokenizer::load(model_dir)?;
    let target = TargetFingerprint::from_files(
        &model_dir.join("config.json"),
        &model_dir.join("tokenizer.json"),
        tokenizer.chat_template.as_deref(),
    )
    .map_err(|e| InferError::Config {
        field: "--model",
        reason: e.to_string(),
    })?;
    Ok(WiringManifest::new(
        target,
        taps,
        TapPoint::ResidualStream,
        dtype,
        Producer::tandem(Job::Serve, device, "tree-verify"),
    ))
}

/// Every difference between the head's manifest and what serving does. A head without a Tandem
/// manifest can only be checked on its taps (made elsewhere, it carries no fingerprints).
pub fn check_head(
    config: &Eagle3Config,
    serving: &WiringManifest,
) -> Result<Vec<Mismatch>, InferError> {
    match &config.tandem_wiring {
        Some(trained) => Ok(check(trained, serving)),
        None => {
            let mut expected = serving.clone();
            expected.taps = head_taps(
                config,
                &serving.target.architecture,
                serving.target.num_layers,
            )?;
            Ok(check(&expected, serving))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{Value, json};

    const LAYERS: usize = 30;

    /// A foreign head's config (no Tandem manifest) with `ids` merged in.
    fn foreign(ids: Value) -> Eagle3Config {
        let mut config = json!({
            "architectures": ["LlamaForCausalLMEagle3"], "hidden_size": 64,
            "intermediate_size": 128, "num_attention_heads": 4, "vocab_size": 256,
            "rms_norm_eps": 1e-5
        });
        for (k, v) in ids.as_object().unwrap() {
            config[k] = v.clone();
        }
        serde_json::from_value(config).unwrap()
    }

    fn blocks(ids: &[usize]) -> Vec<TapId> {
        ids.iter().map(|&k| TapId::Block(k)).collect()
    }

    #[test]
    fn nested_ids_are_read_as_sglang_reads_them_for_the_family() {
        let head =
            foreign(json!({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 15, 27]}}));
        // SGLang's Llama code adds 1 to every id: [2, 15, 27] is blocks [2, 15, 27] ...
        let llama = read_head_taps(&head, "LlamaForCausalLM", LAYERS, None).unwrap();
        assert_eq!(llama.taps, blocks(&[2, 15, 27]));
        // ... its DeepSeek code only when the first id is 1: here blocks [1, 14, 26].
        let deepseek = read_head_taps(&head, "DeepseekV3ForCausalLM", LAYERS, None).unwrap();
        assert_eq!(deepseek.taps, blocks(&[1, 14, 26]));
        let lines = llama.describe(LAYERS).join("\n");
        assert!(lines.contains("read as sglang-classic"), "{lines}");
        assert!(
            lines.contains("SGLang reads this key so for LlamaForCausalLM"),
            "{lines}"
        );
        // The other readings are printed, the vLLM one among them (one block early).
        assert!(
            lines.contains("read as vllm: [block 1, block 14, block 26]"),
            "{lines}"
        );
        assert!(lines.contains("--convention"), "{lines}");
    }

    #[test]
    fn top_level_ids_are_read_as_vllm_reads_them() {
        let head = foreign(json!({"eagle_aux_hidden_state_layer_ids": [2, 15, 27]}));
        let read = read_head_taps(&head, "LlamaForCausalLM", LAYERS, None).unwrap();
        assert_eq!(read.taps, blocks(&[1, 14, 26]));
        assert!(matches!(
            read.source,
            TapSource::Ids {
                convention: Convention::Vllm,
                ..
            }
        ));
    }

    #[test]
    fn ids_in_both_places_must_agree_unless_a_convention_is_named() {
        // What Tandem exports: both engines read blocks [1, 14, 26].
        let agreeing = foreign(json!({
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 14, 26]},
            "eagle_aux_hidden_state_layer_ids": [2, 15, 27]
        }));
        let read = read_head_taps(&agreeing, "LlamaForCausalLM", LAYERS, None).unwrap();
        assert_eq!(read.taps, blocks(&[1, 14, 26]));
        // The same ids in both places: one engine serves the head one block off.
        let clash = foreign(json!({
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 15, 27]},
            "eagle_aux_hidden_state_layer_ids": [2, 15, 27]
        }));
        let err = read_head_taps(&clash, "LlamaForCausalLM", LAYERS, None)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("[block 2, block 15, block 27] for SGLang"),
            "{err}"
        );
        assert!(
            err.contains("[block 1, block 14, block 26] for vLLM"),
            "{err}"
        );
        assert!(err.contains("--convention"), "{err}");
        // Naming the convention settles it, on the place that convention's engine reads.
        let by_vllm =
            read_head_taps(&clash, "LlamaForCausalLM", LAYERS, Some(Convention::Vllm)).unwrap();
        assert_eq!(by_vllm.taps, blocks(&[1, 14, 26]));
        let by_hf =
            read_head_taps(&clash, "LlamaForCausalLM", LAYERS, Some(Convention::Hf)).unwrap();
        assert_eq!(by_hf.taps, blocks(&[1, 14, 26]));
        let by_sglang = read_head_taps(
            &clash,
            "LlamaForCausalLM",
            LAYERS,
            Some(Convention::SglangClassic),
        )
        .unwrap();
        assert_eq!(by_sglang.taps, blocks(&[2, 15, 27]));
        assert!(
            by_sglang.describe(LAYERS)[0].contains("(--convention:"),
            "{:?}",
            by_sglang.describe(LAYERS)
        );
    }

    #[test]
    fn no_ids_serve_the_default_and_a_manifest_wins() {
        let bare = foreign(json!({}));
        let read = read_head_taps(&bare, "LlamaForCausalLM", LAYERS, None).unwrap();
        assert_eq!(read.taps, default_aux_taps(LAYERS).unwrap());
        assert_eq!(read.source, TapSource::Default);
        assert!(read.describe(LAYERS)[0].contains("default"));
        let err = read_head_taps(&bare, "LlamaForCausalLM", LAYERS, Some(Convention::Vllm))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("names no eagle_aux_hidden_state_layer_ids"),
            "{err}"
        );
        // Bad top-level values are refused with the value in the sentence.
        let bad = foreign(json!({"eagle_aux_hidden_state_layer_ids": "2,15,27"}));
        let err = read_head_taps(&bad, "LlamaForCausalLM", LAYERS, None)
            .unwrap_err()
            .to_string();
        assert!(err.contains("not a list of integers"), "{err}");
    }
}
