//! Reading a dump directory: [`DumpReader`] (the trainer's entry point) and the shard scan
//! shared with resuming writers.

use std::fs::{self, File};
use std::io::BufReader;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use arrow_ipc::reader::FileReader;

use crate::error::FormatError;
use crate::layout::{Layout, META_MANIFEST, META_SHARD};
use crate::manifest::{DumpManifest, MANIFEST_FILE, ShardInfo, partition_dir_name};

/// One sample of a dump, hidden states widened to f32.
#[derive(Debug, Clone, PartialEq)]
pub struct DumpRecord {
    /// The dataset's id of the conversation (not necessarily unique: ShareGPT repeats some).
    pub sample_id: String,
    /// `n` token ids of the rendered conversation (chat template applied, truncated).
    pub input_ids: Vec<u32>,
    /// `n` flags: 1 where the token belongs to an assistant turn (its content and its
    /// end-of-turn token), 0 for everything the template or the user wrote.
    pub loss_mask: Vec<u8>,
    /// `[n, slots * T]` row-major: for each token, the taps in slot order, concatenated.
    pub aux_hidden: Vec<f32>,
    /// `[n, T]` row-major: the residual stream leaving the last block (block L-1), from which
    /// the trainer recomputes target logits with the final norm and lm_head.
    pub last_hidden: Vec<f32>,
}

impl DumpRecord {
    /// Number of tokens.
    pub fn len(&self) -> usize {
        self.input_ids.len()
    }

    /// Whether the record has no tokens (never true for rows written by `tandem dump`).
    pub fn is_empty(&self) -> bool {
        self.input_ids.is_empty()
    }
}

/// Shard file name for shard number `n`.
pub(crate) fn shard_name(n: usize) -> String {
    format!("shard-{n:05}.arrow")
}

/// Temporary name of shard `n` while it is written.
pub(crate) fn temp_shard_name(n: usize) -> String {
    format!(".shard-{n:05}.arrow.tmp")
}

fn is_shard_name(name: &str) -> bool {
    name.strip_prefix("shard-")
        .and_then(|rest| rest.strip_suffix(".arrow"))
        .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
}

pub(crate) fn is_temp_shard_name(name: &str) -> bool {
    name.starts_with(".shard-") && name.ends_with(".arrow.tmp")
}

type ShardFile = FileReader<BufReader<File>>;

fn open_shard(path: &Path) -> Result<ShardFile, FormatError> {
    let file = File::open(path).map_err(FormatError::io("open", path))?;
    FileReader::try_new(BufReader::new(file), None).map_err(FormatError::arrow(path))
}

/// A completed shard found on disk.
#[derive(Debug, Clone)]
pub(crate) struct ScannedShard {
    pub path: PathBuf,
    pub info: ShardInfo,
}

/// Lists the completed shards of `dir` in order and checks each against `identity`: same
/// layout, same manifest identity, rows and record ranges contiguous. Temporary shards are
/// ignored (they are incomplete by construction).
pub(crate) fn scan_shards(
    dir: &Path,
    identity: &DumpManifest,
) -> Result<Vec<ScannedShard>, FormatError> {
    let mut names = Vec::new();
    for entry in fs::read_dir(dir).map_err(FormatError::io("list", dir))? {
        let entry = entry.map_err(FormatError::io("list", dir))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        if is_shard_name(&name) {
            names.push(name);
        }
    }
    names.sort();
    let layout = Layout::of(identity);
    let mut shards: Vec<ScannedShard> = Vec::with_capacity(names.len());
    for (n, name) in names.iter().enumerate() {
        let path = dir.join(name);
        let bad = |reason: String| FormatError::BadShard {
            path: path.clone(),
            reason,
        };
        if *name != shard_name(n) {
            return Err(bad(format!(
                "shards must be numbered without gaps; expected {} here",
                shard_name(n)
            )));
        }
        let reader = open_shard(&path)?;
        let schema = reader.schema();
        layout.check_schema(&schema).map_err(bad)?;
        let meta = schema
            .metadata()
            .get(META_MANIFEST)
            .ok_or_else(|| bad(format!("no {META_MANIFEST} schema metadata")))?;
        let shard_identity: DumpManifest =
            serde_json::from_str(meta).map_err(|source| FormatError::Json {
                path: path.join(META_MANIFEST),
                source,
            })?;
        let differences = identity.differences(&shard_identity);
        if !differences.is_empty() {
            return Err(bad(format!(
                "written with other settings than {MANIFEST_FILE}: {}",
                differences.join("; ")
            )));
        }
        let info = reader
            .custom_metadata()
            .get(META_SHARD)
            .ok_or_else(|| bad(format!("no {META_SHARD} footer metadata")))?;
        let info: ShardInfo = serde_json::from_str(info).map_err(|source| FormatError::Json {
            path: path.join(META_SHARD),
            source,
        })?;
        if info.file != *name {
            return Err(bad(format!("its metadata names it {:?}", info.file)));
        }
        if reader.num_batches() as u64 != info.rows {
            return Err(bad(format!(
                "{} record batches but its metadata says {} rows (one batch per row)",
                reader.num_batches(),
                info.rows
            )));
        }
        let expected_first = shards.last().map_or(0, |s| s.info.end_record);
        if info.first_record != expected_first || info.end_record < info.first_record {
            return Err(bad(format!(
                "covers dataset records {}..{}, but the previous shards end at record {}",
                info.first_record, info.end_record, expected_first
            )));
        }
        shards.push(ScannedShard { path, info });
    }
    Ok(shards)
}

/// The rank directories of a data-parallel dump in `dir` (`rank-00000`, ... in order, with
/// no gap), or `None` when `dir` has none.
fn partition_dirs(dir: &Path) -> Result<Option<Vec<PathBuf>>, FormatError> {
    if !dir.is_dir() {
        return Ok(None);
    }
    let mut names = Vec::new();
    for entry in fs::read_dir(dir).map_err(FormatError::io("list", dir))? {
        let entry = entry.map_err(FormatError::io("list", dir))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        if name
            .strip_prefix("rank-")
            .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
            && entry.path().is_dir()
        {
            names.push(name);
        }
    }
    if names.is_empty() {
        return Ok(None);
    }
    names.sort();
    for (rank, name) in names.iter().enumerate() {
        if *name != partition_dir_name(rank) {
            return Err(FormatError::NotADump {
                path: dir.to_owned(),
                reason: format!(
                    "a data-parallel dump needs rank directories without gaps: {} is missing \
                     ({} found)",
                    partition_dir_name(rank),
                    names.join(", ")
                ),
            });
        }
    }
    Ok(Some(names.iter().map(|n| dir.join(n)).collect()))
}

/// Reads a dump directory written by `tandem dump`.
///
/// The shards are authoritative: [`DumpReader::manifest`] is `manifest.json` with the shard
/// list and totals recomputed from the shards found, so a dump interrupted between a shard
/// rename and the manifest rewrite reads completely. Rows are numbered across shards in
/// order. Reads go through one cached open shard (behind a mutex), so sequential iteration
/// opens each shard once; the reader is `Send + Sync`.
pub struct DumpReader {
    dir: PathBuf,
    manifest: DumpManifest,
    /// SHA-256 of `manifest.json` as read by [`DumpReader::open`].
    manifest_sha256: String,
    layout: Layout,
    shards: Vec<ScannedShard>,
    /// `starts[i]`: global index of shard i's first row; one extra entry = total rows.
    starts: Vec<usize>,
    cache: Mutex<Option<(usize, ShardFile)>>,
}

impl std::fmt::Debug for DumpReader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DumpReader")
            .field("dir", &self.dir)
            .field("rows", &self.len())
            .field("shards", &self.shards.len())
            .finish()
    }
}

impl DumpReader {
    /// Opens `dir`: reads and validates `manifest.json`, then checks every completed shard.
    ///
    /// A data-parallel dump (`tandem dump --rank R --world-size W`) is a directory of rank
    /// directories `rank-00000` .. without a manifest of its own: it reads as one dump, the
    /// ranks' rows one rank after the other, once every rank is there with the same identity.
    pub fn open(dir: &Path) -> Result<Self, FormatError> {
        let manifest_path = dir.join(MANIFEST_FILE);
        if !manifest_path.is_file() {
            if let Some(ranks) = partition_dirs(dir)? {
                return Self::open_partitioned(dir, &ranks);
            }
            return Err(FormatError::NotADump {
                path: dir.to_owned(),
                reason: format!("no {MANIFEST_FILE}"),
            });
        }
        let mut manifest = DumpManifest::load(&manifest_path)?;
        let manifest_bytes =
            fs::read(&manifest_path).map_err(FormatError::io("read", &manifest_path))?;
        let manifest_sha256 = tandem_wiring::sha256_hex(&manifest_bytes);
        let shards = scan_shards(dir, &manifest.identity())?;
        manifest.shards = shards.iter().map(|s| s.info.clone()).collect();
        // Keep `complete` from manifest.json only if it describes the same shards.
        let complete = manifest.complete
            && manifest.records_read == manifest.shards.last().map_or(0, |s| s.end_record);
        manifest.recount();
        manifest.complete = complete;
        let mut starts = Vec::with_capacity(shards.len() + 1);
        let mut total = 0usize;
        for s in &shards {
            starts.push(total);
            total += s.info.rows as usize;
        }
        starts.push(total);
        Ok(DumpReader {
            dir: dir.to_owned(),
            layout: Layout::of(&manifest),
            manifest,
            manifest_sha256,
            shards,
            starts,
            cache: Mutex::new(None),
        })
    }

    /// The ranks of a data-parallel dump read as one (see [`DumpReader::open`]).
    fn open_partitioned(dir: &Path, ranks: &[PathBuf]) -> Result<Self, FormatError> {
        let parts: Vec<DumpReader> = ranks
            .iter()
            .map(|r| Self::open(r))
            .collect::<Result<_, _>>()?;
        let world = parts.len();
        let mut reference = parts[0].manifest.identity();
        reference.partition = None;
        for (rank, part) in parts.iter().enumerate() {
            let bad = |reason: String| FormatError::NotADump {
                path: part.dir.clone(),
                reason,
            };
            match part.manifest.partition {
                Some(p) if p.rank == rank && p.world_size == world => {}
                Some(p) => {
                    return Err(bad(format!(
                        "it holds rank {} of {}, but {} is rank {rank} of the {world} rank \
                         directories found in {}",
                        p.rank,
                        p.world_size,
                        partition_dir_name(rank),
                        dir.display()
                    )));
                }
                None => {
                    return Err(bad(
                        "a single-process dump inside a data-parallel dump directory".into(),
                    ));
                }
            }
            let mut identity = part.manifest.identity();
            identity.partition = None;
            let differences = reference.differences(&identity);
            if !differences.is_empty() {
                return Err(bad(format!(
                    "written with other settings than rank 0: {}",
                    differences.join("; ")
                )));
            }
        }
        // Each rank counts its own records (ordinals from 0), and each was checked complete
        // against its own shards when opened.
        let records_read: u64 = parts.iter().map(|p| p.manifest.records_read).sum();
        let complete = parts.iter().all(|p| p.manifest.complete);
        let mut manifest = parts[0].manifest.clone();
        manifest.partition = None;
        manifest.shards.clear();
        let mut shards = Vec::new();
        let mut hashes = String::new();
        for (rank, part) in parts.into_iter().enumerate() {
            hashes.push_str(&part.manifest_sha256);
            for shard in part.shards {
                let mut info = shard.info.clone();
                info.file = format!("{}/{}", partition_dir_name(rank), info.file);
                manifest.shards.push(info);
                shards.push(shard);
            }
        }
        manifest.recount();
        manifest.records_read = records_read;
        manifest.complete = complete;
        let mut starts = Vec::with_capacity(shards.len() + 1);
        let mut total = 0usize;
        for s in &shards {
            starts.push(total);
            total += s.info.rows as usize;
        }
        starts.push(total);
        Ok(DumpReader {
            dir: dir.to_owned(),
            layout: Layout::of(&manifest),
            manifest,
            // One hash over the ranks' manifest hashes, in rank order.
            manifest_sha256: tandem_wiring::sha256_hex(hashes.as_bytes()),
            shards,
            starts,
            cache: Mutex::new(None),
        })
    }

    /// The dump's manifest (totals from the shards).
    pub fn manifest(&self) -> &DumpManifest {
        &self.manifest
    }

    /// The directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Lowercase hex SHA-256 of the directory's `manifest.json` as it was opened (what
    /// `sha256sum DIR/manifest.json` prints while the dump is unchanged).
    pub fn manifest_sha256(&self) -> &str {
        &self.manifest_sha256
    }

    /// What a head trained on this dump records about it (`tandem_wiring.trained_on`): the
    /// directory name and path, the manifest hash, the dataset, whether it was regenerated,
    /// rows and tokens (totals recounted from the shards).
    pub fn dump_ref(&self) -> tandem_wiring::DumpRef {
        // `.` or `..` name no directory; the resolved path does.
        let resolved = fs::canonicalize(&self.dir).unwrap_or_else(|_| self.dir.clone());
        let name = resolved
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| self.dir.display().to_string());
        tandem_wiring::DumpRef {
            name,
            path: self.dir.display().to_string(),
            manifest_sha256: Some(self.manifest_sha256.clone()),
            dataset: Some(self.manifest.dataset.clone()),
            regenerated: Some(self.manifest.settings.regenerate.is_some()),
            rows: self.manifest.rows,
            tokens: self.manifest.tokens,
            stage: None,
        }
    }

    /// Number of rows (samples).
    pub fn len(&self) -> usize {
        *self.starts.last().unwrap_or(&0)
    }

    /// Whether the dump has no rows.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Row `index` (0-based across all shards).
    pub fn read(&self, index: usize) -> Result<DumpRecord, FormatError> {
        if index >= self.len() {
            return Err(FormatError::RowOutOfRange {
                index,
                len: self.len(),
            });
        }
        // Last shard whose first row is <= index (empty shards are skipped over).
        let shard = self.starts.partition_point(|&s| s <= index) - 1;
        let row = index - self.starts[shard];
        let path = &self.shards[shard].path;
        let mut cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
        if cache.as_ref().is_none_or(|(i, _)| *i != shard) {
            *cache = Some((shard, open_shard(path)?));
        }
        let (_, reader) = cache.as_mut().expect("just filled");
        reader.set_index(row).map_err(FormatError::arrow(path))?;
        let batch = reader
            .next()
            .ok_or_else(|| FormatError::BadShard {
                path: path.clone(),
                reason: format!("record batch {row} is missing"),
            })?
            .map_err(FormatError::arrow(path))?;
        if batch.num_rows() != 1 {
            return Err(FormatError::BadShard {
                path: path.clone(),
                reason: format!(
                    "record batch {row} has {} rows; this layout has one row per batch",
                    batch.num_rows()
                ),
            });
        }
        self.layout
            .decode(&batch, 0)
            .map_err(|reason| FormatError::BadShard {
                path: path.clone(),
                reason,
            })
    }

    /// All rows in order.
    pub fn iter(&self) -> impl Iterator<Item = Result<DumpRecord, FormatError>> + '_ {
        (0..self.len()).map(|i| self.read(i))
    }
}
