//! The real registry datasets under `<workspace>/data/` (fetched by `scripts/fetch_datasets.sh`).
//! Each test passes with a printed skip message when its file is absent, so a fresh checkout
//! stays green; `cargo test -p tandem-data -- --nocapture` shows the measured numbers.

use std::path::PathBuf;
use std::time::Instant;

use tandem_data::{
    DatasetReader, Role, SkipReason, Split, humaneval_prompts, mtbench_prompts, open_dataset,
    registry_entry,
};

fn data_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../data")
}

/// The opened reader, or `None` (with a message) when the dataset is not fetched.
fn open_or_skip(name: &str) -> Option<DatasetReader> {
    let entry = registry_entry(name).unwrap();
    let path = entry.local_path(&data_root());
    if !path.is_file() {
        eprintln!(
            "SKIPPED: {} not found; run scripts/fetch_datasets.sh {name}",
            path.display()
        );
        return None;
    }
    Some(open_dataset(name, &data_root()).unwrap())
}

#[test]
fn sharegpt_streams_every_complete_record() {
    let Some(mut reader) = open_or_skip("sharegpt") else {
        return;
    };
    assert_eq!(reader.split(), Some(Split::Train));
    let start = Instant::now();
    let mut kept = 0u64;
    let mut turns_of_kept = 0u64;
    let mut skipped_by_reason = std::collections::BTreeMap::new();
    let mut tail = None;
    for item in reader.by_ref() {
        match item {
            Ok(c) => {
                kept += 1;
                turns_of_kept += c.messages.len() as u64;
                assert_ne!(
                    c.messages
                        .iter()
                        .find(|m| m.role != Role::System)
                        .unwrap()
                        .role,
                    Role::Assistant
                );
            }
            Err(s) => {
                *skipped_by_reason.entry(s.reason).or_insert(0u64) += 1;
                tail = Some(s);
            }
        }
    }
    let elapsed = start.elapsed();
    let stats = reader.into_stats();
    eprintln!("sharegpt: {stats}");
    eprintln!(
        "sharegpt: skips {}",
        serde_json::to_string(&stats.skipped).unwrap()
    );
    eprintln!("sharegpt: parse time {:.2?}", elapsed);

    let expected = registry_entry("sharegpt").unwrap().expected_records;
    // Every complete record parses; the cut-off tail is the one extra, malformed, record.
    assert_eq!(stats.parsed, expected);
    assert_eq!(stats.parsed_messages, 129_071);
    assert_eq!(stats.records, expected + 1);
    assert!(stats.truncated);
    let tail = tail.unwrap();
    assert_eq!(tail.reason, SkipReason::Malformed);
    assert!(tail.detail.contains("truncated"), "{tail}");
    assert_eq!(stats.skipped.get(SkipReason::Malformed), 1);
    assert_eq!(stats.skipped.get(SkipReason::NonUtf8), 0);
    assert_eq!(stats.kept, kept);
    assert_eq!(stats.messages, turns_of_kept);
    assert_eq!(stats.records, stats.kept + stats.skipped.total());
    for (reason, n) in skipped_by_reason {
        assert_eq!(stats.skipped.get(reason), n);
    }
}

#[test]
fn mtbench_has_80_two_turn_questions() {
    let Some(mut reader) = open_or_skip("mtbench") else {
        return;
    };
    assert_eq!(reader.split(), Some(Split::Eval));
    let convs: Vec<_> = reader.by_ref().collect::<Result<_, _>>().unwrap();
    assert_eq!(convs.len(), 80);
    assert!(
        convs
            .iter()
            .all(|c| c.messages.len() == 1 && c.messages[0].role == Role::User)
    );
    let path = registry_entry("mtbench").unwrap().local_path(&data_root());
    let prompts = mtbench_prompts(&path).unwrap();
    assert_eq!(prompts.len(), 80);
    assert!(prompts.iter().all(|p| p.turns.len() == 2));
    let mut categories: Vec<_> = prompts.iter().map(|p| p.category.as_str()).collect();
    categories.sort();
    categories.dedup();
    assert_eq!(categories.len(), 8);
    eprintln!("mtbench: {}; categories {categories:?}", reader.stats());
}

#[test]
fn humaneval_has_164_prompts() {
    let Some(mut reader) = open_or_skip("humaneval") else {
        return;
    };
    assert_eq!(reader.split(), Some(Split::Eval));
    let convs: Vec<_> = reader.by_ref().collect::<Result<_, _>>().unwrap();
    assert_eq!(convs.len(), 164);
    assert_eq!(convs[0].id, "HumanEval/0");
    let path = registry_entry("humaneval")
        .unwrap()
        .local_path(&data_root());
    let prompts = humaneval_prompts(&path).unwrap();
    assert_eq!(prompts.len(), 164);
    assert!(prompts[0].turns[0].starts_with("from typing import List"));
    eprintln!("humaneval: {}", reader.stats());
}
