"""The bench report: one JSON of every figure, markdown tables, two PNG plots.

Files under the output folder, named after the suite:

- ``<suite>.json``: the whole report (cases, every result with both timings and
  its correctness check, floors, measured ceilings, targets, missing peers);
- ``<suite>.md``: the table (primary figures: CUDA-graph replay, microseconds
  per verify call), the eager table, the targets and the notes;
- ``<suite>-time.png``: one group of bars per case (its name under it), one bar
  per system, microseconds (log scale), each bar labelled with its value;
- ``<suite>-speedup.png``: per case, SGLang extend's time / ours (tree) and
  FlashMLA's / ours (chain); for the graph suite eager / replay.

Plots need matplotlib (Agg backend); without it the report says so and the
JSON and markdown are still written; ``python -m kdtree_pipeline.bench.report
<suite>.json`` re-renders them later on a machine that has it.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kdtree_pipeline.bench.results import Result, Table
from kdtree_pipeline.bench.suites import Case, Suite, length_counts, prefix_lens_of
from kdtree_pipeline.bench.targets import TargetResult

#: (system, mask, column header) of the main table
COLUMNS = (("ours", "tree", "ours tree"), ("ours", "chain", "ours chain"),
           ("sglang-extend", "tree", "SGLang extend"), ("sglang-splitkv", "chain", "SGLang split-KV"),
           ("flashmla", "chain", "FlashMLA"))
SYSTEM_LABELS = {"ours": "ours", "ours-sm120": "ours sm_120 (emulated)", "sglang-extend": "SGLang extend",
                 "sglang-splitkv": "SGLang split-KV", "flashmla": "FlashMLA"}
SM120_CAPTION = ("sm_120 (RTX PRO 6000 Blackwell) figures come from the sm_120 emulation on this GPU "
                 "(`target=\"sm_120\"`: the kernel, tile, shared-memory limits and occupancy an sm_120 GPU gets); "
                 "no sm_120 GPU is available here. The sm_120 floor is a prediction from the RTX PRO 6000's "
                 "documented bandwidth and bf16 tensor rate, not a measurement.")


def build(suite: Suite, cases: Sequence[Case], results: Sequence[Result], floors: dict[str, dict[str, Any]],
          ceilings: dict[str, Any] | None, targets: Sequence[TargetResult], missing: dict[str, str],
          systems: Sequence[str], meta: dict[str, Any] | None = None,
          sm120_floors: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """The report as one JSON-able dict."""
    return {
        "sm120_floors": sm120_floors or {},
        "suite": suite.name,
        "kind": suite.kind,
        "description": suite.description,
        "systems": list(systems),
        "missing": dict(missing),
        "ceilings": ceilings,
        # prefix: the longest request's (every request's but in a ragged case); prefixes: a ragged
        # case's per-request lengths, None for a uniform case
        "cases": [{"name": c.name, "series": c.series, "bs": c.bs, "n": c.n, "heads": c.heads, "prefix": c.prefix,
                   "prefixes": list(c.prefixes) if c.is_ragged else None, "label": c.ragged_label,
                   "layout": c.layout, "masks": list(c.masks), "tree": c.tree, "hint": c.hint} for c in cases],
        "floors": floors,
        "results": [r.as_dict() for r in results],
        "targets": [t.as_dict() for t in targets],
        "meta": meta or {},
    }


def _results(report: dict[str, Any]) -> Table:
    keep = ("case", "system", "mask", "status", "replay_us", "eager_us", "graph_error", "error", "check",
            "rotations", "calls", "replay_reps", "eager_reps", "extra")
    return Table([Result(**{k: r.get(k) if k != "extra" else r.get(k) or {} for k in keep})
                  for r in report["results"]])


def _us(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v:.3g}" if v < 1000 else f"{v:.0f}"


def _cell(table: Table, case: str, system: str, mask: str, report: dict[str, Any], eager: bool = False) -> str:
    r = table.get(case, system, mask)
    if r is None:
        if system in report["missing"]:
            return "missing"
        return "-"
    if r.status == "ok":
        if eager:
            return _us(r.eager_us)
        return _us(r.time_us) + (" (eager)" if r.timing == "eager" else "")
    if r.status == "wrong":
        return f"WRONG {_us(r.eager_us if eager else r.time_us)}"
    return r.status


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or b is None or b == 0 else f"{a / b:.2f}"


def compare_table(report: dict[str, Any], eager: bool = False) -> str:
    """The main table: microseconds per call (graph replay unless marked), ratios."""
    t = _results(report)
    head = ["case"] + [c[2] for c in COLUMNS] + ["floor", "ours/FlashMLA", "floor/ours"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for c in report["cases"]:
        name = c["name"]
        cells = [name] + [_cell(t, name, s, m, report, eager) for s, m, _ in COLUMNS]
        fl = (report["floors"].get(name) or {}).get("floor_us")
        get = _eager if eager else Table.time
        ours_tree, ours_chain, fm = (get(t, name, s, m) for s, m in
                                     (("ours", "tree"), ("ours", "chain"), ("flashmla", "chain")))
        cells += [_us(fl), _ratio(ours_chain, fm), _ratio(fl, ours_tree)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def sm120_table(report: dict[str, Any]) -> str:
    """The sm_120 emulation next to the Hopper kernel and SGLang's kernels (which also run
    on sm_120), with the RTX PRO 6000's predicted floor; "" when ours-sm120 did not run."""
    if "ours-sm120" not in report["systems"]:
        return ""
    t = _results(report)
    head = ["case", "sm_120 tree", "sm_120 chain", "Hopper kernel tree", "sm_120 / Hopper", "SGLang split-KV",
            "sm_120 / split-KV", "SGLang extend", "extend / sm_120", "sm_120 floor (RTX PRO 6000, predicted)"]
    lines = [SM120_CAPTION, "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for c in report["cases"]:
        name = c["name"]
        s_tree, s_chain, hop, skv, ext = (t.time(name, s, m) for s, m in (
            ("ours-sm120", "tree"), ("ours-sm120", "chain"), ("ours", "tree"), ("sglang-splitkv", "chain"),
            ("sglang-extend", "tree")))
        fl = (report.get("sm120_floors", {}).get(name) or {}).get("floor_us")
        lines.append("| " + " | ".join([
            name, _cell(t, name, "ours-sm120", "tree", report), _cell(t, name, "ours-sm120", "chain", report),
            _cell(t, name, "ours", "tree", report), _ratio(s_tree, hop), _cell(t, name, "sglang-splitkv", "chain", report),
            _ratio(s_chain, skv), _cell(t, name, "sglang-extend", "tree", report), _ratio(ext, s_tree), _us(fl)]) + " |")
    return "\n".join(lines)


def _eager(t: Table, case: str, system: str, mask: str) -> float | None:
    r = t.get(case, system, mask)
    return r.eager_us if r is not None and r.status == "ok" else None


def _prefixes(c: dict[str, Any]) -> tuple[int, ...]:
    """A report case's per-request prefix lengths (a report written before ragged cases has no
    ``prefixes``: every request has ``prefix``)."""
    return prefix_lens_of(c["bs"], c["prefix"], c.get("prefixes") or None)


def prefix_text(c: dict[str, Any]) -> str:
    """``65536`` for a uniform case; ``1 x 65536, 7 x 1024`` for a ragged one (longest first)."""
    if not c.get("prefixes"):
        return str(c["prefix"])
    return ", ".join(f"{k} x {v}" for v, k in length_counts(c["prefixes"]))


def _shape(c: dict[str, Any]) -> tuple:
    """A report case's Case.shape."""
    return c["bs"], c["n"], c["heads"], _prefixes(c)


def fragmentation_table(report: dict[str, Any]) -> str:
    t = _results(report)
    systems = [x for x in ("ours", "ours-sm120", "sglang-extend") if x in report["systems"]]
    head = ["prefix", "layout"] + [h for x in systems for h in (SYSTEM_LABELS[x] + " tree", SYSTEM_LABELS[x] + " penalty")]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    base = {_shape(c): c["name"] for c in report["cases"] if c["layout"] == "contiguous"}
    for c in report["cases"]:
        ref = base.get(_shape(c))
        cells = [prefix_text(c), c["layout"]]
        for system in systems:
            v = t.time(c["name"], system, "tree")
            v0 = t.time(ref, system, "tree") if ref else None
            cells.append(_cell(t, c["name"], system, "tree", report))
            cells.append("-" if v is None or v0 is None else f"{(v / v0 - 1) * 100:+.1f}%")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def graph_table(report: dict[str, Any]) -> str:
    t = _results(report)
    head = ["case", "ours eager", "ours replay", "eager / replay", "saved per call"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for c in report["cases"]:
        r = t.get(c["name"], "ours", c["masks"][0])
        if r is None or r.status != "ok":
            lines.append(f"| {c['name']} | {r.status if r else '-'} | | | |")
            continue
        saved = "-" if r.eager_us is None or r.replay_us is None else f"{r.eager_us - r.replay_us:.3g}"
        lines.append(f"| {c['name']} | {_us(r.eager_us)} | {_us(r.replay_us)} | {_ratio(r.eager_us, r.replay_us)} "
                     f"| {saved} |")
    return "\n".join(lines)


def main_table(report: dict[str, Any]) -> str:
    """The table the plan shows for this suite."""
    if report["kind"] == "fragmentation":
        return fragmentation_table(report)
    if report["kind"] == "graph":
        return graph_table(report)
    sm = sm120_table(report)
    return compare_table(report) + (f"\n\n{sm}" if sm else "")


def _check_text(check: dict[str, Any] | None) -> str:
    """The compare figures of a failed check; the same text from a live dict or its JSON form."""
    if not check:
        return "no check"
    parts = []
    for k in ("max_abs", "max_rel_excess", "rel_l2", "cos_diff", "nonfinite"):
        if k in check:
            v = check[k]
            parts.append(f"{k} {v:.2e}" if isinstance(v, float) and k != "nonfinite" else f"{k} {v}")
    return ", ".join(parts)


def notes(report: dict[str, Any]) -> list[str]:
    out = [f"{SYSTEM_LABELS.get(s, s)}: missing ({err})" for s, err in report["missing"].items()]
    for r in report["results"]:
        if r["status"] in ("error", "unsupported", "wrong", "skipped"):
            why = r["error"] or (f"reference check failed ({_check_text(r['check'])})" if r["status"] == "wrong"
                                 else "")
            out.append(f"{r['case']} {r['system']} {r['mask']}: {r['status']}" + (f": {why}" if why else ""))
        elif r["graph_error"]:
            out.append(f"{r['case']} {r['system']} {r['mask']}: not capturable in a CUDA graph, eager figure shown "
                       f"({r['graph_error']})")
    return out


def markdown(report: dict[str, Any]) -> str:
    ce = report.get("ceilings") or {}
    lines = [f"### Bench `{report['suite']}`: {report['description']}", ""]
    meta = report.get("meta") or {}
    if meta.get("gpu"):
        lines.append(f"GPU: {meta['gpu']}" + (f"; copy {ce['copy_tb_s']:.2f} TB/s, bf16 matmul "
                                                f"{ce['matmul_tflop_s']:.0f} TFLOP/s (measured in this run)"
                                                if ce else ""))
        lines.append("")
    lines.append("Microseconds per verify call, median of CUDA-graph replays (\"(eager)\": the peer could not be "
                 "captured); bf16, random data, inputs rotated past the L2. Floor = max(bytes / copy bandwidth, "
                 "flops / matmul rate).")
    lines += ["", main_table(report), ""]
    ragged = [c for c in report["cases"] if c.get("prefixes")]
    if ragged and report["kind"] != "fragmentation":  # the fragmentation table prints the lengths itself
        lines += ["Ragged cases (one prefix length per request; ours gets the longest as its host hint):", ""]
        lines += [f"- {c['name']}: {prefix_text(c)}" for c in ragged] + [""]
    if report["kind"] == "compare":
        lines += ["Eager (Python launch path, back-to-back calls):", "", compare_table(report, eager=True), ""]
    if report["targets"]:
        lines.append("Targets:")
        lines.append("")
        for t in report["targets"]:
            tr = TargetResult(**t)
            lines.append(f"- {tr.summary()}")
        lines.append("")
    ns = notes(report)
    if ns:
        lines += ["Notes:", ""] + [f"- {n}" for n in ns] + [""]
    return "\n".join(lines)


def _plot_series(report: dict[str, Any]) -> tuple[list[str], dict[str, list[float | None]],
                                                 dict[str, list[float | None]]]:
    """(case names, time series, speedup series): each series is one value (or
    None) per case, in case order, so every bar sits above its case's name."""
    t = _results(report)
    kind = report["kind"]
    names = [c["name"] for c in report["cases"]]
    times: dict[str, list[float | None]] = {}
    speed: dict[str, list[float | None]] = {}

    def put(series: dict[str, list[float | None]], label: str, i: int, v: float | None) -> None:
        if v is not None:
            series.setdefault(label, [None] * len(names))[i] = v

    for i, c in enumerate(report["cases"]):
        if kind == "graph":
            r = t.get(c["name"], "ours", c["masks"][0])
            if r is not None and r.status == "ok":
                put(times, "ours eager", i, r.eager_us)
                put(times, "ours graph replay", i, r.replay_us)
                if r.eager_us and r.replay_us:
                    put(speed, "eager / graph replay", i, r.eager_us / r.replay_us)
            continue
        for system, mask, label in COLUMNS + (("ours-sm120", "tree", "ours sm_120 (emulated) tree"),):
            put(times, label, i, t.time(c["name"], system, mask))
        if kind == "compare":
            put(times, "floor", i, (report["floors"].get(c["name"]) or {}).get("floor_us"))
        tree, chain = t.time(c["name"], "ours", "tree"), t.time(c["name"], "ours", "chain")
        ext, fla = t.time(c["name"], "sglang-extend", "tree"), t.time(c["name"], "flashmla", "chain")
        if ext is not None and tree:
            put(speed, "SGLang extend / ours tree", i, ext / tree)
        if fla is not None and chain:
            put(speed, "FlashMLA / ours chain", i, fla / chain)
    return names, times, speed


def plots(report: dict[str, Any], out_dir: Path) -> tuple[list[Path], list[str]]:
    """Write the PNGs: one group of bars per case, the case name under it, one bar
    per system (time) or per peer ratio (speedup), each bar labelled with its
    value. Returns (paths written, notes on what was not drawn)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:
        return [], [f"matplotlib is not available ({type(e).__name__}: {e}): no PNG plots written"]
    names, times, speed = _plot_series(report)
    written, skipped = [], []
    for what, series, ylabel, title in (
        ("time", times, "microseconds per verify call (log)", "time per case"),
        ("speedup", speed, "peer time / ours (log; > 1: ours faster)", "speedup of ours per case"),
    ):
        if not series:
            skipped.append(f"{what} plot: no figures to draw"
                           + (" (no SGLang extend or FlashMLA figures)" if what == "speedup" else ""))
            continue
        width = 0.8 / len(series)
        fig, ax = plt.subplots(figsize=(max(8.0, 0.9 * len(names) * max(1, len(series)) / 3 + 3), 6))
        cmap = plt.get_cmap("tab10")
        for j, (label, values) in enumerate(series.items()):
            xs = [i + (j - (len(series) - 1) / 2) * width for i, v in enumerate(values) if v is not None]
            vs = [v for v in values if v is not None]
            bars = ax.bar(xs, vs, width, label=label, color="lightgray" if label == "floor" else cmap(j % 10),
                          edgecolor="black", linewidth=0.3)
            ax.bar_label(bars, labels=[f"{v:.0f}" if v >= 100 else f"{v:.3g}" for v in vs], fontsize=6, rotation=90, padding=2)
        if what == "speedup":
            ax.axhline(1, color="black", linewidth=0.8)
            if report["kind"] == "compare":
                ax.axhline(50, color="red", linestyle=":", linewidth=1, label="50x (long-context target)")
        ax.set_xticks(range(len(names)))
        ax.set_xticklabels(names, rotation=45, ha="right", fontsize=8)
        ax.set_yscale("log")
        ax.set_ylabel(ylabel)
        ax.set_title(f"bench {report['suite']}: {title}")
        ax.grid(True, axis="y", which="both", alpha=0.3)
        ax.legend(fontsize=8)
        path = out_dir / f"{report['suite']}-{what}.png"
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written, skipped


def json_safe(o: Any) -> Any:
    """JSON-safe: non-finite floats become the strings "inf", "-inf", "nan"; paths become strings."""
    if isinstance(o, float) and not math.isfinite(o):
        return str(o)
    if isinstance(o, dict):
        return {str(k): json_safe(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [json_safe(v) for v in o]
    if isinstance(o, (str, int, float, bool)) or o is None:
        return o
    return str(o)


def write(report: dict[str, Any], out_dir: Path | str) -> dict[str, Any]:
    """Write JSON, markdown and PNGs; returns {"json", "markdown", "png": [...], "notes": [...]}."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    pngs, plot_notes = plots(report, out)
    report.setdefault("meta", {})["plot_notes"] = plot_notes
    md_path = out / f"{report['suite']}.md"
    md_path.write_text(markdown(report) + "".join(f"\n{n}\n" for n in plot_notes))
    js_path = out / f"{report['suite']}.json"
    tmp = js_path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(json_safe(report), indent=1, allow_nan=False) + "\n")
    os.replace(tmp, js_path)
    return {"json": js_path, "markdown": md_path, "png": pngs, "notes": plot_notes}


def main(argv: list[str] | None = None) -> int:
    """``python -m kdtree_pipeline.bench.report REPORT.json [--out DIR]``: re-render the markdown
    and PNGs from a report JSON (e.g. one carried back from a GPU host without matplotlib)."""
    import argparse
    import sys

    ap = argparse.ArgumentParser(prog="python -m kdtree_pipeline.bench.report", description=main.__doc__)
    ap.add_argument("report", type=Path)
    ap.add_argument("--out", type=Path, default=None, help="folder (default: the JSON's folder)")
    args = ap.parse_args(argv)
    try:
        rep = json.loads(args.report.read_text())
        if not isinstance(rep, dict) or "results" not in rep or "suite" not in rep:
            raise ValueError("not a bench report (no 'suite' or 'results')")
    except (OSError, ValueError) as e:
        print(f"report: {args.report}: expected a bench report JSON: {e}", file=sys.stderr)
        return 2
    files = write(rep, args.out or args.report.parent)
    print(f"wrote {files['markdown']}" + "".join(f", {p}" for p in files["png"])
          + "".join(f"\n{n}" for n in files["notes"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
