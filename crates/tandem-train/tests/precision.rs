//! The objective's precision when the backend's float type is not f32 (bf16 on CUDA): the
//! target softmax over the draft vocabulary, the draft log-softmax and the loss are computed
//! in f32, and gradients flow back to the draft logits in their own dtype.
//!
//! No bf16 backend runs on the CPU here (ndarray holds f32 and f64 only), so this binary makes
//! f64 the ndarray device's default float type: every tensor the trainer creates is then f64,
//! as every tensor is bf16 on CUDA, and only the explicit casts produce f32. The defaults are
//! per device and per process, which is why these tests live in their own test binary.

use std::path::PathBuf;
use std::sync::Once;

use burn::backend::{Autodiff, NdArray};
use burn::prelude::*;
use burn::tensor::{DType, FloatDType, IntDType, TensorData, set_default_dtypes};
use rand::{Rng, SeedableRng};
use tandem_dump::DumpRecord;
use tandem_eagle::{DraftOutput, build_vocab_map};
use tandem_model::testing::{scratch_dir, tiny_config, write_random_model};
use tandem_train::data::{Batch, Dataset, MemorySource};
use tandem_train::objective::{
    BatchTargets, draft_id_tensor, objective, position_mask, step_weight,
};
use tandem_train::target::{TargetHead, fingerprint};
use tandem_train::{TrainOptions, train_on};
use tandem_wiring::{Job, Producer, TapId, TapPoint, WiringManifest};

type B = NdArray<f32>;
type AB = Autodiff<B>;

/// f64 as the CPU device's default float type, before any tensor exists in this process.
fn f64_device() -> burn::backend::ndarray::NdArrayDevice {
    static INIT: Once = Once::new();
    let device = Default::default();
    INIT.call_once(|| {
        set_default_dtypes::<B>(&device, FloatDType::F64, IntDType::I64)
            .expect("no tensor was created on the device before");
    });
    device
}

/// A tiny random target (hidden 32, vocab 96, 6 blocks), lm_head tied to the embedding.
fn tiny_target(name: &str) -> PathBuf {
    let dir = scratch_dir(&format!("precision-{name}"));
    let mut config = tiny_config("LlamaForCausalLM", 6);
    config.model_type = Some("llama".to_owned());
    config.tie_word_embeddings = true;
    write_random_model(&dir, &config, 5).unwrap();
    std::fs::write(dir.join("tokenizer.json"), "{\"model\": \"tiny\"}").unwrap();
    dir
}

fn values(t: Tensor<B, 3>) -> Vec<f64> {
    t.into_data().convert::<f64>().to_vec::<f64>().unwrap()
}

#[test]
fn target_softmax_and_loss_are_f32_when_the_backend_float_is_not() {
    let device = f64_device();
    let dir = tiny_target("objective");
    let head = TargetHead::<B>::load(&dir, &device).unwrap();
    assert_eq!(
        head.lm_head_t.dtype(),
        DType::F64,
        "the backend float is f64 here"
    );

    // Two sequences (lengths 6 and 4, width 6) with random last-block residuals.
    let (b, w, t, n) = (2usize, 6usize, 32usize, 48usize);
    let mut rng = rand::rngs::StdRng::seed_from_u64(3);
    let lengths = vec![6, 4];
    let batch = Batch {
        rows: vec![0, 1],
        lengths: lengths.clone(),
        width: w,
        input_ids: (0..b * w).map(|_| rng.random_range(0..96u32)).collect(),
        loss_mask: vec![0, 1, 1, 1, 1, 1, 0, 1, 1, 1, 0, 0],
        aux: Vec::new(),
        last_hidden: (0..b * w * t)
            .map(|_| rng.random::<f32>() * 4.0 - 2.0)
            .collect(),
    };
    let counts: Vec<u64> = (0..96).map(|_| rng.random_range(0..100)).collect();
    let vocab = build_vocab_map(&counts, n, 96).unwrap();
    let draft_ids = draft_id_tensor::<B>(&vocab, &device);
    let targets = BatchTargets::<B>::compute(&head, &batch, &draft_ids);
    assert_eq!(targets.probs.dtype(), DType::F32, "target softmax in f32");
    assert_eq!(targets.shifted(1).dtype(), DType::F32, "padding rows too");

    // Reference in f64 from the backend's own (f64) target logits.
    let last = Tensor::<B, 3>::from_data(
        TensorData::new(batch.last_hidden.clone(), [b, w, t]),
        &device,
    );
    let logits = values(head.logits(last));
    let ids = vocab.target_ids();
    let mut want = vec![0f64; b * w * n];
    let mut argmax = Vec::with_capacity(b * w);
    for row in 0..b * w {
        let full = &logits[row * 96..(row + 1) * 96];
        let best = (0..96)
            .max_by(|&x, &y| full[x].total_cmp(&full[y]))
            .unwrap();
        argmax.push(best as u32);
        let max = ids
            .iter()
            .map(|&i| full[i as usize])
            .fold(f64::MIN, f64::max);
        let z: f64 = ids.iter().map(|&i| (full[i as usize] - max).exp()).sum();
        for (k, &i) in ids.iter().enumerate() {
            want[row * n + k] = (full[i as usize] - max).exp() / z;
        }
    }
    assert_eq!(targets.argmax, argmax);
    let got = values(targets.probs.clone());
    let worst = got
        .iter()
        .zip(&want)
        .map(|(g, w)| (g - w).abs())
        .fold(0.0, f64::max);
    assert!(worst < 1e-6, "f32 softmax vs f64 reference: {worst}");

    // The objective on an autodiff backend: f32 loss, gradients in the logits' dtype (f64).
    let steps = 2;
    let draft_logits: Vec<Vec<f64>> = (0..steps)
        .map(|_| {
            (0..b * w * n)
                .map(|_| rng.random::<f64>() * 6.0 - 3.0)
                .collect()
        })
        .collect();
    let leaves: Vec<Tensor<AB, 3>> = draft_logits
        .iter()
        .map(|v| {
            Tensor::<AB, 3>::from_data(TensorData::new(v.clone(), [b, w, n]), &device)
                .require_grad()
        })
        .collect();
    let outputs: Vec<DraftOutput<AB>> = leaves
        .iter()
        .map(|l| DraftOutput {
            hidden: Tensor::zeros([b, w, t], &device),
            logits: l.clone(),
        })
        .collect();
    let ad_targets = BatchTargets::<AB> {
        probs: Tensor::from_inner(targets.probs.clone()),
        argmax: targets.argmax.clone(),
    };
    let (loss, stats) = objective(&outputs, &ad_targets, &batch, &vocab);
    assert_eq!(loss.dtype(), DType::F32, "the loss is reduced in f32");

    // The same loss in f64 by hand (see the objective module's docs).
    let mut total = 0f64;
    for (i, q) in draft_logits.iter().enumerate() {
        let (mask, _) = position_mask(&batch.loss_mask, &lengths, w, &argmax, &vocab, i);
        let mut sum = 0f64;
        for row in 0..b * w {
            if !mask[row] {
                continue;
            }
            let (s, pos) = (row / w, row % w);
            let q = &q[row * n..(row + 1) * n];
            let max = q.iter().copied().fold(f64::MIN, f64::max);
            let log_z = q.iter().map(|v| (v - max).exp()).sum::<f64>().ln() + max;
            let src = pos + 1 + i;
            for k in 0..n {
                let p = if src < w {
                    want[(s * w + src) * n + k]
                } else {
                    1.0 / n as f64
                };
                sum += p * (q[k] - log_z);
            }
        }
        let loss_i = -sum / (b * w) as f64;
        assert!(
            (stats[i].loss - loss_i).abs() <= 1e-5 * loss_i.abs().max(1.0),
            "step {i}: {} vs f64 {loss_i}",
            stats[i].loss
        );
        total += step_weight(i) * loss_i;
    }
    let value = loss
        .clone()
        .into_data()
        .convert::<f64>()
        .to_vec::<f64>()
        .unwrap()[0];
    assert!(
        (value - total).abs() <= 1e-5 * total.abs(),
        "{value} vs {total}"
    );
    let grads = loss.backward();
    for leaf in &leaves {
        let g = leaf.grad(&grads).expect("the draft logits get a gradient");
        assert_eq!(
            g.dtype(),
            DType::F64,
            "gradient cast back to the logits' dtype"
        );
        let g = values(g);
        assert!(g.iter().all(|v| v.is_finite()) && g.iter().any(|v| *v != 0.0));
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The whole loop (AdamW, clipping, validation, checkpoint, export) runs when the backend's
/// float type is not f32 and the objective mixes in f32.
#[test]
fn training_runs_with_a_non_f32_backend_float() {
    let device = f64_device();
    let dir = tiny_target("train");
    let out = scratch_dir("precision-train-out");
    let taps = vec![TapId::Block(1), TapId::Block(2), TapId::Block(3)];
    let mut rng = rand::rngs::StdRng::seed_from_u64(9);
    let records: Vec<DumpRecord> = (0..12)
        .map(|i| {
            let len = 10 + i % 5;
            DumpRecord {
                sample_id: format!("r{i}"),
                input_ids: (0..len).map(|_| rng.random_range(0..96u32)).collect(),
                loss_mask: (0..len).map(|k| u8::from(k >= 3)).collect(),
                aux_hidden: (0..len * 3 * 32)
                    .map(|_| rng.random::<f32>() - 0.5)
                    .collect(),
                last_hidden: (0..len * 32)
                    .map(|_| rng.random::<f32>() * 2.0 - 1.0)
                    .collect(),
            }
        })
        .collect();
    let wiring = WiringManifest::new(
        fingerprint(&dir, false).unwrap(),
        taps,
        TapPoint::ResidualStream,
        "f32",
        Producer::tandem(Job::Dump, "cpu", "prefill"),
    );
    let data = Dataset::new(vec![Box::new(MemorySource {
        wiring,
        hidden_size: 32,
        records,
        name: "memory".to_owned(),
    })])
    .unwrap();
    let mut o = TrainOptions::new(vec![PathBuf::from("memory")], &dir, &out);
    o.draft_vocab = Some(48);
    o.ttt_steps = 2;
    o.batch_size = 4;
    o.lr = 1e-3;
    o.val_fraction = 0.2;
    o.max_steps = Some(3);
    o.save_every = 0;
    let report = train_on::<AB>(&o, data, &device).unwrap();
    assert_eq!(report.steps, 3);
    let last = report.last_train.unwrap();
    assert!(last.loss.is_finite() && last.loss > 0.0, "{}", last.loss);
    assert!(out.join("config.json").exists() && out.join("model.safetensors").exists());
    std::fs::remove_dir_all(&out).unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
}
