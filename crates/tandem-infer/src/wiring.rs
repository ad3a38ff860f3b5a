//! The wiring check where a head meets the serving engine: which taps the head was trained on,
//! which taps serving will feed it, and every difference as a sentence.

use std::path::Path;

use tandem_eagle::Eagle3Config;
use tandem_model::TargetTokenizer;
use tandem_wiring::{
    Convention, Job, Mismatch, Producer, TapId, TapPoint, TargetFingerprint, WiringManifest, check,
    default_aux_taps,
};

use crate::engine::InferError;

/// The taps a head expects, in slot order: its Tandem manifest when it has one; else its
/// `eagle_aux_hidden_state_layer_ids` read as SGLang reads them (heads from SpecForge / SGLang
/// training); else the EAGLE-3 default set.
pub fn head_taps(config: &Eagle3Config, num_layers: usize) -> Result<Vec<TapId>, InferError> {
    if let Some(m) = &config.tandem_wiring {
        return Ok(m.taps.clone());
    }
    let ids = config
        .eagle_config
        .as_ref()
        .and_then(|e| e.eagle_aux_hidden_state_layer_ids.clone());
    let taps = match ids {
        Some(ids) => Convention::SglangHeuristic.to_canonical(&ids, num_layers),
        None => default_aux_taps(num_layers),
    };
    taps.map_err(|e| InferError::Config {
        field: "eagle_aux_hidden_state_layer_ids",
        reason: e.to_string(),
    })
}

/// The manifest of what serving feeds the head: the target in `model_dir`, fingerprinted as
/// `tandem dump` fingerprints it, and the serving taps.
pub fn serving_manifest(
    model_dir: &Path,
    taps: Vec<TapId>,
    dtype: &str,
    device: &str,
) -> Result<WiringManifest, InferError> {
    let tokenizer = TargetTokenizer::load(model_dir)?;
    let target = TargetFingerprint::from_files(
        &model_dir.join("config.json"),
        &model_dir.join("tokenizer.json"),
        tokenizer.chat_template.as_deref(),
    )
    .map_err(|e| InferError::Config {
        field: "--model",
        reason: e.to_string(),
    })?;
    Ok(WiringManifest::new(
        target,
        taps,
        TapPoint::ResidualStream,
        dtype,
        Producer::tandem(Job::Serve, device, "tree-verify"),
    ))
}

/// Every difference between the head's manifest and what serving does. A head without a Tandem
/// manifest can only be checked on its taps (made elsewhere, it carries no fingerprints).
pub fn check_head(
    config: &Eagle3Config,
    serving: &WiringManifest,
) -> Result<Vec<Mismatch>, InferError> {
    match &config.tandem_wiring {
        Some(trained) => Ok(check(trained, serving)),
        None => {
            let mut expected = serving.clone();
            expected.taps = head_taps(config, serving.target.num_layers)?;
            Ok(check(&expected, serving))
        }
    }
}
