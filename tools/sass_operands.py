"""How far ahead the portable kernel's ldmatrix loads run, read from its SASS (no GPU).

    PYTHONPATH=src python3 tools/sass_operands.py build/lib/libkdtree_verify.so [--arch sm_120]

The tile's S loop issues 72 HMMA.16816 per key tile (18 k-steps x 4 n8 tiles) and its PV
loop 64; each HMMA's B operand is a register pair that an ldmatrix filled. The source keeps
two B buffers of two pairs each in S (ldmatrix.x4) and three in PV, so that a load runs a
few HMMAs ahead of its use; when ptxas is short of registers it may fold them into one or
two pairs, and every HMMA then waits on the load just before it (docs/kernel-notes.md,
entry J6). This prints, for the first key tile's HMMAs in code order, how many distinct B
pairs each loop uses and the most used ones. Needs cuobjdump (the build extra; found as the build finds it).
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


def hmma_b_operands(sass: str) -> list[str]:
    """The B operand of each HMMA of the portable kernel, in code order."""
    inside, b = False, []
    for line in sass.splitlines():
        if "Function :" in line:
            inside = KERNEL in line
        elif inside and (m := re.match(r"\s+/\*[0-9a-f]+\*/\s+(.*?);", line)) and "HMMA" in m.group(1):
            b.append(re.split(r",\s*", m.group(1))[2])
    return b


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
    for name, ops in (("S", b[:S_HMMAS]), ("PV", b[S_HMMAS:S_HMMAS + PV_HMMAS])):
        c = collections.Counter(ops)
        print(f"{args.arch} {name}: {len(ops)} HMMAs, {len(c)} distinct B pairs, most used {c.most_common(3)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
