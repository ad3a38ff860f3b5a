//! The wiring manifest: what a dump, a trained head or a serving path was wired to, and the
//! check that compares two of them.
//!
//! Every artefact Tandem produces carries one. Comparing the training-side manifest with the
//! serving-side one catches the field failure modes (facts section 6) before they show up as
//! a silently collapsed accept length.

use std::collections::BTreeMap;
use std::fmt;
use std::fs;
use std::io::Write;
use std::path::Path;
use std::str::FromStr;

use serde::{Deserialize, Serialize};
use serde_json::Value;
use sha2::{Digest, Sha256};

use crate::convention::RawIds;
use crate::error::{Result, WiringError};
use crate::taps::{TapId, TapPoint, format_taps};

/// The manifest schema this build writes and reads.
pub const SCHEMA_VERSION: u32 = 1;

/// Lowercase hex SHA-256 of `bytes`.
pub fn sha256_hex(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

/// Compact JSON with object keys sorted at every level.
///
/// Hashing this instead of the file's bytes makes fingerprints insensitive to whitespace, key
/// order and number spelling (`1e-05` vs `0.00001`), which differ between tools that re-save
/// the same config. Floats are written in Rust's shortest round-trip exponent form (`1e-5`).
/// Keys are sorted explicitly rather than relying on serde_json's map type, whose order
/// depends on a feature another crate in the build may switch on.
pub fn canonical_json(value: &Value) -> String {
    let mut out = String::new();
    write_canonical(value, &mut out);
    out
}

fn write_canonical(value: &Value, out: &mut String) {
    match value {
        Value::Object(map) => {
            let sorted: BTreeMap<&String, &Value> = map.iter().collect();
            out.push('{');
            for (i, (k, v)) in sorted.into_iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                out.push_str(&Value::String(k.clone()).to_string());
                out.push(':');
                write_canonical(v, out);
            }
            out.push('}');
        }
        Value::Array(items) => {
            out.push('[');
            for (i, v) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                write_canonical(v, out);
            }
            out.push(']');
        }
        // Floats in Rust's shortest round-trip exponent form rather than serde_json's, whose
        // float formatter has changed between releases: a hash must not depend on it.
        Value::Number(n) if n.is_f64() => match n.as_f64() {
            Some(f) => out.push_str(&format!("{f:e}")),
            None => out.push_str(&n.to_string()),
        },
        scalar => out.push_str(&scalar.to_string()),
    }
}

/// Identity of the target model the taps were taken from.
///
/// Hashes: `config_sha256` and `tokenizer_sha256` are SHA-256 of [`canonical_json`] of the
/// parsed file; `chat_template_sha256` is SHA-256 of the template's UTF-8 bytes exactly as
/// given (whitespace in a template changes the rendered prompt, so it is not normalised).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TargetFingerprint {
    /// `architectures[0]` from config.json, e.g. `LlamaForCausalLM`.
    pub architecture: String,
    /// `model_type` from config.json, e.g. `llama`.
    pub model_type: String,
    /// `num_hidden_layers`: the number of decoder blocks.
    pub num_layers: usize,
    /// `hidden_size`: width of one tap.
    pub hidden_size: usize,
    /// `vocab_size` of the target.
    pub vocab_size: usize,
    /// SHA-256 of the canonical config.json.
    pub config_sha256: String,
    /// SHA-256 of the canonical tokenizer.json.
    pub tokenizer_sha256: String,
    /// SHA-256 of the chat template, when one is used to render prompts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub chat_template_sha256: Option<String>,
}

impl TargetFingerprint {
    /// Fingerprints a Hugging Face model directory's `config.json` and `tokenizer.json`.
    pub fn from_files(
        config_json: &Path,
        tokenizer_json: &Path,
        chat_template: Option<&str>,
    ) -> Result<Self> {
        let config = read_file(config_json)?;
        let tokenizer = read_file(tokenizer_json)?;
        Self::from_json_bytes(
            &config,
            config_json,
            &tokenizer,
            tokenizer_json,
            chat_template,
        )
    }

    /// Like [`TargetFingerprint::from_files`] for bytes already in memory; the paths only
    /// name the sources in errors.
    pub fn from_json_bytes(
        config_json: &[u8],
        config_name: &Path,
        tokenizer_json: &[u8],
        tokenizer_name: &Path,
        chat_template: Option<&str>,
    ) -> Result<Self> {
        let config: Value = parse_json(config_json, config_name)?;
        let tokenizer: Value = parse_json(tokenizer_json, tokenizer_name)?;
        // Multimodal configs keep the language model under `text_config`.
        let text = config.get("text_config").filter(|v| v.is_object());
        let field = |name: &'static str| -> Result<&Value> {
            config
                .get(name)
                .or_else(|| text.and_then(|t| t.get(name)))
                .ok_or_else(|| WiringError::ConfigField {
                    path: config_name.to_owned(),
                    field: name,
                    reason: "is missing".to_owned(),
                })
        };
        let count = |name: &'static str| -> Result<usize> {
            let v = field(name)?;
            v.as_u64()
                .and_then(|n| usize::try_from(n).ok())
                .ok_or_else(|| WiringError::ConfigField {
                    path: config_name.to_owned(),
                    field: name,
                    reason: format!("is not a non-negative integer: {v}"),
                })
        };
        let architecture = field("architectures")?
            .get(0)
            .and_then(Value::as_str)
            .ok_or_else(|| WiringError::ConfigField {
                path: config_name.to_owned(),
                field: "architectures",
                reason: "has no string as its first element".to_owned(),
            })?
            .to_owned();
        let model_type = field("model_type")?
            .as_str()
            .ok_or_else(|| WiringError::ConfigField {
                path: config_name.to_owned(),
                field: "model_type",
                reason: "is not a string".to_owned(),
            })?
            .to_owned();
        Ok(TargetFingerprint {
            architecture,
            model_type,
            num_layers: count("num_hidden_layers")?,
            hidden_size: count("hidden_size")?,
            vocab_size: count("vocab_size")?,
            config_sha256: sha256_hex(canonical_json(&config).as_bytes()),
            tokenizer_sha256: sha256_hex(canonical_json(&tokenizer).as_bytes()),
            chat_template_sha256: chat_template.map(|t| sha256_hex(t.as_bytes())),
        })
    }
}

fn read_file(path: &Path) -> Result<Vec<u8>> {
    fs::read(path).map_err(|source| WiringError::Io {
        action: "read",
        path: path.to_owned(),
        source,
    })
}

fn parse_json<T: serde::de::DeserializeOwned>(bytes: &[u8], path: &Path) -> Result<T> {
    serde_json::from_slice(bytes).map_err(|source| WiringError::Json {
        path: path.to_owned(),
        source,
    })
}

/// The Tandem job that produced a manifest. Serde/Display: `dump`, `train`, `serve`, `replay`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Job {
    /// Offline capture of aux states for training.
    Dump,
    /// Training of the draft head.
    Train,
    /// Online speculative decoding.
    Serve,
    /// Re-running captured data through a path to compare it.
    Replay,
}

impl fmt::Display for Job {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Job::Dump => "dump",
            Job::Train => "train",
            Job::Serve => "serve",
            Job::Replay => "replay",
        })
    }
}

impl FromStr for Job {
    type Err = WiringError;

    fn from_str(s: &str) -> Result<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "dump" => Ok(Job::Dump),
            "train" => Ok(Job::Train),
            "serve" => Ok(Job::Serve),
            "replay" => Ok(Job::Replay),
            _ => Err(WiringError::Parse {
                input: s.to_owned(),
                reason: "expected a job: dump, train, serve or replay".to_owned(),
            }),
        }
    }
}

/// Who wrote a manifest. Informational: producer differences are never mismatches.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Producer {
    /// Always `tandem` for manifests written by this project.
    pub tool: String,
    /// Version of the tool.
    pub tool_version: String,
    /// Which job captured the taps.
    pub job: Job,
    /// Device description, e.g. `cpu` or `cuda:0 (NVIDIA H200)`.
    pub device: String,
    /// Which forward path captured them: `prefill`, `decode`, `tree-verify`, `micro-batch`...
    /// Recorded because a path that skips the tap is a known failure mode.
    pub execution_path: String,
}

impl Producer {
    /// A producer record for this build of Tandem.
    pub fn tandem(job: Job, device: impl Into<String>, execution_path: impl Into<String>) -> Self {
        Producer {
            tool: "tandem".to_owned(),
            tool_version: env!("CARGO_PKG_VERSION").to_owned(),
            job,
            device: device.into(),
            execution_path: execution_path.into(),
        }
    }
}

/// What a set of captured hidden states (or a head trained on them) is wired to.
///
/// JSON example:
/// ```json
/// {"schema_version": 1,
///  "target": {"architecture": "LlamaForCausalLM", "model_type": "llama", "num_layers": 30, ..},
///  "taps": ["block:1", "block:14", "block:26"], "tap_point": "residual-stream",
///  "dtype": "f32", "producer": {"tool": "tandem", "job": "dump", ..},
///  "raw_ids": {"convention": "sglang-heuristic", "ids": [1, 14, 26]}}
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WiringManifest {
    /// Always [`SCHEMA_VERSION`] when written by this build.
    pub schema_version: u32,
    /// The target model.
    pub target: TargetFingerprint,
    /// Ordered slots: slot i of the concatenated aux state is `taps[i]`.
    pub taps: Vec<TapId>,
    /// Which value is captured at each tap.
    pub tap_point: TapPoint,
    /// Element type of the captured states: `f32`, `bf16`, `f16`.
    pub dtype: String,
    /// Who wrote this.
    pub producer: Producer,
    /// How the user asked for the taps, when they gave engine ids.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub raw_ids: Option<RawIds>,
    /// A trained head's data: the dumps it was fitted on (job `train`; empty for a dump's own
    /// manifest). Provenance only, never part of [`check`]; manifests written before this
    /// field existed read as empty.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub trained_on: Vec<DumpRef>,
}

/// Names one dump a head was trained on, so a head can be traced to its data: the dump
/// directory, a hash of its `manifest.json` as it was when training read it (the manifest
/// lists every shard with its rows and record range), what it was dumped from and its size.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DumpRef {
    /// The dump directory's name (its last path component), e.g. `sharegpt-regen`.
    pub name: String,
    /// The directory as the trainer was given it.
    pub path: String,
    /// Lowercase hex SHA-256 of the dump's `manifest.json` bytes; `None` for rows that did
    /// not come from a dump directory (in-memory sources).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub manifest_sha256: Option<String>,
    /// The dataset the dump was made from (registry name or path), when known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dataset: Option<String>,
    /// Whether the assistant turns were regenerated by the target (`tandem dump
    /// --regenerate`), when known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub regenerated: Option<bool>,
    /// Rows in the dump.
    pub rows: u64,
    /// Tokens over those rows.
    pub tokens: u64,
    /// For a head trained in stages (each `tandem train --init-from` the previous head): the
    /// stage this dump was used in, 0 first. Absent for a head trained in one run.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stage: Option<u32>,
}

/// The data lineage a head exports: the dumps of the head it started from (`prior`, its
/// `trained_on`), then the dumps of this run (`current`) as the next stage. A head trained in
/// one run (no prior) keeps `current` unstaged. (A resumed run exports its checkpoint's
/// lineage as it is: the caller does not call this.)
pub fn lineage(prior: &[DumpRef], current: &[DumpRef]) -> Vec<DumpRef> {
    if prior.is_empty() {
        return current.to_vec();
    }
    let staged: Vec<DumpRef> = prior
        .iter()
        .map(|d| DumpRef {
            stage: Some(d.stage.unwrap_or(0)),
            ..d.clone()
        })
        .collect();
    let next = staged.iter().filter_map(|d| d.stage).max().unwrap_or(0) + 1;
    staged
        .into_iter()
        .chain(current.iter().map(|d| DumpRef {
            stage: Some(next),
            ..d.clone()
        }))
        .collect()
}

impl fmt::Display for DumpRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} ({} rows, {} tokens",
            self.name, self.rows, self.tokens
        )?;
        if let Some(sha) = &self.manifest_sha256 {
            write!(f, ", manifest sha256 {}", &sha[..sha.len().min(12)])?;
        }
        write!(f, ")")
    }
}

impl WiringManifest {
    /// A manifest at the current schema version, without raw ids.
    pub fn new(
        target: TargetFingerprint,
        taps: Vec<TapId>,
        tap_point: TapPoint,
        dtype: impl Into<String>,
        producer: Producer,
    ) -> Self {
        WiringManifest {
            schema_version: SCHEMA_VERSION,
            target,
            taps,
            tap_point,
            dtype: dtype.into(),
            producer,
            raw_ids: None,
            trained_on: Vec::new(),
        }
    }

    /// Records the engine ids the taps were requested with.
    pub fn with_raw_ids(mut self, raw_ids: RawIds) -> Self {
        self.raw_ids = Some(raw_ids);
        self
    }

    /// Checks the manifest against itself: at least one tap, every tap exists in the target,
    /// and recorded raw ids resolve to exactly the recorded taps (a mismatch there is how a
    /// silent fallback to default ids shows up).
    pub fn validate(&self) -> Result<()> {
        let invalid = |reason: String| WiringError::InvalidManifest { path: None, reason };
        if self.taps.is_empty() {
            return Err(invalid("no taps".to_owned()));
        }
        let layers = self.target.num_layers;
        for tap in &self.taps {
            tap.check_exists(layers)
                .map_err(|e| invalid(e.to_string()))?;
        }
        if let Some(raw) = &self.raw_ids {
            let resolved = raw
                .to_canonical(layers)
                .map_err(|e| invalid(format!("raw ids {raw}: {e}")))?;
            if resolved != self.taps {
                return Err(invalid(format!(
                    "raw ids {raw} name {} but the recorded taps are {}",
                    format_taps(&resolved),
                    format_taps(&self.taps)
                )));
            }
        }
        Ok(())
    }

    /// Writes pretty JSON atomically: a temporary file in the same directory, then a rename,
    /// so a reader never sees half a manifest.
    pub fn save(&self, path: &Path) -> Result<()> {
        let name = path.file_name().ok_or_else(|| WiringError::Io {
            action: "write",
            path: path.to_owned(),
            source: std::io::Error::new(std::io::ErrorKind::InvalidInput, "not a file path"),
        })?;
        let tmp = path.with_file_name(format!(
            ".{}.tmp-{}",
            name.to_string_lossy(),
            std::process::id()
        ));
        let mut json = serde_json::to_string_pretty(self).map_err(|source| WiringError::Json {
            path: path.to_owned(),
            source,
        })?;
        json.push('\n');
        let io = |action, path: &Path| {
            let path = path.to_owned();
            move |source| WiringError::Io {
                action,
                path,
                source,
            }
        };
        let write = || -> Result<()> {
            let mut file = fs::File::create(&tmp).map_err(io("create", &tmp))?;
            file.write_all(json.as_bytes()).map_err(io("write", &tmp))?;
            file.sync_all().map_err(io("sync", &tmp))?;
            fs::rename(&tmp, path).map_err(io("rename into place", path))
        };
        let result = write();
        if result.is_err() {
            // Best effort: do not leave the temporary file behind; the first error matters.
            let _ = fs::remove_file(&tmp);
        }
        result
    }

    /// Reads and validates a manifest. Errors name the file and, for JSON errors, the line
    /// and column.
    pub fn load(path: &Path) -> Result<Self> {
        let bytes = read_file(path)?;
        // Look at the version first so that a future schema gets a clear error instead of a
        // confusing "missing field".
        #[derive(Deserialize)]
        struct Version {
            schema_version: u32,
        }
        let version: Version = parse_json(&bytes, path)?;
        if version.schema_version != SCHEMA_VERSION {
            return Err(WiringError::UnsupportedSchema {
                path: path.to_owned(),
                found: version.schema_version,
                supported: SCHEMA_VERSION,
            });
        }
        let manifest: WiringManifest = parse_json(&bytes, path)?;
        manifest.validate().map_err(|e| match e {
            WiringError::InvalidManifest { reason, .. } => WiringError::InvalidManifest {
                path: Some(path.to_owned()),
                reason,
            },
            other => other,
        })?;
        Ok(manifest)
    }
}

/// What a [`Mismatch`] is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum MismatchKind {
    /// One slot holds a different tap.
    SlotTap,
    /// Different numbers of taps.
    SlotCount,
    /// Residual stream vs normed output.
    TapPoint,
    /// Different architecture or model type.
    Architecture,
    /// Different number of decoder blocks.
    LayerCount,
    /// Different hidden size.
    HiddenSize,
    /// Different vocabulary size.
    VocabSize,
    /// Different config.json.
    ConfigHash,
    /// Different tokenizer.json.
    TokenizerHash,
    /// Different (or missing) chat template.
    ChatTemplateHash,
    /// Different element type of the captured states.
    Dtype,
}

/// How bad a [`Mismatch`] is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Severity {
    /// Advisory: numerics drift a little, the wiring is right.
    Warning,
    /// The head will not see what it was trained on.
    Error,
}

/// One difference between the expected (training-side) and actual (serving-side) manifest.
///
/// `Display` gives the sentence, followed by the hint in parentheses when there is one.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Mismatch {
    /// What differs.
    pub kind: MismatchKind,
    /// Error or warning.
    pub severity: Severity,
    /// The slot, for [`MismatchKind::SlotTap`].
    pub slot: Option<usize>,
    /// The expected value, as text.
    pub expected: String,
    /// The actual value, as text.
    pub actual: String,
    /// A sentence a person understands, e.g. "slot 0: trained on embed, served block 2".
    pub message: String,
    /// A likely cause, e.g. a layer-id convention mismatch. Only the first tap mismatch of a
    /// check carries the tap-pattern hint, so a list of mismatches does not repeat it.
    pub hint: Option<String>,
}

impl Mismatch {
    /// Whether this mismatch breaks the wiring (as opposed to an advisory warning).
    pub fn is_fatal(&self) -> bool {
        self.severity == Severity::Error
    }

    fn new(
        kind: MismatchKind,
        expected: impl ToString,
        actual: impl ToString,
        message: String,
    ) -> Self {
        Mismatch {
            kind,
            severity: Severity::Error,
            slot: None,
            expected: expected.to_string(),
            actual: actual.to_string(),
            message,
            hint: None,
        }
    }
}

impl fmt::Display for Mismatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)?;
        if let Some(hint) = &self.hint {
            write!(f, " ({hint})")?;
        }
        Ok(())
    }
}

/// Compares the manifest a head was trained with (`expected`) against the one of the path
/// serving it (`actual`) and returns every mismatch: taps first, then the tap point, the
/// target fingerprint and the dtype. Producer differences are not mismatches. An empty
/// result means the wiring agrees.
pub fn check(expected: &WiringManifest, actual: &WiringManifest) -> Vec<Mismatch> {
    let mut out = Vec::new();
    check_taps(&expected.taps, &actual.taps, &mut out);
    if expected.tap_point != actual.tap_point {
        out.push(Mismatch::new(
            MismatchKind::TapPoint,
            expected.tap_point,
            actual.tap_point,
            format!(
                "tap point: trained on {}, served {}",
                expected.tap_point.describe(),
                actual.tap_point.describe()
            ),
        ));
    }
    check_target(&expected.target, &actual.target, &mut out);
    let (e, a) = (
        normalize_dtype(&expected.dtype),
        normalize_dtype(&actual.dtype),
    );
    if e != a {
        let mut m = Mismatch::new(
            MismatchKind::Dtype,
            &expected.dtype,
            &actual.dtype,
            format!("dtype: trained on {e} taps, served {a}"),
        );
        m.severity = Severity::Warning;
        m.hint = Some(
            "advisory: a precision change shifts numerics slightly, not the wiring".to_owned(),
        );
        out.push(m);
    }
    out
}

fn check_taps(expected: &[TapId], actual: &[TapId], out: &mut Vec<Mismatch>) {
    let first = out.len();
    if expected.len() != actual.len() {
        let missing = multiset_minus(expected, actual);
        let extra = multiset_minus(actual, expected);
        let mut detail = Vec::new();
        if !missing.is_empty() {
            detail.push(format!("missing: {}", join_taps(&missing)));
        }
        if !extra.is_empty() {
            detail.push(format!("extra: {}", join_taps(&extra)));
        }
        let detail = if detail.is_empty() {
            String::new()
        } else {
            format!(" ({})", detail.join("; "))
        };
        out.push(Mismatch::new(
            MismatchKind::SlotCount,
            expected.len(),
            actual.len(),
            format!(
                "slot count: trained with {} taps, served {}{detail}",
                expected.len(),
                actual.len()
            ),
        ));
    }
    for (slot, (e, a)) in expected.iter().zip(actual).enumerate() {
        if e != a {
            let mut m = Mismatch::new(
                MismatchKind::SlotTap,
                e.canonical(),
                a.canonical(),
                format!("slot {slot}: trained on {e}, served {a}"),
            );
            m.slot = Some(slot);
            out.push(m);
        }
    }
    if out.len() > first {
        out[first].hint = tap_hint(expected, actual);
    }
}

/// Names the pattern behind differing tap lists, most specific first.
fn tap_hint(expected: &[TapId], actual: &[TapId]) -> Option<String> {
    if let Some(shift) = constant_shift(expected, actual) {
        let blocks = if shift.abs() == 1 { "block" } else { "blocks" };
        let cause = match shift {
            1 => "a layer-id convention mismatch, e.g. vLLM/HF ids (id k = block k-1) read as \
                  SGLang ids (id k = block k)"
                .to_owned(),
            -1 => "a layer-id convention mismatch, e.g. SGLang ids (id k = block k) read as \
                   vLLM/HF ids (id k = block k-1), or SGLang's first-id heuristic"
                .to_owned(),
            _ => "the ids were offset by a constant; compare the layer-id conventions and the \
                  layer counts"
                .to_owned(),
        };
        return Some(format!("every slot is off by {shift:+} {blocks}: {cause}"));
    }
    if expected.len() == actual.len() && multiset_minus(expected, actual).is_empty() {
        return Some(format!(
            "the served taps are the trained taps in another order; the fc weights expect {}",
            format_taps(expected)
        ));
    }
    let mut hints = Vec::new();
    let has_embed = |taps: &[TapId]| taps.contains(&TapId::Embed);
    match (has_embed(expected), has_embed(actual)) {
        (true, false) => hints.push("the head was trained with an embed tap that is not served"),
        (false, true) => hints.push("an embed tap is served that the head was not trained on"),
        _ => {}
    }
    let n = expected.len();
    if n == actual.len() && n > 1 {
        if actual[..n - 1] == expected[1..] {
            hints.push("the served slots are the trained slots moved one slot earlier");
        } else if actual[1..] == expected[..n - 1] {
            hints.push("the served slots are the trained slots moved one slot later");
        }
    }
    (!hints.is_empty()).then(|| hints.join("; "))
}

/// The constant `d` with `actual[i] = expected[i] + d blocks` for every slot, if there is one.
fn constant_shift(expected: &[TapId], actual: &[TapId]) -> Option<i64> {
    if expected.len() != actual.len() || expected.is_empty() {
        return None;
    }
    let mut shift = None;
    for (e, a) in expected.iter().zip(actual) {
        let d = a.residual_position()? as i64 - e.residual_position()? as i64;
        if *shift.get_or_insert(d) != d {
            return None;
        }
    }
    shift.filter(|&d| d != 0)
}

/// Elements of `a` not matched by an element of `b`, counting duplicates.
fn multiset_minus(a: &[TapId], b: &[TapId]) -> Vec<TapId> {
    let mut rest = b.to_vec();
    a.iter()
        .filter(|t| match rest.iter().position(|r| r == *t) {
            Some(i) => {
                rest.swap_remove(i);
                false
            }
            None => true,
        })
        .copied()
        .collect()
}

fn join_taps(taps: &[TapId]) -> String {
    taps.iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(", ")
}

fn check_target(e: &TargetFingerprint, a: &TargetFingerprint, out: &mut Vec<Mismatch>) {
    if e.architecture != a.architecture || e.model_type != a.model_type {
        out.push(Mismatch::new(
            MismatchKind::Architecture,
            format!("{} ({})", e.architecture, e.model_type),
            format!("{} ({})", a.architecture, a.model_type),
            format!(
                "architecture: trained on {} ({}), served {} ({})",
                e.architecture, e.model_type, a.architecture, a.model_type
            ),
        ));
    }
    if e.num_layers != a.num_layers {
        out.push(Mismatch::new(
            MismatchKind::LayerCount,
            e.num_layers,
            a.num_layers,
            format!(
                "layer count: trained on a {}-layer target, served a {}-layer target",
                e.num_layers, a.num_layers
            ),
        ));
    }
    if e.hidden_size != a.hidden_size {
        out.push(Mismatch::new(
            MismatchKind::HiddenSize,
            e.hidden_size,
            a.hidden_size,
            format!(
                "hidden size: trained on {}, served {}: the fc input width no longer matches",
                e.hidden_size, a.hidden_size
            ),
        ));
    }
    if e.vocab_size != a.vocab_size {
        out.push(Mismatch::new(
            MismatchKind::VocabSize,
            e.vocab_size,
            a.vocab_size,
            format!(
                "vocab size: trained on {}, served {}: d2t/t2d no longer index the target's vocab",
                e.vocab_size, a.vocab_size
            ),
        ));
    }
    if e.config_sha256 != a.config_sha256 {
        out.push(Mismatch::new(
            MismatchKind::ConfigHash,
            &e.config_sha256,
            &a.config_sha256,
            format!(
                "config differs (sha256 {} vs {}): the served target is not configured like \
                 the one the head was trained against",
                short(&e.config_sha256),
                short(&a.config_sha256)
            ),
        ));
    }
    if e.tokenizer_sha256 != a.tokenizer_sha256 {
        out.push(Mismatch::new(
            MismatchKind::TokenizerHash,
            &e.tokenizer_sha256,
            &a.tokenizer_sha256,
            format!(
                "tokenizer differs (sha256 {} vs {}): token ids do not mean the same text to \
                 the head and the served target",
                short(&e.tokenizer_sha256),
                short(&a.tokenizer_sha256)
            ),
        ));
    }
    let none = || "none".to_owned();
    let message = match (&e.chat_template_sha256, &a.chat_template_sha256) {
        (Some(x), Some(y)) if x != y => Some(format!(
            "chat template differs (sha256 {} vs {}): the head was trained on prompts rendered \
             by another template",
            short(x),
            short(y)
        )),
        (Some(x), None) => Some(format!(
            "chat template: trained with one (sha256 {}), served without: prompts are not \
             rendered the way the head saw them",
            short(x)
        )),
        (None, Some(y)) => Some(format!(
            "chat template: trained without one, served with one (sha256 {}): prompts are not \
             rendered the way the head saw them",
            short(y)
        )),
        _ => None,
    };
    if let Some(message) = message {
        out.push(Mismatch::new(
            MismatchKind::ChatTemplateHash,
            e.chat_template_sha256.clone().unwrap_or_else(none),
            a.chat_template_sha256.clone().unwrap_or_else(none),
            message,
        ));
    }
}

/// First 12 hex digits: enough to tell hashes apart in a sentence.
fn short(hash: &str) -> String {
    match hash.get(..12) {
        Some(prefix) if hash.len() > 12 => format!("{prefix}.."),
        _ => hash.to_owned(),
    }
}

/// Maps dtype spellings to one name so that `float32` and `f32` are not reported as different.
pub fn normalize_dtype(dtype: &str) -> String {
    let lower = dtype.trim().to_ascii_lowercase();
    match lower.trim_start_matches("torch.") {
        "f32" | "fp32" | "float32" | "float" => "f32".to_owned(),
        "bf16" | "bfloat16" => "bf16".to_owned(),
        "f16" | "fp16" | "float16" | "half" => "f16".to_owned(),
        "f64" | "fp64" | "float64" | "double" => "f64".to_owned(),
        other => other.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::convention::Convention;
    use std::path::PathBuf;

    fn fingerprint() -> TargetFingerprint {
        TargetFingerprint {
            architecture: "LlamaForCausalLM".to_owned(),
            model_type: "llama".to_owned(),
            num_layers: 30,
            hidden_size: 576,
            vocab_size: 49152,
            config_sha256: sha256_hex(b"config"),
            tokenizer_sha256: sha256_hex(b"tokenizer"),
            chat_template_sha256: Some(sha256_hex(b"template")),
        }
    }

    fn manifest(taps: &[TapId], job: Job) -> WiringManifest {
        WiringManifest::new(
            fingerprint(),
            taps.to_vec(),
            TapPoint::ResidualStream,
            "f32",
            Producer::tandem(job, "cpu", "prefill"),
        )
    }

    fn blocks(ks: &[usize]) -> Vec<TapId> {
        ks.iter().map(|&k| TapId::Block(k)).collect()
    }

    fn check_taps_only(e: &[TapId], a: &[TapId]) -> Vec<Mismatch> {
        check(&manifest(e, Job::Train), &manifest(a, Job::Serve))
    }

    fn temp_dir(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("tandem-wiring-{name}-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn sha256_of_known_input() {
        assert_eq!(
            sha256_hex(b"abc"),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
    }

    #[test]
    fn canonical_json_ignores_formatting_and_key_order() {
        let a: Value = serde_json::from_str(r#"{"b": 1, "a": {"y": [1, 2], "x": 1e-05}}"#).unwrap();
        let b: Value =
            serde_json::from_str("{\n  \"a\": {\"x\": 0.00001, \"y\": [1,2]},\n  \"b\": 1\n}")
                .unwrap();
        assert_eq!(canonical_json(&a), canonical_json(&b));
        assert_eq!(canonical_json(&a), r#"{"a":{"x":1e-5,"y":[1,2]},"b":1}"#);
        let c: Value = serde_json::from_str(r#"{"a": {"y": [2, 1], "x": 1e-05}, "b": 1}"#).unwrap();
        assert_ne!(canonical_json(&a), canonical_json(&c));
    }

    #[test]
    fn identical_manifests_have_no_mismatch() {
        let e = manifest(&blocks(&[1, 14, 26]), Job::Train);
        let mut a = manifest(&blocks(&[1, 14, 26]), Job::Serve);
        // Producer and dtype spelling are not mismatches.
        a.producer.device = "cuda:0".to_owned();
        a.producer.execution_path = "tree-verify".to_owned();
        a.dtype = "float32".to_owned();
        assert!(check(&e, &a).is_empty());
    }

    #[test]
    fn off_by_one_gets_the_convention_hint() {
        let ms = check_taps_only(&blocks(&[1, 14, 26]), &blocks(&[2, 15, 27]));
        assert_eq!(ms.len(), 3);
        assert!(
            ms.iter()
                .all(|m| m.kind == MismatchKind::SlotTap && m.is_fatal())
        );
        assert_eq!(ms[0].message, "slot 0: trained on block 1, served block 2");
        let first = ms[0].to_string();
        assert!(first.contains("every slot is off by +1 block"), "{first}");
        assert!(first.contains("convention"), "{first}");
        assert!(ms[1].hint.is_none() && ms[2].hint.is_none());
        assert_eq!(ms[2].slot, Some(2));

        // SGLang ids [1, 14, 26] served by vLLM: blocks [0, 13, 25], off by -1.
        let served = Convention::Vllm.to_canonical(&[1, 14, 26], 30).unwrap();
        let ms = check_taps_only(&blocks(&[1, 14, 26]), &served);
        assert!(ms[0].to_string().contains("off by -1 block"), "{}", ms[0]);

        // HF indices vs canonical: embed -> block 0 is the same +1 shift.
        let ms = check_taps_only(
            &[TapId::Embed, TapId::Block(13), TapId::Block(25)],
            &blocks(&[0, 14, 26]),
        );
        assert!(ms[0].to_string().contains("off by +1 block"), "{}", ms[0]);
        assert_eq!(ms[0].message, "slot 0: trained on embed, served block 0");
    }

    #[test]
    fn larger_constant_shift_is_named() {
        let ms = check_taps_only(&blocks(&[1, 14, 26]), &blocks(&[3, 16, 28]));
        assert!(ms[0].to_string().contains("off by +2 blocks"), "{}", ms[0]);
    }

    #[test]
    fn permutation_is_named() {
        let ms = check_taps_only(&blocks(&[1, 14, 26]), &blocks(&[26, 14, 1]));
        assert_eq!(ms.len(), 2);
        assert!(ms[0].to_string().contains("another order"), "{}", ms[0]);
    }

    #[test]
    fn missing_embed_with_same_count() {
        // Failure mode 2: trained on [embed, a, b], served on [a, b, c].
        let ms = check_taps_only(
            &[TapId::Embed, TapId::Block(1), TapId::Block(14)],
            &blocks(&[1, 14, 26]),
        );
        assert_eq!(ms.len(), 3);
        let s = ms[0].to_string();
        assert!(
            s.starts_with("slot 0: trained on embed, served block 1"),
            "{s}"
        );
        assert!(s.contains("embed tap that is not served"), "{s}");
        assert!(s.contains("moved one slot earlier"), "{s}");
    }

    #[test]
    fn slot_count_lists_extra_and_missing() {
        let ms = check_taps_only(&blocks(&[1, 14, 26]), &blocks(&[1, 14, 26, 29]));
        assert_eq!(ms.len(), 1);
        assert_eq!(ms[0].kind, MismatchKind::SlotCount);
        assert_eq!(
            ms[0].to_string(),
            "slot count: trained with 3 taps, served 4 (extra: block 29)"
        );

        let ms = check_taps_only(
            &[TapId::Embed, TapId::Block(1), TapId::Block(14)],
            &blocks(&[1, 14]),
        );
        assert_eq!(ms[0].kind, MismatchKind::SlotCount);
        let s = ms[0].to_string();
        assert!(s.contains("(missing: embed)"), "{s}");
        assert!(s.contains("embed tap that is not served"), "{s}");
        // Every slot mismatch over the common prefix is reported too.
        assert_eq!(
            ms.iter()
                .filter(|m| m.kind == MismatchKind::SlotTap)
                .count(),
            2
        );

        let ms = check_taps_only(
            &blocks(&[1, 14]),
            &[TapId::Embed, TapId::Block(1), TapId::Block(14)],
        );
        assert!(ms[0].to_string().contains("extra: embed"), "{}", ms[0]);
        assert!(
            ms[0].to_string().contains("embed tap is served"),
            "{}",
            ms[0]
        );
    }

    #[test]
    fn tap_point_sentence() {
        let e = manifest(&blocks(&[1, 14, 26]), Job::Train);
        let mut a = e.clone();
        a.tap_point = TapPoint::Normed;
        let ms = check(&e, &a);
        assert_eq!(ms.len(), 1);
        assert_eq!(ms[0].kind, MismatchKind::TapPoint);
        assert_eq!(
            ms[0].to_string(),
            "tap point: trained on the residual stream (pre-norm), served the normed output"
        );
    }

    #[test]
    fn every_target_difference_is_reported() {
        let e = manifest(&blocks(&[1, 14, 26]), Job::Train);
        let mut a = e.clone();
        a.target = TargetFingerprint {
            architecture: "Qwen2ForCausalLM".to_owned(),
            model_type: "qwen2".to_owned(),
            num_layers: 32,
            hidden_size: 4096,
            vocab_size: 128256,
            config_sha256: sha256_hex(b"config2"),
            tokenizer_sha256: sha256_hex(b"tokenizer2"),
            chat_template_sha256: Some(sha256_hex(b"template2")),
        };
        a.dtype = "bf16".to_owned();
        let ms = check(&e, &a);
        let kinds: Vec<MismatchKind> = ms.iter().map(|m| m.kind).collect();
        assert_eq!(
            kinds,
            [
                MismatchKind::Architecture,
                MismatchKind::LayerCount,
                MismatchKind::HiddenSize,
                MismatchKind::VocabSize,
                MismatchKind::ConfigHash,
                MismatchKind::TokenizerHash,
                MismatchKind::ChatTemplateHash,
                MismatchKind::Dtype,
            ]
        );
        let dtype = ms.last().unwrap();
        assert_eq!(dtype.severity, Severity::Warning);
        assert!(!dtype.is_fatal());
        assert!(ms[..7].iter().all(Mismatch::is_fatal));
        let template = ms[6].to_string();
        assert!(
            template.starts_with("chat template differs (sha256 "),
            "{template}"
        );
        assert!(
            template.contains("trained on prompts rendered by another template"),
            "{template}"
        );
        assert!(template.contains(&format!("{}..", &sha256_hex(b"template")[..12])));
        assert!(
            ms[5].to_string().starts_with("tokenizer differs"),
            "{}",
            ms[5]
        );
        assert!(ms[1].to_string().contains("30-layer") && ms[1].to_string().contains("32-layer"));
        assert_eq!(dtype.message, "dtype: trained on f32 taps, served bf16");
    }

    #[test]
    fn missing_chat_template_is_a_mismatch() {
        let e = manifest(&blocks(&[1, 14, 26]), Job::Train);
        let mut a = e.clone();
        a.target.chat_template_sha256 = None;
        let ms = check(&e, &a);
        assert_eq!(ms.len(), 1);
        assert_eq!(ms[0].kind, MismatchKind::ChatTemplateHash);
        assert_eq!(ms[0].actual, "none");
        assert!(ms[0].to_string().contains("served without"), "{}", ms[0]);
    }

    #[test]
    fn mismatch_serializes_for_reports() {
        let ms = check_taps_only(&blocks(&[1]), &blocks(&[2]));
        let json = serde_json::to_value(&ms[0]).unwrap();
        assert_eq!(json["kind"], "slot-tap");
        assert_eq!(json["severity"], "error");
        assert_eq!(json["expected"], "block:1");
    }

    #[test]
    fn save_and_load_round_trip() {
        let dir = temp_dir("roundtrip");
        let path = dir.join("wiring.json");
        let m = manifest(&blocks(&[1, 14, 26]), Job::Dump)
            .with_raw_ids("sglang:1,14,26".parse().unwrap());
        m.save(&path).unwrap();
        let text = fs::read_to_string(&path).unwrap();
        assert!(text.contains("\"schema_version\": 1"), "{text}");
        assert!(text.contains("\"block:14\""), "{text}");
        assert!(text.contains("\"residual-stream\""), "{text}");
        assert!(text.contains("\"sglang-heuristic\""), "{text}");
        assert!(text.contains("\"job\": \"dump\""), "{text}");
        assert_eq!(WiringManifest::load(&path).unwrap(), m);
        // No temporary file is left behind.
        assert_eq!(fs::read_dir(&dir).unwrap().count(), 1);
        // Without raw ids the field is omitted and still loads.
        let plain = manifest(&blocks(&[1, 14, 26]), Job::Train);
        plain.save(&path).unwrap();
        assert!(!fs::read_to_string(&path).unwrap().contains("raw_ids"));
        assert_eq!(WiringManifest::load(&path).unwrap(), plain);
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn load_errors_name_the_file() {
        let dir = temp_dir("errors");
        let missing = dir.join("absent.json");
        let err = WiringManifest::load(&missing).unwrap_err();
        assert!(matches!(err, WiringError::Io { .. }));
        assert!(err.to_string().contains("absent.json"), "{err}");

        let bad = dir.join("bad.json");
        fs::write(&bad, "{\"schema_version\": 1,\n \"taps\": [").unwrap();
        let err = WiringManifest::load(&bad).unwrap_err();
        assert!(matches!(err, WiringError::Json { .. }));
        let msg = err.to_string();
        assert!(msg.contains("bad.json") && msg.contains("line"), "{msg}");

        let future = dir.join("future.json");
        fs::write(&future, r#"{"schema_version": 7}"#).unwrap();
        let err = WiringManifest::load(&future).unwrap_err();
        assert!(
            matches!(err, WiringError::UnsupportedSchema { found: 7, .. }),
            "{err}"
        );

        // Raw ids that do not resolve to the recorded taps: a silent default substitution.
        let inconsistent = dir.join("inconsistent.json");
        let mut m = manifest(&blocks(&[1, 14, 26]), Job::Serve);
        m.raw_ids = Some(RawIds::new(Convention::Vllm, vec![5, 6, 7]));
        m.save(&inconsistent).unwrap();
        let err = WiringManifest::load(&inconsistent).unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains("inconsistent.json") && msg.contains("vllm:5,6,7"),
            "{msg}"
        );

        let out_of_range = dir.join("range.json");
        manifest(&blocks(&[1, 14, 30]), Job::Serve)
            .save(&out_of_range)
            .unwrap();
        let err = WiringManifest::load(&out_of_range).unwrap_err();
        assert!(err.to_string().contains("block 30"), "{err}");
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn fingerprint_from_files() {
        let dir = temp_dir("fingerprint");
        let config = dir.join("config.json");
        let tokenizer = dir.join("tokenizer.json");
        fs::write(
            &config,
            r#"{"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                "num_hidden_layers": 30, "hidden_size": 576, "vocab_size": 49152,
                "rms_norm_eps": 1e-05}"#,
        )
        .unwrap();
        fs::write(
            &tokenizer,
            r#"{"model": {"type": "BPE"}, "version": "1.0"}"#,
        )
        .unwrap();
        let fp =
            TargetFingerprint::from_files(&config, &tokenizer, Some("{{ messages }}")).unwrap();
        assert_eq!(fp.architecture, "LlamaForCausalLM");
        assert_eq!(fp.model_type, "llama");
        assert_eq!(
            (fp.num_layers, fp.hidden_size, fp.vocab_size),
            (30, 576, 49152)
        );
        assert_eq!(fp.chat_template_sha256, Some(sha256_hex(b"{{ messages }}")));
        assert_eq!(fp.config_sha256.len(), 64);

        // Re-saving the config with other formatting keeps the hash.
        fs::write(
            &config,
            "{\"vocab_size\":49152,\"hidden_size\":576,\"rms_norm_eps\":0.00001,\
             \"num_hidden_layers\":30,\"model_type\":\"llama\",\
             \"architectures\":[\"LlamaForCausalLM\"]}",
        )
        .unwrap();
        let again =
            TargetFingerprint::from_files(&config, &tokenizer, Some("{{ messages }}")).unwrap();
        assert_eq!(again, fp);

        // Multimodal layout: fields under text_config.
        fs::write(
            &config,
            r#"{"architectures": ["X"], "model_type": "x",
                "text_config": {"num_hidden_layers": 4, "hidden_size": 8, "vocab_size": 16}}"#,
        )
        .unwrap();
        let fp = TargetFingerprint::from_files(&config, &tokenizer, None).unwrap();
        assert_eq!(fp.num_layers, 4);
        assert_eq!(fp.chat_template_sha256, None);

        fs::write(&config, r#"{"architectures": ["X"], "model_type": "x"}"#).unwrap();
        let err = TargetFingerprint::from_files(&config, &tokenizer, None).unwrap_err();
        assert!(
            matches!(
                err,
                WiringError::ConfigField {
                    field: "num_hidden_layers",
                    ..
                }
            ),
            "{err}"
        );
        assert!(err.to_string().contains("config.json"), "{err}");
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn dtype_spellings_normalize() {
        assert_eq!(normalize_dtype("torch.bfloat16"), "bf16");
        assert_eq!(normalize_dtype("FP16"), "f16");
        assert_eq!(normalize_dtype("float32"), "f32");
        assert_eq!(normalize_dtype("int8"), "int8");
    }

    fn dump_ref(name: &str, stage: Option<u32>) -> DumpRef {
        DumpRef {
            name: name.to_owned(),
            path: format!("/data/{name}"),
            manifest_sha256: Some(sha256_hex(name.as_bytes())),
            dataset: None,
            regenerated: Some(true),
            rows: 3,
            tokens: 300,
            stage,
        }
    }

    #[test]
    fn lineage_stages_fine_tuning_runs() {
        let (a, b, d) = (
            dump_ref("a", None),
            dump_ref("b", None),
            dump_ref("d", None),
        );
        // One run: unstaged, as before the field existed.
        let first = lineage(&[], &[a.clone(), b.clone()]);
        assert_eq!(first, vec![a.clone(), b.clone()]);
        // Fine-tuned on d: the earlier dumps become stage 0, d stage 1.
        let second = lineage(&first, std::slice::from_ref(&d));
        let stages = |v: &[DumpRef]| {
            v.iter()
                .map(|r| (r.name.clone(), r.stage))
                .collect::<Vec<_>>()
        };
        assert_eq!(
            stages(&second),
            vec![
                ("a".into(), Some(0)),
                ("b".into(), Some(0)),
                ("d".into(), Some(1))
            ]
        );
        // The same dumps again in a later run are a new stage (more passes over them).
        let third = lineage(&second, &[d.clone(), b.clone()]);
        assert_eq!(
            stages(&third),
            vec![
                ("a".into(), Some(0)),
                ("b".into(), Some(0)),
                ("d".into(), Some(1)),
                ("d".into(), Some(2)),
                ("b".into(), Some(2))
            ]
        );
        // Manifests without the field read as unstaged, and unstaged refs are written without it.
        let json = serde_json::to_value(&a).unwrap();
        assert!(json.get("stage").is_none());
        let back: DumpRef = serde_json::from_value(json).unwrap();
        assert_eq!(back.stage, None);
        assert_eq!(serde_json::to_value(&third[4]).unwrap()["stage"], 2);
    }

    #[test]
    fn trained_on_is_additive_and_outside_the_check() {
        let dump = manifest(&blocks(&[1, 14, 26]), Job::Dump);
        // A manifest written before the field existed has no `trained_on` key and still reads.
        let old = serde_json::to_value(&dump).unwrap();
        assert!(
            old.get("trained_on").is_none(),
            "empty lists are not written"
        );
        let parsed: WiringManifest = serde_json::from_value(old).unwrap();
        assert!(parsed.trained_on.is_empty());
        assert_eq!(parsed, dump);

        let mut head = manifest(&blocks(&[1, 14, 26]), Job::Train);
        head.trained_on.push(DumpRef {
            name: "sharegpt-regen".to_owned(),
            path: "/tmp/tandem/sharegpt-regen".to_owned(),
            manifest_sha256: Some(sha256_hex(b"manifest")),
            dataset: Some("sharegpt".to_owned()),
            regenerated: Some(true),
            rows: 12,
            tokens: 3456,
            stage: None,
        });
        let json = serde_json::to_string(&head).unwrap();
        assert!(
            json.contains("\"trained_on\":[{\"name\":\"sharegpt-regen\""),
            "{json}"
        );
        let back: WiringManifest = serde_json::from_str(&json).unwrap();
        assert_eq!(back, head);
        assert!(
            check(&dump, &head).is_empty(),
            "provenance is not wiring: {:?}",
            check(&dump, &head)
        );
        assert_eq!(
            head.trained_on[0].to_string(),
            format!(
                "sharegpt-regen (12 rows, 3456 tokens, manifest sha256 {})",
                &sha256_hex(b"manifest")[..12]
            )
        );
    }

    #[test]
    fn job_forms() {
        for job in [Job::Dump, Job::Train, Job::Serve, Job::Replay] {
            assert_eq!(job.to_string().parse::<Job>().unwrap(), job);
            assert_eq!(serde_json::to_string(&job).unwrap(), format!("\"{job}\""));
        }
        assert!("bench".parse::<Job>().is_err());
    }
}
