//! The target's weights on the GPU in bf16, with the projections that read the same input fused
//! into one matrix (q|k|v and gate|up) so each is one matmul launch.

use cudarc::driver::CudaSlice;
use tandem_model::weights::WeightFiles;
use tandem_model::{ModelError, ModelSpec};

use crate::device::Gpu;
use crate::error::CudaError;
use crate::tensor_parallel::{RankSplit, column_block, row_block};

/// Row-major bf16 bit patterns of an f32 host tensor (round to nearest even).
pub fn to_bf16_bits(values: &[f32]) -> Vec<u16> {
    values
        .iter()
        .map(|&v| half::bf16::from_f32(v).to_bits())
        .collect()
}

pub struct LayerWeights {
    pub input_norm: CudaSlice<u16>,
    /// `[heads * head_dim + 2 * kv_heads * head_dim, hidden]`: q_proj, k_proj, v_proj stacked.
    pub qkv: CudaSlice<u16>,
    /// The three biases stacked the same way (Qwen2), f32.
    pub qkv_bias: Option<CudaSlice<f32>>,
    /// Qwen3's per-head RMSNorm weights of q and k, `[head_dim]` each.
    pub qk_norm: Option<(CudaSlice<u16>, CudaSlice<u16>)>,
    pub o: CudaSlice<u16>,
    pub post_norm: CudaSlice<u16>,
    /// `[2 * intermediate, hidden]`: gate_proj then up_proj.
    pub gate_up: CudaSlice<u16>,
    pub down: CudaSlice<u16>,
}

pub struct DeviceWeights {
    pub embed: CudaSlice<u16>,
    pub layers: Vec<LayerWeights>,
    pub final_norm: CudaSlice<u16>,
    /// `None` when tied: the lm_head is the embedding matrix.
    pub lm_head: Option<CudaSlice<u16>>,
}

impl DeviceWeights {
    /// Refuses what the fast path does not implement, by name, before anything is uploaded.
    pub fn check_supported(spec: &ModelSpec) -> Result<(), CudaError> {
        let unsupported = |what: &str| CudaError::Unsupported {
            what: what.to_string(),
            architecture: spec.architecture.clone(),
        };
        if spec.mla.is_some() || spec.moe.is_some() {
            return Err(unsupported(
                "latent attention / mixture-of-experts layers (DeepSeek-V3)",
            ));
        }
        if spec.qk_norm && spec.qkv_bias {
            // The kernel norms the projection before rope_qkv adds the bias.
            return Err(unsupported(
                "per-head q/k RMSNorm together with q/k/v biases",
            ));
        }
        if spec.o_bias {
            return Err(unsupported("a bias on o_proj"));
        }
        if spec.sliding_window.is_some() {
            return Err(unsupported("sliding-window attention"));
        }
        if !spec.head_dim.is_multiple_of(32) || spec.head_dim > 256 {
            return Err(unsupported(&format!(
                "head_dim {} (needs a multiple of 32, at most 256)",
                spec.head_dim
            )));
        }
        Ok(())
    }

    /// One tensor-parallel rank's weights (`spec` is the whole model's): its heads' rows of
    /// q_proj, k_proj, v_proj (and their biases), its rows of gate_proj and up_proj, its input
    /// columns of o_proj and down_proj; norms, embedding and lm_head whole (replicated, not split
    /// by vocabulary). Rank 0 of 1: the whole model.
    pub fn load_split(
        gpu: &Gpu,
        spec: &ModelSpec,
        files: &WeightFiles,
        split: RankSplit,
    ) -> Result<Self, CudaError> {
        Self::check_supported(spec)?;
        spec.check_tensor_parallel(split.ranks)?;
        let h = spec.hidden_size;
        let hd = spec.head_dim;
        let q_out = spec.num_heads * hd;
        let kv_out = spec.num_kv_heads * hd;
        let inter = spec.intermediate_size;
        let bf16 = |values: &[f32]| gpu.upload(&to_bf16_bits(values));
        let read = |name: &str, shape: &[usize]| -> Result<Vec<f32>, ModelError> {
            Ok(files.read(name, shape)?.values)
        };
        // A column-parallel weight's (or bias's, `cols` 1) rows of this rank.
        let rows_of = |name: &str, rows: usize, cols: usize| -> Result<Vec<f32>, ModelError> {
            let shape: &[usize] = if cols == 1 { &[rows] } else { &[rows, cols] };
            Ok(row_block(&read(name, shape)?, cols, split.part(rows)))
        };
        // A row-parallel weight `[h, cols]`'s input columns of this rank.
        let columns_of = |name: &str, cols: usize| -> Result<Vec<f32>, ModelError> {
            Ok(column_block(
                &read(name, &[h, cols])?,
                cols,
                split.part(cols),
            ))
        };
        let mut layers = Vec::with_capacity(spec.num_layers);
        for i in 0..spec.num_layers {
            let p = format!("model.layers.{i}");
            let mut qkv = rows_of(&format!("{p}.self_attn.q_proj.weight"), q_out, h)?;
            qkv.extend(rows_of(&format!("{p}.self_attn.k_proj.weight"), kv_out, h)?);
            qkv.extend(rows_of(&format!("{p}.self_attn.v_proj.weight"), kv_out, h)?);
            let qkv_bias = if spec.qkv_bias {
                let mut b = rows_of(&format!("{p}.self_attn.q_proj.bias"), q_out, 1)?;
                b.extend(rows_of(&format!("{p}.self_attn.k_proj.bias"), kv_out, 1)?);
                b.extend(rows_of(&format!("{p}.self_attn.v_proj.bias"), kv_out, 1)?);
                Some(gpu.upload(&b)?)
            } else {
                None
            };
            let qk_norm = if spec.qk_norm {
                Some((
                    bf16(&read(&format!("{p}.self_attn.q_norm.weight"), &[hd])?)?,
                    bf16(&read(&format!("{p}.self_attn.k_norm.weight"), &[hd])?)?,
                ))
            } else {
                None
            };
            let mut gate_up = rows_of(&format!("{p}.mlp.gate_proj.weight"), inter, h)?;
            gate_up.extend(rows_of(&format!("{p}.mlp.up_proj.weight"), inter, h)?);
            layers.push(LayerWeights {
                input_norm: bf16(&read(&format!("{p}.input_layernorm.weight"), &[h])?)?,
                qkv: bf16(&qkv)?,
                qkv_bias,
                qk_norm,
                o: bf16(&columns_of(&format!("{p}.self_attn.o_proj.weight"), q_out)?)?,
                post_norm: bf16(&read(
                    &format!("{p}.post_attention_layernorm.weight"),
                    &[h],
                )?)?,
                gate_up: bf16(&gate_up)?,
                down: bf16(&columns_of(&format!("{p}.mlp.down_proj.weight"), inter)?)?,
            });
        }
        let embed = bf16(&read("model.embed_tokens.weight", &[spec.vocab_size, h])?)?;
        let lm_head = if spec.tie_word_embeddings || !files.contains("lm_head.weight") {
            None
        } else {
            Some(bf16(&read("lm_head.weight", &[spec.vocab_size, h])?)?)
        };
        Ok(Self {
            embed,
            layers,
            final_norm: bf16(&read("model.norm.weight", &[h])?)?,
            lm_head,
        })
    }

    pub fn lm_head(&self) -> &CudaSlice<u16> {
        self.lm_head.as_ref().unwrap_or(&self.embed)
    }
}
