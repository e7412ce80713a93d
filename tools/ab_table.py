"""Tabulate a tools/ab_bench.py JSONL file: per case, each label's figures (one per process, in
the order they ran), the ratio of each label's mean to the first label's, and FlashMLA's figure
where a process timed it. With ``--sm120-ratio``, also ours-sm120 / ours per label (the sm_120
targets' ratio).

    python3 tools/ab_table.py docs/bench/2026-12-01-h200-q/ab-bench-j5-combine.jsonl base,c1,j5,c1j5
    python3 tools/ab_table.py FILE.jsonl base,variant --system ours-sm120 --sm120-ratio

A figure that a process could not take (status other than ok, e.g. a library of another ABI) is
shown as "-" and left out of the mean. ``--any-status`` also takes figures whose output check
failed (status "wrong"): a timing-only diagnostic build (kernel-notes M8, T3) is wrong by design,
and its rows say so; the table then marks those figures with "*".

``--verdict PCT`` pairs each label's figures with the first label's round by round (the k-th
process of each label is round k, as `ab-bench` runs them) and calls a case a gain when every
round is at least PCT percent faster than the baseline's same round, a loss when every round is
at least PCT percent slower, else noise: a change that one round shows and another does not is
within a call's spread (kernel-notes Q1). It ends with each label's count of gains and losses.

    python3 tools/ab_table.py FILE.jsonl base,b16,b16p --verdict 1.5
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path


def load(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class Figure(float):
    """A time in us; ``wrong``: its call's output failed the check (taken with --any-status)."""

    wrong = False


def figures(rows: list[dict], any_status: bool = False) -> tuple[list[str], dict[tuple[str, str, str], list[float]]]:
    """The cases in the order they first ran, and (case, system, label) -> the figures taken
    (status ok; with ``any_status`` also "wrong", marked)."""
    cases: list[str] = []
    got: dict[tuple[str, str, str], list[float]] = defaultdict(list)
    for r in rows:
        if r["case"] not in cases:
            cases.append(r["case"])
        status = r.get("status")
        if r.get("us") is not None and (status == "ok" or (any_status and status == "wrong")):
            f = Figure(r["us"])
            f.wrong = status != "ok"
            got[(r["case"], r["system"], r["label"])].append(f)
    return cases, got


def _fmt(x: float) -> str:
    return f"{x:.1f}" + ("*" if getattr(x, "wrong", False) else "")


def _mean(v: list[float]) -> float | None:
    return statistics.mean(v) if v else None


def table(rows: list[dict], labels: list[str], system: str = "ours", any_status: bool = False) -> list[str]:
    """Markdown lines: case, each label's figures, FlashMLA, each later label's mean / the first's."""
    cases, got = figures(rows, any_status)
    out = ["| case | " + " | ".join(labels) + " | FlashMLA | " + " | ".join(f"{x} / {labels[0]}" for x in labels[1:]) + " |",
           "|---" * (2 * len(labels) + 1) + "|"]
    for c in cases:
        cells = [" / ".join(_fmt(x) for x in got[(c, system, lab)]) or "-" for lab in labels]
        fm = [x for lab in labels for x in got[(c, "flashmla", lab)]]
        cells.append(f"{fm[0]:.1f}" if fm else "-")
        base = _mean(got[(c, system, labels[0])])
        for lab in labels[1:]:
            m = _mean(got[(c, system, lab)])
            cells.append(f"{m / base:.3f}" if m is not None and base else "-")
        out.append(f"| {c} | " + " | ".join(cells) + " |")
    return out


def sm120_ratios(rows: list[dict], labels: list[str], any_status: bool = False) -> list[str]:
    """Markdown lines: per case and label, mean(ours-sm120) / mean(ours)."""
    cases, got = figures(rows, any_status)
    out = ["| case | " + " | ".join(labels) + " |", "|---" * (len(labels) + 1) + "|"]
    for c in cases:
        cells = []
        for lab in labels:
            a, b = _mean(got[(c, "ours-sm120", lab)]), _mean(got[(c, "ours", lab)])
            cells.append(f"{a / b:.3f}" if a is not None and b else "-")
        out.append(f"| {c} | " + " | ".join(cells) + " |")
    return out


def verdicts(rows: list[dict], labels: list[str], pct: float, system: str = "ours",
             any_status: bool = False) -> list[str]:
    """Markdown lines: per case and later label, the per-round change against the first label
    (percent) and gain / loss / noise, then one line per label with its counts."""
    cases, got = figures(rows, any_status)
    out = ["| case | " + " | ".join(f"{x} vs {labels[0]}, per round" for x in labels[1:]) + " |",
           "|---" * len(labels) + "|"]
    tally = {lab: {"gain": [], "loss": [], "noise": []} for lab in labels[1:]}
    for c in cases:
        base = got[(c, system, labels[0])]
        cells = []
        for lab in labels[1:]:
            var = got[(c, system, lab)]
            n = min(len(base), len(var))
            if n == 0:
                cells.append("-")
                continue
            change = [100.0 * (var[k] / base[k] - 1.0) for k in range(n)]
            kind = "gain" if all(x <= -pct for x in change) else "loss" if all(x >= pct for x in change) else "noise"
            tally[lab][kind].append(c)
            cells.append(" / ".join(f"{x:+.1f}%" for x in change) + f" {kind}")
        out.append(f"| {c} | " + " | ".join(cells) + " |")
    out.append("")
    for lab, t in tally.items():
        out.append(f"{lab}: {len(t['gain'])} gains ({', '.join(t['gain']) or 'none'}), {len(t['loss'])} losses "
                   f"({', '.join(t['loss']) or 'none'}), {len(t['noise'])} within {pct}% in some round ({system})")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("jsonl", type=Path)
    ap.add_argument("labels", help="comma list of labels; the first is the baseline")
    ap.add_argument("--system", default="ours")
    ap.add_argument("--sm120-ratio", action="store_true", help="also ours-sm120 / ours per label")
    ap.add_argument("--any-status", action="store_true",
                    help='also figures whose output check failed (status "wrong", marked *): diagnostic builds')
    ap.add_argument("--verdict", type=float, default=None, metavar="PCT",
                    help="per case: gain / loss when every round moves by at least PCT percent against the first label")
    args = ap.parse_args(argv)
    labels = [x for x in args.labels.split(",") if x]
    rows = load(args.jsonl)
    known = {r["label"] for r in rows}
    unknown = [x for x in labels if x not in known]
    if not labels or unknown:
        print(f"labels: expected some of {', '.join(sorted(known))}, got {args.labels!r}", file=sys.stderr)
        return 2
    print("\n".join(table(rows, labels, args.system, args.any_status)))
    if args.sm120_ratio:
        print()
        print("\n".join(sm120_ratios(rows, labels, args.any_status)))
    if args.verdict is not None:
        if not args.verdict > 0 or len(labels) < 2:
            print(f"--verdict: expected a percentage > 0 and at least two labels, got {args.verdict} and "
                  f"{len(labels)} label(s)", file=sys.stderr)
            return 2
        print()
        print("\n".join(verdicts(rows, labels, args.verdict, args.system, args.any_status)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
