//! Similarity of a dumped slot to a recomputed value, accumulated over all tokens of all
//! replayed samples, and the per-token statistics that name faults no candidate explains
//! (zeros, repeated rows, flat norms).

use serde::Serialize;

/// When a dumped slot counts as holding a candidate.
///
/// A dump stores bf16 (8 significant bits: a relative rounding error up to 2^-9 per value) and
/// may come from another device's kernels; the replay recomputes in the serving precision.
/// Defaults: cosine similarity >= 0.999 and relative error <= 2e-2, both over all tokens.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Tolerance {
    /// Smallest cosine similarity (all tokens' values as one vector) that counts as a match.
    pub min_cosine: f64,
    /// Largest relative error `max |dump - recomputed| / max |recomputed|` that counts.
    pub max_rel_err: f64,
}

impl Default for Tolerance {
    fn default() -> Self {
        Tolerance {
            min_cosine: 0.999,
            max_rel_err: 2e-2,
        }
    }
}

impl Tolerance {
    /// Whether a cosine / relative error pair is within tolerance.
    pub fn accepts(&self, cosine: f64, rel_err: f64) -> bool {
        cosine >= self.min_cosine && rel_err <= self.max_rel_err
    }
}

/// Running sums for one (slot, candidate) pair.
#[derive(Debug, Clone, Copy)]
pub struct Accumulator {
    dot: f64,
    sq_obs: f64,
    sq_ref: f64,
    max_abs_diff: f64,
    max_abs_ref: f64,
    min_token_cosine: f64,
    tokens: usize,
}

impl Default for Accumulator {
    fn default() -> Self {
        Accumulator {
            dot: 0.0,
            sq_obs: 0.0,
            sq_ref: 0.0,
            max_abs_diff: 0.0,
            max_abs_ref: 0.0,
            min_token_cosine: f64::INFINITY,
            tokens: 0,
        }
    }
}

fn cosine(dot: f64, a: f64, b: f64) -> f64 {
    if a == 0.0 || b == 0.0 {
        // A zero vector points nowhere: it resembles nothing (and zeros are reported apart).
        0.0
    } else {
        dot / (a.sqrt() * b.sqrt())
    }
}

impl Accumulator {
    /// Adds one token: the dumped row `obs` against the recomputed row `reference`.
    pub fn add_row(&mut self, obs: &[f32], reference: &[f32]) {
        let (mut dot, mut so, mut sr) = (0f64, 0f64, 0f64);
        for (&o, &r) in obs.iter().zip(reference) {
            let (o, r) = (f64::from(o), f64::from(r));
            dot += o * r;
            so += o * o;
            sr += r * r;
            self.max_abs_diff = self.max_abs_diff.max((o - r).abs());
            self.max_abs_ref = self.max_abs_ref.max(r.abs());
        }
        self.dot += dot;
        self.sq_obs += so;
        self.sq_ref += sr;
        self.min_token_cosine = self.min_token_cosine.min(cosine(dot, so, sr));
        self.tokens += 1;
    }

    /// Cosine similarity of all tokens' values taken as one vector.
    pub fn cosine(&self) -> f64 {
        cosine(self.dot, self.sq_obs, self.sq_ref)
    }

    /// `max |obs - ref| / max |ref|` over all tokens (the project's parity measure).
    pub fn rel_err(&self) -> f64 {
        if self.max_abs_ref == 0.0 {
            if self.max_abs_diff == 0.0 {
                0.0
            } else {
                f64::INFINITY
            }
        } else {
            self.max_abs_diff / self.max_abs_ref
        }
    }

    /// The worst single token's cosine (1 when no token was added).
    pub fn min_token_cosine(&self) -> f64 {
        if self.tokens == 0 {
            1.0
        } else {
            self.min_token_cosine
        }
    }

    /// Tokens added.
    pub fn tokens(&self) -> usize {
        self.tokens
    }
}

/// Statistics of one dumped slot by itself.
#[derive(Debug, Clone, Default)]
pub struct SlotStats {
    norms: Vec<f64>,
    zero_rows: usize,
    repeated_rows: usize,
    rows_after_first: usize,
    /// First zero row and last zero row (token index over all replayed samples).
    zero_span: Option<(usize, usize)>,
}

impl SlotStats {
    /// Adds one sample's rows of this slot (`rows[t]` = the slot's values at token t).
    pub fn add_sample<'a>(&mut self, rows: impl Iterator<Item = &'a [f32]>) {
        let mut previous: Option<&[f32]> = None;
        for row in rows {
            let index = self.norms.len();
            let sq: f64 = row.iter().map(|&v| f64::from(v) * f64::from(v)).sum();
            self.norms.push(sq.sqrt());
            if sq == 0.0 {
                self.zero_rows += 1;
                let span = self.zero_span.get_or_insert((index, index));
                span.1 = index;
            }
            if let Some(p) = previous {
                self.rows_after_first += 1;
                if p == row {
                    self.repeated_rows += 1;
                }
            }
            previous = Some(row);
        }
    }

    /// Rows seen.
    pub fn tokens(&self) -> usize {
        self.norms.len()
    }

    /// Rows that are exactly zero.
    pub fn zero_rows(&self) -> usize {
        self.zero_rows
    }

    /// Rows equal to the previous token's row (within one sample).
    pub fn repeated_rows(&self) -> usize {
        self.repeated_rows
    }

    /// Rows that have a previous token in their sample.
    pub fn rows_after_first(&self) -> usize {
        self.rows_after_first
    }

    /// First and last zero row, over all replayed tokens in order.
    pub fn zero_span(&self) -> Option<(usize, usize)> {
        self.zero_span
    }

    /// Mean per-token L2 norm.
    pub fn mean_norm(&self) -> f64 {
        if self.norms.is_empty() {
            0.0
        } else {
            self.norms.iter().sum::<f64>() / self.norms.len() as f64
        }
    }

    /// Coefficient of variation of the per-token norms (std / mean). An RMSNorm output has
    /// almost the same norm at every token (`sqrt(T) * |w|` for flat weights); the residual
    /// stream's norms vary widely (the first token's especially).
    pub fn norm_cv(&self) -> f64 {
        let mean = self.mean_norm();
        if mean == 0.0 {
            return 0.0;
        }
        let var = self
            .norms
            .iter()
            .map(|n| (n - mean) * (n - mean))
            .sum::<f64>()
            / self.norms.len() as f64;
        var.sqrt() / mean
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identical_rows_match_exactly() {
        let mut a = Accumulator::default();
        a.add_row(&[1.0, -2.0, 3.0], &[1.0, -2.0, 3.0]);
        assert!((a.cosine() - 1.0).abs() < 1e-12);
        assert_eq!(a.rel_err(), 0.0);
        assert!(Tolerance::default().accepts(a.cosine(), a.rel_err()));
    }

    #[test]
    fn zeros_resemble_nothing() {
        let mut a = Accumulator::default();
        a.add_row(&[0.0, 0.0], &[1.0, 2.0]);
        assert_eq!(a.cosine(), 0.0);
        assert_eq!(a.rel_err(), 1.0);
    }

    #[test]
    fn slot_stats_count_zeros_and_repeats() {
        let mut s = SlotStats::default();
        let rows: Vec<Vec<f32>> = vec![vec![1.0, 0.0], vec![1.0, 0.0], vec![0.0, 0.0]];
        s.add_sample(rows.iter().map(Vec::as_slice));
        assert_eq!((s.tokens(), s.zero_rows(), s.repeated_rows()), (3, 1, 1));
        assert_eq!(s.zero_span(), Some((2, 2)));
    }
}
