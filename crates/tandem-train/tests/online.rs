//! `tandem train --online`: taps captured through the dump's hook while training, no shards.
//! On a tiny random Llama with SmolLM2's tokenizer and chat template, training online on a chat
//! JSONL gives exactly the run that `tandem dump` + training on the dump gives (every metric
//! line, the exported weights byte for byte), names its data `online:<file>`, and refuses what
//! it cannot do with a sentence.

use std::fs;
use std::path::{Path, PathBuf};

use burn::backend::{Autodiff, NdArray};
use tandem_dump::{DumpOptions, DumpReader, GenerationSettings, OnlineCapture, run_dump};
use tandem_model::TargetModel;
use tandem_model::testing::{scratch_dir, write_tiny_chat_model};
use tandem_train::data::Dataset;
use tandem_train::{TrainError, TrainOptions, train_on};

type B = NdArray<f32>;
type AB = Autodiff<B>;

/// A tiny random Llama (8 blocks, hidden 32) with SmolLM2's tokenizer and chat template.
fn tiny_model(name: &str) -> PathBuf {
    let dir = scratch_dir(&format!("online-{name}-model"));
    write_tiny_chat_model(&dir, 8, 7).unwrap();
    dir
}

/// Sixteen two-turn conversations (one too long for `max_len`, one without a reply).
fn write_dataset(dir: &Path) -> PathBuf {
    let topics = [
        "the sea",
        "a red fox",
        "bread",
        "the moon",
        "rain",
        "a violin",
        "chess",
        "tea",
        "a bridge",
        "snow",
        "a lighthouse",
        "bees",
        "a clock",
        "autumn",
    ];
    let mut lines: Vec<String> = topics
        .iter()
        .enumerate()
        .map(|(i, t)| {
            serde_json::json!({"id": format!("c{i}"), "messages": [
                {"role": "user", "content": format!("Tell me about {t}.")},
                {"role": "assistant", "content": format!("{t} is worth a sentence or two; here they are, about {t}.")},
                {"role": "user", "content": "And one more fact?"},
                {"role": "assistant", "content": format!("People have written about {t} for centuries.")}
            ]})
            .to_string()
        })
        .collect();
    lines.push(
        serde_json::json!({"id": "long", "messages": [
            {"role": "user", "content": "word ".repeat(400)},
            {"role": "assistant", "content": "ok"}
        ]})
        .to_string(),
    );
    lines.push(
        serde_json::json!({"id": "no-reply", "messages": [{"role": "user", "content": "hi"}]})
            .to_string(),
    );
    let path = dir.join("conversations.jsonl");
    fs::write(&path, lines.join("\n") + "\n").unwrap();
    path
}

fn train_options(model: &Path, out: &Path, dumps: Vec<PathBuf>) -> TrainOptions {
    let mut o = TrainOptions::new(dumps, model, out);
    o.draft_vocab = Some(64);
    o.ttt_steps = 3;
    o.batch_size = 3;
    o.epochs = 2;
    o.lr = 3e-3;
    o.val_fraction = 0.15;
    o.max_len = 96;
    o.save_every = 0;
    o
}

fn capture_options(model: &Path, dataset: &Path, out: &Path) -> DumpOptions {
    let mut o = DumpOptions::new(model, dataset.to_string_lossy(), out);
    o.max_len = 96;
    o
}

fn open_online(o: &DumpOptions) -> Result<OnlineCapture, tandem_dump::DumpError> {
    OnlineCapture::open(o, || {
        Ok(Box::new(TargetModel::<B>::load(
            &o.model_dir,
            &Default::default(),
        )?))
    })
}

/// Metric lines without their clocks.
fn metrics(dir: &Path) -> Vec<serde_json::Value> {
    fs::read_to_string(dir.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| {
            let mut v: serde_json::Value = serde_json::from_str(l).unwrap();
            let map = v.as_object_mut().unwrap();
            map.retain(|k, _| !(k.contains("second") || k.ends_with("_s") || k.contains("per_s")));
            v
        })
        .collect()
}

#[test]
fn online_training_equals_training_on_the_dump_of_the_same_data() {
    let dir = scratch_dir("online-equals-dump");
    let model = tiny_model("equal");
    let dataset = write_dataset(&dir);

    // Offline: tandem dump, then train on the dump.
    let dump_dir = dir.join("dump");
    let summary = run_dump::<B>(
        &capture_options(&model, &dataset, &dump_dir),
        &Default::default(),
    )
    .unwrap();
    assert_eq!(
        summary.rows, 14,
        "the long and the reply-less conversations are skipped"
    );
    let offline_out = dir.join("offline");
    let offline = train_on::<AB>(
        &train_options(&model, &offline_out, vec![dump_dir.clone()]),
        Dataset::open(std::slice::from_ref(&dump_dir)).unwrap(),
        &Default::default(),
    )
    .unwrap();

    // Online: the same conversations, captured while training; nothing written but the head.
    let capture = open_online(&capture_options(&model, &dataset, Path::new(""))).unwrap();
    let dump = DumpReader::open(&dump_dir).unwrap();
    assert_eq!(capture.len(), dump.len());
    assert_eq!(capture.manifest().tokens, dump.manifest().tokens);
    assert_eq!(
        capture.manifest().assistant_tokens,
        dump.manifest().assistant_tokens
    );
    assert_eq!(capture.manifest().skipped, dump.manifest().skipped);
    assert_eq!(capture.manifest().wiring.taps, dump.manifest().wiring.taps);
    // Row by row, the values a dump stores (bf16) and reads back.
    for i in [0, 5, 13] {
        let (a, b) = (capture.read(i).unwrap(), dump.read(i).unwrap());
        assert_eq!(a.input_ids, b.input_ids);
        assert_eq!(a.loss_mask, b.loss_mask);
        assert_eq!(a.aux_hidden, b.aux_hidden, "row {i}: aux taps");
        assert_eq!(a.last_hidden, b.last_hidden, "row {i}: last block");
    }
    let online_out = dir.join("online");
    let mut options = train_options(&model, &online_out, Vec::new());
    options.online = Some(dataset.display().to_string());
    let online = train_on::<AB>(
        &options,
        Dataset::new(vec![Box::new(capture)]).unwrap(),
        &Default::default(),
    )
    .unwrap();

    assert_eq!(online.steps, offline.steps);
    assert!(online.steps >= 8);
    assert_eq!(metrics(&online_out), metrics(&offline_out));
    assert_eq!(
        fs::read(online_out.join("model.safetensors")).unwrap(),
        fs::read(offline_out.join("model.safetensors")).unwrap(),
        "the exported heads differ"
    );
    let trained_on = &online.trained_on;
    assert_eq!(trained_on.len(), 1);
    assert_eq!(trained_on[0].name, "online:conversations.jsonl");
    assert_eq!(trained_on[0].rows, 14);
    assert!(!dir.join("online").join("shard-00000.arrow").exists());
}

#[test]
fn online_capture_refuses_what_it_cannot_do() {
    let dir = scratch_dir("online-refusals");
    let model = tiny_model("refusals");
    let dataset = write_dataset(&dir);

    let mut regenerate = capture_options(&model, &dataset, Path::new(""));
    regenerate.regenerate = Some(GenerationSettings {
        max_new_tokens: 8,
        temperature: 0.0,
        top_p: 1.0,
        top_k: 0,
        seed: 0,
    });
    let err = open_online(&regenerate).unwrap_err().to_string();
    assert!(err.contains("regenerate them once"), "{err}");

    let empty = dir.join("empty.jsonl");
    fs::write(
        &empty,
        "{\"id\": \"x\", \"messages\": [{\"role\": \"user\", \"content\": \"hi\"}]}\n",
    )
    .unwrap();
    let err = open_online(&capture_options(&model, &empty, Path::new("")))
        .unwrap_err()
        .to_string();
    assert!(err.contains("no trainable conversation"), "{err}");

    // Dumps and --online together, or neither: refused before anything runs.
    let mut both = train_options(&model, &dir.join("out"), vec![dir.join("dump")]);
    both.online = Some("x.jsonl".to_owned());
    let capture = open_online(&capture_options(&model, &dataset, Path::new(""))).unwrap();
    let err = train_on::<AB>(
        &both,
        Dataset::new(vec![Box::new(capture)]).unwrap(),
        &Default::default(),
    )
    .unwrap_err();
    assert!(
        matches!(
            err,
            TrainError::InvalidOption {
                option: "online",
                ..
            }
        ),
        "{err}"
    );
}
