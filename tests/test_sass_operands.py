"""tools/sass_operands.py, which reads how far ahead the portable kernel's ldmatrix loads run
from its SASS (docs/kernel-notes.md, entries J6 and M2): B pairs and load distances (CPU)."""

from __future__ import annotations

from conftest import load_tool

so = load_tool("sass_operands")


def _listing(body: list[str], kernel: str = so.KERNEL) -> str:
    lines = [f"\t\tFunction : _ZN6kdtree{len(kernel)}{kernel}ENS_6ParamsE"]
    lines += [f"        /*{16 * i:04x}*/                   {insn} ;" for i, insn in enumerate(body)]
    return "\n".join(lines) + "\n"


# two HMMAs fed by an ldmatrix.x4 three instructions earlier (R8-R11: B pairs R8 and R10),
# then one whose B pair was loaded by the instruction just before it
PROGRAM = [
    "LDSM.16.M88.4 R8, [R2]",
    "IADD3 R3, R2, 0x10, RZ",
    "MOV R4, R5",
    "HMMA.16816.F32.BF16 R20, R12, R8, R20",
    "HMMA.16816.F32.BF16 R24, R12, R10, R24",
    "@P0 LDSM.16.M88.2 R30, [R3]",
    "HMMA.16816.F32.BF16 R20, R14, R30, R20",
    "HMMA.16816.F32.BF16 R24, R14, R40, R24",  # R40: never written before
]


def test_b_operands_and_distances():
    sass = _listing(PROGRAM)
    assert so.hmma_b_operands(sass) == ["R8", "R10", "R30", "R40"]
    # the .x4 writes R8..R11, so R10's writer is the LDSM too; the guarded .x2 writes R30, R31
    assert so.load_distances(sass) == [3, 4, 1, None]


def test_an_hmma_accumulator_and_a_wide_load_count_as_writes():
    sass = _listing(["HMMA.16816.F32.BF16 R8, R12, R16, R8",   # writes R8..R11
                     "LDS.128 R16, [R2]",                       # writes R16..R19
                     "HMMA.16816.F32.BF16 R20, R12, R10, R20",
                     "HMMA.16816.F32.BF16 R24, R12, R18, R24"])
    assert so.load_distances(sass) == [None, 2, 2]


def test_other_functions_are_ignored():
    other = _listing(["LDSM.16.M88.2 R8, [R2]", "HMMA.16816.F32.BF16 R20, R12, R8, R20"], kernel="combine_narrow_kernel")
    assert so.hmma_b_operands(other) == [] and so.load_distances(other) == []
    both = other + _listing(["HMMA.16816.F32.BF16 R20, R12, R8, R20"])
    assert so.load_distances(both) == [None]  # the other function's write does not count


def test_summary():
    assert so._summary([3, 4, 1, None]) == "loads ahead: median 3, min 1 instructions; 1 HMMAs within 2 of their load"
    assert so._summary([None]) == "no B pair written before its HMMA"
