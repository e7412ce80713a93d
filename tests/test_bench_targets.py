"""Target evaluation on synthetic timings: every pass/fail branch, other GPUs, missing peers."""

from __future__ import annotations

import pytest

from kdtree_pipeline.bench.gate import verdict
from kdtree_pipeline.bench.results import Result, Table
from kdtree_pipeline.bench.suites import SUITES, Case
from kdtree_pipeline.bench.targets import SPECS, evaluate, gate_passes

H200 = "NVIDIA H200"
LC = [Case(1, 16, 8, 23000), Case(1, 16, 8, 65536)]


def table(times: dict[tuple[str, str, str], float | str]) -> Table:
    """(case, system, mask) -> microseconds, or a status string for a failed figure."""
    rows = []
    for (c, s, m), v in times.items():
        if isinstance(v, str):
            rows.append(Result(c, s, m, v, error=f"{v} on purpose"))
        else:
            rows.append(Result(c, s, m, "ok", replay_us=float(v), eager_us=float(v) * 2))
    return Table(rows)


def good(cases=LC, ours=20.0, chain=19.0, ext=None, split=100.0, fm=18.0) -> dict:
    t = {}
    for c in cases:
        t[(c.name, "ours", "tree")] = ours
        t[(c.name, "ours", "chain")] = chain
        t[(c.name, "sglang-extend", "tree")] = ext if ext is not None else ours * 100
        t[(c.name, "sglang-splitkv", "chain")] = split
        t[(c.name, "flashmla", "chain")] = fm
    return t


FLOORS = {c.name: 10.0 for c in LC}
ALL = ("extend_50x", "splitkv", "flashmla", "tree_vs_chain", "floor_fraction")


def by_name(ts):
    return {t.name: t for t in ts}


def test_all_targets_pass_with_good_figures():
    ts = by_name(evaluate(ALL, LC, table(good()), FLOORS, H200))
    assert {t.status for t in ts.values()} == {"pass"}
    assert ts["extend_50x"].measured == pytest.approx(100.0)
    assert ts["floor_fraction"].measured == pytest.approx(0.5)
    assert ts["flashmla"].measured == pytest.approx(19 / 18)
    assert ts["flashmla"].goal_met is False  # 1.06 passes the 1.25 floor but misses the 1.0 goal
    assert gate_passes(list(ts.values()))


def test_extend_50x_fails_and_says_by_how_much():
    t = good()
    t[(LC[1].name, "sglang-extend", "tree")] = 20.0 * 40  # 40x at 64k
    tr = by_name(evaluate(("extend_50x",), LC, table(t), FLOORS, H200))["extend_50x"]
    assert tr.status == "fail" and tr.worst_case == LC[1].name
    assert tr.measured == pytest.approx(40.0)
    assert "1.25" in tr.miss  # a factor 50/40 short
    assert "FAIL" in tr.summary()


def test_micro_targets_cover_the_nohint_cases():
    """Issue 16: the no-hint micro cases (ours as under graph capture) are held to the
    FlashMLA target like every micro shape, and are not sm_120 seed shapes."""
    micro = SUITES["micro"]
    nohint = [c.name for c in micro.cases if not c.hint]
    assert nohint == ["bs1-N16-H8-L1024-nohint", "bs1-N16-H8-L4096-nohint"]
    t = good(micro.cases)
    t[(nohint[0], "ours", "chain")] = 18.0 * 1.3  # 1.3x FlashMLA: over the 1.25 floor
    for c in micro.cases:
        t[(c.name, "ours-sm120", "tree")] = 30.0
    ts = by_name(evaluate(("flashmla", "sm120_seed", "sm120_hopper"), micro.cases, table(t), {}, H200))
    fm = ts["flashmla"]
    assert fm.status == "fail" and fm.worst_case == nohint[0]
    assert set(nohint) <= {r["case"] for r in fm.rows}
    assert not set(nohint) & {r["case"] for r in ts["sm120_seed"].rows}
    assert set(nohint) <= {r["case"] for r in ts["sm120_hopper"].rows}


def test_micro_targets_cover_the_ragged_cases():
    """Every micro target that takes per-shape ratios has a row for each ragged micro case;
    floor_fraction and sm120_seed (bs=1 shapes) have none."""
    micro = SUITES["micro"]
    ragged = {c.name for c in micro.cases if c.is_ragged}
    assert len(ragged) == 5
    t = good(micro.cases)
    for c in micro.cases:
        t[(c.name, "ours-sm120", "tree")] = t[(c.name, "ours-sm120", "chain")] = 30.0
    ts = by_name(evaluate(micro.targets, micro.cases, table(t), {c.name: 10.0 for c in micro.cases}, H200))
    assert set(ts) == set(micro.targets)
    for name, t_ in ts.items():
        rows = {r["case"] for r in t_.rows}
        if name in ("floor_fraction", "sm120_seed"):
            assert not rows & ragged, name
        else:
            assert ragged <= rows, name


def test_extend_50x_ignores_prefixes_below_23k():
    cases = [Case(1, 16, 8, 4096), Case(1, 16, 8, 23000)]
    t = good(cases)
    t[(cases[0].name, "sglang-extend", "tree")] = 20.0 * 2  # only 2x at 4k: not a target there
    tr = by_name(evaluate(("extend_50x",), cases, table(t), {}, H200))["extend_50x"]
    assert tr.status == "pass" and [r["case"] for r in tr.rows] == [cases[1].name]


RAGGED = [Case.ragged(16, 8, (65536,) + (1024,) * 7, "one64k-seven1k"),
          Case.ragged(8, 16, (32768,) + (2048,) * 31, "one32k-rest2k")]
PER_SHAPE = ("splitkv", "flashmla", "tree_vs_chain", "sm120_hopper", "sm120_splitkv")
ONE_REQUEST = ("extend_50x", "sm120_extend_50x", "floor_fraction", "sm120_seed")


def test_ragged_cases_held_to_every_per_shape_target_and_left_out_of_the_long_context_ones():
    """A ragged case (longest prefix 64k) is a row of every per-shape ratio, and a miss there
    fails the target at that case; the long-context and bs=1 targets leave it out even where
    its longest prefix would qualify (extend only 2x faster is not an extend_50x miss)."""
    cases = LC + RAGGED
    t = good(cases, split=100.0)
    for c in cases:
        t[(c.name, "ours-sm120", "tree")] = 30.0
        t[(c.name, "ours-sm120", "chain")] = 30.0
    for c in RAGGED:
        t[(c.name, "sglang-extend", "tree")] = 20.0 * 2
    ts = by_name(evaluate(PER_SHAPE + ONE_REQUEST, cases, table(t), {c.name: 10.0 for c in cases}, H200))
    for name in PER_SHAPE:
        assert {c.name for c in RAGGED} <= {r["case"] for r in ts[name].rows}, name
    for name in ONE_REQUEST:
        assert not {c.name for c in RAGGED} & {r["case"] for r in ts[name].rows}, name
    assert ts["extend_50x"].status == "pass" and ts["sm120_extend_50x"].status == "pass"
    assert [r["case"] for r in ts["floor_fraction"].rows] == [LC[1].name]
    assert {r["case"] for r in ts["sm120_seed"].rows} == {c.name for c in LC}
    t[(RAGGED[1].name, "ours", "chain")] = 18.0 * 1.3  # 1.3x FlashMLA at the bs32 ragged batch
    fm = by_name(evaluate(("flashmla",), cases, table(t), {}, H200))["flashmla"]
    assert fm.status == "fail" and fm.worst_case == RAGGED[1].name and fm.measured == pytest.approx(1.3)


def test_a_reported_target_is_shown_missed_and_decides_nothing():
    """sm120_extend_50x is reported, not gated: a 32x emulation at N 64 is listed as missed
    with its reason and figure, the gate passes on the gated targets, and a gated target's miss
    (sm120_hopper at 2.6x, on the same long-context shapes) still fails it."""
    from kdtree_pipeline.bench.gate import headline

    lc = SUITES["long-context"]
    assert "sm120_extend_50x" in lc.targets and "sm120_hopper" in lc.targets
    assert SPECS["sm120_extend_50x"].reported and all(SPECS[n].reported is None for n in lc.targets
                                                       if n != "sm120_extend_50x")
    cases = list(lc.cases)
    t = good(cases)
    for c in cases:
        t[(c.name, "ours-sm120", "tree")] = t[(c.name, "ours-sm120", "chain")] = 20.0 * 1.9
        if c.n == 64:
            t[(c.name, "sglang-extend", "tree")] = 20.0 * 1.9 * 32  # 32x the emulation, 61x ours
    ts = evaluate(lc.targets, cases, table(t), {c.name: 10.0 for c in cases}, H200)
    rep = by_name(ts)["sm120_extend_50x"]
    assert rep.status == "fail" and not rep.gated and rep.measured == pytest.approx(32.0)
    assert rep.summary().startswith("sm120_extend_50x: missed (worst 32x")
    assert "reported, not gated: " in rep.summary() and "sm_120 GPU" in rep.summary()
    assert by_name(ts)["extend_50x"].status == "pass" and by_name(ts)["sm120_hopper"].status == "pass"
    assert gate_passes(ts)
    ok, why = verdict(lc, ("ours", "ours-sm120"), [], ts, [], H200)
    assert ok and why is None
    head = headline(lc, {"targets": ts, "results": [], "gpu": H200})
    assert head.startswith(f"{len(lc.targets) - 1}/{len(lc.targets) - 1} targets met")
    assert "reported, not gated: sm120_extend_50x 32x (missed)" in head
    # a gated emulation target on the same shapes still decides
    for c in cases:
        if c.n == 64:
            t[(c.name, "ours-sm120", "tree")] = 20.0 * 2.6
    ts = evaluate(lc.targets, cases, table(t), {c.name: 10.0 for c in cases}, H200)
    assert by_name(ts)["sm120_hopper"].status == "fail" and not gate_passes(ts)
    ok, why = verdict(lc, ("ours", "ours-sm120"), [], ts, [], H200)
    assert not ok and "sm120_hopper: FAIL" in why and "sm120_extend_50x" not in why


def test_ragged_fragmentation_is_taken_against_the_same_lengths():
    lens = (300, 10, 10)
    uni = Case(3, 4, 2, 300, layout="contiguous", masks=("tree",))
    rag0, rag = (Case.ragged(4, 2, lens, "one300", layout=lay, masks=("tree",)) for lay in ("contiguous", "fragmented"))
    t = {(rag0.name, "ours", "tree"): 10.0, (uni.name, "ours", "tree"): 30.0, (rag.name, "ours", "tree"): 10.5}
    tr = by_name(evaluate(("fragmentation",), [rag0, uni, rag], table(t), {}, H200))["fragmentation"]
    assert [r["case"] for r in tr.rows] == [rag.name]
    assert tr.rows[0]["ours_contiguous_us"] == 10.0 and tr.measured == pytest.approx(0.05) and tr.status == "pass"


def test_splitkv_must_be_strictly_faster():
    t = good(split=19.0)  # ours chain 19.0 == split-KV: not faster
    tr = by_name(evaluate(("splitkv",), LC, table(t), FLOORS, H200))["splitkv"]
    assert tr.status == "fail" and tr.measured == pytest.approx(1.0)


def test_splitkv_unsupported_shape_is_listed_not_counted():
    t = good()
    t[(LC[0].name, "sglang-splitkv", "chain")] = "error"  # e.g. shared memory at N=64
    tr = by_name(evaluate(("splitkv",), LC, table(t), FLOORS, H200))["splitkv"]
    assert tr.status == "pass"
    row = next(r for r in tr.rows if r["case"] == LC[0].name)
    assert row["ok"] is None and "error" in row["note"]


def test_flashmla_over_125_fails_between_goal_and_floor_passes():
    tr = by_name(evaluate(("flashmla",), LC, table(good(chain=24.0, fm=18.0)), FLOORS, H200))["flashmla"]
    assert tr.status == "fail" and tr.measured == pytest.approx(24 / 18)
    assert "%" in tr.miss
    tr = by_name(evaluate(("flashmla",), LC, table(good(chain=17.0, fm=18.0)), FLOORS, H200))["flashmla"]
    assert tr.status == "pass" and tr.goal_met is True


def test_tree_vs_chain():
    tr = by_name(evaluate(("tree_vs_chain",), LC, table(good(ours=22.0, chain=19.0)), FLOORS, H200))
    assert tr["tree_vs_chain"].status == "fail" and tr["tree_vs_chain"].measured == pytest.approx(22 / 19)
    tr = by_name(evaluate(("tree_vs_chain",), LC, table(good(ours=20.0, chain=19.0)), FLOORS, H200))
    assert tr["tree_vs_chain"].status == "pass" and tr["tree_vs_chain"].goal_met is False  # 1.053: issue 16's 5%
    tr = by_name(evaluate(("tree_vs_chain",), LC, table(good(ours=19.5, chain=19.0)), FLOORS, H200))
    assert tr["tree_vs_chain"].goal_met is True and "goal 1.050 met" in tr["tree_vs_chain"].summary()


def test_floor_fraction():
    tr = by_name(evaluate(("floor_fraction",), LC, table(good(ours=30.0)), FLOORS, H200))["floor_fraction"]
    assert tr.status == "fail" and tr.measured == pytest.approx(10 / 30)
    assert [r["case"] for r in tr.rows] == [LC[1].name]  # only the bs=1 H=8 N=16 65536 shape
    # the goal (issue 16's 0.55) is a fraction to reach from below: met at or above it
    tr = by_name(evaluate(("floor_fraction",), LC, table(good(ours=20.0)), FLOORS, H200))["floor_fraction"]
    assert tr.status == "pass" and tr.measured == pytest.approx(0.5) and tr.goal_met is False
    tr = by_name(evaluate(("floor_fraction",), LC, table(good(ours=17.0)), FLOORS, H200))["floor_fraction"]
    assert tr.goal_met is True


def test_ours_error_is_a_miss_not_a_skip():
    t = good()
    t[(LC[0].name, "ours", "chain")] = "wrong"
    tr = by_name(evaluate(("flashmla",), LC, table(t), FLOORS, H200))["flashmla"]
    assert tr.status == "fail" and "without a correct figure of ours" in tr.miss


def test_missing_peer_leaves_target_unmeasured():
    t = {k: v for k, v in good().items() if k[1] != "flashmla"}
    for c in LC:
        t[(c.name, "flashmla", "chain")] = "missing"
    tr = by_name(evaluate(("flashmla",), LC, table(t), FLOORS, H200))["flashmla"]
    assert tr.status == "unmeasured" and "missing" in tr.note
    assert not gate_passes([tr])


@pytest.mark.parametrize("gpu", ["NVIDIA H100 80GB HBM3", "NVIDIA H200", "NVIDIA H100 PCIe"])
def test_the_targets_hold_on_every_hopper_gpu(gpu):
    """Same-run ratios: an H100's figures are held to the targets as an H200's are, and miss
    where they miss (1.3x FlashMLA fails on either)."""
    assert {x.status for x in evaluate(ALL, LC, table(good()), FLOORS, gpu)} == {"pass"}
    tr = by_name(evaluate(ALL, LC, table(good(chain=18.0 * 1.3)), FLOORS, gpu))["flashmla"]
    assert tr.status == "fail" and tr.miss


def test_other_gpu_is_not_applicable_but_figures_are_kept():
    t = good(chain=40.0)  # would fail on the H200
    ts = evaluate(ALL, LC, table(t), FLOORS, "NVIDIA RTX PRO 6000 Blackwell")
    assert {x.status for x in ts} == {"n/a"}
    assert by_name(ts)["flashmla"].measured == pytest.approx(40 / 18)
    assert by_name(ts)["flashmla"].miss is None
    assert not gate_passes(ts)
    ok, why = verdict(SUITES["long-context"], ("ours", "flashmla"), [], ts, [], "NVIDIA RTX PRO 6000 Blackwell")
    assert not ok and "Hopper (H100, H200)" in why and "not applicable" in why


def test_fragmentation_penalty():
    cases = [Case(1, 16, 8, L, layout=lay, masks=("tree",)) for L in (4096, 65536)
             for lay in ("contiguous", "runs16", "fragmented")]
    t = {}
    for c in cases:
        base = 10.0 if c.prefix == 4096 else 30.0
        t[(c.name, "ours", "tree")] = base * (1.05 if c.layout != "contiguous" else 1.0)
        t[(c.name, "sglang-extend", "tree")] = base * 100 * (1.5 if c.layout == "fragmented" else 1.0)
    tr = by_name(evaluate(("fragmentation",), cases, table(t), {}, H200))["fragmentation"]
    assert tr.status == "pass" and tr.measured == pytest.approx(0.05)
    frag = [r for r in tr.rows if r["layout"] == "fragmented"]
    assert all(r["extend_penalty"] == pytest.approx(0.5) for r in frag)
    t[(cases[-1].name, "ours", "tree")] = 30.0 * 1.2
    tr = by_name(evaluate(("fragmentation",), cases, table(t), {}, H200))["fragmentation"]
    assert tr.status == "fail" and tr.worst_case == cases[-1].name
    assert "percentage points" in tr.miss and "+20.0%" in tr.summary()


def test_unknown_target_name():
    with pytest.raises(ValueError, match="target: expected one of"):
        evaluate(("nope",), LC, table(good()), FLOORS, H200)


def test_every_suite_names_known_targets():
    for s in SUITES.values():
        assert set(s.targets) <= set(SPECS)


def test_verdict_fails_on_ours_errors_and_skips():
    ts = evaluate(("tree_vs_chain",), LC, table(good()), FLOORS, H200)
    res = [Result(LC[0].name, "ours", "tree", "ok", replay_us=1.0),
           Result(LC[1].name, "ours", "tree", "skipped", error="the suite's time budget (1 s) ran out")]
    ok, why = verdict(SUITES["micro"], ("ours",), res, ts, [], H200)
    assert not ok and "budget" in why and "not correct or not measured" in why
    ok, why = verdict(SUITES["micro"], ("ours",), res[:1], ts, [], H200)
    assert ok and why is None
    ok, why = verdict(SUITES["micro"], ("flashmla",), [], ts, [], H200)
    assert not ok and "'ours' was not among --systems" in why
