//! DeepSeek-V3 (Kimi-K2 architecture) against HF transformers, and the micro-batched path
//! against the plain one.
//!
//! Parity: the fixtures of `scripts/reference/make_deepseek_golden.py` (two tiny random models,
//! 2 dense + 2 MoE layers each; one with q LoRA and interleaved rope, one with `q_proj` and yarn)
//! hold HF's logits and every `hidden_states` entry; each must agree to a relative error
//! (max |diff| / max |reference|) of at most 1e-4 in f32.
//!
//! Micro-batching: the same steps run plain and micro-batched must give the same taps and
//! logits (1e-5, f32), and the micro-batched path must pass the hook once per micro-batch at
//! every tap point, interleaved layer by layer.

use std::path::{Path, PathBuf};

use tandem_model::backend::CpuBackend;
use tandem_model::burn::prelude::*;
use tandem_model::testing::{
    GoldenFile, check_prefill_against_hf, rel_err, scratch_dir, tiny_config, write_random_model,
};
use tandem_model::{Execution, KvCache, LogitsFor, StepInput, StepOutput, TapRequest, TargetModel};
use tandem_wiring::TapId;

type B = CpuBackend;

/// HF parity tolerance: max |tandem - hf| / max |hf| per tensor.
const PARITY_REL: f32 = 1e-4;
/// Plain vs micro-batched: |a - b| <= tol * (1 + |b|) per element.
const PATH_TOL: f32 = 1e-5;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/deepseek_v3")
        .join(name)
}

fn load(name: &str) -> TargetModel<B> {
    TargetModel::load(&fixture(name), &Default::default()).unwrap()
}

fn host(t: Tensor<B, 3>) -> Vec<f32> {
    t.into_data().to_vec::<f32>().unwrap()
}

fn check_parity(name: &str) {
    let model = load(name);
    let golden = GoldenFile::open(&fixture(name).join("golden.safetensors"));
    let (layers, hidden) = (model.spec.num_layers, model.spec.hidden_size);
    assert_eq!(layers, 4);
    let last_blocks = check_prefill_against_hf(&model, &golden, 2, PARITY_REL, name);
    // Block L-1, which hidden_states leaves out, against the fixture's hooked block outputs.
    for (case, last) in last_blocks.iter().enumerate() {
        let (_, blocks) = golden.f32s(&format!("case{case}.block_out"));
        let n = last.len() / hidden;
        let e = rel_err(last, &blocks[(layers - 1) * n * hidden..]);
        assert!(
            e <= PARITY_REL,
            "{name} case{case}: block {} rel err {e}",
            layers - 1
        );
    }
}

#[test]
fn deepseek_v3_with_q_lora_and_interleaved_rope_matches_hf() {
    let model = load("mla_qlora");
    let mla = model.spec.mla.as_ref().unwrap();
    assert!(mla.q_lora_rank == Some(16) && mla.rope_interleave);
    assert!(model.spec.is_moe());
    check_parity("mla_qlora");
}

#[test]
fn deepseek_v3_with_q_proj_and_yarn_matches_hf() {
    let model = load("yarn_noqlora");
    let mla = model.spec.mla.as_ref().unwrap();
    assert!(mla.q_lora_rank.is_none() && !mla.rope_interleave);
    // HF: 12^-0.5 * (0.1 ln 4 + 1)^2 (yarn_apply_mscale with mscale_all_dim 1).
    assert!((mla.softmax_scale - 0.374_260_670_390_048_6).abs() < 1e-12);
    check_parity("yarn_noqlora");
}

/// One forward of `step` on `cache`; taps and logits on the host.
fn run(
    model: &TargetModel<B>,
    cache: &mut KvCache<B>,
    step: &StepInput,
) -> (StepOutput<B>, Vec<Vec<f32>>, Vec<f32>) {
    let out = model
        .forward(
            step,
            cache,
            &TapRequest::all(model.spec.num_layers),
            LogitsFor::All,
        )
        .unwrap();
    let taps = out.taps.tensors.iter().map(|t| host(t.clone())).collect();
    let logits = host(out.logits.clone().unwrap());
    (out, taps, logits)
}

fn assert_same(a: &[f32], b: &[f32], what: &str, real: &[bool], hidden_width: usize) {
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        if !real[i / hidden_width] {
            continue; // padding slots attend to themselves only; nobody reads them
        }
        assert!(
            (x - y).abs() <= PATH_TOL * (1.0 + y.abs()),
            "{what}: element {i}: micro-batched {x} vs plain {y}"
        );
    }
}

/// Builds a step from the cache's layout (both paths' caches give the same step).
type MakeStep = dyn Fn(&KvCache<B>) -> StepInput;

/// Runs `steps` (built from the cache before each) plain and micro-batched from fresh caches of
/// `batch` sequences and compares every tap and the logits; returns the micro-batched path's
/// visited tap points of each step.
fn compare_paths(model: &mut TargetModel<B>, batch: usize, steps: &[&MakeStep]) -> Vec<Vec<TapId>> {
    let mut plain = model.new_cache(batch, 32);
    let mut micro = model.new_cache(batch, 32);
    let mut visited = Vec::new();
    for (s, make) in steps.iter().enumerate() {
        let step = make(&plain);
        assert_eq!(step, make(&micro));
        model.execution = Execution::Plain;
        let (p_out, p_taps, p_logits) = run(model, &mut plain, &step);
        model.execution = Execution::MicroBatched;
        let (m_out, m_taps, m_logits) = run(model, &mut micro, &step);
        assert_eq!(p_out.taps.visited.len(), model.spec.num_layers + 2);
        let h = model.spec.hidden_size;
        for (slot, (m, p)) in m_taps.iter().zip(&p_taps).enumerate() {
            let what = format!("step {s} tap {}", p_out.taps.taps[slot]);
            assert_same(m, p, &what, &step.real, h);
        }
        let what = format!("step {s} logits");
        assert_same(
            &m_logits,
            &p_logits,
            &what,
            &step.real,
            model.spec.vocab_size,
        );
        visited.push(m_out.taps.visited);
    }
    model.execution = Execution::Auto;
    visited
}

/// Every tap point twice in a row (one per micro-batch), layer by layer.
fn interleaved(layers: usize) -> Vec<TapId> {
    TapRequest::all(layers)
        .taps
        .into_iter()
        .flat_map(|t| [t, t])
        .collect()
}

const PROMPTS: [&[u32]; 3] = [
    &[3, 17, 42, 5, 60, 11, 29],
    &[9, 2, 33],
    &[50, 23, 37, 8, 1],
];

#[test]
fn micro_batched_deepseek_equals_plain_over_ragged_prefill_decode_and_tree() {
    let mut model = load("mla_qlora");
    let layers = model.spec.num_layers;
    let prefill = |c: &KvCache<B>| c.prefill_step(&PROMPTS).unwrap();
    let decode = |c: &KvCache<B>| c.decode_step(&[7, 12, 40]).unwrap();
    let tree = |c: &KvCache<B>| {
        let parents: &[Option<usize>] = &[None, Some(0), Some(0), Some(1)];
        c.tree_step(&[
            (&[4, 5, 6, 7], parents),
            (&[8, 9], &[None, Some(0)]),
            (&[10], &[None]),
        ])
        .unwrap()
    };
    // Three sequences split by rows [0, 2) and [2, 3).
    let visited = compare_paths(&mut model, 3, &[&prefill, &decode, &tree]);
    for v in visited {
        assert_eq!(v, interleaved(layers));
    }
    // Auto picks the micro-batched path for this MoE model and batch; plain for one sequence.
    let mut cache = model.new_cache(3, 16);
    let step = cache.prefill_step(&PROMPTS).unwrap();
    let out = model
        .forward(&step, &mut cache, &TapRequest::all(layers), LogitsFor::None)
        .unwrap();
    assert_eq!(out.taps.visited, interleaved(layers));
    let mut cache = model.new_cache(1, 16);
    let step = cache.prefill_step(&[PROMPTS[0]]).unwrap();
    let out = model
        .forward(&step, &mut cache, &TapRequest::all(layers), LogitsFor::None)
        .unwrap();
    assert_eq!(out.taps.visited, TapRequest::all(layers).taps);
}

#[test]
fn micro_batched_single_sequence_splits_its_tokens_and_equals_plain() {
    let mut model = load("yarn_noqlora");
    let layers = model.spec.num_layers;
    // Chunked prefill 7 + 4 tokens (slots [0, 4) + [4, 7), then [0, 2) + [2, 4)), then decode
    // (one token: nothing to split).
    let first = |c: &KvCache<B>| c.prefill_step(&[PROMPTS[0]]).unwrap();
    let second = |c: &KvCache<B>| c.prefill_step(&[&[13, 14, 15, 16][..]]).unwrap();
    let decode = |c: &KvCache<B>| c.decode_step(&[21]).unwrap();
    let visited = compare_paths(&mut model, 1, &[&first, &second, &decode]);
    assert_eq!(visited[0], interleaved(layers));
    assert_eq!(visited[1], interleaved(layers));
    assert_eq!(visited[2], TapRequest::all(layers).taps);
}

/// The lanes slice a grouped-query mask (4 query heads on 2 KV heads) and address cache rows of
/// a Llama model as well: forcing the micro-batched path there changes nothing either.
#[test]
fn micro_batched_llama_equals_plain() {
    let dir = scratch_dir("micro-llama");
    write_random_model(&dir, &tiny_config("LlamaForCausalLM", 3), 5).unwrap();
    let mut model = TargetModel::<B>::load(&dir, &Default::default()).unwrap();
    assert!(!model.spec.is_moe());
    let prefill = |c: &KvCache<B>| c.prefill_step(&PROMPTS).unwrap();
    let decode = |c: &KvCache<B>| c.decode_step(&[7, 12, 40]).unwrap();
    compare_paths(&mut model, 3, &[&prefill, &decode]);
    let single = |c: &KvCache<B>| c.prefill_step(&[PROMPTS[0]]).unwrap();
    compare_paths(&mut model, 1, &[&single]);
}
