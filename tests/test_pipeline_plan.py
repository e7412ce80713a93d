"""Phase table, plan state round-trip and rendering (no git here)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kdtree_engine.pipeline import evidence, plan
from kdtree_engine.pipeline.phases import PHASES, PhaseError, phase

TEMPLATES = Path(__file__).resolve().parents[1] / "templates"


def _record(gate: str, variant: str | None = None, **kw) -> dict:
    rec = evidence.make_record(
        gate, True, {"median_us": 12.3456789, "cases": 48, "table": [1, 2]},
        kw.pop("headline", f"{gate} headline"), variant=variant, device=kw.pop("device", None),
        details=kw.pop("details", None),
    )
    rec["time_utc"] = kw.pop("time_utc", "2030-01-02T03:04:05Z")
    rec.update(kw)
    return rec


def _done_state(*numbers: int) -> dict:
    state = plan.new_state()
    for n in numbers:
        recs = {g.stem: _record(g.gate, g.variant) for g in PHASES[n].gates}
        plan.mark_done(state, n, recs, "c0ffee" * 7)
    return state


def test_phase_table_matches_design():
    assert [g.stem for g in phase(0).gates] == ["build", "oracle-selftest"]
    assert [g.stem for g in phase(1).gates] == ["build", "oracle", "bench-micro"]
    assert [g.stem for g in phase(2).gates] == ["oracle", "integrate"]
    assert [g.stem for g in phase(3).gates] == ["bench-long-context", "smoke"]
    assert [g.stem for g in phase(4).gates] == ["graph"]
    assert [g.stem for g in phase(5).gates] == ["defrag"]
    bench = phase(1).gate("bench-micro")
    assert bench.nox_args() == ["-s", "bench", "--", "--suite", "micro"]
    assert bench.nox_args(no_venv=True)[:3] == ["-s", "bench", "--no-venv"]
    assert not phase(0).needs_gpu and all(phase(n).needs_gpu for n in range(1, 6))


@pytest.mark.parametrize("bad", [6, -1, "7", "x", "01", None])
def test_unknown_phase_is_refused(bad):
    with pytest.raises(PhaseError, match="expected a number from 0 to 5"):
        phase(bad)


def test_unknown_gate_is_refused():
    with pytest.raises(PhaseError, match="'smoke' is not part of phase 0"):
        phase(0).gate("smoke")


def test_state_round_trip(tmp_path):
    state = _done_state(0, 1)
    path = plan.save_state(state, tmp_path / "s.json")
    loaded = plan.load_state(path)
    assert loaded == state
    assert plan.dump_state(loaded) == path.read_text()
    keys = list(json.loads(path.read_text()).keys())
    assert keys == sorted(keys)
    p0 = loaded["phases"][0]
    assert p0["status"] == "done" and p0["date"] == "2030-01-02" and p0["gpu"] == "none (CPU)"
    assert p0["gates"][0]["evidence"]["metrics"] == {"cases": 48, "median_us": 12.3456789}


def test_missing_state_is_all_todo(tmp_path):
    state = plan.load_state(tmp_path / "absent.json")
    assert [p["status"] for p in state["phases"]] == ["todo"] * 6


@pytest.mark.parametrize(
    "text, match",
    [
        ('{"schema": 1, "phases": [', "not valid JSON"),
        ('{"schema": 9, "phases": []}', "schema 9"),
        ("[]", "expected a JSON object"),
    ],
)
def test_corrupt_state_is_refused(tmp_path, text, match):
    path = tmp_path / "s.json"
    path.write_text(text)
    with pytest.raises(plan.PlanError, match=match) as e:
        plan.load_state(path)
    assert str(path) in str(e.value)


def test_bad_status_is_refused(tmp_path):
    state = plan.new_state()
    state["phases"][2]["status"] = "finished"
    path = plan.save_state(state, tmp_path / "s.json")
    with pytest.raises(plan.PlanError, match="phase 2 status 'finished'"):
        plan.load_state(path)


def test_render_is_byte_identical_and_shows_figures():
    table = "| shape | us |\n|---|---|\n| 1x16x8 | 3.2 |"
    state = _done_state(0)
    h200 = {"name": "NVIDIA H200", "capability": "9.0"}
    recs = {
        "build": _record("build"),
        "oracle": _record("oracle", device=h200),
        "bench-micro": _record("bench", "micro", headline="30x vs triton | 2.1x floor",
                               details={"markdown_table": table}, device=h200),
    }
    plan.mark_done(state, 1, recs, "abcdef123456" * 3)
    first = plan.render(state, TEMPLATES)
    assert plan.render(json.loads(plan.dump_state(state)), TEMPLATES) == first
    assert "30x vs triton \\| 2.1x floor" in first
    assert table in first
    assert "NVIDIA H200 (sm 9.0)" in first
    assert "median_us = 12.35" in first
    assert "**remaining = sglang integration + long-context performance + smoke" in first
    assert "| 1 | kernel in isolation | done | 2030-01-02 | NVIDIA H200 (sm 9.0) | abcdef123456 |" in first


def test_phase_table_names_the_code_each_phase_was_proven_on():
    """A phase recorded on older code keeps that code's content hash in the summary
    table, so a reader sees which phases' proofs cover the current code."""
    state = plan.new_state()
    for n, digest in ((0, "aaaa" * 16), (1, "bbbb" * 16)):
        recs = {g.stem: _record(g.gate, g.variant) for g in PHASES[n].gates}
        for r in recs.values():
            r["code"] = {"commit": "c0ffee" * 7, "content_hash": digest, "dirty": False}
        plan.mark_done(state, n, recs, "c0ffee" * 7)
    text = plan.render(state, TEMPLATES)
    rows = {line.split(" | ")[0]: line for line in text.splitlines() if line.startswith("| ")}
    assert rows["| 0"].endswith("| aaaaaaaaaaaa |")
    assert rows["| 1"].endswith("| bbbbbbbbbbbb |")
    assert rows["| 2"].endswith("| - |")


def test_commit_subject_style():
    state = _done_state(0, 1, 2, 3)
    assert plan.commit_subject(state) == (
        "plans/0002: mark Phase 0-3 done; remaining = cuda-graph safety + defrag"
    )
    msg = plan.commit_message(state, 3)
    assert "- bench-long-context: bench headline (evidence commit " in msg
    assert plan.commit_subject(_done_state(0, 2, 3)).startswith("plans/0002: mark Phase 0, 2-3 done;")
    assert plan.commit_subject(_done_state(*range(6))).endswith("remaining = none")


def test_template_error_names_template(tmp_path):
    (tmp_path / plan.TEMPLATE).write_text("{{ title }} {{ no_such_value }}\n")
    with pytest.raises(plan.PlanError, match="no_such_value") as e:
        plan.render(plan.new_state(), tmp_path)
    assert plan.TEMPLATE in str(e.value)


def test_status_table_lists_every_gate():
    text = plan.status_table(_done_state(0))
    for g in ("build", "oracle-selftest", "bench-micro", "bench-long-context", "graph", "defrag"):
        assert g in text
    assert "remaining = kernel in isolation" in text
