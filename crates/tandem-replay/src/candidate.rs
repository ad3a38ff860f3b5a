//! The candidates a dumped slot is compared against: every point of the serving engine's block
//! loop (`embed`, `block 0..L-1`, `final`), captured through the one capture hook by a prefill
//! exactly like the speculative loop's, plus the normed input of every layer (what a capture
//! that reads `input_layernorm(hidden)` instead of `hidden + residual` records).

use std::fmt;

use serde::{Serialize, Serializer};
use tandem_model::{CaptureTarget, TapRequest};
use tandem_wiring::TapId;

use crate::error::ReplayError;

/// A value the serving path computes that a dumped slot may hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Candidate {
    /// A tap point of the block loop (`final` is post-norm by definition).
    Tap(TapId),
    /// The residual stream entering decoder layer `k` after that layer's `input_layernorm`:
    /// a normed value where the residual stream was meant.
    NormedInput(usize),
    /// Block `layer`'s output as tensor-parallel rank `rank` of `tp` holds it before the MLP's
    /// all-reduce: the residual stream after the attention plus only that rank's share of the
    /// MLP (`TargetModel::mlp_partial_sums`). What a capture taken before the all-reduce
    /// records.
    PartialSum {
        layer: usize,
        tp: usize,
        rank: usize,
    },
}

impl Candidate {
    /// Whether the value is the output of an RMSNorm rather than the residual stream.
    pub fn is_normed(&self) -> bool {
        matches!(
            self,
            Candidate::Tap(TapId::Final) | Candidate::NormedInput(_)
        )
    }

    /// Machine form: `embed`, `block:3`, `final`, `normed-input:4`.
    pub fn canonical(&self) -> String {
        match self {
            Candidate::Tap(t) => t.canonical(),
            Candidate::NormedInput(k) => format!("normed-input:{k}"),
            Candidate::PartialSum { layer, tp, rank } => {
                format!("tp-partial-sum:block:{layer}:rank:{rank}/{tp}")
            }
        }
    }

    /// A phrase for sentences, naming the norm for normed values.
    pub fn describe(&self) -> String {
        match self {
            Candidate::Tap(TapId::Final) => "final (the final RMSNorm's output)".to_owned(),
            Candidate::Tap(t) => t.to_string(),
            Candidate::NormedInput(k) => format!(
                "the normed input of layer {k} (its input_layernorm applied to {})",
                TapId::from_residual_position(*k)
            ),
            Candidate::PartialSum { layer, tp, rank } => format!(
                "a tensor-parallel partial sum: block {layer}'s output as rank {rank} of {tp} \
                 holds it before the MLP's all-reduce (the residual plus only rank {rank}'s \
                 share of down_proj)"
            ),
        }
    }

    /// The canonical tap, when this is a tap point of the block loop.
    pub fn tap(&self) -> Option<TapId> {
        match self {
            Candidate::Tap(t) => Some(*t),
            Candidate::NormedInput(_) | Candidate::PartialSum { .. } => None,
        }
    }
}

impl fmt::Display for Candidate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Candidate::Tap(t) => t.fmt(f),
            Candidate::NormedInput(k) => write!(f, "normed input of layer {k}"),
            Candidate::PartialSum { layer, tp, rank } => {
                write!(f, "block {layer} partial sum of TP rank {rank}/{tp}")
            }
        }
    }
}

impl Serialize for Candidate {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.canonical())
    }
}

/// Every tap point of a model with `num_layers` blocks, in forward order: `embed`,
/// `block 0..L-1`, `final`.
pub fn all_taps(num_layers: usize) -> Vec<TapId> {
    tandem_model::TapRequest::all(num_layers).taps
}

/// The candidate list of a model: the tap points, then the normed input of every layer.
pub fn all_candidates(num_layers: usize) -> Vec<Candidate> {
    let mut out: Vec<Candidate> = all_taps(num_layers)
        .into_iter()
        .map(Candidate::Tap)
        .collect();
    out.extend((0..num_layers).map(Candidate::NormedInput));
    out
}

/// Tensor-parallel degrees whose partial sums replay considers: those of 2, 4 and 8 that split
/// `intermediate_size` evenly.
pub fn partial_sum_degrees(intermediate_size: usize) -> Vec<usize> {
    [2, 4, 8]
        .into_iter()
        .filter(|tp| intermediate_size.is_multiple_of(*tp))
        .collect()
}

/// The partial-sum candidates of the blocks `layers` (each degree, each rank), in the order
/// [`capture_partial_sums`] returns their values.
pub fn partial_sum_candidates(layers: &[usize], degrees: &[usize]) -> Vec<Candidate> {
    let mut sorted = layers.to_vec();
    sorted.sort_unstable();
    sorted.dedup();
    let mut out = Vec::new();
    for layer in sorted {
        for &tp in degrees {
            out.extend((0..tp).map(|rank| Candidate::PartialSum { layer, tp, rank }));
        }
    }
    out
}

/// The values of `candidates` (all [`Candidate::PartialSum`], as
/// [`partial_sum_candidates`] lists them) for one sample, from the taps `captured` already holds
/// (block k's input is the tap at residual position k), so no second prefill runs; `None` when
/// the model does not compute partial sums.
pub fn capture_partial_sums(
    model: &dyn CaptureTarget,
    captured: &CandidateValues,
    candidates: &[Candidate],
) -> Result<Option<Vec<Vec<f32>>>, ReplayError> {
    let mut blocks: Vec<(usize, &[f32])> = Vec::new();
    let mut degrees = Vec::new();
    for c in candidates {
        if let Candidate::PartialSum { layer, tp, .. } = *c {
            if !blocks.iter().any(|(k, _)| *k == layer) {
                let input = captured
                    .get(Candidate::Tap(TapId::from_residual_position(layer)))
                    .expect("every tap point is captured");
                blocks.push((layer, input));
            }
            if !degrees.contains(&tp) {
                degrees.push(tp);
            }
        }
    }
    let Some(parts) = model.block_partial_sums(&blocks, &degrees)? else {
        return Ok(None);
    };
    let mut values = Vec::with_capacity(candidates.len());
    for c in candidates {
        let found = parts.iter().find(|(layer, tp, rank, _)| {
            *c == Candidate::PartialSum {
                layer: *layer,
                tp: *tp,
                rank: *rank,
            }
        });
        match found {
            Some((_, _, _, v)) => values.push(v.clone()),
            None => return Ok(None),
        }
    }
    Ok(Some(values))
}

/// Every candidate's values for one sample, on the host in f32.
#[derive(Debug, Clone)]
pub struct CandidateValues {
    /// The candidates, in [`all_candidates`] order.
    pub candidates: Vec<Candidate>,
    /// `values[c]` is `[tokens, hidden]` row-major for `candidates[c]`.
    pub values: Vec<Vec<f32>>,
    /// Tokens of the sample.
    pub tokens: usize,
    /// The target's hidden size T.
    pub hidden: usize,
}

impl CandidateValues {
    /// The `[tokens, hidden]` values of `candidate`.
    pub fn get(&self, candidate: Candidate) -> Option<&[f32]> {
        self.candidates
            .iter()
            .position(|c| *c == candidate)
            .map(|i| self.values[i].as_slice())
    }
}

/// Runs `input_ids` as one prefill through the target's block loop with every tap point
/// requested ([`CaptureTarget::capture_taps`], the capture the dump runs too), and derives the
/// normed inputs with the target's own norm weights.
pub fn capture_candidates(
    model: &dyn CaptureTarget,
    input_ids: &[u32],
) -> Result<CandidateValues, ReplayError> {
    let spec = model.spec();
    let (layers, hidden) = (spec.num_layers, spec.hidden_size);
    let mut values = model.capture_taps(input_ids, &TapRequest::new(all_taps(layers)))?;
    // Request index k is residual position k (embed = 0, block k-1 = k) for k <= L.
    for k in 0..layers {
        let weight = model.input_norm(k)?;
        values.push(rms_norm_rows(&values[k], &weight, spec.rms_norm_eps));
    }
    Ok(CandidateValues {
        candidates: all_candidates(layers),
        values,
        tokens: input_ids.len(),
        hidden,
    })
}

/// `x * rsqrt(mean(x^2) + eps) * w` per row of `x` (`[rows, w.len()]`), in f64 like a careful
/// reference; the f32 result differs from the device's by rounding only.
pub fn rms_norm_rows(x: &[f32], weight: &[f32], eps: f64) -> Vec<f32> {
    let h = weight.len();
    let mut out = Vec::with_capacity(x.len());
    for row in x.chunks_exact(h) {
        let mean_sq = row
            .iter()
            .map(|&v| f64::from(v) * f64::from(v))
            .sum::<f64>()
            / h as f64;
        let scale = 1.0 / (mean_sq + eps).sqrt();
        out.extend(
            row.iter()
                .zip(weight)
                .map(|(&v, &w)| (f64::from(v) * scale * f64::from(w)) as f32),
        );
    }
    out
}
