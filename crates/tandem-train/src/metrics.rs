//! The metrics log (`metrics.jsonl`, one JSON object per line) and the running averages shown
//! in the progress bar.

use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::TrainError;
use crate::objective::{StepStats, step_weight};

/// One line of `metrics.jsonl`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MetricsLine {
    /// `train` (one optimizer step) or `val` (a pass over the validation split).
    pub kind: String,
    /// Optimizer steps done when the line was written (1 after the first step).
    pub step: usize,
    /// Epoch (0-based) of the step.
    pub epoch: usize,
    /// Learning rate used (train lines).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lr: Option<f64>,
    /// Weighted total loss sum_i 0.8^i loss_i.
    pub loss: f64,
    /// loss_i per TTT step.
    pub ploss: Vec<f64>,
    /// acc_i per TTT step.
    pub acc: Vec<f64>,
    /// Global gradient norm before clipping (train lines).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub grad_norm: Option<f64>,
    /// Real tokens in the batch (train) or the split (val).
    pub tokens: usize,
    /// Tokens per second of the step, data loading included (train lines).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens_per_s: Option<f64>,
    /// Seconds since the run (or the resumed run) started.
    pub elapsed_s: f64,
}

/// Sums of per-step stats over several batches (for validation and running averages).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StatsSum {
    /// Sum of loss_i weighted by batches.
    pub loss: Vec<f64>,
    /// Correct predictions per step.
    pub correct: Vec<usize>,
    /// Denominators per step.
    pub denominator: Vec<usize>,
    /// Batches added.
    pub batches: usize,
    /// Tokens added.
    pub tokens: usize,
}

impl StatsSum {
    /// Adds one batch.
    pub fn add(&mut self, stats: &[StepStats], tokens: usize) {
        if self.loss.len() < stats.len() {
            self.loss.resize(stats.len(), 0.0);
            self.correct.resize(stats.len(), 0);
            self.denominator.resize(stats.len(), 0);
        }
        for (i, s) in stats.iter().enumerate() {
            self.loss[i] += s.loss;
            self.correct[i] += s.correct;
            self.denominator[i] += s.denominator;
        }
        self.batches += 1;
        self.tokens += tokens;
    }

    /// Mean loss_i over the batches.
    pub fn ploss(&self) -> Vec<f64> {
        self.loss
            .iter()
            .map(|l| l / self.batches.max(1) as f64)
            .collect()
    }

    /// acc_i over all positions.
    pub fn acc(&self) -> Vec<f64> {
        self.correct
            .iter()
            .zip(&self.denominator)
            .map(|(&c, &d)| if d == 0 { 0.0 } else { c as f64 / d as f64 })
            .collect()
    }

    /// sum_i 0.8^i mean loss_i.
    pub fn total_loss(&self) -> f64 {
        self.ploss()
            .iter()
            .enumerate()
            .map(|(i, l)| l * step_weight(i))
            .sum()
    }
}

/// Appends lines to `metrics.jsonl`.
#[derive(Debug)]
pub struct MetricsLog {
    path: PathBuf,
}

impl MetricsLog {
    /// A log at `path`. With `keep_until = Some(step)` (a resumed run) the lines written after
    /// optimizer step `step` by the interrupted run are dropped, so the log reads as one run;
    /// with `None` the log starts empty.
    pub fn open(path: &Path, keep_until: Option<usize>) -> Result<Self, TrainError> {
        let kept = match keep_until {
            None => Vec::new(),
            Some(step) => read_lines(path)?
                .into_iter()
                .filter(|l| l.step <= step)
                .collect(),
        };
        let mut text = String::new();
        for line in &kept {
            text.push_str(&serde_json::to_string(line).expect("metrics serialise"));
            text.push('\n');
        }
        std::fs::write(path, text).map_err(TrainError::io("write", path))?;
        Ok(MetricsLog {
            path: path.to_owned(),
        })
    }

    /// Appends one line.
    pub fn append(&mut self, line: &MetricsLine) -> Result<(), TrainError> {
        let mut file = std::fs::OpenOptions::new()
            .append(true)
            .open(&self.path)
            .map_err(TrainError::io("open", &self.path))?;
        let mut text = serde_json::to_string(line).expect("metrics serialise");
        text.push('\n');
        file.write_all(text.as_bytes())
            .map_err(TrainError::io("append to", &self.path))
    }

    /// Path of the log.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// Reads every line of a metrics log (a missing file reads as empty).
pub fn read_lines(path: &Path) -> Result<Vec<MetricsLine>, TrainError> {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(TrainError::io("read", path)(e)),
    };
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            serde_json::from_str(l).map_err(|source| TrainError::Json {
                path: path.to_owned(),
                source,
            })
        })
        .collect()
}
