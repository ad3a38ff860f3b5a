//! Server metrics in the Prometheus text format (`GET /metrics`): requests by outcome, tokens,
//! throughput, queue depth, accept-length histogram and per-position acceptance.

use std::collections::VecDeque;
use std::fmt::Write;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use tandem_infer::AcceptanceStats;

/// A cumulative histogram with fixed upper bounds.
#[derive(Debug, Clone)]
struct Histogram {
    bounds: Vec<f64>,
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Histogram {
    fn new(bounds: Vec<f64>) -> Self {
        let n = bounds.len();
        Self {
            bounds,
            counts: vec![0; n],
            sum: 0.0,
            count: 0,
        }
    }

    fn observe(&mut self, v: f64) {
        for (b, c) in self.bounds.iter().zip(&mut self.counts) {
            if v <= *b {
                *c += 1;
            }
        }
        self.sum += v;
        self.count += 1;
    }

    fn render(&self, out: &mut String, name: &str, help: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        for (b, c) in self.bounds.iter().zip(&self.counts) {
            let _ = writeln!(out, "{name}_bucket{{le=\"{b}\"}} {c}");
        }
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {}", self.count);
        let _ = writeln!(out, "{name}_sum {}", self.sum);
        let _ = writeln!(out, "{name}_count {}", self.count);
    }
}

#[derive(Debug)]
struct Inner {
    requests: [u64; 5],
    prompt_tokens: u64,
    generation_tokens: u64,
    queue_depth: usize,
    running: usize,
    accept_length: Histogram,
    latency: Histogram,
    first_token: Histogram,
    acceptance: AcceptanceStats,
    /// Rounds by draft shape, as the engine's speculation policy last reported them.
    policy_rounds: Vec<(String, u64)>,
    /// `(time, cumulative generated tokens)` over the throughput window.
    recent: VecDeque<(Instant, u64)>,
}

/// How a request ended, for `tandem_requests_total{outcome=...}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    Ok = 0,
    Invalid = 1,
    Rejected = 2,
    Cancelled = 3,
    Failed = 4,
}

const OUTCOMES: [&str; 5] = [
    "ok",
    "invalid",
    "rejected_queue_full",
    "cancelled",
    "failed",
];
const WINDOW: Duration = Duration::from_secs(10);

/// Shared by the HTTP handlers and the engine thread.
#[derive(Debug)]
pub struct Metrics {
    inner: Mutex<Inner>,
}

impl Metrics {
    /// `max_accept` is the longest round (draft depth + 1), the accept-length buckets' range.
    pub fn new(max_accept: usize) -> Self {
        let seconds = vec![
            0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
        ];
        Self {
            inner: Mutex::new(Inner {
                requests: [0; 5],
                prompt_tokens: 0,
                generation_tokens: 0,
                queue_depth: 0,
                running: 0,
                accept_length: Histogram::new((1..=max_accept.max(1)).map(|i| i as f64).collect()),
                latency: Histogram::new(seconds.clone()),
                first_token: Histogram::new(seconds),
                acceptance: AcceptanceStats::new(0),
                policy_rounds: Vec::new(),
                recent: VecDeque::new(),
            }),
        }
    }

    fn with<R>(&self, f: impl FnOnce(&mut Inner) -> R) -> R {
        // A panic elsewhere must not take the metrics down with it.
        let mut guard = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        f(&mut guard)
    }

    pub fn request_done(&self, outcome: Outcome) {
        self.with(|m| m.requests[outcome as usize] += 1);
    }
    pub fn prompt_tokens(&self, n: usize) {
        self.with(|m| m.prompt_tokens += n as u64);
    }
    /// Tokens committed by the engine (any request).
    pub fn generated(&self, n: usize) {
        self.with(|m| {
            m.generation_tokens += n as u64;
            let now = Instant::now();
            m.recent.push_back((now, m.generation_tokens));
            while m
                .recent
                .front()
                .is_some_and(|(t, _)| now.duration_since(*t) > WINDOW)
            {
                m.recent.pop_front();
            }
        });
    }
    /// One verification round that accepted `accepted` draft tokens.
    pub fn round(&self, accepted: usize) {
        self.with(|m| m.accept_length.observe((accepted + 1) as f64));
    }
    /// A request's whole acceptance record (per-position statistics).
    pub fn acceptance(&self, stats: &AcceptanceStats) {
        self.with(|m| m.acceptance.merge(stats));
    }
    pub fn latency(&self, seconds: f64) {
        self.with(|m| m.latency.observe(seconds));
    }
    pub fn first_token(&self, seconds: f64) {
        self.with(|m| m.first_token.observe(seconds));
    }
    /// Rounds run so far by the draft shape the speculation policy chose (`none`: no drafts).
    pub fn set_policy_rounds(&self, rounds: Vec<(String, u64)>) {
        self.with(|m| m.policy_rounds = rounds);
    }
    pub fn set_queue(&self, queued: usize, running: usize) {
        self.with(|m| {
            m.queue_depth = queued;
            m.running = running;
        });
    }

    /// Generated tokens per second over the last 10 seconds.
    pub fn tokens_per_second(&self) -> f64 {
        self.with(|m| match (m.recent.front(), m.recent.back()) {
            (Some((t0, n0)), Some((t1, n1))) if t1 > t0 => {
                (n1 - n0) as f64 / t1.duration_since(*t0).as_secs_f64()
            }
            _ => 0.0,
        })
    }

    /// The Prometheus text exposition.
    pub fn render(&self) -> String {
        let tps = self.tokens_per_second();
        self.with(|m| {
            let mut out = String::new();
            let _ = writeln!(
                out,
                "# HELP tandem_requests_total Requests by how they ended.\n# TYPE tandem_requests_total counter"
            );
            for (name, n) in OUTCOMES.iter().zip(m.requests) {
                let _ = writeln!(out, "tandem_requests_total{{outcome=\"{name}\"}} {n}");
            }
            let counters = [
                ("tandem_prompt_tokens_total", "Prompt tokens admitted.", m.prompt_tokens),
                ("tandem_generation_tokens_total", "Tokens generated.", m.generation_tokens),
                ("tandem_rounds_total", "Speculative verification rounds.", m.accept_length.count),
            ];
            for (name, help, v) in counters {
                let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter\n{name} {v}");
            }
            let gauges = [
                ("tandem_generation_tokens_per_second", "Tokens generated per second over the last 10 s.", tps),
                ("tandem_queue_depth", "Requests waiting to join the running batch.", m.queue_depth as f64),
                ("tandem_running_sequences", "Sequences in the running batch.", m.running as f64),
                ("tandem_accept_length_mean", "Mean tokens committed per round (tau).", m.acceptance.accept_length()),
            ];
            for (name, help, v) in gauges {
                let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {v}");
            }
            m.accept_length.render(
                &mut out,
                "tandem_accept_length",
                "Tokens committed per verification round (accepted drafts + 1).",
            );
            let _ = writeln!(
                out,
                "# HELP tandem_draft_position_acceptance Share of rounds reaching draft position i that accepted it.\n# TYPE tandem_draft_position_acceptance gauge"
            );
            for (i, p) in m.acceptance.per_position().iter().enumerate() {
                let _ = writeln!(out, "tandem_draft_position_acceptance{{position=\"{i}\"}} {p}");
            }
            if !m.policy_rounds.is_empty() {
                let _ = writeln!(
                    out,
                    "# HELP tandem_policy_rounds_total Rounds by the draft shape the speculation policy chose (none: no drafts).\n# TYPE tandem_policy_rounds_total counter"
                );
                for (shape, n) in &m.policy_rounds {
                    let _ = writeln!(out, "tandem_policy_rounds_total{{shape=\"{shape}\"}} {n}");
                }
            }
            m.latency.render(&mut out, "tandem_request_latency_seconds", "End-to-end request latency.");
            m.first_token.render(&mut out, "tandem_time_to_first_token_seconds", "Time to the first generated token.");
            out
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn value(text: &str, series: &str) -> f64 {
        text.lines()
            .find_map(|l| l.strip_prefix(series).and_then(|r| r.strip_prefix(' ')))
            .unwrap_or_else(|| panic!("{series} missing in\n{text}"))
            .parse()
            .unwrap()
    }

    #[test]
    fn counters_histograms_and_acceptance_render_as_prometheus_text() {
        let m = Metrics::new(4);
        m.request_done(Outcome::Ok);
        m.request_done(Outcome::Ok);
        m.request_done(Outcome::Rejected);
        m.prompt_tokens(30);
        m.generated(5);
        for accepted in [0, 2, 3, 3] {
            m.round(accepted);
        }
        let mut stats = AcceptanceStats::new(3);
        stats.record(2, 3);
        stats.record(0, 3);
        m.acceptance(&stats);
        m.set_policy_rounds(vec![("none".into(), 7), ("3/1/4".into(), 4)]);
        let text = m.render();
        assert_eq!(value(&text, "tandem_requests_total{outcome=\"ok\"}"), 2.0);
        assert_eq!(
            value(
                &text,
                "tandem_requests_total{outcome=\"rejected_queue_full\"}"
            ),
            1.0
        );
        assert_eq!(value(&text, "tandem_prompt_tokens_total"), 30.0);
        // Rounds committed 1, 3, 4, 4 tokens: cumulative buckets.
        assert_eq!(value(&text, "tandem_accept_length_bucket{le=\"1\"}"), 1.0);
        assert_eq!(value(&text, "tandem_accept_length_bucket{le=\"3\"}"), 2.0);
        assert_eq!(
            value(&text, "tandem_accept_length_bucket{le=\"+Inf\"}"),
            4.0
        );
        assert_eq!(value(&text, "tandem_accept_length_sum"), 12.0);
        // Position 0 reached twice, accepted once; position 1 reached once, accepted once.
        assert_eq!(
            value(&text, "tandem_draft_position_acceptance{position=\"0\"}"),
            0.5
        );
        assert_eq!(
            value(&text, "tandem_draft_position_acceptance{position=\"1\"}"),
            1.0
        );
        assert_eq!(value(&text, "tandem_accept_length_mean"), 2.0);
        assert_eq!(
            value(&text, "tandem_policy_rounds_total{shape=\"none\"}"),
            7.0
        );
        assert_eq!(
            value(&text, "tandem_policy_rounds_total{shape=\"3/1/4\"}"),
            4.0
        );
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            let (_, v) = line.rsplit_once(' ').unwrap();
            assert!(v.parse::<f64>().is_ok(), "bad sample line {line}");
        }
    }
}
