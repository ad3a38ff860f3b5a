//! Training data: one or more dumps read as one row space, the train/validation split, the
//! seeded epoch plan (shuffle + length bucketing) and batch assembly.
//!
//! Everything here is deterministic from the seed, so a resumed run re-derives exactly the
//! batches it would have seen.

use std::path::PathBuf;

use sha2::{Digest, Sha256};
pub use tandem_format::SampleSource;
use tandem_format::{DumpReader, DumpRecord, FormatError};
use tandem_wiring::{DumpRef, WiringManifest};

use crate::error::TrainError;

/// Rows held in memory (tests, small experiments).
#[derive(Debug, Clone)]
pub struct MemorySource {
    /// Wiring of the rows.
    pub wiring: WiringManifest,
    /// T.
    pub hidden_size: usize,
    /// The rows.
    pub records: Vec<DumpRecord>,
    /// Name for messages.
    pub name: String,
}

impl SampleSource for MemorySource {
    fn wiring(&self) -> &WiringManifest {
        &self.wiring
    }
    fn hidden_size(&self) -> usize {
        self.hidden_size
    }
    fn num_slots(&self) -> usize {
        self.wiring.taps.len()
    }
    fn len(&self) -> usize {
        self.records.len()
    }
    fn read(&self, index: usize) -> Result<DumpRecord, FormatError> {
        self.records
            .get(index)
            .cloned()
            .ok_or(FormatError::RowOutOfRange {
                index,
                len: self.records.len(),
            })
    }
    fn name(&self) -> String {
        self.name.clone()
    }
    /// Rows and tokens counted in memory; no manifest, dataset or generation settings.
    fn dump_ref(&self) -> DumpRef {
        DumpRef {
            name: self.name.clone(),
            path: self.name.clone(),
            manifest_sha256: None,
            dataset: None,
            regenerated: None,
            rows: self.records.len() as u64,
            tokens: self.records.iter().map(|r| r.len() as u64).sum(),
            stage: None,
        }
    }
}

/// Several sources read as one row space (row `i` of source `k` is global row
/// `starts[k] + i`). Their wiring must agree (checked by the trainer).
pub struct Dataset {
    sources: Vec<Box<dyn SampleSource>>,
    starts: Vec<usize>,
}

impl std::fmt::Debug for Dataset {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let names: Vec<String> = self.sources.iter().map(|s| s.name()).collect();
        f.debug_struct("Dataset")
            .field("sources", &names)
            .field("rows", &self.len())
            .finish()
    }
}

impl Dataset {
    /// Concatenates `sources` (at least one).
    pub fn new(sources: Vec<Box<dyn SampleSource>>) -> Result<Self, TrainError> {
        if sources.is_empty() {
            return Err(TrainError::InvalidOption {
                option: "dump",
                reason: "at least one dump directory is needed".to_owned(),
            });
        }
        let mut starts = Vec::with_capacity(sources.len() + 1);
        let mut total = 0;
        for s in &sources {
            starts.push(total);
            total += s.len();
        }
        starts.push(total);
        Ok(Dataset { sources, starts })
    }

    /// Opens dump directories.
    pub fn open(dirs: &[PathBuf]) -> Result<Self, TrainError> {
        let mut sources: Vec<Box<dyn SampleSource>> = Vec::new();
        for dir in dirs {
            sources.push(Box::new(DumpReader::open(dir)?));
        }
        Self::new(sources)
    }

    /// The sources, in order.
    pub fn sources(&self) -> &[Box<dyn SampleSource>] {
        &self.sources
    }

    /// Total rows.
    pub fn len(&self) -> usize {
        *self.starts.last().unwrap_or(&0)
    }

    /// Whether there are no rows.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Global row `index`.
    pub fn read(&self, index: usize) -> Result<DumpRecord, TrainError> {
        let k = self.starts.partition_point(|&s| s <= index) - 1;
        if k >= self.sources.len() {
            return Err(TrainError::NoData {
                reason: format!("row {index} of {}", self.len()),
            });
        }
        Ok(self.sources[k].read(index - self.starts[k])?)
    }

    /// The first source's wiring (all agree once checked).
    pub fn wiring(&self) -> &WiringManifest {
        self.sources[0].wiring()
    }
}

/// SplitMix64: a tiny, fixed PRNG, so that shuffles never change with a dependency's version.
#[derive(Debug, Clone)]
pub struct SplitMix64(u64);

impl SplitMix64 {
    /// Seeded generator.
    pub fn new(seed: u64) -> Self {
        SplitMix64(seed)
    }
    /// Next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in `0..n` (n > 0).
    pub fn below(&mut self, n: usize) -> usize {
        ((u128::from(self.next_u64()) * n as u128) >> 64) as usize
    }
    /// Fisher-Yates shuffle.
    pub fn shuffle<T>(&mut self, items: &mut [T]) {
        for i in (1..items.len()).rev() {
            let j = self.below(i + 1);
            items.swap(i, j);
        }
    }
}

/// Whether a sample belongs to the validation split: SHA-256 of its sample id, read as a
/// fraction of 2^64, below `val_fraction`. Rows sharing an id (datasets repeat some) always
/// land on the same side, so no conversation is both trained and validated on.
pub fn is_validation(sample_id: &str, val_fraction: f64) -> bool {
    let digest = Sha256::digest(sample_id.as_bytes());
    let x = u64::from_be_bytes(digest[..8].try_into().expect("8 bytes"));
    (x as f64) / 2f64.powi(64) < val_fraction
}

/// One row's entry in the index built by the trainer's first pass.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RowInfo {
    /// Global row index.
    pub index: usize,
    /// Tokens used for training (after `--max-len`).
    pub len: usize,
}

/// The batches of epoch `epoch`, as lists of global row indices.
///
/// Rows are shuffled with a generator seeded by `(seed, epoch)`, cut into windows of
/// `batch_size * bucket_batches` rows, each window sorted by length (length bucketing: little
/// padding), cut into batches of `batch_size`, and the batches of all windows shuffled again.
pub fn plan_epoch(
    rows: &[RowInfo],
    batch_size: usize,
    bucket_batches: usize,
    seed: u64,
    epoch: usize,
) -> Vec<Vec<usize>> {
    let batch_size = batch_size.max(1);
    let mut rng = SplitMix64::new(seed ^ (epoch as u64).wrapping_mul(0xA076_1D64_78BD_642F));
    let mut order: Vec<&RowInfo> = rows.iter().collect();
    rng.shuffle(&mut order);
    let mut batches = Vec::new();
    for window in order.chunks(batch_size * bucket_batches.max(1)) {
        let mut window = window.to_vec();
        window.sort_by_key(|r| (r.len, r.index));
        for chunk in window.chunks(batch_size) {
            batches.push(chunk.iter().map(|r| r.index).collect());
        }
    }
    rng.shuffle(&mut batches);
    batches
}

/// A padded batch on the host, ready to upload.
#[derive(Debug, Clone)]
pub struct Batch {
    /// Global row indices.
    pub rows: Vec<usize>,
    /// Real length of each sequence.
    pub lengths: Vec<usize>,
    /// Padded width (longest sequence).
    pub width: usize,
    /// `[batch * width]` token ids (0 in padding).
    pub input_ids: Vec<u32>,
    /// `[batch * width]` loss mask (0 in padding).
    pub loss_mask: Vec<u8>,
    /// `[batch, width, slots * T]` aux states (0 in padding).
    pub aux: Vec<f32>,
    /// `[batch, width, T]` last-block residual (0 in padding).
    pub last_hidden: Vec<f32>,
}

impl Batch {
    /// Sequences in the batch.
    pub fn size(&self) -> usize {
        self.lengths.len()
    }
    /// Real tokens in the batch.
    pub fn tokens(&self) -> usize {
        self.lengths.iter().sum()
    }
}

/// Reads rows `rows` of `data`, cuts each to `max_len` tokens and pads them to one width.
/// Checks every row's widths against `slots` taps of `hidden` each.
pub fn assemble(
    data: &Dataset,
    rows: &[usize],
    max_len: usize,
    slots: usize,
    hidden: usize,
) -> Result<Batch, TrainError> {
    let mut records = Vec::with_capacity(rows.len());
    for &index in rows {
        let r = data.read(index)?;
        check_record(&r, index, slots, hidden)?;
        records.push(r);
    }
    let lengths: Vec<usize> = records.iter().map(|r| r.len().min(max_len)).collect();
    let width = lengths.iter().copied().max().unwrap_or(0);
    let aux_w = slots * hidden;
    let b = records.len();
    let mut batch = Batch {
        rows: rows.to_vec(),
        lengths: lengths.clone(),
        width,
        input_ids: vec![0; b * width],
        loss_mask: vec![0; b * width],
        aux: vec![0.0; b * width * aux_w],
        last_hidden: vec![0.0; b * width * hidden],
    };
    for (i, (r, &n)) in records.iter().zip(&lengths).enumerate() {
        batch.input_ids[i * width..i * width + n].copy_from_slice(&r.input_ids[..n]);
        batch.loss_mask[i * width..i * width + n].copy_from_slice(&r.loss_mask[..n]);
        batch.aux[i * width * aux_w..(i * width + n) * aux_w]
            .copy_from_slice(&r.aux_hidden[..n * aux_w]);
        batch.last_hidden[i * width * hidden..(i * width + n) * hidden]
            .copy_from_slice(&r.last_hidden[..n * hidden]);
    }
    Ok(batch)
}

/// Checks that a row's vectors have the lengths its token count implies.
pub fn check_record(
    r: &DumpRecord,
    index: usize,
    slots: usize,
    hidden: usize,
) -> Result<(), TrainError> {
    let n = r.input_ids.len();
    let bad = |reason: String| TrainError::BadSample {
        index,
        sample_id: r.sample_id.clone(),
        reason,
    };
    if r.loss_mask.len() != n {
        return Err(bad(format!(
            "{} loss-mask entries for {n} tokens",
            r.loss_mask.len()
        )));
    }
    if r.aux_hidden.len() != n * slots * hidden {
        return Err(bad(format!(
            "aux_hidden has {} values, expected {n} tokens x {slots} taps x {hidden}",
            r.aux_hidden.len()
        )));
    }
    if r.last_hidden.len() != n * hidden {
        return Err(bad(format!(
            "last_hidden has {} values, expected {n} tokens x {hidden}",
            r.last_hidden.len()
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splitmix_is_the_reference_sequence() {
        // First outputs of SplitMix64 seeded with 0 (reference values of the algorithm).
        let mut r = SplitMix64::new(0);
        assert_eq!(r.next_u64(), 0xE220_A839_7B1D_CDAF);
        assert_eq!(r.next_u64(), 0x6E78_9E6A_A1B9_65F4);
    }

    #[test]
    fn validation_split_is_by_id_and_near_the_fraction() {
        let ids: Vec<String> = (0..2000).map(|i| format!("conv-{i}")).collect();
        let val = ids.iter().filter(|id| is_validation(id, 0.1)).count();
        assert!(
            (150..250).contains(&val),
            "{val} of 2000 in validation at 10%"
        );
        // Same id, same side; fraction 0 and 1 are all-train / all-validation.
        assert_eq!(is_validation("x", 0.3), is_validation("x", 0.3));
        assert!(!ids.iter().any(|id| is_validation(id, 0.0)));
        assert!(ids.iter().all(|id| is_validation(id, 1.0)));
    }

    #[test]
    fn epoch_plan_covers_every_row_once_buckets_by_length_and_is_seeded() {
        let rows: Vec<RowInfo> = (0..103)
            .map(|i| RowInfo {
                index: i,
                len: (i * 37) % 50 + 1,
            })
            .collect();
        let plan = plan_epoch(&rows, 4, 5, 42, 0);
        let mut seen: Vec<usize> = plan.iter().flatten().copied().collect();
        seen.sort_unstable();
        assert_eq!(seen, (0..103).collect::<Vec<_>>());
        // 103 rows = 5 windows of 20 (5 full batches each) + one window of 3.
        assert_eq!(plan.iter().filter(|b| b.len() < 4).count(), 1);
        assert_eq!(plan, plan_epoch(&rows, 4, 5, 42, 0), "same seed, same plan");
        assert_ne!(
            plan,
            plan_epoch(&rows, 4, 5, 42, 1),
            "next epoch reshuffles"
        );
        assert_ne!(
            plan,
            plan_epoch(&rows, 4, 5, 43, 0),
            "another seed reshuffles"
        );
        // Bucketing: within each batch lengths are sorted neighbours of a window, so the mean
        // spread is far below that of a random batch (~50 * 3/5).
        let len = |i: usize| rows[i].len as f64;
        let spread: f64 = plan
            .iter()
            .map(|b| {
                let l: Vec<f64> = b.iter().map(|&i| len(i)).collect();
                l.iter().cloned().fold(f64::MIN, f64::max)
                    - l.iter().cloned().fold(f64::MAX, f64::min)
            })
            .sum::<f64>()
            / plan.len() as f64;
        assert!(spread < 15.0, "mean length spread in a batch {spread}");
    }
}
