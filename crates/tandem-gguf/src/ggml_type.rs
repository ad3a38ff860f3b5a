//! The ggml tensor element types a GGUF file can name, with their block geometry.
//!
//! Numbers and sizes follow `ggml.h` / gguf-py `GGML_QUANT_SIZES`. Knowing the size of every
//! type (not only the ones we can dequantise) lets the reader validate a whole file and refuse a
//! tensor later by name instead of failing on an opaque number.

use std::fmt;

/// Elements per super-block of the k-quant and i-quant families (`QK_K`).
pub const QK_K: usize = 256;

/// A ggml tensor element type as stored in a GGUF tensor info.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[allow(non_camel_case_types)] // The ggml names (Q4_K, IQ2_XXS, ...) are what users search for.
pub enum GgmlType {
    F32,
    F16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q8_1,
    Q2_K,
    Q3_K,
    Q4_K,
    Q5_K,
    Q6_K,
    Q8_K,
    IQ2_XXS,
    IQ2_XS,
    IQ3_XXS,
    IQ1_S,
    IQ4_NL,
    IQ3_S,
    IQ2_S,
    IQ4_XS,
    I8,
    I16,
    I32,
    I64,
    F64,
    IQ1_M,
    BF16,
    TQ1_0,
    TQ2_0,
    MXFP4,
    NVFP4,
}

/// `(type, ggml number, name, elements per block, bytes per block)`.
const TYPE_TABLE: &[(GgmlType, u32, &str, usize, usize)] = &[
    (GgmlType::F32, 0, "F32", 1, 4),
    (GgmlType::F16, 1, "F16", 1, 2),
    (GgmlType::Q4_0, 2, "Q4_0", 32, 18),
    (GgmlType::Q4_1, 3, "Q4_1", 32, 20),
    (GgmlType::Q5_0, 6, "Q5_0", 32, 22),
    (GgmlType::Q5_1, 7, "Q5_1", 32, 24),
    (GgmlType::Q8_0, 8, "Q8_0", 32, 34),
    (GgmlType::Q8_1, 9, "Q8_1", 32, 36),
    (GgmlType::Q2_K, 10, "Q2_K", QK_K, 84),
    (GgmlType::Q3_K, 11, "Q3_K", QK_K, 110),
    (GgmlType::Q4_K, 12, "Q4_K", QK_K, 144),
    (GgmlType::Q5_K, 13, "Q5_K", QK_K, 176),
    (GgmlType::Q6_K, 14, "Q6_K", QK_K, 210),
    (GgmlType::Q8_K, 15, "Q8_K", QK_K, 292),
    (GgmlType::IQ2_XXS, 16, "IQ2_XXS", QK_K, 66),
    (GgmlType::IQ2_XS, 17, "IQ2_XS", QK_K, 74),
    (GgmlType::IQ3_XXS, 18, "IQ3_XXS", QK_K, 98),
    (GgmlType::IQ1_S, 19, "IQ1_S", QK_K, 50),
    (GgmlType::IQ4_NL, 20, "IQ4_NL", 32, 18),
    (GgmlType::IQ3_S, 21, "IQ3_S", QK_K, 110),
    (GgmlType::IQ2_S, 22, "IQ2_S", QK_K, 82),
    (GgmlType::IQ4_XS, 23, "IQ4_XS", QK_K, 136),
    (GgmlType::I8, 24, "I8", 1, 1),
    (GgmlType::I16, 25, "I16", 1, 2),
    (GgmlType::I32, 26, "I32", 1, 4),
    (GgmlType::I64, 27, "I64", 1, 8),
    (GgmlType::F64, 28, "F64", 1, 8),
    (GgmlType::IQ1_M, 29, "IQ1_M", QK_K, 56),
    (GgmlType::BF16, 30, "BF16", 1, 2),
    (GgmlType::TQ1_0, 34, "TQ1_0", QK_K, 54),
    (GgmlType::TQ2_0, 35, "TQ2_0", QK_K, 66),
    (GgmlType::MXFP4, 39, "MXFP4", 32, 17),
    (GgmlType::NVFP4, 40, "NVFP4", 64, 36),
];

/// Type numbers whose layout this reader does not model (removed from ggml, or too new); naming
/// them makes the refusal explainable.
const NAMED_ONLY_TYPES: &[(u32, &str)] = &[
    (4, "Q4_2"),
    (5, "Q4_3"),
    (31, "Q4_0_4_4"),
    (32, "Q4_0_4_8"),
    (33, "Q4_0_8_8"),
    (36, "IQ4_NL_4_4"),
    (37, "IQ4_NL_4_8"),
    (38, "IQ4_NL_8_8"),
    (41, "Q1_0"),
];

impl GgmlType {
    fn entry(self) -> &'static (GgmlType, u32, &'static str, usize, usize) {
        TYPE_TABLE
            .iter()
            .find(|entry| entry.0 == self)
            .expect("every GgmlType variant has a TYPE_TABLE row")
    }

    /// The type with ggml number `id`, or `None` when this reader does not know its layout.
    pub fn from_id(id: u32) -> Option<Self> {
        TYPE_TABLE
            .iter()
            .find(|entry| entry.1 == id)
            .map(|entry| entry.0)
    }

    /// A human name for any ggml type number, including removed or not-yet-supported ones.
    pub fn name_of_id(id: u32) -> Option<&'static str> {
        Self::from_id(id).map(Self::name).or_else(|| {
            NAMED_ONLY_TYPES
                .iter()
                .find(|(named, _)| *named == id)
                .map(|(_, name)| *name)
        })
    }

    /// The ggml enum number (`GGML_TYPE_*`).
    pub fn id(self) -> u32 {
        self.entry().1
    }

    /// The ggml name, e.g. `"Q4_K"`.
    pub fn name(self) -> &'static str {
        self.entry().2
    }

    /// Elements per block; a row length (`ne[0]`) must be a multiple of it.
    pub fn block_len(self) -> usize {
        self.entry().3
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        self.entry().4
    }

    /// Whether [`crate::dequantize_into`] can turn this type into f32.
    pub fn can_dequantize(self) -> bool {
        matches!(
            self,
            Self::F32
                | Self::F16
                | Self::BF16
                | Self::Q8_0
                | Self::Q4_0
                | Self::Q4_1
                | Self::Q4_K
                | Self::Q6_K
        )
    }
}

impl fmt::Display for GgmlType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_round_trip_and_are_unique() {
        for &(ty, id, name, _, _) in TYPE_TABLE {
            assert_eq!(GgmlType::from_id(id), Some(ty));
            assert_eq!(ty.name(), name);
            assert_eq!(ty.to_string(), name);
            assert!(NAMED_ONLY_TYPES.iter().all(|(named, _)| *named != id));
        }
    }

    #[test]
    fn removed_and_unknown_ids_are_named_when_possible() {
        assert_eq!(GgmlType::from_id(31), None);
        assert_eq!(GgmlType::name_of_id(31), Some("Q4_0_4_4"));
        assert_eq!(GgmlType::name_of_id(12), Some("Q4_K"));
        assert_eq!(GgmlType::name_of_id(999), None);
    }
}
