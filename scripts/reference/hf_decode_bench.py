"""HF transformers baseline for `tandem bench-target`: generate() decode speed of the same model
on the same GPU, bf16, eager attention, greedy, same prompt construction (real text repeated to
--prompt-tokens), KV cache on. Prints a markdown table and writes JSON.

Usage: python3 hf_decode_bench.py MODEL_DIR [--prompt-tokens 128] [--new-tokens 64]
       [--batch 1,8] [--repeats 3] [--json OUT]
"""
import argparse
import json
import statistics
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

SEED_TEXT = ("The history of mathematics spans thousands of years, from counting and "
             "geometry in ancient civilisations to the abstract structures of today. ")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--batch", default="1")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--attn", default="eager")
    ap.add_argument("--json")
    args = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(
        args.model, dtype=torch.bfloat16, attn_implementation=args.attn).to(dev).eval()
    seed = tok(SEED_TEXT, add_special_tokens=False)["input_ids"]
    prompt = (seed * (args.prompt_tokens // len(seed) + 1))[: args.prompt_tokens]
    paris = tok("The capital of France is", return_tensors="pt").to(dev)
    with torch.no_grad():
        out = model.generate(**paris, max_new_tokens=1, do_sample=False)
    print("hf next token after 'The capital of France is':", repr(tok.decode(out[0, -1:])))
    rows = []
    for batch in [int(b) for b in args.batch.split(",")]:
        ids = torch.tensor([prompt] * batch, device=dev)
        mask = torch.ones_like(ids)
        ttfts, tps = [], []
        for rep in range(args.repeats + 1):
            with torch.no_grad():
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=1,
                               min_new_tokens=1, do_sample=False, pad_token_id=tok.eos_token_id)
                torch.cuda.synchronize()
                t1 = time.perf_counter()
                model.generate(input_ids=ids, attention_mask=mask,
                               max_new_tokens=args.new_tokens + 1,
                               min_new_tokens=args.new_tokens + 1, do_sample=False,
                               pad_token_id=tok.eos_token_id)
                torch.cuda.synchronize()
                t2 = time.perf_counter()
            if rep > 0:
                ttft = t1 - t0
                ttfts.append(ttft)
                tps.append(batch * args.new_tokens / ((t2 - t1) - ttft))
        row = {"impl": f"hf-transformers-{args.attn}", "batch": batch,
               "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens,
               "ttft_ms_median": statistics.median(ttfts) * 1e3,
               "tokens_per_second": statistics.median(tps)}
        print(row, flush=True)
        rows.append(row)
    print("| impl | batch | prompt | TTFT ms (median) | tokens/s |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['impl']} | {r['batch']} | {r['prompt_tokens']} | {r['ttft_ms_median']:.1f} | {r['tokens_per_second']:.1f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
