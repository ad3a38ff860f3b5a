//! The speculative loop on the real target with the committed SmolLM2 head (CPU f32): greedy
//! speculative output equals target-only greedy output token for token on MT-Bench first
//! turns, for chain and tree drafting, and the head is actually accepted.

mod common;

use common::*;
use tandem_infer::engine::target_greedy;
use tandem_infer::wiring::{check_head, head_taps, serving_manifest};
use tandem_infer::{SpecConfig, SpecEngine};
use tandem_model::backend::CpuBackend;
use tandem_model::sampling::SamplingParams;
use tandem_model::{ChatMessage, TapRequest, TargetModel, TargetTokenizer};

const PROMPTS: usize = 3;
const NEW_TOKENS: usize = 32;

#[test]
fn greedy_speculative_equals_target_greedy_on_mtbench() {
    let dir = smollm2_dir();
    let head_dir = workspace_root().join("heads/smollm2-135m-eagle3");
    let device = Default::default();
    let target = TargetModel::<CpuBackend>::load(&dir, &device).unwrap();
    let tokenizer = TargetTokenizer::load(&dir).unwrap();
    let head =
        tandem_eagle::load_pretrained(&head_dir, target.embed_tokens.clone(), &device).unwrap();
    let taps = head_taps(
        &head.config,
        &target.spec.architecture,
        target.spec.num_layers,
    )
    .unwrap();
    // The committed head was trained on exactly what serving taps (only a dtype note allowed).
    let serving = serving_manifest(&dir, taps.clone(), "f32", "cpu").unwrap();
    let fatal: Vec<String> = check_head(&head.config, &serving)
        .unwrap()
        .iter()
        .filter(|m| m.is_fatal())
        .map(|m| m.to_string())
        .collect();
    assert!(fatal.is_empty(), "wiring mismatches: {fatal:?}");

    let data_root = workspace_root().join("data");
    let prompts: Vec<Vec<u32>> = tandem_data::eval_prompts("mtbench", &data_root)
        .expect("run scripts/fetch_datasets.sh mtbench")
        .iter()
        .take(PROMPTS)
        .map(|p| {
            tokenizer
                .encode_chat(&[ChatMessage::new("user", p.turns[0].clone())], true)
                .unwrap()
        })
        .collect();
    let stop = tokenizer.eos_ids.clone();
    let expected: Vec<Vec<u32>> = prompts
        .iter()
        .map(|p| target_greedy(&target, p, NEW_TOKENS, &stop).unwrap())
        .collect();
    for config in [
        SpecConfig::chain(3),
        SpecConfig {
            num_steps: 3,
            topk: 4,
            num_draft_tokens: 8,
            sampling: SamplingParams::greedy(),
            seed: 0,
        },
    ] {
        let engine = SpecEngine {
            target: &target,
            draft: Some(&head.draft),
            taps: TapRequest::new(taps.clone()),
            config,
        };
        // All prompts decoded together (batch > 1, ragged lengths).
        let out = engine.generate(&prompts, NEW_TOKENS, &stop).unwrap();
        let mut accepted = 0;
        for (i, seq) in out.sequences.iter().enumerate() {
            assert_eq!(seq.tokens, expected[i], "prompt {i} with {config:?}");
            accepted += seq.stats.accepted_tokens;
        }
        let tau: f64 = out
            .sequences
            .iter()
            .map(|s| s.stats.accept_length())
            .sum::<f64>()
            / PROMPTS as f64;
        eprintln!("{config:?}: mean accept length {tau:.2}, {accepted} draft tokens accepted");
        assert!(accepted > 0, "a trained head must be accepted sometimes");
    }
}
