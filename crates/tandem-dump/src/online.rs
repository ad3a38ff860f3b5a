//! Online capture (`tandem train --online`): the rows a dump of the same options would hold,
//! captured through the same hook when the trainer asks for them, with no shard on disk.
//!
//! A multi-million-token dump of four taps is tens of GB, and a GPU machine often starts empty;
//! the conversations themselves are a few MB (e.g. `datasets/regenerated/`). Online capture
//! reads and tokenizes the dataset up front (the row space, the split and the draft vocabulary
//! need every row's ids), then runs [`capture`] for a row when it is read, exactly as
//! `tandem dump` does for a shard. So a row read here equals the row a dump would have written
//! (up to the dump's bf16/f16 storage rounding), and the manifest is the dump's identity with
//! the counts filled in: a head trained online carries the same wiring.

use std::collections::BTreeMap;
use std::sync::Mutex;

use tandem_data::{Split, open_dataset};
use tandem_format::{FormatError, SampleSource};
use tandem_model::{TapRequest, TargetTokenizer};
use tandem_wiring::{DumpRef, WiringManifest, sha256_hex};

use crate::error::DumpError;
use crate::job::{DumpOptions, capture, check_options, dump_identity, to_chat};
use crate::manifest::{DumpManifest, StorageDtype};
use crate::mask::{MaskedTokens, tokenize_conversation};
use crate::reader::DumpRecord;
use tandem_model::CaptureTarget;

/// A dataset whose rows are captured from the target on demand.
pub struct OnlineCapture {
    manifest: DumpManifest,
    manifest_sha256: String,
    /// (sample id, token ids and loss mask) per row, in dataset order.
    rows: Vec<(String, MaskedTokens)>,
    request: TapRequest,
    /// One target serves every reader thread, one capture at a time.
    target: Mutex<Box<dyn CaptureTarget + Send>>,
}

impl std::fmt::Debug for OnlineCapture {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OnlineCapture")
            .field("dataset", &self.manifest.dataset)
            .field("rows", &self.rows.len())
            .finish()
    }
}

impl OnlineCapture {
    /// Reads and tokenizes `options.dataset` (its own assistant turns: online capture does not
    /// regenerate; regenerate once with `tandem dump --regenerate` and keep the conversations),
    /// up to `options.max_samples` rows, and keeps `load()`'s target for the captures.
    pub fn open(
        options: &DumpOptions,
        load: impl FnOnce() -> Result<Box<dyn CaptureTarget + Send>, DumpError>,
    ) -> Result<Self, DumpError> {
        if options.regenerate.is_some() {
            return Err(DumpError::InvalidOption {
                option: "--online",
                reason: "online capture trains on the dataset's own replies; regenerate them \
                         once with `tandem dump --regenerate` (its conversations-*.jsonl files) \
                         and train online on those"
                    .to_owned(),
            });
        }
        check_options(options)?;
        let tokenizer = TargetTokenizer::load(&options.model_dir)?;
        let reader = open_dataset(&options.dataset, &options.data_root)?;
        let split = reader.split();
        if split == Some(Split::Eval) && !options.allow_eval {
            return Err(DumpError::EvalDataset {
                dataset: options.dataset.clone(),
            });
        }
        let mut manifest = dump_identity(options, &tokenizer, split)?;
        let template_sha = manifest.chat_template_sha256.clone().unwrap_or_default();
        let mut rows = Vec::new();
        let mut skipped: BTreeMap<String, u64> = BTreeMap::new();
        let mut records_read = 0u64;
        for item in reader {
            if options
                .max_samples
                .is_some_and(|max| rows.len() as u64 >= max)
            {
                break;
            }
            records_read += 1;
            let conversation = match item {
                Ok(c) => c,
                Err(skip) => {
                    *skipped.entry(skip.reason.to_string()).or_default() += 1;
                    continue;
                }
            };
            match tokenize_conversation(
                &tokenizer,
                &template_sha,
                &to_chat(&conversation),
                options.max_len,
            )? {
                Ok(tokens) => rows.push((conversation.id.clone(), tokens)),
                Err(skip) => *skipped.entry(skip.reason.to_owned()).or_default() += 1,
            }
        }
        if rows.is_empty() {
            return Err(DumpError::InvalidOption {
                option: "--dataset",
                reason: format!(
                    "{} gave no trainable conversation (skipped: {skipped:?})",
                    options.dataset
                ),
            });
        }
        manifest.rows = rows.len() as u64;
        manifest.tokens = rows.iter().map(|(_, t)| t.input_ids.len() as u64).sum();
        manifest.assistant_tokens = rows
            .iter()
            .map(|(_, t)| t.loss_mask.iter().map(|&m| u64::from(m)).sum::<u64>())
            .sum();
        manifest.truncated = rows.iter().filter(|(_, t)| t.truncated).count() as u64;
        manifest.records_read = records_read;
        manifest.skipped = skipped;
        manifest.complete = options.max_samples.is_none();
        let manifest_sha256 = sha256_hex(&serde_json::to_vec(&manifest).expect("serialises"));
        let mut request = manifest.wiring.taps.clone();
        request.push(manifest.last_hidden_tap);
        Ok(Self {
            manifest,
            manifest_sha256,
            rows,
            request: TapRequest::new(request),
            target: Mutex::new(load()?),
        })
    }

    /// The identity a dump of the same options would have, with this dataset's counts.
    pub fn manifest(&self) -> &DumpManifest {
        &self.manifest
    }

    /// Rows.
    pub fn len(&self) -> usize {
        self.rows.len()
    }

    /// Whether there are no rows (never, after [`OnlineCapture::open`]).
    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    /// Row `index`, captured now through the target's hook (as `tandem dump` captures it).
    pub fn read(&self, index: usize) -> Result<DumpRecord, DumpError> {
        let (id, tokens) = self.rows.get(index).ok_or(FormatError::RowOutOfRange {
            index,
            len: self.rows.len(),
        })?;
        let mut record = {
            let target = self.target.lock().unwrap_or_else(|e| e.into_inner());
            capture(target.as_ref(), &self.request, id.clone(), tokens.clone())?
        };
        // Rounded as a dump stores them, so online training sees the values a dump of the
        // same options would give back.
        let dtype = self.manifest.dtype;
        for v in record
            .aux_hidden
            .iter_mut()
            .chain(record.last_hidden.iter_mut())
        {
            *v = match dtype {
                StorageDtype::Bf16 => half::bf16::from_f32(*v).to_f32(),
                StorageDtype::F16 => half::f16::from_f32(*v).to_f32(),
            };
        }
        Ok(record)
    }

    /// What a head trained on these rows records about them: `online:<dataset>`, the sha256
    /// of the manifest JSON (no file: the identity serialised), rows and tokens.
    pub fn dump_ref(&self) -> DumpRef {
        let name = std::path::Path::new(&self.manifest.dataset)
            .file_name()
            .map_or_else(
                || self.manifest.dataset.clone(),
                |n| n.to_string_lossy().into_owned(),
            );
        DumpRef {
            name: format!("online:{name}"),
            path: self.manifest.dataset.clone(),
            manifest_sha256: Some(self.manifest_sha256.clone()),
            dataset: Some(self.manifest.dataset.clone()),
            regenerated: Some(false),
            rows: self.manifest.rows,
            tokens: self.manifest.tokens,
            stage: None,
        }
    }
}

/// `tandem train --online`: rows captured from the target when read, through the hook the
/// dump job uses (no shards on disk).
impl SampleSource for OnlineCapture {
    fn wiring(&self) -> &WiringManifest {
        &self.manifest().wiring
    }
    fn hidden_size(&self) -> usize {
        self.manifest().hidden_size
    }
    fn num_slots(&self) -> usize {
        self.manifest().num_slots
    }
    fn len(&self) -> usize {
        OnlineCapture::len(self)
    }
    fn read(&self, index: usize) -> Result<DumpRecord, FormatError> {
        OnlineCapture::read(self, index).map_err(|e| match e {
            DumpError::Format(e) => e,
            other => FormatError::Source {
                name: SampleSource::name(self),
                source: Box::new(other),
            },
        })
    }
    fn name(&self) -> String {
        format!("online capture of {}", self.manifest().dataset)
    }
    fn split(&self) -> Option<&str> {
        self.manifest().dataset_split.as_deref()
    }
    fn dump_ref(&self) -> DumpRef {
        OnlineCapture::dump_ref(self)
    }
}
