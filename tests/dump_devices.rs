//! `tandem dump --devices 0,1` (issue #19): the command starts one rank per device and the
//! ranks together hold the rows a single `tandem dump` writes, byte for byte (by sample id).
//! On the CPU the devices only name the ranks; the split, the resume directories and the reader
//! are the ones a GPU run uses.

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

#[test]
fn devices_start_one_rank_each_and_read_as_the_single_process_dump() {
    let dir = scratch_dir("dump-devices");
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
