//! The speculative loop on a tiny random target and a random (untrained) head: greedy
//! speculative output must equal target-only greedy output token for token whatever the head
//! proposes (chain and tree, batch > 1, ragged prompts), and sampling must keep the target's
//! distribution (chi-square).

use tandem_eagle::{Eagle3Config, Eagle3Draft, VocabMap};
use tandem_infer::engine::target_greedy;
use tandem_infer::{SpecConfig, SpecEngine};
use tandem_model::backend::CpuBackend;
use tandem_model::sampling::{SamplingParams, distribution};
use tandem_model::testing::{
    chi_square_999, second_token_marginal, tiny_config, write_random_model,
};
use tandem_model::{LogitsFor, TapRequest, TargetModel};
use tandem_wiring::default_aux_taps;

type B = CpuBackend;

fn setup(name: &str) -> (TargetModel<B>, Eagle3Draft<B>, TapRequest) {
    let dir = tandem_model::testing::scratch_dir(&format!("engine-{name}"));
    let config = tiny_config("LlamaForCausalLM", 4);
    write_random_model(&dir, &config, 21).unwrap();
    let target = TargetModel::<B>::load(&dir, &Default::default()).unwrap();
    let taps = default_aux_taps(4).unwrap();
    let head_config = Eagle3Config::for_target(&config, config.vocab_size, taps.len());
    let spec = head_config.resolve().unwrap();
    let draft = Eagle3Draft::init(
        spec,
        VocabMap::identity(config.vocab_size),
        target.embed_tokens.clone(),
        5,
        &Default::default(),
    )
    .unwrap();
    (target, draft, TapRequest::new(taps))
}

fn check_greedy_equivalence(config: SpecConfig) {
    let (target, draft, taps) = setup(&format!("greedy-{}-{}", config.topk, config.num_steps));
    let prompts = vec![vec![3u32, 14, 15, 92, 65], vec![2u32, 71, 82]];
    let engine = SpecEngine {
        target: &target,
        draft: Some(&draft),
        taps,
        config,
    };
    let out = engine.generate(&prompts, 24, &[]).unwrap();
    for (b, prompt) in prompts.iter().enumerate() {
        let expected = target_greedy(&target, prompt, 24, &[]).unwrap();
        assert_eq!(
            out.sequences[b].tokens, expected,
            "sequence {b} with {config:?}"
        );
        let stats = &out.sequences[b].stats;
        // Every round commits at least the bonus token and at most the tree depth + 1.
        assert!(stats.rounds > 0, "no verification round ran");
        let tau = stats.accept_length();
        assert!(
            (1.0..=config.num_steps as f64 + 1.0).contains(&tau),
            "tau {tau}"
        );
        eprintln!(
            "{config:?}: sequence {b}: {} rounds, tau {tau:.2}",
            stats.rounds
        );
    }
}

/// DeepSeek-V3 target (the committed tiny HF fixture, 2 dense + 2 MoE layers) with a head made
/// for it: the speculative loop verifies two sequences at once, which the target runs
/// micro-batched (auto: batch >= 2 on a MoE model), while the reference decodes each sequence
/// alone on the plain path. Greedy outputs must still be equal token for token.
#[test]
fn deepseek_micro_batched_speculation_equals_plain_target_greedy() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/deepseek_v3/mla_qlora");
    let config = tandem_model::HfConfig::load(&dir.join("config.json")).unwrap();
    let target = TargetModel::<B>::load(&dir, &Default::default()).unwrap();
    assert!(target.spec.is_moe());
    let taps = default_aux_taps(target.spec.num_layers).unwrap();
    let head_config = Eagle3Config::for_target(&config, config.vocab_size, taps.len());
    let draft = Eagle3Draft::init(
        head_config.resolve().unwrap(),
        VocabMap::identity(config.vocab_size),
        target.embed_tokens.clone(),
        5,
        &Default::default(),
    )
    .unwrap();
    let prompts = vec![vec![3u32, 14, 15, 42, 60], vec![2u32, 31, 8]];
    let config = SpecConfig {
        num_steps: 3,
        topk: 2,
        num_draft_tokens: 6,
        sampling: SamplingParams::greedy(),
        seed: 0,
    };
    let engine = SpecEngine {
        target: &target,
        draft: Some(&draft),
        taps: TapRequest::new(taps),
        config,
    };
    let out = engine.generate(&prompts, 12, &[]).unwrap();
    for (b, prompt) in prompts.iter().enumerate() {
        let expected = target_greedy(&target, prompt, 12, &[]).unwrap();
        assert_eq!(out.sequences[b].tokens, expected, "sequence {b}");
        assert!(out.sequences[b].stats.rounds > 0);
    }
}

#[test]
fn chain_greedy_equals_target_greedy() {
    check_greedy_equivalence(SpecConfig::chain(3));
}

#[test]
fn tree_greedy_equals_target_greedy() {
    check_greedy_equivalence(SpecConfig {
        num_steps: 3,
        topk: 4,
        num_draft_tokens: 8,
        sampling: SamplingParams::greedy(),
        seed: 0,
    });
}

/// Rigs partial acceptance: the head's final norm is zeroed so it always proposes token 0, and
/// the target's lm_head column for token 0 is scaled so the target itself emits token 0 in runs
/// at some positions and other tokens elsewhere. Returns the target's vocabulary size.
fn rig_partial_acceptance(target: &mut TargetModel<B>, draft: &mut Eagle3Draft<B>) -> usize {
    use tandem_model::burn::module::Param;
    use tandem_model::burn::prelude::*;
    let [h, v] = target.lm_head_t.dims();
    let column0 = target.lm_head_t.clone().slice([0..h, 0..1]) * 6.0;
    target.lm_head_t = target.lm_head_t.clone().slice_assign([0..h, 0..1], column0);
    draft.norm.weight =
        Param::from_tensor(Tensor::zeros([draft.spec.hidden_size], &Default::default()));
    v
}

/// Partial acceptance exercised for real ([`rig_partial_acceptance`]). Greedy output must still equal
/// target-only greedy output, and accepted runs must show up in the statistics.
#[test]
fn partially_accepted_drafts_commit_correctly() {
    let (mut target, mut draft, taps) = setup("partial");
    let v = rig_partial_acceptance(&mut target, &mut draft);
    let prompts = vec![vec![9u32, 4, 33], vec![61u32, 2, 2, 8, 90, 17]];
    for config in [
        SpecConfig::chain(4),
        SpecConfig {
            num_steps: 3,
            topk: 2,
            num_draft_tokens: 6,
            sampling: SamplingParams::greedy(),
            seed: 0,
        },
    ] {
        let engine = SpecEngine {
            target: &target,
            draft: Some(&draft),
            taps: taps.clone(),
            config,
        };
        let out = engine.generate(&prompts, 40, &[]).unwrap();
        let mut accepted = 0;
        for (b, prompt) in prompts.iter().enumerate() {
            let expected = target_greedy(&target, prompt, 40, &[]).unwrap();
            assert_eq!(
                out.sequences[b].tokens, expected,
                "sequence {b} with {config:?}"
            );
            accepted += out.sequences[b].stats.accepted_tokens;
            let zeros = expected.iter().filter(|&&t| t == 0).count();
            assert!(
                zeros > 0 && zeros < expected.len(),
                "target output should mix token 0 and others (v={v})"
            );
        }
        assert!(
            accepted >= 5,
            "drafts of token 0 should be accepted in runs: {accepted}"
        );
    }
}

/// Chi-square: the second generated token (the first one produced by tree verification) must
/// follow the target's marginal distribution sum_t1 p(t1) p(t2 | t1), computed exactly here.
/// Several temperatures, and top-p / top-k truncation.
#[test]
fn sampling_keeps_the_target_distribution() {
    let (target, draft, taps) = setup("sampling");
    for (temperature, top_p, top_k) in [(2.0, 1.0, 0), (0.7, 1.0, 0), (1.0, 0.9, 20)] {
        let sampling = SamplingParams {
            temperature,
            top_p,
            top_k,
        };
        check_sampling(&target, &draft, &taps, sampling);
    }
}

fn check_sampling(
    target: &TargetModel<B>,
    draft: &Eagle3Draft<B>,
    taps: &TapRequest,
    sampling: SamplingParams,
) {
    let prompt = vec![5u32, 6, 7];
    let vocab = target.spec.vocab_size;
    let probs_after = |tokens: &[u32]| -> Vec<f32> {
        let mut cache = target.new_cache(1, tokens.len());
        let step = cache.prefill_step(&[tokens]).unwrap();
        let out = target
            .forward(&step, &mut cache, &TapRequest::none(), LogitsFor::Last)
            .unwrap();
        let logits = out.logits.unwrap().into_data().to_vec::<f32>().unwrap();
        distribution(&logits, &sampling)
    };
    let marginal = second_token_marginal(&prompt, probs_after);
    let draws = 2000;
    let mut counts = vec![0usize; vocab];
    let config = SpecConfig {
        num_steps: 2,
        topk: 2,
        num_draft_tokens: 4,
        sampling,
        seed: 0,
    };
    for seed in 0..draws {
        let engine = SpecEngine {
            target,
            draft: Some(draft),
            taps: taps.clone(),
            config: SpecConfig {
                seed: seed as u64,
                ..config
            },
        };
        let out = engine
            .generate(std::slice::from_ref(&prompt), 2, &[])
            .unwrap();
        counts[out.sequences[0].tokens[1] as usize] += 1;
    }
    let (chi2, limit) = chi_square_999(&marginal, &counts);
    eprintln!("{sampling:?}: chi2 {chi2:.1} (limit {limit:.1})");
    assert!(
        chi2 < limit,
        "{sampling:?}: chi2 {chi2:.1} (limit {limit:.1})"
    );
}

#[test]
fn bad_requests_are_refused_by_name() {
    let (target, draft, taps) = setup("bad");
    let engine = SpecEngine {
        target: &target,
        draft: Some(&draft),
        taps: taps.clone(),
        config: SpecConfig::chain(3),
    };
    let err = engine.generate(&[vec![]], 4, &[]).unwrap_err().to_string();
    assert!(err.contains("at least one token"), "{err}");
    let long = vec![1u32; 300];
    let err = engine.generate(&[long], 4, &[]).unwrap_err().to_string();
    assert!(err.contains("does not fit"), "{err}");
    let bad = SpecEngine {
        target: &target,
        draft: Some(&draft),
        taps: taps.clone(),
        config: SpecConfig {
            num_draft_tokens: 9,
            ..SpecConfig::chain(3)
        },
    };
    let err = bad.generate(&[vec![1]], 4, &[]).unwrap_err().to_string();
    assert!(err.contains("num_draft_tokens"), "{err}");
    let hot = SpecEngine {
        target: &target,
        draft: Some(&draft),
        taps,
        config: SpecConfig {
            sampling: SamplingParams {
                temperature: -1.0,
                top_p: 1.0,
                top_k: 0,
            },
            ..SpecConfig::chain(3)
        },
    };
    let err = hot.generate(&[vec![1]], 4, &[]).unwrap_err().to_string();
    assert!(err.contains("temperature"), "{err}");
}

/// The serving pattern: requests join a running batch between rounds, leave when done or
/// cancelled, and a small cache forces compaction (and ends one sequence for a full context).
/// Every finished greedy sequence still equals target-only greedy output.
#[test]
fn requests_join_and_leave_a_running_batch() {
    use tandem_infer::{Finish, Request};
    let (target, draft, taps) = setup("running-batch");
    let engine = SpecEngine {
        target: &target,
        draft: Some(&draft),
        taps,
        config: SpecConfig {
            num_steps: 3,
            topk: 2,
            num_draft_tokens: 5,
            sampling: SamplingParams::greedy(),
            seed: 0,
        },
    };
    let request = |id: u64, prompt: Vec<u32>, max_new_tokens: usize| Request {
        id,
        prompt,
        max_new_tokens,
        stop_ids: Vec::new(),
        sampling: SamplingParams::greedy(),
        seed: id,
    };
    let capacity = 40;
    let mut batch = engine.new_batch(capacity);
    let mut streamed: std::collections::BTreeMap<u64, Vec<u32>> = Default::default();
    let mut finished = std::collections::BTreeMap::new();
    let mut record = |progress: Vec<tandem_infer::Progress>| {
        for p in progress {
            streamed.entry(p.id).or_default().extend(&p.tokens);
            if let Some(out) = p.finished {
                finished.insert(p.id, out);
            }
        }
    };
    let prompts = [
        vec![3u32, 14, 15, 92, 65],
        vec![2u32, 71, 82],
        vec![9u32, 26, 53, 58, 79, 93, 23],
        vec![5u32, 8],
    ];
    record(
        engine
            .admit(&mut batch, vec![request(0, prompts[0].clone(), 12)])
            .unwrap(),
    );
    record(engine.step(&mut batch).unwrap());
    record(
        engine
            .admit(
                &mut batch,
                vec![
                    request(1, prompts[1].clone(), 30),
                    request(2, prompts[2].clone(), 200),
                ],
            )
            .unwrap(),
    );
    assert_eq!(batch.ids(), vec![0, 1, 2]);
    for _ in 0..2 {
        record(engine.step(&mut batch).unwrap());
    }
    let cancelled = engine
        .cancel(&mut batch, 1)
        .unwrap()
        .expect("request 1 is running");
    assert!(!cancelled.tokens.is_empty());
    record(
        engine
            .admit(&mut batch, vec![request(3, prompts[3].clone(), 8)])
            .unwrap(),
    );
    // A duplicate id and an over-long prompt are refused without touching the batch.
    let before = batch.ids();
    assert!(
        engine
            .admit(&mut batch, vec![request(3, vec![1], 4)])
            .is_err()
    );
    assert!(
        engine
            .admit(&mut batch, vec![request(9, vec![1; capacity], 4)])
            .is_err()
    );
    assert_eq!(batch.ids(), before);
    while !batch.is_empty() {
        record(engine.step(&mut batch).unwrap());
    }
    assert!(
        batch.compactions > 0,
        "the small cache must have been compacted"
    );

    for id in [0u64, 3] {
        let out = &finished[&id];
        let expected =
            target_greedy(&target, &prompts[id as usize], out.tokens.len(), &[]).unwrap();
        assert_eq!(out.finish, Finish::Length, "request {id}");
        assert_eq!(out.tokens, expected, "request {id}");
        assert_eq!(streamed[&id], out.tokens, "streamed pieces of request {id}");
    }
    // Request 2 wanted 200 tokens in 40 columns: it ends for a full context, its tokens still
    // equal target greedy output, and it reached as far as one more round could not fit.
    let out = &finished[&2];
    assert_eq!(out.finish, Finish::ContextFull);
    let expected = target_greedy(&target, &prompts[2], out.tokens.len(), &[]).unwrap();
    assert_eq!(out.tokens, expected);
    assert!(prompts[2].len() + out.tokens.len() + 5 > capacity);
    assert!(
        !finished.contains_key(&1),
        "a cancelled request does not finish"
    );
}

/// The target-only baseline (the engine without a head) has the same running-batch behaviour:
/// joins, leaves, compaction, and greedy output equal to plain generation.
#[test]
fn target_only_batch_joins_and_leaves() {
    use tandem_infer::{Finish, Request};
    let (target, _, _) = setup("plain-batch");
    let engine = SpecEngine {
        target: &target,
        draft: None,
        taps: TapRequest::none(),
        config: SpecConfig::chain(3),
    };
    let request = |id: u64, prompt: Vec<u32>, max_new_tokens: usize| Request {
        id,
        prompt,
        max_new_tokens,
        stop_ids: Vec::new(),
        sampling: SamplingParams::greedy(),
        seed: id,
    };
    let prompts = [
        vec![3u32, 14, 15, 92, 65],
        vec![2u32, 71, 82],
        vec![7u32; 9],
    ];
    let mut batch = engine.new_batch(24);
    let mut finished = std::collections::BTreeMap::new();
    let mut record = |progress: Vec<tandem_infer::Progress>| {
        for p in progress {
            if let Some(out) = p.finished {
                finished.insert(p.id, out);
            }
        }
    };
    record(
        engine
            .admit(&mut batch, vec![request(0, prompts[0].clone(), 10)])
            .unwrap(),
    );
    for _ in 0..3 {
        record(engine.step(&mut batch).unwrap());
    }
    record(
        engine
            .admit(
                &mut batch,
                vec![
                    request(1, prompts[1].clone(), 12),
                    request(2, prompts[2].clone(), 100),
                ],
            )
            .unwrap(),
    );
    while !batch.is_empty() {
        record(engine.step(&mut batch).unwrap());
    }
    assert!(batch.compactions > 0);
    for id in 0..3u64 {
        let out = &finished[&id];
        let expected =
            target_greedy(&target, &prompts[id as usize], out.tokens.len(), &[]).unwrap();
        assert_eq!(out.tokens, expected, "request {id}");
    }
    assert_eq!(finished[&2].finish, Finish::ContextFull);
    assert_eq!(finished[&0].tokens.len(), 10);
}

/// One greedy request per prompt, ids `0..`, each with its own budget of `max_new_tokens`.
fn greedy_requests(prompts: &[Vec<u32>], max_new_tokens: usize) -> Vec<tandem_infer::Request> {
    prompts
        .iter()
        .enumerate()
        .map(|(i, p)| tandem_infer::Request {
            id: i as u64,
            prompt: p.clone(),
            max_new_tokens,
            stop_ids: Vec::new(),
            sampling: SamplingParams::greedy(),
            seed: 0,
        })
        .collect()
}

/// The speculation policy on burn (the one driver gives every backend its plain rounds, the
/// deferred head extension and the calibration): the measured table prices a switch, prompts
/// joining a batch that is expected to run plain rounds defer their head extension, and with
/// probes forcing drafted rounds (and their catch-ups) in between, greedy output still equals
/// target-only greedy output token for token.
#[test]
fn adaptive_policy_rounds_keep_greedy_output_exact_on_burn() {
    use tandem_infer::{Choice, CostTable, PolicyConfig, Shape, SpeculationPolicy};

    let (target, draft, taps) = setup("adaptive");
    let engine = SpecEngine {
        target: &target,
        draft: Some(&draft),
        taps,
        config: SpecConfig::chain(3),
    };
    let shapes = vec![Shape::parse("3/1/4").unwrap()];
    let mut batch = engine.new_batch_with_policy(
        256,
        SpeculationPolicy::forced(shapes.clone(), Choice::Plain),
    );
    let measured = engine.calibrate(&mut batch, &[1, 2]).unwrap();
    assert!(batch.is_empty());
    assert_eq!(measured.columns.len(), 2, "two contexts measured");
    let switch = measured.switch_per_step.expect("a catch-up was timed");
    assert!(switch > 0.0 && switch < 1.0, "{switch}");
    // A catch-up takes no more pieces than steps, so a piece costs at least a step.
    let per_piece = measured.switch_per_piece.expect("a catch-up was timed");
    assert!(
        per_piece >= switch && per_piece < 1.0,
        "{per_piece} per piece, {switch} per step"
    );

    // Drafting priced far above plain rounds: every round is plain but for a probe every
    // fourth, which catches the head up first.
    let costly = CostTable::flat(vec![1, 4], vec![vec![1e-3, 1e-3], vec![1.0, 1.0]]);
    let config = PolicyConfig {
        probe_every: 4,
        // Probes every 4 plain rounds whatever they cost (the rounds this test needs).
        probe_budget: None,
        ..PolicyConfig::default()
    };
    batch.policy = SpeculationPolicy::adaptive(shapes, costly, config).unwrap();
    let prompts = [vec![3u32, 14, 15, 92, 65], vec![2u32, 71, 82]];
    let requests = greedy_requests(&prompts, 20);
    let mut tokens: Vec<Vec<u32>> = vec![Vec::new(); prompts.len()];
    let mut keep = |progress: Vec<tandem_infer::Progress>| {
        for p in progress {
            tokens[p.id as usize].extend(&p.tokens);
        }
    };
    keep(engine.admit(&mut batch, requests).unwrap());
    // Both prompts wait for a catch-up: every prompt token but the first, and the first
    // generated token.
    assert_eq!(batch.deferred_rounds(), 5);
    while !batch.is_empty() {
        keep(engine.step(&mut batch).unwrap());
    }
    let rounds = batch.policy.rounds();
    assert!(
        rounds.iter().any(|(l, n)| l == "none" && *n > 0)
            && rounds.iter().any(|(l, n)| l == "3/1/4" && *n > 0),
        "{rounds:?}"
    );
    for (i, prompt) in prompts.iter().enumerate() {
        let expected = target_greedy(&target, prompt, 20, &[]).unwrap();
        assert_eq!(tokens[i], expected, "prompt {i}");
    }
}

/// A catch-up extends the head over each row's last `catch_up_tail` deferred tokens only: after
/// the same plain run the head's cache grows by the tail, not by the whole run as with
/// `catch_up_tail: None`, the switch is priced by the tail, and the drafted rounds after it
/// still give exactly the target's greedy output.
#[test]
fn a_tail_catch_up_extends_the_head_over_the_last_deferred_tokens_only() {
    use tandem_infer::{Choice, Shape, SpeculationPolicy};

    let (target, draft, taps) = setup("tail");
    let engine = SpecEngine {
        target: &target,
        draft: Some(&draft),
        taps,
        config: SpecConfig::chain(3),
    };
    let shapes = vec![Shape::parse("3/1/4").unwrap()];
    let prompts = [vec![3u32, 14, 15, 92, 65], vec![2u32, 71, 82]];
    let mut grown = Vec::new();
    let mut deferred_runs = Vec::new();
    for tail in [None, Some(2)] {
        let mut batch = engine.new_batch_with_policy(
            256,
            SpeculationPolicy::forced(shapes.clone(), Choice::Plain),
        );
        batch.catch_up_tail = tail;
        let mut tokens: Vec<Vec<u32>> = vec![Vec::new(); prompts.len()];
        let mut keep = |progress: Vec<tandem_infer::Progress>| {
            for p in progress {
                tokens[p.id as usize].extend(&p.tokens);
            }
        };
        keep(
            engine
                .admit(&mut batch, greedy_requests(&prompts, 20))
                .unwrap(),
        );
        for _ in 0..6 {
            keep(engine.step(&mut batch).unwrap());
        }
        let deferred = batch.deferred_rounds();
        assert!(deferred >= 6, "six plain rounds deferred, got {deferred}");
        assert_eq!(
            batch.catch_up_rounds(),
            tail.map_or(deferred, |t| deferred.min(t))
        );
        let before = batch.head_columns();
        engine.catch_up(&mut batch).unwrap();
        assert_eq!(batch.deferred_rounds(), 0);
        grown.push(batch.head_columns() - before);
        deferred_runs.push(deferred);
        batch.policy.force(Choice::Draft(0));
        while !batch.is_empty() {
            keep(engine.step(&mut batch).unwrap());
        }
        for (i, prompt) in prompts.iter().enumerate() {
            let expected = target_greedy(&target, prompt, 20, &[]).unwrap();
            assert_eq!(tokens[i], expected, "tail {tail:?}, prompt {i}");
        }
    }
    assert_eq!(deferred_runs[0], deferred_runs[1], "the same plain run");
    assert_eq!(
        grown,
        vec![deferred_runs[0], 2],
        "head columns a catch-up added"
    );
}

/// A long plain run forgets its oldest deferred tokens (keeping each row's last few) instead of
/// catching the head up on all of them: the deferral stays bounded, the head's cache gets a gap,
/// and the drafted rounds that follow still give exactly the target's greedy output.
#[test]
fn forgetting_old_deferred_tokens_keeps_greedy_output_exact() {
    use tandem_infer::{CostTable, PolicyConfig, Shape, SpeculationPolicy};

    let (target, draft, taps) = setup("forget");
    let engine = SpecEngine {
        target: &target,
        draft: Some(&draft),
        taps,
        config: SpecConfig::chain(3),
    };
    // Plain rounds but for a probe every twelfth, which catches up on what is left.
    let costly = CostTable::flat(vec![1, 4], vec![vec![1e-3, 1e-3], vec![1.0, 1.0]]);
    let config = PolicyConfig {
        probe_every: 12,
        // Probes every 12 plain rounds whatever they cost (the rounds this test needs).
        probe_budget: None,
        ..PolicyConfig::default()
    };
    let policy =
        SpeculationPolicy::adaptive(vec![Shape::parse("3/1/4").unwrap()], costly, config).unwrap();
    let mut batch = engine.new_batch_with_policy(256, policy);
    batch.max_deferred = 6;
    batch.deferred_keep = 3;
    let prompts = [vec![3u32, 14, 15, 92, 65, 35, 89], vec![2u32, 71, 82]];
    let requests = greedy_requests(&prompts, 40);
    let mut tokens: Vec<Vec<u32>> = vec![Vec::new(); prompts.len()];
    let mut keep = |progress: Vec<tandem_infer::Progress>| {
        for p in progress {
            tokens[p.id as usize].extend(&p.tokens);
        }
    };
    keep(engine.admit(&mut batch, requests).unwrap());
    let mut most = 0;
    while !batch.is_empty() {
        keep(engine.step(&mut batch).unwrap());
        most = most.max(batch.deferred_rounds());
    }
    assert!(most <= 6, "deferred {most}");
    let drafted = batch
        .policy
        .rounds()
        .iter()
        .find(|(l, _)| l == "3/1/4")
        .map_or(0, |(_, n)| *n);
    assert!(drafted >= 2, "{:?}", batch.policy.rounds());
    for (i, prompt) in prompts.iter().enumerate() {
        let expected = target_greedy(&target, prompt, 40, &[]).unwrap();
        assert_eq!(tokens[i], expected, "prompt {i}");
    }
}

/// What a round or an admission streamed: each request's id, new tokens and acceptance.
fn summary(progress: Vec<tandem_infer::Progress>) -> Vec<(u64, Vec<u32>, Option<usize>)> {
    progress
        .into_iter()
        .map(|p| (p.id, p.tokens, p.accepted))
        .collect()
}

/// The head's roots of two batches that ran the same requests agree to 1e-5 of their largest
/// value (the head's hidden state at each row's last accepted slot depends on every key kept in
/// its cache).
fn assert_head_roots_agree(
    engine: &SpecEngine<'_, B>,
    got: &tandem_infer::RunningBatch<TargetModel<B>>,
    want: &tandem_infer::RunningBatch<TargetModel<B>>,
    round: usize,
) {
    let got = engine.head_roots(got).unwrap().unwrap_or_default();
    let want = engine.head_roots(want).unwrap().unwrap_or_default();
    assert_eq!(got.len(), want.len(), "round {round}");
    let scale = want.iter().fold(1e-6f32, |m, v| m.max(v.abs()));
    let worst = got
        .iter()
        .zip(&want)
        .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
    assert!(
        worst <= 1e-5 * scale,
        "round {round}: head roots differ by {worst} (largest {scale})"
    );
}

/// The head's extend queued over the whole verified chain before the host reads the
/// verification (`RunningBatch::early_extend`, the tokens being the target's greedy ids) leaves
/// what the extend over the accepted tokens leaves. Two batches of the same prompts run in
/// lockstep, one each way, with partial acceptance rigged as above (the head always proposes
/// token 0; the target emits it in runs): every round must stream the same tokens with the same
/// acceptance, and the head's roots (its hidden state at each row's last accepted slot, which
/// depends on every key kept in its cache) must agree.
#[test]
fn early_extend_over_the_whole_chain_leaves_what_the_accepted_extend_leaves() {
    let (mut target, mut draft, taps) = setup("early-extend");
    rig_partial_acceptance(&mut target, &mut draft);
    let engine = SpecEngine {
        target: &target,
        draft: Some(&draft),
        taps,
        config: SpecConfig::chain(4),
    };
    let prompts = [
        vec![9u32, 4, 33],
        vec![61u32, 2, 2, 8, 90, 17],
        vec![5u32, 0, 7, 7],
    ];
    let mut early = engine.new_batch(128);
    early.early_extend = true;
    let mut exact = engine.new_batch(128);
    exact.early_extend = false;
    early.record_rounds();
    exact.record_rounds();
    assert_eq!(
        summary(
            engine
                .admit(&mut early, greedy_requests(&prompts, 36))
                .unwrap()
        ),
        summary(
            engine
                .admit(&mut exact, greedy_requests(&prompts, 36))
                .unwrap()
        )
    );
    let (mut rounds, mut partial, mut accepted) = (0, 0, 0);
    while !exact.is_empty() {
        let got = summary(engine.step(&mut early).unwrap());
        let want = summary(engine.step(&mut exact).unwrap());
        assert_eq!(got, want, "round {rounds}");
        for (_, _, a) in &want {
            let a = a.expect("every round drafts");
            accepted += a;
            partial += usize::from(a > 0 && a < 4);
        }
        assert_head_roots_agree(&engine, &early, &exact, rounds);
        rounds += 1;
    }
    assert!(early.is_empty(), "both batches finish in the same round");
    // The same columns in use in both caches at every round: the rejected tail of each early
    // extend is forgotten, not left as holes.
    let columns = |b: &tandem_infer::RunningBatch<_>| -> Vec<(usize, usize)> {
        b.round_records()
            .iter()
            .filter(|r| r.kind == "round")
            .map(|r| (r.target_columns, r.head_columns))
            .collect()
    };
    assert_eq!(columns(&early), columns(&exact));
    assert!(
        accepted >= 5 && partial >= 2,
        "acceptance must be partial in places: {accepted} accepted, {partial} partial rounds"
    );
}

/// Rows leaving during plain rounds move out of the head's cache and roots only when the head
/// is next read (`RunningBatch::lazy_head`): two batches of the same requests in lockstep, one
/// retiring the head's rows lazily and one at once, under a policy of plain rounds with a
/// drafted probe every fourth, with budgets that end rows in different rounds and a second join
/// part-way. Every round must stream the same tokens with the same acceptance, the head's
/// roots must agree after each round (gathered through the pending rows where they are not yet
/// cut), the lazy batch must have held pending rows across some round, and every output must be
/// the target's greedy output.
#[test]
fn retiring_the_heads_rows_lazily_leaves_what_retiring_them_at_once_leaves() {
    use tandem_infer::{CostTable, PolicyConfig, Shape, SpeculationPolicy};

    let (target, draft, taps) = setup("lazy-head");
    let engine = SpecEngine {
        target: &target,
        draft: Some(&draft),
        taps,
        config: SpecConfig::chain(3),
    };
    let policy = || {
        let costly = CostTable::flat(vec![1, 4], vec![vec![1e-3, 1e-3], vec![1.0, 1.0]]);
        let config = PolicyConfig {
            probe_every: 4,
            // Probes every 4 plain rounds whatever they cost (the rounds this test needs).
            probe_budget: None,
            ..PolicyConfig::default()
        };
        SpeculationPolicy::adaptive(vec![Shape::parse("3/1/4").unwrap()], costly, config).unwrap()
    };
    let mut lazy = engine.new_batch_with_policy(256, policy());
    lazy.lazy_head = true;
    let mut eager = engine.new_batch_with_policy(256, policy());
    eager.lazy_head = false;
    let prompts = [
        vec![3u32, 14, 15, 92, 65],
        vec![2u32, 71, 82],
        vec![27u32, 18, 28, 18, 28, 45],
        vec![11u32, 5],
        vec![40u32, 41, 42, 43],
        vec![8u32, 1, 9],
    ];
    let budgets = [5usize, 6, 7, 8, 7, 12];
    let requests = |ids: std::ops::Range<usize>| -> Vec<tandem_infer::Request> {
        let mut all = greedy_requests(&prompts, 0);
        for (r, &n) in all.iter_mut().zip(&budgets) {
            r.max_new_tokens = n;
        }
        all[ids].to_vec()
    };
    let mut tokens: Vec<Vec<u32>> = vec![Vec::new(); prompts.len()];
    let admit = |ids: std::ops::Range<usize>,
                 lazy: &mut tandem_infer::RunningBatch<_>,
                 eager: &mut tandem_infer::RunningBatch<_>| {
        let got = summary(engine.admit(lazy, requests(ids.clone())).unwrap());
        let want = summary(engine.admit(eager, requests(ids)).unwrap());
        assert_eq!(got, want, "admission");
        want
    };
    for (id, t, _) in admit(0..4, &mut lazy, &mut eager) {
        tokens[id as usize].extend(t);
    }
    let (mut rounds, mut pending_rounds) = (0, 0);
    while !eager.is_empty() {
        if rounds == 6 {
            for (id, t, _) in admit(4..6, &mut lazy, &mut eager) {
                tokens[id as usize].extend(t);
            }
        }
        let got = summary(engine.step(&mut lazy).unwrap());
        let want = summary(engine.step(&mut eager).unwrap());
        assert_eq!(got, want, "round {rounds}");
        for (id, t, _) in want {
            tokens[id as usize].extend(t);
        }
        assert!(!eager.head_retire_pending(), "round {rounds}");
        pending_rounds += usize::from(lazy.head_retire_pending());
        assert_head_roots_agree(&engine, &lazy, &eager, rounds);
        rounds += 1;
    }
    assert!(lazy.is_empty(), "both batches finish in the same round");
    assert!(
        pending_rounds >= 2,
        "{pending_rounds} rounds left rows pending"
    );
    for (i, prompt) in prompts.iter().enumerate() {
        let expected = target_greedy(&target, prompt, budgets[i], &[]).unwrap();
        assert_eq!(tokens[i], expected, "prompt {i}");
    }
}

/// A join of ragged prompts prefilled in groups of similar length
/// (`RunningBatch::prefill_group_slots`): with a fixed cost of 4 slots a prefill, prompts of 30,
/// 3, 4 and 28 tokens are cut into {30, 28} and {4, 3} (76 padded-and-fixed slots against 124
/// for one prefill), so the batch holds them longest group first; the progress still comes back
/// in the requests' order, and every sequence's greedy output equals target-only greedy output.
#[test]
fn a_ragged_join_prefilled_in_groups_keeps_greedy_output_exact() {
    let (target, draft, taps) = setup("prefill-groups");
    let engine = SpecEngine {
        target: &target,
        draft: Some(&draft),
        taps,
        config: SpecConfig::chain(3),
    };
    let prompts: Vec<Vec<u32>> = [30usize, 3, 4, 28]
        .iter()
        .enumerate()
        .map(|(i, &n)| (0..n).map(|t| ((t * 7 + i * 13) % 90 + 1) as u32).collect())
        .collect();
    let mut batch = engine.new_batch(96);
    batch.prefill_group_slots = Some(4);
    let first = engine
        .admit(&mut batch, greedy_requests(&prompts, 10))
        .unwrap();
    assert_eq!(
        first.iter().map(|p| p.id).collect::<Vec<_>>(),
        vec![0, 1, 2, 3]
    );
    assert_eq!(batch.ids(), vec![0, 3, 2, 1], "two groups, longest first");
    let mut outputs: std::collections::BTreeMap<u64, Vec<u32>> = Default::default();
    let mut record = |progress: Vec<tandem_infer::Progress>| {
        for p in progress {
            outputs.entry(p.id).or_default().extend(&p.tokens);
        }
    };
    record(first);
    while !batch.is_empty() {
        record(engine.step(&mut batch).unwrap());
    }
    for (id, prompt) in prompts.iter().enumerate() {
        let expected = target_greedy(&target, prompt, 10, &[]).unwrap();
        assert_eq!(outputs[&(id as u64)], expected, "request {id}");
    }
}

/// The calibration prices one plain decode step whatever the plain rounds' lookahead: a round
/// of four steps timed as one priced a plain token four times too dear, and a server
/// with `TANDEM_PLAIN_LOOKAHEAD=4` then drafted at every concurrency (session 50, H100: c=64
/// 0.77x target-only). The plain price over the chain's, measured with lookahead 1 and 4 on
/// the same engine, must agree within a factor of 2 (the chain's round is the same in both:
/// it normalises the machine's speed; the bug gives about 4).
#[test]
fn calibration_prices_a_plain_step_whatever_the_lookahead() {
    use tandem_infer::{Choice, Shape, SpeculationPolicy};
    let (target, draft, taps) = setup("calibration-lookahead");
    let engine = SpecEngine {
        target: &target,
        draft: Some(&draft),
        taps,
        config: SpecConfig::chain(3),
    };
    let shapes = vec![Shape::parse("3/1/4").unwrap()];
    let plain_over_chain = |lookahead: usize| {
        let mut batch = engine.new_batch_with_policy(
            256,
            SpeculationPolicy::forced(shapes.clone(), Choice::Plain),
        );
        batch.plain_lookahead = lookahead;
        let costs = engine.calibrate(&mut batch, &[1]).unwrap();
        costs.at(0, 1, 32) / costs.at(1, 1, 32)
    };
    // Wall-clock prices on a shared CI machine are noisy (a single pair once measured 2.75):
    // the median of three calibrations of each lookahead.
    let median_of_three = |lookahead: usize| {
        let mut ratios = [0.0f64; 3];
        for ratio in &mut ratios {
            *ratio = plain_over_chain(lookahead);
        }
        ratios.sort_by(f64::total_cmp);
        ratios[1]
    };
    let one = median_of_three(1);
    let four = median_of_three(4);
    assert!(
        four / one < 2.0 && four / one > 0.5,
        "plain price over the chain's: {one:.3} one step a round, {four:.3} four"
    );
}

/// Plain rounds with a lookahead ([`tandem_infer::RunningBatch::plain_lookahead`]): a round
/// queues up to four decode steps, each later one fed the previous step's greedy ids, and
/// streams what it committed at once. Against the same requests decoded one step a round: the
/// same tokens and finishes for a request admitted alone, two that join it later, one that
/// stops on a stop id inside a round (its later steps' tokens dropped) and one that fills the
/// cache; no request runs past its `max_new_tokens`; and rounds did stream several tokens.
#[test]
fn plain_rounds_with_a_lookahead_stream_the_tokens_of_one_step_rounds() {
    use tandem_infer::{Finish, Request};
    let (target, _, _) = setup("lookahead");
    let engine = SpecEngine {
        target: &target,
        draft: None,
        taps: TapRequest::none(),
        config: SpecConfig::chain(3),
    };
    let prompts = [
        vec![3u32, 14, 15, 92, 65],
        vec![2u32, 71, 82],
        vec![7u32; 9],
    ];
    let greedy: Vec<Vec<u32>> = prompts
        .iter()
        .map(|p| target_greedy(&target, p, 40, &[]).unwrap())
        .collect();
    // Request 1 stops at the first token of its greedy output, from the fourth on, that it
    // has not produced before: mid-round with a lookahead of four.
    let stop_at = (3..greedy[1].len())
        .find(|&i| !greedy[1][..i].contains(&greedy[1][i]))
        .expect("a fresh token in the greedy output");
    let stop = greedy[1][stop_at];
    let request = |id: u64, max_new_tokens: usize, stop_ids: Vec<u32>| Request {
        id,
        prompt: prompts[id as usize].clone(),
        max_new_tokens,
        stop_ids,
        sampling: SamplingParams::greedy(),
        seed: id,
    };
    let run = |lookahead: usize| {
        let mut batch = engine.new_batch(40);
        batch.plain_lookahead = lookahead;
        let mut finished = std::collections::BTreeMap::new();
        let mut streamed: std::collections::BTreeMap<u64, Vec<u32>> = Default::default();
        let mut most = 0;
        let mut record = |progress: Vec<tandem_infer::Progress>| {
            for p in progress {
                most = most.max(p.tokens.len());
                streamed.entry(p.id).or_default().extend(&p.tokens);
                if let Some(out) = p.finished {
                    finished.insert(p.id, out);
                }
            }
        };
        record(
            engine
                .admit(&mut batch, vec![request(0, 10, Vec::new())])
                .unwrap(),
        );
        for _ in 0..2 {
            record(engine.step(&mut batch).unwrap());
        }
        record(
            engine
                .admit(
                    &mut batch,
                    vec![request(1, 30, vec![stop]), request(2, 100, Vec::new())],
                )
                .unwrap(),
        );
        while !batch.is_empty() {
            record(engine.step(&mut batch).unwrap());
        }
        (finished, streamed, most)
    };
    let (one, one_streamed, one_most) = run(1);
    let (four, four_streamed, four_most) = run(4);
    assert_eq!(one_most, 1, "one step a round streams a token at a time");
    assert_eq!(four_most, 4, "rounds of four steps stream four tokens");
    for id in 0..3u64 {
        assert_eq!(four[&id].tokens, one[&id].tokens, "request {id}");
        assert_eq!(four[&id].finish, one[&id].finish, "request {id}");
        assert_eq!(
            four_streamed[&id], four[&id].tokens,
            "request {id} streamed"
        );
        assert_eq!(one_streamed[&id], one[&id].tokens, "request {id} streamed");
        let n = four[&id].tokens.len();
        assert_eq!(four[&id].tokens, greedy[id as usize][..n], "request {id}");
    }
    assert_eq!(
        (four[&0].tokens.len(), four[&0].finish),
        (10, Finish::Length)
    );
    assert_eq!(four[&1].finish, Finish::Stop);
    assert_eq!(four[&1].tokens, greedy[1][..stop_at]);
    assert_eq!(four[&2].finish, Finish::ContextFull);
}

/// A head's engine with plain rounds of three steps (their taps into the backlog step by step)
/// defers the head over the same tokens and taps as six one-step rounds: after the same six
/// plain steps both batches have the same deferral, and the catch-up over it leaves the same
/// head roots (the head's hidden state at each row's last token, which depends on every tap it
/// read); drafted rounds after it still give exactly the target's greedy output.
#[test]
fn lookahead_plain_rounds_defer_the_heads_tokens_as_one_step_rounds_do() {
    use tandem_infer::{Choice, Shape, SpeculationPolicy};

    let (target, draft, taps) = setup("lookahead-head");
    let engine = SpecEngine {
        target: &target,
        draft: Some(&draft),
        taps,
        config: SpecConfig::chain(3),
    };
    let shapes = vec![Shape::parse("3/1/4").unwrap()];
    let prompts = [vec![3u32, 14, 15, 92, 65], vec![2u32, 71, 82]];
    let mut batches = Vec::new();
    let mut outputs = Vec::new();
    for (lookahead, rounds) in [(1, 6), (3, 2)] {
        let mut batch = engine.new_batch_with_policy(
            256,
            SpeculationPolicy::forced(shapes.clone(), Choice::Plain),
        );
        batch.catch_up_tail = None;
        batch.plain_lookahead = lookahead;
        let mut tokens: Vec<Vec<u32>> = vec![Vec::new(); prompts.len()];
        let mut most = 0;
        let mut keep = |progress: Vec<tandem_infer::Progress>| {
            for p in progress {
                most = most.max(p.tokens.len());
                tokens[p.id as usize].extend(&p.tokens);
            }
        };
        keep(
            engine
                .admit(&mut batch, greedy_requests(&prompts, 30))
                .unwrap(),
        );
        for _ in 0..rounds {
            keep(engine.step(&mut batch).unwrap());
        }
        assert_eq!(most, lookahead, "tokens a plain round streamed");
        outputs.push(tokens);
        batches.push(batch);
    }
    assert_eq!(outputs[0], outputs[1], "six plain steps either way");
    assert_eq!(batches[0].deferred_rounds(), batches[1].deferred_rounds());
    for batch in &mut batches {
        engine.catch_up(batch).unwrap();
        assert_eq!(batch.deferred_rounds(), 0);
    }
    assert_eq!(batches[0].head_columns(), batches[1].head_columns());
    assert_head_roots_agree(&engine, &batches[1], &batches[0], 6);
    for (batch, tokens) in batches.iter_mut().zip(&mut outputs) {
        batch.policy.force(Choice::Draft(0));
        while !batch.is_empty() {
            for p in engine.step(batch).unwrap() {
                tokens[p.id as usize].extend(&p.tokens);
            }
        }
        for (i, prompt) in prompts.iter().enumerate() {
            let expected = target_greedy(&target, prompt, 30, &[]).unwrap();
            assert_eq!(tokens[i], expected, "prompt {i}");
        }
    }
}
