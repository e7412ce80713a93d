"""Where the portable kernel's warps spend a key tile, from an Nsight Compute source page.

    python3 tools/ncu_phases.py ncu-1-64-8-23000-sass.csv [more.csv ...]

Input: ``ncu --import R.ncu-rep --page source --csv --print-source sass`` of
``verify_attn_kernel_mma_qreg`` (the ``ncu-stalls`` step of tools/gpu_session.sh writes it).
The key loop is cut into phases by its landmarks: the loop top (the tile's ``__syncthreads``,
``BAR.SYNC ... 0x0``, or, in the tile with a producer warpgroup, the math warps' wait on the
stage's full mbarrier, ``SYNCS.PHASECHK``: the last of these executed once per tile before the
first S product), the S products (HMMAs before the first transposed ldmatrix), and the PV
products (from the first ``LDSM...MT88`` to the last HMMA). The producer warpgroup's code
(from its ``USETMAXREG.DEALLOC`` to the math warps' ``USETMAXREG.TRY_ALLOC`` or to the end,
wherever ptxas put it) is a phase of its own, "producer". For each phase: its share of the
warp-state samples, its instructions executed per warp and tile (the producer's per producer
warp and tile), and its top stall reasons. docs/kernel-notes.md (sessions H and N) reads it.

A second table takes the code outside the key loop (the prologue and the epilogue: what each CTA
pays once, whatever its tile count) and groups its instructions by how often each ran, so that a
loop of the prologue shows as one group of its own (entry P2 found the sm_120 tile's Q staging
that way: 6 iterations per warp, 2.55% of the samples at bs1 N16 H8 91k).
"""

from __future__ import annotations

import argparse
import csv
import re
from collections import Counter

PHASES = ("prologue", "loop top + loader", "S", "exchange + softmax", "PV", "epilogue", "producer")


def opcode(src: str) -> str:
    return re.sub(r"^@!?U?P\w+\s+", "", src.strip()).split(" ")[0]


def phases(rows: list[dict]) -> dict[str, list[tuple[int, int]]]:
    """Index ranges [lo, hi] of each phase in the instruction list (the producer's, when the
    kernel has one, cut out of whichever phase ptxas placed it in)."""
    ex = [int(r["Instructions Executed"] or 0) for r in rows]
    src = [r["Source"] for r in rows]
    peak = tile_count(rows)
    dealloc = next((i for i, s in enumerate(src) if "USETMAXREG.DEALLOC" in s), None)
    p_end = None if dealloc is None else next(
        (i for i in range(dealloc + 1, len(src)) if "USETMAXREG.TRY_ALLOC" in src[i]), len(src))

    def producers(i: int) -> bool:
        return dealloc is not None and dealloc <= i < p_end

    if any(producers(i) and "HMMA" in src[i] and ex[i] for i in range(len(src))):
        raise ValueError("the producer's code (USETMAXREG.DEALLOC .. TRY_ALLOC) encloses the key loop")

    def hot(i: int) -> bool:
        return ex[i] >= peak // 2

    mt = [i for i, s in enumerate(src) if "MT88" in s and hot(i)]
    hm = [i for i, s in enumerate(src) if "HMMA" in s and hot(i)]
    first_hmma = hm[0] if hm else len(src)
    tops = [i for i, s in enumerate(src[:first_hmma])
            if hot(i) and not producers(i) and (("BAR.SYNC" in s and s.strip().endswith("0x0")) or "SYNCS.PHASECHK" in s)]
    if not tops or not mt:
        raise ValueError("landmarks not found: is this verify_attn_kernel_mma_qreg's SASS page?")
    top = tops[-1]
    s_h = [i for i in hm if top < i < mt[0]]
    pv_h = [i for i in hm if i > mt[0]]
    if not s_h or not pv_h:
        raise ValueError("no S or PV products between the landmarks")
    s0, s1, p0, p1 = s_h[0], s_h[-1], mt[0], pv_h[-1]
    out = {"prologue": [(0, top - 1)], "loop top + loader": [(top, s0 - 1)], "S": [(s0, s1)],
           "exchange + softmax": [(s1 + 1, p0 - 1)], "PV": [(p0, p1)], "epilogue": [(p1 + 1, len(rows) - 1)],
           "producer": []}
    if dealloc is not None:  # (no executed product lies in [dealloc, p_end): checked above)
        out["producer"] = [(dealloc, p_end - 1)]
        for name in PHASES[:-1]:  # cut [dealloc, p_end) out of the phase that holds it
            cut = []
            for lo, hi in out[name]:
                if hi < dealloc or lo >= p_end:
                    cut.append((lo, hi))
                else:
                    cut += [r for r in ((lo, dealloc - 1), (p_end, hi)) if r[0] <= r[1]]
            out[name] = cut
    return out


def tile_count(rows: list[dict]) -> int:
    """How often one instruction of the key loop runs: the products' count (once per math warp and
    tile). Not the page's busiest instruction: an mbarrier wait's retry loop runs once per poll."""
    peak = max((int(r["Instructions Executed"] or 0) for r in rows if "HMMA" in r["Source"]), default=0)
    if not peak:
        raise ValueError("no executed HMMA in the source page: is this verify_attn_kernel_mma_qreg's SASS page?")
    return peak


def _sample_sum(seg: list[dict]) -> float:
    return sum(float(r["Warp Stall Sampling (All Samples)"] or 0) for r in seg)


def _samples(seg: list[dict], stall_cols: list[str], top: int) -> tuple[float, list[tuple[str, float]]]:
    """A run of instructions' samples, and its ``top`` stall reasons as % of their samples."""
    stalls = Counter()
    for r in seg:
        for c in stall_cols:
            stalls[c[len("stall_"):]] += float(r[c] or 0)
    st = sum(stalls.values()) or 1.0
    return _sample_sum(seg), [(k, 100.0 * v / st) for k, v in stalls.most_common(top) if v]


def _columns(rows: list[dict]) -> tuple[list[str], float]:
    """The page's stall-reason columns (all samples, not the not-issued ones) and its total samples."""
    stall_cols = [c for c in rows[0] if c.startswith("stall_") and "Not Issued" not in c]
    return stall_cols, _sample_sum(rows) or 1.0


def summarize(rows: list[dict]) -> list[dict]:
    ranges = phases(rows)
    stall_cols, total = _columns(rows)
    per_tile = tile_count(rows)
    out = []
    for name in PHASES:
        if not ranges[name] and name == "producer":
            continue
        seg = [r for lo, hi in ranges[name] for r in rows[lo:hi + 1]]
        # the producer's warps run their own loop: its hottest instruction is once per producer warp and tile
        norm = max((int(r["Instructions Executed"] or 0) for r in seg), default=0) if name == "producer" else per_tile
        samples, stalls = _samples(seg, stall_cols, 3)
        ops = Counter()
        for r in seg:
            ops[opcode(r["Source"]).split(".")[0]] += int(r["Instructions Executed"] or 0)
        out.append({"phase": name, "samples_pct": 100.0 * samples / total,
                    "instr_per_warp_tile": sum(ops.values()) / (norm or 1),
                    "hmma_per_warp_tile": ops["HMMA"] / (norm or 1),
                    "stalls": stalls})
    return out


def outside_loop(rows: list[dict], top: int = 6) -> list[dict]:
    """The prologue's and the epilogue's instructions grouped by their executed count (0 left
    out), the ``top`` groups with the most samples: count, static instructions, share of all
    the page's samples, top stalls."""
    ranges = phases(rows)
    stall_cols, total = _columns(rows)
    groups: dict[int, list[dict]] = {}
    for name in ("prologue", "epilogue"):
        for lo, hi in ranges[name]:
            for r in rows[lo:hi + 1]:
                n = int(r["Instructions Executed"] or 0)
                if n:
                    groups.setdefault(n, []).append(r)
    out = []
    for n, seg in groups.items():
        samples, stalls = _samples(seg, stall_cols, 2)
        out.append({"executed": n, "instructions": len(seg), "samples_pct": 100.0 * samples / total,
                    "stalls": stalls})
    out.sort(key=lambda g: (-g["samples_pct"], g["executed"]))
    return out[:top]


def read(path: str) -> list[dict]:
    with open(path, newline="") as f:
        lines = list(csv.reader(f))
    hdr = next(i for i, r in enumerate(lines) if r and r[0] == "Address")  # a kernel-name line may precede it
    return [dict(zip(lines[hdr], r, strict=True)) for r in lines[hdr + 1:] if r]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("csv", nargs="+")
    args = ap.parse_args()
    for path in args.csv:
        print(f"--- {path}")
        print("| phase | samples % | instructions per warp and tile | HMMA | top stalls (% of the phase's samples) |")
        print("|---|---|---|---|---|")
        rows = read(path)
        for p in summarize(rows):
            st = ", ".join(f"{k} {v:.0f}" for k, v in p["stalls"])
            print(f"| {p['phase']} | {p['samples_pct']:.1f} | {p['instr_per_warp_tile']:.0f} | "
                  f"{p['hmma_per_warp_tile']:.0f} | {st} |")
        print()
        print("Outside the key loop (prologue and epilogue), instructions grouped by how often each ran:")
        print()
        print("| times executed | instructions | samples % | top stalls (% of the group's samples) |")
        print("|---|---|---|---|")
        for g in outside_loop(rows):
            st = ", ".join(f"{k} {v:.0f}" for k, v in g["stalls"])
            print(f"| {g['executed']} | {g['instructions']} | {g['samples_pct']:.2f} | {st} |")


if __name__ == "__main__":
    main()
