//! The training loop of `tandem train`: checks, the data pass, AdamW with warm-up + cosine and
//! global grad-norm clipping, validation, checkpoints with exact resume, metrics, export.

use std::path::{Path, PathBuf};
use std::time::Instant;

use burn::module::{AutodiffModule, Module, ModuleVisitor, Param};
use burn::optim::{AdamWConfig, GradientsParams, Optimizer};
use burn::prelude::*;
use burn::record::{FullPrecisionSettings, NamedMpkFileRecorder, Recorder};
use burn::tensor::TensorData;
use burn::tensor::backend::AutodiffBackend;
use indicatif::{ProgressBar, ProgressStyle};
use serde::{Deserialize, Serialize};
use tandem_eagle::{
    Eagle3Config, Eagle3Draft, VocabMap, WeightDtype, build_vocab_map, load_pretrained,
    save_pretrained,
};
use tandem_wiring::{DumpRef, Job, Producer, RawIds, TapPoint, WiringManifest, check};

use tandem_format::DumpRecord;

use crate::data::{Dataset, RowInfo, assemble, check_record, is_validation};
use crate::driver::{Run, StepEngine, StepOutcome, run_schedule, wall_clock};
use crate::error::TrainError;
use crate::metrics::{MetricsLine, MetricsLog, StatsSum, read_lines};
use crate::objective::{BatchTargets, draft_id_tensor, objective};
use crate::plot;
use crate::schedule::FittedHorizon;
use crate::target::{TargetHead, fingerprint};

/// Batches sorted together by length when planning an epoch.
pub(crate) const BUCKET_BATCHES: usize = 32;
/// Where checkpoints go inside `--out`.
pub const CHECKPOINT_DIR: &str = "checkpoints";
/// The metrics log inside `--out`.
pub const METRICS_FILE: &str = "metrics.jsonl";
/// The curves page inside `--out`.
pub const CURVES_FILE: &str = "curves.html";
/// The resolved options inside `--out`.
pub const OPTIONS_FILE: &str = "train_options.json";

/// Everything `tandem train` is told. Defaults: [`TrainOptions::new`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainOptions {
    /// Dump directories (`tandem dump` output), read as one dataset.
    pub dumps: Vec<PathBuf>,
    /// The target model directory the dumps were captured from.
    pub model: PathBuf,
    /// Output directory: the exported head, checkpoints, metrics, curves.
    pub out: PathBuf,
    /// Draft vocabulary size (default: min(32000, target vocab)).
    pub draft_vocab: Option<usize>,
    /// TTT unroll length.
    pub ttt_steps: usize,
    /// Passes over the training split.
    pub epochs: usize,
    /// Peak learning rate.
    pub lr: f64,
    /// Sequences per batch.
    pub batch_size: usize,
    /// Tokens per sequence (longer rows are cut).
    pub max_len: usize,
    /// Share of the steps spent warming up.
    pub warmup_ratio: f64,
    /// Final learning rate as a share of the peak.
    pub min_lr_ratio: f64,
    /// AdamW weight decay.
    pub weight_decay: f64,
    /// Global gradient-norm clip (0 = off).
    pub max_grad_norm: f64,
    /// Share of samples (by id) held out for validation.
    pub val_fraction: f64,
    /// Validate every this many steps (0 = only at the end of each epoch).
    pub eval_every: usize,
    /// Checkpoint every this many steps (0 = only at the end).
    pub save_every: usize,
    /// Checkpoints kept on disk (oldest deleted first; at least 1).
    pub keep_checkpoints: usize,
    /// Seed of the initialisation and of the data order.
    pub seed: u64,
    /// Stop after this many optimizer steps in total (the schedule still spans all epochs).
    pub max_steps: Option<usize>,
    /// Stop after the step during which this run has trained for this many seconds
    /// (validation, checkpoint and export follow as after `max_steps`). The schedule's
    /// horizon is fitted to the limit from the measured steps/s (never beyond the epochs), so
    /// the learning rate reaches its floor when time is up; the fit is saved in the
    /// checkpoints' [`TrainState`]. Not saved with the run's identity: a resumed run may use
    /// another limit, and keeps a horizon fitted before.
    #[serde(default)]
    pub max_seconds: Option<f64>,
    /// Start from this head directory instead of a random initialisation.
    pub init_from: Option<PathBuf>,
    /// Export the final head in bf16 instead of f32.
    pub export_bf16: bool,
    /// Continue the run in `out` from its latest checkpoint.
    pub resume: bool,
    /// Draw a progress bar on stderr.
    pub progress: bool,
    /// Device description for the manifest (`cpu`, `cuda`).
    pub device_label: String,
    /// `--online`: the dataset whose rows are captured from the target while training
    /// (`tandem_dump::OnlineCapture`) instead of read from `dumps`.
    #[serde(default)]
    pub online: Option<String>,
    /// This process is one replica of a data-parallel run (the GPU trainer only): it trains
    /// on its share of every global batch and sums gradients with the others over NCCL. Not
    /// part of the run's identity: a run may resume on another number of GPUs.
    #[serde(default)]
    pub data_parallel: Option<crate::replicas::DataParallel>,
}

impl TrainOptions {
    /// SpecForge-like defaults: 7 TTT steps, 1 epoch, lr 1e-4, batch 4, max length 2048,
    /// warm-up 1.5%, cosine to 0, no weight decay, clip 0.5, 2% validation, checkpoint every
    /// 500 steps (2 kept), seed 0.
    pub fn new(dumps: Vec<PathBuf>, model: impl Into<PathBuf>, out: impl Into<PathBuf>) -> Self {
        TrainOptions {
            dumps,
            model: model.into(),
            out: out.into(),
            draft_vocab: None,
            ttt_steps: 7,
            epochs: 1,
            lr: 1e-4,
            batch_size: 4,
            max_len: 2048,
            warmup_ratio: 0.015,
            min_lr_ratio: 0.0,
            weight_decay: 0.0,
            max_grad_norm: 0.5,
            val_fraction: 0.02,
            eval_every: 0,
            save_every: 500,
            keep_checkpoints: 2,
            seed: 0,
            max_steps: None,
            max_seconds: None,
            init_from: None,
            export_bf16: false,
            resume: false,
            progress: false,
            device_label: "cpu".to_owned(),
            online: None,
            data_parallel: None,
        }
    }

    /// The options a resumed run must share with the interrupted one (everything that shapes
    /// the parameters: data, model, schedule, seed).
    pub(crate) fn identity(&self) -> serde_json::Value {
        let mut v = serde_json::to_value(self).expect("options serialise");
        let map = v.as_object_mut().expect("object");
        for volatile in [
            "out",
            "resume",
            "progress",
            "device_label",
            "max_steps",
            "max_seconds",
            "eval_every",
            "save_every",
            "keep_checkpoints",
            "export_bf16",
            "data_parallel",
        ] {
            map.remove(volatile);
        }
        v
    }

    pub(crate) fn validate(&self) -> Result<(), TrainError> {
        let bad = |option, reason: &str| {
            Err(TrainError::InvalidOption {
                option,
                reason: reason.to_owned(),
            })
        };
        match (&self.online, self.dumps.is_empty()) {
            (None, true) => return bad("dump", "at least one dump directory is needed"),
            (Some(_), false) => {
                return bad(
                    "online",
                    "trains on taps captured from --dataset; pass it without --dump",
                );
            }
            _ => {}
        }
        if self.ttt_steps == 0 {
            return bad("ttt-steps", "must be at least 1");
        }
        if self.epochs == 0 {
            return bad("epochs", "must be at least 1");
        }
        if !(self.lr > 0.0 && self.lr.is_finite()) {
            return bad("lr", "must be a positive number");
        }
        if self.batch_size == 0 {
            return bad("batch-size", "must be at least 1");
        }
        if self.max_len < 3 {
            return bad("max-len", "must be at least 3 tokens");
        }
        if !(0.0..1.0).contains(&self.val_fraction) {
            return bad("val-fraction", "must be in [0, 1)");
        }
        if !(0.0..=1.0).contains(&self.warmup_ratio) || !(0.0..=1.0).contains(&self.min_lr_ratio) {
            return bad(
                "warmup-ratio",
                "warm-up and minimum-lr ratios must be in [0, 1]",
            );
        }
        if self
            .max_seconds
            .is_some_and(|s| !(s > 0.0 && s.is_finite()))
        {
            return bad("max-seconds", "must be a positive number of seconds");
        }
        if let Some(dp) = &self.data_parallel
            && (dp.world_size == 0 || dp.rank >= dp.world_size)
        {
            return bad(
                "rank",
                &format!("rank {} of {} replicas", dp.rank, dp.world_size),
            );
        }
        if self.max_grad_norm < 0.0 || self.weight_decay < 0.0 {
            return bad(
                "max-grad-norm",
                "clip and weight decay must not be negative",
            );
        }
        Ok(())
    }
}

/// Progress of a run, saved with every checkpoint.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainState {
    /// Optimizer steps done.
    pub step: usize,
    /// Epoch of the next batch.
    pub epoch: usize,
    /// Index of the next batch in that epoch's plan.
    pub batch_in_epoch: usize,
    /// Steps of the whole `--epochs` schedule (the warm-up is a share of these).
    pub total_steps: usize,
    /// The horizon fitted to `--max-seconds` once it is (the schedule then ends there);
    /// kept on resume, since it came from measured step times.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fitted_horizon: Option<FittedHorizon>,
    /// Real tokens trained on so far.
    pub tokens_seen: u64,
    /// Rows in the dataset and in the training split (a resumed run must see the same).
    pub rows: usize,
    /// Rows in the training split.
    pub train_rows: usize,
    /// [`TrainOptions`] identity of the run.
    pub options: serde_json::Value,
}

/// What a finished run reports.
#[derive(Debug, Clone)]
pub struct TrainReport {
    /// Optimizer steps done in total.
    pub steps: usize,
    /// Steps of the whole schedule (the horizon fitted to `--max-seconds`, if one was).
    pub total_steps: usize,
    /// The step the run resumed from, if it did.
    pub resumed_from: Option<usize>,
    /// The exported head directory (`--out`).
    pub export_dir: PathBuf,
    /// Rows in the training and validation splits.
    pub train_rows: usize,
    /// Rows held out.
    pub val_rows: usize,
    /// The first and last train lines of this run.
    pub first_train: Option<MetricsLine>,
    /// The last train line.
    pub last_train: Option<MetricsLine>,
    /// The first validation line of the whole run (its steps may come from before a resume).
    pub first_val: Option<MetricsLine>,
    /// The last validation line.
    pub last_val: Option<MetricsLine>,
    /// Steps per second of this run (data loading and validation included).
    pub steps_per_s: f64,
    /// Training tokens per second of this run.
    pub tokens_per_s: f64,
    /// The dumps the head was trained on, as its config.json names them
    /// (`tandem_wiring.trained_on`).
    pub trained_on: Vec<DumpRef>,
}

/// The burn trainer runs in one process; replicas are the GPU trainer's.
fn refuse_data_parallel(options: &TrainOptions) -> Result<(), TrainError> {
    match &options.data_parallel {
        Some(dp) => Err(TrainError::InvalidOption {
            option: "devices",
            reason: format!(
                "data-parallel training (rank {} of {}) runs on the GPU trainer: pass --device cuda",
                dp.rank, dp.world_size
            ),
        }),
        None => Ok(()),
    }
}

fn record_err(path: &Path) -> impl FnOnce(burn::record::RecorderError) -> TrainError {
    let path = path.to_owned();
    move |e| TrainError::Record {
        path,
        reason: e.to_string(),
    }
}

/// Runs `tandem train` on the dumps of `options` with backend `B` (an autodiff backend).
pub fn train<B: AutodiffBackend>(
    options: &TrainOptions,
    device: &B::Device,
) -> Result<TrainReport, TrainError> {
    options.validate()?;
    refuse_data_parallel(options)?;
    let data = Dataset::open(&options.dumps)?;
    train_on::<B>(options, data, device)
}

/// [`train`] on an already opened dataset (tests use in-memory sources).
pub fn train_on<B: AutodiffBackend>(
    options: &TrainOptions,
    data: Dataset,
    device: &B::Device,
) -> Result<TrainReport, TrainError> {
    options.validate()?;
    refuse_data_parallel(options)?;
    let start = Instant::now();
    std::fs::create_dir_all(&options.out).map_err(TrainError::io("create", &options.out))?;
    let wiring = check_data(options, &data)?;
    let head = TargetHead::<B::InnerBackend>::load(&options.model, device)?;
    let spec = &head.spec;
    let hidden = spec.hidden_size;
    let slots = wiring.taps.len();
    let engine_ids = engine_ids(&wiring, spec.num_layers)?;

    // First pass: lengths, the split, token counts for the draft vocabulary.
    let RowIndex {
        train: train_rows,
        val: val_rows,
        counts,
    } = index_rows(options, &data, slots, hidden, spec.vocab_size)?;
    if train_rows.is_empty() {
        return Err(TrainError::NoData {
            reason: format!(
                "{} rows, {} in validation, none left to train on (rows need at least 3 tokens)",
                data.len(),
                val_rows.len()
            ),
        });
    }
    let batches_per_epoch = train_rows.len().div_ceil(options.batch_size);
    let total_steps = batches_per_epoch * options.epochs;

    // The head, its vocabulary and config: resumed, initialised from a head, or fresh.
    let recorder = NamedMpkFileRecorder::<FullPrecisionSettings>::new();
    let mut optim = AdamWConfig::new()
        .with_beta_1(0.9)
        .with_beta_2(0.999)
        .with_epsilon(1e-8)
        .with_weight_decay(options.weight_decay as f32)
        .init::<B, Eagle3Draft<B>>();
    let embed = || Tensor::<B, 2>::from_inner(head.embed_tokens.clone());
    let identity = options.identity();
    let (model, base_config, state, resumed_from) = if options.resume {
        let (dir, state) = resume_state(options, &identity, data.len(), train_rows.len())?;
        let loaded = load_pretrained::<B>(&dir.join("head"), embed(), device)?;
        let model = loaded
            .draft
            .load_file(dir.join("model"), &recorder, device)
            .map_err(record_err(&dir.join("model.mpk")))?;
        let record = recorder
            .load(dir.join("optim"), device)
            .map_err(record_err(&dir.join("optim.mpk")))?;
        optim = optim.load_record(record);
        let step = state.step;
        (model, loaded.config, state, Some(step))
    } else {
        let (model, config) = fresh_model::<B>(options, &head, &wiring, &counts, embed(), device)?;
        let state = fresh_state(options, identity, data.len(), train_rows.len(), total_steps)?;
        (model, config, state, None)
    };
    let trained_on: Vec<DumpRef> = data.sources().iter().map(|s| s.dump_ref()).collect();
    let export_config = export_config(
        &base_config,
        &wiring,
        &engine_ids,
        &trained_on,
        resumed_from.is_some(),
        &options.device_label,
    )?;
    write_json(&options.out.join(OPTIONS_FILE), options)?;
    let log = MetricsLog::open(&options.out.join(METRICS_FILE), resumed_from)?;
    let draft_ids = draft_id_tensor::<B::InnerBackend>(&model.vocab, device);
    let mut engine = BurnEngine {
        model: Some(model),
        optim,
        data: &data,
        head: &head,
        draft_ids,
        options,
        slots,
        hidden,
        export_config: &export_config,
        device: device.clone(),
    };
    run_schedule(
        Run {
            options,
            train_rows: &train_rows,
            val_rows: &val_rows,
            state,
            resumed_from,
            log,
            start,
            trained_on,
            clock: wall_clock(),
        },
        &mut engine,
    )
}

/// The burn trainer's side of the run: autodiff through [`Eagle3Draft::forward_ttt`] and
/// [`objective`], burn's AdamW, burn records for checkpoints.
struct BurnEngine<'a, B: AutodiffBackend, O> {
    /// Taken out for the optimizer step (which consumes it), always put back.
    model: Option<Eagle3Draft<B>>,
    optim: O,
    data: &'a Dataset,
    head: &'a TargetHead<B::InnerBackend>,
    draft_ids: Tensor<B::InnerBackend, 1, Int>,
    options: &'a TrainOptions,
    slots: usize,
    hidden: usize,
    export_config: &'a Eagle3Config,
    device: B::Device,
}

impl<B: AutodiffBackend, O: Optimizer<Eagle3Draft<B>, B>> BurnEngine<'_, B, O> {
    fn model(&self) -> &Eagle3Draft<B> {
        self.model
            .as_ref()
            .expect("the model is put back after every step")
    }
}

impl<B: AutodiffBackend, O: Optimizer<Eagle3Draft<B>, B>> StepEngine for BurnEngine<'_, B, O> {
    fn step(&mut self, rows: &[usize], lr: f64, step: usize) -> Result<StepOutcome, TrainError> {
        let options = self.options;
        let batch = assemble(self.data, rows, options.max_len, self.slots, self.hidden)?;
        let model = self
            .model
            .take()
            .expect("the model is put back after every step");
        let aux = Tensor::<B, 3>::from_data(
            TensorData::new(
                batch.aux.clone(),
                [batch.size(), batch.width, self.slots * self.hidden],
            ),
            &self.device,
        );
        let outputs =
            match model.forward_ttt(aux, &batch.input_ids, &batch.lengths, options.ttt_steps) {
                Ok(outputs) => outputs,
                Err(e) => {
                    self.model = Some(model);
                    return Err(e.into());
                }
            };
        let inner = BatchTargets::compute(self.head, &batch, &self.draft_ids);
        let targets = BatchTargets::<B> {
            probs: Tensor::from_inner(inner.probs),
            argmax: inner.argmax,
        };
        let (loss, stats) = objective(&outputs, &targets, &batch, &model.vocab);
        drop(outputs);
        let loss_value = scalar(loss.clone());
        if !loss_value.is_finite() {
            // No step on a non-finite loss: the weights stay those of the last good step.
            self.model = Some(model);
            return Err(TrainError::Diverged {
                step: step + 1,
                loss: loss_value,
            });
        }
        let mut grads = GradientsParams::from_grads(loss.backward(), &model);
        let grad_norm = clip_global_norm::<B>(&model, &mut grads, options.max_grad_norm);
        self.model = Some(self.optim.step(lr, model, grads));
        Ok(StepOutcome {
            loss: loss_value,
            stats,
            grad_norm,
            tokens: batch.tokens(),
        })
    }

    fn validate(&mut self, rows: &[RowInfo]) -> Result<StatsSum, TrainError> {
        validate(
            &self.model().valid(),
            self.data,
            rows,
            self.head,
            &self.draft_ids,
            self.options,
            self.slots,
            self.hidden,
        )
    }

    fn checkpoint(&mut self, state: &TrainState) -> Result<(), TrainError> {
        save_checkpoint(
            self.model(),
            &self.optim,
            state,
            self.export_config,
            self.options,
        )
    }

    fn export(&mut self, dtype: WeightDtype) -> Result<(), TrainError> {
        Ok(save_pretrained(
            &self.model().valid(),
            self.export_config,
            &self.options.out,
            dtype,
        )?)
    }
}

/// The state of an interrupted run in `--out` (`--resume`), refused when the options or the
/// data differ from the run's. Returns the checkpoint directory and its state.
pub(crate) fn resume_state(
    options: &TrainOptions,
    identity: &serde_json::Value,
    rows: usize,
    train_rows: usize,
) -> Result<(PathBuf, TrainState), TrainError> {
    let (dir, state) = latest_checkpoint(&options.out)?;
    if state.options != *identity {
        return Err(TrainError::Resume {
            path: options.out.clone(),
            reason: format!(
                "the options differ from the interrupted run's ({}); resume with the same \
                 data, model, schedule and seed",
                describe_differences(&state.options, identity)
            ),
        });
    }
    if state.rows != rows || state.train_rows != train_rows {
        return Err(TrainError::Resume {
            path: options.out.clone(),
            reason: format!(
                "the dumps now hold {rows} rows ({train_rows} for training), the run was \
                 started on {} ({})",
                state.rows, state.train_rows
            ),
        });
    }
    Ok((dir, state))
}

/// The state of a new run; the checkpoints of an earlier run in `--out` are cleared.
pub(crate) fn fresh_state(
    options: &TrainOptions,
    identity: serde_json::Value,
    rows: usize,
    train_rows: usize,
    total_steps: usize,
) -> Result<TrainState, TrainError> {
    // Only the replica that writes checkpoints clears them: data-parallel replicas share
    // `--out`, and two removing one tree at once fail on each other's deletions.
    let primary = options
        .data_parallel
        .as_ref()
        .is_none_or(|dp| dp.is_primary());
    let checkpoints = options.out.join(CHECKPOINT_DIR);
    if primary && checkpoints.exists() {
        std::fs::remove_dir_all(&checkpoints).map_err(TrainError::io("clear", &checkpoints))?;
    }
    Ok(TrainState {
        step: 0,
        epoch: 0,
        batch_in_epoch: 0,
        total_steps,
        fitted_horizon: None,
        tokens_seen: 0,
        rows,
        train_rows,
        options: identity,
    })
}

/// Checks the dumps against each other and against `--model`, refuses evaluation data and
/// non-residual taps, and returns the wiring the head is trained on.
pub(crate) fn check_data(
    options: &TrainOptions,
    data: &Dataset,
) -> Result<WiringManifest, TrainError> {
    let first = data.sources()[0].wiring().clone();
    for source in data.sources() {
        if source.split() == Some("eval") {
            return Err(TrainError::EvalData {
                path: PathBuf::from(source.name()),
                dataset: source.split().unwrap_or_default().to_owned(),
            });
        }
    }
    for source in &data.sources()[1..] {
        let sentences: Vec<String> = check(&first, source.wiring())
            .iter()
            .filter(|m| m.is_fatal())
            .map(ToString::to_string)
            .collect();
        if !sentences.is_empty() {
            return Err(TrainError::WiringMismatch {
                what: format!(
                    "dump {} does not agree with dump {}",
                    source.name(),
                    data.sources()[0].name()
                ),
                sentences,
            });
        }
    }
    if first.tap_point != TapPoint::ResidualStream {
        return Err(TrainError::InvalidOption {
            option: "dump",
            reason: format!(
                "the dump captured {}; EAGLE-3 heads read the residual stream",
                first.tap_point.describe()
            ),
        });
    }
    let model_target = fingerprint(&options.model, first.target.chat_template_sha256.is_some())?;
    let mut actual = first.clone();
    actual.target = model_target;
    let sentences: Vec<String> = check(&first, &actual)
        .iter()
        .filter(|m| m.is_fatal())
        .map(ToString::to_string)
        .collect();
    if !sentences.is_empty() {
        return Err(TrainError::WiringMismatch {
            what: format!(
                "dump {} was not captured from --model {}",
                data.sources()[0].name(),
                options.model.display()
            ),
            sentences,
        });
    }
    Ok(first)
}

/// What the first pass over the data finds.
struct RowIndex {
    /// Training rows (at least 3 tokens), with lengths after `--max-len`.
    train: Vec<RowInfo>,
    /// Validation rows.
    val: Vec<RowInfo>,
    /// `[vocab]` counts of the training split's assistant tokens.
    counts: Vec<u64>,
}

/// The first pass over the data: every row checked, split by id, lengths after `--max-len`,
/// and counts of the assistant tokens of the training split (for the draft vocabulary).
fn index_rows(
    options: &TrainOptions,
    data: &Dataset,
    slots: usize,
    hidden: usize,
    vocab: usize,
) -> Result<RowIndex, TrainError> {
    let bar = if options.progress {
        let bar = ProgressBar::new(data.len() as u64);
        bar.set_style(
            ProgressStyle::with_template("indexing dump {bar:30} {pos}/{len} rows")
                .expect("valid template"),
        );
        bar
    } else {
        ProgressBar::hidden()
    };
    let mut train = Vec::new();
    let mut val = Vec::new();
    let mut counts = vec![0u64; vocab];
    for index in 0..data.len() {
        let r = data.read(index)?;
        let row = index_row(&r, index, options, slots, hidden, &mut counts)?;
        bar.inc(1);
        match row {
            Some((info, true)) => val.push(info),
            Some((info, false)) => train.push(info),
            None => {}
        }
    }
    bar.finish_and_clear();
    Ok(RowIndex { train, val, counts })
}

/// One row of the first pass (both trainers): its widths checked against `slots` taps of
/// `hidden`, its token ids against the vocabulary (`counts.len()`), its length cut to
/// `--max-len`. `None` when fewer than 3 tokens are left (nothing to train on); otherwise the
/// row and whether it is held out for validation. A training row's assistant tokens are added
/// to `counts` (for the draft vocabulary).
pub(crate) fn index_row(
    r: &DumpRecord,
    index: usize,
    options: &TrainOptions,
    slots: usize,
    hidden: usize,
    counts: &mut [u64],
) -> Result<Option<(RowInfo, bool)>, TrainError> {
    let vocab = counts.len();
    check_record(r, index, slots, hidden)?;
    if let Some(&id) = r.input_ids.iter().find(|&&t| t as usize >= vocab) {
        return Err(TrainError::BadSample {
            index,
            sample_id: r.sample_id.clone(),
            reason: format!("token id {id} is outside the target vocabulary ({vocab})"),
        });
    }
    let len = r.len().min(options.max_len);
    if len < 3 {
        return Ok(None);
    }
    let val = is_validation(&r.sample_id, options.val_fraction);
    if !val {
        for (&t, &m) in r.input_ids[..len].iter().zip(&r.loss_mask[..len]) {
            if m != 0 {
                counts[t as usize] += 1;
            }
        }
    }
    Ok(Some((RowInfo { index, len }, val)))
}

/// A new head: from `--init-from` or randomly initialised, with its config.
pub(crate) fn fresh_model<B: AutodiffBackend>(
    options: &TrainOptions,
    head: &TargetHead<B::InnerBackend>,
    wiring: &WiringManifest,
    counts: &[u64],
    embed: Tensor<B, 2>,
    device: &B::Device,
) -> Result<(Eagle3Draft<B>, Eagle3Config), TrainError> {
    let vocab_size = head.spec.vocab_size;
    if let Some(dir) = &options.init_from {
        let loaded = load_pretrained::<B>(dir, embed, device)?;
        let spec = &loaded.draft.spec;
        if spec.fc_in() != wiring.taps.len() * head.spec.hidden_size {
            return Err(TrainError::InvalidOption {
                option: "init-from",
                reason: format!(
                    "{}: fc reads {} values per token, the dump has {} taps x {}",
                    dir.display(),
                    spec.fc_in(),
                    wiring.taps.len(),
                    head.spec.hidden_size
                ),
            });
        }
        if let Some(want) = options.draft_vocab
            && want != spec.draft_vocab_size
        {
            return Err(TrainError::InvalidOption {
                option: "draft-vocab",
                reason: format!(
                    "{want}, but --init-from {} has a draft vocabulary of {} (its d2t/t2d are \
                     kept)",
                    dir.display(),
                    spec.draft_vocab_size
                ),
            });
        }
        if let Some(trained) = &loaded.config.tandem_wiring {
            let sentences: Vec<String> = check(trained, wiring)
                .iter()
                .filter(|m| m.is_fatal())
                .map(ToString::to_string)
                .collect();
            if !sentences.is_empty() {
                return Err(TrainError::WiringMismatch {
                    what: format!(
                        "--init-from {} was trained on other wiring than the dump",
                        dir.display()
                    ),
                    sentences,
                });
            }
        } else if let Some(ids) = loaded
            .config
            .eagle_config
            .as_ref()
            .and_then(|e| e.eagle_aux_hidden_state_layer_ids.clone())
        {
            // Read as SGLang reads them for this target's family (tandem_wiring::engines).
            let taps = tandem_wiring::sglang_convention(&wiring.target.architecture)
                .to_canonical(&ids, head.spec.num_layers)?;
            if taps != wiring.taps {
                return Err(TrainError::WiringMismatch {
                    what: format!(
                        "--init-from {} names other taps than the dump",
                        dir.display()
                    ),
                    sentences: vec![format!(
                        "its eagle_aux_hidden_state_layer_ids {ids:?} read by SGLang are {}, \
                         the dump holds {}",
                        tandem_wiring::format_taps(&taps),
                        tandem_wiring::format_taps(&wiring.taps)
                    )],
                });
            }
        }
        return Ok((loaded.draft, loaded.config));
    }
    let draft_vocab = options.draft_vocab.unwrap_or(32_000.min(vocab_size));
    if draft_vocab == 0 || draft_vocab > vocab_size {
        return Err(TrainError::InvalidOption {
            option: "draft-vocab",
            reason: format!("{draft_vocab} must be in 1..={vocab_size} (the target vocabulary)"),
        });
    }
    let vocab: VocabMap = build_vocab_map(counts, draft_vocab, vocab_size)?;
    let config = head_config(head, draft_vocab, wiring.taps.len());
    let spec = config.resolve()?;
    let model = Eagle3Draft::init(spec, vocab, embed, options.seed, device)?;
    Ok((model, config))
}

/// The config of a new head for the target: [`Eagle3Config::for_target`], except on a target
/// with multi-head latent attention (DeepSeek-V3, Kimi-K2), whose `head_dim` (HF sets it to
/// `qk_rope_head_dim`) and `rope_scaling` (yarn) describe only the rope part of its attention.
/// The head's one layer is a Llama layer with RoPE over whole heads, so it takes
/// `hidden_size / num_attention_heads` and unscaled RoPE, as SpecForge's DeepSeek-V3 head config
/// does (a Llama layer has no yarn: copied, it made the head config invalid).
fn head_config<B: Backend>(head: &TargetHead<B>, draft_vocab: usize, taps: usize) -> Eagle3Config {
    let mut config = Eagle3Config::for_target(&head.config, draft_vocab, taps);
    if head.spec.mla.is_some() {
        config.head_dim = None;
        config.rope_scaling = None;
    }
    config
}

/// The ids each engine reads for the dump's taps, in its place and convention: SGLang's for
/// `eagle_config`, vLLM's for the top level (`tandem_wiring::engines`). Checked before training,
/// so a head that could not be exported faithfully is refused before any step runs.
pub(crate) fn engine_ids(
    wiring: &WiringManifest,
    num_layers: usize,
) -> Result<(Vec<i64>, Vec<i64>), TrainError> {
    tandem_wiring::export_ids(&wiring.taps, &wiring.target.architecture, num_layers).map_err(|e| {
        TrainError::InvalidOption {
            option: "dump",
            reason: format!(
                "the dump's taps cannot be written as SGLang and vLLM layer ids, so an exported \
                 head would be served on other taps: {e}"
            ),
        }
    })
}

/// The config the head is exported with: SGLang-convention aux ids in `eagle_config`, the
/// canonical wiring (job `train`) under `tandem_wiring`, naming the dumps it was trained on
/// (`trained_on`): after those of the `--init-from` head, as the next stage
/// ([`tandem_wiring::lineage`]); a resumed run (`resumed`) keeps its checkpoint's lineage.
pub(crate) fn export_config(
    base: &Eagle3Config,
    wiring: &WiringManifest,
    (sglang_ids, vllm_ids): &(Vec<i64>, Vec<i64>),
    trained_on: &[DumpRef],
    resumed: bool,
    device_label: &str,
) -> Result<Eagle3Config, TrainError> {
    let prior = base
        .tandem_wiring
        .as_ref()
        .map(|w| w.trained_on.clone())
        .unwrap_or_default();
    let trained_on = if resumed && !prior.is_empty() {
        prior
    } else {
        tandem_wiring::lineage(&prior, trained_on)
    };
    let mut config = base.clone();
    let mut eagle = config
        .eagle_config
        .take()
        .unwrap_or(tandem_eagle::EagleConfig {
            eagle_aux_hidden_state_layer_ids: None,
            use_aux_hidden_state: true,
            extra: Default::default(),
        });
    eagle.eagle_aux_hidden_state_layer_ids = Some(sglang_ids.to_vec());
    eagle.use_aux_hidden_state = true;
    config.eagle_config = Some(eagle);
    // vLLM reads the top level only (and would otherwise serve its default taps).
    config.extra.insert(
        tandem_wiring::AUX_IDS_KEY.to_owned(),
        serde_json::json!(vllm_ids),
    );
    let mut trained = wiring.clone();
    trained.producer = Producer::tandem(Job::Train, device_label, "train");
    trained.raw_ids = Some(RawIds::new(
        tandem_wiring::sglang_convention(&wiring.target.architecture),
        sglang_ids.to_vec(),
    ));
    trained.trained_on = trained_on;
    trained.validate()?;
    config.tandem_wiring = Some(trained);
    config.extra.remove("num_aux_taps");
    if config.num_taps() != wiring.taps.len() {
        return Err(TrainError::InvalidOption {
            option: "dump",
            reason: "tap count of the head and of the dump differ".to_owned(),
        });
    }
    Ok(config)
}

/// Validation pass: the whole held-out split, batches sorted by length, no gradients.
#[allow(clippy::too_many_arguments)]
fn validate<B: Backend>(
    model: &Eagle3Draft<B>,
    data: &Dataset,
    rows: &[RowInfo],
    head: &TargetHead<B>,
    draft_ids: &Tensor<B, 1, Int>,
    options: &TrainOptions,
    slots: usize,
    hidden: usize,
) -> Result<StatsSum, TrainError> {
    let mut sorted = rows.to_vec();
    sorted.sort_by_key(|r| (r.len, r.index));
    let device = draft_ids.device();
    let mut sum = StatsSum::default();
    for chunk in sorted.chunks(options.batch_size) {
        let indices: Vec<usize> = chunk.iter().map(|r| r.index).collect();
        let batch = assemble(data, &indices, options.max_len, slots, hidden)?;
        let aux = Tensor::<B, 3>::from_data(
            TensorData::new(
                batch.aux.clone(),
                [batch.size(), batch.width, slots * hidden],
            ),
            &device,
        );
        let outputs =
            model.forward_ttt(aux, &batch.input_ids, &batch.lengths, options.ttt_steps)?;
        let targets = BatchTargets::compute(head, &batch, draft_ids);
        let (_, stats) = objective(&outputs, &targets, &batch, &model.vocab);
        sum.add(&stats, batch.tokens());
    }
    Ok(sum)
}

fn scalar<B: Backend>(t: Tensor<B, 1>) -> f64 {
    t.into_data()
        .convert::<f64>()
        .to_vec::<f64>()
        .expect("float scalar")[0]
}

/// Global L2 norm of all gradients (as `torch.nn.utils.clip_grad_norm_`), and, when it exceeds
/// `max_norm > 0`, every gradient scaled by `max_norm / (norm + 1e-6)`. Returns the norm before
/// clipping. (burn's own `GradientClippingConfig::Norm` clips each tensor separately.)
pub fn clip_global_norm<B: AutodiffBackend>(
    model: &Eagle3Draft<B>,
    grads: &mut GradientsParams,
    max_norm: f64,
) -> f64 {
    struct SquaredNorm<'a> {
        grads: &'a GradientsParams,
        sum: f64,
    }
    impl<B: AutodiffBackend> ModuleVisitor<B> for SquaredNorm<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            if let Some(g) = self.grads.get::<B::InnerBackend, D>(param.id) {
                self.sum += g
                    .powi_scalar(2)
                    .sum()
                    .into_data()
                    .convert::<f64>()
                    .to_vec::<f64>()
                    .expect("float")[0];
            }
        }
    }
    struct Scale<'a> {
        grads: &'a mut GradientsParams,
        factor: f64,
    }
    impl<B: AutodiffBackend> ModuleVisitor<B> for Scale<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            if let Some(g) = self.grads.remove::<B::InnerBackend, D>(param.id) {
                self.grads.register(param.id, g * self.factor);
            }
        }
    }
    let mut norm = SquaredNorm { grads, sum: 0.0 };
    Module::<B>::visit(model, &mut norm);
    let total = norm.sum.sqrt();
    if max_norm > 0.0 && total > max_norm {
        let mut scale = Scale {
            grads,
            factor: max_norm / (total + 1e-6),
        };
        Module::<B>::visit(model, &mut scale);
    }
    total
}

pub(crate) fn write_json<T: Serialize>(path: &Path, value: &T) -> Result<(), TrainError> {
    let mut text = serde_json::to_string_pretty(value).expect("serialise");
    text.push('\n');
    std::fs::write(path, text).map_err(TrainError::io("write", path))
}

pub(crate) fn checkpoint_name(step: usize) -> String {
    format!("step-{step:08}")
}

/// Saves parameters + optimizer state (burn records, full precision), the state, the head as
/// an engine-loadable directory, and the curves; points `checkpoints/latest` at it; deletes
/// the oldest beyond `keep_checkpoints`.
fn save_checkpoint<B: AutodiffBackend, O: Optimizer<Eagle3Draft<B>, B>>(
    model: &Eagle3Draft<B>,
    optim: &O,
    state: &TrainState,
    config: &Eagle3Config,
    options: &TrainOptions,
) -> Result<(), TrainError> {
    let root = options.out.join(CHECKPOINT_DIR);
    let name = checkpoint_name(state.step);
    let dir = root.join(&name);
    let tmp = root.join(format!(".{name}.tmp"));
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp).map_err(TrainError::io("clear", &tmp))?;
    }
    std::fs::create_dir_all(&tmp).map_err(TrainError::io("create", &tmp))?;
    let recorder = NamedMpkFileRecorder::<FullPrecisionSettings>::new();
    model
        .clone()
        .save_file(tmp.join("model"), &recorder)
        .map_err(record_err(&tmp.join("model.mpk")))?;
    Recorder::<B>::record(&recorder, optim.to_record(), tmp.join("optim"))
        .map_err(record_err(&tmp.join("optim.mpk")))?;
    write_json(&tmp.join("state.json"), state)?;
    save_pretrained(&model.valid(), config, &tmp.join("head"), WeightDtype::F32)?;
    if dir.exists() {
        std::fs::remove_dir_all(&dir).map_err(TrainError::io("replace", &dir))?;
    }
    std::fs::rename(&tmp, &dir).map_err(TrainError::io("rename into place", &dir))?;
    prune_checkpoints(options, &root, &name)?;
    let lines = read_lines(&options.out.join(METRICS_FILE))?;
    plot::write(
        &options.out.join(CURVES_FILE),
        &format!("tandem train: {}", options.out.display()),
        &lines,
    )
}

/// Points `checkpoints/latest` at checkpoint `name` and deletes the oldest beyond
/// `keep_checkpoints`.
pub(crate) fn prune_checkpoints(
    options: &TrainOptions,
    root: &Path,
    name: &str,
) -> Result<(), TrainError> {
    let latest = root.join("latest");
    let latest_tmp = root.join(".latest.tmp");
    std::fs::write(&latest_tmp, format!("{name}\n"))
        .map_err(TrainError::io("write", &latest_tmp))?;
    std::fs::rename(&latest_tmp, &latest).map_err(TrainError::io("rename into place", &latest))?;
    // Keep the newest `keep_checkpoints`.
    let mut names: Vec<String> = std::fs::read_dir(root)
        .map_err(TrainError::io("list", root))?
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("step-"))
        .collect();
    names.sort();
    let keep = options.keep_checkpoints.max(1);
    if names.len() > keep {
        for old in &names[..names.len() - keep] {
            let path = root.join(old);
            std::fs::remove_dir_all(&path).map_err(TrainError::io("delete", &path))?;
        }
    }
    Ok(())
}

/// The checkpoint `checkpoints/latest` names, and its state.
pub(crate) fn latest_checkpoint(out: &Path) -> Result<(PathBuf, TrainState), TrainError> {
    let root = out.join(CHECKPOINT_DIR);
    let latest = root.join("latest");
    let name = std::fs::read_to_string(&latest).map_err(|e| TrainError::Resume {
        path: out.to_owned(),
        reason: format!("no checkpoint to resume from ({}: {e})", latest.display()),
    })?;
    let dir = root.join(name.trim());
    let path = dir.join("state.json");
    let text = std::fs::read_to_string(&path).map_err(TrainError::io("read", &path))?;
    let state: TrainState = serde_json::from_str(&text).map_err(|source| TrainError::Json {
        path: path.clone(),
        source,
    })?;
    Ok((dir, state))
}

pub(crate) fn describe_differences(before: &serde_json::Value, now: &serde_json::Value) -> String {
    let (Some(a), Some(b)) = (before.as_object(), now.as_object()) else {
        return "unreadable options".to_owned();
    };
    let mut keys: Vec<&String> = a.keys().chain(b.keys()).collect();
    keys.sort();
    keys.dedup();
    let diffs: Vec<String> = keys
        .into_iter()
        .filter(|k| a.get(*k) != b.get(*k))
        .map(|k| {
            format!(
                "{k}: was {}, now {}",
                a.get(k).map_or("unset".to_owned(), ToString::to_string),
                b.get(k).map_or("unset".to_owned(), ToString::to_string)
            )
        })
        .collect();
    diffs.join("; ")
}
