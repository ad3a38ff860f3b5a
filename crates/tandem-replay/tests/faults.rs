//! The fault suite: for each single-machine failure mode of `eagle3-facts.md` section 6, the
//! test produces the faulty artefact itself (a dump whose data or manifest is wrong, a model
//! with another fingerprint, a head wired elsewhere) and asserts that replay names the fault.
//! The product paths have no option to produce any of these.

mod common;

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use common::*;
use tandem_dump::{DumpManifest, DumpReader, DumpRecord, DumpWriter, ShardLimits};
use tandem_eagle::{Eagle3Config, EagleConfig};
use tandem_model::burn::prelude::*;
use tandem_model::testing::{rel_l2, tiny_config};
use tandem_model::{Execution, LogitsFor, TapRequest, TargetModel};
use tandem_replay::{
    Candidate, HeadWiring, Level, ReplayOptions, ReplayReport, Status, fingerprint_model, replay,
};
use tandem_wiring::{Convention, RawIds, TapId};

fn default_taps() -> Vec<TapId> {
    blocks(&[1, 3, 4])
}

fn sglang_raw() -> RawIds {
    RawIds::new(Convention::SglangHeuristic, vec![1, 3, 4])
}

#[test]
fn a_consistent_dump_matches_every_slot() {
    let dir = tap_dump(
        "clean",
        &default_taps(),
        Some(sglang_raw()),
        &default_taps(),
    );
    let report = run_replay(&dir, None);
    assert!(report.ok(), "{:?}", report.problems());
    for s in &report.slots {
        assert_eq!(s.status, Status::Match, "{}", s.verdict);
        assert_eq!(s.verdict, "match");
        assert_eq!(s.observed, Some(Candidate::Tap(default_taps()[s.slot])));
        let best = s.best.unwrap();
        assert!(best.cosine > 0.9999 && best.rel_err < 5e-3, "{best:?}");
        assert!(!s.normed);
    }
    assert_eq!(report.samples, 3);
    assert_eq!(report.tokens, 65);
    let lh = report.last_hidden.as_ref().unwrap();
    assert_eq!(lh.status, Status::Match);
    // The report renders; the HTML is self-contained.
    let html = report.to_html();
    assert!(html.starts_with("<!DOCTYPE html>") && html.contains("<style>"));
    assert!(!html.contains("http://") && !html.contains("https://") && !html.contains("<script"));
    let json: serde_json::Value = serde_json::from_str(&report.to_json()).unwrap();
    assert_eq!(json["slots"][0]["verdict"], "match");
    assert_eq!(json["slots"][0]["observed"], "block:1");
}

/// (a) Layer-id convention mismatch / off-by-one: the manifest says [1, 3, 4] (requested as
/// SGLang ids) but the data holds [2, 4, 5], as when vLLM/HF-style ids reach a loop that reads
/// them as SGLang ids; and the other direction, the SGLang ids read as vLLM ids.
#[test]
fn a_off_by_one_is_named_with_the_conventions_that_produce_it() {
    let dir = tap_dump(
        "plus-one",
        &default_taps(),
        Some(sglang_raw()),
        &blocks(&[2, 4, 5]),
    );
    let report = run_replay(&dir, None);
    assert!(!report.ok());
    assert_eq!(report.mismatched_slots().len(), 3);
    let v0 = &report.slots[0].verdict;
    assert!(
        v0.starts_with("dump slot 0 holds block 2 but the manifest says block 1: off by +1 block"),
        "{v0}"
    );
    assert!(v0.contains("read as a sglang-classic"), "{v0}");
    assert!(v0.contains("vllm"), "{v0}");
    let text = all_text(&report);
    assert!(text.contains("every slot holds the tap +1 block"), "{text}");
    assert!(
        text.contains("ids [2, 4, 5] mean [block 1, block 3, block 4] in hf/vllm/eagle"),
        "{text}"
    );

    let dir = tap_dump(
        "minus-one",
        &default_taps(),
        Some(sglang_raw()),
        &blocks(&[0, 2, 3]),
    );
    let report = run_replay(&dir, None);
    let v1 = &report.slots[1].verdict;
    assert!(
        v1.starts_with("dump slot 1 holds block 2 but the manifest says block 3: off by -1 block"),
        "{v1}"
    );
    // The recorded ids, read as vLLM ids, give exactly the data's taps.
    assert!(v1.contains("a sglang-heuristic"), "{v1}");
    let text = all_text(&report);
    assert!(
        text.contains("ids [1, 3, 4] mean [block 1, block 3, block 4] in sglang-heuristic")
            && text.contains("read as hf/vllm/eagle"),
        "{text}"
    );
}

/// (b) Trained on [embed, a, b], declared [a, b, c] (and the reverse).
#[test]
fn b_missing_or_extra_embedding_tap() {
    let with_embed = [TapId::Embed, TapId::Block(1), TapId::Block(3)];
    let dir = tap_dump("extra-embed", &default_taps(), None, &with_embed);
    let report = run_replay(&dir, None);
    assert!(!report.ok());
    let v0 = &report.slots[0].verdict;
    assert!(
        v0.starts_with("dump slot 0 holds embed but the manifest says block 1: an embedding tap"),
        "{v0}"
    );
    let text = all_text(&report);
    assert!(text.contains("extra embedding tap"), "{text}");
    assert!(text.contains("moved one slot later"), "{text}");

    let dir = tap_dump("missing-embed", &with_embed, None, &default_taps());
    let report = run_replay(&dir, None);
    let text = all_text(&report);
    assert!(text.contains("missing embedding tap"), "{text}");
    assert!(
        report.slots[0]
            .verdict
            .starts_with("dump slot 0 holds block 1 but the manifest says embed"),
        "{}",
        report.slots[0].verdict
    );
}

/// (c) Slots permuted: the data holds [3, 1, 4] under a manifest saying [1, 3, 4].
#[test]
fn c_permuted_slots() {
    let dir = tap_dump("permuted", &default_taps(), None, &blocks(&[3, 1, 4]));
    let report = run_replay(&dir, None);
    assert_eq!(report.mismatched_slots().len(), 2);
    assert_eq!(report.slots[2].status, Status::Match);
    assert!(
        report.slots[0].verdict.starts_with(
            "dump slot 0 holds block 3 but the manifest says block 1: off by +2 blocks"
        ),
        "{}",
        report.slots[0].verdict
    );
    let text = all_text(&report);
    assert!(text.contains("permuted slots"), "{text}");
}

/// (d) An execution path that skips the tap: a slot of zeros, a slot captured for only half of
/// the tokens, a stale value one token late, a value captured once and reused.
#[test]
fn d_skipped_and_stale_taps() {
    let id = identity(&tiny_fingerprint(), &default_taps(), None, HIDDEN);
    let dir = write_dump("zeros", &id, |model, ids| {
        let mut v = tap_values(model, ids, &default_taps());
        v[1].iter_mut().for_each(|x| *x = 0.0);
        v
    });
    let report = run_replay(&dir, None);
    assert_eq!(report.slots[1].status, Status::Mismatch);
    let v = &report.slots[1].verdict;
    assert!(
        v.contains("is all zeros over 65 tokens") && v.contains("skipped the tap"),
        "{v}"
    );
    assert_eq!(report.slots[1].zero_tokens, 65);
    assert_eq!(report.slots[0].status, Status::Match);

    let dir = write_dump("half", &id, |model, ids| {
        let mut v = tap_values(model, ids, &default_taps());
        let half = ids.len() / 2 * HIDDEN;
        v[2][half..].iter_mut().for_each(|x| *x = 0.0);
        v
    });
    let report = run_replay(&dir, None);
    let v = &report.slots[2].verdict;
    assert!(
        v.contains("is zero for") && v.contains("only part of the tokens"),
        "{v}"
    );

    let dir = write_dump("late", &id, |model, ids| {
        let mut v = tap_values(model, ids, &default_taps());
        // Token t carries token t-1's value (token 0 keeps its own).
        let shifted: Vec<f32> = v[0][..HIDDEN]
            .iter()
            .chain(&v[0][..(ids.len() - 1) * HIDDEN])
            .copied()
            .collect();
        v[0] = shifted;
        v
    });
    let report = run_replay(&dir, None);
    let v = &report.slots[0].verdict;
    assert!(
        v.contains("holds block 1 one token late") && v.contains("stale"),
        "{v}"
    );

    let dir = write_dump("reused", &id, |model, ids| {
        let mut v = tap_values(model, ids, &default_taps());
        let first = v[1][..HIDDEN].to_vec();
        v[1] = first.repeat(ids.len());
        v
    });
    let report = run_replay(&dir, None);
    let v = &report.slots[1].verdict;
    assert!(v.contains("same values at every token"), "{v}");
}

/// (e) A normed tap instead of the residual stream: `final` in the last slot, and the normed
/// input of layer 4 (input_layernorm(block 3)) in the middle slot.
#[test]
fn e_normed_instead_of_residual() {
    let id = identity(&tiny_fingerprint(), &default_taps(), None, HIDDEN);
    let dir = write_dump("normed", &id, |model, ids| {
        let mut v = tap_values(
            model,
            ids,
            &[TapId::Block(1), TapId::Block(3), TapId::Final],
        );
        let block3: Tensor<B, 2> = Tensor::from_data(
            TensorData::new(v[1].clone(), [ids.len(), HIDDEN]),
            &Default::default(),
        );
        v[1] = model.layers[4]
            .input_layernorm
            .forward(block3)
            .into_data()
            .to_vec::<f32>()
            .unwrap();
        v
    });
    let report = run_replay(&dir, None);
    let s2 = &report.slots[2];
    assert_eq!(s2.observed, Some(Candidate::Tap(TapId::Final)));
    assert!(s2.normed);
    assert!(
        s2.verdict
            .starts_with("dump slot 2 holds final (the final RMSNorm's output) but the manifest says block 4: the tap is post-norm"),
        "{}",
        s2.verdict
    );
    let s1 = &report.slots[1];
    assert_eq!(s1.observed, Some(Candidate::NormedInput(4)));
    assert!(
        s1.normed && s1.verdict.contains("normed input of layer 4"),
        "{}",
        s1.verdict
    );
    assert!(!report.slots[0].normed);
    // Flat norms are reported: the normed slots' per-token norms barely vary.
    assert!(
        s2.norm_cv < report.slots[0].norm_cv,
        "{} vs {}",
        s2.norm_cv,
        report.slots[0].norm_cv
    );
}

/// (f) Tokenizer or chat-template mismatch: the dump's fingerprint differs from the model's.
#[test]
fn f_tokenizer_and_chat_template_mismatch() {
    let mut other = tiny_fingerprint();
    other.tokenizer_sha256 = tandem_wiring::sha256_hex(b"another tokenizer");
    other.chat_template_sha256 = Some(tandem_wiring::sha256_hex(b"{{ messages }}"));
    let id = identity(&other, &default_taps(), None, HIDDEN);
    let taps = default_taps();
    let dir = write_dump("fingerprint", &id, move |model, ids| {
        tap_values(model, ids, &taps)
    });
    let report = run_replay(&dir, None);
    // The data still matches tap by tap; the fingerprints are what is wrong.
    assert!(report.mismatched_slots().is_empty());
    assert!(!report.ok());
    let errors: Vec<String> = report.errors().iter().map(|f| f.message.clone()).collect();
    let text = errors.join("\n");
    assert!(
        text.contains("dump vs --model: tokenizer differs"),
        "{text}"
    );
    assert!(text.contains("chat template differs"), "{text}");
    assert!(
        report.errors().iter().all(|f| f.topic == "fingerprint"),
        "{text}"
    );
}

/// (g) Wrong widths: each slot is T/2 wide, a tensor-parallel shard that was never gathered.
#[test]
fn g_sharded_tap_width() {
    let half = HIDDEN / 2;
    let id = identity(&tiny_fingerprint(), &default_taps(), None, half);
    let dir = write_dump("sharded", &id, move |model, ids| {
        let full = tap_values(model, ids, &default_taps());
        full.iter()
            .enumerate()
            .map(|(slot, v)| {
                // Slot 1 holds the second shard, the others the first.
                let shard = usize::from(slot == 1);
                v.chunks_exact(HIDDEN)
                    .flat_map(|row| row[shard * half..(shard + 1) * half].to_vec())
                    .collect()
            })
            .collect()
    });
    let report = run_replay(&dir, None);
    assert!(!report.ok());
    let width = report.findings.iter().find(|f| f.topic == "width").unwrap();
    assert_eq!(width.level, Level::Error);
    assert!(
        width.message.contains("aux width 48 = 3 x 16")
            && width.message.contains("T/2 wide, a tensor-parallel shard"),
        "{}",
        width.message
    );
    let v = &report.slots[1].verdict;
    assert!(
        v.contains("is 16 wide but the target's hidden size is 32: it holds columns 16..32 of block 3, shard 1 of 2"),
        "{v}"
    );
    let text = all_text(&report);
    assert!(
        text.contains("hidden size: trained on 16, served 32"),
        "{text}"
    );
}

/// (h) The head's manifest (or its SGLang ids) names other taps than the dump holds: serving
/// would feed the head other slots than it was trained on.
#[test]
fn h_head_manifest_vs_dump_taps() {
    let dir = tap_dump("head", &default_taps(), None, &default_taps());
    let dump = tandem_dump::DumpReader::open(&dir).unwrap();
    let mut config = Eagle3Config::for_target(&tiny_config("LlamaForCausalLM", LAYERS), 64, 3);
    let mut trained = dump.manifest().wiring.clone();
    trained.taps = blocks(&[2, 4, 5]);
    config.tandem_wiring = Some(trained);
    let head = HeadWiring::from_config(&config, "LlamaForCausalLM", LAYERS, "head-a").unwrap();
    let report = run_replay(&dir, Some(&head));
    assert_eq!(report.mismatched_slots().len(), 3);
    let v = &report.slots[0].verdict;
    assert!(
        v.starts_with("dump slot 0 holds block 1 as its manifest says, but serving would feed the head block 2 in this slot"),
        "{v}"
    );
    let text = all_text(&report);
    assert!(
        text.contains("serving would feed the head [block 2, block 4, block 5]")
            && text.contains("every slot off by +1"),
        "{text}"
    );

    // A head from elsewhere: SGLang's Llama model code adds 1 to every id and captures layer
    // inputs, so ids [2, 4, 5] are blocks [2, 4, 5] (sglang-classic, whatever the first id).
    config.tandem_wiring = None;
    config.eagle_config = Some(EagleConfig {
        eagle_aux_hidden_state_layer_ids: Some(vec![2, 4, 5]),
        use_aux_hidden_state: true,
        extra: Default::default(),
    });
    let head = HeadWiring::from_config(&config, "LlamaForCausalLM", LAYERS, "head-b").unwrap();
    assert_eq!(head.taps, blocks(&[2, 4, 5]));
    let report = run_replay(&dir, Some(&head));
    assert_eq!(report.mismatched_slots().len(), 3);
    assert!(
        report.slots[2].verdict.contains("sglang-classic"),
        "{}",
        report.slots[2].verdict
    );

    // The head that matches: its ids read by SGLang name exactly the dump's taps.
    config.eagle_config = Some(EagleConfig {
        eagle_aux_hidden_state_layer_ids: Some(vec![1, 3, 4]),
        use_aux_hidden_state: true,
        extra: Default::default(),
    });
    let head = HeadWiring::from_config(&config, "LlamaForCausalLM", LAYERS, "head-c").unwrap();
    let report = run_replay(&dir, Some(&head));
    assert!(report.ok(), "{:?}", report.problems());
}

// (i) The micro-batched (two-batch-overlap) path on a DeepSeek-V3 target: the committed tiny HF
// fixture (2 dense + 2 MoE layers). A dump captured by one path replays cleanly through the
// other; a micro-batched capture that skips the hook for one micro-batch (the fault SGLang
// shipped for DeepSeek, eagle3-facts 6.3, produced here in test code: the product has no such
// option) is named by replay.

/// Aux taps of the dumps (the 4-block target's EAGLE-3 defaults would repeat block 1).
fn deepseek_taps() -> Vec<TapId> {
    vec![TapId::Block(0), TapId::Block(1), TapId::Block(2)]
}

/// The fixture model plus SmolLM2's tokenizer files, for a real fingerprint.
fn deepseek_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = temp_dir("deepseek-model");
        let fixture = workspace_root().join("tests/fixtures/deepseek_v3/mla_qlora");
        for file in ["config.json", "model.safetensors"] {
            std::fs::copy(fixture.join(file), dir.join(file)).unwrap();
        }
        for file in ["tokenizer.json", "tokenizer_config.json"] {
            std::fs::copy(smollm2_dir().join(file), dir.join(file)).unwrap();
        }
        dir
    })
}

fn deepseek(execution: Execution) -> TargetModel<B> {
    let mut model = TargetModel::load(deepseek_dir(), &Default::default()).unwrap();
    model.execution = execution;
    model
}

/// Three samples of ids inside the fixture's 64-token vocabulary (lengths 20, 33, 12).
fn samples() -> Vec<Vec<u32>> {
    sample_ids()
        .into_iter()
        .map(|ids| ids.into_iter().map(|t| t % 64).collect())
        .collect()
}

/// Per sample, `[n, slots * T]` aux values and `[n, T]` last-block values, captured as an
/// engine running all samples as one ragged batch does (one prefill through the hook).
/// `skip_second_micro_batch` zeroes what the second micro-batch's rows would have contributed,
/// i.e. what a micro-batched path that calls the hook for its first micro-batch only records.
fn batched_capture(
    model: &TargetModel<B>,
    skip_second_micro_batch: bool,
) -> Vec<(Vec<f32>, Vec<f32>)> {
    let samples = samples();
    let prompts: Vec<&[u32]> = samples.iter().map(Vec::as_slice).collect();
    let mut cache = model.new_cache(prompts.len(), 64);
    let step = cache.prefill_step(&prompts).unwrap();
    let mut request = deepseek_taps();
    request.push(TapId::Block(model.spec.num_layers - 1));
    let out = model
        .forward(
            &step,
            &mut cache,
            &TapRequest::new(request.clone()),
            LogitsFor::None,
        )
        .unwrap();
    // The micro-batched path passes every tap point once per micro-batch.
    let lanes = model.execution.micro_batches(&step, model.spec.is_moe());
    assert_eq!(
        out.taps.visited.len(),
        lanes.len() * (model.spec.num_layers + 2)
    );
    let t = model.spec.hidden_size;
    let values: Vec<Vec<f32>> = out
        .taps
        .tensors
        .into_iter()
        .map(|x| x.into_data().to_vec::<f32>().unwrap())
        .collect();
    let skipped_rows = if skip_second_micro_batch {
        assert_eq!(lanes.len(), 2, "the fault needs a micro-batched step");
        lanes[1].rows.clone()
    } else {
        0..0
    };
    samples
        .iter()
        .enumerate()
        .map(|(b, ids)| {
            let mut aux = Vec::new();
            let mut last = Vec::new();
            for i in 0..ids.len() {
                let row = (b * step.width + i) * t..(b * step.width + i + 1) * t;
                for v in &values[..deepseek_taps().len()] {
                    if skipped_rows.contains(&b) {
                        aux.extend(std::iter::repeat_n(0.0, t));
                    } else {
                        aux.extend_from_slice(&v[row.clone()]);
                    }
                }
                last.extend_from_slice(&values[deepseek_taps().len()][row]);
            }
            (aux, last)
        })
        .collect()
}

/// Per sample, one prefill of its own (what `tandem dump` does).
fn per_sample_capture(model: &TargetModel<B>) -> Vec<(Vec<f32>, Vec<f32>)> {
    let last = TapId::Block(model.spec.num_layers - 1);
    samples()
        .iter()
        .map(|ids| {
            let v = tap_values(model, ids, &deepseek_taps());
            let t = model.spec.hidden_size;
            let aux = (0..ids.len())
                .flat_map(|i| v.iter().flat_map(move |s| s[i * t..(i + 1) * t].to_vec()))
                .collect();
            (aux, tap_values(model, ids, &[last]).remove(0))
        })
        .collect()
}

fn write_deepseek_dump(name: &str, values: Vec<(Vec<f32>, Vec<f32>)>) -> PathBuf {
    let fingerprint = fingerprint_model(deepseek_dir()).unwrap();
    let id: DumpManifest = identity(&fingerprint, &deepseek_taps(), None, 32);
    let dir = temp_dir(name);
    let mut writer = DumpWriter::open(&dir, &id, ShardLimits::default()).unwrap();
    for (i, (ids, (aux, last))) in samples().into_iter().zip(values).enumerate() {
        let record = DumpRecord {
            sample_id: format!("s{i}"),
            loss_mask: vec![1; ids.len()],
            input_ids: ids,
            aux_hidden: aux,
            last_hidden: last,
        };
        writer.write(&record, false).unwrap();
    }
    writer.finish(true).unwrap();
    dir
}

fn replay_with(dir: &Path, execution: Execution) -> ReplayReport {
    let model = deepseek(execution);
    let fingerprint = fingerprint_model(deepseek_dir()).unwrap();
    let dump = DumpReader::open(dir).unwrap();
    let options = ReplayOptions {
        model_label: format!("deepseek {execution:?}"),
        ..ReplayOptions::default()
    };
    let report = replay(&model, &fingerprint, &dump, None, &options).unwrap();
    eprintln!("{}", report.to_table());
    report
}

fn assert_clean(report: &ReplayReport) {
    assert!(report.ok(), "{:?}", report.problems());
    for s in &report.slots {
        assert_eq!(s.status, Status::Match, "{}", s.verdict);
        assert_eq!(s.observed, Some(Candidate::Tap(deepseek_taps()[s.slot])));
    }
    assert_eq!(report.tokens, 65);
}

#[test]
fn i_a_micro_batched_dump_replays_cleanly_through_the_plain_path() {
    // Auto micro-batches three sequences on this MoE model: rows [0, 2) and [2, 3).
    let model = deepseek(Execution::Auto);
    let dir = write_deepseek_dump("micro-dump", batched_capture(&model, false));
    assert_clean(&replay_with(&dir, Execution::Plain));
}

#[test]
fn i_a_plain_dump_replays_cleanly_through_the_micro_batched_path() {
    let dir = write_deepseek_dump(
        "plain-dump",
        per_sample_capture(&deepseek(Execution::Plain)),
    );
    // Replay runs one sample at a time: forced micro-batching splits its tokens in two.
    assert_clean(&replay_with(&dir, Execution::MicroBatched));
}

/// eagle3-facts 6.3: the two-batch-overlap path captured nothing for part of the batch.
#[test]
fn i_a_micro_batched_path_that_skips_the_hook_is_named() {
    let model = deepseek(Execution::MicroBatched);
    let dir = write_deepseek_dump("skipped-micro-batch", batched_capture(&model, true));
    let report = replay_with(&dir, Execution::Plain);
    assert!(!report.ok());
    assert_eq!(report.mismatched_slots().len(), 3);
    // Rows [2, 3) are the third sample: its 12 tokens of the 65 are zero in every slot.
    for s in &report.slots {
        assert_eq!(s.zero_tokens, 12, "{}", s.verdict);
        assert!(
            s.verdict
                .contains("is zero for 12 of 65 tokens (replayed tokens 53..=64)")
                && s.verdict
                    .contains("captured for only part of the tokens (micro-batches not merged"),
            "{}",
            s.verdict
        );
    }
    // As in SGLang, only the aux taps are lost; the last block still matches.
    assert_eq!(report.last_hidden.as_ref().unwrap().status, Status::Match);
}

/// Block `layer` of `model` as tensor-parallel rank `rank` of `tp` sees it before the MLP's
/// all-reduce, built independently of `TargetModel::mlp_partial_sums`: a copy of the model whose
/// layer-`layer` down_proj keeps only rank `rank`'s rows (Megatron's row split) gives, at that
/// block's tap, the residual after attention plus only that rank's share of the MLP.
fn partial_sum_by_masked_weights(
    model: &TargetModel<B>,
    ids: &[u32],
    layer: usize,
    tp: usize,
    rank: usize,
) -> Vec<f32> {
    let mut masked = model.clone();
    let tandem_model::model::FeedForward::Dense(mlp) = &mut masked.layers[layer].mlp else {
        panic!("a dense MLP");
    };
    let [inter, _] = mlp.down_proj.weight_t.dims();
    let per = inter / tp;
    let keep: Vec<f32> = (0..inter)
        .map(|i| f32::from(u8::from(i / per == rank)))
        .collect();
    let keep = Tensor::<B, 2>::from_data(TensorData::new(keep, [inter, 1]), &Default::default());
    mlp.down_proj.weight_t = mlp.down_proj.weight_t.clone() * keep;
    tap_values(&masked, ids, &[TapId::Block(layer)]).remove(0)
}

/// Issue #19 (4): a capture taken before the tensor-parallel all-reduce (one rank's partial
/// sum) is named by replay, with the rank and the degree; the partial sums replay computes equal
/// the masked-weight construction above.
#[test]
fn j_tensor_parallel_partial_sum_is_named_with_its_rank() {
    let model = tiny_model();
    let ids = &sample_ids()[0];
    let parts = model.mlp_partial_sums(ids, &[3], &[2]).unwrap();
    assert_eq!(parts.len(), 2);
    for (layer, tp, rank, values) in &parts {
        let want = partial_sum_by_masked_weights(&model, ids, *layer, *tp, *rank);
        let err = rel_l2(values, &want);
        assert!(err < 1e-5, "rank {rank}: rel err {err:.2e}");
    }
    // The two ranks' partial sums are not the tap, and they sum to it plus the shared residual.
    let full = tap_values(&model, ids, &[TapId::Block(3)]).remove(0);
    assert!(rel_l2(&parts[0].3, &full) > 1e-2);
    // Input that is not whole rows of the hidden size is refused with a sentence, not a panic.
    let err = model
        .block_partial_sums(&[(3, &[0.5; HIDDEN + 1])], &[2])
        .unwrap_err()
        .to_string();
    assert!(err.contains("not a whole number"), "{err}");

    let id = identity(
        &tiny_fingerprint(),
        &default_taps(),
        Some(sglang_raw()),
        HIDDEN,
    );
    let dir = write_dump("tp-partial", &id, |model, ids| {
        vec![
            tap_values(model, ids, &[TapId::Block(1)]).remove(0),
            partial_sum_by_masked_weights(model, ids, 3, 2, 1),
            partial_sum_by_masked_weights(model, ids, 4, 4, 3),
        ]
    });
    let report = run_replay(&dir, None);
    assert_eq!(report.slots[0].status, Status::Match);
    let s1 = &report.slots[1];
    assert_eq!(
        s1.observed,
        Some(Candidate::PartialSum {
            layer: 3,
            tp: 2,
            rank: 1
        })
    );
    assert!(
        s1.verdict.starts_with(
            "dump slot 1 holds a tensor-parallel partial sum: block 3's output as rank 1 of 2"
        ) && s1
            .verdict
            .contains("before the all-reduce of a 2-way tensor-parallel MLP")
            && s1.verdict.contains("rank 1"),
        "{}",
        s1.verdict
    );
    let s2 = &report.slots[2];
    assert_eq!(
        s2.observed,
        Some(Candidate::PartialSum {
            layer: 4,
            tp: 4,
            rank: 3
        })
    );
    assert!(s2.verdict.contains("rank 3 of 4"), "{}", s2.verdict);
    assert!(!report.ok());
}
