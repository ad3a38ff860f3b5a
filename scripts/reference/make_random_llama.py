"""A Llama-3.1-8B-shaped model (or, with --shape qwen2.5-1.5b, a Qwen2.5-1.5B-shaped one) with
random bf16 weights, written as HF safetensors shards (`model-0000N-of-0000M.safetensors` + `model.safetensors.index.json`) and an HF config.json, for
speed tables of a target the size users train heads for (issue #16). Made on the GPU machine
(uploads there are limited to 64 MiB a call): the weights are drawn on the GPU with a fixed seed.
The tokenizer files are copied from another model directory (token ids stay below its vocab).

Usage: python3 make_random_llama.py OUT_DIR --tokenizer-from MODEL_DIR [--shape S] [--layers N]
       [--config-from MODEL_DIR]  (another model's config.json as the shape, e.g. SmolLM2's for
       its step times without carrying its weights)
"""
import argparse
import json
import os
import shutil

import torch
from safetensors.torch import save_file

LLAMA_31_8B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "hidden_act": "silu",
    "vocab_size": 128256,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "max_position_embeddings": 131072,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 1,
    "eos_token_id": 2,
}

# Qwen2.5-Coder-1.5B-Instruct's shape (the second real target): q/k/v biases, tied embeddings.
QWEN25_15B = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_size": 1536,
    "intermediate_size": 8960,
    "num_hidden_layers": 28,
    "num_attention_heads": 12,
    "num_key_value_heads": 2,
    "hidden_act": "silu",
    "vocab_size": 151936,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "max_position_embeddings": 32768,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "bos_token_id": 151643,
    "eos_token_id": 151645,
}

SHAPES = {"llama-3.1-8b": LLAMA_31_8B, "qwen2.5-1.5b": QWEN25_15B}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--tokenizer-from", required=True)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.1-8b")
    ap.add_argument("--layers", type=int, help="default: the shape's")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--config-from", help="a model directory whose config.json is the shape")
    args = ap.parse_args()
    base = SHAPES[args.shape]
    if args.config_from:
        with open(os.path.join(args.config_from, "config.json")) as f:
            base = json.load(f)
    args.layers = args.layers or base["num_hidden_layers"]
    cfg = dict(base, num_hidden_layers=args.layers)
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    hd = cfg.get("head_dim", h // cfg["num_attention_heads"])
    bias = cfg["model_type"] == "qwen2"
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    gen = torch.Generator(device="cuda").manual_seed(args.seed)

    def rand(*shape):
        # Small weights keep the residual stream finite through every layer in bf16.
        return (torch.randn(*shape, device="cuda", generator=gen) * 0.02).to(torch.bfloat16).cpu()

    def ones(n):
        return torch.ones(n, dtype=torch.bfloat16)

    os.makedirs(args.out, exist_ok=True)
    shards = [{"model.embed_tokens.weight": rand(cfg["vocab_size"], h)}]
    for i in range(args.layers):
        p = f"model.layers.{i}"
        shards.append({
            f"{p}.input_layernorm.weight": ones(h),
            f"{p}.self_attn.q_proj.weight": rand(q, h),
            f"{p}.self_attn.k_proj.weight": rand(kv, h),
            f"{p}.self_attn.v_proj.weight": rand(kv, h),
            f"{p}.self_attn.o_proj.weight": rand(h, q),
            f"{p}.post_attention_layernorm.weight": ones(h),
            f"{p}.mlp.gate_proj.weight": rand(inter, h),
            f"{p}.mlp.up_proj.weight": rand(inter, h),
            f"{p}.mlp.down_proj.weight": rand(h, inter),
        })
        if bias:
            shards[-1].update({f"{p}.self_attn.{n}_proj.bias": rand(d)
                               for n, d in (("q", q), ("k", kv), ("v", kv))})
    last = {"model.norm.weight": ones(h)}
    if not cfg.get("tie_word_embeddings", False):
        last["lm_head.weight"] = rand(cfg["vocab_size"], h)
    shards.append(last)
    # About 4 GB per file, as HF shards.
    files, current, size = [], {}, 0
    for part in shards:
        current.update(part)
        size += sum(t.numel() * 2 for t in part.values())
        if size > 4e9:
            files.append(current)
            current, size = {}, 0
    if current:
        files.append(current)
    weight_map = {}
    for n, tensors in enumerate(files):
        name = f"model-{n + 1:05d}-of-{len(files):05d}.safetensors"
        tmp = os.path.join(args.out, name + ".tmp")
        save_file(tensors, tmp, metadata={"format": "pt"})
        os.replace(tmp, os.path.join(args.out, name))
        weight_map.update({k: name for k in tensors})
    with open(os.path.join(args.out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=1)
    with open(os.path.join(args.out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                 "generation_config.json"):
        src = os.path.join(args.tokenizer_from, name)
        if os.path.exists(src):
            shutil.copy(src, args.out)
    params = sum(t.numel() for part in files for t in part.values())
    print(f"wrote {args.out}: {params / 1e9:.2f} B parameters in {len(files)} shards")


if __name__ == "__main__":
    main()
