#!/usr/bin/env python3
"""Golden fixture for Tandem's Qwen3ForCausalLM on the burn path (issue #16): a tiny random
Qwen3 model (per-head RMSNorm on q and k before RoPE, head_dim independent of hidden_size,
tied embeddings) run through HF transformers' own Qwen3ForCausalLM, loaded with
`from_pretrained` from the very files Tandem reads. No Tandem code is involved.

Reference settings: float32, attn_implementation="eager", CPU, batch 1 per case, no padding,
positions 0..seq-1, torch deterministic algorithms on, weights from a seeded torch generator.

Pinned versions (scripts/reference/requirements-deepseek.txt, the same environment): torch
2.15.0, transformers 5.24.0, safetensors 0.8.0, Python 3.11 (any torch >= 2.11 gives the same
files up to float rounding; golden.json records the versions used).

Usage:
    python scripts/reference/make_qwen3_golden.py [OUT_DIR]     # default tests/fixtures/qwen3

Writes OUT_DIR/config.json, model.safetensors (f32, hub names), golden.safetensors (per case N:
caseN.input_ids i64 [seq], caseN.logits f32 [seq, vocab], caseN.hidden_states f32 [L+1, seq,
hidden]: 0 = embeddings, k = output of block k-1, L = the final norm's output) and golden.json.
"""

import json
import math
import os
import platform
import sys

import safetensors
import safetensors.torch
import torch
import transformers

SEED = 20261

CONFIG = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": 96,
    # head_dim * heads (64) differs from hidden_size (48), as in Qwen3-8B's 128 * 32 vs 4096
    # being equal but Qwen3-0.6B's 128 * 16 vs 1024 not.
    "hidden_size": 48,
    "head_dim": 16,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 80,
    "num_hidden_layers": 3,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 256,
    "rope_theta": 1000000.0,
    "attention_bias": False,
    "tie_word_embeddings": True,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "torch_dtype": "float32",
}

CASES = [
    [3, 17, 42, 5, 60, 11, 29, 8, 50, 23, 37, 90, 2],
    [9, 2, 33, 33, 14, 61, 7],
]


def random_weights(cfg, gen):
    """HF hub names -> f32 tensors (tied: no lm_head.weight). Scales keep activations O(1)."""
    h, d = cfg["hidden_size"], cfg["head_dim"]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    w = {}

    def lin(name, out_dim, in_dim):
        w[name] = torch.randn(out_dim, in_dim, generator=gen) / math.sqrt(in_dim)

    def norm(name, dim):
        w[name] = 1.0 + 0.3 * (torch.rand(dim, generator=gen) * 2 - 1)

    w["model.embed_tokens.weight"] = torch.randn(cfg["vocab_size"], h, generator=gen)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        norm(f"{p}.input_layernorm.weight", h)
        norm(f"{p}.post_attention_layernorm.weight", h)
        lin(f"{p}.self_attn.q_proj.weight", heads * d, h)
        lin(f"{p}.self_attn.k_proj.weight", kv * d, h)
        lin(f"{p}.self_attn.v_proj.weight", kv * d, h)
        lin(f"{p}.self_attn.o_proj.weight", h, heads * d)
        norm(f"{p}.self_attn.q_norm.weight", d)
        norm(f"{p}.self_attn.k_norm.weight", d)
        lin(f"{p}.mlp.gate_proj.weight", cfg["intermediate_size"], h)
        lin(f"{p}.mlp.up_proj.weight", cfg["intermediate_size"], h)
        lin(f"{p}.mlp.down_proj.weight", h, cfg["intermediate_size"])
    norm("model.norm.weight", h)
    return {k: v.contiguous().float() for k, v in w.items()}


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else "tests/fixtures/qwen3"
    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    gen = torch.Generator().manual_seed(SEED)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(CONFIG, f, indent=2)
        f.write("\n")
    weights = random_weights(CONFIG, gen)
    safetensors.torch.save_file(weights, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    model = transformers.Qwen3ForCausalLM.from_pretrained(
        out, torch_dtype=torch.float32, attn_implementation="eager"
    ).eval()
    state = model.state_dict()
    # The loader read every tensor as written, and the lm_head is the embedding (tied).
    for name, value in weights.items():
        assert torch.equal(state[name], value), f"{name} not loaded as written"
    assert torch.equal(state["lm_head.weight"], weights["model.embed_tokens.weight"])
    golden = {}
    with torch.no_grad():
        for c, ids in enumerate(CASES):
            input_ids = torch.tensor([ids], dtype=torch.long)
            outputs = model(input_ids=input_ids, output_hidden_states=True, use_cache=False)
            hs = torch.stack([h[0] for h in outputs.hidden_states])
            assert hs.shape[0] == CONFIG["num_hidden_layers"] + 1
            golden[f"case{c}.input_ids"] = input_ids[0]
            golden[f"case{c}.logits"] = outputs.logits[0].float()
            golden[f"case{c}.hidden_states"] = hs.float()
    golden = {k: v.contiguous() for k, v in golden.items()}
    safetensors.torch.save_file(golden, os.path.join(out, "golden.safetensors"))
    meta = {
        "model": "tiny random Qwen3ForCausalLM",
        "cases": [{"input_ids": ids} for ids in CASES],
        "tensors": {k: list(v.shape) for k, v in golden.items()},
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "safetensors": safetensors.__version__,
        },
        "settings": "float32, eager attention, CPU, batch 1, no padding, use_cache False",
    }
    with open(os.path.join(out, "golden.json"), "w") as f:
        json.dump(meta, f, indent=2)
        f.write("\n")
    top = max(golden[f"case{c}.logits"].abs().max().item() for c in range(len(CASES)))
    print(f"wrote {out}: logits max |x| {top:.3f}")


if __name__ == "__main__":
    main()
