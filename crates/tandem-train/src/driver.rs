//! The run both trainers share (burn in [`crate::trainer`], the GPU in [`crate::gpu`]): the
//! epoch plans, the learning-rate schedule, one metrics line per step, validation and
//! checkpoint timing, `--max-steps` / `--max-seconds`, the progress bar, and at the end the
//! export, the curves and the report. What differs is one optimizer step, a validation pass,
//! a checkpoint and the export: [`StepEngine`].

use std::time::Instant;

use indicatif::{ProgressBar, ProgressStyle};
use tandem_eagle::WeightDtype;
use tandem_wiring::DumpRef;

use crate::data::{RowInfo, plan_epoch};
use crate::error::TrainError;
use crate::metrics::{MetricsLine, MetricsLog, StatsSum, read_lines};
use crate::objective::StepStats;
use crate::plot;
use crate::schedule::{lr_at, warmup_steps};
use crate::trainer::{BUCKET_BATCHES, CURVES_FILE, TrainOptions, TrainReport, TrainState};

/// What one optimizer step reports.
#[derive(Debug, Clone)]
pub(crate) struct StepOutcome {
    /// The weighted total loss.
    pub loss: f64,
    /// Per TTT step.
    pub stats: Vec<StepStats>,
    /// Global gradient norm before clipping.
    pub grad_norm: f64,
    /// Real tokens in the batch.
    pub tokens: usize,
}

/// One trainer's side of the run.
pub(crate) trait StepEngine {
    /// One optimizer step on the global rows `rows` at learning rate `lr`; `step` is the
    /// number of steps done before it.
    fn step(&mut self, rows: &[usize], lr: f64, step: usize) -> Result<StepOutcome, TrainError>;
    /// A pass over the validation rows.
    fn validate(&mut self, rows: &[RowInfo]) -> Result<StatsSum, TrainError>;
    /// A checkpoint of the current weights and optimizer state at `state`.
    fn checkpoint(&mut self, state: &TrainState) -> Result<(), TrainError>;
    /// The trained head as an engine-loadable directory in `--out`.
    fn export(&mut self, dtype: WeightDtype) -> Result<(), TrainError>;
    /// Whether `flag` holds on any replica of a data-parallel run (the replicas must agree
    /// on when a wall-clock limit stops them); `flag` itself in one process.
    fn any_rank(&mut self, flag: bool) -> Result<bool, TrainError> {
        Ok(flag)
    }
}

/// The split and the run's bookkeeping, as the trainer set them up.
pub(crate) struct Run<'a> {
    pub options: &'a TrainOptions,
    pub train_rows: &'a [RowInfo],
    pub val_rows: &'a [RowInfo],
    /// The state to continue from (fresh or resumed); advanced in place.
    pub state: TrainState,
    pub resumed_from: Option<usize>,
    pub log: MetricsLog,
    /// When the job started (metrics' `elapsed_s`).
    pub start: Instant,
    pub trained_on: Vec<DumpRef>,
}

/// Runs the schedule from `run.state` to its end (or `--max-steps` / `--max-seconds`), then
/// exports, draws the curves and reports.
pub(crate) fn run_schedule(
    mut run: Run<'_>,
    engine: &mut dyn StepEngine,
) -> Result<TrainReport, TrainError> {
    let options = run.options;
    let state = &mut run.state;
    let total_steps = state.total_steps;
    let warmup = warmup_steps(total_steps, options.warmup_ratio);
    let bar = if options.progress {
        let bar = ProgressBar::new(total_steps as u64);
        bar.set_style(
            ProgressStyle::with_template(
                "{spinner} [{elapsed_precise}] {bar:30} {pos}/{len} steps {msg}",
            )
            .expect("valid template"),
        );
        bar
    } else {
        ProgressBar::hidden()
    };
    bar.set_position(state.step as u64);

    let stop_at = options.max_steps.unwrap_or(usize::MAX).min(total_steps);
    let run_start = Instant::now();
    let steps_before = state.step;
    let mut tokens_this_run = 0usize;
    let mut first_train = None;
    let mut last_train = None;
    let mut last_saved = None;
    let elapsed = |s: &Instant| s.elapsed().as_secs_f64();
    'epochs: while state.epoch < options.epochs && state.step < stop_at {
        let plan = plan_epoch(
            run.train_rows,
            options.batch_size,
            BUCKET_BATCHES,
            options.seed,
            state.epoch,
        );
        while state.batch_in_epoch < plan.len() {
            if state.step >= stop_at {
                break 'epochs;
            }
            let step_start = Instant::now();
            let lr = lr_at(
                state.step,
                total_steps,
                warmup,
                options.lr,
                options.min_lr_ratio,
            );
            let outcome = engine.step(&plan[state.batch_in_epoch], lr, state.step)?;
            if !outcome.loss.is_finite() || !outcome.grad_norm.is_finite() {
                return Err(TrainError::Diverged {
                    step: state.step + 1,
                    loss: outcome.loss,
                });
            }
            state.step += 1;
            state.batch_in_epoch += 1;
            state.tokens_seen += outcome.tokens as u64;
            tokens_this_run += outcome.tokens;
            let mut sum = StatsSum::default();
            sum.add(&outcome.stats, outcome.tokens);
            let line = MetricsLine {
                kind: "train".to_owned(),
                step: state.step,
                epoch: state.epoch,
                lr: Some(lr),
                loss: outcome.loss,
                ploss: sum.ploss(),
                acc: sum.acc(),
                grad_norm: Some(outcome.grad_norm),
                tokens: outcome.tokens,
                tokens_per_s: Some(outcome.tokens as f64 / elapsed(&step_start).max(1e-9)),
                elapsed_s: elapsed(&run.start),
            };
            run.log.append(&line)?;
            bar.set_position(state.step as u64);
            bar.set_message(format!(
                "loss {:.3} acc0 {:.3} {:.0} tok/s",
                line.loss,
                line.acc.first().copied().unwrap_or(0.0),
                tokens_this_run as f64 / elapsed(&run_start).max(1e-9)
            ));
            if first_train.is_none() {
                first_train = Some(line.clone());
            }
            last_train = Some(line);

            let epoch_done = state.batch_in_epoch == plan.len();
            let time_up = options
                .max_seconds
                .is_some_and(|limit| elapsed(&run_start) >= limit);
            let time_up = if options.max_seconds.is_some() {
                engine.any_rank(time_up)?
            } else {
                time_up
            };
            let evaluate = (options.eval_every > 0
                && state.step.is_multiple_of(options.eval_every))
                || epoch_done
                || state.step == stop_at
                || time_up;
            if evaluate && !run.val_rows.is_empty() {
                let sum = engine.validate(run.val_rows)?;
                run.log.append(&MetricsLine {
                    kind: "val".to_owned(),
                    step: state.step,
                    epoch: state.epoch,
                    lr: None,
                    loss: sum.total_loss(),
                    ploss: sum.ploss(),
                    acc: sum.acc(),
                    grad_norm: None,
                    tokens: sum.tokens,
                    tokens_per_s: None,
                    elapsed_s: elapsed(&run.start),
                })?;
            }
            if epoch_done {
                state.epoch += 1;
                state.batch_in_epoch = 0;
            }
            let periodic = options.save_every > 0 && state.step.is_multiple_of(options.save_every);
            if periodic && state.step < stop_at && !time_up {
                engine.checkpoint(state)?;
                last_saved = Some(state.step);
            }
            if time_up {
                break 'epochs;
            }
            if epoch_done {
                continue 'epochs;
            }
        }
        // Only reached when a plan was already exhausted (a resume right at an epoch end).
        state.epoch += 1;
        state.batch_in_epoch = 0;
    }
    bar.finish_and_clear();

    if last_saved != Some(state.step) && state.step > steps_before {
        engine.checkpoint(state)?;
    }
    engine.export(if options.export_bf16 {
        WeightDtype::Bf16
    } else {
        WeightDtype::F32
    })?;
    let lines = read_lines(run.log.path())?;
    // Next to the metrics (a data-parallel replica other than rank 0 logs in its own folder).
    let curves = run.log.path().with_file_name(CURVES_FILE);
    plot::write(
        &curves,
        &format!("tandem train: {}", options.out.display()),
        &lines,
    )?;
    let run_seconds = elapsed(&run_start).max(1e-9);
    let vals: Vec<&MetricsLine> = lines.iter().filter(|l| l.kind == "val").collect();
    Ok(TrainReport {
        steps: state.step,
        total_steps,
        resumed_from: run.resumed_from,
        export_dir: options.out.clone(),
        train_rows: run.train_rows.len(),
        val_rows: run.val_rows.len(),
        first_train,
        last_train,
        first_val: vals.first().map(|l| (*l).clone()),
        last_val: vals.last().map(|l| (*l).clone()),
        steps_per_s: (state.step - steps_before) as f64 / run_seconds,
        tokens_per_s: tokens_this_run as f64 / run_seconds,
        trained_on: run.trained_on,
    })
}
