//! `manifest.json`: what a dump directory holds and how it was made.
//!
//! The identity part (wiring, dataset, template, settings, storage) is also stored in every
//! shard's schema metadata, so a shard copied out of its directory still says what it is.
//! Shards are authoritative for the counts: [`crate::DumpReader`] and a resumed dump rebuild
//! the totals from the shards' own metadata, so a crash between renaming a shard and
//! rewriting `manifest.json` loses nothing.

use std::collections::BTreeMap;
use std::fmt;
use std::fs;
use std::io::Write;
use std::path::Path;

use serde::{Deserialize, Serialize};
use tandem_wiring::{TapId, check, format_taps};

use crate::error::FormatError;

/// Name in [`DumpManifest::format`].
pub const FORMAT_NAME: &str = "tandem-dump";
/// Layout version in [`DumpManifest::format_version`]; bumped on any incompatible change.
pub const FORMAT_VERSION: u32 = 1;
/// File name of the manifest inside a dump directory.
pub const MANIFEST_FILE: &str = "manifest.json";

/// Element type the hidden states are stored in.
///
/// Arrow has no bfloat16 type, so `bf16` is stored as `UInt16` bit patterns (the upper half of
/// the f32 bits, rounded to nearest-even); `f16` uses Arrow's `Float16`. Either way the dtype
/// is also in the field metadata (`tandem.dtype`). Serde/Display: `bf16`, `f16`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum StorageDtype {
    /// bfloat16 as `UInt16` bit patterns (the default: the range of f32, as SpecForge stores).
    #[default]
    Bf16,
    /// IEEE half precision as Arrow `Float16` (overflows above 65504).
    F16,
}

impl StorageDtype {
    /// `bf16` or `f16`.
    pub fn as_str(self) -> &'static str {
        match self {
            StorageDtype::Bf16 => "bf16",
            StorageDtype::F16 => "f16",
        }
    }
}

impl fmt::Display for StorageDtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for StorageDtype {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "bf16" | "bfloat16" => Ok(StorageDtype::Bf16),
            "f16" | "fp16" | "float16" | "half" => Ok(StorageDtype::F16),
            other => Err(format!("unknown storage dtype {other:?} (bf16, f16)")),
        }
    }
}

/// How `--regenerate` produced the assistant turns.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct GenerationSettings {
    /// Token budget of one assistant turn.
    pub max_new_tokens: usize,
    /// 0 = greedy.
    pub temperature: f32,
    /// Nucleus sampling threshold (1 = off).
    pub top_p: f32,
    /// Top-k (0 = off).
    pub top_k: usize,
    /// Base seed; each (record, turn) draws from its own stream derived from it, so a
    /// sample's reply does not depend on which batch it was generated in.
    pub seed: u64,
}

/// Settings that change the content of the rows; a resumed dump must use the same.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct DumpSettings {
    /// Samples are truncated to this many tokens.
    pub max_len: usize,
    /// `Some` when the target wrote the assistant turns itself (`--regenerate`).
    pub regenerate: Option<GenerationSettings>,
}

/// One completed shard, as recorded in its own footer metadata (`tandem.shard`) and in
/// `manifest.json`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardInfo {
    /// File name inside the dump directory, e.g. `shard-00000.arrow`.
    pub file: String,
    /// Rows (samples) in the shard.
    pub rows: u64,
    /// Tokens over those rows.
    pub tokens: u64,
    /// Tokens with loss mask 1.
    pub assistant_tokens: u64,
    /// First dataset record (0-based ordinal in the dataset stream, skipped records included)
    /// this shard accounts for.
    pub first_record: u64,
    /// One past the last dataset record it accounts for; the next shard starts here.
    pub end_record: u64,
    /// Records of `first_record..end_record` that did not become rows, by reason.
    pub skipped: BTreeMap<String, u64>,
    /// Rows cut to `max_len`.
    pub truncated: u64,
}

/// Everything about a dump directory: its wiring, how it was made, and what it holds.
///
/// JSON in `manifest.json`; the identity part (everything but the counts and the shard list)
/// is also each shard's `tandem.manifest` schema metadata.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DumpManifest {
    /// Always [`FORMAT_NAME`].
    pub format: String,
    /// [`FORMAT_VERSION`] of the writer.
    pub format_version: u32,
    /// What the aux states are wired to (job `dump`, execution path `prefill`, tap point
    /// residual stream, storage dtype).
    pub wiring: tandem_wiring::WiringManifest,
    /// Width T of one tap (the target's hidden size).
    pub hidden_size: usize,
    /// Taps per token in `aux_hidden` (= `wiring.taps.len()`); its width is `num_slots * T`.
    pub num_slots: usize,
    /// The tap stored in `last_hidden`: always the last block, `block L-1`.
    pub last_hidden_tap: TapId,
    /// Storage element type of `aux_hidden` and `last_hidden`.
    pub dtype: StorageDtype,
    /// Arrow IPC body compression (`zstd`).
    pub compression: String,
    /// The dataset: registry name, or the path given.
    pub dataset: String,
    /// `train` / `eval`, when known.
    pub dataset_split: Option<String>,
    /// SHA-256 of the chat template the samples were rendered with.
    pub chat_template_sha256: Option<String>,
    /// Settings that shape the rows.
    pub settings: DumpSettings,
    /// Rows over all shards.
    pub rows: u64,
    /// Tokens over all rows.
    pub tokens: u64,
    /// Tokens with loss mask 1.
    pub assistant_tokens: u64,
    /// Rows cut to `max_len`.
    pub truncated: u64,
    /// Dataset records accounted for (rows + skips); a resumed dump continues here.
    pub records_read: u64,
    /// Records that did not become rows, by reason (the dataset reader's reasons such as
    /// `malformed`, `non_utf8`, `single_role`, and the dump's own: `too_long`,
    /// `template_error`, `tokenizer_error`, `no_assistant_tokens`).
    pub skipped: BTreeMap<String, u64>,
    /// Whether the whole dataset has been read (false after a `--max-samples` stop).
    pub complete: bool,
    /// Completed shards, in order.
    pub shards: Vec<ShardInfo>,
    /// Set in the directory of one rank of a data-parallel dump (`tandem dump --rank R
    /// --world-size W`): it holds the dataset records `i` with `i % W == R`, and its record
    /// ordinals count those records only. Absent (`null`) in a single-process dump.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub partition: Option<Partition>,
}

/// One rank's share of a data-parallel dump: dataset records `i` with `i % world_size ==
/// rank`, written to `rank-RRRRR/` of the dump directory ([`partition_dir_name`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Partition {
    pub rank: usize,
    pub world_size: usize,
}

impl Partition {
    /// The dataset record (0-based, skipped records included) of this rank's local record
    /// `local`: regeneration seeds and sample order follow the global record, so a record is
    /// dumped the same whichever rank reads it.
    pub fn global_record(&self, local: u64) -> u64 {
        local * self.world_size as u64 + self.rank as u64
    }
}

/// The subdirectory rank `rank` of a data-parallel dump writes: `rank-00000`, ...
pub fn partition_dir_name(rank: usize) -> String {
    format!("rank-{rank:05}")
}

impl DumpManifest {
    /// A manifest with no rows yet for taps `wiring` stored as `dtype`: one slot per tap of the
    /// target's width, `last_hidden` from the last block, zstd, the chat template the wiring's
    /// fingerprint names. The writer fills in the counts and shards.
    pub fn new(
        wiring: tandem_wiring::WiringManifest,
        dtype: StorageDtype,
        dataset: impl Into<String>,
        settings: DumpSettings,
    ) -> Self {
        let target = &wiring.target;
        DumpManifest {
            format: FORMAT_NAME.to_owned(),
            format_version: FORMAT_VERSION,
            hidden_size: target.hidden_size,
            num_slots: wiring.taps.len(),
            last_hidden_tap: TapId::Block(target.num_layers.saturating_sub(1)),
            dtype,
            compression: "zstd".to_owned(),
            dataset: dataset.into(),
            dataset_split: None,
            chat_template_sha256: target.chat_template_sha256.clone(),
            settings,
            rows: 0,
            tokens: 0,
            assistant_tokens: 0,
            truncated: 0,
            records_read: 0,
            skipped: BTreeMap::new(),
            complete: false,
            shards: Vec::new(),
            partition: None,
            wiring,
        }
    }

    /// Width of one token's `aux_hidden` row: `num_slots * hidden_size`.
    pub fn aux_width(&self) -> usize {
        self.num_slots * self.hidden_size
    }

    /// The aux taps, in slot order.
    pub fn taps(&self) -> &[TapId] {
        &self.wiring.taps
    }

    /// Share of tokens under the loss mask.
    pub fn assistant_share(&self) -> f64 {
        if self.tokens == 0 {
            0.0
        } else {
            self.assistant_tokens as f64 / self.tokens as f64
        }
    }

    /// This manifest without counts or shards: what goes into each shard's schema metadata
    /// and what two runs must agree on.
    pub fn identity(&self) -> DumpManifest {
        DumpManifest {
            rows: 0,
            tokens: 0,
            assistant_tokens: 0,
            truncated: 0,
            records_read: 0,
            skipped: BTreeMap::new(),
            complete: false,
            shards: Vec::new(),
            ..self.clone()
        }
    }

    /// Recomputes the totals from `shards` (which are authoritative).
    pub fn recount(&mut self) {
        self.rows = self.shards.iter().map(|s| s.rows).sum();
        self.tokens = self.shards.iter().map(|s| s.tokens).sum();
        self.assistant_tokens = self.shards.iter().map(|s| s.assistant_tokens).sum();
        self.truncated = self.shards.iter().map(|s| s.truncated).sum();
        self.records_read = self.shards.last().map_or(0, |s| s.end_record);
        self.skipped.clear();
        for shard in &self.shards {
            for (reason, n) in &shard.skipped {
                *self.skipped.entry(reason.clone()).or_insert(0) += n;
            }
        }
    }

    /// Every way `other` (a new run) differs from `self` (what the directory holds) in what
    /// shapes the rows, one sentence each: the wiring check's sentences first, then the
    /// dataset, template, settings and storage. Empty when a run may add to the directory.
    pub fn differences(&self, other: &DumpManifest) -> Vec<String> {
        let mut out: Vec<String> = check(&self.wiring, &other.wiring)
            .iter()
            .map(ToString::to_string)
            .collect();
        if self.format_version != other.format_version {
            out.push(format!(
                "format version: the directory holds version {}, this build writes {}",
                self.format_version, other.format_version
            ));
        }
        if self.dataset != other.dataset {
            out.push(format!(
                "dataset: the directory was dumped from {:?}, this run reads {:?}",
                self.dataset, other.dataset
            ));
        }
        if self.chat_template_sha256 != other.chat_template_sha256
            && self.wiring.target.chat_template_sha256 == other.wiring.target.chat_template_sha256
        {
            out.push(format!(
                "chat template: {} in the directory, {} now",
                self.chat_template_sha256.as_deref().unwrap_or("none"),
                other.chat_template_sha256.as_deref().unwrap_or("none")
            ));
        }
        if self.last_hidden_tap != other.last_hidden_tap {
            out.push(format!(
                "last hidden state: {} in the directory, {} now",
                self.last_hidden_tap, other.last_hidden_tap
            ));
        }
        if self.settings.max_len != other.settings.max_len {
            out.push(format!(
                "max length: samples in the directory are cut at {} tokens, this run cuts at {}",
                self.settings.max_len, other.settings.max_len
            ));
        }
        match (&self.settings.regenerate, &other.settings.regenerate) {
            (None, Some(_)) => out.push(
                "regeneration: the directory holds the dataset's own replies, this run \
                 regenerates them (--regenerate)"
                    .to_owned(),
            ),
            (Some(_), None) => out.push(
                "regeneration: the directory holds replies regenerated by the target, this run \
                 uses the dataset's own (no --regenerate)"
                    .to_owned(),
            ),
            (Some(a), Some(b)) if a != b => out.push(format!(
                "generation settings: the directory was regenerated with {}, this run uses {}",
                describe_generation(a),
                describe_generation(b)
            )),
            _ => {}
        }
        if self.dtype != other.dtype {
            out.push(format!(
                "storage dtype: {} in the directory, {} now",
                self.dtype, other.dtype
            ));
        }
        if self.partition != other.partition {
            let describe = |p: &Option<Partition>| match p {
                Some(p) => format!("rank {} of {}", p.rank, p.world_size),
                None => "a single-process dump".to_owned(),
            };
            out.push(format!(
                "partition: the directory holds {}, this run writes {}",
                describe(&self.partition),
                describe(&other.partition)
            ));
        }
        out
    }

    /// Checks the manifest against itself (wiring valid, slot count and width agree).
    pub fn validate(&self, path: &Path) -> Result<(), FormatError> {
        let bad = |reason: String| FormatError::NotADump {
            path: path.to_owned(),
            reason,
        };
        if self.format != FORMAT_NAME {
            return Err(bad(format!(
                "format is {:?}, expected {FORMAT_NAME:?}",
                self.format
            )));
        }
        if self.format_version != FORMAT_VERSION {
            return Err(bad(format!(
                "format version {} is not supported (this build reads {FORMAT_VERSION})",
                self.format_version
            )));
        }
        self.wiring.validate().map_err(|e| bad(e.to_string()))?;
        if self.num_slots != self.wiring.taps.len() {
            return Err(bad(format!(
                "num_slots is {} but the wiring names {} taps {}",
                self.num_slots,
                self.wiring.taps.len(),
                format_taps(&self.wiring.taps)
            )));
        }
        if self.hidden_size != self.wiring.target.hidden_size {
            return Err(bad(format!(
                "hidden_size is {} but the target's is {}",
                self.hidden_size, self.wiring.target.hidden_size
            )));
        }
        Ok(())
    }

    /// Reads and validates `manifest.json`.
    pub fn load(path: &Path) -> Result<DumpManifest, FormatError> {
        let bytes = fs::read(path).map_err(FormatError::io("read", path))?;
        let manifest: DumpManifest =
            serde_json::from_slice(&bytes).map_err(|source| FormatError::Json {
                path: path.to_owned(),
                source,
            })?;
        manifest.validate(path)?;
        Ok(manifest)
    }

    /// Writes pretty JSON atomically (temporary file, sync, rename), so a crash never leaves
    /// half a manifest.
    pub fn save(&self, path: &Path) -> Result<(), FormatError> {
        let mut json = serde_json::to_string_pretty(self).map_err(|source| FormatError::Json {
            path: path.to_owned(),
            source,
        })?;
        json.push('\n');
        write_atomic(path, json.as_bytes())
    }

    /// The identity as compact JSON, for shard schema metadata.
    pub(crate) fn identity_json(&self) -> String {
        serde_json::to_string(&self.identity()).expect("a manifest always serialises")
    }
}

/// `greedy, 256 tokens/turn, seed 0` or `temperature 0.7, top-p 0.9, top-k 0, ...`.
pub fn describe_generation(g: &GenerationSettings) -> String {
    let mode = if g.temperature == 0.0 {
        "greedy".to_owned()
    } else {
        format!(
            "temperature {}, top-p {}, top-k {}",
            g.temperature, g.top_p, g.top_k
        )
    };
    format!("{mode}, {} tokens/turn, seed {}", g.max_new_tokens, g.seed)
}

/// Writes `bytes` to `path` through a temporary file in the same directory and a rename.
pub(crate) fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), FormatError> {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tmp = path.with_file_name(format!(".{name}.tmp"));
    let result = (|| {
        let mut file = fs::File::create(&tmp).map_err(FormatError::io("create", &tmp))?;
        file.write_all(bytes)
            .map_err(FormatError::io("write", &tmp))?;
        file.sync_all().map_err(FormatError::io("sync", &tmp))?;
        fs::rename(&tmp, path).map_err(FormatError::io("rename into place", path))
    })();
    if result.is_err() {
        // Best effort; the first error is the one to report.
        let _ = fs::remove_file(&tmp);
    }
    result
}
