//! How fast `DumpWriter` turns captured records into zstd Arrow shards and `DumpReader` reads
//! them back (one thread each), for a dump's shape (default: Qwen2.5-Coder-1.5B, three
//! 1,536-wide taps and the last block, bf16), next to the unavoidable part (the f32 <-> bf16
//! conversion) in the same run. The capture job writes on a thread of its own; this says
//! whether that thread keeps up with the GPU's capture (15,587 tok/s on the H200 for this
//! shape, BENCHMARKS.md "Issue #18, session 22"), and what one trainer loader thread reads.
//!
//!   cargo run --release -p tandem-format --example dump_throughput [hidden] [slots] [tokens] [rows]

use std::time::Instant;

use tandem_format::{
    DumpManifest, DumpReader, DumpRecord, DumpSettings, DumpWriter, ShardLimits, StorageDtype,
};
use tandem_wiring::{Job, Producer, TapId, TapPoint, TargetFingerprint, WiringManifest};

fn arg(i: usize, default: usize) -> usize {
    std::env::args()
        .nth(i)
        .map_or(default, |a| a.parse().expect("a whole number"))
}

/// Values with the spread of a residual stream (a few units) and random low bits, so zstd sees
/// data as incompressible as real hidden states.
fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            ((x >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 6.0
        })
        .collect()
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let (hidden, slots, tokens, rows) = (arg(1, 1536), arg(2, 3), arg(3, 1024), arg(4, 32));
    let taps: Vec<TapId> = (0..slots).map(TapId::Block).collect();
    let wiring = WiringManifest::new(
        TargetFingerprint {
            architecture: "Qwen2ForCausalLM".into(),
            model_type: "qwen2".into(),
            num_layers: slots + 1,
            hidden_size: hidden,
            vocab_size: 151_936,
            config_sha256: "0".repeat(64),
            tokenizer_sha256: "0".repeat(64),
            chat_template_sha256: None,
        },
        taps,
        TapPoint::ResidualStream,
        "bf16",
        Producer::tandem(Job::Dump, "cpu", "prefill"),
    );
    let identity = DumpManifest::new(
        wiring,
        StorageDtype::Bf16,
        "dump-throughput",
        DumpSettings {
            max_len: tokens,
            regenerate: None,
        },
    );
    let records: Vec<DumpRecord> = (0..rows)
        .map(|r| DumpRecord {
            sample_id: format!("row-{r}"),
            input_ids: (0..tokens as u32)
                .map(|t| (t * 7 + r as u32) % 151_936)
                .collect(),
            loss_mask: (0..tokens).map(|t| u8::from(t > tokens / 4)).collect(),
            aux_hidden: values(tokens * slots * hidden, 2 * r as u64 + 1),
            last_hidden: values(tokens * hidden, 2 * r as u64 + 2),
        })
        .collect();
    let total_tokens = (tokens * rows) as f64;
    let (mut write, mut read, mut convert) = (Vec::new(), Vec::new(), Vec::new());
    for repeat in 0..3 {
        let dir = std::env::temp_dir().join(format!("tandem-dump-throughput-{repeat}"));
        let _ = std::fs::remove_dir_all(&dir);
        let t0 = Instant::now();
        let mut writer = DumpWriter::open(&dir, &identity, ShardLimits::default()).unwrap();
        for record in &records {
            writer.write(record, false).unwrap();
        }
        writer.finish(true).unwrap();
        write.push(total_tokens / t0.elapsed().as_secs_f64());
        let t0 = Instant::now();
        let reader = DumpReader::open(&dir).unwrap();
        for i in 0..reader.len() {
            let r = reader.read(i).unwrap();
            assert_eq!(
                r.aux_hidden.len(),
                tokens * slots * hidden,
                "row {i} read back whole"
            );
        }
        read.push(total_tokens / t0.elapsed().as_secs_f64());
        let t0 = Instant::now();
        let mut sink = 0u16;
        for record in &records {
            let bf16: Vec<half::bf16> = record
                .aux_hidden
                .iter()
                .chain(&record.last_hidden)
                .map(|&v| half::bf16::from_f32(v))
                .collect();
            sink ^= bf16[bf16.len() / 2].to_bits();
        }
        convert.push(total_tokens / t0.elapsed().as_secs_f64());
        std::hint::black_box(sink);
        let _ = std::fs::remove_dir_all(&dir);
    }
    println!(
        "{rows} rows x {tokens} tokens, {slots} taps + last block of width {hidden}, bf16, median of 3"
    );
    println!("| stage | tokens/s |\n|---|---|");
    println!(
        "| DumpWriter::write (encode, zstd, Arrow, shard files) | {:.0} |",
        median(write)
    );
    println!(
        "| DumpReader::read (zstd, Arrow, bf16 -> f32) | {:.0} |",
        median(read)
    );
    println!(
        "| baseline: f32 -> bf16 conversion only | {:.0} |",
        median(convert)
    );
}
