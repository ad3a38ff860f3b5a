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

/// Splits one join's prompts into prefill groups, each prefilled on its own (one step, padded to
/// its longest prompt). A prefill costs about a fixed part plus a part per padded slot: in
/// session 33's c=32/c=64 round logs (H200, SmolLM2) one-prompt prefills took ~2.7 ms + 13 us a
/// token, and batched ones 8-11 us a padded slot, where MT-Bench prompts padded to the longest
/// of 63 made 3.6 slots per prompt token (25,263 slots for 6,967 tokens, 202 ms). So the
/// prompts, longest first, are cut into the runs that minimise `groups * fixed_slots + padded
/// slots` (`fixed_slots`: the fixed part in slots). Returns indices into `lengths`, each group
/// longest first, the longest group first; one group when nothing is gained. Ties keep fewer
/// groups.
pub fn prefill_groups(lengths: &[usize], fixed_slots: usize) -> Vec<Vec<usize>> {
    let n = lengths.len();
    let mut order: Vec<usize> = (0..n).collect();
    // Longest first; equal lengths keep the call's order.
    order.sort_by_key(|&i| std::cmp::Reverse(lengths[i]));
    // best[j]: the least cost of the first j prompts (in `order`), cut[j]: where its last group
    // starts. A group order[i..j] costs fixed_slots + (j - i) * lengths[order[i]].
    let mut best = vec![0usize; n + 1];
    let mut cut = vec![0usize; n + 1];
    for j in 1..=n {
        best[j] = usize::MAX;
        for i in 0..j {
            let cost = best[i]
                .saturating_add(fixed_slots)
                .saturating_add((j - i).saturating_mul(lengths[order[i]]));
            if cost < best[j] {
                best[j] = cost;
                cut[j] = i;
            }
        }
    }
    let mut groups = Vec::new();
    let mut j = n;
    while j > 0 {
        let i = cut[j];
        groups.push(order[i..j].to_vec());
        j = i;
    }
    groups.reverse();
    groups
}

/// [`prefill_groups`]' fixed part, in slots, when `TANDEM_PREFILL_GROUPS` is unset: a prefill
/// step costs about as much as 256 padded slots (session 34's c=64 joins).
pub const DEFAULT_PREFILL_GROUP_SLOTS: usize = 256;

/// `TANDEM_PREFILL_GROUPS`' value as [`prefill_groups`]' fixed part, in slots: a whole number
/// above 0 sets it, 0 keeps one prefill a join (`None`), unset or anything else gives
/// [`DEFAULT_PREFILL_GROUP_SLOTS`].
pub fn prefill_group_slots(value: Option<&str>) -> Option<usize> {
    match value.and_then(|v| v.trim().parse::<usize>().ok()) {
        Some(0) => None,
        Some(slots) => Some(slots),
        None => Some(DEFAULT_PREFILL_GROUP_SLOTS),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefill_groups_cut_where_padding_costs_more_than_a_prefill() {
        // One long prompt and three short ones, 256 slots a prefill: together 256 + 4 * 400 =
        // 1,856; the long one alone, then the rest, 656 + 346 = 1,002; each alone 1,499.
        assert_eq!(
            prefill_groups(&[30, 400, 25, 20], 256),
            vec![vec![1], vec![0, 2, 3]]
        );
        // Equal lengths: nothing to gain, one group in the call's order.
        assert_eq!(prefill_groups(&[50, 50, 50], 256), vec![vec![0, 1, 2]]);
        // A dearer fixed part keeps one group: at 2,000 slots a prefill, 2,000 + 4 * 400 = 3,600
        // against 2,400 + 2,090 = 4,490 for the cut above.
        assert_eq!(
            prefill_groups(&[30, 400, 25, 20], 2_000),
            vec![vec![1, 0, 2, 3]]
        );
        // No fixed part: every distinct length alone (no padding at all).
        assert_eq!(
            prefill_groups(&[30, 400, 30, 20], 0),
            vec![vec![1], vec![0, 2], vec![3]]
        );
        // Nothing to split.
        assert_eq!(prefill_groups(&[], 256), Vec::<Vec<usize>>::new());
        assert_eq!(prefill_groups(&[7], 256), vec![vec![0]]);
    }

    #[test]
    fn prefill_groups_match_an_exhaustive_search() {
        // Every way of cutting the sorted prompts into runs, for a few ragged joins: the
        // dynamic programme's cost is the least of them.
        let cost = |lengths: &[usize], groups: &[Vec<usize>], fixed: usize| {
            groups
                .iter()
                .map(|g| fixed + g.len() * g.iter().map(|&i| lengths[i]).max().unwrap())
                .sum::<usize>()
        };
        let joins: [&[usize]; 4] = [
            &[401, 12, 350, 33, 90, 91, 7, 200],
            &[64, 64, 63, 1, 2, 300],
            &[5, 500, 5, 500, 5, 500],
            &[100, 90, 80, 70, 60, 50, 40, 30, 20, 10],
        ];
        for lengths in joins {
            for fixed in [0, 16, 100, 256, 1_000] {
                let groups = prefill_groups(lengths, fixed);
                let mut all: Vec<usize> = groups.iter().flatten().copied().collect();
                all.sort_unstable();
                assert_eq!(all, (0..lengths.len()).collect::<Vec<_>>(), "a partition");
                let mut sorted: Vec<usize> = (0..lengths.len()).collect();
                sorted.sort_by_key(|&i| std::cmp::Reverse(lengths[i]));
                let n = sorted.len();
                let mut least = usize::MAX;
                for mask in 0..(1u32 << (n - 1)) {
                    // Bit k set: a cut after sorted position k.
                    let mut runs = vec![vec![sorted[0]]];
                    for (k, &prompt) in sorted.iter().enumerate().skip(1) {
                        if mask & (1 << (k - 1)) != 0 {
                            runs.push(Vec::new());
                        }
                        runs.last_mut().unwrap().push(prompt);
                    }
                    least = least.min(cost(lengths, &runs, fixed));
                }
                assert_eq!(
                    cost(lengths, &groups, fixed),
                    least,
                    "{lengths:?} at {fixed}"
                );
            }
        }
    }

    #[test]
    fn the_group_switch_reads_whole_numbers_zero_turns_it_off_and_the_rest_keeps_the_default() {
        assert_eq!(prefill_group_slots(None), Some(DEFAULT_PREFILL_GROUP_SLOTS));
        assert_eq!(prefill_group_slots(Some("512")), Some(512));
        assert_eq!(prefill_group_slots(Some(" 64 ")), Some(64));
        assert_eq!(prefill_group_slots(Some("0")), None);
        assert_eq!(
            prefill_group_slots(Some("on")),
            Some(DEFAULT_PREFILL_GROUP_SLOTS)
        );
    }

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
