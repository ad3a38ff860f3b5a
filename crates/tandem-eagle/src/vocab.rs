//! The draft vocabulary: which target tokens the head can propose, and the two buffers that
//! encode it in every EAGLE-3 checkpoint.
//!
//! - `d2t` (int64, `[draft_vocab]`) stores OFFSETS: draft id `i` is target id `i + d2t[i]`.
//! - `t2d` (bool, `[vocab]`) marks the target ids that are in the draft vocabulary.
//!
//! Draft ids are assigned in increasing target-id order (SpecForge sorts the chosen ids), so
//! `logits[..., t2d]` on the target side lines up with `lm_head` rows on the draft side.
//! Saving ids instead of offsets in `d2t` makes every proposed token wrong (facts section 6.7);
//! [`VocabMap::from_buffers`] rejects buffers that are not offsets of an increasing id list.

use crate::error::EagleError;

/// The draft vocabulary of a head, as the `d2t` / `t2d` buffers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VocabMap {
    /// `[draft_vocab]` offsets: target id of draft id `i` is `i + d2t[i]`.
    pub d2t: Vec<i64>,
    /// `[vocab]`: target id `j` is in the draft vocabulary.
    pub t2d: Vec<bool>,
}

/// Builds the draft vocabulary from token frequencies, as SpecForge does: the
/// `draft_vocab_size` most frequent target ids (ties broken by the smaller id), padded with the
/// smallest ids not yet chosen when fewer than `draft_vocab_size` ids occur at all, then sorted
/// by id.
///
/// `token_counts[j]` is how often target id `j` occurs (in assistant turns of the training
/// data); it may be shorter than `vocab_size` (missing ids count 0) but not longer.
pub fn build_vocab_map(
    token_counts: &[u64],
    draft_vocab_size: usize,
    vocab_size: usize,
) -> Result<VocabMap, EagleError> {
    if draft_vocab_size == 0 || draft_vocab_size > vocab_size {
        return Err(EagleError::Vocab {
            reason: format!(
                "draft vocab size {draft_vocab_size} must be in 1..={vocab_size} (the target \
                 vocab size)"
            ),
        });
    }
    if token_counts.len() > vocab_size {
        return Err(EagleError::Vocab {
            reason: format!(
                "token counts cover {} ids but the target vocabulary has {vocab_size}",
                token_counts.len()
            ),
        });
    }
    let mut seen: Vec<(u64, usize)> = token_counts
        .iter()
        .enumerate()
        .filter(|(_, c)| **c > 0)
        .map(|(id, c)| (*c, id))
        .collect();
    // Most frequent first; equal counts by increasing id, so the result is deterministic.
    seen.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
    seen.truncate(draft_vocab_size);
    let mut t2d = vec![false; vocab_size];
    for &(_, id) in &seen {
        t2d[id] = true;
    }
    let mut missing = draft_vocab_size - seen.len();
    for flag in t2d.iter_mut() {
        if missing == 0 {
            break;
        }
        if !*flag {
            *flag = true;
            missing -= 1;
        }
    }
    let d2t = t2d
        .iter()
        .enumerate()
        .filter(|(_, in_draft)| **in_draft)
        .enumerate()
        .map(|(draft_id, (target_id, _))| target_id as i64 - draft_id as i64)
        .collect();
    Ok(VocabMap { d2t, t2d })
}

impl VocabMap {
    /// The identity map (draft vocabulary = target vocabulary): all offsets 0.
    pub fn identity(vocab_size: usize) -> Self {
        VocabMap {
            d2t: vec![0; vocab_size],
            t2d: vec![true; vocab_size],
        }
    }

    /// Checks buffers read from a checkpoint: `d2t` must be offsets of strictly increasing
    /// in-range target ids, and `t2d` must mark exactly those ids.
    pub fn from_buffers(d2t: Vec<i64>, t2d: Vec<bool>) -> Result<Self, EagleError> {
        let vocab = t2d.len() as i64;
        let mut previous = -1i64;
        for (i, &offset) in d2t.iter().enumerate() {
            let id = i as i64 + offset;
            if id < 0 || id >= vocab {
                return Err(EagleError::Vocab {
                    reason: format!(
                        "d2t[{i}] = {offset} maps draft id {i} to target id {id}, outside \
                         0..{vocab}; d2t must hold offsets (target id = i + d2t[i]), not ids"
                    ),
                });
            }
            if id <= previous {
                return Err(EagleError::Vocab {
                    reason: format!(
                        "d2t maps draft ids {} and {i} to target ids {previous} and {id}, not \
                         increasing; d2t must hold offsets (target id = i + d2t[i]) of sorted ids",
                        i - 1
                    ),
                });
            }
            if !t2d[id as usize] {
                return Err(EagleError::Vocab {
                    reason: format!(
                        "draft id {i} maps to target id {id} but t2d[{id}] is false: d2t and t2d \
                         disagree"
                    ),
                });
            }
            previous = id;
        }
        let marked = t2d.iter().filter(|b| **b).count();
        if marked != d2t.len() {
            return Err(EagleError::Vocab {
                reason: format!(
                    "t2d marks {marked} target ids but d2t has {} entries",
                    d2t.len()
                ),
            });
        }
        Ok(VocabMap { d2t, t2d })
    }

    /// Rows of `lm_head`.
    pub fn draft_size(&self) -> usize {
        self.d2t.len()
    }

    /// The target vocabulary size.
    pub fn target_size(&self) -> usize {
        self.t2d.len()
    }

    /// Target id of draft id `draft_id` (`draft_id + d2t[draft_id]`).
    pub fn to_target(&self, draft_id: usize) -> u32 {
        (draft_id as i64 + self.d2t[draft_id]) as u32
    }

    /// Draft id of a target id, when the target id is in the draft vocabulary.
    pub fn to_draft(&self, target_id: u32) -> Option<usize> {
        let t = target_id as usize;
        if t >= self.t2d.len() || !self.t2d[t] {
            return None;
        }
        // Draft ids are sorted by target id, so the draft id is the rank of `t` among them.
        let ids = self.target_ids();
        ids.binary_search(&target_id).ok()
    }

    /// Target id of every draft id, `[draft_vocab]`, increasing.
    pub fn target_ids(&self) -> Vec<u32> {
        (0..self.d2t.len()).map(|i| self.to_target(i)).collect()
    }

    /// Whether target id `target_id` can be proposed by the head.
    pub fn contains(&self, target_id: u32) -> bool {
        self.t2d.get(target_id as usize).copied().unwrap_or(false)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Hand-worked: vocab 8, counts id:count = 1:5, 3:9, 4:9, 6:1, 7:2; draft 3 takes the
    /// three most frequent {3, 4, 1}, sorted [1, 3, 4]; offsets [1-0, 3-1, 4-2] = [1, 2, 2].
    #[test]
    fn top_n_sorted_and_written_as_offsets() {
        let counts = [0, 5, 0, 9, 9, 0, 1, 2];
        let map = build_vocab_map(&counts, 3, 8).unwrap();
        assert_eq!(map.d2t, vec![1, 2, 2]);
        assert_eq!(
            map.t2d,
            vec![false, true, false, true, true, false, false, false]
        );
        assert_eq!(map.target_ids(), vec![1, 3, 4]);
        assert_eq!(map.to_target(2), 4);
        assert_eq!(map.to_draft(3), Some(1));
        assert_eq!(map.to_draft(7), None);
    }

    /// Ties go to the smaller id: counts 2:4, 5:4, 6:4 with draft 2 keep {2, 5}.
    #[test]
    fn ties_break_by_smaller_id() {
        let counts = [0, 0, 4, 0, 0, 4, 4];
        let map = build_vocab_map(&counts, 2, 7).unwrap();
        assert_eq!(map.target_ids(), vec![2, 5]);
        assert_eq!(map.d2t, vec![2, 4]);
    }

    /// Fewer distinct ids than the draft vocabulary: pad with the smallest unused ids.
    /// Seen {5, 2}; draft 4 adds 0 and 1: ids [0, 1, 2, 5], offsets [0, 0, 0, 2].
    #[test]
    fn pads_with_smallest_unused_ids() {
        let counts = [0, 0, 3, 0, 0, 7];
        let map = build_vocab_map(&counts, 4, 6).unwrap();
        assert_eq!(map.target_ids(), vec![0, 1, 2, 5]);
        assert_eq!(map.d2t, vec![0, 0, 0, 2]);
        assert_eq!(map.t2d.iter().filter(|b| **b).count(), 4);
    }

    #[test]
    fn full_draft_vocab_is_the_identity() {
        let map = build_vocab_map(&[1, 0, 2], 3, 3).unwrap();
        assert_eq!(map, VocabMap::identity(3));
    }

    #[test]
    fn refuses_bad_sizes() {
        assert!(build_vocab_map(&[1, 2], 3, 2).is_err());
        assert!(build_vocab_map(&[1, 2, 3], 1, 2).is_err());
        assert!(build_vocab_map(&[], 0, 2).is_err());
    }

    /// Buffers round-trip through the checkpoint validator; ids stored instead of offsets are
    /// caught with a sentence naming the convention.
    #[test]
    fn validates_buffers_and_catches_ids_instead_of_offsets() {
        let map = build_vocab_map(&[0, 5, 0, 9, 9, 0, 1, 2], 3, 8).unwrap();
        let back = VocabMap::from_buffers(map.d2t.clone(), map.t2d.clone()).unwrap();
        assert_eq!(back, map);
        // Ids [1, 3, 4] written as if they were offsets map to 1, 4, 6.
        let err = VocabMap::from_buffers(vec![1, 3, 4], map.t2d.clone()).unwrap_err();
        assert!(err.to_string().contains("t2d[6] is false"), "{err}");
        let err = VocabMap::from_buffers(vec![1, 3, 9], map.t2d).unwrap_err();
        assert!(err.to_string().contains("offsets"), "{err}");
    }
}
