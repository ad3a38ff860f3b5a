//! Dump analysis in polars (`tandem dump-info`, `tandem stats`).
//!
//! The dump's rows are read once through [`tandem_format::DumpReader`] (which decodes the
//! stored bf16/f16 taps) into two long frames: one row per dump row (tokens, assistant tokens)
//! and one row per token and tap (position, assistant flag, the tap's L2 norm). Everything
//! reported is a lazy polars query over them: per dataset (rows, tokens, row lengths, assistant
//! share), per tap (norm mean, standard deviation, coefficient of variation) and per tap and
//! position bucket. The tables print as text and export as Parquet or CSV.
//!
//! The norm statistics tell a normed tap from a residual-stream one: the residual stream's norm
//! grows through the blocks and varies a lot between tokens, while a normed value sits near
//! `sqrt(T) * |w|` with little spread.

use std::fmt;
use std::fs;
use std::path::{Path, PathBuf};

use polars::prelude::*;
use tandem_format::{DumpReader, FormatError};

/// The frame type of every table here, for callers that do not depend on polars.
pub use polars::prelude::DataFrame;

#[derive(Debug, thiserror::Error)]
pub enum StatsError {
    #[error(transparent)]
    Format(#[from] FormatError),
    #[error("polars: {0}")]
    Polars(#[from] PolarsError),
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: unknown table format (name it .parquet or .csv)")]
    UnknownFormat { path: PathBuf },
    #[error("no dumps to summarise")]
    NoDumps,
}

/// Position buckets of the per-position table: upper bounds (exclusive) and labels.
pub const POSITION_BUCKETS: [(u32, &str); 3] = [(64, "0-63"), (256, "64-255"), (1024, "256-1023")];
/// The label of positions past the last bucket.
pub const LAST_BUCKET: &str = "1024+";

/// The frames read from one dump.
pub struct DumpFrames {
    /// One row per dump row: `dataset`, `row`, `sample_id`, `tokens`, `assistant_tokens`.
    pub rows: DataFrame,
    /// One row per token and tap: `dataset`, `row`, `position`, `assistant`, `slot` (`slot i`
    /// or `last`), `tap` (canonical id), `norm`.
    pub norms: DataFrame,
}

/// Reads the rows of the dump in `dir` (at most `limit`) into [`DumpFrames`].
pub fn read_frames(dir: &Path, limit: Option<usize>) -> Result<DumpFrames, StatsError> {
    let reader = DumpReader::open(dir)?;
    let m = reader.manifest();
    let (t, slots) = (m.hidden_size, m.num_slots);
    let dataset = m.dataset.clone();
    let labels: Vec<(String, String)> = m
        .wiring
        .taps
        .iter()
        .enumerate()
        .map(|(i, tap)| (format!("slot {i}"), tap.to_string()))
        .chain([("last".to_owned(), m.last_hidden_tap.to_string())])
        .collect();
    let rows = limit.map_or(reader.len(), |l| l.min(reader.len()));
    let (mut row_index, mut sample_ids, mut tokens, mut assistant_tokens) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let (mut t_row, mut t_position, mut t_assistant, mut t_slot, mut t_tap, mut t_norm) = (
        Vec::new(),
        Vec::new(),
        Vec::new(),
        Vec::new(),
        Vec::new(),
        Vec::new(),
    );
    for i in 0..rows {
        let record = reader.read(i)?;
        row_index.push(i as u64);
        sample_ids.push(record.sample_id.clone());
        tokens.push(record.len() as u64);
        assistant_tokens.push(record.loss_mask.iter().map(|&m| u64::from(m)).sum::<u64>());
        for token in 0..record.len() {
            let aux = &record.aux_hidden[token * slots * t..(token + 1) * slots * t];
            let last = &record.last_hidden[token * t..(token + 1) * t];
            for (slot, values) in aux.chunks_exact(t).chain([last]).enumerate() {
                t_row.push(i as u64);
                t_position.push(token as u32);
                t_assistant.push(record.loss_mask[token] != 0);
                t_slot.push(labels[slot].0.as_str());
                t_tap.push(labels[slot].1.as_str());
                t_norm.push(l2(values));
            }
        }
    }
    let rows_frame = DataFrame::new(
        row_index.len(),
        vec![
            Column::new("dataset".into(), vec![dataset.as_str(); row_index.len()]),
            Column::new("row".into(), row_index),
            Column::new("sample_id".into(), sample_ids),
            Column::new("tokens".into(), tokens),
            Column::new("assistant_tokens".into(), assistant_tokens),
        ],
    )?;
    let norms_frame = DataFrame::new(
        t_norm.len(),
        vec![
            Column::new("dataset".into(), vec![dataset.as_str(); t_norm.len()]),
            Column::new("row".into(), t_row),
            Column::new("position".into(), t_position),
            Column::new("assistant".into(), t_assistant),
            Column::new("slot".into(), t_slot),
            Column::new("tap".into(), t_tap),
            Column::new("norm".into(), t_norm),
        ],
    )?;
    Ok(DumpFrames {
        rows: rows_frame,
        norms: norms_frame,
    })
}

fn l2(values: &[f32]) -> f64 {
    values
        .iter()
        .map(|&v| f64::from(v) * f64::from(v))
        .sum::<f64>()
        .sqrt()
}

/// The statistics of one or more dumps.
pub struct DumpStats {
    /// Per dataset: `rows`, `tokens`, `mean_row_tokens`, `max_row_tokens`, `assistant_share`.
    pub datasets: DataFrame,
    /// Per dataset and tap: `tokens`, `norm_mean`, `norm_std` (population), `norm_cv`.
    pub norms: DataFrame,
    /// The same per position bucket ([`POSITION_BUCKETS`]), with `assistant_share`.
    pub norms_by_position: DataFrame,
}

/// Summarises the dumps in `dirs` (at most `limit` rows of each).
pub fn dump_stats(dirs: &[&Path], limit: Option<usize>) -> Result<DumpStats, StatsError> {
    if dirs.is_empty() {
        return Err(StatsError::NoDumps);
    }
    let mut rows = Vec::with_capacity(dirs.len());
    let mut norms = Vec::with_capacity(dirs.len());
    for dir in dirs {
        let frames = read_frames(dir, limit)?;
        rows.push(frames.rows.lazy());
        norms.push(frames.norms.lazy());
    }
    let rows = concat(rows, UnionArgs::default())?;
    let norms = concat(norms, UnionArgs::default())?;
    let datasets = rows
        .group_by_stable([col("dataset")])
        .agg([
            len().alias("rows"),
            col("tokens").sum().alias("tokens"),
            col("tokens").mean().alias("mean_row_tokens"),
            col("tokens").max().alias("max_row_tokens"),
            col("assistant_tokens").sum().alias("assistant_tokens"),
        ])
        .with_column(
            (col("assistant_tokens").cast(DataType::Float64)
                / col("tokens").cast(DataType::Float64))
            .alias("assistant_share"),
        )
        .collect()?;
    let norm_stats = || {
        [
            len().alias("tokens"),
            col("norm").mean().alias("norm_mean"),
            col("norm").std(0).alias("norm_std"),
        ]
    };
    let cv = (col("norm_std") / col("norm_mean")).alias("norm_cv");
    let by_tap = norms
        .clone()
        .group_by_stable([col("dataset"), col("slot"), col("tap")])
        .agg(norm_stats())
        .with_column(cv.clone())
        .collect()?;
    let mut bucket = when(col("position").lt(lit(POSITION_BUCKETS[0].0)))
        .then(lit(POSITION_BUCKETS[0].1))
        .when(col("position").lt(lit(POSITION_BUCKETS[1].0)))
        .then(lit(POSITION_BUCKETS[1].1));
    for (bound, label) in &POSITION_BUCKETS[2..] {
        bucket = bucket
            .when(col("position").lt(lit(*bound)))
            .then(lit(*label));
    }
    let by_position = norms
        .with_column(bucket.otherwise(lit(LAST_BUCKET)).alias("positions"))
        .group_by_stable([col("dataset"), col("slot"), col("tap"), col("positions")])
        .agg(
            norm_stats()
                .into_iter()
                .chain([col("assistant")
                    .cast(DataType::Float64)
                    .mean()
                    .alias("assistant_share")])
                .collect::<Vec<_>>(),
        )
        .with_column(cv)
        .collect()?;
    Ok(DumpStats {
        datasets,
        norms: by_tap,
        norms_by_position: by_position,
    })
}

impl DumpStats {
    /// Writes the three tables into `dir` as `datasets`, `norms` and `norms_by_position`
    /// with the extension `format` (`parquet` or `csv`); each file is written under a temporary
    /// name and renamed when complete. Returns the paths written.
    pub fn export(&self, dir: &Path, format: &str) -> Result<Vec<PathBuf>, StatsError> {
        export_tables(
            dir,
            format,
            &[
                ("datasets", self.datasets.clone()),
                ("norms", self.norms.clone()),
                ("norms_by_position", self.norms_by_position.clone()),
            ],
        )
    }
}

/// Writes `table` to `path` as Parquet (`.parquet`) or CSV (`.csv`), through a temporary name
/// renamed when the file is complete (a failed write leaves nothing under `path`).
pub fn write_table(table: &mut DataFrame, path: &Path) -> Result<(), StatsError> {
    let extension = path.extension().and_then(|e| e.to_str()).unwrap_or("");
    if !matches!(extension, "parquet" | "csv") {
        return Err(StatsError::UnknownFormat {
            path: path.to_path_buf(),
        });
    }
    let io = |source| StatsError::Io {
        path: path.to_path_buf(),
        source,
    };
    let tmp = path.with_extension(format!("{extension}.tmp"));
    let file = fs::File::create(&tmp).map_err(io)?;
    let written = match extension {
        "parquet" => ParquetWriter::new(file).finish(table).map(|_| ()),
        _ => CsvWriter::new(file).finish(table),
    };
    if let Err(e) = written {
        let _ = fs::remove_file(&tmp);
        return Err(e.into());
    }
    fs::rename(&tmp, path).map_err(io)
}

/// The values of the string column `name` of `table` (nulls as empty strings).
pub fn column_strings(table: &DataFrame, name: &str) -> Result<Vec<String>, StatsError> {
    Ok(table
        .column(name)?
        .str()?
        .iter()
        .map(|v| v.unwrap_or_default().to_owned())
        .collect())
}

/// The values of the numeric column `name` of `table`, as f64 (nulls as NaN).
pub fn column_f64s(table: &DataFrame, name: &str) -> Result<Vec<f64>, StatsError> {
    Ok(table
        .column(name)?
        .cast(&DataType::Float64)?
        .f64()?
        .iter()
        .map(|v| v.unwrap_or(f64::NAN))
        .collect())
}

/// A frame as aligned text, every row: floats with 3 decimals, nulls as `-`, text columns
/// aligned left and the others right.
pub fn render(table: &DataFrame) -> String {
    let names: Vec<String> = table
        .get_column_names()
        .iter()
        .map(|n| n.to_string())
        .collect();
    let left: Vec<bool> = table
        .columns()
        .iter()
        .map(|c| c.dtype() == &DataType::String)
        .collect();
    let mut cells: Vec<Vec<String>> = vec![names];
    for i in 0..table.height() {
        let row = table
            .columns()
            .iter()
            .map(|c| match c.get(i) {
                Ok(AnyValue::Float64(v)) => format!("{v:.3}"),
                Ok(AnyValue::Float32(v)) => format!("{v:.3}"),
                Ok(AnyValue::String(s)) => s.to_owned(),
                Ok(AnyValue::StringOwned(s)) => s.to_string(),
                Ok(AnyValue::Null) => "-".to_owned(),
                Ok(v) => v.to_string(),
                Err(_) => "?".to_owned(),
            })
            .collect();
        cells.push(row);
    }
    let widths: Vec<usize> = (0..cells[0].len())
        .map(|j| cells.iter().map(|r| r[j].len()).max().unwrap_or(0))
        .collect();
    cells
        .iter()
        .map(|r| {
            r.iter()
                .zip(&widths)
                .zip(&left)
                .map(|((c, w), left)| {
                    if *left {
                        format!("{c:<w$}")
                    } else {
                        format!("{c:>w$}")
                    }
                })
                .collect::<Vec<_>>()
                .join("  ")
                .trim_end()
                .to_owned()
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// Writes each `(name, table)` into `dir` as `name.format` (`parquet` or `csv`) through
/// [`write_table`] (temporary names, renamed when complete). Returns the paths written.
pub fn export_tables(
    dir: &Path,
    format: &str,
    tables: &[(&str, DataFrame)],
) -> Result<Vec<PathBuf>, StatsError> {
    fs::create_dir_all(dir).map_err(|source| StatsError::Io {
        path: dir.to_path_buf(),
        source,
    })?;
    let mut written = Vec::new();
    for (name, table) in tables {
        let path = dir.join(format!("{name}.{format}"));
        write_table(&mut table.clone(), &path)?;
        written.push(path);
    }
    Ok(written)
}

impl fmt::Display for DumpStats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "per dataset:\n{}", render(&self.datasets))?;
        writeln!(
            f,
            "per-token L2 norm by tap (cv = std / mean):\n{}",
            render(&self.norms)
        )?;
        writeln!(
            f,
            "per-token L2 norm by tap and position:\n{}",
            render(&self.norms_by_position)
        )
    }
}
