//! The one-hook property: the taps and logits of a sequence are the same whether it is prefilled
//! at once, prefilled in chunks, decoded token by token, verified as a chain or a branching tree
//! in tree mode, or run inside a ragged batch; and every path passes every tap point.

use tandem_model::backend::CpuBackend;
use tandem_model::burn::prelude::*;
use tandem_model::testing::{scratch_dir, tiny_config, write_random_model};
use tandem_model::{KvCache, LogitsFor, StepInput, TapRequest, TargetModel};
use tandem_wiring::TapId;

type B = CpuBackend;
const TOL: f32 = 1e-4;

fn model(arch: &str) -> TargetModel<B> {
    let dir = scratch_dir(&format!("capture-{arch}"));
    write_random_model(&dir, &tiny_config(arch, 3), 11).unwrap();
    TargetModel::load(&dir, &Default::default()).unwrap()
}

fn taps(m: &TargetModel<B>) -> TapRequest {
    let mut t = vec![TapId::Embed];
    t.extend((0..m.spec.num_layers).map(TapId::Block));
    t.push(TapId::Final);
    TapRequest::new(t)
}

/// Per tap, per token rows `[hidden]` of sequence `b` for the real slots of a step, plus the
/// logits rows.
struct Rows {
    taps: Vec<Vec<Vec<f32>>>,
    logits: Vec<Vec<f32>>,
}

fn run(
    m: &TargetModel<B>,
    cache: &mut KvCache<B>,
    step: &StepInput,
    b: usize,
    slots: &[usize],
) -> Rows {
    run_rows(m, cache, step, &[(b, slots)]).remove(0)
}

/// One forward; the rows of several sequences (`(b, slots)` each).
fn run_rows(
    m: &TargetModel<B>,
    cache: &mut KvCache<B>,
    step: &StepInput,
    picks: &[(usize, &[usize])],
) -> Vec<Rows> {
    let out = m.forward(step, cache, &taps(m), LogitsFor::All).unwrap();
    let expected: Vec<TapId> = taps(m).taps;
    assert_eq!(
        out.taps.visited, expected,
        "the path must pass every tap point in order"
    );
    let logits = out.logits.unwrap();
    picks
        .iter()
        .map(|&(b, slots)| {
            let rows_of = |t: Tensor<B, 3>| -> Vec<Vec<f32>> {
                let [_, w, d] = t.dims();
                let v = t.into_data().to_vec::<f32>().unwrap();
                slots
                    .iter()
                    .map(|&i| v[(b * w + i) * d..(b * w + i + 1) * d].to_vec())
                    .collect()
            };
            Rows {
                taps: out
                    .taps
                    .tensors
                    .iter()
                    .map(|t| rows_of(t.clone()))
                    .collect(),
                logits: rows_of(logits.clone()),
            }
        })
        .collect()
}

fn append(acc: &mut Rows, more: Rows) {
    if acc.taps.is_empty() {
        *acc = more;
        return;
    }
    for (a, m) in acc.taps.iter_mut().zip(more.taps) {
        a.extend(m);
    }
    acc.logits.extend(more.logits);
}

fn assert_close(a: &Rows, b: &Rows, what: &str) {
    assert_eq!(a.taps.len(), b.taps.len());
    for (slot, (ta, tb)) in a.taps.iter().zip(&b.taps).enumerate() {
        assert_eq!(ta.len(), tb.len(), "{what}: tap {slot} token count");
        for (pos, (ra, rb)) in ta.iter().zip(tb).enumerate() {
            for (x, y) in ra.iter().zip(rb) {
                assert!(
                    (x - y).abs() <= TOL * (1.0 + y.abs()),
                    "{what}: tap slot {slot} token {pos}: {x} vs {y}"
                );
            }
        }
    }
    for (pos, (ra, rb)) in a.logits.iter().zip(&b.logits).enumerate() {
        for (x, y) in ra.iter().zip(rb) {
            assert!(
                (x - y).abs() <= TOL * (1.0 + y.abs()),
                "{what}: logits token {pos}: {x} vs {y}"
            );
        }
    }
}

const SEQ: [u32; 12] = [5, 17, 42, 3, 88, 61, 9, 70, 33, 2, 50, 14];

fn reference(m: &TargetModel<B>) -> Rows {
    reference_of(m, &SEQ)
}

fn reference_of(m: &TargetModel<B>, seq: &[u32]) -> Rows {
    let mut cache = m.new_cache(1, 64);
    let step = cache.prefill_step(&[seq]).unwrap();
    run(m, &mut cache, &step, 0, &(0..seq.len()).collect::<Vec<_>>())
}

/// The first `n` tokens of `rows`.
fn first(rows: &Rows, n: usize) -> Rows {
    Rows {
        taps: rows.taps.iter().map(|t| t[..n].to_vec()).collect(),
        logits: rows.logits[..n].to_vec(),
    }
}

fn check_all_paths(arch: &str) {
    let m = model(arch);
    let full = reference(&m);

    // Chunked prefill: 5 + 7.
    let mut cache = m.new_cache(1, 64);
    let mut rows = Rows {
        taps: vec![],
        logits: vec![],
    };
    for chunk in [&SEQ[..5], &SEQ[5..]] {
        let step = cache.prefill_step(&[chunk]).unwrap();
        append(
            &mut rows,
            run(
                &m,
                &mut cache,
                &step,
                0,
                &(0..chunk.len()).collect::<Vec<_>>(),
            ),
        );
    }
    assert_close(&rows, &full, "chunked prefill");

    // Token-by-token decode.
    let mut cache = m.new_cache(1, 64);
    let mut rows = Rows {
        taps: vec![],
        logits: vec![],
    };
    for t in SEQ {
        let step = cache.decode_step(&[t]).unwrap();
        append(&mut rows, run(&m, &mut cache, &step, 0, &[0]));
    }
    assert_close(&rows, &full, "decode");

    // Prefill 4, then the remaining 8 verified as a chain in tree mode.
    let mut cache = m.new_cache(1, 64);
    let step = cache.prefill_step(&[&SEQ[..4]]).unwrap();
    let mut rows = run(&m, &mut cache, &step, 0, &[0, 1, 2, 3]);
    let parents: Vec<Option<usize>> = (0..8)
        .map(|i| if i == 0 { None } else { Some(i - 1) })
        .collect();
    let step = cache.tree_step(&[(&SEQ[4..], &parents)]).unwrap();
    append(
        &mut rows,
        run(&m, &mut cache, &step, 0, &(0..8).collect::<Vec<_>>()),
    );
    assert_close(&rows, &full, "tree chain");

    // A branching tree after prefill 6: nodes [a, x, b, y] with a->b the true path (SEQ[6],
    // SEQ[7]) and x, y decoys (x sibling of a, y child of x). The true path's rows must equal the
    // reference; then keep only the accepted path and continue decoding the rest.
    let mut cache = m.new_cache(1, 64);
    let step = cache.prefill_step(&[&SEQ[..6]]).unwrap();
    let mut rows = run(&m, &mut cache, &step, 0, &(0..6).collect::<Vec<_>>());
    let tree_tokens = [SEQ[6], 1, SEQ[7], 4];
    let tree_parents = [None, None, Some(0), Some(1)];
    let step = cache.tree_step(&[(&tree_tokens, &tree_parents)]).unwrap();
    append(&mut rows, run(&m, &mut cache, &step, 0, &[0, 2]));
    cache.keep_only(0, 4, &[0, 2]);
    assert_eq!(cache.seq_len(0), 8);
    for &t in &SEQ[8..] {
        let step = cache.decode_step(&[t]).unwrap();
        append(&mut rows, run(&m, &mut cache, &step, 0, &[0]));
    }
    assert_close(&rows, &full, "branching tree + commit + decode");

    // Ragged batch: sequence 1 is SEQ, sequence 0 a shorter different prompt.
    let other = [7u32, 7, 8];
    let mut cache = m.new_cache(2, 64);
    let step = cache.prefill_step(&[&other, &SEQ[..9]]).unwrap();
    let mut rows = run(&m, &mut cache, &step, 1, &(0..9).collect::<Vec<_>>());
    let step = cache.prefill_step(&[&[1, 2, 3], &SEQ[9..]]).unwrap();
    append(&mut rows, run(&m, &mut cache, &step, 1, &[0, 1, 2]));
    assert_close(&rows, &full, "ragged batch");
}

#[test]
fn llama_taps_are_path_independent() {
    check_all_paths("LlamaForCausalLM");
}

#[test]
fn qwen2_taps_are_path_independent() {
    check_all_paths("Qwen2ForCausalLM");
}

#[test]
fn qwen3_taps_are_path_independent() {
    check_all_paths("Qwen3ForCausalLM");
}

#[test]
fn full_cache_is_refused_before_anything_is_written() {
    let m = model("LlamaForCausalLM");
    let mut cache = m.new_cache(1, 8);
    let step = cache.prefill_step(&[&SEQ[..6]]).unwrap();
    m.forward(&step, &mut cache, &TapRequest::none(), LogitsFor::None)
        .unwrap();
    let step = cache.prefill_step(&[&SEQ[6..]]).unwrap();
    let err = m
        .forward(&step, &mut cache, &TapRequest::none(), LogitsFor::None)
        .unwrap_err();
    assert!(err.to_string().contains("KV cache is full"), "{err}");
    assert_eq!(cache.used(), 6, "nothing written by the refused step");
}

#[test]
fn out_of_range_tokens_and_taps_are_named() {
    let m = model("LlamaForCausalLM");
    let mut cache = m.new_cache(1, 8);
    let step = cache.prefill_step(&[&[1, 500]]).unwrap();
    let err = m
        .forward(&step, &mut cache, &TapRequest::none(), LogitsFor::None)
        .unwrap_err();
    assert!(err.to_string().contains("500"), "{err}");
    let step = cache.prefill_step(&[&[1, 2]]).unwrap();
    let err = m
        .forward(
            &step,
            &mut cache,
            &TapRequest::new(vec![TapId::Block(3)]),
            LogitsFor::None,
        )
        .unwrap_err();
    assert!(err.to_string().contains("block"), "{err}");
}

/// A running batch: sequence B is prefilled on its own and joins A's cache as a new row; a
/// tree step with a rejected sibling leaves invalid columns; compaction moves every sequence's
/// columns to the front; A leaves and B decodes on. Every token's taps and logits must equal
/// the same sequence run alone.
#[test]
fn sequences_join_leave_and_compact_without_changing_taps() {
    const OTHER: [u32; 9] = [8, 1, 77, 23, 64, 12, 40, 91, 6];
    let m = model("LlamaForCausalLM");
    let (want_a, want_b) = (reference_of(&m, &SEQ), reference_of(&m, &OTHER));
    let empty = || Rows {
        taps: Vec::new(),
        logits: Vec::new(),
    };
    let (mut got_a, mut got_b) = (empty(), empty());

    let capacity = 24;
    let mut cache = m.new_cache(1, capacity);
    let step = cache.prefill_step(&[&SEQ[..5]]).unwrap();
    append(&mut got_a, run(&m, &mut cache, &step, 0, &[0, 1, 2, 3, 4]));

    let mut newcomer = m.new_cache(1, capacity);
    let step = newcomer.prefill_step(&[&OTHER[..3]]).unwrap();
    append(&mut got_b, run(&m, &mut newcomer, &step, 0, &[0, 1, 2]));
    cache.append(newcomer).unwrap();
    assert_eq!((cache.batch(), cache.used()), (2, 5));
    assert_eq!((cache.seq_len(0), cache.seq_len(1)), (5, 3));

    // Each sequence verifies its true next token beside a wrong sibling and keeps the first.
    let trees: [(&[u32], &[Option<usize>]); 2] = [
        (&[SEQ[5], 0], &[None, None]),
        (&[OTHER[3], 1], &[None, None]),
    ];
    let step = cache.tree_step(&trees).unwrap();
    let mut rows = run_rows(&m, &mut cache, &step, &[(0, &[0]), (1, &[0])]);
    append(&mut got_b, rows.pop().unwrap());
    append(&mut got_a, rows.pop().unwrap());
    cache.keep_only(0, 2, &[0]);
    cache.keep_only(1, 2, &[0]);

    for i in 0..2 {
        let step = cache.decode_step(&[SEQ[6 + i], OTHER[4 + i]]).unwrap();
        let mut rows = run_rows(&m, &mut cache, &step, &[(0, &[0]), (1, &[0])]);
        append(&mut got_b, rows.pop().unwrap());
        append(&mut got_a, rows.pop().unwrap());
    }
    assert_eq!(cache.used(), 9);
    cache.compact();
    assert_eq!(
        (cache.used(), cache.seq_len(0), cache.seq_len(1)),
        (8, 8, 6),
        "compaction reclaims padding and rejected columns"
    );

    let step = cache.decode_step(&[SEQ[8], OTHER[6]]).unwrap();
    let mut rows = run_rows(&m, &mut cache, &step, &[(0, &[0]), (1, &[0])]);
    append(&mut got_b, rows.pop().unwrap());
    append(&mut got_a, rows.pop().unwrap());

    cache.remove(0);
    assert_eq!((cache.batch(), cache.seq_len(0)), (1, 7));
    let step = cache.prefill_step(&[&OTHER[7..]]).unwrap();
    append(&mut got_b, run(&m, &mut cache, &step, 0, &[0, 1]));

    assert_close(
        &got_a,
        &first(&want_a, 9),
        "sequence A in the running batch",
    );
    assert_close(&got_b, &want_b, "sequence B in the running batch");
}
