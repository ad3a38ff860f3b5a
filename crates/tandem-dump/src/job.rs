//! The dump job: dataset -> chat template -> (optional regeneration) -> one prefill through
//! the capture hook -> shards, over any [`CaptureTarget`] (the burn model, or the CUDA fast path).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressStyle};
use tandem_data::{Conversation, Split, open_dataset};
use tandem_model::burn::prelude::*;
use tandem_model::{
    ChatMessage, Execution, SamplingParams, TapRequest, TargetModel, TargetTokenizer,
};
use tandem_wiring::{Job, Producer, TapId, TapPoint, TapSpec, TargetFingerprint, WiringManifest};

use crate::error::DumpError;
use crate::manifest::{
    DumpManifest, DumpSettings, GenerationSettings, Partition, StorageDtype, partition_dir_name,
};
use crate::mask::{MaskedTokens, SampleSkip, tokenize_conversation};
use crate::reader::DumpRecord;
use crate::regen::{RegenStats, regenerate};
use crate::writer::{DumpWriter, ShardLimits};
use tandem_format::FormatError;
use tandem_model::CaptureTarget;

/// Everything `tandem dump` is asked to do.
#[derive(Debug, Clone)]
pub struct DumpOptions {
    /// HF model directory of the target.
    pub model_dir: PathBuf,
    /// Registry name (`sharegpt`) or path of a dataset file.
    pub dataset: String,
    /// Where registry datasets live (`data/`).
    pub data_root: PathBuf,
    /// Output directory (created; resumed when it holds the same dump).
    pub out: PathBuf,
    /// Aux taps (`default`, `canonical:...`, `sglang:1,14,26`, ...).
    pub taps: TapSpec,
    /// Stop once the dump holds this many rows (earlier runs included).
    pub max_samples: Option<u64>,
    /// Start no new batch of records after this many seconds of this run's processing loop
    /// (model loading excluded); the batch under way is finished and written. Like
    /// `max_samples`, it leaves the dump resumable and marked incomplete.
    pub max_seconds: Option<f64>,
    /// Samples are cut to this many tokens.
    pub max_len: usize,
    /// `Some`: the target writes the assistant turns (`--regenerate`).
    pub regenerate: Option<GenerationSettings>,
    /// Conversations regenerated together.
    pub batch_size: usize,
    /// Storage type of the hidden states.
    pub dtype: StorageDtype,
    /// When shards are closed.
    pub shard_limits: ShardLimits,
    /// Allow evaluation datasets (mtbench, humaneval) as input.
    pub allow_eval: bool,
    /// Device description for the manifest's producer, e.g. `cpu`.
    pub device_label: String,
    /// Draw a progress bar on stderr.
    pub progress: bool,
    /// Tests only: shard files report a full disk after this many bytes.
    #[doc(hidden)]
    pub simulate_full_disk_after: Option<u64>,
    /// Plain or micro-batched target steps (the taps are the same either way).
    pub execution: Execution,
    /// Tensor-parallel degree of the burn target's blocks (`TargetModel::set_tensor_parallel`;
    /// 1 = unsplit). The taps are the reduced residual stream either way.
    pub tensor_parallel: usize,
    /// One rank of a data-parallel dump (`--rank R --world-size W`): this process dumps the
    /// records `i % W == R` into `out/rank-RRRRR/`, resumes there, and `--max-samples` counts
    /// its own rows. `DumpReader::open(out)` reads the ranks as one dump.
    pub partition: Option<Partition>,
}

impl DumpOptions {
    /// Defaults for everything but the model, dataset and output: default taps, max length
    /// 2048, no regeneration, batch 8, bf16, default shard limits, CPU, no progress bar.
    pub fn new(
        model_dir: impl Into<PathBuf>,
        dataset: impl Into<String>,
        out: impl Into<PathBuf>,
    ) -> Self {
        DumpOptions {
            model_dir: model_dir.into(),
            dataset: dataset.into(),
            data_root: PathBuf::from("data"),
            out: out.into(),
            taps: TapSpec::Default,
            max_samples: None,
            max_seconds: None,
            max_len: 2048,
            regenerate: None,
            batch_size: 8,
            dtype: StorageDtype::Bf16,
            shard_limits: ShardLimits::default(),
            allow_eval: false,
            device_label: "cpu".to_owned(),
            progress: false,
            simulate_full_disk_after: None,
            execution: Execution::Auto,
            tensor_parallel: 1,
            partition: None,
        }
    }
}

/// What one run did.
#[derive(Debug, Clone)]
pub struct DumpSummary {
    /// The directory's manifest after the run.
    pub manifest: DumpManifest,
    /// Rows the directory held before this run (non-zero when resumed).
    pub resumed_rows: u64,
    /// Rows written by this run.
    pub rows: u64,
    /// Tokens captured by this run.
    pub tokens: u64,
    /// Records this run skipped, by reason.
    pub skipped: BTreeMap<String, u64>,
    /// Wall time of the processing loop (model loading excluded).
    pub seconds: f64,
    /// Time spent in prefill captures.
    pub capture_seconds: f64,
    /// Tokens generated by `--regenerate`.
    pub generated_tokens: u64,
    /// Time spent generating.
    pub generation_seconds: f64,
    /// Assistant turns generated.
    pub generated_turns: u64,
    /// Generated turns that hit the token budget before an end-of-turn token.
    pub cut_turns: u64,
}

impl DumpSummary {
    /// Captured tokens per second of the whole loop.
    pub fn tokens_per_second(&self) -> f64 {
        rate(self.tokens, self.seconds)
    }

    /// Captured tokens per second of the prefill captures alone.
    pub fn capture_tokens_per_second(&self) -> f64 {
        rate(self.tokens, self.capture_seconds)
    }

    /// Generated tokens per second (`--regenerate`).
    pub fn generation_tokens_per_second(&self) -> f64 {
        rate(self.generated_tokens, self.generation_seconds)
    }
}

fn rate(n: u64, seconds: f64) -> f64 {
    if seconds > 0.0 {
        n as f64 / seconds
    } else {
        0.0
    }
}

pub(crate) fn check_options(o: &DumpOptions) -> Result<(), DumpError> {
    let invalid = |option, reason: &str| {
        Err(DumpError::InvalidOption {
            option,
            reason: reason.to_owned(),
        })
    };
    if o.max_len < 2 {
        return invalid("--max-len", "must be at least 2 tokens");
    }
    if o.batch_size == 0 {
        return invalid("--batch-size", "must be at least 1");
    }
    if o.max_samples == Some(0) {
        return invalid("--max-samples", "must be at least 1");
    }
    if o.max_seconds.is_some_and(|s| !(s > 0.0 && s.is_finite())) {
        return invalid("--max-seconds", "must be a positive number of seconds");
    }
    if o.shard_limits.max_rows == 0 || o.shard_limits.max_bytes == 0 {
        return invalid("shard limits", "must be at least 1");
    }
    if let Some(p) = o.partition {
        if p.world_size == 0 {
            return invalid("--world-size", "must be at least 1");
        }
        if p.rank >= p.world_size {
            return invalid(
                "--rank",
                &format!(
                    "rank {} is not below the world size {}",
                    p.rank, p.world_size
                ),
            );
        }
    }
    if let Some(g) = &o.regenerate {
        if g.max_new_tokens == 0 {
            return invalid("--max-new-tokens", "must be at least 1");
        }
        SamplingParams {
            temperature: g.temperature,
            top_p: g.top_p,
            top_k: g.top_k,
        }
        .validate()?;
    }
    Ok(())
}

/// Builds the manifest identity of a dump of `options` with the target in `options.model_dir`.
pub fn dump_identity(
    options: &DumpOptions,
    tokenizer: &TargetTokenizer,
    split: Option<Split>,
) -> Result<DumpManifest, DumpError> {
    let template = tokenizer
        .chat_template
        .as_deref()
        .ok_or_else(|| DumpError::InvalidOption {
            option: "--model",
            reason: format!(
                "{} has no chat template (tokenizer_config.json chat_template or \
                 chat_template.jinja); the loss mask is derived from it",
                options.model_dir.display()
            ),
        })?;
    let target = TargetFingerprint::from_files(
        &options.model_dir.join("config.json"),
        &options.model_dir.join("tokenizer.json"),
        Some(template),
    )?;
    let layers = target.num_layers;
    let taps = options.taps.resolve(layers)?;
    if taps.contains(&TapId::Final) {
        return Err(DumpError::InvalidOption {
            option: "--taps",
            reason: "`final` is the normed output of the final RMSNorm; EAGLE-3 taps the \
                     residual stream (use block ids)"
                .to_owned(),
        });
    }
    let mut wiring = WiringManifest::new(
        target,
        taps.clone(),
        TapPoint::ResidualStream,
        options.dtype.as_str(),
        Producer::tandem(
            Job::Dump,
            options.device_label.clone(),
            if options.tensor_parallel > 1 {
                format!("prefill, tensor-parallel {}", options.tensor_parallel)
            } else {
                "prefill".to_owned()
            },
        ),
    );
    if let Some(raw) = options.taps.raw_ids() {
        wiring = wiring.with_raw_ids(raw.clone());
    }
    wiring.validate()?;
    Ok(DumpManifest {
        dataset_split: split.map(|s| s.to_string()),
        partition: options.partition,
        ..DumpManifest::new(
            wiring,
            options.dtype,
            options.dataset.clone(),
            DumpSettings {
                max_len: options.max_len,
                regenerate: options.regenerate,
            },
        )
    })
}

/// What became of one dataset record.
enum Outcome {
    Skip(&'static str),
    /// A row, whether it was cut to `max_len`, and (regenerated runs) the conversation with the
    /// target's replies as one chat-JSONL line.
    Row(DumpRecord, bool, Option<String>),
}

/// The regenerated conversations of the rows in completed shards, one chat-JSONL file per
/// shard (`conversations-00000.jsonl` beside `shard-00000.arrow`, the rows in the same order):
/// the regenerated text itself, a few MB where the shards are GB, from which `tandem dump
/// --dataset` (without `--regenerate`) captures the same token ids again, e.g. with other taps
/// or on a machine that has not regenerated. Written under a temporary name and renamed once
/// the shard is complete, so a file exists only for a complete shard.
struct ConversationFiles {
    dir: PathBuf,
    /// Lines of rows not yet in a completed shard, in row order.
    pending: Vec<String>,
    /// Shards whose file is written (or that existed before this run).
    done: usize,
}

/// File name of the conversations of shard `shard_file` (`shard-00003.arrow` ->
/// `conversations-00003.jsonl`).
pub(crate) fn conversations_file_name(shard_file: &str) -> String {
    let stem = shard_file
        .strip_prefix("shard-")
        .and_then(|s| s.strip_suffix(".arrow"))
        .unwrap_or(shard_file);
    format!("conversations-{stem}.jsonl")
}

impl ConversationFiles {
    /// Writes the files of shards completed since the last call.
    fn flush(&mut self, manifest: &DumpManifest) -> Result<(), DumpError> {
        while self.done < manifest.shards.len() {
            let shard = &manifest.shards[self.done];
            let rows = (shard.rows as usize).min(self.pending.len());
            let mut text = String::new();
            for line in self.pending.drain(..rows) {
                text.push_str(&line);
                text.push('\n');
            }
            let name = conversations_file_name(&shard.file);
            let path = self.dir.join(&name);
            let tmp = self.dir.join(format!(".{name}.tmp"));
            std::fs::write(&tmp, text).map_err(FormatError::io("write", &tmp))?;
            std::fs::rename(&tmp, &path).map_err(FormatError::io("rename into place", &path))?;
            self.done += 1;
        }
        Ok(())
    }
}

/// One chat-JSONL line: `{"id": ..., "messages": [{"role": ..., "content": ...}, ...]}`.
fn conversation_line(id: &str, messages: &[ChatMessage]) -> String {
    let messages: Vec<serde_json::Value> = messages
        .iter()
        .map(|m| serde_json::json!({"role": m.role, "content": m.content}))
        .collect();
    serde_json::json!({"id": id, "messages": messages}).to_string()
}

/// The directory this process writes: `out`, or `out/rank-RRRRR` for one rank of a
/// data-parallel dump.
pub fn dump_dir(options: &DumpOptions) -> PathBuf {
    match options.partition {
        Some(p) => options.out.join(partition_dir_name(p.rank)),
        None => options.out.clone(),
    }
}

/// The dataset record of this process's record `local` (they differ for one rank of a
/// data-parallel dump): what seeds regeneration, so a record is dumped the same whichever
/// rank reads it.
fn global_record(options: &DumpOptions, local: u64) -> u64 {
    options.partition.map_or(local, |p| p.global_record(local))
}

/// The records of one rank, `i % world_size == rank` (every record without a partition),
/// skipped records included: the stream a rank's record ordinals count.
struct RankRecords<I> {
    inner: I,
    /// Records passed over before the first one, then between two.
    skip_first: usize,
    skip_between: usize,
    started: bool,
}

impl<I: Iterator> RankRecords<I> {
    fn new(inner: I, partition: Option<Partition>) -> Self {
        let (rank, world) = partition.map_or((0, 1), |p| (p.rank, p.world_size));
        RankRecords {
            inner,
            skip_first: rank,
            skip_between: world - 1,
            started: false,
        }
    }
}

impl<I: Iterator> Iterator for RankRecords<I> {
    type Item = I::Item;
    fn next(&mut self) -> Option<I::Item> {
        let skip = if self.started {
            self.skip_between
        } else {
            self.skip_first
        };
        self.started = true;
        for _ in 0..skip {
            self.inner.next()?;
        }
        self.inner.next()
    }
}

/// Runs (or resumes) a dump on the burn backend `B`.
pub fn run_dump<B: Backend>(
    options: &DumpOptions,
    device: &B::Device,
) -> Result<DumpSummary, DumpError> {
    run_dump_with(options, || {
        let mut model = TargetModel::<B>::load(&options.model_dir, device)?;
        model.execution = options.execution;
        model.set_tensor_parallel(options.tensor_parallel)?;
        Ok(Box::new(model))
    })
}

/// Runs (or resumes) a dump on the target `load` returns (called once the dump is known to
/// need it): the burn model, or the CUDA fast path ([`CaptureTarget`]).
pub fn run_dump_with<'a>(
    options: &DumpOptions,
    load: impl FnOnce() -> Result<Box<dyn CaptureTarget + 'a>, DumpError>,
) -> Result<DumpSummary, DumpError> {
    check_options(options)?;
    let tokenizer = TargetTokenizer::load(&options.model_dir)?;
    let mut reader = open_dataset(&options.dataset, &options.data_root)?;
    if reader.split() == Some(Split::Eval) && !options.allow_eval {
        return Err(DumpError::EvalDataset {
            dataset: options.dataset.clone(),
        });
    }
    if options.regenerate.is_some() {
        // Prompts are enough: the target writes the replies.
        reader = reader.require_assistant(false);
    }
    let identity = dump_identity(options, &tokenizer, reader.split())?;
    let context = tandem_model::HfConfig::load(&options.model_dir.join("config.json"))?
        .max_position_embeddings;
    if options.max_len > context {
        return Err(DumpError::InvalidOption {
            option: "--max-len",
            reason: format!(
                "{} is longer than the target's context ({context} positions)",
                options.max_len
            ),
        });
    }
    let template_sha = identity.chat_template_sha256.clone().unwrap_or_default();
    let out = dump_dir(options);
    let mut writer = DumpWriter::open(&out, &identity, options.shard_limits)?;
    let mut reader = RankRecords::new(reader, options.partition);
    if let Some(bytes) = options.simulate_full_disk_after {
        writer.simulate_full_disk_after(bytes);
    }
    let resumed_rows = writer.rows();
    let mut summary = DumpSummary {
        manifest: writer.manifest().clone(),
        resumed_rows,
        rows: 0,
        tokens: 0,
        skipped: BTreeMap::new(),
        seconds: 0.0,
        capture_seconds: 0.0,
        generated_tokens: 0,
        generation_seconds: 0.0,
        generated_turns: 0,
        cut_turns: 0,
    };
    if options.max_samples.is_some_and(|max| resumed_rows >= max) {
        let complete = writer.manifest().complete;
        summary.manifest = writer.finish(complete)?;
        return Ok(summary);
    }

    let model = load()?;
    let mut request = identity.wiring.taps.clone();
    request.push(identity.last_hidden_tap);
    let request = TapRequest::new(request);

    // Records already accounted for by completed shards are read past, not processed.
    let mut exhausted = false;
    for _ in 0..writer.next_record() {
        if reader.next().is_none() {
            exhausted = true;
            break;
        }
    }

    let progress = if options.progress {
        let bar = match options.max_samples {
            Some(max) => ProgressBar::new(max),
            None => ProgressBar::new_spinner(),
        };
        bar.set_style(
            ProgressStyle::with_template(
                "{spinner} [{elapsed_precise}] {bar:30} {pos}/{len} rows {msg}",
            )
            .expect("valid template"),
        );
        bar.set_position(resumed_rows);
        bar.enable_steady_tick(Duration::from_millis(250));
        bar
    } else {
        ProgressBar::hidden()
    };

    let start = Instant::now();
    let mut regen_stats = RegenStats::default();
    let conversations = ConversationFiles {
        dir: out.clone(),
        pending: Vec::new(),
        done: writer.manifest().shards.len(),
    };
    // Rows and records handed to the writer so far (it may not have written them yet).
    let mut rows = resumed_rows;
    let mut next_record = writer.next_record();
    // The writer (bf16 encoding, zstd, Arrow, shard renames, conversation files) runs on a
    // thread of its own, so the target's next capture overlaps the last record's compression
    // and write; on the H200 these took 40% of a capture-only dump when they ran in turn.
    let (to_writer, outcomes_in) = std::sync::mpsc::sync_channel::<Outcome>(WRITE_QUEUE);
    let (result, written) = std::thread::scope(|scope| {
        let written = scope.spawn(move || write_outcomes(writer, conversations, outcomes_in));
        let result = (|| -> Result<bool, DumpError> {
            while !exhausted {
                let want = conversations_to_read(
                    options.regenerate.is_some(),
                    options.batch_size,
                    options.max_samples,
                    rows,
                );
                if options
                    .max_seconds
                    .is_some_and(|limit| start.elapsed().as_secs_f64() >= limit)
                {
                    return Ok(false);
                }
                // Read records in order until `want` conversations are collected.
                let mut items: Vec<Result<Conversation, &'static str>> = Vec::new();
                while items.iter().filter(|i| i.is_ok()).count() < want {
                    match reader.next() {
                        None => {
                            exhausted = true;
                            break;
                        }
                        Some(Ok(conv)) => items.push(Ok(conv)),
                        Some(Err(skipped)) => items.push(Err(skipped.reason.as_str())),
                    }
                }
                let outcomes = process(
                    model.as_ref(),
                    &tokenizer,
                    &template_sha,
                    options,
                    &request,
                    next_record,
                    items,
                    &mut summary,
                    &mut regen_stats,
                )?;
                for outcome in outcomes {
                    next_record += 1;
                    let is_row = match &outcome {
                        Outcome::Skip(reason) => {
                            *summary.skipped.entry((*reason).to_owned()).or_insert(0) += 1;
                            false
                        }
                        Outcome::Row(record, ..) => {
                            rows += 1;
                            summary.rows += 1;
                            summary.tokens += record.input_ids.len() as u64;
                            true
                        }
                    };
                    if to_writer.send(outcome).is_err() {
                        // The writer stopped on an error, which its join reports.
                        return Ok(false);
                    }
                    if is_row {
                        progress.set_position(rows);
                        let elapsed = start.elapsed().as_secs_f64();
                        let skipped: u64 = summary.skipped.values().sum();
                        progress.set_message(format!(
                            "{:.0} tok/s, {} tokens, {skipped} skipped",
                            rate(summary.tokens, elapsed),
                            summary.tokens,
                        ));
                        if options.max_samples.is_some_and(|max| rows >= max) {
                            return Ok(false);
                        }
                    }
                }
            }
            Ok(true)
        })();
        drop(to_writer);
        let written = written
            .join()
            .expect("the dump writer thread does not panic");
        (result, written)
    });
    progress.finish_and_clear();
    summary.seconds = start.elapsed().as_secs_f64();
    summary.generated_tokens = regen_stats.generated_tokens;
    summary.generation_seconds = regen_stats.seconds;
    summary.generated_turns = regen_stats.turns;
    summary.cut_turns = regen_stats.cut_turns;
    // A write error comes first: the records after it were captured but not written.
    let (writer, mut conversations) = written?;
    match result {
        Ok(complete) => {
            summary.manifest = writer.finish(complete)?;
            conversations.flush(&summary.manifest)?;
            Ok(summary)
        }
        Err(e) => {
            writer.abandon();
            Err(e)
        }
    }
}

/// Captured records the writer thread may hold before the capture waits for it (a record of
/// 2,048 tokens with four 1,536-wide taps is 50 MB in f32).
const WRITE_QUEUE: usize = 4;

/// The writer thread: writes `outcomes` in order (skips counted, rows into shards, the
/// conversation files of completed shards) until the capture stops sending. On an error the
/// open shard is removed (completed shards stay valid) and the error returned.
fn write_outcomes(
    mut writer: DumpWriter,
    mut conversations: ConversationFiles,
    outcomes: std::sync::mpsc::Receiver<Outcome>,
) -> Result<(DumpWriter, ConversationFiles), DumpError> {
    for outcome in outcomes {
        let written = match outcome {
            Outcome::Skip(reason) => {
                writer.skip(reason);
                Ok(())
            }
            Outcome::Row(record, truncated, line) => writer
                .write(&record, truncated)
                .map_err(DumpError::from)
                .and_then(|()| {
                    if let Some(line) = line {
                        conversations.pending.push(line);
                    }
                    conversations.flush(writer.manifest())
                }),
        };
        if let Err(e) = written {
            writer.abandon();
            return Err(e);
        }
    }
    Ok((writer, conversations))
}

/// How many conversations the next batch reads: one at a time when capturing; up to
/// `--batch-size` when regenerating, but no more than the rows `--max-samples` still wants
/// (`dump --max-samples 4` used to regenerate a whole batch of 8 and keep 4).
pub fn conversations_to_read(
    regenerate: bool,
    batch_size: usize,
    max_samples: Option<u64>,
    rows_written: u64,
) -> usize {
    let batch = if regenerate { batch_size.max(1) } else { 1 };
    match max_samples {
        Some(max) => batch.min(max.saturating_sub(rows_written).max(1) as usize),
        None => batch,
    }
}

/// Why a run wrote no row, when the skips say: a dataset of prompts without replies (e.g.
/// MT-Bench) read without `--regenerate` has no assistant token to train on.
pub fn zero_rows_reason(
    rows: u64,
    skipped: &BTreeMap<String, u64>,
    regenerate: bool,
    dataset: &str,
) -> Option<String> {
    if rows > 0 || skipped.is_empty() {
        return None;
    }
    let total: u64 = skipped.values().sum();
    let no_reply = ["single_role", "no_assistant_tokens"]
        .iter()
        .map(|r| skipped.get(*r).copied().unwrap_or(0))
        .sum::<u64>();
    let reasons: Vec<String> = skipped.iter().map(|(r, n)| format!("{r}={n}")).collect();
    Some(if no_reply == total && !regenerate {
        format!(
            "no row written: none of the {total} conversations of {dataset} has an assistant \
             reply to train on ({}); add --regenerate to have the target write the replies",
            reasons.join(" ")
        )
    } else {
        format!(
            "no row written: all {total} conversations of {dataset} were skipped ({})",
            reasons.join(" ")
        )
    })
}

pub(crate) fn to_chat(conv: &Conversation) -> Vec<ChatMessage> {
    conv.messages
        .iter()
        .map(|m| ChatMessage::new(m.role.as_str(), m.content.clone()))
        .collect()
}

/// Turns a run of consecutive records (starting at ordinal `first_record`) into outcomes, in
/// the same order.
#[allow(clippy::too_many_arguments)]
fn process(
    model: &dyn CaptureTarget,
    tokenizer: &TargetTokenizer,
    template_sha: &str,
    options: &DumpOptions,
    request: &TapRequest,
    first_record: u64,
    items: Vec<Result<Conversation, &'static str>>,
    summary: &mut DumpSummary,
    regen_stats: &mut RegenStats,
) -> Result<Vec<Outcome>, DumpError> {
    // Messages per record, after regeneration when asked.
    let mut prepared: Vec<Result<(String, Vec<ChatMessage>), &'static str>> = items
        .iter()
        .map(|item| match item {
            Ok(conv) => Ok((conv.id.clone(), to_chat(conv))),
            Err(reason) => Err(*reason),
        })
        .collect();
    if let Some(settings) = &options.regenerate {
        let batch: Vec<(u64, Vec<ChatMessage>)> = prepared
            .iter()
            .enumerate()
            .filter_map(|(i, p)| {
                p.as_ref()
                    .ok()
                    .map(|(_, m)| (global_record(options, first_record + i as u64), m.clone()))
            })
            .collect();
        let mut results = Vec::new();
        for chunk in batch.chunks(options.batch_size) {
            results.extend(regenerate(
                model,
                tokenizer,
                chunk,
                settings,
                options.max_len,
                regen_stats,
            )?);
        }
        let mut results = results.into_iter();
        for p in prepared.iter_mut() {
            if let Ok((_, messages)) = p {
                match results.next().expect("one result per conversation") {
                    Ok(regenerated) => *messages = regenerated.messages,
                    Err(SampleSkip { reason, .. }) => *p = Err(reason),
                }
            }
        }
    }
    let mut outcomes = Vec::with_capacity(prepared.len());
    for p in prepared {
        let (id, messages) = match p {
            Ok(x) => x,
            Err(reason) => {
                outcomes.push(Outcome::Skip(reason));
                continue;
            }
        };
        let masked =
            match tokenize_conversation(tokenizer, template_sha, &messages, options.max_len)? {
                Ok(m) => m,
                Err(skip) => {
                    outcomes.push(Outcome::Skip(skip.reason));
                    continue;
                }
            };
        let t0 = Instant::now();
        let record = capture(model, request, id, masked.clone())?;
        summary.capture_seconds += t0.elapsed().as_secs_f64();
        let line = options
            .regenerate
            .is_some()
            .then(|| conversation_line(&record.sample_id, &messages));
        outcomes.push(Outcome::Row(record, masked.truncated, line));
    }
    Ok(outcomes)
}

/// One prefill of `tokens` through the capture hook; lays the aux slots out per token
/// (`[tokens, slots * hidden]`) and keeps the last tap as the last block.
pub(crate) fn capture(
    model: &dyn CaptureTarget,
    request: &TapRequest,
    sample_id: String,
    tokens: MaskedTokens,
) -> Result<DumpRecord, DumpError> {
    let n = tokens.input_ids.len();
    let mut taps = model.capture_taps(&tokens.input_ids, request)?;
    let h = model.spec().hidden_size;
    let last_hidden = taps
        .pop()
        .expect("the dump requests the slots and the last block");
    let mut aux_hidden = Vec::with_capacity(n * taps.len() * h);
    for t in 0..n {
        for slot in &taps {
            aux_hidden.extend_from_slice(&slot[t * h..(t + 1) * h]);
        }
    }
    Ok(DumpRecord {
        sample_id,
        input_ids: tokens.input_ids,
        loss_mask: tokens.loss_mask,
        aux_hidden,
        last_hidden,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn regeneration_batches_stop_at_max_samples() {
        // Capturing reads one conversation at a time whatever the options.
        assert_eq!(conversations_to_read(false, 8, Some(4), 0), 1);
        // Regenerating: a batch, capped by the rows --max-samples still wants.
        assert_eq!(conversations_to_read(true, 8, None, 100), 8);
        assert_eq!(conversations_to_read(true, 8, Some(4), 0), 4);
        assert_eq!(conversations_to_read(true, 8, Some(20), 17), 3);
        assert_eq!(conversations_to_read(true, 8, Some(20), 0), 8);
        // Never zero (the loop would spin): the row check ends the run.
        assert_eq!(conversations_to_read(true, 8, Some(4), 4), 1);
    }

    #[test]
    fn zero_rows_say_why() {
        let skipped: BTreeMap<String, u64> = [("single_role".to_owned(), 80)].into();
        let why = zero_rows_reason(0, &skipped, false, "mtbench").unwrap();
        assert!(
            why.contains("80 conversations of mtbench")
                && why.contains("single_role=80")
                && why.contains("--regenerate"),
            "{why}"
        );
        let mixed: BTreeMap<String, u64> =
            [("single_role".to_owned(), 3), ("too_long".to_owned(), 2)].into();
        let why = zero_rows_reason(0, &mixed, false, "x.jsonl").unwrap();
        assert!(
            why.contains("all 5 conversations") && !why.contains("--regenerate"),
            "{why}"
        );
        assert_eq!(zero_rows_reason(3, &skipped, false, "mtbench"), None);
        assert_eq!(
            zero_rows_reason(0, &BTreeMap::new(), false, "mtbench"),
            None
        );
    }
}
