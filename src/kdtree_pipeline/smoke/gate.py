"""The ``smoke`` gate: SGLang serving real HTTP traffic through the plugin, proven end to end.

    python -m kdtree_pipeline smoke [--launches typo,off-eager,...] [--out DIR] [--budget-s S]

On a GPU host with the live bundle (``tools/live_site.py`` makes ``.live/live.tar.xz``), the
gate first checks that the server's Python imports what a server start imports (:mod:`.imports`:
one failure naming every package the bundle lacks), then writes the model (:mod:`.model`: one
TP8 rank of Kimi K2.6 per layer, generated weights), then starts SGLang once per launch
(:data:`.live.LAUNCHES`): ``KDTREE_VERIFY=typo`` must stop the launch with the plugin's message;
kernel off and on, eager and with CUDA graphs, serve greedy outputs that :mod:`.compare` holds
to a bf16 tolerance, the speculative figures, a streamed request, eight concurrent ones, decode
speed at 23k-91k tokens for one and eight requests, and (kernel on, eager) a prompt over the
context length and a client that drops its stream; with the library missing the server serves on
SGLang's path and logs the plugin's ``off`` line. After every stop no process and no GPU memory
of the server is left.

A run cut short resumes: each launch's result is kept in ``--out`` and the same command goes on
with the launches not done on this code, bundle and GPU (exit 3 until all are). Then one evidence record
(``smoke.json``) with the live table; exit 0 on pass, 1 on a failed check, 2 on bad usage.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import signal
import sys
import threading
from pathlib import Path
from typing import Any

from .. import evidence
from . import imports, live
from . import model as M
from .compare import compare

GATE = "smoke"
INCOMPLETE = 3
#: decode tokens/s of kernel on over off that the live run must reach, eager, at 23k tokens
TARGET_SPEEDUP_23K = 2.0


class UsageError(ValueError):
    """Bad command-line input: exit 2, nothing written."""


class _Terminated(Exception):
    """SIGTERM arrived; raised so that the running launch's ``finally`` stops its server (each
    server runs in its own process group, which a signal to the gate alone would not reach)."""


@contextlib.contextmanager
def _stop_on_sigterm():
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_term(signum: int, frame: object) -> None:
        raise _Terminated()

    old = signal.signal(signal.SIGTERM, on_term)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m kdtree_pipeline smoke", description=__doc__.splitlines()[0])
    p.add_argument("--launches", default=",".join(live.DEFAULT_LAUNCHES),
                   help=f"comma list of launches, in order (default: all of {', '.join(live.DEFAULT_LAUNCHES)}; "
                   f"also: {', '.join(n for n in live.LAUNCHES if n not in live.DEFAULT_LAUNCHES)})")
    p.add_argument("--out", type=Path, default=None, help="the run's folder (default build/smoke)")
    p.add_argument("--site", type=Path, default=None,
                   help="the live bundle, .live/live.tar.xz (tools/live_site.py), unpacked into --out; or a "
                   "folder it was unpacked into")
    p.add_argument("--layers", type=int, default=4, help="main layers of the generated model (>= 2)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="start no launch when less than the slowest one so far is left of this many seconds")
    p.add_argument("--port", type=int, default=30117)
    p.add_argument("--ready-timeout", type=float, default=live.READY_TIMEOUT_S, help="seconds a server may take to answer")
    return p


def validate(args: argparse.Namespace) -> list[str]:
    names = [n.strip() for n in args.launches.split(",") if n.strip()]
    bad = [n for n in names if n not in live.LAUNCHES]
    if bad or not names:
        raise UsageError(f"--launches: expected names from {', '.join(live.LAUNCHES)}, got {args.launches!r}")
    if args.layers < 2:
        raise UsageError(f"--layers: expected at least 2 main layers, got {args.layers}")
    if args.budget_s is not None and args.budget_s <= 0:
        raise UsageError(f"--budget-s: expected a positive number of seconds, got {args.budget_s}")
    return names


def why_cannot_run(site: Path) -> str | None:
    """The one sentence saying why this machine cannot run the gate, or None."""
    if shutil.which("nvidia-smi") is None:
        return "the smoke gate starts SGLang on a GPU and this machine has no nvidia-smi (no NVIDIA GPU)"
    try:
        import torch

        if not torch.cuda.is_available():
            return "the smoke gate starts SGLang on a GPU and torch sees no CUDA device here"
    except ImportError:
        return "the smoke gate writes its model with torch, which is not importable here"
    if not (site.is_file() or (site / "sglang").is_dir()):
        return (f"no live bundle at {site}: make it with `python3 tools/live_site.py` (SGLang 0.5.17, its kernels "
                "and pins for the GPU host) and carry it")
    return None


# -- evaluation ----------------------------------------------------------------------------------


def speed_table(results: dict[str, live.LaunchResult]) -> list[dict[str, Any]]:
    rows = []
    for mode in ("eager", "graphs"):
        off, on = results.get(f"off-{mode}"), results.get(f"on-{mode}")
        if not (off and on):
            continue
        so, sn = off.checks.get("speed") or {}, on.checks.get("speed") or {}
        for key in so:
            a, b = so[key], sn.get(key) or {}
            if not (a.get("tokens_per_s") and b.get("tokens_per_s")):
                continue
            row = {"mode": mode, "length": a["length"], "bs": a["bs"],
                   "off_tok_s": a["tokens_per_s"], "on_tok_s": b["tokens_per_s"],
                   "speedup": round(b["tokens_per_s"] / a["tokens_per_s"], 2),
                   "off_step_ms": a.get("step_ms"), "on_step_ms": b.get("step_ms"),
                   "accept_off": a.get("accept_length"), "accept_on": b.get("accept_length")}
            if a.get("step_ms") and b.get("step_ms"):
                # the time the kernel took out of the verify step: attention's share of the step with
                # SGLang's kernel is at least that much (the rest of the step is the same code)
                row["attention_share_off_min"] = round(max(0.0, 1 - b["step_ms"] / a["step_ms"]), 3)
            rows.append(row)
    return rows


def speed_targets(rows: list[dict[str, Any]]) -> list[str]:
    """Kernel on >= TARGET_SPEEDUP_23K x off in decode tokens/s at 23k eager, and more at 64k-91k."""
    problems = []
    eager = [r for r in rows if r["mode"] == "eager"]
    for bs in sorted({r["bs"] for r in eager}):
        at = {r["length"]: r["speedup"] for r in eager if r["bs"] == bs}
        base = at.get(min(at, default=0))
        if base is None:
            continue
        if base < TARGET_SPEEDUP_23K:
            problems.append(f"decode at {min(at)} tokens, bs {bs}, eager: kernel on {base}x off, target >= "
                            f"{TARGET_SPEEDUP_23K}x")
        for n, s in at.items():
            if n > min(at) and s < base:
                problems.append(f"decode at {n} tokens, bs {bs}, eager: {s}x, less than the {base}x at {min(at)}")
    if not eager:
        problems.append("no eager speed runs of both kernel off and on")
    return problems


def markdown(rows: list[dict[str, Any]], comparisons: dict[str, Any], gpu: str) -> str:
    out = [f"Live SGLang on {gpu}: decode tokens/s with the verify kernel off (SGLang's Triton path) and on.",
           "", "| mode | prompt | bs | off tok/s | on tok/s | on/off | verify step off ms | on ms | attention share off >= |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['mode']} | {r['length']} | {r['bs']} | {r['off_tok_s']} | {r['on_tok_s']} | {r['speedup']}x | "
                   f"{r['off_step_ms']} | {r['on_step_ms']} | {r.get('attention_share_off_min', '-')} |")
    out += ["", "| outputs | prompts | tokens | same ids before a flip | flips (bf16 ties) | max logprob diff |",
            "|---|---|---|---|---|---|"]
    for mode, c in comparisons.items():
        out.append(f"| {mode} on vs off | {len(c['prompts'])} | {c['tokens']} | {c['matched']} | {c['flips']} | "
                   f"{c['max_logprob_diff']} |")
    return "\n".join(out)


def evaluate(results: dict[str, live.LaunchResult], names: list[str]) -> dict[str, Any]:
    problems = [f"{n}: {p}" for n in names for p in results[n].problems]
    comparisons = {}
    for mode in ("eager", "graphs"):
        off, on = results.get(f"off-{mode}"), results.get(f"on-{mode}")
        if off and on and "outputs" in off.checks and "outputs" in on.checks:
            c = compare(off.checks["outputs"], on.checks["outputs"])
            comparisons[mode] = c
            problems += [f"outputs {mode}: {p}" for p in c["problems"]]
    rows = speed_table(results)
    if "off-eager" in names and "on-eager" in names:
        problems += speed_targets(rows)
    return {"problems": problems, "comparisons": comparisons, "speed": rows}


def headline(ev: dict[str, Any], results: dict[str, live.LaunchResult], gpu: str) -> str:
    parts = [f"{len(results)} launches of SGLang on {gpu}"]
    for mode, c in ev["comparisons"].items():
        parts.append(f"{mode} on = off on {len(c['prompts'])} prompts ({c['matched']}/{c['tokens']} tokens before "
                     f"a bf16 tie, max logprob diff {c['max_logprob_diff']})")
    for r in ev["speed"]:
        if r["mode"] == "eager" and r["bs"] == 1:
            parts.append(f"{r['length'] // 1000}k bs1 eager {r['speedup']}x")
    on = [r for n, r in results.items() if n.startswith("on-")]
    calls = sum(r.plugin.get("kernel_calls") or 0 for r in on)
    falls = sum(r.plugin.get("verify_fallbacks") or 0 for r in on)
    parts.append(f"{calls} kernel calls logged, {falls} verify fallbacks")
    return "; ".join(parts)


def main(argv: list[str]) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:
        return int(e.code or 0)
    try:
        names = validate(args)
    except UsageError as e:
        print(f"smoke: {e}", file=sys.stderr)
        return 2
    root = evidence.repo_root()
    out = args.out or root / "build" / "smoke"
    site = args.site or root / ".live" / "live.tar.xz"
    why = why_cannot_run(site)
    if why:
        print(f"smoke: FAILED: {why}", file=sys.stderr)
        evidence.write_record(evidence.make_record(GATE, False, {}, "not run", reason=why))
        return 1
    site_dir = site if site.is_dir() else live.prepare_site(site, out / "site")
    # a launch saved on this code, this bundle and this GPU is done: a bundle made again runs its
    # launches again, and one table never holds figures of two GPUs
    gpu_name = (evidence.device_info() or {}).get("name", "")
    run = live.Run(out, out / "model", [site_dir], root=root, port=args.port, ready_timeout=args.ready_timeout,
                   code=f"{evidence.content_hash(root)} {live.site_stamp(site_dir)} {gpu_name}")
    cannot = imports.check(run.python, live.server_env(live.LAUNCHES["off-eager"], run.paths, run.cache), cwd=out)
    if cannot:
        why = "the server cannot start: " + "; ".join(cannot)
        print(f"smoke: FAILED: {why}", file=sys.stderr)
        evidence.write_record(evidence.make_record(GATE, False, {}, "live smoke failed", reason=why[:2000]))
        return 1
    spec = M.ModelSpec(layers=args.layers)
    print(f"smoke: model {M.write(out / 'model', spec)}", flush=True)
    try:
        with _stop_on_sigterm():
            results = live.run_launches(run, names, budget_s=args.budget_s)
    except (KeyboardInterrupt, _Terminated) as e:  # the launch's finally stopped its server
        why = "interrupted (Ctrl-C)" if isinstance(e, KeyboardInterrupt) else "terminated (SIGTERM)"
        print(f"smoke: {why}; the server was stopped", file=sys.stderr)
        return 130 if isinstance(e, KeyboardInterrupt) else 143
    if any(n not in results for n in names):
        left = [n for n in names if n not in results]
        print(f"smoke: INCOMPLETE: {', '.join(left)} not run yet; run the same command again to go on", file=sys.stderr)
        return INCOMPLETE
    ev = evaluate(results, names)
    gpu = gpu_name or "the GPU"
    passed = not ev["problems"]
    metrics = {"launches": {n: {"passed": r.passed, "ready_s": r.ready_s, "seconds": r.seconds,
                                "kernel_calls": r.plugin.get("kernel_calls"),
                                "verify_fallbacks": r.plugin.get("verify_fallbacks")} for n, r in results.items()},
               "speed": ev["speed"],
               "outputs": {m: {k: c[k] for k in ("tokens", "matched", "flips", "max_logprob_diff", "passed")}
                           for m, c in ev["comparisons"].items()},
               "model": {"layers": spec.layers, "heads": spec.heads, "bytes": M.nbytes(spec)},
               "sglang": (results.get("on-eager") or next(iter(results.values()))).checks.get("spec", {}).get("version")}
    table = markdown(ev["speed"], ev["comparisons"], gpu)
    record = evidence.make_record(
        GATE, passed, metrics, headline(ev, results, gpu) if passed else "live smoke failed",
        reason=None if passed else "; ".join(ev["problems"])[:2000],
        details={"launches": {n: dict(vars(r)) for n, r in results.items()}, "comparisons": ev["comparisons"],
                 "markdown_table": table},
    )
    path = evidence.write_record(record)
    print(table)
    print(f"smoke: {'PASS: ' + record['headline'] if passed else 'FAIL: ' + record['reason']}\n  evidence: {path}")
    return 0 if passed else 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main(sys.argv[1:]))
