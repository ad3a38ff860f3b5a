//! CUDA kernels run on the CPU: `tests/emulated/cuda_emu.h` emulates the few CUDA features they
//! use (a thread per CUDA thread, barriers for `__syncthreads`, warp exchanges for shuffles and
//! `mma.sync`, whose fragments it decodes by the PTX ISA's layout), and a harness compiled with
//! the kernel source checks its outputs against a plain implementation. CI has no GPU; this is
//! how a kernel's indexing, fragment assembly and online softmax are checked before a GPU
//! session (the GPU test `tensor_core_attention_matches_the_row_kernel` then checks the same
//! kernel on the hardware). Needs g++ with C++20.

use std::path::{Path, PathBuf};
use std::process::Command;

fn crate_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Builds `harness` (in tests/emulated) against kernels/ and runs it; panics with its output
/// when it fails.
fn build_and_run(harness: &str) -> String {
    let kernels = crate_dir().join("../../kernels");
    let source = crate_dir().join("tests/emulated").join(harness);
    let binary = Path::new(env!("CARGO_TARGET_TMPDIR")).join(harness.replace(".cpp", ""));
    let built = Command::new("g++")
        .args([
            "-std=c++20",
            "-O2",
            "-pthread",
            "-Wno-unknown-pragmas",
            "-I",
        ])
        .arg(&kernels)
        .arg("-o")
        .arg(&binary)
        .arg(&source)
        .output()
        .expect("g++ runs (the emulated kernel tests need g++ with C++20)");
    assert!(
        built.status.success(),
        "g++ could not build {harness}:\n{}",
        String::from_utf8_lossy(&built.stderr)
    );
    let ran = Command::new(&binary).output().expect("the harness runs");
    let stdout = String::from_utf8_lossy(&ran.stdout).into_owned();
    assert!(
        ran.status.success(),
        "{harness} failed:\n{stdout}{}",
        String::from_utf8_lossy(&ran.stderr)
    );
    stdout
}

/// kernels/attention_mma.cu against a double-precision attention over the same bf16 keys and
/// values: a ragged causal prefill with padding slots (SmolLM2's 9/3 heads, head_dim 64), a
/// tree after a cached prefix with hidden columns (head_dim 128, GQA), long causal rows with a
/// sharp softmax (maxima that move from tile to tile), a narrow verification at batch 3 (the
/// rows of three query heads in one block), and rows that see nothing. Tolerance
/// 2e-2 absolute (the kernel rounds the query and the probabilities to bf16: a few 1e-3 here;
/// a wrong fragment, rescale or mask bit is off by 0.1-1: each of eleven such mutations failed it).
#[test]
fn tensor_core_attention_matches_a_plain_attention_on_the_emulator() {
    let report = build_and_run("attention_mma_check.cpp");
    eprintln!("{report}");
    assert_eq!(
        report.lines().filter(|l| l.ends_with(" ok")).count(),
        5,
        "{report}"
    );
}
