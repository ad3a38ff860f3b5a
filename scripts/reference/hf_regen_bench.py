"""HF transformers reference for `tandem dump --regenerate`: the same regeneration and capture
done the usual way, on the same conversations, model and GPU, so the tokens/s that the tandem
dump prints can be read against it.

What it does, step for step as crates/tandem-dump (job.rs, regen.rs) does it:

- Conversations: read in file order from a chat JSONL (`messages` or `conversations`, roles
  normalised as tandem-data does: human/user, gpt/assistant/chatgpt/bing/bard/model, system).
  Leading assistant turns are dropped; a conversation with an empty message, a system
  message after the start, or no user message is skipped (tandem-data's `check`).
- Batching: records are read until `--batch-size` usable conversations are collected; that
  group is regenerated together (tandem: `want = batch_size` in job.rs, then `regenerate`).
- Turns: round r writes the r-th assistant turn of every conversation of the group at once.
  A conversation without assistant turns gets one after each run of user messages (`plan`).
  The prompt of a turn is the chat template rendered up to it with the generation prompt,
  tokenised without special tokens. If prompt + 1 >= --max-len (or the context), the
  conversation ends before that turn; if that is its first turn it is skipped (`too_long`).
- Budget: per turn min(--max-new-tokens, max_len - prompt, context - prompt) tokens; a
  sequence stops on its own at an end-of-turn id (the eos token plus <|im_end|> /
  <|eot_id|> / <|endoftext|> when the chat template uses them, as TargetTokenizer does) or
  at its budget. Greedy. The reply is the generated ids without the stop token, decoded with
  special tokens kept.
- Capture: each regenerated conversation is rendered with the chat template, cut to
  --max-len tokens, and run one sample at a time with `output_hidden_states=True`; the
  three EAGLE-3 taps (blocks 1, L/2-1, L-4 = hidden_states[2], [L/2], [L-3]) and the last
  block's output (a forward hook, as hf_capture_bench.py) are copied to host memory.
- Timing: generation time = the wall time of the round loop of each group (prompt rendering,
  tokenising and decoding included, as tandem's `RegenStats.seconds`); capture time = the
  forwards and copies; overall = the whole loop. Tokens/s are reported the way
  `tandem dump` prints them: generated tokens / generation seconds, captured tokens /
  capture seconds, captured tokens / overall seconds.

What differs:

- HF `generate()` pads the group on the left and keeps finished sequences in the batch until
  the longest one stops (they decode padding); tandem's ragged cache drops a finished
  sequence from the step. Per-sequence budgets are enforced with a StoppingCriteria, so each
  sequence gets exactly tandem's budget.
- HF uses its own KV cache and eager attention in bf16 (cuBLAS); tandem runs burn-cuda bf16.
  Greedy replies can differ where bf16 rounding flips a near-tie, so the two runs generate
  similar but not identical token counts: compare tokens/s, not totals.
- tandem's number includes its first-batch JIT compilation (cold start, ~8 s on the H200);
  here one small warm-up generate() and forward run before the clock starts.
- No loss mask and no Arrow shards are written (the mask and zstd writing are host work
  that tandem's overall figure includes; the capture figure excludes it on both sides).
- The row count stops at --samples like `--max-samples`: the group in which the count is
  reached is regenerated in full (as in tandem), its extra rows are not captured.

Usage: python3 hf_regen_bench.py MODEL_DIR CONVERSATIONS.jsonl [--samples N] [--max-len 512]
       [--max-new-tokens 128] [--batch-size 16] [--device cuda|cpu] [--dtype bf16|f32]
       [--json OUT] [--dump-replies OUT.jsonl]
"""
import argparse
import json
import time

import torch
from transformers import (AutoModelForCausalLM, AutoTokenizer, StoppingCriteria,
                          StoppingCriteriaList)

ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
         "chatgpt": "assistant", "bing": "assistant", "bard": "assistant",
         "model": "assistant", "system": "system"}


def conversations(path):
    """(id, messages) of each usable record, in file order, as tandem-data checks them."""
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            turns = rec.get("messages", rec.get("conversations"))
            if not isinstance(turns, list):
                continue
            raw = []
            if isinstance(rec.get("system"), str) and rec["system"].strip():
                raw.append(("system", rec["system"]))
            ok = True
            for t in turns:
                role = ROLES.get(str(t.get("role", t.get("from", ""))).strip().lower())
                text = t.get("content", t.get("value"))
                if role is None or not isinstance(text, str):
                    ok = False
                    break
                raw.append((role, text))
            if not ok or not raw:
                continue
            n_sys = next((i for i, (r, _) in enumerate(raw) if r != "system"), len(raw))
            k = n_sys
            while k < len(raw) and raw[k][0] == "assistant":
                k += 1
            msgs = raw[:n_sys] + raw[k:]
            if any(not c.strip() for _, c in msgs):
                continue
            if any(r == "system" for r, _ in msgs[n_sys:]):
                continue
            if not any(r == "user" for r, _ in msgs):
                continue
            yield str(rec.get("id", n)), [{"role": r, "content": c} for r, c in msgs]


def plan(messages):
    """regen.rs `plan`: keep the conversation's own assistant slots, or add one after each
    run of user messages for prompt-only conversations."""
    if any(m["role"] == "assistant" for m in messages):
        return [dict(m) for m in messages]
    out = []
    for i, m in enumerate(messages):
        out.append(dict(m))
        nxt = messages[i + 1]["role"] if i + 1 < len(messages) else None
        if m["role"] == "user" and nxt != "user":
            out.append({"role": "assistant", "content": ""})
    return out


def stop_ids(tok):
    """TargetTokenizer::load: the eos token, plus end-of-turn tokens the template uses."""
    ids = []
    if tok.eos_token is not None:
        i = tok.convert_tokens_to_ids(tok.eos_token)
        if i is not None and i != tok.unk_token_id:
            ids.append(i)
    template = tok.chat_template or ""
    for extra in ["<|im_end|>", "<|eot_id|>", "<|endoftext|>"]:
        i = tok.convert_tokens_to_ids(extra)
        if i is not None and i != tok.unk_token_id and i not in ids and extra in template:
            ids.append(i)
    return ids


class RowBudget(StoppingCriteria):
    """Each row stops after its own number of new tokens."""

    def __init__(self, start, budgets, device):
        self.start = start
        self.budgets = torch.tensor(budgets, device=device)

    def __call__(self, input_ids, scores, **kwargs):
        return (input_ids.shape[1] - self.start) >= self.budgets


def generate_batch(model, prompts, budgets, eos, pad, device):
    """regen.rs `generate_batch`, greedy: per sequence its tokens (no stop token) and whether
    it stopped on a stop token (False: budget reached)."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, width - len(p):] = torch.tensor(p)
        mask[b, width - len(p):] = 1
    ids, mask = ids.to(device), mask.to(device)
    out = model.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=max(budgets), do_sample=False,
        temperature=None, top_p=None, top_k=None, eos_token_id=eos, pad_token_id=pad,
        stopping_criteria=StoppingCriteriaList([RowBudget(width, budgets, device)]))
    results = []
    for b, budget in enumerate(budgets):
        gen = out[b, width:].tolist()[:budget]
        cut = next((k for k, t in enumerate(gen) if t in eos), None)
        results.append((gen, False) if cut is None else (gen[:cut], True))
    return results


def regenerate(model, tok, group, args, eos, pad, context, stats):
    """regen.rs `regenerate` for one group: returns per conversation the messages with the
    target's replies, or None (skipped: the first turn's prompt does not fit)."""
    states = []
    for _, messages in group:
        messages = plan(messages)
        todo = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        states.append({"messages": messages, "todo": todo, "next": 0, "skip": False})
    t0 = time.perf_counter()
    while True:
        jobs = []
        for s, st in enumerate(states):
            if st["skip"] or st["next"] >= len(st["todo"]):
                continue
            at = st["todo"][st["next"]]
            text = tok.apply_chat_template(st["messages"][:at], tokenize=False,
                                           add_generation_prompt=True)
            prompt = tok(text, add_special_tokens=False)["input_ids"]
            if len(prompt) + 1 >= args.max_len or len(prompt) + 1 >= context:
                st["messages"] = st["messages"][:at]
                st["todo"] = st["todo"][:st["next"]]
                if st["next"] == 0:
                    st["skip"] = True
                continue
            budget = min(args.max_new_tokens, args.max_len - len(prompt), context - len(prompt))
            jobs.append((s, prompt, budget))
        if not jobs:
            break
        outs = generate_batch(model, [j[1] for j in jobs], [j[2] for j in jobs], eos, pad,
                              model.device)
        for (s, _, _), (tokens, stopped) in zip(jobs, outs):
            st = states[s]
            st["messages"][st["todo"][st["next"]]]["content"] = tok.decode(
                tokens, skip_special_tokens=False)
            stats["generated_tokens"] += len(tokens)
            stats["turns"] += 1
            stats["cut_turns"] += int(not stopped)
            st["next"] += 1
    if model.device.type == "cuda":
        torch.cuda.synchronize()
    stats["generation_s"] += time.perf_counter() - t0
    return [None if st["skip"] else st["messages"] for st in states]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("jsonl")
    ap.add_argument("--samples", type=int, default=64, help="rows to capture (--max-samples)")
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="bf16 (default on cuda) or f32 (cpu)")
    ap.add_argument("--json", help="write the numbers here")
    ap.add_argument("--dump-replies", help="write the regenerated conversations here (JSONL)")
    args = ap.parse_args()
    dtype = {"bf16": torch.bfloat16, "f32": torch.float32}[
        args.dtype or ("bf16" if args.device == "cuda" else "f32")]
    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(
        args.model, dtype=dtype, attn_implementation="eager").to(args.device).eval()
    context = model.config.max_position_embeddings
    eos = stop_ids(tok)
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos[0]
    layers = model.config.num_hidden_layers
    idx = [2, layers // 2, layers - 3]
    last = {}
    model.model.layers[-1].register_forward_hook(
        lambda m, i, o: last.__setitem__("h", o[0] if isinstance(o, tuple) else o))
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)

    source = conversations(args.jsonl)
    with torch.no_grad():  # warm-up: one short generate and one forward, not timed
        _, first = next(conversations(args.jsonl))
        text = tok.apply_chat_template(plan(first)[:1], tokenize=False,
                                       add_generation_prompt=True)
        warm = tok(text, add_special_tokens=False)["input_ids"][: args.max_len - 8]
        generate_batch(model, [warm, warm], [4, 4], eos, pad, model.device)
        model(torch.tensor([warm], device=args.device), output_hidden_states=True)
        sync()

    stats = {"generated_tokens": 0, "turns": 0, "cut_turns": 0, "generation_s": 0.0}
    rows, tokens, capture_s, conversations_read = 0, 0, 0.0, 0
    replies = open(args.dump_replies, "w", encoding="utf-8") if args.dump_replies else None
    t_start = time.perf_counter()
    with torch.no_grad():
        done = False
        while not done:
            group = []
            for item in source:
                group.append(item)
                if len(group) == args.batch_size:
                    break
            if not group:
                break
            conversations_read += len(group)
            for (cid, _), messages in zip(group, regenerate(model, tok, group, args, eos, pad,
                                                            context, stats)):
                if messages is None:
                    continue
                text = tok.apply_chat_template(messages, tokenize=False)
                ids = tok(text, add_special_tokens=False)["input_ids"][: args.max_len]
                if replies:
                    replies.write(json.dumps({"id": cid, "messages": messages}) + "\n")
                t0 = time.perf_counter()
                out = model(torch.tensor([ids], device=args.device), output_hidden_states=True)
                aux = torch.cat([out.hidden_states[i] for i in idx], dim=-1).cpu()
                h = last["h"].cpu()
                del aux, h
                sync()
                capture_s += time.perf_counter() - t0
                rows += 1
                tokens += len(ids)
                if rows >= args.samples:
                    done = True
                    break
    sync()
    total_s = time.perf_counter() - t_start
    if replies:
        replies.close()
    gen_tps = stats["generated_tokens"] / max(stats["generation_s"], 1e-9)
    result = {
        "impl": f"hf-transformers-eager-{args.dtype or ('bf16' if args.device == 'cuda' else 'f32')}",
        "device": args.device, "batch_size": args.batch_size, "max_len": args.max_len,
        "max_new_tokens": args.max_new_tokens, "conversations": conversations_read,
        "rows": rows, "tokens": tokens, "turns": stats["turns"],
        "cut_turns": stats["cut_turns"], "generated_tokens": stats["generated_tokens"],
        "generation_s": stats["generation_s"], "generation_tokens_per_s": gen_tps,
        "capture_s": capture_s, "capture_tokens_per_s": tokens / max(capture_s, 1e-9),
        "total_s": total_s, "tokens_per_s": tokens / max(total_s, 1e-9),
    }
    # The same two lines `tandem dump --regenerate` prints, then one table row.
    print(f"wrote {rows} rows, {tokens} tokens in {total_s:.1f}s: "
          f"{result['tokens_per_s']:.0f} tok/s overall, "
          f"{result['capture_tokens_per_s']:.0f} tok/s in prefill captures")
    print(f"regenerated {stats['turns']} turns ({stats['cut_turns']} hit the token budget): "
          f"{stats['generated_tokens']} tokens in {stats['generation_s']:.1f}s, {gen_tps:.1f} tok/s")
    print(f"| {result['impl']} regenerate | batch {args.batch_size} | {rows} rows | "
          f"{tokens} tokens | {stats['generated_tokens']} generated in "
          f"{stats['generation_s']:.1f} s | {gen_tps:.0f} gen tok/s | "
          f"{result['capture_tokens_per_s']:.0f} capture tok/s |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
