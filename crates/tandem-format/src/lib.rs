//! The dump format: what `tandem dump` writes and `tandem train` reads, without the capture
//! job that makes it (that is `tandem-dump`, which links the target model and the CUDA path).
//!
//! A dump directory holds, per sample, the token ids, the loss mask (assistant tokens only),
//! the aux hidden states (all taps of a token concatenated in slot order) and the residual
//! stream leaving the last block, as Arrow IPC shards with a [`tandem_wiring::WiringManifest`]
//! in every shard and in `manifest.json`. Shards are written under a temporary name and renamed
//! when complete, so an interrupted dump resumes after its last complete shard.
//!
//! The trainer reads a dump with [`DumpReader`], through [`SampleSource`]:
//!
//! ```no_run
//! use std::path::Path;
//! let dump = tandem_format::DumpReader::open(Path::new("runs/dump-sharegpt-20"))?;
//! let m = dump.manifest();
//! println!("{} rows, taps {:?}, width {}", dump.len(), m.wiring.taps, m.aux_width());
//! for record in dump.iter() {
//!     let record = record?;
//!     assert_eq!(record.aux_hidden.len(), record.len() * m.num_slots * m.hidden_size);
//! }
//! # Ok::<(), tandem_format::FormatError>(())
//! ```
//!
//! The on-disk layout is described in `crates/tandem-dump/README.md` and in [`layout`].

pub mod error;
pub mod info;
pub mod layout;
pub mod manifest;
pub mod reader;
pub mod source;
pub mod writer;

pub use error::FormatError;
pub use info::{DumpInfo, dump_info};
pub use manifest::{
    DumpManifest, DumpSettings, FORMAT_NAME, FORMAT_VERSION, GenerationSettings, MANIFEST_FILE,
    Partition, ShardInfo, StorageDtype, partition_dir_name,
};
pub use reader::{DumpReader, DumpRecord};
pub use source::SampleSource;
pub use writer::{DumpWriter, ShardLimits};
