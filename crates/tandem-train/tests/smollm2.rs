//! The done-when test on the real target: `tandem dump` on SmolLM2-135M-Instruct (default taps
//! blocks 1, 14, 26 through the capture hook), then `tandem train` of a head with hidden 576 on
//! it for 30 steps: the loss falls and acc_0 rises, the export reloads to identical outputs,
//! and the reloaded head served step by step reproduces its own training unroll.

use std::path::PathBuf;

use burn::backend::{Autodiff, NdArray};
use burn::module::Module;
use burn::prelude::*;
use burn::record::{FullPrecisionSettings, NamedMpkFileRecorder};
use burn::tensor::TensorData;
use tandem_dump::{DumpOptions, DumpReader, run_dump};
use tandem_eagle::{Eagle3Draft, load_pretrained, ttt_step_tokens};
use tandem_model::testing::smollm2_dir;
use tandem_train::metrics::read_lines;
use tandem_train::target::TargetHead;
use tandem_train::{TrainOptions, train};

type B = NdArray<f32>;

fn temp_dir(name: &str) -> PathBuf {
    tandem_model::testing::scratch_dir(&format!("train-smol-{name}"))
}

const CONVERSATIONS: [(&str, &str); 10] = [
    (
        "What is the capital of France?",
        "The capital of France is Paris.",
    ),
    (
        "Name three primary colors.",
        "Red, blue and yellow are the three primary colors.",
    ),
    (
        "How many legs does a spider have?",
        "A spider has eight legs.",
    ),
    ("What is 12 times 7?", "12 times 7 is 84."),
    (
        "Who wrote Romeo and Juliet?",
        "Romeo and Juliet was written by William Shakespeare.",
    ),
    (
        "What is the largest ocean?",
        "The Pacific Ocean is the largest ocean on Earth.",
    ),
    (
        "What day comes after Monday?",
        "Tuesday comes after Monday.",
    ),
    (
        "What is the boiling point of water?",
        "Water boils at 100 degrees Celsius at sea level.",
    ),
    (
        "Translate 'hello' into Spanish.",
        "'Hello' in Spanish is 'hola'.",
    ),
    ("What color is grass?", "Grass is usually green."),
];

fn mean(v: &[f64]) -> f64 {
    v.iter().sum::<f64>() / v.len() as f64
}

#[test]
fn dump_train_export_reload_on_smollm2() {
    let model = smollm2_dir();
    let dir = temp_dir("run");
    let data = dir.join("chat.jsonl");
    let lines: Vec<String> = CONVERSATIONS
        .iter()
        .enumerate()
        .map(|(i, (q, a))| {
            serde_json::json!({"id": format!("c{i}"), "messages": [
                {"role": "user", "content": q}, {"role": "assistant", "content": a}]})
            .to_string()
        })
        .collect();
    std::fs::write(&data, lines.join("\n") + "\n").unwrap();
    let dump = dir.join("dump");
    let mut o = DumpOptions::new(&model, data.to_string_lossy(), &dump);
    o.max_len = 64;
    let device = Default::default();
    // The dump runs the real target on the jobs' CPU backend (burn-flex, which multiplies by
    // the loader's transposed weight views in place; burn-ndarray copies them every product).
    run_dump::<tandem_model::backend::CpuBackend>(&o, &Default::default()).unwrap();
    assert_eq!(DumpReader::open(&dump).unwrap().len(), 10);

    let out = dir.join("head");
    let mut t = TrainOptions::new(vec![dump.clone()], &model, &out);
    t.draft_vocab = Some(256);
    t.ttt_steps = 2;
    t.batch_size = 2;
    t.epochs = 6;
    t.lr = 2e-3;
    t.warmup_ratio = 0.1;
    t.min_lr_ratio = 0.1;
    t.val_fraction = 0.0;
    t.max_len = 64;
    let report = train::<Autodiff<B>>(&t, &device).unwrap();
    assert_eq!(report.steps, 30, "5 batches x 6 epochs");

    // Compare whole epochs: the same samples, only batched differently.
    let train_lines: Vec<_> = read_lines(&out.join("metrics.jsonl"))
        .unwrap()
        .into_iter()
        .filter(|l| l.kind == "train")
        .collect();
    let epoch = |e: usize, f: &dyn Fn(&tandem_train::metrics::MetricsLine) -> f64| {
        mean(
            &train_lines
                .iter()
                .filter(|l| l.epoch == e)
                .map(f)
                .collect::<Vec<_>>(),
        )
    };
    let (loss0, loss5) = (epoch(0, &|l| l.loss), epoch(5, &|l| l.loss));
    let (acc0, acc5) = (epoch(0, &|l| l.acc[0]), epoch(5, &|l| l.acc[0]));
    let (acc1_0, acc1_5) = (epoch(0, &|l| l.acc[1]), epoch(5, &|l| l.acc[1]));
    eprintln!(
        "smollm2: {:.3} steps/s, {:.0} tok/s; epoch loss {loss0:.3} -> {loss5:.3}, acc_0 \
         {acc0:.3} -> {acc5:.3}, acc_1 {acc1_0:.3} -> {acc1_5:.3}",
        report.steps_per_s, report.tokens_per_s
    );
    assert!(loss5 < 0.8 * loss0, "loss {loss0} -> {loss5}");
    assert!(acc5 > acc0 + 0.1, "acc_0 {acc0} -> {acc5}");

    // The export reloads to the trained parameters (the final checkpoint's burn record).
    let head = TargetHead::<B>::load(&model, &device).unwrap();
    let exported = load_pretrained::<B>(&out, head.embed_tokens.clone(), &device)
        .unwrap()
        .draft;
    assert_eq!(exported.spec.hidden_size, 576);
    assert_eq!(exported.spec.fc_in(), 3 * 576);
    let latest = std::fs::read_to_string(out.join("checkpoints/latest")).unwrap();
    let ckpt = out.join("checkpoints").join(latest.trim());
    let trained = load_pretrained::<B>(&ckpt.join("head"), head.embed_tokens.clone(), &device)
        .unwrap()
        .draft
        .load_file(
            ckpt.join("model"),
            &NamedMpkFileRecorder::<FullPrecisionSettings>::new(),
            &device,
        )
        .unwrap();
    let record = DumpReader::open(&dump).unwrap().read(0).unwrap();
    let n = record.input_ids.len();
    let aux = Tensor::<B, 3>::from_data(
        TensorData::new(record.aux_hidden.clone(), [1, n, 3 * 576]),
        &device,
    );
    let unroll = |d: &Eagle3Draft<B>| {
        d.forward_ttt(aux.clone(), &record.input_ids, &[n], 2)
            .unwrap()
    };
    let values = |t: Tensor<B, 3>| t.into_data().to_vec::<f32>().unwrap();
    let (a, b) = (unroll(&exported), unroll(&trained));
    for (x, y) in a.iter().zip(&b) {
        assert_eq!(
            values(x.logits.clone()),
            values(y.logits.clone()),
            "export == trained"
        );
    }
    let json: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("config.json")).unwrap()).unwrap();
    assert_eq!(
        json["eagle_config"]["eagle_aux_hidden_state_layer_ids"],
        serde_json::json!([1, 14, 26])
    );
    assert_eq!(
        json["eagle_aux_hidden_state_layer_ids"],
        serde_json::json!([2, 15, 27]),
        "vLLM ids at the top level"
    );
    // The head's manifest names its dump: directory, manifest hash, dataset, rows, tokens.
    let reader = DumpReader::open(&dump).unwrap();
    let named = &json["tandem_wiring"]["trained_on"];
    assert_eq!(named.as_array().map(Vec::len), Some(1), "{named}");
    let named = &named[0];
    assert_eq!(named["name"], "dump");
    assert_eq!(named["path"], dump.display().to_string());
    let manifest_sha =
        tandem_wiring::sha256_hex(&std::fs::read(dump.join("manifest.json")).unwrap());
    assert_eq!(named["manifest_sha256"], manifest_sha.as_str());
    assert_eq!(named["dataset"], data.to_string_lossy().as_ref());
    assert_eq!(named["regenerated"], false);
    assert_eq!(named["rows"], 10);
    assert_eq!(named["tokens"], reader.manifest().tokens);
    assert_eq!(report.trained_on, vec![reader.dump_ref()]);

    // Served: extend over positions 0..=t, then one draft step, equals the unroll at t.
    let t = n / 2;
    let mut cache = exported.new_cache(1, n + 2);
    let tokens = ttt_step_tokens(&record.input_ids, &[n], n, 0);
    let step = cache.prefill_step(&[&tokens[..=t]]).unwrap();
    let ext = exported
        .extend(
            &step,
            aux.clone().slice([0..1, 0..t + 1, 0..3 * 576]),
            &mut cache,
        )
        .unwrap();
    let token = ttt_step_tokens(&record.input_ids, &[n], n, 1)[t];
    let step = cache.decode_step(&[token]).unwrap();
    let served = exported
        .forward_step(
            &step,
            ext.hidden.slice([0..1, t..t + 1, 0..576]),
            &mut cache,
        )
        .unwrap();
    let want = values(a[1].logits.clone().slice([0..1, t..t + 1, 0..256]));
    let got = values(served.logits);
    let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
    let diff = got
        .iter()
        .zip(&want)
        .fold(0f32, |m, (x, y)| m.max((x - y).abs()));
    assert!(
        diff / scale < 1e-4,
        "served step 1 differs from the unroll: {diff} / {scale}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}
