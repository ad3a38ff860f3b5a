#!/usr/bin/env python3
"""Write a chat-JSONL subset of the packaged ShareGPT file for the GPU regeneration runs.

The packaged file is truncated mid-record, so it is read record by record (json.raw_decode)
rather than with json.load. A conversation is kept when its first 2 x `--exchanges` turns are
human/gpt turns that alternate and are not empty (split conversations may start with the
assistant); the dump's --regenerate replaces the assistant turns with the target's own.
`--skip` usable conversations are passed over first. The sharegpt-3k file of earlier runs came
from tandem-data's reader, whose notion of usable differs slightly: this script's first 3,000
overlap it but are not the same list.

    python3 scripts/reference/sharegpt_subset.py data/sharegpt/ShareGPT_V3_unfiltered_cleaned_split.json \
        --count 12000 --out .device/f/sharegpt-12k.jsonl && xz -9 .device/f/sharegpt-12k.jsonl
"""
import argparse
import gzip
import json
import re

ROLES = {"human": "user", "gpt": "assistant"}


def records(path):
    text = open(path, encoding="utf-8").read()
    decoder = json.JSONDecoder()
    i = text.index("[") + 1
    while True:
        while i < len(text) and text[i] in " \r\n\t,":
            i += 1
        if i >= len(text) or text[i] == "]":
            return
        try:
            record, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return  # the truncated last record
        yield record


def usable(record, exchanges):
    messages = []
    for turn in (record.get("conversations") or [])[: 2 * exchanges]:
        role = ROLES.get(turn.get("from"))
        content = turn.get("value") or ""
        if role is None or not content.strip():
            return None
        if messages and messages[-1]["role"] == role:
            return None
        messages.append({"role": role, "content": content})
    return messages or None


def normalise(text):
    return re.sub(r"\s+", " ", text).strip().lower()


def eval_prompts(paths):
    """Prompts of evaluation sets (MT-Bench question.jsonl `turns`, HumanEval `prompt`), so
    that conversations containing one are kept out of training data."""
    prompts = set()
    for path in paths:
        opener = gzip.open if path.endswith(".gz") else open
        with opener(path, "rt", encoding="utf-8") as f:
            for line in f:
                if not line.strip():
                    continue
                row = json.loads(line)
                for text in row.get("turns", []) + [row.get("prompt", "")]:
                    if len(normalise(text)) >= 20:
                        prompts.add(normalise(text))
    return prompts


# Words and symbols that mark a request about code (issue #18: the Qwen2.5-Coder head is trained
# on code-leaning chat; no code-instruction set is packaged here, so ShareGPT's code requests go
# first).
CODE = re.compile(r"```|\bdef |\bclass |\bimport |#include|console\.log|\bfunction\b|=>|"
                  r"\b(python|javascript|typescript|java|rust|golang|c\+\+|sql|html|css|bash|regex|"
                  r"react|node\.?js|django|flask|pandas|numpy|api|json|code|script|compile|bug|"
                  r"algorithm|leetcode)\b", re.IGNORECASE)


def is_code(messages):
    return bool(CODE.search(messages[0]["content"])) if messages[0]["role"] == "user" else False


def contains_eval(messages, prompts):
    for m in messages:
        if m["role"] != "user":
            continue
        text = normalise(m["content"])
        if any(p in text for p in prompts):
            return True
    return False


def main():
    p = argparse.ArgumentParser()
    p.add_argument("source")
    p.add_argument("--skip", type=int, default=0)
    p.add_argument("--count", type=int, required=True)
    p.add_argument("--exchanges", type=int, default=2)
    p.add_argument("--out", required=True)
    p.add_argument("--prompts-only", action="store_true",
                   help="replace assistant turns by '.' (the dump's --regenerate writes them "
                        "anew; the file then travels in a fraction of the size)")
    p.add_argument("--code-first", action="store_true",
                   help="write the conversations whose first user turn asks about code first, "
                        "then the others, up to --count")
    p.add_argument("--exclude", nargs="*", default=[],
                   help="evaluation sets whose prompts must not appear in a kept conversation "
                        "(data/mtbench/question.jsonl, data/humaneval/HumanEval.jsonl.gz)")
    a = p.parse_args()
    excluded = eval_prompts(a.exclude)
    seen = written = dropped = code = 0
    kept = []
    for record in records(a.source):
        messages = usable(record, a.exchanges)
        if messages is None:
            continue
        if excluded and contains_eval(messages, excluded):
            dropped += 1
            continue
        seen += 1
        if seen <= a.skip:
            continue
        kept.append((record.get("id"), messages))
        if not a.code_first and len(kept) == a.count:
            break
    if a.code_first:
        # A stable sort: code requests first, each group in the file's order.
        kept.sort(key=lambda item: not is_code(item[1]))
    with open(a.out + ".tmp", "w", encoding="utf-8") as f:
        for record_id, messages in kept[: a.count]:
            if a.prompts_only:
                for m in messages:
                    if m["role"] == "assistant":
                        m["content"] = "."
            f.write(json.dumps({"id": record_id, "messages": messages}) + "\n")
            written += 1
            code += is_code(messages)
    import os

    os.replace(a.out + ".tmp", a.out)
    print(f"{written} conversations after skipping {a.skip} usable ones -> {a.out} "
          f"({dropped} dropped for containing one of {len(excluded)} evaluation prompts; "
          f"{code} ask about code)")


if __name__ == "__main__":
    main()
