#!/usr/bin/env python3
"""Golden fixtures for Tandem's DeepseekV3ForCausalLM (DeepSeek-V3 / Kimi-K2 architecture).

Writes tiny random DeepSeek-V3 models (config.json + model.safetensors, HF hub tensor names,
one safetensors key per routed expert as the hub checkpoints have them) and runs them through
HF transformers' own DeepseekV3ForCausalLM, loaded with `from_pretrained` from those very
files, so the fixture also checks that transformers reads the files the way Tandem does.
No Tandem code is involved.

Reference settings: float32, attn_implementation="eager", CPU, batch 1 per case, no padding,
positions 0..seq-1, torch deterministic algorithms on, weights from a seeded torch generator.

Pinned versions (scripts/reference/requirements-deepseek.txt): torch 2.15.0,
transformers 5.24.0, safetensors 0.8.0, numpy 2.4.6, Python 3.11.

Usage:
    python scripts/reference/make_deepseek_golden.py [OUT_DIR]
    OUT_DIR defaults to tests/fixtures/deepseek_v3

Writes one directory per model under OUT_DIR:
  mla_qlora/   q_lora_rank 16, plain RoPE, rope_interleave true (DeepSeek-V3's layout)
  yarn_noqlora/ q_lora_rank null (q_proj), yarn rope scaling with mscale_all_dim, rope_interleave false
each holding
  config.json           the hub-style config (rope_theta / rope_scaling, not rope_parameters)
  model.safetensors     f32 weights with hub names
  golden.safetensors    per case N:
    caseN.input_ids     i64 [seq]
    caseN.logits        f32 [seq, vocab]
    caseN.hidden_states f32 [L+1, seq, hidden]  HF output_hidden_states: 0 = embeddings,
                                                k = output of block k-1, L = final norm output
    caseN.block_out     f32 [L, seq, hidden]    forward-hook output of decoder layer k
                                                (pre-norm residual, = block k)
  golden.json           versions, shapes, the smallest top-k routing margin seen (a margin
                        near zero would make the expert choice fragile to rounding)
"""

import json
import math
import os
import platform
import sys

import numpy as np
import safetensors.torch
import torch
import transformers

SEED = 20260
VOCAB = 64
HIDDEN = 32

BASE_CONFIG = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "vocab_size": VOCAB,
    "hidden_size": HIDDEN,
    "intermediate_size": 48,
    "moe_intermediate_size": 16,
    "num_hidden_layers": 4,
    "first_k_dense_replace": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "kv_lora_rank": 16,
    "qk_nope_head_dim": 8,
    "qk_rope_head_dim": 4,
    "v_head_dim": 6,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "num_experts_per_tok": 3,
    "n_group": 4,
    "topk_group": 2,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 256,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "torch_dtype": "float32",
}

MODELS = {
    "mla_qlora": dict(BASE_CONFIG, q_lora_rank=16, rope_interleave=True),
    "yarn_noqlora": dict(
        BASE_CONFIG,
        q_lora_rank=None,
        rope_interleave=False,
        rope_theta=500.0,
        rope_scaling={
            "type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 64,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
    ),
}

CASES = [
    [3, 17, 42, 5, 60, 11, 29, 8, 50, 23, 37],
    [9, 2, 33, 33, 14, 61, 7],
]


def random_weights(cfg, gen):
    """HF hub names -> f32 tensors. Scales keep activations O(1) through 4 blocks."""
    h = cfg["hidden_size"]
    heads = cfg["num_attention_heads"]
    qk = cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]
    w = {}

    def lin(name, out_dim, in_dim):
        w[name] = torch.randn(out_dim, in_dim, generator=gen) / math.sqrt(in_dim)

    def norm(name, dim):
        w[name] = 1.0 + 0.2 * (torch.rand(dim, generator=gen) * 2 - 1)

    w["model.embed_tokens.weight"] = torch.randn(cfg["vocab_size"], h, generator=gen)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        norm(f"{p}.input_layernorm.weight", h)
        norm(f"{p}.post_attention_layernorm.weight", h)
        a = f"{p}.self_attn"
        if cfg["q_lora_rank"] is None:
            lin(f"{a}.q_proj.weight", heads * qk, h)
        else:
            lin(f"{a}.q_a_proj.weight", cfg["q_lora_rank"], h)
            norm(f"{a}.q_a_layernorm.weight", cfg["q_lora_rank"])
            lin(f"{a}.q_b_proj.weight", heads * qk, cfg["q_lora_rank"])
        lin(f"{a}.kv_a_proj_with_mqa.weight", cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"], h)
        norm(f"{a}.kv_a_layernorm.weight", cfg["kv_lora_rank"])
        lin(
            f"{a}.kv_b_proj.weight",
            heads * (cfg["qk_nope_head_dim"] + cfg["v_head_dim"]),
            cfg["kv_lora_rank"],
        )
        lin(f"{a}.o_proj.weight", h, heads * cfg["v_head_dim"])

        def mlp(prefix, inter):
            lin(f"{prefix}.gate_proj.weight", inter, h)
            lin(f"{prefix}.up_proj.weight", inter, h)
            lin(f"{prefix}.down_proj.weight", h, inter)

        if i < cfg["first_k_dense_replace"]:
            mlp(f"{p}.mlp", cfg["intermediate_size"])
        else:
            # Router logits spread over a few units so sigmoid scores differ clearly.
            w[f"{p}.mlp.gate.weight"] = 2.0 * torch.randn(cfg["n_routed_experts"], h, generator=gen) / math.sqrt(h)
            w[f"{p}.mlp.gate.e_score_correction_bias"] = 0.1 * torch.randn(cfg["n_routed_experts"], generator=gen)
            for e in range(cfg["n_routed_experts"]):
                mlp(f"{p}.mlp.experts.{e}", cfg["moe_intermediate_size"])
            mlp(f"{p}.mlp.shared_experts", cfg["moe_intermediate_size"] * cfg["n_shared_experts"])
    norm("model.norm.weight", h)
    lin("lm_head.weight", cfg["vocab_size"], h)
    return {k: v.contiguous().float() for k, v in w.items()}


def routing_margins(cfg, gate_inputs, weights):
    """Smallest gaps at the group and expert top-k boundaries, recomputed from the gate inputs:
    how far each token's choice is from a tie."""
    n_exp, n_group = cfg["n_routed_experts"], cfg["n_group"]
    worst = float("inf")
    for layer, x in gate_inputs.items():
        p = f"model.layers.{layer}.mlp.gate"
        scores = torch.sigmoid(x.reshape(-1, x.shape[-1]) @ weights[f"{p}.weight"].T)
        choice = scores + weights[f"{p}.e_score_correction_bias"]
        group = choice.view(-1, n_group, n_exp // n_group).topk(2, dim=-1)[0].sum(-1)
        g_sorted = group.sort(dim=-1, descending=True)[0]
        k = cfg["topk_group"]
        if k < n_group:
            worst = min(worst, (g_sorted[:, k - 1] - g_sorted[:, k]).min().item())
        keep = torch.zeros_like(group).scatter_(1, group.topk(k, dim=-1)[1], 1).bool()
        mask = keep.unsqueeze(-1).expand(-1, n_group, n_exp // n_group).reshape(-1, n_exp)
        c_sorted = choice.masked_fill(~mask, float("-inf")).sort(dim=-1, descending=True)[0]
        t = cfg["num_experts_per_tok"]
        worst = min(worst, (c_sorted[:, t - 1] - c_sorted[:, t]).min().item())
    return worst


def main():
    out_root = sys.argv[1] if len(sys.argv) > 1 else "tests/fixtures/deepseek_v3"
    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    gen = torch.Generator().manual_seed(SEED)
    for name, cfg in MODELS.items():
        out = os.path.join(out_root, name)
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "config.json"), "w") as f:
            json.dump(cfg, f, indent=2)
            f.write("\n")
        weights = random_weights(cfg, gen)
        safetensors.torch.save_file(weights, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})

        model = transformers.DeepseekV3ForCausalLM.from_pretrained(
            out, torch_dtype=torch.float32, attn_implementation="eager"
        ).eval()
        # The loader must have read every tensor as written (fused experts included).
        state = model.state_dict()
        for i in range(cfg["first_k_dense_replace"], cfg["num_hidden_layers"]):
            p = f"model.layers.{i}.mlp"
            gate_up = torch.stack(
                [
                    torch.cat([weights[f"{p}.experts.{e}.gate_proj.weight"], weights[f"{p}.experts.{e}.up_proj.weight"]])
                    for e in range(cfg["n_routed_experts"])
                ]
            )
            assert torch.equal(state[f"{p}.experts.gate_up_proj"], gate_up), f"{p} experts not loaded as written"
            assert torch.equal(state[f"{p}.gate.e_score_correction_bias"], weights[f"{p}.gate.e_score_correction_bias"])
        assert torch.equal(state["model.layers.0.self_attn.kv_b_proj.weight"], weights["model.layers.0.self_attn.kv_b_proj.weight"])

        block_out, gate_inputs = {}, {}
        hooks = []
        for k, layer in enumerate(model.model.layers):
            hooks.append(layer.register_forward_hook(lambda _m, _i, o, k=k: block_out.__setitem__(k, o[0] if isinstance(o, tuple) else o)))
            if k >= cfg["first_k_dense_replace"]:
                hooks.append(layer.mlp.gate.register_forward_hook(lambda _m, i, _o, k=k: gate_inputs.__setitem__(k, i[0])))
        golden, margins = {}, []
        with torch.no_grad():
            for c, ids in enumerate(CASES):
                input_ids = torch.tensor([ids], dtype=torch.long)
                outputs = model(input_ids=input_ids, output_hidden_states=True, use_cache=False)
                hs = torch.stack([h[0] for h in outputs.hidden_states])
                assert hs.shape[0] == cfg["num_hidden_layers"] + 1
                golden[f"case{c}.input_ids"] = input_ids[0]
                golden[f"case{c}.logits"] = outputs.logits[0].float()
                golden[f"case{c}.hidden_states"] = hs.float()
                golden[f"case{c}.block_out"] = torch.stack([block_out[k][0] for k in range(cfg["num_hidden_layers"])]).float()
                margins.append(routing_margins(cfg, gate_inputs, weights))
        for h in hooks:
            h.remove()
        golden = {k: v.contiguous() for k, v in golden.items()}
        safetensors.torch.save_file(golden, os.path.join(out, "golden.safetensors"))
        meta = {
            "model": name,
            "cases": [{"input_ids": ids} for ids in CASES],
            "min_routing_margin": min(margins),
            "tensors": {k: list(v.shape) for k, v in golden.items()},
            "versions": {
                "python": platform.python_version(),
                "torch": torch.__version__,
                "transformers": transformers.__version__,
                "safetensors": safetensors.__version__,
                "numpy": np.__version__,
            },
            "settings": "float32, eager attention, CPU, batch 1, no padding, use_cache False",
        }
        with open(os.path.join(out, "golden.json"), "w") as f:
            json.dump(meta, f, indent=2)
            f.write("\n")
        print(f"{name}: min routing margin {min(margins):.4g}, logits max |x| {max(golden[f'case{c}.logits'].abs().max().item() for c in range(len(CASES))):.3f}")


if __name__ == "__main__":
    main()
