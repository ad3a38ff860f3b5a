//! Learning-rate schedule: linear warm-up, then cosine decay (SpecForge's `CosineAnnealingWarmupLR`
//! shape).

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
}
