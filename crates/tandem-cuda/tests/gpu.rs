//! GPU tests of the fast path. They need an NVIDIA GPU, so CI (no GPU) lists them as ignored;
//! on the device machine run the built test binary with `--ignored` (scripts/gpu/fast_path.sh).

use std::sync::Arc;

use rand::{Rng, SeedableRng};
use tandem_cuda::check::{CheckPoint, Tolerance, check_point, load_pair};
use tandem_cuda::{DeviceRows, Gpu, reference};
use tandem_model::testing::{rel_err, scratch_dir, write_random_model};
use tandem_model::{HfConfig, LogitsFor, TapRequest, Taps};
use tandem_wiring::TapId;

fn gpu() -> Arc<Gpu> {
    Gpu::new(0).expect("these tests need a CUDA GPU")
}

/// A small model the kernels accept (head_dim 32), in a fresh directory.
fn tiny_model(architecture: &str, tied: bool, seed: u64) -> std::path::PathBuf {
    tiny_model_with(architecture, tied, seed, 32)
}

/// [`tiny_model`] with heads of `head_dim` (4 heads; hidden stays 128, so q is 4 * head_dim
/// wide, as in Qwen3 where heads * head_dim need not equal hidden).
fn tiny_model_with(
    architecture: &str,
    tied: bool,
    seed: u64,
    head_dim: usize,
) -> std::path::PathBuf {
    let config: HfConfig = serde_json::from_value(serde_json::json!({
        "architectures": [architecture],
        "hidden_size": 128, "intermediate_size": 192, "num_hidden_layers": 3,
        "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5,
        "head_dim": head_dim,
        "rope_theta": 10000.0, "vocab_size": 300, "max_position_embeddings": 4096,
        "tie_word_embeddings": tied
    }))
    .expect("config");
    let dir = scratch_dir(&format!("cuda-{architecture}-{tied}-{head_dim}"));
    write_random_model(&dir, &config, seed).expect("model written");
    dir
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn fast_path_matches_the_burn_reference_in_every_mode() {
    let gpu = gpu();
    // Qwen3: per-head q/k RMSNorm before RoPE, and heads * head_dim (256) != hidden (128).
    for (architecture, tied, head_dim) in [
        ("LlamaForCausalLM", true, 32),
        ("Qwen2ForCausalLM", false, 32),
        ("Qwen3ForCausalLM", true, 64),
    ] {
        let dir = tiny_model_with(architecture, tied, 7, head_dim);
        let (fast, reference) = load_pair(&dir, gpu.clone()).expect("both paths load");
        for (batch, kv_len) in [
            (1, 1),
            (1, 2),
            (1, 33),
            (1, 300),
            (3, 40),
            (5, 17),
            (16, 64),
        ] {
            let report = check_point(
                &fast,
                &reference,
                CheckPoint { batch, kv_len },
                Tolerance::default(),
            )
            .expect("point runs");
            eprintln!("{architecture} {report:?}");
            assert!(
                report.passed,
                "{architecture} batch {batch} kv {kv_len}: {report:?}"
            );
            assert_eq!(report.greedy_real_mismatches, 0);
        }
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn every_mode_passes_every_tap_point_through_the_hook() {
    let dir = tiny_model("LlamaForCausalLM", true, 3);
    let (fast, _) = load_pair(&dir, gpu()).expect("loads");
    let layers = fast.spec.num_layers;
    let mut expected = vec![TapId::Embed];
    expected.extend((0..layers).map(TapId::Block));
    expected.push(TapId::Final);
    let request = TapRequest::new(vec![TapId::Block(1), TapId::Embed, TapId::Block(1)]);
    let mut cache = fast.new_cache(2, 32).expect("cache");
    let steps = [cache
        .layout()
        .prefill_step(&[&[5, 6, 7], &[9]])
        .expect("prefill")];
    let out = fast
        .forward(&steps[0], &mut cache, &request, LogitsFor::Last)
        .expect("prefill runs");
    assert_eq!(out.taps.visited, expected, "prefill");
    assert_eq!(out.taps.taps, request.taps);
    // Slots 0 and 2 asked for the same tap: equal copies.
    assert_eq!(
        out.taps.tensors[0].to_host().unwrap(),
        out.taps.tensors[2].to_host().unwrap()
    );
    let step = cache.layout().decode_step(&[1, 2]).expect("decode");
    let out = fast
        .forward(&step, &mut cache, &request, LogitsFor::Last)
        .expect("decode runs");
    assert_eq!(out.taps.visited, expected, "decode");
    let step = cache
        .layout()
        .tree_step(&[
            (&[3, 4][..], &[None, Some(0)][..]),
            (&[8, 9][..], &[None, None][..]),
        ])
        .expect("tree");
    let out = fast
        .forward(&step, &mut cache, &request, LogitsFor::All)
        .expect("tree runs");
    assert_eq!(out.taps.visited, expected, "tree");
    let DeviceRows {
        batch,
        width,
        hidden,
        ..
    } = out.taps.tensors[1];
    assert_eq!((batch, width, hidden), (2, 2, 128));
}

/// Two steps' taps: the same tap points walked, the same rows, and each slot within `tolerance`
/// of the largest value.
fn assert_taps_close(a: &Taps<DeviceRows>, b: &Taps<DeviceRows>, tolerance: f32, label: &str) {
    assert_eq!(a.visited, b.visited, "{label}: tap points");
    for (slot, (ta, tb)) in a.tensors.iter().zip(&b.tensors).enumerate() {
        assert_eq!(ta.batch, tb.batch, "{label}: tap rows");
        let gap = rel_err(&ta.to_host().unwrap(), &tb.to_host().unwrap());
        assert!(
            gap <= tolerance,
            "{label}: tap slot {slot} differs by {gap}"
        );
    }
}

/// A step's outputs against a reference's (`expected`): logits and every tap slot within
/// `tolerance` of the largest value, and the same greedy token in every row unless the
/// reference has a near-tie there (within twice that tolerance); returns the reference's
/// greedy tokens.
fn assert_outputs_close(
    got: tandem_cuda::CudaStepOutput,
    expected: tandem_cuda::CudaStepOutput,
    tolerance: f32,
    label: &str,
) -> Vec<u32> {
    let (lg, le) = (
        got.logits.expect("logits"),
        expected.logits.expect("logits"),
    );
    let (hg, he) = (lg.to_host().unwrap(), le.to_host().unwrap());
    let gap = rel_err(&hg, &he);
    assert!(gap <= tolerance, "{label}: logits differ by {gap}");
    let (ids_g, ids_e) = (lg.argmax().unwrap(), le.argmax().unwrap());
    for (row, (&x, &y)) in ids_g.iter().zip(&ids_e).enumerate() {
        let logits = &he[row * le.vocab..(row + 1) * le.vocab];
        // A changed argmax is forgiven within what the logits tolerance allows (relative to
        // the row's largest logit, ~20 on the tied test models).
        let largest = logits.iter().fold(0f32, |m, v| m.max(v.abs()));
        let margin = (logits[y as usize] - logits[x as usize]).abs();
        assert!(
            x == y || margin <= 2.0 * tolerance * largest.max(1.0),
            "{label} row {row}: greedy {x} vs {y} (margin {margin})"
        );
    }
    assert_taps_close(&got.taps, &expected.taps, tolerance, label);
    ids_e
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn graph_replay_gives_the_eager_outputs() {
    // Two copies of the same target, one replaying CUDA graphs for decode-sized steps and one
    // launching every kernel: a ragged prefill, decode steps (the first two of a shape run
    // eagerly, the third is captured, the rest replay), tree steps with logits for every slot and taps,
    // more decode: the same logits (the same kernels with the same inputs; 1e-6 of the largest
    // logit allows cuBLAS a different reduction order inside a capture), the same greedy
    // tokens, the same taps and tap-point walk.
    // Second case: 3 sequences in a cache reserved for 8, so graphed steps are padded to a
    // batch of 4 (copies of sequence 0 in the spare rows) and trimmed back.
    let two: &[&[u32]] = &[&[5, 6, 7, 8, 9], &[11, 12]];
    let three: &[&[u32]] = &[&[5, 6, 7, 8, 9], &[11, 12], &[3, 1, 4, 1]];
    graph_replay_case(two, 0);
    graph_replay_case(three, 8);
}

fn graph_replay_case(prompts: &[&[u32]], reserve: usize) {
    let gpu = gpu();
    let dir = tiny_model("LlamaForCausalLM", false, 11);
    let graphed = tandem_cuda::CudaTarget::load(&dir, gpu.clone()).expect("loads");
    let eager = tandem_cuda::CudaTarget::load(&dir, gpu.clone()).expect("loads");
    eager.set_graphs(false);
    let taps = TapRequest::new(vec![TapId::Block(1), TapId::Final, TapId::Embed]);
    // The same requests twice, on new caches each time: the second pass's caches get the
    // first pass's buffers back from the pool (zeroed), so its steps replay the graphs the
    // first pass captured, from its first decode step on, and still equal the eager ones.
    for pass in 0..2 {
        let mut caches = [
            graphed.new_cache(prompts.len(), 128).expect("cache"),
            eager.new_cache(prompts.len(), 128).expect("cache"),
        ];
        caches[0].reserve(&gpu, reserve).expect("reserve");
        graph_replay_pass(&graphed, &eager, &taps, prompts, &mut caches, pass);
        let stats = graphed.graph_stats();
        eprintln!("graphs after pass {pass}: {stats:?}");
        // The decode shape and the tree shape were each captured once, on their third step,
        // and replayed from then on: decode 4 + 3 times, the tree twice; in the second pass
        // all 6 + 4 + 3 steps replay.
        assert_eq!(stats.captured, 2, "pass {pass}: {stats:?}");
        assert_eq!(stats.replays, [9, 22][pass], "pass {pass}: {stats:?}");
    }
    assert_eq!(eager.graph_stats(), tandem_cuda::GraphStats::default());
}

fn graph_replay_pass(
    graphed: &tandem_cuda::CudaTarget,
    eager: &tandem_cuda::CudaTarget,
    taps: &TapRequest,
    prompts: &[&[u32]],
    caches: &mut [tandem_cuda::CudaKvCache; 2],
    pass: usize,
) {
    let prefill = caches[0].layout().prefill_step(prompts).expect("prefill");
    let compare = |step: &tandem_model::StepInput,
                   caches: &mut [tandem_cuda::CudaKvCache; 2],
                   logits_for: LogitsFor,
                   label: &str|
     -> Vec<u32> {
        let label = format!("pass {pass}, {label}");
        let [a, b] = caches;
        let out_a = graphed
            .forward(step, a, taps, logits_for)
            .expect("graphed step");
        let out_b = eager
            .forward(step, b, taps, logits_for)
            .expect("eager step");
        let (la, lb) = (out_a.logits.expect("logits"), out_b.logits.expect("logits"));
        assert_eq!(la.rows, lb.rows, "{label}: logits rows");
        let gap = rel_err(&la.to_host().unwrap(), &lb.to_host().unwrap());
        assert!(
            gap <= 1e-6,
            "{label}: logits differ by {gap} of the largest"
        );
        let ids = la.argmax().unwrap();
        assert_eq!(ids, lb.argmax().unwrap(), "{label}: greedy tokens");
        assert_taps_close(&out_a.taps, &out_b.taps, 1e-6, &label);
        ids
    };
    let mut next = compare(&prefill, caches, LogitsFor::Last, "prefill");
    for i in 0..6 {
        let step = caches[0].layout().decode_step(&next).expect("decode");
        next = compare(&step, caches, LogitsFor::Last, &format!("decode {i}"));
    }
    for i in 0..4 {
        let drafts: Vec<Vec<u32>> = next.iter().map(|&t| vec![t, t + 1, t + 2]).collect();
        let parents = [None, Some(0), Some(0)];
        let trees: Vec<(&[u32], &[Option<usize>])> = drafts
            .iter()
            .map(|d| (d.as_slice(), &parents[..]))
            .collect();
        let step = caches[0].layout().tree_step(&trees).expect("tree");
        let ids = compare(&step, caches, LogitsFor::All, &format!("tree {i}"));
        next = ids.iter().step_by(3).copied().collect();
    }
    for i in 0..3 {
        let step = caches[0].layout().decode_step(&next).expect("decode");
        next = compare(&step, caches, LogitsFor::Last, &format!("late decode {i}"));
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn norm_silu_and_argmax_kernels_match_their_references() {
    let gpu = gpu();
    let mut rng = rand::rngs::StdRng::seed_from_u64(11);
    let (rows, hidden) = (5, 576);
    let x: Vec<f32> = (0..rows * hidden)
        .map(|_| rng.random_range(-30.0..30.0))
        .collect();
    let delta: Vec<f32> = (0..rows * hidden)
        .map(|_| rng.random_range(-3.0..3.0))
        .collect();
    let w: Vec<f32> = (0..hidden)
        .map(|_| reference::round_bf16(rng.random_range(0.5..1.5)))
        .collect();
    let w_bits: Vec<u16> = w
        .iter()
        .map(|&v| half::bf16::from_f32(v).to_bits())
        .collect();
    let mut x_d = gpu.upload(&x).unwrap();
    let delta_d = gpu.upload(&delta).unwrap();
    let w_d = gpu.upload(&w_bits).unwrap();
    let mut out = gpu.zeros::<u16>(rows * hidden).unwrap();
    let mut out_f32 = gpu.zeros::<f32>(rows * hidden).unwrap();
    gpu.add_rms_norm(
        &mut x_d,
        Some(&delta_d),
        &w_d,
        &mut out,
        Some(&mut out_f32),
        rows,
        hidden,
        1e-5,
    )
    .unwrap();
    let sum: Vec<f32> = x.iter().zip(&delta).map(|(a, b)| a + b).collect();
    let expected = reference::rms_norm(&sum, &w, 1e-5);
    let got = gpu.download(&out_f32).unwrap();
    let worst = got
        .iter()
        .zip(&expected)
        .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
    assert!(worst < 1e-4, "rms norm off by {worst}");
    assert_eq!(
        gpu.download(&x_d).unwrap(),
        sum,
        "the residual add is written back exactly"
    );
    let bf16_out: Vec<f32> = gpu
        .download(&out)
        .unwrap()
        .iter()
        .map(|&b| half::bf16::from_bits(b).to_f32())
        .collect();
    assert!(
        bf16_out
            .iter()
            .zip(&expected)
            .all(|(a, b)| *a == reference::round_bf16(*b))
    );

    let inter = 300;
    let gate_up: Vec<f32> = (0..rows * 2 * inter)
        .map(|_| rng.random_range(-8.0..8.0))
        .collect();
    let mut act = gpu.zeros::<u16>(rows * inter).unwrap();
    gpu.silu_mul(&gpu.upload(&gate_up).unwrap(), &mut act, rows, inter)
        .unwrap();
    let act: Vec<f32> = gpu
        .download(&act)
        .unwrap()
        .iter()
        .map(|&b| half::bf16::from_bits(b).to_f32())
        .collect();
    for r in 0..rows {
        let g = &gate_up[r * 2 * inter..r * 2 * inter + inter];
        let u = &gate_up[r * 2 * inter + inter..(r + 1) * 2 * inter];
        for (a, e) in act[r * inter..(r + 1) * inter]
            .iter()
            .zip(reference::silu_mul(g, u))
        {
            assert!((a - e).abs() <= e.abs() * 8e-3 + 1e-6, "silu {a} vs {e}");
        }
    }

    // torch.argmax's first index, also for ties far apart, a maximum in the last entry and a
    // constant row, at a few rows and at more, through `argmax_rows_split` (fewer rows than
    // SMs: parts of a row in blocks of their own) and `argmax_rows` (a block a row).
    let vocab = 49_152;
    let mut logits: Vec<f32> = (0..10 * vocab)
        .map(|_| rng.random_range(-10.0..10.0))
        .collect();
    logits[vocab + 777] = 99.0;
    logits[vocab + 40_000] = 99.0; // a tie: the first index wins, as in torch.argmax
    logits[3 * vocab..4 * vocab].fill(1.0);
    logits[5 * vocab - 1] = 50.0;
    let device = gpu.upload(&logits).unwrap();
    for split in [true, false] {
        gpu.set_argmax_split(split);
        for rows in [5, 10] {
            let got = gpu.argmax_rows(&device, rows, vocab).unwrap();
            let expected: Vec<u32> = logits
                .chunks(vocab)
                .take(rows)
                .map(|r| reference::argmax(r) as u32)
                .collect();
            assert_eq!(got, expected, "{rows} rows, split {split}");
            assert_eq!(
                &got[1..5],
                &[777, expected[2], 0, vocab as u32 - 1],
                "{rows} rows, split {split}"
            );
        }
    }
    // NaNs (never a maximum) around a row's maximum, a row of NaNs and -inf (token 0), and a
    // head's 32,000-token rows through a d2t-like table: the split's ids are the block-a-row
    // kernel's, launched again and again (each launch leaves its counts at 0 for the next).
    let draft_vocab = 32_000;
    let mut odd: Vec<f32> = (0..3 * draft_vocab)
        .map(|_| rng.random_range(-10.0..10.0))
        .collect();
    for i in (0..draft_vocab).step_by(3) {
        odd[i] = f32::NAN;
    }
    odd[20_001] = 60.0;
    for (i, v) in odd[draft_vocab..2 * draft_vocab].iter_mut().enumerate() {
        *v = if i % 2 == 0 {
            f32::NAN
        } else {
            f32::NEG_INFINITY
        };
    }
    let odd_device = gpu.upload(&odd).unwrap();
    let table: Vec<u32> = (0..draft_vocab as u32).map(|i| 3 * i + 1).collect();
    let table = gpu.upload(&table).unwrap();
    let ids = |split: bool| {
        gpu.set_argmax_split(split);
        let mut out = gpu.scratch::<u32>(3).unwrap();
        gpu.argmax_rows_into(
            &odd_device,
            3,
            draft_vocab,
            Some(&table),
            &mut out.slice_mut(..),
        )
        .unwrap();
        gpu.download(&out).unwrap()
    };
    let plain = ids(false);
    assert_eq!(
        &plain[..2],
        &[3 * 20_001 + 1, 1],
        "NaNs skipped; no maximum: token 0"
    );
    for _ in 0..3 {
        assert_eq!(ids(true), plain);
    }
    gpu.set_argmax_split(true);
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn rope_cache_write_and_attention_kernels_match_their_references() {
    use tandem_cuda::AttentionShape;
    let gpu = gpu();
    let mut rng = rand::rngs::StdRng::seed_from_u64(5);
    let shape = AttentionShape {
        batch: 2,
        width: 3,
        heads: 4,
        kv_heads: 2,
        head_dim: 64,
        capacity: 16,
    };
    let (rows, hd) = (shape.rows(), shape.head_dim);
    let (q_dim, kv_dim) = (shape.heads * hd, shape.kv_heads * hd);
    let col0 = 5;
    let total = col0 + shape.width;
    let qkv: Vec<f32> = (0..rows * (q_dim + 2 * kv_dim))
        .map(|_| rng.random_range(-2.0..2.0))
        .collect();
    let positions: Vec<i32> = (0..rows as i32).map(|r| 40 + 7 * r).collect();
    let inv_freq: Vec<f32> = (0..hd / 2)
        .map(|j| 10000f32.powf(-(2.0 * j as f32) / hd as f32))
        .collect();
    // Columns before col0 hold earlier tokens: random bf16 values.
    let cache_len = shape.batch * kv_dim * shape.capacity;
    let old: Vec<u16> = (0..cache_len)
        .map(|_| half::bf16::from_f32(rng.random_range(-2.0..2.0)).to_bits())
        .collect();
    let mut k_cache = gpu.upload(&old).unwrap();
    let mut v_cache = gpu
        .upload(&old.iter().rev().copied().collect::<Vec<_>>())
        .unwrap();
    let mut q = gpu.zeros::<f32>(rows * q_dim).unwrap();
    gpu.rope_qkv(
        &gpu.upload(&qkv).unwrap(),
        None,
        &gpu.upload(&positions).unwrap().as_view(),
        &gpu.upload(&inv_freq).unwrap(),
        &mut q,
        &mut k_cache,
        &mut v_cache,
        shape,
        col0,
        None,
    )
    .unwrap();
    let q_host = gpu.download(&q).unwrap();
    let bf = |b: u16| half::bf16::from_bits(b).to_f32();
    let keys: Vec<f32> = gpu
        .download(&k_cache)
        .unwrap()
        .into_iter()
        .map(bf)
        .collect();
    let values: Vec<f32> = gpu
        .download(&v_cache)
        .unwrap()
        .into_iter()
        .map(bf)
        .collect();
    let at =
        |b: usize, h: usize, col: usize| ((b * shape.kv_heads + h) * shape.capacity + col) * hd;
    for r in 0..rows {
        let (b, i) = (r / shape.width, r % shape.width);
        let row = &qkv[r * (q_dim + 2 * kv_dim)..(r + 1) * (q_dim + 2 * kv_dim)];
        for h in 0..shape.heads {
            let expected =
                reference::rope(&row[h * hd..(h + 1) * hd], &inv_freq, positions[r] as usize);
            let got = &q_host[r * q_dim + h * hd..r * q_dim + (h + 1) * hd];
            assert!(
                got.iter().zip(&expected).all(|(a, e)| (a - e).abs() < 1e-4),
                "q row {r} head {h}"
            );
        }
        for h in 0..shape.kv_heads {
            let k = reference::rope(
                &row[q_dim + h * hd..q_dim + (h + 1) * hd],
                &inv_freq,
                positions[r] as usize,
            );
            let v = &row[q_dim + kv_dim + h * hd..q_dim + kv_dim + (h + 1) * hd];
            let col = at(b, h, col0 + i);
            assert!(
                keys[col..col + hd]
                    .iter()
                    .zip(&k)
                    .all(|(a, e)| *a == reference::round_bf16(*e)),
                "k {r} {h}"
            );
            assert!(
                values[col..col + hd]
                    .iter()
                    .zip(v)
                    .all(|(a, e)| *a == reference::round_bf16(*e)),
                "v {r} {h}"
            );
        }
    }
    // A random visibility pattern with at least one visible column per row.
    let mut mask = vec![f32::NEG_INFINITY; rows * total];
    let mut visible = vec![vec![false; total]; rows];
    for r in 0..rows {
        for c in 0..total {
            visible[r][c] = c == r % total || rng.random_bool(0.6);
            if visible[r][c] {
                mask[r * total + c] = 0.0;
            }
        }
    }
    let mut out = gpu.zeros::<u16>(rows * q_dim).unwrap();
    gpu.attention(
        &q,
        &k_cache,
        &v_cache,
        &gpu.upload(&mask).unwrap(),
        None,
        &mut out,
        shape,
        total,
        None,
    )
    .unwrap();
    let out: Vec<f32> = gpu.download(&out).unwrap().into_iter().map(bf).collect();
    let groups = shape.heads / shape.kv_heads;
    for r in 0..rows {
        let b = r / shape.width;
        for h in 0..shape.heads {
            let kvh = h / groups;
            let ks: Vec<Vec<f32>> = (0..total)
                .map(|c| keys[at(b, kvh, c)..at(b, kvh, c) + hd].to_vec())
                .collect();
            let vs: Vec<Vec<f32>> = (0..total)
                .map(|c| values[at(b, kvh, c)..at(b, kvh, c) + hd].to_vec())
                .collect();
            let expected = reference::attention(
                &q_host[r * q_dim + h * hd..r * q_dim + (h + 1) * hd],
                &ks,
                &vs,
                &visible[r],
            );
            let got = &out[r * q_dim + h * hd..r * q_dim + (h + 1) * hd];
            // The output is stored in bf16: one rounding (2^-8 relative) plus f32 summation order.
            assert!(
                got.iter()
                    .zip(&expected)
                    .all(|(a, e)| (a - e).abs() <= e.abs() * 8e-3 + 1e-3),
                "attention row {r} head {h}: {got:?} vs {expected:?}"
            );
        }
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn topk_softmax_kernel_matches_its_reference() {
    let gpu = gpu();
    let mut rng = rand::rngs::StdRng::seed_from_u64(5);
    let (rows, vocab) = (7, 8192);
    let mut logits: Vec<f32> = (0..rows * vocab)
        .map(|_| rng.random_range(-12.0..12.0))
        .collect();
    // Exact ties at the top of row 0 and a peaked row 1: ties must go to the lower index.
    logits[100] = 40.0;
    logits[7] = 40.0;
    logits[vocab + 5000] = 60.0;
    let device = gpu.upload(&logits).unwrap();
    for k in [1, 4, 8] {
        let (probs, ids) = gpu.topk_softmax_rows(&device, rows, vocab, k).unwrap();
        for r in 0..rows {
            let (want_p, want_i) = reference::topk_softmax(&logits[r * vocab..(r + 1) * vocab], k);
            let got_i: Vec<usize> = ids[r * k..(r + 1) * k]
                .iter()
                .map(|&i| i as usize)
                .collect();
            assert_eq!(got_i, want_i, "row {r}, k {k}");
            for (g, w) in probs[r * k..(r + 1) * k].iter().zip(&want_p) {
                assert!(
                    (g - w).abs() <= 1e-5 * w.max(1e-3),
                    "row {r}, k {k}: {g} vs {w}"
                );
            }
        }
    }
}

/// The kernel's two ways to the top k (each thread's own best entries merged, for the drafting
/// k; k argmax passes over the whole row, for larger k) give the same ids and the very same
/// probability bits, also on rows built to trip them: many exact ties, a row's top entries all
/// in one thread's share, -inf entries, NaNs, and fewer choosable entries than k (id 0
/// repeated). Rows 1 to 8 of a draft vocabulary, against the reference where it applies.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn topk_softmax_single_pass_agrees_bit_for_bit_with_the_argmax_passes() {
    let gpu = gpu();
    let mut rng = rand::rngs::StdRng::seed_from_u64(11);
    let vocab = 32_000;
    for rows in 1..=8usize {
        // Quarter steps in [-10, 10): thousands of exact ties in every row (never -0.0).
        let mut logits: Vec<f32> = (0..rows * vocab)
            .map(|_| rng.random_range(-40i32..40) as f32 * 0.25)
            .collect();
        let mut host_checked = vec![true; rows];
        for r in 0..rows {
            let row = &mut logits[r * vocab..(r + 1) * vocab];
            match r % 4 {
                // The top entries all in thread 5's share (block of 1024), two of them tied.
                1 => {
                    for (n, i) in (5..vocab).step_by(1024).take(9).enumerate() {
                        row[i] = 30.0 - (n / 2) as f32;
                    }
                }
                // -inf entries, and an exact tie at the top across threads.
                2 => {
                    for i in (0..vocab).step_by(7) {
                        row[i] = f32::NEG_INFINITY;
                    }
                    row[3000] = 20.0;
                    row[1] = 20.0;
                }
                // NaNs (never chosen; the probabilities are NaN).
                3 => {
                    for i in (0..vocab).step_by(5) {
                        row[i] = f32::NAN;
                    }
                    host_checked[r] = false;
                }
                _ => {}
            }
        }
        // The last row of an odd batch: only three choosable entries.
        if rows % 2 == 1 {
            let row = &mut logits[(rows - 1) * vocab..rows * vocab];
            row.fill(f32::NAN);
            (row[9], row[4000], row[31_999]) = (1.0, 2.0, 1.0);
            host_checked[rows - 1] = false;
        }
        let device = gpu.upload(&logits).unwrap();
        let (all_p, all_i) = gpu.topk_softmax_rows(&device, rows, vocab, 32).unwrap();
        for k in [1, 2, 4, 8] {
            let (probs, ids) = gpu.topk_softmax_rows(&device, rows, vocab, k).unwrap();
            for r in 0..rows {
                let first = r * 32..r * 32 + k;
                assert_eq!(
                    ids[r * k..(r + 1) * k],
                    all_i[first.clone()],
                    "rows {rows} row {r} k {k}"
                );
                let bits = |p: &[f32]| p.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                assert_eq!(
                    bits(&probs[r * k..(r + 1) * k]),
                    bits(&all_p[first]),
                    "rows {rows} row {r} k {k}"
                );
                let row = &logits[r * vocab..(r + 1) * vocab];
                if host_checked[r] {
                    let (want_p, want_i) = reference::topk_softmax(row, k);
                    let got: Vec<usize> = ids[r * k..(r + 1) * k]
                        .iter()
                        .map(|&i| i as usize)
                        .collect();
                    assert_eq!(got, want_i, "rows {rows} row {r} k {k}");
                    for (g, w) in probs[r * k..(r + 1) * k].iter().zip(&want_p) {
                        assert!(
                            (g - w).abs() <= 1e-5 * w.max(1e-3),
                            "row {r}, k {k}: {g} vs {w}"
                        );
                    }
                } else if rows % 2 == 1 && r == rows - 1 {
                    let want: Vec<u32> = [4000, 9, 31_999, 0, 0, 0, 0, 0][..k].to_vec();
                    assert_eq!(ids[r * k..(r + 1) * k], want, "row {r}, k {k}");
                }
            }
        }
    }
}

/// The KV-cache moves of a running batch (append, retain, compact) against the same moves done
/// on the host copies: every head of every owned column lands where the layout says, and the
/// bookkeeping follows.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn kv_cache_moves_put_every_column_where_the_layout_says() {
    // Without reserved rows (a join reallocates) and with them (a join copies in place).
    for reserve in [false, true] {
        kv_cache_moves_case(reserve);
    }
}

fn kv_cache_moves_case(reserve: bool) {
    let gpu = gpu();
    let dir = tiny_model("LlamaForCausalLM", true, 5);
    let (fast, _) = load_pair(&dir, gpu.clone()).expect("loads");
    let (heads, dim) = (fast.spec.num_kv_heads, fast.spec.head_dim);
    let capacity = 24;
    let none = TapRequest::none();
    let prefill = |prompts: &[&[u32]]| {
        let mut cache = fast.new_cache(prompts.len(), capacity).expect("cache");
        let step = cache.layout().prefill_step(prompts).expect("prefill");
        fast.forward(&step, &mut cache, &none, LogitsFor::Last)
            .expect("forward");
        cache
    };
    // Host view: value of (layer, sequence, head, column) as a head_dim slice.
    let at = |host: &[Vec<u16>], layer: usize, b: usize, h: usize, c: usize| {
        let row = (b * heads + h) * capacity + c;
        host[layer][row * dim..(row + 1) * dim].to_vec()
    };
    let mut a = prefill(&[&[5, 6, 7], &[9]]);
    if reserve {
        a.reserve(&gpu, 4).expect("reserve");
        assert_eq!(a.rows_allocated(), 4);
    }
    let b = prefill(&[&[1, 2, 3, 4, 8]]);
    let (ak, av) = a.to_host(&gpu).expect("host");
    let (bk, bv) = b.to_host(&gpu).expect("host");
    a.append(&gpu, b).expect("append");
    assert_eq!(a.batch(), 3);
    assert_eq!(a.layout().used(), 5);
    assert_eq!(
        (0..3).map(|s| a.layout().seq_len(s)).collect::<Vec<_>>(),
        [3, 1, 5]
    );
    let (k, v) = a.to_host(&gpu).expect("host");
    for layer in 0..fast.spec.num_layers {
        for h in 0..heads {
            for c in 0..3 {
                assert_eq!(at(&k, layer, 0, h, c), at(&ak, layer, 0, h, c));
                assert_eq!(at(&v, layer, 0, h, c), at(&av, layer, 0, h, c));
            }
            for c in 0..5 {
                assert_eq!(at(&k, layer, 2, h, c), at(&bk, layer, 0, h, c));
                assert_eq!(at(&v, layer, 2, h, c), at(&bv, layer, 0, h, c));
            }
            // Columns nobody wrote stay zero.
            assert!(at(&k, layer, 1, h, 3).iter().all(|&x| x == 0));
        }
    }
    // Sequence 1 leaves.
    a.retain(&gpu, &[0, 2]).expect("retain");
    let (k2, _) = a.to_host(&gpu).expect("host");
    assert_eq!(a.batch(), 2);
    assert_eq!(a.layout().seq_len(1), 5);
    for layer in 0..fast.spec.num_layers {
        for h in 0..heads {
            for c in 0..5 {
                assert_eq!(at(&k2, layer, 1, h, c), at(&k, layer, 2, h, c));
            }
        }
    }
    // A tree step of 3 nodes, of which each sequence keeps a different path, then compaction.
    let step = a
        .layout()
        .tree_step(&[
            (&[10, 11, 12], &[None, Some(0), Some(0)]),
            (&[13, 14, 15], &[None, Some(0), Some(1)]),
        ])
        .expect("tree");
    fast.forward(&step, &mut a, &none, LogitsFor::All)
        .expect("forward");
    a.layout_mut().keep_only(0, 3, &[0, 2]);
    a.layout_mut().keep_only(1, 3, &[0, 1, 2]);
    let plan = a.layout().compaction_plan();
    assert_eq!(plan, [vec![0, 1, 2, 5, 7], vec![0, 1, 2, 3, 4, 5, 6, 7]]);
    let (k3, v3) = a.to_host(&gpu).expect("host");
    a.compact(&gpu).expect("compact");
    assert_eq!(a.layout().used(), 8);
    let (k4, v4) = a.to_host(&gpu).expect("host");
    for layer in 0..fast.spec.num_layers {
        for h in 0..heads {
            for (s, cols) in plan.iter().enumerate() {
                for (to, &from) in cols.iter().enumerate() {
                    assert_eq!(at(&k4, layer, s, h, to), at(&k3, layer, s, h, from));
                    assert_eq!(at(&v4, layer, s, h, to), at(&v3, layer, s, h, from));
                }
            }
        }
    }
}

/// `sample_rows` (GPU nucleus sampling by bisection + Gumbel-max) against the host's exact
/// distribution (`tandem_model::sampling::distribution`: sort, cumulative mass): 40,000 draws of
/// one row with distinct seeds. Tokens outside the nucleus never appear, every token's frequency
/// is within 5 standard errors (+0.002) of its probability, the total variation distance is
/// under 0.02, and the same seeds give the same tokens.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn sample_kernel_draws_from_the_nucleus_distribution() {
    let gpu = gpu();
    let mut rng = rand::rngs::StdRng::seed_from_u64(11);
    let vocab = 4096;
    // About twenty plausible tokens over a long tail, like a language model's row.
    let row: Vec<f32> = (0..vocab)
        .map(|i| {
            if i % 200 == 3 {
                rng.random_range(2.0..6.0)
            } else {
                rng.random_range(-10.0..-4.0)
            }
        })
        .collect();
    let draws = 40_000;
    let logits: Vec<f32> = (0..draws).flat_map(|_| row.iter().copied()).collect();
    let device = gpu.upload(&logits).unwrap();
    let seeds: Vec<u64> = (0..draws).map(|_| rng.random()).collect();
    for (temperature, top_p) in [(0.7f32, 0.9f32), (1.0, 1.0), (0.5, 0.5)] {
        let params = tandem_model::SamplingParams {
            temperature,
            top_p,
            top_k: 0,
        };
        let want = tandem_model::sampling::distribution(&row, &params);
        let got = gpu
            .sample_rows(&device, draws, vocab, temperature, top_p, &seeds)
            .unwrap();
        let again = gpu
            .sample_rows(&device, draws, vocab, temperature, top_p, &seeds)
            .unwrap();
        assert_eq!(
            got, again,
            "T {temperature}, top_p {top_p}: same seeds, same tokens"
        );
        let mut counts = vec![0usize; vocab];
        for &t in &got {
            counts[t as usize] += 1;
        }
        let mut tv = 0.0f64;
        for (t, (&c, &p)) in counts.iter().zip(&want).enumerate() {
            let freq = c as f64 / draws as f64;
            let p = p as f64;
            if p == 0.0 {
                assert_eq!(
                    c, 0,
                    "T {temperature}, top_p {top_p}: token {t} is outside the nucleus"
                );
            }
            let se = (p * (1.0 - p) / draws as f64).sqrt();
            assert!(
                (freq - p).abs() <= 5.0 * se + 0.002,
                "T {temperature}, top_p {top_p}: token {t} drawn {freq:.4}, probability {p:.4}"
            );
            tv += 0.5 * (freq - p).abs();
        }
        assert!(
            tv < 0.02,
            "T {temperature}, top_p {top_p}: total variation {tv:.4}"
        );
    }
}

/// `build_mask` expands a step's compact mask parts into exactly the additive mask the host
/// builds (`ColumnLayout::attention_mask`, one group) for a ragged prefill from an empty cache,
/// a branching tree over cached columns, a chunk with an idle (all-padding) sequence, and the
/// same parts padded to more sequences (`MaskParts::padded`); and the graphed launch (used
/// columns and row stride read from the step's scalars) gives the same mask.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn build_mask_kernel_expands_the_layouts_mask() {
    use tandem_cuda::MaskColumns;
    use tandem_model::{ColumnLayout, MaskParts};
    let gpu = gpu();
    let expand_on_gpu = |parts: &MaskParts| -> Vec<f32> {
        let rows = parts.real.len();
        let total = parts.used + parts.width;
        let valid = gpu.upload(&parts.valid).unwrap();
        let sees = gpu.upload(&parts.sees).unwrap();
        let real = gpu.upload(&parts.real).unwrap();
        let mut mask = gpu.zeros::<f32>(rows * total).unwrap();
        gpu.build_mask(
            &valid.as_view(),
            &sees.as_view(),
            &real.as_view(),
            &mut mask,
            (rows, parts.width),
            MaskColumns::Used(parts.used),
        )
        .unwrap();
        let eager = gpu.download(&mask).unwrap()[..rows * total].to_vec();
        // As a graphed step launches it: used and total read from [col0, total] on the device,
        // `valid` and the mask sized for a capacity of 600 columns.
        let capacity = 600;
        let batch = rows / parts.width.max(1);
        let mut valid_room = parts.valid.clone();
        valid_room.resize(batch * capacity, 7);
        let valid_room = gpu.upload(&valid_room).unwrap();
        let scalars = gpu.upload(&[parts.used as i32, total as i32]).unwrap();
        let mut graphed = gpu.zeros::<f32>(rows * capacity).unwrap();
        let columns = MaskColumns::FromScalars {
            scalars: &scalars.as_view(),
            capacity,
        };
        gpu.build_mask(
            &valid_room.as_view(),
            &sees.as_view(),
            &real.as_view(),
            &mut graphed,
            (rows, parts.width),
            columns,
        )
        .unwrap();
        let graphed = gpu.download(&graphed).unwrap()[..rows * total].to_vec();
        assert!(graphed == eager, "the mask from the scalars differs");
        eager
    };
    let mut layout = ColumnLayout::new(3, 512);
    let mut checked = 0;
    let mut check = |layout: &ColumnLayout, step: &tandem_model::StepInput| {
        let parts = layout.mask_parts(step);
        let want = layout.attention_mask(step, 1);
        assert!(
            expand_on_gpu(&parts) == want,
            "step {checked}: masks differ"
        );
        let padded = parts.clone().padded(5);
        assert!(
            expand_on_gpu(&padded) == padded.expand(),
            "step {checked}: padded"
        );
        checked += 1;
    };
    let long: Vec<u32> = (1..300).collect();
    let step = layout.prefill_step(&[&long, &[5, 6], &[7, 8, 9]]).unwrap();
    check(&layout, &step);
    layout.advance(&step);
    let parents: Vec<Option<usize>> = vec![None, Some(0), Some(0), Some(1), Some(2)];
    let trees: Vec<(&[u32], &[Option<usize>])> = vec![
        (&[1, 2, 3, 4, 5], &parents),
        (&[5, 6], &parents[..2]),
        (&[7], &parents[..1]),
    ];
    let step = layout.tree_step(&trees).unwrap();
    check(&layout, &step);
    layout.advance(&step);
    let step = layout.prefill_step(&[&[3], &[], &[4, 5]]).unwrap();
    check(&layout, &step);
    assert_eq!(checked, 3);
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn fused_small_steps_match_the_unfused_kernels() {
    // Steps of up to GEMV_MAX_ROWS rows run the fused matrix-vector kernels (norm + q|k|v +
    // RoPE + cache write, o_proj into the residual, norm + gate|up + SwiGLU, down_proj into the
    // residual); the unfused path (cuBLAS GEMMs and the separate kernels, each checked against
    // its reference above) is the reference.
    small_steps_match_the_unfused_kernels("fused", 32, false, |t| {
        // Every row count the kernels take (the default only fuses steps of up to 4 rows).
        t.set_fused_rows(tandem_cuda::GEMV_MAX_ROWS)
    });
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn tensor_core_small_steps_match_the_unfused_kernels() {
    // The same with the fused steps' products on the tensor cores (kernels/rows_mma.cu,
    // `TANDEM_CUDA_MMA_ROWS=1`): q|k|v with RoPE and the cache write, o_proj, gate|up with
    // SwiGLU, down_proj and the logits, at every row count the fused path takes.
    small_steps_match_the_unfused_kernels("fused, tensor cores", 32, false, |t| {
        t.gpu().set_mma_rows(true).expect("an sm_80+ GPU");
        t.set_fused_rows(tandem_cuda::GEMV_MAX_ROWS)
    });
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn persistent_steps_match_the_unfused_kernels() {
    // The persistent step (the whole step in one launch, grid barriers between the phases)
    // against the unfused path, as the fused kernels are checked: eagerly at head_dim 32 and 64
    // (q wider than hidden), and with CUDA graphs (its decode steps replayed, reading the
    // step's first column and column count from the scalars the graph is given).
    for (head_dim, graphs) in [(32, false), (64, false), (32, true)] {
        small_steps_match_the_unfused_kernels("persistent", head_dim, graphs, |t| {
            t.set_persistent_rows(tandem_cuda::GEMV_MAX_ROWS)
        });
    }
}

/// `configure`d small steps against the unfused path, both over their own caches: a prefill of
/// one short prompt (5 rows), decode steps (1 row), tree steps of 6 and 8 rows and 9 rows (past
/// GEMV_MAX_ROWS: unfused on both sides, so the caches must still agree after it). Tolerance:
/// 2e-3 of the largest logit / tap value (the matrix-vector sums run in another order than
/// cuBLAS's, which can move a bf16 rounding of an activation by one step).
fn small_steps_match_the_unfused_kernels(
    mode: &str,
    head_dim: usize,
    graphs: bool,
    configure: impl Fn(&tandem_cuda::CudaTarget),
) {
    for (architecture, tied) in [("LlamaForCausalLM", true), ("Qwen2ForCausalLM", false)] {
        let architecture = architecture.to_string();
        let gpu = gpu();
        let dir = tiny_model_with(&architecture, tied, 23, head_dim);
        let fused = tandem_cuda::CudaTarget::load(&dir, gpu.clone()).expect("loads");
        let unfused = tandem_cuda::CudaTarget::load(&dir, gpu.clone()).expect("loads");
        fused.set_graphs(graphs);
        unfused.set_graphs(false);
        unfused.set_fused_rows(0);
        unfused.set_persistent_rows(0);
        fused.set_fused_rows(0);
        fused.set_persistent_rows(0);
        configure(&fused);
        let architecture = format!("{architecture} ({mode}, head_dim {head_dim}, graphs {graphs})");
        let taps = TapRequest::new(vec![TapId::Embed, TapId::Block(1), TapId::Final]);
        let mut caches = [
            fused.new_cache(1, 128).expect("cache"),
            unfused.new_cache(1, 128).expect("cache"),
        ];
        let compare = |step: &tandem_model::StepInput,
                       caches: &mut [tandem_cuda::CudaKvCache; 2],
                       logits_for: LogitsFor,
                       label: &str|
         -> Vec<u32> {
            let [a, b] = caches;
            let out_a = fused.forward(step, a, &taps, logits_for).expect("fused");
            let out_b = unfused
                .forward(step, b, &taps, logits_for)
                .expect("unfused");
            assert_outputs_close(out_a, out_b, 2e-3, &format!("{architecture} {label}"))
        };
        let prefill = caches[0]
            .layout()
            .prefill_step(&[&[5, 6, 7, 8, 9]])
            .unwrap();
        let mut next = compare(&prefill, &mut caches, LogitsFor::Last, "prefill of 5");
        for i in 0..3 {
            let step = caches[0].layout().decode_step(&next).unwrap();
            next = compare(&step, &mut caches, LogitsFor::Last, &format!("decode {i}"));
        }
        for width in [6, 8, 9] {
            let drafts: Vec<u32> = (0..width as u32).map(|i| (next[0] + i) % 300).collect();
            // A binary tree: slot i's parent is slot (i - 1) / 2.
            let parents: Vec<Option<usize>> = (0..width)
                .map(|i: usize| i.checked_sub(1).map(|p| p / 2))
                .collect();
            let step = caches[0]
                .layout()
                .tree_step(&[(drafts.as_slice(), parents.as_slice())])
                .unwrap();
            let ids = compare(
                &step,
                &mut caches,
                LogitsFor::All,
                &format!("tree of {width}"),
            );
            next = vec![ids[0]];
            let step = caches[0].layout().decode_step(&next).unwrap();
            next = compare(
                &step,
                &mut caches,
                LogitsFor::Last,
                &format!("decode after {width}"),
            );
        }
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn small_step_rows_are_batch_invariant() {
    // With the persistent step, and with the fused kernels on every step of up to
    // GEMV_MAX_ROWS rows, a token's logits and taps must be the same bits whether the step decodes it
    // alone, verifies it inside a chain of four, or decodes it next to another sequence: what
    // makes greedy speculative output equal target-only output. Cache A decodes t0..t3 one at a
    // time; cache B verifies the chain [t0, t1, t2, t3] in one step; cache C decodes t0..t3 as
    // sequence 0 of a batch of two (sequence 1 another prompt); cache D verifies the tree
    // [t0, x, t1, t2] (x a rejected sibling of t1), keeps t0 t1 t2 (x stays behind as a hidden
    // column, as a speculative round leaves it) and then decodes t3. The prompt (62 tokens,
    // prefilled the same way everywhere) puts the new columns across the attention chunk
    // boundary at 64. Graphs off and on (C's steps replay after two eager ones). With the
    // one-launch q|k|v and attention (`CudaTarget::set_qkv_attention_sequences`), A's and C's
    // decode steps take it and B's and D's verifications do not: the same bits either way; with
    // it for verifications too (`set_qkv_attention_width`), B's chain and D's tree take it as
    // well (a cluster computes a sequence's four tokens and attends each after its barrier),
    // so with the first mode a verification through the one launch has the two launches' bits.
    let gpu = gpu();
    for (architecture, tied, head_dim) in [
        ("LlamaForCausalLM", true, 32),
        ("Qwen2ForCausalLM", false, 64),
    ] {
        for (graphs, mode) in [
            (false, "persistent"),
            (true, "persistent"),
            (false, "fused"),
            (true, "fused"),
            (false, "fused on tensor cores"),
            (true, "fused on tensor cores"),
            // Decode steps (A, C) take q|k|v and attention in one launch a layer, the
            // verifications (B, D) the two launches.
            (
                false,
                "fused, one-launch q|k|v and attention, on tensor cores",
            ),
            (
                true,
                "fused, one-launch q|k|v and attention, on tensor cores",
            ),
            // Every step of up to 8 tokens a sequence takes it (B and D as well).
            (
                false,
                "fused, one-launch q|k|v and attention for verifications too, on tensor cores",
            ),
            (
                true,
                "fused, one-launch q|k|v and attention for verifications too, on tensor cores",
            ),
            // Each layer's MLP in one launch (its output added by the next layer's reader:
            // the one-launch q|k|v and attention in A and C's decode steps and B and D's
            // verifications, `add_mlp_partials` before the two launches in batch C's steps).
            (
                false,
                "fused, one-launch q|k|v and attention for verifications too, one-launch MLP, on tensor cores",
            ),
            (
                true,
                "fused, one-launch q|k|v and attention for verifications too, one-launch MLP, on tensor cores",
            ),
            (false, "fused, one-launch MLP, on tensor cores"),
        ] {
            let dir = tiny_model_with(architecture, tied, 31, head_dim);
            gpu.set_mma_rows(mode.ends_with("tensor cores"))
                .expect("an sm_80+ GPU");
            let target = tandem_cuda::CudaTarget::load(&dir, gpu.clone()).expect("loads");
            target.set_graphs(graphs);
            let all = tandem_cuda::GEMV_MAX_ROWS;
            // The tensor-core kernels take steps of up to 32 rows (row groups of 8).
            let fused_rows = if mode.ends_with("tensor cores") {
                tandem_cuda::FUSED_MAX_ROWS
            } else {
                all
            };
            target.set_fused_rows(if mode.starts_with("fused") {
                fused_rows
            } else {
                0
            });
            target.set_persistent_rows(if mode == "persistent" { all } else { 0 });
            let one_launch = mode.contains("one-launch");
            target.set_qkv_attention_sequences(if one_launch { fused_rows } else { 0 });
            let width = if mode.contains("verifications too") {
                all
            } else {
                1
            };
            target.set_qkv_attention_width(width);
            if one_launch {
                assert!(
                    gpu.qkv_attention_fits(
                        target.spec.hidden_size,
                        head_dim,
                        width,
                        gpu.mlp_parts(target.spec.hidden_size, target.spec.intermediate_size)
                            .is_some()
                    ),
                    "the one-launch q|k|v and attention takes head_dim {head_dim} at width {width}"
                );
            }
            // The one-launch MLP modes (Hopper: thread-block clusters): 12 slices in clusters
            // of 6, 2 sums.
            let one_launch_mlp = mode.contains("one-launch MLP");
            gpu.set_mlp_cluster(if one_launch_mlp {
                tandem_cuda::MLP_CLUSTER
            } else {
                0
            });
            let mlp = gpu.mlp_parts(target.spec.hidden_size, target.spec.intermediate_size);
            if one_launch_mlp && ["H100", "H200"].iter().any(|h| gpu.name().contains(h)) {
                assert_eq!(mlp, Some(2), "{mode}: the one-launch MLP on {}", gpu.name());
            }
            let label = format!(
                "{architecture} {mode} head_dim {head_dim} graphs {graphs} mlp sums {mlp:?}"
            );
            let taps = TapRequest::new(vec![TapId::Block(1), TapId::Final]);
            let prompt: Vec<u32> = (0..62u32).map(|i| (i * 7 + 3) % 300).collect();
            let other: Vec<u32> = (0..62u32).map(|i| (i * 11 + 5) % 300).collect();
            let chain: [u32; 4] = [17, 230, 41, 99];
            let bits = |v: Vec<f32>| v.into_iter().map(f32::to_bits).collect::<Vec<u32>>();
            let row = |v: &[u32], r: usize, n: usize| v[r * n..(r + 1) * n].to_vec();
            let hidden = target.spec.hidden_size;
            let vocab = target.spec.vocab_size;

            let mut a = target.new_cache(1, 128).unwrap();
            let mut b = target.new_cache(1, 128).unwrap();
            let mut c = target.new_cache(2, 128).unwrap();
            let mut d = target.new_cache(1, 128).unwrap();
            for cache in [&mut a, &mut b, &mut d] {
                let step = cache.layout().prefill_step(&[&prompt]).unwrap();
                target
                    .forward(&step, cache, &taps, LogitsFor::Last)
                    .unwrap();
            }
            let step = c.layout().prefill_step(&[&prompt, &other]).unwrap();
            target
                .forward(&step, &mut c, &taps, LogitsFor::Last)
                .unwrap();

            let parents: Vec<Option<usize>> = (0..4).map(|i: usize| i.checked_sub(1)).collect();
            let step = b.layout().tree_step(&[(&chain, &parents)]).unwrap();
            let verified = target
                .forward(&step, &mut b, &taps, LogitsFor::All)
                .unwrap();
            let v_logits = bits(verified.logits.unwrap().to_host().unwrap());
            let v_taps: Vec<Vec<u32>> = verified
                .taps
                .tensors
                .iter()
                .map(|t| bits(t.to_host().unwrap()))
                .collect();
            let mut a_all = Vec::new();
            for (i, &token) in chain.iter().enumerate() {
                let step = a.layout().decode_step(&[token]).unwrap();
                let alone = target
                    .forward(&step, &mut a, &taps, LogitsFor::Last)
                    .unwrap();
                let step = c.layout().decode_step(&[token, (token + 1) % 300]).unwrap();
                let paired = target
                    .forward(&step, &mut c, &taps, LogitsFor::Last)
                    .unwrap();
                let a_logits = bits(alone.logits.unwrap().to_host().unwrap());
                a_all.push(a_logits.clone());
                let c_logits = bits(paired.logits.unwrap().to_host().unwrap());
                assert_eq!(
                    a_logits,
                    row(&v_logits, i, vocab),
                    "{label}: token {i}'s logits decoded alone vs verified in a chain"
                );
                assert_eq!(
                    a_logits,
                    row(&c_logits, 0, vocab),
                    "{label}: token {i}'s logits alone vs in a batch of two"
                );
                for (slot, (ta, tc)) in alone
                    .taps
                    .tensors
                    .iter()
                    .zip(&paired.taps.tensors)
                    .enumerate()
                {
                    let ta = bits(ta.to_host().unwrap());
                    let tc = bits(tc.to_host().unwrap());
                    assert_eq!(
                        ta,
                        row(&v_taps[slot], i, hidden),
                        "{label}: token {i} tap {slot} vs the chain"
                    );
                    assert_eq!(
                        ta,
                        row(&tc, 0, hidden),
                        "{label}: token {i} tap {slot} vs the batch"
                    );
                }
            }
            // D: a tree with a rejected sibling, its column kept as a hole, then a decode.
            let tree = [chain[0], 5, chain[1], chain[2]];
            let tree_parents = [None, Some(0), Some(0), Some(2)];
            let step = d.layout().tree_step(&[(&tree, &tree_parents)]).unwrap();
            let verified = target
                .forward(&step, &mut d, &taps, LogitsFor::All)
                .unwrap();
            let tree_logits = bits(verified.logits.unwrap().to_host().unwrap());
            for (slot, i) in [(0, 0), (2, 1), (3, 2)] {
                assert_eq!(
                    row(&tree_logits, slot, vocab),
                    a_all[i],
                    "{label}: token {i}'s logits in a tree beside a rejected sibling"
                );
            }
            d.layout_mut().keep_only(0, 4, &[0, 2, 3]);
            let step = d.layout().decode_step(&[chain[3]]).unwrap();
            let after_hole = target
                .forward(&step, &mut d, &taps, LogitsFor::Last)
                .unwrap();
            assert_eq!(
                bits(after_hole.logits.unwrap().to_host().unwrap()),
                a_all[3],
                "{label}: token 3's logits decoded after a hidden column"
            );
            // E (tensor cores, which take steps of up to 32 rows): the chain verified as
            // sequence 3 of a batch of five chains (20 rows in row groups of 8: its rows 12-15
            // are the second group's last four), each sequence prefilled alone and joined into
            // the batch as an admission joins.
            if mode.ends_with("tensor cores") {
                let mut e = target.new_cache(1, 128).unwrap();
                let mut chains = Vec::new();
                for s in 0..5u32 {
                    let own: Vec<u32> = if s == 3 {
                        prompt.clone()
                    } else {
                        (0..62u32).map(|i| (i * (13 + s) + s) % 300).collect()
                    };
                    let mut one = target.new_cache(1, 128).unwrap();
                    let step = one.layout().prefill_step(&[&own]).unwrap();
                    target
                        .forward(&step, &mut one, &taps, LogitsFor::Last)
                        .unwrap();
                    if s == 0 {
                        e = one;
                    } else {
                        e.append(&gpu, one).unwrap();
                    }
                    chains.push(if s == 3 {
                        chain
                    } else {
                        [s + 1, 2 * s + 7, 3 * s + 11, 40 + s]
                    });
                }
                let trees: Vec<(&[u32], &[Option<usize>])> = chains
                    .iter()
                    .map(|c| (c.as_slice(), parents.as_slice()))
                    .collect();
                let step = e.layout().tree_step(&trees).unwrap();
                assert_eq!(step.batch * step.width, 20);
                let wide = target
                    .forward(&step, &mut e, &taps, LogitsFor::All)
                    .unwrap();
                let w_logits = bits(wide.logits.unwrap().to_host().unwrap());
                for i in 0..4 {
                    assert_eq!(
                        row(&w_logits, 12 + i, vocab),
                        row(&v_logits, i, vocab),
                        "{label}: token {i}'s logits in a 20-row verification vs a chain of four"
                    );
                }
                for (slot, tap) in wide.taps.tensors.iter().enumerate() {
                    let tap = bits(tap.to_host().unwrap());
                    for i in 0..4 {
                        assert_eq!(
                            row(&tap, 12 + i, hidden),
                            row(&v_taps[slot], i, hidden),
                            "{label}: token {i} tap {slot} in a 20-row verification"
                        );
                    }
                }
            }
            if graphs {
                assert!(
                    target.graph_stats().replays > 0,
                    "{label}: no step replayed a graph"
                );
            }
        }
    }
}

/// The trainer's corpus upload through two page-locked buffers (`PinnedUpload`): two and a
/// half buffers' worth written at an offset arrive bit for bit, both buffers refilled (each
/// waiting for its previous copy), the tail copied plain, and nothing before the offset touched.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn pinned_upload_delivers_every_value_in_place() {
    let gpu = gpu();
    let n = tandem_cuda::STAGING_VALUES * 5 / 2 + 7;
    let src: Vec<u16> = (0..n as u64)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 7) as u16)
        .collect();
    let offset = 100;
    let mut dst = gpu.zeros::<u16>(offset + n).unwrap();
    let mut upload = tandem_cuda::PinnedUpload::new(&gpu);
    assert!(
        upload.is_pinned(),
        "the host would not lock the staging buffers"
    );
    upload.upload(&gpu, &src, &mut dst, offset).unwrap();
    let back = gpu.download(&dst).unwrap();
    assert!(
        back[..offset].iter().all(|&v| v == 0),
        "values before the offset changed"
    );
    let wrong = back[offset..]
        .iter()
        .zip(&src)
        .filter(|(a, b)| a != b)
        .count();
    assert_eq!(wrong, 0, "{wrong} of {n} values differ");
}

/// `gemv_norm_rows` (the head's final norm and draft logits in one launch) against
/// `add_rms_norm` then `gemv_rows` on the same rows: within 1e-3 of the largest logit (the
/// staged norm sums a row's squares in another order, so a normed value may round to the
/// neighbouring bf16), and a row's logits the same bits at every row count 1..=8, as the
/// fused kernels' batch invariance needs.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn gemv_norm_rows_is_a_final_norm_then_gemv_rows() {
    let gpu = gpu();
    let mut rng = rand::rngs::StdRng::seed_from_u64(30);
    let bf16 = |v: f32| half::bf16::from_f32(v).to_bits();
    let eps = 1e-5f32;
    for (inp, out) in [(576, 8192), (128, 577), (1536, 1536)] {
        let x: Vec<f32> = (0..8 * inp).map(|_| rng.random_range(-3.0..3.0)).collect();
        let norm: Vec<u16> = (0..inp).map(|_| bf16(rng.random_range(0.5..1.5))).collect();
        let w: Vec<u16> = (0..out * inp)
            .map(|_| bf16(rng.random_range(-0.1..0.1)))
            .collect();
        let (normd, wd) = (gpu.upload(&norm).unwrap(), gpu.upload(&w).unwrap());
        // The two-launch path.
        let mut xd = gpu.upload(&x).unwrap();
        let mut normed = gpu.zeros::<u16>(8 * inp).unwrap();
        gpu.add_rms_norm(&mut xd, None, &normd, &mut normed, None, 8, inp, eps)
            .unwrap();
        let mut y = gpu.zeros::<f32>(8 * out).unwrap();
        gpu.gemv_rows(&normed, &wd, &mut y, 8, inp, out, false)
            .unwrap();
        let two_launches = gpu.download(&y).unwrap();
        let largest = two_launches.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let run = |rows: usize| {
            let mut y = gpu.zeros::<f32>(8 * out).unwrap();
            gpu.gemv_norm_rows(&xd, &normd, &wd, &mut y, rows, inp, out, eps)
                .unwrap();
            gpu.download(&y).unwrap()
        };
        let all_rows = run(8);
        for i in 0..8 * out {
            let err = (all_rows[i] - two_launches[i]).abs();
            assert!(
                err <= 1e-3 * largest,
                "{inp}x{out} [{i}]: {} vs {} (largest {largest})",
                all_rows[i],
                two_launches[i]
            );
        }
        for rows in 1..8 {
            let got = run(rows);
            for i in 0..rows * out {
                assert_eq!(
                    got[i].to_bits(),
                    all_rows[i].to_bits(),
                    "{inp}x{out} rows {rows} [{i}]: not the bits of a step of eight"
                );
            }
            assert!(
                got[rows * out..].iter().all(|&v| v == 0.0),
                "rows past {rows} written"
            );
        }
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn gemv_rows_matches_a_host_reference_with_the_same_bits_at_every_row_count() {
    // `gemv_rows` (o_proj, down_proj and the logits of the fused small steps) splits an
    // output's dot product over up to four warps and has a kernel per row bucket (1, 2, 4, 8
    // rows) and outputs a warp (1, 2, 4). Against an f64 host reference at every row count
    // 1..=8 in every kernel that holds it, with and without the residual add, for each split
    // (576 and 577 outputs: 4 warps, the odd width leaving a block part-empty; 1,536: 2;
    // 5,000: 1); and a row's result must be the same bits at every row count and in every
    // kernel, which is what keeps speculative greedy output equal to target-only output.
    let gpu = gpu();
    let mut rng = rand::rngs::StdRng::seed_from_u64(26);
    let bf16 = |v: f32| half::bf16::from_f32(v).to_bits();
    for (inp, out) in [(576, 576), (1536, 577), (576, 1536), (128, 5000)] {
        let x: Vec<u16> = (0..8 * inp)
            .map(|_| bf16(rng.random_range(-1.0..1.0)))
            .collect();
        let w: Vec<u16> = (0..out * inp)
            .map(|_| bf16(rng.random_range(-0.1..0.1)))
            .collect();
        let residual: Vec<f32> = (0..8 * out).map(|_| rng.random_range(-1.0..1.0)).collect();
        let (xd, wd) = (gpu.upload(&x).unwrap(), gpu.upload(&w).unwrap());
        let to_f64 = |b: u16| f64::from(half::bf16::from_bits(b).to_f32());
        let reference: Vec<f64> = (0..8 * out)
            .map(|i| {
                let (r, o) = (i / out, i % out);
                (0..inp)
                    .map(|k| to_f64(x[r * inp + k]) * to_f64(w[o * inp + k]))
                    .sum()
            })
            .collect();
        for accumulate in [false, true] {
            let run = |rows: usize, bucket: usize, outputs: usize| {
                let mut y = gpu.upload(&residual).unwrap();
                gpu.gemv_rows_by(
                    &xd, &wd, &mut y, rows, inp, out, accumulate, bucket, outputs,
                )
                .unwrap();
                gpu.download(&y).unwrap()
            };
            let all_rows = run(8, 8, 4);
            let kernels = [1, 2, 4, 8]
                .into_iter()
                .flat_map(|bucket| [1, 2, 4].map(|outputs| (bucket, outputs)));
            for (bucket, outputs) in kernels {
                for rows in 1..=bucket {
                    let got = run(rows, bucket, outputs);
                    for i in 0..rows * out {
                        let expected = reference[i]
                            + if accumulate {
                                f64::from(residual[i])
                            } else {
                                0.0
                            };
                        let err = (f64::from(got[i]) - expected).abs();
                        assert!(
                            err <= 1e-4 * (1.0 + expected.abs()),
                            "{inp}x{out} rows {rows} bucket {bucket}/{outputs} acc {accumulate} [{i}]: \
                             {} vs {expected}",
                            got[i]
                        );
                        assert_eq!(
                            got[i].to_bits(),
                            all_rows[i].to_bits(),
                            "{inp}x{out} rows {rows} bucket {bucket}/{outputs} [{i}]: not the bits the \
                             same row gets in a step of eight"
                        );
                    }
                    // Rows past `rows` are left alone.
                    assert_eq!(got[rows * out..], residual[rows * out..]);
                }
            }
        }
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn tensor_core_small_steps_keep_a_rows_bits_at_every_width() {
    // kernels/rows_mma.cu at SmolLM2's shapes (o_proj 576 -> 576 and down_proj 1,536 -> 576
    // into the residual, the 49,152 logits, an odd 577 that leaves a tile part-empty; gate|up
    // 576 -> 2 x 1,536 with SwiGLU): against an f64 host reference (1e-4 of 1 + |value|) or the
    // CUDA-core kernel (SwiGLU's bf16 output: 1e-2 relative + 1e-3), with a row's bits the same
    // at every row count from 1 to 8 and rows past the step left alone. That the tensor cores
    // compute each output column on its own is what this rests on; the emulator test checks
    // the kernels' indexing, this the hardware.
    let gpu = gpu();
    let mut rng = rand::rngs::StdRng::seed_from_u64(38);
    let bf16 = |v: f32| half::bf16::from_f32(v).to_bits();
    let to_f64 = |b: u16| f64::from(half::bf16::from_bits(b).to_f32());
    for (inp, out, accumulate) in [
        (576, 576, true),
        (1536, 576, true),
        (576, 49152, false),
        (576, 577, false),
    ] {
        let x: Vec<u16> = (0..8 * inp)
            .map(|_| bf16(rng.random_range(-1.0..1.0)))
            .collect();
        let w: Vec<u16> = (0..out * inp)
            .map(|_| bf16(rng.random_range(-0.1..0.1)))
            .collect();
        let residual: Vec<f32> = (0..8 * out).map(|_| rng.random_range(-1.0..1.0)).collect();
        let (xd, wd) = (gpu.upload(&x).unwrap(), gpu.upload(&w).unwrap());
        let run = |rows: usize| {
            gpu.set_mma_rows(true).expect("an sm_80+ GPU");
            let mut y = gpu.upload(&residual).unwrap();
            gpu.gemv_rows(&xd, &wd, &mut y, rows, inp, out, accumulate)
                .unwrap();
            gpu.set_mma_rows(false).unwrap();
            gpu.download(&y).unwrap()
        };
        let all_rows = run(8);
        for i in 0..8 * out {
            let (r, o) = (i / out, i % out);
            let dot: f64 = (0..inp)
                .map(|k| to_f64(x[r * inp + k]) * to_f64(w[o * inp + k]))
                .sum();
            let expected = dot
                + if accumulate {
                    f64::from(residual[i])
                } else {
                    0.0
                };
            let err = (f64::from(all_rows[i]) - expected).abs();
            assert!(
                err <= 1e-4 * (1.0 + expected.abs()),
                "{inp}x{out} [{i}]: {} vs {expected}",
                all_rows[i]
            );
        }
        for rows in 1..8 {
            let got = run(rows);
            for i in 0..rows * out {
                assert_eq!(
                    got[i].to_bits(),
                    all_rows[i].to_bits(),
                    "{inp}x{out} rows {rows} [{i}]: not the bits of a step of eight"
                );
            }
            assert_eq!(
                got[rows * out..],
                residual[rows * out..],
                "rows past {rows}"
            );
        }
    }
    let (hidden, inter, eps) = (576, 1536, 1e-5f32);
    let x: Vec<f32> = (0..8 * hidden)
        .map(|_| rng.random_range(-3.0..3.0))
        .collect();
    let norm: Vec<u16> = (0..hidden)
        .map(|_| bf16(rng.random_range(0.5..1.5)))
        .collect();
    let w: Vec<u16> = (0..2 * inter * hidden)
        .map(|_| bf16(rng.random_range(-0.1..0.1)))
        .collect();
    let (xd, normd, wd) = (
        gpu.upload(&x).unwrap(),
        gpu.upload(&norm).unwrap(),
        gpu.upload(&w).unwrap(),
    );
    let run = |rows: usize, mma: bool| {
        gpu.set_mma_rows(mma).expect("an sm_80+ GPU");
        let mut act = gpu.zeros::<u16>(8 * inter).unwrap();
        gpu.norm_gate_up_silu(&xd, &normd, &wd, &mut act, rows, hidden, inter, eps)
            .unwrap();
        gpu.set_mma_rows(false).unwrap();
        gpu.download(&act).unwrap()
    };
    let cuda_cores = run(8, false);
    let all_rows = run(8, true);
    for i in 0..8 * inter {
        let (a, b) = (to_f64(all_rows[i]), to_f64(cuda_cores[i]));
        assert!(
            (a - b).abs() <= 1e-2 * b.abs() + 1e-3,
            "gate|up [{i}]: {a} vs the CUDA cores' {b}"
        );
    }
    for rows in 1..8 {
        let got = run(rows, true);
        assert_eq!(
            got[..rows * inter],
            all_rows[..rows * inter],
            "gate|up rows {rows}"
        );
        assert!(
            got[rows * inter..].iter().all(|&v| v == 0),
            "gate|up rows past {rows}"
        );
    }
}

/// Issue #19: a tensor-parallel target's taps and logits equal one GPU's, at every tap point,
/// over a ragged prefill, decode steps, a tree verification, and after the cache moves a
/// running batch makes (a sequence leaving, one joining, compaction), which every rank's cache
/// must mirror. The reference is the unsplit target on the same (unfused, eager) kernels, so
/// the only difference is the order of the split sums: tolerance 2e-3 of the largest value, as
/// for the fused kernels.
///
/// Always: 2 ranks on GPU 0 with the host sum (`TpReduction::HostSimulation`). With
/// `TANDEM_TEST_GPUS=N` (NCCL loadable, scripts/gpu/nccl_env.sh): 1 rank through NCCL (the
/// split code with a one-rank communicator) and, for N >= 2, 2 ranks over NCCL on GPUs 0 and 1.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn tensor_parallel_taps_and_logits_equal_one_gpu() {
    use tandem_cuda::{CudaTarget, TpReduction};
    let gpus: usize = std::env::var("TANDEM_TEST_GPUS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    // Rank 0 shares the unsplit target's GPU object (they run one after the other); a second
    // rank on GPU 0 gets its own stream and cuBLAS handle, as a rank on its own GPU would.
    let first = gpu();
    let second_on_first = gpu();
    let second = (gpus >= 2).then(|| Gpu::new(1).expect("a second GPU"));
    for (architecture, tied) in [("LlamaForCausalLM", true), ("Qwen2ForCausalLM", false)] {
        let dir = tiny_model(architecture, tied, 31);
        let whole = CudaTarget::load(&dir, first.clone()).expect("loads");
        whole.set_graphs(false);
        whole.set_fused_rows(0);
        whole.set_persistent_rows(0);
        let mut cases: Vec<(String, Vec<Arc<Gpu>>, TpReduction)> = vec![(
            "2 ranks on one GPU, host sums".into(),
            vec![first.clone(), second_on_first.clone()],
            TpReduction::HostSimulation,
        )];
        if gpus >= 1 {
            cases.push((
                "1 rank over NCCL".into(),
                vec![first.clone()],
                TpReduction::Nccl,
            ));
        }
        if let Some(second) = &second {
            cases.push((
                "2 ranks over NCCL".into(),
                vec![first.clone(), second.clone()],
                TpReduction::Nccl,
            ));
        }
        for (label, devices, reduction) in cases {
            // NCCL ranks replay CUDA graphs of their steps (all-reduces included) by default;
            // run them eagerly too, first (a failed capture then still leaves the eager result).
            let graph_modes: &[bool] = match reduction {
                TpReduction::Nccl => &[false, true],
                TpReduction::HostSimulation => &[false],
            };
            for &graphs in graph_modes {
                let label = format!("{architecture}, {label}, graphs {graphs}");
                let split = CudaTarget::load_tensor_parallel(&dir, &devices, reduction)
                    .unwrap_or_else(|e| panic!("{label}: {e}"));
                assert_eq!(split.tensor_parallel(), devices.len());
                split.set_graphs(graphs);
                assert_eq!(split.graphs_enabled(), graphs, "{label}");
                tensor_parallel_case(&whole, &split, &label);
                if graphs {
                    assert!(split.graph_stats().replays > 0, "{label}: no step replayed");
                }
            }
        }
    }
}

fn tensor_parallel_case(
    whole: &tandem_cuda::CudaTarget,
    split: &tandem_cuda::CudaTarget,
    label: &str,
) {
    let layers = whole.spec.num_layers;
    let mut points = vec![TapId::Embed];
    points.extend((0..layers).map(TapId::Block));
    points.push(TapId::Final);
    let taps = TapRequest::new(points);
    let mut caches = [
        whole.new_cache(2, 96).expect("cache"),
        split.new_cache(2, 96).expect("cache"),
    ];
    let compare = |step: &tandem_model::StepInput,
                   caches: &mut [tandem_cuda::CudaKvCache; 2],
                   logits_for: LogitsFor,
                   what: &str|
     -> Vec<u32> {
        let [a, b] = caches;
        let out_a = whole.forward(step, a, &taps, logits_for).expect("whole");
        let out_b = split
            .forward(step, b, &taps, logits_for)
            .unwrap_or_else(|e| panic!("{label} {what}: {e}"));
        assert_outputs_close(out_b, out_a, 2e-3, &format!("{label} {what}"))
    };
    let prefill = caches[0]
        .layout()
        .prefill_step(&[&[5, 6, 7, 8, 9], &[11, 12]])
        .unwrap();
    let mut next = compare(&prefill, &mut caches, LogitsFor::Last, "prefill");
    for i in 0..3 {
        let step = caches[0].layout().decode_step(&next).unwrap();
        next = compare(&step, &mut caches, LogitsFor::Last, &format!("decode {i}"));
    }
    // A tree of 4 over each sequence, then the first two slots kept (as after acceptance).
    let trees: Vec<(Vec<u32>, Vec<Option<usize>>)> = next
        .iter()
        .map(|&t| {
            (
                vec![t, (t + 1) % 300, (t + 2) % 300, (t + 3) % 300],
                vec![None, Some(0), Some(0), Some(1)],
            )
        })
        .collect();
    let refs: Vec<(&[u32], &[Option<usize>])> = trees
        .iter()
        .map(|(t, p)| (t.as_slice(), p.as_slice()))
        .collect();
    let step = caches[0].layout().tree_step(&refs).unwrap();
    let ids = compare(&step, &mut caches, LogitsFor::All, "tree of 4");
    // Slots 0 and 1 (a root-to-leaf path) accepted: the rejected slots stay in the cache as
    // invalid columns, which the later steps must mask and the compaction drop on every rank.
    for cache in caches.iter_mut() {
        for b in 0..2 {
            cache.layout_mut().keep_only(b, 4, &[0, 1]);
        }
    }
    next = vec![ids[1], ids[4 + 1]];
    let step = caches[0].layout().decode_step(&next).unwrap();
    next = compare(&step, &mut caches, LogitsFor::Last, "decode after the tree");
    // Sequence 0 leaves; a newcomer prefilled on its own joins; the columns are compacted.
    let [a, b] = &mut caches;
    a.retain(whole.gpu(), &[1]).unwrap();
    b.retain(split.gpu(), &[1]).unwrap();
    let mut newcomers = [
        whole.new_cache(1, 96).expect("cache"),
        split.new_cache(1, 96).expect("cache"),
    ];
    let prefill = newcomers[0]
        .layout()
        .prefill_step(&[&[21, 22, 23]])
        .unwrap();
    let joined = compare(
        &prefill,
        &mut newcomers,
        LogitsFor::Last,
        "newcomer prefill",
    );
    let [na, nb] = newcomers;
    a.append(whole.gpu(), na).unwrap();
    b.append(split.gpu(), nb).unwrap();
    a.compact(whole.gpu()).unwrap();
    b.compact(split.gpu()).unwrap();
    next = vec![next[1], joined[0]];
    for i in 0..2 {
        let step = caches[0].layout().decode_step(&next).unwrap();
        next = compare(
            &step,
            &mut caches,
            LogitsFor::Last,
            &format!("decode after the moves {i}"),
        );
    }
}

/// The tensor-core attention (kernels/attention_mma.cu) on the hardware: the same steps through
/// the row kernel and through it, both against the f32 host reference, for a ragged causal
/// prefill with padding slots (head_dim 64, SmolLM2's 9/3 heads, two row tiles), a tree of 40
/// nodes after a 130-column prefix with hidden columns (head_dim 128, GQA 4/2, three column
/// tiles), a verification of 8 tokens at batch 3 (three query heads' rows in one block) and long
/// causal rows with a sharp softmax. The emulator test
/// (`tests/emulated_kernels.rs`) checks the same kernel's indexing on the CPU; this checks that
/// the GPU's mma fragments are what the emulator assumes.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn tensor_core_attention_matches_the_row_kernel() {
    use tandem_cuda::AttentionShape;
    let gpu = gpu();
    let mut rng = rand::rngs::StdRng::seed_from_u64(11);
    let bf = |b: u16| half::bf16::from_bits(b).to_f32();
    type Visible = Box<dyn Fn(usize, usize, usize) -> bool>;
    let parents: Vec<usize> = (0..40)
        .map(|i| if i == 0 { 0 } else { (i * 7 + 3) % i })
        .collect();
    let hidden_prefix: Vec<bool> = (0..130).map(|j| j % 5 == 2).collect();
    let cases: Vec<(&str, AttentionShape, usize, Visible, f32)> = vec![
        (
            "ragged causal prefill",
            AttentionShape {
                batch: 2,
                width: 70,
                heads: 9,
                kv_heads: 3,
                head_dim: 64,
                capacity: 96,
            },
            0,
            // Sequence 1's prompt is 50 slots; its padding slots see only their own column.
            Box::new(|b, i, j| if b == 1 && i >= 50 { j == i } else { j <= i }),
            3.0,
        ),
        (
            "tree after a prefix with hidden columns",
            AttentionShape {
                batch: 1,
                width: 40,
                heads: 4,
                kv_heads: 2,
                head_dim: 128,
                capacity: 200,
            },
            130,
            Box::new(move |_, i, j| {
                if j < 130 {
                    return !hidden_prefix[j];
                }
                let mut node = i;
                loop {
                    if j - 130 == node {
                        return true;
                    }
                    if node == 0 {
                        return false;
                    }
                    node = parents[node];
                }
            }),
            4.0,
        ),
        (
            // Three query heads a KV head in one block: 24 rows.
            "narrow chain verification after a prefix, batch 3",
            AttentionShape {
                batch: 3,
                width: 8,
                heads: 9,
                kv_heads: 3,
                head_dim: 64,
                capacity: 128,
            },
            100,
            Box::new(|b, i, j| {
                if j < 100 {
                    (j * 7 + b * 3) % 11 != 0
                } else {
                    j - 100 <= i
                }
            }),
            3.0,
        ),
        (
            "long causal, sharp softmax",
            AttentionShape {
                batch: 1,
                width: 150,
                heads: 2,
                kv_heads: 2,
                head_dim: 64,
                capacity: 160,
            },
            0,
            Box::new(|_, i, j| j <= i),
            12.0,
        ),
    ];
    for (name, shape, used, visible, spread) in cases {
        let (rows, hd) = (shape.rows(), shape.head_dim);
        let total = used + shape.width;
        let q: Vec<f32> = (0..rows * shape.heads * hd)
            .map(|_| rng.random_range(-1.0..1.0f32) * spread)
            .collect();
        let cache_len = shape.batch * shape.kv_heads * shape.capacity * hd;
        let mut random_bf16 = || -> Vec<u16> {
            (0..cache_len)
                .map(|_| half::bf16::from_f32(rng.random_range(-1.0..1.0)).to_bits())
                .collect()
        };
        let (keys, values) = (random_bf16(), random_bf16());
        let mut mask = vec![f32::NEG_INFINITY; rows * total];
        for r in 0..rows {
            for j in 0..total {
                if visible(r / shape.width, r % shape.width, j) {
                    mask[r * total + j] = 0.0;
                }
            }
        }
        let (q_dev, k_dev, v_dev, mask_dev) = (
            gpu.upload(&q).unwrap(),
            gpu.upload(&keys).unwrap(),
            gpu.upload(&values).unwrap(),
            gpu.upload(&mask).unwrap(),
        );
        let run = |min_width: usize| -> Vec<f32> {
            // No row floor: every case goes to the kernel asked for.
            gpu.set_mma_attention(min_width, 0).unwrap();
            let mut out = gpu.zeros::<u16>(rows * shape.heads * hd).unwrap();
            gpu.attention(
                &q_dev, &k_dev, &v_dev, &mask_dev, None, &mut out, shape, total, None,
            )
            .unwrap();
            gpu.download(&out).unwrap().into_iter().map(bf).collect()
        };
        let by_rows = run(0);
        let by_mma = run(1);
        gpu.set_mma_attention(0, 0).unwrap();
        let at =
            |b: usize, h: usize, col: usize| ((b * shape.kv_heads + h) * shape.capacity + col) * hd;
        let (mut worst_rows, mut worst_mma) = (0.0f32, 0.0f32);
        for r in 0..rows {
            let b = r / shape.width;
            let seen: Vec<bool> = (0..total).map(|j| mask[r * total + j] == 0.0).collect();
            for h in 0..shape.heads {
                let kvh = h / (shape.heads / shape.kv_heads);
                let ks: Vec<Vec<f32>> = (0..total)
                    .map(|c| {
                        keys[at(b, kvh, c)..at(b, kvh, c) + hd]
                            .iter()
                            .map(|&x| bf(x))
                            .collect()
                    })
                    .collect();
                let vs: Vec<Vec<f32>> = (0..total)
                    .map(|c| {
                        values[at(b, kvh, c)..at(b, kvh, c) + hd]
                            .iter()
                            .map(|&x| bf(x))
                            .collect()
                    })
                    .collect();
                let at_q = (r * shape.heads + h) * hd;
                let want = reference::attention(&q[at_q..at_q + hd], &ks, &vs, &seen);
                for d in 0..hd {
                    worst_rows = worst_rows.max((by_rows[at_q + d] - want[d]).abs());
                    worst_mma = worst_mma.max((by_mma[at_q + d] - want[d]).abs());
                }
            }
        }
        eprintln!("{name}: max |error| row kernel {worst_rows:.2e}, tensor cores {worst_mma:.2e}");
        // The row kernel keeps the query in f32 (one bf16 rounding of the output); the tensor
        // cores also round the query and the probabilities to bf16 (a few 1e-3 on the emulator).
        assert!(worst_rows < 5e-3, "{name}: row kernel off by {worst_rows}");
        assert!(
            worst_mma < 2e-2,
            "{name}: tensor-core kernel off by {worst_mma}"
        );
    }
}
