//! Acceptance policy: which draft nodes the target accepts, and the token it adds.
//!
//! Greedy: walk from the root; at each node, accept the child whose token equals the target's
//! argmax there; stop when none does. The target's argmax at the last accepted node is the
//! bonus token.
//!
//! Sampling ("target-only" tree rejection sampling, as SGLang's
//! `tree_speculative_sampling_target_only`): at a node with target distribution `p`, try the
//! children in order; child token `x` is accepted with probability `p(x)`; when rejected, `x` is
//! removed from `p` and the rest renormalised before trying the next child. If no child is
//! accepted, the bonus token is drawn from what is left of `p`. The output token at each step is
//! then distributed exactly as `p` (P(x_i) = prod_{j<i}(1 - p_j(x_j)) * p_i(x_i) = p(x_i)), so
//! sampling stays lossless whatever the draft proposed.

use rand::Rng;
use serde::Serialize;

use crate::tree::DraftTree;

/// Outcome of verifying one tree.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Acceptance {
    /// Accepted nodes from the root's first accepted child down (root excluded), in path order.
    pub accepted: Vec<usize>,
    /// The target's own token after the last accepted node.
    pub bonus: u32,
}

impl Acceptance {
    /// Tokens this round commits: the accepted draft tokens, then the bonus token.
    pub fn committed_tokens(&self, tree: &DraftTree) -> Vec<u32> {
        let mut out: Vec<u32> = self.accepted.iter().map(|&n| tree.tokens[n]).collect();
        out.push(self.bonus);
        out
    }

    /// The path from the root through the accepted nodes (what stays in the KV cache).
    pub fn path_with_root(&self) -> Vec<usize> {
        let mut path = vec![0];
        path.extend_from_slice(&self.accepted);
        path
    }
}

/// Greedy verification: `target_argmax[node]` is the target's argmax after node `node`.
pub fn verify_greedy(tree: &DraftTree, target_argmax: &[u32]) -> Acceptance {
    let mut accepted = Vec::new();
    let mut node = 0;
    'walk: loop {
        let want = target_argmax[node];
        for child in tree.children(node) {
            if tree.tokens[child] == want {
                accepted.push(child);
                node = child;
                continue 'walk;
            }
        }
        break;
    }
    Acceptance {
        accepted,
        bonus: target_argmax[node],
    }
}

/// Lossless sampling verification: `target_probs(node)` is the target's (temperature / top-k /
/// top-p adjusted) distribution after node `node`.
pub fn verify_sampling<R: Rng + ?Sized>(
    tree: &DraftTree,
    mut target_probs: impl FnMut(usize) -> Vec<f32>,
    rng: &mut R,
) -> Acceptance {
    let mut accepted = Vec::new();
    let mut node = 0;
    'walk: loop {
        let mut p = target_probs(node);
        for child in tree.children(node) {
            let x = tree.tokens[child] as usize;
            let px = p[x];
            if px > 0.0 && rng.random::<f32>() < px {
                accepted.push(child);
                node = child;
                continue 'walk;
            }
            // Rejected: remove x and renormalise the residual.
            let rest = 1.0 - px;
            p[x] = 0.0;
            if rest > 0.0 {
                for v in p.iter_mut() {
                    *v /= rest;
                }
            }
        }
        let bonus = sample(&p, rng);
        return Acceptance { accepted, bonus };
    }
}

fn sample<R: Rng + ?Sized>(probs: &[f32], rng: &mut R) -> u32 {
    let u: f64 = rng.random::<f64>() * probs.iter().map(|&p| p as f64).sum::<f64>();
    let mut acc = 0f64;
    let mut last = 0;
    for (i, &p) in probs.iter().enumerate() {
        if p > 0.0 {
            acc += p as f64;
            last = i;
            if u < acc {
                return i as u32;
            }
        }
    }
    last as u32
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    /// Tree: root -> {a=5, b=6}; a -> {c=7}. (Nodes 1=a, 2=b, 3=c.)
    fn small_tree() -> DraftTree {
        DraftTree::from_parents(vec![9, 5, 6, 7], vec![None, Some(0), Some(0), Some(1)])
    }

    #[test]
    fn greedy_accepts_the_matching_path_and_adds_the_bonus() {
        let tree = small_tree();
        // Target after root wants 5 (a), after a wants 7 (c), after c wants 3.
        let acc = verify_greedy(&tree, &[5, 7, 0, 3]);
        assert_eq!(acc.accepted, vec![1, 3]);
        assert_eq!(acc.bonus, 3);
        assert_eq!(acc.committed_tokens(&tree), vec![5, 7, 3]);
    }

    #[test]
    fn greedy_takes_a_sibling_when_the_first_child_misses() {
        let tree = small_tree();
        let acc = verify_greedy(&tree, &[6, 0, 4, 0]);
        assert_eq!(acc.accepted, vec![2]);
        assert_eq!(acc.bonus, 4);
    }

    #[test]
    fn greedy_rejects_everything_and_keeps_the_target_token() {
        let tree = small_tree();
        let acc = verify_greedy(&tree, &[8, 0, 0, 0]);
        assert!(acc.accepted.is_empty());
        assert_eq!(acc.bonus, 8);
    }

    /// The first output token of a round must be distributed exactly as the target's p at the
    /// root, whatever the draft proposes (here two children 5 and 6). Chi-square over 40k draws.
    #[test]
    fn sampling_keeps_the_target_distribution_at_the_root() {
        let tree = small_tree();
        let p_root = vec![0.05f32, 0.1, 0.0, 0.15, 0.0, 0.3, 0.1, 0.2, 0.1, 0.0];
        let p_a = vec![0.1f32; 10];
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        let n = 40_000;
        let mut counts = vec![0usize; 10];
        for _ in 0..n {
            let acc = verify_sampling(
                &tree,
                |node| {
                    if node == 0 {
                        p_root.clone()
                    } else {
                        p_a.clone()
                    }
                },
                &mut rng,
            );
            let first = acc.committed_tokens(&tree)[0] as usize;
            counts[first] += 1;
        }
        let chi2: f64 = p_root
            .iter()
            .zip(&counts)
            .filter(|(p, _)| **p > 0.0)
            .map(|(&p, &c)| {
                let e = p as f64 * n as f64;
                (c as f64 - e).powi(2) / e
            })
            .sum();
        // 6 degrees of freedom (7 non-zero cells): the 99.9% quantile is 22.46.
        assert!(chi2 < 22.46, "chi2 {chi2}, counts {counts:?}");
        assert_eq!(
            counts[2] + counts[4] + counts[9],
            0,
            "zero-probability tokens never appear"
        );
    }
}
