//! The one table mapping GGUF tensor names to Hugging Face Llama/Qwen2 state-dict names.

/// Which rotary permutation, if any, llama.cpp applied to a tensor's rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeRows {
    /// Not permuted.
    Plain,
    /// `attn_q`: permuted with `n_head = num_attention_heads`.
    QueryHeads,
    /// `attn_k`: permuted with `n_head = num_key_value_heads`.
    KeyValueHeads,
}

/// One mapping rule. Per-layer rules match `blk.{N}.{gguf}` and produce
/// `model.layers.{N}.{hf}`; global rules match the whole name.
struct Rule {
    gguf: &'static str,
    hf: &'static str,
    per_layer: bool,
    rope_rows: RopeRows,
}

const fn global(gguf: &'static str, hf: &'static str) -> Rule {
    Rule {
        gguf,
        hf,
        per_layer: false,
        rope_rows: RopeRows::Plain,
    }
}

const fn layer(gguf: &'static str, hf: &'static str, rope_rows: RopeRows) -> Rule {
    Rule {
        gguf,
        hf,
        per_layer: true,
        rope_rows,
    }
}

/// GGUF name -> Hugging Face name. Biases only occur in Qwen2 (and rare Llama variants with
/// `attention_bias`); llama.cpp permutes q/k biases like their weights.
const TENSOR_NAMES: &[Rule] = &[
    global("token_embd.weight", "model.embed_tokens.weight"),
    global("output_norm.weight", "model.norm.weight"),
    global("output.weight", "lm_head.weight"),
    layer(
        "attn_norm.weight",
        "input_layernorm.weight",
        RopeRows::Plain,
    ),
    layer(
        "attn_q.weight",
        "self_attn.q_proj.weight",
        RopeRows::QueryHeads,
    ),
    layer(
        "attn_k.weight",
        "self_attn.k_proj.weight",
        RopeRows::KeyValueHeads,
    ),
    layer("attn_v.weight", "self_attn.v_proj.weight", RopeRows::Plain),
    layer("attn_q.bias", "self_attn.q_proj.bias", RopeRows::QueryHeads),
    layer(
        "attn_k.bias",
        "self_attn.k_proj.bias",
        RopeRows::KeyValueHeads,
    ),
    layer("attn_v.bias", "self_attn.v_proj.bias", RopeRows::Plain),
    layer(
        "attn_output.weight",
        "self_attn.o_proj.weight",
        RopeRows::Plain,
    ),
    layer(
        "ffn_norm.weight",
        "post_attention_layernorm.weight",
        RopeRows::Plain,
    ),
    layer("ffn_gate.weight", "mlp.gate_proj.weight", RopeRows::Plain),
    layer("ffn_up.weight", "mlp.up_proj.weight", RopeRows::Plain),
    layer("ffn_down.weight", "mlp.down_proj.weight", RopeRows::Plain),
];

/// Where a GGUF tensor goes in the Hugging Face checkpoint.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HfTensorName {
    pub name: String,
    /// Layer index for `blk.N.*` tensors.
    pub layer: Option<usize>,
    /// The permutation llama.cpp's converter applies to this tensor for architectures that use
    /// it (Llama); the importer decides per architecture whether to undo it.
    pub rope_rows: RopeRows,
}

/// The Hugging Face name of GGUF tensor `gguf_name`, or `None` when the table has no rule.
pub fn hf_tensor_name(gguf_name: &str) -> Option<HfTensorName> {
    let (layer, rest) = match gguf_name.strip_prefix("blk.") {
        Some(rest) => {
            let (index, suffix) = rest.split_once('.')?;
            // Reject "01" and "+1": they would not round-trip to the same GGUF name.
            if index.is_empty()
                || !index.bytes().all(|b| b.is_ascii_digit())
                || (index.len() > 1 && index.starts_with('0'))
            {
                return None;
            }
            (Some(index.parse().ok()?), suffix)
        }
        None => (None, gguf_name),
    };
    TENSOR_NAMES
        .iter()
        .find(|rule| rule.per_layer == layer.is_some() && rule.gguf == rest)
        .map(|rule| HfTensorName {
            name: match layer {
                Some(layer) => format!("model.layers.{layer}.{}", rule.hf),
                None => rule.hf.to_owned(),
            },
            layer,
            rope_rows: rule.rope_rows,
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn maps_global_and_layer_tensors() {
        let embed = hf_tensor_name("token_embd.weight").unwrap();
        assert_eq!(
            (embed.name.as_str(), embed.layer),
            ("model.embed_tokens.weight", None)
        );
        assert_eq!(
            hf_tensor_name("output.weight").unwrap().name,
            "lm_head.weight"
        );
        let q = hf_tensor_name("blk.12.attn_q.weight").unwrap();
        assert_eq!(q.name, "model.layers.12.self_attn.q_proj.weight");
        assert_eq!((q.layer, q.rope_rows), (Some(12), RopeRows::QueryHeads));
        assert_eq!(
            hf_tensor_name("blk.0.attn_k.weight").unwrap().rope_rows,
            RopeRows::KeyValueHeads
        );
        assert_eq!(
            hf_tensor_name("blk.3.ffn_norm.weight").unwrap().name,
            "model.layers.3.post_attention_layernorm.weight"
        );
    }

    #[test]
    fn unknown_or_malformed_names_have_no_mapping() {
        for name in [
            "rope_freqs.weight",
            "blk.x.attn_q.weight",
            "blk.01.attn_q.weight",
            "blk.attn_q.weight",
            "blk.0.token_embd.weight",
            "attn_q.weight",
        ] {
            assert_eq!(hf_tensor_name(name), None, "{name}");
        }
    }
}
