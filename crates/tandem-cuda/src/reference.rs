//! Plain Rust versions of the kernels in `kernels/llama.cu`, written from the HF formulas, for
//! the kernel tests (random inputs, GPU vs these) and as their specification.

/// bf16 round trip of an f32 (round to nearest even), as the kernels store bf16.
pub fn round_bf16(v: f32) -> f32 {
    half::bf16::from_f32(v).to_f32()
}

/// HF LlamaRMSNorm of each row: `w * x / sqrt(mean(x^2) + eps)`.
pub fn rms_norm(x: &[f32], w: &[f32], eps: f32) -> Vec<f32> {
    let hidden = w.len();
    x.chunks(hidden)
        .flat_map(|row| {
            let mean = row.iter().map(|v| v * v).sum::<f32>() / hidden as f32;
            let inv = 1.0 / (mean + eps).sqrt();
            row.iter()
                .zip(w)
                .map(move |(v, w)| v * inv * w)
                .collect::<Vec<_>>()
        })
        .collect()
}

/// HF `apply_rotary_pos_emb` on one head vector (rotate_half layout).
pub fn rope(x: &[f32], inv_freq: &[f32], position: usize) -> Vec<f32> {
    let half = x.len() / 2;
    let mut out = vec![0.0; x.len()];
    for j in 0..half {
        let angle = inv_freq[j] * position as f32;
        let (s, c) = angle.sin_cos();
        out[j] = x[j] * c - x[j + half] * s;
        out[j + half] = x[j + half] * c + x[j] * s;
    }
    out
}

/// Softmax attention of one query over `keys`/`values` rows, visible where `visible[j]`.
pub fn attention(q: &[f32], keys: &[Vec<f32>], values: &[Vec<f32>], visible: &[bool]) -> Vec<f32> {
    let scale = 1.0 / (q.len() as f32).sqrt();
    let scores: Vec<f32> = keys
        .iter()
        .zip(visible)
        .map(|(k, &ok)| {
            if ok {
                q.iter().zip(k).map(|(a, b)| a * b).sum::<f32>() * scale
            } else {
                f32::NEG_INFINITY
            }
        })
        .collect();
    let max = scores.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
    let weights: Vec<f32> = scores.iter().map(|s| (s - max).exp()).collect();
    let sum: f32 = weights.iter().sum();
    let mut out = vec![0.0; q.len()];
    for (w, v) in weights.iter().zip(values) {
        for (o, x) in out.iter_mut().zip(v) {
            *o += w / sum * x;
        }
    }
    out
}

/// SwiGLU: `silu(gate) * up`.
pub fn silu_mul(gate: &[f32], up: &[f32]) -> Vec<f32> {
    gate.iter()
        .zip(up)
        .map(|(g, u)| g / (1.0 + (-g).exp()) * u)
        .collect()
}

/// The `k` largest entries of `row` with their softmax probabilities (f64 sums), descending,
/// ties to the lower index: `(probs, ids)`.
pub fn topk_softmax(row: &[f32], k: usize) -> (Vec<f32>, Vec<usize>) {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = row.iter().map(|&v| f64::from(v - max).exp()).sum();
    let mut order: Vec<usize> = (0..row.len()).collect();
    order.sort_by(|&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
    order.truncate(k);
    let probs = order
        .iter()
        .map(|&i| (f64::from(row[i] - max).exp() / sum) as f32)
        .collect();
    (probs, order)
}

/// First index of the maximum (torch.argmax).
pub fn argmax(row: &[f32]) -> usize {
    let mut best = 0;
    for (i, v) in row.iter().enumerate() {
        if *v > row[best] {
            best = i;
        }
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rms_norm_matches_a_hand_worked_row() {
        // x = [3, 4]: mean(x^2) = 12.5, 1/sqrt(12.5) = 0.28284; w = [1, 2].
        let out = rms_norm(&[3.0, 4.0], &[1.0, 2.0], 0.0);
        assert!((out[0] - 0.848_528).abs() < 1e-5 && (out[1] - 2.262_742).abs() < 1e-5);
    }

    #[test]
    fn rope_at_position_zero_is_identity_and_preserves_norm() {
        let x = [0.3, -1.2, 0.7, 2.0];
        let inv = [1.0, 0.01];
        assert_eq!(rope(&x, &inv, 0), x.to_vec());
        let y = rope(&x, &inv, 17);
        let norm = |v: &[f32]| v.iter().map(|a| a * a).sum::<f32>();
        assert!((norm(&x) - norm(&y)).abs() < 1e-5);
        // Pair (0, 2) rotates by 17 rad: y0 = x0 cos - x2 sin.
        assert!((y[0] - (0.3 * 17f32.cos() - 0.7 * 17f32.sin())).abs() < 1e-6);
    }

    #[test]
    fn attention_ignores_hidden_columns_and_averages_equal_scores() {
        let q = [1.0, 0.0];
        let keys = vec![vec![0.0, 1.0], vec![0.0, 1.0], vec![100.0, 0.0]];
        let values = vec![vec![1.0, 0.0], vec![3.0, 2.0], vec![50.0, 50.0]];
        let out = attention(&q, &keys, &values, &[true, true, false]);
        assert_eq!(out, vec![2.0, 1.0]);
    }

    #[test]
    fn topk_softmax_by_hand() {
        // logits [0, ln 3, ln 2, ln 3]: probabilities [1, 3, 2, 3] / 9; ties keep the lower
        // index first.
        let (p, i) = topk_softmax(&[0.0, 3f32.ln(), 2f32.ln(), 3f32.ln()], 3);
        assert_eq!(i, vec![1, 3, 2]);
        for (got, want) in p.iter().zip([3.0 / 9.0, 3.0 / 9.0, 2.0 / 9.0]) {
            assert!((got - want).abs() < 1e-6, "{p:?}");
        }
    }

    #[test]
    fn argmax_takes_the_first_maximum() {
        assert_eq!(argmax(&[1.0, 3.0, 3.0, -1.0]), 1);
    }

    #[test]
    fn bf16_rounding_is_to_nearest_even() {
        // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties to even (1.0).
        assert_eq!(round_bf16(1.0 + 1.0 / 256.0), 1.0);
        assert_eq!(round_bf16(1.0 + 3.0 / 256.0), 1.0 + 4.0 / 256.0);
    }
}
