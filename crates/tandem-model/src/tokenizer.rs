//! Tokenisation (HF `tokenizer.json` via `tokenizers`) and chat rendering with the model's own
//! Jinja template (`minijinja`, with Python string-method compatibility as HF templates use).

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::ModelError;

/// One chat message, OpenAI / HF style.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
        }
    }
}

/// `tokenizer_config.json` fields we use. Special tokens may be strings or `{content: ...}`.
#[derive(Debug, Clone, Default, Deserialize)]
struct TokenizerConfig {
    #[serde(default)]
    chat_template: Option<serde_json::Value>,
    #[serde(default)]
    bos_token: Option<serde_json::Value>,
    #[serde(default)]
    eos_token: Option<serde_json::Value>,
    #[serde(default)]
    add_bos_token: Option<bool>,
}

fn token_string(v: &Option<serde_json::Value>) -> Option<String> {
    match v {
        Some(serde_json::Value::String(s)) => Some(s.clone()),
        Some(serde_json::Value::Object(o)) => {
            o.get("content").and_then(|c| c.as_str()).map(String::from)
        }
        _ => None,
    }
}

/// A token's byte range `(start, end)` in the text it was encoded from.
pub type ByteSpan = (usize, usize);

/// The target's tokenizer and chat template, loaded from an HF model directory.
pub struct TargetTokenizer {
    tokenizer: tokenizers::Tokenizer,
    path: PathBuf,
    pub chat_template: Option<String>,
    pub bos_token: Option<String>,
    pub eos_token: Option<String>,
    /// Token ids that end generation.
    pub eos_ids: Vec<u32>,
    pub add_bos_token: bool,
}

impl std::fmt::Debug for TargetTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TargetTokenizer")
            .field("path", &self.path)
            .field("eos_ids", &self.eos_ids)
            .finish()
    }
}

impl TargetTokenizer {
    pub fn load(dir: &Path) -> Result<Self, ModelError> {
        let path = dir.join("tokenizer.json");
        if !path.exists() {
            return Err(ModelError::Tokenizer {
                path,
                reason: "file not found".into(),
            });
        }
        let tokenizer =
            tokenizers::Tokenizer::from_file(&path).map_err(|e| ModelError::Tokenizer {
                path: path.clone(),
                reason: e.to_string(),
            })?;
        let config_path = dir.join("tokenizer_config.json");
        let config: TokenizerConfig = if config_path.exists() {
            let text = std::fs::read_to_string(&config_path).map_err(|source| ModelError::Io {
                path: config_path.clone(),
                source,
            })?;
            serde_json::from_str(&text).map_err(|source| ModelError::Json {
                path: config_path.clone(),
                source,
            })?
        } else {
            TokenizerConfig::default()
        };
        let chat_template = match &config.chat_template {
            Some(serde_json::Value::String(s)) => Some(s.clone()),
            // A list of named templates: take "default".
            Some(serde_json::Value::Array(list)) => list
                .iter()
                .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
                .and_then(|t| t.get("template"))
                .and_then(|t| t.as_str())
                .map(String::from),
            _ => None,
        };
        let chat_template = match chat_template {
            Some(t) => Some(t),
            None => std::fs::read_to_string(dir.join("chat_template.jinja")).ok(),
        };
        let bos_token = token_string(&config.bos_token);
        let eos_token = token_string(&config.eos_token);
        let mut eos_ids: Vec<u32> = eos_token
            .iter()
            .filter_map(|t| tokenizer.token_to_id(t))
            .collect();
        // Chat models end a turn with their end-of-turn token even when eos is another token.
        for extra in ["<|im_end|>", "<|eot_id|>", "<|endoftext|>"] {
            if let Some(id) = tokenizer.token_to_id(extra)
                && !eos_ids.contains(&id)
                && chat_template.as_deref().is_some_and(|t| t.contains(extra))
            {
                eos_ids.push(id);
            }
        }
        Ok(Self {
            tokenizer,
            path,
            chat_template,
            bos_token,
            eos_token,
            eos_ids,
            add_bos_token: config.add_bos_token.unwrap_or(false),
        })
    }

    /// Token ids of `text`. Special tokens written literally in `text` (e.g. `<|im_start|>`) are
    /// recognised, as HF tokenizers do; `add_special_tokens` controls the post-processor (BOS).
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, ModelError> {
        let encoding = self
            .tokenizer
            .encode(text, add_special_tokens)
            .map_err(|e| ModelError::Tokenizer {
                path: self.path.clone(),
                reason: e.to_string(),
            })?;
        Ok(encoding.get_ids().to_vec())
    }

    /// Like [`TargetTokenizer::encode`], with each token's byte range `(start, end)` in
    /// `text`: the dump job maps the character spans of assistant turns in a rendered chat to
    /// tokens with these. Tokens added by the post-processor (BOS) have the range `(0, 0)`.
    pub fn encode_with_offsets(
        &self,
        text: &str,
        add_special_tokens: bool,
    ) -> Result<(Vec<u32>, Vec<ByteSpan>), ModelError> {
        let encoding = self
            .tokenizer
            .encode(text, add_special_tokens)
            .map_err(|e| ModelError::Tokenizer {
                path: self.path.clone(),
                reason: e.to_string(),
            })?;
        Ok((encoding.get_ids().to_vec(), encoding.get_offsets().to_vec()))
    }

    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String, ModelError> {
        self.tokenizer
            .decode(ids, skip_special_tokens)
            .map_err(|e| ModelError::Tokenizer {
                path: self.path.clone(),
                reason: e.to_string(),
            })
    }

    pub fn vocab_size(&self) -> usize {
        self.tokenizer.get_vocab_size(true)
    }

    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.tokenizer.token_to_id(token)
    }

    /// Renders `messages` with the model's chat template, as HF `apply_chat_template` does.
    pub fn render_chat(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, ModelError> {
        let template = self
            .chat_template
            .as_deref()
            .ok_or_else(|| ModelError::ChatTemplate {
                reason: "the model has no chat template (tokenizer_config.json chat_template)"
                    .into(),
            })?;
        render_template(
            template,
            messages,
            add_generation_prompt,
            self.bos_token.as_deref().unwrap_or(""),
            self.eos_token.as_deref().unwrap_or(""),
        )
    }

    /// Renders and tokenises a chat; the template already writes any BOS it wants, so no
    /// special tokens are added on top (as HF `apply_chat_template(tokenize=True)`).
    pub fn encode_chat(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<Vec<u32>, ModelError> {
        let text = self.render_chat(messages, add_generation_prompt)?;
        self.encode(&text, false)
    }
}

/// Renders an HF chat template. `raise_exception` and Python string methods (`strip`, `split`,
/// ...) are provided because real templates use them.
pub fn render_template(
    template: &str,
    messages: &[ChatMessage],
    add_generation_prompt: bool,
    bos_token: &str,
    eos_token: &str,
) -> Result<String, ModelError> {
    let mut env = minijinja::Environment::new();
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    // HF renders with trim_blocks and lstrip_blocks.
    env.set_trim_blocks(true);
    env.set_lstrip_blocks(true);
    env.add_function(
        "raise_exception",
        |message: String| -> Result<String, minijinja::Error> {
            Err(minijinja::Error::new(
                minijinja::ErrorKind::InvalidOperation,
                message,
            ))
        },
    );
    env.add_template("chat", template)
        .map_err(|e| ModelError::ChatTemplate {
            reason: e.to_string(),
        })?;
    let tmpl = env
        .get_template("chat")
        .map_err(|e| ModelError::ChatTemplate {
            reason: e.to_string(),
        })?;
    tmpl.render(minijinja::context! {
        messages => messages,
        add_generation_prompt => add_generation_prompt,
        bos_token => bos_token,
        eos_token => eos_token,
    })
    .map_err(|e| ModelError::ChatTemplate {
        reason: e.to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The ChatML template shape SmolLM2 uses (default system prompt when none is given).
    const CHATML: &str = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are helpful.<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

    #[test]
    fn renders_chatml_with_default_system_prompt() {
        let out = render_template(CHATML, &[ChatMessage::new("user", "Hi")], true, "", "").unwrap();
        assert_eq!(
            out,
            "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        );
    }

    #[test]
    fn template_errors_name_the_problem() {
        let t = "{{ raise_exception('Conversation roles must alternate') }}";
        let err = render_template(t, &[], false, "", "").unwrap_err();
        assert!(err.to_string().contains("roles must alternate"), "{err}");
    }

    #[test]
    fn python_string_methods_work() {
        let t = "{{ messages[0]['content'].strip() }}";
        let out = render_template(t, &[ChatMessage::new("user", "  x  ")], false, "", "").unwrap();
        assert_eq!(out, "x");
    }
}
