//! Turning logits into a next-token distribution (temperature, top-k, top-p) and drawing from
//! it. Pure host functions: the speculative verifier's rejection sampling must use exactly the
//! same distribution as target-only sampling, so both call these.

use rand::Rng;
use serde::{Deserialize, Serialize};

use crate::error::ModelError;

/// Sampling settings. `temperature == 0` means greedy.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct SamplingParams {
    pub temperature: f32,
    /// Keep the smallest set of tokens whose probability reaches `top_p` (1.0 = off).
    pub top_p: f32,
    /// Keep the `top_k` most likely tokens (0 = off).
    pub top_k: usize,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self::greedy()
    }
}

impl SamplingParams {
    pub fn greedy() -> Self {
        Self {
            temperature: 0.0,
            top_p: 1.0,
            top_k: 0,
        }
    }

    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0
    }

    /// Refuses values outside their domain, naming the field.
    pub fn validate(&self) -> Result<(), ModelError> {
        if !self.temperature.is_finite() || self.temperature < 0.0 {
            return Err(ModelError::InvalidSampling {
                field: "temperature",
                reason: format!("{} is not a finite value >= 0", self.temperature),
            });
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(ModelError::InvalidSampling {
                field: "top_p",
                reason: format!("{} is not in (0, 1]", self.top_p),
            });
        }
        Ok(())
    }
}

/// Index of the largest value; ties go to the lowest index (as torch.argmax).
pub fn argmax(values: &[f32]) -> usize {
    let mut best = 0;
    for (i, &v) in values.iter().enumerate() {
        if v > values[best] {
            best = i;
        }
    }
    best
}

/// The probability distribution sampling draws from: softmax(logits / T) restricted to the
/// top-k tokens and then to the top-p nucleus, renormalised. Greedy gives a one-hot at argmax.
pub fn distribution(logits: &[f32], params: &SamplingParams) -> Vec<f32> {
    let mut probs = vec![0f32; logits.len()];
    if params.is_greedy() {
        probs[argmax(logits)] = 1.0;
        return probs;
    }
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0f64;
    for (p, &l) in probs.iter_mut().zip(logits) {
        let e = (((l - max) / params.temperature) as f64).exp();
        *p = e as f32;
        sum += e;
    }
    for p in probs.iter_mut() {
        *p = (*p as f64 / sum) as f32;
    }
    let restrict = params.top_k > 0 && params.top_k < logits.len() || params.top_p < 1.0;
    if !restrict {
        return probs;
    }
    let mut order: Vec<usize> = (0..probs.len()).collect();
    // Stable sort by descending probability: ties keep the lower token id first.
    order.sort_by(|&a, &b| probs[b].total_cmp(&probs[a]));
    let k_limit = if params.top_k > 0 {
        params.top_k.min(order.len())
    } else {
        order.len()
    };
    let mut kept = Vec::new();
    let mut mass = 0f64;
    let top_k_mass: f64 = order[..k_limit].iter().map(|&i| probs[i] as f64).sum();
    for &i in &order[..k_limit] {
        kept.push(i);
        mass += probs[i] as f64;
        if mass / top_k_mass >= params.top_p as f64 {
            break;
        }
    }
    let kept_mass: f64 = kept.iter().map(|&i| probs[i] as f64).sum();
    let mut out = vec![0f32; probs.len()];
    for &i in &kept {
        out[i] = (probs[i] as f64 / kept_mass) as f32;
    }
    out
}

/// Draws one index from a probability vector (which must sum to ~1).
pub fn sample_from<R: Rng + ?Sized>(probs: &[f32], rng: &mut R) -> usize {
    let u: f64 = rng.random::<f64>();
    let mut acc = 0f64;
    let mut last_nonzero = 0;
    for (i, &p) in probs.iter().enumerate() {
        if p > 0.0 {
            acc += p as f64;
            last_nonzero = i;
            if u < acc {
                return i;
            }
        }
    }
    // Rounding left u above the total: the last token with mass.
    last_nonzero
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    #[test]
    fn greedy_is_one_hot_at_first_maximum() {
        let p = distribution(&[1.0, 3.0, 3.0, 0.0], &SamplingParams::greedy());
        assert_eq!(p, vec![0.0, 1.0, 0.0, 0.0]);
    }

    #[test]
    fn temperature_one_is_softmax() {
        let logits = [0.0f32, (2.0f32).ln()];
        let p = distribution(
            &logits,
            &SamplingParams {
                temperature: 1.0,
                top_p: 1.0,
                top_k: 0,
            },
        );
        assert!((p[0] - 1.0 / 3.0).abs() < 1e-6 && (p[1] - 2.0 / 3.0).abs() < 1e-6);
    }

    /// Hand-worked: probs [0.5, 0.3, 0.15, 0.05]; top_p 0.75 keeps {0.5, 0.3} -> [0.625, 0.375].
    #[test]
    fn top_p_keeps_smallest_nucleus() {
        let logits: Vec<f32> = [0.5f32, 0.3, 0.15, 0.05].iter().map(|p| p.ln()).collect();
        let p = distribution(
            &logits,
            &SamplingParams {
                temperature: 1.0,
                top_p: 0.75,
                top_k: 0,
            },
        );
        assert!(
            (p[0] - 0.625).abs() < 1e-5 && (p[1] - 0.375).abs() < 1e-5,
            "{p:?}"
        );
        assert_eq!(p[2], 0.0);
        assert_eq!(p[3], 0.0);
    }

    #[test]
    fn top_k_keeps_k_tokens() {
        let logits: Vec<f32> = [0.1f32, 0.4, 0.2, 0.3].iter().map(|p| p.ln()).collect();
        let p = distribution(
            &logits,
            &SamplingParams {
                temperature: 1.0,
                top_p: 1.0,
                top_k: 2,
            },
        );
        assert!(
            (p[1] - 4.0 / 7.0).abs() < 1e-5 && (p[3] - 3.0 / 7.0).abs() < 1e-5,
            "{p:?}"
        );
    }

    #[test]
    fn sampling_frequencies_follow_the_distribution() {
        let probs = [0.2f32, 0.5, 0.3];
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        let mut counts = [0usize; 3];
        let n = 30_000;
        for _ in 0..n {
            counts[sample_from(&probs, &mut rng)] += 1;
        }
        for (c, p) in counts.iter().zip(probs) {
            // 5 standard deviations of a binomial proportion.
            let sd = (p * (1.0 - p) / n as f32).sqrt();
            assert!(((*c as f32 / n as f32) - p).abs() < 5.0 * sd, "{counts:?}");
        }
    }

    #[test]
    fn invalid_values_are_named() {
        let err = SamplingParams {
            temperature: -1.0,
            top_p: 1.0,
            top_k: 0,
        }
        .validate()
        .unwrap_err();
        assert!(err.to_string().contains("temperature"));
        let err = SamplingParams {
            temperature: 1.0,
            top_p: 0.0,
            top_k: 0,
        }
        .validate()
        .unwrap_err();
        assert!(err.to_string().contains("top_p"));
    }
}
