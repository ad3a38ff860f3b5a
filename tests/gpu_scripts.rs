//! The helpers that summarise GPU runs (scripts/gpu/*.py) on hand-made reports: their numbers
//! go into BENCHMARKS.md and the closing notes, and a GPU session is too scarce to find a wrong
//! summary there.

use std::path::{Path, PathBuf};
use std::process::Command;

fn scratch(name: &str) -> PathBuf {
    let dir =
        std::env::temp_dir().join(format!("tandem-gpu-scripts-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("scratch dir");
    dir
}

fn run_script(script: &str, args: &[&str]) -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("scripts/gpu")
        .join(script);
    let out = Command::new("python3")
        .arg(&path)
        .args(args)
        .output()
        .expect("python3 runs");
    assert!(
        out.status.success(),
        "{script} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn write_json(dir: &Path, name: &str, value: serde_json::Value) {
    std::fs::write(dir.join(name), value.to_string()).expect("report written");
}

/// serve_pairs.py: the median of per-repeat ratios (not a ratio of medians), a repeat with
/// failed requests left out and named, and adaptive-X against target-only-X.
#[test]
fn serve_pairs_takes_the_median_of_per_repeat_ratios() {
    let dir = scratch("serve-pairs");
    // Repeat by repeat (tok/s): target-only 100, 110, 90, 100; adaptive 98, 100, 99, 120 (its
    // repeat 4 had a failed request). Ratios of repeats 1-3: 0.98, 0.909.., 1.1 -> median 0.98.
    // (The ratio of the medians over those repeats, 99 / 100, would be 0.99.)
    let target = [100.0, 110.0, 90.0, 100.0];
    let adaptive = [98.0, 100.0, 99.0, 120.0];
    for (i, (t, a)) in target.iter().zip(adaptive).enumerate() {
        let rep = i + 1;
        write_json(
            &dir,
            &format!("load_target-only_c32_r{rep}.json"),
            serde_json::json!({"tokens_per_second": t, "failed": 0}),
        );
        write_json(
            &dir,
            &format!("load_adaptive_c32_r{rep}.json"),
            serde_json::json!({"tokens_per_second": a, "failed": u32::from(rep == 4)}),
        );
        // The same switch on both servers: adaptive-mma 2x target-only-mma every repeat.
        write_json(
            &dir,
            &format!("load_target-only-mma_c32_r{rep}.json"),
            serde_json::json!({"tokens_per_second": 50.0 * rep as f64, "failed": 0}),
        );
        write_json(
            &dir,
            &format!("load_adaptive-mma_c32_r{rep}.json"),
            serde_json::json!({"tokens_per_second": 100.0 * rep as f64, "failed": 0}),
        );
    }
    let root = dir.to_str().unwrap();
    let out = run_script(
        "serve_pairs.py",
        &[
            root,
            "target-only_c32",
            "adaptive_c32",
            "target-only-mma_c32",
            "adaptive-mma_c32",
        ],
    );
    let line = |prefix: &str| {
        out.lines()
            .find(|l| l.starts_with(prefix))
            .unwrap_or_else(|| panic!("no line `{prefix}` in:\n{out}"))
            .to_owned()
    };
    let adaptive_line = line("adaptive_c32 / target-only_c32:");
    assert!(adaptive_line.contains("median 0.980"), "{adaptive_line}");
    assert!(
        adaptive_line.contains("min 0.909, max 1.100"),
        "{adaptive_line}"
    );
    assert!(adaptive_line.contains("3 repeats"), "{adaptive_line}");
    assert!(adaptive_line.contains("repeats [4]"), "{adaptive_line}");
    assert!(
        line("adaptive-mma_c32 / target-only-mma_c32:").contains("median 2.000"),
        "{out}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// mma_ab.py: the row kernel's times over each tensor-core arm's, per prompt, step and batch.
#[test]
fn mma_ab_divides_the_row_kernels_times_by_each_arms() {
    let dir = scratch("mma-ab");
    let report = |ttft: f64, step: f64| {
        serde_json::json!([
            {"step": "verify", "width": 32, "batch": 8, "ttft_ms_median": ttft, "step_ms_median": step}
        ])
    };
    write_json(&dir, "prefill-rows-512.json", report(12.0, 3.0));
    write_json(&dir, "prefill-4-512.json", report(4.0, 1.5));
    write_json(&dir, "prefill-16-512.json", report(6.0, 3.0));
    let out = run_script(
        "mma_ab.py",
        &[dir.to_str().unwrap(), "512", "--", "4", "16"],
    );
    let row = out
        .lines()
        .find(|l| l.starts_with("| 512 | verify 32 | 8 |"))
        .unwrap_or_else(|| panic!("no verify row in:\n{out}"));
    assert!(
        row.contains("| 12.00, 3.000 | 4.00 (3.00), 1.500 (2.00) | 6.00 (2.00), 3.000 (1.00) |"),
        "{row}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// round_logs.py: a server's admissions and rounds from its round log, summed by kind, with the
/// mean one-prompt prefill and the rounds by choice, and its drafted rounds by batch class
/// against the plain rounds that would have committed their tokens.
#[test]
fn round_logs_sum_admissions_and_rounds_by_kind() {
    let dir = scratch("round-logs");
    let header = "at_s,kind,rows,target_columns,longest,head_columns,choice,tokens,draft_s,verify_s,\
                  extend_s,catch_up_s,housekeeping_s,wall_s,queued_s,setup_s,captured,predicted_s,\
                  predicted_plain_s";
    let rows = [
        // Two one-prompt admissions (prefills of 2 and 4 ms), one of three prompts.
        "0.1,admit,1,0,0,0,extended,50,0,0.002,0.001,0,0,0.003,0,0,0,NaN,NaN",
        "0.2,admit,1,50,50,50,extended,70,0,0.004,0.001,0,0,0.005,0,0,0,NaN,NaN",
        "0.3,admit,3,70,70,70,deferred,200,0,0.010,0,0,0,0.010,0,0,0,NaN,NaN",
        "0.4,round,5,80,80,80,3/1/4,11,0,0.001,0,0,0,0.002,0,0,1,0.002,0.001",
        "0.5,round,5,84,84,84,none,5,0,0.001,0,0,0,0.001,0,0,0,0.002,0.001",
        "0.6,round,5,85,85,85,3/1/4,9,0,0.001,0,0,0,0.002,0,0,0,0.002,0.001",
        // One row: 2 tokens in 1.4 ms where a plain round is priced at 0.6 ms a token.
        "0.7,round,1,90,90,90,3/4/8,2,0,0.001,0,0,0,0.0014,0,0,0,0.0015,0.0006",
    ];
    std::fs::write(
        dir.join("rounds_adaptive_c8.csv"),
        format!("{}\n{}\n", header.replace(' ', ""), rows.join("\n")),
    )
    .expect("log written");
    let out = run_script(
        "round_logs.py",
        &[dir.to_str().unwrap(), "adaptive_c8", "absent_c8"],
    );
    assert!(
        out.contains(
            "adaptive_c8: admissions 3 (320 prompt tokens, 0.018 s; one-prompt prefill 3.00 ms), \
             rounds 4 (27 tokens, 0.006 s): 3/1/4 2, 3/4/8 1, none 1"
        ),
        "{out}"
    );
    // Drafted rounds against plain rounds committing the same tokens: the one-row round as
    // 2 x 0.6 ms (0.2 ms dearer), the 5-row rounds as 11/5 and 9/5 rounds of 1 ms (4 ms, what
    // they took); 0.2 ms of 6.4 ms of rounds is +3.1%.
    assert!(
        out.contains(
            "1 row: 1 rounds, 2 tokens, 1.40 ms, as plain 1.20 ms (+0.20 ms); 5-8 rows: 2 rounds, \
             20 tokens, 4.00 ms, as plain 4.00 ms (+0.00 ms); all: +0.20 ms, +3.1% of round time"
        ),
        "{out}"
    );
    assert!(out.contains("absent_c8: no round log"), "{out}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// ncu_steps.py: an ncu CSV split into steps at their logits (and the kernels that finish a
/// step after them), the target's steps named by their attention, the head's (logits over fewer
/// tiles) as extends or draft steps, with each kernel's mean and time a step.
#[test]
fn ncu_steps_splits_a_run_into_steps_by_kind() {
    let dir = scratch("ncu-steps");
    let mut lines = vec![
        "==PROF== Connected to process".to_string(),
        r#""ID","Kernel Name","Grid Size","Metric Name","Metric Unit","Metric Value""#.to_string(),
    ];
    let mut id = 0;
    let mut kernel = |name: &str, grid: &str, us: f64| {
        // Times in ns, as ncu writes them; a second metric row that must be ignored.
        lines.push(format!(
            r#""{id}","{name}(int, float)","{grid}","gpu__time_duration.sum","nsecond","{:.0}""#,
            us * 1e3
        ));
        lines.push(format!(
            r#""{id}","{name}(int, float)","{grid}","launch__registers_per_thread","register/thread","64""#
        ));
        id += 1;
    };
    for _ in 0..2 {
        // A one-row target step (two layers), its logits over 3072 tiles and the argmax ...
        for _ in 0..2 {
            kernel("qkv_attention_mma", "(9, 6, 1)", 12.0);
            kernel("gemv_rows_mma", "(1, 36, 1)", 5.0);
            kernel("norm_gate_up_silu_mma", "(1, 192, 1)", 7.0);
            kernel("gemv_rows_mma", "(1, 36, 1)", 6.0);
        }
        kernel("gemv_norm_rows_mma", "(1, 3072, 1)", 20.0);
        kernel("argmax_rows", "(1, 1, 1)", 5.0);
        // ... the head's extend (fc from the taps, logits over 512 tiles, the roots) ...
        kernel("taps_to_bf16", "(1, 1, 1)", 4.0);
        kernel("gemv_rows_mma", "(1, 36, 1)", 3.0);
        kernel("norm_qkv_rope_mma", "(1, 60, 1)", 8.0);
        kernel("gemv_norm_rows_mma", "(1, 512, 1)", 9.0);
        kernel("gather_accepted_roots", "(1, 1, 1)", 9.0);
        kernel("argmax_rows", "(1, 1, 1)", 5.0);
        // ... and a draft step.
        kernel("build_mask", "(1, 1, 1)", 3.0);
        kernel("norm_qkv_rope_mma", "(1, 60, 1)", 8.0);
        kernel("gemv_norm_rows_mma", "(1, 512, 1)", 9.0);
        kernel("argmax_rows", "(1, 1, 1)", 5.0);
    }
    // An 8-row step: attention over 8 rows x 9 heads.
    kernel("norm_qkv_rope_mma", "(1, 60, 1)", 9.0);
    kernel("attention_invariant", "(72, 1, 1)", 7.0);
    kernel("gemv_norm_rows_mma", "(1, 3072, 1)", 22.0);
    let csv = dir.join("ncu.csv");
    std::fs::write(&csv, lines.join("\n") + "\n").expect("csv written");
    let out = run_script("ncu_steps.py", &[csv.to_str().unwrap()]);
    // Target step: 2 x (12 + 5 + 7 + 6) + 20 + 5 = 85 us in 10 kernels.
    assert!(
        out.contains(
            "STEP one-launch attention: 2 steps, median 85.0 us of kernel time in 10 kernels"
        ),
        "{out}"
    );
    assert!(out.contains("gemv_rows_mma (o_proj)"), "{out}");
    // The layer's second product is down_proj: 6 us, twice a step.
    let down = out
        .lines()
        .find(|l| l.trim_start().starts_with("gemv_rows_mma (down_proj)"))
        .unwrap_or_else(|| panic!("no down_proj line:\n{out}"));
    let fields: Vec<&str> = down.split_whitespace().collect();
    assert_eq!(
        fields[2..],
        [
            "2.0", "a", "step", "mean", "6.00", "us", "12.0", "us", "a", "step"
        ],
        "{out}"
    );
    // Extend: 4 + 3 + 8 + 9 + 9 + 5 = 38 us in 6 kernels, its first product the fc.
    assert!(
        out.contains("STEP head extend: 2 steps, median 38.0 us of kernel time in 6 kernels"),
        "{out}"
    );
    assert!(out.contains("gemv_rows_mma (fc)"), "{out}");
    assert!(
        out.contains("STEP head draft: 2 steps, median 25.0 us of kernel time in 4 kernels"),
        "{out}"
    );
    assert!(
        out.contains("STEP 8 rows: 1 steps, median 38.0 us of kernel time in 3 kernels"),
        "{out}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
