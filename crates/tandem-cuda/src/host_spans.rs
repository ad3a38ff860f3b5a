//! Host time by call site, for finding where a speculative round's host work goes.
//!
//! `tandem bench --phase-timing` on an H100 (session 55) showed ~59 us of host queueing in each
//! phase of a 3/1/4 round at batch 1 (draft, verify, extend), where launching a CUDA graph
//! costs a few. With `TANDEM_HOST_SPANS=1` the fast path's steps time their parts (the host
//! inputs, the graph lookup, the input uploads, the replay, the output copies) and `tandem
//! bench` prints the totals. Off (the default), a span is one relaxed check of a cached flag.

use std::sync::{Mutex, OnceLock};
use std::time::Instant;

/// Calls and seconds by span name, in the order the names were first seen.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct SpanTotals {
    rows: Vec<(&'static str, u64, f64)>,
}

impl SpanTotals {
    /// Adds one call of `name` that took `seconds`.
    pub fn add(&mut self, name: &'static str, seconds: f64) {
        match self.rows.iter_mut().find(|(n, _, _)| *n == name) {
            Some((_, calls, total)) => {
                *calls += 1;
                *total += seconds;
            }
            None => self.rows.push((name, 1, seconds)),
        }
    }

    /// `(name, calls, seconds)` for every span seen.
    pub fn rows(&self) -> &[(&'static str, u64, f64)] {
        &self.rows
    }

    /// A table of the spans: calls, total ms and us a call.
    pub fn table(&self) -> String {
        let mut out =
            String::from("| host span | calls | total ms | us a call |\n|---|---|---|---|\n");
        for (name, calls, seconds) in &self.rows {
            out.push_str(&format!(
                "| {name} | {calls} | {:.1} | {:.1} |\n",
                seconds * 1e3,
                seconds * 1e6 / (*calls).max(1) as f64
            ));
        }
        out
    }
}

static ENABLED: OnceLock<bool> = OnceLock::new();
static TOTALS: Mutex<SpanTotals> = Mutex::new(SpanTotals { rows: Vec::new() });

/// Whether spans are timed: `TANDEM_HOST_SPANS=1`, read once.
pub fn enabled() -> bool {
    *ENABLED.get_or_init(|| std::env::var("TANDEM_HOST_SPANS").is_ok_and(|v| v.trim() == "1"))
}

/// A timed span: its time is added to `name`'s total when it is dropped.
#[must_use = "a span times the scope that holds it"]
pub struct Span {
    name: &'static str,
    start: Option<Instant>,
}

/// Starts timing `name` (nothing is timed unless [`enabled`]).
pub fn span(name: &'static str) -> Span {
    Span {
        name,
        start: enabled().then(Instant::now),
    }
}

impl Drop for Span {
    fn drop(&mut self) {
        if let Some(start) = self.start {
            let seconds = start.elapsed().as_secs_f64();
            TOTALS
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner())
                .add(self.name, seconds);
        }
    }
}

/// The totals so far.
pub fn totals() -> SpanTotals {
    TOTALS
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
        .clone()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn totals_count_calls_and_add_seconds_by_name_in_first_seen_order() {
        let mut t = SpanTotals::default();
        t.add("replay", 2e-6);
        t.add("load", 10e-6);
        t.add("replay", 4e-6);
        assert_eq!(t.rows().len(), 2);
        assert_eq!(t.rows()[0].0, "replay");
        assert_eq!(t.rows()[0].1, 2);
        assert!((t.rows()[0].2 - 6e-6).abs() < 1e-12);
        assert_eq!(t.rows()[1], ("load", 1, 10e-6));
        let table = t.table();
        // 6 us over 2 calls: 3.0 us a call; 10 us over 1.
        assert!(table.contains("| replay | 2 | 0.0 | 3.0 |"), "{table}");
        assert!(table.contains("| load | 1 | 0.0 | 10.0 |"), "{table}");
    }
}
