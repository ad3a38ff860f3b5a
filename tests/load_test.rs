//! The bounded load test on CPU (small): `tandem serve` with the committed head, then
//! `tandem load-test` over MT-Bench first turns; the report must account for every request and
//! its latency percentiles must be ordered. The printed table is the CI record of p50/p99 and
//! throughput.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};

#[test]
fn load_test_against_the_speculative_server() {
    let root = env!("CARGO_MANIFEST_DIR");
    let bin = env!("CARGO_BIN_EXE_tandem");
    let mut server = Command::new(bin)
        .args([
            "serve",
            "--port",
            "0",
            "--max-batch",
            "4",
            "--context",
            "512",
        ])
        .current_dir(root)
        .stdout(Stdio::piped())
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
    let json = std::env::temp_dir().join(format!("tandem-load-{}.json", std::process::id()));
    let out = Command::new(bin)
        .args([
            "load-test",
            "--url",
            &url,
            "--requests",
            "6",
            "--concurrency",
            "3",
        ])
        .args(["--max-tokens", "8", "--label", "speculative-cpu", "--json"])
        .arg(&json)
        .current_dir(root)
        .output()
        .expect("tandem load-test runs");
    let _ = server.kill();
    let _ = server.wait();
    let table = String::from_utf8_lossy(&out.stdout);
    eprintln!("{table}{}", String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "load test failed");
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
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
