//! Draft trees in SGLang's scheme (EAGLE-2/3 "efficient" tree).
//!
//! Drafting runs `depth` steps. Step 0 expands the last verified token into its `topk` most
//! likely children (score = draft probability). Each later step expands the `topk` current beams
//! into `topk` children each, scores them by the product of probabilities along the path, and
//! keeps the best `topk` as the next beams. Every candidate of every step is recorded; the tree
//! that the target verifies is the root (the verified token) plus the `num_draft_tokens - 1`
//! best-scored candidates overall, kept in the order they were recorded so parents precede
//! children.
//!
//! The recorded lists use SGLang's layout so its published test case is our golden test:
//! `scores[i]`/`tokens[i]` of step 0 hold `topk` entries, of step i>0 `topk * topk` entries
//! (beam-major); `parents[0] = [-1, 0, .., topk-1]` and `parents[i]` (i>0) are the flat indices
//! of the beams chosen at step i.

use serde::Serialize;

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum TreeError {
    #[error(
        "draft tree needs topk >= 1, depth >= 1 and num_draft_tokens >= 2 (got topk {topk}, depth {depth}, num_draft_tokens {num_draft_tokens})"
    )]
    BadShape {
        topk: usize,
        depth: usize,
        num_draft_tokens: usize,
    },
    #[error(
        "num_draft_tokens {num_draft_tokens} exceeds the {available} candidates that topk {topk} and depth {depth} produce, plus the root"
    )]
    TooManyDraftTokens {
        num_draft_tokens: usize,
        available: usize,
        topk: usize,
        depth: usize,
    },
    #[error("step {step}: expected {expected} entries, got {got}")]
    StepSize {
        step: usize,
        expected: usize,
        got: usize,
    },
    #[error("selected candidate {index} has no selected parent (invalid tree)")]
    OrphanCandidate { index: usize },
}

/// One drafting step's candidates, in SGLang's flat layout.
#[derive(Debug, Clone, PartialEq)]
pub struct DraftStep {
    /// Cumulative path probabilities of the candidates.
    pub scores: Vec<f32>,
    pub tokens: Vec<u32>,
    /// Step 0: `[-1, 0, .., topk-1]`; step i>0: flat candidate indices of the chosen beams.
    pub parents: Vec<i64>,
}

/// The tree the target verifies: node 0 is the last verified token.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DraftTree {
    pub tokens: Vec<u32>,
    /// `parents[0] = None` (root); every other node's parent precedes it.
    pub parents: Vec<Option<usize>>,
    /// Depth of each node (root 0); the node's position is prefix length + depth.
    pub depth: Vec<usize>,
    /// First child of each node (SGLang `retrive_next_token`), the most recently recorded first.
    pub first_child: Vec<Option<usize>>,
    /// Next sibling of each node (SGLang `retrive_next_sibling`).
    pub next_sibling: Vec<Option<usize>>,
}

impl DraftTree {
    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// A chain: root followed by `draft` tokens, each the child of the previous one.
    pub fn chain(root: u32, draft: &[u32]) -> Self {
        let mut tokens = vec![root];
        tokens.extend_from_slice(draft);
        let parents = (0..tokens.len()).map(|i| i.checked_sub(1)).collect();
        Self::from_parents(tokens, parents)
    }

    /// Builds the child/sibling links from a parent array (parents precede children). Children
    /// are linked so that the most recently added child comes first, as SGLang's kernel does.
    pub fn from_parents(tokens: Vec<u32>, parents: Vec<Option<usize>>) -> Self {
        let n = tokens.len();
        let mut depth = vec![0usize; n];
        let mut first_child = vec![None; n];
        let mut next_sibling = vec![None; n];
        for i in 1..n {
            if let Some(p) = parents[i] {
                depth[i] = depth[p] + 1;
            }
        }
        // SGLang walks nodes from last to first and pushes each onto its parent's child list.
        for i in (1..n).rev() {
            if let Some(p) = parents[i] {
                next_sibling[i] = first_child[p];
                first_child[p] = Some(i);
            }
        }
        Self {
            tokens,
            parents,
            depth,
            first_child,
            next_sibling,
        }
    }

    /// Children of `node` in verification order.
    pub fn children(&self, node: usize) -> Vec<usize> {
        let mut out = Vec::new();
        let mut cur = self.first_child[node];
        while let Some(c) = cur {
            out.push(c);
            cur = self.next_sibling[c];
        }
        out
    }

    /// `mask[i * n + j]`: node i may attend to node j (an ancestor or itself).
    pub fn attention_mask(&self) -> Vec<bool> {
        let n = self.len();
        let mut mask = vec![false; n * n];
        for i in 0..n {
            let mut cur = Some(i);
            while let Some(c) = cur {
                mask[i * n + c] = true;
                cur = self.parents[c];
            }
        }
        mask
    }

    /// Absolute positions of the nodes after a prefix of `prefix_len` committed tokens (the root
    /// is the last verified token, not yet in the cache, so it sits at `prefix_len`).
    pub fn positions(&self, prefix_len: usize) -> Vec<usize> {
        self.depth.iter().map(|d| prefix_len + d).collect()
    }
}

/// Accumulates drafting steps (SGLang `select_top_k_tokens`) and organises them into the tree
/// to verify (SGLang `build_tree_kernel_efficient`).
#[derive(Debug, Clone)]
pub struct TreeBuilder {
    topk: usize,
    steps: Vec<DraftStep>,
    /// Cumulative scores of the current beams.
    beam_scores: Vec<f32>,
}

/// A beam to expand in the next drafting step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Beam {
    /// Which beam of the previous step it extends (index into the previous step's beams; for
    /// step 0 always 0, the root).
    pub from_beam: usize,
    pub token: u32,
}

impl TreeBuilder {
    pub fn new(topk: usize) -> Self {
        Self {
            topk,
            steps: Vec::new(),
            beam_scores: Vec::new(),
        }
    }

    pub fn steps(&self) -> &[DraftStep] {
        &self.steps
    }

    /// Records one drafting step from the draft's top-k per current beam (`probs[b][c]`,
    /// `tokens[b][c]`; one beam at step 0) and returns the beams to expand next, best first.
    pub fn push(&mut self, probs: &[Vec<f32>], tokens: &[Vec<u32>]) -> Vec<Beam> {
        let k = self.topk;
        if self.steps.is_empty() {
            let scores = probs[0][..k].to_vec();
            let toks = tokens[0][..k].to_vec();
            let mut parents = vec![-1i64];
            parents.extend((0..k as i64).collect::<Vec<_>>());
            self.beam_scores = scores.clone();
            self.steps.push(DraftStep {
                scores,
                tokens: toks.clone(),
                parents,
            });
            return toks
                .iter()
                .enumerate()
                .map(|(c, &token)| Beam {
                    from_beam: c,
                    token,
                })
                .collect();
        }
        let mut scores = Vec::with_capacity(k * k);
        let mut toks = Vec::with_capacity(k * k);
        for b in 0..k {
            for c in 0..k {
                scores.push(self.beam_scores[b] * probs[b][c]);
                toks.push(tokens[b][c]);
            }
        }
        let chosen = top_k_indices(&scores, k);
        // Flat index of the chosen candidates in the whole recorded score list.
        let offset = k + (self.steps.len() - 1) * k * k;
        let parents = chosen.iter().map(|&i| (offset + i) as i64).collect();
        self.beam_scores = chosen.iter().map(|&i| scores[i]).collect();
        let beams = chosen
            .iter()
            .map(|&i| Beam {
                from_beam: i / k,
                token: toks[i],
            })
            .collect();
        self.steps.push(DraftStep {
            scores,
            tokens: toks,
            parents,
        });
        beams
    }

    /// The tree to verify: `root` plus the `num_draft_tokens - 1` best candidates.
    pub fn build(&self, root: u32, num_draft_tokens: usize) -> Result<DraftTree, TreeError> {
        build_tree(root, &self.steps, self.topk, num_draft_tokens)
    }
}

/// One sequence's tree drafting on the host, shared by the burn and the fast engines: the
/// [`TreeBuilder`] plus the node table that says which drafted node extends which. Each draft
/// step re-runs every beam's whole path from the root ([`BeamSearch::paths`], laid out by
/// [`BeamStep`]) in one tree step of the head, so every beam attends to exactly its own
/// ancestors (the head cache's column validity is per sequence, not per query), and the step's
/// shape depends on `topk` and the depth only: `topk` paths of `depth` slots, the layout a
/// device can build without the host (`CudaDraft::draft_beams`). The engine keeps each
/// evaluated beam's hidden output by node index.
#[derive(Debug, Clone)]
pub struct BeamSearch {
    builder: TreeBuilder,
    /// `(token, parent node)`; `None` = a child of the root.
    nodes: Vec<(u32, Option<usize>)>,
    /// The nodes to expand next, best first.
    beams: Vec<usize>,
}

impl BeamSearch {
    pub fn new(topk: usize) -> Self {
        Self {
            builder: TreeBuilder::new(topk),
            nodes: Vec::new(),
            beams: Vec::new(),
        }
    }

    /// Records one draft step: the top-k (`probs[j]`, `tokens[j]`, target ids) of each current
    /// beam `j`, or of the root for the first step.
    pub fn push(&mut self, probs: &[Vec<f32>], tokens: &[Vec<u32>]) {
        let chosen = self.builder.push(probs, tokens);
        let previous = std::mem::take(&mut self.beams);
        for beam in chosen {
            self.nodes
                .push((beam.token, previous.get(beam.from_beam).copied()));
            self.beams.push(self.nodes.len() - 1);
        }
    }

    /// The current beams (node indices), in the order [`BeamSearch::push`] expects their top-k.
    pub fn beams(&self) -> &[usize] {
        &self.beams
    }

    /// The parent node of `node` (`None`: the root).
    pub fn parent(&self, node: usize) -> Option<usize> {
        self.nodes[node].1
    }

    /// The token of `node` (a target id).
    pub fn token(&self, node: usize) -> u32 {
        self.nodes[node].0
    }

    /// Each beam's path, in beam order: its nodes from the root's child down to the beam.
    pub fn paths(&self) -> Vec<Vec<usize>> {
        self.beams
            .iter()
            .map(|&beam| {
                let mut path = Vec::new();
                let mut cur = Some(beam);
                while let Some(c) = cur {
                    path.push(c);
                    cur = self.nodes[c].1;
                }
                path.reverse();
                path
            })
            .collect()
    }

    /// The steps recorded so far (SGLang's layout, [`DraftStep`]).
    pub fn steps(&self) -> &[DraftStep] {
        self.builder.steps()
    }

    /// The tree to verify: `root` plus the `num_draft_tokens - 1` best candidates.
    pub fn build(&self, root: u32, num_draft_tokens: usize) -> Result<DraftTree, TreeError> {
        self.builder.build(root, num_draft_tokens)
    }
}

/// Step 0 of every sequence's [`BeamSearch`] from its root's top-k: flat `[batch * k]`
/// probabilities and target token ids, row `b` for sequence `b`.
pub fn push_roots(searches: &mut [BeamSearch], k: usize, probs: &[f32], tokens: &[u32]) {
    for (b, search) in searches.iter_mut().enumerate() {
        search.push(
            &[probs[b * k..(b + 1) * k].to_vec()],
            &[tokens[b * k..(b + 1) * k].to_vec()],
        );
    }
}

/// The next draft step of a batch of [`BeamSearch`]es (each with `topk` beams of the same
/// depth): every beam's path, beam after beam, so beam `j`'s node at depth `d` is slot
/// `j * depth + d` (its parent the slot before it; depth 0 a child of the committed prefix) and
/// the beam itself is slot `j * depth + depth - 1`. Nodes two beams share run once in each
/// path: the shape is fixed, and a node's inputs (its token, its parent's output, its ancestors'
/// keys) are the same in every path.
#[derive(Debug, Clone)]
pub struct BeamStep {
    /// Per sequence, the node in each slot.
    pub frontiers: Vec<Vec<usize>>,
    /// `topk * depth`: the step's width.
    pub width: usize,
    /// Slots of a path (the beams' depth).
    pub depth: usize,
    /// Per sequence, the tokens and local parents of its slots.
    pub inputs: Vec<(Vec<u32>, Vec<Option<usize>>)>,
}

impl BeamStep {
    pub fn new(searches: &[BeamSearch]) -> Self {
        let paths: Vec<Vec<Vec<usize>>> = searches.iter().map(BeamSearch::paths).collect();
        let depth = paths.first().and_then(|p| p.first()).map_or(0, Vec::len);
        assert!(
            paths.iter().flatten().all(|p| p.len() == depth),
            "every beam of a draft step is at the same depth"
        );
        let frontiers: Vec<Vec<usize>> = paths.iter().map(|p| p.concat()).collect();
        let width = frontiers.iter().map(Vec::len).max().unwrap_or(0);
        let inputs = searches
            .iter()
            .zip(&frontiers)
            .map(|(search, frontier)| {
                frontier
                    .iter()
                    .enumerate()
                    .map(|(slot, &node)| {
                        let parent = (slot % depth > 0).then(|| slot - 1);
                        (search.token(node), parent)
                    })
                    .unzip()
            })
            .collect();
        Self {
            frontiers,
            width,
            depth,
            inputs,
        }
    }

    /// The trees for `ColumnLayout::tree_step`.
    pub fn trees(&self) -> Vec<(&[u32], &[Option<usize>])> {
        self.inputs
            .iter()
            .map(|(t, p)| (t.as_slice(), p.as_slice()))
            .collect()
    }

    /// The slot of beam `j` (its path's last node).
    pub fn beam_slot(&self, j: usize) -> usize {
        j * self.depth + self.depth - 1
    }
}

/// Indices of the `k` largest values, largest first; ties keep the lower index first (as
/// torch.topk on CUDA does for distinct values; ties are unspecified there). The order is total
/// (no two indices compare equal), so selecting the first `k` and sorting only them gives what
/// sorting all of them gives: a 5/8/32 tree's 264 candidates no longer sorted whole per sequence
/// and round (a full sort was a quarter of the driver's host time on such trees,
/// `driver_host_time`, session 56).
fn top_k_indices(values: &[f32], k: usize) -> Vec<usize> {
    let by_rank = |a: &usize, b: &usize| values[*b].total_cmp(&values[*a]).then(a.cmp(b));
    let mut order: Vec<usize> = (0..values.len()).collect();
    if (1..order.len()).contains(&k) {
        order.select_nth_unstable_by(k - 1, by_rank);
    }
    order.truncate(k);
    order.sort_unstable_by(by_rank);
    order
}

/// SGLang's `build_tree_kernel_efficient` for one sequence: selects the best
/// `num_draft_tokens - 1` candidates over all steps, keeps them in recorded order, and links
/// each to its parent (the root for step-0 candidates).
pub fn build_tree(
    root: u32,
    steps: &[DraftStep],
    topk: usize,
    num_draft_tokens: usize,
) -> Result<DraftTree, TreeError> {
    let depth = steps.len();
    if topk == 0 || depth == 0 || num_draft_tokens < 2 {
        return Err(TreeError::BadShape {
            topk,
            depth,
            num_draft_tokens,
        });
    }
    let candidates = topk + (depth - 1) * topk * topk;
    let mut all_scores = Vec::with_capacity(candidates);
    let mut all_tokens = Vec::with_capacity(candidates);
    // parent_list: step 0's [-1, 0..topk) then the chosen beams of steps 1..depth-1.
    let mut parent_list: Vec<i64> = Vec::new();
    for (i, step) in steps.iter().enumerate() {
        let expected = if i == 0 { topk } else { topk * topk };
        if step.scores.len() != expected || step.tokens.len() != expected {
            return Err(TreeError::StepSize {
                step: i,
                expected,
                got: step.scores.len().min(step.tokens.len()),
            });
        }
        all_scores.extend_from_slice(&step.scores);
        all_tokens.extend_from_slice(&step.tokens);
        if i + 1 < depth {
            parent_list.extend_from_slice(&step.parents);
        }
    }
    if num_draft_tokens - 1 > all_scores.len() {
        return Err(TreeError::TooManyDraftTokens {
            num_draft_tokens,
            available: all_scores.len(),
            topk,
            depth,
        });
    }
    let mut selected = top_k_indices(&all_scores, num_draft_tokens - 1);
    selected.sort_unstable();
    let mut tokens = vec![root];
    let mut parents = vec![None];
    for &index in &selected {
        tokens.push(all_tokens[index]);
        let parent_slot = index / topk;
        if parent_slot == 0 {
            parents.push(Some(0));
            continue;
        }
        // `selected` is sorted: the parent's place in it by bisection.
        let parent = usize::try_from(parent_list[parent_slot])
            .ok()
            .and_then(|parent| selected.binary_search(&parent).ok());
        match parent {
            Some(p) => parents.push(Some(p + 1)),
            None => return Err(TreeError::OrphanCandidate { index }),
        }
    }
    Ok(DraftTree::from_parents(tokens, parents))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The selection gives what sorting every index gives, ties and all: random scores drawn
    /// from a few values (many ties), at every k from 0 past the length.
    #[test]
    fn top_k_indices_equal_the_full_sort_with_ties() {
        let full_sort = |values: &[f32], k: usize| {
            let mut order: Vec<usize> = (0..values.len()).collect();
            order.sort_by(|&a, &b| values[b].total_cmp(&values[a]).then(a.cmp(&b)));
            order.truncate(k);
            order
        };
        let mut state = 12345u64;
        let mut next = || {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (state >> 33) as u32
        };
        for len in [0, 1, 2, 7, 64, 264] {
            let values: Vec<f32> = (0..len).map(|_| (next() % 9) as f32 * 0.125).collect();
            for k in 0..=len + 2 {
                assert_eq!(
                    top_k_indices(&values, k),
                    full_sort(&values, k),
                    "{len} values, k {k}"
                );
            }
        }
        // -0.0 and 0.0 are ordered by total_cmp (0.0 first), NaN above everything.
        let values = [0.0, -0.0, f32::NAN, 1.0, 0.0];
        assert_eq!(top_k_indices(&values, 5), full_sort(&values, 5));
        assert_eq!(top_k_indices(&values, 2), vec![2, 3]);
    }

    /// Hand-worked beam step, topk 2: the root's top-2 are 10 (0.6) and 11 (0.4); then beam 10
    /// proposes 20/21 (0.5 each) and beam 11 proposes 30 (0.9) / 31 (0.1). Cumulative scores
    /// 0.30 0.30 0.36 0.04 keep 30 (from 11) and 20 (from 10; the tie with 21 goes to the
    /// lower index). The next step runs both beams' paths, [11, 30] then [10, 20].
    #[test]
    fn beam_search_paths_and_step_layout_by_hand() {
        let mut search = BeamSearch::new(2);
        search.push(&[vec![0.6, 0.4]], &[vec![10, 11]]);
        assert_eq!(search.beams(), [0, 1]);
        assert_eq!(search.paths(), [vec![0], vec![1]]);
        let step = BeamStep::new(std::slice::from_ref(&search));
        assert_eq!((step.width, step.depth), (2, 1));
        assert_eq!(step.inputs[0], (vec![10, 11], vec![None, None]));
        search.push(
            &[vec![0.5, 0.5], vec![0.9, 0.1]],
            &[vec![20, 21], vec![30, 31]],
        );
        assert_eq!(search.beams(), [2, 3]);
        assert_eq!(search.parent(2), Some(1));
        assert_eq!(search.parent(3), Some(0));
        assert_eq!(search.paths(), [vec![1, 2], vec![0, 3]]);
        let step = BeamStep::new(&[search.clone(), search.clone()]);
        assert_eq!((step.width, step.depth), (4, 2));
        assert_eq!(step.frontiers[1], [1, 2, 0, 3]);
        assert_eq!(
            step.inputs[1],
            (vec![11, 30, 10, 20], vec![None, Some(0), None, Some(2)])
        );
        assert_eq!((step.beam_slot(0), step.beam_slot(1)), (1, 3));
        // A third step: both beams extend beam 0 ([11, 30]): the shared nodes run twice.
        search.push(
            &[vec![0.5, 0.4], vec![0.1, 0.1]],
            &[vec![40, 41], vec![50, 51]],
        );
        assert_eq!(search.paths(), [vec![1, 2, 4], vec![1, 2, 5]]);
        let step = BeamStep::new(std::slice::from_ref(&search));
        assert_eq!(
            step.inputs[0],
            (
                vec![11, 30, 40, 11, 30, 41],
                vec![None, Some(0), Some(1), None, Some(3), Some(4)]
            )
        );
        assert_eq!(search.steps().len(), 3);
        // The tree keeps the 3 best candidates: 10 (0.6), 11 (0.4), 30 (0.36).
        let tree = search.build(7, 4).unwrap();
        assert_eq!(tree.tokens, [7, 10, 11, 30]);
        assert_eq!(tree.parents, [None, Some(0), Some(0), Some(2)]);
    }
}
