//! `--regenerate`: the target writes the assistant turns itself, batched.
//!
//! Conversations are regenerated turn by turn: round r generates the r-th assistant turn of
//! every conversation of the batch at once (ragged prefill of the prompts rendered with the
//! chat template, then one decode step per token, each sequence stopping on its own at an
//! end-of-turn token or its budget). Each (record, turn) samples from its own seeded stream,
//! so a reply does not depend on the batch it was generated in (greedy replies can still
//! differ in rare near-ties, since padding changes the floating-point summation order).

use rand::SeedableRng;
use rand::rngs::StdRng;
use tandem_model::{ChatMessage, SamplingParams, TargetTokenizer};

use crate::error::DumpError;
use crate::manifest::GenerationSettings;
use crate::mask::{SKIP_TEMPLATE_ERROR, SKIP_TOKENIZER_ERROR, SKIP_TOO_LONG, SampleSkip};
use tandem_model::CaptureTarget;

/// One conversation after regeneration.
#[derive(Debug, Clone)]
pub(crate) struct Regenerated {
    /// The conversation with the target's replies (cut before the first turn whose prompt no
    /// longer fits `max_len`).
    pub messages: Vec<ChatMessage>,
}

/// What the regeneration of a batch cost, for the tokens/s report.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct RegenStats {
    pub generated_tokens: u64,
    /// Assistant turns written.
    pub turns: u64,
    /// Turns that ended at their token budget instead of an end-of-turn token.
    pub cut_turns: u64,
    pub seconds: f64,
}

/// splitmix64: decorrelates the seeds of neighbouring (record, turn) pairs.
fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

fn turn_rng(seed: u64, record: u64, turn: usize) -> StdRng {
    StdRng::seed_from_u64(mix(mix(seed ^ mix(record)) ^ turn as u64))
}

/// Where the replies go: the conversation's own assistant positions, or, for prompt-only
/// conversations (evaluation sets), one reply after each run of user messages.
fn plan(messages: &[ChatMessage]) -> Vec<ChatMessage> {
    if messages.iter().any(|m| m.role == "assistant") {
        return messages.to_vec();
    }
    let mut out = Vec::with_capacity(messages.len() * 2);
    for (i, m) in messages.iter().enumerate() {
        out.push(m.clone());
        let next_is_user = messages.get(i + 1).is_some_and(|n| n.role == "user");
        if m.role == "user" && !next_is_user {
            out.push(ChatMessage::new("assistant", ""));
        }
    }
    out
}

struct State {
    record: u64,
    messages: Vec<ChatMessage>,
    /// Indices of the assistant messages still to write, in order.
    todo: Vec<usize>,
    next: usize,
    skip: Option<SampleSkip>,
}

/// Regenerates the assistant turns of `batch` (record ordinal, messages) with `model`.
pub(crate) fn regenerate(
    model: &dyn CaptureTarget,
    tokenizer: &TargetTokenizer,
    batch: &[(u64, Vec<ChatMessage>)],
    settings: &GenerationSettings,
    max_len: usize,
    stats: &mut RegenStats,
) -> Result<Vec<Result<Regenerated, SampleSkip>>, DumpError> {
    let sampling = SamplingParams {
        temperature: settings.temperature,
        top_p: settings.top_p,
        top_k: settings.top_k,
    };
    let mut states: Vec<State> = batch
        .iter()
        .map(|(record, messages)| {
            let messages = plan(messages);
            let todo = (0..messages.len())
                .filter(|&i| messages[i].role == "assistant")
                .collect();
            State {
                record: *record,
                messages,
                todo,
                next: 0,
                skip: None,
            }
        })
        .collect();
    let start = std::time::Instant::now();
    loop {
        // (state index, prompt, budget, rng) for every conversation with a turn left.
        let mut jobs = Vec::new();
        for (s, state) in states.iter_mut().enumerate() {
            if state.skip.is_some() || state.next >= state.todo.len() {
                continue;
            }
            let at = state.todo[state.next];
            let prompt = match tokenizer.render_chat(&state.messages[..at], true) {
                Ok(text) => match tokenizer.encode(&text, false) {
                    Ok(ids) => ids,
                    Err(e) => {
                        state.skip = Some(SampleSkip {
                            reason: SKIP_TOKENIZER_ERROR,
                            detail: e.to_string(),
                        });
                        continue;
                    }
                },
                Err(e) => {
                    state.skip = Some(SampleSkip {
                        reason: SKIP_TEMPLATE_ERROR,
                        detail: e.to_string(),
                    });
                    continue;
                }
            };
            if prompt.len() + 1 >= max_len
                || prompt.len() + 1 >= model.spec().max_position_embeddings
            {
                // No room for this turn: the conversation ends before it.
                state.messages.truncate(at);
                state.todo.truncate(state.next);
                if state.next == 0 {
                    state.skip = Some(SampleSkip {
                        reason: SKIP_TOO_LONG,
                        detail: format!(
                            "the prompt of the first assistant turn has {} tokens (max {max_len})",
                            prompt.len()
                        ),
                    });
                }
                continue;
            }
            let budget = settings
                .max_new_tokens
                .min(max_len - prompt.len())
                .min(model.spec().max_position_embeddings - prompt.len());
            let rng = turn_rng(settings.seed, state.record, state.next);
            jobs.push((s, prompt, budget, rng));
        }
        if jobs.is_empty() {
            break;
        }
        let prompts: Vec<&[u32]> = jobs.iter().map(|j| j.1.as_slice()).collect();
        let budgets: Vec<usize> = jobs.iter().map(|j| j.2).collect();
        let mut rngs: Vec<StdRng> = jobs.iter().map(|j| j.3.clone()).collect();
        let outputs =
            model.generate_batch(&prompts, &budgets, &sampling, &mut rngs, &tokenizer.eos_ids)?;
        for ((s, ..), (tokens, stopped)) in jobs.iter().zip(outputs) {
            let state = &mut states[*s];
            let at = state.todo[state.next];
            state.messages[at].content = tokenizer.decode(&tokens, false)?;
            stats.generated_tokens += tokens.len() as u64;
            stats.turns += 1;
            stats.cut_turns += u64::from(!stopped);
            state.next += 1;
        }
    }
    stats.seconds += start.elapsed().as_secs_f64();
    Ok(states
        .into_iter()
        .map(|s| match s.skip {
            Some(skip) => Err(skip),
            None => Ok(Regenerated {
                messages: s.messages,
            }),
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prompt_only_conversations_get_a_reply_after_each_user_run() {
        let m = |r: &str| ChatMessage::new(r, "x");
        let roles = |v: Vec<ChatMessage>| v.into_iter().map(|m| m.role).collect::<Vec<_>>();
        assert_eq!(
            roles(plan(&[m("system"), m("user"), m("user"), m("user")])),
            ["system", "user", "user", "user", "assistant"]
        );
        assert_eq!(
            roles(plan(&[m("user"), m("user")])),
            ["user", "user", "assistant"]
        );
        assert_eq!(
            roles(plan(&[m("user"), m("assistant"), m("user")])),
            ["user", "assistant", "user"],
            "conversations with replies keep their own structure"
        );
    }

    #[test]
    fn streams_differ_per_record_and_turn() {
        use rand::Rng;
        let a: u64 = turn_rng(0, 1, 0).random();
        let b: u64 = turn_rng(0, 2, 0).random();
        let c: u64 = turn_rng(0, 1, 1).random();
        let a2: u64 = turn_rng(0, 1, 0).random();
        assert_eq!(a, a2);
        assert!(a != b && a != c && b != c);
    }
}
