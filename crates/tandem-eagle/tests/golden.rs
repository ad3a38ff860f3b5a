//! The training unroll against an independent implementation: golden outputs of SpecForge's
//! draft forward re-implemented in PyTorch (`tests/fixtures/make_ttt_golden.py`, seeded), for a
//! tiny head saved in the engines' checkpoint layout, 4 TTT steps over 9 tokens.

use std::path::PathBuf;

use burn::backend::NdArray;
use burn::prelude::*;
use burn::tensor::TensorData;
use safetensors::{Dtype, SafeTensors};
use tandem_eagle::load_pretrained;

type B = NdArray<f32>;

/// Stated tolerance: max abs diff / max abs reference, f32 on both sides.
const RTOL: f32 = 1e-4;

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

fn tensor(st: &SafeTensors<'_>, name: &str) -> (Vec<usize>, Vec<f32>, Vec<i64>) {
    let view = st.tensor(name).unwrap();
    let data = view.data();
    match view.dtype() {
        Dtype::F32 => (
            view.shape().to_vec(),
            data.chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect(),
            Vec::new(),
        ),
        Dtype::I64 => (
            view.shape().to_vec(),
            Vec::new(),
            data.chunks_exact(8)
                .map(|b| i64::from_le_bytes(b.try_into().unwrap()))
                .collect(),
        ),
        other => panic!("{name}: unexpected dtype {other:?}"),
    }
}

#[test]
fn unroll_matches_the_pytorch_reference() {
    let bytes = std::fs::read(fixtures().join("golden.safetensors")).unwrap();
    let golden = SafeTensors::deserialize(&bytes).unwrap();
    let device = Default::default();
    let (shape, embed, _) = tensor(&golden, "embed");
    let embed = Tensor::<B, 2>::from_data(TensorData::new(embed, [shape[0], shape[1]]), &device);
    let head = load_pretrained::<B>(&fixtures().join("head"), embed, &device).unwrap();
    assert!(head.report.renamed.is_empty() && head.report.unknown.is_empty());
    let (shape, aux, _) = tensor(&golden, "aux");
    let aux = Tensor::<B, 3>::from_data(TensorData::new(aux, [1, shape[1], shape[2]]), &device);
    let (_, _, ids) = tensor(&golden, "input_ids");
    let ids: Vec<u32> = ids.iter().map(|&i| i as u32).collect();
    let n = ids.len();
    let outputs = head.draft.forward_ttt(aux, &ids, &[n], 4).unwrap();
    for (step, out) in outputs.into_iter().enumerate() {
        for (what, got) in [("hidden", out.hidden), ("logits", out.logits)] {
            let (shape, want, _) = tensor(&golden, &format!("step{step}.{what}"));
            assert_eq!(got.dims().to_vec(), shape, "step {step} {what} shape");
            let got = got.into_data().to_vec::<f32>().unwrap();
            let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
            let diff = got
                .iter()
                .zip(&want)
                .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
            assert!(
                diff / scale <= RTOL,
                "step {step} {what}: max abs diff {diff}, relative {}",
                diff / scale
            );
        }
    }
}
