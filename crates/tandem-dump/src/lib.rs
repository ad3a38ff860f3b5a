//! `tandem dump`: offline EAGLE-3 training data.
//!
//! A dump renders each conversation of a dataset with the target's chat template, runs one
//! prefill through the target's capture hook, and stores per sample the token ids, the loss
//! mask (assistant tokens only), the aux hidden states (all taps of a token concatenated in
//! slot order) and the residual stream leaving the last block, as Arrow IPC shards with a
//! [`tandem_wiring::WiringManifest`] in every shard and in `manifest.json`.
//!
//! The format itself (layout, manifest, reader, writer, `dump-info`) is the `tandem-format`
//! crate, re-exported here; the trainer depends on that crate alone.

pub mod error;
pub mod job;
pub mod mask;
pub mod online;
mod regen;

pub use error::DumpError;
pub use job::{
    DumpOptions, DumpSummary, conversations_to_read, dump_dir, dump_identity, run_dump,
    run_dump_with, zero_rows_reason,
};
pub use online::OnlineCapture;
pub use tandem_format::{
    DumpInfo, DumpManifest, DumpReader, DumpRecord, DumpSettings, DumpWriter, FORMAT_NAME,
    FORMAT_VERSION, FormatError, GenerationSettings, MANIFEST_FILE, Partition, SampleSource,
    ShardInfo, ShardLimits, StorageDtype, dump_info, info, layout, manifest, partition_dir_name,
    reader, writer,
};
