//! Canonical tap ids and tap points.
//!
//! Engines disagree about what an integer "layer id" means, so nothing in Tandem stores raw
//! integers as the identity of a tap. A [`TapId`] names a physical point of the target's
//! forward pass; engine ids are converted to and from it by [`crate::Convention`].

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::error::WiringError;

/// A physical point in the target's forward pass where a hidden state is captured.
///
/// The derived order follows the forward pass: `Embed < Block(0) < Block(1) < .. < Final`.
///
/// String forms:
/// - canonical (serde, [`TapId::canonical`], manifests, `canonical:` tap specs):
///   `embed`, `block:5`, `final`;
/// - display (sentences for people): `embed`, `block 5`, `final`;
/// - parsing ([`FromStr`]) accepts all of the above plus `block5` and `b5`, case-insensitive.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub enum TapId {
    /// Output of the token embedding: the residual stream entering block 0.
    Embed,
    /// Residual stream leaving decoder block `k` (0-based), before the final RMSNorm.
    Block(usize),
    /// Output of the final RMSNorm (what feeds `lm_head`). Post-norm by definition.
    Final,
}

impl TapId {
    /// The canonical machine string: `embed`, `block:5` or `final`.
    pub fn canonical(&self) -> String {
        match self {
            TapId::Embed => "embed".to_owned(),
            TapId::Block(k) => format!("block:{k}"),
            TapId::Final => "final".to_owned(),
        }
    }

    /// Position along the residual stream: `embed` = 0, `block k` = k + 1.
    ///
    /// `final` has none: it is a normed value, not a point on the residual stream, so it
    /// cannot take part in "shifted by n blocks" reasoning.
    pub fn residual_position(&self) -> Option<usize> {
        match self {
            TapId::Embed => Some(0),
            TapId::Block(k) => Some(k + 1),
            TapId::Final => None,
        }
    }

    /// Inverse of [`TapId::residual_position`].
    pub fn from_residual_position(position: usize) -> TapId {
        match position {
            0 => TapId::Embed,
            p => TapId::Block(p - 1),
        }
    }

    /// Errors when this tap does not exist in a model with `num_layers` decoder blocks.
    pub fn check_exists(&self, num_layers: usize) -> Result<(), WiringError> {
        match self {
            TapId::Block(k) if *k >= num_layers => Err(WiringError::TapOutOfRange {
                tap: *self,
                num_layers,
            }),
            _ => Ok(()),
        }
    }
}

impl fmt::Display for TapId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TapId::Embed => f.write_str("embed"),
            TapId::Block(k) => write!(f, "block {k}"),
            TapId::Final => f.write_str("final"),
        }
    }
}

impl FromStr for TapId {
    type Err = WiringError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let lower = s.trim().to_ascii_lowercase();
        match lower.as_str() {
            "embed" | "embedding" | "embeddings" => return Ok(TapId::Embed),
            "final" | "final-norm" | "final_norm" => return Ok(TapId::Final),
            _ => {}
        }
        // Longest prefix first, so that "block5" is not read as "b" + "lock5".
        let number = ["block", "b"]
            .iter()
            .find_map(|prefix| lower.strip_prefix(prefix))
            .map(|rest| rest.trim_start_matches([':', ' ', '_']).trim());
        match number {
            Some(n) if !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()) => {
                n.parse().map(TapId::Block).map_err(|e| WiringError::Parse {
                    input: s.to_owned(),
                    reason: format!("block number: {e}"),
                })
            }
            _ => Err(WiringError::Parse {
                input: s.to_owned(),
                reason: "expected a tap id: `embed`, `block 5` / `block:5` / `block5` / `b5`, \
                         or `final`"
                    .to_owned(),
            }),
        }
    }
}

impl TryFrom<String> for TapId {
    type Error = WiringError;

    fn try_from(s: String) -> Result<Self, Self::Error> {
        s.parse()
    }
}

impl From<TapId> for String {
    fn from(tap: TapId) -> String {
        tap.canonical()
    }
}

/// Which value is captured at each tap.
///
/// Every engine taps the residual stream; a normed capture is a known failure mode
/// (the `fc` weights were trained on un-normed activations). Serde form: `residual-stream`
/// or `normed`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum TapPoint {
    /// The residual stream itself (`hidden + residual`), before any norm.
    ResidualStream,
    /// A normed value (e.g. after an RMSNorm).
    Normed,
}

impl TapPoint {
    /// A phrase for sentences: "the residual stream (pre-norm)" / "the normed output".
    pub fn describe(&self) -> &'static str {
        match self {
            TapPoint::ResidualStream => "the residual stream (pre-norm)",
            TapPoint::Normed => "the normed output",
        }
    }
}

impl fmt::Display for TapPoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            TapPoint::ResidualStream => "residual-stream",
            TapPoint::Normed => "normed",
        })
    }
}

impl FromStr for TapPoint {
    type Err = WiringError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().replace('_', "-").as_str() {
            "residual-stream" | "residual" | "pre-norm" | "prenorm" => Ok(TapPoint::ResidualStream),
            "normed" | "post-norm" | "postnorm" => Ok(TapPoint::Normed),
            _ => Err(WiringError::Parse {
                input: s.to_owned(),
                reason: "expected a tap point: `residual-stream` or `normed`".to_owned(),
            }),
        }
    }
}

/// Formats taps for sentences: `[embed, block 13, block 25]`.
pub fn format_taps(taps: &[TapId]) -> String {
    let items: Vec<String> = taps.iter().map(ToString::to_string).collect();
    format!("[{}]", items.join(", "))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_every_documented_form() {
        for s in [
            "block 5",
            "block5",
            "b5",
            "block:5",
            "BLOCK 5",
            " Block:5 ",
            "block_5",
        ] {
            assert_eq!(s.parse::<TapId>().unwrap(), TapId::Block(5), "{s:?}");
        }
        assert_eq!("embed".parse::<TapId>().unwrap(), TapId::Embed);
        assert_eq!("final".parse::<TapId>().unwrap(), TapId::Final);
        for bad in [
            "", "block", "b", "block -1", "blockx", "5", "layer 5", "b5x",
        ] {
            let err = bad.parse::<TapId>().unwrap_err();
            assert!(matches!(err, WiringError::Parse { .. }), "{bad:?}");
        }
    }

    #[test]
    fn display_and_canonical_forms_round_trip() {
        for tap in [
            TapId::Embed,
            TapId::Block(0),
            TapId::Block(31),
            TapId::Final,
        ] {
            assert_eq!(tap.to_string().parse::<TapId>().unwrap(), tap);
            assert_eq!(tap.canonical().parse::<TapId>().unwrap(), tap);
        }
        assert_eq!(TapId::Block(5).to_string(), "block 5");
        assert_eq!(TapId::Block(5).canonical(), "block:5");
    }

    #[test]
    fn serde_uses_canonical_strings() {
        let taps = vec![TapId::Embed, TapId::Block(5), TapId::Final];
        let json = serde_json::to_string(&taps).unwrap();
        assert_eq!(json, r#"["embed","block:5","final"]"#);
        let back: Vec<TapId> = serde_json::from_str(&json).unwrap();
        assert_eq!(back, taps);
        assert!(serde_json::from_str::<TapId>(r#""layer 3""#).is_err());
        let point = serde_json::to_string(&TapPoint::ResidualStream).unwrap();
        assert_eq!(point, r#""residual-stream""#);
    }

    #[test]
    fn order_follows_the_forward_pass() {
        let mut taps = vec![TapId::Final, TapId::Block(2), TapId::Embed, TapId::Block(0)];
        taps.sort();
        assert_eq!(
            taps,
            [TapId::Embed, TapId::Block(0), TapId::Block(2), TapId::Final]
        );
    }

    #[test]
    fn residual_positions_invert() {
        for p in 0..40 {
            let tap = TapId::from_residual_position(p);
            assert_eq!(tap.residual_position(), Some(p));
        }
        assert_eq!(TapId::Final.residual_position(), None);
    }

    #[test]
    fn existence_depends_on_layer_count() {
        assert!(TapId::Block(29).check_exists(30).is_ok());
        let err = TapId::Block(30).check_exists(30).unwrap_err();
        assert!(err.to_string().contains("30-layer"), "{err}");
        assert!(TapId::Final.check_exists(30).is_ok());
    }

    #[test]
    fn tap_point_forms() {
        assert_eq!(
            "pre-norm".parse::<TapPoint>().unwrap(),
            TapPoint::ResidualStream
        );
        assert_eq!("normed".parse::<TapPoint>().unwrap(), TapPoint::Normed);
        assert!("both".parse::<TapPoint>().is_err());
        assert_eq!(
            format_taps(&[TapId::Embed, TapId::Block(13)]),
            "[embed, block 13]"
        );
    }
}
