//! Qwen3 (per-head RMSNorm on q and k before RoPE, `head_dim` independent of `hidden_size`,
//! tied embeddings) on the burn path against HF transformers.
//!
//! The fixture of `scripts/reference/make_qwen3_golden.py` (a tiny random model: 3 layers,
//! hidden 48, 4 heads of 16, 2 KV heads) holds HF's logits and every `hidden_states` entry for
//! two prompts. Each must agree to a relative error (max |diff| / max |reference|) of at most
//! 1e-4 in f32: in one prefill, token by token through the KV cache, and with both prompts in
//! one ragged batch.

use std::path::{Path, PathBuf};

use tandem_model::backend::CpuBackend;
use tandem_model::burn::prelude::*;
use tandem_model::testing::{GoldenFile, check_prefill_against_hf, rel_err};
use tandem_model::{LogitsFor, TapRequest, TargetModel};

type B = CpuBackend;

/// HF parity tolerance: max |tandem - hf| / max |hf| per tensor.
const PARITY_REL: f32 = 1e-4;

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/qwen3")
}

fn host<const D: usize>(t: Tensor<B, D>) -> Vec<f32> {
    t.into_data().to_vec::<f32>().unwrap()
}

fn load() -> TargetModel<B> {
    TargetModel::load(&fixture(), &Default::default()).unwrap()
}

#[test]
fn qwen3_prefill_matches_hf_logits_and_every_hidden_state() {
    let model = load();
    let spec = &model.spec;
    // The features this fixture exists for: q/k norm, head_dim * heads != hidden, tied head.
    assert!(spec.qk_norm, "Qwen3 must get the per-head q/k norm");
    assert_eq!(
        (spec.head_dim, spec.num_heads, spec.hidden_size),
        (16, 4, 48)
    );
    let golden = GoldenFile::open(&fixture().join("golden.safetensors"));
    check_prefill_against_hf(&model, &golden, 2, PARITY_REL, "qwen3");
}

#[test]
fn qwen3_decode_through_the_cache_and_a_ragged_batch_match_hf() {
    let model = load();
    let golden = GoldenFile::open(&fixture().join("golden.safetensors"));
    let vocab = model.spec.vocab_size;
    let cases: Vec<Vec<u32>> = (0..2)
        .map(|c| golden.ids(&format!("case{c}.input_ids")))
        .collect();
    let references: Vec<Vec<f32>> = (0..2)
        .map(|c| golden.f32s(&format!("case{c}.logits")).1)
        .collect();
    // Token by token: a 3-token prefill, then one decode step per remaining token; each step's
    // last logits row against HF's row at that position (RoPE positions and the q/k norm
    // through the cache).
    for (case, ids) in cases.iter().enumerate() {
        let mut cache = model.new_cache(1, ids.len());
        let step = cache.prefill_step(&[&ids[..3]]).unwrap();
        let mut last = model
            .forward(&step, &mut cache, &TapRequest::none(), LogitsFor::Last)
            .unwrap();
        for position in 2..ids.len() {
            if position > 2 {
                let step = cache.decode_step(&[ids[position]]).unwrap();
                last = model
                    .forward(&step, &mut cache, &TapRequest::none(), LogitsFor::Last)
                    .unwrap();
            }
            let row = &references[case][position * vocab..(position + 1) * vocab];
            let e = rel_err(&host(last.logits.clone().unwrap()), row);
            assert!(
                e <= PARITY_REL,
                "case{case} position {position}: rel err {e}"
            );
        }
    }
    // Both prompts in one ragged prefill (the shorter one padded): every real row.
    let refs: Vec<&[u32]> = cases.iter().map(Vec::as_slice).collect();
    let width = cases.iter().map(Vec::len).max().unwrap();
    let mut cache = model.new_cache(2, width);
    let step = cache.prefill_step(&refs).unwrap();
    let out = model
        .forward(&step, &mut cache, &TapRequest::none(), LogitsFor::All)
        .unwrap();
    let logits = host(out.logits.unwrap());
    for (case, ids) in cases.iter().enumerate() {
        let start = case * width * vocab;
        let actual = &logits[start..start + ids.len() * vocab];
        let e = rel_err(actual, &references[case]);
        assert!(
            e <= PARITY_REL,
            "case{case} in the ragged batch: rel err {e}"
        );
    }
}
