"""run_phase / record_phase in real temporary git repositories, with a stand-in
gate runner that writes real evidence records for the temporary tree."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

import pytest

from kdtree_pipeline import evidence, plan
from kdtree_pipeline.phases import PHASES, Gate, PhaseError
from kdtree_pipeline.run import (
    GateFailed,
    PipelineError,
    _find_plot,
    record,
    record_phase,
    render_plan,
    run_phase,
)

PROJECT = Path(__file__).resolve().parents[1]
PNG = b"\x89PNG\r\n\x1a\n"  # the 8-byte PNG signature


def git(repo: Path, *args: str) -> str:
    """Run a real git command in ``repo`` and return its stdout."""
    return subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True,
                          check=True).stdout


def _snapshot(root: Path) -> tuple[str, str, dict[str, bytes | None]]:
    files = {p.name: (p.read_bytes() if p.exists() else None) for p in plan.plan_paths(root)}
    return git(root, "rev-parse", "HEAD"), git(root, "status", "--porcelain"), files


class FakeRunner:
    """Writes a real evidence record per gate; ``fail`` names gates that fail,
    ``silent`` gates that pass without writing anything."""

    def __init__(self, root: Path, fail: tuple[str, ...] = (), silent: tuple[str, ...] = ()):
        self.root, self.fail, self.silent, self.calls = root, fail, silent, []

    def __call__(self, gate: Gate, env: Mapping[str, str], no_venv: bool) -> int:
        self.calls.append((gate.stem, no_venv))
        if gate.stem in self.silent:
            return 0
        ok = gate.stem not in self.fail
        rec = evidence.make_record(gate.gate, ok, {"ms": 1.25}, f"{gate.stem} ok" if ok else "bad",
                                   variant=gate.variant, device=None, root=self.root)
        evidence.write_record(rec, env["KDTREE_EVIDENCE_DIR"])
        return 0 if ok else 1


def write_evidence(root: Path, directory: Path, n: int, **override) -> None:
    for g in PHASES[n].gates:
        rec = evidence.make_record(g.gate, True, {"ms": 2.0}, f"{g.stem} fine", variant=g.variant,
                                   device={"name": "NVIDIA H200", "capability": "9.0"}, root=root)
        rec.update(override)
        evidence.write_record(rec, directory)


def test_phase0_runs_gates_and_commits_plan(project_repo):
    runner = FakeRunner(project_repo)
    result = run_phase(0, project_repo / "build" / "ev", root=project_repo, runner=runner,
                       no_venv=True, log=lambda s: None)
    assert runner.calls == [("build", True), ("oracle-selftest", True)]
    assert result.commit == git(project_repo, "rev-parse", "HEAD").strip()
    files = git(project_repo, "show", "--name-only", "--format=", "HEAD").split()
    assert sorted(files) == sorted(f"plans/{p.name}" for p in plan.plan_paths(project_repo))
    subject, body = git(project_repo, "log", "-1", "--format=%s%n%b").split("\n", 1)
    h = evidence.content_hash(project_repo)
    assert subject == (f"plans/0002: mark Phase 0 (build + oracle baseline) done on {h[:8]}; "
                       "remaining = kernel in isolation + sglang integration + long-context "
                       "performance + smoke + cuda-graph safety + defrag")
    initial = git(project_repo, "rev-parse", "HEAD~1").strip()
    assert f"- build: build ok (evidence commit {initial[:12]}" in body
    state = plan.load_state(plan.plan_paths(project_repo)[0])
    assert state["phases"][0]["status"] == "done"
    assert state["phases"][0]["gates"][0]["evidence"]["commit"] == initial
    assert state["head_content_hash"] == h


def test_stops_at_first_failed_gate(project_repo):
    runner = FakeRunner(project_repo, fail=("build",))
    before = _snapshot(project_repo)
    with pytest.raises(GateFailed, match="gate build failed"):
        run_phase(0, project_repo / "build" / "ev", root=project_repo, runner=runner,
                  log=lambda s: None)
    assert [c[0] for c in runner.calls] == ["build"]
    assert _snapshot(project_repo) == before


def test_gate_that_writes_no_evidence_fails(project_repo):
    ev = project_repo / "build" / "ev"
    write_evidence(project_repo, ev, 0)  # an old passing record must not be reused
    runner = FakeRunner(project_repo, silent=("oracle-selftest",))
    with pytest.raises(GateFailed, match="oracle-selftest exited 0 but wrote no evidence"):
        run_phase(0, ev, root=project_repo, runner=runner, log=lambda s: None)


def test_gpu_phase_without_cuda_changes_nothing(project_repo):
    runner = FakeRunner(project_repo)
    before = _snapshot(project_repo)
    with pytest.raises(GateFailed, match="phase 1 needs a CUDA GPU"):
        run_phase(1, root=project_repo, runner=runner, has_cuda=lambda: False)
    assert runner.calls == [] and _snapshot(project_repo) == before


def test_record_from_evidence_elsewhere(project_repo, tmp_path):
    write_evidence(project_repo, tmp_path / "ev0", 0)
    write_evidence(project_repo, tmp_path / "ev1", 1)
    record_phase(0, tmp_path / "ev0", root=project_repo)
    result = record_phase(1, tmp_path / "ev1", root=project_repo)
    assert result.message.startswith("plans/0002: mark Phase 1 (kernel in isolation) done on ")
    md = plan.plan_paths(project_repo)[1].read_text()
    assert "| 1 | kernel in isolation | done |" in md and "NVIDIA H200 (sm 9.0)" in md


def test_wrong_content_hash_is_refused_naming_both(project_repo, tmp_path):
    write_evidence(project_repo, tmp_path / "ev", 0)
    old = evidence.content_hash(project_repo)
    (project_repo / "csrc" / "kernel.cu").write_text("// changed after the gates ran\n")
    git(project_repo, "commit", "-qam", "change kernel")
    new = evidence.content_hash(project_repo)
    before = _snapshot(project_repo)
    with pytest.raises(PipelineError) as e:
        record_phase(0, tmp_path / "ev", root=project_repo)
    assert old in str(e.value) and new in str(e.value) and old != new
    assert _snapshot(project_repo) == before


def test_a_gpu_gate_that_ran_another_library_is_refused(project_repo, tmp_path):
    """Phase 1's gates ran a library that this tree's csrc/ did not build (a variant, a build
    of older sources, a record from before records named their library): the recording is
    refused, naming the library and why, and nothing changes. Phase 0's CPU gates are not
    asked for a library."""
    from conftest import stamp_library

    write_evidence(project_repo, tmp_path / "ev0", 0)
    record_phase(0, tmp_path / "ev0", root=project_repo)
    variant = project_repo / "build" / "lib" / "v" / "libkdtree_verify.so"
    variant.parent.mkdir(parents=True)
    variant.write_bytes(b"a variant")
    (project_repo / "csrc" / "extra.cuh").write_text("// a source the stamped library was not built from\n")
    git(project_repo, "add", "-A")
    git(project_repo, "commit", "-qm", "add a header")
    cases = {
        "variant": ({"library": {"path": str(variant), "matches": None, "why": "no readable build stamp"}},
                    str(variant)),
        "stale": ({}, "was built from csrc/"),  # the stamp names csrc/ before extra.cuh
        "unnamed": ({"library": None}, "does not say which kernel library"),
    }
    for name, (override, expect) in cases.items():
        ev = tmp_path / f"ev-{name}"
        write_evidence(project_repo, ev, 1, **override)
        before = _snapshot(project_repo)
        with pytest.raises(PipelineError) as e:
            record_phase(1, ev, root=project_repo)
        assert expect in str(e.value) and "kernel library" in str(e.value), name
        assert _snapshot(project_repo) == before
    lib = stamp_library(project_repo)  # rebuilt from this csrc/: now the records prove this tree
    write_evidence(project_repo, tmp_path / "ev-ok", 1)
    assert record_phase(1, tmp_path / "ev-ok", root=project_repo).commit
    from kdtree_engine.kernel import build

    md = plan.plan_paths(project_repo)[1].read_text()
    phase1 = md.split("## Phase 1")[1].split("## Phase 2")[0]
    assert f"| {build.file_sha256(lib)[:12]} |" in phase1  # the library column


@pytest.mark.parametrize("damage", ["truncate", "garbage", "empty"])
def test_corrupt_evidence_is_refused(project_repo, tmp_path, damage):
    write_evidence(project_repo, tmp_path / "ev", 0)
    path = tmp_path / "ev" / "oracle-selftest.json"
    text = path.read_text()
    path.write_text({"truncate": text[: len(text) // 2], "garbage": "\x00\x01{", "empty": ""}[damage])
    before = _snapshot(project_repo)
    with pytest.raises(evidence.EvidenceError, match="oracle-selftest.json: not valid JSON"):
        record_phase(0, tmp_path / "ev", root=project_repo)
    assert _snapshot(project_repo) == before


def test_evidence_of_another_gate_or_failed_is_refused(project_repo, tmp_path):
    write_evidence(project_repo, tmp_path / "ev", 0)
    rec = evidence.load_record(tmp_path / "ev" / "build.json")
    rec["gate"] = "oracle"
    evidence.write_record(rec, tmp_path / "other")
    (tmp_path / "other" / "oracle.json").rename(tmp_path / "ev" / "build.json")
    with pytest.raises(PipelineError, match="is for gate 'oracle', expected 'build'"):
        record_phase(0, tmp_path / "ev", root=project_repo)
    write_evidence(project_repo, tmp_path / "ev2", 0, passed=False, reason="nvcc not found")
    with pytest.raises(PipelineError, match=r"gate build failed \(nvcc not found\)"):
        record_phase(0, tmp_path / "ev2", root=project_repo)
    with pytest.raises(PipelineError, match="no evidence for gate build"):
        record_phase(0, tmp_path / "empty", root=project_repo)


def test_predecessors_not_done_then_override(project_repo, tmp_path):
    write_evidence(project_repo, tmp_path / "ev", 2)
    before = _snapshot(project_repo)
    with pytest.raises(PipelineError, match=r"phase\(s\) 0 \(build \+ oracle baseline\), 1 "):
        record_phase(2, tmp_path / "ev", root=project_repo)
    assert _snapshot(project_repo) == before
    record_phase(2, tmp_path / "ev", root=project_repo, override=True)
    state = plan.load_state(plan.plan_paths(project_repo)[0])
    assert state["phases"][2]["override"] and state["phases"][2]["override_missing"] == [0, 1]
    assert "Recorded with `--override` while phase(s) 0, 1 were not done." in (
        plan.plan_paths(project_repo)[1].read_text())


def _record_phases_0_to_2(root: Path, tmp_path: Path) -> None:
    for n in range(3):
        write_evidence(root, tmp_path / f"ev{n}", n)
        record_phase(n, tmp_path / f"ev{n}", root=root)


def test_partial_records_the_gates_with_evidence_and_keeps_the_phase_open(project_repo, tmp_path):
    _record_phases_0_to_2(project_repo, tmp_path)
    write_evidence(project_repo, tmp_path / "ev3", 3)
    (tmp_path / "ev3" / "smoke.json").unlink()  # the host had no server to smoke-test
    before = _snapshot(project_repo)
    with pytest.raises(PipelineError, match="no evidence for gate smoke"):
        record_phase(3, tmp_path / "ev3", root=project_repo)
    assert _snapshot(project_repo) == before
    result = record_phase(3, tmp_path / "ev3", root=project_repo, partial=True)
    h = evidence.content_hash(project_repo)[:8]
    assert result.message.startswith(
        f"plans/0002: record Phase 3 (long-context performance + smoke) in progress on {h}; "
        "remaining = smoke + cuda-graph safety + defrag")
    assert "- bench-long-context: bench-long-context fine" in result.message
    assert "- smoke: no evidence" in result.message
    state = plan.load_state(plan.plan_paths(project_repo)[0])
    assert state["phases"][3]["status"] == "in progress"
    assert plan.done_phases(state) == [0, 1, 2]
    md = plan.plan_paths(project_repo)[1].read_text()
    assert "| 3 | long-context performance + smoke | in progress |" in md
    assert "| smoke | `nox -s smoke` | - | no evidence yet |" in md
    assert "bench-long-context fine" in md
    # phase 4 still waits for phase 3
    write_evidence(project_repo, tmp_path / "ev4", 4)
    with pytest.raises(PipelineError, match=r"phase\(s\) 3 "):
        record_phase(4, tmp_path / "ev4", root=project_repo)


def test_partial_still_refuses_bad_or_absent_evidence(project_repo, tmp_path):
    _record_phases_0_to_2(project_repo, tmp_path)
    before = _snapshot(project_repo)
    with pytest.raises(PipelineError, match="no evidence in .* for any of its gates"):
        record_phase(3, tmp_path / "empty", root=project_repo, partial=True)
    write_evidence(project_repo, tmp_path / "bad", 3, passed=False, reason="2 targets missed")
    (tmp_path / "bad" / "smoke.json").unlink()
    with pytest.raises(PipelineError, match=r"gate bench-long-context failed \(2 targets missed\)"):
        record_phase(3, tmp_path / "bad", root=project_repo, partial=True)
    assert _snapshot(project_repo) == before


def test_partial_with_every_gate_records_done(project_repo, tmp_path):
    write_evidence(project_repo, tmp_path / "ev", 0)
    result = record_phase(0, tmp_path / "ev", root=project_repo, partial=True)
    assert result.message.startswith("plans/0002: mark Phase 0 (build + oracle baseline) done on ")


def test_dirty_sources_are_refused(project_repo, tmp_path):
    write_evidence(project_repo, tmp_path / "ev", 0)
    (project_repo / "src" / "kdtree_engine" / "new.py").write_text("x = 1\n")
    before = _snapshot(project_repo)
    with pytest.raises(PipelineError, match="src/ differ from HEAD"):
        record_phase(0, tmp_path / "ev", root=project_repo)
    assert _snapshot(project_repo) == before


def test_no_commit_writes_plan_only(project_repo, tmp_path):
    write_evidence(project_repo, tmp_path / "ev", 0)
    head = git(project_repo, "rev-parse", "HEAD")
    result = record_phase(0, tmp_path / "ev", root=project_repo, commit=False)
    assert result.commit is None and git(project_repo, "rev-parse", "HEAD") == head
    assert "?? plans/" in git(project_repo, "status", "--porcelain")


def test_unknown_phase(project_repo):
    with pytest.raises(PhaseError, match="unknown phase 9"):
        run_phase(9, root=project_repo)


def test_real_noxfile_gpu_session_fails_without_cuda():
    """The project's own noxfile: a GPU gate on a CPU machine fails, never skips."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("checks the no-GPU failure")
    out = subprocess.run([sys.executable, "-m", "nox", "--no-venv", "-s", "graph"], cwd=PROJECT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "gate graph needs a CUDA GPU" in out.stdout + out.stderr
    listed = subprocess.run([sys.executable, "-m", "nox", "-l"], cwd=PROJECT, capture_output=True,
                            text=True, timeout=120).stdout
    assert "* tests" in listed and "- oracle-selftest" in listed and "- graph [gpu]" in listed


def _count(root: Path) -> int:
    return int(git(root, "rev-list", "--count", "HEAD"))


def test_repeat_with_same_results_makes_no_commit(project_repo, tmp_path):
    write_evidence(project_repo, tmp_path / "ev", 0)
    record_phase(0, tmp_path / "ev", root=project_repo)
    # the same gates again, later and on the plan commit: new times and commit only
    write_evidence(project_repo, tmp_path / "again", 0, time_utc="2099-01-01T00:00:00Z")
    before = _snapshot(project_repo)
    result = record_phase(0, tmp_path / "again", root=project_repo)
    assert result.skipped and result.commit is None and result.unchanged == (0,)
    h = evidence.content_hash(project_repo)
    assert result.message == (f"Phase 0 unchanged: the evidence proves the same content hash "
                              f"({h[:12]}) with the same results as recorded; nothing to commit")
    assert _snapshot(project_repo) == before


def _versions_but(monkeypatch, **changed: str | None) -> None:
    """Make every record written from now on name these library versions instead (a gate run
    in another environment: a fresh clone's nox venv has neither sglang nor triton)."""
    real = evidence.versions
    monkeypatch.setattr(evidence, "versions", lambda *a, **k: {**real(*a, **k), **changed})


def test_phase0_whose_only_difference_is_an_unused_library_version_makes_no_commit(project_repo, monkeypatch):
    """A fresh clone runs Phase 0's CPU gates in a new venv: sglang missing, another triton, another
    Python. Neither gate computes with them, so the same content hash and results are the same
    proof: nothing is written or committed, and the result says so."""
    ev = project_repo / "build" / "ev"
    run_phase(0, ev, root=project_repo, runner=FakeRunner(project_repo), no_venv=True, log=lambda s: None)
    start, before = _count(project_repo), _snapshot(project_repo)
    _versions_but(monkeypatch, sglang=None, triton="9.9.9", python="3.99.0")
    result = run_phase(0, ev, root=project_repo, runner=FakeRunner(project_repo), no_venv=True,
                       log=lambda s: None)
    assert json.loads((ev / "build.json").read_text())["versions"]["triton"] == "9.9.9"  # the record has it
    assert result.skipped and result.commit is None and result.unchanged == (0,)
    assert result.message.startswith("Phase 0 unchanged: the evidence proves the same content hash")
    assert _count(project_repo) == start and _snapshot(project_repo) == before


def test_phase0_on_another_version_of_a_library_its_gates_use_re_proves(project_repo, monkeypatch):
    """The build gate compiles with nvcc and the oracle self-test computes with torch: another
    version of either is another proof, recorded in a new commit that names it."""
    ev = project_repo / "build" / "ev"
    run_phase(0, ev, root=project_repo, runner=FakeRunner(project_repo), no_venv=True, log=lambda s: None)
    start = _count(project_repo)
    _versions_but(monkeypatch, nvcc="99.1 (V99.1.7)")
    result = run_phase(0, ev, root=project_repo, runner=FakeRunner(project_repo), no_venv=True,
                       log=lambda s: None)
    assert result.commit and _count(project_repo) == start + 1
    assert result.message.startswith("plans/0002: re-prove Phase 0 on ")
    state = plan.load_state(plan.plan_paths(project_repo)[0])
    assert state["phases"][0]["gates"][0]["evidence"]["versions"] == {"nvcc": "99.1 (V99.1.7)"}


def test_new_results_on_the_same_code_re_prove(project_repo, tmp_path):
    write_evidence(project_repo, tmp_path / "ev", 0)
    record_phase(0, tmp_path / "ev", root=project_repo)
    write_evidence(project_repo, tmp_path / "new", 0, headline="a better figure")
    result = record_phase(0, tmp_path / "new", root=project_repo)
    h = evidence.content_hash(project_repo)
    assert result.commit and git(project_repo, "log", "-1", "--format=%s").startswith(
        f"plans/0002: re-prove Phase 0 on {h[:8]}; remaining = kernel in isolation")
    assert "a better figure" in plan.plan_paths(project_repo)[1].read_text()


def test_one_recording_of_every_phase_is_one_commit(project_repo, tmp_path):
    ev = tmp_path / "ev"
    for n in range(6):
        write_evidence(project_repo, ev, n)
    (ev / "smoke.json").unlink()  # the GPU host has no server
    start = _count(project_repo)
    with pytest.raises(PipelineError, match="phase 4 needs phase.s. 3"):
        record(ev, root=project_repo)  # phase 3 is not complete; without --partial it is left out
    assert _count(project_repo) == start
    result = record(ev, root=project_repo, partial=True, override=True)
    assert _count(project_repo) == start + 1
    h = evidence.content_hash(project_repo)[:8]
    subject = result.message.splitlines()[0]
    assert subject == (f"plans/0002: mark Phase 0-2, 4-5 done on {h}, record Phase 3 (long-context "
                       f"performance + smoke) in progress on {h}; remaining = smoke")
    state = plan.load_state(plan.plan_paths(project_repo)[0])
    assert [p["status"] for p in state["phases"]] == ["done"] * 3 + ["in progress"] + ["done"] * 2
    assert state["phases"][4]["override_missing"] == [3]
    files = git(project_repo, "show", "--name-only", "--format=", "HEAD").split()
    assert all(f.startswith("plans/") for f in files)
    # the same folder again: nothing changed, nothing committed
    again = record(ev, root=project_repo, partial=True, override=True)
    assert again.skipped and again.unchanged == tuple(range(6)) and _count(project_repo) == start + 1


def test_partial_does_not_reopen_a_done_phase(project_repo, tmp_path):
    write_evidence(project_repo, tmp_path / "ev0", 0)
    record_phase(0, tmp_path / "ev0", root=project_repo)
    ev = tmp_path / "gpu"
    write_evidence(project_repo, ev, 1)  # build.json is there, oracle-selftest.json is not
    result = record(ev, root=project_repo, partial=True)
    assert any(n.startswith("phase 0: not recorded, it is done") for n in result.notes)
    state = plan.load_state(plan.plan_paths(project_repo)[0])
    assert state["phases"][0]["status"] == "done" and state["phases"][1]["status"] == "done"


def test_hand_edit_is_refused_and_kept(project_repo, tmp_path):
    write_evidence(project_repo, tmp_path / "ev", 0)
    record_phase(0, tmp_path / "ev", root=project_repo)
    md = plan.plan_paths(project_repo)[1]
    md.write_text(md.read_text().replace("| done |", "| done (checked by hand) |"))
    write_evidence(project_repo, tmp_path / "new", 0, headline="another figure")
    before = _snapshot(project_repo)
    for call in (lambda: record_phase(0, tmp_path / "new", root=project_repo),
                 lambda: render_plan(commit=True, root=project_repo)):
        with pytest.raises(PipelineError) as e:
            call()
        assert f"plans/{md.name} differs from what plans/{plan.PLAN_STEM}.state.json renders" in str(e.value)
        assert "edited by hand" in str(e.value) and "nothing was changed" in str(e.value)
        assert _snapshot(project_repo) == before
    assert "done (checked by hand)" in md.read_text()
    assert not list(md.parent.glob(".*.tmp"))


def test_template_change_is_not_a_hand_edit(project_repo, tmp_path):
    write_evidence(project_repo, tmp_path / "ev", 0)
    record_phase(0, tmp_path / "ev", root=project_repo)
    tpl = project_repo / "templates" / plan.TEMPLATE
    tpl.write_text(tpl.read_text() + "\nA new footer.\n")
    git(project_repo, "commit", "-qam", "template: footer")
    result = render_plan(commit=True, root=project_repo)
    assert result.commit and plan.plan_paths(project_repo)[1].read_text().endswith("A new footer.\n")


def test_stale_phase_is_shown_after_the_code_changes(project_repo, tmp_path):
    write_evidence(project_repo, tmp_path / "ev", 0)
    record_phase(0, tmp_path / "ev", root=project_repo)
    old = evidence.content_hash(project_repo)
    (project_repo / "csrc" / "kernel.cu").write_text("// faster\n")
    git(project_repo, "commit", "-qam", "kernel: faster")
    render_plan(commit=True, root=project_repo)
    md = plan.plan_paths(project_repo)[1].read_text()
    assert f"| {old[:12]} | no: re-prove |" in md
    new = evidence.content_hash(project_repo)
    assert f"Needs re-proving on {new[:12]}:" in md
    assert f"- Phase 0 (build + oracle baseline), proven on {old[:12]}: `invoke phase0`" in md


def test_recorded_plan_has_no_machine_local_path(project_repo, tmp_path):
    ev = tmp_path / "ev"
    for g in PHASES[0].gates:
        rec = evidence.make_record(g.gate, True, {"library": str(project_repo / "build" / "lib" / "k.so"),
                                                  "out_dir": str(tmp_path / "bench")},
                                   f"{g.stem} at {project_repo}/build", device=None, root=project_repo)
        evidence.write_record(rec, ev)
    record_phase(0, ev, root=project_repo)
    for p in plan.plan_paths(project_repo):
        text = p.read_text()
        assert str(tmp_path) not in text and str(project_repo) not in text
    assert "library = build/lib/k.so" in plan.plan_paths(project_repo)[1].read_text()


def test_bench_plots_are_committed_and_linked(project_repo, tmp_path):
    ev = tmp_path / "results" / "ev"
    write_evidence(project_repo, ev, 0)
    bench = tmp_path / "results" / "bench"  # as a GPU session packs them: beside ev/
    bench.mkdir()
    (bench / "micro-time.png").write_bytes(PNG + b"fake")
    rec = evidence.load_record(ev / "build.json")
    rec["details"] = {"files": {"png": ["/elsewhere/bench/micro-time.png", "/elsewhere/gone.png"]},
                      "markdown_table": "| case | us |\n|---|---|\n| a | 1 |"}
    evidence.write_record(rec, ev)
    result = record_phase(0, ev, root=project_repo)
    files = git(project_repo, "show", "--name-only", "--format=", "HEAD").split()
    assert f"plans/{plan.PLOTS_DIR}/micro-time.png" in files
    assert (project_repo / "plans" / plan.PLOTS_DIR / "micro-time.png").read_bytes() == PNG + b"fake"
    assert f"[micro-time.png]({plan.PLOTS_DIR}/micro-time.png)" in plan.plan_paths(project_repo)[1].read_text()
    assert f"plots: plans/{plan.PLOTS_DIR}/micro-time.png" in result.message
    assert "gone.png" not in result.message


def _png(path: Path, body: bytes = b"plot") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(PNG + body)
    return path


def test_find_plot_does_not_reach_deeper_than_the_sibling_folders(tmp_path):
    """A plot two levels under the evidence folder's parent (as an unrelated file
    anywhere under /tmp would be) is not the run's plot."""
    ev = tmp_path / "ev"
    ev.mkdir()
    _png(tmp_path / "a" / "b" / "micro-time.png", b"decoy")
    assert _find_plot("micro-time.png", [], ev) is None
    _png(ev / "sub" / "micro-time.png", b"decoy")  # nor under the evidence folder's own subfolders
    assert _find_plot("micro-time.png", [], ev) is None


def test_find_plot_finds_a_sibling_folders_plot(tmp_path):
    ev = tmp_path / "results" / "ev"
    ev.mkdir(parents=True)
    plot = _png(tmp_path / "results" / "bench" / "micro-time.png")
    _png(tmp_path / "results" / "bench" / "deeper" / "micro-time.png", b"decoy")
    assert _find_plot("micro-time.png", [], ev) == plot
    assert _find_plot("other.png", [], ev) is None


def test_find_plot_refuses_two_siblings_with_the_name(tmp_path):
    ev = tmp_path / "ev"
    ev.mkdir()
    one = _png(tmp_path / "bench" / "micro-time.png")
    two = _png(tmp_path / "bench2" / "micro-time.png")
    with pytest.raises(PipelineError, match="micro-time.png.*ambiguous") as e:
        _find_plot("micro-time.png", [], ev)
    assert str(one) in str(e.value) and str(two) in str(e.value)


def test_find_plot_refuses_a_file_that_is_not_a_png(tmp_path):
    ev = tmp_path / "ev"
    bench = tmp_path / "bench"
    bench.mkdir()
    ev.mkdir()
    (bench / "micro-time.png").write_bytes(b"\x89PNG fake")  # not the full signature
    with pytest.raises(PipelineError, match="micro-time.png.*not a PNG"):
        _find_plot("micro-time.png", [], ev)
    (ev / "micro-time.png").write_text("hello")
    with pytest.raises(PipelineError, match="not a PNG"):
        _find_plot("micro-time.png", [], ev)
    with pytest.raises(PipelineError, match="not a PNG"):  # a recorded path is checked too
        _find_plot("micro-time.png", [str(bench / "micro-time.png")], tmp_path / "empty")


def test_find_plot_prefers_the_evidence_folders_own_file(tmp_path):
    ev = tmp_path / "ev"
    own = _png(ev / "micro-time.png", b"own")
    _png(tmp_path / "bench" / "micro-time.png", b"sibling")
    _png(tmp_path / "bench2" / "micro-time.png", b"sibling")  # no ambiguity: ev/ wins first
    assert _find_plot("micro-time.png", [], ev) == own
    recorded = _png(tmp_path / "elsewhere" / "deep" / "micro-time.png", b"recorded")
    assert _find_plot("micro-time.png", [str(recorded)], ev) == recorded


def test_ambiguous_plot_refuses_the_record_before_a_file_is_touched(project_repo, tmp_path):
    ev = tmp_path / "results" / "ev"
    write_evidence(project_repo, ev, 0)
    _png(tmp_path / "results" / "bench" / "micro-time.png")
    _png(tmp_path / "results" / "bench-old" / "micro-time.png")
    rec = evidence.load_record(ev / "build.json")
    rec["details"] = {"files": {"png": ["/elsewhere/bench/micro-time.png"]}}
    evidence.write_record(rec, ev)
    before = _snapshot(project_repo)
    with pytest.raises(PipelineError, match="ambiguous"):
        record_phase(0, ev, root=project_repo)
    assert _snapshot(project_repo) == before
