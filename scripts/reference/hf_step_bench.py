"""HF transformers (bf16, sdpa by default) reference for `tandem fast-bench`: the time of one
decode step and of one verification step of W tokens per sequence (a causal chain, as the
fast path's `verify W` rows) on top of a cached prompt, at each batch size, plus generate()
decode tokens/s. Same prompt construction as hf_decode_bench.py (real text repeated).

Usage: python3 hf_step_bench.py MODEL_DIR [--batch 1,8,32] [--widths 4,8,32]
       [--prompt-tokens 128] [--steps 20] [--attn sdpa] [--device-map auto] [--json OUT]

--device-map auto spreads the layers over every visible GPU (accelerate's pipeline split, what
HF offers for a model across GPUs), the baseline next to `tandem fast-bench --tp N`.
"""
import argparse
import json
import statistics
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

SEED_TEXT = ("The history of mathematics spans thousands of years, from counting and "
             "geometry in ancient civilisations to the abstract structures of today. ")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--batch", default="1,8,32")
    ap.add_argument("--widths", default="4,8,32")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--attn", default="sdpa")
    ap.add_argument("--device-map", help="e.g. auto: the layers over every visible GPU")
    ap.add_argument("--json")
    args = ap.parse_args()
    tok = AutoTokenizer.from_pretrained(args.model)
    if args.device_map:
        model = AutoModelForCausalLM.from_pretrained(
            args.model, dtype=torch.bfloat16, attn_implementation=args.attn,
            device_map=args.device_map).eval()
    else:
        model = AutoModelForCausalLM.from_pretrained(
            args.model, dtype=torch.bfloat16, attn_implementation=args.attn).to("cuda").eval()
    # The inputs go where lm_head is: accelerate returns outputs on the inputs' device, so ids
    # on GPU 0 would copy every step's full logits back from the last GPU (263 MB for verify 32
    # at batch 32); the embedding's hook moves the few ids to GPU 0 itself.
    device = torch.device("cuda")
    used = ["cuda:0"]
    if args.device_map:
        placement = getattr(model, "hf_device_map", None) or {}
        names = {str(torch.device("cuda", v)) if isinstance(v, int) else str(v)
                 for v in placement.values()}
        if {"cpu", "disk"} & names:
            raise SystemExit(f"the device map puts layers off the GPUs: {placement}")
        used = sorted(names)
        print("device map:", placement, flush=True)
        head = placement.get("lm_head", next(iter(placement.values()), 0))
        device = torch.device("cuda", head) if isinstance(head, int) else torch.device(str(head))
    seed = tok(SEED_TEXT, add_special_tokens=False)["input_ids"]
    prompt = (seed * (args.prompt_tokens // len(seed) + 1))[: args.prompt_tokens]
    rows = []
    for batch in [int(b) for b in args.batch.split(",")]:
        ids = torch.tensor([prompt] * batch, device=device)
        with torch.no_grad():
            cache = DynamicCache()
            out = model(input_ids=ids, past_key_values=cache, use_cache=True)
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            for width in [1] + [int(w) for w in args.widths.split(",")]:
                times = []
                step_ids = nxt.repeat(1, width)
                for i in range(args.steps + 2):
                    for d in used:
                        torch.cuda.synchronize(torch.device(d))
                    t0 = time.perf_counter()
                    o = model(input_ids=step_ids, past_key_values=cache, use_cache=True)
                    o.logits.argmax(-1).cpu()
                    t1 = time.perf_counter()
                    cache.crop(args.prompt_tokens)
                    if i >= 2:
                        times.append(t1 - t0)
                ms = statistics.median(times) * 1e3
                impl = f"hf-transformers-{args.attn}"
                if args.device_map:
                    impl += f"-device-map-{args.device_map}-{len(used)}gpu"
                row = {"impl": impl, "batch": batch, "devices": used,
                       "step": "decode" if width == 1 else f"verify {width}", "width": width,
                       "step_ms_median": ms,
                       "tokens_per_second": batch / ms * 1e3 if width == 1 else None}
                print(row, flush=True)
                rows.append(row)
    print("| impl | step | batch | step ms (median) | tokens/s (decode) | step / decode step |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        dec = next(d for d in rows if d["batch"] == r["batch"] and d["width"] == 1)
        tps = f"{r['tokens_per_second']:.1f}" if r["tokens_per_second"] else "-"
        print(f"| {r['impl']} | {r['step']} | {r['batch']} | {r['step_ms_median']:.3f} | {tps} | "
              f"{r['step_ms_median'] / dec['step_ms_median']:.2f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
