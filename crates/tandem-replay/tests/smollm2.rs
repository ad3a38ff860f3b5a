//! Replay on the real SmolLM2-135M-Instruct with a real dump made by `tandem dump`'s library
//! entry point: every slot must match (cosine >= 0.999, relative error <= 2e-2).

mod common;

use common::*;
use tandem_dump::{DumpOptions, DumpReader, run_dump};
use tandem_model::TargetModel;
use tandem_replay::{ReplayOptions, Status, fingerprint_model, replay};
use tandem_wiring::TapSpec;

#[test]
fn smollm2_real_dump_matches_every_slot() {
    let dir = temp_dir("smollm2");
    let data = dir.join("chats.jsonl");
    let chats = [
        (
            "a",
            "What is the capital of France?",
            "The capital of France is Paris.",
        ),
        ("b", "Name three colours.", "Red, green and blue."),
        (
            "c",
            "Write a haiku about rain.",
            "Soft rain on the roof,\nquiet streets shine in grey light,\nthe gutters sing low.",
        ),
    ];
    let lines: Vec<String> = chats
        .iter()
        .map(|(id, q, a)| {
            serde_json::json!({"id": id, "messages": [
                {"role": "user", "content": q}, {"role": "assistant", "content": a}]})
            .to_string()
        })
        .collect();
    std::fs::write(&data, lines.join("\n")).unwrap();
    let out = dir.join("dump");
    let mut options = DumpOptions::new(smollm2_dir(), data.to_string_lossy(), &out);
    options.max_len = 96;
    options.taps = "sglang:1,14,26".parse::<TapSpec>().unwrap();
    run_dump::<B>(&options, &Default::default()).unwrap();

    let model = TargetModel::<B>::load(&smollm2_dir(), &Default::default()).unwrap();
    let dump = DumpReader::open(&out).unwrap();
    let report = replay(
        &model,
        &fingerprint_model(&smollm2_dir()).unwrap(),
        &dump,
        None,
        &ReplayOptions {
            model_label: "SmolLM2-135M-Instruct".to_owned(),
            ..ReplayOptions::default()
        },
    )
    .unwrap();
    eprintln!("{}", report.to_table());
    assert!(report.ok(), "{:?}", report.problems());
    assert_eq!(report.samples, 3);
    for s in &report.slots {
        assert_eq!(s.status, Status::Match, "{}", s.verdict);
        let best = s.best.unwrap();
        assert!(
            best.cosine >= 0.9999 && best.rel_err <= 1e-2,
            "slot {}: {best:?}",
            s.slot
        );
    }
    assert_eq!(report.last_hidden.as_ref().unwrap().status, Status::Match);
}
