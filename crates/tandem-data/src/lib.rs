//! Conversation datasets for `tandem dump` and evaluation prompts for the evaluation jobs.
//!
//! * [`open_dataset`] streams a dataset as normalised [`Conversation`]s: a registry name
//!   (`sharegpt`, `mtbench`, `humaneval`, see `datasets/registry.toml` and
//!   `scripts/fetch_datasets.sh`) or a local file in one of the [`Format`]s.
//! * Unusable records are yielded as [`Skipped`] (file, line/record, [`SkipReason`], detail)
//!   and counted in [`ReadStats`] / [`SkipCounts`], which serialise for the dump job's report;
//!   they never stop the iteration. Only a dataset that cannot be opened at all is a
//!   [`DataError`].
//! * [`mtbench_prompts`], [`humaneval_prompts`] and [`eval_prompts`] read evaluation sets
//!   strictly, all turns included.
//!
//! Training code must check [`DatasetReader::split`]: evaluation sets are [`Split::Eval`] and
//! must stay out of training data.
//!
//! ```no_run
//! use std::path::Path;
//! let mut reader = tandem_data::open_dataset("sharegpt", Path::new("data"))?;
//! assert_eq!(reader.split(), Some(tandem_data::Split::Train));
//! for conv in reader.by_ref().take(1000).filter_map(Result::ok) {
//!     println!("{} {} messages", conv.id, conv.messages.len());
//! }
//! println!("{}", reader.stats());
//! # Ok::<(), tandem_data::DataError>(())
//! ```

#![warn(missing_docs)]

mod error;
mod eval;
mod reader;
mod record;
mod registry;
mod scan;
mod skip;
mod types;

pub use error::{DataError, Location, Skipped};
pub use eval::{eval_prompts, humaneval_prompts, mtbench_prompts};
pub use reader::{DatasetReader, detect_format, open_dataset};
pub use registry::{DatasetEntry, Format, Split, registry, registry_entry};
pub use skip::{ReadStats, SkipCounts, SkipReason};
pub use types::{Conversation, EvalPrompt, Message, Role, UnknownRole};
