//! The normalised conversation model every reader produces.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// Speaker of a message, normalised from the many spellings datasets use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// System prompt.
    System,
    /// The human side (`human`, `user`).
    User,
    /// The model side (`gpt`, `assistant`, `chatgpt`, `bing`, `bard`, `model`).
    Assistant,
}

impl Role {
    /// Normalises a dataset's role name, case-insensitively and ignoring surrounding
    /// whitespace. `None` for names outside the known set (`function`, `tool`, ...): such
    /// conversations are skipped as [`crate::SkipReason::UnknownRole`], because guessing a
    /// side for tool output would teach the draft the wrong distribution.
    pub fn parse(name: &str) -> Option<Role> {
        const NAMES: [(&str, Role); 9] = [
            ("human", Role::User),
            ("user", Role::User),
            ("gpt", Role::Assistant),
            ("assistant", Role::Assistant),
            ("chatgpt", Role::Assistant),
            ("bing", Role::Assistant),
            ("bard", Role::Assistant),
            ("model", Role::Assistant),
            ("system", Role::System),
        ];
        let name = name.trim();
        NAMES
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|&(_, r)| r)
    }

    /// The role name chat templates expect (`system`, `user`, `assistant`).
    pub fn as_str(self) -> &'static str {
        match self {
            Role::System => "system",
            Role::User => "user",
            Role::Assistant => "assistant",
        }
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Error of [`Role::from_str`]: the name is not a known role.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown role {0:?}")]
pub struct UnknownRole(pub String);

impl FromStr for Role {
    type Err = UnknownRole;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Role::parse(s).ok_or_else(|| UnknownRole(s.to_owned()))
    }
}

/// One turn of a conversation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Message {
    /// Normalised speaker.
    pub role: Role,
    /// Text exactly as in the dataset (not trimmed: whitespace can be meaningful, e.g. code).
    pub content: String,
}

impl Message {
    /// Shorthand constructor.
    pub fn new(role: Role, content: impl Into<String>) -> Self {
        Message {
            role,
            content: content.into(),
        }
    }
}

/// A conversation that passed the checks of [`crate::DatasetReader`].
///
/// Guarantees: at least one user message; at least one assistant message unless the reader
/// allows prompt-only conversations (the default for evaluation formats); system messages only
/// at the start; the first non-system message is a user message; no message is empty or
/// whitespace-only. Consecutive messages of the same role are kept (see
/// [`Conversation::roles_alternate`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Conversation {
    /// Id from the dataset (`id`, `question_id`, `task_id`), or `record-N` / `line-N` when the
    /// record has none. Not guaranteed unique: ShareGPT V3 repeats 123 ids with different
    /// content, so key outputs by position if uniqueness matters.
    pub id: String,
    /// Messages in order.
    pub messages: Vec<Message>,
    /// Where it came from: the registry name, or the path given for a local file.
    pub source: String,
}

impl Conversation {
    /// Whether user and assistant messages strictly alternate after the leading system
    /// messages. Some chat templates (Llama-2, Mistral) raise on non-alternating input; the
    /// reader keeps such conversations, so a caller with such a template filters on this.
    pub fn roles_alternate(&self) -> bool {
        let mut turns = self.messages.iter().filter(|m| m.role != Role::System);
        let Some(mut prev) = turns.next().map(|m| m.role) else {
            return true;
        };
        for m in turns {
            if m.role == prev {
                return false;
            }
            prev = m.role;
        }
        true
    }

    /// Content of the first user message (the prompt, for evaluation and regeneration).
    pub fn first_user(&self) -> Option<&str> {
        self.messages
            .iter()
            .find(|m| m.role == Role::User)
            .map(|m| m.content.as_str())
    }
}

/// An evaluation prompt (MT-Bench question or HumanEval task) with all of its user turns.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EvalPrompt {
    /// `question_id` (MT-Bench) or `task_id` (HumanEval), as a string.
    pub id: String,
    /// MT-Bench category (`writing`, `coding`, ...); `humaneval` for HumanEval tasks.
    pub category: String,
    /// User turns in order: two for MT-Bench, one (the code prompt) for HumanEval.
    pub turns: Vec<String>,
}
