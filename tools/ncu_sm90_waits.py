"""Where the Hopper kernel's warps wait, from an Nsight Compute source page.

    python3 tools/ncu_sm90_waits.py ncu-32-8-16-8192-sass.csv [more.csv ...]

Input: ``ncu --import R.ncu-rep --page source --csv --print-source sass`` of
``verify_attn_kernel_sm90`` (the ``ncu-stalls`` step of tools/gpu_session.sh with
``NCU_KERNEL=verify_attn_kernel_sm90`` writes it). The kernel's code is cut into its roles by
the ``USETMAXREG`` instructions the roles begin with (csrc/sm90_kernel.cuh: the math warpgroups'
``setmaxnreg.inc`` is ``USETMAXREG.TRY_ALLOC``, the producer's ``.dec`` is ``USETMAXREG.DEALLOC``):
everything before the first of them is the prologue every CTA pays once (PDL wait, the step
plan's job, setup_work, mbarrier init, Q's copies, the roles' barrier). Each mbarrier wait
(``SYNCS.PHASECHK...TRYWAIT`` and the branch that retries it) is named by its shared-memory
offset in the kernel's layout (``full``/``empty`` of buffer 0/1 and piece group 0-3, 4-7, 8;
``hand`` of warpgroup 0/1) and printed with its address expression: where that adds a register
(the warpgroup's or the producer half's buffer: one instruction serves both), the name is that
of buffer 0 or warpgroup 0's offset; a math warpgroup's wait says whether the first wgmma behind
it is an S (64x64) or a PV (64x256) product. The math warpgroups' wgmma waits (``WARPGROUP.DEPBAR``), their
wgmma issue (``HGMMA``, ``WARPGROUP.ARRIVE``) and proxy fences (``FENCE.VIEW.ASYNC``,
``MEMBAR``), and the producer's L2 prefetch (the uniform loop around ``UBLKPF``) are summed.
Shares are of all warp-state samples of the kernel. docs/kernel-notes.md (entry AE6) reads it.
"""

from __future__ import annotations

import argparse
import csv
import re
import sys
from collections import Counter

# csrc/sm90_kernel.cuh's layout: Q and two key buffers of 9 chunks of 64 x 128 B, the maxima and
# row sums (2 x 2 x 64 floats), then the mbarriers: full[2][3], empty[2][3], hand[2]
TILE = 9 * 64 * 128
BAR_OFF = 3 * TILE + 2 * 2 * 64 * 4
GROUPS = ("0-3", "4-7", "8")


def barrier_names() -> dict[int, str]:
    names = {}
    for kind, base in (("full", 0), ("empty", 48)):
        for buf in range(2):
            for g, grp in enumerate(GROUPS):
                names[BAR_OFF + base + 8 * (3 * buf + g)] = f"{kind}({buf}, {grp})"
    for w in range(2):
        names[BAR_OFF + 96 + 8 * w] = f"hand({w})"
    return names


def read_source(path: str) -> tuple[list[str], list[dict[str, str]]]:
    """The source page's header and its instruction rows (the kernel-name line before the
    header is skipped); a ValueError names a file that is not such a page."""
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    start = next((i for i, r in enumerate(rows) if r and r[0] == "Address"), None)
    if start is None or "Source" not in rows[start]:
        raise ValueError(f"{path}: no 'Address', 'Source' header: not an ncu source page (--page source --csv)")
    hdr = rows[start]
    if "Warp Stall Sampling (All Samples)" not in hdr:
        raise ValueError(f"{path}: no 'Warp Stall Sampling (All Samples)' column (profile with --set full)")
    return hdr, [dict(zip(hdr, r, strict=False)) for r in rows[start + 1:] if len(r) >= len(hdr)]


def samples(row: dict[str, str]) -> int:
    v = row.get("Warp Stall Sampling (All Samples)", "") or "0"
    return int(float(v))


def analyse(rows: list[dict[str, str]]) -> dict:
    """Samples by role and by the kernel's waits; see the module docstring."""
    src = [r["Source"] for r in rows]
    marks = {name: next((i for i, s in enumerate(src) if f"USETMAXREG.{name}" in s), None)
             for name in ("TRY_ALLOC", "DEALLOC")}
    if None in marks.values():
        raise ValueError("no USETMAXREG.TRY_ALLOC and USETMAXREG.DEALLOC: not verify_attn_kernel_sm90's code")
    first, second = sorted(marks.values())
    role_of = {marks["TRY_ALLOC"]: "math", marks["DEALLOC"]: "producer"}

    def role(i: int) -> str:
        return "prologue" if i < first else role_of[first] if i < second else role_of[second]

    total = sum(samples(r) for r in rows)
    by_role: Counter = Counter()
    waits: Counter = Counter()
    kinds: Counter = Counter()
    names = barrier_names()
    skip: set[int] = set()
    for i, (r, s) in enumerate(zip(rows, src, strict=True)):
        n = samples(r)
        by_role[role(i)] += n
        if i in skip:
            continue
        m = re.search(r"SYNCS\.PHASECHK\S*TRYWAIT\s+\S+,\s*\[([^\]]*)\]", s)
        if m:
            expr = m.group(1).strip()
            off = re.search(r"0x([0-9a-f]+)\s*$", expr)
            name = names.get(int(off.group(1), 16), f"mbarrier +{off.group(0)}") if off else expr
            # what the wait is for: the first wgmma behind it (64x64: S, 64x256: PV)
            nxt = next((g.group(1) for k in range(i + 1, min(i + 80, len(src)))
                        if (g := re.search(r"HGMMA\.(\d+x\d+)x16", src[k]))), None)
            what = {"64x64": " before S", "64x256": " before PV"}.get(nxt, "") if role(i) == "math" else ""
            name = f"{name}{what} [{expr}]"
            for k in range(i + 1, min(i + 4, len(rows))):  # the retry branch right behind it
                if "BRA" in src[k]:
                    n += samples(rows[k])
                    skip.add(k)
                    break
            waits[(role(i), name)] += n
            continue
        if role(i) == "math":
            for kind, pat in (("wgmma wait (WARPGROUP.DEPBAR)", "WARPGROUP.DEPBAR"), ("wgmma issue (HGMMA)", "HGMMA"),
                              ("wgmma fence (WARPGROUP.ARRIVE)", "WARPGROUP.ARRIVE"),
                              ("proxy fence (FENCE.VIEW.ASYNC, MEMBAR)", "FENCE.VIEW.ASYNC|MEMBAR")):
                if re.search(pat, s):
                    kinds[kind] += n
                    break
        elif role(i) == "prologue" and "BAR.SYNC" in s:
            kinds["prologue: __syncthreads and the instruction after it"] += n + (samples(rows[i + 1]) if i + 1 < len(rows) else 0)
            skip.add(i + 1)
    # the producer's L2 prefetch: the uniform loop around UBLKPF (its lanes' addresses one by one)
    # (the loop's body: from its branch's target to the branch, both included)
    pf = [i for i, s in enumerate(src) if "UBLKPF" in s]
    if pf:
        hi = next((k for k in range(pf[-1], min(pf[-1] + 6, len(src))) if "BRA.U.ANY" in src[k]), None)
        target = re.search(r"BRA\.U\.ANY\s+(0x[0-9a-f]+)", src[hi]) if hi is not None else None
        addr = {int(r["Address"], 16): i for i, r in enumerate(rows)}
        lo = addr.get(int(target.group(1), 16)) if target else None
        if lo is None or lo > pf[0]:
            lo, hi = pf[0], pf[-1]  # no loop around it: the prefetches alone
        kinds["producer: L2 prefetch loop (UBLKPF)"] = sum(samples(rows[k]) for k in range(lo, hi + 1))
    return {"total": total, "roles": by_role, "waits": waits, "kinds": kinds}


def table(name: str, a: dict) -> str:
    t = a["total"] or 1
    out = [f"### {name}: {a['total']} samples", "", "| where | samples | share |", "|---|---|---|"]
    for role in ("prologue", "math", "producer"):
        out.append(f"| {role} (all its code) | {a['roles'][role]} | {100 * a['roles'][role] / t:.1f}% |")
    for (role, bar), n in sorted(a["waits"].items(), key=lambda x: -x[1]):
        if n:
            out.append(f"| {role}: wait on {bar} | {n} | {100 * n / t:.1f}% |")
    for kind, n in sorted(a["kinds"].items(), key=lambda x: -x[1]):
        out.append(f"| {kind} | {n} | {100 * n / t:.1f}% |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("csv", nargs="+")
    args = ap.parse_args(argv)
    for path in args.csv:
        try:
            _, rows = read_source(path)
            print(table(path, analyse(rows)))
        except (OSError, ValueError) as e:
            print(f"ncu_sm90_waits: {e}", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
