"""invoke tasks: ``invoke phase0`` .. ``invoke phase5``, ``invoke record``, ``invoke status``, ``invoke plan``.

Only orchestration lives here; the logic is in ``kdtree_pipeline``.
Settings come from invoke.yaml (overridable as ``INVOKE_KDTREE_*``).
A refusal exits 2 with one sentence; a failed gate exits 1.
"""

from __future__ import annotations

import shlex
import sys
from collections.abc import Mapping
from pathlib import Path

from invoke import Context, Exit, task

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT / "src"))  # kdtree_pipeline runs from the checkout; it is not installed

from kdtree_pipeline import plan as _plan  # noqa: E402
from kdtree_pipeline import run as _run  # noqa: E402
from kdtree_pipeline.phases import Gate  # noqa: E402

PHASE_HELP = {
    "evidence": "record from evidence made elsewhere (a folder of <gate>.json); runs no gate",
    "no_commit": "write the plan files but do not commit them",
    "override": "record even though earlier phases are not done (the plan says so)",
    "no_venv": "run the gates with `nox --no-venv` (a host that cannot make venvs)",
    "partial": "with --evidence: record the gates whose evidence is there; the phase stays in progress",
}


def _settings(c: Context) -> Mapping:
    return c.config.get("kdtree", {})


def _runner(c: Context) -> _run.GateRunner:
    """Run each gate with ``c.run`` so invoke's echo/hide settings apply."""

    def run(gate: Gate, env: Mapping[str, str], no_venv: bool) -> int:
        cmd = shlex.join(_run.nox_command(gate, no_venv=no_venv))
        return c.run(cmd, env=dict(env), replace_env=True, warn=True, pty=False).exited

    return run


def _phase(c: Context, n: int, evidence: str, no_commit: bool, override: bool, no_venv: bool,
           partial: bool = False) -> None:
    if partial and not evidence:
        raise Exit(f"invoke phase{n}: --partial records evidence made elsewhere; give it --evidence DIR", code=2)
    settings = _settings(c)
    commit = not no_commit and bool(settings.get("commit", True))
    no_venv = no_venv or bool(settings.get("nox_no_venv", False)) or _run.no_venv_default()
    try:
        if evidence:
            result = _run.record(Path(evidence), phases=[n], commit=commit, override=override,
                                 partial=partial, root=ROOT)
        else:  # the gates write to evidence.evidence_dir(): $KDTREE_EVIDENCE_DIR, else build/evidence
            result = _run.run_phase(
                n,
                commit=commit,
                override=override,
                no_venv=no_venv,
                root=ROOT,
                runner=_runner(c),
            )
    except _run.REFUSALS as e:
        raise Exit(f"invoke phase{n}: {e}", code=2) from None
    except _run.GateFailed as e:
        raise Exit(f"invoke phase{n}: {e}", code=1) from None
    _report(result, commit)


def _report(result: _run.PhaseResult, commit: bool) -> None:
    for note in result.notes:
        print(note)
    subject = result.message.splitlines()[0]
    if result.commit:
        print(f"committed {result.commit[:12]}: {subject}")
    elif result.skipped and result.unchanged:
        print(result.message)
    elif result.skipped:
        print(f"plan unchanged, nothing to commit ({subject})")
    elif not commit:
        print(f"wrote {result.plan_path.relative_to(ROOT)} (not committed): {subject}")


@task(help=PHASE_HELP, auto_shortflags=False)
def phase0(c: Context, evidence: str = "", no_commit: bool = False, override: bool = False,
           no_venv: bool = False, partial: bool = False) -> None:
    """Phase 0, build + oracle baseline: gates build, oracle-selftest (CPU)."""
    _phase(c, 0, evidence, no_commit, override, no_venv, partial)


@task(help=PHASE_HELP, auto_shortflags=False)
def phase1(c: Context, evidence: str = "", no_commit: bool = False, override: bool = False,
           no_venv: bool = False, partial: bool = False) -> None:
    """Phase 1, kernel in isolation: gates build, oracle, bench --suite micro (GPU)."""
    _phase(c, 1, evidence, no_commit, override, no_venv, partial)


@task(help=PHASE_HELP, auto_shortflags=False)
def phase2(c: Context, evidence: str = "", no_commit: bool = False, override: bool = False,
           no_venv: bool = False, partial: bool = False) -> None:
    """Phase 2, SGLang integration: gates oracle, integrate (GPU)."""
    _phase(c, 2, evidence, no_commit, override, no_venv, partial)


@task(help=PHASE_HELP, auto_shortflags=False)
def phase3(c: Context, evidence: str = "", no_commit: bool = False, override: bool = False,
           no_venv: bool = False, partial: bool = False) -> None:
    """Phase 3, long-context performance + smoke: gates bench --suite long-context, smoke (GPU)."""
    _phase(c, 3, evidence, no_commit, override, no_venv, partial)


@task(help=PHASE_HELP, auto_shortflags=False)
def phase4(c: Context, evidence: str = "", no_commit: bool = False, override: bool = False,
           no_venv: bool = False, partial: bool = False) -> None:
    """Phase 4, CUDA-graph safety: gate graph (GPU)."""
    _phase(c, 4, evidence, no_commit, override, no_venv, partial)


@task(help=PHASE_HELP, auto_shortflags=False)
def phase5(c: Context, evidence: str = "", no_commit: bool = False, override: bool = False,
           no_venv: bool = False, partial: bool = False) -> None:
    """Phase 5, KV defrag: gate defrag (GPU)."""
    _phase(c, 5, evidence, no_commit, override, no_venv, partial)


@task(help={
    "evidence": "folder of <gate>.json records made elsewhere (required)",
    "no_commit": PHASE_HELP["no_commit"],
    "override": PHASE_HELP["override"],
    "partial": "also record a phase not yet done that has evidence for some of its gates (in progress)",
}, auto_shortflags=False)
def record(c: Context, evidence: str = "", no_commit: bool = False, override: bool = False,
           partial: bool = False) -> None:
    """Record every phase whose evidence is in --evidence DIR, in one commit; runs no gate."""
    if not evidence:
        raise Exit("invoke record: give the folder of evidence records with --evidence DIR", code=2)
    commit = not no_commit and bool(_settings(c).get("commit", True))
    try:
        result = _run.record(Path(evidence), commit=commit, override=override, partial=partial, root=ROOT)
    except _run.REFUSALS as e:
        raise Exit(f"invoke record: {e}", code=2) from None
    _report(result, commit)


@task
def status(c: Context) -> None:
    """Show the phases and gates of the plan, and which need re-proving on this code (read-only)."""
    try:
        state = _plan.load_state(_plan.plan_paths(ROOT)[0])
        head, note = _run.here_content_hash(ROOT)
    except _run.REFUSALS as e:
        raise Exit(f"invoke status: {e}", code=2) from None
    print(_plan.status_table(state, head, note), end="")


@task(help={"commit": "commit the re-rendered plan files (only those)"})
def plan(c: Context, commit: bool = False) -> None:
    """Re-render the plan markdown from its state file; --commit to commit it."""
    try:
        result = _run.render_plan(commit=commit, root=ROOT)
    except _run.REFUSALS as e:
        raise Exit(f"invoke plan: {e}", code=2) from None
    _report(result, commit)
