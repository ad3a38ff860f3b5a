//! What a request must satisfy to join a running batch, decided in one place for every engine
//! (the burn engine, the CUDA fast engine, the target-only engine), so that they refuse the
//! same requests with the same words. Before this, each engine had its own longest-prompt rule
//! and only the fast engine refused an id given twice in one call or counted the model's
//! position limit.

use crate::engine::{InferError, Request, check_request_alone};

/// The limits of one batch under one engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Admission {
    /// Cache columns each sequence of the batch may use.
    pub capacity: usize,
    /// The model's position limit (`max_position_embeddings`).
    pub max_positions: usize,
    /// Columns one round appends per sequence before it is compacted: the tree's width when
    /// speculating, 1 for a target-only decode step.
    pub round_width: usize,
    /// The target's vocabulary (prompt tokens must be inside it).
    pub vocab: usize,
}

impl Admission {
    /// The longest prompt the batch accepts: after it, the first token and one whole round
    /// must still fit, both in the cache and in the model's positions.
    pub fn max_prompt_len(&self) -> usize {
        self.capacity
            .min(self.max_positions)
            .saturating_sub(self.round_width + 1)
    }

    /// Checks `requests` (one admit call) against the batch whose running ids `running` are:
    /// every request on its own, then its id against the batch and against the earlier
    /// requests of the same call. The first problem is the error; nothing is admitted then.
    pub fn check(&self, requests: &[Request], running: &[u64]) -> Result<(), InferError> {
        let room = self.max_prompt_len();
        for (i, r) in requests.iter().enumerate() {
            check_request_alone(r, self.vocab)?;
            let reason = if r.prompt.len() > room {
                format!(
                    "a prompt of {} tokens does not fit the context: at most {room} tokens leave \
                     room for the first token and one round of {} in {} columns ({} positions)",
                    r.prompt.len(),
                    self.round_width,
                    self.capacity,
                    self.max_positions
                )
            } else if running.contains(&r.id) {
                format!("request id {} is already running", r.id)
            } else if requests[..i].iter().any(|o| o.id == r.id) {
                format!("request id {} is given twice", r.id)
            } else {
                continue;
            };
            return Err(InferError::Request { reason });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(id: u64, prompt_len: usize) -> Request {
        request_with(id, vec![1; prompt_len])
    }

    fn request_with(id: u64, prompt: Vec<u32>) -> Request {
        Request {
            id,
            prompt,
            max_new_tokens: 4,
            stop_ids: Vec::new(),
            sampling: tandem_model::SamplingParams::greedy(),
            seed: 0,
        }
    }

    const RULES: Admission = Admission {
        capacity: 64,
        max_positions: 8192,
        round_width: 4,
        vocab: 100,
    };

    #[test]
    fn the_longest_prompt_leaves_the_first_token_and_one_round() {
        // 64 columns: a prompt of 59 + the first token + a round of 4 = 64.
        assert_eq!(RULES.max_prompt_len(), 59);
        assert!(RULES.check(&[request(1, 59)], &[]).is_ok());
        let err = RULES.check(&[request(1, 60)], &[]).unwrap_err().to_string();
        assert!(err.contains("a prompt of 60 tokens does not fit"), "{err}");
        // The position limit binds when it is below the cache.
        let short = Admission {
            max_positions: 32,
            ..RULES
        };
        assert_eq!(short.max_prompt_len(), 27);
        // Target-only: a decode step is one column.
        let plain = Admission {
            round_width: 1,
            ..RULES
        };
        assert_eq!(plain.max_prompt_len(), 62);
        // A batch too small for even one round accepts nothing.
        let tiny = Admission {
            capacity: 4,
            ..RULES
        };
        assert_eq!(tiny.max_prompt_len(), 0);
        assert!(tiny.check(&[request(1, 1)], &[]).is_err());
    }

    #[test]
    fn ids_must_be_new_to_the_batch_and_to_the_call() {
        let err = RULES
            .check(&[request(7, 3)], &[5, 7])
            .unwrap_err()
            .to_string();
        assert!(err.contains("request id 7 is already running"), "{err}");
        let err = RULES
            .check(&[request(1, 3), request(2, 3), request(1, 3)], &[5])
            .unwrap_err()
            .to_string();
        assert!(err.contains("request id 1 is given twice"), "{err}");
        assert!(
            RULES
                .check(&[request(1, 3), request(2, 3)], &[5, 6])
                .is_ok()
        );
    }

    #[test]
    fn a_request_is_checked_on_its_own_first() {
        let err = RULES.check(&[request(1, 0)], &[]).unwrap_err().to_string();
        assert!(err.contains("at least one token"), "{err}");
        let outside = request_with(1, vec![100]);
        let err = RULES.check(&[outside], &[]).unwrap_err().to_string();
        assert!(err.contains("outside the vocabulary of 100"), "{err}");
    }
}
