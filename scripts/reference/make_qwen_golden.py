#!/usr/bin/env python3
"""Golden fixture for Qwen2.5-Coder-1.5B-Instruct (issue #18): HF transformers loads the same
Q4_K_M GGUF Tandem imports, dequantises it to f32 and runs it with eager attention on the CPU.
No Tandem code is involved.

Pinned environment: scripts/reference/requirements.txt (torch 2.15.0, transformers 5.24.0,
tokenizers 0.23.3, gguf 0.19.0, Python 3.11); float32 weights and activations, eager attention,
batch 1, no padding, greedy only.

    scripts/fetch_qwen_coder.sh
    .venv-ref/bin/python scripts/reference/make_qwen_golden.py \
        [models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf] [tests/fixtures/qwen2.5-coder-1.5b]

Writes golden.safetensors (f32 / i64) and golden.json (cases, rendered chat text, greedy
text, versions, meaning of every tensor). Kept small (the repository travels to the GPU
machine on every call): no full-vocabulary logits, only the reference's top 512 at the last
position and the argmax of every position.
"""

import json
import os
import sys
import time
from importlib.metadata import version as pkg_version

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

DEFAULT_GGUF = "models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
DEFAULT_OUT = "tests/fixtures/qwen2.5-coder-1.5b"
TOP = 512
GREEDY_NEW_TOKENS = 12

CASES = [
    ("case0", "chat", [{"role": "user", "content": "Write a Python function that checks whether a number is prime."}]),
    ("case1", "raw", "def quicksort(arr):\n    \"\"\"Sort a list of numbers.\"\"\"\n"),
]


def as_ids(x):
    if hasattr(x, "keys") and "input_ids" in x:
        x = x["input_ids"]
    return [int(i) for i in x]


def main():
    gguf = sys.argv[1] if len(sys.argv) > 1 else DEFAULT_GGUF
    out_dir = sys.argv[2] if len(sys.argv) > 2 else DEFAULT_OUT
    os.makedirs(out_dir, exist_ok=True)
    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    model_dir, gguf_name = os.path.dirname(os.path.abspath(gguf)), os.path.basename(gguf)
    t0 = time.time()
    tok = AutoTokenizer.from_pretrained(model_dir, gguf_file=gguf_name)
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, gguf_file=gguf_name, dtype=torch.float32, attn_implementation="eager"
    )
    model.eval()
    cfg = model.config
    assert model.dtype == torch.float32 and cfg._attn_implementation == "eager"
    print(f"loaded in {time.time() - t0:.1f}s: {cfg.model_type}, {cfg.num_hidden_layers} layers")
    n_layers = cfg.num_hidden_layers

    captured = {}

    def make_hook(k):
        def hook(_module, _inp, output):
            o = output[0] if isinstance(output, (tuple, list)) else output
            captured[k] = o.detach().clone()

        return hook

    for k in range(n_layers):
        model.model.layers[k].register_forward_hook(make_hook(k))

    tensors, meaning, cases = {}, {}, {}

    def put(key, t, what):
        t = t.detach().cpu().contiguous()
        t = t.to(torch.float32) if t.dtype.is_floating_point else t.to(torch.int64)
        tensors[key] = t.clone()
        meaning[key] = {"shape": list(t.shape), "dtype": str(t.dtype).replace("torch.", ""), "meaning": what}

    with torch.no_grad():
        for name, kind, content in CASES:
            if kind == "chat":
                rendered = tok.apply_chat_template(content, add_generation_prompt=True, tokenize=False)
                ids = as_ids(tok.apply_chat_template(content, add_generation_prompt=True))
            else:
                rendered = content
                ids = as_ids(tok(content, add_special_tokens=False))
            inp = torch.tensor([ids])
            out = model(input_ids=inp, attention_mask=torch.ones_like(inp), output_hidden_states=True, use_cache=False)
            logits = out.logits[0]
            last = logits[-1]
            top = torch.topk(last, TOP)
            put(f"{name}.input_ids", inp[0], "token ids of the case")
            put(f"{name}.top_ids", top.indices, f"the reference's top {TOP} vocabulary ids at the last position")
            put(f"{name}.top_logits", top.values, "logits of top_ids at the last position")
            put(f"{name}.argmax", logits.argmax(-1), "argmax over the full vocabulary at every position")
            put(
                f"{name}.block_out_last",
                torch.stack([captured[k][0, -1] for k in range(n_layers)]),
                "forward-hook output of decoder layer k at the last position (pre-norm residual stream)",
            )
            put(f"{name}.embed_last", out.hidden_states[0][0, -1], "hidden_states[0] (embeddings) at the last position")
            put(f"{name}.final_last", out.hidden_states[-1][0, -1], "hidden_states[-1] (after the final norm) at the last position")
            gen = model.generate(
                inp,
                attention_mask=torch.ones_like(inp),
                generation_config=GenerationConfig(
                    do_sample=False, num_beams=1, max_new_tokens=GREEDY_NEW_TOKENS, min_new_tokens=0,
                    eos_token_id=None, pad_token_id=cfg.pad_token_id, bos_token_id=cfg.bos_token_id,
                ),
            )
            new = gen[0, len(ids):]
            put(f"{name}.greedy_ids", new, f"greedy continuation, {GREEDY_NEW_TOKENS} tokens (no EOS stop)")
            top2 = torch.topk(last, 2).values
            cases[name] = {
                "kind": kind,
                "content": content,
                "rendered": rendered,
                "ids": ids,
                "greedy_text": tok.decode(new),
                "last_top2_margin": float(top2[0] - top2[1]),
            }
            print(name, len(ids), "tokens; greedy:", repr(cases[name]["greedy_text"]))

    save_file(tensors, os.path.join(out_dir, "golden.safetensors.tmp"))
    os.replace(os.path.join(out_dir, "golden.safetensors.tmp"), os.path.join(out_dir, "golden.safetensors"))
    meta = {
        "gguf": gguf_name,
        "gguf_bytes": os.path.getsize(gguf),
        "reference": "HF transformers, GGUF dequantised to float32, eager attention, CPU, batch 1",
        "versions": {p: pkg_version(p) for p in ("torch", "transformers", "tokenizers", "gguf", "numpy", "safetensors")},
        "config": {k: getattr(cfg, k) for k in ("model_type", "num_hidden_layers", "hidden_size", "vocab_size", "rope_theta", "rms_norm_eps", "tie_word_embeddings") if hasattr(cfg, k)},
        "cases": cases,
        "tensors": meaning,
    }
    with open(os.path.join(out_dir, "golden.json"), "w") as f:
        json.dump(meta, f, indent=1, default=str)
    print(f"wrote {out_dir} in {time.time() - t0:.1f}s")


if __name__ == "__main__":
    main()
