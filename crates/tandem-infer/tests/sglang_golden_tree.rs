//! SGLang's published `test_build_tree_kernel_efficient` (python/sglang/srt/speculative/
//! build_eagle_tree.py): topk 4, depth 4, 8 draft tokens, two sequences with 5 and 10 verified
//! tokens. Inputs copied from that test; expected positions, links and tokens are its asserts.

use tandem_infer::tree::{DraftStep, build_tree};

fn steps_for(batch: usize) -> (u32, Vec<DraftStep>) {
    let verified = [29974u32, 13][batch];
    let scores: [Vec<Vec<f32>>; 4] = [
        vec![
            vec![7.1127e-01, 2.8292e-01, 2.2995e-03, 1.7357e-03],
            vec![9.7476e-01, 2.2219e-02, 6.5031e-04, 1.3212e-04],
        ],
        vec![
            vec![
                6.9142e-01, 1.2863e-02, 1.6873e-03, 1.1871e-03, 2.4787e-01, 1.8818e-02, 1.4204e-02,
                9.2235e-04, 2.2971e-03, 1.6700e-06, 1.8737e-07, 8.3146e-08, 1.2771e-03, 2.4374e-04,
                1.7832e-04, 1.1947e-05,
            ],
            vec![
                8.4832e-02, 6.6068e-02, 5.8304e-02, 5.7851e-02, 2.3616e-03, 1.1243e-03, 5.4368e-04,
                2.7768e-04, 2.5286e-04, 1.5578e-04, 2.8817e-05, 1.2888e-05, 1.2834e-04, 2.5417e-06,
                1.1279e-06, 1.6088e-08,
            ],
        ],
        vec![
            vec![
                6.6438e-01, 2.6997e-02, 2.4236e-05, 4.0821e-06, 2.4402e-01, 2.8409e-03, 5.0935e-04,
                2.9022e-04, 1.6178e-02, 2.0567e-03, 4.5892e-04, 3.0034e-05, 1.3023e-02, 5.0497e-04,
                3.6371e-04, 8.7750e-05,
            ],
            vec![
                2.3263e-02, 2.0054e-02, 9.3990e-03, 2.7783e-03, 6.4156e-02, 5.5506e-04, 1.0429e-04,
                9.7211e-05, 4.9950e-02, 5.0630e-03, 9.0068e-04, 3.3656e-04, 7.5817e-03, 8.5731e-04,
                6.9972e-04, 6.0793e-04,
            ],
        ],
        vec![
            vec![
                6.6420e-01, 1.0525e-04, 6.5864e-05, 1.2253e-06, 1.3019e-01, 1.0461e-01, 5.2083e-03,
                1.6777e-03, 2.0103e-02, 6.7335e-03, 1.2625e-04, 1.0364e-05, 1.5142e-02, 7.0819e-04,
                9.6595e-05, 8.7951e-05,
            ],
            vec![
                5.8608e-02, 1.8840e-03, 7.8535e-04, 4.4400e-04, 1.2185e-02, 2.0684e-03, 1.7418e-03,
                1.4327e-03, 6.2455e-03, 6.1487e-03, 2.6862e-03, 1.8034e-03, 1.8590e-03, 1.6151e-03,
                1.2481e-03, 3.6038e-04,
            ],
        ],
    ];
    let tokens: [Vec<Vec<u32>>; 4] = [
        vec![vec![29896, 29906, 29900, 29945], vec![13, 2, 29871, 28956]],
        vec![
            vec![
                29889, 29974, 29945, 29900, 29974, 29922, 29930, 29958, 29889, 29974, 29930, 29945,
                29974, 29922, 29930, 29958,
            ],
            vec![
                22550, 4136, 16492, 8439, 29871, 2, 3001, 13, 2, 13, 29906, 29946, 2, 13, 29871,
                259,
            ],
        ],
        vec![
            vec![
                29946, 29945, 29953, 29906, 29896, 29945, 29900, 29906, 29896, 29945, 29906, 29953,
                29896, 29945, 29906, 29946,
            ],
            vec![
                29871, 2, 29901, 29889, 29871, 2, 395, 259, 29901, 29871, 2, 29889, 3001, 1234,
                7146, 2186,
            ],
        ],
        vec![
            vec![
                29946, 29974, 29945, 29930, 29889, 29922, 29974, 29930, 29974, 29946, 29930, 29922,
                29889, 29974, 29945, 29922,
            ],
            vec![
                29941, 29906, 2, 29946, 29871, 450, 319, 14990, 29946, 29941, 2, 29906, 29871, 2,
                3001, 13,
            ],
        ],
    ];
    let parents: [Vec<Vec<i64>>; 4] = [
        vec![vec![-1, 0, 1, 2, 3], vec![-1, 0, 1, 2, 3]],
        vec![vec![4, 8, 9, 10], vec![4, 5, 6, 7]],
        vec![vec![20, 24, 21, 28], vec![24, 28, 20, 21]],
        vec![vec![36, 40, 41, 44], vec![36, 40, 44, 45]],
    ];
    let steps = (0..4)
        .map(|s| DraftStep {
            scores: scores[s][batch].clone(),
            tokens: tokens[s][batch].clone(),
            parents: parents[s][batch].clone(),
        })
        .collect();
    (verified, steps)
}

fn opt(v: &[i64]) -> Vec<Option<usize>> {
    v.iter().map(|&x| usize::try_from(x).ok()).collect()
}

#[test]
fn matches_sglang_build_tree_kernel_efficient() {
    let seq_lens = [5usize, 10];
    let expected_positions = [[5, 6, 6, 7, 7, 8, 8, 9], [10, 11, 12, 12, 12, 12, 13, 14]];
    let expected_next_token = [[1, 3, 4, 5, 6, 7, -1, -1], [1, 2, -1, 6, -1, -1, 7, -1]];
    let expected_next_sibling = [
        [-1, 2, -1, -1, -1, -1, -1, -1],
        [-1, -1, 3, 4, 5, -1, -1, -1],
    ];
    let expected_tokens = [
        [29974, 29896, 29906, 29889, 29974, 29946, 29896, 29946],
        [13, 13, 22550, 4136, 16492, 8439, 29871, 29941],
    ];
    for b in 0..2 {
        let (root, steps) = steps_for(b);
        let tree = build_tree(root, &steps, 4, 8).unwrap();
        assert_eq!(
            tree.positions(seq_lens[b]),
            expected_positions[b],
            "positions of sequence {b}"
        );
        assert_eq!(
            tree.first_child,
            opt(&expected_next_token[b]),
            "retrive_next_token of sequence {b}"
        );
        assert_eq!(
            tree.next_sibling,
            opt(&expected_next_sibling[b]),
            "retrive_next_sibling of sequence {b}"
        );
        assert_eq!(
            tree.tokens, expected_tokens[b],
            "draft tokens of sequence {b}"
        );
        // The verification mask lets each node see exactly its ancestors and itself.
        let mask = tree.attention_mask();
        let n = tree.len();
        for i in 0..n {
            let seen = (0..n).filter(|&j| mask[i * n + j]).count();
            assert_eq!(seen, tree.depth[i] + 1, "node {i} sees its depth + 1 nodes");
        }
    }
}

/// Re-drafting the same step outputs through `TreeBuilder::push` (SGLang `select_top_k_tokens`)
/// reproduces SGLang's recorded beams (`parents_list`) and scores.
#[test]
fn tree_builder_reproduces_sglang_beam_selection() {
    use tandem_infer::TreeBuilder;
    for b in 0..2 {
        let (root, steps) = steps_for(b);
        let mut builder = TreeBuilder::new(4);
        let mut beam_scores: Vec<f32> = vec![1.0];
        for (s, step) in steps.iter().enumerate() {
            let beams = beam_scores.len();
            let width = step.scores.len() / beams;
            let probs: Vec<Vec<f32>> = (0..beams)
                .map(|bm| {
                    (0..width)
                        .map(|c| step.scores[bm * width + c] / beam_scores[bm])
                        .collect()
                })
                .collect();
            let tokens: Vec<Vec<u32>> = (0..beams)
                .map(|bm| step.tokens[bm * width..(bm + 1) * width].to_vec())
                .collect();
            builder.push(&probs, &tokens);
            let recorded = &builder.steps()[s];
            assert_eq!(
                recorded.parents, step.parents,
                "sequence {b} step {s} beams"
            );
            for (x, y) in recorded.scores.iter().zip(&step.scores) {
                assert!(
                    (x - y).abs() <= 1e-6 * y.abs().max(1e-30),
                    "sequence {b} step {s}: {x} vs {y}"
                );
            }
            // Next step's beams: the chosen flat indices' scores.
            beam_scores = if s == 0 {
                step.scores.clone()
            } else {
                let offset = 4 + (s - 1) * 16;
                step.parents
                    .iter()
                    .map(|&p| step.scores[p as usize - offset])
                    .collect()
            };
        }
        let tree = builder.build(root, 8).unwrap();
        assert_eq!(tree, build_tree(root, &steps, 4, 8).unwrap());
    }
}
