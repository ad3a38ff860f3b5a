//! `tandem dump`: offline EAGLE-3 training data.
//!
//! A dump renders each conversation of a dataset with the target's chat template, runs one
//! prefill through the target's capture hook, and stores per sample the token ids, the loss
//! mask (assistant tokens only), the aux hidden states (all taps of a token concatenated in
//! slot order) and the residual stream leaving the last block, as Arrow IPC shards with a
//! [`tandem_wiring::WiringManifest`] in every shard and in `manifest.json`.
//!
//! The trainer reads a dump with [`DumpReader`]:
//!
//! ```no_run
//! use std::path::Path;
//! let dump = tandem_dump::DumpReader::open(Path::new("runs/dump-sharegpt-20"))?;
//! let m = dump.manifest();
//! println!("{} rows, taps {:?}, width {}", dump.len(), m.wiring.taps, m.aux_width());
//! for record in dump.iter() {
//!     let record = record?;
//!     assert_eq!(record.aux_hidden.len(), record.len() * m.num_slots * m.hidden_size);
//! }
//! # Ok::<(), tandem_dump::DumpError>(())
//! ```
//!
//! The on-disk layout is described in the crate README and in [`layout`].

pub mod error;
pub mod info;
pub mod job;
pub mod layout;
pub mod manifest;
pub mod mask;
pub mod online;
pub mod reader;
mod regen;
pub mod target;
pub mod writer;

pub use error::DumpError;
pub use info::{DumpInfo, dump_info};
pub use job::{
    DumpOptions, DumpSummary, conversations_to_read, dump_identity, run_dump, run_dump_with,
    zero_rows_reason,
};
pub use manifest::{
    DumpManifest, DumpSettings, FORMAT_NAME, FORMAT_VERSION, GenerationSettings, MANIFEST_FILE,
    ShardInfo, StorageDtype,
};
pub use online::OnlineCapture;
pub use reader::{DumpReader, DumpRecord};
pub use target::DumpTarget;
pub use writer::{DumpWriter, ShardLimits};
