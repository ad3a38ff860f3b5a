//! Engine layer-id conventions and lossless conversion to canonical taps.
//!
//! The same integers mean different blocks in different engines (see the facts table in
//! `shared/reference/eagle3-facts.md`, section 1). A drafter trained under one reading and
//! served under another silently loses most of its acceptance, so every raw id that enters
//! Tandem is converted to [`TapId`]s here, with the convention named explicitly.
//!
//! Summary, for a model with `L` decoder blocks (`block k` = residual stream leaving block k):
//!
//! | convention          | valid ids      | id `i` means                                           |
//! |---------------------|----------------|--------------------------------------------------------|
//! | `hf`                | `0..=L`        | 0 = embed, `k` = block k-1, `L` = final (post-norm)    |
//! | `sglang-classic`    | `0..=L-2`      | block i (captured before layer i+1)                    |
//! | `sglang-heuristic`  | depends on ids | first id == 1: as classic; otherwise block i-1         |
//! | `vllm`              | `0..=L-1`      | 0 = embed, `k` = block k-1 (input of layer k)          |
//! | `eagle`             | `0..=L-1`      | 0 = embed, `k` = block k-1 (input of layer k)          |
//! | `specforge`         | `0..=L-2`, ×3  | exactly 3 ids, then SGLang's +1: block i               |
//!
//! Capture loops only run *before* a layer, so the last block's pre-norm output
//! (`block L-1`) has no id in any engine, and HF exposes only its normed version (`final`).

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::error::{Result, WiringError};
use crate::taps::{TapId, format_taps};

/// How an engine (or library) interprets integer layer ids for hidden-state capture.
///
/// String form (Display, serde, the prefix of a tap spec): `hf`, `sglang-classic`,
/// `sglang-heuristic`, `vllm`, `eagle`, `specforge`. Parsing also accepts `sglang` (=
/// `sglang-heuristic`, what current SGLang does), `transformers`, `huggingface`,
/// `eagle-official`, `eagle3`, and `_` for `-`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub enum Convention {
    /// HF transformers `output_hidden_states` index: 0 = embed, k = block k-1, and the last
    /// index `L` = `final` (post-norm!), so the last block's pre-norm output is absent.
    Hf,
    /// SGLang before 2026: id i is captured as `hidden + residual` before layer i+1, i.e.
    /// block i. The embedding cannot be captured (no residual before layer 0).
    SglangClassic,
    /// SGLang after its 2026 change: the +1 is applied only when the *first* id is exactly 1
    /// (then every id i = block i, as classic). For any other first id, every id i is read as
    /// "input of layer i" = block i-1; id 0 would be the embedding, which SGLang cannot
    /// capture, so it is rejected. Consequently a tap list starting with `block 0` has no
    /// representation.
    SglangHeuristic,
    /// vLLM after its 2026 refactor: id 0 = embed, id k = block k-1 (the HF index), passed
    /// through to a loop that captures before layer k, and id L = the last block's output
    /// (pre-norm), collected after the loop. Read only from the top level of the draft's
    /// config (`eagle_aux_hidden_state_layer_ids`), never from `eagle_config`; without it vLLM
    /// uses (2, L//2, L-3). Source: vLLM's Llama model and EAGLE-3 loader as summarised in
    /// shared/reference/eagle3-facts.md section 1 (read 2026-11-30).
    Vllm,
    /// The official EAGLE code: it taps `hidden_states` before layers {2, L//2, L-3}. Explicit
    /// ids in this convention mean "input of layer i": 0 = embed, i = block i-1.
    EagleOfficial,
    /// SpecForge: exactly 3 non-negative ids, then SGLang's +1, so id i = block i.
    SpecForge,
}

/// How one convention (or one branch of the SGLang heuristic) reads ids.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Reading {
    /// Id i = block i (SGLang's +1: captured before layer i+1). Valid ids `0..=L-2`.
    BlockIsId,
    /// Id i = input of layer i: 0 = embed (when `embed` is capturable), i = block i-1.
    /// Valid ids `0..=L-1` (or `1..=L-1` without embed).
    LayerInput { embed: bool },
    /// HF `hidden_states` index: 0 = embed, k = block k-1, L = final. Valid `0..=L`.
    HfIndex,
    /// vLLM: 0 = embed, k = block k-1, and L = block L-1 (the residual after the loop, not
    /// the final norm). Valid `0..=L`.
    VllmLayerInput,
}

const NO_EMBED_IN_SGLANG: &str = "SGLang captures `hidden + residual` before a layer and there \
                                  is no residual before layer 0, so the embedding is never captured";
const NO_FINAL: &str = "engines capture the pre-norm residual stream; the final-norm output is \
                        not a capture point";

impl Convention {
    /// Every convention, in a stable order (used by [`reinterpretations`]).
    pub const ALL: [Convention; 6] = [
        Convention::Hf,
        Convention::SglangClassic,
        Convention::SglangHeuristic,
        Convention::Vllm,
        Convention::EagleOfficial,
        Convention::SpecForge,
    ];

    /// The canonical name: `hf`, `sglang-classic`, `sglang-heuristic`, `vllm`, `eagle`,
    /// `specforge`.
    pub fn name(self) -> &'static str {
        match self {
            Convention::Hf => "hf",
            Convention::SglangClassic => "sglang-classic",
            Convention::SglangHeuristic => "sglang-heuristic",
            Convention::Vllm => "vllm",
            Convention::EagleOfficial => "eagle",
            Convention::SpecForge => "specforge",
        }
    }

    /// One line saying what an id means, for help texts and diagnoses.
    pub fn meaning(self) -> &'static str {
        match self {
            Convention::Hf => {
                "hidden_states index: 0 = embed, k = block k-1, L = final (post-norm)"
            }
            Convention::SglangClassic => "id i = block i (captured before layer i+1)",
            Convention::SglangHeuristic => {
                "first id == 1: id i = block i; otherwise id i = input of layer i = block i-1"
            }
            Convention::Vllm => {
                "id 0 = embed, id k = block k-1 (input of layer k, no offset), id L = block L-1"
            }
            Convention::EagleOfficial => "id i = input of layer i: 0 = embed, i = block i-1",
            Convention::SpecForge => "exactly 3 ids, id i = block i (SGLang's +1)",
        }
    }

    /// The number of ids this convention requires, if it fixes one.
    pub fn required_id_count(self) -> Option<usize> {
        match self {
            Convention::SpecForge => Some(3),
            _ => None,
        }
    }

    /// Converts raw ids in this convention to canonical taps, slot order preserved.
    ///
    /// An empty list gives an empty list (except SpecForge, which needs exactly 3): engines
    /// substitute their defaults for "no ids", but that substitution is a separate, explicit
    /// step ([`Convention::default_raw_ids`]) so that it can never happen silently.
    pub fn to_canonical(self, raw_ids: &[i64], num_layers: usize) -> Result<Vec<TapId>> {
        check_layers(num_layers)?;
        self.check_count(raw_ids.len())?;
        let reading = self.reading_for_ids(raw_ids);
        raw_ids
            .iter()
            .map(|&id| self.id_to_tap(reading, id, num_layers))
            .collect()
    }

    /// Converts canonical taps to raw ids in this convention, slot order preserved.
    ///
    /// Guarantees `to_canonical(from_canonical(taps)?) == taps`. The reverse round trip is
    /// exact for every convention except `sglang-heuristic`, where `[1, ..]` and
    /// `[2, ..]`-style id lists can name the same blocks; there the classic form is
    /// produced when the first tap is `block 1` (it means the same to old and new SGLang),
    /// and the layer-input form otherwise.
    pub fn from_canonical(self, taps: &[TapId], num_layers: usize) -> Result<Vec<i64>> {
        check_layers(num_layers)?;
        self.check_count(taps.len())?;
        for tap in taps {
            tap.check_exists(num_layers)?;
        }
        let reading = match (self, taps.first()) {
            (Convention::SglangHeuristic, Some(first)) => match first {
                TapId::Block(1) => Reading::BlockIsId,
                TapId::Block(0) => {
                    return Err(self.not_expressible(
                        *first,
                        "the first id decides how SGLang reads the list: block 0 in the first \
                         slot would need id 0 (read as the embedding) or id 1 (which switches \
                         on the +1 and means block 1)"
                            .to_owned(),
                    ));
                }
                _ => Reading::LayerInput { embed: false },
            },
            _ => self.reading_for_ids(&[]),
        };
        taps.iter()
            .map(|&tap| self.tap_to_id(reading, tap, num_layers))
            .collect()
    }

    /// The raw ids a user writes in this convention to get the default aux taps
    /// ([`default_aux_taps`]): `[2, L//2, L-3]` for hf/vllm/eagle, `[1, L//2-1, L-4]` for the
    /// SGLang family and SpecForge.
    ///
    /// SGLang's own "no ids in config" default is written in its source as the layer inputs
    /// `[2, L//2, L-3]`; those are internal loop indices after its +1, and equal the
    /// user-facing ids `[1, L//2-1, L-4]` returned here.
    pub fn default_raw_ids(self, num_layers: usize) -> Result<Vec<i64>> {
        self.from_canonical(&default_aux_taps(num_layers)?, num_layers)
    }

    fn check_count(self, got: usize) -> Result<()> {
        match self.required_id_count() {
            Some(expected) if expected != got => Err(WiringError::WrongIdCount {
                convention: self,
                expected,
                got,
            }),
            _ => Ok(()),
        }
    }

    /// The reading of a whole id list; only the SGLang heuristic looks at the ids.
    fn reading_for_ids(self, raw_ids: &[i64]) -> Reading {
        match self {
            Convention::Hf => Reading::HfIndex,
            Convention::SglangClassic | Convention::SpecForge => Reading::BlockIsId,
            Convention::SglangHeuristic => match raw_ids.first() {
                Some(1) | None => Reading::BlockIsId,
                Some(_) => Reading::LayerInput { embed: false },
            },
            Convention::Vllm => Reading::VllmLayerInput,
            Convention::EagleOfficial => Reading::LayerInput { embed: true },
        }
    }

    fn id_to_tap(self, reading: Reading, id: i64, num_layers: usize) -> Result<TapId> {
        let l = num_layers as i64;
        let (min, max) = match reading {
            Reading::BlockIsId => (0, l - 2),
            Reading::LayerInput { embed } => (if embed { 0 } else { 1 }, l - 1),
            Reading::HfIndex | Reading::VllmLayerInput => (0, l),
        };
        if id < min || id > max {
            return Err(WiringError::LayerIdOutOfRange {
                convention: self,
                id,
                num_layers,
                min,
                max,
            });
        }
        let id = id as usize;
        Ok(match reading {
            Reading::BlockIsId => TapId::Block(id),
            Reading::LayerInput { .. } => TapId::from_residual_position(id),
            Reading::HfIndex if id == num_layers => TapId::Final,
            Reading::HfIndex | Reading::VllmLayerInput => TapId::from_residual_position(id),
        })
    }

    fn tap_to_id(self, reading: Reading, tap: TapId, num_layers: usize) -> Result<i64> {
        let last = num_layers - 1;
        let id = match (reading, tap) {
            (Reading::HfIndex, TapId::Final) => num_layers,
            (_, TapId::Final) => return Err(self.not_expressible(tap, NO_FINAL.to_owned())),
            (Reading::HfIndex, TapId::Block(k)) if k == last => {
                return Err(self.not_expressible(
                    tap,
                    format!(
                        "hidden_states[{num_layers}] is the final-norm output, so the last \
                         block's pre-norm output is not among the hidden states"
                    ),
                ));
            }
            (Reading::BlockIsId, TapId::Embed)
            | (Reading::LayerInput { embed: false }, TapId::Embed) => {
                return Err(self.not_expressible(tap, NO_EMBED_IN_SGLANG.to_owned()));
            }
            (Reading::BlockIsId, TapId::Block(k)) if k == last => {
                return Err(self.not_expressible(
                    tap,
                    format!(
                        "it would be captured before layer {num_layers}, which the capture loop \
                         never reaches"
                    ),
                ));
            }
            (Reading::LayerInput { .. }, TapId::Block(k)) if k == last => {
                return Err(self.not_expressible(
                    tap,
                    "ids name the input of a layer, and the last block's output is the input \
                     of no layer"
                        .to_owned(),
                ));
            }
            (Reading::BlockIsId, TapId::Block(k)) => k,
            (Reading::LayerInput { .. } | Reading::HfIndex | Reading::VllmLayerInput, t) => t
                .residual_position()
                .expect("only `final` lacks a residual position and it was handled above"),
        };
        Ok(id as i64)
    }

    fn not_expressible(self, tap: TapId, reason: String) -> WiringError {
        WiringError::NotExpressible {
            convention: self,
            tap,
            reason,
        }
    }
}

fn check_layers(num_layers: usize) -> Result<()> {
    // With 0 layers HF index 0 would be both `embed` and `final`: reject rather than guess.
    if num_layers == 0 {
        return Err(WiringError::TooFewLayers {
            num_layers,
            min: 1,
            what: "a layer-id conversion",
        });
    }
    Ok(())
}

impl fmt::Display for Convention {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Convention {
    type Err = WiringError;

    fn from_str(s: &str) -> Result<Self> {
        Ok(
            match s.trim().to_ascii_lowercase().replace('_', "-").as_str() {
                "hf" | "transformers" | "huggingface" => Convention::Hf,
                "sglang-classic" => Convention::SglangClassic,
                "sglang" | "sglang-heuristic" => Convention::SglangHeuristic,
                "vllm" => Convention::Vllm,
                "eagle" | "eagle-official" | "eagle3" => Convention::EagleOfficial,
                "specforge" | "spec-forge" => Convention::SpecForge,
                _ => {
                    return Err(WiringError::Parse {
                        input: s.to_owned(),
                        reason: "expected a convention: hf, sglang (= sglang-heuristic), \
                                 sglang-classic, vllm, eagle, specforge"
                            .to_owned(),
                    });
                }
            },
        )
    }
}

impl TryFrom<String> for Convention {
    type Error = WiringError;

    fn try_from(s: String) -> Result<Self> {
        s.parse()
    }
}

impl From<Convention> for String {
    fn from(c: Convention) -> String {
        c.name().to_owned()
    }
}

/// The default aux taps every engine agrees on physically: blocks `[1, L//2 - 1, L - 4]`.
///
/// SmolLM2 (30 layers): blocks [1, 14, 26]; Llama-3.1-8B (32 layers): blocks [1, 15, 28].
pub fn default_aux_taps(num_layers: usize) -> Result<Vec<TapId>> {
    // L - 4 must be a block; below 4 layers the formula has no meaning.
    if num_layers < 4 {
        return Err(WiringError::TooFewLayers {
            num_layers,
            min: 4,
            what: "the default aux taps [1, L//2-1, L-4]",
        });
    }
    Ok(vec![
        TapId::Block(1),
        TapId::Block(num_layers / 2 - 1),
        TapId::Block(num_layers - 4),
    ])
}

/// How the same raw ids read under every convention, in [`Convention::ALL`] order.
///
/// Used to explain a mismatch: "these ids mean blocks [1, 14, 26] under sglang but blocks
/// [0, 13, 25] under vllm".
pub fn reinterpretations(
    raw_ids: &[i64],
    num_layers: usize,
) -> Vec<(Convention, Result<Vec<TapId>>)> {
    Convention::ALL
        .iter()
        .map(|&c| (c, c.to_canonical(raw_ids, num_layers)))
        .collect()
}

/// One line per convention, e.g. `vllm: [embed, block 13, block 25]` or
/// `sglang-classic: error: embed cannot be expressed ...`.
pub fn describe_reinterpretations(raw_ids: &[i64], num_layers: usize) -> Vec<String> {
    reinterpretations(raw_ids, num_layers)
        .into_iter()
        .map(|(c, r)| match r {
            Ok(taps) => format!("{c}: {}", format_taps(&taps)),
            Err(e) => format!("{c}: error: {e}"),
        })
        .collect()
}

/// Raw ids together with the convention they were written in, as a user asked for them.
///
/// String form: `<convention>:<id>,<id>,..`, e.g. `sglang-classic:1,14,26`.
/// Serde form: `{"convention": "sglang-classic", "ids": [1, 14, 26]}`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct RawIds {
    /// The convention the ids are written in.
    pub convention: Convention,
    /// The ids, in slot order.
    pub ids: Vec<i64>,
}

impl RawIds {
    /// Pairs ids with their convention.
    pub fn new(convention: Convention, ids: Vec<i64>) -> Self {
        RawIds { convention, ids }
    }

    /// The canonical taps these ids name in a model with `num_layers` blocks.
    pub fn to_canonical(&self, num_layers: usize) -> Result<Vec<TapId>> {
        self.convention.to_canonical(&self.ids, num_layers)
    }
}

impl fmt::Display for RawIds {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let ids: Vec<String> = self.ids.iter().map(ToString::to_string).collect();
        write!(f, "{}:{}", self.convention, ids.join(","))
    }
}

impl FromStr for RawIds {
    type Err = WiringError;

    fn from_str(s: &str) -> Result<Self> {
        match s.parse::<TapSpec>()? {
            TapSpec::Raw(raw) => Ok(raw),
            _ => Err(WiringError::Parse {
                input: s.to_owned(),
                reason: "expected raw ids `<convention>:<id>,..`, e.g. `sglang:1,14,26`".to_owned(),
            }),
        }
    }
}

/// What a user asks for on the command line (`--taps`).
///
/// String forms:
/// - `default`: the default aux taps ([`default_aux_taps`]);
/// - `canonical:embed,block1,block14` (any [`TapId`] form per item; printed canonically as
///   `canonical:embed,block:1,block:14`);
/// - `<convention>:<ids>`: raw ids, e.g. `sglang:1,14,26`, `vllm:2,15,27`, `hf:0,14,26`,
///   `eagle:2,15,27`, `specforge:1,14,26`.
///
/// Whitespace around items is ignored; an empty id list is rejected, because "no ids" is
/// exactly how engines silently fall back to their defaults.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum TapSpec {
    /// The default aux taps for the target's depth.
    Default,
    /// Taps given canonically.
    Canonical(Vec<TapId>),
    /// Raw ids in a named convention.
    Raw(RawIds),
}

impl TapSpec {
    /// The canonical taps for a model with `num_layers` blocks.
    pub fn resolve(&self, num_layers: usize) -> Result<Vec<TapId>> {
        match self {
            TapSpec::Default => default_aux_taps(num_layers),
            TapSpec::Canonical(taps) => {
                for tap in taps {
                    tap.check_exists(num_layers)?;
                }
                Ok(taps.clone())
            }
            TapSpec::Raw(raw) => raw.to_canonical(num_layers),
        }
    }

    /// The raw ids, when the spec was given in an engine convention.
    pub fn raw_ids(&self) -> Option<&RawIds> {
        match self {
            TapSpec::Raw(raw) => Some(raw),
            _ => None,
        }
    }
}

impl fmt::Display for TapSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TapSpec::Default => f.write_str("default"),
            TapSpec::Canonical(taps) => {
                let items: Vec<String> = taps.iter().map(TapId::canonical).collect();
                write!(f, "canonical:{}", items.join(","))
            }
            TapSpec::Raw(raw) => raw.fmt(f),
        }
    }
}

impl FromStr for TapSpec {
    type Err = WiringError;

    fn from_str(s: &str) -> Result<Self> {
        let parse_err = |reason: String| WiringError::Parse {
            input: s.to_owned(),
            reason,
        };
        let trimmed = s.trim();
        if trimmed.eq_ignore_ascii_case("default") {
            return Ok(TapSpec::Default);
        }
        let Some((prefix, list)) = trimmed.split_once(':') else {
            return Err(parse_err(
                "expected `default`, `canonical:<taps>` or `<convention>:<ids>`, e.g. \
                 `sglang:1,14,26`"
                    .to_owned(),
            ));
        };
        let items: Vec<&str> = list.split(',').map(str::trim).collect();
        if items.iter().all(|i| i.is_empty()) {
            return Err(parse_err(format!("no ids after `{prefix}:`")));
        }
        if prefix.trim().eq_ignore_ascii_case("canonical") {
            let taps = items
                .iter()
                .map(|i| i.parse::<TapId>())
                .collect::<Result<Vec<_>>>()
                .map_err(|e| parse_err(format!("bad tap: {e}")))?;
            return Ok(TapSpec::Canonical(taps));
        }
        let convention = prefix.parse::<Convention>().map_err(|_| {
            parse_err(format!(
                "unknown convention {:?}; expected canonical, hf, sglang (= sglang-heuristic), \
                 sglang-classic, vllm, eagle or specforge",
                prefix.trim()
            ))
        })?;
        let ids = items
            .iter()
            .map(|i| {
                i.parse::<i64>()
                    .map_err(|e| parse_err(format!("id {i:?} is not an integer: {e}")))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(TapSpec::Raw(RawIds::new(convention, ids)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn blocks(ks: &[usize]) -> Vec<TapId> {
        ks.iter().map(|&k| TapId::Block(k)).collect()
    }

    fn canon(c: Convention, ids: &[i64], l: usize) -> Vec<TapId> {
        c.to_canonical(ids, l)
            .unwrap_or_else(|e| panic!("{c} {ids:?} L={l}: {e}"))
    }

    // ---- the facts table, row by row -------------------------------------------------------

    #[test]
    fn default_aux_sets_for_known_models() {
        // SmolLM2-135M: 30 layers. Llama-3.1-8B: 32 layers.
        assert_eq!(default_aux_taps(30).unwrap(), blocks(&[1, 14, 26]));
        assert_eq!(default_aux_taps(32).unwrap(), blocks(&[1, 15, 28]));
        // Odd depth: L//2 is floor division.
        assert_eq!(default_aux_taps(31).unwrap(), blocks(&[1, 14, 27]));
        assert!(matches!(
            default_aux_taps(3),
            Err(WiringError::TooFewLayers { min: 4, .. })
        ));
    }

    #[test]
    fn default_raw_ids_per_convention() {
        use Convention::*;
        // "no ids in config -> inputs of layers [2, L//2, L-3]" in the HF-index family ...
        for c in [Hf, Vllm, EagleOfficial] {
            assert_eq!(c.default_raw_ids(30).unwrap(), [2, 15, 27], "{c}");
            assert_eq!(c.default_raw_ids(32).unwrap(), [2, 16, 29], "{c}");
        }
        // ... and [1, L//2-1, L-4] for the SGLang family (its +1 makes them the same blocks).
        for c in [SglangClassic, SglangHeuristic, SpecForge] {
            assert_eq!(c.default_raw_ids(30).unwrap(), [1, 14, 26], "{c}");
            assert_eq!(c.default_raw_ids(32).unwrap(), [1, 15, 28], "{c}");
        }
        // All defaults agree physically.
        for c in Convention::ALL {
            for l in [8, 16, 24, 28, 30, 32, 36, 40, 48, 61, 80, 126] {
                let raw = c.default_raw_ids(l).unwrap();
                assert_eq!(canon(c, &raw, l), default_aux_taps(l).unwrap(), "{c} L={l}");
            }
        }
    }

    #[test]
    fn hf_index_zero_is_embed_and_last_is_final() {
        let l = 30;
        assert_eq!(
            canon(Convention::Hf, &[0, 1, 15, 29, 30], l),
            [
                TapId::Embed,
                TapId::Block(0),
                TapId::Block(14),
                TapId::Block(28),
                TapId::Final
            ]
        );
        // The off-by-one: hidden_states[L] is post-norm, so block L-1 has no HF index.
        let err = Convention::Hf
            .from_canonical(&[TapId::Block(29)], l)
            .unwrap_err();
        assert!(matches!(
            err,
            WiringError::NotExpressible {
                tap: TapId::Block(29),
                ..
            }
        ));
        assert!(err.to_string().contains("final-norm"), "{err}");
        assert_eq!(
            Convention::Hf.from_canonical(&[TapId::Final], l).unwrap(),
            [30]
        );
        let err = Convention::Hf.to_canonical(&[31], l).unwrap_err();
        assert!(matches!(
            err,
            WiringError::LayerIdOutOfRange {
                id: 31,
                num_layers: 30,
                ..
            }
        ));
    }

    #[test]
    fn sglang_classic_id_is_block() {
        let l = 30;
        assert_eq!(
            canon(Convention::SglangClassic, &[1, 14, 26], l),
            blocks(&[1, 14, 26])
        );
        assert_eq!(
            canon(Convention::SglangClassic, &[0, 2, 28], l),
            blocks(&[0, 2, 28])
        );
        // Id L-1 would be captured before layer L, which never runs.
        let err = Convention::SglangClassic
            .to_canonical(&[29], l)
            .unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("29") && msg.contains("30-layer"), "{msg}");
        assert!(Convention::SglangClassic.to_canonical(&[-1], l).is_err());
    }

    #[test]
    fn embed_is_not_expressible_in_sglang() {
        for c in [
            Convention::SglangClassic,
            Convention::SglangHeuristic,
            Convention::SpecForge,
        ] {
            let taps = [TapId::Embed, TapId::Block(13), TapId::Block(25)];
            let err = c.from_canonical(&taps, 30).unwrap_err();
            assert!(
                matches!(
                    err,
                    WiringError::NotExpressible {
                        tap: TapId::Embed,
                        ..
                    }
                ),
                "{c}: {err}"
            );
            assert!(err.to_string().contains("embed"), "{err}");
        }
        // ... but it is in the HF-index family.
        for c in [Convention::Hf, Convention::Vllm, Convention::EagleOfficial] {
            assert_eq!(
                c.from_canonical(&[TapId::Embed, TapId::Block(13)], 30)
                    .unwrap(),
                [0, 14]
            );
        }
    }

    #[test]
    fn final_is_only_expressible_in_hf() {
        for c in Convention::ALL {
            let r = c.from_canonical(&[TapId::Final, TapId::Block(3), TapId::Block(5)], 30);
            assert_eq!(r.is_ok(), c == Convention::Hf, "{c}");
        }
    }

    #[test]
    fn sglang_heuristic_depends_on_the_first_id() {
        let l = 30;
        let h = Convention::SglangHeuristic;
        // First id 1: the +1 applies, ids are blocks (same as classic).
        assert_eq!(canon(h, &[1, 14, 26], l), blocks(&[1, 14, 26]));
        // First id 2: read as layer inputs, every id means one block earlier.
        assert_eq!(canon(h, &[2, 15, 27], l), blocks(&[1, 14, 26]));
        assert_eq!(canon(h, &[2, 14, 26], l), blocks(&[1, 13, 25]));
        // The ambiguity: the same list reads differently in classic SGLang.
        assert_eq!(
            canon(Convention::SglangClassic, &[2, 15, 27], l),
            blocks(&[2, 15, 27])
        );
        // Only the first id is looked at: a later 1 does not switch the reading.
        assert_eq!(canon(h, &[3, 1, 20], l), blocks(&[2, 0, 19]));
        assert_eq!(canon(h, &[1, 0, 20], l), blocks(&[1, 0, 20]));
        // Without the +1, id 0 would be the embedding: rejected.
        let err = h.to_canonical(&[5, 0], l).unwrap_err();
        assert!(matches!(
            err,
            WiringError::LayerIdOutOfRange { id: 0, min: 1, .. }
        ));
        let err = h.to_canonical(&[0, 5], l).unwrap_err();
        assert!(matches!(err, WiringError::LayerIdOutOfRange { id: 0, .. }));
        // A first tap of block 0 has no representation.
        let err = h.from_canonical(&blocks(&[0, 5]), l).unwrap_err();
        assert!(matches!(
            err,
            WiringError::NotExpressible {
                tap: TapId::Block(0),
                ..
            }
        ));
        // from_canonical prefers the portable classic form when the first tap is block 1.
        assert_eq!(
            h.from_canonical(&blocks(&[1, 14, 26]), l).unwrap(),
            [1, 14, 26]
        );
        assert_eq!(
            h.from_canonical(&blocks(&[2, 14, 26]), l).unwrap(),
            [3, 15, 27]
        );
    }

    #[test]
    fn vllm_and_eagle_pass_ids_through_as_layer_inputs() {
        let l = 30;
        for c in [Convention::Vllm, Convention::EagleOfficial] {
            assert_eq!(canon(c, &[2, 15, 27], l), blocks(&[1, 14, 26]), "{c}");
            assert_eq!(
                canon(c, &[0, 1, 29], l),
                [TapId::Embed, TapId::Block(0), TapId::Block(28)]
            );
        }
        // vLLM also collects the residual after its loop: id L is the last block's output.
        let vllm = Convention::Vllm;
        assert_eq!(canon(vllm, &[2, 15, 30], l), blocks(&[1, 14, 29]));
        assert_eq!(
            vllm.from_canonical(&blocks(&[1, 14, 29]), l).unwrap(),
            [2, 15, 30]
        );
        assert!(vllm.to_canonical(&[31], l).is_err());
        let err = Convention::EagleOfficial
            .to_canonical(&[30], l)
            .unwrap_err();
        assert!(matches!(
            err,
            WiringError::LayerIdOutOfRange {
                id: 30,
                num_layers: 30,
                max: 29,
                ..
            }
        ));
    }

    #[test]
    fn specforge_requires_three_non_negative_ids() {
        let sf = Convention::SpecForge;
        assert_eq!(canon(sf, &[1, 14, 26], 30), blocks(&[1, 14, 26]));
        let err = sf.to_canonical(&[1, 14], 30).unwrap_err();
        assert!(matches!(
            err,
            WiringError::WrongIdCount {
                expected: 3,
                got: 2,
                ..
            }
        ));
        assert!(sf.to_canonical(&[1, 14, 26, 27], 30).is_err());
        assert!(sf.to_canonical(&[], 30).is_err());
        let err = sf.to_canonical(&[-1, 14, 26], 30).unwrap_err();
        assert!(matches!(err, WiringError::LayerIdOutOfRange { id: -1, .. }));
        assert!(sf.from_canonical(&blocks(&[1, 2]), 30).is_err());
    }

    #[test]
    fn out_of_range_errors_name_the_id_and_layer_count() {
        for c in Convention::ALL {
            let err = c.to_canonical(&[1, 2, 999], 30).unwrap_err();
            let msg = err.to_string();
            assert!(msg.contains("999"), "{c}: {msg}");
            assert!(msg.contains("30-layer"), "{c}: {msg}");
            assert!(msg.contains(c.name()), "{c}: {msg}");
        }
        let err = Convention::Vllm
            .from_canonical(&[TapId::Block(40)], 30)
            .unwrap_err();
        assert!(matches!(
            err,
            WiringError::TapOutOfRange {
                tap: TapId::Block(40),
                num_layers: 30
            }
        ));
        assert!(Convention::Hf.to_canonical(&[0], 0).is_err());
    }

    #[test]
    fn reinterpretations_explain_a_mismatch() {
        let all = reinterpretations(&[1, 14, 26], 30);
        assert_eq!(all.len(), Convention::ALL.len());
        let get = |c: Convention| {
            all.iter()
                .find(|(x, _)| *x == c)
                .unwrap()
                .1
                .as_ref()
                .unwrap()
                .clone()
        };
        assert_eq!(get(Convention::SglangHeuristic), blocks(&[1, 14, 26]));
        assert_eq!(get(Convention::SglangClassic), blocks(&[1, 14, 26]));
        assert_eq!(get(Convention::Vllm), blocks(&[0, 13, 25]));
        assert_eq!(get(Convention::Hf), blocks(&[0, 13, 25]));
        let lines = describe_reinterpretations(&[0, 14, 26], 30);
        assert!(lines.contains(&"vllm: [embed, block 13, block 25]".to_owned()));
        assert!(
            lines
                .iter()
                .any(|l| l.starts_with("sglang-heuristic: error:"))
        );
    }

    // ---- round trips -----------------------------------------------------------------------

    /// Every 1-, 2- and 3-slot list drawn from the taps that exist in an `l`-layer model.
    fn tap_lists(l: usize) -> Vec<Vec<TapId>> {
        let mut pool = vec![TapId::Embed, TapId::Final];
        pool.extend((0..l).map(TapId::Block));
        let mut out = Vec::new();
        for &a in &pool {
            out.push(vec![a]);
            for &b in &pool {
                out.push(vec![a, b]);
                for &c in &pool {
                    out.push(vec![a, b, c]);
                }
            }
        }
        out
    }

    #[test]
    fn canonical_round_trips_for_every_convention() {
        for l in [1, 2, 4, 7, 12] {
            for taps in tap_lists(l) {
                for c in Convention::ALL {
                    if let Ok(ids) = c.from_canonical(&taps, l) {
                        assert_eq!(
                            c.to_canonical(&ids, l).unwrap(),
                            taps,
                            "{c} L={l} ids={ids:?}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn raw_round_trips_for_every_convention() {
        for l in [1, 2, 5, 9] {
            let range: Vec<i64> = (-2..=l as i64 + 2).collect();
            let mut lists: Vec<Vec<i64>> = vec![vec![]];
            for &a in &range {
                lists.push(vec![a]);
                for &b in &range {
                    for &c in &range {
                        lists.push(vec![a, b, c]);
                    }
                }
            }
            for ids in &lists {
                for c in Convention::ALL {
                    let Ok(taps) = c.to_canonical(ids, l) else {
                        continue;
                    };
                    let back = c
                        .from_canonical(&taps, l)
                        .unwrap_or_else(|e| panic!("{c} L={l} {ids:?} -> {taps:?}: {e}"));
                    if c == Convention::SglangHeuristic {
                        // Two id forms can name the same blocks; the canonical side is exact.
                        assert_eq!(c.to_canonical(&back, l).unwrap(), taps, "{c} {ids:?}");
                    } else {
                        assert_eq!(&back, ids, "{c} L={l}");
                    }
                }
            }
        }
    }

    #[test]
    fn default_taps_are_expressible_everywhere() {
        for l in 4..=128 {
            let taps = default_aux_taps(l).unwrap();
            for c in Convention::ALL {
                let ids = c.from_canonical(&taps, l).unwrap();
                assert_eq!(c.to_canonical(&ids, l).unwrap(), taps, "{c} L={l}");
            }
        }
    }

    // ---- string forms ----------------------------------------------------------------------

    #[test]
    fn convention_names_round_trip() {
        for c in Convention::ALL {
            assert_eq!(c.name().parse::<Convention>().unwrap(), c);
            let json = serde_json::to_string(&c).unwrap();
            assert_eq!(json, format!("\"{}\"", c.name()));
            assert_eq!(serde_json::from_str::<Convention>(&json).unwrap(), c);
        }
        assert_eq!(
            "sglang".parse::<Convention>().unwrap(),
            Convention::SglangHeuristic
        );
        assert_eq!(
            "SGLang_Classic".parse::<Convention>().unwrap(),
            Convention::SglangClassic
        );
        assert!("tensorrt".parse::<Convention>().is_err());
    }

    #[test]
    fn tap_spec_forms() {
        let spec: TapSpec = "sglang:1,14,26".parse().unwrap();
        assert_eq!(
            spec,
            TapSpec::Raw(RawIds::new(Convention::SglangHeuristic, vec![1, 14, 26]))
        );
        assert_eq!(spec.to_string(), "sglang-heuristic:1,14,26");
        assert_eq!(spec.resolve(30).unwrap(), blocks(&[1, 14, 26]));

        let spec: TapSpec = "vllm: 2, 15, 27".parse().unwrap();
        assert_eq!(spec.resolve(30).unwrap(), blocks(&[1, 14, 26]));

        let spec: TapSpec = "canonical:embed,block1,block14".parse().unwrap();
        assert_eq!(
            spec.resolve(30).unwrap(),
            [TapId::Embed, TapId::Block(1), TapId::Block(14)]
        );
        assert_eq!(spec.to_string(), "canonical:embed,block:1,block:14");
        assert_eq!(spec.to_string().parse::<TapSpec>().unwrap(), spec);
        assert!(spec.raw_ids().is_none());

        assert_eq!("default".parse::<TapSpec>().unwrap(), TapSpec::Default);
        assert_eq!(TapSpec::Default.resolve(32).unwrap(), blocks(&[1, 15, 28]));

        for spec in [
            "hf:0,14,26",
            "eagle:2,15,27",
            "specforge:1,14,26",
            "sglang-classic:1",
        ] {
            let parsed: TapSpec = spec.parse().unwrap();
            assert_eq!(parsed.to_string().parse::<TapSpec>().unwrap(), parsed);
        }
        for bad in [
            "",
            "sglang",
            "sglang:",
            "sglang:1,x",
            "trt:1,2",
            "canonical:layer3",
        ] {
            let err = bad.parse::<TapSpec>().unwrap_err();
            assert!(matches!(err, WiringError::Parse { .. }), "{bad:?}: {err}");
        }
        // Resolution checks the layer count.
        let err = "canonical:block30"
            .parse::<TapSpec>()
            .unwrap()
            .resolve(30)
            .unwrap_err();
        assert!(err.to_string().contains("30-layer"), "{err}");
        let err = "vllm:2,15,40"
            .parse::<TapSpec>()
            .unwrap()
            .resolve(30)
            .unwrap_err();
        assert!(err.to_string().contains("40"), "{err}");
    }

    #[test]
    fn raw_ids_string_and_serde_forms() {
        let raw: RawIds = "specforge:1,14,26".parse().unwrap();
        assert_eq!(raw.to_string(), "specforge:1,14,26");
        let json = serde_json::to_value(&raw).unwrap();
        assert_eq!(
            json,
            serde_json::json!({"convention": "specforge", "ids": [1, 14, 26]})
        );
        assert!("canonical:embed".parse::<RawIds>().is_err());
    }
}
