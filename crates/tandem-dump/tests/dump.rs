//! End-to-end tests of `tandem dump`: stored taps against a direct forward, the loss mask,
//! skips, resume, refusal of a different wiring, I/O failures, regeneration, and reading the
//! files from Python (pyarrow and polars).

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use tandem_dump::layout::encode_bf16;
use tandem_dump::mask::tokenize_conversation;
use tandem_dump::{
    DumpError, DumpOptions, DumpReader, DumpRecord, DumpSummary, FormatError, GenerationSettings,
    Partition, ShardLimits, StorageDtype, run_dump,
};
use tandem_model::backend::CpuBackend;
use tandem_model::testing::{smollm2_dir, workspace_root, write_tiny_chat_model};
use tandem_model::{
    ChatMessage, GenerateOptions, LogitsFor, SamplingParams, TapRequest, TargetModel,
    TargetTokenizer,
};
use tandem_wiring::{Convention, TapId, TapPoint};

type B = CpuBackend;

/// A fresh, empty directory for one test.
fn temp_dir(name: &str) -> PathBuf {
    tandem_model::testing::scratch_dir(&format!("dump-test-{name}"))
}

/// A tiny random Llama (8 blocks, hidden 32) with SmolLM2's tokenizer and chat template: the
/// whole pipeline in milliseconds. Default taps for 8 blocks: [1, 3, 4]; last block 7.
fn tiny_model() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = temp_dir("tiny-model");
        write_tiny_chat_model(&dir, 8, 7).unwrap();
        dir
    })
}

fn conv(id: &str, turns: &[(&str, &str)]) -> String {
    let messages: Vec<serde_json::Value> = turns
        .iter()
        .map(|(role, content)| serde_json::json!({"role": role, "content": content}))
        .collect();
    serde_json::json!({"id": id, "messages": messages}).to_string()
}

/// Good conversations, in order.
fn good_conversations() -> Vec<String> {
    vec![
        conv(
            "a",
            &[
                ("user", "Hello there"),
                ("assistant", "Hi! How can I help?"),
            ],
        ),
        conv(
            "b",
            &[
                ("system", "Be brief."),
                ("user", "What is 2+2?"),
                ("assistant", "4."),
                ("user", "And 3+3?"),
                ("assistant", "6, of course."),
            ],
        ),
        conv(
            "c",
            &[("user", "Name a colour."), ("assistant", "\nBlue\n")],
        ),
        conv(
            "d",
            &[
                ("user", "Write code"),
                ("assistant", "```python\nprint(1)\n```"),
            ],
        ),
        conv("e", &[("user", "Thanks"), ("assistant", "You're welcome.")]),
        conv("f", &[("user", "Bye"), ("assistant", "Goodbye!")]),
    ]
}

/// A JSONL dataset mixing good conversations with one bad record of each kind.
fn write_dataset(dir: &Path) -> PathBuf {
    let good = good_conversations();
    let long_prompt = "word ".repeat(300);
    let mut bytes: Vec<u8> = Vec::new();
    let mut line = |b: &[u8]| {
        bytes.extend_from_slice(b);
        bytes.push(b'\n');
    };
    line(good[0].as_bytes());
    line(b"{this is not json");
    line(good[1].as_bytes());
    line(
        b"{\"id\": \"bad-utf8\", \"messages\": [{\"role\": \"user\", \"content\": \"\xff\xfe\"}]}",
    );
    line(good[2].as_bytes());
    line(conv("empty", &[]).as_bytes());
    line(good[3].as_bytes());
    line(conv("only-user", &[("user", "anyone?")]).as_bytes());
    line(conv("long", &[("user", &long_prompt), ("assistant", "ok")]).as_bytes());
    line(good[4].as_bytes());
    line(good[5].as_bytes());
    let path = dir.join("chat.jsonl");
    fs::write(&path, bytes).unwrap();
    path
}

fn options(model: &Path, dataset: &Path, out: &Path) -> DumpOptions {
    let mut o = DumpOptions::new(model, dataset.to_string_lossy(), out);
    o.max_len = 96;
    o.shard_limits = ShardLimits {
        max_rows: 2,
        max_bytes: 1 << 30,
    };
    o
}

fn dump(o: &DumpOptions) -> Result<DumpSummary, DumpError> {
    run_dump::<B>(o, &Default::default())
}

fn records(dir: &Path) -> Vec<DumpRecord> {
    let reader = DumpReader::open(dir).unwrap();
    reader.iter().collect::<Result<Vec<_>, _>>().unwrap()
}

fn skips(pairs: &[(&str, u64)]) -> BTreeMap<String, u64> {
    pairs.iter().map(|(r, n)| (r.to_string(), *n)).collect()
}

/// Runs of consecutive masked tokens, decoded.
fn masked_runs(tokenizer: &TargetTokenizer, ids: &[u32], mask: &[u8]) -> Vec<String> {
    let mut runs = Vec::new();
    let mut current = Vec::new();
    for (&id, &m) in ids.iter().zip(mask) {
        if m == 1 {
            current.push(id);
        } else if !current.is_empty() {
            runs.push(tokenizer.decode(&current, false).unwrap());
            current.clear();
        }
    }
    if !current.is_empty() {
        runs.push(tokenizer.decode(&current, false).unwrap());
    }
    runs
}

/// The trainer may read from loader threads.
#[test]
fn the_reader_can_be_shared_between_threads() {
    fn send_sync<T: Send + Sync>() {}
    send_sync::<DumpReader>();
    send_sync::<DumpRecord>();
}

#[test]
fn stored_taps_equal_a_direct_forward_of_the_real_model() {
    let dir = temp_dir("real");
    let data = dir.join("chat.jsonl");
    let good = good_conversations();
    fs::write(&data, format!("{}\n{}\n", good[0], good[1])).unwrap();
    let out = dir.join("out");
    let mut o = options(&smollm2_dir(), &data, &out);
    // SGLang ids 1,14,26 name blocks 1, 14, 26 of a 30-block model.
    o.taps = "sglang:1,14,26".parse().unwrap();
    let summary = dump(&o).unwrap();
    assert_eq!(summary.rows, 2);

    let reader = DumpReader::open(&out).unwrap();
    let m = reader.manifest();
    let taps = vec![TapId::Block(1), TapId::Block(14), TapId::Block(26)];
    assert_eq!(m.wiring.taps, taps);
    assert_eq!(
        m.wiring.raw_ids.as_ref().unwrap().convention,
        Convention::SglangHeuristic
    );
    assert_eq!(m.wiring.tap_point, TapPoint::ResidualStream);
    assert_eq!(m.wiring.producer.execution_path, "prefill");
    assert_eq!(m.wiring.dtype, "bf16");
    assert_eq!((m.hidden_size, m.num_slots), (576, 3));
    assert_eq!(
        m.last_hidden_tap,
        TapId::Block(29),
        "block L-1 is always stored"
    );
    assert!(m.complete);

    let model = TargetModel::<B>::load(&smollm2_dir(), &Default::default()).unwrap();
    let mut request = taps.clone();
    request.push(TapId::Block(29));
    for record in reader.iter() {
        let record = record.unwrap();
        let n = record.len();
        let mut cache = model.new_cache(1, n);
        let step = cache.prefill_step(&[&record.input_ids]).unwrap();
        let out = model
            .forward(
                &step,
                &mut cache,
                &TapRequest::new(request.clone()),
                LogitsFor::None,
            )
            .unwrap();
        let direct: Vec<Vec<f32>> = out
            .taps
            .tensors
            .iter()
            .map(|t| t.clone().into_data().to_vec::<f32>().unwrap())
            .collect();
        for token in 0..n {
            for (slot, values) in direct.iter().enumerate().take(3) {
                let want = encode_bf16(&values[token * 576..(token + 1) * 576]);
                let start = token * 3 * 576 + slot * 576;
                let got = encode_bf16(&record.aux_hidden[start..start + 576]);
                assert_eq!(
                    got, want,
                    "{}: token {token}, slot {slot}",
                    record.sample_id
                );
            }
            let want = encode_bf16(&direct[3][token * 576..(token + 1) * 576]);
            let got = encode_bf16(&record.last_hidden[token * 576..(token + 1) * 576]);
            assert_eq!(
                got, want,
                "{}: token {token}, last hidden",
                record.sample_id
            );
        }
    }
}

#[test]
fn loss_mask_covers_assistant_content_and_end_of_turn_only() {
    let tokenizer = TargetTokenizer::load(&smollm2_dir()).unwrap();
    let messages = vec![
        ChatMessage::new("user", "What is 2+2?"),
        ChatMessage::new("assistant", "4."),
        ChatMessage::new("user", "And 3+3?"),
        ChatMessage::new("assistant", "\nSix, of course.\n"),
    ];
    let masked = tokenize_conversation(&tokenizer, "sha", &messages, 4096)
        .unwrap()
        .unwrap();
    assert!(!masked.truncated);
    assert_eq!(
        masked.input_ids,
        tokenizer.encode_chat(&messages, false).unwrap(),
        "the ids are the chat template's render"
    );
    assert_eq!(
        masked_runs(&tokenizer, &masked.input_ids, &masked.loss_mask),
        ["4.<|im_end|>", "\nSix, of course.\n<|im_end|>"],
        "exactly each reply and its end-of-turn token"
    );
    // The newline the template writes after <|im_end|> is not trained on.
    let end = tokenizer.token_to_id("<|im_end|>").unwrap();
    for (i, &id) in masked.input_ids.iter().enumerate() {
        if id == end && masked.loss_mask[i] == 1 {
            assert_eq!(masked.loss_mask.get(i + 1).copied().unwrap_or(0), 0);
        }
    }

    // Truncation keeps the prefix; a cut that leaves no assistant token is a skip.
    let short = tokenize_conversation(&tokenizer, "sha", &messages, 40)
        .unwrap()
        .unwrap();
    assert!(short.truncated);
    assert_eq!(short.input_ids, masked.input_ids[..40]);
    let none = tokenize_conversation(&tokenizer, "sha", &messages, 10)
        .unwrap()
        .unwrap_err();
    assert_eq!(none.reason, "too_long");
}

#[test]
fn a_template_that_rewrites_earlier_turns_is_refused_by_name() {
    let dir = temp_dir("bad-template");
    fs::copy(
        smollm2_dir().join("tokenizer.json"),
        dir.join("tokenizer.json"),
    )
    .unwrap();
    // Renders only the last message: renders of prefixes are not prefixes of the full render.
    let template = "{% for m in messages %}{% if loop.last %}<|im_start|>{{ m['role'] }}\n\
                    {{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}\
                    {% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";
    let config = serde_json::json!({"chat_template": template, "eos_token": "<|im_end|>"});
    fs::write(dir.join("tokenizer_config.json"), config.to_string()).unwrap();
    let tokenizer = TargetTokenizer::load(&dir).unwrap();
    let messages = vec![
        ChatMessage::new("user", "Hi"),
        ChatMessage::new("assistant", "Hello"),
    ];
    let err = tokenize_conversation(&tokenizer, "abc123", &messages, 100).unwrap_err();
    let text = err.to_string();
    assert!(
        matches!(err, DumpError::TemplateNotPrefixStable { .. }),
        "{text}"
    );
    assert!(
        text.contains("abc123") && text.contains("not prefix-stable"),
        "{text}"
    );
}

#[test]
fn bad_records_are_skipped_and_counted_by_reason() {
    let dir = temp_dir("skips");
    let data = write_dataset(&dir);
    let out = dir.join("out");
    let summary = dump(&options(tiny_model(), &data, &out)).unwrap();
    let expected = skips(&[
        ("empty_conversation", 1),
        ("malformed", 1),
        ("non_utf8", 1),
        ("single_role", 1),
        ("too_long", 1),
    ]);
    assert_eq!(summary.skipped, expected);
    let m = &summary.manifest;
    assert_eq!(m.skipped, expected);
    assert_eq!(m.rows, 6);
    assert_eq!(m.records_read, 11);
    assert!(m.complete);
    assert_eq!(m.shards.len(), 3);
    let on_disk = tandem_dump::DumpManifest::load(&out.join("manifest.json")).unwrap();
    assert_eq!(on_disk.skipped, expected);
    let ids: Vec<String> = records(&out).into_iter().map(|r| r.sample_id).collect();
    assert_eq!(ids, ["a", "b", "c", "d", "e", "f"]);
}

#[test]
fn resume_after_a_max_samples_stop_equals_an_uninterrupted_run() {
    let dir = temp_dir("resume");
    let data = write_dataset(&dir);
    let whole = dir.join("whole");
    dump(&options(tiny_model(), &data, &whole)).unwrap();

    let parts = dir.join("parts");
    let mut o = options(tiny_model(), &data, &parts);
    o.max_samples = Some(3);
    let first = dump(&o).unwrap();
    assert_eq!((first.rows, first.manifest.rows), (3, 3));
    assert!(!first.manifest.complete);
    // The same command again has nothing to do.
    let again = dump(&o).unwrap();
    assert_eq!((again.resumed_rows, again.rows), (3, 0));
    o.max_samples = None;
    let rest = dump(&o).unwrap();
    assert_eq!((rest.resumed_rows, rest.rows), (3, 3));

    assert_eq!(records(&parts), records(&whole));
    let (a, b) = (
        &rest.manifest,
        DumpReader::open(&whole).unwrap().manifest().clone(),
    );
    assert_eq!(
        (
            a.rows,
            a.tokens,
            a.assistant_tokens,
            a.records_read,
            &a.skipped,
            a.complete
        ),
        (
            b.rows,
            b.tokens,
            b.assistant_tokens,
            b.records_read,
            &b.skipped,
            b.complete
        )
    );
}

/// `--max-seconds` stops before the next batch once the time is up and leaves a resumable,
/// incomplete dump; an expired limit starts no batch at all.
#[test]
fn a_time_limit_stops_between_batches_and_resumes() {
    let dir = temp_dir("time-limit");
    let data = write_dataset(&dir);
    let whole = dir.join("whole");
    dump(&options(tiny_model(), &data, &whole)).unwrap();

    let parts = dir.join("parts");
    let mut o = options(tiny_model(), &data, &parts);
    o.max_seconds = Some(1e-9);
    let first = dump(&o).unwrap();
    assert_eq!((first.rows, first.manifest.rows), (0, 0));
    assert!(!first.manifest.complete);
    o.max_seconds = Some(3600.0);
    let rest = dump(&o).unwrap();
    assert_eq!(rest.rows, 6);
    assert!(rest.manifest.complete);
    assert_eq!(records(&parts), records(&whole));

    o.max_seconds = Some(-1.0);
    let err = dump(&o).unwrap_err();
    assert!(err.to_string().contains("--max-seconds"), "{err}");
}

#[test]
fn a_full_disk_keeps_completed_shards_valid_and_a_crash_is_resumed() {
    let dir = temp_dir("full-disk");
    let data = write_dataset(&dir);
    let whole = dir.join("whole");
    dump(&options(tiny_model(), &data, &whole)).unwrap();
    let first_shard = fs::metadata(whole.join("shard-00000.arrow")).unwrap().len();

    // Room for the first shard and a little more: the second shard cannot be written.
    let out = dir.join("out");
    let mut o = options(tiny_model(), &data, &out);
    o.simulate_full_disk_after = Some(first_shard + 100);
    let err = dump(&o).unwrap_err();
    let text = err.to_string();
    assert!(
        matches!(err, DumpError::Format(FormatError::ShardWrite { .. })),
        "{text}"
    );
    assert!(text.contains("No space left on device"), "{text}");
    assert!(
        text.contains("1 completed shard(s) (2 rows)") && text.contains("re-run"),
        "{text}"
    );
    let names: Vec<String> = fs::read_dir(&out)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert!(
        !names.iter().any(|n| n.ends_with(".tmp")),
        "temporary shard left: {names:?}"
    );
    let partial = DumpReader::open(&out).unwrap();
    assert_eq!(partial.len(), 2);
    assert_eq!(records(&out), records(&whole)[..2]);

    // A crash leaves a temporary shard behind; the next run discards it and finishes.
    fs::write(out.join(".shard-00001.arrow.tmp"), b"half a shard").unwrap();
    o.simulate_full_disk_after = None;
    let resumed = dump(&o).unwrap();
    assert_eq!(resumed.resumed_rows, 2);
    assert!(!out.join(".shard-00001.arrow.tmp").exists());
    assert_eq!(records(&out), records(&whole));
    assert_eq!(
        resumed.manifest.skipped,
        DumpReader::open(&whole).unwrap().manifest().skipped
    );
}

#[test]
fn a_different_wiring_or_setting_in_the_same_directory_is_refused() {
    let dir = temp_dir("refuse");
    let data = write_dataset(&dir);
    let out = dir.join("out");
    let mut o = options(tiny_model(), &data, &out);
    o.taps = "sglang:1,3,4".parse().unwrap();
    o.max_samples = Some(1);
    dump(&o).unwrap();

    // vLLM ids 1,3,4 are blocks 0,2,3: every slot one block earlier.
    o.taps = "vllm:1,3,4".parse().unwrap();
    let err = dump(&o).unwrap_err();
    let text = err.to_string();
    assert!(
        matches!(err, DumpError::Format(FormatError::ManifestMismatch { .. })),
        "{text}"
    );
    assert!(
        text.contains("slot 0: trained on block 1, served block 0"),
        "{text}"
    );
    assert!(text.contains("off by -1 block"), "{text}");

    o.taps = "sglang:1,3,4".parse().unwrap();
    o.max_len = 64;
    let text = dump(&o).unwrap_err().to_string();
    assert!(text.contains("max length"), "{text}");
    o.max_len = 96;
    o.dtype = StorageDtype::F16;
    let text = dump(&o).unwrap_err().to_string();
    assert!(text.contains("dtype"), "{text}");
    // The directory is untouched by the refused runs.
    assert_eq!(DumpReader::open(&out).unwrap().len(), 1);
}

#[test]
fn unwritable_or_foreign_output_directories_are_clear_errors() {
    let dir = temp_dir("unwritable");
    let data = write_dataset(&dir);
    let file = dir.join("a-file");
    fs::write(&file, b"x").unwrap();
    let err = dump(&options(tiny_model(), &data, &file.join("out"))).unwrap_err();
    let text = err.to_string();
    assert!(
        text.contains("cannot create directory") && text.contains("a-file"),
        "{text}"
    );

    let foreign = dir.join("foreign");
    fs::create_dir_all(&foreign).unwrap();
    fs::write(foreign.join("notes.txt"), b"mine").unwrap();
    let text = dump(&options(tiny_model(), &data, &foreign))
        .unwrap_err()
        .to_string();
    assert!(
        text.contains("not empty") && text.contains("notes.txt"),
        "{text}"
    );
}

#[test]
fn regenerate_stores_the_targets_own_batched_replies() {
    let dir = temp_dir("regen");
    let data = dir.join("chat.jsonl");
    let good = good_conversations();
    fs::write(&data, format!("{}\n{}\n{}\n", good[0], good[1], good[2])).unwrap();
    let settings = GenerationSettings {
        max_new_tokens: 5,
        temperature: 0.0,
        top_p: 1.0,
        top_k: 0,
        seed: 0,
    };
    let out = dir.join("greedy");
    let mut o = options(tiny_model(), &data, &out);
    o.max_len = 256;
    o.regenerate = Some(settings);
    o.batch_size = 2;
    let summary = dump(&o).unwrap();
    assert_eq!(summary.rows, 3);
    assert_eq!(
        summary.generated_turns, 4,
        "one turn each, two for the two-turn conversation"
    );
    assert_eq!(summary.manifest.settings.regenerate, Some(settings));

    // The regenerated conversations are kept beside the shards, one chat-JSONL file per
    // shard; a dump of them without --regenerate captures the very same token ids and masks.
    let mut kept = String::new();
    for shard in &summary.manifest.shards {
        let name = shard
            .file
            .replace("shard-", "conversations-")
            .replace(".arrow", ".jsonl");
        kept.push_str(&fs::read_to_string(out.join(&name)).unwrap());
    }
    assert_eq!(kept.lines().count(), 3, "{kept}");
    let again = dir.join("again.jsonl");
    fs::write(&again, &kept).unwrap();
    let mut o2 = options(tiny_model(), &again, &dir.join("recaptured"));
    o2.max_len = 256;
    dump(&o2).unwrap();
    let (first, second) = (records(&out), records(&dir.join("recaptured")));
    assert_eq!(first.len(), second.len());
    for (a, b) in first.iter().zip(&second) {
        assert_eq!(a.sample_id, b.sample_id);
        assert_eq!(a.input_ids, b.input_ids, "{}", a.sample_id);
        assert_eq!(a.loss_mask, b.loss_mask, "{}", a.sample_id);
    }

    // The first reply of each conversation is what single-sequence greedy generation gives.
    let tokenizer = TargetTokenizer::load(tiny_model()).unwrap();
    let model = TargetModel::<B>::load(tiny_model(), &Default::default()).unwrap();
    let prompts = [
        vec![ChatMessage::new("user", "Hello there")],
        vec![
            ChatMessage::new("system", "Be brief."),
            ChatMessage::new("user", "What is 2+2?"),
        ],
        vec![ChatMessage::new("user", "Name a colour.")],
    ];
    for (record, prompt) in records(&out).iter().zip(&prompts) {
        let ids = tokenizer.encode_chat(prompt, true).unwrap();
        let generated = tandem_model::generate(
            &model,
            &ids,
            &GenerateOptions {
                max_new_tokens: 5,
                sampling: SamplingParams::greedy(),
                stop_ids: tokenizer.eos_ids.clone(),
                seed: 0,
            },
        )
        .unwrap();
        let reply = tokenizer.decode(&generated.tokens, false).unwrap();
        let runs = masked_runs(&tokenizer, &record.input_ids, &record.loss_mask);
        assert_eq!(
            runs[0],
            format!("{reply}<|im_end|>"),
            "{}",
            record.sample_id
        );
    }

    // Sampled replies depend on the record, not on the batch they were generated in.
    let sampled = |batch: usize, name: &str| {
        let mut o = options(tiny_model(), &data, &dir.join(name));
        o.max_len = 256;
        o.regenerate = Some(GenerationSettings {
            temperature: 1.0,
            seed: 3,
            ..settings
        });
        o.batch_size = batch;
        dump(&o).unwrap();
        records(&dir.join(name))
            .into_iter()
            .map(|r| r.input_ids)
            .collect::<Vec<_>>()
    };
    assert_eq!(sampled(1, "sampled-1"), sampled(3, "sampled-3"));
}

#[test]
fn dump_info_reports_counts_dtype_and_per_tap_norms() {
    let dir = temp_dir("info");
    let data = write_dataset(&dir);
    let out = dir.join("out");
    dump(&options(tiny_model(), &data, &out)).unwrap();
    let info = tandem_dump::dump_info(&out).unwrap();
    let stats = tandem_stats::dump_stats(&[&out], None).unwrap();
    let rows = records(&out);
    let tokens: usize = rows.iter().map(DumpRecord::len).sum();
    assert_eq!(info.manifest.tokens as usize, tokens);
    let slots = tandem_stats::column_strings(&stats.norms, "slot").unwrap();
    let taps = tandem_stats::column_strings(&stats.norms, "tap").unwrap();
    assert_eq!(
        slots,
        ["slot 0", "slot 1", "slot 2", "last"],
        "three aux slots and the last block"
    );
    assert_eq!(taps[3], TapId::Block(7).to_string());
    // Slot 1 (block 3) by hand.
    let norms: Vec<f64> = rows
        .iter()
        .flat_map(|r| {
            r.aux_hidden
                .chunks_exact(96)
                .map(|t| {
                    t[32..64]
                        .iter()
                        .map(|&v| f64::from(v).powi(2))
                        .sum::<f64>()
                        .sqrt()
                })
                .collect::<Vec<_>>()
        })
        .collect();
    let mean = norms.iter().sum::<f64>() / norms.len() as f64;
    let polars_mean = tandem_stats::column_f64s(&stats.norms, "norm_mean").unwrap()[1];
    assert!((polars_mean - mean).abs() < 1e-9 * mean);
    let text = format!("{info}{stats}");
    for needle in [
        "rows        6",
        "bf16 (UInt16 bit patterns)",
        "block 3",
        "assistant",
        "too_long=1",
    ] {
        assert!(text.contains(needle), "{needle:?} missing from:\n{text}");
    }

    // What a head trained on this dump records about it.
    let reader = DumpReader::open(&out).unwrap();
    let r = reader.dump_ref();
    assert_eq!(r.name, "out");
    assert_eq!(r.path, out.display().to_string());
    assert_eq!((r.rows, r.tokens as usize), (6, tokens));
    assert_eq!(r.regenerated, Some(false));
    assert_eq!(r.dataset.as_deref(), Some(data.to_str().unwrap()));
    let manifest_bytes = fs::read(out.join("manifest.json")).unwrap();
    assert_eq!(
        r.manifest_sha256.as_deref(),
        Some(tandem_wiring::sha256_hex(&manifest_bytes).as_str()),
        "the hash sha256sum prints for manifest.json"
    );
}

/// Whether python3 with pyarrow and polars is available; CI (scripts/test.sh installs them)
/// must have it, elsewhere the test is skipped with a note.
fn python_with_arrow() -> bool {
    let ok = Command::new("python3")
        .args(["-c", "import pyarrow, polars, numpy"])
        .status()
        .is_ok_and(|s| s.success());
    if !ok {
        assert!(
            std::env::var_os("CI").is_none()
                && std::env::var_os("TANDEM_REQUIRE_PYARROW").is_none(),
            "python3 with pyarrow, polars and numpy is required here (pip install pyarrow polars)"
        );
        eprintln!("skipping: python3 with pyarrow, polars and numpy is not available");
    }
    ok
}

#[test]
fn pyarrow_and_polars_read_the_files() {
    if !python_with_arrow() {
        return;
    }
    let dir = temp_dir("python");
    let data = write_dataset(&dir);
    for dtype in [StorageDtype::Bf16, StorageDtype::F16] {
        let out = dir.join(dtype.as_str());
        let mut o = options(tiny_model(), &data, &out);
        o.dtype = dtype;
        o.max_samples = Some(3);
        dump(&o).unwrap();
        let output = Command::new("python3")
            .arg(workspace_root().join("scripts/check_dump.py"))
            .arg(&out)
            .output()
            .unwrap();
        assert!(
            output.status.success(),
            "{dtype}: check_dump.py failed:\n{}",
            String::from_utf8_lossy(&output.stderr)
        );
        let report: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
        let rows = report["rows"].as_array().unwrap();
        let ours = records(&out);
        assert_eq!(rows.len(), ours.len());
        for (py, r) in rows.iter().zip(&ours) {
            assert_eq!(py["sample_id"], r.sample_id.as_str());
            assert_eq!(py["tokens"], r.len());
            assert_eq!(
                py["ids_sum"],
                r.input_ids.iter().map(|&i| u64::from(i)).sum::<u64>()
            );
            assert_eq!(
                py["mask_sum"],
                r.loss_mask.iter().map(|&m| u64::from(m)).sum::<u64>()
            );
            let sum = |v: &[f32]| v.iter().map(|&x| f64::from(x)).sum::<f64>();
            for (key, ours) in [
                ("aux_sum", sum(&r.aux_hidden)),
                ("last_sum", sum(&r.last_hidden)),
            ] {
                let theirs = py[key].as_f64().unwrap();
                assert!(
                    (theirs - ours).abs() <= 1e-9 * ours.abs().max(1.0),
                    "{key}: {theirs} vs {ours}"
                );
            }
            let head: Vec<f64> = r.aux_hidden[..4].iter().map(|&x| f64::from(x)).collect();
            assert_eq!(
                py["aux_head"],
                serde_json::json!(head),
                "{dtype}: first values, bit for bit"
            );
            let n = r.last_hidden.len();
            let tail: Vec<f64> = r.last_hidden[n - 4..]
                .iter()
                .map(|&x| f64::from(x))
                .collect();
            assert_eq!(py["last_tail"], serde_json::json!(tail));
        }
    }
}

fn by_sample_id(records: Vec<DumpRecord>) -> BTreeMap<String, DumpRecord> {
    let n = records.len();
    let map: BTreeMap<String, DumpRecord> = records
        .into_iter()
        .map(|r| (r.sample_id.clone(), r))
        .collect();
    assert_eq!(map.len(), n, "sample ids repeat");
    map
}

/// `tandem dump --rank R --world-size W` (issue #19): W processes each dump the records
/// `i % W == R` into `rank-RRRRR/`; `DumpReader::open` reads the ranks as one dump holding
/// exactly the rows of a single-process dump, byte for byte (compared by sample id), with the
/// same totals. A rank resumes on its own; sampled regeneration is seeded by the global record,
/// so it does not depend on the split; a rank directory of another world size is refused, and
/// so is a dump with a rank missing.
#[test]
fn a_data_parallel_dump_reads_as_the_single_process_dump() {
    let dir = temp_dir("data-parallel");
    let data = write_dataset(&dir);
    let whole = dir.join("whole");
    dump(&options(tiny_model(), &data, &whole)).unwrap();
    let split = dir.join("split");
    let world = 3;
    for rank in 0..world {
        let mut o = options(tiny_model(), &data, &split);
        o.partition = Some(Partition {
            rank,
            world_size: world,
        });
        if rank == 1 {
            // Stopped after one row, then resumed in its own directory.
            o.max_samples = Some(1);
            assert_eq!(dump(&o).unwrap().rows, 1);
            o.max_samples = None;
            let rest = dump(&o).unwrap();
            assert_eq!(rest.resumed_rows, 1);
        } else {
            dump(&o).unwrap();
        }
        assert!(
            split
                .join(format!("rank-{rank:05}/manifest.json"))
                .is_file()
        );
    }
    let single = DumpReader::open(&whole).unwrap();
    let parallel = DumpReader::open(&split).unwrap();
    assert_eq!(by_sample_id(records(&split)), by_sample_id(records(&whole)));
    let (a, b) = (parallel.manifest(), single.manifest());
    assert_eq!(
        (
            a.rows,
            a.tokens,
            a.assistant_tokens,
            a.records_read,
            &a.skipped,
            a.complete,
            a.partition
        ),
        (
            b.rows,
            b.tokens,
            b.assistant_tokens,
            b.records_read,
            &b.skipped,
            b.complete,
            None
        )
    );
    // Disjoint shares: each rank's rows are its records `i % 3 == rank` (the good ones are
    // records 0, 2, 4, 6, 9, 10: ids a..f).
    let rank_ids = |rank: usize| -> Vec<String> {
        records(&split.join(format!("rank-{rank:05}")))
            .into_iter()
            .map(|r| r.sample_id)
            .collect()
    };
    assert_eq!(rank_ids(0), ["a", "d", "e"]);
    assert_eq!(rank_ids(1), ["c", "f"]);
    assert_eq!(rank_ids(2), ["b"]);

    // A rank of another world size in the same directory is refused by name.
    let mut o = options(tiny_model(), &data, &split);
    o.partition = Some(Partition {
        rank: 0,
        world_size: 2,
    });
    let err = dump(&o).unwrap_err().to_string();
    assert!(
        err.contains("partition") && err.contains("rank 0 of 3"),
        "{err}"
    );
    // A rank directory missing: the dump does not read as complete data.
    let gap = dir.join("gap");
    fs::create_dir_all(&gap).unwrap();
    for rank in [0, 2] {
        let name = format!("rank-{rank:05}");
        fs::create_dir_all(gap.join(&name)).unwrap();
        for entry in fs::read_dir(split.join(&name)).unwrap() {
            let entry = entry.unwrap();
            fs::copy(entry.path(), gap.join(&name).join(entry.file_name())).unwrap();
        }
    }
    let err = DumpReader::open(&gap).unwrap_err().to_string();
    assert!(err.contains("rank-00001 is missing"), "{err}");

    // Sampled regeneration, one conversation per batch: the same replies whichever rank
    // draws them.
    let regen_data = dir.join("regen.jsonl");
    let good = good_conversations();
    fs::write(
        &regen_data,
        format!("{}\n{}\n{}\n", good[0], good[2], good[4]),
    )
    .unwrap();
    let regen = |out: &Path, partition: Option<Partition>| {
        let mut o = options(tiny_model(), &regen_data, out);
        o.max_len = 256;
        o.batch_size = 1;
        o.regenerate = Some(GenerationSettings {
            max_new_tokens: 6,
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            seed: 5,
        });
        o.partition = partition;
        dump(&o).unwrap();
    };
    regen(&dir.join("regen-whole"), None);
    for rank in 0..2 {
        regen(
            &dir.join("regen-split"),
            Some(Partition {
                rank,
                world_size: 2,
            }),
        );
    }
    assert_eq!(
        by_sample_id(records(&dir.join("regen-split"))),
        by_sample_id(records(&dir.join("regen-whole")))
    );
}
