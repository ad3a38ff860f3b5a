//! Rows of training data as the trainer sees them: a dump directory ([`DumpReader`]), rows
//! captured from the target while training (`tandem_dump::OnlineCapture`), or rows in memory.

use tandem_wiring::{DumpRef, WiringManifest};

use crate::error::FormatError;
use crate::reader::{DumpReader, DumpRecord};

/// Rows of training data: what the trainer needs from a dump.
pub trait SampleSource: Send + Sync {
    /// The wiring of every row (taps, target fingerprint).
    fn wiring(&self) -> &WiringManifest;
    /// T: width of one tap.
    fn hidden_size(&self) -> usize;
    /// Taps per token.
    fn num_slots(&self) -> usize;
    /// Rows.
    fn len(&self) -> usize;
    /// Whether there are no rows.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Row `index`.
    fn read(&self, index: usize) -> Result<DumpRecord, FormatError>;
    /// A name for messages (the dump directory).
    fn name(&self) -> String;
    /// The dataset split the rows came from, when known (`train`, `eval`).
    fn split(&self) -> Option<&str> {
        None
    }
    /// What a head trained on these rows records about them (`tandem_wiring.trained_on` of
    /// the exported config.json): name, manifest hash, rows, tokens.
    fn dump_ref(&self) -> DumpRef;
}

impl SampleSource for DumpReader {
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
        DumpReader::len(self)
    }
    fn read(&self, index: usize) -> Result<DumpRecord, FormatError> {
        DumpReader::read(self, index)
    }
    fn name(&self) -> String {
        self.dir().display().to_string()
    }
    fn split(&self) -> Option<&str> {
        self.manifest().dataset_split.as_deref()
    }
    fn dump_ref(&self) -> DumpRef {
        DumpReader::dump_ref(self)
    }
}
