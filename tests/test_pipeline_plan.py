"""Phase table, plan state round-trip and rendering (no git here)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kdtree_pipeline import evidence, plan
from kdtree_pipeline.phases import PHASES, VERSIONS_USED, PhaseError, phase

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
        plan.mark_done(state, n, recs)
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
    plan.mark_done(state, 1, recs)
    first = plan.render(state, TEMPLATES)
    assert plan.render(json.loads(plan.dump_state(state)), TEMPLATES) == first
    assert "30x vs triton \\| 2.1x floor" in first
    assert table in first
    assert "NVIDIA H200 (sm 9.0)" in first
    assert "median_us = 12.35" in first
    assert "**remaining = sglang integration + long-context performance + smoke" in first
    commit = recs["oracle"]["code"]["commit"]
    assert (f"| 1 | kernel in isolation | done | 2030-01-02 | NVIDIA H200 (sm 9.0) | "
            f"{(commit or '-')[:12]} |") in first


def test_phase_table_names_the_code_each_phase_was_proven_on():
    """A phase recorded on older code keeps that code's content hash in the summary
    table, so a reader sees which phases' proofs cover the current code."""
    state = plan.new_state()
    for n, digest in ((0, "aaaa" * 16), (1, "bbbb" * 16)):
        recs = {g.stem: _record(g.gate, g.variant) for g in PHASES[n].gates}
        for r in recs.values():
            r["code"] = {"commit": "c0ffee" * 7, "content_hash": digest, "dirty": False}
        plan.mark_done(state, n, recs)
    state["head_content_hash"] = "bbbb" * 16
    text = plan.render(state, TEMPLATES)
    rows = {line.split(" | ")[0]: line for line in text.splitlines() if line.startswith("| ")}
    assert rows["| 0"].endswith("| c0ffeec0ffee | aaaaaaaaaaaa | no: re-prove |")
    assert rows["| 1"].endswith("| c0ffeec0ffee | bbbbbbbbbbbb | yes |")
    assert rows["| 2"].endswith("| - | - | - |")
    assert "- Phase 0 (build + oracle baseline), proven on aaaaaaaaaaaa: `invoke phase0`" in text
    assert "Phase 1 (kernel" not in text.split("## Phase 0")[0].split("Needs re-proving")[1]
    # the one commit column is defined before the table
    preamble = text.split("| phase |")[0]
    assert "**commit**" in preamble and "**content hash**" in preamble and "**current**" in preamble


def test_commit_subject_says_the_change():
    h = "fe2260e0" + "0" * 56
    state = _done_state(0, 1, 2, 3, 4)
    one = [plan.Change(4, "done", h)]
    assert plan.commit_subject(state, one) == (
        "plans/0002: mark Phase 4 (cuda-graph safety) done on fe2260e0; remaining = defrag")
    several = [plan.Change(1, "re-proved", h), plan.Change(2, "re-proved", h), plan.Change(3, "done", h)]
    assert plan.commit_subject(state, several) == (
        "plans/0002: re-prove Phase 1-2 on fe2260e0, mark Phase 3 (long-context performance + smoke) "
        "done on fe2260e0; remaining = defrag")
    msg = plan.commit_message(state, [plan.Change(3, "done", h)], unchanged=[0])
    assert "Phase 3 (long-context performance + smoke): done on content hash fe2260e00000" in msg
    assert "- bench-long-context: bench headline (evidence commit " in msg
    assert "Unchanged (same content hash and results as recorded): Phase 0" in msg
    assert plan.commit_subject(_done_state(*range(6))).endswith("remaining = none")
    assert plan.commit_subject(_done_state(0)).startswith("plans/0002: re-render from templates/plan.md.j2;")


def test_remaining_names_the_missing_gates_of_a_phase_in_progress():
    state = _done_state(0, 1, 2, 4, 5)
    plan.mark_done(state, 3, {"bench-long-context": _record("bench", "long-context")},
                   override_missing=[])
    assert state["phases"][3]["status"] == "in progress"
    assert plan.remaining_text(state) == "smoke"


def test_machine_local_paths_are_made_relative_or_left_out():
    rec = _record("build")
    root = rec["root"]
    rec["metrics"] = {"library": f"{root}/build/lib/libk.so", "out_dir": "/tmp/bench",
                      "windows": "C:\\bench", "name": "relative/ok", "bytes": 3}
    rec["headline"] = f"built {root}/build/lib/libk.so"
    s = plan.summarize(rec)
    assert s["metrics"] == {"bytes": 3, "library": "build/lib/libk.so", "name": "relative/ok"}
    assert s["headline"] == "built build/lib/libk.so"


def test_schema_1_state_is_upgraded(tmp_path):
    state = _done_state(0)
    old = json.loads(plan.dump_state(state))
    old["schema"] = 1
    for key in ("head_content_hash", "markdown_sha256"):
        del old[key]
    old["phases"][0]["code_commit"] = "ab" * 20
    old["phases"][0]["gates"][0]["evidence"]["metrics"]["library"] = "/work/x/build/lib/libk.so"
    for key in ("plots", "versions"):  # schema 1 summaries had no plot names
        del old["phases"][0]["gates"][0]["evidence"][key]
    path = tmp_path / "s.json"
    path.write_text(json.dumps(old))
    loaded = plan.load_state(path)
    assert loaded["schema"] == plan.STATE_SCHEMA
    assert "code_commit" not in loaded["phases"][0]
    assert "library" not in loaded["phases"][0]["gates"][0]["evidence"]["metrics"]
    assert loaded["phases"][0]["gates"][0]["evidence"]["headline"] == "build headline"
    assert "/work/x" not in plan.render(loaded, TEMPLATES)  # and it renders


def test_same_results_on_new_times_and_commit_are_unchanged():
    before = _done_state(0)
    after = json.loads(plan.dump_state(before))
    recs = {g.stem: _record(g.gate, g.variant, time_utc="2031-05-06T07:08:09Z") for g in PHASES[0].gates}
    for r in recs.values():
        r["code"]["commit"] = "1234" * 10
        r["metrics"]["seconds"] = 99.0  # how long it ran is not a result
    plan.mark_done(after, 0, recs)
    assert plan.keep_unchanged(before, after, 0)
    assert after["phases"][0]["date"] == "2030-01-02"  # the recorded entry is kept
    recs["build"]["headline"] = "a different figure"
    plan.mark_done(after, 0, recs)
    assert not plan.keep_unchanged(before, after, 0)
    assert plan.change_of(before, after, 0).kind == "re-proved"


def test_versions_used_name_every_gate_and_only_versions_a_record_has():
    assert set(VERSIONS_USED) == {g.gate for p in PHASES for g in p.gates}
    names = set(evidence.versions())
    assert all(set(used) <= names for used in VERSIONS_USED.values()), (VERSIONS_USED, names)


def test_the_plan_keeps_the_versions_a_gate_computes_with_and_compares_only_those():
    env = {"python": "3.11.7", "torch": "2.13.0+cpu", "cuda": None, "triton": "3.9.0",
           "sglang": "0.5.23", "nvcc": "13.0 (V13.0.88)"}
    assert plan.summarize(_record("build", versions=env))["versions"] == {"nvcc": "13.0 (V13.0.88)"}
    assert plan.summarize(_record("oracle-selftest", versions=env))["versions"] == {"torch": "2.13.0+cpu"}
    assert plan.summarize(_record("integrate", versions=env))["versions"] == {
        "sglang": "0.5.23", "torch": "2.13.0+cpu", "triton": "3.9.0"}
    # a state recorded when the plan kept every version, then the same gates in a venv without
    # sglang and triton: the same proof
    before = plan.new_state()
    plan.mark_done(before, 0, {g.stem: _record(g.gate, g.variant) for g in PHASES[0].gates})
    for g in before["phases"][0]["gates"]:
        g["evidence"]["versions"] = {k: v for k, v in env.items() if v}
    bare = {**env, "triton": None, "sglang": None, "python": "3.12.1"}
    after = json.loads(plan.dump_state(before))
    plan.mark_done(after, 0, {g.stem: _record(g.gate, g.variant, versions=bare) for g in PHASES[0].gates})
    assert plan.keep_unchanged(before, after, 0)
    # another torch under the reference self-test is another proof
    after = json.loads(plan.dump_state(before))
    plan.mark_done(after, 0, {g.stem: _record(g.gate, g.variant, versions={**bare, "torch": "2.14.0"})
                              for g in PHASES[0].gates})
    assert not plan.keep_unchanged(before, after, 0)


def test_hand_edit_is_told_from_a_template_change(tmp_path):
    state = _done_state(0)
    _, text = plan.render_files(state, TEMPLATES)
    assert not plan.hand_edited(state, text, TEMPLATES)
    assert not plan.hand_edited(state, None, TEMPLATES)
    assert plan.hand_edited(state, text.replace("| done |", "| done!! |"), TEMPLATES)
    # a new template renders differently, but the file on disk is what the pipeline wrote
    changed = tmp_path / "t"
    changed.mkdir()
    (changed / plan.TEMPLATE).write_text((TEMPLATES / plan.TEMPLATE).read_text() + "\nNew footer.\n")
    assert not plan.hand_edited(state, text, changed)
    # a state from before markdown_sha256: the committed markdown is what the pipeline wrote
    state["markdown_sha256"] = None
    assert not plan.hand_edited(state, text, changed, committed_text=text)
    assert plan.hand_edited(state, text + "edit\n", changed, committed_text=text)


def test_template_error_names_template(tmp_path):
    (tmp_path / plan.TEMPLATE).write_text("{{ title }} {{ no_such_value }}\n")
    with pytest.raises(plan.PlanError, match="no_such_value") as e:
        plan.render(plan.new_state(), tmp_path)
    assert plan.TEMPLATE in str(e.value)


def test_status_table_lists_every_gate_and_the_stale_phases():
    state = _done_state(0, 1)
    proven = plan.phase_hashes(state["phases"][0])[0]
    text = plan.status_table(state, proven)
    for g in ("build", "oracle-selftest", "bench-micro", "bench-long-context", "graph", "defrag"):
        assert g in text
    assert "remaining = sglang integration" in text
    assert "needs re-proving: none" in text
    text = plan.status_table(state, "9" * 64)
    assert "content hash of src/ and csrc/ here: 999999999999" in text
    assert ("needs re-proving: Phase 0 (build + oracle baseline, proven on "
            f"{proven[:12]}); Phase 1 (kernel in isolation, proven on {proven[:12]})") in text
    assert "no: re-prove" in text.splitlines()[1]
