//! Every accepted format, through the public API, on small inline fixtures.

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use tandem_data::{
    Conversation, DataError, DatasetReader, Format, Location, Message, Role, SkipCounts,
    SkipReason, Skipped, Split, eval_prompts, humaneval_prompts, mtbench_prompts, open_dataset,
};

/// A fresh directory under the system temp dir, removed on drop (no tempfile dependency
/// needed for this little).
struct TempDir(PathBuf);

impl TempDir {
    fn new() -> Self {
        static N: AtomicUsize = AtomicUsize::new(0);
        let dir = std::env::temp_dir().join(format!(
            "tandem-data-test-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }

    fn file(&self, name: &str, bytes: &[u8]) -> PathBuf {
        let p = self.0.join(name);
        fs::create_dir_all(p.parent().unwrap()).unwrap();
        fs::write(&p, bytes).unwrap();
        p
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

fn gzip(bytes: &[u8]) -> Vec<u8> {
    let mut enc = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    enc.write_all(bytes).unwrap();
    enc.finish().unwrap()
}

fn collect(reader: &mut DatasetReader) -> (Vec<Conversation>, Vec<Skipped>) {
    let (mut kept, mut skipped) = (Vec::new(), Vec::new());
    for item in reader {
        match item {
            Ok(c) => kept.push(c),
            Err(s) => skipped.push(s),
        }
    }
    (kept, skipped)
}

fn open(path: &Path) -> DatasetReader {
    DatasetReader::open(path, None).unwrap()
}

fn assert_invariant(r: &DatasetReader) {
    let s = r.stats();
    assert_eq!(s.records, s.kept + s.skipped.total(), "{s}");
    assert!(s.parsed >= s.kept && s.parsed <= s.records, "{s}");
}

const SHAREGPT: &str = r#"[
  {"id": "a_0", "conversations": [
    {"from": "human", "value": "Hi \"there\" [x] {y}"},
    {"from": "gpt", "value": "Hello!\nHow can I help?"}]},
  {"id": "b_1", "conversations": [
    {"from": "gpt", "value": "continued answer"},
    {"from": "human", "value": "next question"},
    {"from": "gpt", "value": "next answer"}]},
  {"id": "c_0", "conversations": [
    {"from": "human", "value": "call it"},
    {"from": "function", "value": "{}"}]},
  {"id": "d_0", "conversations": []},
  {"id": "e_0", "conversations": [
    {"from": "human", "value": "q"},
    {"from": "gpt", "value": "   "}]},
  {"id": "f_0", "conversations": [{"from": "human", "value": "no answer"}]},
  {"id": "g_0", "conversations": [
    {"from": "system", "value": "You are terse."},
    {"from": "human", "value": "q1"},
    {"from": "human", "value": "q2"},
    {"from": "bing", "value": "a"}]},
  {"id": "h_0", "conversations": "not a list"},
  {"id": "i_0", "conversations": [
    {"from": "human", "value": "complete record before the cut"},
    {"from": "gpt", "value": "yes"}]},
  {"id": "j_0", "conversations": [
    {"from": "human", "value": "this record is cut off mid-str"#;

#[test]
fn sharegpt_truncated_array() {
    let dir = TempDir::new();
    let path = dir.file("sg.json", SHAREGPT.as_bytes());
    let mut r = open(&path);
    assert_eq!(r.format(), Format::ShareGptJson);
    assert_eq!(r.split(), None);
    let (kept, skipped) = collect(&mut r);

    let ids: Vec<_> = kept.iter().map(|c| c.id.as_str()).collect();
    assert_eq!(ids, ["a_0", "b_1", "g_0", "i_0"]);
    assert_eq!(
        kept[0].messages,
        [
            Message::new(Role::User, "Hi \"there\" [x] {y}"),
            Message::new(Role::Assistant, "Hello!\nHow can I help?"),
        ]
    );
    // Leading assistant turn dropped.
    assert_eq!(
        kept[1].messages[0],
        Message::new(Role::User, "next question")
    );
    assert_eq!(kept[1].messages.len(), 2);
    // System kept; consecutive user turns kept.
    assert_eq!(kept[2].messages[0].role, Role::System);
    assert_eq!(kept[2].messages.len(), 4);
    assert!(!kept[2].roles_alternate());
    assert!(kept[0].roles_alternate());
    assert!(kept.iter().all(|c| c.source == path.display().to_string()));

    let reasons: Vec<_> = skipped.iter().map(|s| s.reason).collect();
    assert_eq!(
        reasons,
        [
            SkipReason::UnknownRole,
            SkipReason::EmptyConversation,
            SkipReason::EmptyMessage,
            SkipReason::SingleRole,
            SkipReason::Malformed,
            SkipReason::Malformed,
        ]
    );
    let tail = skipped.last().unwrap();
    assert!(matches!(tail.location, Location::Record { index: 10, .. }));
    assert!(tail.detail.contains("truncated"), "{}", tail.detail);
    let msg = tail.to_string();
    assert!(
        msg.contains("sg.json") && msg.contains("record 10"),
        "{msg}"
    );

    let s = r.stats();
    assert_eq!((s.records, s.parsed, s.kept, s.messages), (10, 8, 4, 10));
    assert_eq!(s.parsed_messages, 16);
    assert_eq!(s.skipped.get(SkipReason::Malformed), 2);
    assert_eq!(s.skipped.total(), 6);
    assert_eq!(s.leading_assistant_dropped, 1);
    assert_eq!(s.consecutive_same_role, 1);
    assert!(s.truncated);
    assert_invariant(&r);
}

#[test]
fn sharegpt_complete_array_and_take() {
    let dir = TempDir::new();
    let complete = format!(
        "{}\"}}, {{\"from\": \"gpt\", \"value\": \"a\"}}]}}\n]\n",
        SHAREGPT
    );
    let path = dir.file("sg.json", complete.as_bytes());
    let mut r = open(&path);
    let (kept, _) = collect(&mut r);
    assert_eq!(kept.len(), 5);
    assert!(!r.stats().truncated);
    assert_eq!(r.stats().skipped.get(SkipReason::Malformed), 1);

    // `max_samples` is the caller's `.take`; stats cover what was read.
    let mut r = open(&path);
    let first: Vec<_> = r.by_ref().filter_map(Result::ok).take(2).collect();
    assert_eq!(first.len(), 2);
    assert_eq!(r.stats().records, 2);
}

#[test]
fn non_utf8_inside_a_record_is_skipped_alone() {
    let dir = TempDir::new();
    let mut bytes = Vec::new();
    bytes.extend_from_slice(b"[{\"id\":\"ok1\",\"conversations\":[{\"from\":\"human\",\"value\":\"q\"},{\"from\":\"gpt\",\"value\":\"a\"}]},\n");
    bytes.extend_from_slice(b"{\"id\":\"bad\",\"conversations\":[{\"from\":\"human\",\"value\":\"caf\xe9 \xff\"},{\"from\":\"gpt\",\"value\":\"a\"}]},\n");
    bytes.extend_from_slice(b"{\"id\":\"ok2\",\"conversations\":[{\"from\":\"human\",\"value\":\"caf\xc3\xa9\"},{\"from\":\"gpt\",\"value\":\"a\"}]}]");
    let path = dir.file("latin1.json", &bytes);
    let mut r = open(&path);
    let (kept, skipped) = collect(&mut r);
    assert_eq!(kept.len(), 2);
    assert_eq!(kept[1].messages[0].content, "café");
    assert_eq!(skipped.len(), 1);
    assert_eq!(skipped[0].reason, SkipReason::NonUtf8);
    assert!(matches!(
        skipped[0].location,
        Location::Record { index: 2, .. }
    ));
    assert_eq!(r.stats().parsed, 2);
    assert_invariant(&r);

    // The same in JSONL.
    let mut lines = Vec::new();
    lines.extend_from_slice(b"{\"messages\":[{\"role\":\"user\",\"content\":\"\xfe\"},{\"role\":\"assistant\",\"content\":\"a\"}]}\n");
    lines.extend_from_slice(b"{\"messages\":[{\"role\":\"user\",\"content\":\"q\"},{\"role\":\"assistant\",\"content\":\"a\"}]}\n");
    // Detection skips the undecodable first line and looks at the next.
    let path = dir.file("x.jsonl", &lines);
    let mut r = open(&path);
    assert_eq!(r.format(), Format::ChatJsonl);
    let (kept, skipped) = collect(&mut r);
    assert_eq!(kept.len(), 1);
    assert_eq!(kept[0].id, "line-2");
    assert_eq!(skipped[0].reason, SkipReason::NonUtf8);
    assert_eq!(skipped[0].location, Location::Line(1));
}

#[test]
fn chat_jsonl_both_spellings_blank_lines_and_line_numbers() {
    let dir = TempDir::new();
    let text = concat!(
        r#"{"id": "m1", "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}"#,
        "\n\n",
        r#"{"conversations": [{"from": "HUMAN", "value": "q"}, {"from": "Model", "value": "a"}]}"#,
        "\r\n",
        "{not json\n",
        r#"{"messages": [{"role": "user", "content": "q"}]}"#,
        "\n",
        r#"{"messages": [{"role": "tool", "content": "x"}]}"#,
        "\n   \n"
    );
    let path = dir.file("chat.data", text.as_bytes());
    let mut r = open(&path);
    assert_eq!(r.format(), Format::ChatJsonl);
    let (kept, skipped) = collect(&mut r);
    assert_eq!(kept.len(), 2);
    assert_eq!(kept[0].id, "m1");
    assert_eq!(kept[0].messages.len(), 3);
    assert_eq!(kept[1].id, "line-3");
    assert_eq!(kept[1].messages[1], Message::new(Role::Assistant, "a"));
    let got: Vec<_> = skipped.iter().map(|s| (s.location, s.reason)).collect();
    assert_eq!(
        got,
        [
            (Location::Line(4), SkipReason::Malformed),
            (Location::Line(5), SkipReason::SingleRole),
            (Location::Line(6), SkipReason::UnknownRole),
        ]
    );
    assert_eq!(r.stats().records, 5);
    assert_invariant(&r);

    // Prompt-only reading keeps the user-only conversation.
    let r = open(&path).require_assistant(false);
    assert_eq!(r.filter_map(Result::ok).count(), 3);
}

const MTBENCH: &str = concat!(
    r#"{"question_id": 81, "category": "writing", "turns": ["Write a post.", "Rewrite it."]}"#,
    "\n",
    r#"{"question_id": 82, "category": "math", "turns": ["What is 2+2?", "And 3+3?"]}"#,
    "\n"
);

#[test]
fn mtbench_question_jsonl() {
    let dir = TempDir::new();
    let path = dir.file("question.jsonl", MTBENCH.as_bytes());
    let mut r = open(&path);
    assert_eq!(r.format(), Format::MtBenchJsonl);
    assert_eq!(r.split(), Some(Split::Eval));
    let (kept, skipped) = collect(&mut r);
    assert!(skipped.is_empty());
    assert_eq!(kept.len(), 2);
    assert_eq!(kept[0].id, "81");
    assert_eq!(
        kept[0].messages,
        [Message::new(Role::User, "Write a post.")]
    );

    let prompts = mtbench_prompts(&path).unwrap();
    assert_eq!(prompts.len(), 2);
    assert_eq!(prompts[1].id, "82");
    assert_eq!(prompts[1].category, "math");
    assert_eq!(prompts[1].turns, ["What is 2+2?", "And 3+3?"]);

    // Strict: a bad line is an error naming file and line.
    let bad = format!("{MTBENCH}{{\"question_id\": 83, \"turns\": [\"\"]}}\n");
    let path = dir.file("bad/question.jsonl", bad.as_bytes());
    let err = mtbench_prompts(&path).unwrap_err();
    assert!(matches!(
        err,
        DataError::Record {
            location: Location::Line(3),
            ..
        }
    ));
    let msg = err.to_string();
    assert!(
        msg.contains("question.jsonl: line 3: empty_message"),
        "{msg}"
    );
    let dup = format!("{MTBENCH}{}", MTBENCH.lines().next().unwrap());
    let path = dir.file("dup/question.jsonl", dup.as_bytes());
    assert!(
        mtbench_prompts(&path)
            .unwrap_err()
            .to_string()
            .contains("duplicate id")
    );
}

const HUMANEVAL: &str = concat!(
    r#"{"task_id": "HumanEval/0", "prompt": "def f(x):\n    \"\"\"doc\"\"\"\n", "entry_point": "f", "canonical_solution": "    return x\n", "test": ""}"#,
    "\n",
    r#"{"task_id": "HumanEval/1", "prompt": "def g():\n", "entry_point": "g", "canonical_solution": "", "test": ""}"#,
    "\n"
);

#[test]
fn humaneval_gzip_and_plain() {
    let dir = TempDir::new();
    let gz = dir.file("HumanEval.jsonl.gz", &gzip(HUMANEVAL.as_bytes()));
    let plain = dir.file("he.jsonl", HUMANEVAL.as_bytes());
    for path in [&gz, &plain] {
        let mut r = open(path);
        assert_eq!(r.format(), Format::HumanEvalJsonl);
        assert_eq!(r.split(), Some(Split::Eval));
        let (kept, skipped) = collect(&mut r);
        assert!(skipped.is_empty());
        assert_eq!(kept[0].id, "HumanEval/0");
        assert_eq!(
            kept[0].messages,
            [Message::new(Role::User, "def f(x):\n    \"\"\"doc\"\"\"\n")]
        );
        let prompts = humaneval_prompts(path).unwrap();
        assert_eq!(prompts.len(), 2);
        assert_eq!(prompts[1].turns, ["def g():\n"]);
        assert_eq!(prompts[1].category, "humaneval");
    }
}

#[test]
fn corrupt_gzip_ends_with_one_read_error() {
    let dir = TempDir::new();
    let many: String = (0..2000)
        .map(|i| {
            format!(
                "{{\"task_id\": \"T/{i}\", \"prompt\": \"p{i} {}\"}}\n",
                "x".repeat(i % 50)
            )
        })
        .collect();
    let z = gzip(many.as_bytes());
    let path = dir.file("cut.jsonl.gz", &z[..z.len() / 2]);
    let mut r = open(&path);
    let (kept, skipped) = collect(&mut r);
    assert!(!kept.is_empty() && kept.len() < 2000);
    let last = skipped.last().unwrap();
    assert_eq!(last.reason, SkipReason::ReadError);
    assert_eq!(r.stats().skipped.get(SkipReason::ReadError), 1);
    assert_invariant(&r);
    assert!(r.next().is_none());
}

#[test]
fn registry_names_resolve_under_data_root() {
    let dir = TempDir::new();
    let err = open_dataset("mtbench", &dir.0).unwrap_err();
    assert!(matches!(err, DataError::NotFetched { .. }));
    assert!(
        err.to_string()
            .contains("scripts/fetch_datasets.sh mtbench"),
        "{err}"
    );

    dir.file("mtbench/question.jsonl", MTBENCH.as_bytes());
    let r = open_dataset("mtbench", &dir.0).unwrap();
    assert_eq!(r.source(), "mtbench");
    assert_eq!(r.split(), Some(Split::Eval));
    let convs: Vec<_> = r.filter_map(Result::ok).collect();
    assert_eq!(convs.len(), 2);
    assert_eq!(convs[0].source, "mtbench");
    assert_eq!(eval_prompts("mtbench", &dir.0).unwrap().len(), 2);

    // The registry's format is enforced: an array where JSONL is expected fails up front.
    dir.file("humaneval/HumanEval.jsonl.gz", &gzip(b"[]"));
    let err = open_dataset("humaneval", &dir.0).unwrap_err();
    assert!(
        err.to_string().contains("expected humaneval-jsonl"),
        "{err}"
    );

    dir.file(
        "sharegpt/ShareGPT_V3_unfiltered_cleaned_split.json",
        SHAREGPT.as_bytes(),
    );
    let r = open_dataset("sharegpt", &dir.0).unwrap();
    assert_eq!(r.split(), Some(Split::Train));
    assert_eq!(r.filter_map(Result::ok).count(), 4);
    let err = eval_prompts("sharegpt", &dir.0).unwrap_err();
    assert!(
        err.to_string().contains("not an evaluation prompt format"),
        "{err}"
    );

    // A path works as a spec; an unknown name lists the registry.
    let p = dir.file("local.jsonl", MTBENCH.as_bytes());
    let r = open_dataset(p.to_str().unwrap(), &dir.0).unwrap();
    assert_eq!(r.format(), Format::MtBenchJsonl);
    let err = open_dataset("ultrachat", &dir.0).unwrap_err();
    assert!(matches!(err, DataError::UnknownDataset { .. }));
    assert!(
        err.to_string().contains("sharegpt, mtbench, humaneval"),
        "{err}"
    );
}

#[test]
fn unreadable_files_fail_up_front() {
    let dir = TempDir::new();
    let cases: [(&str, &[u8], &str); 5] = [
        ("empty.json", b"", "empty"),
        ("blank.jsonl", b"\n  \n", "empty"),
        ("text.txt", b"hello", "not JSON or JSONL"),
        ("obj.json", b"{\n  \"a\": 1\n}\n", "cannot tell the format"),
        (
            "other.jsonl",
            b"{\"text\": \"x\"}\n",
            "cannot tell the format",
        ),
    ];
    for (name, bytes, want) in cases {
        let path = dir.file(name, bytes);
        let err = DatasetReader::open(&path, None).err().unwrap();
        let msg = err.to_string();
        assert!(msg.contains(name) && msg.contains(want), "{name}: {msg}");
    }
    let err = DatasetReader::open(&dir.0.join("missing.json"), None)
        .err()
        .unwrap();
    assert!(matches!(err, DataError::Io { .. }));
    // A JSONL file named .json is read by content.
    let path = dir.file("actually-lines.json", MTBENCH.as_bytes());
    assert_eq!(open(&path).format(), Format::MtBenchJsonl);
    // Asking for an array format on a JSONL file fails.
    let err = DatasetReader::open(&path, Some(Format::ShareGptJson))
        .err()
        .unwrap();
    assert!(err.to_string().contains("expected sharegpt-json"), "{err}");
}

#[test]
fn skip_counts_serialise_as_a_map() {
    let mut c = SkipCounts::default();
    c.add(SkipReason::NonUtf8);
    c.add(SkipReason::Malformed);
    c.add(SkipReason::NonUtf8);
    let json = serde_json::to_string(&c).unwrap();
    assert_eq!(json, r#"{"malformed":1,"non_utf8":2}"#);
    let back: SkipCounts = serde_json::from_str(&json).unwrap();
    assert_eq!(back, c);
    assert_eq!(c.to_string(), "malformed=1 non_utf8=2");
    for r in SkipReason::ALL {
        assert_eq!(serde_json::to_value(r).unwrap(), r.as_str());
    }
    let mut total = SkipCounts::default();
    total.merge(&c);
    total.merge(&c);
    assert_eq!(total.get(SkipReason::NonUtf8), 4);
    assert_eq!(total.total(), 6);
}

#[test]
fn reader_is_send_and_jsonl_bom_is_ignored() {
    fn assert_send<T: Send>() {}
    assert_send::<DatasetReader>();
    let dir = TempDir::new();
    let path = dir.file("bom.jsonl", format!("\u{feff}{MTBENCH}").as_bytes());
    let mut r = open(&path);
    assert_eq!(r.format(), Format::MtBenchJsonl);
    assert_eq!(collect(&mut r).0.len(), 2);
    assert_eq!(mtbench_prompts(&path).unwrap().len(), 2);
}

#[test]
fn role_normalisation() {
    for (name, role) in [
        ("human", Role::User),
        ("USER", Role::User),
        (" Human ", Role::User),
        ("gpt", Role::Assistant),
        ("assistant", Role::Assistant),
        ("ChatGPT", Role::Assistant),
        ("bing", Role::Assistant),
        ("Bard", Role::Assistant),
        ("model", Role::Assistant),
        ("System", Role::System),
    ] {
        assert_eq!(Role::parse(name), Some(role), "{name}");
        assert_eq!(name.parse::<Role>().unwrap(), role);
    }
    for name in ["function", "tool", "observation", "", "humans"] {
        assert_eq!(Role::parse(name), None, "{name}");
        assert!(name.parse::<Role>().is_err());
    }
    assert_eq!(Role::Assistant.as_str(), "assistant");
    assert_eq!(serde_json::to_string(&Role::User).unwrap(), "\"user\"");
}
