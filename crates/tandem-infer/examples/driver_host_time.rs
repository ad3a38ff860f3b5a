//! The speculative driver's own host time per round, without a device: the driver over the
//! scripted backend (`tandem_infer::backend::scripted`, whose steps cost next to nothing), so a
//! round's wall time is the driver's work (the policy's choice, the steps' inputs from the
//! column layout, acceptance, commit, bookkeeping) plus the scripted backend's trivial steps.
//! On a GPU this work lies between one round's read-back and the next round's launches, where
//! the device may wait for it. Target-only rounds at the same batch size are the baseline, in
//! the same run.
//!
//!     cargo run --release -p tandem-infer --example driver_host_time [-- REPEATS [SHAPE]]
//!
//! SHAPE (e.g. `chain` or `5/8/32`) keeps only the shapes whose label holds it, with the
//! target-only baseline (for a profiler). Prints, for each round shape and batch size, the median over REPEATS runs (default 5) of
//! each run's median round, the tokens a round commits, and the phases' mean host time a
//! round (draft, verify, extend as the driver books them).

use std::time::Instant;

use tandem_infer::backend::scripted::{ScriptedHead, ScriptedTarget};
use tandem_infer::{Engine, Request, SpecConfig};
use tandem_model::TapRequest;
use tandem_model::sampling::SamplingParams;
use tandem_wiring::default_aux_taps;

const PROMPT_TOKENS: usize = 200;
const NEW_TOKENS: usize = 128;

fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    let n = values.len();
    if n == 0 {
        f64::NAN
    } else if n % 2 == 1 {
        values[n / 2]
    } else {
        (values[n / 2 - 1] + values[n / 2]) / 2.0
    }
}

struct RunResult {
    median_round_us: f64,
    tokens_per_round: f64,
    /// Mean host time a round in draft, verify and extend (us).
    phases_us: [f64; 3],
}

fn run(
    target: &ScriptedTarget,
    head: &ScriptedHead,
    config: Option<SpecConfig>,
    batch_size: usize,
) -> RunResult {
    let engine = Engine {
        target,
        draft: config.map(|_| head),
        taps: match config {
            Some(_) => TapRequest::new(default_aux_taps(30).expect("SmolLM2's 30 layers")),
            None => TapRequest::none(),
        },
        config: config.unwrap_or(SpecConfig::chain(1)),
    };
    let width = config.map_or(1, |c| c.num_draft_tokens);
    let mut batch = engine.new_batch(PROMPT_TOKENS + (NEW_TOKENS + 1) * width + 1);
    let requests: Vec<Request> = (0..batch_size)
        .map(|i| Request {
            id: i as u64,
            prompt: (0..PROMPT_TOKENS as u32)
                .map(|t| (t * 7919 + i as u32 * 104_729) % target.vocab as u32)
                .collect(),
            max_new_tokens: NEW_TOKENS,
            stop_ids: Vec::new(),
            sampling: SamplingParams::greedy(),
            seed: 0,
        })
        .collect();
    engine.admit(&mut batch, requests).expect("admission");
    let before = batch.timings;
    let mut rounds_us = Vec::new();
    let mut committed = 0usize;
    while !batch.is_empty() {
        let t0 = Instant::now();
        let progress = engine.step(&mut batch).expect("round");
        rounds_us.push(t0.elapsed().as_secs_f64() * 1e6);
        committed += progress.iter().map(|p| p.tokens.len()).sum::<usize>();
    }
    let t = batch.timings;
    let rounds = rounds_us.len() as f64;
    let per_round = |now: f64, then: f64| (now - then) * 1e6 / rounds;
    RunResult {
        median_round_us: median(&mut rounds_us),
        tokens_per_round: committed as f64 / rounds / batch_size as f64,
        phases_us: [
            per_round(t.draft_s, before.draft_s),
            per_round(t.verify_s, before.verify_s),
            per_round(t.extend_s, before.extend_s),
        ],
    }
}

fn main() {
    let repeats: usize = std::env::args()
        .nth(1)
        .and_then(|v| v.parse().ok())
        .unwrap_or(5);
    let only = std::env::args().nth(2);
    let target = ScriptedTarget {
        vocab: 49_152,
        max_positions: 8192,
        hidden: 576,
    };
    let head = ScriptedHead {
        vocab: 49_152,
        hidden: 576,
        accept_per_mille: 700,
    };
    let tree = |num_steps, topk, num_draft_tokens| SpecConfig {
        num_steps,
        topk,
        num_draft_tokens,
        ..SpecConfig::chain(num_steps)
    };
    let shapes: [(&str, Option<SpecConfig>); 4] = [
        ("target only", None),
        ("chain 3/1/4", Some(SpecConfig::chain(3))),
        ("tree 3/4/8", Some(tree(3, 4, 8))),
        ("tree 5/8/32", Some(tree(5, 8, 32))),
    ];
    println!(
        "driver host time a round over the scripted backend ({PROMPT_TOKENS}-token prompts, \
         {NEW_TOKENS} new tokens, head right for 70% of tokens; median of {repeats} runs' \
         median rounds)"
    );
    println!(
        "| shape | batch | tokens a round a sequence | host us a round | host us a token | \
         x target-only's round | draft / verify / extend us a round |"
    );
    println!("|---|---|---|---|---|---|---|");
    for batch_size in [1usize, 8, 32] {
        let mut baseline = f64::NAN;
        for (label, config) in shapes {
            if config.is_some() && only.as_ref().is_some_and(|o| !label.contains(o.as_str())) {
                continue;
            }
            let results: Vec<RunResult> = (0..repeats)
                .map(|_| run(&target, &head, config, batch_size))
                .collect();
            let mut medians: Vec<f64> = results.iter().map(|r| r.median_round_us).collect();
            let round_us = median(&mut medians);
            let tokens = results[0].tokens_per_round;
            let phases: Vec<f64> = (0..3)
                .map(|i| results.iter().map(|r| r.phases_us[i]).sum::<f64>() / repeats as f64)
                .collect();
            if config.is_none() {
                baseline = round_us;
            }
            println!(
                "| {label} | {batch_size} | {tokens:.2} | {round_us:.1} | {:.2} | {:.2} | \
                 {:.1} / {:.1} / {:.1} |",
                round_us / (tokens * batch_size as f64),
                round_us / baseline,
                phases[0],
                phases[1],
                phases[2]
            );
        }
    }
}
