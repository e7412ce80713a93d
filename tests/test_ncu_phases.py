"""tools/ncu_phases.py, which cuts the portable kernel's key loop into phases from an
Nsight Compute source page (docs/kernel-notes.md, session H): landmarks, shares, refusals (CPU)."""

from __future__ import annotations

import csv
import io

import pytest

from conftest import load_tool

npz = load_tool("ncu_phases")

HDR = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed", "stall_wait",
       "stall_short_sb", "stall_wait (Not Issued)"]
# (source, samples, executed, wait, short_sb): a prologue, then one tile executed 100 times
PROGRAM = [
    ("LDC R1, c[0x0][0x28]", 4, 1, 4, 0),
    ("BAR.SYNC.DEFER_BLOCKING 0x0", 10, 100, 10, 0),  # the tile's __syncthreads
    ("LDGSTS.E.BYPASS.128 [R2], desc[UR4][R4.64]", 6, 100, 6, 0),
    ("LDSM.16.M88.2 R8, [R9]", 2, 100, 0, 2),
    ("HMMA.16816.F32.BF16 R12, R16, R8, R12", 30, 100, 20, 10),
    ("HMMA.16816.F32.BF16 R12, R20, R8, R12", 10, 100, 10, 0),
    ("BAR.SYNC.DEFER_BLOCKING 0x1, 0x40", 8, 100, 8, 0),  # the partner exchange
    ("MUFU.EX2 R3, R3", 10, 100, 10, 0),
    ("LDSM.16.MT88.4 R24, [R9]", 5, 100, 0, 5),
    ("HMMA.16816.F32.BF16 R28, R32, R24, R28", 15, 100, 0, 15),
    ("STG.E.64 desc[UR4][R6.64], R28", 0, 1, 0, 0),
]


def rows(program=PROGRAM):
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(["Kernel Name", "verify_attn_kernel_mma_qreg"])
    w.writerow(HDR)
    for i, (src, smp, ex, wt, sb) in enumerate(program):
        w.writerow([hex(i * 16), src, smp, ex, wt, sb, 0])
    return buf.getvalue()


def test_phases_are_cut_at_the_landmarks(tmp_path):
    f = tmp_path / "page.csv"
    f.write_text(rows())
    out = {p["phase"]: p for p in npz.summarize(npz.read(str(f)))}
    assert out["S"]["hmma_per_warp_tile"] == 2 and out["PV"]["hmma_per_warp_tile"] == 1
    assert out["S"]["samples_pct"] == pytest.approx(40.0)  # 40 of 100 samples
    assert out["loop top + loader"]["instr_per_warp_tile"] == pytest.approx(3.0)  # BAR, LDGSTS, LDSM
    assert out["exchange + softmax"]["instr_per_warp_tile"] == pytest.approx(2.0)
    assert out["prologue"]["instr_per_warp_tile"] == pytest.approx(0.01)
    assert out["S"]["stalls"][0] == ("wait", pytest.approx(75.0))  # 30 of 40 (Not Issued columns ignored)
    assert sum(p["samples_pct"] for p in out.values()) == pytest.approx(100.0)


def test_a_page_without_the_landmarks_is_refused(tmp_path):
    f = tmp_path / "page.csv"
    f.write_text(rows([s for s in PROGRAM if "MT88" not in s[0]]))
    with pytest.raises(ValueError, match="landmarks"):
        npz.summarize(npz.read(str(f)))


# The tile with a producer warpgroup (entry N1): the math warps' loop starts at their wait on the
# stage's full mbarrier; the producer's loop (4 warps, half the math warps' count) is a phase of
# its own, wherever ptxas put it: after the math warps' code (sm_90a) or before it (sm_120a).
MATH = [
    ("SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [R1+URZ+0x16000], R2", 10, 100, 10, 0),  # wait on full
    ("LDSM.16.M88.4 R8, [R9]", 2, 100, 0, 2),
    ("HMMA.16816.F32.BF16 R12, R16, R8, R12", 30, 100, 20, 10),
    ("HMMA.16816.F32.BF16 R12, R20, R8, R12", 10, 100, 10, 0),
    ("BAR.SYNC.DEFER_BLOCKING 0x1, 0x40", 8, 100, 8, 0),
    ("MUFU.EX2 R3, R3", 10, 100, 10, 0),
    ("LDSM.16.MT88.4 R24, [R9]", 5, 100, 0, 5),
    ("HMMA.16816.F32.BF16 R28, R32, R24, R28", 15, 100, 0, 15),
    ("STG.E.64 desc[UR4][R6.64], R28", 0, 1, 0, 0),
    ("EXIT", 0, 1, 0, 0),
]
PRODUCER = [
    ("USETMAXREG.DEALLOC.CTAPOOL 0x18", 1, 1, 1, 0),
    ("SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [UR26+0x16010], R4", 3, 50, 3, 0),  # wait on empty
    ("LDGSTS.E.BYPASS.128 [R2], desc[UR4][R4.64]", 6, 50, 6, 0),
    ("LDGSTS.E.BYPASS.128 [R2+0x10], desc[UR4][R4.64+0x10]", 4, 50, 4, 0),
    ("EXIT", 0, 1, 0, 0),
]
PROLOGUE = [("LDC R1, c[0x0][0x28]", 4, 1, 4, 0)]
TRY_ALLOC = [("USETMAXREG.TRY_ALLOC.CTAPOOL UP0, 0xf0", 1, 1, 1, 0)]


@pytest.mark.parametrize("program", [PROLOGUE + TRY_ALLOC + MATH + PRODUCER, PROLOGUE + PRODUCER + TRY_ALLOC + MATH],
                         ids=["producer-after", "producer-before"])
def test_the_producer_warpgroup_is_a_phase_and_the_loop_starts_at_the_full_wait(tmp_path, program):
    f = tmp_path / "page.csv"
    f.write_text(rows(program))
    out = {p["phase"]: p for p in npz.summarize(npz.read(str(f)))}
    assert out["loop top + loader"]["instr_per_warp_tile"] == pytest.approx(2.0)  # the wait, one LDSM
    assert out["S"]["hmma_per_warp_tile"] == 2 and out["PV"]["hmma_per_warp_tile"] == 1
    prod = out["producer"]
    assert prod["instr_per_warp_tile"] == pytest.approx(152 / 50)  # per producer warp and tile
    assert prod["samples_pct"] == pytest.approx(100.0 * 14 / 109)
    assert prod["stalls"][0][0] == "wait"
    assert out["prologue"]["samples_pct"] == pytest.approx(100.0 * 5 / 109)  # LDC and TRY_ALLOC only
    assert sum(p["samples_pct"] for p in out.values()) == pytest.approx(100.0)


def test_a_producer_block_around_the_key_loop_is_refused(tmp_path):
    f = tmp_path / "page.csv"
    f.write_text(rows(PROLOGUE + PRODUCER[:1] + MATH + TRY_ALLOC))
    with pytest.raises(ValueError, match="encloses the key loop"):
        npz.summarize(npz.read(str(f)))


def test_a_busy_wait_retry_loop_does_not_set_the_tile_count(tmp_path):
    """The mbarrier wait's retry (ptxas puts it out of line, at the end) runs once per poll: a page
    whose busiest instruction is that poll is still cut at the products (session O's GPU page was
    refused before this)."""
    retry = [("SYNCS.PHASECHK.TRANS64 P0, [R1+URZ+0x16000], R2", 40, 5000, 40, 0), ("BRA 0x100", 0, 5000, 0, 0)]
    f = tmp_path / "page.csv"
    f.write_text(rows(PROLOGUE + TRY_ALLOC + MATH + PRODUCER + retry))
    out = {p["phase"]: p for p in npz.summarize(npz.read(str(f)))}
    assert out["S"]["hmma_per_warp_tile"] == 2 and out["PV"]["hmma_per_warp_tile"] == 1
    assert out["loop top + loader"]["instr_per_warp_tile"] == pytest.approx(2.0)


def test_the_producers_wait_is_never_the_math_warps_loop_top(tmp_path):
    """With the producer's code placed before the math warps' (sm_120a), its wait on the empty
    mbarrier comes before the first product and runs as often: it is not taken for the loop top."""
    prod = [(s, smp, 100 if "PHASECHK" in s else ex, wt, sb) for s, smp, ex, wt, sb in PRODUCER]
    math = [m for m in MATH if "PHASECHK" not in m[0]]  # no loop top of the math warps' own
    f = tmp_path / "page.csv"
    f.write_text(rows(PROLOGUE + prod + TRY_ALLOC + math))
    with pytest.raises(ValueError, match="landmarks"):
        npz.summarize(npz.read(str(f)))


def test_outside_the_loop_groups_by_how_often_an_instruction_ran(tmp_path):
    """A prologue loop (6 iterations of each of 100 warps' copies) is one group, apart from the
    code run once per warp; nothing of the key loop is in the table."""
    loop = [("IMAD.HI R5, R14, 0x38e38e39, RZ", 5, 600, 5, 0), ("MUFU.RCP R16, R16", 7, 600, 7, 0),
            ("LDGSTS.E.BYPASS.128 [R15], desc[UR16][R12.64]", 3, 600, 0, 3)]
    f = tmp_path / "page.csv"
    f.write_text(rows(PROGRAM[:1] + loop + PROGRAM[1:]))
    out = npz.outside_loop(npz.read(str(f)))
    assert [(g["executed"], g["instructions"]) for g in out] == [(600, 3), (1, 2)]
    assert out[0]["samples_pct"] == pytest.approx(100.0 * 15 / 115)
    assert out[0]["stalls"][0] == ("wait", pytest.approx(100.0 * 12 / 15))
    assert out[1]["samples_pct"] == pytest.approx(100.0 * 4 / 115)  # LDC and the epilogue's STG
