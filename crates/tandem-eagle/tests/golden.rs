//! The training unroll against an independent implementation: golden outputs of SpecForge's
//! draft forward re-implemented in PyTorch (`tests/fixtures/make_ttt_golden.py`, seeded), for a
//! tiny head saved in the engines' checkpoint layout, 4 TTT steps over 9 tokens.

use std::path::PathBuf;

use burn::backend::NdArray;
use burn::prelude::*;
use burn::tensor::TensorData;
use tandem_eagle::load_pretrained;
use tandem_model::testing::{GoldenFile, rel_err};

type B = NdArray<f32>;

/// Stated tolerance: max abs diff / max abs reference, f32 on both sides.
const RTOL: f32 = 1e-4;

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

#[test]
fn unroll_matches_the_pytorch_reference() {
    let golden = GoldenFile::open(&fixtures().join("golden.safetensors"));
    let device = Default::default();
    let (shape, embed) = golden.f32s("embed");
    let embed = Tensor::<B, 2>::from_data(TensorData::new(embed, [shape[0], shape[1]]), &device);
    let head = load_pretrained::<B>(&fixtures().join("head"), embed, &device).unwrap();
    assert!(head.report.renamed.is_empty() && head.report.unknown.is_empty());
    let (shape, aux) = golden.f32s("aux");
    let aux = Tensor::<B, 3>::from_data(TensorData::new(aux, [1, shape[1], shape[2]]), &device);
    let ids = golden.ids("input_ids");
    let n = ids.len();
    let outputs = head.draft.forward_ttt(aux, &ids, &[n], 4).unwrap();
    for (step, out) in outputs.into_iter().enumerate() {
        for (what, got) in [("hidden", out.hidden), ("logits", out.logits)] {
            let (shape, want) = golden.f32s(&format!("step{step}.{what}"));
            assert_eq!(got.dims().to_vec(), shape, "step {step} {what} shape");
            let got = got.into_data().to_vec::<f32>().unwrap();
            let err = rel_err(&got, &want);
            assert!(err <= RTOL, "step {step} {what}: relative error {err}");
        }
    }
}
