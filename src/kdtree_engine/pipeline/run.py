"""Run a phase's gates through nox and record the phase from their evidence.

Data flows one way: gate -> evidence record -> plan state -> template ->
commit. :func:`run_phase` runs the gates in order (stopping at the first
failure) and then calls :func:`record_phase`, which is also what
``invoke phaseN --evidence DIR`` uses for evidence made on another machine.
Every refusal raises before the plan files are touched.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kdtree_engine.pipeline import commit as _commit
from kdtree_engine.pipeline import evidence, plan
from kdtree_engine.pipeline.phases import Gate, Phase, PhaseError, phase

#: A gate runner takes (gate, environment, no_venv) and returns the exit code.
GateRunner = Callable[[Gate, Mapping[str, str], bool], int]


class PipelineError(RuntimeError):
    """A phase was refused (exit code 2): bad input or a state that would make the
    record wrong. The message is one sentence saying what and why."""


class GateFailed(RuntimeError):
    """A gate failed or could not run (exit code 1); the phase stopped there."""


@dataclass(frozen=True)
class PhaseResult:
    """What a recorded phase left: the plan files, the commit (None when skipped or
    ``--no-commit``), and the commit message used."""

    phase: int | None  # None for a plain re-render
    state_path: Path
    plan_path: Path
    commit: str | None
    skipped: bool
    message: str


def nox_command(gate: Gate, *, no_venv: bool = False) -> list[str]:
    """``python -m nox -s <session> [--no-venv] [-- args]``."""
    return [sys.executable, "-m", "nox", *gate.nox_args(no_venv=no_venv)]


def nox_runner(root: Path) -> GateRunner:
    """The default runner: nox in ``root``, output straight to the terminal."""

    def run(gate: Gate, env: Mapping[str, str], no_venv: bool) -> int:
        try:
            return subprocess.run(nox_command(gate, no_venv=no_venv), cwd=root, env=dict(env)).returncode
        except OSError as e:
            print(f"kdtree: cannot start nox for gate {gate.stem}: {e}", file=sys.stderr)
            return 127

    return run


def no_venv_default() -> bool:
    """``KDTREE_NOX_NO_VENV=1`` makes every gate run with ``nox --no-venv``."""
    return os.environ.get("KDTREE_NOX_NO_VENV", "").strip().lower() in ("1", "true", "yes")


#: Everything that refuses a phase with one clear sentence (exit code 2).
REFUSALS: tuple[type[Exception], ...] = (
    PipelineError, PhaseError, plan.PlanError, _commit.CommitError, evidence.EvidenceError
)


def default_evidence_dir(root: Path, given: Path | str | None = None) -> Path:
    """``given``, else ``$KDTREE_EVIDENCE_DIR``, else ``<root>/build/evidence``."""
    if given is not None:
        return Path(given)
    env = os.environ.get("KDTREE_EVIDENCE_DIR")
    return Path(env) if env else root / "build" / "evidence"


def cuda_available() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:
        return False


def check_predecessors(state: dict[str, Any], p: Phase, override: bool) -> list[int]:
    """The earlier phases not done. Refuse unless ``override``; then return them so
    the plan records the override."""
    missing = [q["number"] for q in state["phases"][: p.number] if q["status"] != "done"]
    if missing and not override:
        names = ", ".join(f"{n} ({state['phases'][n]['title']})" for n in missing)
        raise PipelineError(
            f"phase {p.number} needs phase(s) {names} done first; record those, or pass "
            "--override to record it anyway (the plan will say so)"
        )
    return missing


def check_clean_sources(root: Path) -> str:
    """Refuse when src/ or csrc/ differ from HEAD (evidence would match no commit);
    return HEAD's commit."""
    repo = _commit.open_repo(root)
    if not repo.head.is_valid():
        raise PipelineError(f"{root} has no commit yet; commit the code before recording a phase")
    dirty = [d for d in evidence.HASHED_DIRS if repo.is_dirty(untracked_files=True, path=d)]
    if dirty:
        raise PipelineError(
            f"{' and '.join(d + '/' for d in dirty)} differ from HEAD "
            f"{repo.head.commit.hexsha[:12]}; commit or revert them first, since the "
            "evidence would match no commit"
        )
    return repo.head.commit.hexsha


def load_evidence(p: Phase, evidence_dir: Path, root: Path, *, allow_missing: bool = False
                  ) -> dict[str, dict[str, Any]]:
    """Load and check each gate's record: present, readable, passed, for that gate,
    made on the code of this tree (content hash). ``allow_missing`` skips gates
    with no record file (a partial record); a record that is there is still checked."""
    current = evidence.content_hash(root)
    records: dict[str, dict[str, Any]] = {}
    for g in p.gates:
        path = evidence_dir / f"{g.stem}.json"
        if not path.exists():
            if allow_missing:
                continue
            raise PipelineError(
                f"phase {p.number}: no evidence for gate {g.stem} (expected {path}); run "
                f"`nox -s {' '.join(g.nox_args()[1:])}` first"
            )
        rec = evidence.load_record(path)
        if rec["gate"] != g.gate or rec.get("variant") != g.variant:
            got = evidence.record_name(rec["gate"], rec.get("variant"))
            raise PipelineError(f"evidence file {path} is for gate {got!r}, expected {g.stem!r}")
        if not rec["passed"]:
            why = rec.get("reason") or rec.get("headline") or "no reason given"
            raise PipelineError(f"evidence file {path}: gate {g.stem} failed ({why})")
        got_hash = rec["code"]["content_hash"]
        if got_hash != current:
            raise PipelineError(
                f"evidence file {path} was made on code with content hash {got_hash}, but "
                f"src/ and csrc/ here hash to {current}; re-run the gate on this code"
            )
        records[g.stem] = rec
    return records


def record_phase(
    n: int | str,
    evidence_dir: Path | str | None = None,
    *,
    commit: bool = True,
    override: bool = False,
    partial: bool = False,
    root: Path | None = None,
) -> PhaseResult:
    """Record phase ``n`` as done from the evidence in ``evidence_dir``, re-render the
    plan and (when ``commit``) commit the plan files. ``partial`` records the gates
    whose evidence is there and marks the phase in progress while any is missing
    (e.g. the long-context bench of phase 3 on a host that cannot run the smoke)."""
    p = phase(n)
    root = (root or evidence.repo_root()).resolve()
    state_path, plan_path = plan.plan_paths(root)
    state = plan.load_state(state_path)
    missing = check_predecessors(state, p, override)
    head = check_clean_sources(root)
    if commit:
        _commit.preflight(root, [state_path, plan_path])
    ev_dir = default_evidence_dir(root, evidence_dir)
    records = load_evidence(p, ev_dir, root, allow_missing=partial)
    if not records:
        raise PipelineError(
            f"phase {p.number}: no evidence in {ev_dir} for any of its gates "
            f"({', '.join(g.stem for g in p.gates)}); nothing to record"
        )
    plan.mark_done(state, p.number, records, head, override_missing=missing)  # in progress if any is missing
    text = plan.render(state, root / "templates")
    message = plan.commit_message(state, p.number)
    result = _commit.write_and_commit(
        root, {state_path: plan.dump_state(state), plan_path: text}, message, commit=commit
    )
    return PhaseResult(p.number, state_path, plan_path, result.commit, result.skipped, message)


def run_phase(
    n: int | str,
    evidence_dir: Path | str | None = None,
    *,
    commit: bool = True,
    override: bool = False,
    no_venv: bool | None = None,
    root: Path | None = None,
    runner: GateRunner | None = None,
    has_cuda: Callable[[], bool] = cuda_available,
    log: Callable[[str], None] = print,
) -> PhaseResult:
    """Run phase ``n``'s gates in order through nox, stop at the first failure, and
    when all pass record the phase (:func:`record_phase`)."""
    p = phase(n)
    root = (root or evidence.repo_root()).resolve()
    ev_dir = default_evidence_dir(root, evidence_dir)
    no_venv = no_venv_default() if no_venv is None else no_venv
    state_path, plan_path = plan.plan_paths(root)
    # A gate that cannot run fails the phase; nothing else is worth checking then.
    if p.needs_gpu and not has_cuda():
        raise GateFailed(
            f"phase {p.number} needs a CUDA GPU (gates {', '.join(p.gpu_gates)}) and this "
            f"machine has none; run its gates on a GPU host and record them with "
            f"`invoke phase{p.number} --evidence DIR`"
        )
    # Refuse before spending time on gates whatever would refuse the record.
    check_predecessors(plan.load_state(state_path), p, override)
    check_clean_sources(root)
    if commit:
        _commit.preflight(root, [state_path, plan_path])
    runner = runner or nox_runner(root)
    env = {**os.environ, "KDTREE_EVIDENCE_DIR": str(ev_dir.resolve())}
    for g in p.gates:
        stale = ev_dir / f"{g.stem}.json"
        stale.unlink(missing_ok=True)  # a gate that writes nothing must not reuse old evidence
        log(f"kdtree: phase {p.number}: gate {g.stem}: nox {' '.join(g.nox_args(no_venv=no_venv))}")
        code = runner(g, env, no_venv)
        if code != 0:
            raise GateFailed(
                f"phase {p.number} stopped: gate {g.stem} failed (nox exit {code}); "
                "the plan was not changed"
            )
        if not stale.exists():
            raise GateFailed(
                f"phase {p.number} stopped: gate {g.stem} exited 0 but wrote no evidence "
                f"({stale}); the plan was not changed"
            )
    return record_phase(p.number, ev_dir, commit=commit, override=override, root=root)


def render_plan(*, commit: bool = False, root: Path | None = None) -> PhaseResult | None:
    """Re-render the plan from its state (``invoke plan``); commit it when asked."""
    root = (root or evidence.repo_root()).resolve()
    state_path, plan_path = plan.plan_paths(root)
    state = plan.load_state(state_path)
    text = plan.render(state, root / "templates")
    message = plan.commit_message(state)
    result = _commit.write_and_commit(
        root, {state_path: plan.dump_state(state), plan_path: text}, message, commit=commit
    )
    return PhaseResult(None, state_path, plan_path, result.commit, result.skipped, message)
