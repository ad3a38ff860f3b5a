//! Wiring of EAGLE-3 hidden-state taps, kept consistent between training and serving.
//!
//! A draft head is trained on hidden states tapped at a few points of the target model and
//! only works when served with states from exactly the same points. Engines disagree about
//! what an integer layer id means, so this crate:
//!
//! - names tap points canonically ([`TapId`]: `embed`, `block k`, `final`);
//! - converts each engine's ids to and from those names losslessly ([`Convention`]), and
//!   shows how one id list reads under every convention ([`reinterpretations`]);
//! - records the wiring of every artefact ([`WiringManifest`]) and compares two of them,
//!   explaining each difference in a sentence ([`check`], [`Mismatch`]).
//!
//! String forms, one canonical machine form each:
//!
//! | thing        | canonical (serde / manifests)          | also parsed                        |
//! |--------------|----------------------------------------|------------------------------------|
//! | [`TapId`]    | `embed`, `block:5`, `final`            | `block 5`, `block5`, `b5`          |
//! | [`Convention`]| `hf`, `sglang-classic`, `sglang-heuristic`, `vllm`, `eagle`, `specforge` | `sglang`, `transformers`, `eagle3` |
//! | [`TapPoint`] | `residual-stream`, `normed`            | `pre-norm`, `post-norm`            |
//! | [`TapSpec`]  | `default`, `canonical:embed,block:1`, `vllm:2,15,27` | `canonical:block1,b14` |
//!
//! `Display` of a [`TapId`] is `block 5` (for sentences). This crate has no tensor code.
//!
//! ```
//! use tandem_wiring::{Convention, TapId, TapSpec};
//!
//! // SmolLM2 has 30 decoder blocks. The same physical taps, written for two engines:
//! let sglang: TapSpec = "sglang:1,14,26".parse().unwrap();
//! let vllm: TapSpec = "vllm:2,15,27".parse().unwrap();
//! assert_eq!(sglang.resolve(30).unwrap(), vllm.resolve(30).unwrap());
//! assert_eq!(
//!     Convention::Vllm.to_canonical(&[1, 14, 26], 30).unwrap(),
//!     [TapId::Block(0), TapId::Block(13), TapId::Block(25)],
//! );
//! ```

pub mod convention;
pub mod engines;
pub mod error;
pub mod manifest;
pub mod taps;

pub use convention::{
    Convention, RawIds, TapSpec, default_aux_taps, describe_reinterpretations, reinterpretations,
};
pub use engines::{
    AUX_IDS_KEY, EngineReading, export_ids, sglang_convention, sglang_reading, vllm_reading,
};
pub use error::{Result, WiringError};
pub use manifest::{
    DumpRef, Job, Mismatch, MismatchKind, Producer, SCHEMA_VERSION, Severity, TargetFingerprint,
    WiringManifest, canonical_json, check, lineage, normalize_dtype, sha256_hex,
};
pub use taps::{TapId, TapPoint, format_taps};
