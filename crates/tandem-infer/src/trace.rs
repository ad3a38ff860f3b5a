//! A record of every round and admission of a running batch (fast path), for finding where a
//! serving run's time went when the totals of [`crate::Timings`] do not say: which rounds the
//! policy chose at which batch size and context, what it predicted they would cost and what
//! they cost, and what ran around them (catch-ups, housekeeping, graph captures).

use std::fmt::Write as _;

/// One round or admission.
#[derive(Debug, Clone, PartialEq)]
pub struct RoundRecord {
    /// Seconds since the trace started.
    pub at_s: f64,
    /// `round` or `admit`.
    pub kind: &'static str,
    /// Sequences in the batch when it ran (admissions: the newcomers).
    pub rows: usize,
    /// Used columns of the target's cache before the step (every row's attention reads them).
    pub target_columns: usize,
    /// The longest sequence in the batch before the step.
    pub longest: usize,
    /// Used columns of the head's cache before the step (0 without a head).
    pub head_columns: usize,
    /// The round's choice (`none`, a shape) or, for admissions, `deferred` / `extended`.
    pub choice: String,
    /// Tokens committed (admissions: prompt tokens prefilled).
    pub tokens: usize,
    pub draft_s: f64,
    pub verify_s: f64,
    pub extend_s: f64,
    /// The head's catch-up run before the round (a switch from plain rounds).
    pub catch_up_s: f64,
    /// Making room before the round and retiring finished rows after it.
    pub housekeeping_s: f64,
    /// The whole call.
    pub wall_s: f64,
    /// GPU work queued before the call (the previous call's asynchronous tail), drained first
    /// while recording so that the phases above are the call's own.
    pub queued_s: f64,
    /// Admissions: allocating the newcomers' target cache and laying out their prefill (part of
    /// `verify_s`, the prefill).
    pub setup_s: f64,
    /// CUDA graphs captured during the call.
    pub captured: usize,
    /// What the policy's table said the choice would cost, and a plain round (adaptive
    /// policies; NaN otherwise).
    pub predicted_s: f64,
    pub predicted_plain_s: f64,
}

impl RoundRecord {
    pub const CSV_HEADER: &'static str = "at_s,kind,rows,target_columns,longest,head_columns,\
choice,tokens,draft_s,verify_s,extend_s,catch_up_s,housekeeping_s,wall_s,queued_s,setup_s,\
captured,predicted_s,predicted_plain_s";

    fn csv_line(&self, out: &mut String) {
        let _ = writeln!(
            out,
            "{:.6},{},{},{},{},{},{},{},{:.6},{:.6},{:.6},{:.6},{:.6},{:.6},{:.6},{:.6},{},{:.6},{:.6}",
            self.at_s,
            self.kind,
            self.rows,
            self.target_columns,
            self.longest,
            self.head_columns,
            self.choice,
            self.tokens,
            self.draft_s,
            self.verify_s,
            self.extend_s,
            self.catch_up_s,
            self.housekeeping_s,
            self.wall_s,
            self.queued_s,
            self.setup_s,
            self.captured,
            self.predicted_s,
            self.predicted_plain_s
        );
    }
}

/// The records as CSV, header first.
pub fn to_csv(records: &[RoundRecord]) -> String {
    let mut out = String::with_capacity(64 + records.len() * 120);
    out.push_str(RoundRecord::CSV_HEADER);
    out.push('\n');
    for r in records {
        r.csv_line(&mut out);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn csv_has_one_field_per_header_column_and_keeps_the_values() {
        let r = RoundRecord {
            at_s: 1.5,
            kind: "round",
            rows: 32,
            target_columns: 400,
            longest: 321,
            head_columns: 390,
            choice: "3/1/4".into(),
            tokens: 70,
            draft_s: 3e-4,
            verify_s: 2e-3,
            extend_s: 4e-4,
            catch_up_s: 0.0,
            housekeeping_s: 1e-5,
            wall_s: 2.8e-3,
            queued_s: 1e-5,
            setup_s: 0.0,
            captured: 1,
            predicted_s: f64::NAN,
            predicted_plain_s: 1.7e-3,
        };
        let text = to_csv(&[r.clone(), r]);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 3);
        let header = lines[0].split(',').count();
        for line in &lines[1..] {
            let fields: Vec<&str> = line.split(',').collect();
            assert_eq!(fields.len(), header, "{line}");
            assert_eq!(fields[6], "3/1/4");
            assert_eq!(fields[2].parse::<usize>().unwrap(), 32);
            assert!((fields[9].parse::<f64>().unwrap() - 2e-3).abs() < 1e-9);
            assert_eq!(fields[17], "NaN");
        }
    }
}
