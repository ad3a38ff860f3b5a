//! Tensor-parallel block arithmetic (issue #19): a target run as N ranks (q|k|v and gate|up
//! split by columns, o_proj and down_proj by rows, the partial products summed as the
//! all-reduce does) gives every tap point and the logits of the unsplit model, over a ragged
//! prefill, a decode step and a branching tree verification; the hook sees the reduced
//! residual stream once per step. The ranks run in one process here; the split and the
//! position of the reduction are what the test pins down. Tolerance: 1e-5 relative L2 (f32,
//! the split only reorders sums).

use tandem_model::backend::CpuBackend;
use tandem_model::burn::prelude::*;
use tandem_model::testing::{rel_l2, scratch_dir, tiny_config, write_random_model};
use tandem_model::{LogitsFor, ModelError, TapRequest, TargetModel};
use tandem_wiring::TapId;

type B = CpuBackend;

fn model(arch: &str) -> TargetModel<B> {
    let dir = scratch_dir(&format!("tensor-parallel-{arch}"));
    write_random_model(&dir, &tiny_config(arch, 3), 23).unwrap();
    TargetModel::load(&dir, &Default::default()).unwrap()
}

fn host<const D: usize>(t: Tensor<B, D>) -> Vec<f32> {
    t.into_data().to_vec::<f32>().unwrap()
}

/// Every tap and the logits of three steps over one cache: a ragged prefill of two sequences,
/// one decode step, and a branching tree for each.
fn steps(m: &TargetModel<B>) -> Vec<(String, Vec<f32>)> {
    let mut request = vec![TapId::Embed];
    request.extend((0..m.spec.num_layers).map(TapId::Block));
    request.push(TapId::Final);
    let request = TapRequest::new(request);
    let mut cache = m.new_cache(2, 64);
    let mut out = Vec::new();
    let mut record = |what: &str, o: tandem_model::StepOutput<B>| {
        for (tap, t) in request.taps.iter().zip(o.taps.tensors) {
            out.push((format!("{what} {tap}"), host(t)));
        }
        out.push((format!("{what} logits"), host(o.logits.unwrap())));
    };
    let seq_a: [u32; 5] = [5, 17, 42, 3, 88];
    let seq_b: [u32; 9] = [61, 9, 70, 33, 2, 50, 14, 8, 1];
    let step = cache.prefill_step(&[&seq_a, &seq_b]).unwrap();
    record(
        "prefill",
        m.forward(&step, &mut cache, &request, LogitsFor::All)
            .unwrap(),
    );
    let step = cache.decode_step(&[77, 23]).unwrap();
    record(
        "decode",
        m.forward(&step, &mut cache, &request, LogitsFor::All)
            .unwrap(),
    );
    let tokens: [u32; 4] = [64, 12, 40, 91];
    let parents = [None, Some(0), Some(0), Some(2)];
    let step = cache
        .tree_step(&[(&tokens, &parents), (&tokens, &parents)])
        .unwrap();
    record(
        "tree",
        m.forward(&step, &mut cache, &request, LogitsFor::All)
            .unwrap(),
    );
    out
}

fn check(arch: &str) {
    let plain = model(arch);
    let want = steps(&plain);
    for ranks in [2usize] {
        let mut split = plain.clone();
        split.set_tensor_parallel(ranks).unwrap();
        assert_eq!(split.tensor_parallel(), ranks);
        let got = steps(&split);
        assert_eq!(got.len(), want.len());
        let mut worst = 0f64;
        for ((name, g), (_, w)) in got.iter().zip(&want) {
            assert_eq!(g.len(), w.len(), "{name}");
            let err = rel_l2(g, w);
            worst = worst.max(err);
            assert!(err < 1e-5, "{arch} TP={ranks} {name}: rel L2 {err:.2e}");
        }
        eprintln!(
            "{arch} TP={ranks}: worst rel L2 over {} tensors {worst:.2e}",
            got.len()
        );
    }
    // The split really changes the arithmetic: one rank's partial MLP sum is not the tap.
    let ids = [5u32, 17, 42, 3, 88];
    let parts = plain.mlp_partial_sums(&ids, &[1], &[2]).unwrap();
    let full = tandem_model::CaptureTarget::capture_taps(
        &plain,
        &ids,
        &TapRequest::new(vec![TapId::Block(1)]),
    )
    .unwrap()
    .remove(0);
    assert!(rel_l2(&parts[0].3, &full) > 1e-2);
}

#[test]
fn llama_split_over_two_ranks_gives_the_unsplit_taps_and_logits() {
    check("LlamaForCausalLM");
}

#[test]
fn qwen2_split_over_two_ranks_gives_the_unsplit_taps_and_logits() {
    check("Qwen2ForCausalLM");
}

#[test]
fn degrees_that_do_not_split_the_heads_are_refused_by_name() {
    let mut m = model("LlamaForCausalLM");
    let err = m.set_tensor_parallel(3).unwrap_err();
    assert!(
        matches!(&err, ModelError::InvalidConfig { reason, .. }
            if reason.contains("num_attention_heads = 4 does not split over 3")),
        "{err}"
    );
    assert_eq!(m.tensor_parallel(), 1);
    assert!(m.set_tensor_parallel(0).is_err());
}
