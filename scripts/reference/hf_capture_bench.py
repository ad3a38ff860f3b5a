"""HF transformers baseline for `tandem dump` (prefill-only mode): the same capture done the
usual way, `output_hidden_states=True`, bf16, on the same GPU. Each conversation is rendered
with the chat template, cut to --max-len tokens, run one sample at a time (as the dump job
does), and the three EAGLE-3 taps (blocks 1, L/2-1, L-4 = hidden_states[2], [L/2], [L-3]) plus
the last block's output are copied to host memory. Prints tokens/s.

Usage: python3 hf_capture_bench.py MODEL_DIR CONVERSATIONS.jsonl [--samples N] [--max-len 512]
"""
import argparse
import json
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("jsonl")
    ap.add_argument("--samples", type=int, default=200)
    ap.add_argument("--max-len", type=int, default=512)
    args = ap.parse_args()
    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(
        args.model, dtype=torch.bfloat16, attn_implementation="eager").cuda().eval()
    layers = model.config.num_hidden_layers
    idx = [2, layers // 2, layers - 3]
    last = {}
    model.model.layers[-1].register_forward_hook(
        lambda m, i, o: last.__setitem__("h", o[0] if isinstance(o, tuple) else o))
    samples = []
    with open(args.jsonl) as f:
        for line in f:
            msgs = json.loads(line)["messages"]
            ids = tok.apply_chat_template(msgs, tokenize=False)
            ids = tok(ids, add_special_tokens=False)["input_ids"][: args.max_len]
            samples.append(ids)
            if len(samples) >= args.samples:
                break
    tokens = 0
    with torch.no_grad():
        for ids in samples[:3]:  # warm-up
            model(torch.tensor([ids], device="cuda"), output_hidden_states=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for ids in samples:
            out = model(torch.tensor([ids], device="cuda"), output_hidden_states=True)
            aux = torch.cat([out.hidden_states[i] for i in idx], dim=-1).cpu()
            h = last["h"].cpu()
            tokens += len(ids)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
    print(f"| hf-transformers eager output_hidden_states | {len(samples)} samples | {tokens} tokens | {dt:.1f} s | {tokens / dt:.0f} tok/s |")


if __name__ == "__main__":
    main()
