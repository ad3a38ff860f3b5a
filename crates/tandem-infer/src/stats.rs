//! Acceptance statistics: accept length (tau = mean over rounds of accepted draft tokens + 1)
//! and per-position acceptance (of the rounds that reached draft position i, the share that
//! accepted it).

use serde::Serialize;

#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct AcceptanceStats {
    pub rounds: u64,
    /// Total accepted draft tokens over all rounds.
    pub accepted_tokens: u64,
    /// `reached[i]`: rounds in which draft position i was tried (position i-1 was accepted).
    pub reached: Vec<u64>,
    /// `accepted[i]`: rounds in which draft position i was accepted.
    pub accepted: Vec<u64>,
    /// Sum over rounds of (committed tokens)^2, committed = accepted drafts + 1: with
    /// `accepted_tokens` it gives the per-round variance of the accept length.
    pub committed_sq: u64,
}

impl AcceptanceStats {
    pub fn new(max_depth: usize) -> Self {
        Self {
            reached: vec![0; max_depth],
            accepted: vec![0; max_depth],
            ..Self::default()
        }
    }

    /// Records one verification round that accepted `accepted_len` draft tokens, where the
    /// tree reached `tree_depth` levels.
    pub fn record(&mut self, accepted_len: usize, tree_depth: usize) {
        if self.reached.len() < tree_depth {
            self.reached.resize(tree_depth, 0);
            self.accepted.resize(tree_depth, 0);
        }
        self.rounds += 1;
        self.accepted_tokens += accepted_len as u64;
        self.committed_sq += (accepted_len as u64 + 1).pow(2);
        for i in 0..tree_depth.min(accepted_len + 1) {
            self.reached[i] += 1;
        }
        for i in 0..accepted_len.min(tree_depth) {
            self.accepted[i] += 1;
        }
    }

    pub fn merge(&mut self, other: &AcceptanceStats) {
        if self.reached.len() < other.reached.len() {
            self.reached.resize(other.reached.len(), 0);
            self.accepted.resize(other.reached.len(), 0);
        }
        self.rounds += other.rounds;
        self.accepted_tokens += other.accepted_tokens;
        self.committed_sq += other.committed_sq;
        for i in 0..other.reached.len() {
            self.reached[i] += other.reached[i];
            self.accepted[i] += other.accepted[i];
        }
    }

    /// tau: mean tokens committed per round (accepted drafts + the bonus token).
    pub fn accept_length(&self) -> f64 {
        if self.rounds == 0 {
            return 0.0;
        }
        (self.accepted_tokens + self.rounds) as f64 / self.rounds as f64
    }

    /// Standard error of [`Self::accept_length`] treating rounds as independent (sample
    /// variance of the tokens committed per round over `rounds`); `None` below two rounds.
    pub fn accept_length_se(&self) -> Option<f64> {
        if self.rounds < 2 {
            return None;
        }
        let n = self.rounds as f64;
        let mean = self.accept_length();
        let variance = ((self.committed_sq as f64 - n * mean * mean) / (n - 1.0)).max(0.0);
        Some((variance / n).sqrt())
    }

    /// Conditional acceptance rate per draft position.
    pub fn per_position(&self) -> Vec<f64> {
        self.reached
            .iter()
            .zip(&self.accepted)
            .map(|(&r, &a)| if r == 0 { 0.0 } else { a as f64 / r as f64 })
            .collect()
    }
}

/// Standard error of a pooled ratio `sum(committed) / sum(rounds)` over independent units
/// (prompts or samples), by the delta method (cluster-robust): `sqrt(sum(e_u^2) / (n - 1) / n)
/// / mean(rounds)` with `e_u = committed_u - ratio * rounds_u`. `None` below two units with
/// rounds.
pub fn ratio_se(units: &[(u64, u64)]) -> Option<f64> {
    let units: Vec<(f64, f64)> = units
        .iter()
        .filter(|(rounds, _)| *rounds > 0)
        .map(|&(r, c)| (r as f64, c as f64))
        .collect();
    let n = units.len() as f64;
    if units.len() < 2 {
        return None;
    }
    let rounds: f64 = units.iter().map(|u| u.0).sum();
    let ratio = units.iter().map(|u| u.1).sum::<f64>() / rounds;
    let residuals: f64 = units.iter().map(|(r, c)| (c - ratio * r).powi(2)).sum();
    Some((residuals / (n - 1.0) / n).sqrt() / (rounds / n))
}

/// Standard error of an accept length: the larger of the per-round estimate and the per-unit
/// one ([`ratio_se`] over prompts or samples). Rounds of one prompt are correlated (easy text
/// stays easy), so the per-unit estimate is usually the larger and the honest one.
pub fn accept_length_se(stats: &AcceptanceStats, units: &[AcceptanceStats]) -> Option<f64> {
    let units: Vec<(u64, u64)> = units
        .iter()
        .map(|u| (u.rounds, u.accepted_tokens + u.rounds))
        .collect();
    larger(stats.accept_length_se(), ratio_se(&units))
}

/// Standard error of the acceptance share at draft position `i`: the larger of the binomial
/// estimate over rounds ([`share_se`]) and the per-unit one ([`ratio_se`] of accepted over
/// reached per prompt or sample). With few prompts, rounds of one prompt share its text, and
/// the binomial error alone would flag a gap that one unusual prompt explains.
pub fn position_se(stats: &AcceptanceStats, units: &[AcceptanceStats], i: usize) -> Option<f64> {
    let at = |v: &[u64]| v.get(i).copied().unwrap_or(0);
    let binomial = share_se(at(&stats.accepted), at(&stats.reached))?;
    let units: Vec<(u64, u64)> = units
        .iter()
        .map(|u| (at(&u.reached), at(&u.accepted)))
        .collect();
    larger(Some(binomial), ratio_se(&units))
}

fn larger(a: Option<f64>, b: Option<f64>) -> Option<f64> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.max(b)),
        (a, b) => a.or(b),
    }
}

/// Standard error of an acceptance share `accepted / reached` (binomial, the share pulled half
/// a count towards 1/2 so that 0 and 1 keep their uncertainty); `None` when never reached.
pub fn share_se(accepted: u64, reached: u64) -> Option<f64> {
    if reached == 0 {
        return None;
    }
    let p = (accepted as f64 + 0.5) / (reached as f64 + 1.0);
    Some((p * (1.0 - p) / reached as f64).sqrt())
}

/// One unit of a paired speed comparison (a prompt, or a batch of prompts): the tokens and
/// seconds of the speculative run and of the target-only run over the same prompts.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PairedRun {
    pub spec_tokens: f64,
    pub spec_seconds: f64,
    pub target_tokens: f64,
    pub target_seconds: f64,
}

/// The pooled speedup `(sum spec_tokens / sum spec_seconds) / (sum target_tokens / sum
/// target_seconds)` over `units`.
pub fn pooled_speedup(units: &[PairedRun]) -> f64 {
    let sum = |f: fn(&PairedRun) -> f64| units.iter().map(f).sum::<f64>();
    (sum(|u| u.spec_tokens) / sum(|u| u.spec_seconds))
        / (sum(|u| u.target_tokens) / sum(|u| u.target_seconds))
}

/// Standard error of [`pooled_speedup`] over independent units, by the delta method: the
/// speedup is a product of four sums' means, `M T / (N S)`, so `log speedup` moves with
/// `z_u = m_u / M + t_u / T - n_u / N - s_u / S` per unit, and `se = speedup * sd(z) /
/// sqrt(n)`. Units share their prompt's difficulty between the two runs (a long reply is
/// long in both), which this pairing keeps. `None` below two units.
pub fn speedup_se(units: &[PairedRun]) -> Option<f64> {
    if units.len() < 2 {
        return None;
    }
    let n = units.len() as f64;
    let mean = |f: fn(&PairedRun) -> f64| units.iter().map(f).sum::<f64>() / n;
    let (m, s, t, k) = (
        mean(|u| u.spec_tokens),
        mean(|u| u.spec_seconds),
        mean(|u| u.target_seconds),
        mean(|u| u.target_tokens),
    );
    let z: Vec<f64> = units
        .iter()
        .map(|u| {
            u.spec_tokens / m + u.target_seconds / t - u.target_tokens / k - u.spec_seconds / s
        })
        .collect();
    let z_mean = z.iter().sum::<f64>() / n;
    let variance = z.iter().map(|v| (v - z_mean).powi(2)).sum::<f64>() / (n - 1.0);
    Some(pooled_speedup(units) * (variance / n).sqrt())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Hand-worked: three rounds with depth 3 accepting 3, 1 and 0 drafts.
    /// tau = (4 + 2 + 1) / 3; position 0 reached 3x accepted 2x; position 1 reached 2x accepted
    /// 1x; position 2 reached 1x accepted 1x.
    #[test]
    fn accept_length_and_positions_match_hand_worked_case() {
        let mut s = AcceptanceStats::new(3);
        s.record(3, 3);
        s.record(1, 3);
        s.record(0, 3);
        assert!((s.accept_length() - 7.0 / 3.0).abs() < 1e-12);
        assert_eq!(s.reached, vec![3, 2, 1]);
        assert_eq!(s.accepted, vec![2, 1, 1]);
        let p = s.per_position();
        assert!((p[0] - 2.0 / 3.0).abs() < 1e-12 && (p[1] - 0.5).abs() < 1e-12 && p[2] == 1.0);
        // Committed 4, 2, 1: mean 7/3, sample variance (16 + 4 + 1 - 3 (7/3)^2) / 2 = 7/3,
        // standard error sqrt(7/9).
        assert_eq!(s.committed_sq, 21);
        let se = s.accept_length_se().unwrap();
        assert!((se - (7.0f64 / 9.0).sqrt()).abs() < 1e-12, "{se}");
        let mut merged = AcceptanceStats::new(3);
        merged.record(3, 3);
        let mut rest = AcceptanceStats::new(3);
        rest.record(1, 3);
        rest.record(0, 3);
        merged.merge(&rest);
        assert_eq!(merged, s);
        assert_eq!(AcceptanceStats::new(3).accept_length_se(), None);
    }

    /// Hand-worked: units (rounds, committed) (2, 6), (2, 2), (4, 8): ratio 16 / 8 = 2,
    /// residuals 2, -2, 0, se = sqrt(8 / 2 / 3) / (8 / 3) = 0.4330.
    #[test]
    fn standard_errors_match_hand_worked_cases() {
        let se = ratio_se(&[(2, 6), (2, 2), (4, 8)]).unwrap();
        assert!(
            (se - (4.0f64 / 3.0).sqrt() / (8.0 / 3.0)).abs() < 1e-12,
            "{se}"
        );
        assert_eq!(ratio_se(&[(5, 9)]), None, "one prompt has no spread");
        assert_eq!(
            ratio_se(&[(5, 9), (0, 0)]),
            None,
            "units without rounds do not count"
        );
        // 0 of 10 keeps an uncertainty: p = 0.5 / 11.
        let p: f64 = 0.5 / 11.0;
        assert!((share_se(0, 10).unwrap() - (p * (1.0 - p) / 10.0).sqrt()).abs() < 1e-12);
        assert_eq!(share_se(0, 0), None);
        // The larger of the per-round and per-prompt estimates: prompt a accepts 3 drafts in
        // both its rounds, prompt b none.
        let unit = |accepted: &[usize]| {
            let mut u = AcceptanceStats::new(3);
            for &a in accepted {
                u.record(a, 3);
            }
            u
        };
        let (a, b) = (unit(&[3, 3]), unit(&[0, 0]));
        let mut stats = a.clone();
        stats.merge(&b);
        let rounds = stats.accept_length_se().unwrap();
        let prompts = ratio_se(&[(2, 8), (2, 2)]).unwrap();
        assert!(prompts > rounds);
        assert_eq!(
            accept_length_se(&stats, &[a.clone(), b.clone()]),
            Some(prompts)
        );
        assert_eq!(
            accept_length_se(&stats, std::slice::from_ref(&stats)),
            Some(rounds)
        );
        // Position 0: 2 of 4 rounds accepted, all by one prompt. Binomial over rounds:
        // p = 2.5 / 5, sqrt(0.25 / 4) = 0.25; over the two prompts (reached 2, accepted 2 and
        // 0): ratio 0.5, residuals 1 and -1, sqrt(2 / 1 / 2) / 2 = 0.5, the larger.
        let se = position_se(&stats, &[a, b], 0).unwrap();
        assert!((se - 0.5).abs() < 1e-12, "{se}");
        assert!((position_se(&stats, &[], 0).unwrap() - 0.25).abs() < 1e-12);
        assert_eq!(position_se(&AcceptanceStats::new(3), &[], 0), None);
    }

    /// By hand: two prompts, each 100 tokens both ways; speculative 1 s and 2 s, target-only
    /// 2 s and 3 s: (200 / 3) / (200 / 5) = 5/3.
    #[test]
    fn pooled_speedup_by_hand() {
        let units = [
            PairedRun {
                spec_tokens: 100.0,
                spec_seconds: 1.0,
                target_tokens: 100.0,
                target_seconds: 2.0,
            },
            PairedRun {
                spec_tokens: 100.0,
                spec_seconds: 2.0,
                target_tokens: 100.0,
                target_seconds: 3.0,
            },
        ];
        assert!((pooled_speedup(&units) - 5.0 / 3.0).abs() < 1e-12);
        // Every unit the same speedup with the same weights: no spread.
        let same = [units[0]; 4];
        assert!(speedup_se(&same).unwrap() < 1e-12);
        assert_eq!(speedup_se(&units[..1]), None);
    }

    /// The delta-method error against an independent estimate: the jackknife (leave one unit
    /// out, recompute the pooled speedup) over 40 seeded random units whose speedups spread
    /// around 1.5; the two agree within 15% (both are first-order approximations).
    #[test]
    fn speedup_se_agrees_with_the_jackknife() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        let units: Vec<PairedRun> = (0..40)
            .map(|_| {
                let target_tokens = rng.random_range(40.0..128.0);
                let spec_tokens = target_tokens * rng.random_range(0.9..1.1);
                let target_seconds = target_tokens / 1300.0 * rng.random_range(0.95..1.05);
                let speedup = rng.random_range(1.1..1.9);
                PairedRun {
                    spec_tokens,
                    spec_seconds: spec_tokens / (1300.0 * speedup),
                    target_tokens,
                    target_seconds,
                }
            })
            .collect();
        let n = units.len() as f64;
        let leave_one_out: Vec<f64> = (0..units.len())
            .map(|i| {
                let rest: Vec<PairedRun> = units
                    .iter()
                    .enumerate()
                    .filter(|&(j, _)| j != i)
                    .map(|(_, u)| *u)
                    .collect();
                pooled_speedup(&rest)
            })
            .collect();
        let mean = leave_one_out.iter().sum::<f64>() / n;
        let jackknife = ((n - 1.0) / n
            * leave_one_out
                .iter()
                .map(|v| (v - mean).powi(2))
                .sum::<f64>())
        .sqrt();
        let delta = speedup_se(&units).unwrap();
        assert!(
            (delta / jackknife - 1.0).abs() < 0.15,
            "delta {delta} vs jackknife {jackknife}"
        );
        assert!(delta > 0.01, "{delta}");
    }
}
