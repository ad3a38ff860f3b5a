//! The polars statistics against sums worked by hand over the same records, and the Parquet and
//! CSV exports read back by pyarrow (an independent reader; CI installs it, see scripts/test.sh).

use std::path::{Path, PathBuf};
use std::process::Command;

use tandem_format::{
    DumpManifest, DumpRecord, DumpSettings, DumpWriter, ShardLimits, StorageDtype,
};
use tandem_stats::{LAST_BUCKET, dump_stats, read_frames};
use tandem_wiring::{Job, Producer, TapId, TapPoint, TargetFingerprint, WiringManifest};

const HIDDEN: usize = 8;
const TAPS: [TapId; 2] = [TapId::Block(1), TapId::Block(2)];

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("tandem-stats-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn identity(dataset: &str) -> DumpManifest {
    let target = TargetFingerprint {
        architecture: "LlamaForCausalLM".into(),
        model_type: "llama".into(),
        num_layers: 4,
        hidden_size: HIDDEN,
        vocab_size: 100,
        config_sha256: "0".repeat(64),
        tokenizer_sha256: "1".repeat(64),
        chat_template_sha256: None,
    };
    let wiring = WiringManifest::new(
        target,
        TAPS.to_vec(),
        TapPoint::ResidualStream,
        StorageDtype::Bf16.as_str(),
        Producer::tandem(Job::Dump, "cpu", "test"),
    );
    DumpManifest::new(
        wiring,
        StorageDtype::Bf16,
        dataset,
        DumpSettings {
            max_len: 2048,
            regenerate: None,
        },
    )
}

/// Rows of the given lengths whose tap values are exact in bf16 (small integers), so the norms
/// worked by hand below are the stored ones.
fn records(lengths: &[usize], seed: u32) -> Vec<DumpRecord> {
    lengths
        .iter()
        .enumerate()
        .map(|(r, &n)| {
            let value = |token: usize, k: usize| {
                ((token as u32 * 7 + k as u32 * 3 + r as u32 + seed) % 9) as f32 - 4.0
            };
            DumpRecord {
                sample_id: format!("s{r}"),
                input_ids: (0..n as u32).map(|t| t % 100).collect(),
                loss_mask: (0..n).map(|t| u8::from(t % 3 != 0)).collect(),
                aux_hidden: (0..n)
                    .flat_map(|t| (0..TAPS.len() * HIDDEN).map(move |k| value(t, k)))
                    .collect(),
                last_hidden: (0..n)
                    .flat_map(|t| (0..HIDDEN).map(move |k| 2.0 * value(t, k + 50)))
                    .collect(),
            }
        })
        .collect()
}

fn write(dir: &Path, dataset: &str, rows: &[DumpRecord]) {
    let mut writer = DumpWriter::open(dir, &identity(dataset), ShardLimits::default()).unwrap();
    for r in rows {
        writer.write(r, false).unwrap();
    }
    writer.finish(true).unwrap();
}

fn l2(v: &[f32]) -> f64 {
    v.iter().map(|&x| f64::from(x).powi(2)).sum::<f64>().sqrt()
}

/// (mean, population std) of `values`.
fn moments(values: &[f64]) -> (f64, f64) {
    let mean = values.iter().sum::<f64>() / values.len() as f64;
    let var = values.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / values.len() as f64;
    (mean, var.sqrt())
}

fn column_f64(df: &polars::prelude::DataFrame, name: &str) -> Vec<f64> {
    tandem_stats::column_f64s(df, name).unwrap()
}

fn column_str(df: &polars::prelude::DataFrame, name: &str) -> Vec<String> {
    tandem_stats::column_strings(df, name).unwrap()
}

#[test]
fn dump_statistics_match_hand_sums_per_dataset_tap_and_position() {
    let root = scratch("hand");
    let (a, b) = (root.join("a"), root.join("b"));
    let rows_a = records(&[5, 70, 300], 0);
    let rows_b = records(&[12, 1030], 4);
    write(&a, "set-a", &rows_a);
    write(&b, "set-b", &rows_b);
    let stats = dump_stats(&[&a, &b], None).unwrap();

    // Per dataset: rows, tokens, row lengths, assistant share.
    assert_eq!(column_str(&stats.datasets, "dataset"), ["set-a", "set-b"]);
    assert_eq!(column_f64(&stats.datasets, "rows"), [3.0, 2.0]);
    assert_eq!(column_f64(&stats.datasets, "tokens"), [375.0, 1042.0]);
    assert_eq!(
        column_f64(&stats.datasets, "max_row_tokens"),
        [300.0, 1030.0]
    );
    let share = |rows: &[DumpRecord]| {
        let (m, n) = rows.iter().fold((0, 0), |(m, n), r| {
            (
                m + r.loss_mask.iter().filter(|&&x| x == 1).count(),
                n + r.len(),
            )
        });
        m as f64 / n as f64
    };
    let shares = column_f64(&stats.datasets, "assistant_share");
    assert!((shares[0] - share(&rows_a)).abs() < 1e-12);
    assert!((shares[1] - share(&rows_b)).abs() < 1e-12);

    // Per tap: slot 1 of set-a, and the last block of set-b, by hand.
    let slot1: Vec<f64> = rows_a
        .iter()
        .flat_map(|r| {
            r.aux_hidden
                .chunks_exact(TAPS.len() * HIDDEN)
                .map(|t| l2(&t[HIDDEN..2 * HIDDEN]))
                .collect::<Vec<_>>()
        })
        .collect();
    let last_b: Vec<f64> = rows_b
        .iter()
        .flat_map(|r| {
            r.last_hidden
                .chunks_exact(HIDDEN)
                .map(l2)
                .collect::<Vec<_>>()
        })
        .collect();
    let slots = column_str(&stats.norms, "slot");
    let datasets = column_str(&stats.norms, "dataset");
    let taps = column_str(&stats.norms, "tap");
    let (means, stds) = (
        column_f64(&stats.norms, "norm_mean"),
        column_f64(&stats.norms, "norm_std"),
    );
    let find = |d: &str, s: &str| {
        (0..slots.len())
            .find(|&i| datasets[i] == d && slots[i] == s)
            .unwrap()
    };
    for (i, want) in [
        (find("set-a", "slot 1"), &slot1),
        (find("set-b", "last"), &last_b),
    ] {
        let (mean, std) = moments(want);
        assert!(
            (means[i] - mean).abs() < 1e-9 * mean,
            "mean {} vs {mean}",
            means[i]
        );
        assert!(
            (stds[i] - std).abs() < 1e-9 * mean,
            "std {} vs {std}",
            stds[i]
        );
    }
    assert_eq!(taps[find("set-a", "slot 1")], "block 2");
    assert_eq!(taps[find("set-b", "last")], "block 3");

    // Per position bucket: set-b's 1030-token row reaches the last bucket, with 6 tokens.
    let p = &stats.norms_by_position;
    let (pd, ps, pb) = (
        column_str(p, "dataset"),
        column_str(p, "slot"),
        column_str(p, "positions"),
    );
    let tokens = column_f64(p, "tokens");
    let last_bucket = (0..pd.len())
        .find(|&i| pd[i] == "set-b" && ps[i] == "slot 0" && pb[i] == LAST_BUCKET)
        .unwrap();
    assert_eq!(tokens[last_bucket], 6.0);
    let first_bucket = (0..pd.len())
        .find(|&i| pd[i] == "set-a" && ps[i] == "last" && pb[i] == "0-63")
        .unwrap();
    // set-a: 5 + 64 + 64 tokens at positions 0..63.
    assert_eq!(tokens[first_bucket], 133.0);

    // A row limit reads the first rows only; the text shows every table.
    let limited = read_frames(&a, Some(1)).unwrap();
    assert_eq!(limited.rows.height(), 1);
    assert_eq!(limited.norms.height(), 5 * (TAPS.len() + 1));
    let text = stats.to_string();
    for needle in ["set-a", "set-b", "slot 1", "block 3", "1024+", "norm_cv"] {
        assert!(text.contains(needle), "{needle:?} missing from:\n{text}");
    }
}

#[test]
fn parquet_and_csv_exports_read_back_with_pyarrow() {
    let root = scratch("export");
    let dump = root.join("d");
    write(&dump, "set-a", &records(&[9, 40], 1));
    let stats = dump_stats(&[&dump], None).unwrap();
    let parquet = stats.export(&root.join("parquet"), "parquet").unwrap();
    let csv = stats.export(&root.join("csv"), "csv").unwrap();
    assert!(
        tandem_stats::write_table(&mut stats.norms.clone(), &root.join("x.json")).is_err(),
        "an unknown extension is refused"
    );
    let has_pyarrow = Command::new("python3")
        .args(["-c", "import pyarrow"])
        .status()
        .is_ok_and(|s| s.success());
    if !has_pyarrow {
        assert!(
            std::env::var_os("CI").is_none(),
            "CI must have pyarrow (scripts/test.sh installs it)"
        );
        eprintln!("skipped: python3 with pyarrow is not installed");
        return;
    }
    // pyarrow reads each table; its norm means and the CSV's must equal polars'.
    let script = r#"
import sys, json, pyarrow.parquet as pq, pyarrow.csv as pc
out = {}
for path in sys.argv[1:]:
    t = pq.read_table(path) if path.endswith(".parquet") else pc.read_csv(path)
    out[path] = {"rows": t.num_rows, "columns": t.column_names,
                 "norm_mean": t.column("norm_mean").to_pylist() if "norm_mean" in t.column_names else None}
print(json.dumps(out))
"#;
    let paths: Vec<String> = parquet
        .iter()
        .chain(&csv)
        .map(|p| p.display().to_string())
        .collect();
    let output = Command::new("python3")
        .arg("-c")
        .arg(script)
        .args(&paths)
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let read: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
    let means = column_f64(&stats.norms, "norm_mean");
    for path in &paths {
        let table = &read[path];
        let name = Path::new(path).file_stem().unwrap().to_str().unwrap();
        let want = match name {
            "datasets" => stats.datasets.height(),
            "norms" => stats.norms.height(),
            _ => stats.norms_by_position.height(),
        };
        assert_eq!(table["rows"].as_u64().unwrap() as usize, want, "{path}");
        if name == "norms" {
            let got: Vec<f64> = table["norm_mean"]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_f64().unwrap())
                .collect();
            for (g, w) in got.iter().zip(&means) {
                assert!((g - w).abs() <= 1e-9 * w, "{path}: {g} vs {w}");
            }
        }
    }
}
