//! Decoding one record and turning it into a checked conversation.

use serde::Deserialize;

use crate::{Message, Role, SkipReason};

/// Why one record was rejected: category and specifics.
pub(crate) type Reject = (SkipReason, String);

/// A ShareGPT / chat JSONL record. Both spellings are accepted: `conversations` with
/// `from`/`value` (ShareGPT) and `messages` with `role`/`content` (OpenAI).
#[derive(Deserialize)]
struct ChatRecord {
    #[serde(default)]
    id: Option<serde_json::Value>,
    #[serde(alias = "messages")]
    conversations: Option<Vec<Turn>>,
    /// Some ShareGPT derivatives carry the system prompt beside the turns.
    #[serde(default)]
    system: Option<String>,
}

#[derive(Deserialize)]
struct Turn {
    #[serde(alias = "role")]
    from: Option<String>,
    #[serde(alias = "content")]
    value: Option<Content>,
}

/// Message text: a string, or OpenAI content parts (`[{"type": "text", "text": ...}]`).
#[derive(Deserialize)]
#[serde(untagged)]
enum Content {
    Text(String),
    Parts(Vec<Part>),
}

#[derive(Deserialize)]
struct Part {
    #[serde(rename = "type", default)]
    kind: Option<String>,
    #[serde(default)]
    text: Option<String>,
}

#[derive(Deserialize)]
struct MtBenchRecord {
    question_id: serde_json::Value,
    #[serde(default)]
    category: Option<String>,
    turns: Vec<String>,
}

#[derive(Deserialize)]
struct HumanEvalRecord {
    task_id: String,
    prompt: String,
}

/// A record that decoded and passed the checks.
#[derive(Debug)]
pub(crate) struct Checked {
    /// Id from the record, if it has one.
    pub id: Option<String>,
    pub messages: Vec<Message>,
    pub leading_assistant_dropped: bool,
    pub consecutive_same_role: bool,
}

/// A record that decoded into the expected JSON shape, and the outcome of its checks.
#[derive(Debug)]
pub(crate) struct Parsed {
    /// Messages in the record as stored (before any check or drop).
    pub messages: u64,
    pub outcome: Result<Checked, Reject>,
}

/// Outcome of decoding one record: `Err` when it is not the expected JSON shape (not counted
/// as parsed).
pub(crate) type Decoded = Result<Parsed, Reject>;

fn parsed(messages: usize, outcome: Result<Checked, Reject>) -> Decoded {
    Ok(Parsed {
        messages: messages as u64,
        outcome,
    })
}

fn id_string(v: &serde_json::Value) -> Option<String> {
    match v {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Number(n) => Some(n.to_string()),
        _ => None,
    }
}

fn malformed(e: impl std::fmt::Display) -> Reject {
    (SkipReason::Malformed, e.to_string())
}

/// Checks the bytes are UTF-8; JSON text must be, and a lossy decode would put U+FFFD into
/// training data. A leading byte-order mark (first line of a JSONL file written on Windows)
/// is dropped: serde_json rejects it.
pub(crate) fn utf8(bytes: &[u8]) -> Result<&str, Reject> {
    let bytes = bytes.strip_prefix(crate::scan::BOM).unwrap_or(bytes);
    std::str::from_utf8(bytes).map_err(|e| {
        (
            SkipReason::NonUtf8,
            format!("invalid UTF-8 at byte {} of the record", e.valid_up_to()),
        )
    })
}

/// Decodes a ShareGPT / chat record.
pub(crate) fn decode_chat(text: &str, require_assistant: bool) -> Decoded {
    let rec: ChatRecord = serde_json::from_str(text).map_err(malformed)?;
    let Some(turns) = rec.conversations else {
        return Err(malformed("no `conversations` or `messages` list"));
    };
    let n_turns = turns.len();
    let mut raw = Vec::with_capacity(n_turns + 1);
    if let Some(system) = rec.system.filter(|s| !s.trim().is_empty()) {
        raw.push((Role::System, Some(system)));
    }
    for (i, turn) in turns.into_iter().enumerate() {
        let n = i + 1;
        let Some(name) = turn.from else {
            return Err(malformed(format!("turn {n} has no `from`/`role`")));
        };
        let text = match turn.value {
            None => None,
            Some(Content::Text(s)) => Some(s),
            Some(Content::Parts(parts)) => {
                let mut s = String::new();
                for p in parts {
                    match (p.kind.as_deref(), p.text) {
                        (None | Some("text"), Some(t)) => s.push_str(&t),
                        (kind, _) => {
                            return Err(malformed(format!(
                                "turn {n} has a non-text content part ({})",
                                kind.unwrap_or("untyped")
                            )));
                        }
                    }
                }
                Some(s)
            }
        };
        let Some(role) = Role::parse(&name) else {
            let why = (
                SkipReason::UnknownRole,
                format!("turn {n} has role {name:?}"),
            );
            return parsed(n_turns, Err(why));
        };
        raw.push((role, text));
    }
    let id = rec.id.as_ref().and_then(id_string);
    parsed(n_turns, check(id, raw, require_assistant))
}

/// Decodes an MT-Bench question into its first turn (the conversation reader's view).
pub(crate) fn decode_mtbench(text: &str, require_assistant: bool) -> Decoded {
    let (id, _, turns) = decode_mtbench_full(text)?;
    let n_turns = turns.len();
    let raw = turns.into_iter().take(1).map(|t| (Role::User, Some(t)));
    parsed(n_turns, check(Some(id), raw.collect(), require_assistant))
}

/// Decodes an MT-Bench question: (id, category, turns).
pub(crate) fn decode_mtbench_full(text: &str) -> Result<(String, String, Vec<String>), Reject> {
    let rec: MtBenchRecord = serde_json::from_str(text).map_err(malformed)?;
    let id = id_string(&rec.question_id)
        .ok_or_else(|| malformed("`question_id` is neither a string nor a number"))?;
    Ok((id, rec.category.unwrap_or_default(), rec.turns))
}

/// Decodes a HumanEval task into a single user message holding the prompt.
pub(crate) fn decode_humaneval(text: &str, require_assistant: bool) -> Decoded {
    let (id, prompt) = decode_humaneval_full(text)?;
    let raw = vec![(Role::User, Some(prompt))];
    parsed(1, check(Some(id), raw, require_assistant))
}

/// Decodes a HumanEval task: (task_id, prompt).
pub(crate) fn decode_humaneval_full(text: &str) -> Result<(String, String), Reject> {
    let rec: HumanEvalRecord = serde_json::from_str(text).map_err(malformed)?;
    Ok((rec.task_id, rec.prompt))
}

/// The conversation checks, in this order (the first failure names the skip):
/// 1. no messages at all: `EmptyConversation`;
/// 2. assistant turns right after the leading system messages are dropped (a sample must
///    start with a prompt; SpecForge / FastChat do the same);
/// 3. an empty or whitespace-only message among the rest: `EmptyMessage` (dropping it would
///    merge two turns of the other side or orphan an answer, so the conversation goes);
/// 4. a system message after the first user/assistant message: `MisplacedSystem`;
/// 5. no user message, or none from the assistant when required: `SingleRole`.
///
/// Consecutive same-role messages are kept unchanged (chat templates render them as separate
/// turns, and merging would invent a separator) and only flagged.
fn check(
    id: Option<String>,
    raw: Vec<(Role, Option<String>)>,
    require_assistant: bool,
) -> Result<Checked, Reject> {
    if raw.is_empty() {
        return Err((SkipReason::EmptyConversation, "no messages".into()));
    }
    let total = raw.len();
    let n_system = raw.iter().take_while(|(r, _)| *r == Role::System).count();
    let n_leading_assistant = raw[n_system..]
        .iter()
        .take_while(|(r, _)| *r == Role::Assistant)
        .count();
    let mut messages = Vec::with_capacity(total - n_leading_assistant);
    for (i, (role, text)) in raw.into_iter().enumerate() {
        if (n_system..n_system + n_leading_assistant).contains(&i) {
            continue;
        }
        let n = i + 1;
        let content = match text {
            Some(t) if !t.trim().is_empty() => t,
            _ => {
                return Err((
                    SkipReason::EmptyMessage,
                    format!("message {n} ({role}) is empty"),
                ));
            }
        };
        if role == Role::System && messages.len() > n_system {
            return Err((
                SkipReason::MisplacedSystem,
                format!("message {n} is a system message after the conversation started"),
            ));
        }
        messages.push(Message { role, content });
    }
    let has = |r: Role| messages.iter().any(|m| m.role == r);
    if !has(Role::User) {
        return Err((SkipReason::SingleRole, "no user message".into()));
    }
    if require_assistant && !has(Role::Assistant) {
        return Err((SkipReason::SingleRole, "no assistant message".into()));
    }
    let consecutive_same_role = messages.windows(2).any(|w| w[0].role == w[1].role);
    Ok(Checked {
        id,
        messages,
        leading_assistant_dropped: n_leading_assistant > 0,
        consecutive_same_role,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reason(d: Decoded) -> SkipReason {
        match d.map(|p| p.outcome) {
            Err((r, _)) | Ok(Err((r, _))) => r,
            Ok(Ok(c)) => panic!("expected a skip, got {c:?}"),
        }
    }

    fn ok(d: Decoded) -> Checked {
        match d.map(|p| p.outcome) {
            Ok(Ok(c)) => c,
            Err(e) | Ok(Err(e)) => panic!("expected a conversation, got {e:?}"),
        }
    }

    #[test]
    fn sharegpt_and_openai_spellings() {
        let sg = r#"{"id":"a_0","conversations":[{"from":"human","value":"hi"},{"from":"gpt","value":"yo","markdown":null}]}"#;
        let c = ok(decode_chat(sg, true));
        assert_eq!(c.id.as_deref(), Some("a_0"));
        assert_eq!(
            c.messages,
            [
                Message::new(Role::User, "hi"),
                Message::new(Role::Assistant, "yo")
            ]
        );
        let oa = r#"{"messages":[{"role":"system","content":"be nice"},{"role":"user","content":[{"type":"text","text":"h"},{"text":"i"}]},{"role":"assistant","content":"yo"}],"id":7}"#;
        let c = ok(decode_chat(oa, true));
        assert_eq!(c.id.as_deref(), Some("7"));
        assert_eq!(c.messages[0], Message::new(Role::System, "be nice"));
        assert_eq!(c.messages[1], Message::new(Role::User, "hi"));
        let with_system = r#"{"system":"sys","conversations":[{"from":"human","value":"q"},{"from":"gpt","value":"a"}]}"#;
        let c = ok(decode_chat(with_system, true));
        assert_eq!(c.id, None);
        assert_eq!(c.messages[0], Message::new(Role::System, "sys"));
    }

    #[test]
    fn each_skip_reason() {
        let conv = |turns: &str| format!(r#"{{"id":"x","conversations":[{turns}]}}"#);
        assert_eq!(reason(decode_chat("{", true)), SkipReason::Malformed);
        assert_eq!(reason(decode_chat("[1]", true)), SkipReason::Malformed);
        assert_eq!(
            reason(decode_chat(r#"{"id":"x"}"#, true)),
            SkipReason::Malformed
        );
        assert_eq!(
            reason(decode_chat(&conv(r#"{"value":"no role"}"#), true)),
            SkipReason::Malformed
        );
        assert_eq!(
            reason(decode_chat(
                &conv(r#"{"from":"human","value":[{"type":"image_url","image_url":{}}]}"#),
                true
            )),
            SkipReason::Malformed
        );
        assert_eq!(
            reason(decode_chat(&conv(""), true)),
            SkipReason::EmptyConversation
        );
        assert_eq!(
            reason(decode_chat(
                &conv(r#"{"from":"human","value":" \n"},{"from":"gpt","value":"a"}"#),
                true
            )),
            SkipReason::EmptyMessage
        );
        assert_eq!(
            reason(decode_chat(
                &conv(r#"{"from":"human","value":null},{"from":"gpt","value":"a"}"#),
                true
            )),
            SkipReason::EmptyMessage
        );
        assert_eq!(
            reason(decode_chat(
                &conv(r#"{"from":"human","value":"q"},{"from":"function","value":"{}"}"#),
                true
            )),
            SkipReason::UnknownRole
        );
        assert_eq!(
            reason(decode_chat(&conv(r#"{"from":"human","value":"q"}"#), true)),
            SkipReason::SingleRole
        );
        // Assistant-only: the leading assistant turns are dropped and no user remains.
        assert_eq!(
            reason(decode_chat(&conv(r#"{"from":"gpt","value":"a"}"#), true)),
            SkipReason::SingleRole
        );
        assert_eq!(
            reason(decode_chat(
                &conv(
                    r#"{"from":"human","value":"q"},{"from":"system","value":"s"},{"from":"gpt","value":"a"}"#
                ),
                true
            )),
            SkipReason::MisplacedSystem
        );
    }

    #[test]
    fn leading_assistant_dropped_system_kept_and_consecutive_flagged() {
        let t = r#"{"conversations":[
            {"from":"system","value":"s"},
            {"from":"gpt","value":"dropped 1"},
            {"from":"bard","value":"dropped 2"},
            {"from":"human","value":"q1"},
            {"from":"user","value":"q2"},
            {"from":"ChatGPT","value":"a"}]}"#;
        let c = ok(decode_chat(t, true));
        let roles: Vec<_> = c.messages.iter().map(|m| m.role).collect();
        assert_eq!(
            roles,
            [Role::System, Role::User, Role::User, Role::Assistant]
        );
        assert!(c.leading_assistant_dropped);
        assert!(c.consecutive_same_role);
        // An empty message among the dropped turns does not matter.
        let t = r#"{"conversations":[{"from":"gpt","value":""},{"from":"human","value":"q"},{"from":"gpt","value":"a"}]}"#;
        let c = ok(decode_chat(t, true));
        assert_eq!(c.messages.len(), 2);
        assert!(!c.consecutive_same_role);
    }

    #[test]
    fn prompt_only_when_assistant_not_required() {
        let t = r#"{"messages":[{"role":"user","content":"q"}]}"#;
        assert_eq!(reason(decode_chat(t, true)), SkipReason::SingleRole);
        assert_eq!(ok(decode_chat(t, false)).messages.len(), 1);
    }

    #[test]
    fn mtbench_and_humaneval_records() {
        let q = r#"{"question_id": 81, "category": "writing", "turns": ["one", "two"]}"#;
        let c = ok(decode_mtbench(q, false));
        assert_eq!(c.id.as_deref(), Some("81"));
        assert_eq!(c.messages, [Message::new(Role::User, "one")]);
        assert_eq!(
            decode_mtbench_full(q).unwrap(),
            (
                "81".into(),
                "writing".into(),
                vec!["one".into(), "two".into()]
            )
        );
        assert_eq!(
            reason(decode_mtbench(r#"{"question_id":1,"turns":[]}"#, false)),
            SkipReason::EmptyConversation
        );
        assert_eq!(
            reason(decode_mtbench(r#"{"question_id":1,"turns":[" "]}"#, false)),
            SkipReason::EmptyMessage
        );
        assert_eq!(
            reason(decode_mtbench(r#"{"question_id":[],"turns":["q"]}"#, false)),
            SkipReason::Malformed
        );
        let h = r#"{"task_id": "HumanEval/0", "prompt": "def f():\n", "test": "x"}"#;
        let c = ok(decode_humaneval(h, false));
        assert_eq!(c.id.as_deref(), Some("HumanEval/0"));
        assert_eq!(c.messages, [Message::new(Role::User, "def f():\n")]);
        assert_eq!(
            reason(decode_humaneval(r#"{"task_id":"t"}"#, false)),
            SkipReason::Malformed
        );
    }

    #[test]
    fn non_utf8_reports_the_offset() {
        let (r, detail) = utf8(b"{\"a\":\"\xff\"}").unwrap_err();
        assert_eq!(r, SkipReason::NonUtf8);
        assert!(detail.contains("byte 6"), "{detail}");
    }
}
