//! GGUF metadata values and typed access to them.

use std::collections::HashMap;
use std::fmt;

use crate::GgufError;

/// The type tag of a GGUF metadata value (`gguf_type` in ggml).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ValueType {
    U8,
    I8,
    U16,
    I16,
    U32,
    I32,
    F32,
    Bool,
    String,
    Array,
    U64,
    I64,
    F64,
}

impl ValueType {
    /// The type with GGUF tag `id`, if there is one.
    pub fn from_id(id: u32) -> Option<Self> {
        Some(match id {
            0 => Self::U8,
            1 => Self::I8,
            2 => Self::U16,
            3 => Self::I16,
            4 => Self::U32,
            5 => Self::I32,
            6 => Self::F32,
            7 => Self::Bool,
            8 => Self::String,
            9 => Self::Array,
            10 => Self::U64,
            11 => Self::I64,
            12 => Self::F64,
            _ => return None,
        })
    }

    /// The GGUF tag number.
    pub fn id(self) -> u32 {
        match self {
            Self::U8 => 0,
            Self::I8 => 1,
            Self::U16 => 2,
            Self::I16 => 3,
            Self::U32 => 4,
            Self::I32 => 5,
            Self::F32 => 6,
            Self::Bool => 7,
            Self::String => 8,
            Self::Array => 9,
            Self::U64 => 10,
            Self::I64 => 11,
            Self::F64 => 12,
        }
    }

    /// Lower-case name used in error messages (`"u32"`, `"string"`, ...).
    pub fn name(self) -> &'static str {
        match self {
            Self::U8 => "u8",
            Self::I8 => "i8",
            Self::U16 => "u16",
            Self::I16 => "i16",
            Self::U32 => "u32",
            Self::I32 => "i32",
            Self::F32 => "f32",
            Self::Bool => "bool",
            Self::String => "string",
            Self::Array => "array",
            Self::U64 => "u64",
            Self::I64 => "i64",
            Self::F64 => "f64",
        }
    }
}

impl fmt::Display for ValueType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// One metadata value. Arrays keep their declared element type so that an empty array still
/// says what it would hold.
#[derive(Clone, Debug, PartialEq)]
pub enum MetadataValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    String(String),
    Array {
        element_type: ValueType,
        values: Vec<MetadataValue>,
    },
    U64(u64),
    I64(i64),
    F64(f64),
}

impl MetadataValue {
    /// The value's type tag.
    pub fn value_type(&self) -> ValueType {
        match self {
            Self::U8(_) => ValueType::U8,
            Self::I8(_) => ValueType::I8,
            Self::U16(_) => ValueType::U16,
            Self::I16(_) => ValueType::I16,
            Self::U32(_) => ValueType::U32,
            Self::I32(_) => ValueType::I32,
            Self::F32(_) => ValueType::F32,
            Self::Bool(_) => ValueType::Bool,
            Self::String(_) => ValueType::String,
            Self::Array { .. } => ValueType::Array,
            Self::U64(_) => ValueType::U64,
            Self::I64(_) => ValueType::I64,
            Self::F64(_) => ValueType::F64,
        }
    }

    /// Describes the type for error messages, including an array's element type.
    pub fn type_description(&self) -> String {
        match self {
            Self::Array { element_type, .. } => format!("array of {element_type}"),
            other => other.value_type().name().to_owned(),
        }
    }

    /// Any integer type that holds a non-negative value, widened to u64. Converters write counts
    /// as u32 or i32 depending on the tool, so callers should not care which.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Self::U8(v) => Some(v.into()),
            Self::U16(v) => Some(v.into()),
            Self::U32(v) => Some(v.into()),
            Self::U64(v) => Some(v),
            Self::I8(v) => u64::try_from(v).ok(),
            Self::I16(v) => u64::try_from(v).ok(),
            Self::I32(v) => u64::try_from(v).ok(),
            Self::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    /// An f32 or f64 value as f64 (f32 is widened exactly).
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Self::F32(v) => Some(v.into()),
            Self::F64(v) => Some(v),
            _ => None,
        }
    }

    /// The value of a bool.
    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            Self::Bool(v) => Some(v),
            _ => None,
        }
    }

    /// The text of a string.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Self::String(v) => Some(v),
            _ => None,
        }
    }

    /// The elements of an array.
    pub fn as_array(&self) -> Option<&[MetadataValue]> {
        match self {
            Self::Array { values, .. } => Some(values),
            _ => None,
        }
    }
}

/// All key/value pairs of a GGUF file, in file order, with lookup by key.
#[derive(Clone, Debug, Default)]
pub struct Metadata {
    entries: Vec<(String, MetadataValue)>,
    index: HashMap<String, usize>,
}

impl Metadata {
    /// Adds a pair; a repeated key is an error because readers would disagree on which wins.
    pub(crate) fn insert(&mut self, key: String, value: MetadataValue) -> Result<(), GgufError> {
        if self.index.contains_key(&key) {
            return Err(GgufError::InvalidMetadata {
                key,
                problem: "the key appears more than once".into(),
            });
        }
        self.index.insert(key.clone(), self.entries.len());
        self.entries.push((key, value));
        Ok(())
    }

    /// The value stored under `key`.
    pub fn get(&self, key: &str) -> Option<&MetadataValue> {
        self.index.get(key).map(|&i| &self.entries[i].1)
    }

    /// Pairs in file order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &MetadataValue)> {
        self.entries
            .iter()
            .map(|(key, value)| (key.as_str(), value))
    }

    /// Number of key/value pairs.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    fn wrong_type(key: &str, expected: &str, found: &MetadataValue) -> GgufError {
        GgufError::InvalidMetadata {
            key: key.to_owned(),
            problem: format!("expected {expected}, found {}", found.type_description()),
        }
    }

    /// A non-negative integer of any width; `Ok(None)` when the key is absent.
    pub fn get_u64(&self, key: &str) -> Result<Option<u64>, GgufError> {
        self.get(key)
            .map(|value| {
                value
                    .as_u64()
                    .ok_or_else(|| Self::wrong_type(key, "a non-negative integer", value))
            })
            .transpose()
    }

    /// Like [`Metadata::get_u64`] but converted to `usize`.
    pub fn get_usize(&self, key: &str) -> Result<Option<usize>, GgufError> {
        self.get_u64(key)?
            .map(|v| {
                usize::try_from(v).map_err(|_| GgufError::InvalidMetadata {
                    key: key.to_owned(),
                    problem: format!("{v} does not fit in usize"),
                })
            })
            .transpose()
    }

    /// A required non-negative integer.
    pub fn require_usize(&self, key: &str) -> Result<usize, GgufError> {
        self.get_usize(key)?
            .ok_or_else(|| GgufError::MissingMetadata {
                key: key.to_owned(),
            })
    }

    /// An f32 or f64 value, widened to f64.
    pub fn get_f64(&self, key: &str) -> Result<Option<f64>, GgufError> {
        self.get(key)
            .map(|value| {
                value
                    .as_f64()
                    .ok_or_else(|| Self::wrong_type(key, "a float", value))
            })
            .transpose()
    }

    /// A bool; `Ok(None)` when the key is absent, an error naming the key for another type.
    pub fn get_bool(&self, key: &str) -> Result<Option<bool>, GgufError> {
        self.get(key)
            .map(|value| {
                value
                    .as_bool()
                    .ok_or_else(|| Self::wrong_type(key, "a bool", value))
            })
            .transpose()
    }

    /// A string; `Ok(None)` when the key is absent, an error naming the key for another type.
    pub fn get_str(&self, key: &str) -> Result<Option<&str>, GgufError> {
        self.get(key)
            .map(|value| {
                value
                    .as_str()
                    .ok_or_else(|| Self::wrong_type(key, "a string", value))
            })
            .transpose()
    }

    /// A required string.
    pub fn require_str(&self, key: &str) -> Result<&str, GgufError> {
        self.get_str(key)?
            .ok_or_else(|| GgufError::MissingMetadata {
                key: key.to_owned(),
            })
    }

    /// An array whose elements are all strings.
    pub fn get_str_array(&self, key: &str) -> Result<Option<Vec<&str>>, GgufError> {
        let Some(value) = self.get(key) else {
            return Ok(None);
        };
        let wrong = || Self::wrong_type(key, "an array of strings", value);
        let values = value.as_array().ok_or_else(wrong)?;
        values
            .iter()
            .map(|element| element.as_str().ok_or_else(wrong))
            .collect::<Result<Vec<_>, _>>()
            .map(Some)
    }

    /// An array whose elements are all non-negative integers.
    pub fn get_u64_array(&self, key: &str) -> Result<Option<Vec<u64>>, GgufError> {
        let Some(value) = self.get(key) else {
            return Ok(None);
        };
        let wrong = || Self::wrong_type(key, "an array of non-negative integers", value);
        let values = value.as_array().ok_or_else(wrong)?;
        values
            .iter()
            .map(|element| element.as_u64().ok_or_else(wrong))
            .collect::<Result<Vec<_>, _>>()
            .map(Some)
    }
}
