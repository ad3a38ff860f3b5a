//! The OpenAI wire format: request bodies, their validation into one [`Generation`], response
//! and streaming-chunk bodies, and the error body `{"error": {message, type, param, code}}`.
//! Every refusal names the field at fault (`param`), as the OpenAI API does.

use serde::Deserialize;
use serde_json::{Value, json};
use tandem_model::{ChatMessage, SamplingParams};

/// An error answered to the client: HTTP status plus the OpenAI error body.
#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    pub status: u16,
    pub message: String,
    pub kind: &'static str,
    pub param: Option<String>,
    pub code: Option<&'static str>,
}

impl ApiError {
    /// 400: the request is malformed or a value is out of range.
    pub fn invalid(param: impl Into<Option<String>>, message: impl Into<String>) -> Self {
        Self {
            status: 400,
            message: message.into(),
            kind: "invalid_request_error",
            param: param.into(),
            code: None,
        }
    }
    pub fn model_not_found(requested: &str, served: &str) -> Self {
        Self {
            status: 404,
            message: format!(
                "The model `{requested}` does not exist; this server serves `{served}`"
            ),
            kind: "invalid_request_error",
            param: Some("model".into()),
            code: Some("model_not_found"),
        }
    }
    pub fn overloaded(queue: usize) -> Self {
        Self {
            status: 429,
            message: format!(
                "The server is busy: the request queue ({queue}) is full; retry later"
            ),
            kind: "rate_limit_error",
            param: None,
            code: Some("queue_full"),
        }
    }
    /// The HTTP layer refused the body itself (413 over the size limit, 400 unreadable).
    pub fn body_rejected(status: u16, message: impl Into<String>) -> Self {
        Self {
            status,
            message: format!("The request body was refused: {}", message.into()),
            kind: "invalid_request_error",
            param: None,
            code: (status == 413).then_some("request_too_large"),
        }
    }
    pub fn unavailable(message: impl Into<String>) -> Self {
        Self {
            status: 503,
            message: message.into(),
            kind: "server_error",
            param: None,
            code: Some("shutting_down"),
        }
    }
    pub fn internal(message: impl Into<String>) -> Self {
        Self {
            status: 500,
            message: message.into(),
            kind: "server_error",
            param: None,
            code: None,
        }
    }
    pub fn not_found(path: &str) -> Self {
        Self {
            status: 404,
            message: format!("Unknown route {path}"),
            kind: "invalid_request_error",
            param: None,
            code: Some("unknown_url"),
        }
    }
    pub fn body(&self) -> Value {
        json!({"error": {
            "message": self.message,
            "type": self.kind,
            "param": self.param,
            "code": self.code,
        }})
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum OneOrMany {
    One(String),
    Many(Vec<String>),
}

impl OneOrMany {
    fn into_vec(self) -> Vec<String> {
        match self {
            OneOrMany::One(s) => vec![s],
            OneOrMany::Many(v) => v,
        }
    }
}

#[derive(Debug, Clone, Default, Deserialize)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
}

/// `POST /v1/completions`. Fields we do not implement are refused by name when they would
/// change the result (`n > 1`, `echo`, `logprobs`, `best_of`); the rest are ignored.
#[derive(Debug, Clone, Deserialize)]
pub struct CompletionRequest {
    pub model: Option<String>,
    pub prompt: OneOrMany,
    #[serde(flatten)]
    pub common: CommonFields,
    #[serde(default)]
    pub echo: bool,
    pub logprobs: Option<Value>,
    pub best_of: Option<i64>,
}

/// `POST /v1/chat/completions`.
#[derive(Debug, Clone, Deserialize)]
pub struct ChatRequest {
    pub model: Option<String>,
    pub messages: Vec<ChatMessageIn>,
    pub max_completion_tokens: Option<i64>,
    #[serde(flatten)]
    pub common: CommonFields,
    #[serde(default)]
    pub logprobs: Option<bool>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct ChatMessageIn {
    pub role: String,
    #[serde(default)]
    pub content: Option<MessageContent>,
}

/// A message's content: a string, or a list of parts of which only text parts are supported.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum MessageContent {
    Text(String),
    Parts(Vec<ContentPart>),
}

#[derive(Debug, Clone, Deserialize)]
pub struct ContentPart {
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(default)]
    pub text: Option<String>,
}

/// Sampling and control fields shared by both endpoints.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct CommonFields {
    pub max_tokens: Option<i64>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    /// Not OpenAI, but vLLM and SGLang accept it; -1 or 0 = off.
    pub top_k: Option<i64>,
    #[serde(default)]
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    pub stop: Option<OneOrMany>,
    pub seed: Option<u64>,
    pub n: Option<i64>,
}

/// What to generate from.
#[derive(Debug, Clone, PartialEq)]
pub enum PromptSource {
    /// Raw text (completions): tokenised with the tokenizer's special tokens.
    Text(String),
    /// A conversation (chat): rendered with the model's chat template.
    Chat(Vec<ChatMessage>),
}

/// A validated request of either endpoint.
#[derive(Debug, Clone, PartialEq)]
pub struct Generation {
    pub prompt: PromptSource,
    /// `None` = the server default (bounded by the context).
    pub max_tokens: Option<usize>,
    pub sampling: SamplingParams,
    pub stop: Vec<String>,
    pub stream: bool,
    pub include_usage: bool,
    pub seed: Option<u64>,
}

/// Parses JSON, naming the field path of a type error (`messages[0].role`).
fn parse<T: for<'de> Deserialize<'de>>(body: &[u8]) -> Result<T, ApiError> {
    let mut de = serde_json::Deserializer::from_slice(body);
    serde_path_to_error::deserialize(&mut de).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        if inner.is_syntax() || inner.is_eof() {
            ApiError::invalid(None, format!("The body is not valid JSON: {inner}"))
        } else {
            let param = (path != ".").then_some(path);
            ApiError::invalid(param, format!("Invalid request body: {inner}"))
        }
    })
}

/// [`parse`] for a request that flattens [`CommonFields`]: serde's `flatten` buffers those
/// fields and loses their path, so a type error in one (`"max_tokens": "8"`) would name no
/// `param`. They are parsed on their own first (unknown keys are ignored there), which names
/// the field; then the whole request.
fn parse_with_common<T: for<'de> Deserialize<'de>>(body: &[u8]) -> Result<T, ApiError> {
    match parse::<CommonFields>(body) {
        // A syntax error is reported by the full parse, with the same message.
        Err(e) if e.param.is_some() => Err(e),
        _ => parse(body),
    }
}

fn check_model(model: &Option<String>, served: &str) -> Result<(), ApiError> {
    match model {
        Some(m) if m != served => Err(ApiError::model_not_found(m, served)),
        _ => Ok(()),
    }
}

/// The fields both endpoints share, validated, around `prompt`.
fn validate_common(
    c: CommonFields,
    max_tokens: Option<i64>,
    max_tokens_field: &str,
    prompt: PromptSource,
) -> Result<Generation, ApiError> {
    let max_tokens = match max_tokens.or(c.max_tokens) {
        None => None,
        Some(n) if n >= 1 => Some(n as usize),
        Some(n) => {
            return Err(ApiError::invalid(
                max_tokens_field.to_owned(),
                format!("{max_tokens_field} must be at least 1, got {n}"),
            ));
        }
    };
    let temperature = c.temperature.unwrap_or(1.0);
    if !temperature.is_finite() || !(0.0..=2.0).contains(&temperature) {
        return Err(ApiError::invalid(
            "temperature".to_owned(),
            format!("temperature must be in [0, 2], got {temperature}"),
        ));
    }
    let top_p = c.top_p.unwrap_or(1.0);
    if !top_p.is_finite() || top_p <= 0.0 || top_p > 1.0 {
        return Err(ApiError::invalid(
            "top_p".to_owned(),
            format!("top_p must be in (0, 1], got {top_p}"),
        ));
    }
    let top_k = match c.top_k.unwrap_or(0) {
        -1 | 0 => 0,
        k if k > 0 => k as usize,
        k => {
            return Err(ApiError::invalid(
                "top_k".to_owned(),
                format!("top_k must be -1, 0 (off) or positive, got {k}"),
            ));
        }
    };
    if let Some(n) = c.n
        && n != 1
    {
        return Err(ApiError::invalid(
            "n".to_owned(),
            format!("only n = 1 is supported, got {n}"),
        ));
    }
    let stop = c.stop.map(OneOrMany::into_vec).unwrap_or_default();
    if stop.len() > 4 {
        return Err(ApiError::invalid(
            "stop".to_owned(),
            format!("at most 4 stop sequences are allowed, got {}", stop.len()),
        ));
    }
    if stop.iter().any(String::is_empty) {
        return Err(ApiError::invalid(
            "stop".to_owned(),
            "stop sequences must not be empty",
        ));
    }
    let sampling = SamplingParams {
        temperature: temperature as f32,
        top_p: top_p as f32,
        top_k,
    };
    Ok(Generation {
        prompt,
        max_tokens,
        sampling,
        stop,
        stream: c.stream.unwrap_or(false),
        include_usage: c.stream_options.unwrap_or_default().include_usage,
        seed: c.seed,
    })
}

/// Validates a `/v1/completions` body for the model `served`.
pub fn parse_completion(body: &[u8], served: &str) -> Result<Generation, ApiError> {
    let r: CompletionRequest = parse_with_common(body)?;
    check_model(&r.model, served)?;
    if r.echo {
        return Err(ApiError::invalid(
            "echo".to_owned(),
            "echo is not supported",
        ));
    }
    if r.logprobs.as_ref().is_some_and(|v| !v.is_null()) {
        return Err(ApiError::invalid(
            "logprobs".to_owned(),
            "logprobs are not supported",
        ));
    }
    if r.best_of.is_some_and(|b| b != 1) {
        return Err(ApiError::invalid(
            "best_of".to_owned(),
            "only best_of = 1 is supported",
        ));
    }
    let mut prompts = r.prompt.into_vec();
    if prompts.len() != 1 {
        return Err(ApiError::invalid(
            "prompt".to_owned(),
            format!("exactly one prompt is supported, got {}", prompts.len()),
        ));
    }
    let prompt = prompts.remove(0);
    if prompt.is_empty() {
        return Err(ApiError::invalid(
            "prompt".to_owned(),
            "the prompt is empty",
        ));
    }
    validate_common(r.common, None, "max_tokens", PromptSource::Text(prompt))
}

/// Validates a `/v1/chat/completions` body for the model `served`.
pub fn parse_chat(body: &[u8], served: &str) -> Result<Generation, ApiError> {
    let r: ChatRequest = parse_with_common(body)?;
    check_model(&r.model, served)?;
    if r.logprobs == Some(true) {
        return Err(ApiError::invalid(
            "logprobs".to_owned(),
            "logprobs are not supported",
        ));
    }
    if r.messages.is_empty() {
        return Err(ApiError::invalid(
            "messages".to_owned(),
            "messages must contain at least one message",
        ));
    }
    let mut messages = Vec::with_capacity(r.messages.len());
    for (i, m) in r.messages.into_iter().enumerate() {
        let role = match m.role.as_str() {
            "system" | "user" | "assistant" => m.role,
            "developer" => "system".to_owned(),
            other => {
                return Err(ApiError::invalid(
                    format!("messages[{i}].role"),
                    format!(
                        "role `{other}` is not supported; use system, developer, user or assistant"
                    ),
                ));
            }
        };
        let content = match m.content {
            None => {
                return Err(ApiError::invalid(
                    format!("messages[{i}].content"),
                    "content is required",
                ));
            }
            Some(MessageContent::Text(t)) => t,
            Some(MessageContent::Parts(parts)) => {
                let mut text = String::new();
                for (j, p) in parts.into_iter().enumerate() {
                    match (p.kind.as_str(), p.text) {
                        ("text", Some(t)) => text.push_str(&t),
                        (kind, _) => {
                            return Err(ApiError::invalid(
                                format!("messages[{i}].content[{j}]"),
                                format!("only text content parts are supported, got `{kind}`"),
                            ));
                        }
                    }
                }
                text
            }
        };
        messages.push(ChatMessage::new(role, content));
    }
    let field = if r.max_completion_tokens.is_some() {
        "max_completion_tokens"
    } else {
        "max_tokens"
    };
    validate_common(
        r.common,
        r.max_completion_tokens,
        field,
        PromptSource::Chat(messages),
    )
}

/// Which endpoint a response is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    Completions,
    Chat,
}

/// Token counts and the speculative statistics of one request.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub total_tokens: usize,
}

/// The `tandem` extension field: what speculation did for this request.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct SpecUsage {
    /// Draft tokens the target accepted.
    pub accepted_draft_tokens: u64,
    /// Verification rounds.
    pub rounds: u64,
    /// Tokens committed per round (accepted drafts + 1).
    pub accept_length: f64,
    /// Per draft position, the share of rounds reaching it that accepted it.
    pub per_position_acceptance: Vec<f64>,
    /// Rounds by the draft shape the speculation policy chose (`steps/topk/tokens`, `none` for
    /// a round without drafts).
    pub shapes: std::collections::BTreeMap<String, u64>,
    /// The generated token ids (before stop-string truncation).
    pub completion_token_ids: Vec<u32>,
}

/// A full (non-streaming) response body.
#[allow(clippy::too_many_arguments)]
pub fn response_body(
    endpoint: Endpoint,
    id: &str,
    created: u64,
    model: &str,
    text: &str,
    finish_reason: &str,
    usage: &Usage,
    spec: &SpecUsage,
) -> Value {
    let choice = match endpoint {
        Endpoint::Completions => json!({
            "index": 0, "text": text, "finish_reason": finish_reason, "logprobs": null
        }),
        Endpoint::Chat => json!({
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "finish_reason": finish_reason,
            "logprobs": null
        }),
    };
    json!({
        "id": id,
        "object": match endpoint { Endpoint::Completions => "text_completion", Endpoint::Chat => "chat.completion" },
        "created": created,
        "model": model,
        "choices": [choice],
        "usage": usage,
        "tandem": spec,
    })
}

/// One streaming chunk: a text delta (`first` adds the assistant role for chat), or the final
/// chunk when `finish_reason` is set.
pub fn chunk_body(
    endpoint: Endpoint,
    id: &str,
    created: u64,
    model: &str,
    delta: &str,
    first: bool,
    finish_reason: Option<&str>,
) -> Value {
    let choice = match endpoint {
        Endpoint::Completions => json!({
            "index": 0, "text": delta, "finish_reason": finish_reason, "logprobs": null
        }),
        Endpoint::Chat => {
            let delta = if finish_reason.is_some() && delta.is_empty() {
                json!({})
            } else if first {
                json!({"role": "assistant", "content": delta})
            } else {
                json!({"content": delta})
            };
            json!({"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": null})
        }
    };
    json!({
        "id": id,
        "object": match endpoint { Endpoint::Completions => "text_completion", Endpoint::Chat => "chat.completion.chunk" },
        "created": created,
        "model": model,
        "choices": [choice],
    })
}

/// The usage chunk streamed last when `stream_options.include_usage` is set.
pub fn usage_chunk_body(
    endpoint: Endpoint,
    id: &str,
    created: u64,
    model: &str,
    usage: &Usage,
    spec: &SpecUsage,
) -> Value {
    json!({
        "id": id,
        "object": match endpoint { Endpoint::Completions => "text_completion", Endpoint::Chat => "chat.completion.chunk" },
        "created": created,
        "model": model,
        "choices": [],
        "usage": usage,
        "tandem": spec,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const MODEL: &str = "smollm2";

    fn chat(body: Value) -> Result<Generation, ApiError> {
        parse_chat(body.to_string().as_bytes(), MODEL)
    }

    #[test]
    fn a_minimal_chat_gets_openai_defaults() {
        let g =
            chat(json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})).unwrap();
        assert_eq!(
            g.prompt,
            PromptSource::Chat(vec![ChatMessage::new("user", "hi")])
        );
        assert_eq!(g.max_tokens, None);
        assert_eq!(g.sampling.temperature, 1.0);
        assert_eq!(g.sampling.top_p, 1.0);
        assert!(!g.stream);
    }

    #[test]
    fn text_parts_are_joined_and_developer_is_system() {
        let g = chat(json!({"messages": [
            {"role": "developer", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
        ], "max_completion_tokens": 7, "temperature": 0}))
        .unwrap();
        assert_eq!(
            g.prompt,
            PromptSource::Chat(vec![
                ChatMessage::new("system", "be brief"),
                ChatMessage::new("user", "ab")
            ])
        );
        assert_eq!(g.max_tokens, Some(7));
        assert!(g.sampling.is_greedy());
    }

    /// Each bad input is refused with 400 (404 for the model) naming its field.
    #[test]
    fn bad_inputs_name_their_field() {
        let cases: Vec<(Value, u16, Option<&str>)> = vec![
            (
                json!({"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]}),
                404,
                Some("model"),
            ),
            (json!({"messages": []}), 400, Some("messages")),
            (
                json!({"messages": [{"role": "robot", "content": "x"}]}),
                400,
                Some("messages[0].role"),
            ),
            (
                json!({"messages": [{"role": "user"}]}),
                400,
                Some("messages[0].content"),
            ),
            (
                json!({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}),
                400,
                Some("messages[0].content[0]"),
            ),
            (
                json!({"messages": [{"role": 3, "content": "x"}]}),
                400,
                Some("messages[0].role"),
            ),
            (
                json!({"messages": [{"role": "user", "content": "x"}], "temperature": 2.5}),
                400,
                Some("temperature"),
            ),
            (
                json!({"messages": [{"role": "user", "content": "x"}], "temperature": -0.1}),
                400,
                Some("temperature"),
            ),
            (
                json!({"messages": [{"role": "user", "content": "x"}], "top_p": 0}),
                400,
                Some("top_p"),
            ),
            (
                json!({"messages": [{"role": "user", "content": "x"}], "top_p": 1.5}),
                400,
                Some("top_p"),
            ),
            (
                json!({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}),
                400,
                Some("max_tokens"),
            ),
            (
                json!({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": -3}),
                400,
                Some("max_completion_tokens"),
            ),
            (
                json!({"messages": [{"role": "user", "content": "x"}], "n": 2}),
                400,
                Some("n"),
            ),
            (
                json!({"messages": [{"role": "user", "content": "x"}], "stop": ["a", "b", "c", "d", "e"]}),
                400,
                Some("stop"),
            ),
            (
                json!({"messages": [{"role": "user", "content": "x"}], "top_k": -4}),
                400,
                Some("top_k"),
            ),
            (json!({"messages": "hello"}), 400, Some("messages")),
            // Type errors in the flattened common fields name the field too.
            (
                json!({"messages": [{"role": "user", "content": "x"}], "max_tokens": "8"}),
                400,
                Some("max_tokens"),
            ),
            (
                json!({"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}),
                400,
                Some("temperature"),
            ),
            (json!({"model": MODEL}), 400, None),
        ];
        for (body, status, param) in cases {
            let err = chat(body.clone()).expect_err(&body.to_string());
            assert_eq!(err.status, status, "{body}: {err:?}");
            assert_eq!(err.param.as_deref(), param, "{body}: {err:?}");
            assert_eq!(err.body()["error"]["message"], json!(err.message));
        }
    }

    #[test]
    fn malformed_json_is_a_400_not_a_crash() {
        for body in [
            &b"{"[..],
            b"",
            b"not json",
            b"{\"messages\": [}",
            &[0xff, 0xfe][..],
        ] {
            let err = parse_chat(body, MODEL).unwrap_err();
            assert_eq!(err.status, 400);
            assert_eq!(err.kind, "invalid_request_error");
            let err = parse_completion(body, MODEL).unwrap_err();
            assert_eq!(err.status, 400);
        }
    }

    #[test]
    fn completions_accept_one_prompt_and_refuse_what_would_change_the_result() {
        let ok = parse_completion(
            json!({"model": MODEL, "prompt": ["Once"], "max_tokens": 5, "stop": "\n", "stream": true,
                   "stream_options": {"include_usage": true}, "seed": 4})
            .to_string()
            .as_bytes(),
            MODEL,
        )
        .unwrap();
        assert_eq!(ok.prompt, PromptSource::Text("Once".into()));
        assert_eq!(ok.stop, vec!["\n".to_owned()]);
        assert!(ok.stream && ok.include_usage);
        assert_eq!(ok.seed, Some(4));
        for (body, param) in [
            (json!({"prompt": ""}), "prompt"),
            (json!({"prompt": ["a", "b"]}), "prompt"),
            (json!({"prompt": "a", "echo": true}), "echo"),
            (json!({"prompt": "a", "logprobs": 2}), "logprobs"),
            (json!({"prompt": "a", "best_of": 3}), "best_of"),
            (json!({"prompt": "a", "max_tokens": "8"}), "max_tokens"),
            (json!({"prompt": "a", "stream": "yes"}), "stream"),
        ] {
            let err = parse_completion(body.to_string().as_bytes(), MODEL).unwrap_err();
            assert_eq!(err.param.as_deref(), Some(param), "{body}");
        }
    }

    #[test]
    fn chunks_follow_the_openai_shapes() {
        let first = chunk_body(Endpoint::Chat, "c1", 5, MODEL, "Hel", true, None);
        assert_eq!(first["object"], "chat.completion.chunk");
        assert_eq!(
            first["choices"][0]["delta"],
            json!({"role": "assistant", "content": "Hel"})
        );
        let last = chunk_body(Endpoint::Chat, "c1", 5, MODEL, "", false, Some("stop"));
        assert_eq!(last["choices"][0]["delta"], json!({}));
        assert_eq!(last["choices"][0]["finish_reason"], "stop");
        let text = chunk_body(Endpoint::Completions, "c1", 5, MODEL, "lo", false, None);
        assert_eq!(text["choices"][0]["text"], "lo");
        assert_eq!(text["choices"][0]["finish_reason"], Value::Null);
    }
}
