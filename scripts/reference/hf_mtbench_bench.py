"""HF transformers baseline for `tandem bench --prompts mtbench`: generate() on the same MT-Bench
first turns, same model, same GPU, so issue #6's table can show tandem target-only, tandem
speculative and HF generate() from one run.

Step for step as `tandem bench` builds and times its target-only baseline (src/commands/spec.rs):

- Prompts: the first turn of each question of MT-Bench's question.jsonl, in file order, the
  first --max-prompts of them, as one user message rendered with the chat template and the
  generation prompt, tokenised without special tokens (TargetTokenizer::encode_chat).
- Decoding: greedy, batch 1, up to --max-new-tokens new tokens, stopping at the eos token or an
  end-of-turn token the template uses (TargetTokenizer's stop ids, hf_regen_bench.stop_ids).
  The stop token is not counted, as tandem does not count it.
- Timing: the wall time of each prompt's generate() call (prefill included, device
  synchronised), summed; tok/s = generated tokens / that sum. One short generate() warms up
  before the clock starts (tandem warms up with one speculative run of 8 tokens).

What differs: HF runs its own KV cache and attention kernels (--attn, default eager) in bf16;
tandem runs burn-cuda bf16. Greedy outputs can differ where bf16 rounding flips a near-tie, so
token totals may differ slightly: compare tokens/s.

Usage: python3 hf_mtbench_bench.py MODEL_DIR QUESTIONS.jsonl [--max-prompts 80]
       [--max-new-tokens 64] [--device cuda|cpu] [--dtype bf16|f32] [--attn eager] [--json OUT]
"""
import argparse
import json
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_regen_bench import stop_ids


def first_turns(path, limit):
    """The first turn of each MT-Bench question, in file order (tandem-data mtbench_prompts)."""
    out = []
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            q = json.loads(line)
            turns = q.get("turns") or []
            if not turns or not turns[0].strip():
                raise SystemExit(f"{path}: question {q.get('question_id')} has no first turn")
            out.append((q.get("question_id"), turns[0]))
            if len(out) == limit:
                break
    return out


def encode_chat(tok, text):
    rendered = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                       add_generation_prompt=True)
    return tok(rendered, add_special_tokens=False)["input_ids"]


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def generate(model, prompt, max_new_tokens, eos, pad, device):
    """Greedy continuation of one prompt: (tokens without the stop token, stopped, seconds)."""
    ids = torch.tensor([prompt], device=device)
    sync(device)
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                             max_new_tokens=max_new_tokens, do_sample=False, temperature=None,
                             top_p=None, top_k=None, eos_token_id=eos, pad_token_id=pad)
    sync(device)
    seconds = time.perf_counter() - t0
    gen = out[0, len(prompt):].tolist()
    cut = next((k for k, t in enumerate(gen) if t in eos), None)
    return (gen, False, seconds) if cut is None else (gen[:cut], True, seconds)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("questions")
    ap.add_argument("--max-prompts", type=int, default=80)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "f32"])
    ap.add_argument("--attn", default="eager")
    ap.add_argument("--json")
    args = ap.parse_args()
    tok = AutoTokenizer.from_pretrained(args.model)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(
        args.model, dtype=dtype, attn_implementation=args.attn).to(args.device).eval()
    eos = stop_ids(tok)
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos[0]
    prompts = [(qid, encode_chat(tok, text)) for qid, text in
               first_turns(args.questions, args.max_prompts)]
    generate(model, prompts[0][1], 8, eos, pad, args.device)
    rows = []
    for qid, prompt in prompts:
        tokens, stopped, seconds = generate(model, prompt, args.max_new_tokens, eos, pad,
                                            args.device)
        rows.append({"question_id": qid, "prompt_tokens": len(prompt), "tokens": len(tokens),
                     "stopped": stopped, "seconds": seconds, "ids": tokens})
    total_tokens = sum(r["tokens"] for r in rows)
    total_seconds = sum(r["seconds"] for r in rows)
    summary = {"impl": f"hf-transformers-{args.attn}", "device": args.device,
               "dtype": args.dtype, "prompts": len(rows), "max_new_tokens": args.max_new_tokens,
               "tokens": total_tokens, "seconds": total_seconds,
               "tokens_per_second": total_tokens / max(total_seconds, 1e-9),
               "stopped_at_eos": sum(r["stopped"] for r in rows)}
    print("| impl | device | prompts | max new tokens | tokens | seconds | tok/s | stopped at eos |")
    print("|---|---|---|---|---|---|---|---|")
    print(f"| {summary['impl']} {args.dtype} | {args.device} | {summary['prompts']} | "
          f"{args.max_new_tokens} | {total_tokens} | {total_seconds:.1f} | "
          f"{summary['tokens_per_second']:.1f} | {summary['stopped_at_eos']} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"summary": summary, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
