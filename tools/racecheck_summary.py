"""A few lines per compute-sanitizer racecheck report (`--racecheck-report all` or `hazard`):
its summary line, the analysis records (which two source lines race, how many hazards), and the
hazard records grouped by type and by the two accesses, in the order racecheck saw them, with
the warpgroup (thread index // 128) of each thread.

    python3 tools/racecheck_summary.py /tmp/bench/racecheck-*.txt

A RAW group "Write a.cu:10 (wg 1) -> Read a.cu:20 (wg 0)" says that racecheck saw warpgroup 1's
write first and then warpgroup 0's read without an ordering it knows of; WAR is the reverse
(the read first, the write second). Used by tools/gpu_session.sh, step racecheck (issue 16).
"""

from __future__ import annotations

import re
import sys
from collections import Counter
from pathlib import Path

_PREFIX = re.compile(r"^=+\s?")
_SUMMARY = re.compile(r"RACECHECK SUMMARY:.*")
_HAZARD = re.compile(r"(?i:(error|warning|info)): Potential (RAW|WAR|WAW) hazard detected at __shared__ (0x[0-9a-f]+)"
                     r" in block \((\d+),(\d+),(\d+)\)")
_THREAD = re.compile(r"^(Read|Write) Thread \((\d+),(\d+),(\d+)\)")
_RACE = re.compile(r"(?i:(error|warning|info)): Race reported between (Read|Write) access at (.*)")
_AND = re.compile(r"^and (Read|Write) access at (.*?)(?: \[(\d+) hazards?\])?$")
_SRC = re.compile(r"([\w.\-/]+\.(?:cu|cuh|h|hpp|cc|cpp)):(\d+)")
_PC = re.compile(r"(?:\+|at )(0x[0-9a-f]+)")


def _where(text: str) -> str:
    """The source line of an access (file:line), else its offset in the kernel."""
    m = _SRC.search(text)
    if m:
        return f"{Path(m.group(1)).name}:{m.group(2)}"
    m = _PC.search(text)
    return f"+{m.group(1)}" if m else text.strip()


def summarize(text: str, most: int = 12) -> list[str]:
    lines = [_PREFIX.sub("", ln).strip() for ln in text.splitlines()]
    out: list[str] = []
    summary = [m.group(0) for ln in lines if (m := _SUMMARY.search(ln))]
    out.append(summary[-1] if summary else "no RACECHECK SUMMARY line (the run did not finish?)")
    races: list[str] = []
    hazards: Counter[tuple] = Counter()
    blocks: dict[tuple, set] = {}
    for i, ln in enumerate(lines):
        m = _RACE.search(ln)
        if m and i + 1 < len(lines):
            a = _AND.search(lines[i + 1])
            if a:
                n = f" [{a.group(3)} hazards]" if a.group(3) else ""
                races.append(f"race ({m.group(1).upper()}): {m.group(2)} {_where(m.group(3))} / "
                             f"{a.group(1)} {_where(a.group(2))}{n}")
            continue
        m = _HAZARD.search(ln)
        if m:
            acc = []
            for nxt in lines[i + 1:i + 4]:
                t = _THREAD.search(nxt)
                if t:
                    acc.append(f"{t.group(1)} {_where(nxt)} (wg {int(t.group(2)) // 128})")
                if len(acc) == 2:
                    break
            if len(acc) == 2:
                key = (m.group(1).upper(), m.group(2), acc[0], acc[1])
                hazards[key] += 1
                blocks.setdefault(key, set()).add(f"({m.group(4)},{m.group(5)},{m.group(6)})")
    for r in sorted(set(races), key=races.index):
        out.append("  " + r)
    for (sev, kind, first, second), n in hazards.most_common(most):
        b = blocks[(sev, kind, first, second)]
        out.append(f"  hazard {kind} ({sev}) x{n}: {first} -> {second}; blocks {len(b)}: "
                   + " ".join(sorted(b)[:4]) + (" ..." if len(b) > 4 else ""))
    if len(hazards) > most:
        out.append(f"  ... {len(hazards) - most} more hazard groups")
    return out


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: python3 tools/racecheck_summary.py REPORT...", file=sys.stderr)
        return 2
    for name in argv:
        p = Path(name)
        text = p.read_text(errors="replace") if p.is_file() else ""
        print(f"{p.name}:")
        for ln in summarize(text) if text else ["(no such file or empty)"]:
            print("  " + ln)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
