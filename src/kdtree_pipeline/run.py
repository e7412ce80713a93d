"""Run a phase's gates through nox and record the phase from their evidence.

Data flows one way: gate -> evidence record -> plan state -> template ->
commit. :func:`run_phase` runs the gates in order (stopping at the first
failure) and then calls :func:`record_phase`, which is also what
``invoke phaseN --evidence DIR`` uses for evidence made on another machine.
Every refusal raises before the plan files are touched.
"""

from __future__ import annotations

import contextlib
import copy
import os
import subprocess
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kdtree_pipeline import commit as _commit
from kdtree_pipeline import evidence, plan
from kdtree_pipeline.phases import PHASES, Gate, Phase, PhaseError, all_gate_stems, phase

#: A gate runner takes (gate, environment, no_venv) and returns the exit code.
GateRunner = Callable[[Gate, Mapping[str, str], bool], int]


class PipelineError(RuntimeError):
    """A phase was refused (exit code 2): bad input or a state that would make the
    record wrong. The message is one sentence saying what and why."""


class GateFailed(RuntimeError):
    """A gate failed or could not run (exit code 1); the phase stopped there."""


@dataclass(frozen=True)
class PhaseResult:
    """What a recording left: the plan files, the commit (None when skipped or
    ``--no-commit``), and the commit message used."""

    phase: int | None  # the one phase recorded; None for several, or a plain re-render
    state_path: Path
    plan_path: Path
    commit: str | None
    skipped: bool  # nothing to commit
    message: str  # the commit message, or (skipped) why nothing changed
    unchanged: tuple[int, ...] = ()  # phases whose new evidence repeated the record
    notes: tuple[str, ...] = ()  # phases with evidence that were left alone, and why


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


def here_content_hash(root: Path) -> tuple[str, str]:
    """(content hash of src/ and csrc/ here, a note when they differ from HEAD)."""
    h = evidence.content_hash(root)
    try:
        check_clean_sources(root)
    except (PipelineError, _commit.CommitError) as e:
        return h, f" (working tree, not HEAD: {str(e).split(';')[0]})"
    return h, " (HEAD)"


def check_library(path: Path, rec: dict[str, Any]) -> None:
    """A GPU gate's record proves this tree's code only if the kernel library it ran was built
    from this tree's csrc/ (its ``library`` provenance, evidence.make_record): a variant
    (a hand-built library named by KDTREE_LIB), a build of older sources or an unstamped file is
    refused, naming the library and why."""
    lib = rec.get("library")
    if not isinstance(lib, dict):
        raise PipelineError(
            f"evidence file {path}: it does not say which kernel library the {rec['gate']} gate ran "
            "(made before records named it); re-run the gate on this code"
        )
    if lib.get("matches") is not True:
        raise PipelineError(
            f"evidence file {path}: the {rec['gate']} gate ran the kernel library {lib.get('path')}, which "
            f"this tree's csrc/ did not build ({lib.get('why') or 'no reason recorded'}); build it with "
            "`python -m kdtree_pipeline build` and re-run the gate, without KDTREE_LIB"
        )


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
        if g.needs_gpu:
            check_library(path, rec)
        records[g.stem] = rec
    return records


@dataclass(frozen=True)
class Selection:
    """Which phases a recording takes from an evidence folder, their records, and
    a sentence for each phase with evidence there that it leaves alone."""

    records: dict[int, dict[str, dict[str, Any]]]
    skipped: list[str]


def _present(p: Phase, evidence_dir: Path) -> list[str]:
    """The stems of the phase's gates that have a record in the folder."""
    return [g.stem for g in p.gates if (evidence_dir / f"{g.stem}.json").exists()]


def _take_incomplete(p: Phase, present: list[str], state: dict[str, Any], partial: bool) -> tuple[bool, str | None]:
    """Whether a phase with records for only some of its gates (``present``) is recorded from
    the folder (``partial``, and the phase is not done), and when it has some but is not, why."""
    if not present:
        return False, None
    lacking = ", ".join(f"{g.stem}.json" for g in p.gates if g.stem not in present)
    if not partial:
        return False, f"phase {p.number}: not recorded, {lacking} missing (--partial records part of a phase)"
    if state["phases"][p.number]["status"] == "done":
        return False, (f"phase {p.number}: not recorded, it is done and {lacking} missing here "
                       "(--partial does not reopen a done phase; name it to do so)")
    return True, None


def _load_some(p: Phase, evidence_dir: Path, root: Path, partial: bool) -> dict[str, dict[str, Any]]:
    """:func:`load_evidence`, refusing a phase none of whose gates has a record there."""
    records = load_evidence(p, evidence_dir, root, allow_missing=partial)
    if not records:
        raise PipelineError(
            f"phase {p.number}: no evidence in {evidence_dir} for any of its gates "
            f"({', '.join(g.stem for g in p.gates)}); nothing to record"
        )
    return records


def select_evidence(evidence_dir: Path, root: Path, state: dict[str, Any], *,
                    phases: list[int] | None = None, partial: bool = False) -> Selection:
    """``phases`` given: exactly those (every gate's record required unless ``partial``).
    Otherwise every phase all of whose gates have a record in the folder, and with
    ``partial`` also a phase not yet done that has some of them (a done phase is
    not reopened by part of its evidence)."""
    chosen: dict[int, dict[str, dict[str, Any]]] = {}
    skipped: list[str] = []
    for n in phases if phases is not None else [p.number for p in PHASES]:
        p = phase(n)
        present = _present(p, evidence_dir)
        if phases is None and len(present) < len(p.gates):
            take, why = _take_incomplete(p, present, state, partial)
            skipped += [why] if why else []
            if not take:
                continue
        chosen[n] = _load_some(p, evidence_dir, root, partial)
    if not chosen:
        stems = ", ".join(f"{s}.json" for s in all_gate_stems())
        why = "; ".join(skipped) if skipped else f"none of {stems} is there"
        raise PipelineError(f"no phase to record from {evidence_dir}: {why}")
    return Selection(chosen, skipped)


PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _checked_png(name: str, path: Path) -> Path:
    """``path``, or a refusal when it does not start with the PNG signature."""
    with path.open("rb") as f:
        head = f.read(len(PNG_SIGNATURE))
    if head != PNG_SIGNATURE:
        raise PipelineError(
            f"plot {name}: {path} is not a PNG (it does not start with the PNG signature); "
            f"refusing to commit it as a plot"
        )
    return path


def _find_plot(name: str, recorded: list[str], evidence_dir: Path) -> Path | None:
    """A bench plot: where the gate wrote it (``recorded``) when that is on this
    machine, else ``evidence_dir/<name>``, else ``<name>`` in a sibling folder one
    level deep (``evidence_dir.parent/*/<name>``, as a GPU session packs ``ev/``
    and ``bench/``). Nothing deeper is searched: with the evidence in /tmp, a glob
    under the parent reached unrelated files. None when nothing matches; a
    :class:`PipelineError` when two siblings both hold ``<name>`` (ambiguous) or
    the match is not a PNG."""
    for p in recorded:
        if Path(p).name == name and Path(p).is_file():
            return _checked_png(name, Path(p))
    own = evidence_dir / name
    if own.is_file():
        return _checked_png(name, own)
    here = evidence_dir.resolve()
    found = evidence_dir.parent.glob(f"*/{name}") if evidence_dir.parent.is_dir() else []
    siblings = sorted(c for c in found if c.is_file() and c.parent.resolve() != here)
    if len(siblings) > 1:
        raise PipelineError(
            f"plot {name}: more than one sibling folder of {evidence_dir} holds it "
            f"({', '.join(str(c) for c in siblings)}); ambiguous, so nothing was recorded. "
            f"Keep one, or put the right one in {evidence_dir}"
        )
    return _checked_png(name, siblings[0]) if siblings else None


def _plots(records: dict[str, dict[str, Any]], evidence_dir: Path) -> dict[str, dict[str, Path]]:
    """stem -> {plot name: file found} for the gates that list plots."""
    out: dict[str, dict[str, Path]] = {}
    for stem, rec in records.items():
        files = (rec.get("details") or {}).get("files") or {}
        pngs = [str(x) for x in files.get("png") or []] if isinstance(files, dict) else []
        found = {Path(x).name: _find_plot(Path(x).name, pngs, evidence_dir) for x in pngs}
        out[stem] = {k: v for k, v in found.items() if v is not None}
    return out


def check_not_hand_edited(root: Path, state: dict[str, Any]) -> None:
    """Refuse when the plan markdown was edited by hand (see :func:`plan.hand_edited`)."""
    _state_path, plan_path = plan.plan_paths(root)
    text = plan_path.read_text() if plan_path.exists() else None
    committed = None
    if text is not None and not state.get("markdown_sha256"):
        with contextlib.suppress(Exception):
            repo = _commit.open_repo(root)
            committed = repo.git.show(f"HEAD:{plan.rel_paths()[1]}", strip_newline_in_stdout=False)
    if plan.hand_edited(state, text, root / "templates", committed):
        md, st = plan.rel_paths()[1], plan.rel_paths()[0]
        raise PipelineError(
            f"{md} differs from what {st} renders, so it was edited by hand and recording "
            f"would overwrite the edit; nothing was changed. Put the change in "
            f"templates/{plan.TEMPLATE} (or the state), or restore the file with "
            f"`git checkout -- {md}`, then record again"
        )


def _name_plots(entry: dict[str, Any], found: dict[str, dict[str, Path]]) -> None:
    """Put the names of the plots found for each gate (:func:`_plots`) in its summary."""
    for g in entry["gates"]:
        if g["evidence"] is not None:
            g["evidence"]["plots"] = sorted(found.get(g["name"], {}))


def _unchanged_message(before: dict[str, Any], unchanged: list[int]) -> str:
    done = ", ".join(f"Phase {n}" for n in unchanged)
    hashes = sorted({h[:12] for n in unchanged for h in plan.phase_hashes(before["phases"][n])})
    return (f"{done} unchanged: the evidence proves the same content hash "
            f"({', '.join(hashes)}) with the same results as recorded; nothing to commit")


def record(
    evidence_dir: Path | str | None = None,
    *,
    phases: list[int] | None = None,
    commit: bool = True,
    override: bool = False,
    partial: bool = False,
    root: Path | None = None,
) -> PhaseResult:
    """Record, in one commit, every phase whose evidence is in ``evidence_dir`` (or
    just ``phases``), re-render the plan and (when ``commit``) commit the plan
    files and the plots they link. A phase whose new evidence repeats the recorded
    results on the same content hash is left as it was; when that is every phase,
    nothing is written or committed (``skipped``). Every refusal comes before a
    file is touched."""
    root = (root or evidence.repo_root()).resolve()
    state_path, plan_path = plan.plan_paths(root)
    before = plan.load_state(state_path)
    check_clean_sources(root)
    if commit:
        _commit.preflight(root, [state_path, plan_path])
    check_not_hand_edited(root, before)
    ev_dir = Path(evidence_dir) if evidence_dir is not None else evidence.evidence_dir(root)
    sel = select_evidence(ev_dir, root, before, phases=phases, partial=partial)
    after = copy.deepcopy(before)
    after["head_content_hash"] = evidence.content_hash(root)
    changes: list[plan.Change] = []
    unchanged: list[int] = []
    figures: dict[Path, bytes] = {}
    for n, records in sorted(sel.records.items()):
        missing = check_predecessors(after, phase(n), override)
        plan.mark_done(after, n, records, override_missing=missing)  # in progress if any is missing
        found = _plots(records, ev_dir)
        _name_plots(after["phases"][n], found)
        if plan.keep_unchanged(before, after, n):
            unchanged.append(n)
            continue
        changes.append(plan.change_of(before, after, n))
        figures.update({plan_path.parent / plan.PLOTS_DIR / name: src.read_bytes()
                        for files in found.values() for name, src in files.items()})
    notes = tuple(sel.skipped)
    if not changes:
        return PhaseResult(phases[0] if phases and len(phases) == 1 else None, state_path, plan_path,
                           None, True, _unchanged_message(before, unchanged), tuple(unchanged), notes)
    message = plan.commit_message(after, changes, unchanged)
    state_text, md_text = plan.render_files(after, root / "templates")
    result = _commit.write_and_commit(
        root, {state_path: state_text, plan_path: md_text, **figures}, message, commit=commit
    )
    return PhaseResult(changes[0].number if len(changes) == 1 else None, state_path, plan_path,
                       result.commit, result.skipped, message, tuple(unchanged), notes)


def record_phase(
    n: int | str,
    evidence_dir: Path | str | None = None,
    *,
    commit: bool = True,
    override: bool = False,
    partial: bool = False,
    root: Path | None = None,
) -> PhaseResult:
    """Record phase ``n`` from the evidence in ``evidence_dir`` (:func:`record` of that
    phase alone). ``partial`` records the gates whose evidence is there and marks
    the phase in progress while any is missing (e.g. the long-context bench of
    phase 3 on a host that cannot run the smoke)."""
    return record(evidence_dir, phases=[phase(n).number], commit=commit, override=override,
                  partial=partial, root=root)


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
    ev_dir = Path(evidence_dir) if evidence_dir is not None else evidence.evidence_dir(root)
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
    state = plan.load_state(state_path)
    check_predecessors(state, p, override)
    check_clean_sources(root)
    if commit:
        _commit.preflight(root, [state_path, plan_path])
    check_not_hand_edited(root, state)
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


def render_plan(*, commit: bool = False, root: Path | None = None) -> PhaseResult:
    """Re-render the plan from its state (``invoke plan``), with staleness against the
    content hash of src/ and csrc/ here; commit it when asked. Refuses a
    hand-edited plan, as recording does."""
    root = (root or evidence.repo_root()).resolve()
    state_path, plan_path = plan.plan_paths(root)
    state = plan.load_state(state_path)
    if commit:
        check_clean_sources(root)
        _commit.preflight(root, [state_path, plan_path])
    check_not_hand_edited(root, state)
    state["head_content_hash"] = evidence.content_hash(root)
    message = plan.commit_message(state)
    state_text, md_text = plan.render_files(state, root / "templates")
    result = _commit.write_and_commit(
        root, {state_path: state_text, plan_path: md_text}, message, commit=commit
    )
    return PhaseResult(None, state_path, plan_path, result.commit, result.skipped, message)
