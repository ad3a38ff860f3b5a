//! A minimal GGUF writer for tests, and tests of the reader and importer on files it writes.

use half::{bf16, f16};

use crate::{GgmlType, MetadataValue, ValueType};

/// Builds GGUF bytes: metadata pairs and tensors in insertion order.
pub(crate) struct GgufWriter {
    pub version: u32,
    metadata: Vec<(String, MetadataValue)>,
    /// `(name, dims, ggml type number, data)`.
    tensors: Vec<(String, Vec<u64>, u32, Vec<u8>)>,
}

impl GgufWriter {
    pub fn new() -> Self {
        Self {
            version: 3,
            metadata: Vec::new(),
            tensors: Vec::new(),
        }
    }

    /// Sets `key`, replacing an earlier value in place.
    pub fn kv(mut self, key: &str, value: MetadataValue) -> Self {
        match self
            .metadata
            .iter_mut()
            .find(|(existing, _)| existing == key)
        {
            Some((_, existing)) => *existing = value,
            None => self.metadata.push((key.to_owned(), value)),
        }
        self
    }

    pub fn tensor(self, name: &str, dims: &[u64], ggml_type: GgmlType, data: Vec<u8>) -> Self {
        self.tensor_with_type_id(name, dims, ggml_type.id(), data)
    }

    pub fn tensor_with_type_id(
        mut self,
        name: &str,
        dims: &[u64],
        type_id: u32,
        data: Vec<u8>,
    ) -> Self {
        self.tensors
            .push((name.to_owned(), dims.to_vec(), type_id, data));
        self
    }

    pub fn without_tensor(mut self, name: &str) -> Self {
        self.tensors.retain(|(tensor, ..)| tensor != name);
        self
    }

    pub fn build(&self) -> Vec<u8> {
        let alignment = self
            .metadata
            .iter()
            .find(|(key, _)| key == "general.alignment")
            .and_then(|(_, value)| value.as_u64())
            .unwrap_or(32) as usize;
        let mut out = b"GGUF".to_vec();
        out.extend(self.version.to_le_bytes());
        out.extend((self.tensors.len() as u64).to_le_bytes());
        out.extend((self.metadata.len() as u64).to_le_bytes());
        for (key, value) in &self.metadata {
            write_string(&mut out, key);
            out.extend(value.value_type().id().to_le_bytes());
            write_value(&mut out, value);
        }
        let mut offset = 0usize;
        let mut offsets = Vec::new();
        for (name, dims, type_id, data) in &self.tensors {
            write_string(&mut out, name);
            out.extend((dims.len() as u32).to_le_bytes());
            for dim in dims {
                out.extend(dim.to_le_bytes());
            }
            out.extend(type_id.to_le_bytes());
            out.extend((offset as u64).to_le_bytes());
            offsets.push(offset);
            offset = (offset + data.len()).next_multiple_of(alignment);
        }
        if !self.tensors.is_empty() {
            out.resize(out.len().next_multiple_of(alignment), 0);
        }
        let data_start = out.len();
        for ((_, _, _, data), offset) in self.tensors.iter().zip(offsets) {
            out.resize(data_start + offset, 0);
            out.extend(data);
        }
        out
    }
}

fn write_string(out: &mut Vec<u8>, text: &str) {
    out.extend((text.len() as u64).to_le_bytes());
    out.extend(text.as_bytes());
}

fn write_value(out: &mut Vec<u8>, value: &MetadataValue) {
    match value {
        MetadataValue::U8(v) => out.extend(v.to_le_bytes()),
        MetadataValue::I8(v) => out.extend(v.to_le_bytes()),
        MetadataValue::U16(v) => out.extend(v.to_le_bytes()),
        MetadataValue::I16(v) => out.extend(v.to_le_bytes()),
        MetadataValue::U32(v) => out.extend(v.to_le_bytes()),
        MetadataValue::I32(v) => out.extend(v.to_le_bytes()),
        MetadataValue::F32(v) => out.extend(v.to_le_bytes()),
        MetadataValue::Bool(v) => out.push(u8::from(*v)),
        MetadataValue::String(v) => write_string(out, v),
        MetadataValue::Array {
            element_type,
            values,
        } => {
            out.extend(element_type.id().to_le_bytes());
            out.extend((values.len() as u64).to_le_bytes());
            for value in values {
                write_value(out, value);
            }
        }
        MetadataValue::U64(v) => out.extend(v.to_le_bytes()),
        MetadataValue::I64(v) => out.extend(v.to_le_bytes()),
        MetadataValue::F64(v) => out.extend(v.to_le_bytes()),
    }
}

pub(crate) fn string(text: &str) -> MetadataValue {
    MetadataValue::String(text.to_owned())
}

pub(crate) fn strings(texts: &[&str]) -> MetadataValue {
    MetadataValue::Array {
        element_type: ValueType::String,
        values: texts.iter().map(|text| string(text)).collect(),
    }
}

pub(crate) fn i32s(values: &[i32]) -> MetadataValue {
    MetadataValue::Array {
        element_type: ValueType::I32,
        values: values.iter().map(|&v| MetadataValue::I32(v)).collect(),
    }
}

/// Deterministic values that f16 and bf16 represent exactly (multiples of 1/64 below 1).
pub(crate) fn pattern(len: usize, seed: usize) -> Vec<f32> {
    (0..len)
        .map(|i| ((i * 37 + seed * 11) % 101) as f32 / 64.0 - 50.0 / 64.0)
        .collect()
}

/// Encodes `values` exactly for F32/F16/BF16; for block types returns `values.len()` worth of
/// patterned blocks whose f16 scales are set to 1/8 (the exact values are then whatever the
/// separately tested dequantiser says).
pub(crate) fn encode(ggml_type: GgmlType, values: &[f32]) -> Vec<u8> {
    match ggml_type {
        GgmlType::F32 => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
        GgmlType::F16 => values
            .iter()
            .flat_map(|&v| f16::from_f32(v).to_le_bytes())
            .collect(),
        GgmlType::BF16 => values
            .iter()
            .flat_map(|&v| bf16::from_f32(v).to_le_bytes())
            .collect(),
        _ => {
            let blocks = values.len() / ggml_type.block_len();
            let block_bytes = ggml_type.block_bytes();
            let scale_offsets: &[usize] = match ggml_type {
                GgmlType::Q8_0 | GgmlType::Q4_0 => &[0],
                GgmlType::Q4_1 | GgmlType::Q4_K => &[0, 2],
                GgmlType::Q6_K => &[208],
                other => panic!("no test encoding for {other}"),
            };
            let mut bytes: Vec<u8> = (0..blocks * block_bytes)
                .map(|i| (i * 53 % 251) as u8)
                .collect();
            for block in bytes.chunks_exact_mut(block_bytes) {
                for &at in scale_offsets {
                    block[at..at + 2].copy_from_slice(&f16::from_f32(0.125).to_le_bytes());
                }
            }
            bytes
        }
    }
}

/// Dimensions of the tiny Llama used by the import tests.
pub(crate) const HIDDEN: u64 = 32;
pub(crate) const HEADS: u64 = 4;
pub(crate) const KV_HEADS: u64 = 2;
pub(crate) const HEAD_DIM: u64 = 8;
pub(crate) const FFN: u64 = 256;
pub(crate) const LAYERS: u64 = 2;
pub(crate) const TOKENS: &[&str] = &[
    "<|endoftext|>",
    "<|im_start|>",
    "a",
    "b",
    "ab",
    "Ġ",
    "Ġa",
    "c",
];

/// A complete two-layer Llama GGUF using every supported tensor type somewhere.
pub(crate) fn tiny_llama() -> GgufWriter {
    tiny_model("llama")
}

/// A two-layer model of architecture `arch` ("llama" or "qwen2"; Qwen2 adds q/k/v biases).
pub(crate) fn tiny_model(arch: &str) -> GgufWriter {
    let key = |suffix: &str| format!("{arch}.{suffix}");
    let count = |value: u64| MetadataValue::U32(value as u32);
    let mut writer = GgufWriter::new()
        .kv("general.architecture", string(arch))
        .kv("general.name", string("tiny"))
        .kv(&key("block_count"), count(LAYERS))
        .kv(&key("context_length"), count(128))
        .kv(&key("embedding_length"), count(HIDDEN))
        .kv(&key("feed_forward_length"), count(FFN))
        .kv(&key("attention.head_count"), count(HEADS))
        .kv(&key("attention.head_count_kv"), count(KV_HEADS))
        .kv(&key("rope.freq_base"), MetadataValue::F32(100_000.0))
        .kv(
            &key("attention.layer_norm_rms_epsilon"),
            MetadataValue::F32(1e-5),
        )
        .kv(&key("rope.dimension_count"), count(HEAD_DIM))
        .kv("tokenizer.ggml.model", string("gpt2"))
        .kv(
            "tokenizer.ggml.pre",
            string(if arch == "qwen2" { "qwen2" } else { "smollm" }),
        )
        .kv("tokenizer.ggml.tokens", strings(TOKENS))
        .kv("tokenizer.ggml.token_type", i32s(&[3, 3, 1, 1, 1, 1, 1, 1]))
        .kv("tokenizer.ggml.merges", strings(&["a b", "Ġ a"]))
        .kv("tokenizer.ggml.bos_token_id", MetadataValue::U32(1))
        .kv("tokenizer.ggml.eos_token_id", MetadataValue::U32(0))
        .kv("tokenizer.chat_template", string("{{ messages }}"));
    let vocab = TOKENS.len() as u64;
    let global: [(&str, Vec<u64>, GgmlType); 2] = [
        ("token_embd.weight", vec![HIDDEN, vocab], GgmlType::F32),
        ("output_norm.weight", vec![HIDDEN], GgmlType::F32),
    ];
    for (seed, (name, dims, ty)) in global.into_iter().enumerate() {
        let values = pattern(dims.iter().product::<u64>() as usize, seed);
        writer = writer.tensor(name, &dims, ty, encode(ty, &values));
    }
    for layer in 0..LAYERS {
        let ffn_down_type = if layer == 0 {
            GgmlType::Q4_K
        } else {
            GgmlType::Q6_K
        };
        let mut tensors: Vec<(&str, Vec<u64>, GgmlType)> = vec![
            ("attn_norm.weight", vec![HIDDEN], GgmlType::F32),
            (
                "attn_q.weight",
                vec![HIDDEN, HEADS * HEAD_DIM],
                GgmlType::Q8_0,
            ),
            (
                "attn_k.weight",
                vec![HIDDEN, KV_HEADS * HEAD_DIM],
                GgmlType::F16,
            ),
            (
                "attn_v.weight",
                vec![HIDDEN, KV_HEADS * HEAD_DIM],
                GgmlType::BF16,
            ),
            (
                "attn_output.weight",
                vec![HEADS * HEAD_DIM, HIDDEN],
                GgmlType::Q4_0,
            ),
            ("ffn_norm.weight", vec![HIDDEN], GgmlType::F32),
            ("ffn_gate.weight", vec![HIDDEN, FFN], GgmlType::Q4_1),
            ("ffn_up.weight", vec![HIDDEN, FFN], GgmlType::F32),
            ("ffn_down.weight", vec![FFN, HIDDEN], ffn_down_type),
        ];
        if arch == "qwen2" {
            tensors.extend([
                ("attn_q.bias", vec![HEADS * HEAD_DIM], GgmlType::F32),
                ("attn_k.bias", vec![KV_HEADS * HEAD_DIM], GgmlType::F32),
                ("attn_v.bias", vec![KV_HEADS * HEAD_DIM], GgmlType::F32),
            ]);
        }
        for (seed, (suffix, dims, ty)) in tensors.into_iter().enumerate() {
            let values = pattern(
                dims.iter().product::<u64>() as usize,
                seed + 20 * layer as usize,
            );
            writer = writer.tensor(
                &format!("blk.{layer}.{suffix}"),
                &dims,
                ty,
                encode(ty, &values),
            );
        }
    }
    writer
}

/// A fresh, empty directory under the system temp dir, removed on drop.
pub(crate) struct TempDir(pub std::path::PathBuf);

impl TempDir {
    pub fn new(label: &str) -> Self {
        use std::sync::atomic::{AtomicUsize, Ordering};
        static COUNTER: AtomicUsize = AtomicUsize::new(0);
        let path = std::env::temp_dir().join(format!(
            "tandem-gguf-{label}-{}-{}",
            std::process::id(),
            COUNTER.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&path);
        std::fs::create_dir_all(&path).unwrap();
        Self(path)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[cfg(test)]
mod reader_tests {
    use super::*;
    use crate::{GgufError, GgufFile};

    fn all_value_types() -> GgufWriter {
        let nested = MetadataValue::Array {
            element_type: ValueType::Array,
            values: vec![i32s(&[1, -2]), i32s(&[])],
        };
        GgufWriter::new()
            .kv("u8", MetadataValue::U8(200))
            .kv("i8", MetadataValue::I8(-100))
            .kv("u16", MetadataValue::U16(60_000))
            .kv("i16", MetadataValue::I16(-30_000))
            .kv("u32", MetadataValue::U32(4_000_000_000))
            .kv("i32", MetadataValue::I32(-2_000_000_000))
            .kv("f32", MetadataValue::F32(1e-5))
            .kv("bool", MetadataValue::Bool(true))
            .kv("string", string("héllo"))
            .kv("u64", MetadataValue::U64(u64::MAX))
            .kv("i64", MetadataValue::I64(i64::MIN))
            .kv("f64", MetadataValue::F64(-1.5e300))
            .kv("strings", strings(&["a", "", "ĠΩ"]))
            .kv("nested", nested)
    }

    #[test]
    fn parses_every_metadata_type_in_v2_and_v3() {
        for version in [2, 3] {
            let mut writer = all_value_types();
            writer.version = version;
            let file = GgufFile::from_bytes(writer.build()).unwrap();
            assert_eq!(file.version(), version);
            let metadata = file.metadata();
            assert_eq!(metadata.len(), 14);
            for (key, value) in &writer.metadata {
                assert_eq!(metadata.get(key), Some(value), "{key}");
            }
            assert_eq!(metadata.get_u64("u8").unwrap(), Some(200));
            assert_eq!(
                metadata.get_u64("i8").unwrap_err().to_string(),
                "metadata key i8: expected a non-negative integer, found i8"
            );
            assert_eq!(metadata.get_f64("f32").unwrap(), Some(9.999999747378752e-6));
            assert_eq!(metadata.get_str("string").unwrap(), Some("héllo"));
            assert_eq!(
                metadata.get_str_array("strings").unwrap(),
                Some(vec!["a", "", "ĠΩ"])
            );
            assert_eq!(metadata.get_str("missing").unwrap(), None);
            assert_eq!(
                metadata.get("nested").unwrap().type_description(),
                "array of array"
            );
            let keys: Vec<&str> = metadata.iter().map(|(key, _)| key).collect();
            assert_eq!(keys[..3], ["u8", "i8", "u16"]);
            assert_eq!(file.tensors().len(), 0);
            assert_eq!(file.data_offset() % 32, 0);
        }
    }

    #[test]
    fn reads_tensor_infos_alignment_and_rows() {
        let values = pattern(64 * 3, 1);
        let bytes = GgufWriter::new()
            .kv("general.alignment", MetadataValue::U32(64))
            .tensor(
                "norm",
                &[5],
                GgmlType::F32,
                encode(GgmlType::F32, &pattern(5, 0)),
            )
            .tensor(
                "matrix",
                &[64, 3],
                GgmlType::F16,
                encode(GgmlType::F16, &values),
            )
            .build();
        let file = GgufFile::from_bytes(bytes).unwrap();
        assert_eq!(file.alignment(), 64);
        assert_eq!(file.data_offset() % 64, 0);
        let matrix = file.tensor("matrix").unwrap().clone();
        assert_eq!((matrix.offset, matrix.byte_len), (64, 64 * 3 * 2));
        assert_eq!(matrix.torch_shape(), [3, 64]);
        assert_eq!((matrix.row_len(), matrix.row_count()), (64, 3));
        assert_eq!(file.dequantize(&matrix).unwrap(), values);
        assert_eq!(file.dequantize_rows(&matrix, 1..3).unwrap(), values[64..]);
        assert!(file.dequantize_rows(&matrix, 2..4).is_err());
        assert_eq!(
            file.dequantize(file.tensor("norm").unwrap()).unwrap(),
            pattern(5, 0)
        );
    }

    #[test]
    fn open_memory_maps_a_file() {
        let dir = TempDir::new("open");
        let path = dir.0.join("tiny.gguf");
        std::fs::write(&path, tiny_llama().build()).unwrap();
        let file = GgufFile::open(&path).unwrap();
        assert_eq!(file.architecture().unwrap(), "llama");
        assert_eq!(file.tensors().len(), 2 + 9 * LAYERS as usize);
        let missing = GgufFile::open(&dir.0.join("absent.gguf")).unwrap_err();
        assert!(missing.to_string().starts_with("cannot read "), "{missing}");
    }

    #[test]
    fn bad_magic_is_named() {
        let mut bytes = all_value_types().build();
        bytes[..4].copy_from_slice(b"GGML");
        let error = GgufFile::from_bytes(bytes).unwrap_err();
        assert!(matches!(error, GgufError::BadMagic { .. }));
        assert!(error.to_string().contains("not a GGUF file"), "{error}");
    }

    #[test]
    fn unsupported_versions_are_refused() {
        for (version, hint) in [(1, false), (4, false), (3u32.swap_bytes(), true)] {
            let mut writer = all_value_types();
            writer.version = version;
            let error = GgufFile::from_bytes(writer.build()).unwrap_err();
            assert!(matches!(error, GgufError::UnsupportedVersion { version: v } if v == version));
            assert_eq!(error.to_string().contains("big-endian"), hint, "{error}");
        }
    }

    #[test]
    fn truncated_metadata_names_the_key_and_range() {
        let bytes = all_value_types().build();
        // Cut inside the last value (the nested array).
        let error = GgufFile::from_bytes(bytes[..bytes.len() - 3].to_vec()).unwrap_err();
        let message = error.to_string();
        assert!(matches!(error, GgufError::Truncated { .. }), "{message}");
        assert!(message.contains("metadata pair #13 (nested)"), "{message}");
        assert!(
            message.contains(&format!("but the file has {} bytes", bytes.len() - 3)),
            "{message}"
        );
    }

    #[test]
    fn truncated_tensor_data_names_the_tensor_and_range() {
        let bytes = tiny_llama().build();
        let file_len = bytes.len() - 10;
        let error = GgufFile::from_bytes(bytes[..file_len].to_vec()).unwrap_err();
        let GgufError::TruncatedTensor {
            tensor,
            start,
            end,
            file_len: reported,
        } = &error
        else {
            panic!("unexpected error {error}");
        };
        assert_eq!(tensor, "blk.1.ffn_down.weight");
        assert_eq!((*end, *reported), (bytes.len() as u64, file_len as u64));
        assert_eq!(end - start, 210 * (FFN * HIDDEN / 256));
        assert!(
            error.to_string().contains(&format!(
                "tensor blk.1.ffn_down.weight needs bytes {start}..{end}"
            )),
            "{error}"
        );
    }

    #[test]
    fn unknown_ggml_types_are_refused_by_number_and_name() {
        let with_type = |type_id| {
            GgufWriter::new()
                .tensor_with_type_id("weird", &[32], type_id, vec![0; 64])
                .build()
        };
        let error = GgufFile::from_bytes(with_type(31)).unwrap_err();
        assert_eq!(
            error.to_string(),
            "tensor weird: unknown ggml type 31 (Q4_0_4_4, not supported by this reader)"
        );
        let error = GgufFile::from_bytes(with_type(99)).unwrap_err();
        assert_eq!(error.to_string(), "tensor weird: unknown ggml type 99");
    }

    #[test]
    fn known_but_undequantisable_types_are_refused_by_name() {
        let bytes = GgufWriter::new()
            .tensor("q5", &[256], GgmlType::Q5_K, vec![0; 176])
            .build();
        let file = GgufFile::from_bytes(bytes).unwrap();
        let error = file.dequantize(&file.tensors()[0]).unwrap_err();
        assert!(matches!(
            error,
            GgufError::UnsupportedGgmlType {
                ggml_type: GgmlType::Q5_K,
                ..
            }
        ));
        assert!(
            error
                .to_string()
                .starts_with("tensor q5: ggml type Q5_K cannot be dequantised yet"),
            "{error}"
        );
    }

    #[test]
    fn malformed_tensor_infos_are_refused() {
        let row_not_whole_blocks = GgufWriter::new()
            .tensor("odd", &[48], GgmlType::Q8_0, vec![0; 51])
            .build();
        let error = GgufFile::from_bytes(row_not_whole_blocks).unwrap_err();
        assert!(
            error
                .to_string()
                .contains("row length 48 is not a multiple of the Q8_0 block length 32"),
            "{error}"
        );

        let duplicate = GgufWriter::new()
            .tensor("same", &[1], GgmlType::F32, vec![0; 4])
            .tensor("same", &[1], GgmlType::F32, vec![0; 4])
            .build();
        assert!(
            GgufFile::from_bytes(duplicate)
                .unwrap_err()
                .to_string()
                .contains("more than once")
        );
    }
}

#[cfg(test)]
mod import_tests {
    use std::collections::HashMap;

    use serde_json::Value;

    use super::*;
    use crate::rope::unpermute_rope_rows;
    use crate::{GgufError, GgufFile, import_gguf};

    fn read_json(path: &std::path::Path) -> Value {
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
    }

    fn import(
        writer: &GgufWriter,
        label: &str,
    ) -> (TempDir, Result<crate::ImportReport, GgufError>) {
        let dir = TempDir::new(label);
        let source = dir.0.join("tiny.gguf");
        std::fs::write(&source, writer.build()).unwrap();
        let result = import_gguf(&source, &dir.0.join("hf"));
        (dir, result)
    }

    #[test]
    fn imports_a_tiny_llama() {
        let writer = tiny_llama();
        let (dir, report) = import(&writer, "import");
        let report = report.unwrap();
        let out = dir.0.join("hf");

        assert_eq!(report.architecture, "llama");
        assert_eq!(report.tensor_count, 2 + 9 * LAYERS as usize);
        assert_eq!(report.ggml_type_counts["F32"], 2 + 3 * LAYERS as usize);
        assert_eq!(report.ggml_type_counts["Q4_K"], 1);
        assert_eq!(report.tokenizer_pre, "smollm");
        assert!(report.tie_word_embeddings);
        assert!(report.warnings.is_empty(), "{:?}", report.warnings);
        let mut listed: Vec<String> = std::fs::read_dir(&out)
            .unwrap()
            .map(|entry| entry.unwrap().file_name().into_string().unwrap())
            .collect();
        listed.sort();
        let mut expected = report.files.clone();
        expected.sort();
        assert_eq!(listed, expected, "no temporary files are left behind");

        let config = read_json(&out.join("config.json"));
        assert_eq!(config["architectures"][0], "LlamaForCausalLM");
        assert_eq!(config["model_type"], "llama");
        assert_eq!(config["hidden_size"], HIDDEN);
        assert_eq!(config["intermediate_size"], FFN);
        assert_eq!(config["num_hidden_layers"], LAYERS);
        assert_eq!(config["num_attention_heads"], HEADS);
        assert_eq!(config["num_key_value_heads"], KV_HEADS);
        assert_eq!(config["head_dim"], HEAD_DIM);
        assert_eq!(config["rms_norm_eps"].as_f64(), Some(9.999999747378752e-6));
        assert_eq!(config["rope_theta"].as_f64(), Some(100_000.0));
        assert_eq!(config["max_position_embeddings"], 128);
        assert_eq!(config["vocab_size"], TOKENS.len());
        assert_eq!(config["tie_word_embeddings"], true);
        assert_eq!(
            (
                config["bos_token_id"].as_u64(),
                config["eos_token_id"].as_u64()
            ),
            (Some(1), Some(0))
        );
        assert!(config.get("pad_token_id").is_none());
        assert_eq!(config["rope_scaling"], Value::Null);
        assert_eq!(config["torch_dtype"], "float32");

        let generation = read_json(&out.join("generation_config.json"));
        assert_eq!(
            (
                generation["bos_token_id"].as_u64(),
                generation["eos_token_id"].as_u64()
            ),
            (Some(1), Some(0))
        );
        let tokenizer_config = read_json(&out.join("tokenizer_config.json"));
        assert_eq!(tokenizer_config["bos_token"], "<|im_start|>");
        assert_eq!(tokenizer_config["eos_token"], "<|endoftext|>");
        assert_eq!(tokenizer_config["chat_template"], "{{ messages }}");
        assert_eq!(tokenizer_config["add_bos_token"], false);
        let provenance = read_json(&out.join("tandem_import.json"));
        assert_eq!(provenance["source_file"], "tiny.gguf");
        assert_eq!(provenance["tensors"][0]["ggml_type"], "F32");

        // Weights: HF names and shapes, q/k un-permuted with their own head counts.
        let gguf = GgufFile::from_bytes(writer.build()).unwrap();
        let bytes = std::fs::read(out.join("model.safetensors")).unwrap();
        let (_, header) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
        assert_eq!(
            header
                .metadata()
                .as_ref()
                .and_then(|m| m.get("format"))
                .map(String::as_str),
            Some("pt")
        );
        let tensors = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        assert_eq!(tensors.len(), 2 + 9 * LAYERS as usize);
        assert!(tensors.tensor("lm_head.weight").is_err());
        let load = |name: &str| -> (Vec<usize>, Vec<f32>) {
            let view = tensors.tensor(name).unwrap();
            assert_eq!(view.dtype(), safetensors::Dtype::F32);
            let values = view
                .data()
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
                .collect();
            (view.shape().to_vec(), values)
        };
        let dequantized = |name: &str| gguf.dequantize(gguf.tensor(name).unwrap()).unwrap();
        let hidden = HIDDEN as usize;

        let (shape, q) = load("model.layers.1.self_attn.q_proj.weight");
        assert_eq!(shape, [(HEADS * HEAD_DIM) as usize, hidden]);
        assert_eq!(
            q,
            unpermute_rope_rows(&dequantized("blk.1.attn_q.weight"), hidden, HEADS as usize)
                .unwrap()
        );
        let (shape, k) = load("model.layers.0.self_attn.k_proj.weight");
        assert_eq!(shape, [(KV_HEADS * HEAD_DIM) as usize, hidden]);
        assert_eq!(
            k,
            unpermute_rope_rows(
                &dequantized("blk.0.attn_k.weight"),
                hidden,
                KV_HEADS as usize
            )
            .unwrap()
        );
        assert_ne!(k, dequantized("blk.0.attn_k.weight"));

        let plain: HashMap<&str, &str> = HashMap::from([
            ("model.embed_tokens.weight", "token_embd.weight"),
            ("model.norm.weight", "output_norm.weight"),
            (
                "model.layers.0.input_layernorm.weight",
                "blk.0.attn_norm.weight",
            ),
            (
                "model.layers.0.self_attn.v_proj.weight",
                "blk.0.attn_v.weight",
            ),
            (
                "model.layers.0.self_attn.o_proj.weight",
                "blk.0.attn_output.weight",
            ),
            (
                "model.layers.1.post_attention_layernorm.weight",
                "blk.1.ffn_norm.weight",
            ),
            (
                "model.layers.0.mlp.gate_proj.weight",
                "blk.0.ffn_gate.weight",
            ),
            ("model.layers.1.mlp.up_proj.weight", "blk.1.ffn_up.weight"),
            (
                "model.layers.0.mlp.down_proj.weight",
                "blk.0.ffn_down.weight",
            ),
            (
                "model.layers.1.mlp.down_proj.weight",
                "blk.1.ffn_down.weight",
            ),
        ]);
        for (hf_name, gguf_name) in plain {
            let (shape, values) = load(hf_name);
            assert_eq!(
                shape,
                gguf.tensor(gguf_name).unwrap().torch_shape(),
                "{hf_name}"
            );
            assert_eq!(values, dequantized(gguf_name), "{hf_name}");
        }
        assert_eq!(
            load("model.layers.1.mlp.down_proj.weight").0,
            [hidden, FFN as usize]
        );
        assert_eq!(
            load("model.embed_tokens.weight").1,
            pattern(hidden * TOKENS.len(), 0)
        );
    }

    #[test]
    fn imported_tokenizer_loads_and_encodes() {
        let (dir, report) = import(&tiny_llama(), "tokenizer");
        report.unwrap();
        let tokenizer = tokenizers::Tokenizer::from_file(dir.0.join("hf/tokenizer.json")).unwrap();
        let encoding = tokenizer.encode("ab a<|im_start|>b", false).unwrap();
        assert_eq!(encoding.get_ids(), [4, 6, 1, 3]);
        assert_eq!(
            tokenizer.decode(&[4, 6, 1, 3], false).unwrap(),
            "ab a<|im_start|>b"
        );
        assert_eq!(tokenizer.decode(&[4, 6, 1, 3], true).unwrap(), "ab ab");
    }

    #[test]
    fn add_bos_token_becomes_a_template() {
        let writer = tiny_llama().kv("tokenizer.ggml.add_bos_token", MetadataValue::Bool(true));
        let (dir, report) = import(&writer, "bos");
        report.unwrap();
        let tokenizer = tokenizers::Tokenizer::from_file(dir.0.join("hf/tokenizer.json")).unwrap();
        assert_eq!(tokenizer.encode("ab", true).unwrap().get_ids(), [1, 4]);
        assert_eq!(tokenizer.encode("ab", false).unwrap().get_ids(), [4]);
    }

    #[test]
    fn untied_output_becomes_lm_head() {
        let vocab = TOKENS.len() as u64;
        let writer = tiny_llama().tensor(
            "output.weight",
            &[HIDDEN, vocab],
            GgmlType::F16,
            encode(GgmlType::F16, &pattern((HIDDEN * vocab) as usize, 9)),
        );
        let (dir, report) = import(&writer, "untied");
        assert!(!report.unwrap().tie_word_embeddings);
        let bytes = std::fs::read(dir.0.join("hf/model.safetensors")).unwrap();
        let tensors = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        assert_eq!(
            tensors.tensor("lm_head.weight").unwrap().shape(),
            [TOKENS.len(), HIDDEN as usize]
        );
        assert_eq!(
            read_json(&dir.0.join("hf/config.json"))["tie_word_embeddings"],
            false
        );
    }

    #[test]
    fn unsupported_architecture_is_refused_by_name() {
        let writer = tiny_llama().kv("general.architecture", string("gpt2"));
        let (dir, result) = import(&writer, "arch");
        let error = result.unwrap_err();
        assert_eq!(
            error.to_string(),
            "gpt2 is not supported by the importer yet (supported: llama, qwen2)"
        );
        assert!(
            !dir.0.join("hf").exists(),
            "nothing is written for a refused model"
        );
    }

    #[test]
    fn refusals_leave_no_files_and_name_the_problem() {
        let cases: Vec<(GgufWriter, &str)> = vec![
            (
                tiny_llama().without_tensor("blk.1.ffn_up.weight"),
                "required tensor blk.1.ffn_up.weight is missing",
            ),
            (
                tiny_llama().without_tensor("blk.0.ffn_down.weight").tensor(
                    "blk.0.ffn_down.weight",
                    &[FFN, HIDDEN],
                    GgmlType::Q5_K,
                    vec![0; 176 * 32],
                ),
                "tensor blk.0.ffn_down.weight: ggml type Q5_K cannot be dequantised yet",
            ),
            (
                tiny_llama().tensor(
                    "rope_freqs.weight",
                    &[HEAD_DIM / 2],
                    GgmlType::F32,
                    vec![0; 16],
                ),
                "rope_freqs.weight",
            ),
            (
                tiny_llama().tensor(
                    "blk.0.attn_rot_embd",
                    &[HEAD_DIM],
                    GgmlType::F32,
                    vec![0; 32],
                ),
                "tensor blk.0.attn_rot_embd has no Hugging Face equivalent",
            ),
            (
                tiny_llama().without_tensor("output_norm.weight").tensor(
                    "output_norm.weight",
                    &[HIDDEN * 2],
                    GgmlType::F32,
                    vec![0; 256],
                ),
                "tensor output_norm.weight: Hugging Face shape [64]",
            ),
        ];
        for (writer, expected) in cases {
            let (dir, result) = import(&writer, "refuse");
            let message = result.unwrap_err().to_string();
            assert!(
                message.contains(expected),
                "{message:?} should contain {expected:?}"
            );
            assert!(!dir.0.join("hf").exists());
        }

        let unknown_pre = tiny_llama().kv("tokenizer.ggml.pre", string("mystery"));
        let (_dir, result) = import(&unknown_pre, "pre");
        let message = result.unwrap_err().to_string();
        assert!(
            message.contains("pre-tokenizer \"mystery\" (tokenizer.ggml.pre) is not known"),
            "{message}"
        );
    }

    #[test]
    fn imports_a_tiny_qwen2_with_biases_and_no_permutation() {
        let writer = tiny_model("qwen2");
        let (dir, report) = import(&writer, "qwen2");
        let report = report.unwrap();
        assert_eq!(report.architecture, "qwen2");
        assert!(report.tensors.iter().all(|tensor| !tensor.rope_unpermuted));
        let out = dir.0.join("hf");
        let config = read_json(&out.join("config.json"));
        assert_eq!(config["architectures"][0], "Qwen2ForCausalLM");
        assert_eq!(config["model_type"], "qwen2");
        assert_eq!(config["use_sliding_window"], false);

        let gguf = GgufFile::from_bytes(writer.build()).unwrap();
        let bytes = std::fs::read(out.join("model.safetensors")).unwrap();
        let tensors = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        for (hf_name, gguf_name) in [
            (
                "model.layers.0.self_attn.q_proj.weight",
                "blk.0.attn_q.weight",
            ),
            (
                "model.layers.1.self_attn.k_proj.weight",
                "blk.1.attn_k.weight",
            ),
            ("model.layers.0.self_attn.q_proj.bias", "blk.0.attn_q.bias"),
            ("model.layers.1.self_attn.v_proj.bias", "blk.1.attn_v.bias"),
        ] {
            let view = tensors.tensor(hf_name).unwrap();
            let values: Vec<f32> = view
                .data()
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
                .collect();
            assert_eq!(
                values,
                gguf.dequantize(gguf.tensor(gguf_name).unwrap()).unwrap(),
                "{hf_name}"
            );
        }

        let tokenizer = tokenizers::Tokenizer::from_file(out.join("tokenizer.json")).unwrap();
        assert_eq!(
            tokenizer
                .encode("ab a<|im_start|>", false)
                .unwrap()
                .get_ids(),
            [4, 6, 1]
        );

        let missing_bias = tiny_model("qwen2").without_tensor("blk.1.attn_k.bias");
        let (_dir, result) = import(&missing_bias, "qwen2-bias");
        assert_eq!(
            result.unwrap_err().to_string(),
            "required tensor blk.1.attn_k.bias is missing"
        );
    }

    #[test]
    fn llama_with_attention_biases_is_refused() {
        let writer = tiny_llama().tensor(
            "blk.0.attn_q.bias",
            &[HEADS * HEAD_DIM],
            GgmlType::F32,
            vec![0; 4 * (HEADS * HEAD_DIM) as usize],
        );
        let (_dir, result) = import(&writer, "llama-bias");
        let message = result.unwrap_err().to_string();
        assert!(
            message.contains("attention biases are not supported for llama"),
            "{message}"
        );
    }

    #[test]
    fn every_known_pre_tokenizer_builds_a_loadable_tokenizer() {
        for pre in ["gpt-2", "smollm", "llama-bpe", "llama3", "qwen2"] {
            let file =
                GgufFile::from_bytes(tiny_llama().kv("tokenizer.ggml.pre", string(pre)).build())
                    .unwrap();
            let special = crate::SpecialTokenIds {
                bos: Some(1),
                eos: Some(0),
                ..Default::default()
            };
            let files =
                crate::tokenizer::build_tokenizer_files(file.metadata(), &special, 128).unwrap();
            let tokenizer: tokenizers::Tokenizer =
                files.tokenizer_json.to_string().parse().unwrap();
            assert_eq!(
                tokenizer.encode("ab a", false).unwrap().get_ids(),
                [4, 6],
                "{pre}"
            );
            assert_eq!(tokenizer.decode(&[4, 6], false).unwrap(), "ab a", "{pre}");
        }
    }
}
