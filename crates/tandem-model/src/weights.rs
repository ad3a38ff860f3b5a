//! Safetensors weights of an HF model directory (single file or sharded with an index), read by
//! their HF tensor names and converted to f32 on the host.
//!
//! FP8 block-scaled weights (the published DeepSeek-V3 / Kimi-K2 checkpoints) are dequantised on
//! the way: an `F8_E4M3` (or `F8_E5M2`) tensor `X` is read with its sibling `X_scale_inv`
//! (`[ceil(rows / block_rows), ceil(cols / block_cols)]`, the block from config.json's
//! `quantization_config.weight_block_size`, default 128 x 128) as
//! `fp8_to_f32(X[i, j]) * X_scale_inv[i / block_rows, j / block_cols]`, the same product as
//! DeepSeek's `weight_dequant` and HF transformers' fine-grained FP8 dequantisation. The scales
//! are not weights of their own: [`WeightFiles::names`] leaves them out.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensors};

use crate::error::ModelError;

/// Memory-mapped safetensors shards and the index of which shard holds which tensor.
pub struct WeightFiles {
    dir: PathBuf,
    shards: Vec<(PathBuf, Mmap)>,
    location: HashMap<String, usize>,
    /// `[rows, cols]` of one FP8 scale block.
    fp8_block: [usize; 2],
}

/// The FP8 scale block when config.json has no `quantization_config.weight_block_size`.
pub const DEFAULT_FP8_BLOCK: [usize; 2] = [128, 128];

/// Suffix of the per-block inverse scale of an FP8 tensor (`X` -> `X_scale_inv`).
pub const FP8_SCALE_SUFFIX: &str = "_scale_inv";

/// One tensor read to the host: row-major f32 values and the shape as stored.
#[derive(Debug, Clone)]
pub struct HostTensor {
    pub shape: Vec<usize>,
    pub values: Vec<f32>,
}

impl WeightFiles {
    /// Opens `model.safetensors`, or the shards listed in `model.safetensors.index.json`. The FP8
    /// scale block is `quantization_config.weight_block_size` of `dir/config.json` when present,
    /// else [`DEFAULT_FP8_BLOCK`].
    pub fn open(dir: &Path) -> Result<Self, ModelError> {
        let fp8_block = fp8_block_from_config(&dir.join("config.json"))?;
        let single = dir.join("model.safetensors");
        let index = dir.join("model.safetensors.index.json");
        let shard_names: Vec<String> = if single.exists() {
            vec!["model.safetensors".to_string()]
        } else if index.exists() {
            let text = std::fs::read_to_string(&index).map_err(|source| ModelError::Io {
                path: index.clone(),
                source,
            })?;
            #[derive(serde::Deserialize)]
            struct Index {
                weight_map: BTreeMap<String, String>,
            }
            let parsed: Index = serde_json::from_str(&text).map_err(|source| ModelError::Json {
                path: index.clone(),
                source,
            })?;
            let mut names: Vec<String> = parsed.weight_map.into_values().collect();
            names.sort();
            names.dedup();
            names
        } else {
            return Err(ModelError::NoWeights {
                dir: dir.to_path_buf(),
            });
        };
        let mut shards = Vec::new();
        let mut location = HashMap::new();
        for (i, name) in shard_names.iter().enumerate() {
            let path = dir.join(name);
            let file = std::fs::File::open(&path).map_err(|source| ModelError::Io {
                path: path.clone(),
                source,
            })?;
            // SAFETY-free: memmap2's map is `unsafe` because another process could truncate the
            // file underneath us; we read it once at load time and copy every tensor out.
            let mmap = map_readonly(&file).map_err(|source| ModelError::Io {
                path: path.clone(),
                source,
            })?;
            let parsed =
                SafeTensors::deserialize(&mmap).map_err(|e| ModelError::BadSafetensors {
                    path: path.clone(),
                    reason: e.to_string(),
                })?;
            for tensor_name in parsed.names() {
                location.insert(tensor_name.to_string(), i);
            }
            shards.push((path, mmap));
        }
        Ok(Self {
            dir: dir.to_path_buf(),
            shards,
            location,
            fp8_block,
        })
    }

    /// Overrides the FP8 scale block `[rows, cols]` (both at least 1).
    pub fn with_fp8_block(mut self, block: [usize; 2]) -> Self {
        assert!(block[0] > 0 && block[1] > 0, "FP8 block {block:?} is empty");
        self.fp8_block = block;
        self
    }

    /// The FP8 scale block `[rows, cols]` in use.
    pub fn fp8_block(&self) -> [usize; 2] {
        self.fp8_block
    }

    /// Whether tensor `name` is stored (scales included).
    pub fn contains(&self, name: &str) -> bool {
        self.location.contains_key(name)
    }

    /// The names of the stored weights, sorted, without the `_scale_inv` scales of FP8 tensors
    /// (they are part of their tensor, read with it). A `_scale_inv` whose tensor is missing or
    /// not FP8 is listed, so a check for unexpected tensors still sees it.
    pub fn names(&self) -> Vec<String> {
        let scales: HashSet<String> = self
            .location
            .keys()
            .filter(|name| self.is_fp8(name))
            .map(|name| format!("{name}{FP8_SCALE_SUFFIX}"))
            .collect();
        let mut names: Vec<String> = self
            .location
            .keys()
            .filter(|name| !scales.contains(*name))
            .cloned()
            .collect();
        names.sort();
        names
    }

    /// Whether the stored dtype of `name` is FP8 (false when it is missing or unreadable).
    fn is_fp8(&self, name: &str) -> bool {
        let Some(&shard) = self.location.get(name) else {
            return false;
        };
        SafeTensors::deserialize(&self.shards[shard].1)
            .ok()
            .and_then(|st| st.tensor(name).ok())
            .is_some_and(|v| matches!(v.dtype(), Dtype::F8_E4M3 | Dtype::F8_E5M2))
    }

    /// Reads tensor `name` as f32, checking its shape against `expected`.
    pub fn read(&self, name: &str, expected: &[usize]) -> Result<HostTensor, ModelError> {
        let tensor = self.read_any(name)?;
        if tensor.shape != expected {
            return Err(ModelError::ShapeMismatch {
                name: name.to_string(),
                expected: expected.to_vec(),
                actual: tensor.shape,
            });
        }
        Ok(tensor)
    }

    /// Reads tensor `name` as f32 whatever its shape; FP8 tensors are dequantised with their
    /// `_scale_inv` block scales.
    pub fn read_any(&self, name: &str) -> Result<HostTensor, ModelError> {
        self.with_view(name, |view| match view.dtype() {
            Dtype::F8_E4M3 | Dtype::F8_E5M2 => self.dequantize_fp8(name, view),
            _ => Ok(HostTensor {
                shape: view.shape().to_vec(),
                values: float_values(name, view)?,
            }),
        })
    }

    /// Runs `f` on the stored view of tensor `name`.
    fn with_view<T>(
        &self,
        name: &str,
        f: impl FnOnce(&TensorView<'_>) -> Result<T, ModelError>,
    ) -> Result<T, ModelError> {
        let shard = *self
            .location
            .get(name)
            .ok_or_else(|| ModelError::MissingTensor {
                name: name.to_string(),
                dir: self.dir.clone(),
            })?;
        let (path, mmap) = &self.shards[shard];
        let parsed = SafeTensors::deserialize(mmap).map_err(|e| ModelError::BadSafetensors {
            path: path.clone(),
            reason: e.to_string(),
        })?;
        let view = parsed
            .tensor(name)
            .map_err(|e| ModelError::BadSafetensors {
                path: path.clone(),
                reason: e.to_string(),
            })?;
        f(&view)
    }

    /// `fp8(w[i, j]) * scale_inv[i / block_rows, j / block_cols]` for a 2-D FP8 tensor `name`.
    fn dequantize_fp8(&self, name: &str, view: &TensorView<'_>) -> Result<HostTensor, ModelError> {
        let dtype = format!("{:?}", view.dtype());
        let shape = view.shape().to_vec();
        let &[rows, cols] = shape.as_slice() else {
            return Err(ModelError::Fp8Layout {
                name: name.to_string(),
                dtype,
                shape,
            });
        };
        let scale_name = format!("{name}{FP8_SCALE_SUFFIX}");
        if !self.contains(&scale_name) {
            return Err(ModelError::Fp8MissingScale {
                name: name.to_string(),
                dtype,
                dir: self.dir.clone(),
            });
        }
        let [block_rows, block_cols] = self.fp8_block;
        let expected = [rows.div_ceil(block_rows), cols.div_ceil(block_cols)];
        let (scale_shape, scales) = self.with_view(&scale_name, |scale| {
            let shape = scale.shape().to_vec();
            if shape != expected {
                return Ok((shape, Vec::new()));
            }
            Ok((shape, float_values(&scale_name, scale)?))
        })?;
        if scale_shape != expected {
            return Err(ModelError::Fp8ScaleShape {
                name: name.to_string(),
                shape: [rows, cols],
                block: self.fp8_block,
                expected,
                actual: scale_shape,
            });
        }
        let decode: fn(u8) -> f32 = match view.dtype() {
            Dtype::F8_E4M3 => f8_e4m3_to_f32,
            _ => f8_e5m2_to_f32,
        };
        let bytes = view.data();
        let scale_cols = expected[1];
        let mut values = Vec::with_capacity(rows * cols);
        for (i, row) in bytes.chunks_exact(cols.max(1)).take(rows).enumerate() {
            let scale_row = &scales[(i / block_rows) * scale_cols..][..scale_cols];
            values.extend(
                row.iter()
                    .enumerate()
                    .map(|(j, &b)| decode(b) * scale_row[j / block_cols]),
            );
        }
        Ok(HostTensor {
            shape: vec![rows, cols],
            values,
        })
    }
}

/// The values of an F32, F16 or BF16 tensor as f32.
fn float_values(name: &str, view: &TensorView<'_>) -> Result<Vec<f32>, ModelError> {
    decode_floats(view.dtype(), view.data()).ok_or_else(|| ModelError::UnsupportedDtype {
        name: name.to_string(),
        dtype: format!("{:?}", view.dtype()),
    })
}

/// Little-endian F32, F16 or BF16 safetensors bytes as f32 (`None` for any other dtype).
/// Shared with the head's checkpoint reader (tandem-eagle).
pub fn decode_floats(dtype: Dtype, bytes: &[u8]) -> Option<Vec<f32>> {
    Some(match dtype {
        Dtype::F32 => bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
        Dtype::F16 => bytes
            .chunks_exact(2)
            .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        Dtype::BF16 => bytes
            .chunks_exact(2)
            .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        _ => return None,
    })
}

/// OCP FP8 E4M3 ("fn": finite, NaN only) to f32: sign, 4 exponent bits with bias 7, 3 mantissa
/// bits; exponent 0 is subnormal (`m * 2^-9`), `S.1111.111` is NaN, no infinities, max 448.
pub fn f8_e4m3_to_f32(b: u8) -> f32 {
    let exponent = i32::from((b >> 3) & 0x0F);
    let mantissa = f32::from(b & 0x07);
    let magnitude = if exponent == 0x0F && b & 0x07 == 0x07 {
        f32::NAN
    } else if exponent == 0 {
        mantissa * (-9f32).exp2()
    } else {
        (1.0 + mantissa / 8.0) * ((exponent - 7) as f32).exp2()
    };
    if b & 0x80 != 0 { -magnitude } else { magnitude }
}

/// OCP FP8 E5M2 to f32: the upper byte of an IEEE half (bias 15, infinities and NaNs as in f16).
pub fn f8_e5m2_to_f32(b: u8) -> f32 {
    half::f16::from_bits(u16::from(b) << 8).to_f32()
}

/// `quantization_config.weight_block_size` of config.json at `path`; the default when the file,
/// the section or the field is absent.
fn fp8_block_from_config(path: &Path) -> Result<[usize; 2], ModelError> {
    let Ok(text) = std::fs::read_to_string(path) else {
        return Ok(DEFAULT_FP8_BLOCK);
    };
    let config: serde_json::Value =
        serde_json::from_str(&text).map_err(|source| ModelError::Json {
            path: path.to_path_buf(),
            source,
        })?;
    let Some(block) = config
        .get("quantization_config")
        .and_then(|q| q.get("weight_block_size"))
        .filter(|b| !b.is_null())
    else {
        return Ok(DEFAULT_FP8_BLOCK);
    };
    let sizes: Option<Vec<usize>> = block.as_array().and_then(|items| {
        items
            .iter()
            .map(|v| {
                v.as_u64()
                    .and_then(|n| usize::try_from(n).ok())
                    .filter(|&n| n > 0)
            })
            .collect()
    });
    match sizes.as_deref() {
        Some(&[rows, cols]) => Ok([rows, cols]),
        _ => Err(ModelError::InvalidConfig {
            field: "quantization_config.weight_block_size",
            reason: format!("is {block}; expected [rows, cols], two positive integers"),
        }),
    }
}

#[allow(unsafe_code)]
fn map_readonly(file: &std::fs::File) -> std::io::Result<Mmap> {
    // SAFETY: the map is read-only and every tensor is copied out during loading; a concurrent
    // truncation by another process is the only hazard and is outside what we can guard.
    unsafe { Mmap::map(file) }
}

impl HostTensor {
    /// Transpose of a 2-D `[rows, cols]` tensor, giving `[cols, rows]`.
    pub fn transposed(&self) -> HostTensor {
        let (rows, cols) = (self.shape[0], self.shape[1]);
        let mut values = vec![0.0f32; rows * cols];
        for r in 0..rows {
            for c in 0..cols {
                values[c * rows + r] = self.values[r * cols + c];
            }
        }
        HostTensor {
            shape: vec![cols, rows],
            values,
        }
    }
}
