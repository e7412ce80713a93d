"""How far ahead the portable kernel's ldmatrix loads run, read from its SASS (no GPU).

    PYTHONPATH=src python3 tools/sass_operands.py build/lib/libkdtree_verify.so [--arch sm_120]

The tile's S loop issues 72 HMMA.16816 per key tile (18 k-steps x 4 n8 tiles) and its PV
loop 64; each HMMA's B operand is a register pair that an ldmatrix filled. The source keeps
two B buffers of two pairs each in S (ldmatrix.x4) and three in PV, so that a load runs a
few HMMAs ahead of its use; when ptxas is short of registers it may fold them into one or
two pairs, and every HMMA then waits on the load just before it (docs/kernel-notes.md,
entry J6). This prints, for the first key tile's HMMAs in code order, how many distinct B
pairs each loop uses and the most used ones, and how far ahead its loads run: for each HMMA,
the instructions since the one that last wrote its B pair (the S loop's median is 8-9 on
main's sm_90a build; a folded loop reads 1, docs/kernel-notes.md, session M). Needs cuobjdump
(the build extra; found as the build finds it).
"""

from __future__ import annotations

import argparse
import collections
import re
import sys
from pathlib import Path

from kdtree_engine.kernel.build import dump_sass

S_HMMAS, PV_HMMAS = 18 * 4, 32 * 2
KERNEL = "verify_attn_kernel_mma_qreg"


_INSN = re.compile(r"\s+/\*[0-9a-f]+\*/\s+(.*?);")
_REG = re.compile(r"R(\d+)")


def _kernel_insns(sass: str) -> list[str]:
    """The portable kernel's instructions (without their address), in code order."""
    inside, out = False, []
    for line in sass.splitlines():
        if "Function :" in line:
            inside = KERNEL in line
        elif inside and (m := _INSN.match(line)):
            out.append(m.group(1))
    return out


def _b_operand(insn: str) -> str | None:
    """An HMMA's B operand (its third), None for any other instruction."""
    return re.split(r",\s*", insn)[2] if "HMMA" in insn else None


def hmma_b_operands(sass: str) -> list[str]:
    """The B operand of each HMMA of the portable kernel, in code order."""
    return [b for insn in _kernel_insns(sass) if (b := _b_operand(insn)) is not None]


def _dest(insn: str) -> tuple[int, int] | None:
    """(first register, registers written) of an instruction that writes registers (a guard
    predicate dropped); an LDSM writes 1, 2 or 4 (.x1 / .2 / .4), an HMMA.16816 its 4
    accumulators, a .64 / .128 load 2 / 4, anything else its first operand's register."""
    parts = insn.split()
    if parts and parts[0].startswith("@"):
        parts = parts[1:]
    if len(parts) < 2:
        return None
    op, first = parts[0], parts[1].rstrip(",")
    m = _REG.fullmatch(first.split(".")[0])
    if not m:
        return None
    width = 1
    if op.startswith("LDSM"):
        width = 4 if op.endswith(".4") else 2 if op.endswith(".2") else 1
    elif op.startswith("HMMA"):
        width = 4
    elif op.startswith("LD"):
        width = 4 if ".128" in op else 2 if ".64" in op else 1
    return int(m.group(1)), width


def load_distances(sass: str) -> list[int | None]:
    """For each HMMA of the portable kernel in code order: how many instructions back the
    instruction that last wrote its B pair's first register sits (None: not written earlier
    in code order, e.g. loaded before a branch the listing puts later)."""
    last: dict[int, int] = {}
    out: list[int | None] = []
    for i, insn in enumerate(_kernel_insns(sass)):
        if (op := _b_operand(insn)) is not None:
            b = _REG.match(op)
            out.append(i - last[int(b.group(1))] if b and int(b.group(1)) in last else None)
        if d := _dest(insn):
            for r in range(d[0], d[0] + d[1]):
                last[r] = i
    return out


def _summary(dist: list[int | None]) -> str:
    known = sorted(x for x in dist if x is not None)
    if not known:
        return "no B pair written before its HMMA"
    return (f"loads ahead: median {known[len(known) // 2]}, min {known[0]} instructions; "
            f"{sum(x <= 2 for x in known)} HMMAs within 2 of their load")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    ap.add_argument("library", type=Path)
    ap.add_argument("--arch", default="sm_90a")
    args = ap.parse_args()
    sass = dump_sass(args.library, args.arch)
    if sass is None:
        print(f"sass_operands: no {args.arch} SASS from {args.library} (cuobjdump missing, or no such arch)", file=sys.stderr)
        return 2
    b = hmma_b_operands(sass)
    if len(b) < S_HMMAS + PV_HMMAS:
        print(f"sass_operands: {KERNEL} for {args.arch}: {len(b)} HMMAs, expected at least {S_HMMAS + PV_HMMAS}", file=sys.stderr)
        return 1
    dist = load_distances(sass)
    for name, lo, hi in (("S", 0, S_HMMAS), ("PV", S_HMMAS, S_HMMAS + PV_HMMAS)):
        c = collections.Counter(b[lo:hi])
        print(f"{args.arch} {name}: {hi - lo} HMMAs, {len(c)} distinct B pairs, most used {c.most_common(3)}; "
              f"{_summary(dist[lo:hi])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
