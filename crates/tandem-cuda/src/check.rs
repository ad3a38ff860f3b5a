//! The fast path against the burn reference (CPU, f32) on the same weights and inputs: every
//! mode (ragged prefill, decode, tree verification), every tap point, the logits and the greedy
//! tokens. Used by `tandem fast-check` (sweeps batch sizes and KV lengths on the real model) and
//! by this crate's GPU tests (tiny random models).

use std::path::Path;

use serde::Serialize;
use tandem_model::backend::CpuBackend;
use tandem_model::burn::prelude::*;
use tandem_model::testing::rel_err;
use tandem_model::{LogitsFor, StepInput, TapRequest, TargetModel};

use crate::error::CudaError;
use crate::model::CudaTarget;

/// Tolerances of the comparison, relative to the largest magnitude of the reference tensor
/// (max |fast - ref| / max |ref|). The fast path stores weights, matmul inputs and the KV cache
/// in bf16 (8 bits of mantissa: 2^-9 = 2e-3 relative per rounding) and accumulates in f32;
/// errors compound over the layers, so a few times 1e-2 at the deepest tap is bf16 behaviour,
/// while a wiring or indexing bug gives O(1).
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Tolerance {
    pub logits: f32,
    pub taps: f32,
    /// Reference top-2 logit gap under which a greedy disagreement counts as a bf16 tie.
    pub tie_gap: f32,
}

impl Default for Tolerance {
    fn default() -> Self {
        Self {
            logits: 0.05,
            taps: 0.10,
            tie_gap: 0.25,
        }
    }
}

/// One point of the sweep: `batch` ragged sequences whose longest reaches `kv_len` cache
/// columns in the decode step.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct CheckPoint {
    pub batch: usize,
    pub kv_len: usize,
}

#[derive(Debug, Clone, Serialize)]
pub struct PointReport {
    pub point: CheckPoint,
    /// Sequences compared against their own reference run (all, or first and last).
    pub rows_checked: Vec<usize>,
    pub logits_rel: f32,
    /// Worst tap and its relative error.
    pub worst_tap: String,
    pub taps_rel: f32,
    /// Where the worst tap error sits: step (0 prefill, 1 decode, 2 tree), token slot, channel,
    /// the two values, and that token's own relative error (max diff / max |ref| over its row).
    pub worst_at: Option<WorstElement>,
    pub greedy_agree: usize,
    pub greedy_total: usize,
    /// Disagreements where the reference's top-2 gap exceeds the tie gap.
    pub greedy_real_mismatches: usize,
    pub passed: bool,
}

#[derive(Debug, Clone, Serialize)]
pub struct WorstElement {
    pub step: usize,
    pub token: usize,
    pub channel: usize,
    pub fast: f32,
    pub reference: f32,
    pub token_rel: f32,
}

/// The element of largest |fast - ref| of `[tokens, dim]` rows.
fn worst_element(fast: &[f32], reference: &[f32], dim: usize, step: usize) -> WorstElement {
    let (mut at, mut worst) = (0, -1f32);
    for (i, (a, b)) in fast.iter().zip(reference).enumerate() {
        if (a - b).abs() > worst {
            worst = (a - b).abs();
            at = i;
        }
    }
    let token = at / dim;
    let row = token * dim..(token + 1) * dim;
    WorstElement {
        step,
        token,
        channel: at % dim,
        fast: fast[at],
        reference: reference[at],
        token_rel: rel_err(&fast[row.clone()], &reference[row]),
    }
}

fn top2_gap(row: &[f32]) -> f32 {
    let (mut a, mut b) = (f32::NEG_INFINITY, f32::NEG_INFINITY);
    for &v in row {
        if v > a {
            b = a;
            a = v;
        } else if v > b {
            b = v;
        }
    }
    a - b
}

/// Row `b`'s first `len` slots of a `[batch, width, dim]` host tensor.
fn slots(values: &[f32], b: usize, width: usize, dim: usize, start: usize, len: usize) -> &[f32] {
    let from = (b * width + start) * dim;
    &values[from..from + len * dim]
}

/// The token ids of sequence `b` at `len` tokens: real-looking ids spread over the vocabulary,
/// different per sequence so a row mix-up shows.
pub fn prompt_for(b: usize, len: usize, vocab: usize) -> Vec<u32> {
    (0..len)
        .map(|i| ((i * 7919 + b * 104_729 + 17) % (vocab - 1)) as u32 + 1)
        .collect()
}

/// The three steps every point runs, for sequence lengths `lens`: prefill, one decode token,
/// and a 4-node tree (root, two children of the root, one grandchild).
struct Steps {
    prompts: Vec<Vec<u32>>,
    decode: Vec<u32>,
    tree_tokens: Vec<Vec<u32>>,
    tree_parents: Vec<Option<usize>>,
}

impl Steps {
    fn new(lens: &[usize], vocab: usize) -> Self {
        let prompts: Vec<Vec<u32>> = lens
            .iter()
            .enumerate()
            .map(|(b, &n)| prompt_for(b, n, vocab))
            .collect();
        let decode = (0..lens.len())
            .map(|b| ((b * 31 + 5) % vocab) as u32)
            .collect();
        let tree_tokens = (0..lens.len())
            .map(|b| {
                (0..4)
                    .map(|i| ((b * 13 + i * 101 + 3) % vocab) as u32)
                    .collect()
            })
            .collect();
        Self {
            prompts,
            decode,
            tree_tokens,
            tree_parents: vec![None, Some(0), Some(0), Some(1)],
        }
    }
}

/// Host copies of one step's outputs: logits `[rows, vocab]` and every tap `[batch, width, h]`.
struct HostStep {
    logits: Vec<f32>,
    taps: Vec<Vec<f32>>,
    width: usize,
}

fn run_fast(
    model: &CudaTarget,
    steps: &Steps,
    capacity: usize,
) -> Result<Vec<HostStep>, CudaError> {
    let taps = TapRequest::all(model.spec.num_layers);
    let batch = steps.prompts.len();
    let mut cache = model.new_cache(batch, capacity)?;
    let mut out = Vec::new();
    let prompts: Vec<&[u32]> = steps.prompts.iter().map(|p| p.as_slice()).collect();
    let prefill = cache.layout().prefill_step(&prompts)?;
    let decode = |cache: &crate::CudaKvCache| cache.layout().decode_step(&steps.decode);
    let run = |step: &StepInput,
               cache: &mut crate::CudaKvCache,
               logits: LogitsFor|
     -> Result<HostStep, CudaError> {
        let o = model.forward(step, cache, &taps, logits)?;
        Ok(HostStep {
            logits: o.logits.expect("logits requested").to_host()?,
            taps: o
                .taps
                .tensors
                .iter()
                .map(|t| t.to_host())
                .collect::<Result<_, _>>()?,
            width: step.width,
        })
    };
    out.push(run(&prefill, &mut cache, LogitsFor::Last)?);
    let step = decode(&cache)?;
    out.push(run(&step, &mut cache, LogitsFor::Last)?);
    let trees: Vec<(&[u32], &[Option<usize>])> = steps
        .tree_tokens
        .iter()
        .map(|t| (t.as_slice(), steps.tree_parents.as_slice()))
        .collect();
    let step = cache.layout().tree_step(&trees)?;
    out.push(run(&step, &mut cache, LogitsFor::All)?);
    Ok(out)
}

/// Longest prefill step of the CPU reference.
const REFERENCE_CHUNK: usize = 512;

fn run_reference(
    model: &TargetModel<CpuBackend>,
    steps: &Steps,
    b: usize,
) -> Result<Vec<HostStep>, CudaError> {
    let taps = TapRequest::all(model.spec.num_layers);
    let prompt = &steps.prompts[b];
    let mut cache = model.new_cache(1, prompt.len() + 8);
    let host = |t: Tensor<CpuBackend, 3>| t.into_data().to_vec::<f32>().expect("f32 tensor");
    let mut out = Vec::new();
    // The reference prefills in chunks of REFERENCE_CHUNK tokens (equal to one prefill: the
    // burn crate's capture_paths test) so a 4096-token prompt does not build a 4096 x 4096
    // score matrix per head on the CPU; the fast path does the whole prompt in one step.
    let mut logits = Vec::new();
    let mut taps_by_chunk: Vec<Vec<Vec<f32>>> = Vec::new();
    for chunk in prompt.chunks(REFERENCE_CHUNK) {
        let step = cache.layout().prefill_step(&[chunk])?;
        let o = model.forward(&step, &mut cache, &taps, LogitsFor::Last)?;
        logits = host(o.logits.expect("logits requested"));
        taps_by_chunk.push(o.taps.tensors.into_iter().map(host).collect());
    }
    let prefill_taps = (0..taps.taps.len())
        .map(|t| {
            taps_by_chunk
                .iter()
                .flat_map(|c| c[t].iter().copied())
                .collect()
        })
        .collect();
    out.push(HostStep {
        logits,
        taps: prefill_taps,
        width: prompt.len(),
    });
    let mut run = |step: StepInput,
                   cache: &mut tandem_model::KvCache<CpuBackend>,
                   logits: LogitsFor|
     -> Result<(), CudaError> {
        let o = model.forward(&step, cache, &taps, logits)?;
        out.push(HostStep {
            logits: host(o.logits.expect("logits requested")),
            taps: o.taps.tensors.into_iter().map(host).collect(),
            width: step.width,
        });
        Ok(())
    };
    let step = cache.layout().decode_step(&steps.decode[b..=b])?;
    run(step, &mut cache, LogitsFor::Last)?;
    let step = cache
        .layout()
        .tree_step(&[(&steps.tree_tokens[b], &steps.tree_parents)])?;
    run(step, &mut cache, LogitsFor::All)?;
    Ok(out)
}

/// Runs one point: the fast path on the whole ragged batch, the reference on each checked
/// sequence alone, and compares that sequence's slots.
pub fn check_point(
    fast: &CudaTarget,
    reference: &TargetModel<CpuBackend>,
    point: CheckPoint,
    tolerance: Tolerance,
) -> Result<PointReport, CudaError> {
    let spec = &fast.spec;
    let (h, vocab) = (spec.hidden_size, spec.vocab_size);
    // Ragged: sequence b is shorter by b % 3 tokens (at least one token).
    let longest = point.kv_len.saturating_sub(1).max(1);
    let lens: Vec<usize> = (0..point.batch)
        .map(|b| longest.saturating_sub(b % 3).max(1))
        .collect();
    let steps = Steps::new(&lens, vocab);
    let fast_out = run_fast(fast, &steps, longest + 8)?;
    let rows: Vec<usize> = if point.batch * longest <= 8192 || point.batch <= 2 {
        (0..point.batch).collect()
    } else {
        vec![0, point.batch - 1]
    };
    let names: Vec<String> = TapRequest::all(spec.num_layers)
        .taps
        .iter()
        .map(|t| t.to_string())
        .collect();
    let (mut logits_rel, mut taps_rel, mut worst_tap) = (0f32, 0f32, String::new());
    let mut worst_at = None;
    let (mut agree, mut total, mut real_mismatch) = (0, 0, 0);
    for &b in &rows {
        let ref_out = run_reference(reference, &steps, b)?;
        for (s, (f, r)) in fast_out.iter().zip(&ref_out).enumerate() {
            // Which slots of the fast step belong to sequence b, and how many logits rows.
            let real = if s == 0 { lens[b] } else { r.width };
            let (logit_rows_fast, logit_rows_ref): (&[f32], &[f32]) = if s < 2 {
                (&f.logits[b * vocab..(b + 1) * vocab], &r.logits[..])
            } else {
                (slots(&f.logits, b, f.width, vocab, 0, real), &r.logits[..])
            };
            logits_rel = logits_rel.max(rel_err(logit_rows_fast, logit_rows_ref));
            for (fr, rr) in logit_rows_fast
                .chunks(vocab)
                .zip(logit_rows_ref.chunks(vocab))
            {
                total += 1;
                let (a, c) = (crate::reference::argmax(fr), crate::reference::argmax(rr));
                if a == c {
                    agree += 1;
                } else if top2_gap(rr) > tolerance.tie_gap {
                    real_mismatch += 1;
                }
            }
            for (t, (ft, rt)) in f.taps.iter().zip(&r.taps).enumerate() {
                let (fs, rs) = (
                    slots(ft, b, f.width, h, 0, real),
                    slots(rt, 0, r.width, h, 0, real),
                );
                let e = rel_err(fs, rs);
                if e > taps_rel {
                    taps_rel = e;
                    worst_tap = names[t].clone();
                    worst_at = Some(worst_element(fs, rs, h, s));
                }
            }
        }
    }
    let passed = logits_rel <= tolerance.logits && taps_rel <= tolerance.taps && real_mismatch == 0;
    Ok(PointReport {
        point,
        rows_checked: rows,
        logits_rel,
        worst_tap,
        taps_rel,
        worst_at,
        greedy_agree: agree,
        greedy_total: total,
        greedy_real_mismatches: real_mismatch,
        passed,
    })
}

/// Loads both paths of the model in `dir`.
pub fn load_pair(
    dir: &Path,
    gpu: std::sync::Arc<crate::Gpu>,
) -> Result<(CudaTarget, TargetModel<CpuBackend>), CudaError> {
    let fast = CudaTarget::load(dir, gpu)?;
    let reference = TargetModel::<CpuBackend>::load(dir, &Default::default())?;
    Ok((fast, reference))
}
