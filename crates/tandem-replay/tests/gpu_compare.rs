//! GPU test of `tandem compare`'s offline half on the CUDA fast path (session 19), against burn
//! on the CPU (f32), on a tiny random target and head whose shapes the fast path's kernels
//! accept. CI has no GPU, so it is ignored there; on the device machine run the built test
//! binary with `--ignored`. The dump holds the target's own greedy text with burn's taps
//! (stored as bf16, as `tandem dump` stores them).
//!
//! - `CudaTarget::last_block_argmax` (final norm, lm_head and argmax over recorded last-block
//!   states) agrees with burn's on at least 97% of the tokens (bf16 against f32);
//! - the recorded taps, uploaded one tensor per tap (`SpecBackend::rows_from_host`, the way
//!   `drafted_acceptance` feeds them), draft the same trees on both backends: draft extend over
//!   each sample's slots, then a chain and a tree; at least 90% of the draft tokens equal;
//! - `drafted_acceptance` walks the same rounds on both (every position of the chain view:
//!   rounds, samples and greedy checks equal, and the dump reads as the fast target's greedy
//!   text on at least 97% of its tokens).

use std::path::PathBuf;
use std::sync::Arc;

use tandem_cuda::{CudaDraft, CudaTarget, Gpu, TpReduction};
use tandem_dump::{
    DumpManifest, DumpReader, DumpRecord, DumpSettings, DumpWriter, ShardLimits, StorageDtype,
};
use tandem_eagle::{Eagle3Config, Eagle3Draft, VocabMap};
use tandem_infer::{Engine, FastSpecEngine, Shape, SpecBackend, SpecConfig, SpecEngine};
use tandem_model::backend::CpuBackend;
use tandem_model::testing::{scratch_dir, tiny_config, write_random_model};
use tandem_model::{CaptureTarget, HfConfig, LogitsFor, TapRequest, Taps, TargetModel};
use tandem_replay::{
    Candidate, OfflinePositions, ReplayOptions, Status, drafted_acceptance, generate_samples,
    replay,
};
use tandem_wiring::{
    Job, Producer, TapId, TapPoint, TargetFingerprint, WiringManifest, default_aux_taps,
};

type B = CpuBackend;

const STEPS: usize = 3;
const LAYERS: usize = 4;
const HIDDEN: usize = 128;
const VOCAB: usize = 300;

struct Fixture {
    dir: PathBuf,
    cpu_target: TargetModel<B>,
    cpu_draft: Eagle3Draft<B>,
    target: CudaTarget,
    draft: CudaDraft,
    taps: Vec<TapId>,
}

/// The target of the fast path's GPU tests (head_dim 32) and a seeded random head for it.
fn fixture() -> Fixture {
    let mut config: HfConfig = tiny_config("LlamaForCausalLM", LAYERS);
    config.max_position_embeddings = 256;
    config.hidden_size = HIDDEN;
    config.intermediate_size = 192;
    config.vocab_size = VOCAB;
    let dir = scratch_dir("gpu-compare");
    write_random_model(&dir, &config, 11).expect("model written");
    let gpu: Arc<Gpu> = Gpu::new(0).expect("this test needs a CUDA GPU");
    let target = CudaTarget::load(&dir, gpu).expect("fast target");
    let cpu_target = TargetModel::<B>::load(&dir, &Default::default()).expect("cpu target");
    let taps = default_aux_taps(LAYERS).unwrap();
    let spec = Eagle3Config::for_target(&config, VOCAB, taps.len())
        .resolve()
        .unwrap();
    let cpu_draft = Eagle3Draft::init(
        spec.clone(),
        VocabMap::identity(VOCAB),
        cpu_target.embed_tokens.clone(),
        5,
        &Default::default(),
    )
    .unwrap();
    let draft = CudaDraft::new(
        &target,
        spec,
        VocabMap::identity(VOCAB),
        &cpu_draft.to_host(),
    )
    .expect("fast head");
    Fixture {
        dir,
        cpu_target,
        cpu_draft,
        target,
        draft,
        taps,
    }
}

/// The fixture target's fingerprint as the dumps here record it (placeholder hashes: replay is
/// given the same fingerprint).
fn fixture_fingerprint() -> TargetFingerprint {
    TargetFingerprint {
        architecture: "LlamaForCausalLM".into(),
        model_type: "llama".into(),
        num_layers: LAYERS,
        hidden_size: HIDDEN,
        vocab_size: VOCAB,
        config_sha256: "0".repeat(64),
        tokenizer_sha256: "0".repeat(64),
        chat_template_sha256: None,
    }
}

/// A bf16 dump manifest of `taps` at the residual stream, produced on `device` by `path`.
fn dump_identity(
    fingerprint: TargetFingerprint,
    taps: &[TapId],
    device: &str,
    path: &str,
    dataset: &str,
) -> DumpManifest {
    DumpManifest::new(
        WiringManifest::new(
            fingerprint,
            taps.to_vec(),
            TapPoint::ResidualStream,
            "bf16",
            Producer::tandem(Job::Dump, device, path),
        ),
        StorageDtype::Bf16,
        dataset,
        DumpSettings {
            max_len: 256,
            regenerate: None,
        },
    )
}

/// Four prompts continued greedily by burn's target, with burn's taps and last block.
fn write_dump(f: &Fixture) -> PathBuf {
    let prompts: Vec<Vec<u32>> = (0..4)
        .map(|i| {
            (0..10 + 3 * i)
                .map(|j| ((j * 37 + i * 11) % VOCAB) as u32)
                .collect()
        })
        .collect();
    let samples = generate_samples(&f.cpu_target, &prompts, 24, &[]).unwrap();
    let fingerprint = fixture_fingerprint();
    let identity = dump_identity(fingerprint, &f.taps, "cpu", "prefill", "gpu-compare");
    let dir = scratch_dir("gpu-compare-dump");
    let mut writer = DumpWriter::open(&dir, &identity, ShardLimits::default()).unwrap();
    let mut request = f.taps.clone();
    request.push(TapId::Block(LAYERS - 1));
    for (i, s) in samples.iter().enumerate() {
        let n = s.input_ids.len();
        let mut cache = f.cpu_target.new_cache(1, n);
        let step = cache.prefill_step(&[&s.input_ids]).unwrap();
        let out = f
            .cpu_target
            .forward(
                &step,
                &mut cache,
                &TapRequest::new(request.clone()),
                LogitsFor::None,
            )
            .unwrap();
        let values: Vec<Vec<f32>> = out
            .taps
            .tensors
            .into_iter()
            .map(|t| t.into_data().to_vec::<f32>().unwrap())
            .collect();
        let slots = f.taps.len();
        let mut aux = Vec::with_capacity(n * HIDDEN * slots);
        for t in 0..n {
            for v in &values[..slots] {
                aux.extend_from_slice(&v[t * HIDDEN..(t + 1) * HIDDEN]);
            }
        }
        let record = DumpRecord {
            sample_id: format!("s{i}"),
            input_ids: s.input_ids.clone(),
            loss_mask: s.loss_mask.clone(),
            aux_hidden: aux,
            last_hidden: values[slots].clone(),
        };
        writer.write(&record, false).unwrap();
    }
    writer.finish(true).unwrap();
    dir
}

/// For each sample: draft extend over its slots `0..=s` (`s = n - STEPS - 2`) from the recorded
/// taps, then one tree from token `s + 1`, as `drafted_acceptance` does; every tree's tokens.
fn trees_from_dump<T: SpecBackend>(engine: &Engine<'_, T>, dump: &DumpReader) -> Vec<u32> {
    let m = dump.manifest();
    let (h, slots) = (m.hidden_size, m.num_slots);
    let head = engine.draft.expect("a head");
    let mut tokens = Vec::new();
    for record in dump.iter() {
        let record = record.unwrap();
        let width = record.len() - STEPS - 1;
        let tensors = (0..slots)
            .map(|k| {
                let mut values = Vec::with_capacity(width * h);
                for t in 0..width {
                    values.extend_from_slice(&record.aux_hidden[(t * slots + k) * h..][..h]);
                }
                engine.target.rows_from_host(&values, 1, width, h).unwrap()
            })
            .collect();
        let taps = Taps {
            taps: Vec::new(),
            tensors,
            visited: Vec::new(),
        };
        let mut cache = engine.target.new_head_cache(head, 1, width + 64).unwrap();
        let chunk = vec![record.input_ids[1..=width].to_vec()];
        let roots = engine
            .draft_extend(
                head,
                &mut cache,
                &chunk,
                &taps,
                width,
                &[(0..width).collect()],
            )
            .unwrap();
        let trees = engine
            .draft_trees(
                head,
                Shape::of(&engine.config),
                &[record.input_ids[width]],
                &roots,
                &mut cache,
            )
            .unwrap();
        tokens.extend(trees[0].tokens.iter().copied());
    }
    tokens
}

fn share_equal(a: &[u32], b: &[u32]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).filter(|(x, y)| x == y).count() as f64 / a.len().max(1) as f64
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn compare_drafts_offline_on_the_fast_path_as_burn_does() {
    let f = fixture();
    let dump = DumpReader::open(&write_dump(&f)).unwrap();

    let (mut fast_ids, mut cpu_ids) = (Vec::new(), Vec::new());
    for record in dump.iter() {
        let record = record.unwrap();
        let fast = SpecBackend::last_block_argmax(&f.target, &record.last_hidden).unwrap();
        assert_eq!(fast.len(), record.len());
        fast_ids.extend(fast);
        cpu_ids.extend(SpecBackend::last_block_argmax(&f.cpu_target, &record.last_hidden).unwrap());
    }
    let agree = share_equal(&fast_ids, &cpu_ids);
    assert!(agree >= 0.97, "last-block argmax agrees on {agree:.3}");

    let tree = SpecConfig {
        topk: 4,
        num_draft_tokens: 8,
        ..SpecConfig::chain(STEPS)
    };
    for config in [SpecConfig::chain(STEPS), tree] {
        let fast = FastSpecEngine {
            target: &f.target,
            draft: Some(&f.draft),
            taps: TapRequest::new(f.taps.clone()),
            config,
        };
        let cpu = SpecEngine {
            target: &f.cpu_target,
            draft: Some(&f.cpu_draft),
            taps: TapRequest::new(f.taps.clone()),
            config,
        };
        let (a, b) = (trees_from_dump(&fast, &dump), trees_from_dump(&cpu, &dump));
        let same = share_equal(&a, &b);
        assert!(
            same >= 0.9,
            "topk {}: draft tokens agree on {same:.3}",
            config.topk
        );
        let walk = |positions| {
            (
                drafted_acceptance(&fast, &dump, None, positions, 2).unwrap(),
                drafted_acceptance(&cpu, &dump, None, positions, 2).unwrap(),
            )
        };
        let (on_gpu, on_cpu) = walk(OfflinePositions::Every);
        assert_eq!(on_gpu.samples, on_cpu.samples);
        assert_eq!(on_gpu.stats.rounds, on_cpu.stats.rounds);
        assert_eq!(on_gpu.greedy_checked, on_cpu.greedy_checked);
        assert!(
            on_gpu.greedy_share() >= 0.97,
            "{:.3}",
            on_gpu.greedy_share()
        );
        // Serving's rounds run too (their positions follow acceptance, so only bounds).
        let (on_gpu, on_cpu) = walk(OfflinePositions::Rounds);
        assert_eq!(on_gpu.samples, on_cpu.samples);
        assert!(on_gpu.stats.rounds > 0 && on_gpu.stats.accept_length() >= 1.0);
    }
}

/// Issue #19 (4) on the fast path: a dump whose block-1 slot was captured before the MLP's
/// all-reduce on rank 0 of a 2-way tensor-parallel fast-path target
/// (`CudaTarget::set_partial_sum_fault`, the kernels' own partial sum, not a host
/// construction) is replayed through that target (without the fault): replay names the slot "a
/// tensor-parallel partial sum" of rank 0 of 2 (its candidates from the model's CPU f32 copy),
/// and the true slots, captured by the unsplit target, match the split target's captures.
/// The ranks share GPU 0 (host sums), so this runs on one GPU.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn replay_names_a_tensor_parallel_partial_sum_taken_on_the_fast_path() {
    let f = fixture();
    let gpu = f.target.gpu().clone();
    let second = Gpu::new(0).expect("a second stream on GPU 0");
    let split =
        CudaTarget::load_tensor_parallel(&f.dir, &[gpu, second], TpReduction::HostSimulation)
            .expect("2-way split target");
    let taps = vec![TapId::Block(0), TapId::Block(1), TapId::Block(2)];
    let fingerprint = fixture_fingerprint();
    let identity = dump_identity(
        fingerprint.clone(),
        &taps,
        "cuda",
        "prefill, tensor-parallel 2",
        "tp-partial-sum",
    );
    let dir = scratch_dir("gpu-tp-partial-dump");
    let mut writer = DumpWriter::open(&dir, &identity, ShardLimits::default()).unwrap();
    for i in 0..3usize {
        let ids: Vec<u32> = (0..24 + 5 * i)
            .map(|j| ((j * 53 + i * 7 + 3) % VOCAB) as u32)
            .collect();
        let n = ids.len();
        let mut request = taps.clone();
        request.push(TapId::Block(LAYERS - 1));
        let truth = f
            .target
            .capture_taps(&ids, &TapRequest::new(request))
            .unwrap();
        split.set_partial_sum_fault(true);
        let faulty = split
            .capture_taps(&ids, &TapRequest::new(vec![TapId::Block(1)]))
            .unwrap()
            .remove(0);
        split.set_partial_sum_fault(false);
        let gap = tandem_model::testing::rel_err(&faulty, &truth[1]);
        assert!(gap > 0.05, "the partial sum is not the tap (gap {gap})");
        let slots = [&truth[0], &faulty, &truth[2]];
        let mut aux = Vec::with_capacity(n * HIDDEN * slots.len());
        for t in 0..n {
            for v in slots {
                aux.extend_from_slice(&v[t * HIDDEN..(t + 1) * HIDDEN]);
            }
        }
        let record = DumpRecord {
            sample_id: format!("s{i}"),
            input_ids: ids,
            loss_mask: vec![1; n],
            aux_hidden: aux,
            last_hidden: truth[3].clone(),
        };
        writer.write(&record, false).unwrap();
    }
    writer.finish(true).unwrap();
    let dump = DumpReader::open(&dir).unwrap();
    let options = ReplayOptions {
        serving_dtype: "bf16".into(),
        device: "cuda".into(),
        model_label: "tiny, --tp 2".into(),
        ..ReplayOptions::default()
    };
    let report = replay(&split, &fingerprint, &dump, None, &options).expect("replay runs");
    eprintln!("{}", report.to_table());
    assert_eq!(
        report.slots[0].status,
        Status::Match,
        "{}",
        report.slots[0].verdict
    );
    assert_eq!(
        report.slots[2].status,
        Status::Match,
        "{}",
        report.slots[2].verdict
    );
    let s1 = &report.slots[1];
    assert_eq!(
        s1.observed,
        Some(Candidate::PartialSum {
            layer: 1,
            tp: 2,
            rank: 0
        }),
        "{}",
        s1.verdict
    );
    assert!(
        s1.verdict.contains("a tensor-parallel partial sum") && s1.verdict.contains("rank 0 of 2"),
        "{}",
        s1.verdict
    );
    assert!(!report.ok());
}
