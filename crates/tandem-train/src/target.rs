//! The frozen pieces of the target the trainer needs: the token embedding (the head's input),
//! the final norm and the lm_head (target logits recomputed from the dumped last-block
//! residual), and the target's fingerprint for the wiring check.

use std::path::Path;

use burn::prelude::*;
use burn::tensor::TensorData;
use tandem_model::HfConfig;
use tandem_model::model::RmsNorm;
use tandem_model::weights::WeightFiles;
use tandem_model::{ModelSpec, TargetTokenizer};
use tandem_wiring::TargetFingerprint;

use crate::error::TrainError;

/// Embedding, final norm and lm_head of the target, on device `B`; never trained.
#[derive(Debug, Clone)]
pub struct TargetHead<B: Backend> {
    /// The target's config.json.
    pub config: HfConfig,
    /// Its resolved spec.
    pub spec: ModelSpec,
    /// `[vocab, T]`.
    pub embed_tokens: Tensor<B, 2>,
    /// The final RMSNorm.
    pub norm: RmsNorm<B>,
    /// `[T, vocab]` (the embedding's transpose when tied).
    pub lm_head_t: Tensor<B, 2>,
}

impl<B: Backend> TargetHead<B> {
    /// Reads only `model.embed_tokens.weight`, `model.norm.weight` and `lm_head.weight` (or
    /// the tied embedding) of an HF model directory.
    pub fn load(dir: &Path, device: &B::Device) -> Result<Self, TrainError> {
        let config = HfConfig::load(&dir.join("config.json"))?;
        let spec = config.resolve()?;
        let weights = WeightFiles::open(dir)?;
        let (v, h) = (spec.vocab_size, spec.hidden_size);
        let embed = weights.read("model.embed_tokens.weight", &[v, h])?;
        let norm = weights.read("model.norm.weight", &[h])?;
        let lm_head = if spec.tie_word_embeddings || !weights.contains("lm_head.weight") {
            embed.transposed()
        } else {
            weights.read("lm_head.weight", &[v, h])?.transposed()
        };
        let upload2 = |t: tandem_model::weights::HostTensor| {
            Tensor::<B, 2>::from_data(TensorData::new(t.values, t.shape), device)
        };
        Ok(TargetHead {
            embed_tokens: upload2(embed),
            norm: RmsNorm {
                weight: Tensor::from_data(TensorData::new(norm.values, [h]), device),
                eps: spec.rms_norm_eps,
            },
            lm_head_t: upload2(lm_head),
            config,
            spec,
        })
    }

    /// Host copies of the three pieces in HF layout (`[vocab, T]` embedding and lm_head, `[T]`
    /// norm), for trainers outside burn: read back from the loaded tensors, so the weights
    /// files are read once and the lm_head is the tied embedding exactly when [`Self::load`]
    /// made it so.
    pub fn host_pieces(&self) -> TargetPieces {
        let host = |t: Tensor<B, 2>| -> Vec<f32> {
            t.into_data()
                .convert::<f32>()
                .to_vec::<f32>()
                .expect("f32 weights")
        };
        TargetPieces {
            embed_tokens: host(self.embed_tokens.clone()),
            norm: self
                .norm
                .weight
                .clone()
                .into_data()
                .convert::<f32>()
                .to_vec::<f32>()
                .expect("f32 weights"),
            // lm_head_t is [T, vocab]; HF layout is its transpose.
            lm_head: host(self.lm_head_t.clone().transpose()),
        }
    }

    /// Target logits from the residual leaving the last block: `[b, n, T]` -> `[b, n, vocab]`
    /// (final norm, then lm_head), exactly the target's own last step.
    pub fn logits(&self, last_hidden: Tensor<B, 3>) -> Tensor<B, 3> {
        let [b, n, h] = last_hidden.dims();
        self.norm
            .forward(last_hidden)
            .reshape([b * n, h])
            .matmul(self.lm_head_t.clone())
            .reshape([b, n, self.spec.vocab_size])
    }
}

/// [`TargetHead::host_pieces`]: the frozen target weights as host f32, HF layout.
#[derive(Debug, Clone, PartialEq)]
pub struct TargetPieces {
    /// `[vocab, T]`.
    pub embed_tokens: Vec<f32>,
    /// `[T]`.
    pub norm: Vec<f32>,
    /// `[vocab, T]`.
    pub lm_head: Vec<f32>,
}

/// Fingerprint of the target in `dir`, computed as `tandem dump` computes it: config.json,
/// tokenizer.json and, when `with_chat_template`, the chat template the tokenizer loads.
pub fn fingerprint(dir: &Path, with_chat_template: bool) -> Result<TargetFingerprint, TrainError> {
    let template = if with_chat_template {
        TargetTokenizer::load(dir)?.chat_template
    } else {
        None
    };
    Ok(TargetFingerprint::from_files(
        &dir.join("config.json"),
        &dir.join("tokenizer.json"),
        template.as_deref(),
    )?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::NdArray;
    use tandem_model::testing::{scratch_dir, tiny_config, write_random_model};

    /// The host pieces equal the tensors of the weights files (read independently), HF layout,
    /// for an untied lm_head and for one tied to the embedding.
    #[test]
    fn host_pieces_are_the_weights_files_in_hf_layout() {
        for tied in [false, true] {
            let dir = scratch_dir(&format!("host-pieces-{tied}"));
            let mut config = tiny_config("LlamaForCausalLM", 2);
            config.tie_word_embeddings = tied;
            write_random_model(&dir, &config, 3).unwrap();
            let head = TargetHead::<NdArray>::load(&dir, &Default::default()).unwrap();
            let pieces = head.host_pieces();
            let files = WeightFiles::open(&dir).unwrap();
            let (v, h) = (head.spec.vocab_size, head.spec.hidden_size);
            let embed = files
                .read("model.embed_tokens.weight", &[v, h])
                .unwrap()
                .values;
            assert_eq!(pieces.embed_tokens, embed);
            assert_eq!(
                pieces.norm,
                files.read("model.norm.weight", &[h]).unwrap().values
            );
            let lm_head = if tied {
                embed
            } else {
                files.read("lm_head.weight", &[v, h]).unwrap().values
            };
            assert_eq!(pieces.lm_head, lm_head, "tied: {tied}");
        }
    }
}
