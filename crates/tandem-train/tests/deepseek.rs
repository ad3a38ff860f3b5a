//! `tandem train` on a DeepSeek-V3 target: the committed tiny HF fixture (multi-head latent
//! attention with q LoRA, 2 dense + 2 MoE layers, hidden 32, vocab 64). Hidden states of a
//! handful of sequences are captured through the capture hook twice, on the plain path and
//! micro-batched (two lanes, the two-batch-overlap path), written as two dumps with
//! `tandem_dump::DumpWriter`, and a head is trained on both: the loss falls and acc_0 rises,
//! the export reloads to identical outputs and its manifest names the DeepSeek target. The
//! other fixture (yarn RoPE scaling, as the real models ship) trains a head with plain RoPE.

use std::path::{Path, PathBuf};
use std::time::Instant;

use burn::backend::{Autodiff, NdArray};
use burn::module::Module;
use burn::prelude::*;
use burn::record::{FullPrecisionSettings, NamedMpkFileRecorder};
use burn::tensor::TensorData;
use rand::{Rng, SeedableRng};
use tandem_dump::{
    DumpManifest, DumpReader, DumpRecord, DumpSettings, DumpWriter, ShardLimits, StorageDtype,
};
use tandem_eagle::{Eagle3Draft, VocabMap, load_pretrained};
use tandem_model::{
    Execution, GenerateOptions, LogitsFor, SamplingParams, TapRequest, TargetModel,
};
use tandem_train::metrics::read_lines;
use tandem_train::objective::{position_mask, step_weight};
use tandem_train::target::{TargetHead, fingerprint};
use tandem_train::{TrainOptions, train};
use tandem_wiring::{Convention, Job, Producer, TapId, TapPoint, WiringManifest};

type B = NdArray<f32>;
type AB = Autodiff<B>;

/// Aux taps: the EAGLE-3 defaults `[1, L/2-1, L-4]` of the 4-block target, what `tandem dump`
/// taps by default (other choices such as blocks 0..=2 or the last block cannot be written as
/// the SGLang ids of the export's `eagle_aux_hidden_state_layer_ids`).
const TAPS: [TapId; 3] = [TapId::Block(1), TapId::Block(1), TapId::Block(0)];
const HIDDEN: usize = 32;
const VOCAB: u32 = 64;
const SEQUENCES: usize = 12;
const PROMPT: usize = 4;
const REPLY: usize = 20;

fn temp_dir(name: &str) -> PathBuf {
    tandem_model::testing::scratch_dir(&format!("train-deepseek-{name}"))
}

/// A fixture model (`mla_qlora` or `yarn_noqlora`) plus a placeholder tokenizer.json (for its
/// fingerprint; the test works on token ids).
fn deepseek_dir(fixture: &str) -> PathBuf {
    let dir = temp_dir(&format!("{fixture}-model"));
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/deepseek_v3")
        .join(fixture);
    for file in ["config.json", "model.safetensors"] {
        std::fs::copy(fixture.join(file), dir.join(file)).unwrap();
    }
    std::fs::write(
        dir.join("tokenizer.json"),
        "{\"model\": \"deepseek-fixture\"}",
    )
    .unwrap();
    dir
}

/// Seeded sequences: a random prompt (loss mask 0) and a reply sampled from the target itself
/// (loss mask 1).
fn sequences(model: &TargetModel<B>, count: usize) -> Vec<(Vec<u32>, Vec<u8>)> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    (0..count)
        .map(|i| {
            let prompt: Vec<u32> = (0..PROMPT).map(|_| rng.random_range(2..VOCAB)).collect();
            let reply = tandem_model::generate(
                model,
                &prompt,
                &GenerateOptions {
                    max_new_tokens: REPLY,
                    sampling: SamplingParams {
                        temperature: 0.7,
                        top_p: 1.0,
                        top_k: 0,
                    },
                    stop_ids: Vec::new(),
                    seed: 100 + i as u64,
                },
            )
            .unwrap();
            let ids: Vec<u32> = prompt.iter().chain(&reply.tokens).copied().collect();
            // One length for all rows: batches without padding (see `loss_floor`).
            assert_eq!(ids.len(), PROMPT + REPLY);
            let mask = (0..ids.len()).map(|k| u8::from(k >= PROMPT)).collect();
            (ids, mask)
        })
        .collect()
}

/// Per sequence, `[n, 3 * T]` aux values and `[n, T]` last-block values from one prefill of
/// all sequences as one batch, through the capture hook: on the plain path one lane, on
/// the micro-batched path two lanes (split by sequences), each passing the hook with its rows.
fn capture(model: &TargetModel<B>, seqs: &[(Vec<u32>, Vec<u8>)]) -> Vec<(Vec<f32>, Vec<f32>)> {
    let prompts: Vec<&[u32]> = seqs.iter().map(|(ids, _)| ids.as_slice()).collect();
    let width = prompts.iter().map(|p| p.len()).max().unwrap();
    let mut cache = model.new_cache(prompts.len(), width);
    let step = cache.prefill_step(&prompts).unwrap();
    let lanes = model.execution.micro_batches(&step, model.spec.is_moe());
    let expected_lanes = if model.execution == Execution::Plain {
        1
    } else {
        2
    };
    assert_eq!(lanes.len(), expected_lanes, "{:?}", model.execution);
    let mut request = TAPS.to_vec();
    request.push(TapId::Block(model.spec.num_layers - 1));
    let out = model
        .forward(
            &step,
            &mut cache,
            &TapRequest::new(request),
            LogitsFor::None,
        )
        .unwrap();
    // Every tap point is passed once per lane.
    assert_eq!(
        out.taps.visited.len(),
        lanes.len() * (model.spec.num_layers + 2)
    );
    let values: Vec<Vec<f32>> = out
        .taps
        .tensors
        .into_iter()
        .map(|x| x.into_data().to_vec::<f32>().unwrap())
        .collect();
    let t = HIDDEN;
    seqs.iter()
        .enumerate()
        .map(|(b, (ids, _))| {
            let mut aux = Vec::with_capacity(ids.len() * TAPS.len() * t);
            let mut last = Vec::with_capacity(ids.len() * t);
            for i in 0..ids.len() {
                let row = (b * step.width + i) * t..(b * step.width + i + 1) * t;
                for v in &values[..TAPS.len()] {
                    aux.extend_from_slice(&v[row.clone()]);
                }
                last.extend_from_slice(&values[TAPS.len()][row]);
            }
            (aux, last)
        })
        .collect()
}

/// A dump manifest as `tandem dump` writes it (no chat template: the rows are token ids).
fn identity(model_dir: &Path, execution_path: &str) -> DumpManifest {
    let target = fingerprint(model_dir, false).unwrap();
    let wiring = WiringManifest::new(
        target,
        TAPS.to_vec(),
        TapPoint::ResidualStream,
        StorageDtype::Bf16.as_str(),
        Producer::tandem(Job::Dump, "cpu", execution_path),
    );
    DumpManifest {
        chat_template_sha256: None,
        ..DumpManifest::new(
            wiring,
            StorageDtype::Bf16,
            "deepseek-fixture-ids",
            DumpSettings {
                max_len: 256,
                regenerate: None,
            },
        )
    }
}

fn write_dump(
    model_dir: &Path,
    name: &str,
    execution_path: &str,
    seqs: &[(Vec<u32>, Vec<u8>)],
    values: Vec<(Vec<f32>, Vec<f32>)>,
) -> PathBuf {
    let dir = temp_dir(name);
    let id = identity(model_dir, execution_path);
    let mut writer = DumpWriter::open(&dir, &id, ShardLimits::default()).unwrap();
    for (i, ((ids, mask), (aux, last))) in seqs.iter().zip(values).enumerate() {
        let record = DumpRecord {
            sample_id: format!("deepseek-{i}"),
            input_ids: ids.clone(),
            loss_mask: mask.clone(),
            aux_hidden: aux,
            last_hidden: last,
        };
        writer.write(&record, false).unwrap();
    }
    let manifest = writer.finish(true).unwrap();
    assert_eq!(manifest.rows, seqs.len() as u64);
    dir
}

/// max |a - b| / max |a|.
fn rel_err(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    let scale = a.iter().fold(0f32, |m, x| m.max(x.abs()));
    let diff = a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
    diff / scale
}

/// The least loss any head can reach on `rows` (one epoch of `tandem train`'s total loss, all
/// rows of one length): the soft cross-entropy against the target's distribution over the
/// draft vocabulary is at least that distribution's entropy, at every position the objective
/// counts for TTT step `i` (weighted 0.8^i and reduced over batch * width as the objective
/// reduces it). The target of this random fixture is far from peaked, so the floor is high.
fn loss_floor(model_dir: &Path, rows: &[DumpRecord], vocab: &VocabMap, steps: usize) -> f64 {
    let head = TargetHead::<B>::load(model_dir, &Default::default()).unwrap();
    let draft_ids = vocab.target_ids();
    let mut total = 0.0;
    for r in rows {
        let n = r.len();
        let last = Tensor::<B, 3>::from_data(
            TensorData::new(r.last_hidden.clone(), [1, n, HIDDEN]),
            &Default::default(),
        );
        let logits = head.logits(last).into_data().to_vec::<f32>().unwrap();
        let v = VOCAB as usize;
        let mut argmax = Vec::with_capacity(n);
        let mut entropy = Vec::with_capacity(n);
        for row in logits.chunks_exact(v) {
            let best = (0..v).max_by(|&a, &b| row[a].total_cmp(&row[b])).unwrap();
            argmax.push(best as u32);
            let x: Vec<f64> = draft_ids
                .iter()
                .map(|&t| f64::from(row[t as usize]))
                .collect();
            let max = x.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let z: f64 = x.iter().map(|x| (x - max).exp()).sum();
            entropy.push(
                -x.iter()
                    .map(|x| {
                        let logp = x - max - z.ln();
                        logp.exp() * logp
                    })
                    .sum::<f64>(),
            );
        }
        for i in 0..steps {
            let (mask, _) = position_mask(&r.loss_mask, &[n], n, &argmax, vocab, i);
            let sum: f64 = (0..n)
                .filter(|&t| mask[t])
                .map(|t| entropy[t + 1 + i])
                .sum();
            total += step_weight(i) * sum / n as f64;
        }
    }
    total / rows.len() as f64
}

fn mean(values: impl Iterator<Item = f64>) -> f64 {
    let v: Vec<f64> = values.collect();
    v.iter().sum::<f64>() / v.len() as f64
}

#[test]
fn deepseek_target_dumps_train_export_and_reload() {
    let start = Instant::now();
    let model_dir = deepseek_dir("mla_qlora");
    let device = Default::default();
    let mut target = TargetModel::<B>::load(&model_dir, &device).unwrap();
    assert!(target.spec.mla.is_some() && target.spec.is_moe());
    assert_eq!(
        tandem_wiring::default_aux_taps(target.spec.num_layers).unwrap(),
        TAPS
    );
    target.execution = Execution::Plain;
    let seqs = sequences(&target, SEQUENCES);

    // (1) The same sequences captured on the plain path and micro-batched: the same taps.
    let plain = capture(&target, &seqs);
    target.execution = Execution::MicroBatched;
    let micro = capture(&target, &seqs);
    for (b, (p, m)) in plain.iter().zip(&micro).enumerate() {
        let (aux, last) = (rel_err(&p.0, &m.0), rel_err(&p.1, &m.1));
        assert!(aux < 1e-5 && last < 1e-5, "sequence {b}: {aux} {last}");
    }
    let plain_dump = write_dump(&model_dir, "plain-dump", "prefill", &seqs, plain);
    let micro_dump = write_dump(&model_dir, "micro-dump", "micro-batch", &seqs, micro);
    let captured_s = start.elapsed().as_secs_f64();

    // (2) A head trained on both dumps (their wiring agrees; the trainer checks it).
    let out = temp_dir("out");
    let mut o = TrainOptions::new(
        vec![plain_dump.clone(), micro_dump.clone()],
        &model_dir,
        &out,
    );
    o.draft_vocab = Some(48);
    o.ttt_steps = 3;
    o.batch_size = 4;
    o.epochs = 20;
    o.lr = 3e-3;
    o.warmup_ratio = 0.05;
    o.min_lr_ratio = 0.1;
    o.val_fraction = 0.0;
    o.max_grad_norm = 1.0;
    o.save_every = 0;
    let report = train::<AB>(&o, &device).unwrap();
    assert_eq!(report.train_rows, 2 * SEQUENCES);
    let lines = read_lines(&out.join("metrics.jsonl")).unwrap();
    let train: Vec<_> = lines.iter().filter(|l| l.kind == "train").collect();
    assert_eq!(train.len(), report.steps);
    // One epoch is 6 batches: the first and the last epoch.
    let k = 2 * SEQUENCES / o.batch_size;
    let first_loss = mean(train[..k].iter().map(|l| l.loss));
    let last_loss = mean(train[train.len() - k..].iter().map(|l| l.loss));
    let first_acc = mean(train[..k].iter().map(|l| l.acc[0]));
    let last_acc = mean(train[train.len() - k..].iter().map(|l| l.acc[0]));
    let loaded = load_pretrained::<B>(&out, target.embed_tokens.clone(), &device).unwrap();
    let rows: Vec<DumpRecord> = DumpReader::open(&plain_dump)
        .unwrap()
        .iter()
        .map(Result::unwrap)
        .collect();
    let floor = loss_floor(&model_dir, &rows, &loaded.draft.vocab, o.ttt_steps);
    eprintln!(
        "deepseek: {} steps ({} rows), {:.1} steps/s; train loss {first_loss:.3} -> \
         {last_loss:.3} (floor {floor:.3}), acc0 {first_acc:.3} -> {last_acc:.3}; \
         captured in {captured_s:.2} s",
        report.steps, report.train_rows, report.steps_per_s
    );
    assert!(report.steps >= 30, "{} steps", report.steps);
    assert!(
        first_loss > floor && last_loss > floor - 1e-3,
        "the floor {floor} is a lower bound"
    );
    assert!(
        last_loss - floor < 0.5 * (first_loss - floor),
        "loss {first_loss} -> {last_loss} (floor {floor}): the head did not close half the gap"
    );
    assert!(
        last_acc > first_acc + 0.25,
        "acc0 {first_acc} -> {last_acc}"
    );

    // (3) The export reloads to the trained parameters' outputs and names the DeepSeek target.
    let json: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("config.json")).unwrap()).unwrap();
    let wiring = &json["tandem_wiring"];
    assert_eq!(wiring["target"]["architecture"], "DeepseekV3ForCausalLM");
    assert_eq!(wiring["target"]["model_type"], "deepseek_v3");
    assert_eq!(wiring["target"]["num_layers"], 4);
    assert_eq!(
        wiring["taps"],
        serde_json::json!(["block:1", "block:1", "block:0"])
    );
    assert_eq!(wiring["producer"]["job"], "train");
    let sglang = Convention::SglangHeuristic
        .from_canonical(&TAPS, 4)
        .unwrap();
    assert_eq!(
        json["eagle_config"]["eagle_aux_hidden_state_layer_ids"],
        serde_json::json!(sglang)
    );
    assert_eq!(report.trained_on.len(), 2, "{:?}", report.trained_on);
    for (dump, r) in [&plain_dump, &micro_dump].iter().zip(&report.trained_on) {
        let reader = DumpReader::open(dump).unwrap();
        assert_eq!(r.manifest_sha256.as_deref(), Some(reader.manifest_sha256()));
    }

    let manifest = loaded.config.tandem_wiring.as_ref().unwrap();
    assert_eq!(manifest.target, fingerprint(&model_dir, false).unwrap());
    assert_eq!(manifest.target.architecture, "DeepseekV3ForCausalLM");
    let exported = loaded.draft;
    let latest = std::fs::read_to_string(out.join("checkpoints/latest")).unwrap();
    let ckpt = out.join("checkpoints").join(latest.trim());
    let recorder = NamedMpkFileRecorder::<FullPrecisionSettings>::new();
    let trained = load_pretrained::<B>(&ckpt.join("head"), target.embed_tokens.clone(), &device)
        .unwrap()
        .draft
        .load_file(ckpt.join("model"), &recorder, &device)
        .unwrap();
    let r = DumpReader::open(&micro_dump).unwrap().read(0).unwrap();
    let n = r.input_ids.len();
    let run = |d: &Eagle3Draft<B>| -> Vec<f32> {
        let aux = Tensor::<B, 3>::from_data(
            TensorData::new(r.aux_hidden.clone(), [1, n, TAPS.len() * HIDDEN]),
            &device,
        );
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
    eprintln!("deepseek test: {:.2} s", start.elapsed().as_secs_f64());
    for dir in [out, plain_dump, micro_dump, model_dir] {
        std::fs::remove_dir_all(dir).unwrap();
    }
}

/// The other fixture (q_proj, yarn RoPE scaling as DeepSeek-V3 and Kimi-K2 ship): its
/// `rope_scaling` belongs to the rope part of the latent attention, not to the head's Llama
/// layer, so the head is trained and exported with plain RoPE over whole heads
/// (`hidden_size / num_attention_heads`) and reloads; before, the trainer refused the target
/// (a Llama layer has no yarn).
#[test]
fn a_yarn_deepseek_target_trains_a_head_with_plain_rope() {
    let model_dir = deepseek_dir("yarn_noqlora");
    let device = Default::default();
    let mut target = TargetModel::<B>::load(&model_dir, &device).unwrap();
    assert_eq!(
        target
            .spec
            .rope_scaling
            .as_ref()
            .map(|s| s.rope_type.as_str()),
        Some("yarn")
    );
    target.execution = Execution::MicroBatched;
    let seqs = sequences(&target, 4);
    let values = capture(&target, &seqs);
    let dump = write_dump(&model_dir, "yarn-dump", "micro-batch", &seqs, values);
    let out = temp_dir("yarn-out");
    let mut o = TrainOptions::new(vec![dump.clone()], &model_dir, &out);
    o.draft_vocab = Some(48);
    o.ttt_steps = 2;
    o.val_fraction = 0.0;
    o.save_every = 0;
    let report = train::<AB>(&o, &device).unwrap();
    assert_eq!(report.steps, 1);
    let json: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("config.json")).unwrap()).unwrap();
    assert!(json["rope_scaling"].is_null(), "{}", json["rope_scaling"]);
    assert!(json["head_dim"].is_null(), "{}", json["head_dim"]);
    assert_eq!(
        json["tandem_wiring"]["target"]["architecture"],
        "DeepseekV3ForCausalLM"
    );
    let loaded = load_pretrained::<B>(&out, target.embed_tokens.clone(), &device).unwrap();
    let spec = &loaded.draft.spec;
    assert_eq!(
        (spec.num_heads, spec.num_kv_heads, spec.head_dim),
        (4, 4, 8)
    );
    for dir in [out, dump, model_dir] {
        std::fs::remove_dir_all(dir).unwrap();
    }
}
