//! Hugging Face `tokenizer.json` / `tokenizer_config.json` / `generation_config.json` from the
//! GGUF vocabulary.
//!
//! Only byte-level BPE vocabularies (`tokenizer.ggml.model == "gpt2"`) are converted. GGUF keeps
//! tokens, merges and token types but not the pre-tokenizer itself, only llama.cpp's name for it
//! (`tokenizer.ggml.pre`); [`pre_tokenizer`] maps known names back to the Hugging Face pipeline
//! those models were converted from.

use std::collections::HashMap;

use serde_json::{Map, Value, json};

use crate::GgufError;
use crate::config::SpecialTokenIds;
use crate::metadata::Metadata;

/// llama.cpp token types (`llama_token_type`) that Hugging Face treats as added special tokens.
const TOKEN_TYPE_CONTROL: u64 = 3;
const TOKEN_TYPE_USER_DEFINED: u64 = 4;

/// GPT-2's byte-level split, used by most BPE tokenizers that do not bring their own regex.
fn byte_level(use_regex: bool, trim_offsets: bool) -> Value {
    json!({
        "type": "ByteLevel",
        "add_prefix_space": false,
        "trim_offsets": trim_offsets,
        "use_regex": use_regex,
    })
}

fn split_isolated(regex: &str) -> Value {
    json!({
        "type": "Split",
        "pattern": {"Regex": regex},
        "behavior": "Isolated",
        "invert": false,
    })
}

/// The `(normalizer, pre_tokenizer)` Hugging Face uses for the model family llama.cpp calls
/// `pre`, or `None` for names this importer does not know. Each entry mirrors the original
/// family's `tokenizer.json`.
pub fn pre_tokenizer(pre: &str) -> Option<(Value, Value)> {
    const LLAMA3_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
    const QWEN2_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
    Some(match pre {
        "gpt-2" => (Value::Null, byte_level(true, true)),
        // SmolLM / SmolLM2 (and StarCoder-style vocabularies): single digits, then GPT-2 split.
        "smollm" => (
            Value::Null,
            json!({
                "type": "Sequence",
                "pretokenizers": [
                    {"type": "Digits", "individual_digits": true},
                    byte_level(true, true),
                ],
            }),
        ),
        "llama3" | "llama-v3" | "llama-bpe" => (
            Value::Null,
            json!({
                "type": "Sequence",
                "pretokenizers": [split_isolated(LLAMA3_REGEX), byte_level(false, true)],
            }),
        ),
        "qwen2" => (
            json!({"type": "NFC"}),
            json!({
                "type": "Sequence",
                "pretokenizers": [split_isolated(QWEN2_REGEX), byte_level(false, false)],
            }),
        ),
        _ => return None,
    })
}

/// The generated tokenizer files and what the report needs to know about them.
#[derive(Debug)]
pub(crate) struct TokenizerFiles {
    pub tokenizer_json: Value,
    pub tokenizer_config_json: Value,
    pub generation_config_json: Value,
    pub pre: String,
    pub token_count: usize,
    pub warnings: Vec<String>,
}

/// Builds the tokenizer files from GGUF metadata; `model_max_length` is the context length.
pub(crate) fn build_tokenizer_files(
    metadata: &Metadata,
    special: &SpecialTokenIds,
    model_max_length: usize,
) -> Result<TokenizerFiles, GgufError> {
    let model = metadata.require_str("tokenizer.ggml.model")?;
    if model != "gpt2" {
        return Err(GgufError::UnsupportedTokenizer(format!(
            "tokenizer.ggml.model is {model:?}; only byte-level BPE (\"gpt2\") vocabularies are supported"
        )));
    }
    let pre = metadata.require_str("tokenizer.ggml.pre")?;
    let (normalizer, pre_tokenizer) = pre_tokenizer(pre).ok_or_else(|| {
        GgufError::UnsupportedTokenizer(format!(
            "pre-tokenizer {pre:?} (tokenizer.ggml.pre) is not known; supported: gpt-2, smollm, \
             llama-bpe, qwen2"
        ))
    })?;

    let tokens = metadata
        .get_str_array("tokenizer.ggml.tokens")?
        .ok_or_else(|| GgufError::MissingMetadata {
            key: "tokenizer.ggml.tokens".into(),
        })?;
    let merges = metadata
        .get_str_array("tokenizer.ggml.merges")?
        .ok_or_else(|| GgufError::MissingMetadata {
            key: "tokenizer.ggml.merges".into(),
        })?;
    let token_types = metadata
        .get_u64_array("tokenizer.ggml.token_type")?
        .unwrap_or_default();
    if !token_types.is_empty() && token_types.len() != tokens.len() {
        return Err(GgufError::InvalidMetadata {
            key: "tokenizer.ggml.token_type".into(),
            problem: format!("{} entries for {} tokens", token_types.len(), tokens.len()),
        });
    }

    let mut warnings = Vec::new();
    let mut vocab = Map::with_capacity(tokens.len());
    let mut first_id: HashMap<&str, usize> = HashMap::with_capacity(tokens.len());
    for (id, &token) in tokens.iter().enumerate() {
        if let Some(&earlier) = first_id.get(token) {
            // A JSON vocabulary cannot hold two ids for one string; the first wins, as in
            // llama.cpp's own token-to-id map.
            warnings.push(format!(
                "token {token:?} appears as ids {earlier} and {id}; kept {earlier}"
            ));
            continue;
        }
        first_id.insert(token, id);
        vocab.insert(token.to_owned(), id.into());
    }

    let added_tokens: Vec<Value> = token_types
        .iter()
        .enumerate()
        .filter(|&(_, &kind)| kind == TOKEN_TYPE_CONTROL || kind == TOKEN_TYPE_USER_DEFINED)
        .map(|(id, _)| {
            json!({
                "id": id,
                "content": tokens[id],
                "single_word": false,
                "lstrip": false,
                "rstrip": false,
                "normalized": false,
                "special": true,
            })
        })
        .collect();

    let token_text = |id: Option<u32>, what: &str| -> Result<Option<&str>, GgufError> {
        id.map(|id| {
            tokens
                .get(id as usize)
                .copied()
                .ok_or_else(|| GgufError::InvalidMetadata {
                    key: format!("tokenizer.ggml.{what}_token_id"),
                    problem: format!(
                        "id {id} is outside the vocabulary of {} tokens",
                        tokens.len()
                    ),
                })
        })
        .transpose()
    };
    let bos = token_text(special.bos, "bos")?;
    let eos = token_text(special.eos, "eos")?;
    let pad = token_text(special.pad, "padding")?;
    let unk = token_text(special.unk, "unknown")?;
    let add_bos = metadata
        .get_bool("tokenizer.ggml.add_bos_token")?
        .unwrap_or(false);
    let add_eos = metadata
        .get_bool("tokenizer.ggml.add_eos_token")?
        .unwrap_or(false);

    let post_processor = if add_bos || add_eos {
        let bos_template = add_bos.then(|| bos.zip(special.bos)).flatten();
        let eos_template = add_eos.then(|| eos.zip(special.eos)).flatten();
        if add_bos && bos_template.is_none() || add_eos && eos_template.is_none() {
            return Err(GgufError::UnsupportedTokenizer(
                "add_bos_token / add_eos_token is set but the token id is missing".into(),
            ));
        }
        json!({
            "type": "Sequence",
            "processors": [
                byte_level(true, false),
                template_processing(bos_template, eos_template),
            ],
        })
    } else {
        byte_level(true, false)
    };

    let tokenizer_json = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added_tokens,
        "normalizer": normalizer,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": post_processor,
        "decoder": byte_level(true, true),
        "model": {
            "type": "BPE",
            "dropout": null,
            "unk_token": null,
            "continuing_subword_prefix": null,
            "end_of_word_suffix": null,
            "fuse_unk": false,
            "byte_fallback": false,
            "ignore_merges": false,
            "vocab": vocab,
            "merges": merges,
        },
    });

    let mut tokenizer_config = json!({
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "bos_token": bos,
        "eos_token": eos,
        "pad_token": pad,
        "unk_token": unk,
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": false,
        "tokenizer_class": "PreTrainedTokenizerFast",
    });
    if let Some(template) = metadata.get_str("tokenizer.chat_template")? {
        tokenizer_config["chat_template"] = template.into();
    }

    let mut generation_config = json!({
        "bos_token_id": special.bos,
        "eos_token_id": special.eos,
    });
    if let (Some(eos), Some(eot)) = (special.eos, special.eot)
        && eos != eot
    {
        // Chat models stop on the end-of-turn token as well as on end-of-text.
        generation_config["eos_token_id"] = json!([eos, eot]);
    }
    if let Some(pad) = special.pad {
        generation_config["pad_token_id"] = pad.into();
    }

    Ok(TokenizerFiles {
        tokenizer_json,
        tokenizer_config_json: tokenizer_config,
        generation_config_json: generation_config,
        pre: pre.to_owned(),
        token_count: tokens.len(),
        warnings,
    })
}

/// `TemplateProcessing` adding `bos` before and/or `eos` after each sequence.
fn template_processing(bos: Option<(&str, u32)>, eos: Option<(&str, u32)>) -> Value {
    let special =
        |token: &str, type_id: u32| json!({"SpecialToken": {"id": token, "type_id": type_id}});
    let sequence = |id: &str, type_id: u32| json!({"Sequence": {"id": id, "type_id": type_id}});
    let wrap = |id: &str, type_id: u32| {
        let mut pieces = Vec::new();
        pieces.extend(bos.map(|(token, _)| special(token, type_id)));
        pieces.push(sequence(id, type_id));
        pieces.extend(eos.map(|(token, _)| special(token, type_id)));
        pieces
    };
    let mut pair = wrap("A", 0);
    pair.extend(wrap("B", 1));
    let special_tokens: Map<String, Value> = bos
        .into_iter()
        .chain(eos)
        .map(|(token, id)| {
            (
                token.to_owned(),
                json!({"id": token, "ids": [id], "tokens": [token]}),
            )
        })
        .collect();
    json!({
        "type": "TemplateProcessing",
        "single": wrap("A", 0),
        "pair": pair,
        "special_tokens": special_tokens,
    })
}
