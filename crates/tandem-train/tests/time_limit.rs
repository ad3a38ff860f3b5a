//! `tandem train --max-seconds` on the CPU: the cosine schedule is fitted to the limit, so the
//! learning rate ends on (or near) its floor instead of mid-decay. A test binary of its own:
//! the fit times real steps, and cargo runs test binaries one at a time, so no sibling test
//! competes for the cores while they are timed.

use std::path::{Path, PathBuf};

use burn::backend::{Autodiff, NdArray};
use rand::{Rng, SeedableRng};
use tandem_dump::DumpRecord;
use tandem_model::testing::{scratch_dir, tiny_config, write_random_model};
use tandem_train::data::{Dataset, MemorySource};
use tandem_train::metrics::read_lines;
use tandem_train::schedule::{lr_at, warmup_steps};
use tandem_train::target::fingerprint;
use tandem_train::{TrainOptions, TrainState, train_on};
use tandem_wiring::{Job, Producer, TapId, TapPoint, WiringManifest};

type AB = Autodiff<NdArray<f32>>;

const HIDDEN: usize = 32;
const TAPS: [TapId; 3] = [TapId::Block(1), TapId::Block(2), TapId::Block(3)];

/// A tiny random target (hidden 32, vocab 96) with a placeholder tokenizer for its fingerprint.
fn tiny_target(dir: &Path) {
    let mut config = tiny_config("LlamaForCausalLM", 6);
    config.model_type = Some("llama".to_owned());
    write_random_model(dir, &config, 17).unwrap();
    std::fs::write(dir.join("tokenizer.json"), "{\"model\": \"tiny\"}").unwrap();
}

/// Random rows of 32 tokens (the last 28 trained on): the fit needs steps, not a model that
/// learns.
fn rows(count: usize) -> Vec<DumpRecord> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(3);
    (0..count)
        .map(|i| {
            let len = 32;
            let mut values =
                |n: usize| -> Vec<f32> { (0..n).map(|_| rng.random_range(-1.0..1.0f32)).collect() };
            let aux_hidden = values(len * TAPS.len() * HIDDEN);
            let last_hidden = values(len * HIDDEN);
            DumpRecord {
                sample_id: format!("row-{i}"),
                input_ids: (0..len).map(|k| ((i * 7 + k * 13) % 96) as u32).collect(),
                loss_mask: (0..len).map(|k| u8::from(k >= 4)).collect(),
                aux_hidden,
                last_hidden,
            }
        })
        .collect()
}

/// With `--max-seconds` and far more epochs than fit, the checkpoint records a horizon short of
/// the epochs, the logged rates follow the cosine over that horizon, and the last one is on
/// the floor (or near it, if the machine slowed down after the timed steps), where the epoch
/// schedule would still be near the peak.
#[test]
fn a_time_limit_fits_the_schedule_so_the_lr_ends_near_its_floor() {
    let model = scratch_dir("time-limit-model");
    tiny_target(&model);
    let out: PathBuf = scratch_dir("time-limit-out");
    let wiring = WiringManifest::new(
        fingerprint(&model, false).unwrap(),
        TAPS.to_vec(),
        TapPoint::ResidualStream,
        "f32",
        Producer::tandem(Job::Dump, "cpu", "prefill"),
    );
    let data = Dataset::new(vec![Box::new(MemorySource {
        wiring,
        hidden_size: HIDDEN,
        records: rows(16),
        name: "memory".to_owned(),
    })])
    .unwrap();
    let mut o = TrainOptions::new(vec![PathBuf::from("memory")], &model, &out);
    o.draft_vocab = Some(48);
    o.ttt_steps = 2;
    o.batch_size = 2;
    o.lr = 3e-3;
    o.min_lr_ratio = 0.1;
    o.val_fraction = 0.0;
    o.save_every = 0;
    o.epochs = 1000;
    o.warmup_ratio = 0.002;
    o.max_seconds = Some(4.0);
    let report = train_on::<AB>(&o, data, &Default::default()).unwrap();

    let epoch_total = report.train_rows.div_ceil(o.batch_size) * o.epochs;
    let latest = std::fs::read_to_string(out.join("checkpoints/latest")).unwrap();
    let state_path = out
        .join("checkpoints")
        .join(latest.trim())
        .join("state.json");
    let state: TrainState =
        serde_json::from_str(&std::fs::read_to_string(state_path).unwrap()).unwrap();
    let horizon = state.fitted_horizon.expect("a horizon was fitted");
    assert_eq!(state.total_steps, epoch_total);
    assert_eq!(report.total_steps, horizon.total_steps);
    assert!(horizon.total_steps < epoch_total, "{horizon:?}");
    assert!(report.steps <= horizon.total_steps);

    let lines = read_lines(&out.join("metrics.jsonl")).unwrap();
    let last = lines.iter().rev().find(|l| l.kind == "train").unwrap();
    let last_lr = last.lr.unwrap();
    let (peak, floor) = (o.lr, o.lr * o.min_lr_ratio);
    let warmup = warmup_steps(epoch_total, o.warmup_ratio);
    let lr = |step, total| lr_at(step, total, warmup, peak, o.min_lr_ratio);
    // A line's `step` counts the steps done, so its rate is that of step `step - 1`.
    assert_eq!(last_lr, lr(last.step - 1, horizon.total_steps));
    if report.steps == horizon.total_steps {
        assert!((last_lr - floor).abs() < 1e-12, "{last_lr}");
    }
    assert!(
        last_lr <= floor + 0.25 * (peak - floor),
        "{last_lr} after {} steps ({horizon:?})",
        report.steps
    );
    assert!(lr(last.step - 1, epoch_total) > 0.9 * peak);
    std::fs::remove_dir_all(&out).unwrap();
    std::fs::remove_dir_all(&model).unwrap();
}
