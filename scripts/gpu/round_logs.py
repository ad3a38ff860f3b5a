"""Where each server's time went, from its round log (`tandem serve --round-log`).

Usage: python3 round_logs.py RESULTS_DIR LABEL...   (reads RESULTS_DIR/rounds_LABEL.csv)

One line per server: its admissions (count, prompt tokens, wall seconds, the mean prefill of a
one-prompt admission), its rounds (count, tokens, wall seconds) and the rounds by choice. The
servers of one serve_pairs comparison took the same loads (a warm-up and the same repeats), so
the totals compare directly; session 34 read session 33's logs by hand this way and found the
c=32 gap in the admissions, not the rounds.
"""

import collections
import csv
import os
import sys


def summarise(path):
    admissions = rounds = 0
    admit_wall = round_wall = 0.0
    prompt_tokens = round_tokens = 0
    singles = []
    choices = collections.Counter()
    with open(path) as f:
        for r in csv.DictReader(f):
            wall = float(r["wall_s"])
            if r["kind"] == "admit":
                admissions += 1
                admit_wall += wall
                prompt_tokens += int(r["tokens"])
                if r["rows"] == "1":
                    singles.append(float(r["verify_s"]))
            else:
                rounds += 1
                round_wall += wall
                round_tokens += int(r["tokens"])
                choices[r["choice"]] += 1
    single = f"{1e3 * sum(singles) / len(singles):.2f} ms" if singles else "-"
    by_choice = ", ".join(f"{c} {n}" for c, n in sorted(choices.items()))
    return (
        f"admissions {admissions} ({prompt_tokens} prompt tokens, {admit_wall:.3f} s; one-prompt "
        f"prefill {single}), rounds {rounds} ({round_tokens} tokens, {round_wall:.3f} s): {by_choice}"
    )


def plain_floor(path):
    """Mean ms per plain round (choice `none`) with the batch at least 3/4 of the fullest
    plain round of the log: wall, the target step (verify column), what is queued after it
    (extend column: a head's deferred taps copy, when not queued before the wait) and
    housekeeping (retiring rows). Session 36 read run 3's logs by hand this way and found
    plain rounds of a server with a head ~3% dearer than target-only's."""
    rows = []
    with open(path) as f:
        for r in csv.DictReader(f):
            if r["kind"] != "admit" and r["choice"] == "none":
                rows.append(r)
    if not rows:
        return "no plain rounds"
    full = max(int(r["rows"]) for r in rows)
    rows = [r for r in rows if 4 * int(r["rows"]) >= 3 * full]

    def mean(column):
        return 1e3 * sum(float(r[column]) for r in rows) / len(rows)

    return (
        f"{len(rows)} plain rounds at >= 3/4 of {full} rows: wall {mean('wall_s'):.3f} ms, "
        f"target step {mean('verify_s'):.3f}, after it {mean('extend_s'):.3f}, "
        f"housekeeping {mean('housekeeping_s'):.3f}"
    )


def main(root, labels):
    for label in labels:
        path = os.path.join(root, f"rounds_{label}.csv")
        try:
            print(f"{label}: {summarise(path)}")
            print(f"{label}: {plain_floor(path)}")
        except (OSError, KeyError, ValueError) as e:
            print(f"{label}: no round log ({e})")


if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2:])
