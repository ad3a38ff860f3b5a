//! `tandem dump --devices 0,1` (issue #19): the command starts one rank per device and the
//! ranks together hold the rows a single `tandem dump` writes, byte for byte (by sample id).
//! On the CPU the devices only name the ranks; the split, the resume directories and the reader
//! are the ones a GPU run uses. Also: `--tp 2` dumps the reduced residual stream (replay finds
//! every slot where the manifest says), and data-parallel training refuses the CPU trainer.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;

use tandem_dump::{DumpReader, DumpRecord};
use tandem_model::testing::{scratch_dir, write_tiny_chat_model};

fn by_sample_id(dir: &Path) -> BTreeMap<String, DumpRecord> {
    DumpReader::open(dir)
        .unwrap()
        .iter()
        .map(|r| {
            let r = r.unwrap();
            (r.sample_id.clone(), r)
        })
        .collect()
}

fn dump(model: &Path, data: &Path, out: &Path, extra: &[&str]) {
    let status = Command::new(env!("CARGO_BIN_EXE_tandem"))
        .args(["dump", "--model"])
        .arg(model)
        .arg("--dataset")
        .arg(data)
        .arg("--out")
        .arg(out)
        .args(["--device", "cpu", "--max-len", "128", "--quiet"])
        .args(extra)
        .env_remove("RANK")
        .env_remove("WORLD_SIZE")
        .status()
        .unwrap();
    assert!(status.success(), "tandem dump {extra:?} failed");
}

/// A tiny chat model and five short conversations: `(model, dataset)`.
fn model_and_data(dir: &Path) -> (std::path::PathBuf, std::path::PathBuf) {
    let model = dir.join("model");
    write_tiny_chat_model(&model, 4, 3).unwrap();
    let mut lines = String::new();
    for i in 0..5 {
        let messages = serde_json::json!([
            {"role": "user", "content": format!("Question number {i}?")},
            {"role": "assistant", "content": format!("Answer number {i}, with a few words.")},
        ]);
        lines.push_str(
            &serde_json::json!({"id": format!("c{i}"), "messages": messages}).to_string(),
        );
        lines.push('\n');
    }
    let data = dir.join("chat.jsonl");
    std::fs::write(&data, lines).unwrap();
    (model, data)
}

#[test]
fn devices_start_one_rank_each_and_read_as_the_single_process_dump() {
    let dir = scratch_dir("dump-devices");
    let (model, data) = model_and_data(&dir);

    dump(&model, &data, &dir.join("single"), &[]);
    dump(&model, &data, &dir.join("parallel"), &["--devices", "0,1"]);
    assert!(dir.join("parallel/rank-00000/manifest.json").is_file());
    assert!(dir.join("parallel/rank-00001/manifest.json").is_file());
    assert!(dir.join("parallel/rank-1.log").is_file());
    let (single, parallel) = (
        by_sample_id(&dir.join("single")),
        by_sample_id(&dir.join("parallel")),
    );
    assert_eq!(single.len(), 5);
    assert_eq!(parallel, single);
    // Rank 1 holds records 1 and 3.
    let rank1: Vec<String> = DumpReader::open(&dir.join("parallel/rank-00001"))
        .unwrap()
        .iter()
        .map(|r| r.unwrap().sample_id)
        .collect();
    assert_eq!(rank1, ["c1", "c3"]);
}

/// `tandem dump --tp 2`: the blocks run as two tensor-parallel ranks, the hook takes the
/// reduced residual stream once, so the rows equal the unsplit dump's (bf16 storage: within
/// one bf16 step, 2^-8 relative) and `tandem replay` (unsplit) matches every slot.
#[test]
fn a_tensor_parallel_dump_holds_the_reduced_residual_stream() {
    let dir = scratch_dir("dump-tp");
    let (model, data) = model_and_data(&dir);
    dump(&model, &data, &dir.join("tp1"), &[]);
    dump(&model, &data, &dir.join("tp2"), &["--tp", "2"]);
    let manifest = std::fs::read_to_string(dir.join("tp2/manifest.json")).unwrap();
    assert!(manifest.contains("tensor-parallel 2"), "{manifest}");
    let (one, two) = (
        by_sample_id(&dir.join("tp1")),
        by_sample_id(&dir.join("tp2")),
    );
    assert_eq!(one.len(), 5);
    for (id, a) in &one {
        let b = &two[id];
        assert_eq!(a.input_ids, b.input_ids);
        for (x, y) in a.aux_hidden.iter().zip(&b.aux_hidden) {
            assert!(
                (x - y).abs() <= x.abs().max(1e-3) / 128.0,
                "{id}: {x} vs {y}"
            );
        }
    }
    let replay = Command::new(env!("CARGO_BIN_EXE_tandem"))
        .args(["replay", "--dump"])
        .arg(dir.join("tp2"))
        .arg("--model")
        .arg(&model)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&replay.stdout).to_string()
        + &String::from_utf8_lossy(&replay.stderr);
    assert!(replay.status.success(), "{text}");
    // A degree that does not split the heads is refused by name.
    let refused = Command::new(env!("CARGO_BIN_EXE_tandem"))
        .args(["dump", "--model"])
        .arg(&model)
        .arg("--dataset")
        .arg(&data)
        .arg("--out")
        .arg(dir.join("tp3"))
        .args([
            "--device",
            "cpu",
            "--max-len",
            "128",
            "--tp",
            "3",
            "--quiet",
        ])
        .output()
        .unwrap();
    assert!(!refused.status.success());
    let err = String::from_utf8_lossy(&refused.stderr);
    assert!(err.contains("does not split over 3"), "{err}");
}

/// Data-parallel training is the GPU trainer's: the CPU trainer refuses a rank by name.
#[test]
fn data_parallel_training_refuses_the_cpu_trainer() {
    let dir = scratch_dir("train-dp-cpu");
    let (model, data) = model_and_data(&dir);
    dump(&model, &data, &dir.join("dump"), &[]);
    let out = Command::new(env!("CARGO_BIN_EXE_tandem"))
        .args(["train", "--dump"])
        .arg(dir.join("dump"))
        .arg("--model")
        .arg(&model)
        .arg("--out")
        .arg(dir.join("head"))
        .args(["--rank", "0", "--world-size", "1", "--quiet"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("data-parallel training (rank 0 of 1) runs on the GPU trainer"),
        "{err}"
    );
    let devices = Command::new(env!("CARGO_BIN_EXE_tandem"))
        .args(["train", "--dump"])
        .arg(dir.join("dump"))
        .arg("--out")
        .arg(dir.join("head2"))
        .args(["--devices", "0,1"])
        .output()
        .unwrap();
    assert!(!devices.status.success());
    let err = String::from_utf8_lossy(&devices.stderr);
    assert!(err.contains("pass --device cuda"), "{err}");
}
