//! Where each serving engine looks for a draft head's aux-layer ids, and how it reads them.
//!
//! The same `config.json` is read differently by each engine: SGLang looks inside
//! `eagle_config`, vLLM only at the top level, and each applies its own convention (or its
//! default taps when the key is absent, silently). [`sglang_reading`] and [`vllm_reading`]
//! model the two loaders; [`export_ids`] gives the ids to write in each place so that both read
//! the head's trained taps. Sources, as summarised in shared/reference/eagle3-facts.md
//! section 1 (read 2026-11-30):
//!
//! - SGLang, `python/sglang/srt/models/llama.py` (`set_eagle3_layers_to_capture`): the ids
//!   from the draft's `eagle_config`, `[val + 1 for val in layer_ids]` for every id: id i is
//!   captured before layer i+1, i.e. block i ([`Convention::SglangClassic`]). The DeepSeek
//!   family's model code adds the 1 only when the first id is 1 (sglang PR #25454,
//!   [`Convention::SglangHeuristic`]). No ids: blocks [1, L/2-1, L-4].
//! - vLLM (after its 2026 refactor), the EAGLE-3 draft config and `llama.py`: the top-level
//!   `eagle_aux_hidden_state_layer_ids` only, passed through: id 0 = embed, id k = block k-1,
//!   id L = the last block's output ([`Convention::Vllm`]). No top-level key: (2, L//2, L-3)
//!   in that convention, i.e. the same default blocks.

use serde_json::Value;

use crate::convention::{Convention, default_aux_taps};
use crate::error::Result;
use crate::taps::TapId;

/// The key both engines read, in different places.
pub const AUX_IDS_KEY: &str = "eagle_aux_hidden_state_layer_ids";

/// What an engine makes of a head's config.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineReading {
    /// `sglang` or `vllm`.
    pub engine: &'static str,
    /// Where it looked (`eagle_config.eagle_aux_hidden_state_layer_ids`, ...).
    pub location: &'static str,
    /// The ids found there, if any.
    pub ids: Option<Vec<i64>>,
    /// How it reads them.
    pub convention: Convention,
    /// The taps it serves the head.
    pub taps: Vec<TapId>,
    /// True when no ids were found and the engine fell back to its default taps.
    pub defaulted: bool,
}

/// The convention SGLang's model code applies to the target `architecture`: the DeepSeek
/// family (`DeepseekV2/V3ForCausalLM`, Kimi-K2) applies the first-id heuristic, every other
/// family (Llama, Qwen2/3, Mistral) adds 1 to every id.
pub fn sglang_convention(architecture: &str) -> Convention {
    if architecture.starts_with("Deepseek") || architecture.starts_with("KimiK") {
        Convention::SglangHeuristic
    } else {
        Convention::SglangClassic
    }
}

/// A list of layer ids as a config holds it (`[1, 14, 26]`); `None` for anything else. Shared
/// with every reader of head configs, so all of them accept the same values.
pub fn parse_aux_ids(value: &Value) -> Option<Vec<i64>> {
    value.as_array()?.iter().map(Value::as_i64).collect()
}

fn ids_at(value: Option<&Value>) -> Option<Vec<i64>> {
    parse_aux_ids(value?)
}

/// SGLang's reading of a head's `config` for a target of `architecture` with `num_layers`
/// blocks.
pub fn sglang_reading(
    config: &Value,
    architecture: &str,
    num_layers: usize,
) -> Result<EngineReading> {
    let ids = ids_at(config.get("eagle_config").and_then(|e| e.get(AUX_IDS_KEY)));
    let convention = sglang_convention(architecture);
    reading(
        "sglang",
        "eagle_config.eagle_aux_hidden_state_layer_ids",
        ids,
        convention,
        num_layers,
    )
}

/// vLLM's reading of a head's `config` for a target with `num_layers` blocks.
pub fn vllm_reading(config: &Value, num_layers: usize) -> Result<EngineReading> {
    let ids = ids_at(config.get(AUX_IDS_KEY));
    reading(
        "vllm",
        "eagle_aux_hidden_state_layer_ids (top level)",
        ids,
        Convention::Vllm,
        num_layers,
    )
}

fn reading(
    engine: &'static str,
    location: &'static str,
    ids: Option<Vec<i64>>,
    convention: Convention,
    num_layers: usize,
) -> Result<EngineReading> {
    let (taps, defaulted) = match &ids {
        Some(ids) => (convention.to_canonical(ids, num_layers)?, false),
        None => (default_aux_taps(num_layers)?, true),
    };
    Ok(EngineReading {
        engine,
        location,
        ids,
        convention,
        taps,
        defaulted,
    })
}

/// The ids to export for `taps` so that each engine reads exactly them: `(sglang, vllm)`, the
/// first for `eagle_config`, the second for the top level. Taps an engine cannot capture
/// (`embed` in SGLang) are an error naming the reason.
pub fn export_ids(
    taps: &[TapId],
    architecture: &str,
    num_layers: usize,
) -> Result<(Vec<i64>, Vec<i64>)> {
    Ok((
        sglang_convention(architecture).from_canonical(taps, num_layers)?,
        Convention::Vllm.from_canonical(taps, num_layers)?,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn blocks(ids: &[usize]) -> Vec<TapId> {
        ids.iter().map(|&k| TapId::Block(k)).collect()
    }

    /// Golden readings for a 30-block Llama and DeepSeek target.
    #[test]
    fn each_engine_reads_its_own_place_in_its_own_convention() {
        let nested = json!({"eagle_config": {AUX_IDS_KEY: [2, 15, 27]}});
        // SGLang Llama: +1 always, so [2, 15, 27] is blocks [2, 15, 27].
        let r = sglang_reading(&nested, "LlamaForCausalLM", 30).unwrap();
        assert_eq!((r.taps.clone(), r.defaulted), (blocks(&[2, 15, 27]), false));
        assert_eq!(r.convention, Convention::SglangClassic);
        // SGLang DeepSeek: the first id is not 1, so ids are layer inputs: blocks [1, 14, 26].
        let r = sglang_reading(&nested, "DeepseekV3ForCausalLM", 30).unwrap();
        assert_eq!(r.taps, blocks(&[1, 14, 26]));
        // vLLM never looks inside eagle_config: its default, silently.
        let r = vllm_reading(&nested, 30).unwrap();
        assert_eq!((r.taps.clone(), r.defaulted), (blocks(&[1, 14, 26]), true));

        let top = json!({AUX_IDS_KEY: [3, 11, 30]});
        let r = vllm_reading(&top, 30).unwrap();
        assert_eq!((r.taps.clone(), r.defaulted), (blocks(&[2, 10, 29]), false));
        assert_eq!(r.ids, Some(vec![3, 11, 30]));
        let r = sglang_reading(&top, "Qwen2ForCausalLM", 30).unwrap();
        assert!(r.defaulted, "SGLang does not read the top level");
        assert_eq!(r.taps, blocks(&[1, 14, 26]));
    }

    /// The committed SmolLM2 head (a 30-block Llama), read from its file the way each engine
    /// reads it: blocks [1, 14, 26] from both, neither by falling back to its default.
    #[test]
    fn the_committed_head_is_read_as_its_trained_taps_by_sglang_and_vllm() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../heads/smollm2-135m-eagle3/config.json");
        let config: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        let trained: Vec<TapId> = config["tandem_wiring"]["taps"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_str().unwrap().parse().unwrap())
            .collect();
        assert_eq!(trained, blocks(&[1, 14, 26]));
        let sglang = sglang_reading(&config, "LlamaForCausalLM", 30).unwrap();
        let vllm = vllm_reading(&config, 30).unwrap();
        for r in [&sglang, &vllm] {
            assert_eq!(r.taps, trained, "{}", r.engine);
            assert!(!r.defaulted, "{} fell back to its default", r.engine);
        }
        assert_eq!(sglang.ids, Some(vec![1, 14, 26]));
        assert_eq!(vllm.ids, Some(vec![2, 15, 27]));
    }

    /// Whatever the taps, the exported config is read as those taps by both engines.
    #[test]
    fn exported_ids_are_read_back_as_the_trained_taps_by_every_engine() {
        for (arch, taps) in [
            ("LlamaForCausalLM", blocks(&[1, 14, 26])),
            ("LlamaForCausalLM", blocks(&[3, 10, 20])),
            ("Qwen2ForCausalLM", blocks(&[0, 9, 28])),
            ("DeepseekV3ForCausalLM", blocks(&[3, 10, 20])),
            ("DeepseekV3ForCausalLM", blocks(&[1, 14, 26])),
        ] {
            let (sglang, vllm) = export_ids(&taps, arch, 30).unwrap();
            let config = json!({"eagle_config": {AUX_IDS_KEY: sglang}, AUX_IDS_KEY: vllm});
            assert_eq!(
                sglang_reading(&config, arch, 30).unwrap().taps,
                taps,
                "{arch}"
            );
            assert_eq!(vllm_reading(&config, 30).unwrap().taps, taps, "{arch}");
        }
        // Llama, taps [3, 10, 20]: SGLang ids [3, 10, 20], vLLM ids [4, 11, 21].
        assert_eq!(
            export_ids(&blocks(&[3, 10, 20]), "LlamaForCausalLM", 30).unwrap(),
            (vec![3, 10, 20], vec![4, 11, 21])
        );
        // SGLang cannot capture the embedding.
        assert!(export_ids(&[TapId::Embed, TapId::Block(3)], "LlamaForCausalLM", 30).is_err());
    }
}
