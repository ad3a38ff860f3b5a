//! Token ids and the loss mask of a conversation, derived from the rendered chat template.
//!
//! Assistant spans are found by rendering conversation prefixes with the model's own template
//! rather than by searching for token patterns: for assistant message `i`,
//! `render(messages[..i], add_generation_prompt = true)` ends where its content starts, and
//! `render(messages[..=i])` ends after its end-of-turn trailer. Both must be prefixes of the
//! full render (otherwise the template rewrites earlier turns, and the error names it). The
//! byte spans are mapped to tokens with the tokenizer's offsets; a token is in a span when its
//! byte range overlaps it. Within a span, tokens after the last end-of-turn token (e.g. the
//! `\n` after `<|im_end|>`) are left out: serving stops at the end-of-turn token, so the draft
//! never predicts what follows it.

use tandem_model::{ChatMessage, TargetTokenizer};

use crate::error::DumpError;

/// Skip reason: no assistant token survives truncation to `max_len`.
pub const SKIP_TOO_LONG: &str = "too_long";
/// Skip reason: the chat template raised an error for this conversation.
pub const SKIP_TEMPLATE_ERROR: &str = "template_error";
/// Skip reason: the tokenizer failed on the rendered text.
pub const SKIP_TOKENIZER_ERROR: &str = "tokenizer_error";
/// Skip reason: the conversation has no assistant token at all.
pub const SKIP_NO_ASSISTANT: &str = "no_assistant_tokens";

/// A tokenised conversation with its loss mask.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MaskedTokens {
    /// Token ids of the full render, cut to `max_len`.
    pub input_ids: Vec<u32>,
    /// 1 for assistant tokens (content and end-of-turn token), else 0.
    pub loss_mask: Vec<u8>,
    /// Whether the render was longer than `max_len` and was cut.
    pub truncated: bool,
}

/// Why one conversation did not become a sample (the run goes on).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SampleSkip {
    /// One of the `SKIP_*` reasons.
    pub reason: &'static str,
    /// Specifics for a log line.
    pub detail: String,
}

fn skip(reason: &'static str, detail: impl ToString) -> SampleSkip {
    SampleSkip {
        reason,
        detail: detail.to_string(),
    }
}

/// Length of the common prefix of two strings, in bytes.
fn common_prefix(a: &str, b: &str) -> usize {
    a.bytes().zip(b.bytes()).take_while(|(x, y)| x == y).count()
}

/// Renders, tokenises and masks `messages`.
///
/// `Ok(Err(skip))` for a conversation to skip and count; `Err` only for a template that is
/// not prefix-stable, which would make every sample's mask wrong.
pub fn tokenize_conversation(
    tokenizer: &TargetTokenizer,
    template_sha256: &str,
    messages: &[ChatMessage],
    max_len: usize,
) -> Result<Result<MaskedTokens, SampleSkip>, DumpError> {
    let render = |msgs: &[ChatMessage], generation_prompt: bool| {
        tokenizer
            .render_chat(msgs, generation_prompt)
            .map_err(|e| skip(SKIP_TEMPLATE_ERROR, e))
    };
    let full = match render(messages, false) {
        Ok(s) => s,
        Err(s) => return Ok(Err(s)),
    };
    let not_stable = |what: String, prefix: &str| DumpError::TemplateNotPrefixStable {
        template_sha256: template_sha256.to_owned(),
        reason: format!(
            "{what} is not a prefix of the full render (they differ from byte {})",
            common_prefix(prefix, &full)
        ),
    };
    let mut spans = Vec::new();
    for (i, message) in messages.iter().enumerate() {
        if message.role != "assistant" {
            continue;
        }
        let (before, through) = match (render(&messages[..i], true), render(&messages[..=i], false))
        {
            (Ok(b), Ok(t)) => (b, t),
            (Err(s), _) | (_, Err(s)) => return Ok(Err(s)),
        };
        if !full.starts_with(&before) {
            return Err(not_stable(
                format!(
                    "the render of the first {i} messages with add_generation_prompt=true \
                     (where assistant turn {i} starts)"
                ),
                &before,
            ));
        }
        if !full.starts_with(&through) || through.len() < before.len() {
            return Err(not_stable(
                format!(
                    "the render of the first {} messages (where assistant turn {i} ends)",
                    i + 1
                ),
                &through,
            ));
        }
        spans.push((before.len(), through.len()));
    }
    let (mut ids, offsets) = match tokenizer.encode_with_offsets(&full, false) {
        Ok(x) => x,
        Err(e) => return Ok(Err(skip(SKIP_TOKENIZER_ERROR, e))),
    };
    let mut mask = vec![0u8; ids.len()];
    for &(start, end) in &spans {
        let inside: Vec<usize> = (0..ids.len())
            .filter(|&t| {
                let (s, e) = offsets[t];
                e > start && s < end
            })
            .collect();
        let last = inside
            .iter()
            .rposition(|&t| tokenizer.eos_ids.contains(&ids[t]))
            .unwrap_or(inside.len().saturating_sub(1));
        for &t in inside.iter().take(last + 1) {
            mask[t] = 1;
        }
    }
    if !mask.contains(&1) {
        return Ok(Err(skip(
            SKIP_NO_ASSISTANT,
            format!("{} assistant turns, no assistant token", spans.len()),
        )));
    }
    let truncated = ids.len() > max_len;
    if truncated {
        ids.truncate(max_len);
        mask.truncate(max_len);
        if !mask.contains(&1) {
            return Ok(Err(skip(
                SKIP_TOO_LONG,
                format!("no assistant token within the first {max_len} tokens"),
            )));
        }
    }
    Ok(Ok(MaskedTokens {
        input_ids: ids,
        loss_mask: mask,
        truncated,
    }))
}
