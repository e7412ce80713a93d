"""Plan state (JSON beside the plan) and its rendering to markdown with jinja2.

The state holds, per phase, its status, date, GPU, code commit, whether it was
recorded with ``--override``, and per gate the latest evidence summary. The
markdown is a pure function of the state and the template: no wall clock, so
the same state renders to the same bytes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jinja2

from kdtree_engine.pipeline import evidence
from kdtree_engine.pipeline.phases import PHASES, Phase

PLAN_ID = "0002"
PLAN_STEM = "0002-sm120-verify-kernel-defrag"
PLAN_TITLE = "Tree-verify MLA kernel (sm_120 first), SGLang integration, KV defrag"
TEMPLATE = "plan.md.j2"
STATE_SCHEMA = 1
STATUSES = ("todo", "in progress", "done", "failed")
MAX_KEY_METRICS = 8


class PlanError(ValueError):
    """The plan state or template is unusable; the message says which file and why."""


def plan_paths(root: Path | None = None) -> tuple[Path, Path]:
    """(state file, rendered markdown) under ``<root>/plans``."""
    root = root or evidence.repo_root()
    return root / "plans" / f"{PLAN_STEM}.state.json", root / "plans" / f"{PLAN_STEM}.md"


def _phase_entry(p: Phase) -> dict[str, Any]:
    return {
        "number": p.number,
        "title": p.title,
        "goal": p.goal,
        "status": "todo",
        "date": None,
        "gpu": None,
        "code_commit": None,
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
        "phases": [_phase_entry(p) for p in PHASES],
    }


def _check_state(state: Any, where: str) -> dict[str, Any]:
    """Validate a loaded state and bring its phase definitions in line with the table,
    keeping the recorded fields."""
    if not isinstance(state, dict):
        raise PlanError(f"{where}: expected a JSON object, got {type(state).__name__}")
    if state.get("schema") != STATE_SCHEMA:
        raise PlanError(f"{where}: schema {state.get('schema')!r}, expected {STATE_SCHEMA}")
    phases = state.get("phases")
    if not isinstance(phases, list) or len(phases) != len(PHASES):
        raise PlanError(f"{where}: 'phases' must be a list of {len(PHASES)} phases (0-{len(PHASES) - 1})")
    fresh = new_state()
    for i, (old, new) in enumerate(zip(phases, fresh["phases"], strict=True)):
        if not isinstance(old, dict) or old.get("number") != i:
            raise PlanError(f"{where}: phases[{i}] must be an object with number {i}")
        status = old.get("status")
        if status not in STATUSES:
            raise PlanError(f"{where}: phase {i} status {status!r}, expected one of {list(STATUSES)}")
        for key in ("status", "date", "gpu", "code_commit"):
            new[key] = old.get(key)
        new["override"] = bool(old.get("override", False))
        new["override_missing"] = list(old.get("override_missing") or [])
        old_gates = {g.get("name"): g for g in old.get("gates") or [] if isinstance(g, dict)}
        for g in new["gates"]:
            ev = old_gates.get(g["name"], {}).get("evidence")
            if ev is not None and not isinstance(ev, dict):
                raise PlanError(f"{where}: phase {i} gate {g['name']} evidence must be an object or null")
            g["evidence"] = ev
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


def summarize(record: dict[str, Any]) -> dict[str, Any]:
    """The part of an evidence record the plan keeps: pass/fail, headline, up to
    eight scalar metrics, device, commit, content hash, time, and the bench gate's
    markdown table when it carries one."""
    metrics = record.get("metrics") or {}
    key_metrics = {k: metrics[k] for k in sorted(metrics) if _is_scalar(metrics[k])}
    key_metrics = dict(list(key_metrics.items())[:MAX_KEY_METRICS])
    dev = record.get("device")
    if isinstance(dev, dict) and dev.get("name"):
        device = f"{dev['name']} (sm {dev.get('capability', '?')})"
    else:
        device = "none (CPU)"
    code = record.get("code") or {}
    details = record.get("details") or {}
    table = details.get("markdown_table") if isinstance(details, dict) else None
    return {
        "passed": bool(record.get("passed")),
        "headline": str(record.get("headline") or ""),
        "reason": record.get("reason"),
        "metrics": key_metrics,
        "device": device,
        "commit": code.get("commit"),
        "content_hash": code.get("content_hash"),
        "time_utc": record.get("time_utc"),
        "versions": {k: v for k, v in sorted((record.get("versions") or {}).items()) if v},
        "markdown_table": table.strip() if isinstance(table, str) and table.strip() else None,
    }


def mark_done(
    state: dict[str, Any],
    number: int,
    records: dict[str, dict[str, Any]],
    code_commit: str | None,
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
    times = sorted(r.get("time_utc") or "" for r in records.values())
    gpus = sorted({s["evidence"]["device"] for s in entry["gates"] if s["needs_gpu"] and s["evidence"]})
    entry["status"] = "done" if all(g["evidence"] for g in entry["gates"]) else "in progress"
    entry["date"] = times[-1][:10] if times and times[-1] else None
    entry["gpu"] = ", ".join(gpus) if gpus else "none (CPU)"
    entry["code_commit"] = code_commit
    entry["override"] = bool(override_missing)
    entry["override_missing"] = sorted(override_missing or [])
    return state


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
    rest = remaining(state)
    return " + ".join(p["title"] for p in rest) if rest else "none"


def commit_subject(state: dict[str, Any]) -> str:
    """``plans/0002: mark Phase 0-3 done; remaining = cuda-graph safety + defrag``."""
    done = done_phases(state)
    head = f"mark Phase {_ranges(done)} done" if done else "no phase done yet"
    started = [p["number"] for p in state["phases"] if p["status"] == "in progress"]
    if started:
        head += f", Phase {_ranges(started)} in progress"
    return f"plans/{PLAN_ID}: {head}; remaining = {remaining_text(state)}"


def commit_message(state: dict[str, Any], recorded: int | None = None) -> str:
    """Subject plus a body listing each gate's headline figure and the evidence's
    commit, for the phase just recorded (or every done phase)."""
    numbers = [recorded] if recorded is not None else done_phases(state)
    lines: list[str] = []
    for n in numbers:
        p = state["phases"][n]
        note = f" (override: phases {_ranges(p['override_missing'])} not done)" if p["override"] else ""
        lines.append(f"Phase {n} ({p['title']}): {p['status']}{note}")
        for g in p["gates"]:
            ev = g["evidence"]
            if ev is None:
                lines.append(f"- {g['name']}: no evidence")
                continue
            commit = (ev.get("commit") or "unknown")[:12]
            lines.append(f"- {g['name']}: {ev['headline']} (evidence commit {commit}, {ev['device']})")
    body = "\n".join(lines) if lines else "Re-rendered from templates/plan.md.j2."
    return f"{commit_subject(state)}\n\n{body}\n"


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


def render(state: dict[str, Any], templates_dir: Path | None = None) -> str:
    """Render the plan markdown from ``state``; :class:`PlanError` on a template error."""
    templates_dir = templates_dir or evidence.repo_root() / "templates"
    state_rel = f"plans/{PLAN_STEM}.state.json"
    try:
        template = environment(templates_dir).get_template(TEMPLATE)
        return template.render(
            plan_id=PLAN_ID,
            title=state["title"],
            phases=state["phases"],
            remaining=remaining(state),
            remaining_text=remaining_text(state),
            state_file=state_rel,
            template_file=f"templates/{TEMPLATE}",
        )
    except jinja2.TemplateError as e:
        where = getattr(e, "filename", None) or templates_dir / TEMPLATE
        line = getattr(e, "lineno", None)
        at = f" line {line}" if line else ""
        raise PlanError(f"template {where}{at}: {type(e).__name__}: {e}") from None


def status_table(state: dict[str, Any]) -> str:
    """A plain-text table of phases and gates for ``invoke status``."""
    rows = [("phase", "status", "date", "GPU", "code commit", "gate", "result", "headline")]
    for p in state["phases"]:
        first = True
        for g in p["gates"]:
            ev = g["evidence"]
            result = "-" if ev is None else ("pass" if ev["passed"] else "FAIL")
            head = "" if ev is None else ev["headline"]
            status = p["status"] + (" (override)" if p["override"] else "")
            lead = (f"{p['number']} {p['title']}", status, p["date"] or "-", p["gpu"] or "-",
                    _short(p["code_commit"])) if first else ("", "", "", "", "")
            rows.append((*lead, g["name"], result, head))
            first = False
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r[:-1], widths, strict=True)) + "  " + r[-1]
             for r in rows]
    lines.append("")
    lines.append(f"remaining = {remaining_text(state)}")
    return "\n".join(line.rstrip() for line in lines) + "\n"
