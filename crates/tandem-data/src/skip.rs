//! Skip reasons and the counters the dump job reports and stores.

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Serialize};

/// Why a record did not become a [`crate::Conversation`]. Serialised in snake_case
/// (`malformed`, `non_utf8`, ...), which is also what [`SkipReason::as_str`] returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SkipReason {
    /// Not valid JSON, or valid JSON of the wrong shape (missing or mistyped field), including
    /// the record cut off by a truncated file.
    Malformed,
    /// The record's bytes are not valid UTF-8 (JSON requires UTF-8).
    NonUtf8,
    /// The record has no messages at all.
    EmptyConversation,
    /// A message (after dropping leading assistant turns) is empty or whitespace-only.
    EmptyMessage,
    /// A message has a role outside [`crate::Role::parse`]'s set (`function`, `tool`, ...).
    UnknownRole,
    /// No user message, or (when assistant turns are required) no assistant message.
    SingleRole,
    /// A system message after the first user/assistant message: chat templates put the system
    /// prompt first, and moving it would change the conversation.
    MisplacedSystem,
    /// The file could not be read further (I/O error, corrupt gzip stream); it ends iteration.
    ReadError,
}

impl SkipReason {
    /// All reasons, in the order they are reported.
    pub const ALL: [SkipReason; 8] = [
        SkipReason::Malformed,
        SkipReason::NonUtf8,
        SkipReason::EmptyConversation,
        SkipReason::EmptyMessage,
        SkipReason::UnknownRole,
        SkipReason::SingleRole,
        SkipReason::MisplacedSystem,
        SkipReason::ReadError,
    ];

    /// Stable snake_case name, as serialised.
    pub fn as_str(self) -> &'static str {
        match self {
            SkipReason::Malformed => "malformed",
            SkipReason::NonUtf8 => "non_utf8",
            SkipReason::EmptyConversation => "empty_conversation",
            SkipReason::EmptyMessage => "empty_message",
            SkipReason::UnknownRole => "unknown_role",
            SkipReason::SingleRole => "single_role",
            SkipReason::MisplacedSystem => "misplaced_system",
            SkipReason::ReadError => "read_error",
        }
    }
}

impl fmt::Display for SkipReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Skipped records per reason. Serialises as a JSON object `{"malformed": 1, ...}` holding only
/// the reasons that occurred.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct SkipCounts(BTreeMap<SkipReason, u64>);

impl SkipCounts {
    /// Counts one skip.
    pub fn add(&mut self, reason: SkipReason) {
        *self.0.entry(reason).or_insert(0) += 1;
    }

    /// Skips for one reason (0 if none).
    pub fn get(&self, reason: SkipReason) -> u64 {
        self.0.get(&reason).copied().unwrap_or(0)
    }

    /// Skips over all reasons.
    pub fn total(&self) -> u64 {
        self.0.values().sum()
    }

    /// Whether nothing was skipped.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// `(reason, count)` for the reasons that occurred, in [`SkipReason`] order.
    pub fn iter(&self) -> impl Iterator<Item = (SkipReason, u64)> + '_ {
        self.0.iter().map(|(&r, &n)| (r, n))
    }

    /// Adds another set of counts (e.g. from a second dataset).
    pub fn merge(&mut self, other: &SkipCounts) {
        for (r, n) in other.iter() {
            *self.0.entry(r).or_insert(0) += n;
        }
    }
}

impl fmt::Display for SkipCounts {
    /// `malformed=1 single_role=140`, or `none`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.0.is_empty() {
            return f.write_str("none");
        }
        for (i, (r, n)) in self.iter().enumerate() {
            if i > 0 {
                f.write_str(" ")?;
            }
            write!(f, "{r}={n}")?;
        }
        Ok(())
    }
}

/// What a [`crate::DatasetReader`] has seen so far (only what was iterated: after `.take(n)`
/// the counts cover the records read, not the whole file).
///
/// Invariant: `records == kept + skipped.total()`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReadStats {
    /// Records encountered: array elements or non-blank lines, including unusable ones (the
    /// cut-off tail of a truncated file counts as one).
    pub records: u64,
    /// Records that decoded into the expected JSON shape (before the conversation checks).
    pub parsed: u64,
    /// Messages in the parsed records, as stored (before checks and drops).
    pub parsed_messages: u64,
    /// Conversations yielded.
    pub kept: u64,
    /// Messages in the kept conversations.
    pub messages: u64,
    /// Skipped records per reason.
    pub skipped: SkipCounts,
    /// Kept conversations that began (after system messages) with assistant turns, which were
    /// dropped: a training sample must start with a prompt. Common in ShareGPT V3, whose
    /// "split" cut long conversations into chunks.
    pub leading_assistant_dropped: u64,
    /// Kept conversations with two consecutive messages of the same role (kept as they are).
    pub consecutive_same_role: u64,
    /// The file ended before its closing `]` (a truncated JSON array).
    pub truncated: bool,
}

impl fmt::Display for ReadStats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} records, {} parsed ({} messages), {} kept ({} messages), skipped: {}; {} with \
             leading assistant turns dropped, {} with consecutive same-role turns{}",
            self.records,
            self.parsed,
            self.parsed_messages,
            self.kept,
            self.messages,
            self.skipped,
            self.leading_assistant_dropped,
            self.consecutive_same_role,
            if self.truncated {
                "; file truncated"
            } else {
                ""
            }
        )
    }
}
