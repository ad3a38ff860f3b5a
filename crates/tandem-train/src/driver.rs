//! The run both trainers share (burn in [`crate::trainer`], the GPU in [`crate::gpu`]): the
//! epoch plans, the learning-rate schedule, one metrics line per step, validation and
//! checkpoint timing, `--max-steps` / `--max-seconds` (with the schedule's horizon fitted to
//! the time limit), the progress bar, and at the end the export, the curves and the report.
//! What differs is one optimizer step, a validation pass, a checkpoint and the export:
//! [`StepEngine`].

use std::time::Instant;

use indicatif::{ProgressBar, ProgressStyle};
use tandem_eagle::WeightDtype;
use tandem_wiring::DumpRef;

use crate::data::{RowInfo, plan_epoch};
use crate::error::TrainError;
use crate::metrics::{MetricsLine, MetricsLog, StatsSum, read_lines};
use crate::objective::StepStats;
use crate::plot;
use crate::schedule::{
    FIT_SAFETY_MARGIN, FIT_SKIP_STEPS, FIT_WINDOW_STEPS, FittedHorizon, TimeLimitFit,
    fit_total_to_time_limit, lr_at, warmup_steps,
};
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
    /// The largest `seconds` over the replicas of a data-parallel run (`seconds` itself in one
    /// process): each replica times its steps on its own clock, but all must fit the same
    /// learning-rate horizon to `--max-seconds`.
    fn largest_over_ranks(&mut self, seconds: f64) -> Result<f64, TrainError> {
        Ok(seconds)
    }
}

/// Seconds on a monotonic clock. A run reads the wall clock ([`wall_clock`]); tests script it,
/// so the time limit and the horizon fit are checked without sleeping.
pub(crate) type Clock = Box<dyn Fn() -> f64>;

/// Seconds since the call.
pub(crate) fn wall_clock() -> Clock {
    let origin = Instant::now();
    Box::new(move || origin.elapsed().as_secs_f64())
}

/// The steps timed for the horizon fit to `--max-seconds`: [`FIT_WINDOW_STEPS`] steps from
/// the end of the warm-up, or from [`FIT_SKIP_STEPS`] into this process when that is later
/// (a resumed run compiles and warms up again).
struct FitWindow {
    first_step: usize,
    /// The clock when `first_step` began.
    started_s: Option<f64>,
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
    /// What `--max-seconds`, the horizon fit and the run's steps/s are measured on.
    pub clock: Clock,
}

/// Runs the schedule from `run.state` to its end (or `--max-steps` / `--max-seconds`), then
/// exports, draws the curves and reports.
///
/// With `--max-seconds`, the schedule's horizon is fitted to the limit once the steps of a
/// [`FitWindow`] have been timed ([`fit_total_to_time_limit`]), so the cosine reaches its floor
/// by the time the limit stops the run rather than stopping it mid-decay. The fit is saved in
/// the state ([`FittedHorizon`]) and a resumed run keeps it: the steps it repeats get the
/// learning rates they had.
pub(crate) fn run_schedule(
    mut run: Run<'_>,
    engine: &mut dyn StepEngine,
) -> Result<TrainReport, TrainError> {
    let options = run.options;
    let state = &mut run.state;
    let clock = &run.clock;
    // The warm-up stays sized from the `--epochs` schedule: it has begun before any step is
    // timed, and a resumed run must see the same one.
    let epoch_total = state.total_steps;
    let warmup = warmup_steps(epoch_total, options.warmup_ratio);
    let mut total_steps = state.fitted_horizon.map_or(epoch_total, |h| h.total_steps);
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

    let max_steps = options.max_steps.unwrap_or(usize::MAX);
    let mut stop_at = max_steps.min(total_steps);
    let run_start = clock();
    let run_seconds = || clock() - run_start;
    let steps_before = state.step;
    let mut fit_window = match options.max_seconds {
        Some(_) if state.fitted_horizon.is_none() => Some(FitWindow {
            first_step: warmup.max(steps_before + FIT_SKIP_STEPS),
            started_s: None,
        }),
        _ => None,
    };
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
            if let Some(window) = &mut fit_window
                && window.first_step == state.step
            {
                window.started_s = Some(clock());
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
                tokens_this_run as f64 / run_seconds().max(1e-9)
            ));
            if first_train.is_none() {
                first_train = Some(line.clone());
            }
            last_train = Some(line);

            if let (Some(window), Some(limit_s)) = (&fit_window, options.max_seconds)
                && let Some(started_s) = window.started_s
                && state.step == window.first_step + FIT_WINDOW_STEPS
            {
                let window_s = engine.largest_over_ranks(clock() - started_s)?;
                let elapsed_s = engine.largest_over_ranks(run_seconds())?;
                let steps_per_s = FIT_WINDOW_STEPS as f64 / window_s.max(1e-9);
                let fitted = fit_total_to_time_limit(&TimeLimitFit {
                    epoch_total,
                    warmup,
                    steps_done: state.step,
                    elapsed_s,
                    limit_s,
                    steps_per_s,
                    margin: FIT_SAFETY_MARGIN,
                });
                state.fitted_horizon = Some(FittedHorizon {
                    total_steps: fitted,
                    steps_per_s,
                    fitted_at_step: state.step,
                });
                total_steps = fitted;
                stop_at = max_steps.min(total_steps);
                bar.set_length(total_steps as u64);
                bar.suspend(|| {
                    eprintln!(
                        "lr schedule fitted to --max-seconds: {fitted} steps (measured \
                         {steps_per_s:.2} steps/s over steps {}..{}; the --epochs schedule has \
                         {epoch_total})",
                        window.first_step, state.step
                    )
                });
                fit_window = None;
            }

            let epoch_done = state.batch_in_epoch == plan.len();
            let time_up = options
                .max_seconds
                .is_some_and(|limit| run_seconds() >= limit);
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
    let run_seconds = run_seconds().max(1e-9);
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

#[cfg(test)]
mod tests {
    use std::cell::Cell;
    use std::rc::Rc;

    use super::*;
    use crate::trainer::METRICS_FILE;

    /// A trainer whose every step takes `step_s` on a scripted clock, recording the learning
    /// rate it was given.
    struct ScriptedEngine {
        now: Rc<Cell<f64>>,
        step_s: f64,
        lrs: Vec<(usize, f64)>,
        checkpoints: Vec<TrainState>,
    }

    impl ScriptedEngine {
        fn new(step_s: f64) -> Self {
            ScriptedEngine {
                now: Rc::new(Cell::new(0.0)),
                step_s,
                lrs: Vec::new(),
                checkpoints: Vec::new(),
            }
        }
    }

    impl StepEngine for ScriptedEngine {
        fn step(&mut self, _: &[usize], lr: f64, step: usize) -> Result<StepOutcome, TrainError> {
            self.now.set(self.now.get() + self.step_s);
            self.lrs.push((step, lr));
            Ok(StepOutcome {
                loss: 1.0,
                stats: vec![StepStats {
                    loss: 1.0,
                    correct: 1,
                    denominator: 2,
                }],
                grad_norm: 1.0,
                tokens: 10,
            })
        }
        fn validate(&mut self, _: &[RowInfo]) -> Result<StatsSum, TrainError> {
            unreachable!("no validation rows")
        }
        fn checkpoint(&mut self, state: &TrainState) -> Result<(), TrainError> {
            self.checkpoints.push(state.clone());
            Ok(())
        }
        fn export(&mut self, _: WeightDtype) -> Result<(), TrainError> {
            Ok(())
        }
    }

    const ROWS: usize = 400;

    fn options(out: &std::path::Path, max_seconds: Option<f64>) -> TrainOptions {
        let mut o = TrainOptions::new(Vec::new(), "model", out);
        o.batch_size = 1;
        o.lr = 1e-3;
        o.warmup_ratio = 0.05;
        o.min_lr_ratio = 0.1;
        o.save_every = 100;
        o.max_seconds = max_seconds;
        o
    }

    fn fresh() -> TrainState {
        TrainState {
            step: 0,
            epoch: 0,
            batch_in_epoch: 0,
            total_steps: ROWS,
            fitted_horizon: None,
            tokens_seen: 0,
            rows: ROWS,
            train_rows: ROWS,
            options: serde_json::Value::Null,
        }
    }

    fn run(options: &TrainOptions, state: TrainState, engine: &mut ScriptedEngine) -> TrainReport {
        let rows: Vec<RowInfo> = (0..ROWS).map(|index| RowInfo { index, len: 10 }).collect();
        let resumed_from = (state.step > 0).then_some(state.step);
        let now = Rc::clone(&engine.now);
        let run = Run {
            options,
            train_rows: &rows,
            val_rows: &[],
            state,
            resumed_from,
            log: MetricsLog::open(&options.out.join(METRICS_FILE), resumed_from).unwrap(),
            start: Instant::now(),
            trained_on: Vec::new(),
            clock: Box::new(move || now.get()),
        };
        run_schedule(run, engine).unwrap()
    }

    /// Steps of 0.125 s, 400 steps in the epoch, a 20 s limit. Warm-up is 20 steps, so steps
    /// 20..70 are timed: 6.25 s, 8 steps/s. At step 70 (8.75 s) 11.25 s remain:
    /// 11.25 * 8 * 0.95 = 85.5, so 85 more steps and a horizon of 155, reached at 19.375 s
    /// with the learning rate on its floor. Before the fit the steps followed the epoch
    /// schedule; after it, the fitted one. A resume from the checkpoint at step 100 keeps the
    /// horizon even with a limit that would allow the whole epoch, and repeats the rates.
    #[test]
    fn the_schedule_is_fitted_to_the_time_limit_and_kept_on_resume() {
        let out = tandem_model::testing::scratch_dir("fit-horizon");
        let mut engine = ScriptedEngine::new(0.125);
        let report = run(&options(&out, Some(20.0)), fresh(), &mut engine);
        let expected = FittedHorizon {
            total_steps: 155,
            steps_per_s: 8.0,
            fitted_at_step: 70,
        };
        assert_eq!((report.steps, report.total_steps), (155, 155));
        assert_eq!(engine.lrs.len(), 155);
        for &(step, lr) in &engine.lrs {
            let total = if step < 70 { ROWS } else { 155 };
            assert_eq!(lr, lr_at(step, total, 20, 1e-3, 0.1), "step {step}");
        }
        assert!(
            (engine.lrs[154].1 - 1e-4).abs() < 1e-15,
            "ends on the floor"
        );
        let saved: Vec<(usize, Option<FittedHorizon>)> = engine
            .checkpoints
            .iter()
            .map(|s| (s.step, s.fitted_horizon))
            .collect();
        assert_eq!(saved, [(100, Some(expected)), (155, Some(expected))]);
        let lines = read_lines(&out.join(METRICS_FILE)).unwrap();
        assert_eq!(lines.last().and_then(|l| l.lr), Some(engine.lrs[154].1));

        let mut resumed = ScriptedEngine::new(0.125);
        let state = engine.checkpoints[0].clone();
        let report = run(&options(&out, Some(1000.0)), state, &mut resumed);
        assert_eq!((report.steps, report.total_steps), (155, 155));
        assert_eq!(resumed.lrs, engine.lrs[100..]);
        assert_eq!(
            resumed.checkpoints.last().unwrap().fitted_horizon,
            Some(expected)
        );

        // Without a time limit nothing is fitted: the whole epoch, its own cosine.
        let mut unlimited = ScriptedEngine::new(0.125);
        let report = run(&options(&out, None), fresh(), &mut unlimited);
        assert_eq!((report.steps, report.total_steps), (ROWS, ROWS));
        assert!(
            unlimited
                .checkpoints
                .iter()
                .all(|s| s.fitted_horizon.is_none())
        );
        std::fs::remove_dir_all(&out).unwrap();
    }

    /// A limit that ends the run inside the timed window fits nothing: the run stops on time
    /// with the epoch schedule, as before.
    #[test]
    fn a_limit_inside_the_timed_window_fits_nothing() {
        let out = tandem_model::testing::scratch_dir("fit-none");
        let mut engine = ScriptedEngine::new(0.125);
        let report = run(&options(&out, Some(5.0)), fresh(), &mut engine);
        assert_eq!((report.steps, report.total_steps), (40, ROWS));
        assert!(
            engine
                .checkpoints
                .iter()
                .all(|s| s.fitted_horizon.is_none())
        );
        std::fs::remove_dir_all(&out).unwrap();
    }
}
