//! Safetensors weights of an HF model directory (single file or sharded with an index), read by
//! their HF tensor names and converted to f32 on the host.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use safetensors::{Dtype, SafeTensors};

use crate::error::ModelError;

/// Memory-mapped safetensors shards and the index of which shard holds which tensor.
pub struct WeightFiles {
    dir: PathBuf,
    shards: Vec<(PathBuf, Mmap)>,
    location: HashMap<String, usize>,
}

/// One tensor read to the host: row-major f32 values and the shape as stored.
#[derive(Debug, Clone)]
pub struct HostTensor {
    pub shape: Vec<usize>,
    pub values: Vec<f32>,
}

impl WeightFiles {
    /// Opens `model.safetensors`, or the shards listed in `model.safetensors.index.json`.
    pub fn open(dir: &Path) -> Result<Self, ModelError> {
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
        })
    }

    pub fn contains(&self, name: &str) -> bool {
        self.location.contains_key(name)
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

    /// Reads tensor `name` as f32 whatever its shape.
    pub fn read_any(&self, name: &str) -> Result<HostTensor, ModelError> {
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
        let bytes = view.data();
        let values: Vec<f32> = match view.dtype() {
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
            other => {
                return Err(ModelError::UnsupportedDtype {
                    name: name.to_string(),
                    dtype: format!("{other:?}"),
                });
            }
        };
        Ok(HostTensor {
            shape: view.shape().to_vec(),
            values,
        })
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
