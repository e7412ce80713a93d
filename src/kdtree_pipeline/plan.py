"""Plan state (JSON beside the plan) and its rendering to markdown with jinja2.

The state holds, per phase, its status, date, GPU, whether it was recorded
with ``--override``, and per gate a summary of its evidence (docs/design.md
section 7). It also holds the content hash of ``src/`` and ``csrc/`` at the
last recording (``head_content_hash``), against which the plan says which
phases are current, and the sha256 of the markdown it rendered
(``markdown_sha256``), by which a hand edit of the markdown is told from a
template change. The markdown is a pure function of the state and the
template: no wall clock, so the same state renders to the same bytes.

Nothing machine-local goes in: absolute paths in metrics become relative to
the repository the gate ran in, or are left out.
"""

from __future__ import annotations

import copy
import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2

from kdtree_pipeline import evidence
from kdtree_pipeline.phases import PHASES, Phase, versions_used

PLAN_ID = "0002"
PLAN_STEM = "0002-sm120-verify-kernel-defrag"
PLAN_TITLE = "Tree-verify MLA kernel (sm_120 first), SGLang integration, KV defrag"
TEMPLATE = "plan.md.j2"
#: Folder beside the plan holding the bench plots its commits link (plans/<this>/).
PLOTS_DIR = f"{PLAN_ID}-figures"
#: 2: no per-phase ``code_commit`` (the evidence's commit is the one commit shown),
#: ``head_content_hash`` and ``markdown_sha256``. A schema-1 state is read and upgraded.
STATE_SCHEMA = 2
READABLE_SCHEMAS = (1, 2)
STATUSES = ("todo", "in progress", "done", "failed")
MAX_KEY_METRICS = 8
#: Metrics that describe the run rather than what it proved (how long it took,
#: whether it recompiled, where it wrote its report): a difference in these alone
#: never makes a phase "changed".
RUN_METRICS = frozenset({"seconds", "rebuilt", "out_dir"})
#: Summary fields that say when and from which commit, not what was proven.
RUN_FIELDS = frozenset({"time_utc", "commit", "library"})  # a rebuild of the same sources is the same result


class PlanError(ValueError):
    """The plan state or template is unusable; the message says which file and why."""


def plan_paths(root: Path | None = None) -> tuple[Path, Path]:
    """(state file, rendered markdown) under ``<root>/plans``."""
    root = root or evidence.repo_root()
    return root / "plans" / f"{PLAN_STEM}.state.json", root / "plans" / f"{PLAN_STEM}.md"


def rel_paths() -> tuple[str, str]:
    """(state file, markdown) relative to the repository, for messages."""
    return f"plans/{PLAN_STEM}.state.json", f"plans/{PLAN_STEM}.md"


def _phase_entry(p: Phase) -> dict[str, Any]:
    return {
        "number": p.number,
        "title": p.title,
        "goal": p.goal,
        "status": "todo",
        "date": None,
        "gpu": None,
        "override": False,
        "override_missing": [],
        "gates": [
            {"name": g.stem, "session": g.session, "args": list(g.args), "needs_gpu": g.needs_gpu,
             "evidence": None}
            for g in p.gates
        ],
    }


def new_state() -> dict[str, Any]:
    """A state with every phase ``todo`` and no evidence."""
    return {
        "schema": STATE_SCHEMA,
        "plan": PLAN_STEM,
        "title": PLAN_TITLE,
        "head_content_hash": None,
        "markdown_sha256": None,
        "phases": [_phase_entry(p) for p in PHASES],
    }


def _upgraded_evidence(ev: Any, where: str) -> dict[str, Any] | None:
    """A gate's recorded summary with the fields later schemas added (defaults) and no
    machine-local metric; None stays None."""
    if ev is None:
        return None
    if not isinstance(ev, dict):
        raise PlanError(f"{where} evidence must be an object or null")
    ev = dict(ev)
    ev["metrics"] = local_free_metrics(ev.get("metrics") or {}, None)
    ev.setdefault("plots", [])  # schema 1 kept no plot names
    ev.setdefault("versions", {})
    ev.setdefault("library", None)  # recorded before records named their library
    return ev


def _take_phase(old: Any, new: dict[str, Any], i: int, where: str) -> None:
    """Copy phase ``i``'s recorded fields from the loaded ``old`` into the table's ``new`` entry."""
    if not isinstance(old, dict) or old.get("number") != i:
        raise PlanError(f"{where}: phases[{i}] must be an object with number {i}")
    if old.get("status") not in STATUSES:
        raise PlanError(f"{where}: phase {i} status {old.get('status')!r}, expected one of {list(STATUSES)}")
    for key in ("status", "date", "gpu"):
        new[key] = old.get(key)
    new["override"] = bool(old.get("override", False))
    new["override_missing"] = list(old.get("override_missing") or [])
    old_gates = {g.get("name"): g for g in old.get("gates") or [] if isinstance(g, dict)}
    for g in new["gates"]:
        g["evidence"] = _upgraded_evidence(old_gates.get(g["name"], {}).get("evidence"),
                                           f"{where}: phase {i} gate {g['name']}")


def _check_state(state: Any, where: str) -> dict[str, Any]:
    """Validate a loaded state and bring its phase definitions in line with the table,
    keeping the recorded fields (a schema-1 state is upgraded: its per-phase
    ``code_commit`` is dropped and machine-local paths are taken out)."""
    if not isinstance(state, dict):
        raise PlanError(f"{where}: expected a JSON object, got {type(state).__name__}")
    if state.get("schema") not in READABLE_SCHEMAS:
        raise PlanError(f"{where}: schema {state.get('schema')!r}, expected one of {list(READABLE_SCHEMAS)}")
    phases = state.get("phases")
    if not isinstance(phases, list) or len(phases) != len(PHASES):
        raise PlanError(f"{where}: 'phases' must be a list of {len(PHASES)} phases (0-{len(PHASES) - 1})")
    fresh = new_state()
    for key in ("head_content_hash", "markdown_sha256"):
        fresh[key] = state.get(key)
    for i, (old, new) in enumerate(zip(phases, fresh["phases"], strict=True)):
        _take_phase(old, new, i, where)
    return fresh


def load_state(path: Path | None = None) -> dict[str, Any]:
    """Read the state file; a missing file gives :func:`new_state`."""
    path = path or plan_paths()[0]
    if not path.exists():
        return new_state()
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise PlanError(f"plan state {path}: unreadable or not valid JSON ({e})") from None
    return _check_state(raw, f"plan state {path}")


def dump_state(state: dict[str, Any]) -> str:
    """The state as JSON text: stable key order, two-space indent, trailing newline."""
    return json.dumps(state, indent=2, sort_keys=True) + "\n"


def save_state(state: dict[str, Any], path: Path | None = None) -> Path:
    path = path or plan_paths()[0]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(dump_state(state))
    return path


def _is_scalar(v: Any) -> bool:
    return isinstance(v, (str, int, float, bool)) or v is None


_ABS_PATH = re.compile(r"^(/|[A-Za-z]:[\\/]|\\\\)")


def local_free(value: Any, root: str | None) -> tuple[bool, Any]:
    """(keep, value) for one metric: an absolute path under ``root`` becomes relative
    to it; any other absolute path is left out (keep False)."""
    if not isinstance(value, str) or not _ABS_PATH.match(value):
        return True, value
    if root:
        base = root.rstrip("/\\")
        if value == base:
            return True, "."
        if value.startswith(base + "/"):
            return True, value[len(base) + 1:]
    return False, None


def local_free_metrics(metrics: dict[str, Any], root: str | None) -> dict[str, Any]:
    out = {}
    for k, v in metrics.items():
        keep, v = local_free(v, root)
        if keep:
            out[k] = v
    return out


def _local_free_text(text: str, root: str | None) -> str:
    """A headline with the gate's repository root taken out of any path in it."""
    if root:
        text = text.replace(root.rstrip("/") + "/", "")
    return text


def summarize(record: dict[str, Any]) -> dict[str, Any]:
    """The part of an evidence record the plan keeps: pass/fail, headline, up to
    eight scalar metrics (machine-local paths made relative or left out), device,
    commit, content hash, time, the versions of the libraries the gate computes with
    (:func:`kdtree_pipeline.phases.versions_used`), the names of its plots and the bench
    gate's markdown table when it carries one."""
    root = record.get("root")
    code = record.get("code") or {}
    details = record.get("details") if isinstance(record.get("details"), dict) else {}
    lib = record.get("library")
    table = details.get("markdown_table")
    return {
        "passed": bool(record.get("passed")),
        "headline": _local_free_text(str(record.get("headline") or ""), root),
        "reason": record.get("reason"),
        "metrics": _key_metrics(record.get("metrics") or {}, root),
        "device": _device_text(record.get("device")),
        "commit": code.get("commit"),
        "content_hash": code.get("content_hash"),
        # the kernel library the gate ran, when this tree's csrc/ built it (evidence.provenance)
        "library": lib.get("sha256") if isinstance(lib, dict) and lib.get("matches") else None,
        "time_utc": record.get("time_utc"),
        # the libraries the gate computes with; the rest of the record's versions describe the machine
        "versions": versions_used(str(record.get("gate")), record.get("versions") or {}),
        "plots": _plot_names(details),
        "markdown_table": table.strip() if isinstance(table, str) and table.strip() else None,
    }


def _key_metrics(metrics: dict[str, Any], root: str | None) -> dict[str, Any]:
    """The first :data:`MAX_KEY_METRICS` scalar metrics by name, machine-local paths made relative
    to ``root`` or left out."""
    scalars = local_free_metrics({k: metrics[k] for k in sorted(metrics) if _is_scalar(metrics[k])}, root)
    return dict(list(scalars.items())[:MAX_KEY_METRICS])


def _device_text(dev: Any) -> str:
    if isinstance(dev, dict) and dev.get("name"):
        return f"{dev['name']} (sm {dev.get('capability', '?')})"
    return "none (CPU)"


def _plot_names(details: dict[str, Any]) -> list[str]:
    """The file names of the PNG plots a record's details list (the bench gate's)."""
    files = details.get("files")
    pngs = files.get("png") if isinstance(files, dict) else None
    return sorted({Path(str(p)).name for p in pngs}) if isinstance(pngs, list) else []


def result_key(summary: dict[str, Any] | None, gate: str | None = None) -> dict[str, Any] | None:
    """What a gate's summary proved: pass/fail, content hash, headline, metrics, device and the
    versions of the libraries ``gate`` computes with (:func:`versions_used`; every version when
    ``gate`` is None), without when, from which commit or how long it took, nor the versions of
    libraries the gate does not use (a summary recorded before the plan kept only those names
    them all). Two summaries with the same key record the same result."""
    if summary is None:
        return None
    key = {k: v for k, v in summary.items() if k not in RUN_FIELDS}
    key["metrics"] = {k: v for k, v in (summary.get("metrics") or {}).items() if k not in RUN_METRICS}
    versions = summary.get("versions") or {}
    key["versions"] = versions_used(gate, versions) if gate else {k: v for k, v in versions.items() if v}
    key.setdefault("plots", [])
    return key


def phase_key(entry: dict[str, Any]) -> dict[str, Any]:
    """What a phase entry records, for telling a new recording from a repeat."""
    return {
        "status": entry["status"],
        "override_missing": entry["override_missing"] if entry["override"] else [],
        "gates": {g["name"]: result_key(g["evidence"], g["session"]) for g in entry["gates"]},
    }


def mark_done(
    state: dict[str, Any],
    number: int,
    records: dict[str, dict[str, Any]],
    *,
    override_missing: list[int] | None = None,
) -> dict[str, Any]:
    """Record phase ``number`` from its gates' evidence (stem -> record): done when
    every gate has a record, else "in progress" (not done: later phases still need
    it; the gates without one show "no evidence yet"). Date and GPU come from the
    evidence, never from the clock."""
    entry = state["phases"][number]
    for g in entry["gates"]:
        g["evidence"] = summarize(records[g["name"]]) if g["name"] in records else None
    entry["status"] = "done" if all(g["evidence"] for g in entry["gates"]) else "in progress"
    latest = max((r.get("time_utc") or "" for r in records.values()), default="")
    entry["date"] = latest[:10] or None
    gpus = sorted({s["evidence"]["device"] for s in entry["gates"] if s["needs_gpu"] and s["evidence"]})
    entry["gpu"] = ", ".join(gpus) if gpus else "none (CPU)"
    entry["override"] = bool(override_missing)
    entry["override_missing"] = sorted(override_missing or [])
    return state


def keep_unchanged(before: dict[str, Any], after: dict[str, Any], number: int) -> bool:
    """When phase ``number`` of ``after`` records the same results on the same code
    as in ``before``, put the recorded entry back (so its times and commit stay)
    and return True."""
    if phase_key(before["phases"][number]) != phase_key(after["phases"][number]):
        return False
    after["phases"][number] = copy.deepcopy(before["phases"][number])
    return True


def done_phases(state: dict[str, Any]) -> list[int]:
    return [p["number"] for p in state["phases"] if p["status"] == "done"]


def remaining(state: dict[str, Any]) -> list[dict[str, Any]]:
    """The phases not done, in order."""
    return [p for p in state["phases"] if p["status"] != "done"]


def _ranges(numbers: list[int]) -> str:
    """[0, 1, 2, 3, 5] -> '0-3, 5'."""
    out: list[tuple[int, int]] = []
    for n in sorted(numbers):
        if out and out[-1][1] == n - 1:
            out[-1] = (out[-1][0], n)
        else:
            out.append((n, n))
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in out)


def remaining_text(state: dict[str, Any]) -> str:
    """What is left to prove: a phase in progress by its gates without evidence,
    a phase not started by its title; ``none`` when every phase is done."""
    parts: list[str] = []
    for p in remaining(state):
        if p["status"] == "in progress":
            parts += [g["name"] for g in p["gates"] if g["evidence"] is None]
        else:
            parts.append(p["title"])
    return " + ".join(parts) if parts else "none"


def phase_hashes(entry: dict[str, Any]) -> list[str]:
    """The content hashes the phase's evidence was made on (one when consistent)."""
    return sorted({g["evidence"]["content_hash"] for g in entry["gates"]
                   if g["evidence"] and g["evidence"].get("content_hash")})


def phase_commits(entry: dict[str, Any]) -> list[str]:
    """The commits the phase's evidence was made on, in gate order, without repeats."""
    seen: list[str] = []
    for g in entry["gates"]:
        c = (g["evidence"] or {}).get("commit")
        if c and c not in seen:
            seen.append(c)
    return seen


def is_current(entry: dict[str, Any], head_hash: str | None) -> bool | None:
    """Whether every gate of the phase was proven on ``head_hash`` (None: no evidence,
    or no head hash known)."""
    hashes = phase_hashes(entry)
    if not hashes or not head_hash:
        return None
    return hashes == [head_hash]


def stale(state: dict[str, Any], head_hash: str | None = None) -> list[dict[str, Any]]:
    """The phases with evidence made on other code than ``head_hash`` (default: the
    hash recorded in the state): they need re-proving."""
    head_hash = head_hash or state.get("head_content_hash")
    return [p for p in state["phases"] if is_current(p, head_hash) is False]


def stale_text(state: dict[str, Any], head_hash: str | None = None) -> str:
    """``Phase 1 (kernel in isolation, proven on 2a790f72ac52)`` ... or ``none``."""
    rows = [f"Phase {p['number']} ({p['title']}, proven on {', '.join(_short(h) for h in phase_hashes(p))})"
            for p in stale(state, head_hash)]
    return "; ".join(rows) if rows else "none"


@dataclass(frozen=True)
class Change:
    """What one recording did to one phase: ``kind`` is ``done`` (newly done),
    ``re-proved`` (done before, done again with new results or on new code) or
    ``in progress`` (some gates recorded)."""

    number: int
    kind: str
    content_hash: str | None


def change_of(before: dict[str, Any], after: dict[str, Any], number: int) -> Change:
    old, new = before["phases"][number], after["phases"][number]
    hashes = phase_hashes(new)
    h = hashes[0] if len(hashes) == 1 else None
    if new["status"] == "done":
        return Change(number, "re-proved" if old["status"] == "done" else "done", h)
    return Change(number, "in progress", h)


def _clause(state: dict[str, Any], changes: list[Change]) -> str:
    c = changes[0]
    nums = _ranges([x.number for x in changes])
    title = f" ({state['phases'][c.number]['title']})" if len(changes) == 1 else ""
    on = f" on {c.content_hash[:8]}" if c.content_hash else ""
    if c.kind == "re-proved":
        return f"re-prove Phase {nums}{on}"
    if c.kind == "done":
        return f"mark Phase {nums}{title} done{on}"
    return f"record Phase {nums}{title} in progress{on}"


def commit_subject(state: dict[str, Any], changes: list[Change] | None = None) -> str:
    """``plans/0002: mark Phase 5 (defrag) done on fe2260e0; remaining = smoke``; with
    several phases, one clause per kind of change and code; without changes (a
    plain re-render) ``plans/0002: re-render the plan; remaining = ...``."""
    groups: list[list[Change]] = []
    for c in changes or []:
        for grp in groups:
            if (grp[0].kind, grp[0].content_hash) == (c.kind, c.content_hash):
                grp.append(c)
                break
        else:
            groups.append([c])
    head = ", ".join(_clause(state, g) for g in groups) if groups else f"re-render from templates/{TEMPLATE}"
    return f"plans/{PLAN_ID}: {head}; remaining = {remaining_text(state)}"


def _gate_lines(entry: dict[str, Any]) -> list[str]:
    lines = []
    for g in entry["gates"]:
        ev = g["evidence"]
        if ev is None:
            lines.append(f"- {g['name']}: no evidence")
            continue
        commit = (ev.get("commit") or "unknown")[:12]
        lines.append(f"- {g['name']}: {ev['headline']} (evidence commit {commit}, {ev['device']})")
        if ev.get("plots"):
            lines.append(f"  plots: {', '.join(f'plans/{PLOTS_DIR}/{n}' for n in ev['plots'])}")
    return lines


def commit_message(state: dict[str, Any], changes: list[Change] | None = None,
                   unchanged: list[int] | None = None) -> str:
    """Subject (:func:`commit_subject`) plus a body: for each phase this recording
    changed, each gate's headline figure and the evidence's commit; the phases
    whose new evidence repeated the recorded results; the phases that need
    re-proving on HEAD's code."""
    lines: list[str] = []
    for c in changes or []:
        p = state["phases"][c.number]
        note = f" (override: phases {_ranges(p['override_missing'])} not done)" if p["override"] else ""
        on = f" on content hash {c.content_hash[:12]}" if c.content_hash else ""
        lines.append(f"Phase {c.number} ({p['title']}): {p['status']}{on}{note}")
        lines += _gate_lines(p)
    if unchanged:
        lines.append("Unchanged (same content hash and results as recorded): "
                     + ", ".join(f"Phase {n}" for n in unchanged))
    if not changes:
        lines.append(f"Re-rendered from templates/{TEMPLATE}.")
    head = state.get("head_content_hash")
    if head:
        lines.append(f"Needs re-proving on HEAD's content hash {head[:12]}: {stale_text(state)}")
    return f"{commit_subject(state, changes)}\n\n" + "\n".join(lines) + "\n"


def _fmt(value: Any) -> str:
    """A metric value for the plan: floats with 4 significant digits."""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.4g}"
    if value is None:
        return "-"
    return str(value)


def _cell(value: Any) -> str:
    """Text safe inside a markdown table cell: pipes escaped, one line."""
    return " ".join(str(value).split()).replace("|", "\\|")


def _short(value: Any, n: int = 12) -> str:
    return str(value)[:n] if value else "-"


def environment(templates_dir: Path) -> jinja2.Environment:
    """The jinja2 environment of the plan: anchored loader, StrictUndefined."""
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(templates_dir)),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
        autoescape=False,
    )
    env.filters["fmt"] = _fmt
    env.filters["short"] = _short
    env.filters["cell"] = _cell
    return env


def _current_text(entry: dict[str, Any], head_hash: str | None) -> str:
    cur = is_current(entry, head_hash)
    return "-" if cur is None else ("yes" if cur else "no: re-prove")


def phase_rows(state: dict[str, Any], head_hash: str | None = None) -> list[dict[str, Any]]:
    """Per phase, the fields the phase table shows: the entry itself, the commit(s)
    and content hash(es) its evidence was made on, and whether that is HEAD's."""
    head_hash = head_hash or state.get("head_content_hash")
    return [{"p": p, "commits": [_short(c) for c in phase_commits(p)],
             "hashes": [_short(h) for h in phase_hashes(p)], "current": _current_text(p, head_hash)}
            for p in state["phases"]]


def render(state: dict[str, Any], templates_dir: Path | None = None) -> str:
    """Render the plan markdown from ``state``; :class:`PlanError` on a template error."""
    templates_dir = templates_dir or evidence.repo_root() / "templates"
    state_rel = rel_paths()[0]
    head = state.get("head_content_hash")
    try:
        template = environment(templates_dir).get_template(TEMPLATE)
        return template.render(
            plan_id=PLAN_ID,
            title=state["title"],
            phases=state["phases"],
            rows=phase_rows(state),
            head_hash=head,
            stale=[{"p": p, "hashes": [_short(h) for h in phase_hashes(p)]} for p in stale(state)],
            remaining=remaining(state),
            remaining_text=remaining_text(state),
            state_file=state_rel,
            plots_dir=PLOTS_DIR,
            template_file=f"templates/{TEMPLATE}",
        )
    except jinja2.TemplateError as e:
        where = getattr(e, "filename", None) or templates_dir / TEMPLATE
        line = getattr(e, "lineno", None)
        at = f" line {line}" if line else ""
        raise PlanError(f"template {where}{at}: {type(e).__name__}: {e}") from None


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def render_files(state: dict[str, Any], templates_dir: Path | None = None) -> tuple[str, str]:
    """(state JSON, markdown): the markdown rendered, its sha256 put in the state."""
    text = render(state, templates_dir)
    state["markdown_sha256"] = sha256_text(text)
    return dump_state(state), text


def hand_edited(state: dict[str, Any], plan_text: str | None, templates_dir: Path | None = None,
                committed_text: str | None = None) -> bool:
    """Whether ``plan_text`` (the markdown on disk; None: absent) is a hand edit: it is
    neither what the state renders nor what the pipeline last wrote (the state's
    ``markdown_sha256``; a state from before that field: the committed markdown,
    ``committed_text``). A template change is not a hand edit."""
    if plan_text is None or plan_text == render(state, templates_dir):
        return False
    recorded = state.get("markdown_sha256")
    if recorded:
        return sha256_text(plan_text) != recorded
    return plan_text != committed_text


def _status_rows(r: dict[str, Any]) -> list[tuple[str, ...]]:
    """One row per gate of the phase row ``r`` (:func:`phase_rows`); the phase's columns on its first."""
    p = r["p"]
    status = p["status"] + (" (override)" if p["override"] else "")
    lead = (f"{p['number']} {p['title']}", status, ", ".join(r["commits"]) or "-", ", ".join(r["hashes"]) or "-",
            r["current"])
    rows = []
    for i, g in enumerate(p["gates"]):
        ev = g["evidence"]
        result = "-" if ev is None else ("pass" if ev["passed"] else "FAIL")
        rows.append((*(lead if i == 0 else ("",) * 5), g["name"], result, "" if ev is None else ev["headline"]))
    return rows


def status_table(state: dict[str, Any], head_hash: str | None = None, note: str = "") -> str:
    """A plain-text table of phases and gates for ``invoke status``: per phase the
    commit and content hash its evidence ran on and whether that hash is
    ``head_hash`` (the code here), then the phases that need re-proving."""
    rows = [("phase", "status", "commit", "content hash", "current", "gate", "result", "headline")]
    for r in phase_rows(state, head_hash):
        rows += _status_rows(r)
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r[:-1], widths, strict=True)) + "  " + r[-1]
             for r in rows]
    lines.append("")
    lines.append(f"content hash of src/ and csrc/ here: {_short(head_hash)}{note}")
    lines.append(f"needs re-proving: {stale_text(state, head_hash)}")
    lines.append(f"remaining = {remaining_text(state)}")
    return "\n".join(line.rstrip() for line in lines) + "\n"
