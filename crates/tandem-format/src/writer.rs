//! Writing a dump directory: shards under a temporary name, renamed when complete, and
//! `manifest.json` rewritten after every shard. Opening an existing directory resumes it.

use std::fs::{self, File};
use std::io::{self, BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use arrow_ipc::CompressionType;
use arrow_ipc::writer::{FileWriter, IpcWriteOptions};
use arrow_schema::{ArrowError, SchemaRef};

use crate::error::FormatError;
use crate::layout::{Layout, META_SHARD};
use crate::manifest::{DumpManifest, MANIFEST_FILE, ShardInfo};
use crate::reader::{DumpRecord, is_temp_shard_name, scan_shards, shard_name, temp_shard_name};

/// When a shard is closed and the next one started.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShardLimits {
    /// Close a shard after this many rows.
    pub max_rows: u64,
    /// Close a shard once its uncompressed hidden states reach this many bytes.
    pub max_bytes: u64,
}

impl Default for ShardLimits {
    fn default() -> Self {
        ShardLimits {
            max_rows: 4096,
            max_bytes: 512 << 20,
        }
    }
}

/// The file under a shard: a plain file, or (tests only) one that reports a full disk once a
/// byte budget shared by all shards of the run is spent, to prove that a failed write leaves
/// the completed shards valid.
enum Sink {
    File(File),
    Limited { file: File, left: Arc<AtomicU64> },
}

impl Sink {
    fn file(&self) -> &File {
        match self {
            Sink::File(f) | Sink::Limited { file: f, .. } => f,
        }
    }
}

impl Write for Sink {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Sink::File(f) => f.write(buf),
            Sink::Limited { file, left } => {
                let budget = left.load(Ordering::Relaxed);
                if budget == 0 {
                    return Err(io::Error::new(
                        io::ErrorKind::StorageFull,
                        "No space left on device (simulated)",
                    ));
                }
                let n = (buf.len() as u64).min(budget) as usize;
                let n = file.write(&buf[..n])?;
                left.fetch_sub(n as u64, Ordering::Relaxed);
                Ok(n)
            }
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        match self {
            Sink::File(f) | Sink::Limited { file: f, .. } => f.flush(),
        }
    }
}

struct OpenShard {
    tmp: PathBuf,
    writer: FileWriter<BufWriter<Sink>>,
    hidden_bytes: u64,
}

/// Writes rows into a dump directory, one dataset record at a time.
///
/// Every dataset record is accounted for exactly once, in order: [`DumpWriter::write`] for a
/// record that became a row, [`DumpWriter::skip`] for one that did not. A shard covers a
/// contiguous range of records and is closed after a row once it reaches its [`ShardLimits`];
/// it is written as `.shard-NNNNN.arrow.tmp`, synced, and renamed to `shard-NNNNN.arrow`, then
/// `manifest.json` is rewritten. After a crash, [`DumpWriter::open`] on the same directory
/// deletes the temporary shard and continues at [`DumpWriter::next_record`].
pub struct DumpWriter {
    dir: PathBuf,
    manifest: DumpManifest,
    layout: Layout,
    schema: SchemaRef,
    limits: ShardLimits,
    /// The shard being formed: its counts so far (its file exists once it has a row).
    pending: ShardInfo,
    open: Option<OpenShard>,
    fail_after_bytes: Option<Arc<AtomicU64>>,
}

impl std::fmt::Debug for DumpWriter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DumpWriter")
            .field("dir", &self.dir)
            .field("rows", &self.manifest.rows)
            .field("next_record", &self.next_record())
            .finish()
    }
}

impl DumpWriter {
    /// Opens `dir` for a dump described by `identity` (a manifest whose counts are ignored).
    ///
    /// A missing or empty directory starts a new dump. A directory holding a dump with the
    /// same identity is resumed: its temporary shards are deleted, its completed shards kept.
    /// A dump with another identity is refused with one sentence per difference (the wiring
    /// check's first); a non-empty directory without `manifest.json` is refused too.
    pub fn open(
        dir: &Path,
        identity: &DumpManifest,
        limits: ShardLimits,
    ) -> Result<Self, FormatError> {
        let identity = identity.identity();
        fs::create_dir_all(dir).map_err(FormatError::io("create directory", dir))?;
        let manifest_path = dir.join(MANIFEST_FILE);
        let manifest = if manifest_path.is_file() {
            let existing = DumpManifest::load(&manifest_path)?;
            let differences = existing.differences(&identity);
            if !differences.is_empty() {
                return Err(FormatError::ManifestMismatch {
                    dir: dir.to_owned(),
                    differences,
                });
            }
            // Keep the directory's identity, but the producer (device, version) of this run.
            let mut manifest = identity.clone();
            manifest.shards = scan_shards(dir, &identity)?
                .into_iter()
                .map(|s| s.info)
                .collect();
            manifest.recount();
            // Still complete only if the shards are the ones the manifest described.
            manifest.complete = existing.complete && existing.records_read == manifest.records_read;
            manifest
        } else {
            let mut foreign = Vec::new();
            for entry in fs::read_dir(dir).map_err(FormatError::io("list", dir))? {
                let entry = entry.map_err(FormatError::io("list", dir))?;
                let name = entry.file_name().to_string_lossy().into_owned();
                if !is_temp_shard_name(&name) && !name.starts_with(&format!(".{MANIFEST_FILE}")) {
                    foreign.push(name);
                }
            }
            if !foreign.is_empty() {
                foreign.sort();
                return Err(FormatError::NotADump {
                    path: dir.to_owned(),
                    reason: format!(
                        "the directory is not empty ({}) and has no {MANIFEST_FILE}; refusing \
                         to write a dump into it",
                        foreign.join(", ")
                    ),
                });
            }
            identity.clone()
        };
        // Temporary shards are incomplete by construction: the records they held are re-read.
        for entry in fs::read_dir(dir).map_err(FormatError::io("list", dir))? {
            let entry = entry.map_err(FormatError::io("list", dir))?;
            if is_temp_shard_name(&entry.file_name().to_string_lossy()) {
                fs::remove_file(entry.path()).map_err(FormatError::io("remove", entry.path()))?;
            }
        }
        manifest.save(&manifest_path)?;
        let layout = Layout::of(&manifest);
        let schema = layout.schema(&manifest);
        let pending = Self::new_pending(&manifest);
        Ok(DumpWriter {
            dir: dir.to_owned(),
            manifest,
            layout,
            schema,
            limits,
            pending,
            open: None,
            fail_after_bytes: None,
        })
    }

    /// Tests only: shard writes report a full disk once `bytes` bytes (over all shards of
    /// this writer) have been written.
    #[doc(hidden)]
    pub fn simulate_full_disk_after(&mut self, bytes: u64) {
        self.fail_after_bytes = Some(Arc::new(AtomicU64::new(bytes)));
    }

    fn new_pending(manifest: &DumpManifest) -> ShardInfo {
        let start = manifest.records_read;
        ShardInfo {
            file: shard_name(manifest.shards.len()),
            rows: 0,
            tokens: 0,
            assistant_tokens: 0,
            first_record: start,
            end_record: start,
            skipped: Default::default(),
            truncated: 0,
        }
    }

    /// The manifest with the completed shards (the shard being written is not counted).
    pub fn manifest(&self) -> &DumpManifest {
        &self.manifest
    }

    /// The dataset record (0-based ordinal) the next call accounts for.
    pub fn next_record(&self) -> u64 {
        self.pending.end_record
    }

    /// Rows written, including those of the shard being written.
    pub fn rows(&self) -> u64 {
        self.manifest.rows + self.pending.rows
    }

    /// Accounts for the next record as skipped for `reason`.
    pub fn skip(&mut self, reason: &str) {
        *self.pending.skipped.entry(reason.to_owned()).or_insert(0) += 1;
        self.pending.end_record += 1;
    }

    /// Writes the next record as a row; closes the shard when it is full.
    pub fn write(&mut self, record: &DumpRecord, truncated: bool) -> Result<(), FormatError> {
        // The dataset record: one rank of a data-parallel dump counts its own records, but
        // each row names its record in the whole dataset, as a single-process dump does.
        let local = self.pending.end_record;
        let source_index = self
            .manifest
            .partition
            .map_or(local, |p| p.global_record(local));
        let batch = self
            .layout
            .encode(&self.schema, record, source_index)
            .map_err(|e| FormatError::BadShard {
                path: self.dir.join(&self.pending.file),
                reason: e.to_string(),
            })?;
        if self.open.is_none() {
            self.open = Some(self.create_shard()?);
        }
        let open = self.open.as_mut().expect("just opened");
        if let Err(e) = open.writer.write(&batch) {
            return Err(self.write_failed(e));
        }
        open.hidden_bytes += ((record.aux_hidden.len() + record.last_hidden.len()) * 2) as u64;
        self.pending.rows += 1;
        self.pending.tokens += record.input_ids.len() as u64;
        self.pending.assistant_tokens +=
            record.loss_mask.iter().map(|&m| u64::from(m)).sum::<u64>();
        self.pending.truncated += u64::from(truncated);
        self.pending.end_record += 1;
        let full = self.pending.rows >= self.limits.max_rows
            || self
                .open
                .as_ref()
                .is_some_and(|o| o.hidden_bytes >= self.limits.max_bytes);
        if full {
            self.close_shard()?;
        }
        Ok(())
    }

    fn create_shard(&self) -> Result<OpenShard, FormatError> {
        let n = self.manifest.shards.len();
        let tmp = self.dir.join(temp_shard_name(n));
        let file = File::create(&tmp).map_err(|source| self.shard_error(&tmp, source))?;
        let sink = match &self.fail_after_bytes {
            Some(left) => Sink::Limited {
                file,
                left: left.clone(),
            },
            None => Sink::File(file),
        };
        let options = IpcWriteOptions::default()
            .try_with_compression(Some(CompressionType::ZSTD))
            .map_err(FormatError::arrow(&tmp))?;
        let writer = FileWriter::try_new_with_options(
            BufWriter::with_capacity(1 << 20, sink),
            &self.schema,
            options,
        )
        .map_err(|e| self.arrow_write_error(&tmp, e))?;
        Ok(OpenShard {
            tmp,
            writer,
            hidden_bytes: 0,
        })
    }

    fn shard_error(&self, path: &Path, source: io::Error) -> FormatError {
        FormatError::ShardWrite {
            path: path.to_owned(),
            dir: self.dir.clone(),
            completed_shards: self.manifest.shards.len(),
            completed_rows: self.manifest.rows,
            source,
        }
    }

    fn arrow_write_error(&self, path: &Path, e: ArrowError) -> FormatError {
        match e {
            ArrowError::IoError(_, source) => self.shard_error(path, source),
            other => FormatError::Arrow {
                path: path.to_owned(),
                source: other,
            },
        }
    }

    /// Turns a failed write into an error and removes the temporary shard (best effort: the
    /// disk may be full or gone, and the first error is what matters).
    fn write_failed(&mut self, e: ArrowError) -> FormatError {
        let open = self.open.take().expect("a shard is open");
        let err = self.arrow_write_error(&open.tmp, e);
        drop(open.writer);
        let _ = fs::remove_file(&open.tmp);
        err
    }

    /// Completes the current shard: footer with its [`ShardInfo`], sync, rename, manifest.
    fn close_shard(&mut self) -> Result<(), FormatError> {
        if self.open.is_none() {
            if self.pending.end_record == self.pending.first_record {
                return Ok(());
            }
            // Skips only: an empty shard still records them and the record range.
            self.open = Some(self.create_shard()?);
        }
        let info_json = serde_json::to_string(&self.pending).expect("shard info serialises");
        let mut open = self.open.take().expect("checked above");
        open.writer.write_metadata(META_SHARD, info_json);
        if let Err(e) = open.writer.finish() {
            self.open = Some(open);
            return Err(self.write_failed(e));
        }
        let tmp = open.tmp.clone();
        let sink = match open.writer.into_inner() {
            Ok(buf) => buf.into_inner().map_err(|e| e.into_error()),
            Err(e) => Err(match e {
                ArrowError::IoError(_, source) => source,
                other => io::Error::other(other.to_string()),
            }),
        };
        let synced = sink.and_then(|sink| sink.file().sync_all());
        if let Err(source) = synced {
            let _ = fs::remove_file(&tmp);
            return Err(self.shard_error(&tmp, source));
        }
        let path = self.dir.join(&self.pending.file);
        if let Err(source) = fs::rename(&tmp, &path) {
            let _ = fs::remove_file(&tmp);
            return Err(self.shard_error(&tmp, source));
        }
        // Durability of the rename itself; not fatal where directories cannot be synced.
        if let Ok(d) = File::open(&self.dir) {
            let _ = d.sync_all();
        }
        self.manifest.shards.push(self.pending.clone());
        self.manifest.recount();
        self.pending = Self::new_pending(&self.manifest);
        self.manifest.save(&self.dir.join(MANIFEST_FILE))
    }

    /// Closes the shard being written (an empty one if only skips are pending) and writes the
    /// final manifest; `complete` says whether the whole dataset has been read.
    pub fn finish(mut self, complete: bool) -> Result<DumpManifest, FormatError> {
        self.close_shard()?;
        self.manifest.complete = complete;
        self.manifest.save(&self.dir.join(MANIFEST_FILE))?;
        Ok(self.manifest)
    }

    /// Abandons the shard being written (its temporary file is removed); the completed shards
    /// and the manifest stay as they are. For runs that end on an error.
    pub fn abandon(mut self) {
        if let Some(open) = self.open.take() {
            drop(open.writer);
            let _ = fs::remove_file(&open.tmp);
        }
    }
}
