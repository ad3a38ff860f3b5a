//! Conversion of a GGUF Llama/Qwen2 model to a Hugging Face model directory (f32 weights).

use std::borrow::Cow;
use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use safetensors::{Dtype, View};
use serde::Serialize;
use serde_json::Value;

use crate::config::{Architecture, Hyperparameters};
use crate::names::{RopeRows, hf_tensor_name};
use crate::rope::unpermute_rope_rows;
use crate::tokenizer::build_tokenizer_files;
use crate::{GgmlType, GgufError, GgufFile, TensorInfo};

/// What [`import_gguf`] wrote; also saved as `tandem_import.json` for provenance.
#[derive(Clone, Debug, Serialize)]
pub struct ImportReport {
    /// File name of the GGUF source (no directory).
    pub source_file: String,
    pub source_size_bytes: u64,
    pub gguf_version: u32,
    /// `general.architecture`.
    pub architecture: String,
    /// `general.name`, if present.
    pub model_name: Option<String>,
    pub tensor_count: usize,
    /// Number of tensors per ggml type name, e.g. `{"F32": 61, "Q4_1": 210, "Q8_0": 1}`.
    pub ggml_type_counts: BTreeMap<String, usize>,
    /// Every imported tensor, in GGUF file order.
    pub tensors: Vec<ImportedTensor>,
    pub parameter_count: u64,
    pub vocab_size: usize,
    /// `tokenizer.ggml.pre`, the llama.cpp pre-tokenizer name.
    pub tokenizer_pre: String,
    pub tie_word_embeddings: bool,
    /// Files written into the output directory.
    pub files: Vec<String>,
    /// Things that did not stop the import but deserve a look (e.g. duplicate tokens).
    pub warnings: Vec<String>,
    /// Crate name and version that did the import.
    pub importer: String,
}

/// One tensor of the import.
#[derive(Clone, Debug, Serialize)]
pub struct ImportedTensor {
    pub gguf_name: String,
    pub hf_name: String,
    pub ggml_type: GgmlType,
    /// GGUF dimensions, fastest-varying first.
    pub gguf_dims: Vec<u64>,
    /// Hugging Face shape (`gguf_dims` reversed), stored as f32.
    pub hf_shape: Vec<usize>,
    /// Whether llama.cpp's rotary row permutation was undone.
    pub rope_unpermuted: bool,
}

impl Serialize for GgmlType {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(self.name())
    }
}

const MODEL_FILE: &str = "model.safetensors";
const PROVENANCE_FILE: &str = "tandem_import.json";

/// Converts the GGUF model at `gguf` into a Hugging Face directory `out_dir` (created if needed):
/// `config.json`, `generation_config.json`, `model.safetensors` (f32, HF names and layouts),
/// `tokenizer.json`, `tokenizer_config.json` and `tandem_import.json` (provenance).
///
/// Every file is first written under a temporary name in `out_dir` and renamed only after all
/// of them succeeded, so an interrupted import never leaves a half-written model that looks
/// complete.
pub fn import_gguf(gguf: &Path, out_dir: &Path) -> Result<ImportReport, GgufError> {
    let file = GgufFile::open(gguf)?;
    let hyperparameters = Hyperparameters::read(&file)?;
    let plan = plan_tensors(&file, &hyperparameters)?;
    let tokenizer = build_tokenizer_files(
        file.metadata(),
        &hyperparameters.special_tokens,
        hyperparameters.max_position_embeddings,
    )?;

    let mut ggml_type_counts = BTreeMap::new();
    for info in file.tensors() {
        *ggml_type_counts
            .entry(info.ggml_type.name().to_owned())
            .or_insert(0) += 1;
    }
    let mut warnings = tokenizer.warnings.clone();
    if tokenizer.token_count != hyperparameters.vocab_size {
        // Not fatal: some models pad the embedding beyond the tokenizer's vocabulary.
        warnings.push(format!(
            "{} tokenizer tokens for {} embedding rows",
            tokenizer.token_count, hyperparameters.vocab_size
        ));
    }
    let files = [
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        MODEL_FILE,
        PROVENANCE_FILE,
    ];
    let report = ImportReport {
        source_file: gguf.file_name().map_or_else(
            || gguf.display().to_string(),
            |name| name.to_string_lossy().into_owned(),
        ),
        source_size_bytes: file.file_len(),
        gguf_version: file.version(),
        architecture: hyperparameters.architecture.gguf_name().to_owned(),
        model_name: file.metadata().get_str("general.name")?.map(str::to_owned),
        tensor_count: file.tensors().len(),
        ggml_type_counts,
        tensors: plan.iter().map(|planned| planned.report.clone()).collect(),
        parameter_count: file.tensors().iter().map(TensorInfo::element_count).sum(),
        vocab_size: hyperparameters.vocab_size,
        tokenizer_pre: tokenizer.pre.clone(),
        tie_word_embeddings: hyperparameters.tie_word_embeddings,
        files: files.iter().map(|&name| name.to_owned()).collect(),
        warnings,
        importer: concat!(env!("CARGO_PKG_NAME"), " ", env!("CARGO_PKG_VERSION")).to_owned(),
    };

    let mut writer = StagedFiles::new(out_dir)?;
    writer.write_json("config.json", &hyperparameters.hf_config())?;
    writer.write_json("generation_config.json", &tokenizer.generation_config_json)?;
    writer.write_json("tokenizer.json", &tokenizer.tokenizer_json)?;
    writer.write_json("tokenizer_config.json", &tokenizer.tokenizer_config_json)?;
    writer.write_safetensors(MODEL_FILE, &file, &plan)?;
    let report_json = serde_json::to_value(&report).map_err(|source| GgufError::Json {
        what: PROVENANCE_FILE.into(),
        source,
    })?;
    writer.write_json(PROVENANCE_FILE, &report_json)?;
    writer.commit()?;
    Ok(report)
}

/// One tensor to convert, checked up front so that serialisation cannot fail half-way.
struct PlannedTensor<'a> {
    info: &'a TensorInfo,
    /// `Some(n_head)` when llama.cpp's rotary permutation must be undone with `n_head` heads.
    unpermute_heads: Option<usize>,
    report: ImportedTensor,
}

/// Maps every GGUF tensor to its Hugging Face name and checks type, shape and completeness.
fn plan_tensors<'a>(
    file: &'a GgufFile,
    hyperparameters: &Hyperparameters,
) -> Result<Vec<PlannedTensor<'a>>, GgufError> {
    let architecture = hyperparameters.architecture;
    let mut plan = Vec::with_capacity(file.tensors().len());
    for info in file.tensors() {
        let mapped = hf_tensor_name(&info.name).ok_or_else(|| {
            GgufError::UnsupportedModel(format!(
                "tensor {} has no Hugging Face equivalent in the {} importer",
                info.name,
                architecture.gguf_name()
            ))
        })?;
        if mapped.name.ends_with(".bias") && !architecture.has_qkv_bias() {
            return Err(GgufError::UnsupportedModel(format!(
                "tensor {}: attention biases are not supported for {}",
                info.name,
                architecture.gguf_name()
            )));
        }
        if let Some(layer) = mapped.layer
            && layer >= hyperparameters.num_hidden_layers
        {
            return Err(GgufError::InvalidTensor {
                tensor: info.name.clone(),
                problem: format!(
                    "layer {layer} but the model has {} layers",
                    hyperparameters.num_hidden_layers
                ),
            });
        }
        if !info.ggml_type.can_dequantize() {
            return Err(GgufError::UnsupportedGgmlType {
                tensor: info.name.clone(),
                ggml_type: info.ggml_type,
            });
        }
        let hf_shape = info.torch_shape();
        let expected = hyperparameters
            .expected_hf_shape(&mapped.name)
            .expect("every name in the mapping table has an expected shape");
        if hf_shape != expected {
            return Err(GgufError::InvalidTensor {
                tensor: info.name.clone(),
                problem: format!(
                    "Hugging Face shape {hf_shape:?} (GGUF dims {:?}) does not match the expected {expected:?} for {}",
                    info.dims, mapped.name
                ),
            });
        }
        let unpermute_heads = match mapped.rope_rows {
            _ if !architecture.has_permuted_rope_rows() => None,
            RopeRows::Plain => None,
            RopeRows::QueryHeads => Some(hyperparameters.num_attention_heads),
            RopeRows::KeyValueHeads => Some(hyperparameters.num_key_value_heads),
        };
        plan.push(PlannedTensor {
            info,
            unpermute_heads,
            report: ImportedTensor {
                gguf_name: info.name.clone(),
                hf_name: mapped.name,
                ggml_type: info.ggml_type,
                gguf_dims: info.dims.clone(),
                hf_shape,
                rope_unpermuted: unpermute_heads.is_some(),
            },
        });
    }
    check_complete(&plan, hyperparameters)?;
    Ok(plan)
}

/// Every tensor a Hugging Face model of this configuration needs must be present.
fn check_complete(
    plan: &[PlannedTensor<'_>],
    hyperparameters: &Hyperparameters,
) -> Result<(), GgufError> {
    let present: HashMap<&str, &str> = plan
        .iter()
        .map(|planned| {
            (
                planned.report.hf_name.as_str(),
                planned.report.gguf_name.as_str(),
            )
        })
        .collect();
    let mut required = vec![
        (
            "token_embd.weight".to_owned(),
            "model.embed_tokens.weight".to_owned(),
        ),
        (
            "output_norm.weight".to_owned(),
            "model.norm.weight".to_owned(),
        ),
    ];
    let mut layer_suffixes = vec![
        "attn_norm.weight",
        "attn_q.weight",
        "attn_k.weight",
        "attn_v.weight",
        "attn_output.weight",
        "ffn_norm.weight",
        "ffn_gate.weight",
        "ffn_up.weight",
        "ffn_down.weight",
    ];
    if hyperparameters.architecture == Architecture::Qwen2 {
        layer_suffixes.extend(["attn_q.bias", "attn_k.bias", "attn_v.bias"]);
    }
    for layer in 0..hyperparameters.num_hidden_layers {
        for suffix in &layer_suffixes {
            let gguf_name = format!("blk.{layer}.{suffix}");
            let hf_name = hf_tensor_name(&gguf_name)
                .expect("layer suffixes are in the table")
                .name;
            required.push((gguf_name, hf_name));
        }
    }
    match required
        .into_iter()
        .find(|(_, hf_name)| !present.contains_key(hf_name.as_str()))
    {
        Some((gguf_name, _)) => Err(GgufError::MissingTensor { tensor: gguf_name }),
        None => Ok(()),
    }
}

/// A tensor dequantised (and un-permuted) only when the safetensors writer asks for its bytes,
/// so that at most one tensor is held in f32 at a time.
struct LazyTensor<'a> {
    file: &'a GgufFile,
    planned: &'a PlannedTensor<'a>,
    /// The first failure; `View::data` cannot return errors, so it parks them here.
    error: &'a RefCell<Option<GgufError>>,
}

impl LazyTensor<'_> {
    fn convert(&self) -> Result<Vec<u8>, GgufError> {
        let info = self.planned.info;
        let mut values = self.file.dequantize(info)?;
        if let Some(n_head) = self.planned.unpermute_heads {
            values = unpermute_rope_rows(&values, info.row_len() as usize, n_head).map_err(
                |problem| GgufError::InvalidTensor {
                    tensor: info.name.clone(),
                    problem,
                },
            )?;
        }
        Ok(values
            .iter()
            .flat_map(|value| value.to_le_bytes())
            .collect())
    }
}

impl View for LazyTensor<'_> {
    fn dtype(&self) -> Dtype {
        Dtype::F32
    }

    fn shape(&self) -> &[usize] {
        &self.planned.report.hf_shape
    }

    fn data(&self) -> Cow<'_, [u8]> {
        match self.convert() {
            Ok(bytes) => Cow::Owned(bytes),
            Err(error) => {
                // The staged file is discarded when an error is parked, so the short write
                // this causes is never seen.
                self.error.borrow_mut().get_or_insert(error);
                Cow::Borrowed(&[])
            }
        }
    }

    fn data_len(&self) -> usize {
        self.planned.report.hf_shape.iter().product::<usize>() * std::mem::size_of::<f32>()
    }
}

/// Files written under temporary names in the output directory and renamed together at the end;
/// dropped without [`StagedFiles::commit`], it removes what it wrote.
struct StagedFiles {
    out_dir: PathBuf,
    staged: Vec<(PathBuf, PathBuf)>,
}

impl StagedFiles {
    fn new(out_dir: &Path) -> Result<Self, GgufError> {
        std::fs::create_dir_all(out_dir).map_err(|source| GgufError::Write {
            path: out_dir.to_owned(),
            source,
        })?;
        Ok(Self {
            out_dir: out_dir.to_owned(),
            staged: Vec::new(),
        })
    }

    /// Reserves a temporary path for `name`; it is cleaned up on failure from now on.
    fn stage(&mut self, name: &str) -> PathBuf {
        let temporary = self
            .out_dir
            .join(format!(".{name}.partial-{}", std::process::id()));
        self.staged
            .push((temporary.clone(), self.out_dir.join(name)));
        temporary
    }

    fn write_json(&mut self, name: &str, value: &Value) -> Result<(), GgufError> {
        let mut text = serde_json::to_string_pretty(value).map_err(|source| GgufError::Json {
            what: name.to_owned(),
            source,
        })?;
        text.push('\n');
        let path = self.stage(name);
        std::fs::write(&path, text).map_err(|source| GgufError::Write { path, source })
    }

    fn write_safetensors(
        &mut self,
        name: &str,
        file: &GgufFile,
        plan: &[PlannedTensor<'_>],
    ) -> Result<(), GgufError> {
        let path = self.stage(name);
        let error = RefCell::new(None);
        let tensors = plan.iter().map(|planned| {
            (
                planned.report.hf_name.clone(),
                LazyTensor {
                    file,
                    planned,
                    error: &error,
                },
            )
        });
        // transformers refuses safetensors checkpoints without a "format" entry.
        let metadata = HashMap::from([("format".to_owned(), "pt".to_owned())]);
        safetensors::serialize_to_file(tensors, Some(metadata), &path).map_err(|source| {
            GgufError::Safetensors {
                path: path.clone(),
                source,
            }
        })?;
        match error.into_inner() {
            Some(error) => Err(error),
            None => Ok(()),
        }
    }

    /// Renames every staged file to its final name.
    fn commit(mut self) -> Result<(), GgufError> {
        while let Some((temporary, final_path)) = self.staged.first() {
            std::fs::rename(temporary, final_path).map_err(|source| GgufError::Write {
                path: final_path.clone(),
                source,
            })?;
            // Renamed files are no longer ours to clean up.
            self.staged.remove(0);
        }
        Ok(())
    }
}

impl Drop for StagedFiles {
    fn drop(&mut self) {
        for (temporary, _) in &self.staged {
            // Best effort: the file may not exist if staging failed before writing it.
            let _ = std::fs::remove_file(temporary);
        }
    }
}
