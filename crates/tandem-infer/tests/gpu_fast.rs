//! GPU tests of the speculative loop on the CUDA fast path. CI has no GPU, so they are ignored
//! there; on the device machine run the built test binary with `--ignored`
//! (scripts/gpu/spec_fast.sh).
//!
//! - The fast head ([`CudaDraft`]) against the burn head (CPU, f32) on a tiny random target
//!   and head: draft extend over ragged prompts, a chain step and a tree step, each fed the
//!   taps its own target path captured. Tolerance: bf16 (relative error 3e-2).
//! - [`FastSpecEngine`] greedy output equals fast target-only greedy output, chain and tree,
//!   batch 3 with ragged prompts.

use std::sync::Arc;

use tandem_cuda::{CudaDraft, CudaTarget, DeviceRows, Gpu};
use tandem_eagle::{Eagle3Config, Eagle3Draft, VocabMap};
use tandem_infer::{FastSpecEngine, SpecConfig, fast_target_generate};
use tandem_model::backend::CpuBackend;
use tandem_model::burn::prelude::*;
use tandem_model::sampling::SamplingParams;
use tandem_model::testing::{rel_err, scratch_dir, tiny_config, write_random_model};
use tandem_model::{HfConfig, LogitsFor, TapRequest, TargetModel};
use tandem_wiring::default_aux_taps;

type B = CpuBackend;

/// bf16 fast path vs f32 reference.
const TOLERANCE: f32 = 3e-2;

struct Fixture {
    cpu_target: TargetModel<B>,
    cpu_draft: Eagle3Draft<B>,
    target: CudaTarget,
    draft: CudaDraft,
    taps: TapRequest,
}

/// A tiny target the kernels accept (head_dim 32, 256 positions) and a random head for it.
fn fixture(name: &str) -> Fixture {
    fixture_with_positions(name, 256)
}

fn fixture_with_positions(name: &str, positions: usize) -> Fixture {
    let mut config: HfConfig = tiny_config("LlamaForCausalLM", 4);
    config.max_position_embeddings = positions;
    config.hidden_size = 128;
    config.intermediate_size = 192;
    config.vocab_size = 300;
    let dir = scratch_dir(&format!("gpu-fast-{name}"));
    write_random_model(&dir, &config, 11).expect("model written");
    let gpu: Arc<Gpu> = Gpu::new(0).expect("these tests need a CUDA GPU");
    let target = CudaTarget::load(&dir, gpu).expect("fast target");
    let cpu_target = TargetModel::<B>::load(&dir, &Default::default()).expect("cpu target");
    let taps = default_aux_taps(config.num_hidden_layers).unwrap();
    let head_config = Eagle3Config::for_target(&config, config.vocab_size, taps.len());
    let spec = head_config.resolve().unwrap();
    let cpu_draft = Eagle3Draft::init(
        spec.clone(),
        VocabMap::identity(config.vocab_size),
        cpu_target.embed_tokens.clone(),
        5,
        &Default::default(),
    )
    .unwrap();
    let draft = CudaDraft::new(
        &target,
        spec,
        VocabMap::identity(config.vocab_size),
        &cpu_draft.to_host(),
    )
    .expect("fast head");
    Fixture {
        cpu_target,
        cpu_draft,
        target,
        draft,
        taps: TapRequest::new(taps),
    }
}

fn host<const D: usize>(t: Tensor<B, D>) -> Vec<f32> {
    t.into_data().convert::<f32>().to_vec::<f32>().unwrap()
}

/// Real rows only (padding slots are not compared: both paths leave them unspecified).
fn real_rows(values: &[f32], real: &[bool], width: usize) -> Vec<f32> {
    values
        .chunks(width)
        .zip(real)
        .filter(|(_, r)| **r)
        .flat_map(|(row, _)| row.iter().copied())
        .collect()
}

/// `n` values uniform in [-scale, scale) from a linear congruential generator at `seed`
/// (advanced), so that two heads can be fed the same hidden inputs.
fn uniform_rows(seed: &mut u32, n: usize, scale: f32) -> Vec<f32> {
    (0..n)
        .map(|_| {
            *seed = seed.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            ((*seed >> 8) as f32 / (1u32 << 24) as f32 * 2.0 - 1.0) * scale
        })
        .collect()
}

/// A second copy of the fixture's head that launches every kernel (graphs off): the
/// reference a graphed head is compared with.
fn eager_head(f: &Fixture) -> CudaDraft {
    let eager = CudaDraft::new(
        &f.target,
        f.draft.spec.clone(),
        f.draft.vocab.clone(),
        &f.cpu_draft.to_host(),
    )
    .expect("second head");
    eager.set_graphs(false);
    eager
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn fast_head_graph_replay_gives_the_eager_outputs() {
    // Two copies of the same head, one replaying CUDA graphs for its steps and one launching
    // every kernel: an extend over ragged chunks, chain steps (width 1) and tree steps (width
    // 3), each fed the same hidden input. The same hidden outputs and draft logits (1e-6 of the
    // largest value) and the same greedy draft tokens; the graphed head captured one graph per
    // repeated shape and replayed the rest.
    let f = fixture("graphs");
    let eager = eager_head(&f);
    let heads = [&f.draft, &eager];
    let h = f.draft.spec.hidden_size;
    let mut caches = [
        f.draft.new_cache(2, 96).unwrap(),
        eager.new_cache(2, 96).unwrap(),
    ];
    let gpu = f.target.gpu().clone();
    let mut seed = 1u32;
    let mut random_hidden = |rows: usize| uniform_rows(&mut seed, rows * h, 1.0);
    let run = |step: tandem_model::StepInput,
               caches: &mut [tandem_cuda::CudaKvCache; 2],
               hidden: &[f32],
               label: &str| {
        let mut outs = Vec::new();
        for (head, cache) in heads.iter().zip(caches.iter_mut()) {
            let input = gpu.upload(hidden).unwrap();
            outs.push(head.forward_step(&step, input, cache).expect("draft step"));
        }
        let gap = rel_err(
            &outs[0].hidden.to_host().unwrap(),
            &outs[1].hidden.to_host().unwrap(),
        );
        assert!(gap <= 1e-6, "{label}: hidden differs by {gap}");
        let gap = rel_err(
            &outs[0].logits.to_host().unwrap(),
            &outs[1].logits.to_host().unwrap(),
        );
        assert!(gap <= 1e-6, "{label}: logits differ by {gap}");
        let ids = outs[0].logits.argmax().unwrap();
        assert_eq!(
            ids,
            outs[1].logits.argmax().unwrap(),
            "{label}: draft tokens"
        );
        ids
    };
    let chunks: [&[u32]; 2] = [&[3, 14, 15, 92, 65], &[2, 71]];
    let step = caches[0].layout().prefill_step(&chunks).unwrap();
    let rows = step.batch * step.width;
    let mut next = run(step, &mut caches, &random_hidden(rows), "extend");
    next.truncate(2);
    for i in 0..5 {
        let step = caches[0].layout().decode_step(&next[..2]).unwrap();
        next = run(step, &mut caches, &random_hidden(2), &format!("chain {i}"));
    }
    for i in 0..3 {
        let drafts: Vec<Vec<u32>> = next
            .iter()
            .take(2)
            .map(|&t| vec![t, t + 1, t + 2])
            .collect();
        let parents = [None, Some(0), Some(1)];
        let trees: Vec<(&[u32], &[Option<usize>])> = drafts
            .iter()
            .map(|d| (d.as_slice(), &parents[..]))
            .collect();
        let step = caches[0].layout().tree_step(&trees).unwrap();
        let ids = run(step, &mut caches, &random_hidden(6), &format!("tree {i}"));
        next = ids.iter().step_by(3).copied().collect();
    }
    let stats = f.draft.graph_stats();
    eprintln!("head graphs: {stats:?}");
    // The extend's shape came once (eager). Chain: two eager steps, the third captured and
    // replayed, two more replays (3); tree: two eager, the third captured and replayed (1).
    assert_eq!(stats.captured, 2, "{stats:?}");
    assert_eq!(stats.replays, 4, "{stats:?}");
    assert_eq!(eager.graph_stats(), tandem_cuda::GraphStats::default());
}

/// The fused head step's two folds (the embedding read inside the q|k|v kernel, the final
/// norm inside the logits kernel: seven launches instead of nine) against the same head
/// launching `embed_rows` and `add_rms_norm`, both eager, over an extend of 2 x 3 slots and
/// chain steps of two rows, every step fused. The hidden outputs must be the same bits (the
/// embedding fold reads the same values in the same order); the logits within 1e-3 of the
/// largest (the staged norm rounds a row to bf16 after a one-warp sum, `add_rms_norm` after a
/// block-wide one) and, against an f64 host reference from the hidden output, within the
/// bf16 rounding of the normed row.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn folded_head_steps_match_the_nine_launch_steps() {
    let f = fixture("fold");
    let mut plain = eager_head(&f);
    plain.set_fold(false);
    let folded = eager_head(&f);
    for head in [&plain, &folded] {
        head.set_fused_rows(8);
    }
    let spec = &f.draft.spec;
    let (h, vocab) = (spec.hidden_size, spec.draft_vocab_size);
    let host_weights = f.cpu_draft.to_host();
    // Round to the nearest bf16, ties to even (the kernels' f32_to_bf16; no NaNs here).
    let bf16 = |v: f32| {
        let bits = v.to_bits();
        f32::from_bits(bits.wrapping_add(0x7fff + ((bits >> 16) & 1)) & 0xffff_0000)
    };
    // The GPU holds the head's weights in bf16.
    let weight = |name: &str| -> Vec<f32> {
        let (_, values) = host_weights
            .get(name)
            .unwrap_or_else(|| panic!("head weight {name}"));
        values.iter().map(|&v| bf16(v)).collect()
    };
    let (norm, lm_head) = (weight("norm.weight"), weight("lm_head.weight"));
    let gpu = f.target.gpu().clone();
    let mut caches = [
        plain.new_cache(2, 64).unwrap(),
        folded.new_cache(2, 64).unwrap(),
    ];
    let mut seed = 7u32;
    let mut random_hidden = |rows: usize| uniform_rows(&mut seed, rows * h, 2.0);
    let mut tokens = vec![vec![5u32, 17, 250], vec![3, 99, 42]];
    let mut worst = 0.0f32;
    for round in 0..4 {
        let step = if round == 0 {
            let chunks: Vec<&[u32]> = tokens.iter().map(Vec::as_slice).collect();
            caches[0].layout().prefill_step(&chunks).unwrap()
        } else {
            caches[0]
                .layout()
                .decode_step(&[tokens[0][0], tokens[1][0]])
                .unwrap()
        };
        let rows = step.batch * step.width;
        let input = random_hidden(rows);
        let mut outs = Vec::new();
        for (head, cache) in [&plain, &folded].into_iter().zip(caches.iter_mut()) {
            let out = head
                .forward_step(&step, gpu.upload(&input).unwrap(), cache)
                .expect("draft step");
            outs.push((out.hidden.to_host().unwrap(), out.logits.to_host().unwrap()));
        }
        let (hidden, logits) = &outs[1];
        assert_eq!(
            outs[0].0.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            hidden.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            "round {round}: the folded embedding changed the hidden output"
        );
        let gap = rel_err(&outs[0].1, logits);
        assert!(
            gap <= 1e-3,
            "round {round}: logits differ by {gap} of the largest"
        );
        worst = worst.max(gap);
        // f64 reference: rms_norm(hidden) * w, rounded to bf16 as the kernel stages it.
        for r in 0..rows {
            let x = &hidden[r * h..(r + 1) * h];
            let mean = x.iter().map(|&v| f64::from(v) * f64::from(v)).sum::<f64>() / h as f64;
            let inv = 1.0 / (mean + spec.rms_norm_eps).sqrt();
            let normed: Vec<f64> = (0..h)
                .map(|i| f64::from(bf16((f64::from(x[i]) * inv) as f32 * norm[i])))
                .collect();
            let row: Vec<f64> = (0..vocab)
                .map(|o| {
                    (0..h)
                        .map(|i| normed[i] * f64::from(lm_head[o * h + i]))
                        .sum()
                })
                .collect();
            let scale = row.iter().fold(0.0f64, |m, v| m.max(v.abs()));
            for o in 0..vocab {
                let err = (f64::from(logits[r * vocab + o]) - row[o]).abs();
                assert!(
                    err <= 2e-3 * scale,
                    "round {round} row {r} logit {o}: {} vs {} (largest {scale})",
                    logits[r * vocab + o],
                    row[o]
                );
            }
        }
        tokens = (0..2)
            .map(|b| vec![(tokens[b][0] * 7 + round as u32 + 1) % vocab as u32])
            .collect();
    }
    eprintln!("folded head: largest logit gap {worst:e} of the largest value");
}

/// `CudaDraft::extend_taps` (one index upload, the fc projected straight into a replayed
/// graph's hidden input, the kept slots gathered from the graph's buffers) against
/// `fc_input` then `extend` on a head that launches every kernel: the kept slots' hidden
/// states and logits within 1e-6 of the largest value, over four extends of one shape (two
/// eager, the third captured, the fourth replayed), each with other tap rows and kept slots.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn extend_taps_keeps_the_slots_of_the_plain_extend() {
    let f = fixture("extend-taps");
    let eager = eager_head(&f);
    let (h, vocab) = (f.draft.spec.hidden_size, f.draft.spec.draft_vocab_size);
    // Taps of a ragged two-prompt prefill: 2 x 5 rows.
    let mut tcache = f.target.new_cache(2, 32).unwrap();
    let prompts: [&[u32]; 2] = [&[5, 6, 7, 8, 9], &[11, 12]];
    let tstep = tcache.layout().prefill_step(&prompts).unwrap();
    let taps = f
        .target
        .forward(&tstep, &mut tcache, &f.taps, LogitsFor::Last)
        .unwrap()
        .taps;
    let mut graphed_cache = f.draft.new_cache(2, 64).unwrap();
    let mut eager_cache = eager.new_cache(2, 64).unwrap();
    for round in 0..4usize {
        let chunks: [&[u32]; 2] = [&[3, 14, 15], &[92, 65, 35]];
        let step = graphed_cache.layout().prefill_step(&chunks).unwrap();
        let tap_rows: Vec<i32> = (0..6).map(|i| ((i * 3 + round) % 10) as i32).collect();
        let last = [(round % 3) as i32, 3 + ((round + 1) % 3) as i32];
        let aux = eager.fc_input(&taps, &tap_rows).unwrap();
        let full = eager.extend(&step, &aux, &mut eager_cache).unwrap();
        let kept = f
            .draft
            .extend_taps(&step, &taps, &tap_rows, &mut graphed_cache, &last)
            .unwrap();
        let (full_hidden, full_logits) = (
            full.hidden.to_host().unwrap(),
            full.logits.to_host().unwrap(),
        );
        let pick = |values: &[f32], width: usize| -> Vec<f32> {
            last.iter()
                .flat_map(|&r| values[r as usize * width..(r as usize + 1) * width].to_vec())
                .collect()
        };
        let gap = rel_err(&kept.hidden.to_host().unwrap(), &pick(&full_hidden, h));
        assert!(gap <= 1e-6, "round {round}: hidden differs by {gap}");
        let gap = rel_err(&kept.logits.to_host().unwrap(), &pick(&full_logits, vocab));
        assert!(gap <= 1e-6, "round {round}: logits differ by {gap}");
        assert_eq!(kept.logits.rows, 2);
    }
    let stats = f.draft.graph_stats();
    assert_eq!((stats.captured, stats.replays), (1, 2), "{stats:?}");
    // Tap rows outside the step and a wrong count are refused by name.
    let step = graphed_cache.layout().prefill_step(&[&[1], &[2]]).unwrap();
    let err = f
        .draft
        .extend_taps(&step, &taps, &[0, 10], &mut graphed_cache, &[0])
        .unwrap_err()
        .to_string();
    assert!(err.contains("tap row 10"), "{err}");
    let err = f
        .draft
        .extend_taps(&step, &taps, &[0], &mut graphed_cache, &[0])
        .unwrap_err()
        .to_string();
    assert!(err.contains("1 tap rows for an extend of 2 slots"), "{err}");
}

/// A tiny random Llama target on the GPU (hidden 128, 300 tokens) and a random head over a
/// draft vocabulary of `draft_vocab` ids that is not a prefix of the target's (every odd id is
/// frequent), so the d2t map matters.
fn head_with_mapped_vocab(name: &str, draft_vocab: usize) -> (Arc<Gpu>, CudaTarget, CudaDraft) {
    let mut config: HfConfig = tiny_config("LlamaForCausalLM", 4);
    config.hidden_size = 128;
    config.intermediate_size = 192;
    config.vocab_size = 300;
    let dir = scratch_dir(name);
    write_random_model(&dir, &config, 11).expect("model written");
    let gpu: Arc<Gpu> = Gpu::new(0).expect("these tests need a CUDA GPU");
    let target = CudaTarget::load(&dir, gpu.clone()).expect("fast target");
    let cpu_target = TargetModel::<B>::load(&dir, &Default::default()).expect("cpu target");
    let taps = default_aux_taps(config.num_hidden_layers).unwrap();
    let counts: Vec<u64> = (0..300)
        .map(|j| if j % 2 == 1 { 50 } else { j % 7 })
        .collect();
    let vocab = tandem_eagle::build_vocab_map(&counts, draft_vocab, 300).unwrap();
    assert!((0..draft_vocab).any(|d| vocab.to_target(d) != d as u32));
    let spec = Eagle3Config::for_target(&config, draft_vocab, taps.len())
        .resolve()
        .unwrap();
    let cpu_draft = Eagle3Draft::init(
        spec.clone(),
        vocab.clone(),
        cpu_target.embed_tokens.clone(),
        5,
        &Default::default(),
    )
    .unwrap();
    let draft = CudaDraft::new(&target, spec, vocab, &cpu_draft.to_host()).expect("fast head");
    (gpu, target, draft)
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn device_beams_record_what_the_host_beams_record() {
    // Tree drafting with the beams picked on the GPU (`CudaDraft::draft_beams`: `beam_select`
    // between the head steps, one read-back at the end) against the host's beams
    // (`host_beams`: the top-k read back and the beams picked on the host at every step), on
    // two caches with the same history and a draft vocabulary smaller than the target's: every
    // step's scores, target ids and parents the same bits, and the caches' keys and values
    // too, at batch 1 (topk 4, 3 steps: the fused kernels), batch 2 (topk 2, 4 steps) and
    // batch 3 (topk 4, 4 steps: up to 36 rows a step, cuBLAS), over rounds that replay graphs.
    use tandem_infer::SpecBackend;
    let draft_vocab = 200;
    let (gpu, target, draft) = head_with_mapped_vocab("gpu-fast-device-beams", draft_vocab);
    let h = draft.spec.hidden_size;
    let mut seed = 9u32;
    let mut random = |n: usize, scale: f32| uniform_rows(&mut seed, n, scale);
    for (batch, topk, steps) in [(1, 4, 3), (2, 2, 4), (3, 4, 4)] {
        let mut host_cache = draft.new_cache(batch, 160).unwrap();
        let mut device_cache = draft.new_cache(batch, 160).unwrap();
        let chunks: Vec<Vec<u32>> = (0..batch)
            .map(|b| (0..3 + 2 * b as u32).map(|i| (i * 37 + 5) % 300).collect())
            .collect();
        let chunks: Vec<&[u32]> = chunks.iter().map(Vec::as_slice).collect();
        let step = host_cache.layout().prefill_step(&chunks).unwrap();
        let prefix = random(step.batch * step.width * h, 1.0);
        for cache in [&mut host_cache, &mut device_cache] {
            draft
                .forward_step(&step, gpu.upload(&prefix).unwrap(), cache)
                .expect("extend");
        }
        for round in 0..3 {
            let label = format!("batch {batch}, topk {topk}, {steps} steps, round {round}");
            let hidden = random(batch * h, 1.0);
            let logits = random(batch * draft_vocab, 4.0);
            let roots = || {
                let rows = DeviceRows {
                    data: gpu.upload(&hidden).unwrap(),
                    batch,
                    width: 1,
                    hidden: h,
                };
                let logits = tandem_cuda::DeviceLogits::new(
                    gpu.upload(&logits).unwrap(),
                    batch,
                    draft_vocab,
                    gpu.clone(),
                );
                (rows, logits)
            };
            draft.set_device_beams(false);
            let (rows, logits_d) = roots();
            let want = target
                .head_beams(
                    &draft,
                    &mut host_cache,
                    &rows,
                    &logits_d,
                    batch,
                    (steps, topk),
                )
                .expect("host beams");
            draft.set_device_beams(true);
            let (rows, logits_d) = roots();
            let got = target
                .head_beams(
                    &draft,
                    &mut device_cache,
                    &rows,
                    &logits_d,
                    batch,
                    (steps, topk),
                )
                .expect("device beams");
            assert_eq!(got.len(), batch, "{label}");
            for (b, (g, w)) in got.iter().zip(&want).enumerate() {
                assert_eq!(g.len(), steps, "{label}: sequence {b}'s steps");
                for (s, (gs, ws)) in g.iter().zip(w).enumerate() {
                    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    assert_eq!(
                        bits(&gs.scores),
                        bits(&ws.scores),
                        "{label}: {b}/{s} scores"
                    );
                    assert_eq!(gs.tokens, ws.tokens, "{label}: {b}/{s} target ids");
                    assert_eq!(gs.parents, ws.parents, "{label}: {b}/{s} parents");
                }
            }
            assert_eq!(
                device_cache.layout().used(),
                host_cache.layout().used(),
                "{label}: columns"
            );
            assert!(
                device_cache.to_host(&gpu).unwrap() == host_cache.to_host(&gpu).unwrap(),
                "{label}: the caches' keys or values differ"
            );
        }
    }
    let stats = draft.graph_stats();
    assert!(stats.replays > 0, "{stats:?}");
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn device_chain_drafts_what_the_host_loop_drafts() {
    // `CudaDraft::draft_chain` (each greedy id mapped through d2t on the GPU into the next
    // step's tokens, one read-back) against the loop it replaces (read each argmax back, map it
    // on the host, build and run the next step), on two caches with the same history, with a
    // draft vocabulary smaller than the target's so the map matters: the same tokens, and the
    // same keys and values in the caches, bit for bit, over rounds of 4 that roll back their
    // draft columns as the driver does (the later rounds replay CUDA graphs).
    let draft_vocab = 200;
    let (gpu, _target, draft) = head_with_mapped_vocab("gpu-fast-device-chain", draft_vocab);
    let h = draft.spec.hidden_size;
    let mut seed = 7u32;
    let mut random = |n: usize, scale: f32| uniform_rows(&mut seed, n, scale);
    let mut host_cache = draft.new_cache(2, 96).unwrap();
    let mut device_cache = draft.new_cache(2, 96).unwrap();
    let chunks: [&[u32]; 2] = [&[3, 14, 15, 92, 65], &[2, 71]];
    let step = host_cache.layout().prefill_step(&chunks).unwrap();
    let prefix = random(step.batch * step.width * h, 1.0);
    for cache in [&mut host_cache, &mut device_cache] {
        draft
            .forward_step(&step, gpu.upload(&prefix).unwrap(), cache)
            .expect("extend");
    }
    let steps = 4;
    for round in 0..4 {
        let roots_hidden = gpu.upload(&random(2 * h, 1.0)).unwrap();
        let roots_logits = gpu.upload(&random(2 * draft_vocab, 4.0)).unwrap();
        // The host loop.
        let mut expected: Vec<Vec<u32>> = vec![Vec::new(); 2];
        let mut logits = tandem_cuda::DeviceLogits::new(
            gpu.duplicate(&roots_logits).unwrap(),
            2,
            draft_vocab,
            gpu.clone(),
        );
        let mut hidden = gpu.duplicate(&roots_hidden).unwrap();
        for s in 0..steps {
            let tokens: Vec<u32> = logits
                .argmax()
                .unwrap()
                .into_iter()
                .map(|d| draft.vocab.to_target(d as usize))
                .collect();
            for (b, &t) in tokens.iter().enumerate() {
                expected[b].push(t);
            }
            if s + 1 == steps {
                break;
            }
            let step = host_cache.layout().decode_step(&tokens).unwrap();
            let out = draft.forward_step(&step, hidden, &mut host_cache).unwrap();
            hidden = out.hidden.data;
            logits = out.logits;
        }
        let drafted = draft
            .draft_chain(&mut device_cache, &roots_hidden, &roots_logits, 2, steps)
            .expect("device chain");
        assert_eq!(drafted, expected, "round {round}: draft tokens");
        assert_eq!(
            device_cache.layout().used(),
            host_cache.layout().used(),
            "round {round}: columns"
        );
        assert!(
            device_cache.to_host(&gpu).unwrap() == host_cache.to_host(&gpu).unwrap(),
            "round {round}: the caches' keys or values differ"
        );
        for cache in [&mut host_cache, &mut device_cache] {
            cache.layout_mut().rollback(steps - 1);
        }
    }
    let stats = draft.graph_stats();
    assert!(stats.replays > 0, "{stats:?}");
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn verification_of_device_chain_tokens_equals_verification_of_host_tokens() {
    // `CudaTarget::forward_chains` (a chain verification whose drafted tokens are copied into
    // the step on the device, `[steps, batch]` as the device chain leaves them) against
    // `forward` of the same step with the tokens written on the host: the same logits, taps
    // and cache, bit for bit. Batch 3 runs padded to a graph batch (the padding rows must keep
    // their placeholders); rounds 3 and 4 replay the graph captured in round 3.
    let f = fixture("chain-verify");
    let gpu = f.target.gpu().clone();
    let prompts: [&[u32]; 3] = [&[3, 14, 15, 92, 65], &[2, 71], &[8, 28, 18, 28]];
    let mut host_cache = f.target.new_cache(3, 64).unwrap();
    let mut device_cache = f.target.new_cache(3, 64).unwrap();
    let step = host_cache.layout().prefill_step(&prompts).unwrap();
    for cache in [&mut host_cache, &mut device_cache] {
        f.target
            .forward(&step, cache, &f.taps, LogitsFor::Last)
            .expect("prefill");
    }
    let steps = 3;
    for round in 0..4u32 {
        // drafts[b][s], and the same ids [steps, batch] on the device.
        let drafts: Vec<Vec<u32>> = (0..3u32)
            .map(|b| {
                (0..steps as u32)
                    .map(|s| (round * 37 + b * 11 + s * 5 + 1) % 300)
                    .collect()
            })
            .collect();
        let ids: Vec<u32> = (0..steps)
            .flat_map(|s| drafts.iter().map(move |d| d[s]))
            .collect();
        let roots = [1u32 + round, 40, 250];
        let trees: Vec<(Vec<u32>, Vec<Option<usize>>)> = roots
            .iter()
            .zip(&drafts)
            .map(|(&r, d)| {
                let tokens: Vec<u32> = std::iter::once(r).chain(d.iter().copied()).collect();
                let parents = (0..tokens.len()).map(|i| i.checked_sub(1)).collect();
                (tokens, parents)
            })
            .collect();
        let refs: Vec<(&[u32], &[Option<usize>])> = trees
            .iter()
            .map(|(t, p)| (t.as_slice(), p.as_slice()))
            .collect();
        let step = host_cache.layout().tree_step(&refs).unwrap();
        let mut placeholders = step.clone();
        for (b, _) in roots.iter().enumerate() {
            for s in 0..steps {
                placeholders.tokens[b * step.width + 1 + s] = 0;
            }
        }
        let expected = f
            .target
            .forward(&step, &mut host_cache, &f.taps, LogitsFor::All)
            .expect("host-token verification");
        let device_ids = gpu.upload(&ids).unwrap();
        let got = f
            .target
            .forward_chains(
                &placeholders,
                &mut device_cache,
                &f.taps,
                LogitsFor::All,
                &device_ids,
                steps,
            )
            .expect("device-token verification");
        let logits =
            |o: &tandem_cuda::CudaStepOutput| o.logits.as_ref().unwrap().to_host().unwrap();
        assert!(
            logits(&got) == logits(&expected),
            "round {round}: logits differ"
        );
        for (i, (a, b)) in got
            .taps
            .tensors
            .iter()
            .zip(&expected.taps.tensors)
            .enumerate()
        {
            assert!(
                a.to_host().unwrap() == b.to_host().unwrap(),
                "round {round}: tap {i}"
            );
        }
        for cache in [&mut host_cache, &mut device_cache] {
            for b in 0..3 {
                cache.layout_mut().keep_only(b, step.width, &[0, 1]);
            }
        }
        assert!(
            device_cache.to_host(&gpu).unwrap() == host_cache.to_host(&gpu).unwrap(),
            "round {round}: the caches' keys or values differ"
        );
    }
    // Too long a chain for the step is refused by name, before anything runs.
    let step = host_cache.layout().decode_step(&[1, 2, 3]).unwrap();
    let err = f
        .target
        .forward_chains(
            &step,
            &mut device_cache,
            &f.taps,
            LogitsFor::All,
            &gpu.upload(&[0u32; 3]).unwrap(),
            1,
        )
        .unwrap_err();
    assert!(
        err.to_string().contains("do not fit a step of width 1"),
        "{err}"
    );
    assert!(
        f.target.graph_stats().replays > 0,
        "{:?}",
        f.target.graph_stats()
    );
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn fast_head_matches_the_burn_head_in_extend_chain_and_tree_steps() {
    let f = fixture("parity");
    let prompts: Vec<Vec<u32>> = vec![
        vec![3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46],
        vec![2, 71, 82, 81, 28],
    ];
    let refs: Vec<&[u32]> = prompts.iter().map(Vec::as_slice).collect();
    let h = f.draft.spec.hidden_size;
    let v = f.draft.spec.draft_vocab_size;

    // Target prefill with taps on both paths.
    let mut cpu_cache = f.cpu_target.new_cache(2, 64);
    let step = cpu_cache.prefill_step(&refs).unwrap();
    let cpu_out = f
        .cpu_target
        .forward(&step, &mut cpu_cache, &f.taps, LogitsFor::Last)
        .unwrap();
    let mut cache = f.target.new_cache(2, 64).unwrap();
    let fast_out = f
        .target
        .forward(&step, &mut cache, &f.taps, LogitsFor::Last)
        .unwrap();

    // Extend over prompt[1..] + one token, fed by each path's own taps.
    let chunks: Vec<Vec<u32>> = prompts
        .iter()
        .map(|p| p[1..].iter().copied().chain([7]).collect())
        .collect();
    let crefs: Vec<&[u32]> = chunks.iter().map(Vec::as_slice).collect();
    let mut cpu_dcache = f.cpu_draft.new_cache(2, 64);
    let dstep = cpu_dcache.prefill_step(&crefs).unwrap();
    let cpu_ext = f
        .cpu_draft
        .extend(
            &dstep,
            cpu_out.taps.concatenated().unwrap(),
            &mut cpu_dcache,
        )
        .unwrap();
    let mut dcache = f.draft.new_cache(2, 64).unwrap();
    let rows: Vec<i32> = (0..(dstep.batch * dstep.width) as i32).collect();
    let aux = f.draft.fc_input(&fast_out.taps, &rows).unwrap();
    let fast_ext = f.draft.extend(&dstep, &aux, &mut dcache).unwrap();
    let compare = |what: &str, fast: &DeviceRows, cpu: Tensor<B, 3>, real: &[bool], w: usize| {
        let fast = real_rows(&fast.to_host().unwrap(), real, w);
        let cpu = real_rows(&host(cpu), real, w);
        let err = rel_err(&fast, &cpu);
        eprintln!("{what}: rel err {err:.2e}");
        assert!(err < TOLERANCE, "{what}: rel err {err}");
    };
    compare(
        "extend hidden",
        &fast_ext.hidden,
        cpu_ext.hidden.clone(),
        &dstep.real,
        h,
    );
    let logits_err = rel_err(
        &real_rows(&fast_ext.logits.to_host().unwrap(), &dstep.real, v),
        &real_rows(&host(cpu_ext.logits), &dstep.real, v),
    );
    eprintln!("extend logits: rel err {logits_err:.2e}");
    assert!(logits_err < TOLERANCE);

    // A chain step from the last real slot of each sequence.
    let last: Vec<usize> = chunks
        .iter()
        .enumerate()
        .map(|(b, c)| b * dstep.width + c.len() - 1)
        .collect();
    let cpu_hidden_rows: Vec<f32> = host(cpu_ext.hidden.clone());
    let pick = |values: &[f32]| -> Vec<f32> {
        last.iter()
            .flat_map(|&r| values[r * h..(r + 1) * h].iter().copied())
            .collect()
    };
    let cpu_in = Tensor::<B, 3>::from_data(
        TensorData::new(pick(&cpu_hidden_rows), [2, 1, h]),
        &Default::default(),
    );
    let fast_in = f
        .draft
        .gpu()
        .upload(&pick(&fast_ext.hidden.to_host().unwrap()))
        .unwrap();
    let tokens = [17u32, 250];
    let cstep = cpu_dcache.decode_step(&tokens).unwrap();
    let cpu_chain = f
        .cpu_draft
        .forward_step(&cstep, cpu_in.clone(), &mut cpu_dcache)
        .unwrap();
    let fast_chain = f
        .draft
        .forward_step(&cstep, fast_in.clone(), &mut dcache)
        .unwrap();
    compare(
        "chain hidden",
        &fast_chain.hidden,
        cpu_chain.hidden,
        &cstep.real,
        h,
    );
    let err = rel_err(
        &fast_chain.logits.to_host().unwrap(),
        &host(cpu_chain.logits),
    );
    eprintln!("chain logits: rel err {err:.2e}");
    assert!(err < TOLERANCE);

    // A tree step (rolled back first, as the drafter does): root children 0 and 1, node 2
    // under node 0; every node's hidden input is the sequence's root output.
    cpu_dcache.rollback(cpu_dcache.used() - 1);
    let used = dcache.layout().used();
    dcache.layout_mut().rollback(used - 1);
    let tree: (&[u32], &[Option<usize>]) = (&[5, 6, 7], &[None, None, Some(0)]);
    let tstep = cpu_dcache.tree_step(&[tree, tree]).unwrap();
    let repeat =
        |values: Vec<f32>| -> Vec<f32> { values.chunks(h).flat_map(|row| row.repeat(3)).collect() };
    let cpu_tree = f
        .cpu_draft
        .forward_step(
            &tstep,
            Tensor::from_data(
                TensorData::new(repeat(host(cpu_in)), [2, 3, h]),
                &Default::default(),
            ),
            &mut cpu_dcache,
        )
        .unwrap();
    let fast_tree_in = f
        .draft
        .gpu()
        .upload(&repeat(f.draft.gpu().download(&fast_in).unwrap()))
        .unwrap();
    let fast_tree = f
        .draft
        .forward_step(&tstep, fast_tree_in, &mut dcache)
        .unwrap();
    compare(
        "tree hidden",
        &fast_tree.hidden,
        cpu_tree.hidden,
        &tstep.real,
        h,
    );
    let err = rel_err(&fast_tree.logits.to_host().unwrap(), &host(cpu_tree.logits));
    eprintln!("tree logits: rel err {err:.2e}");
    assert!(err < TOLERANCE);
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn fast_speculative_greedy_equals_fast_target_greedy() {
    let f = fixture("greedy");
    let prompts: Vec<Vec<u32>> = vec![
        vec![3, 14, 15, 92, 65],
        vec![2, 71, 82],
        vec![9, 4, 33, 61, 2, 2, 8, 90, 17],
    ];
    let expected =
        fast_target_generate(&f.target, &prompts, 24, &[], SamplingParams::greedy(), 0).unwrap();
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
        let engine = FastSpecEngine {
            target: &f.target,
            draft: Some(&f.draft),
            taps: f.taps.clone(),
            config,
        };
        let out = engine.generate(&prompts, 24, &[]).unwrap();
        for (b, want) in expected.iter().enumerate() {
            assert_eq!(
                out.sequences[b].tokens, want.tokens,
                "sequence {b}, {config:?}"
            );
            let stats = &out.sequences[b].stats;
            assert!(stats.rounds > 0);
            let tau = stats.accept_length();
            assert!(
                (1.0..=config.num_steps as f64 + 1.0).contains(&tau),
                "tau {tau}"
            );
        }
        // The same engine on the CPU (burn, f32) agrees on the first tokens too: the fast
        // path computes the same function, not just a self-consistent one.
        let cpu = tandem_infer::engine::target_greedy(&f.cpu_target, &prompts[0], 4, &[]).unwrap();
        assert_eq!(
            out.sequences[0].tokens[..4],
            cpu[..],
            "first tokens vs the CPU reference"
        );
    }
}

/// Lossless sampling on the fast path: the second generated token must follow the target's
/// marginal `sum_t1 p(t1) p(t2 | t1)` (computed from fast-path prefills), chi-square at 99.9%,
/// for several temperatures and with top-p / top-k truncation; the tree (topk 2) drafts.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn fast_sampling_keeps_the_target_distribution() {
    let f = fixture("sampling");
    let prompt = vec![5u32, 6, 7];
    let vocab = f.target.spec.vocab_size;
    for (temperature, top_p, top_k) in [(2.0, 1.0, 0), (0.7, 1.0, 0), (1.0, 0.9, 20)] {
        let sampling = SamplingParams {
            temperature,
            top_p,
            top_k,
        };
        let probs_after = |tokens: &[u32]| -> Vec<f32> {
            let mut cache = f.target.new_cache(1, tokens.len()).unwrap();
            let step = cache.layout().prefill_step(&[tokens]).unwrap();
            let out = f
                .target
                .forward(&step, &mut cache, &TapRequest::none(), LogitsFor::Last)
                .unwrap();
            tandem_model::sampling::distribution(&out.logits.unwrap().to_host().unwrap(), &sampling)
        };
        let marginal = tandem_model::testing::second_token_marginal(&prompt, probs_after);
        let mut counts = vec![0usize; vocab];
        for seed in 0..2000u64 {
            let engine = FastSpecEngine {
                target: &f.target,
                draft: Some(&f.draft),
                taps: f.taps.clone(),
                config: SpecConfig {
                    num_steps: 2,
                    topk: 2,
                    num_draft_tokens: 4,
                    sampling,
                    seed,
                },
            };
            let out = engine
                .generate(std::slice::from_ref(&prompt), 2, &[])
                .unwrap();
            counts[out.sequences[0].tokens[1] as usize] += 1;
        }
        let (chi2, limit) = tandem_model::testing::chi_square_999(&marginal, &counts);
        eprintln!("{sampling:?}: chi2 {chi2:.1} (limit {limit:.1})");
        assert!(
            chi2 < limit,
            "{sampling:?}: chi2 {chi2:.1} (limit {limit:.1})"
        );
    }
}

/// A sequence that reaches the model's context (256 positions here) ends with
/// `Finish::ContextFull`, and what it produced until then is still target greedy output.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn fast_engine_ends_a_sequence_at_the_context_limit() {
    let f = fixture("context");
    let context = f.target.spec.max_position_embeddings;
    let long: Vec<u32> = (0..context as u32 - 20).map(|i| 1 + i % 250).collect();
    let prompts = vec![long, vec![3, 14, 15]];
    let engine = FastSpecEngine {
        target: &f.target,
        draft: Some(&f.draft),
        taps: f.taps.clone(),
        config: SpecConfig::chain(3),
    };
    let out = engine.generate(&prompts, 64, &[]).unwrap();
    let full = &out.sequences[0];
    assert_eq!(full.finish, tandem_infer::Finish::ContextFull);
    assert!(
        !full.tokens.is_empty() && full.tokens.len() < 64,
        "{}",
        full.tokens.len()
    );
    assert!(prompts[0].len() + full.tokens.len() <= context);
    let expected = fast_target_generate(
        &f.target,
        &prompts[..1],
        full.tokens.len(),
        &[],
        SamplingParams::greedy(),
        0,
    )
    .unwrap();
    assert_eq!(full.tokens, expected[0].tokens);
    assert_eq!(out.sequences[1].finish, tandem_infer::Finish::Length);
    assert_eq!(out.sequences[1].tokens.len(), 64);
}

/// Continuous batching on the fast path: requests join mid-flight, one is cancelled, finished
/// ones leave, and a small cache forces compactions; every sequence still equals the fast
/// target-only greedy output of its prompt alone. The same holds for the target alone
/// (`draft: None`, the serving baseline), also with plain rounds of four decode steps queued
/// back to back. Speculative: chain and tree.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn fast_running_batch_joins_leaves_and_compacts_without_changing_outputs() {
    use std::collections::HashMap;
    use tandem_infer::Request;
    let f = fixture("running");
    let prompts: Vec<Vec<u32>> = vec![
        vec![3, 14, 15, 92, 65],
        vec![2, 71, 82],
        vec![9, 4, 33, 61, 2, 2, 8, 90, 17],
        vec![44, 45],
        vec![7, 7, 7, 1],
    ];
    let budgets = [30usize, 12, 25, 30, 20];
    let expected: Vec<Vec<u32>> = prompts
        .iter()
        .zip(budgets)
        .map(|(p, n)| {
            fast_target_generate(
                &f.target,
                std::slice::from_ref(p),
                n,
                &[],
                SamplingParams::greedy(),
                0,
            )
            .unwrap()
            .remove(0)
            .tokens
        })
        .collect();
    let request = |i: usize| Request {
        id: i as u64,
        prompt: prompts[i].clone(),
        max_new_tokens: budgets[i],
        stop_ids: vec![],
        sampling: SamplingParams::greedy(),
        seed: i as u64,
    };
    let tree = SpecConfig {
        num_steps: 3,
        topk: 4,
        num_draft_tokens: 8,
        sampling: SamplingParams::greedy(),
        seed: 0,
    };
    // The last run: target-only plain rounds of four decode steps, the later ones fed the
    // previous step's greedy ids on the GPU (`RunningBatch::plain_lookahead`).
    for (draft, config, lookahead) in [
        (Some(&f.draft), SpecConfig::chain(3), 1),
        (Some(&f.draft), tree, 1),
        (None, SpecConfig::chain(3), 1),
        (None, SpecConfig::chain(3), 4),
    ] {
        let engine = FastSpecEngine {
            target: &f.target,
            draft,
            taps: if draft.is_some() {
                f.taps.clone()
            } else {
                TapRequest::none()
            },
            config,
        };
        // 48 columns: far less than the rounds need without compaction.
        let mut batch = engine.new_batch(48);
        batch.plain_lookahead = lookahead;
        // The tree and target-only runs keep their caches in buffers reserved for 8 rows
        // (joins, leaves and compactions in place); the chain run reallocates at each join.
        if config.topk > 1 || draft.is_none() {
            batch.reserve_rows = 8;
        }
        let mut streamed: HashMap<u64, Vec<u32>> = HashMap::new();
        let mut finished: HashMap<u64, Vec<u32>> = HashMap::new();
        let mut take = |progress: Vec<tandem_infer::Progress>| {
            for p in progress {
                streamed.entry(p.id).or_default().extend(&p.tokens);
                if let Some(out) = p.finished {
                    finished.insert(p.id, out.tokens);
                }
            }
        };
        take(
            engine
                .admit(&mut batch, vec![request(0), request(1)])
                .unwrap(),
        );
        for round in 0.. {
            match round {
                2 => take(
                    engine
                        .admit(&mut batch, vec![request(2), request(3)])
                        .unwrap(),
                ),
                4 => {
                    let out = engine.cancel(&mut batch, 3).unwrap().expect("3 is running");
                    assert!(!out.tokens.is_empty());
                    assert_eq!(out.tokens[..], expected[3][..out.tokens.len()]);
                }
                5 => take(engine.admit(&mut batch, vec![request(4)]).unwrap()),
                _ => {}
            }
            if batch.is_empty() && round > 5 {
                break;
            }
            take(engine.step(&mut batch).unwrap());
        }
        // One column per round without a head: 48 columns last the whole schedule, so only the
        // speculative rounds (4 or 8 columns each) are sure to need compaction.
        assert!(
            batch.compactions > 0 || draft.is_none(),
            "the small cache must have been compacted ({config:?})"
        );
        for i in [0usize, 1, 2, 4] {
            let id = i as u64;
            assert_eq!(
                finished[&id],
                expected[i],
                "sequence {i}, head {}, {config:?}",
                draft.is_some()
            );
            assert_eq!(
                streamed[&id], expected[i],
                "streamed tokens of sequence {i}"
            );
        }
        assert!(
            !finished.contains_key(&3),
            "a cancelled request does not finish"
        );
    }
}

/// Appends each request's committed tokens in `progress` to its stream in `into`.
fn streamed(
    into: &mut std::collections::HashMap<u64, Vec<u32>>,
    progress: Vec<tandem_infer::Progress>,
) {
    for p in progress {
        into.entry(p.id).or_default().extend(&p.tokens);
    }
}

/// The speculation policy's rounds: plain rounds (no drafts, the head's extension deferred),
/// chain and tree rounds in any order, with a row joining in the middle, give target-only
/// greedy output; the head caught up over deferred plain rounds holds the same state as a
/// head extended over the same tokens by a prefill (bf16 tolerance); the cost calibration
/// measures a positive cost for every choice and the adaptive policy accepts its table.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn fast_policy_rounds_and_the_deferred_head_extension_are_exact() {
    use std::collections::HashMap;
    use tandem_infer::{Choice, PolicyConfig, Request, Shape, SpeculationPolicy};
    // Positions for a prompt longer than one catch-up piece (part 3).
    let f = fixture_with_positions("policy", 1024);
    let prompts: Vec<Vec<u32>> = vec![vec![3, 14, 15, 92, 65], vec![2, 71, 82]];
    let budget = 40;
    let request = |i: usize, prompt: Vec<u32>| Request {
        id: i as u64,
        prompt,
        max_new_tokens: budget,
        stop_ids: vec![],
        sampling: SamplingParams::greedy(),
        seed: i as u64,
    };
    let expected: Vec<Vec<u32>> = prompts
        .iter()
        .map(|p| {
            fast_target_generate(
                &f.target,
                std::slice::from_ref(p),
                budget,
                &[],
                SamplingParams::greedy(),
                0,
            )
            .unwrap()
            .remove(0)
            .tokens
        })
        .collect();
    let engine = FastSpecEngine {
        target: &f.target,
        draft: Some(&f.draft),
        taps: f.taps.clone(),
        config: SpecConfig::chain(3),
    };
    let shapes = vec![
        Shape::parse("3/1/4").unwrap(),
        Shape::parse("3/4/8").unwrap(),
    ];

    // 1. Mixed rounds; row 1 joins after two plain rounds (so its deferred run is shorter).
    let mut batch = engine.new_batch_with_policy(
        256,
        SpeculationPolicy::forced(shapes.clone(), Choice::Plain),
    );
    let mut tokens: HashMap<u64, Vec<u32>> = HashMap::new();
    let mut take = |progress| streamed(&mut tokens, progress);
    take(
        engine
            .admit(&mut batch, vec![request(0, prompts[0].clone())])
            .unwrap(),
    );
    let plan = [
        Choice::Plain,
        Choice::Plain,
        Choice::Draft(0),
        Choice::Plain,
        Choice::Plain,
        Choice::Plain,
        Choice::Draft(1),
        Choice::Draft(0),
        Choice::Plain,
    ];
    for (round, &choice) in plan.iter().cycle().enumerate() {
        if batch.is_empty() {
            break;
        }
        if round == 2 {
            take(
                engine
                    .admit(&mut batch, vec![request(1, prompts[1].clone())])
                    .unwrap(),
            );
        }
        batch.policy.force(choice);
        take(engine.step(&mut batch).unwrap());
    }
    for (i, want) in expected.iter().enumerate() {
        assert_eq!(
            &tokens[&(i as u64)],
            want,
            "sequence {i} under mixed rounds"
        );
    }

    // 2. Deferred extension vs a prefill over the same tokens: rows 0 and 1 decode plainly
    //    (row 1 joins two rounds later), then the head catches up. One step a plain round (the
    //    deferral counted below), whatever TANDEM_PLAIN_LOOKAHEAD says.
    let mut batch = engine.new_batch_with_policy(
        256,
        SpeculationPolicy::forced(shapes.clone(), Choice::Plain),
    );
    batch.plain_lookahead = 1;
    let mut got: HashMap<u64, Vec<u32>> = HashMap::new();
    let mut keep = |progress| streamed(&mut got, progress);
    keep(
        engine
            .admit(&mut batch, vec![request(0, prompts[0].clone())])
            .unwrap(),
    );
    for round in 0..7 {
        if round == 2 {
            keep(
                engine
                    .admit(&mut batch, vec![request(1, prompts[1].clone())])
                    .unwrap(),
            );
        }
        keep(engine.step(&mut batch).unwrap());
    }
    // Row 0 is behind by its 7 plain rounds; row 1 joined during them, so its prompt's
    // extension was deferred too: 3 prompt slots (the last paired with its first token) and
    // the 5 rounds after it.
    assert_eq!(batch.deferred_rounds(), 8);
    engine.catch_up(&mut batch).unwrap();
    assert_eq!(batch.deferred_rounds(), 0);
    let caught_up = engine.head_roots(&batch).unwrap().expect("a head");
    let h = caught_up.len() / 2;
    for i in 0..2u64 {
        // The prefill reference: prompt + every generated token but the last, whose pairing
        // with the last tap is the root.
        let generated = &got[&i];
        let mut prompt = prompts[i as usize].clone();
        prompt.extend(&generated[..generated.len() - 1]);
        let mut fresh = engine.new_batch(256);
        let first = engine.admit(&mut fresh, vec![request(0, prompt)]).unwrap();
        assert_eq!(first[0].tokens, [*generated.last().unwrap()], "row {i}");
        let reference = engine.head_roots(&fresh).unwrap().expect("a head");
        let row = &caught_up[i as usize * h..(i as usize + 1) * h];
        let err = rel_err(row, &reference);
        assert!(
            err < TOLERANCE,
            "row {i}: caught-up root vs prefill, rel err {err}"
        );
    }

    // 3. A prompt longer than one catch-up piece (256 columns) joins during plain rounds; the
    //    drafted rounds after it catch the head up in two pieces and still decode exactly.
    let long: Vec<u32> = (0..300u32).map(|i| (i * 7919 + 11) % 299 + 1).collect();
    let long_expected = fast_target_generate(
        &f.target,
        std::slice::from_ref(&long),
        budget,
        &[],
        SamplingParams::greedy(),
        0,
    )
    .unwrap()
    .remove(0)
    .tokens;
    let mut batch = engine.new_batch_with_policy(
        1024,
        SpeculationPolicy::forced(shapes.clone(), Choice::Plain),
    );
    // The whole deferred prompt, not the default tail.
    batch.catch_up_tail = None;
    let mut got: HashMap<u64, Vec<u32>> = HashMap::new();
    let mut keep = |progress| streamed(&mut got, progress);
    keep(
        engine
            .admit(&mut batch, vec![request(0, prompts[0].clone())])
            .unwrap(),
    );
    keep(engine.step(&mut batch).unwrap());
    keep(engine.admit(&mut batch, vec![request(1, long)]).unwrap());
    assert_eq!(
        batch.deferred_rounds(),
        300,
        "the long prompt's extension is deferred"
    );
    batch.policy.force(Choice::Draft(0));
    while !batch.is_empty() {
        keep(engine.step(&mut batch).unwrap());
    }
    assert_eq!(got[&0], expected[0], "row 0 beside a deferred long prompt");
    assert_eq!(got[&1], long_expected, "a long prompt caught up in pieces");

    // 4. Calibration on a batch with reserved rows: it leaves the batch empty with its caches
    //    kept, and a request served afterwards still decodes exactly.
    let mut batch = engine.new_batch_with_policy(
        256,
        SpeculationPolicy::forced(shapes.clone(), Choice::Plain),
    );
    batch.reserve_rows = 4;
    let costs = engine.calibrate(&mut batch, &[1, 4]).unwrap();
    assert_eq!(costs.seconds.len(), 3);
    assert!(batch.is_empty());
    let mut after: Vec<u32> = Vec::new();
    for p in engine
        .admit(&mut batch, vec![request(0, prompts[0].clone())])
        .unwrap()
    {
        after.extend(&p.tokens);
    }
    batch.policy.force(Choice::Draft(1));
    while !batch.is_empty() {
        for p in engine.step(&mut batch).unwrap() {
            after.extend(&p.tokens);
        }
    }
    assert_eq!(after, expected[0], "a request after calibration");
    let policy = SpeculationPolicy::adaptive(shapes, costs.clone(), PolicyConfig::default());
    assert!(policy.is_ok(), "{costs:?}");
}

/// The head's extend queued on the GPU right behind the verification, over every verified slot
/// with the verification's greedy ids as tokens (`RunningBatch::early_extend`), against the
/// extend over the accepted tokens built after the host has read the results: two batches of
/// the same ragged prompts in lockstep, chain 3/1/4, each sequence's root found on the GPU. Every round must stream the same tokens
/// with the same acceptance, and the head's roots must be the same bits (the fused small-step
/// kernels give a row the same bits at every step width) in every round.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn early_extend_on_the_gpu_leaves_the_bits_of_the_accepted_extend() {
    let f = fixture("early-extend");
    // Two sequences: the early extend's 2 x 4 slots stay on the fused kernels (at most 8
    // rows), as every extend of the accepted slots does, so the bits can be compared.
    let prompts: Vec<Vec<u32>> = vec![vec![3, 14, 15, 92, 65], vec![2, 71, 82]];
    let engine = FastSpecEngine {
        target: &f.target,
        draft: Some(&f.draft),
        taps: f.taps.clone(),
        config: SpecConfig::chain(3),
    };
    let requests = || {
        prompts
            .iter()
            .enumerate()
            .map(|(i, p)| tandem_infer::Request {
                id: i as u64,
                prompt: p.clone(),
                max_new_tokens: 40,
                stop_ids: vec![],
                sampling: SamplingParams::greedy(),
                seed: 0,
            })
            .collect::<Vec<_>>()
    };
    let summary = |progress: Vec<tandem_infer::Progress>| -> Vec<(u64, Vec<u32>, Option<usize>)> {
        progress
            .into_iter()
            .map(|p| (p.id, p.tokens, p.accepted))
            .collect()
    };
    let mut early = engine.new_batch(256);
    early.early_extend = true;
    let mut exact = engine.new_batch(256);
    exact.early_extend = false;
    let mut streamed: Vec<Vec<u32>> = vec![Vec::new(); prompts.len()];
    let mut keep = |progress: &[(u64, Vec<u32>, Option<usize>)]| {
        for (id, tokens, _) in progress {
            streamed[*id as usize].extend(tokens);
        }
    };
    let admitted = summary(engine.admit(&mut early, requests()).unwrap());
    assert_eq!(
        admitted,
        summary(engine.admit(&mut exact, requests()).unwrap())
    );
    keep(&admitted);
    let mut rounds = 0;
    while !exact.is_empty() {
        let got = summary(engine.step(&mut early).unwrap());
        let want = summary(engine.step(&mut exact).unwrap());
        assert_eq!(got, want, "round {rounds}");
        keep(&got);
        let got = engine.head_roots(&early).unwrap().unwrap_or_default();
        let want = engine.head_roots(&exact).unwrap().unwrap_or_default();
        assert_eq!(got.len(), want.len(), "round {rounds}");
        let differ = got
            .iter()
            .zip(&want)
            .filter(|(a, b)| a.to_bits() != b.to_bits())
            .count();
        assert_eq!(
            differ, 0,
            "round {rounds}: {differ} head-root values differ"
        );
        rounds += 1;
    }
    assert!(early.is_empty(), "both batches finish in the same round");
    assert!(rounds > 5, "{rounds} rounds");
    // The greedy output is still the target's.
    let expected =
        fast_target_generate(&f.target, &prompts, 40, &[], SamplingParams::greedy(), 0).unwrap();
    for (b, want) in expected.iter().enumerate() {
        assert_eq!(streamed[b], want.tokens, "sequence {b}");
    }
}
