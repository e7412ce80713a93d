"""How far ahead the portable kernel's ldmatrix loads run, read from its SASS (no GPU).

    python3 tools/sass_operands.py build/lib/libkdtree_verify.so [sm_90a|sm_120]

The tile's S loop issues 72 HMMA.16816 per key tile (18 k-steps x 4 n8 tiles) and its PV
loop 64; each HMMA's B operand is a register pair that an ldmatrix filled. The source keeps
four B buffers in S (three in PV) so that a load runs a few HMMAs ahead of its use; when
ptxas is short of registers it may fold them into one or two pairs, and every HMMA then
waits on the load just before it (docs/kernel-notes.md, entry J6). This prints, for the
first key tile's HMMAs in code order, how many distinct B pairs each loop uses and the
most used ones. Needs cuobjdump (the build extra).
"""

from __future__ import annotations

import collections
import re
import shutil
import subprocess
import sys

S_HMMAS, PV_HMMAS = 18 * 4, 32 * 2
KERNEL = "verify_attn_kernel_mma_qreg"


def hmma_b_operands(lib: str, arch: str) -> list[str]:
    out = subprocess.run(["cuobjdump", "-sass", "-arch", arch, lib], capture_output=True, text=True, check=True).stdout
    inside, b = False, []
    for line in out.splitlines():
        if "Function :" in line:
            inside = KERNEL in line
        elif inside and (m := re.match(r"\s+/\*[0-9a-f]+\*/\s+(.*?);", line)) and "HMMA" in m.group(1):
            b.append(re.split(r",\s*", m.group(1))[2])
    return b


def main() -> int:
    if len(sys.argv) < 2 or shutil.which("cuobjdump") is None:
        print(__doc__.strip().splitlines()[2] if len(sys.argv) < 2 else "sass_operands: cuobjdump not on PATH", file=sys.stderr)
        return 2
    arch = sys.argv[2] if len(sys.argv) > 2 else "sm_90a"
    b = hmma_b_operands(sys.argv[1], arch)
    if len(b) < S_HMMAS + PV_HMMAS:
        print(f"sass_operands: {KERNEL} for {arch}: {len(b)} HMMAs, expected at least {S_HMMAS + PV_HMMAS}", file=sys.stderr)
        return 1
    for name, ops in (("S", b[:S_HMMAS]), ("PV", b[S_HMMAS:S_HMMAS + PV_HMMAS])):
        c = collections.Counter(ops)
        print(f"{arch} {name}: {len(ops)} HMMAs, {len(c)} distinct B pairs, most used {c.most_common(3)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
