"""Plan commits with GitPython in real temporary repositories (no mocked git)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from kdtree_pipeline import plan
from kdtree_pipeline.commit import CommitError, write_and_commit
from kdtree_pipeline.run import render_plan


def git(repo: Path, *args: str) -> str:
    """Run a real git command in ``repo`` and return its stdout."""
    return subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True,
                          check=True).stdout


def _snapshot(root: Path) -> tuple[str, str, str, dict[str, bytes | None]]:
    """HEAD, git status, the staged index, and the plan files' bytes."""
    files = {p.name: (p.read_bytes() if p.exists() else None) for p in plan.plan_paths(root)}
    return (git(root, "rev-parse", "HEAD"), git(root, "status", "--porcelain"),
            git(root, "ls-files", "-s"), files)


def _changed_in_head(root: Path) -> list[str]:
    return git(root, "show", "--name-only", "--format=", "HEAD").split()


def test_commits_only_the_plan_files(project_repo):
    root = project_repo
    (root / "README.md").write_text("edited, not staged\n")
    (root / "scratch.txt").write_text("untracked\n")
    result = render_plan(commit=True, root=root)
    assert result.commit == git(root, "rev-parse", "HEAD").strip()
    assert sorted(_changed_in_head(root)) == [
        "plans/0002-sm120-verify-kernel-defrag.md",
        "plans/0002-sm120-verify-kernel-defrag.state.json",
    ]
    assert git(root, "log", "-1", "--format=%s").strip() == plan.commit_subject(plan.new_state())
    status = git(root, "status", "--porcelain")
    assert " M README.md" in status and "?? scratch.txt" in status


def test_noop_render_is_skipped(project_repo):
    first = render_plan(commit=True, root=project_repo)
    head = git(project_repo, "rev-parse", "HEAD")
    second = render_plan(commit=True, root=project_repo)
    assert first.commit and second.commit is None and second.skipped
    assert git(project_repo, "rev-parse", "HEAD") == head


def test_refuses_detached_head(project_repo):
    git(project_repo, "checkout", "-q", "--detach")
    before = _snapshot(project_repo)
    with pytest.raises(CommitError, match="HEAD is detached"):
        render_plan(commit=True, root=project_repo)
    assert _snapshot(project_repo) == before


def test_refuses_other_staged_changes(project_repo):
    (project_repo / "README.md").write_text("staged change\n")
    git(project_repo, "add", "README.md")
    before = _snapshot(project_repo)
    with pytest.raises(CommitError, match=r"other changes are staged \(README.md\)"):
        render_plan(commit=True, root=project_repo)
    assert _snapshot(project_repo) == before


@pytest.mark.parametrize("existing", [False, True], ids=["new-plan", "existing-plan"])
def test_failed_hook_leaves_plan_and_history(project_repo, existing):
    root = project_repo
    if existing:
        render_plan(commit=True, root=root)
        state = plan.load_state(plan.plan_paths(root)[0])
        state["phases"][4]["status"] = "in progress"
        plan.save_state(state, plan.plan_paths(root)[0])
        git(root, "commit", "-q", "-am", "hand edit of the state")
    hook = root / ".git" / "hooks" / "pre-commit"
    hook.parent.mkdir(exist_ok=True)
    hook.write_text("#!/bin/sh\necho 'plan rejected by policy' >&2\nexit 1\n")
    hook.chmod(0o755)
    before = _snapshot(root)
    with pytest.raises(CommitError, match=r"hook pre-commit failed \(exit 1\).*: plan rejected by policy$"):
        render_plan(commit=True, root=root)
    assert _snapshot(root) == before


def test_failure_after_write_restores_files(project_repo):
    """A git error (here: the plan folder is a file, so nothing can be written)
    surfaces as CommitError and leaves everything as it was."""
    (project_repo / "plans").write_text("not a folder\n")
    before = _snapshot(project_repo)
    with pytest.raises(CommitError):
        write_and_commit(project_repo, {project_repo / "plans" / "x.md": "x\n"}, "msg")
    assert _snapshot(project_repo) == before
    assert (project_repo / "plans").read_text() == "not a folder\n"


def test_template_error_changes_nothing(project_repo):
    render_plan(commit=True, root=project_repo)
    (project_repo / "templates" / "plan.md.j2").write_text("{{ phases }} {{ undefined_thing }}\n")
    before = _snapshot(project_repo)
    with pytest.raises(plan.PlanError, match="undefined_thing"):
        render_plan(commit=True, root=project_repo)
    assert _snapshot(project_repo) == before
