"""The loops of a kernel's SASS that issue wgmma, and what each holds (no GPU).

    PYTHONPATH=src python3 tools/sass_loops.py build/lib/libkdtree_verify.so --kernel 'verify_attn_kernel_sm90ILb1'
    PYTHONPATH=src python3 tools/sass_loops.py <site>/flash_mla/_C_legacy.abi3.so \\
        --kernel 'dense28flash_fwd_splitkv_mla_kernel.*bfloat16.*Li576' --blocks

`<site>` is where the bench's sgl-flash-mla wheel is unpacked (`.site/site.tar.xz`): the FlashMLA
binary the bench times, so its loops can be read beside ours without a FlashMLA build
(docs/flashmla-loop.md section 0 had read FlashMLA's source only). A loop is a backward branch
whose body holds an HGMMA; the out-of-line retry of an mbarrier wait (a short block after the
function's body that re-tests the barrier and branches back to the wait) and an `elect` loop
around a TMA issue are not loops of the schedule and are left out. For each loop: its address
range, static instructions, the HGMMAs by shape and where their A operand comes from (`RS`:
registers, `SS`: a shared-memory descriptor), and the counts of the instructions that cost
shared-memory bandwidth, synchronisation or the MUFU unit. Static counts: a loop that holds both
math warpgroups' branches (ours) counts both, where FlashMLA has one loop per warpgroup;
`--blocks` lists the basic blocks of each innermost loop (instructions, HGMMAs, waits, FMULs and
the block's last instruction) to follow one warpgroup's path by hand. Needs cuobjdump (found as
the build finds it), or `--sass FILE` with a saved `cuobjdump -sass` listing.
"""

from __future__ import annotations

import argparse
import collections
import re
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from kdtree_engine.kernel.build import dump_sass  # noqa: E402

_INSN = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_TARGET = re.compile(r"0x([0-9a-f]+)")
# a wait's retry: at most this many instructions, ending in a conditional backward branch
STUB_MAX = 12
# the opcode classes reported per loop, in this order
CLASSES = ("HGMMA", "LDS", "STS", "STSM", "LDSM", "LDG", "LDGSTS", "UTMALDG", "STG", "SYNCS", "BAR", "MUFU", "FMUL",
           "FFMA", "SHFL", "F2FP")


@dataclass(frozen=True)
class Insn:
    addr: int
    pred: str  # "" or the guard, e.g. "@!P0"
    op: str  # the full opcode, e.g. "HGMMA.64x64x16.F32.BF16"
    operands: str

    @property
    def base(self) -> str:
        return self.op.split(".")[0]


@dataclass
class Loop:
    start: int  # index of the first instruction (the branch target)
    end: int  # index of the backward branch
    insns: list[Insn]

    @property
    def body(self) -> list[Insn]:
        return self.insns[self.start:self.end + 1]

    def hgmma(self) -> collections.Counter:
        """(shape, A source) -> count; shape as 64x256x16, A source RS or SS."""
        c: collections.Counter = collections.Counter()
        for i in self.body:
            if i.base == "HGMMA":
                shape = i.op.split(".")[1]
                a = [x.strip() for x in i.operands.split(",")][1]
                c[(shape, "RS" if re.match(r"R\d+$", a) else "SS")] += 1
        return c

    def classes(self) -> collections.Counter:
        return collections.Counter(i.base for i in self.body)


def parse(line: str) -> Insn | None:
    m = _INSN.match(line)
    if not m:
        return None
    text = m.group(2)
    pred = ""
    if text.startswith("@"):
        pred, text = text.split(None, 1)
    op, _, operands = text.partition(" ")
    return Insn(int(m.group(1), 16), pred, op, operands.strip())


def functions(sass: str) -> dict[str, list[Insn]]:
    """Each function's instructions in code order, by mangled name."""
    out: dict[str, list[Insn]] = {}
    cur: list[Insn] | None = None
    for line in sass.splitlines():
        if "Function :" in line:
            cur = out.setdefault(line.split("Function :", 1)[1].strip(), [])
        elif cur is not None and (i := parse(line)):
            cur.append(i)
    return out


def pick(funcs: dict[str, list[Insn]], pattern: str) -> tuple[str, list[Insn]]:
    """The one function whose name matches ``pattern`` (a regex); ValueError on none or several."""
    hits = [n for n in funcs if re.search(pattern, n)]
    if len(hits) != 1:
        names = "\n  ".join(hits or list(funcs)[:20])
        raise ValueError(f"--kernel {pattern!r} matches {len(hits)} functions (want 1):\n  {names}")
    return hits[0], funcs[hits[0]]


def _branch_target(i: Insn) -> int | None:
    if i.base != "BRA":
        return None
    m = _TARGET.search(i.operands)
    return int(m.group(1), 16) if m else None


def _is_out_of_line(insns: list[Insn], k: int) -> bool:
    """Whether the backward branch at k ends out-of-line code: a run entered only by a jump (an
    unconditional branch or exit just before it) that tests an mbarrier, sleeps, or runs a shuffle
    for a divergent warp (`WARPSYNC.COLLECTIVE`, the target of a `BRA.DIV`), and holds no HGMMA;
    its branch back is unconditional, or the run is at most STUB_MAX instructions (a wait's
    retry). nvcc places these after the function's body; each jumps back to where it was called
    from, so its span is not a loop of the schedule."""
    waits, j = False, k
    while j >= 0:
        x = insns[j]
        if j < k and x.base in ("BRA", "EXIT", "RET") and not x.pred:
            break
        if x.base == "HGMMA":
            return False
        waits |= x.base in ("SYNCS", "NANOSLEEP", "WARPSYNC")
        j -= 1
    else:
        return False  # the function's first instructions: not entered by a jump
    return waits and (not insns[k].pred or k - j <= STUB_MAX)


# --any: a loop without HGMMA is reported from this many instructions (an elect loop around a TMA
# issue is 5-8)
ANY_MIN = 30


def loops(insns: list[Insn], any_loop: bool = False) -> list[Loop]:
    """The backward branches whose body holds an HGMMA (any_loop: or has at least ANY_MIN
    instructions, such as a producer's), without out-of-line code, by start address."""
    index = {i.addr: k for k, i in enumerate(insns)}
    found = []
    for k, i in enumerate(insns):
        t = _branch_target(i)
        if t is None or t >= i.addr or t not in index:
            continue
        if _is_out_of_line(insns, k):
            continue
        loop = Loop(index[t], k, insns)
        if any(x.base == "HGMMA" for x in loop.body) or (any_loop and k - index[t] + 1 >= ANY_MIN):
            found.append(loop)
    return sorted(found, key=lambda lp: (lp.start, -lp.end))


def innermost(found: list[Loop]) -> list[Loop]:
    return [a for a in found if not any(b is not a and a.start <= b.start and b.end <= a.end for b in found)]


def blocks(loop: Loop) -> list[list[Insn]]:
    """The loop's basic blocks: split after each branch or exit and before each branch target."""
    body = loop.body
    targets = {t for i in body if (t := _branch_target(i)) is not None}
    out: list[list[Insn]] = [[]]
    for i in body:
        if out[-1] and i.addr in targets:
            out.append([])
        out[-1].append(i)
        if i.base in ("BRA", "EXIT", "RET"):
            out.append([])
    return [b for b in out if b]


def _hgmma_text(c: collections.Counter) -> str:
    return ", ".join(f"{n} x {shape} {a}" for (shape, a), n in sorted(c.items()))


def report(name: str, insns: list[Insn], show_blocks: bool, any_loop: bool = False) -> str:
    found = loops(insns, any_loop)
    inner = innermost(found)
    lines = [f"{name}", f"{len(insns)} instructions, {sum(i.base == 'HGMMA' for i in insns)} HGMMA, "
             f"{len(found)} loops{'' if any_loop else ' with HGMMA'} ({len(inner)} innermost)", "",
             "| loop | instructions | HGMMA | " + " | ".join(CLASSES[1:]) + " |",
             "|---|---|---|" + "---|" * (len(CLASSES) - 1)]
    for lp in found:
        c = lp.classes()
        tag = "" if lp in inner else " (outer)"
        lines.append(f"| {insns[lp.start].addr:#x}-{insns[lp.end].addr:#x}{tag} | {lp.end - lp.start + 1} | "
                     f"{_hgmma_text(lp.hgmma())} | " + " | ".join(str(c[k]) for k in CLASSES[1:]) + " |")
    if show_blocks:
        for lp in inner:
            lines += ["", f"blocks of {insns[lp.start].addr:#x}-{insns[lp.end].addr:#x}:"]
            for b in blocks(lp):
                c = collections.Counter(i.base for i in b)
                marks = " ".join(f"{k} {c[k]}" for k in ("HGMMA", "SYNCS", "BAR", "FMUL", "MUFU", "LDS", "STS") if c[k])
                last = f"{b[-1].pred} {b[-1].op} {b[-1].operands}".strip()
                lines.append(f"  {b[0].addr:#07x} {len(b):4d}  {marks:44s} | {last[:70]}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    ap.add_argument("library", type=Path, nargs="?", help="a shared library or cubin (cuobjdump reads it)")
    ap.add_argument("--sass", type=Path, help="a saved `cuobjdump -sass` listing instead of a library")
    ap.add_argument("--arch", default="sm_90a")
    ap.add_argument("--kernel", required=True, help="a regex that matches one function's mangled name")
    ap.add_argument("--blocks", action="store_true", help="list the basic blocks of each innermost loop")
    ap.add_argument("--any", action="store_true",
                    help=f"also loops without HGMMA of at least {ANY_MIN} instructions (a producer's)")
    args = ap.parse_args(argv)
    if (args.library is None) == (args.sass is None):
        ap.error("give a library or --sass, not both")
    if args.sass:
        sass = args.sass.read_text()
    else:
        sass = dump_sass(args.library, args.arch)
        if sass is None:
            print(f"sass_loops: no {args.arch} SASS from {args.library} (cuobjdump missing, or no such arch)",
                  file=sys.stderr)
            return 2
    try:
        name, insns = pick(functions(sass), args.kernel)
    except ValueError as e:
        print(f"sass_loops: {e}", file=sys.stderr)
        return 2
    print(report(name, insns, args.blocks, args.any))
    return 0


if __name__ == "__main__":
    sys.exit(main())
