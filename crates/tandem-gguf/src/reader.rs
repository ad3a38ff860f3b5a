//! GGUF v2/v3 container parsing: header, metadata, tensor infos and the tensor data section.
//!
//! Layout (all little-endian): magic `GGUF`, u32 version, u64 tensor count, u64 metadata count,
//! the metadata pairs, the tensor infos, padding to `general.alignment`, then tensor data whose
//! per-tensor offsets are relative to the start of that data section.

use std::collections::HashMap;
use std::fs::File;
use std::ops::Range;
use std::path::Path;

use memmap2::Mmap;

use crate::dequant::{DequantError, dequantize_into};
use crate::metadata::{Metadata, MetadataValue, ValueType};
use crate::{GgmlType, GgufError};

const MAGIC: &[u8; 4] = b"GGUF";
const DEFAULT_ALIGNMENT: u64 = 32;
/// ggml's `GGML_MAX_DIMS`; more dimensions than this is a corrupt file, not a real tensor.
const MAX_DIMS: usize = 4;

/// One tensor's description from the GGUF header.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorInfo {
    /// GGUF tensor name, e.g. `blk.0.attn_q.weight`.
    pub name: String,
    /// GGUF dimensions, fastest-varying first: `dims[0]` is the row length. A 2-D tensor with
    /// `dims = [in, out]` is the Hugging Face / PyTorch matrix of shape `[out, in]`.
    pub dims: Vec<u64>,
    /// Element encoding of the data.
    pub ggml_type: GgmlType,
    /// Byte offset of the data relative to the start of the data section.
    pub offset: u64,
    /// Byte length of the data.
    pub byte_len: u64,
}

impl TensorInfo {
    /// Number of elements.
    pub fn element_count(&self) -> u64 {
        self.dims.iter().product()
    }

    /// Row length (`dims[0]`), i.e. elements per row; 1 for a scalar.
    pub fn row_len(&self) -> u64 {
        self.dims.first().copied().unwrap_or(1)
    }

    /// Number of rows: the product of all dimensions but the first.
    pub fn row_count(&self) -> u64 {
        self.dims.iter().skip(1).product()
    }

    /// The shape in PyTorch / Hugging Face order (slowest-varying first): `dims` reversed.
    pub fn torch_shape(&self) -> Vec<usize> {
        // Fits: the constructor checked that the byte length fits in memory.
        self.dims.iter().rev().map(|&d| d as usize).collect()
    }
}

/// The bytes behind a [`GgufFile`]: a memory map for real files, a vector for tests and callers
/// that already hold the data.
enum Storage {
    Mapped(Mmap),
    Owned(Vec<u8>),
}

impl Storage {
    fn bytes(&self) -> &[u8] {
        match self {
            Self::Mapped(map) => map,
            Self::Owned(bytes) => bytes,
        }
    }
}

/// A parsed GGUF file whose tensor data stays in place (memory-mapped) until asked for.
pub struct GgufFile {
    storage: Storage,
    version: u32,
    metadata: Metadata,
    tensors: Vec<TensorInfo>,
    tensor_index: HashMap<String, usize>,
    alignment: u64,
    data_offset: u64,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("version", &self.version)
            .field("file_len", &self.file_len())
            .field("metadata_len", &self.metadata.len())
            .field("tensor_count", &self.tensors.len())
            .field("alignment", &self.alignment)
            .field("data_offset", &self.data_offset)
            .finish()
    }
}

impl GgufFile {
    /// Memory-maps and parses `path`. Every tensor's byte range is checked against the file size
    /// here, so later reads cannot fail on truncation.
    pub fn open(path: &Path) -> Result<Self, GgufError> {
        let read_error = |source| GgufError::Read {
            path: path.to_owned(),
            source,
        };
        let file = File::open(path).map_err(read_error)?;
        // SAFETY: the map is read-only and lives as long as `GgufFile`. Another process changing
        // the file while we read it would corrupt what we see; we accept that, as every
        // memory-mapping model loader does, because copying multi-gigabyte weights is worse.
        #[allow(unsafe_code)]
        let map = unsafe { Mmap::map(&file) }.map_err(read_error)?;
        Self::parse(Storage::Mapped(map))
    }

    /// Parses a GGUF file already held in memory.
    pub fn from_bytes(bytes: Vec<u8>) -> Result<Self, GgufError> {
        Self::parse(Storage::Owned(bytes))
    }

    fn parse(storage: Storage) -> Result<Self, GgufError> {
        let bytes = storage.bytes();
        let mut cursor = Cursor::new(bytes);

        cursor.context = "the file header".into();
        let magic = cursor.take(4)?;
        if magic != MAGIC {
            return Err(GgufError::BadMagic {
                found: magic.to_vec(),
            });
        }
        let version = cursor.u32()?;
        if !(2..=3).contains(&version) {
            return Err(GgufError::UnsupportedVersion { version });
        }
        let tensor_count = cursor.u64()?;
        let metadata_count = cursor.u64()?;

        let mut metadata = Metadata::default();
        for index in 0..metadata_count {
            cursor.context = format!("metadata pair #{index}");
            let key = cursor.string()?;
            cursor.context = format!("metadata pair #{index} ({key})");
            let type_id = cursor.u32()?;
            let value = cursor.value(&key, type_id, 0)?;
            metadata.insert(key, value)?;
        }

        let alignment = match metadata.get("general.alignment") {
            None => DEFAULT_ALIGNMENT,
            Some(value) => match value.as_u64() {
                Some(alignment) if alignment.is_power_of_two() => alignment,
                _ => {
                    return Err(GgufError::InvalidMetadata {
                        key: "general.alignment".into(),
                        problem: format!("must be a power of two, found {value:?}"),
                    });
                }
            },
        };

        let mut raw_infos = Vec::new();
        for index in 0..tensor_count {
            cursor.context = format!("tensor info #{index}");
            let name = cursor.string()?;
            cursor.context = format!("tensor info #{index} ({name})");
            let dim_count = cursor.u32()? as usize;
            if dim_count > MAX_DIMS {
                return Err(GgufError::InvalidTensor {
                    tensor: name,
                    problem: format!("{dim_count} dimensions (ggml allows at most {MAX_DIMS})"),
                });
            }
            let dims = (0..dim_count)
                .map(|_| cursor.u64())
                .collect::<Result<Vec<_>, _>>()?;
            let type_id = cursor.u32()?;
            let offset = cursor.u64()?;
            raw_infos.push((name, dims, type_id, offset));
        }

        let data_offset = cursor.position.next_multiple_of(alignment);
        let file_len = bytes.len() as u64;
        let mut tensors = Vec::with_capacity(raw_infos.len());
        let mut tensor_index = HashMap::with_capacity(raw_infos.len());
        for (name, dims, type_id, offset) in raw_infos {
            let info = tensor_info(name, dims, type_id, offset, alignment)?;
            let start = data_offset.saturating_add(info.offset);
            let end = start.saturating_add(info.byte_len);
            if end > file_len {
                return Err(GgufError::TruncatedTensor {
                    tensor: info.name,
                    start,
                    end,
                    file_len,
                });
            }
            if tensor_index
                .insert(info.name.clone(), tensors.len())
                .is_some()
            {
                return Err(GgufError::InvalidTensor {
                    tensor: info.name,
                    problem: "the name appears more than once".into(),
                });
            }
            tensors.push(info);
        }

        Ok(Self {
            storage,
            version,
            metadata,
            tensors,
            tensor_index,
            alignment,
            data_offset,
        })
    }

    /// GGUF format version (2 or 3).
    pub fn version(&self) -> u32 {
        self.version
    }

    /// All metadata pairs.
    pub fn metadata(&self) -> &Metadata {
        &self.metadata
    }

    /// Tensor infos in file order.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    /// The tensor called `name` (GGUF name, e.g. `blk.0.attn_q.weight`).
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensor_index.get(name).map(|&i| &self.tensors[i])
    }

    /// `general.alignment`, or 32 when absent.
    pub fn alignment(&self) -> u64 {
        self.alignment
    }

    /// Absolute byte offset of the tensor data section.
    pub fn data_offset(&self) -> u64 {
        self.data_offset
    }

    /// Size of the file in bytes.
    pub fn file_len(&self) -> u64 {
        self.storage.bytes().len() as u64
    }

    /// `general.architecture`, e.g. `"llama"`.
    pub fn architecture(&self) -> Result<&str, GgufError> {
        self.metadata.require_str("general.architecture")
    }

    /// The raw (possibly quantised) bytes of a tensor of this file.
    pub fn tensor_data(&self, info: &TensorInfo) -> &[u8] {
        let start = (self.data_offset + info.offset) as usize;
        &self.storage.bytes()[start..start + info.byte_len as usize]
    }

    /// Dequantises a whole tensor to f32 in GGUF order: `dims[0]` varies fastest, so the result is
    /// the row-major PyTorch tensor of shape [`TensorInfo::torch_shape`].
    pub fn dequantize(&self, info: &TensorInfo) -> Result<Vec<f32>, GgufError> {
        self.dequantize_rows(info, 0..info.row_count() as usize)
    }

    /// Dequantises rows `rows` (each `dims[0]` elements long) of a tensor to f32, row-major.
    pub fn dequantize_rows(
        &self,
        info: &TensorInfo,
        rows: Range<usize>,
    ) -> Result<Vec<f32>, GgufError> {
        let row_count = info.row_count() as usize;
        if rows.start > rows.end || rows.end > row_count {
            return Err(GgufError::InvalidTensor {
                tensor: info.name.clone(),
                problem: format!("rows {rows:?} requested but the tensor has {row_count} rows"),
            });
        }
        let row_len = info.row_len() as usize;
        let row_bytes = row_len / info.ggml_type.block_len() * info.ggml_type.block_bytes();
        let data = &self.tensor_data(info)[rows.start * row_bytes..rows.end * row_bytes];
        let mut out = vec![0.0; rows.len() * row_len];
        dequantize_into(info.ggml_type, data, &mut out).map_err(|error| match error {
            DequantError::Unsupported(ggml_type) => GgufError::UnsupportedGgmlType {
                tensor: info.name.clone(),
                ggml_type,
            },
            other => GgufError::InvalidTensor {
                tensor: info.name.clone(),
                problem: other.to_string(),
            },
        })?;
        Ok(out)
    }
}

/// Validates one raw tensor info and computes its byte length.
fn tensor_info(
    name: String,
    dims: Vec<u64>,
    type_id: u32,
    offset: u64,
    alignment: u64,
) -> Result<TensorInfo, GgufError> {
    let Some(ggml_type) = GgmlType::from_id(type_id) else {
        return Err(GgufError::UnknownGgmlType {
            tensor: name,
            type_id,
            name: GgmlType::name_of_id(type_id),
        });
    };
    let invalid = |problem: String| GgufError::InvalidTensor {
        tensor: name.clone(),
        problem,
    };
    let element_count = dims
        .iter()
        .try_fold(1u64, |count, &dim| count.checked_mul(dim))
        .ok_or_else(|| invalid(format!("dimensions {dims:?} overflow")))?;
    let block_len = ggml_type.block_len() as u64;
    let row_len = dims.first().copied().unwrap_or(1);
    if !row_len.is_multiple_of(block_len) {
        return Err(invalid(format!(
            "row length {row_len} is not a multiple of the {ggml_type} block length {block_len}"
        )));
    }
    let byte_len = (element_count / block_len)
        .checked_mul(ggml_type.block_bytes() as u64)
        .filter(|&len| usize::try_from(len).is_ok())
        .ok_or_else(|| invalid(format!("dimensions {dims:?} are too large")))?;
    if !offset.is_multiple_of(alignment) {
        return Err(invalid(format!(
            "data offset {offset} is not a multiple of the alignment {alignment}"
        )));
    }
    Ok(TensorInfo {
        name,
        dims,
        ggml_type,
        offset,
        byte_len,
    })
}

/// Bounds-checked little-endian reads that name what was being read when the file ran out.
struct Cursor<'a> {
    bytes: &'a [u8],
    position: u64,
    context: String,
}

/// Nested arrays deeper than this are certainly corrupt and would only risk stack exhaustion.
const MAX_ARRAY_NESTING: usize = 16;

impl<'a> Cursor<'a> {
    fn new(bytes: &'a [u8]) -> Self {
        Self {
            bytes,
            position: 0,
            context: String::new(),
        }
    }

    fn remaining(&self) -> u64 {
        self.bytes.len() as u64 - self.position
    }

    fn take(&mut self, len: u64) -> Result<&'a [u8], GgufError> {
        if len > self.remaining() {
            return Err(GgufError::Truncated {
                what: self.context.clone(),
                start: self.position,
                end: self.position.saturating_add(len),
                file_len: self.bytes.len() as u64,
            });
        }
        let start = self.position as usize;
        self.position += len;
        Ok(&self.bytes[start..start + len as usize])
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], GgufError> {
        Ok(self
            .take(N as u64)?
            .try_into()
            .expect("take returns exactly N bytes"))
    }

    fn u32(&mut self) -> Result<u32, GgufError> {
        self.array().map(u32::from_le_bytes)
    }

    fn u64(&mut self) -> Result<u64, GgufError> {
        self.array().map(u64::from_le_bytes)
    }

    fn string(&mut self) -> Result<String, GgufError> {
        let len = self.u64()?;
        let bytes = self.take(len)?;
        String::from_utf8(bytes.to_vec()).map_err(|source| GgufError::InvalidUtf8 {
            what: self.context.clone(),
            source,
        })
    }

    fn value(&mut self, key: &str, type_id: u32, depth: usize) -> Result<MetadataValue, GgufError> {
        let value_type =
            ValueType::from_id(type_id).ok_or_else(|| GgufError::UnknownValueType {
                key: key.to_owned(),
                type_id,
            })?;
        Ok(match value_type {
            ValueType::U8 => MetadataValue::U8(u8::from_le_bytes(self.array()?)),
            ValueType::I8 => MetadataValue::I8(i8::from_le_bytes(self.array()?)),
            ValueType::U16 => MetadataValue::U16(u16::from_le_bytes(self.array()?)),
            ValueType::I16 => MetadataValue::I16(i16::from_le_bytes(self.array()?)),
            ValueType::U32 => MetadataValue::U32(self.u32()?),
            ValueType::I32 => MetadataValue::I32(i32::from_le_bytes(self.array()?)),
            ValueType::F32 => MetadataValue::F32(f32::from_le_bytes(self.array()?)),
            ValueType::U64 => MetadataValue::U64(self.u64()?),
            ValueType::I64 => MetadataValue::I64(i64::from_le_bytes(self.array()?)),
            ValueType::F64 => MetadataValue::F64(f64::from_le_bytes(self.array()?)),
            ValueType::Bool => match self.array::<1>()?[0] {
                0 => MetadataValue::Bool(false),
                1 => MetadataValue::Bool(true),
                other => {
                    return Err(GgufError::InvalidMetadata {
                        key: key.to_owned(),
                        problem: format!("bool byte is {other}, expected 0 or 1"),
                    });
                }
            },
            ValueType::String => MetadataValue::String(self.string()?),
            ValueType::Array => {
                if depth >= MAX_ARRAY_NESTING {
                    return Err(GgufError::InvalidMetadata {
                        key: key.to_owned(),
                        problem: format!("arrays nested deeper than {MAX_ARRAY_NESTING} levels"),
                    });
                }
                let element_type_id = self.u32()?;
                let element_type = ValueType::from_id(element_type_id).ok_or_else(|| {
                    GgufError::UnknownValueType {
                        key: key.to_owned(),
                        type_id: element_type_id,
                    }
                })?;
                let len = self.u64()?;
                // Every element takes at least one byte, so a longer claim is a truncated file;
                // checking first avoids allocating for a corrupt length.
                if len > self.remaining() {
                    return Err(GgufError::Truncated {
                        what: format!("{} ({len} array elements)", self.context),
                        start: self.position,
                        end: self.position.saturating_add(len),
                        file_len: self.bytes.len() as u64,
                    });
                }
                let values = (0..len)
                    .map(|_| self.value(key, element_type_id, depth + 1))
                    .collect::<Result<Vec<_>, _>>()?;
                MetadataValue::Array {
                    element_type,
                    values,
                }
            }
        })
    }
}
