"""The invoke tasks as a user runs them: `invoke ...` in a temporary copy of the
project (a real git repository) whose stand-in noxfile writes evidence."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kdtree_pipeline import evidence, plan


def git(repo: Path, *args: str) -> str:
    """Run a real git command in ``repo`` and return its stdout."""
    return subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True,
                          check=True).stdout


def invoke(root: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "KDTREE_NOX_NO_VENV": "1", **env}
    return subprocess.run([sys.executable, "-m", "invoke", *args], cwd=root, env=full_env,
                          capture_output=True, text=True, timeout=180)


def _snapshot(root: Path) -> tuple[str, str, dict[str, bytes | None]]:
    files = {p.name: (p.read_bytes() if p.exists() else None) for p in plan.plan_paths(root)}
    return git(root, "rev-parse", "HEAD"), git(root, "status", "--porcelain"), files


def test_invoke_phase0_records_one_commit_touching_only_plans(project_repo):
    head = git(project_repo, "rev-parse", "HEAD").strip()
    out = invoke(project_repo, "phase0")
    assert out.returncode == 0, out.stderr
    assert git(project_repo, "rev-list", "--count", f"{head}..HEAD").strip() == "1"
    files = git(project_repo, "show", "--name-only", "--format=", "HEAD").split()
    assert files and all(f.startswith("plans/") for f in files)
    subject = git(project_repo, "log", "-1", "--format=%s").strip()
    h = evidence.content_hash(project_repo)
    assert subject.startswith(f"plans/0002: mark Phase 0 (build + oracle baseline) done on {h[:8]}; "
                              "remaining = kernel in isolation")
    assert f"committed {git(project_repo, 'rev-parse', 'HEAD')[:12]}" in out.stdout
    assert (project_repo / "build" / "evidence" / "oracle-selftest.json").exists()
    # invoke status reads the recorded plan and changes nothing.
    before = _snapshot(project_repo)
    status = invoke(project_repo, "status")
    assert status.returncode == 0
    assert "0 build + oracle baseline" in status.stdout and "done" in status.stdout
    assert "oracle-selftest     pass    oracle-selftest fine" in status.stdout
    assert "needs re-proving: none" in status.stdout
    assert _snapshot(project_repo) == before
    # the same phase again: same content hash, same results -> no commit, and it says so
    again = invoke(project_repo, "phase0")
    assert again.returncode == 0, again.stderr
    assert git(project_repo, "rev-list", "--count", f"{head}..HEAD").strip() == "1"
    assert f"Phase 0 unchanged: the evidence proves the same content hash ({h[:12]})" in again.stdout
    assert _snapshot(project_repo) == before


def test_invoke_phase0_gates_write_where_the_variable_says(project_repo, tmp_path):
    ev = tmp_path / "elsewhere"
    out = invoke(project_repo, "phase0", "--no-commit", KDTREE_EVIDENCE_DIR=str(ev))
    assert out.returncode == 0, out.stderr
    assert sorted(p.name for p in ev.iterdir()) == ["build.json", "oracle-selftest.json"]
    assert not (project_repo / "build" / "evidence").exists()


def test_invoke_status_lists_stale_phases(project_repo):
    assert invoke(project_repo, "phase0").returncode == 0
    old = evidence.content_hash(project_repo)
    (project_repo / "csrc" / "kernel.cu").write_text("// new kernel\n")
    git(project_repo, "commit", "-qam", "new kernel")
    status = invoke(project_repo, "status")
    assert status.returncode == 0, status.stderr
    new = evidence.content_hash(project_repo)
    assert f"content hash of src/ and csrc/ here: {new[:12]} (HEAD)" in status.stdout
    assert f"needs re-proving: Phase 0 (build + oracle baseline, proven on {old[:12]})" in status.stdout


def test_invoke_record_one_commit_and_hand_edit_refused(project_repo, tmp_path):
    ev = tmp_path / "ev"
    for gate in ("build", "oracle-selftest"):
        evidence.write_record(evidence.make_record(gate, True, {}, f"{gate} ok", device=None,
                                                   root=project_repo), ev)
    assert invoke(project_repo, "record").returncode == 2
    head = git(project_repo, "rev-parse", "HEAD").strip()
    out = invoke(project_repo, "record", "--evidence", str(ev))
    assert out.returncode == 0, out.stderr
    assert git(project_repo, "rev-list", "--count", f"{head}..HEAD").strip() == "1"
    md = plan.plan_paths(project_repo)[1]
    md.write_text(md.read_text() + "my note\n")
    evidence.write_record(evidence.make_record("build", True, {}, "build better", device=None,
                                               root=project_repo), ev)
    before = _snapshot(project_repo)
    out = invoke(project_repo, "record", "--evidence", str(ev))
    assert out.returncode == 2
    assert f"plans/{md.name} differs from what" in out.stderr and "edited by hand" in out.stderr
    assert _snapshot(project_repo) == before and md.read_text().endswith("my note\n")


def test_invoke_phase0_failed_gate_exits_nonzero_and_changes_nothing(project_repo):
    before = _snapshot(project_repo)
    out = invoke(project_repo, "phase0", FAIL_GATE="oracle-selftest")
    assert out.returncode == 1
    assert "gate oracle-selftest failed" in out.stderr
    assert _snapshot(project_repo) == before


def test_invoke_phase1_on_cpu_needs_a_gpu(project_repo):
    import torch

    if torch.cuda.is_available():
        pytest.skip("checks the no-GPU refusal")
    before = _snapshot(project_repo)
    out = invoke(project_repo, "phase1")
    assert out.returncode != 0
    assert "phase 1 needs a CUDA GPU" in out.stderr
    assert _snapshot(project_repo) == before


def test_invoke_evidence_with_wrong_hash(project_repo, tmp_path):
    rec = evidence.make_record("build", True, {}, "built", device=None, root=project_repo)
    rec["code"]["content_hash"] = "f" * 64
    evidence.write_record(rec, tmp_path / "ev")
    before = _snapshot(project_repo)
    out = invoke(project_repo, "phase0", "--evidence", str(tmp_path / "ev"))
    assert out.returncode == 2
    assert "f" * 64 in out.stderr and evidence.content_hash(project_repo) in out.stderr
    assert _snapshot(project_repo) == before


def test_invoke_partial_needs_evidence_and_records_what_is_there(project_repo, tmp_path):
    before = _snapshot(project_repo)
    out = invoke(project_repo, "phase0", "--partial")
    assert out.returncode == 2 and "--partial records evidence made elsewhere" in out.stderr
    assert _snapshot(project_repo) == before
    rec = evidence.make_record("build", True, {}, "built", device=None, root=project_repo)
    evidence.write_record(rec, tmp_path / "ev")
    out = invoke(project_repo, "phase0", "--evidence", str(tmp_path / "ev"), "--partial")
    assert out.returncode == 0, out.stderr
    assert "record Phase 0 (build + oracle baseline) in progress on" in out.stdout
    assert "| 0 | build + oracle baseline | in progress |" in plan.plan_paths(project_repo)[1].read_text()


def test_invoke_unknown_phase(project_repo):
    out = invoke(project_repo, "phase9")
    assert out.returncode != 0 and "phase9" in out.stderr


def test_invoke_plan_with_failing_hook(project_repo):
    hook = project_repo / ".git" / "hooks" / "pre-commit"
    hook.parent.mkdir(exist_ok=True)
    hook.write_text("#!/bin/sh\necho 'no plans today' >&2\nexit 1\n")
    hook.chmod(0o755)
    before = _snapshot(project_repo)
    out = invoke(project_repo, "plan", "--commit")
    assert out.returncode == 2
    assert "hook pre-commit failed (exit 1)" in out.stderr and "no plans today" in out.stderr
    assert _snapshot(project_repo) == before


def test_invoke_plan_without_commit_then_phase0_no_commit(project_repo):
    head = git(project_repo, "rev-parse", "HEAD")
    assert invoke(project_repo, "plan").returncode == 0
    md = plan.plan_paths(project_repo)[1]
    assert md.read_text().startswith("# Plan 0002:")
    out = invoke(project_repo, "phase0", "--no-commit")
    assert out.returncode == 0, out.stderr
    assert "(not committed)" in out.stdout
    assert "| 0 | build + oracle baseline | done |" in md.read_text()
    assert git(project_repo, "rev-parse", "HEAD") == head
