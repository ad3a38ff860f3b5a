//! `tandem train` on a tiny random target (hidden 32, 6 blocks, vocab 96) with records captured
//! through the target's capture hook: the loss falls and acc_0 rises, the export reloads to
//! identical outputs, `--resume` continues exactly, and wiring mismatches are refused with the
//! check's sentences.

use std::path::{Path, PathBuf};

use burn::backend::{Autodiff, NdArray};
use burn::module::Module;
use burn::optim::GradientsParams;
use burn::prelude::*;
use burn::record::{FullPrecisionSettings, NamedMpkFileRecorder};
use burn::tensor::TensorData;
use rand::{Rng, SeedableRng};
use tandem_dump::DumpRecord;
use tandem_eagle::{Eagle3Draft, load_pretrained};
use tandem_model::testing::{tiny_config, write_random_model};
use tandem_model::{GenerateOptions, LogitsFor, SamplingParams, TapRequest, TargetModel};
use tandem_train::data::{Dataset, MemorySource, SampleSource};
use tandem_train::metrics::read_lines;
use tandem_train::target::fingerprint;
use tandem_train::{TrainError, TrainOptions, clip_global_norm, train_on};
use tandem_wiring::{Job, Producer, TapId, TapPoint, WiringManifest};

type B = NdArray<f32>;
type AB = Autodiff<B>;

fn temp_dir(name: &str) -> PathBuf {
    tandem_model::testing::scratch_dir(&format!("train-test-{name}"))
}

const TAPS: [TapId; 3] = [TapId::Block(1), TapId::Block(2), TapId::Block(3)];

/// A tiny random target (6 blocks) with a placeholder tokenizer.json for its fingerprint. The
/// lm_head is tied to the (unit-scale) embedding so the target's distributions are peaked like
/// a trained model's rather than nearly uniform.
fn tiny_target(name: &str) -> PathBuf {
    let dir = temp_dir(name);
    let mut config = tiny_config("LlamaForCausalLM", 6);
    config.model_type = Some("llama".to_owned());
    config.tie_word_embeddings = true;
    write_random_model(&dir, &config, 17).unwrap();
    std::fs::write(dir.join("tokenizer.json"), "{\"model\": \"tiny\"}").unwrap();
    dir
}

/// Rows as `tandem dump` stores them, captured through the capture hook: a 4-token random
/// prompt (loss mask 0) and a 28-token reply sampled from the target itself (loss mask 1).
fn records(model_dir: &Path, count: usize, seed: u64) -> Vec<DumpRecord> {
    let device = Default::default();
    let model = TargetModel::<B>::load(model_dir, &device).unwrap();
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut taps = TAPS.to_vec();
    taps.push(TapId::Block(5));
    (0..count)
        .map(|i| {
            let prompt: Vec<u32> = (0..4).map(|_| rng.random_range(0..96u32)).collect();
            let reply = tandem_model::generate(
                &model,
                &prompt,
                &GenerateOptions {
                    max_new_tokens: 28,
                    sampling: SamplingParams {
                        temperature: 0.7,
                        top_p: 1.0,
                        top_k: 0,
                    },
                    stop_ids: Vec::new(),
                    seed: seed * 1000 + i as u64,
                },
            )
            .unwrap();
            let ids: Vec<u32> = prompt.iter().chain(&reply.tokens).copied().collect();
            let mut cache = model.new_cache(1, ids.len());
            let step = cache.prefill_step(&[&ids]).unwrap();
            let out = model
                .forward(
                    &step,
                    &mut cache,
                    &TapRequest::new(taps.clone()),
                    LogitsFor::None,
                )
                .unwrap();
            let values = |t: &Tensor<B, 3>| t.clone().into_data().to_vec::<f32>().unwrap();
            let aux = out.taps.tensors[..3].to_vec();
            DumpRecord {
                sample_id: format!("sample-{seed}-{i}"),
                loss_mask: (0..ids.len()).map(|k| u8::from(k >= 4)).collect(),
                input_ids: ids,
                aux_hidden: values(&Tensor::cat(aux, 2)),
                last_hidden: values(&out.taps.tensors[3]),
            }
        })
        .collect()
}

fn wiring(model_dir: &Path, taps: &[TapId]) -> WiringManifest {
    WiringManifest::new(
        fingerprint(model_dir, false).unwrap(),
        taps.to_vec(),
        TapPoint::ResidualStream,
        "f32",
        Producer::tandem(Job::Dump, "cpu", "prefill"),
    )
}

fn source(model_dir: &Path, records: Vec<DumpRecord>, name: &str) -> Box<dyn SampleSource> {
    Box::new(MemorySource {
        wiring: wiring(model_dir, &TAPS),
        hidden_size: 32,
        records,
        name: name.to_owned(),
    })
}

fn options(model: &Path, out: &Path) -> TrainOptions {
    let mut o = TrainOptions::new(vec![PathBuf::from("memory")], model, out);
    o.draft_vocab = Some(48);
    o.ttt_steps = 3;
    o.batch_size = 4;
    o.lr = 3e-3;
    o.warmup_ratio = 0.05;
    o.min_lr_ratio = 0.1;
    o.val_fraction = 0.1;
    o.max_grad_norm = 1.0;
    o.save_every = 0;
    o
}

fn mean(values: impl Iterator<Item = f64>) -> f64 {
    let v: Vec<f64> = values.collect();
    v.iter().sum::<f64>() / v.len() as f64
}

/// The done-when test on a tiny target: a few dozen steps lower the loss and raise acc_0 (on
/// the training batches and on the held-out split), the exported directory reloads to the
/// same outputs as the trained parameters (the final checkpoint's burn record), and the export
/// carries SGLang ids and the canonical wiring.
#[test]
fn tiny_target_training_learns_exports_and_reloads() {
    let model = tiny_target("learn-model");
    let out = temp_dir("learn-out");
    let rows = records(&model, 40, 1);
    let data = Dataset::new(vec![source(&model, rows.clone(), "memory")]).unwrap();
    let mut o = options(&model, &out);
    o.epochs = 7;
    o.eval_every = 10;
    let report = train_on::<AB>(&o, data, &Default::default()).unwrap();
    assert!(report.steps >= 50, "{} steps", report.steps);
    let lines = read_lines(&out.join("metrics.jsonl")).unwrap();
    let train: Vec<_> = lines.iter().filter(|l| l.kind == "train").collect();
    let val: Vec<_> = lines.iter().filter(|l| l.kind == "val").collect();
    let first_loss = mean(train[..8].iter().map(|l| l.loss));
    let last_loss = mean(train[train.len() - 8..].iter().map(|l| l.loss));
    let first_acc = mean(train[..8].iter().map(|l| l.acc[0]));
    let last_acc = mean(train[train.len() - 8..].iter().map(|l| l.acc[0]));
    eprintln!(
        "tiny: {} steps, {:.2} steps/s, {:.0} tok/s; train loss {first_loss:.3} -> \
         {last_loss:.3}, acc0 {first_acc:.3} -> {last_acc:.3}; val acc0 {:.3} -> {:.3}",
        report.steps,
        report.steps_per_s,
        report.tokens_per_s,
        val[0].acc[0],
        val[val.len() - 1].acc[0]
    );
    assert!(
        last_loss < 0.7 * first_loss,
        "loss {first_loss} -> {last_loss}"
    );
    assert!(
        last_acc > first_acc + 0.15,
        "acc0 {first_acc} -> {last_acc}"
    );
    assert!(
        val[val.len() - 1].acc[0] > val[0].acc[0],
        "validation acc0 did not rise"
    );
    assert!(
        val[val.len() - 1].loss < val[0].loss,
        "validation loss did not fall"
    );
    assert_eq!(train[0].ploss.len(), 3);
    assert!(out.join("curves.html").exists());

    // Export: config + weights, reloaded, equal to the trained parameters.
    let json: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("config.json")).unwrap()).unwrap();
    assert_eq!(
        json["eagle_config"]["eagle_aux_hidden_state_layer_ids"],
        serde_json::json!([1, 2, 3]),
        "SGLang ids of blocks 1, 2, 3"
    );
    assert_eq!(
        json["eagle_aux_hidden_state_layer_ids"],
        serde_json::json!([2, 3, 4]),
        "vLLM ids (top level) of blocks 1, 2, 3"
    );
    assert_eq!(json["tandem_wiring"]["producer"]["job"], "train");
    assert_eq!(
        json["tandem_wiring"]["taps"],
        serde_json::json!(["block:1", "block:2", "block:3"])
    );
    // The head names its data: one in-memory source of 40 rows (no manifest to hash).
    let tokens: usize = rows.iter().map(DumpRecord::len).sum();
    assert_eq!(
        json["tandem_wiring"]["trained_on"],
        serde_json::json!([{"name": "memory", "path": "memory", "rows": 40, "tokens": tokens}])
    );
    assert_eq!(report.trained_on.len(), 1);
    let device = Default::default();
    let target = TargetModel::<B>::load(&model, &device).unwrap();
    let exported = load_pretrained::<B>(&out, target.embed_tokens.clone(), &device)
        .unwrap()
        .draft;
    let latest = std::fs::read_to_string(out.join("checkpoints/latest")).unwrap();
    let ckpt = out.join("checkpoints").join(latest.trim());
    let recorder = NamedMpkFileRecorder::<FullPrecisionSettings>::new();
    let trained = load_pretrained::<B>(&ckpt.join("head"), target.embed_tokens.clone(), &device)
        .unwrap()
        .draft
        .load_file(ckpt.join("model"), &recorder, &device)
        .unwrap();
    let r = &rows[0];
    let n = r.input_ids.len();
    let run = |d: &Eagle3Draft<B>| -> Vec<f32> {
        let aux =
            Tensor::<B, 3>::from_data(TensorData::new(r.aux_hidden.clone(), [1, n, 96]), &device);
        d.forward_ttt(aux, &r.input_ids, &[n], 3)
            .unwrap()
            .into_iter()
            .flat_map(|o| o.logits.into_data().to_vec::<f32>().unwrap())
            .collect()
    };
    assert_eq!(
        run(&exported),
        run(&trained),
        "export reloads to identical outputs"
    );
    assert_eq!(exported.vocab, trained.vocab);
    std::fs::remove_dir_all(&out).unwrap();
    std::fs::remove_dir_all(&model).unwrap();
}

/// Stopping after 5 steps and resuming gives exactly the run that never stopped: same
/// parameters, same losses (optimizer moments, data position and schedule restored).
#[test]
fn resume_continues_exactly() {
    let model = tiny_target("resume-model");
    let rows = records(&model, 18, 2);
    let run = |out: &Path, max_steps: Option<usize>, resume: bool| {
        let data = Dataset::new(vec![source(&model, rows.clone(), "memory")]).unwrap();
        let mut o = options(&model, out);
        o.ttt_steps = 2;
        o.epochs = 2;
        o.save_every = 3;
        o.max_steps = max_steps;
        o.resume = resume;
        train_on::<AB>(&o, data, &Default::default()).unwrap()
    };
    let straight = temp_dir("resume-straight");
    let full = run(&straight, None, false);
    let split = temp_dir("resume-split");
    let first = run(&split, Some(5), false);
    assert_eq!(first.steps, 5);
    let second = run(&split, None, true);
    assert_eq!(second.resumed_from, Some(5));
    assert_eq!(second.steps, full.steps);
    let weights = |dir: &Path| std::fs::read(dir.join("model.safetensors")).unwrap();
    assert!(
        weights(&straight) == weights(&split),
        "resumed weights differ"
    );
    let losses = |dir: &Path| -> Vec<(String, usize, f64, Vec<f64>)> {
        read_lines(&dir.join("metrics.jsonl"))
            .unwrap()
            .into_iter()
            .map(|l| (l.kind, l.step, l.loss, l.acc))
            .collect()
    };
    assert_eq!(
        losses(&straight),
        losses(&split),
        "the log reads as one run"
    );
    std::fs::remove_dir_all(&straight).unwrap();
    std::fs::remove_dir_all(&split).unwrap();
    std::fs::remove_dir_all(&model).unwrap();
}

/// `max_seconds` ends the run after the step in which the time ran out, validated, saved and
/// exported like a `max_steps` stop, and the run resumes from there.
#[test]
fn a_time_limit_stops_after_a_step_and_exports() {
    let model = tiny_target("time-model");
    let rows = records(&model, 18, 4);
    let out = temp_dir("time-out");
    let run = |max_seconds: Option<f64>, resume: bool| {
        let data = Dataset::new(vec![source(&model, rows.clone(), "memory")]).unwrap();
        let mut o = options(&model, &out);
        o.ttt_steps = 2;
        o.max_seconds = max_seconds;
        o.resume = resume;
        train_on::<AB>(&o, data, &Default::default())
    };
    let first = run(Some(1e-9), false).unwrap();
    assert_eq!(first.steps, 1, "the limit is checked after each step");
    assert!(first.total_steps > 1);
    assert_eq!(first.last_val.as_ref().map(|l| l.step), Some(1));
    assert!(out.join("config.json").exists() && out.join("model.safetensors").exists());
    let rest = run(Some(3600.0), true).unwrap();
    assert_eq!(rest.resumed_from, Some(1));
    assert_eq!(rest.steps, rest.total_steps);
    let err = run(Some(0.0), false).unwrap_err();
    assert!(err.to_string().contains("max-seconds"), "{err}");
    std::fs::remove_dir_all(&out).unwrap();
    std::fs::remove_dir_all(&model).unwrap();
}

/// A dump from another target, and dumps that disagree with each other, are refused with the
/// wiring check's sentences; so is resuming with other options.
#[test]
fn wiring_mismatches_are_refused_with_sentences() {
    let model = tiny_target("refuse-model");
    let out = temp_dir("refuse-out");
    let rows = records(&model, 4, 3);
    let o = options(&model, &out);

    // Captured from a deeper model.
    let mut other = wiring(&model, &TAPS);
    other.target.num_layers = 8;
    other.target.config_sha256 = "0".repeat(64);
    let data = Dataset::new(vec![Box::new(MemorySource {
        wiring: other,
        hidden_size: 32,
        records: rows.clone(),
        name: "deep".to_owned(),
    }) as Box<dyn SampleSource>])
    .unwrap();
    let err = train_on::<AB>(&o, data, &Default::default()).unwrap_err();
    let text = err.to_string();
    assert!(matches!(err, TrainError::WiringMismatch { .. }), "{text}");
    assert!(text.contains("was not captured from --model"), "{text}");
    assert!(
        text.contains("layer count: trained on a 8-layer target, served a 6-layer target"),
        "{text}"
    );
    assert!(text.contains("config differs"), "{text}");

    // Two dumps one block apart.
    let shifted = [TapId::Block(2), TapId::Block(3), TapId::Block(4)];
    let data = Dataset::new(vec![
        source(&model, rows.clone(), "dump-a"),
        Box::new(MemorySource {
            wiring: wiring(&model, &shifted),
            hidden_size: 32,
            records: rows.clone(),
            name: "dump-b".to_owned(),
        }),
    ])
    .unwrap();
    let text = train_on::<AB>(&o, data, &Default::default())
        .unwrap_err()
        .to_string();
    assert!(
        text.contains("dump dump-b does not agree with dump dump-a"),
        "{text}"
    );
    assert!(
        text.contains("slot 0: trained on block 1, served block 2"),
        "{text}"
    );
    assert!(text.contains("every slot is off by +1 block"), "{text}");

    // Resume without a checkpoint.
    let mut r = o.clone();
    r.resume = true;
    let data = Dataset::new(vec![source(&model, rows, "memory")]).unwrap();
    let text = train_on::<AB>(&r, data, &Default::default())
        .unwrap_err()
        .to_string();
    assert!(text.contains("no checkpoint to resume from"), "{text}");
    std::fs::remove_dir_all(&out).unwrap();
    std::fs::remove_dir_all(&model).unwrap();
}

/// `--init-from` starts from an exported head (its weights and its d2t/t2d), and refuses a head
/// whose manifest names other taps than the dump.
#[test]
fn init_from_starts_from_a_head_and_refuses_other_taps() {
    let model = tiny_target("init-model");
    let rows = records(&model, 16, 4);
    let run = |out: &Path, init: Option<&Path>, epochs: usize| {
        let data = Dataset::new(vec![source(&model, rows.clone(), "memory")]).unwrap();
        let mut o = options(&model, out);
        o.epochs = epochs;
        o.init_from = init.map(Path::to_path_buf);
        train_on::<AB>(&o, data, &Default::default())
    };
    let first = temp_dir("init-first");
    let trained = run(&first, None, 6).unwrap();
    let scratch = temp_dir("init-scratch");
    let fresh = run(&scratch, None, 1).unwrap();
    let second = temp_dir("init-second");
    let continued = run(&second, Some(&first), 1).unwrap();
    let loss = |r: &tandem_train::TrainReport| r.first_train.as_ref().unwrap().loss;
    eprintln!(
        "first-step loss: scratch {:.3}, after 6 epochs {:.3}, init-from {:.3}",
        loss(&fresh),
        trained.last_train.as_ref().unwrap().loss,
        loss(&continued)
    );
    assert!(
        loss(&continued) < 0.8 * loss(&fresh),
        "init-from did not start from the head"
    );
    let vocab = |dir: &Path| {
        let bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        st.tensor("d2t").unwrap().data().to_vec()
    };
    assert_eq!(vocab(&first), vocab(&second), "d2t kept from the head");

    // The same head, its manifest edited to blocks 2, 3, 4 (SGLang ids 2, 3, 4, vLLM ids 3, 4, 5).
    let edited = temp_dir("init-edited");
    std::fs::copy(
        first.join("model.safetensors"),
        edited.join("model.safetensors"),
    )
    .unwrap();
    let mut json: serde_json::Value =
        serde_json::from_slice(&std::fs::read(first.join("config.json")).unwrap()).unwrap();
    json["tandem_wiring"]["taps"] = serde_json::json!(["block:2", "block:3", "block:4"]);
    json["tandem_wiring"]["raw_ids"]["ids"] = serde_json::json!([2, 3, 4]);
    json["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = serde_json::json!([2, 3, 4]);
    json["eagle_aux_hidden_state_layer_ids"] = serde_json::json!([3, 4, 5]);
    std::fs::write(edited.join("config.json"), json.to_string()).unwrap();
    let refused = temp_dir("init-refused");
    let text = run(&refused, Some(&edited), 1).unwrap_err().to_string();
    assert!(
        text.contains("was trained on other wiring than the dump"),
        "{text}"
    );
    assert!(
        text.contains("slot 0: trained on block 2, served block 1"),
        "{text}"
    );
    for dir in [first, scratch, second, edited, refused, model] {
        std::fs::remove_dir_all(dir).unwrap();
    }
}

/// Global-norm clipping scales all gradients together to the bound.
#[test]
fn clipping_bounds_the_global_norm() {
    let model_dir = tiny_target("clip-model");
    let device = Default::default();
    let target = TargetModel::<B>::load(&model_dir, &device).unwrap();
    let config = tandem_eagle::Eagle3Config::for_target(
        &tandem_model::HfConfig::load(&model_dir.join("config.json")).unwrap(),
        96,
        3,
    );
    let draft = Eagle3Draft::<AB>::init(
        config.resolve().unwrap(),
        tandem_eagle::VocabMap::identity(96),
        Tensor::from_inner(target.embed_tokens.clone()),
        3,
        &device,
    )
    .unwrap();
    let aux = Tensor::<AB, 3>::ones([1, 5, 96], &device);
    let outs = draft.forward_ttt(aux, &[1, 2, 3, 4, 5], &[5], 2).unwrap();
    let loss = outs[1].logits.clone().powi_scalar(2).sum();
    let mut grads = GradientsParams::from_grads(loss.backward(), &draft);
    let before = clip_global_norm(&draft, &mut grads, 0.25);
    assert!(before > 0.25, "norm {before}");
    let after = clip_global_norm(&draft, &mut grads, 0.0);
    assert!((after - 0.25).abs() < 1e-4, "clipped norm {after}");
    std::fs::remove_dir_all(&model_dir).unwrap();
}

/// Issue #19, data-parallel training on the GPU trainer: `TANDEM_TEST_GPUS` replicas (one
/// thread per GPU, default 1: NCCL with a single rank, the same code path) against the same run
/// without replicas, same global batch and seed. Every step's loss, gradient norm and step-0
/// accuracy agree (1 replica: to 1e-6 relative, the all-reduce of one rank is the identity;
/// 2+: 2e-2, bf16 matmuls over other row counts), every replica logs the same numbers, and
/// only rank 0 writes the export. Needs NVIDIA GPUs and libnccl:
/// `TANDEM_TEST_GPUS=2 cargo test -p tandem-train --release --test train -- --ignored data_parallel`
#[test]
#[ignore = "needs NVIDIA GPUs and NCCL"]
fn data_parallel_replicas_take_the_single_gpu_steps() {
    let world: usize = std::env::var("TANDEM_TEST_GPUS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1);
    let model = tiny_target("dp-target");
    let recs = records(&model, 24, 5);
    let base = |out: &Path| {
        let mut o = options(&model, out);
        o.device_label = "cuda".to_owned();
        o.max_steps = Some(8);
        o.eval_every = 4;
        o
    };
    let single_out = temp_dir("dp-single");
    let _ = std::fs::remove_dir_all(&single_out);
    tandem_train::train_gpu_on(
        &base(&single_out),
        Dataset::new(vec![source(&model, recs.clone(), "a")]).unwrap(),
    )
    .unwrap();

    let dp_out = temp_dir("dp-replicas");
    let _ = std::fs::remove_dir_all(&dp_out);
    let tag = format!("test-{}", std::process::id());
    std::thread::scope(|scope| {
        let handles: Vec<_> = (0..world)
            .map(|rank| {
                let mut o = base(&dp_out);
                o.data_parallel = Some(tandem_train::replicas::DataParallel {
                    rank,
                    world_size: world,
                    device: rank,
                    rendezvous: dp_out.join("nccl-id"),
                    run_tag: tag.clone(),
                });
                let (model, recs) = (&model, recs.clone());
                scope.spawn(move || {
                    tandem_train::train_gpu_on(
                        &o,
                        Dataset::new(vec![source(model, recs, "a")]).unwrap(),
                    )
                })
            })
            .collect();
        for h in handles {
            h.join().unwrap().unwrap();
        }
    });

    let tol = if world == 1 { 1e-6 } else { 2e-2 };
    let close = |a: f64, b: f64| (a - b).abs() <= tol * b.abs().max(1e-3);
    let single = read_lines(&single_out.join("metrics.jsonl")).unwrap();
    for rank in 0..world {
        let log = if rank == 0 {
            dp_out.join("metrics.jsonl")
        } else {
            dp_out.join(format!("rank-{rank}")).join("metrics.jsonl")
        };
        let lines = read_lines(&log).unwrap();
        assert_eq!(lines.len(), single.len(), "rank {rank}: metrics lines");
        for (a, b) in lines.iter().zip(&single) {
            assert_eq!((a.kind.as_str(), a.step), (b.kind.as_str(), b.step));
            assert_eq!(a.tokens, b.tokens, "rank {rank} step {}: tokens", a.step);
            assert!(
                close(a.loss, b.loss),
                "rank {rank} {} step {}: loss {} vs {}",
                a.kind,
                a.step,
                a.loss,
                b.loss
            );
            if let (Some(x), Some(y)) = (a.grad_norm, b.grad_norm) {
                assert!(
                    close(x, y),
                    "rank {rank} step {}: grad norm {x} vs {y}",
                    a.step
                );
            }
            assert!(
                (a.acc[0] - b.acc[0]).abs() <= if world == 1 { 1e-9 } else { 0.05 },
                "rank {rank} step {}: acc0 {} vs {}",
                a.step,
                a.acc[0],
                b.acc[0]
            );
        }
    }
    assert!(dp_out.join("model.safetensors").is_file());
    assert!(!dp_out.join("rank-1").join("model.safetensors").exists());
}
