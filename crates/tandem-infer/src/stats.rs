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
}
