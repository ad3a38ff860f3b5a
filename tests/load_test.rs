//! The bounded load test on CPU (small): `tandem serve` with the committed head, then
//! `tandem load-test` over MT-Bench first turns; the report must account for every request and
//! its latency percentiles must be ordered. The printed table is the CI record of p50/p99 and
//! throughput. A second server runs the adaptive speculation policy on the burn engine.

use std::io::{BufRead, BufReader, Read};
use std::process::{Command, Stdio};

/// Starts `tandem serve --port 0 ARGS`, runs `tandem load-test` with `requests` requests at
/// `concurrency` and `max_tokens` against it, stops it, and returns the report (JSON), the
/// printed table and the server's stderr.
fn serve_and_load(
    args: &[&str],
    label: &str,
    requests: usize,
    concurrency: usize,
    max_tokens: usize,
) -> (serde_json::Value, String, String) {
    let root = env!("CARGO_MANIFEST_DIR");
    let bin = env!("CARGO_BIN_EXE_tandem");
    let mut server = Command::new(bin)
        .args(["serve", "--port", "0"])
        .args(args)
        .current_dir(root)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("tandem serve starts");
    let stdout = server.stdout.take().unwrap();
    let mut lines = BufReader::new(stdout).lines();
    let url = lines
        .by_ref()
        .map_while(Result::ok)
        .find_map(|l| {
            l.split_once("listening on ")
                .map(|(_, rest)| rest.split_whitespace().next().unwrap().to_owned())
        })
        .expect("the server prints its address");
    let json =
        std::env::temp_dir().join(format!("tandem-load-{label}-{}.json", std::process::id()));
    let out = Command::new(bin)
        .args(["load-test", "--url", &url])
        .args(["--requests", &requests.to_string()])
        .args(["--concurrency", &concurrency.to_string()])
        .args([
            "--max-tokens",
            &max_tokens.to_string(),
            "--label",
            label,
            "--json",
        ])
        .arg(&json)
        .current_dir(root)
        .output()
        .expect("tandem load-test runs");
    let _ = server.kill();
    let _ = server.wait();
    let mut stderr = String::new();
    server
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut stderr)
        .unwrap();
    let table = String::from_utf8_lossy(&out.stdout).into_owned();
    eprintln!("{table}{}", String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "load test failed");
    let report = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    (report, table, stderr)
}

#[test]
fn load_test_against_the_speculative_server() {
    // A fixed shape: every round drafts, whatever this CPU's costs (the adaptive test below
    // covers the policy).
    let (report, table, _) = serve_and_load(
        &[
            "--max-batch",
            "4",
            "--context",
            "512",
            "--speculation",
            "fixed",
        ],
        "speculative-cpu",
        6,
        3,
        8,
    );
    assert_eq!(report["failed"], 0);
    assert_eq!(report["requests"], 6);
    let (p50, p99) = (
        report["latency_p50_s"].as_f64().unwrap(),
        report["latency_p99_s"].as_f64().unwrap(),
    );
    assert!(0.0 < p50 && p50 <= p99, "p50 {p50} p99 {p99}");
    let tokens = report["completion_tokens"].as_u64().unwrap();
    assert!(
        (6..=48).contains(&tokens),
        "{tokens} tokens for 6 requests of at most 8"
    );
    assert!(report["accept_length"].as_f64().unwrap() >= 1.0);
    assert!(table.contains("| speculative-cpu | 6 | 3 | 0 |"), "{table}");
}

/// `--speculation adaptive` (the default) on the burn engine: the server measures each choice's
/// round cost on its own caches before it listens (the table printed at start-up, a plain round
/// and 3/1/4 at batch 1 and 2), then every round is either plain or 3/1/4, and the responses
/// say which (`tandem.shapes`). Which one wins depends on this CPU's costs, so the test checks
/// that the rounds add up, not which choice was made.
#[test]
fn the_burn_engine_measures_its_round_costs_and_serves_by_the_policy() {
    let (report, _, stderr) = serve_and_load(
        &[
            "--max-batch",
            "2",
            "--context",
            "512",
            "--policy-shapes",
            "3/1/4",
        ],
        "adaptive-cpu",
        4,
        2,
        6,
    );
    assert!(
        stderr.contains("speculation policy: round costs measured"),
        "{stderr}"
    );
    let table: Vec<&str> = stderr
        .lines()
        .skip_while(|l| !l.contains("round costs measured"))
        .collect();
    assert!(
        table
            .iter()
            .any(|l| l.contains("none") && l.contains("3/1/4")),
        "{stderr}"
    );
    assert!(
        table
            .iter()
            .any(|l| l.split_whitespace().next() == Some("2")),
        "batch 2 measured: {stderr}"
    );
    assert_eq!(report["failed"], 0);
    let shapes = report["shapes"].as_object().expect("rounds by shape");
    assert!(
        shapes.keys().all(|k| k == "none" || k == "3/1/4"),
        "{shapes:?}"
    );
    let rounds: u64 = shapes.values().map(|v| v.as_u64().unwrap()).sum();
    let tokens = report["completion_tokens"].as_u64().unwrap();
    // A round commits at least one token of each running request, at most 4 with 3/1/4.
    assert!(
        rounds >= 1 && tokens >= rounds && tokens <= 4 * rounds + 4,
        "{rounds} rounds, {tokens} tokens"
    );
}
