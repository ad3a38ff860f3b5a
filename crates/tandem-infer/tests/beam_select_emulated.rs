//! The device tree drafting's beam choice (`beam_select` in kernels/llama.cu, what
//! `CudaDraft::draft_beams` runs between its head steps) against the host's [`BeamSearch`],
//! which defines what a draft step records: the kernel runs on the CPU emulator of
//! crates/tandem-cuda/tests/emulated (`tests/emulated/beam_select_run.cpp`, built with g++), fed
//! made-up top-k rows that this test computes the same way (probabilities that are multiples of
//! 1/256, so products tie across beams, and a tie inside every third row), and every step's
//! scores (bit for bit), target ids and parents, and the next step's slot tokens and hidden-input
//! rows, must be what the host's beam search gives. CI has no GPU; the GPU test
//! `device_beams_record_what_the_host_beams_record` then checks the whole device draft.

use std::path::{Path, PathBuf};
use std::process::Command;

use tandem_infer::{BeamSearch, BeamStep};

#[path = "../../tandem-cuda/tests/emulated/gxx.rs"]
mod gxx;

/// The harness's `made_up_topk`: probabilities (multiples of 1/256, descending, a tie between
/// the second and third on every third row) and draft ids of row `row` at step `s`.
fn made_up_topk(s: usize, row: usize, k: usize, vocab: usize) -> (Vec<f32>, Vec<u32>) {
    let mut w: Vec<u32> = (0..k)
        .map(|c| {
            let h = ((s * 7 + row * 13 + c * 5) as u32).wrapping_mul(2_654_435_761);
            1 + (h >> 16) % 50
        })
        .collect();
    w.sort_by(|a, b| b.cmp(a));
    if k >= 3 && (row + s).is_multiple_of(3) {
        w[2] = w[1];
    }
    let probs = w.iter().map(|&v| v as f32 / 256.0).collect();
    let ids = (0..k)
        .map(|c| ((s * 31 + row * 17 + c * 11) % vocab) as u32)
        .collect();
    (probs, ids)
}

fn d2t(id: u32) -> u32 {
    id * 3 + 1000
}

fn run_harness(batch: usize, k: usize, steps: usize, vocab: usize) -> String {
    let here = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let binary = Path::new(env!("CARGO_TARGET_TMPDIR")).join("beam_select_run");
    gxx::build_harness(&here.join("tests/emulated/beam_select_run.cpp"), &binary);
    let ran = Command::new(&binary)
        .args([batch, k, steps, vocab].map(|v| v.to_string()))
        .output()
        .expect("the harness runs");
    assert!(ran.status.success(), "the harness failed");
    String::from_utf8(ran.stdout).expect("text")
}

/// The numbers of one `|`-separated field of a harness line.
fn field<T: std::str::FromStr>(line: &str, index: usize, parse: impl Fn(&str) -> T) -> Vec<T> {
    line.split('|')
        .nth(index)
        .unwrap_or("")
        .split_whitespace()
        .map(parse)
        .collect()
}

fn check(batch: usize, k: usize, steps: usize, vocab: usize) {
    let out = run_harness(batch, k, steps, vocab);
    let line = |kind: &str, s: usize, b: usize| -> String {
        let prefix = format!("{kind} {s} {b} ");
        let found = out
            .lines()
            .find(|l| l.starts_with(&prefix))
            .unwrap_or_else(|| panic!("no `{prefix}` line in:\n{out}"));
        found[prefix.len()..].to_string()
    };
    let mut searches: Vec<BeamSearch> = (0..batch).map(|_| BeamSearch::new(k)).collect();
    // The device's hidden bank: the roots' rows, then each step's kept beam outputs.
    let mut bank_row: Vec<std::collections::HashMap<usize, usize>> =
        vec![Default::default(); batch];
    for s in 0..steps {
        for (b, search) in searches.iter_mut().enumerate() {
            let (probs, tokens): (Vec<Vec<f32>>, Vec<Vec<u32>>) = if s == 0 {
                let (p, ids) = made_up_topk(0, b, k, vocab);
                (vec![p], vec![ids.into_iter().map(d2t).collect()])
            } else {
                (0..k)
                    .map(|j| {
                        let (p, ids) = made_up_topk(s, b * k + j, k, vocab);
                        (p, ids.into_iter().map(d2t).collect())
                    })
                    .unzip()
            };
            if s > 0 {
                for (j, &beam) in search.beams().iter().enumerate() {
                    bank_row[b].insert(beam, batch + (s - 1) * batch * k + b * k + j);
                }
            }
            search.push(&probs, &tokens);
            let want = &search.steps()[s];
            let got = line("rec", s, b);
            let scores = field(&got, 0, |v| u32::from_str_radix(v, 16).expect("hex"));
            let want_scores: Vec<u32> = want.scores.iter().map(|v| v.to_bits()).collect();
            assert_eq!(scores, want_scores, "step {s} sequence {b}: scores");
            assert_eq!(
                field(&got, 1, |v| v.parse::<u32>().expect("id")),
                want.tokens,
                "step {s} sequence {b}: target ids"
            );
            if s > 0 {
                assert_eq!(
                    field(&got, 2, |v| v.parse::<i64>().expect("index")),
                    want.parents,
                    "step {s} sequence {b}: parents"
                );
            }
        }
        if s + 1 < steps {
            let next = BeamStep::new(&searches);
            for (b, search) in searches.iter().enumerate() {
                let got = line("next", s, b);
                assert_eq!(
                    field(&got, 0, |v| v.parse::<u32>().expect("id")),
                    next.inputs[b].0,
                    "step {} sequence {b}: slot tokens",
                    s + 1
                );
                let want_rows: Vec<i64> = next.frontiers[b]
                    .iter()
                    .map(|&node| match search.parent(node) {
                        Some(p) => bank_row[b][&p] as i64,
                        None => b as i64,
                    })
                    .collect();
                assert_eq!(
                    field(&got, 1, |v| v.parse::<i64>().expect("row")),
                    want_rows,
                    "step {} sequence {b}: hidden-input rows",
                    s + 1
                );
            }
        }
    }
}

/// topk 4 over 4 steps at batch 3 (SGLang's usual tree width), topk 8 (64 candidates: two a
/// lane) over 5 steps, and topk 2 at batch 1.
#[test]
fn device_beam_choice_records_what_the_host_beam_search_records_on_the_emulator() {
    check(3, 4, 4, 1000);
    check(2, 8, 5, 5000);
    check(1, 2, 3, 50);
}
