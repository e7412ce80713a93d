"""Tabulate a tools/ab_bench.py JSONL file: per case, each label's figures (one per process, in
the order they ran), the ratio of each label's mean to the first label's, and FlashMLA's figure
where a process timed it. With ``--sm120-ratio``, also ours-sm120 / ours per label (the sm_120
targets' ratio).

    python3 tools/ab_table.py docs/bench/2026-12-01-h200-q/ab-bench-j5-combine.jsonl base,c1,j5,c1j5
    python3 tools/ab_table.py FILE.jsonl base,variant --system ours-sm120 --sm120-ratio

A figure that a process could not take (status other than ok, e.g. a library of another ABI) is
shown as "-" and left out of the mean.
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


def figures(rows: list[dict]) -> tuple[list[str], dict[tuple[str, str, str], list[float]]]:
    """The cases in the order they first ran, and (case, system, label) -> the figures taken."""
    cases: list[str] = []
    got: dict[tuple[str, str, str], list[float]] = defaultdict(list)
    for r in rows:
        if r["case"] not in cases:
            cases.append(r["case"])
        if r.get("status") == "ok" and r.get("us") is not None:
            got[(r["case"], r["system"], r["label"])].append(float(r["us"]))
    return cases, got


def _mean(v: list[float]) -> float | None:
    return statistics.mean(v) if v else None


def table(rows: list[dict], labels: list[str], system: str = "ours") -> list[str]:
    """Markdown lines: case, each label's figures, FlashMLA, each later label's mean / the first's."""
    cases, got = figures(rows)
    out = ["| case | " + " | ".join(labels) + " | FlashMLA | " + " | ".join(f"{x} / {labels[0]}" for x in labels[1:]) + " |",
           "|---" * (2 * len(labels) + 1) + "|"]
    for c in cases:
        cells = [" / ".join(f"{x:.1f}" for x in got[(c, system, lab)]) or "-" for lab in labels]
        fm = [x for lab in labels for x in got[(c, "flashmla", lab)]]
        cells.append(f"{fm[0]:.1f}" if fm else "-")
        base = _mean(got[(c, system, labels[0])])
        for lab in labels[1:]:
            m = _mean(got[(c, system, lab)])
            cells.append(f"{m / base:.3f}" if m is not None and base else "-")
        out.append(f"| {c} | " + " | ".join(cells) + " |")
    return out


def sm120_ratios(rows: list[dict], labels: list[str]) -> list[str]:
    """Markdown lines: per case and label, mean(ours-sm120) / mean(ours)."""
    cases, got = figures(rows)
    out = ["| case | " + " | ".join(labels) + " |", "|---" * (len(labels) + 1) + "|"]
    for c in cases:
        cells = []
        for lab in labels:
            a, b = _mean(got[(c, "ours-sm120", lab)]), _mean(got[(c, "ours", lab)])
            cells.append(f"{a / b:.3f}" if a is not None and b else "-")
        out.append(f"| {c} | " + " | ".join(cells) + " |")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("jsonl", type=Path)
    ap.add_argument("labels", help="comma list of labels; the first is the baseline")
    ap.add_argument("--system", default="ours")
    ap.add_argument("--sm120-ratio", action="store_true", help="also ours-sm120 / ours per label")
    args = ap.parse_args(argv)
    labels = [x for x in args.labels.split(",") if x]
    rows = load(args.jsonl)
    known = {r["label"] for r in rows}
    unknown = [x for x in labels if x not in known]
    if not labels or unknown:
        print(f"labels: expected some of {', '.join(sorted(known))}, got {args.labels!r}", file=sys.stderr)
        return 2
    print("\n".join(table(rows, labels, args.system)))
    if args.sm120_ratio:
        print()
        print("\n".join(sm120_ratios(rows, labels)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
