//! Replay on the real SmolLM2-135M-Instruct with a real dump made by `tandem dump`'s library
//! entry point: every slot must match (cosine >= 0.999, relative error <= 2e-2).

mod common;

use common::*;
use tandem_dump::{DumpOptions, DumpReader, run_dump};
use tandem_model::TargetModel;
use tandem_replay::{ReplayOptions, Status, fingerprint_model, replay};
use tandem_wiring::{TapId, TapSpec};

/// The jobs' own CPU backend (burn-flex) for the real model: the fault suite's `B`
/// (burn-ndarray, for its tiny trained heads) copies every weight view on each product.
type Real = tandem_model::backend::CpuBackend;

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
    run_dump::<Real>(&options, &Default::default()).unwrap();

    let model = TargetModel::<Real>::load(&smollm2_dir(), &Default::default()).unwrap();
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

/// `diagnose` on the real SmolLM2 with the committed head (trained on blocks [1, 14, 26], SGLang
/// ids [1, 14, 26]): two chat prompts, 24 greedy tokens each, the whole sweep in well under a
/// minute. The committed head is a short run (validation acc_0 0.29) that leans on the token
/// embedding, so ~40 positions cannot single out one wiring; the test checks the readings, the
/// sweep, the zero-taps control, and that serving the head on its manifest's taps costs no
/// significant acceptance.
#[test]
fn smollm2_committed_head_diagnose_runs_on_its_own_text() {
    use tandem_model::{ChatMessage, TargetTokenizer};
    use tandem_replay::diagnose::format_wiring;
    use tandem_replay::{DiagnoseLabels, DiagnoseOptions, diagnose, generate_samples};
    use tandem_wiring::Convention;

    let head_dir = workspace_root().join("heads/smollm2-135m-eagle3");
    let model = TargetModel::<Real>::load(&smollm2_dir(), &Default::default()).unwrap();
    let tokenizer = TargetTokenizer::load(&smollm2_dir()).unwrap();
    let head =
        tandem_eagle::load_pretrained(&head_dir, model.embed_tokens.clone(), &Default::default())
            .unwrap();
    let prompts: Vec<Vec<u32>> = [
        "Explain why the sky is blue in two sentences.",
        "Write a short poem about the sea.",
    ]
    .iter()
    .map(|q| {
        tokenizer
            .encode_chat(&[ChatMessage::new("user", *q)], true)
            .unwrap()
    })
    .collect();
    let start = std::time::Instant::now();
    let samples = generate_samples(&model, &prompts, 24, &tokenizer.eos_ids).unwrap();
    assert!(samples.iter().all(|s| s.loss_mask.contains(&1)));
    let options = DiagnoseOptions {
        steps: 3,
        min_margin: 0.05,
        labels: DiagnoseLabels {
            head: head_dir.display().to_string(),
            model: "SmolLM2-135M-Instruct".to_owned(),
            prompts: "2 chat prompts".to_owned(),
            device: "cpu".to_owned(),
            architecture: String::new(),
        },
    };
    let report = diagnose(&model, &head.draft, &head.config, &samples, &options).unwrap();
    eprintln!("{}", report.to_table(12));
    eprintln!("diagnose took {:.1} s", start.elapsed().as_secs_f64());
    let served = vec![TapId::Block(1), TapId::Block(14), TapId::Block(26)];
    assert_eq!(report.serving, served);
    assert!(
        report.readings[0]
            .reading
            .source
            .contains("Tandem wiring manifest")
    );
    let vllm = report
        .readings
        .iter()
        .find(|r| r.reading.conventions.contains(&Convention::Vllm))
        .unwrap();
    assert_eq!(
        vllm.reading.taps,
        vec![TapId::Block(0), TapId::Block(13), TapId::Block(25)]
    );
    assert!(vllm.accept_length.is_some() && report.readings[0].accept_length.is_some());
    assert!(report.scores.len() >= 30 && report.scores.len() <= 80);
    assert!(report.best_accept_length >= 1.0 && report.positions > 20);
    // Serving the head on its manifest's taps costs no significant acceptance.
    assert!(
        report.consistent,
        "best {}: {:?}",
        format_wiring(&report.best),
        report.verdict
    );
    assert!(report.zero_taps_accept_length.is_some());
    assert!(report.to_html().contains("Every wiring swept"));
}
