//! The driver over the scripted backend (`backend::scripted`: a target whose greedy continuation
//! is a hash of the token, a head that guesses it for a set share of tokens): greedy output is
//! the target's continuation token for token, for chains, trees and target-only rounds, with
//! joins and leaves; and each chain round accepts exactly the drafts the script says the head
//! got right, which pins down what the driver hands the head (each root is the last committed
//! token, each draft step's token the previous draft). `driver_host_time` times the same runs.

use std::collections::BTreeMap;

use tandem_infer::backend::scripted::{ScriptedHead, ScriptedTarget};
use tandem_infer::{Engine, Request, SpecConfig};
use tandem_model::TapRequest;
use tandem_model::sampling::SamplingParams;
use tandem_wiring::default_aux_taps;

fn target() -> ScriptedTarget {
    ScriptedTarget {
        vocab: 49_152,
        max_positions: 8192,
        hidden: 64,
    }
}

fn head() -> ScriptedHead {
    ScriptedHead {
        vocab: 49_152,
        hidden: 64,
        accept_per_mille: 700,
    }
}

fn requests(count: usize, max_new_tokens: usize) -> Vec<Request> {
    (0..count)
        .map(|i| Request {
            id: i as u64,
            prompt: (0..20 + 7 * i as u32)
                .map(|t| (t * 131 + 7) % 49_152)
                .collect(),
            max_new_tokens,
            stop_ids: Vec::new(),
            sampling: SamplingParams::greedy(),
            seed: 0,
        })
        .collect()
}

/// The target's greedy continuation of `prompt`, `n` tokens.
fn continuation(target: &ScriptedTarget, prompt: &[u32], n: usize) -> Vec<u32> {
    let mut out = Vec::with_capacity(n);
    let mut last = *prompt.last().expect("a prompt");
    for _ in 0..n {
        last = target.next(last);
        out.push(last);
    }
    out
}

/// Runs `requests` (the second half joining after three rounds) to completion; returns each
/// request's tokens and the accepted drafts of each of its rounds.
#[allow(clippy::type_complexity)]
fn run(
    config: Option<SpecConfig>,
    requests: Vec<Request>,
) -> (BTreeMap<u64, Vec<u32>>, BTreeMap<u64, Vec<usize>>) {
    let (target, head) = (target(), head());
    let taps = default_aux_taps(30).unwrap();
    let engine = Engine {
        target: &target,
        draft: config.map(|_| &head),
        taps: if config.is_some() {
            TapRequest::new(taps)
        } else {
            TapRequest::none()
        },
        config: config.unwrap_or(SpecConfig::chain(1)),
    };
    let mut batch = engine.new_batch(2048);
    let mut tokens: BTreeMap<u64, Vec<u32>> = BTreeMap::new();
    let mut accepted: BTreeMap<u64, Vec<usize>> = BTreeMap::new();
    let mut record = |progress: Vec<tandem_infer::Progress>| {
        for p in progress {
            tokens.entry(p.id).or_default().extend(&p.tokens);
            if let Some(a) = p.accepted {
                accepted.entry(p.id).or_default().push(a);
            }
        }
    };
    let mut waiting = requests;
    let later = waiting.split_off(waiting.len() / 2);
    record(engine.admit(&mut batch, waiting).unwrap());
    for _ in 0..3 {
        record(engine.step(&mut batch).unwrap());
    }
    record(engine.admit(&mut batch, later).unwrap());
    while !batch.is_empty() {
        record(engine.step(&mut batch).unwrap());
    }
    (tokens, accepted)
}

#[test]
fn greedy_output_is_the_scripted_continuation_for_every_round_shape() {
    let target = target();
    let reqs = requests(6, 40);
    let shapes = [
        None,
        Some(SpecConfig::chain(3)),
        Some(SpecConfig {
            num_steps: 3,
            topk: 4,
            num_draft_tokens: 8,
            ..SpecConfig::chain(3)
        }),
    ];
    for config in shapes {
        let (tokens, _) = run(config, reqs.clone());
        assert_eq!(tokens.len(), reqs.len());
        for r in &reqs {
            assert_eq!(
                tokens[&r.id],
                continuation(&target, &r.prompt, r.max_new_tokens),
                "request {} with {config:?}",
                r.id
            );
        }
    }
}

#[test]
fn each_chain_round_accepts_exactly_the_drafts_the_head_got_right() {
    let (target, head) = (target(), head());
    let steps = 3;
    let reqs = requests(4, 60);
    let (tokens, accepted) = run(Some(SpecConfig::chain(steps)), reqs.clone());
    let mut rounds = 0;
    for r in &reqs {
        // The admission commits the first token; each round then drafts from the last
        // committed token g[i]: draft j is right while the head guesses g[i + j]'s successor.
        let g = &tokens[&r.id];
        let mut i = 0;
        let mut expected = Vec::new();
        while i + 1 < g.len() {
            let a = (0..steps)
                .take_while(|&j| i + j + 1 < g.len() && head.guesses(g[i + j]))
                .count();
            expected.push(a);
            i += a + 1;
        }
        let got = &accepted[&r.id];
        // The last round may accept drafts past the budget that are then not committed.
        let n = got.len() - 1;
        assert_eq!(got[..n], expected[..n], "request {}", r.id);
        assert_eq!(got.len(), expected.len(), "request {}", r.id);
        rounds += got.len();
        assert_eq!(g, &continuation(&target, &r.prompt, r.max_new_tokens));
    }
    // 70% of guesses right: about 2.2 tokens a round, so well under one round a token.
    let committed: usize = reqs.iter().map(|r| r.max_new_tokens - 1).sum();
    assert!(
        rounds * 3 < committed * 2,
        "{rounds} rounds for {committed} tokens"
    );
}
