//! `tandem load-test`: a bounded load test against a running `tandem serve` (or any
//! OpenAI-compatible server): a fixed number of chat requests over MT-Bench first turns with a
//! fixed concurrency; prints p50/p99 latency, time to first byte of the response, throughput,
//! and the server's reported accept length.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;
use clap::Args;
use serde::Serialize;

#[derive(Args, Debug)]
pub struct LoadTestArgs {
    /// Server base URL.
    #[arg(long, default_value = "http://127.0.0.1:8000")]
    pub url: String,
    /// Model name to send (default: the first of GET /v1/models).
    #[arg(long)]
    pub model: Option<String>,
    /// Prompt set (first turns, sent as chat): mtbench, humaneval, or a JSONL path.
    #[arg(long, default_value = "mtbench")]
    pub prompts: String,
    #[arg(long, default_value = "data")]
    pub data_root: PathBuf,
    /// Requests in total (prompts are cycled).
    #[arg(long, default_value_t = 32)]
    pub requests: usize,
    /// Requests in flight at once.
    #[arg(long, default_value_t = 4)]
    pub concurrency: usize,
    #[arg(long, default_value_t = 64)]
    pub max_tokens: usize,
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    /// Write the report as JSON here.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// A label for the report (e.g. "speculative" or "target-only").
    #[arg(long, default_value = "")]
    pub label: String,
}

#[derive(Debug, Serialize)]
pub struct LoadReport {
    pub label: String,
    pub requests: usize,
    pub concurrency: usize,
    pub max_tokens: usize,
    pub failed: usize,
    pub wall_seconds: f64,
    pub completion_tokens: u64,
    pub tokens_per_second: f64,
    pub requests_per_second: f64,
    pub latency_p50_s: f64,
    pub latency_p99_s: f64,
    pub latency_mean_s: f64,
    pub accept_length: f64,
    /// Rounds by the draft shape the server's speculation policy chose, over all responses.
    pub shapes: std::collections::BTreeMap<String, u64>,
    /// Failed requests by reason (the HTTP status and the error's message, or the transport
    /// error), so that a failed load says why.
    pub failures: std::collections::BTreeMap<String, usize>,
}

/// A failed request's reason: its HTTP status and the OpenAI-style error's message.
fn failure_reason(status: u16, body: &serde_json::Value) -> String {
    match body["error"]["message"].as_str() {
        Some(message) => format!("HTTP {status}: {message}"),
        None => format!("HTTP {status}"),
    }
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    // Nearest rank.
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

pub fn run(args: LoadTestArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        args.requests > 0 && args.concurrency > 0,
        "--requests and --concurrency must be at least 1"
    );
    let prompts = tandem_data::eval_prompts(&args.prompts, &args.data_root)
        .with_context(|| format!("reading prompts {}", args.prompts))?;
    anyhow::ensure!(!prompts.is_empty(), "no prompts in {}", args.prompts);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let report = runtime.block_on(async {
        let client = reqwest::Client::new();
        let model = match &args.model {
            Some(m) => m.clone(),
            None => {
                let models: serde_json::Value = client
                    .get(format!("{}/v1/models", args.url))
                    .send()
                    .await
                    .with_context(|| format!("cannot reach {}", args.url))?
                    .json()
                    .await?;
                models["data"][0]["id"]
                    .as_str()
                    .context("GET /v1/models listed no model")?
                    .to_owned()
            }
        };
        let next = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let start = Instant::now();
        let mut workers = Vec::new();
        for _ in 0..args.concurrency.min(args.requests) {
            let (client, next, model) = (client.clone(), next.clone(), model.clone());
            let url = format!("{}/v1/chat/completions", args.url);
            let turns: Vec<String> = prompts
                .iter()
                .map(|p| p.turns.first().cloned().unwrap_or_default())
                .collect();
            let (total, max_tokens, temperature) =
                (args.requests, args.max_tokens, args.temperature);
            workers.push(tokio::spawn(async move {
                let mut results = Vec::new();
                loop {
                    let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    if i >= total {
                        break;
                    }
                    let body = serde_json::json!({
                        "model": model,
                        "messages": [{"role": "user", "content": turns[i % turns.len()]}],
                        "max_tokens": max_tokens,
                        "temperature": temperature,
                        "seed": i,
                    });
                    let t0 = Instant::now();
                    let reply = client.post(&url).json(&body).send().await;
                    let outcome = match reply {
                        Ok(r) if r.status().is_success() => r
                            .json::<serde_json::Value>()
                            .await
                            .map_err(|e| format!("unreadable reply: {e}")),
                        Ok(r) => {
                            let status = r.status();
                            let body = r.json::<serde_json::Value>().await.unwrap_or_default();
                            Err(failure_reason(status.as_u16(), &body))
                        }
                        Err(e) => Err(format!("no reply: {e}")),
                    };
                    results.push((t0.elapsed().as_secs_f64(), outcome));
                }
                results
            }));
        }
        let mut latencies = Vec::new();
        let (mut tokens, mut accepted, mut rounds) = (0u64, 0u64, 0u64);
        let mut shapes = std::collections::BTreeMap::<String, u64>::new();
        let mut failures = std::collections::BTreeMap::<String, usize>::new();
        for w in workers {
            for (latency, outcome) in w.await? {
                match outcome {
                    Ok(v) => {
                        latencies.push(latency);
                        tokens += v["usage"]["completion_tokens"].as_u64().unwrap_or(0);
                        accepted += v["tandem"]["accepted_draft_tokens"].as_u64().unwrap_or(0);
                        rounds += v["tandem"]["rounds"].as_u64().unwrap_or(0);
                        if let Some(by_shape) = v["tandem"]["shapes"].as_object() {
                            for (shape, n) in by_shape {
                                *shapes.entry(shape.clone()).or_default() +=
                                    n.as_u64().unwrap_or(0);
                            }
                        }
                    }
                    Err(reason) => *failures.entry(reason).or_default() += 1,
                }
            }
        }
        let wall = start.elapsed().as_secs_f64();
        latencies.sort_by(f64::total_cmp);
        let mean = latencies.iter().sum::<f64>() / latencies.len().max(1) as f64;
        anyhow::Ok(LoadReport {
            label: args.label.clone(),
            requests: args.requests,
            concurrency: args.concurrency,
            max_tokens: args.max_tokens,
            failed: failures.values().sum(),
            wall_seconds: wall,
            completion_tokens: tokens,
            tokens_per_second: tokens as f64 / wall,
            requests_per_second: latencies.len() as f64 / wall,
            latency_p50_s: percentile(&latencies, 50.0),
            latency_p99_s: percentile(&latencies, 99.0),
            latency_mean_s: mean,
            accept_length: if rounds > 0 {
                (accepted + rounds) as f64 / rounds as f64
            } else {
                1.0
            },
            shapes,
            failures,
        })
    })?;
    println!(
        "| label | requests | concurrency | failed | tokens | tok/s | req/s | p50 s | p99 s | tau |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|");
    println!(
        "| {} | {} | {} | {} | {} | {:.1} | {:.2} | {:.2} | {:.2} | {:.2} |",
        report.label,
        report.requests,
        report.concurrency,
        report.failed,
        report.completion_tokens,
        report.tokens_per_second,
        report.requests_per_second,
        report.latency_p50_s,
        report.latency_p99_s,
        report.accept_length
    );
    if !report.shapes.is_empty() {
        let rounds: Vec<String> = report
            .shapes
            .iter()
            .map(|(s, n)| format!("{s}: {n}"))
            .collect();
        println!("rounds by draft shape: {}", rounds.join(", "));
    }
    for (reason, n) in &report.failures {
        println!("failed: {n} x {reason}");
    }
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_string_pretty(&report)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    anyhow::ensure!(report.failed == 0, "{} request(s) failed", report.failed);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::{failure_reason, percentile};

    #[test]
    fn a_failure_names_its_status_and_the_servers_message() {
        let body =
            serde_json::json!({"error": {"message": "CUDA out of memory", "type": "server_error"}});
        assert_eq!(failure_reason(500, &body), "HTTP 500: CUDA out of memory");
        assert_eq!(failure_reason(429, &serde_json::Value::Null), "HTTP 429");
    }

    #[test]
    fn nearest_rank_percentiles() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&v, 50.0), 50.0);
        assert_eq!(percentile(&v, 99.0), 99.0);
        assert_eq!(percentile(&[3.0], 99.0), 3.0);
        assert_eq!(percentile(&[1.0, 2.0, 3.0, 4.0], 50.0), 2.0);
    }
}
