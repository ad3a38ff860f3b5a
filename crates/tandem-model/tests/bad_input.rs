//! Bad model directories are refused with a message that names the problem.

use std::path::{Path, PathBuf};

use tandem_model::backend::CpuBackend;
use tandem_model::testing::{tiny_config, write_random_model};
use tandem_model::{ModelError, TargetModel};

fn fresh(name: &str) -> PathBuf {
    let dir = tandem_model::testing::scratch_dir(&format!("bad-{name}"));
    write_random_model(&dir, &tiny_config("LlamaForCausalLM", 2), 5).unwrap();
    dir
}

fn load_err(dir: &Path) -> ModelError {
    TargetModel::<CpuBackend>::load(dir, &Default::default()).unwrap_err()
}

#[test]
fn missing_config_is_named() {
    let dir = fresh("noconfig");
    std::fs::remove_file(dir.join("config.json")).unwrap();
    let err = load_err(&dir).to_string();
    assert!(err.contains("config.json"), "{err}");
}

#[test]
fn missing_weights_are_named() {
    let dir = fresh("noweights");
    std::fs::remove_file(dir.join("model.safetensors")).unwrap();
    let err = load_err(&dir).to_string();
    assert!(err.contains("no model.safetensors"), "{err}");
}

#[test]
fn truncated_safetensors_is_refused() {
    let dir = fresh("truncated");
    let path = dir.join("model.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    std::fs::write(&path, &bytes[..bytes.len() / 2]).unwrap();
    let err = load_err(&dir).to_string();
    assert!(
        err.contains("not a valid safetensors") && err.contains("model.safetensors"),
        "{err}"
    );
}

#[test]
fn config_that_disagrees_with_weights_names_the_tensor() {
    let dir = fresh("shape");
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    config["intermediate_size"] = serde_json::json!(80);
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    let err = load_err(&dir);
    match &err {
        ModelError::ShapeMismatch {
            name,
            expected,
            actual,
        } => {
            assert!(name.contains("mlp"), "{err}");
            assert_ne!(expected, actual);
        }
        other => panic!("expected a shape mismatch, got {other}"),
    }
}

#[test]
fn unsupported_architecture_is_named() {
    let dir = fresh("arch");
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    config["architectures"] = serde_json::json!(["FalconForCausalLM"]);
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    let err = load_err(&dir).to_string();
    assert!(
        err.contains("FalconForCausalLM") && err.contains("not supported"),
        "{err}"
    );
}

#[test]
fn missing_tensor_is_named() {
    let dir = fresh("missing-tensor");
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    config["num_hidden_layers"] = serde_json::json!(3);
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    let err = load_err(&dir).to_string();
    assert!(
        err.contains("model.layers.2") && err.contains("missing"),
        "{err}"
    );
}
