//! Parity of the burn target model with HF transformers (f32, eager attention) on the imported
//! SmolLM2-135M-Instruct: logits, every tap point, greedy continuations, tokenizer and chat
//! template. Golden values: tests/fixtures/smollm2 (made by scripts/reference/make_golden.py).

mod common;

use common::*;
use tandem_model::backend::CpuBackend;
use tandem_model::burn::prelude::*;
use tandem_model::{
    ChatMessage, GenerateOptions, LogitsFor, SamplingParams, TapRequest, TargetModel,
    TargetTokenizer,
};
use tandem_wiring::TapId;

/// Stated tolerance: relative error (max abs diff / max abs reference) of f32 logits and hidden
/// states against the f32 eager HF reference.
const LOGITS_RTOL: f32 = 1e-3;
const HIDDEN_RTOL: f32 = 1e-3;

fn to_vec(t: Tensor<CpuBackend, 3>) -> Vec<f32> {
    t.into_data().to_vec::<f32>().unwrap()
}

fn ids_u32(g: &Golden) -> Vec<u32> {
    g.ints.iter().map(|&i| i as u32).collect()
}

#[test]
fn logits_and_taps_match_transformers() {
    let dir = smollm2_dir();
    let golden = load_golden();
    let device = Default::default();
    let model = TargetModel::<CpuBackend>::load(&dir, &device).unwrap();
    let hidden = model.spec.hidden_size;
    let layers = model.spec.num_layers;
    let vocab = model.spec.vocab_size;
    for case in ["case0", "case1", "case2", "case3"] {
        let ids = ids_u32(&golden[&format!("{case}.input_ids")]);
        let n = ids.len();
        let mut cache = model.new_cache(1, n);
        let step = cache.prefill_step(&[&ids]).unwrap();
        let out = model
            .forward(&step, &mut cache, &TapRequest::all(layers), LogitsFor::All)
            .unwrap();
        let logits = to_vec(out.logits.unwrap());
        // Last position, full vocabulary.
        let last = &logits[(n - 1) * vocab..n * vocab];
        let err = relative_error(last, &golden[&format!("{case}.logits_last")].floats);
        assert!(
            err <= LOGITS_RTOL,
            "{case}: last-position logits rel err {err}"
        );
        eprintln!("{case}: last-position logits rel err {err:.2e}");
        // Every position, first 256 vocabulary entries, and the argmax of every position.
        let head: Vec<f32> = (0..n)
            .flat_map(|p| logits[p * vocab..p * vocab + 256].to_vec())
            .collect();
        let err = relative_error(&head, &golden[&format!("{case}.logits_head")].floats);
        assert!(
            err <= LOGITS_RTOL,
            "{case}: per-position logits rel err {err}"
        );
        let argmax: Vec<i64> = (0..n)
            .map(|p| tandem_model::sampling::argmax(&logits[p * vocab..(p + 1) * vocab]) as i64)
            .collect();
        assert_eq!(
            argmax,
            golden[&format!("{case}.argmax")].ints,
            "{case}: argmax per position"
        );

        // Taps at the last position: embed = HF hidden_states[0], block k = forward-hook output
        // of layer k (= hidden_states[k+1] for k < L-1), final = hidden_states[L].
        let hs = &golden[&format!("{case}.hidden_states_last")].floats;
        let blocks = &golden[&format!("{case}.block_out_last")].floats;
        let mut worst_block = 0f32;
        let at_last = |tap: TapId| -> Vec<f32> {
            let t = to_vec(out.taps.get(tap).unwrap().clone());
            t[(n - 1) * hidden..n * hidden].to_vec()
        };
        let err = relative_error(&at_last(TapId::Embed), &hs[0..hidden]);
        assert!(
            err <= HIDDEN_RTOL,
            "{case}: embed vs hidden_states[0]: {err}"
        );
        for k in 0..layers {
            let ours = at_last(TapId::Block(k));
            let err = relative_error(&ours, &blocks[k * hidden..(k + 1) * hidden]);
            assert!(
                err <= HIDDEN_RTOL,
                "{case}: block {k} vs layer {k} output: {err}"
            );
            worst_block = worst_block.max(err);
            if k + 1 < layers {
                let err = relative_error(&ours, &hs[(k + 1) * hidden..(k + 2) * hidden]);
                assert!(
                    err <= HIDDEN_RTOL,
                    "{case}: block {k} vs hidden_states[{}]: {err}",
                    k + 1
                );
            }
        }
        let err = relative_error(
            &at_last(TapId::Final),
            &hs[layers * hidden..(layers + 1) * hidden],
        );
        assert!(
            err <= HIDDEN_RTOL,
            "{case}: final vs hidden_states[{layers}]: {err}"
        );
        eprintln!("{case}: worst block tap rel err {worst_block:.2e}, final tap {err:.2e}");
    }
}

#[test]
fn every_position_of_every_tap_matches_for_case0() {
    let dir = smollm2_dir();
    let golden = load_golden();
    let model = TargetModel::<CpuBackend>::load(&dir, &Default::default()).unwrap();
    let ids = ids_u32(&golden["case0.input_ids"]);
    let layers = model.spec.num_layers;
    let mut cache = model.new_cache(1, ids.len());
    let step = cache.prefill_step(&[&ids]).unwrap();
    let out = model
        .forward(&step, &mut cache, &TapRequest::all(layers), LogitsFor::None)
        .unwrap();
    let per_tap = ids.len() * model.spec.hidden_size;
    let hs = &golden["case0.hidden_states"].floats;
    let blocks = &golden["case0.block_out"].floats;
    let tap = |t: TapId| to_vec(out.taps.get(t).unwrap().clone());
    assert!(relative_error(&tap(TapId::Embed), &hs[..per_tap]) <= HIDDEN_RTOL);
    for k in 0..layers {
        let err = relative_error(
            &tap(TapId::Block(k)),
            &blocks[k * per_tap..(k + 1) * per_tap],
        );
        assert!(err <= HIDDEN_RTOL, "block {k}: {err}");
    }
    let err = relative_error(
        &tap(TapId::Final),
        &hs[layers * per_tap..(layers + 1) * per_tap],
    );
    assert!(err <= HIDDEN_RTOL, "final: {err}");
}

#[test]
fn greedy_continuations_match_transformers() {
    let dir = smollm2_dir();
    let golden = load_golden();
    let model = TargetModel::<CpuBackend>::load(&dir, &Default::default()).unwrap();
    let tokenizer = TargetTokenizer::load(&dir).unwrap();
    for (prompt_key, output_key) in [
        ("greedy.prompt_ids", "greedy.output_ids"),
        ("case0.input_ids", "greedy_case0.output_ids"),
    ] {
        let prompt = ids_u32(&golden[prompt_key]);
        let expected = ids_u32(&golden[output_key]);
        let options = GenerateOptions {
            max_new_tokens: expected.len(),
            sampling: SamplingParams::greedy(),
            stop_ids: Vec::new(),
            seed: 0,
        };
        let generation = tandem_model::generate(&model, &prompt, &options).unwrap();
        assert_eq!(generation.tokens, expected, "{output_key}");
    }
    // The known fact about this model: France's capital is Paris.
    let prompt = tokenizer.encode("The capital of France is", true).unwrap();
    let options = GenerateOptions {
        max_new_tokens: 1,
        sampling: SamplingParams::greedy(),
        stop_ids: Vec::new(),
        seed: 0,
    };
    let generation = tandem_model::generate(&model, &prompt, &options).unwrap();
    assert_eq!(
        tokenizer.decode(&generation.tokens, false).unwrap(),
        " Paris"
    );
}

#[test]
fn tokenizer_and_chat_template_match_transformers() {
    let dir = smollm2_dir();
    let tokenizer = TargetTokenizer::load(&dir).unwrap();
    let golden = load_golden();
    let meta = golden_json();
    let cases: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(fixture_dir().join("tokenizer_cases.json")).unwrap(),
    )
    .unwrap();
    for case in cases.as_array().unwrap() {
        let text = case["text"].as_str().unwrap();
        let expected: Vec<u32> = case["ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect();
        assert_eq!(
            tokenizer.encode(text, false).unwrap(),
            expected,
            "encoding {text:?}"
        );
    }
    // Raw prompts tokenised as HF does by default.
    for case in ["case0", "case1"] {
        let text = meta["cases"][case]["text"].as_str().unwrap();
        assert_eq!(
            tokenizer.encode(text, true).unwrap(),
            ids_u32(&golden[&format!("{case}.input_ids")]),
            "{case}"
        );
    }
    // Chat prompts rendered by the model's own template, byte for byte, then tokenised.
    for case in ["case2", "case3"] {
        let messages: Vec<ChatMessage> =
            serde_json::from_value(meta["cases"][case]["messages"].clone()).unwrap();
        let rendered = tokenizer.render_chat(&messages, true).unwrap();
        assert_eq!(
            rendered,
            meta["cases"][case]["rendered"].as_str().unwrap(),
            "{case}"
        );
        assert_eq!(
            tokenizer.encode_chat(&messages, true).unwrap(),
            ids_u32(&golden[&format!("{case}.input_ids")]),
            "{case}"
        );
    }
}
