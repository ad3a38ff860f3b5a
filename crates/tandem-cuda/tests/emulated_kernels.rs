//! CUDA kernels run on the CPU: `tests/emulated/cuda_emu.h` emulates the CUDA features the
//! kernels of `kernels/` use (a thread per CUDA thread, barriers for `__syncthreads`, warp
//! exchanges for shuffles, ballots and `mma.sync`, whose fragments it decodes by the PTX ISA's
//! layout; static shared arrays as statics, dynamic ones through `DYNAMIC_SHARED`), and a harness
//! compiled with the kernel sources checks their outputs against plain host implementations.
//! CI has no GPU; this is how a kernel's indexing, fragment assembly and online softmax are
//! checked before a GPU session (the GPU tests, e.g. `tensor_core_attention_matches_the_row_kernel`,
//! then check the same kernels on the hardware). Needs g++ with C++20.

use std::path::{Path, PathBuf};
use std::process::Command;

#[path = "emulated/gxx.rs"]
mod gxx;

fn crate_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Builds `harness` (in tests/emulated) against kernels/ and runs it; panics with its output
/// when it fails.
fn build_and_run(harness: &str) -> String {
    let source = crate_dir().join("tests/emulated").join(harness);
    let binary = Path::new(env!("CARGO_TARGET_TMPDIR")).join(harness.replace(".cpp", ""));
    gxx::build_harness(&source, &binary);
    let ran = Command::new(&binary).output().expect("the harness runs");
    let stdout = String::from_utf8_lossy(&ran.stdout).into_owned();
    assert!(
        ran.status.success(),
        "{harness} failed:\n{stdout}{}",
        String::from_utf8_lossy(&ran.stderr)
    );
    stdout
}

/// The harness's report has `checks` lines, each ending in "ok" (it exits non-zero otherwise,
/// which `build_and_run` already refused).
fn expect_all_ok(report: &str, checks: usize) {
    eprintln!("{report}");
    let ok = report.lines().filter(|l| l.ends_with(" ok")).count();
    assert_eq!(ok, checks, "{report}");
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
    expect_all_ok(&build_and_run("attention_mma_check.cpp"), 5);
}

/// kernels/llama.cu on the emulator: `gather_accepted_roots` (the early extend's root pick,
/// which has not yet run on a GPU) against the host's walk of greedy verification (accepted
/// lengths 0 to 3, and a draft that matches again after a mismatch, which must not count; two
/// layout mutations each fail it), and the row attention kernel `attention` next to the
/// tensor-core one on the same ragged prefill after a prefix with hidden columns: each against a
/// double-precision attention (5e-3 and 2e-2) and each other (2e-2); and `gemv_rows`' batch
/// invariance, which greedy speculative output equal to target-only output rests on: row 0's
/// outputs have the same bits in five row-bucket / outputs-a-warp variants with 1-8 rows (a
/// slicing that depends on the row count fails it), and are its dot products (1e-4); and the
/// fused steps' attention (`visible_columns` + `attention_invariant`) over a clean cache and
/// over one with rejected drafts hidden between the visible keys, at 45 and 300 keys (one group
/// of chunks of the block's eight warps, and two), against a plain attention (5e-3; an
/// off-by-one in the visible list fails it); and `copy_f32_pairs` (a plain round's taps
/// appended to the head's backlog in one launch) bit for bit, nothing outside the range; the
/// split argmax (`argmax_rows_split`) against the host's and `argmax_rows`' ids, and
/// `build_mask` from its arguments and from a graphed step's scalars, bit for bit (session 56).
#[test]
fn llama_kernels_match_their_host_models_on_the_emulator() {
    expect_all_ok(&build_and_run("llama_kernels_check.cpp"), 16);
}

/// kernels/rows_mma.cu (the fused small steps' products on the tensor cores, behind
/// `TANDEM_CUDA_MMA_ROWS=1`) on the emulator: `gemv_rows_mma` against double precision (2e-4;
/// both `y =` and `y +=`) with a row's bits the same at every step width from 1 to 8 rows,
/// rows past the step left unwritten, and its tap output (a capture slot) bit-equal to `y`; `gemv_norm_rows_mma`, `norm_gate_up_silu_mma` and
/// `norm_qkv_rope_mma` (a target layer with a bias; the draft head's embedding and hidden
/// inputs) against their CUDA-core twins in llama.cu on the same inputs (1e-4 and 2e-4 absolute
/// in f32, 1e-2 relative in bf16). The shapes split the k range over several warps with a
/// ragged last slice, cross from the head's first input to its second inside a slice, and
/// leave the last tile part-empty. Each of five mutations (A fragment order, the C row
/// mapping, the gate/up pairing, the second input's offset, the slice length) fails it. Steps
/// of 20 and 32 rows in row groups of 8: each group's rows bit-equal to the group run as its
/// own step, in all four kernels, with q|k|v's positions, query rows and cache columns those of
/// the step's rows (batch 5 x width 4). `qkv_attention_mma` (a decode step's q|k|v and
/// attention in one launch) against `norm_qkv_rope_mma` then `attention_invariant` on three
/// rows with hidden drafts among their keys: q, the caches and the attention output bit for bit,
/// in one pass, two with a half-empty second, and three (head_dim 64, GQA 3:1), and in
/// clusters of 4, 2 and 5 blocks (the passes spread over the ranks, the last rank attending;
/// with 5, a rank without a tile); and verifications (a sequence's 3, 4 or 8 tokens in one
/// cluster, a tree-like hole in the new columns); handing the later passes the first pass's
/// pair inputs, or a rank another's passes, fails it. The norm-staging kernels at SmolLM2's
/// width: each row of an 8-row step (three warps of five staging two rows) bit-equal to the row
/// alone.
#[test]
fn tensor_core_small_steps_match_their_cuda_core_twins_on_the_emulator() {
    expect_all_ok(&build_and_run("rows_mma_check.cpp"), 37);
}
