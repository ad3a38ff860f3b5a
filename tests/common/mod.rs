//! Shared by the real-model tests: where the imported SmolLM2 lives and how to read the golden
//! fixtures that `scripts/reference/make_golden.py` produced with HF transformers.
#![allow(dead_code, unused_imports)]

use std::collections::HashMap;
use std::path::PathBuf;

use safetensors::{Dtype, SafeTensors};

/// The imported SmolLM2 directory (`scripts/fetch_smollm2.sh`, run first by the test command).
pub use tandem_model::testing::{smollm2_dir, workspace_root};

pub fn fixture_dir() -> PathBuf {
    workspace_root().join("tests/fixtures/smollm2")
}

/// A golden tensor: shape and values widened to f64 (float) or i64 (int) for comparison.
#[derive(Debug, Clone)]
pub struct Golden {
    pub shape: Vec<usize>,
    pub floats: Vec<f32>,
    pub ints: Vec<i64>,
}

pub fn load_golden() -> HashMap<String, Golden> {
    load_golden_from(&fixture_dir())
}

/// The golden tensors of one fixture directory (`golden.safetensors`).
pub fn load_golden_from(dir: &std::path::Path) -> HashMap<String, Golden> {
    let path = dir.join("golden.safetensors");
    let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let st = SafeTensors::deserialize(&bytes).expect("golden.safetensors parses");
    let mut out = HashMap::new();
    for (name, view) in st.tensors() {
        let data = view.data();
        let (floats, ints) = match view.dtype() {
            Dtype::F32 => (
                data.chunks_exact(4)
                    .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                    .collect(),
                Vec::new(),
            ),
            Dtype::I64 => (
                Vec::new(),
                data.chunks_exact(8)
                    .map(|b| i64::from_le_bytes(b.try_into().unwrap()))
                    .collect(),
            ),
            other => panic!("unexpected dtype {other:?} for {name}"),
        };
        out.insert(
            name.to_string(),
            Golden {
                shape: view.shape().to_vec(),
                floats,
                ints,
            },
        );
    }
    out
}

pub fn golden_json() -> serde_json::Value {
    let path = fixture_dir().join("golden.json");
    serde_json::from_str(&std::fs::read_to_string(&path).expect("golden.json exists"))
        .expect("golden.json parses")
}

/// max |a - b| / max |b|: the relative error of a whole vector, robust to entries near zero.
pub fn relative_error(actual: &[f32], expected: &[f32]) -> f32 {
    assert_eq!(actual.len(), expected.len(), "length mismatch");
    let scale = expected.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-12);
    let diff = actual
        .iter()
        .zip(expected)
        .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
    diff / scale
}
