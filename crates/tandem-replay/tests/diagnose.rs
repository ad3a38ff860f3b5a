//! `diagnose` in the fault suite: tiny heads trained in test code (burn autodiff, a few hundred
//! Adam steps on the tiny target's own greedy text) with a known wiring, then configs that
//! declare that wiring correctly or wrongly. Diagnose must rank the true wiring first and name
//! the fault of a mis-wired serving configuration. The faulty configs are written here; the
//! product has no option to produce them.

mod common;

use std::sync::OnceLock;

use common::*;
use rand::{Rng, SeedableRng};
use tandem_eagle::{Eagle3Config, Eagle3Draft, EagleConfig};
use tandem_model::TargetModel;
use tandem_model::testing::tiny_config;
use tandem_replay::candidate::capture_candidates;
use tandem_replay::diagnose::{assemble_aux, format_wiring};
use tandem_replay::{
    Candidate, DiagnoseLabels, DiagnoseOptions, DiagnoseReport, DiagnoseSample, diagnose,
};
use tandem_wiring::{Convention, TapId};

/// TTT steps trained and measured.
const STEPS: usize = 2;

fn wiring(taps: &[TapId]) -> Vec<Candidate> {
    taps.iter().copied().map(Candidate::Tap).collect()
}

/// The text the test heads are trained and measured on: seeded random token sequences. (The
/// tiny random target's own greedy text collapses into loops within a few tokens, which any
/// wiring predicts; diagnose takes the samples as an argument, and the CLI and the SmolLM2 test
/// measure on the target's greedy continuations.) The loss mask is on everywhere.
fn samples() -> &'static [DiagnoseSample] {
    static SAMPLES: OnceLock<Vec<DiagnoseSample>> = OnceLock::new();
    SAMPLES.get_or_init(|| {
        let mut rng = rand::rngs::StdRng::seed_from_u64(17);
        (0..8)
            .map(|_| {
                let input_ids: Vec<u32> =
                    (0..48).map(|_| rng.random_range(0..VOCAB as u32)).collect();
                DiagnoseSample {
                    loss_mask: vec![1; input_ids.len()],
                    input_ids,
                }
            })
            .collect()
    })
}

/// Trains a head on `samples()` fed the taps of `trained` ([`common::train_head`]).
fn train_head(model: &TargetModel<B>, trained: &[Candidate], seed: u64) -> Eagle3Draft<B> {
    common::train_head(model, samples(), trained, STEPS, 300, seed)
}

fn head_config(ids: Option<Vec<i64>>) -> Eagle3Config {
    let mut config = Eagle3Config::for_target(&tiny_config("LlamaForCausalLM", LAYERS), VOCAB, 3);
    config.eagle_config = Some(EagleConfig {
        eagle_aux_hidden_state_layer_ids: ids,
        use_aux_hidden_state: true,
        extra: Default::default(),
    });
    config
}

fn run(draft: &Eagle3Draft<B>, config: &Eagle3Config, label: &str) -> DiagnoseReport {
    let model = tiny_model();
    let options = DiagnoseOptions {
        steps: STEPS,
        min_margin: 0.05,
        labels: DiagnoseLabels {
            head: label.to_owned(),
            model: "tiny".to_owned(),
            prompts: "random token sequences".to_owned(),
            device: "cpu".to_owned(),
            architecture: String::new(),
        },
    };
    let report = diagnose(&model, draft, config, samples(), &options).unwrap();
    eprintln!("{}", report.to_table(12));
    report
}

/// The head trained on blocks [1, 3, 4] (SGLang ids [1, 3, 4]).
fn head_134() -> &'static Eagle3Draft<B> {
    static HEAD: OnceLock<Eagle3Draft<B>> = OnceLock::new();
    HEAD.get_or_init(|| train_head(&tiny_model(), &wiring(&blocks(&[1, 3, 4])), 3))
}

/// What each candidate's own `TapRequest` through the capture hook returns is exactly what
/// diagnose assembles from its one all-taps capture.
#[test]
fn one_capture_equals_each_candidates_own_tap_request() {
    let model = tiny_model();
    let ids = &samples()[0].input_ids;
    let values = capture_candidates(&model, ids).unwrap();
    for taps in [
        blocks(&[1, 3, 4]),
        blocks(&[0, 2, 3]),
        vec![TapId::Embed, TapId::Block(1), TapId::Final],
    ] {
        let assembled = assemble_aux(&values, &wiring(&taps)).unwrap();
        let own = tap_values(&model, ids, &taps);
        for t in 0..ids.len() {
            for (slot, v) in own.iter().enumerate() {
                let a = &assembled[(t * taps.len() + slot) * HIDDEN..][..HIDDEN];
                assert_eq!(a, &v[t * HIDDEN..(t + 1) * HIDDEN], "{taps:?} token {t}");
            }
        }
    }
}

/// The true wiring ranks first; SGLang-classic ids [1, 3, 4] read as vLLM ids (blocks
/// [0, 2, 3], every slot one block early) are named and lose most of the acceptance.
#[test]
fn sglang_ids_read_as_vllm_ids_are_named_off_by_one() {
    let report = run(head_134(), &head_config(Some(vec![1, 3, 4])), "head-134");
    assert_eq!(
        report.best,
        wiring(&blocks(&[1, 3, 4])),
        "{:?}",
        report.verdict
    );
    assert!(
        report.consistent && report.conclusive,
        "{:?}",
        report.verdict
    );
    let vllm = report
        .readings
        .iter()
        .find(|r| r.reading.conventions.contains(&Convention::Vllm))
        .unwrap();
    assert!(!vllm.agrees);
    assert_eq!(vllm.difference, "every slot -1 block");
    let best = report.best_accept_length;
    let served_as_vllm = vllm.accept_length.unwrap();
    assert!(
        best > 1.5 && vllm.loss.unwrap() > 0.3 * (best - 1.0),
        "best {best:.3}, as vLLM ids {served_as_vllm:.3}"
    );
    let text = report.verdict.join("\n");
    assert!(
        text.contains("eagle_aux_hidden_state_layer_ids [1, 3, 4] read as hf/vllm/eagle ids: [block 0, block 2, block 3], every slot -1 block"),
        "{text}"
    );
}

/// A head from elsewhere whose config is wrong: trained on what vLLM reads from ids [1, 3, 4]
/// (blocks [0, 2, 3]), served by SGLang, which reads them as blocks [1, 3, 4].
#[test]
fn a_head_trained_on_vllm_reading_served_by_sglang_is_mis_wired() {
    let draft = train_head(&tiny_model(), &wiring(&blocks(&[0, 2, 3])), 5);
    let dir = temp_dir("diagnose-vllm-head");
    let config = head_config(Some(vec![1, 3, 4]));
    tandem_eagle::save_pretrained(&draft, &config, &dir, tandem_eagle::WeightDtype::F32).unwrap();
    let model = tiny_model();
    let loaded =
        tandem_eagle::load_pretrained(&dir, model.embed_tokens.clone(), &Default::default())
            .unwrap();
    assert!(loaded.config.tandem_wiring.is_none());
    let report = run(&loaded.draft, &loaded.config, "vllm-head");
    assert_eq!(
        report.best,
        wiring(&blocks(&[0, 2, 3])),
        "{:?}",
        report.verdict
    );
    assert!(!report.consistent && report.conclusive);
    let text = report.verdict.join("\n");
    assert!(
        text.contains("MIS-WIRED: Tandem / SGLang serve it on [block 1, block 3, block 4]")
            && text.contains("every slot +1 block against the trained wiring"),
        "{text}"
    );
    assert!(
        text.contains("what they mean in hf/vllm/eagle") && text.contains("vllm [1, 3, 4]"),
        "{text}"
    );
}

/// A head trained on [embed, block 1, block 3] whose config names no ids: served on the default
/// taps [1, 3, 4], it is missing the embedding tap.
#[test]
fn an_embedding_trained_head_without_ids_is_missing_its_embed_tap() {
    let trained = [TapId::Embed, TapId::Block(1), TapId::Block(3)];
    let draft = train_head(&tiny_model(), &wiring(&trained), 7);
    let report = run(&draft, &head_config(None), "embed-head");
    assert_eq!(report.best, wiring(&trained), "{:?}", report.verdict);
    assert!(!report.consistent);
    let serving = &report.readings[0];
    assert!(serving.reading.serving && serving.reading.source.contains("default"));
    assert_eq!(serving.difference, "missing embed tap");
    let text = report.verdict.join("\n");
    assert!(text.contains("vllm [0, 2, 4]"), "{text}");
    for s in &report.scores {
        assert!(s.accept_length <= report.best_accept_length);
    }
    eprintln!("best {}", format_wiring(&report.best));
}
