//! `tandem dump-info`: what a dump holds, and per-tap norm statistics.
//!
//! The mean and standard deviation of the per-token L2 norm of each slot tell a normed tap
//! from a residual-stream one: the residual stream's norm grows through the blocks and varies
//! a lot between tokens, while a normed value sits near `sqrt(T) * |w|` with little spread.

use std::fmt;
use std::fs;
use std::path::Path;

use tandem_wiring::TapId;

use crate::error::FormatError;
use crate::manifest::{DumpManifest, describe_generation};
use crate::reader::DumpReader;

/// Running mean and variance (Welford), in f64.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct RunningStats {
    /// Values seen.
    pub count: u64,
    mean: f64,
    m2: f64,
}

impl RunningStats {
    /// Adds one value.
    pub fn push(&mut self, x: f64) {
        self.count += 1;
        let delta = x - self.mean;
        self.mean += delta / self.count as f64;
        self.m2 += delta * (x - self.mean);
    }

    /// Mean of the values (0 when none).
    pub fn mean(&self) -> f64 {
        self.mean
    }

    /// Population standard deviation (0 when fewer than two values).
    pub fn std(&self) -> f64 {
        if self.count < 2 {
            0.0
        } else {
            (self.m2 / self.count as f64).sqrt()
        }
    }
}

/// Norm statistics of one stored tap.
#[derive(Debug, Clone, PartialEq)]
pub struct TapNorms {
    /// `slot 0` ... or `last`.
    pub slot: String,
    /// The tap stored there.
    pub tap: TapId,
    /// Per-token L2 norms over all tokens.
    pub norms: RunningStats,
}

/// Summary of a dump directory.
#[derive(Debug, Clone)]
pub struct DumpInfo {
    /// The manifest (totals recomputed from the shards).
    pub manifest: DumpManifest,
    /// Bytes of the completed shard files.
    pub bytes_on_disk: u64,
    /// Token counts per row.
    pub row_lengths: RunningStats,
    /// Longest row.
    pub max_row_len: usize,
    /// Norm statistics of each aux slot, then of the last hidden state.
    pub taps: Vec<TapNorms>,
}

/// Reads every row of `dir` (at most `limit` rows when given) and summarises it.
pub fn dump_info(dir: &Path, limit: Option<usize>) -> Result<DumpInfo, FormatError> {
    let reader = DumpReader::open(dir)?;
    let manifest = reader.manifest().clone();
    let t = manifest.hidden_size;
    let mut taps: Vec<TapNorms> = manifest
        .wiring
        .taps
        .iter()
        .enumerate()
        .map(|(i, &tap)| TapNorms {
            slot: format!("slot {i}"),
            tap,
            norms: RunningStats::default(),
        })
        .collect();
    taps.push(TapNorms {
        slot: "last".to_owned(),
        tap: manifest.last_hidden_tap,
        norms: RunningStats::default(),
    });
    let slots = manifest.num_slots;
    let mut row_lengths = RunningStats::default();
    let mut max_row_len = 0;
    let rows = limit.map_or(reader.len(), |l| l.min(reader.len()));
    for i in 0..rows {
        let record = reader.read(i)?;
        row_lengths.push(record.len() as f64);
        max_row_len = max_row_len.max(record.len());
        for token in 0..record.len() {
            let aux = &record.aux_hidden[token * slots * t..(token + 1) * slots * t];
            for (slot, values) in aux.chunks_exact(t).enumerate() {
                taps[slot].norms.push(l2(values));
            }
            let last = &record.last_hidden[token * t..(token + 1) * t];
            taps[slots].norms.push(l2(last));
        }
    }
    let bytes_on_disk = manifest
        .shards
        .iter()
        .filter_map(|s| fs::metadata(dir.join(&s.file)).ok())
        .map(|m| m.len())
        .sum();
    Ok(DumpInfo {
        manifest,
        bytes_on_disk,
        row_lengths,
        max_row_len,
        taps,
    })
}

fn l2(values: &[f32]) -> f64 {
    values
        .iter()
        .map(|&v| f64::from(v) * f64::from(v))
        .sum::<f64>()
        .sqrt()
}

impl fmt::Display for DumpInfo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let m = &self.manifest;
        let target = &m.wiring.target;
        writeln!(
            f,
            "target      {} ({}, {} layers, hidden {})",
            target.architecture, target.model_type, target.num_layers, target.hidden_size
        )?;
        let taps: Vec<String> = m.wiring.taps.iter().map(ToString::to_string).collect();
        let raw = m
            .wiring
            .raw_ids
            .as_ref()
            .map(|r| format!(" (asked as {r})"))
            .unwrap_or_default();
        writeln!(
            f,
            "taps        [{}]{raw}, {}",
            taps.join(", "),
            m.wiring.tap_point
        )?;
        writeln!(f, "last hidden {}", m.last_hidden_tap)?;
        writeln!(
            f,
            "dtype       {} ({}), {} compression",
            m.dtype,
            match m.dtype {
                crate::StorageDtype::Bf16 => "UInt16 bit patterns",
                crate::StorageDtype::F16 => "Float16",
            },
            m.compression
        )?;
        writeln!(
            f,
            "dataset     {}{}",
            m.dataset,
            m.dataset_split
                .as_deref()
                .map(|s| format!(" ({s})"))
                .unwrap_or_default()
        )?;
        writeln!(
            f,
            "template    sha256 {}",
            m.chat_template_sha256.as_deref().unwrap_or("none")
        )?;
        writeln!(
            f,
            "replies     {}",
            match &m.settings.regenerate {
                Some(g) => format!("regenerated by the target ({})", describe_generation(g)),
                None => "the dataset's own".to_owned(),
            }
        )?;
        writeln!(
            f,
            "producer    {} {} on {}, path {}",
            m.wiring.producer.tool,
            m.wiring.producer.tool_version,
            m.wiring.producer.device,
            m.wiring.producer.execution_path
        )?;
        writeln!(
            f,
            "rows        {} in {} shards ({:.1} MiB){}",
            m.rows,
            m.shards.len(),
            self.bytes_on_disk as f64 / (1 << 20) as f64,
            if m.complete { ", dataset complete" } else { "" }
        )?;
        writeln!(
            f,
            "tokens      {} (mean {:.1}, max {} per row; max-len {}, {} rows truncated)",
            m.tokens,
            self.row_lengths.mean(),
            self.max_row_len,
            m.settings.max_len,
            m.truncated
        )?;
        writeln!(
            f,
            "assistant   {} tokens, {:.1}% of all",
            m.assistant_tokens,
            100.0 * m.assistant_share()
        )?;
        let skipped: Vec<String> = m.skipped.iter().map(|(r, n)| format!("{r}={n}")).collect();
        writeln!(
            f,
            "skipped     {} of {} records{}",
            m.skipped.values().sum::<u64>(),
            m.records_read,
            if skipped.is_empty() {
                String::new()
            } else {
                format!(": {}", skipped.join(" "))
            }
        )?;
        writeln!(
            f,
            "per-token L2 norm over {} tokens (cv = std / mean):",
            self.taps.first().map_or(0, |t| t.norms.count)
        )?;
        writeln!(
            f,
            "  {:<8} {:<10} {:>10} {:>10} {:>8}",
            "slot", "tap", "mean", "std", "cv"
        )?;
        for tap in &self.taps {
            let cv = if tap.norms.mean() > 0.0 {
                tap.norms.std() / tap.norms.mean()
            } else {
                0.0
            };
            writeln!(
                f,
                "  {:<8} {:<10} {:>10.3} {:>10.3} {:>8.3}",
                tap.slot,
                tap.tap.to_string(),
                tap.norms.mean(),
                tap.norms.std(),
                cv
            )?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn welford_matches_the_two_pass_formula() {
        let xs = [1.0, 2.0, 4.0, 8.0, 16.0];
        let mut s = RunningStats::default();
        for x in xs {
            s.push(x);
        }
        let mean = xs.iter().sum::<f64>() / 5.0;
        let var = xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / 5.0;
        assert!((s.mean() - mean).abs() < 1e-12);
        assert!((s.std() - var.sqrt()).abs() < 1e-12);
    }
}
