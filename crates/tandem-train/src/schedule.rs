//! Learning-rate schedule: linear warm-up, then cosine decay (SpecForge's `CosineAnnealingWarmupLR`
//! shape), and the fit of its horizon to a wall-clock limit (`--max-seconds`).

use serde::{Deserialize, Serialize};

/// Learning rate for optimizer step `step` (0-based) of `total` steps.
///
/// Warm-up: `peak * (step + 1) / warmup` for `step < warmup`. Then cosine from `peak` down to
/// `peak * min_ratio` at the last step: `min + (peak - min) * (1 + cos(pi * p)) / 2` with
/// `p = (step - warmup) / (total - warmup - 1)` (p = 0 when only one step remains).
pub fn lr_at(step: usize, total: usize, warmup: usize, peak: f64, min_ratio: f64) -> f64 {
    if step < warmup {
        return peak * (step + 1) as f64 / warmup as f64;
    }
    let min = peak * min_ratio;
    let span = total.saturating_sub(warmup + 1);
    let p = if span == 0 {
        0.0
    } else {
        ((step - warmup) as f64 / span as f64).min(1.0)
    };
    min + (peak - min) * (1.0 + (std::f64::consts::PI * p).cos()) / 2.0
}

/// Warm-up steps for a warm-up ratio of the total (at least 1 when the ratio is positive).
pub fn warmup_steps(total: usize, ratio: f64) -> usize {
    if ratio <= 0.0 {
        0
    } else {
        ((total as f64 * ratio).round() as usize).clamp(1, total.max(1))
    }
}

/// Steps of a run with `--max-seconds` that are never timed for the fit: the first steps of a
/// process compile kernels, autotune cuBLAS and grow allocations, so they are slower than the
/// rest and would make the fitted horizon too short.
pub const FIT_SKIP_STEPS: usize = 3;
/// Steps timed for the fit. Batches are shuffled across length buckets, so single steps vary
/// a lot; the mean over this many is within a few percent of the run's.
pub const FIT_WINDOW_STEPS: usize = 50;
/// Share of the remaining time left unplanned: validation passes and checkpoints outside the
/// timed window, and the spread of the measured rate, must not push the last step past the
/// limit (the run would then stop before the floor).
pub const FIT_SAFETY_MARGIN: f64 = 0.05;

/// What the horizon fit to `--max-seconds` is computed from.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TimeLimitFit {
    /// Steps of the schedule `--epochs` sets (the fit never lengthens it).
    pub epoch_total: usize,
    /// Warm-up steps (sized from `epoch_total` before anything was measured).
    pub warmup: usize,
    /// Optimizer steps done when the fit is made.
    pub steps_done: usize,
    /// Seconds this run has trained so far.
    pub elapsed_s: f64,
    /// `--max-seconds`.
    pub limit_s: f64,
    /// Measured optimizer steps per second.
    pub steps_per_s: f64,
    /// Share of the remaining time not planned for ([`FIT_SAFETY_MARGIN`]).
    pub margin: f64,
}

/// The schedule's total steps for a run that must end by a time limit: the steps done plus
/// those that fit in `(limit - elapsed) * (1 - margin)` at the measured rate, never more than
/// the `--epochs` schedule and never fewer than one step past the warm-up and past the steps
/// done (the cosine needs a step to decay over; a limit that short stops the run first anyway).
pub fn fit_total_to_time_limit(fit: &TimeLimitFit) -> usize {
    let remaining_s = (fit.limit_s - fit.elapsed_s).max(0.0);
    let steps = (remaining_s * fit.steps_per_s * (1.0 - fit.margin)).floor();
    // `as` saturates (and maps NaN to 0), so an unmeasurable rate cannot wrap around.
    let fitting = fit.steps_done.saturating_add(steps as usize);
    let shortest = fit.steps_done.max(fit.warmup) + 1;
    fitting.max(shortest).min(fit.epoch_total)
}

/// A horizon fitted to `--max-seconds`, saved with the run's state so a resumed run keeps it
/// (the fit depends on measured times, so it is made once and never redone).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct FittedHorizon {
    /// The schedule's total steps: the cosine reaches its floor at step `total_steps - 1`,
    /// and the run ends there.
    pub total_steps: usize,
    /// The measured rate the fit used.
    pub steps_per_s: f64,
    /// The step at which the fit was made.
    pub fitted_at_step: usize,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-12
    }

    /// Hand-worked: peak 1e-3, 10 steps, 2 warm-up, floor 0.1: steps 0, 1 warm up to the peak,
    /// step 2 is the peak, step 9 the floor, the middle of 2..9 (5.5) halfway.
    #[test]
    fn warmup_then_cosine() {
        let lr = |s| lr_at(s, 10, 2, 1e-3, 0.1);
        assert!(close(lr(0), 0.5e-3));
        assert!(close(lr(1), 1e-3));
        assert!(close(lr(2), 1e-3));
        assert!(close(lr(9), 1e-4));
        // 12 steps, 2 warm-up: step 5 is 3/9 of the way, (1 + cos(pi/3)) / 2 = 0.75.
        assert!(close(lr_at(5, 12, 2, 1.0, 0.0), 0.75));
        // Monotone after warm-up.
        for s in 2..9 {
            assert!(lr(s + 1) <= lr(s));
        }
        // Past the end stays at the floor.
        assert!(close(lr(20), 1e-4));
    }

    #[test]
    fn no_warmup_and_single_step() {
        assert!(close(lr_at(0, 5, 0, 2.0, 0.0), 2.0));
        assert!(close(lr_at(4, 5, 0, 2.0, 0.0), 0.0));
        assert!(close(lr_at(0, 1, 0, 2.0, 0.0), 2.0));
        assert_eq!(warmup_steps(100, 0.015), 2);
        assert_eq!(warmup_steps(10, 0.0), 0);
        assert_eq!(warmup_steps(10, 0.01), 1);
    }

    fn fit(epoch_total: usize, warmup: usize, steps_done: usize) -> TimeLimitFit {
        TimeLimitFit {
            epoch_total,
            warmup,
            steps_done,
            elapsed_s: 2.0,
            limit_s: 10.0,
            steps_per_s: 50.0,
            margin: 0.05,
        }
    }

    /// Hand-worked: 10 s limit, 2 s elapsed, 50 steps/s, 5% margin: (10 - 2) * 50 * 0.95 = 380
    /// more steps after the 100 done, so 480 in all.
    #[test]
    fn the_horizon_is_the_steps_that_fit_in_the_remaining_time() {
        assert_eq!(fit_total_to_time_limit(&fit(1000, 10, 100)), 480);
        // No margin: 400 more.
        let mut exact = fit(1000, 10, 100);
        exact.margin = 0.0;
        assert_eq!(fit_total_to_time_limit(&exact), 500);
        // A partial step is not planned: 8 s * 50.1 * 0.95 = 380.76.
        let mut partial = fit(1000, 10, 100);
        partial.steps_per_s = 50.1;
        assert_eq!(fit_total_to_time_limit(&partial), 480);
    }

    #[test]
    fn the_horizon_never_outgrows_the_epoch_schedule() {
        assert_eq!(fit_total_to_time_limit(&fit(300, 10, 100)), 300);
        let mut forever = fit(300, 10, 100);
        forever.steps_per_s = f64::INFINITY;
        assert_eq!(fit_total_to_time_limit(&forever), 300);
    }

    /// Too little time left: one step past the warm-up (or past the steps done), so the cosine
    /// has a step to end on; the time limit stops the run before it.
    #[test]
    fn the_horizon_keeps_the_warmup_and_a_step_to_decay_over() {
        assert_eq!(fit_total_to_time_limit(&fit(10_000, 600, 100)), 601);
        let mut late = fit(1000, 10, 100);
        late.elapsed_s = 12.0;
        assert_eq!(fit_total_to_time_limit(&late), 101);
        let mut unmeasured = fit(1000, 10, 100);
        unmeasured.steps_per_s = f64::NAN;
        assert_eq!(fit_total_to_time_limit(&unmeasured), 101);
    }

    /// With the fitted horizon the cosine ends on the floor at the horizon's last step and is
    /// above it one step earlier.
    #[test]
    fn the_fitted_schedule_reaches_the_floor_at_its_last_step() {
        let epoch_total = 2000;
        let warmup = warmup_steps(epoch_total, 0.015);
        let total = fit_total_to_time_limit(&fit(epoch_total, warmup, 100));
        assert_eq!((warmup, total), (30, 480));
        let lr = |s| lr_at(s, total, warmup, 1e-3, 0.1);
        assert!(close(lr(total - 1), 1e-4));
        assert!(lr(total - 2) > 1e-4 + 1e-9);
        // Against the epoch schedule the same step is still near the peak.
        assert!(lr_at(total - 1, epoch_total, warmup, 1e-3, 0.1) > 8e-4);
    }
}
