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


def row_class(rows):
    """The policy's batch classes (`batch_class` in policy.rs): 1, 2, 3-4, 5-8, .., 65+."""
    for upper, label in ((1, "1 row"), (2, "2 rows"), (4, "3-4 rows"), (8, "5-8 rows"),
                         (16, "9-16 rows"), (32, "17-32 rows"), (64, "33-64 rows")):
        if rows <= upper:
            return upper, label
    return 65, "65+ rows"


def drafted_against_plain(path):
    """Drafted rounds by batch class against the plain rounds that would have committed the
    same tokens: a round of `rows` rows committing `tokens` priced as tokens / rows plain rounds
    at the policy's plain price for that round (`predicted_plain_s`, the cost table as
    corrected by timed rounds). Positive: drafting cost more than plain rounds would have.
    Session 45 read run 1's logs this way: c=8's drafted rounds saved ~100 ms (1.75%), and the
    one-row drafted rounds that drain a c=64 load were not a loss."""
    with open(path) as f:
        records = [r for r in csv.DictReader(f) if r["kind"] != "admit"]
    total = sum(float(r["wall_s"]) for r in records)
    by_class = {}
    for r in records:
        plain = float(r["predicted_plain_s"])
        if r["choice"] == "none" or plain != plain:  # NaN: no price (not adaptive)
            continue
        rows = int(r["rows"])
        c = by_class.setdefault(row_class(rows), [0, 0, 0.0, 0.0])
        c[0] += 1
        c[1] += int(r["tokens"])
        c[2] += float(r["wall_s"])
        c[3] += int(r["tokens"]) / rows * plain
    if not by_class:
        return "  drafted rounds against plain ones: none"
    parts = [
        f"{label}: {n} rounds, {tokens} tokens, {1e3 * wall:.2f} ms, as plain {1e3 * plain:.2f} "
        f"ms ({1e3 * (wall - plain):+.2f} ms)"
        for (_, label), (n, tokens, wall, plain) in sorted(by_class.items())
    ]
    excess = sum(wall - plain for _, _, wall, plain in by_class.values())
    share = f", {100 * excess / total:+.1f}% of round time" if total > 0 else ""
    return (
        "  drafted rounds against plain ones (the policy's plain price for their tokens): "
        + "; ".join(parts)
        + f"; all: {1e3 * excess:+.2f} ms{share}"
    )


def median(values):
    values = sorted(values)
    if not values:
        return float("nan")
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else 0.5 * (values[mid - 1] + values[mid])


def detail(path):
    """Where a server's wall time goes beyond its rounds' and admissions' own clocks: plain
    rounds of the most frequent row count (median ms of each column and of the used target
    columns), admissions by row count (median wall, prefill, head part, set-up), and the time
    between one record's end and the next record's start while requests were in flight (the
    scheduler's delivery and queue handling; gaps over 20 ms are idle time between loads and
    are left out)."""
    with open(path) as f:
        records = list(csv.DictReader(f))
    lines = []
    plain = [r for r in records if r["kind"] != "admit" and r["choice"] == "none"]
    if plain:
        common = collections.Counter(int(r["rows"]) for r in plain).most_common(1)[0][0]
        at = [r for r in plain if int(r["rows"]) == common]
        cols = ("wall_s", "verify_s", "extend_s", "housekeeping_s")
        parts = ", ".join(
            f"{c[:-2]} {1e3 * median([float(r[c]) for r in at]):.4f}" for c in cols
        )
        lines.append(
            f"  {len(at)} plain rounds of {common} rows (median ms): {parts}, target columns "
            f"{median([int(r['target_columns']) for r in at]):.0f}"
        )
    admits = collections.defaultdict(list)
    for r in records:
        if r["kind"] == "admit":
            admits[int(r["rows"])].append(r)
    for rows in sorted(admits):
        a = admits[rows]
        cols = ("wall_s", "verify_s", "extend_s", "setup_s")
        parts = ", ".join(f"{c[:-2]} {1e3 * median([float(r[c]) for r in a]):.3f}" for c in cols)
        deferred = sum(r["choice"] == "deferred" for r in a)
        lines.append(f"  admissions of {rows}: {len(a)} ({deferred} deferred), median ms: {parts}")
    gaps = []
    for prev, nxt in zip(records, records[1:]):
        gap = float(nxt["at_s"]) - float(prev["at_s"]) - float(prev["wall_s"])
        if gap < 0.02:
            gaps.append(gap)
    if gaps:
        lines.append(
            f"  between records: {len(gaps)} gaps, total {sum(gaps):.3f} s, median "
            f"{1e6 * median(gaps):.1f} us"
        )
    return "\n".join(lines)


def main(root, labels):
    for label in labels:
        path = os.path.join(root, f"rounds_{label}.csv")
        try:
            print(f"{label}: {summarise(path)}")
            print(f"{label}: {plain_floor(path)}")
            print(detail(path))
            print(drafted_against_plain(path))
        except (OSError, KeyError, ValueError) as e:
            print(f"{label}: no round log ({e})")


if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2:])
