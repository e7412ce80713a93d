"""The ``bench`` gate: the owned kernel against its peers, in one process, on the same inputs.

    python -m kdtree_pipeline bench [--suite micro|long-context|fragmentation|graph]
        [--systems ours,sglang-extend,sglang-splitkv,flashmla] [--out DIR]
        [--budget-s S] [--list]

Per suite (:mod:`kdtree_pipeline.bench.suites`): measure the GPU's copy bandwidth
and bf16 matmul rate (:mod:`~kdtree_pipeline.bench.roofline`), then for every
case build rotated random input sets on the GPU, compute the fp32 reference,
and time every system (graph replay and eager, :mod:`~kdtree_pipeline.bench.timing`),
checking each timed output against the reference. A peer that is not
importable is reported as missing, one that cannot do a case as unsupported,
one that raises as an error; the other figures are still written. Then the
kernel's targets (:mod:`~kdtree_pipeline.bench.targets`) are evaluated on the
figures of this run, and the report (JSON, markdown, PNGs) goes to ``--out``
(default ``build/bench/``) and one evidence record ``bench-<suite>.json``.

The gate passes when every target of the suite is met, every figure of ours is
correct, and the suite finished within its time budget. On a GPU other than an
H100 or H200 (Hopper) the targets are not applicable: figures are recorded, the gate fails.
"""

from __future__ import annotations

import argparse
import sys
import time
import zlib
from collections import Counter
from pathlib import Path
from typing import Any

from kdtree_pipeline import evidence
from kdtree_pipeline.bench import report as report_mod
from kdtree_pipeline.bench import suites as suites_mod
from kdtree_pipeline.bench.results import Result, Table
from kdtree_pipeline.bench.suites import Case, Suite
from kdtree_pipeline.bench.targets import OURS, SPECS, TargetResult, evaluate, gate_passes

GATE = "bench"
#: where the inputs live (the tests point it at the CPU with a simulated CUDA)
DEVICE = "cuda"
#: seconds of timing per (system, case, mask) and mode (replay, eager)
MEASURE_BUDGET_S = 0.25
#: systems whose graph replays of one case are timed side by side, in interleaved rounds
#: (timing.time_replays): the owned kernel's systems, whose ratios the targets take within
#: a few percent (tree against chain, the sm_120 emulation against the Hopper kernel, the step
#: plan made in the call against read). Every
#: peer is timed alone, after them. FlashMLA too: on the H200 its replays interleaved with
#: ours' read 4-11% slower than alone (bs1 N16 H8 64k 53.1-53.3 -> 58.9-59.5 us, bs32 N8 H16 8k
#: 127.6-127.7 -> 132.4-132.9) while ours did not move, for a reason not found; alone is
#: FlashMLA's faster figure, so ours / FlashMLA is not flattered.
SIDE_BY_SIDE = ("ours", "ours-make", "ours-sm120")


def _say(msg: str) -> None:
    print(msg, flush=True)


def _err_text(e: BaseException, limit: int = 400) -> str:
    text = f"{type(e).__name__}: {e}".strip()
    return text if len(text) <= limit else text[:limit] + "..."


def _cuda_alive() -> str | None:
    """None if the CUDA context still works, else the error (a sticky fault ends the suite)."""
    import torch

    try:
        torch.cuda.synchronize()
        torch.zeros(1, device="cuda").add_(1).item()
    except Exception as e:
        return _err_text(e)
    return None


def case_seed(case: Case, seed: int) -> int:
    """The data seed of a case: the same for every slot layout of one shape, so that the
    fragmentation suite times the same request in each layout. A ragged case's key adds its
    lengths (a uniform case's key is what it always was: its recorded figures keep their data)."""
    key = f"{case.bs}-{case.n}-{case.heads}-{case.prefix}"
    if case.is_ragged:
        key += "-" + ",".join(map(str, case.prefix_lens))
    return seed * 100_003 + zlib.crc32(key.encode()) % 100_000


def _worst_check(checks: list[dict[str, Any] | None]) -> dict[str, Any] | None:
    cs = [c for c in checks if c is not None]
    if not cs:
        return None
    failing = [c for c in cs if not c["passed"]]
    return failing[0] if failing else max(cs, key=lambda c: c["max_rel_excess"])


def run_case(case: Case, systems: tuple[str, ...], peers: dict[str, Any], missing: dict[str, str],
             l2_bytes: int, seed: int, out: list[Result],
             side_by_side: tuple[str, ...] = SIDE_BY_SIDE) -> None:
    """Build the inputs of one case and time every system on it, appending to ``out``
    (so that the figures taken before a fatal CUDA fault are kept). The systems named in
    ``side_by_side`` have their replays timed together in interleaved rounds, the others alone
    after them (the bench's group by default; an A/B caller can pass its own)."""
    import torch

    from kdtree_pipeline.bench import data, timing
    from kdtree_pipeline.bench.peers import PEERS, PeerUnsupported
    from kdtree_pipeline.oracle import reference

    plan = [(s, m) for s in systems for m in PEERS[s].masks(case.masks)]
    try:
        rot = data.rotations(case, l2_bytes)
        sets = data.build_sets(case, rot, DEVICE, seed)
        need = sorted({m for s, m in plan if s not in missing})
        refs = {m: reference.verify_attention_ref(*sets[0].batch(m).ref_args())[0] for m in need}
        torch.cuda.synchronize()
    except Exception as e:
        why = f"building the inputs or the reference failed: {_err_text(e)}"
        _say(f"    {why}")
        out += [Result(case.name, s, m, "missing" if s in missing else "error", error=missing.get(s, why))
                for s, m in plan]
        return
    n_sets = len(sets)

    def record(r: Result) -> None:
        out.append(r)
        if r.status in ("ok", "wrong"):
            g = f"replay {r.replay_us:9.2f} us" if r.replay_us is not None else "replay       n/a   "
            e_ = f"eager {r.eager_us:9.2f} us" if r.eager_us is not None else ""
            chk = f"rel_l2 {r.check['rel_l2']:.1e}" if r.check else ""
            _say(f"    {r.system:15s} {r.mask:5s} {g}  {e_}  x{r.rotations} sets  {chk}  "
                 f"{'ok' if r.status == 'ok' else 'WRONG OUTPUT'}"
                 + (f"  (not capturable: {r.graph_error[:80]})" if r.graph_error else ""))
        else:
            _say(f"    {r.system:15s} {r.mask:5s} {r.status}: {(r.error or '')[:160]}")
        if r.status == "error":
            dead = _cuda_alive()
            if dead:
                raise RuntimeError(f"the CUDA context is broken after {r.system} on {case.name} ({r.error}): {dead}")

    def result(s: str, m: str, meas: timing.Measurement) -> Result:
        return Result(case.name, s, m, "ok" if meas.correct else "wrong", replay_us=meas.replay_us,
                      eager_us=meas.eager_us, graph_error=meas.graph_error,
                      check=_worst_check([meas.check_eager, meas.check_replay]), rotations=meas.rotations,
                      calls=meas.calls, replay_reps=meas.replay_reps, eager_reps=meas.eager_reps,
                      extra={"check_eager": meas.check_eager, "check_replay": meas.check_replay,
                             "samples_ms": meas.samples})

    def failed(s: str, m: str, e: BaseException) -> Result:
        if isinstance(e, PeerUnsupported):
            return Result(case.name, s, m, "unsupported", error=str(e), rotations=n_sets)
        return Result(case.name, s, m, "error", error=_err_text(e), rotations=n_sets)  # a crashing peer

    # the side-by-side systems checked and captured one by one, their replays timed together
    # and then their eager figures; then the peers, each alone. No name here holds a system's
    # runners (they hold its GPU tensors): a peer's go when timing.measure returns, before the
    # next system is prepared; a side-by-side system's go with its pending entry.
    together = [(s, m) for s, m in plan if s in side_by_side]
    alone = [(s, m) for s, m in plan if s not in side_by_side]
    pending: list[tuple[str, str, timing.Prepared]] = []

    def flush() -> None:
        if pending:
            timing.time_replays([p for _, _, p in pending], budget_s=MEASURE_BUDGET_S)
        while pending:
            s, m, p = pending.pop(0)  # this loop records it: the finally marks only the runs still waiting
            p.release()
            try:
                timing.time_eager(p, budget_s=MEASURE_BUDGET_S)
                r = result(s, m, p.m)
            except Exception as e:
                r = failed(s, m, e)
            record(r)

    try:
        for s, m in together:
            if s in missing:
                record(Result(case.name, s, m, "missing", error=missing[s]))
                continue
            try:
                pending.append((s, m, timing.prepare([peers[s].prepare(st.batch(m)) for st in sets], refs[m])))
                continue
            except Exception as e:
                r = failed(s, m, e)
            record(r)
        flush()
        for s, m in alone:
            if s in missing:
                record(Result(case.name, s, m, "missing", error=missing[s]))
                continue
            try:
                r = result(s, m, timing.measure([peers[s].prepare(st.batch(m)) for st in sets], refs[m],
                                                budget_s=MEASURE_BUDGET_S))
            except Exception as e:
                r = failed(s, m, e)
            record(r)
    finally:  # a fatal fault: the side-by-side runs not yet recorded say so
        for s, m, p in pending:
            p.release()
            out.append(Result(case.name, s, m, "error", error="not timed: the case ended early (see the error above)",
                              rotations=n_sets))
    del sets, refs
    torch.cuda.empty_cache()


def run_suite(suite: Suite, systems: tuple[str, ...], budget_s: float, seed: int = 0) -> dict[str, Any]:
    """Run one suite on the current CUDA device; returns everything the report and the record need."""
    import torch

    from kdtree_pipeline.bench import roofline
    from kdtree_pipeline.bench.data import DEFAULT_L2_BYTES
    from kdtree_pipeline.bench.peers import PEERS

    t0 = time.monotonic()
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    gpu = props.name
    l2 = int(getattr(props, "L2_cache_size", 0) or DEFAULT_L2_BYTES)
    _say(f"bench {suite.name}: {suite.description}")
    _say(f"  GPU {gpu} (sm_{props.major}{props.minor}, {props.multi_processor_count} SMs, L2 {l2 >> 20} MiB); "
         f"systems: {', '.join(systems)}; budget {budget_s:.0f} s")
    missing: dict[str, str] = {}
    peers: dict[str, Any] = {}
    for s in systems:
        err = PEERS[s].check()
        if err:
            missing[s] = err
            _say(f"  {s}: MISSING: {err}")
        else:
            peers[s] = PEERS[s]
    problems: list[str] = []
    ceilings = None
    try:
        ceil = roofline.measure()
        ceilings = ceil.as_dict()
        _say(f"  ceilings: copy {ceil.copy_bytes_per_s / 1e12:.2f} TB/s, bf16 matmul "
             f"{ceil.matmul_flops_per_s / 1e12:.0f} TFLOP/s")
        floors = {c.name: roofline.floor_terms(c, ceil) for c in suite.cases}
    except Exception as e:
        problems.append(f"measuring the roofline ceilings failed: {_err_text(e)}")
        _say(f"  {problems[-1]}")
        floors = {}

    # the RTX PRO 6000's floor, from its documented ceilings: a prediction for sm_120 users
    sm120_floors = {c.name: roofline.floor_terms(c, roofline.SM120_RTX_PRO_6000) for c in suite.cases} \
        if "ours-sm120" in systems else {}
    results: list[Result] = []
    fatal: str | None = None
    for i, case in enumerate(suite.cases):
        plan = [(s, m) for s in systems for m in PEERS[s].masks(case.masks)]
        spent = time.monotonic() - t0
        if fatal or spent > budget_s:
            why = fatal or f"the suite's time budget ({budget_s:.0f} s) ran out after {spent:.0f} s"
            results += [Result(case.name, s, m, "skipped", error=why) for s, m in plan]
            _say(f"  [{i + 1}/{len(suite.cases)}] {case.name}: skipped ({why[:100]})")
            continue
        fl = floors.get(case.name, {}).get("floor_us")
        _say(f"  [{i + 1}/{len(suite.cases)}] {case.name} ({case.rows} rows, floor "
             f"{'-' if fl is None else f'{fl:.1f}'} us, {spent:.0f} s elapsed)")
        try:
            run_case(case, systems, peers, missing, l2, case_seed(case, seed), results)
        except Exception as e:
            fatal = _err_text(e, 600)
            problems.append(fatal)
            _say(f"  FATAL: {fatal}")
            have = {(r.case, r.system, r.mask) for r in results}
            results += [Result(case.name, s, m, "error", error=fatal) for s, m in plan
                        if (case.name, s, m) not in have]
    table = Table(results)
    targets = evaluate(suite.targets, list(suite.cases), table,
                       {k: v["floor_us"] for k, v in floors.items()}, gpu)
    return {"gpu": gpu, "capability": f"{props.major}.{props.minor}", "l2_bytes": l2, "missing": missing,
            "ceilings": ceilings, "floors": floors, "sm120_floors": sm120_floors, "results": results, "table": table,
            "targets": targets,
            "problems": problems, "seconds": time.monotonic() - t0}


def verdict(suite: Suite, systems: tuple[str, ...], results: list[Result], targets: list[TargetResult],
            problems: list[str], gpu: str | None) -> tuple[bool, str | None]:
    """(passed, reason) from a run's figures: every target met, ours correct everywhere, nothing skipped."""
    reasons = list(problems)
    if "ours" not in systems:
        reasons.append("'ours' was not among --systems: nothing of ours was measured")
    ours_bad = [r for r in results if r.system in OURS and r.status != "ok"]
    if ours_bad:
        reasons.append(f"{len(ours_bad)} figure(s) of ours not correct or not measured: "
                       + "; ".join(f"{r.case} {r.mask} {r.status}" + (f" ({r.error[:80]})" if r.error else "")
                                   for r in ours_bad[:5]))
    skipped = [r for r in results if r.status == "skipped"]
    if skipped:
        reasons.append(f"{len(skipped)} figure(s) skipped: {skipped[0].error}")
    na = [t for t in targets if t.status == "n/a"]
    if na:
        reasons.append(f"targets are set for Hopper (H100, H200) and this GPU is {gpu}: timings recorded, "
                       f"{len(na)} target(s) not applicable")
    for t in targets:
        if t.gated and t.status in ("fail", "unmeasured"):
            reasons.append(t.summary())
    passed = not reasons and gate_passes(targets)
    return passed, None if passed else " | ".join(reasons)


def _slim(r: Result) -> dict[str, Any]:
    """A result for the evidence record: without the raw timing samples (the report JSON has them)."""
    d = r.as_dict()
    d["extra"] = {k: v for k, v in d["extra"].items() if k != "samples_ms"}
    return d


def headline(suite: Suite, run: dict[str, Any]) -> str:
    targets: list[TargetResult] = run["targets"]
    if suite.kind == "graph":
        parts = []
        for r in run["results"]:
            if r.status == "ok" and r.eager_us and r.replay_us:
                parts.append(f"{r.case} eager {r.eager_us:.1f} / replay {r.replay_us:.1f} us")
        return "ours eager vs graph replay per verify call: " + ("; ".join(parts) or "no figures")
    gated = [t for t in targets if t.gated]
    met = sum(t.status == "pass" for t in gated)

    def figs(ts: list[TargetResult]) -> list[str]:
        out = []
        for t in ts:
            if t.measured is not None:
                unit = SPECS[t.name].unit
                v = f"{t.measured * 100:+.1f}%" if unit == "pct" else (f"{t.measured:.0f}x" if t.measured >= 10
                                                                        else f"{t.measured:.2f}")
                out.append(f"{t.name} {v}")
        return out

    worst = figs(gated)
    reported = [f"{f} ({'met' if t.status == 'pass' else 'missed' if t.status == 'fail' else t.status})"
                for t in targets if not t.gated for f in figs([t])]
    return (f"{met}/{len(gated)} targets met on {run['gpu']}" + (f"; worst: {', '.join(worst)}" if worst else "")
            + (f"; reported, not gated: {', '.join(reported)}" if reported else ""))


def _metrics(suite: Suite, run: dict[str, Any], out_dir: Path) -> dict[str, Any]:
    counts = Counter(f"{r.system}:{r.status}" for r in run["results"])
    m: dict[str, Any] = {
        "suite": suite.name, "gpu": run["gpu"], "cases": len(suite.cases), "seconds": round(run["seconds"], 1),
        "results": dict(sorted(counts.items())), "missing": sorted(run["missing"]),
        "targets": {t.name: {"status": t.status, "measured": t.measured, "threshold": t.threshold, "op": t.op,
                             "worst_case": t.worst_case, "miss": t.miss, "goal_met": t.goal_met, "gated": t.gated}
                    for t in run["targets"]},
        "out_dir": str(out_dir),
    }
    if run["ceilings"]:
        m["copy_tb_s"] = round(run["ceilings"]["copy_tb_s"], 3)
        m["matmul_tflop_s"] = round(run["ceilings"]["matmul_tflop_s"], 1)
    ours = {f"{r.case}/{r.mask}": {"replay_us": r.replay_us, "eager_us": r.eager_us}
            for r in run["results"] if r.system == "ours" and r.status == "ok"}
    m["ours_us"] = ours
    return m


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m kdtree_pipeline bench", description=__doc__.splitlines()[0])
    ap.add_argument("--suite", default="micro", help=f"one of {', '.join(suites_mod.SUITES)} (default: micro)")
    ap.add_argument("--systems", default=None,
                    help=f"comma list of {', '.join(suites_mod.SYSTEMS)} (default: the suite's systems)")
    ap.add_argument("--out", type=Path, default=None, help="folder for the JSON/markdown/PNG report "
                    "(default: build/bench/ under the project root)")
    ap.add_argument("--budget-s", type=float, default=None, help="wall-clock budget of the suite in seconds")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--list", action="store_true", help="list the suite's cases and exit")
    return ap


def _validated(args: argparse.Namespace) -> tuple[Suite, tuple[str, ...]]:
    """The suite and systems ``args`` name (from :mod:`~kdtree_pipeline.bench.suites`);
    ValueError naming the bad argument, what was expected and what came."""
    suite = suites_mod.get_suite(args.suite)
    systems = suites_mod.parse_systems(args.systems, suite)
    if args.budget_s is not None and not args.budget_s > 0:
        raise ValueError(f"--budget-s: expected a positive number of seconds, got {args.budget_s}")
    return suite, systems


def check_args(argv: list[str]) -> str | None:
    """What is wrong with the bench arguments ``argv``, or None: pure (no GPU, no
    files), so nox and the module entry point report a bad suite or system first."""
    ap = _parser()

    def error(message: str) -> None:
        raise ValueError(message)

    ap.error = error  # type: ignore[method-assign]
    try:
        if any(a in ("-h", "--help") for a in argv):
            return None
        _validated(ap.parse_args(argv))
    except ValueError as e:
        return str(e)
    return None


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        suite, systems = _validated(args)
    except ValueError as e:
        print(f"bench: {e}", file=sys.stderr)
        return 2
    if args.list:
        for c in suite.cases:
            print(f"{c.name:32s} masks {','.join(c.masks)}")
        print(f"{len(suite.cases)} cases; systems {', '.join(systems)}; targets {', '.join(suite.targets) or '-'}")
        return 0

    rc = evidence.refuse_without_cuda(GATE, variant=suite.name, metrics={"suite": suite.name})
    if rc is not None:
        return rc

    out_dir = args.out if args.out is not None else evidence.repo_root() / "build" / "bench"
    run = run_suite(suite, systems, args.budget_s or suite.budget_s, args.seed)
    passed, reason = verdict(suite, systems, run["results"], run["targets"], run["problems"], run["gpu"])
    rep = report_mod.build(suite, suite.cases, run["results"], run["floors"], run["ceilings"], run["targets"],
                           run["missing"], systems,
                           meta={"gpu": run["gpu"], "capability": run["capability"], "l2_bytes": run["l2_bytes"],
                                 "seconds": round(run["seconds"], 1), "passed": passed, "reason": reason},
                           sm120_floors=run["sm120_floors"])
    files: dict[str, Any] = {}
    try:
        files = report_mod.write(rep, out_dir)
    except Exception as e:  # the evidence record is still written
        files = {"error": _err_text(e)}
        print(f"bench: writing the report to {out_dir} failed: {files['error']}", file=sys.stderr)
    head = headline(suite, run)
    details = report_mod.json_safe({
        "markdown_table": report_mod.main_table(rep),
        "markdown_table_eager": report_mod.compare_table(rep, eager=True) if suite.kind == "compare" else None,
        "markdown": report_mod.markdown(rep),
        "targets": [t.as_dict() for t in run["targets"]],
        "notes": report_mod.notes(rep),
        "files": {k: ([str(p) for p in v] if isinstance(v, list) else str(v)) for k, v in files.items()},
        "ceilings": run["ceilings"],
        "results": [_slim(r) for r in run["results"]],
    })
    rec = evidence.make_record(GATE, passed, report_mod.json_safe(_metrics(suite, run, out_dir)), head,
                               reason=reason, variant=suite.name, details=details)
    path = evidence.write_record(rec)
    _say("")
    _say(report_mod.main_table(rep))
    _say("")
    for t in run["targets"]:
        _say(f"  {t.summary()}")
    _say(f"\nbench {suite.name}: {'PASS' if passed else 'FAIL'}: {head} in {run['seconds']:.0f}s")
    if reason:
        _say(f"  why: {reason}")
    _say(f"  report: {files.get('markdown', '-')}; evidence: {path}")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
