"""tools/ncu_sm90_waits.py, which says where the Hopper kernel's warps wait from an Nsight Compute
source page (docs/kernel-notes.md, entry AE6): roles, named mbarrier waits, refusals (CPU)."""

from __future__ import annotations

import csv
import io

import pytest

from conftest import load_tool

w = load_tool("ncu_sm90_waits")

HDR = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed"]
FULL0 = w.BAR_OFF  # full(0, 0-3)
EMPTY047 = w.BAR_OFF + 48 + 8  # empty(0, 4-7)
HAND1 = w.BAR_OFF + 96 + 8
# (source, samples): the prologue, the math warpgroups, then the producer
PROGRAM = [
    ("LDC R1, c[0x0][0x28]", 3),
    ("BAR.SYNC.DEFER_BLOCKING 0x0", 1),
    ("UMOV UR7, 0x400", 6),  # a stall after the barrier is the barrier's
    ("USETMAXREG.TRY_ALLOC.CTAPOOL UP0, 0xe0", 0),
    (f"SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR29+{hex(FULL0)}], R12", 2),
    ("@!P0  BRA 0x7f00", 18),
    ("FENCE.VIEW.ASYNC.S", 4),
    ("WARPGROUP.ARRIVE", 1),
    ("HGMMA.64x64x16.F32.BF16 R152, gdesc[UR24], R152", 9),
    ("WARPGROUP.DEPBAR.LE gsb0, 0x0", 12),
    (f"SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [R2+UR7+{hex(HAND1)}], R17", 1),
    ("@!P0  BRA 0x7f10", 4),
    ("USETMAXREG.DEALLOC.CTAPOOL 0x38", 0),
    (f"SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [R26+URZ+{hex(EMPTY047)}], R49", 0),
    ("@!P0  BRA 0x7f20", 20),
    ("PLOP3.LUT P0, PT, P0, P1, PT, 0xa2, 0x0", 4),  # the prefetch loop's top: BRA.U.ANY's target
    ("@P1   R2UR P0, UR30, R4", 5),
    ("UBLKPF.L2 [UR30], UR28", 2),
    ("@P1   BRA.U.ANY LOOP", 3),
    ("LDGSTS.E.BYPASS.128 [R2], desc[UR4][R4.64]", 9),
]


def page(program=PROGRAM) -> str:
    buf = io.StringIO()
    out = csv.writer(buf)
    out.writerow(["Kernel Name", "void kdtree::sm90::verify_attn_kernel_sm90<(bool)1>(...)"])
    out.writerow(HDR)
    top = next(i for i, (src, _) in enumerate(program) if src.startswith("PLOP3"))
    for i, (src, n) in enumerate(program):
        out.writerow([hex(0x1000 + 16 * i), src.replace("LOOP", hex(0x1000 + 16 * top)), n, 1])
    return buf.getvalue()


def test_waits_are_named_by_the_layout_and_roles_cut_at_setmaxnreg(tmp_path):
    f = tmp_path / "page.csv"
    f.write_text(page())
    a = w.analyse(w.read_source(str(f))[1])
    assert a["total"] == 104
    assert (a["roles"]["prologue"], a["roles"]["math"], a["roles"]["producer"]) == (10, 51, 43)
    waits = {name.split(" [")[0]: n for (_, name), n in a["waits"].items()}
    # the wait and its retry branch; a math wait names the product behind it (the hand wait has none)
    assert waits == {"full(0, 0-3) before S": 20, "hand(1)": 5, "empty(0, 4-7)": 20}
    assert [r for (r, _) in a["waits"]] == ["math", "math", "producer"]
    assert a["kinds"]["wgmma wait (WARPGROUP.DEPBAR)"] == 12
    assert a["kinds"]["proxy fence (FENCE.VIEW.ASYNC, MEMBAR)"] == 4
    assert a["kinds"]["prologue: __syncthreads and the instruction after it"] == 7
    assert a["kinds"]["producer: L2 prefetch loop (UBLKPF)"] == 14  # PLOP3 .. BRA.U.ANY, not the LDGSTS
    assert "| math: wait on full(0, 0-3) before S [UR29+0x36400] | 20 | 19.2% |" in w.table("x", a)


def test_the_producer_may_come_first(tmp_path):
    """ptxas may place either role's code first: the cut follows the markers, not their order."""
    prod = PROGRAM[12:]
    math = PROGRAM[3:12]
    f = tmp_path / "page.csv"
    f.write_text(page(PROGRAM[:3] + prod + math))
    a = w.analyse(w.read_source(str(f))[1])
    assert (a["roles"]["math"], a["roles"]["producer"]) == (51, 43)


def test_pages_it_cannot_read_are_refused(tmp_path):
    f = tmp_path / "page.csv"
    f.write_text(page([s for s in PROGRAM if "DEALLOC" not in s[0]]))
    with pytest.raises(ValueError, match="USETMAXREG"):
        w.analyse(w.read_source(str(f))[1])
    g = tmp_path / "other.csv"
    g.write_text("a,b\n1,2\n")
    with pytest.raises(ValueError, match="not an ncu source page"):
        w.read_source(str(g))
    assert w.main([str(g)]) == 2
