//! Opening datasets (registry names or local files, format detection) and the streaming reader.

use std::fs::File;
use std::io::{self, BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use flate2::read::MultiGzDecoder;

use crate::error::Location;
use crate::record::{self, Decoded, Reject};
use crate::scan::{ArrayScanner, BOM};
use crate::{
    Conversation, DataError, Format, ReadStats, SkipReason, Skipped, Split, registry,
    registry_entry,
};

/// Read buffer: large enough that the scanner's per-refill overhead is negligible.
const BUF_SIZE: usize = 1 << 20;
/// Non-blank lines looked at to recognise a JSONL flavour.
const DETECT_LINES: usize = 20;

type Input = Box<dyn BufRead + Send>;

/// Opens `path`, transparently decompressing gzip (recognised by its magic bytes, so the
/// extension does not matter).
pub(crate) fn open_input(path: &Path) -> Result<Input, DataError> {
    let file = File::open(path).map_err(|e| DataError::io(path, e))?;
    let mut reader = BufReader::with_capacity(BUF_SIZE, file);
    let gz = reader
        .fill_buf()
        .map_err(|e| DataError::io(path, e))?
        .starts_with(&[0x1f, 0x8b]);
    Ok(if gz {
        Box::new(BufReader::with_capacity(
            BUF_SIZE,
            MultiGzDecoder::new(reader),
        ))
    } else {
        Box::new(reader)
    })
}

/// Recognises the format from the content: a JSON array is ShareGPT-style; JSONL is told
/// apart by the keys of its first decodable line (`turns`: MT-Bench; `task_id` + `prompt`:
/// HumanEval; `messages` / `conversations`: chat).
pub fn detect_format(path: &Path) -> Result<Format, DataError> {
    let mut input = open_input(path)?;
    let io_err = |e| DataError::io(path, e);
    // Skip a BOM and leading whitespace to see the first significant byte.
    let first = loop {
        let buf = input.fill_buf().map_err(io_err)?;
        if buf.is_empty() {
            return Err(DataError::format(path, "file is empty"));
        }
        let skip = if buf.starts_with(BOM) { 3 } else { 0 };
        match buf[skip..].iter().position(|b| !b.is_ascii_whitespace()) {
            Some(i) => break buf[skip + i],
            None => {
                let n = buf.len();
                input.consume(n);
            }
        }
    };
    match first {
        b'[' => return Ok(Format::ShareGptJson),
        b'{' => {}
        b => {
            return Err(DataError::format(
                path,
                format!("not JSON or JSONL (starts with byte {:?})", b as char),
            ));
        }
    }
    let mut line = Vec::new();
    let mut seen = 0;
    while seen < DETECT_LINES {
        line.clear();
        if input.read_until(b'\n', &mut line).map_err(io_err)? == 0 {
            break;
        }
        if line.iter().all(u8::is_ascii_whitespace) {
            continue;
        }
        seen += 1;
        let line = line.strip_prefix(BOM).unwrap_or(&line);
        let Ok(serde_json::Value::Object(obj)) = serde_json::from_slice(line) else {
            continue;
        };
        if obj.contains_key("turns") {
            return Ok(Format::MtBenchJsonl);
        }
        if obj.contains_key("task_id") && obj.contains_key("prompt") {
            return Ok(Format::HumanEvalJsonl);
        }
        if obj.contains_key("messages") || obj.contains_key("conversations") {
            return Ok(Format::ChatJsonl);
        }
    }
    Err(DataError::format(
        path,
        format!(
            "cannot tell the format: none of the first {seen} lines is a JSON object with \
             `messages`, `conversations`, `turns`, or `task_id` + `prompt`"
        ),
    ))
}

/// Resolves a spec to (registry entry if any, path). A spec equal to a registry name is that
/// dataset; anything else is a path (write `./sharegpt` for a file that shadows a name).
pub(crate) fn resolve(
    spec: &str,
    data_root: &Path,
) -> Result<(Option<&'static crate::DatasetEntry>, PathBuf), DataError> {
    if let Some(entry) = registry_entry(spec) {
        let path = entry.local_path(data_root);
        if !path.is_file() {
            return Err(DataError::NotFetched {
                name: entry.name.clone(),
                path,
            });
        }
        return Ok((Some(entry), path));
    }
    let path = PathBuf::from(spec);
    if path.is_file() {
        return Ok((None, path));
    }
    let known: Vec<_> = registry().iter().map(|e| e.name.as_str()).collect();
    Err(DataError::UnknownDataset {
        spec: spec.to_owned(),
        known: known.join(", "),
    })
}

/// Opens a dataset for streaming.
///
/// `spec` is a registry name (`sharegpt`, `mtbench`, `humaneval`: the file fetched by
/// `scripts/fetch_datasets.sh` under `data_root/<name>/`) or the path of a local file, whose
/// format is detected from its content (see [`detect_format`]). Errors are up front: unknown
/// spec, missing file, unreadable file, unrecognisable format. Bad records never are: they are
/// yielded as [`Skipped`] and counted.
pub fn open_dataset(spec: &str, data_root: &Path) -> Result<DatasetReader, DataError> {
    let (entry, path) = resolve(spec, data_root)?;
    match entry {
        Some(e) => {
            let mut r = DatasetReader::open(&path, Some(e.format))?;
            r.source = e.name.clone();
            r.split = Some(e.split);
            Ok(r)
        }
        None => DatasetReader::open(&path, None),
    }
}

enum Inner {
    Array(ArrayScanner<Input>),
    Lines {
        input: Input,
        line: u64,
        buf: Vec<u8>,
    },
    Done,
}

/// Streams the conversations of one file.
///
/// Iterates `Result<Conversation, Skipped>`: every record yields exactly one item, and a
/// skipped record never ends the iteration (only a read error past the start does, after
/// yielding it as a [`SkipReason::ReadError`] skip). Running counts are in
/// [`DatasetReader::stats`]; callers that do not care about individual skips can
/// `.filter_map(Result::ok)` and read the counts afterwards. `max_samples` is the caller's
/// `.take(n)`.
pub struct DatasetReader {
    path: Arc<Path>,
    source: String,
    format: Format,
    split: Option<Split>,
    require_assistant: bool,
    inner: Inner,
    stats: ReadStats,
}

impl std::fmt::Debug for DatasetReader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DatasetReader")
            .field("path", &self.path)
            .field("source", &self.source)
            .field("format", &self.format)
            .field("split", &self.split)
            .field("require_assistant", &self.require_assistant)
            .field("stats", &self.stats)
            .finish_non_exhaustive()
    }
}

impl DatasetReader {
    /// Opens a local file in `format`, or the detected format when `None`. The source name is
    /// the path as given; the split is the format's implied one ([`Format::implied_split`]).
    pub fn open(path: &Path, format: Option<Format>) -> Result<Self, DataError> {
        let detected = detect_format(path)?;
        let format = match format {
            None => detected,
            // JSONL flavours differ only in keys, which the decoder will report per record;
            // an array where lines are expected (or the reverse) cannot work at all.
            Some(f) if (f == Format::ShareGptJson) != (detected == Format::ShareGptJson) => {
                return Err(DataError::format(
                    path,
                    format!("expected {f}, but the content looks like {detected}"),
                ));
            }
            Some(f) => f,
        };
        let input = open_input(path)?;
        let inner = if format == Format::ShareGptJson {
            match ArrayScanner::new(input).map_err(|e| DataError::io(path, e))? {
                Ok(s) => Inner::Array(s),
                Err(why) => return Err(DataError::format(path, why)),
            }
        } else {
            Inner::Lines {
                input,
                line: 0,
                buf: Vec::new(),
            }
        };
        Ok(DatasetReader {
            path: Arc::from(path),
            source: path.display().to_string(),
            format,
            split: format.implied_split(),
            require_assistant: !format.is_prompt_only(),
            inner,
            stats: ReadStats::default(),
        })
    }

    /// Whether conversations need an assistant message (default: yes for chat formats, no for
    /// the prompt-only evaluation formats). Turn it off to read chat data as prompts, e.g. for
    /// regenerating responses with the target model.
    pub fn require_assistant(mut self, required: bool) -> Self {
        self.require_assistant = required;
        self
    }

    /// The file being read.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Name put into [`Conversation::source`].
    pub fn source(&self) -> &str {
        &self.source
    }

    /// The format being read.
    pub fn format(&self) -> Format {
        self.format
    }

    /// Train/eval split: the registry's for named datasets, [`Format::implied_split`] for
    /// local files (`None`: unknown, the caller decides).
    pub fn split(&self) -> Option<Split> {
        self.split
    }

    /// Counts so far.
    pub fn stats(&self) -> &ReadStats {
        &self.stats
    }

    /// Final counts.
    pub fn into_stats(self) -> ReadStats {
        self.stats
    }

    fn decode(&self, bytes: &[u8]) -> Decoded {
        let text = record::utf8(bytes)?;
        let req = self.require_assistant;
        match self.format {
            Format::ShareGptJson | Format::ChatJsonl => record::decode_chat(text, req),
            Format::MtBenchJsonl => record::decode_mtbench(text, req),
            Format::HumanEvalJsonl => record::decode_humaneval(text, req),
        }
    }

    /// Turns one record's outcome into the yielded item, updating the counts.
    fn finish(&mut self, location: Location, decoded: Decoded) -> Result<Conversation, Skipped> {
        self.stats.records += 1;
        let checked = decoded.map(|p| {
            self.stats.parsed += 1;
            self.stats.parsed_messages += p.messages;
            p.outcome
        });
        match checked {
            Ok(Ok(c)) => {
                self.stats.kept += 1;
                self.stats.messages += c.messages.len() as u64;
                self.stats.leading_assistant_dropped += u64::from(c.leading_assistant_dropped);
                self.stats.consecutive_same_role += u64::from(c.consecutive_same_role);
                let id = c.id.unwrap_or_else(|| match location {
                    Location::Line(n) => format!("line-{n}"),
                    Location::Record { index, .. } => format!("record-{index}"),
                });
                Ok(Conversation {
                    id,
                    messages: c.messages,
                    source: self.source.clone(),
                })
            }
            Ok(Err((reason, detail))) | Err((reason, detail)) => {
                Err(self.skip(location, reason, detail))
            }
        }
    }

    fn skip(&mut self, location: Location, reason: SkipReason, detail: String) -> Skipped {
        self.stats.skipped.add(reason);
        Skipped {
            path: self.path.clone(),
            location,
            reason,
            detail,
        }
    }

    /// A read error: counted as a record (the one being read), ends the iteration.
    fn read_error(&mut self, location: Location, e: io::Error) -> Skipped {
        self.inner = Inner::Done;
        self.stats.records += 1;
        self.skip(location, SkipReason::ReadError, e.to_string())
    }
}

impl Iterator for DatasetReader {
    type Item = Result<Conversation, Skipped>;

    fn next(&mut self) -> Option<Self::Item> {
        let index = self.stats.records + 1;
        match &mut self.inner {
            Inner::Done => None,
            Inner::Array(scanner) => {
                let element = scanner.next_element();
                let (truncated, offset) = (scanner.truncated(), scanner.offset());
                self.stats.truncated = truncated;
                match element {
                    None => {
                        self.inner = Inner::Done;
                        None
                    }
                    Some(Err(e)) => {
                        let loc = Location::Record { index, offset };
                        Some(Err(self.read_error(loc, e)))
                    }
                    Some(Ok(el)) => {
                        let loc = Location::Record {
                            index,
                            offset: el.offset,
                        };
                        let decoded = if el.complete {
                            self.decode(&el.bytes)
                        } else {
                            Err((
                                SkipReason::Malformed,
                                format!(
                                    "file ends inside this record ({} bytes): truncated file",
                                    el.bytes.len()
                                ),
                            ))
                        };
                        Some(self.finish(loc, decoded))
                    }
                }
            }
            Inner::Lines { input, line, buf } => loop {
                buf.clear();
                *line += 1;
                let n = *line;
                match input.read_until(b'\n', buf) {
                    Ok(0) => {
                        self.inner = Inner::Done;
                        return None;
                    }
                    Ok(_) if buf.iter().all(u8::is_ascii_whitespace) => continue,
                    Ok(_) => {
                        let bytes = std::mem::take(buf);
                        let decoded = self.decode(&bytes);
                        // Hand the allocation back for the next line.
                        if let Inner::Lines { buf, .. } = &mut self.inner {
                            *buf = bytes;
                        }
                        return Some(self.finish(Location::Line(n), decoded));
                    }
                    Err(e) => return Some(Err(self.read_error(Location::Line(n), e))),
                }
            },
        }
    }
}

/// Reads a JSONL file (plain or gzip) strictly: `f` decodes each non-blank line, and the first
/// bad line is an error naming it. For evaluation sets, where a silently missing prompt would
/// change the benchmark.
pub(crate) fn read_jsonl_strict<T>(
    path: &Path,
    mut f: impl FnMut(&str) -> Result<T, Reject>,
) -> Result<Vec<T>, DataError> {
    let mut input = open_input(path)?;
    let mut out = Vec::new();
    let mut buf = Vec::new();
    for n in 1u64.. {
        buf.clear();
        if input
            .read_until(b'\n', &mut buf)
            .map_err(|e| DataError::io(path, e))?
            == 0
        {
            break;
        }
        if buf.iter().all(u8::is_ascii_whitespace) {
            continue;
        }
        let item = record::utf8(&buf)
            .and_then(&mut f)
            .map_err(|(reason, detail)| DataError::Record {
                path: path.to_owned(),
                location: Location::Line(n),
                reason: format!("{reason}: {detail}"),
            })?;
        out.push(item);
    }
    Ok(out)
}
