"""tools/sass_loops.py, which lists a kernel's wgmma loops from its SASS (docs/kernel-notes.md,
entry AH1): which backward branches are loops, what each holds, the out-of-line code it leaves
out (CPU)."""

from __future__ import annotations

import pytest

from conftest import load_tool

sl = load_tool("sass_loops")


def _listing(body: list[str], name: str = "_ZN6kdtree4sm9023verify_attn_kernel_sm90ILb1EEEvNS_6ParamsE") -> str:
    lines = [f"\t\tFunction : {name}"]
    lines += [f"        /*{16 * i:04x}*/                   {insn} ;" for i, insn in enumerate(body)]
    return "\n".join(lines) + "\n"


# addresses are 16 x the index
PROGRAM = [
    "S2R R0, SR_TID.X",                                              # 0x000
    "UMOV UR4, 0x400",                                               # 0x010
    "SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4], R2",                  # 0x020  loop: the wait
    "@!P0 BRA 0x150",                                                # 0x030  -> its retry
    "HGMMA.64x64x16.F32.BF16 R24, gdesc[UR8], RZ, !UPT",             # 0x040  SS
    "HGMMA.64x256x16.F32.BF16 R24, R152, gdesc[UR12].tnspB, R24",    # 0x050  RS
    "BRA.DIV UR5, 0x180",                                            # 0x060  -> the collective
    "SHFL.BFLY PT, R3, R4, 0x1, 0x1f",                               # 0x070
    "FMUL R5, R5, R6",                                               # 0x080
    "@P1 BRA 0xb0",                                                  # 0x090  an if
    "MUFU.EX2 R7, R7",                                               # 0x0a0
    "IADD3 R9, R9, 0x1, RZ",                                         # 0x0b0
    "ISETP.GE.AND P2, PT, R9, R10, PT",                              # 0x0c0
    "@!P2 BRA 0x20",                                                 # 0x0d0  the loop's back edge
    "EXIT",                                                          # 0x0e0
    "BRA 0xf0",                                                      # 0x0f0  nvcc's end-of-body self loop
    "NOP",                                                           # 0x100
    "UMOV UR6, 0x40",                                                # 0x110  an elect loop (a TMA issue)
    "ELECT P3, URZ, PT",                                             # 0x120
    "@P3 BRA.U.ANY 0x110",                                           # 0x130
    "EXIT",                                                          # 0x140
    "SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4], R2",                  # 0x150  the wait's retry
    "@!P0 BRA 0x150",                                                # 0x160
    "BRA 0x40",                                                      # 0x170  back after the wait
    "WARPSYNC.COLLECTIVE R4, 0x1b0",                                 # 0x180  the divergent shuffle's fallback
    "SHFL.BFLY P6, R3, R4, R33, R34",                                # 0x190
    "ENDCOLLECTIVE",                                                 # 0x1a0
    "BRA 0x70",                                                      # 0x1b0  back into the loop
]


def _insns():
    return sl.functions(_listing(PROGRAM))["_ZN6kdtree4sm9023verify_attn_kernel_sm90ILb1EEEvNS_6ParamsE"]


def test_parse_keeps_guard_opcode_and_operands():
    i = sl.parse("        /*00d0*/                   @!P2 BRA 0x20 ;   /* 0x0000 */")
    assert (i.addr, i.pred, i.op, i.operands, i.base) == (0xD0, "@!P2", "BRA", "0x20", "BRA")
    assert sl.parse("                                      /* 0x000fe20003800000 */") is None


def test_only_the_schedule_loop_is_found():
    insns = _insns()
    found = sl.loops(insns)
    # the retry (0x160 -> 0x150, 0x170 -> 0x40) and the collective (0x1b0 -> 0x70) jump back into
    # the loop, the elect loop holds no HGMMA: one loop, 0x20 .. 0xd0
    assert [(insns[lp.start].addr, insns[lp.end].addr) for lp in found] == [(0x20, 0xD0)]
    lp = found[0]
    assert lp.hgmma() == {("64x64x16", "SS"): 1, ("64x256x16", "RS"): 1}
    c = lp.classes()
    assert (c["SYNCS"], c["SHFL"], c["FMUL"], c["MUFU"]) == (1, 1, 1, 1)
    assert sl.innermost(found) == found


def test_any_adds_long_loops_without_hgmma_but_not_elect_loops(monkeypatch):
    insns = _insns()
    monkeypatch.setattr(sl, "ANY_MIN", 3)
    found = sl.loops(insns, any_loop=True)
    spans = [(insns[lp.start].addr, insns[lp.end].addr) for lp in found]
    assert spans == [(0x20, 0xD0), (0x110, 0x130)]  # the 3-instruction elect loop at ANY_MIN 3
    monkeypatch.setattr(sl, "ANY_MIN", 30)
    assert [(insns[lp.start].addr, insns[lp.end].addr) for lp in sl.loops(insns, any_loop=True)] == [(0x20, 0xD0)]


def test_blocks_split_at_branches_and_targets():
    lp = sl.loops(_insns())[0]
    starts = [b[0].addr for b in sl.blocks(lp)]
    # after each branch (0x30, 0x60, 0x90) and before the if's target 0xb0
    assert starts == [0x20, 0x40, 0x70, 0xA0, 0xB0]
    assert sum(len(b) for b in sl.blocks(lp)) == lp.end - lp.start + 1


def test_outer_loops_are_marked(capsys):
    # a second backward branch around the first makes it the inner one
    body = PROGRAM[:14] + ["@P4 BRA 0x10"] + PROGRAM[15:]
    insns = sl.functions(_listing(body))["_ZN6kdtree4sm9023verify_attn_kernel_sm90ILb1EEEvNS_6ParamsE"]
    found = sl.loops(insns)
    assert [(insns[lp.start].addr, insns[lp.end].addr) for lp in found] == [(0x10, 0xE0), (0x20, 0xD0)]
    assert [insns[lp.start].addr for lp in sl.innermost(found)] == [0x20]
    text = sl.report("k", insns, show_blocks=True)
    assert "0x10-0xe0 (outer)" in text and "| 0x20-0xd0 |" in text and "blocks of 0x20-0xd0" in text


def test_pick_wants_exactly_one_function():
    funcs = sl.functions(_listing(PROGRAM) + _listing(["EXIT"], name="_ZN6kdtree11plan_kernelENS_6ParamsE"))
    assert sl.pick(funcs, "sm90")[0].endswith("ParamsE")
    with pytest.raises(ValueError, match="matches 2 functions"):
        sl.pick(funcs, "kdtree")
    with pytest.raises(ValueError, match="matches 0 functions"):
        sl.pick(funcs, "flash_fwd")


def test_main_reads_a_saved_listing(tmp_path, capsys):
    f = tmp_path / "k.sass"
    f.write_text(_listing(PROGRAM))
    assert sl.main(["--sass", str(f), "--kernel", "sm90"]) == 0
    out = capsys.readouterr().out
    assert "1 loops with HGMMA (1 innermost)" in out
    assert "| 0x20-0xd0 | 12 | 1 x 64x256x16 RS, 1 x 64x64x16 SS |" in out
    assert sl.main(["--sass", str(f), "--kernel", "nothing-like-it"]) == 2
    assert "matches 0 functions" in capsys.readouterr().err
