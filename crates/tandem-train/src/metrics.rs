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

/// The metrics logs of a head trained in stages (each run `--init-from` the previous one's
/// head) as one log: every stage's steps, epochs and elapsed seconds continue from where the
/// previous stage ended, so one plot shows the head's whole training.
pub fn chain_stages(stages: &[Vec<MetricsLine>]) -> Vec<MetricsLine> {
    let (mut step0, mut epoch0, mut time0) = (0usize, 0usize, 0f64);
    let mut out = Vec::new();
    for lines in stages {
        let (mut last_step, mut last_epoch, mut last_time) = (0usize, 0usize, 0f64);
        for line in lines {
            last_step = last_step.max(line.step);
            last_epoch = last_epoch.max(line.epoch + 1);
            last_time = last_time.max(line.elapsed_s);
            out.push(MetricsLine {
                step: line.step + step0,
                epoch: line.epoch + epoch0,
                elapsed_s: line.elapsed_s + time0,
                ..line.clone()
            });
        }
        step0 += last_step;
        epoch0 += last_epoch;
        time0 += last_time;
    }
    out
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

#[cfg(test)]
mod tests {
    use super::*;

    fn line(kind: &str, step: usize, epoch: usize, elapsed_s: f64) -> MetricsLine {
        MetricsLine {
            kind: kind.to_owned(),
            step,
            epoch,
            lr: None,
            loss: step as f64,
            ploss: vec![1.0],
            acc: vec![0.5],
            grad_norm: None,
            tokens: 10,
            tokens_per_s: None,
            elapsed_s,
        }
    }

    #[test]
    fn chained_stages_continue_steps_epochs_and_time() {
        let first = vec![
            line("train", 1, 0, 1.0),
            line("train", 4, 1, 4.0),
            line("val", 4, 1, 5.0),
        ];
        let second = vec![line("train", 1, 0, 0.5), line("val", 2, 0, 2.0)];
        let chained = chain_stages(&[first.clone(), second]);
        let keys: Vec<(String, usize, usize, f64)> = chained
            .iter()
            .map(|l| (l.kind.clone(), l.step, l.epoch, l.elapsed_s))
            .collect();
        assert_eq!(
            keys,
            vec![
                ("train".into(), 1, 0, 1.0),
                ("train".into(), 4, 1, 4.0),
                ("val".into(), 4, 1, 5.0),
                ("train".into(), 5, 2, 5.5),
                ("val".into(), 6, 2, 7.0),
            ]
        );
        // The values themselves are untouched; one stage is itself.
        assert_eq!(chained[3].loss, 1.0);
        assert_eq!(chain_stages(std::slice::from_ref(&first)), first);
    }
}
