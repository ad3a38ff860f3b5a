//! The compare and diagnose reports as polars frames: what their terminal tables print and what
//! `tandem compare --export` / `tandem diagnose --export` write as Parquet or CSV (through
//! [`tandem_stats::export_tables`], temporary names renamed when complete).
//!
//! Column names are the exported schema: snake case, one value per cell, `null` where a side
//! never reached a position or an error cannot be estimated.

use polars::prelude::*;
use tandem_stats::StatsError;

use crate::compare::CompareReport;
use crate::diagnose::{DiagnoseReport, format_wiring};

/// `gap / se`, or `None` when the error is unknown or zero.
fn standard_errors(gap: f64, se: Option<f64>) -> Option<f64> {
    se.filter(|se| *se > 0.0).map(|se| gap / se)
}

impl CompareReport {
    /// One row per draft position: teacher-forced `acc_i` and chain acceptance (`ttt_acc`,
    /// `ttt_chain`), the engine's drafting on the dump (`offline`) and online, their `gap`
    /// (offline - online), its standard error `gap_se`, `z = gap / gap_se` and whether the gap
    /// is `flagged`.
    pub fn positions_frame(&self) -> Result<DataFrame, StatsError> {
        let steps = self.setup.steps;
        let at = |v: &[f64], i: usize| v.get(i).copied();
        let gap_se: Vec<Option<f64>> = (0..steps).map(|i| self.gap_se[i]).collect();
        Ok(df!(
            "position" => (0..steps as u32).collect::<Vec<_>>(),
            "ttt_acc" => (0..steps).map(|i| at(&self.offline_acc, i)).collect::<Vec<_>>(),
            "ttt_chain" => (0..steps).map(|i| at(&self.offline_per_position, i)).collect::<Vec<_>>(),
            "offline" => self.drafted_per_position[..steps].to_vec(),
            "online" => self.online_per_position[..steps].to_vec(),
            "gap" => self.gap[..steps].to_vec(),
            "gap_se" => gap_se.clone(),
            "z" => (0..steps).map(|i| standard_errors(self.gap[i], gap_se[i])).collect::<Vec<_>>(),
            "flagged" => self.flagged_positions[..steps].to_vec(),
        )?)
    }

    /// One row per accept length measured: `offline` (the engine's drafting on the dump),
    /// `online`, their `gap` and the teacher-forced chain's implied length (`ttt_chain`), each
    /// with its standard error (`se`), rounds and samples or prompts (`units`).
    pub fn accept_length_frame(&self) -> Result<DataFrame, StatsError> {
        let drafted = &self.drafted;
        let online = &self.online;
        Ok(df!(
            "measure" => ["offline", "online", "gap", "ttt_chain"],
            "accept_length" => [
                Some(self.drafted_accept_length),
                Some(self.online_accept_length),
                Some(self.accept_length_gap),
                self.offline_accept_length,
            ],
            "se" => [
                self.drafted_accept_length_se,
                self.online_accept_length_se,
                self.accept_length_gap_se,
                None,
            ],
            "z" => [
                None,
                None,
                standard_errors(self.accept_length_gap, self.accept_length_gap_se),
                None,
            ],
            "rounds" => [
                Some(drafted.stats.rounds),
                Some(online.stats.rounds),
                None,
                self.offline.as_ref().map(|o| o.chain_positions as u64),
            ],
            "units" => [
                Some(drafted.samples as u64),
                Some(online.prompts as u64),
                None,
                self.offline.as_ref().map(|o| o.samples as u64),
            ],
            "flagged" => [false, false, self.accept_length_flagged, false],
        )?)
    }

    /// The report's tables by file name: `compare_positions`, `compare_accept_length`.
    pub fn tables(&self) -> Result<Vec<(&'static str, DataFrame)>, StatsError> {
        Ok(vec![
            ("compare_positions", self.positions_frame()?),
            ("compare_accept_length", self.accept_length_frame()?),
        ])
    }
}

impl DiagnoseReport {
    /// One row per wiring swept, best first: `rank`, `wiring`, `accept_length`, `loss` against
    /// the best and its paired standard error `se`, conditional acceptance `pos0 ..`, the
    /// `difference` from the report's reference, the declared `readings` that land on it
    /// (`SERVING`, `ids as <conventions>`) and why it was swept (`origins`).
    pub fn wirings_frame(&self) -> Result<DataFrame, StatsError> {
        let scores = &self.scores;
        let mut columns = vec![
            Column::new(
                "rank".into(),
                scores.iter().map(|s| s.rank as u32).collect::<Vec<_>>(),
            ),
            Column::new(
                "wiring".into(),
                scores
                    .iter()
                    .map(|s| format_wiring(&s.wiring))
                    .collect::<Vec<_>>(),
            ),
            Column::new(
                "accept_length".into(),
                scores.iter().map(|s| s.accept_length).collect::<Vec<_>>(),
            ),
            Column::new(
                "loss".into(),
                scores.iter().map(|s| s.loss).collect::<Vec<_>>(),
            ),
            Column::new(
                "se".into(),
                scores.iter().map(|s| s.loss_se).collect::<Vec<_>>(),
            ),
        ];
        for i in 0..self.steps {
            columns.push(Column::new(
                format!("pos{i}").into(),
                scores
                    .iter()
                    .map(|s| s.per_position.get(i).copied())
                    .collect::<Vec<_>>(),
            ));
        }
        columns.push(Column::new(
            "difference".into(),
            scores
                .iter()
                .map(|s| s.difference.clone())
                .collect::<Vec<_>>(),
        ));
        columns.push(Column::new(
            "readings".into(),
            scores
                .iter()
                .map(|s| self.reading_tags(s.rank).join(", "))
                .collect::<Vec<_>>(),
        ));
        columns.push(Column::new(
            "origins".into(),
            scores
                .iter()
                .map(|s| s.origins.join("; "))
                .collect::<Vec<_>>(),
        ));
        Ok(DataFrame::new(scores.len(), columns)?)
    }

    /// The wirings the terminal table shows: the `top` best and every one a declared reading
    /// lands on, without the `origins` column.
    pub fn shown_wirings(&self, top: usize) -> Result<DataFrame, StatsError> {
        let shown = self
            .wirings_frame()?
            .lazy()
            .filter(
                col("rank")
                    .lt_eq(lit(top as u32))
                    .or(col("readings").neq(lit(""))),
            )
            .collect()?;
        Ok(shown.drop("origins")?)
    }

    /// The report's table by file name: `diagnose_wirings`.
    pub fn tables(&self) -> Result<Vec<(&'static str, DataFrame)>, StatsError> {
        Ok(vec![("diagnose_wirings", self.wirings_frame()?)])
    }
}
