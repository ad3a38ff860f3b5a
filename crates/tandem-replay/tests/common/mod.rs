//! Shared fixtures of the fault suite: a tiny random target (8 blocks, hidden 32) with SmolLM2's
//! tokenizer files (for a real fingerprint), and dumps written through `tandem_dump::DumpWriter`
//! whose data the tests produce themselves, faulty on purpose.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use burn::backend::Autodiff;
use burn::module::AutodiffModule;
use burn::optim::{AdamConfig, GradientsParams, Optimizer};
use burn::prelude::*;
use burn::tensor::activation::log_softmax;
use rand::{Rng, SeedableRng};
use tandem_dump::{
    DumpManifest, DumpReader, DumpRecord, DumpSettings, DumpWriter, ShardLimits, StorageDtype,
};
use tandem_eagle::{Eagle3Config, Eagle3Draft, VocabMap};
use tandem_model::testing::{tiny_config, write_random_model};
use tandem_model::{LogitsFor, TapRequest, TargetModel};
use tandem_replay::candidate::capture_candidates;
use tandem_replay::diagnose::assemble_aux;
use tandem_replay::{Candidate, DiagnoseSample};
use tandem_replay::{HeadWiring, ReplayOptions, ReplayReport, fingerprint_model, replay};
use tandem_wiring::{Job, Producer, RawIds, TapId, TapPoint, TargetFingerprint, WiringManifest};

/// burn-ndarray, not the jobs' `CpuBackend` (burn-flex): the fault suite trains its tiny heads
/// here, and whether a neighbouring wiring ties with the trained one on those heads depends on
/// the training trajectory, which a change of backend moves (on burn-flex the head trained on
/// [1, 3, 4] also fits [2, 3, 4] perfectly, and diagnose rightly calls that inconclusive). The
/// two backends' gradients agree to 1e-6 (`tandem-train`'s `cpu_backends` test).
pub type B = burn::backend::NdArray<f32>;
type AB = Autodiff<B>;

/// Blocks of the tiny target; its default aux taps are blocks [1, 3, 4], its last block 7.
pub const LAYERS: usize = 8;
/// Hidden size of the tiny target.
pub const HIDDEN: usize = 32;
/// Vocabulary of the tiny target (the test heads' draft vocabulary is all of it).
pub const VOCAB: usize = 96;

#[allow(unused_imports)] // each test binary uses its own subset
pub use tandem_model::testing::{smollm2_dir, workspace_root};

/// A fresh, empty directory for one test.
pub fn temp_dir(name: &str) -> PathBuf {
    tandem_model::testing::scratch_dir(&format!("replay-test-{name}"))
}

/// The tiny target's directory (written once per test binary).
pub fn tiny_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = temp_dir("tiny-model");
        let mut config = tiny_config("LlamaForCausalLM", LAYERS);
        config.model_type = Some("llama".to_owned());
        write_random_model(&dir, &config, 11).unwrap();
        for file in ["tokenizer.json", "tokenizer_config.json"] {
            std::fs::copy(smollm2_dir().join(file), dir.join(file)).unwrap();
        }
        dir
    })
}

pub fn tiny_model() -> TargetModel<B> {
    TargetModel::load(tiny_dir(), &Default::default()).unwrap()
}

pub fn tiny_fingerprint() -> TargetFingerprint {
    fingerprint_model(tiny_dir()).unwrap()
}

pub fn blocks(ks: &[usize]) -> Vec<TapId> {
    ks.iter().map(|&k| TapId::Block(k)).collect()
}

/// Three samples of seeded random ids (lengths 20, 33, 12).
pub fn sample_ids() -> Vec<Vec<u32>> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(5);
    [20usize, 33, 12]
        .iter()
        .map(|&n| (0..n).map(|_| rng.random_range(0..96u32)).collect())
        .collect()
}

/// The values of `taps` for one prefill of `ids`, each `[n, T]`, through the capture hook: what
/// an engine that taps these points records.
pub fn tap_values(model: &TargetModel<B>, ids: &[u32], taps: &[TapId]) -> Vec<Vec<f32>> {
    let mut cache = model.new_cache(1, ids.len());
    let step = cache.prefill_step(&[ids]).unwrap();
    let out = model
        .forward(
            &step,
            &mut cache,
            &TapRequest::new(taps.to_vec()),
            LogitsFor::None,
        )
        .unwrap();
    out.taps
        .tensors
        .into_iter()
        .map(|t| t.into_data().to_vec::<f32>().unwrap())
        .collect()
}

/// A dump manifest as `tandem dump` writes it, with `taps` in the manifest and slots of
/// `slot_width` values (the fingerprint's hidden size is set to it, as a dump taken on one
/// tensor-parallel rank would record).
pub fn identity(
    target: &TargetFingerprint,
    taps: &[TapId],
    raw: Option<RawIds>,
    slot_width: usize,
) -> DumpManifest {
    let mut target = target.clone();
    target.hidden_size = slot_width;
    let mut wiring = WiringManifest::new(
        target.clone(),
        taps.to_vec(),
        TapPoint::ResidualStream,
        "bf16",
        Producer::tandem(Job::Dump, "cpu", "prefill"),
    );
    if let Some(raw) = raw {
        wiring = wiring.with_raw_ids(raw);
    }
    DumpManifest::new(
        wiring,
        StorageDtype::Bf16,
        "fault-suite",
        DumpSettings {
            max_len: 64,
            regenerate: None,
        },
    )
}

/// Writes a dump of [`sample_ids`] under `identity`; `slots(model, ids)` produces each slot's
/// `[n, w]` values (the fault under test). `last_hidden` is the true block L-1.
pub fn write_dump(
    name: &str,
    identity: &DumpManifest,
    slots: impl Fn(&TargetModel<B>, &[u32]) -> Vec<Vec<f32>>,
) -> PathBuf {
    let model = tiny_model();
    let dir = temp_dir(name);
    let mut writer = DumpWriter::open(&dir, identity, ShardLimits::default()).unwrap();
    for (i, ids) in sample_ids().iter().enumerate() {
        let n = ids.len();
        let values = slots(&model, ids);
        let w = identity.hidden_size;
        assert_eq!(values.len(), identity.num_slots);
        let mut aux = Vec::with_capacity(n * w * values.len());
        for t in 0..n {
            for v in &values {
                aux.extend_from_slice(&v[t * w..(t + 1) * w]);
            }
        }
        let last = tap_values(&model, ids, &[TapId::Block(LAYERS - 1)]).remove(0);
        let last = if w == HIDDEN { last } else { vec![0.0; n * w] };
        let record = DumpRecord {
            sample_id: format!("s{i}"),
            input_ids: ids.clone(),
            loss_mask: vec![1; n],
            aux_hidden: aux,
            last_hidden: last,
        };
        writer.write(&record, false).unwrap();
    }
    writer.finish(true).unwrap();
    dir
}

/// A dump whose data holds the true values of `data_taps` under a manifest naming
/// `manifest_taps`.
pub fn tap_dump(
    name: &str,
    manifest_taps: &[TapId],
    raw: Option<RawIds>,
    data_taps: &[TapId],
) -> PathBuf {
    let id = identity(&tiny_fingerprint(), manifest_taps, raw, HIDDEN);
    let data_taps = data_taps.to_vec();
    write_dump(name, &id, move |model, ids| {
        tap_values(model, ids, &data_taps)
    })
}

/// Replays `dir` through the tiny target (its own fingerprint) and prints the table.
pub fn run_replay(dir: &Path, head: Option<&HeadWiring>) -> ReplayReport {
    run_replay_with(dir, head, &tiny_fingerprint())
}

pub fn run_replay_with(
    dir: &Path,
    head: Option<&HeadWiring>,
    target: &TargetFingerprint,
) -> ReplayReport {
    let model = tiny_model();
    let dump = DumpReader::open(dir).unwrap();
    let options = ReplayOptions {
        model_label: "tiny".to_owned(),
        ..ReplayOptions::default()
    };
    let report = replay(&model, target, &dump, head, &options).unwrap();
    eprintln!("{}", report.to_table());
    report
}

/// All findings and verdicts as one string, for `contains` assertions.
pub fn all_text(report: &ReplayReport) -> String {
    let mut parts: Vec<String> = report.slots.iter().map(|s| s.verdict.clone()).collect();
    parts.extend(report.findings.iter().map(|f| f.message.clone()));
    parts.join("\n")
}

/// Trains a head on `samples` fed the taps of `trained` (`iterations` Adam steps, burn autodiff):
/// cross-entropy against the target's argmax for each of `steps` TTT steps (weights 0.8^i),
/// every position of every sample.
pub fn train_head(
    model: &TargetModel<B>,
    samples: &[DiagnoseSample],
    trained: &[Candidate],
    steps: usize,
    iterations: usize,
    seed: u64,
) -> Eagle3Draft<B> {
    let device = Default::default();
    let width = samples.iter().map(|s| s.input_ids.len()).max().unwrap();
    let batch = samples.len();
    let slots = trained.len();
    let mut aux = vec![0f32; batch * width * slots * HIDDEN];
    let mut ids = vec![0u32; batch * width];
    let mut lengths = Vec::new();
    let mut targets = vec![vec![0f32; batch * width * VOCAB]; steps];
    let mut counts = vec![0usize; steps];
    for (b, s) in samples.iter().enumerate() {
        let n = s.input_ids.len();
        lengths.push(n);
        ids[b * width..b * width + n].copy_from_slice(&s.input_ids);
        let values = capture_candidates(model, &s.input_ids).unwrap();
        let row = assemble_aux(&values, trained).unwrap();
        let w = slots * HIDDEN;
        aux[b * width * w..(b * width + n) * w].copy_from_slice(&row);
        let last = values
            .get(Candidate::Tap(TapId::Block(LAYERS - 1)))
            .unwrap()
            .to_vec();
        let argmax: Vec<i64> = model
            .logits_from_last_block(Tensor::from_data(
                TensorData::new(last, [1, n, HIDDEN]),
                &device,
            ))
            .argmax(2)
            .into_data()
            .convert::<i64>()
            .to_vec()
            .unwrap();
        for (i, target) in targets.iter_mut().enumerate() {
            for t in 0..n {
                if t + 1 + i < n {
                    target[(b * width + t) * VOCAB + argmax[t + 1 + i] as usize] = 1.0;
                    counts[i] += 1;
                }
            }
        }
    }
    let aux = Tensor::<AB, 3>::from_data(
        TensorData::new(aux, [batch, width, slots * HIDDEN]),
        &device,
    );
    let targets: Vec<Tensor<AB, 3>> = targets
        .into_iter()
        .map(|t| Tensor::from_data(TensorData::new(t, [batch, width, VOCAB]), &device))
        .collect();
    let config = Eagle3Config::for_target(&tiny_config("LlamaForCausalLM", LAYERS), VOCAB, 3);
    let embed = Tensor::<AB, 2>::from_inner(model.embed_tokens.clone());
    let mut draft = Eagle3Draft::<AB>::init(
        config.resolve().unwrap(),
        VocabMap::identity(VOCAB),
        embed,
        seed,
        &device,
    )
    .unwrap();
    let mut optim = AdamConfig::new().init::<AB, Eagle3Draft<AB>>();
    for _ in 0..iterations {
        let outputs = draft
            .forward_ttt(aux.clone(), &ids, &lengths, steps)
            .unwrap();
        let mut loss: Option<Tensor<AB, 1>> = None;
        for (i, out) in outputs.into_iter().enumerate() {
            let ce = (log_softmax(out.logits, 2) * targets[i].clone())
                .sum()
                .neg()
                .div_scalar(counts[i] as f64)
                .mul_scalar(0.8f64.powi(i as i32));
            loss = Some(match loss {
                Some(l) => l + ce,
                None => ce,
            });
        }
        let grads = GradientsParams::from_grads(loss.unwrap().backward(), &draft);
        draft = optim.step(3e-3, draft, grads);
    }
    draft.valid()
}

/// A dump of `samples` (ids and loss mask as given) whose slots hold the true values of
/// `taps`, written as `tandem dump --regenerate` would when the samples are the target's own
/// greedy continuations (`generated` says how many tokens it was asked for).
pub fn samples_dump(
    name: &str,
    model: &TargetModel<B>,
    samples: &[DiagnoseSample],
    taps: &[TapId],
    generated: usize,
) -> PathBuf {
    let mut id = identity(&tiny_fingerprint(), taps, None, HIDDEN);
    id.settings.max_len = samples.iter().map(|s| s.input_ids.len()).max().unwrap_or(0);
    id.settings.regenerate = Some(tandem_dump::GenerationSettings {
        max_new_tokens: generated,
        temperature: 0.0,
        top_p: 1.0,
        top_k: 0,
        seed: 0,
    });
    let dir = temp_dir(name);
    let mut writer = DumpWriter::open(&dir, &id, ShardLimits::default()).unwrap();
    for (i, s) in samples.iter().enumerate() {
        let n = s.input_ids.len();
        let values = tap_values(model, &s.input_ids, taps);
        let mut aux = Vec::with_capacity(n * HIDDEN * taps.len());
        for t in 0..n {
            for v in &values {
                aux.extend_from_slice(&v[t * HIDDEN..(t + 1) * HIDDEN]);
            }
        }
        let record = DumpRecord {
            sample_id: format!("regen{i}"),
            input_ids: s.input_ids.clone(),
            loss_mask: s.loss_mask.clone(),
            aux_hidden: aux,
            last_hidden: tap_values(model, &s.input_ids, &[TapId::Block(LAYERS - 1)]).remove(0),
        };
        writer.write(&record, false).unwrap();
    }
    writer.finish(true).unwrap();
    dir
}
