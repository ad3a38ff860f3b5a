//! `compare` on the tiny target with a seeded random head: the offline tally and the online
//! engine run end to end and produce consistent, bounded numbers.

mod common;

use common::*;
use tandem_dump::DumpReader;
use tandem_eagle::{Eagle3Config, Eagle3Draft, VocabMap};
use tandem_model::TapRequest;
use tandem_model::testing::tiny_config;
use tandem_replay::{CompareReport, offline_acceptance, online_acceptance};

#[test]
fn compare_runs_offline_and_online_on_a_tiny_head() {
    let taps = blocks(&[1, 3, 4]);
    let dir = tap_dump("compare", &taps, None, &taps);
    let model = tiny_model();
    let config = Eagle3Config::for_target(&tiny_config("LlamaForCausalLM", LAYERS), 96, 3);
    let draft = Eagle3Draft::<B>::init(
        config.resolve().unwrap(),
        VocabMap::identity(96),
        model.embed_tokens.clone(),
        3,
        &Default::default(),
    )
    .unwrap();
    let dump = DumpReader::open(&dir).unwrap();
    let steps = 3;
    let offline = offline_acceptance(&model, &draft, &dump, steps, None).unwrap();
    assert_eq!(offline.samples, 3);
    // Loss mask all on: step i counts n - 1 - i positions per sample (n = 20, 33, 12).
    assert_eq!(offline.denominators, vec![62, 59, 56]);
    // Chain positions: t + 3 < n, so n - 3 per sample.
    assert_eq!(offline.chain_positions, 56);
    assert_eq!(offline.reached[0], 56);
    for (a, r) in offline.accepted.iter().zip(&offline.reached) {
        assert!(a <= r);
    }
    let prompts: Vec<Vec<u32>> = sample_ids().into_iter().take(2).collect();
    let online = online_acceptance(
        &model,
        &draft,
        TapRequest::new(taps),
        &prompts,
        steps,
        12,
        &[],
    )
    .unwrap();
    assert_eq!(online.prompts, 2);
    assert!(online.stats.rounds > 0);
    let report = CompareReport::new(
        ["dump".into(), "head".into(), "prompts".into()],
        steps,
        offline,
        online,
        0.2,
    );
    eprintln!("{}", report.to_table());
    assert_eq!(report.gap.len(), steps);
    assert!(report.offline_accept_length >= 1.0 && report.online_accept_length >= 1.0);
    let html = report.to_html();
    assert!(html.contains("<svg") && !html.contains("<script"));
}
