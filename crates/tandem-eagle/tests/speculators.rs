//! The speculators export of the committed SmolLM2 head: what vLLM reads from it, and that
//! Tandem's loader reads it back to the same head.

use std::path::{Path, PathBuf};

use safetensors::SafeTensors;
use serde_json::Value;
use tandem_eagle::{Eagle3Config, EagleError, Verifier, WeightDtype, load_host, save_speculators};
use tandem_wiring::TapId;

fn committed_head() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../heads/smollm2-135m-eagle3")
}

fn temp_dir(name: &str) -> PathBuf {
    tandem_model::testing::scratch_dir(&format!("speculators-{name}"))
}

#[test]
fn the_committed_head_exports_to_speculators_and_loads_back_identically() {
    let host = load_host(&committed_head()).unwrap();
    let verifier = Verifier {
        name_or_path: "HuggingFaceTB/SmolLM2-135M-Instruct".to_owned(),
        architecture: "LlamaForCausalLM".to_owned(),
        speculative_tokens: 3,
    };
    let dir = temp_dir("export");
    save_speculators(&host, &dir, WeightDtype::Bf16, &verifier).unwrap();

    // What vLLM's speculators loader reads (speculators/base.py, algos.py update_eagle3).
    let config: Value =
        serde_json::from_slice(&std::fs::read(dir.join("config.json")).unwrap()).unwrap();
    assert_eq!(config["speculators_model_type"], "eagle3");
    assert_eq!(config["norm_before_residual"], false);
    assert_eq!(config["draft_vocab_size"], 8192);
    assert_eq!(config["target_hidden_size"], 576);
    assert_eq!(config["transformer_layer_config"]["hidden_size"], 576);
    assert_eq!(config["transformer_layer_config"]["num_hidden_layers"], 1);
    assert_eq!(
        config["speculators_config"]["verifier"]["name_or_path"],
        "HuggingFaceTB/SmolLM2-135M-Instruct"
    );
    assert_eq!(
        config["speculators_config"]["proposal_methods"][0]["speculative_tokens"],
        3
    );
    // vLLM passes the top-level ids through: [2, 15, 27] are blocks [1, 14, 26], the taps the
    // head was trained on.
    let vllm = tandem_wiring::vllm_reading(&config, 30).unwrap();
    assert!(!vllm.defaulted);
    assert_eq!(
        vllm.taps,
        vec![TapId::Block(1), TapId::Block(14), TapId::Block(26)]
    );
    // Weights keyed as speculators checkpoints are.
    let bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
    let names: Vec<String> = SafeTensors::deserialize(&bytes)
        .unwrap()
        .names()
        .into_iter()
        .map(str::to_owned)
        .collect();
    assert!(
        names.iter().any(|n| n.starts_with("layers.0.")),
        "{names:?}"
    );
    assert!(
        !names.iter().any(|n| n.starts_with("midlayer.")),
        "{names:?}"
    );

    // Read back by Tandem: the same head, bit for bit (bf16 in, bf16 out), same manifest.
    let back = load_host(&dir).unwrap();
    assert_eq!(back.spec, host.spec);
    assert_eq!(back.vocab, host.vocab);
    assert_eq!(back.weights, host.weights);
    assert_eq!(back.config.tandem_wiring, host.config.tandem_wiring);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn speculators_heads_with_another_layer_are_refused_by_name() {
    let path = committed_head().join("config.json");
    let mut head = Eagle3Config::load(&path).unwrap();
    head.torch_dtype = None;
    let verifier = Verifier {
        name_or_path: "t".to_owned(),
        architecture: "LlamaForCausalLM".to_owned(),
        speculative_tokens: 3,
    };
    let mut value = head.to_speculators(&verifier).unwrap();
    // vLLM's default when the key is absent is true: a head that norms before the residual.
    value
        .as_object_mut()
        .unwrap()
        .remove("norm_before_residual");
    let err = Eagle3Config::from_speculators(&value).unwrap_err();
    assert!(
        matches!(&err, EagleError::Config { field, .. } if *field == "norm_before_residual"),
        "{err}"
    );
    value["norm_before_residual"] = Value::from(false);
    value["speculators_model_type"] = Value::from("eagle");
    let err = Eagle3Config::from_speculators(&value).unwrap_err();
    assert!(err.to_string().contains("eagle3"), "{err}");
    value["speculators_model_type"] = Value::from("eagle3");
    let back = Eagle3Config::from_speculators(&value).unwrap();
    assert_eq!(back.resolve().unwrap(), head.resolve().unwrap());
}
