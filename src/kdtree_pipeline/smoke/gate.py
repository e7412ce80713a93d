"""The ``smoke`` gate: prove a live SGLang server serves with the verify kernel.

``python -m kdtree_pipeline smoke --url http://host:30000`` tests a running server;
``--launch "<command>"`` starts one (``KDTREE_VERIFY`` from ``--kdtree``, output to
a log file, the whole process group stopped at the end, Ctrl-C included), waits
until ``/health`` and ``/v1/models`` answer, then runs the checks (short prompt,
long-context pass key, streaming, concurrent requests, speculative metrics) and,
with ``--record-baseline`` / ``--compare-baseline``, the output fingerprint.
Writes one evidence record (``smoke.json``; ``smoke-baseline.json`` when recording
a baseline) and exits 0 on pass, 1 on any failed check, 2 on bad usage.
"""

from __future__ import annotations

import argparse
import signal
import socket
import sys
import threading
from pathlib import Path
from typing import Any

from .. import evidence
from . import checks as C
from .client import HttpError, Readiness, SmokeClient, wait_ready
from .fingerprint import FingerprintError, compare, load_baseline, make_fingerprint, save_baseline
from .launcher import LaunchError, ServerProcess, parse_command

GATE = "smoke"
DEFAULT_PORT = 30000
SERVER_INFO_KEYS = (
    "version", "model_path", "device", "tp_size", "dp_size", "dtype", "kv_cache_dtype",
    "attention_backend", "speculative_algorithm", "speculative_eagle_topk",
    "speculative_num_steps", "speculative_num_draft_tokens", "kdtree_verify",
)


class UsageError(ValueError):
    """Bad command-line input: exit 2, nothing written."""


class _Terminated(Exception):
    """SIGTERM arrived; raised so that ``finally`` blocks stop the server."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m kdtree_pipeline smoke",
        description="Live-service smoke gate against an OpenAI-compatible SGLang server.",
    )
    where = p.add_argument_group("server")
    where.add_argument("--url", help="base URL of the server, e.g. http://127.0.0.1:30000 "
                       "(with --launch: default from its --host/--port, else port 30000)")
    where.add_argument("--launch", metavar="COMMAND",
                       help='command that starts the server, e.g. "python -m sglang.launch_server '
                       '--model-path ... --port 30000"; run in its own process group')
    where.add_argument("--kdtree", choices=("on", "off"), default=None,
                       help="KDTREE_VERIFY for --launch (with --url: what the server runs); "
                       "default off with --record-baseline, else on")
    where.add_argument("--log", type=Path, default=None,
                       help="server log file for --launch (default build/smoke/server-kdtree-<on|off>.log)")
    where.add_argument("--log-lines", type=int, default=30, help="log lines shown on failure")
    where.add_argument("--stop-grace", type=float, default=30.0,
                       help="seconds between SIGTERM and SIGKILL when stopping the server")
    t = p.add_argument_group("timing")
    t.add_argument("--ready-timeout", type=float, default=None,
                   help="overall readiness deadline in seconds (default 60 with --url, 1800 with --launch)")
    t.add_argument("--poll", type=float, default=1.0, help="readiness poll interval, seconds")
    t.add_argument("--health-timeout", type=float, default=30.0,
                   help="per-request timeout while polling readiness, seconds")
    t.add_argument("--timeout", type=float, default=300.0, help="per-request timeout for checks")
    t.add_argument("--stream-timeout", type=float, default=60.0,
                   help="longest silence allowed inside a streamed answer, seconds")
    c = p.add_argument_group("checks")
    c.add_argument("--model", default=None, help="model name (default: the first of /v1/models)")
    c.add_argument("--prompt", default="The capital of France is")
    c.add_argument("--expect", default=" Paris", help="expected start of the short continuation")
    c.add_argument("--max-tokens", type=int, default=8)
    c.add_argument("--long-tokens", type=int, default=23000,
                   help="long-context prompt length target in tokens (approximated by words; the "
                   "server's usage.prompt_tokens must reach it)")
    c.add_argument("--passkey-seed", type=int, default=0)
    c.add_argument("--concurrency", type=int, default=4)
    c.add_argument("--spec-max-tokens", type=int, default=32)
    c.add_argument("--allow-no-spec", action="store_true",
                   help="pass even if /generate reports no speculative metrics")
    f = p.add_argument_group("fingerprint")
    fx = f.add_mutually_exclusive_group()
    fx.add_argument("--record-baseline", type=Path, metavar="FILE",
                    help="write the outputs as the KDTREE_VERIFY=off baseline")
    fx.add_argument("--compare-baseline", type=Path, metavar="FILE",
                    help="compare the outputs (KDTREE_VERIFY=on) with a baseline")
    p.add_argument("--evidence-dir", type=Path, default=None,
                   help="where to write the evidence record (default $KDTREE_EVIDENCE_DIR or build/evidence)")
    return p


def url_from_launch(argv: list[str]) -> str:
    """``http://host:port`` from SGLang-style ``--host``/``--port`` in the launch command."""
    host, port = "127.0.0.1", str(DEFAULT_PORT)
    for i, a in enumerate(argv):
        for flag in ("--host", "--port"):
            val = None
            if a == flag and i + 1 < len(argv):
                val = argv[i + 1]
            elif a.startswith(flag + "="):
                val = a.split("=", 1)[1]
            if val is not None:
                if flag == "--host":
                    host = "127.0.0.1" if val in ("0.0.0.0", "::", "") else val
                else:
                    port = val
    return f"http://{host}:{port}"


def validate(args: argparse.Namespace) -> dict[str, Any]:
    """Check the arguments; return what the run needs. Raises :class:`UsageError`."""
    positive = {"--poll": args.poll, "--health-timeout": args.health_timeout,
                "--timeout": args.timeout, "--stream-timeout": args.stream_timeout,
                "--max-tokens": args.max_tokens, "--long-tokens": args.long_tokens,
                "--concurrency": args.concurrency, "--spec-max-tokens": args.spec_max_tokens,
                "--log-lines": args.log_lines}
    if args.ready_timeout is not None:
        positive["--ready-timeout"] = args.ready_timeout
    for name, val in positive.items():
        if not val > 0:
            raise UsageError(f"{name}: expected a positive number, got {val}")
    if args.stop_grace < 0:
        raise UsageError(f"--stop-grace: expected seconds >= 0, got {args.stop_grace}")
    kdtree = args.kdtree or ("off" if args.record_baseline else "on")
    if args.record_baseline and kdtree != "off":
        raise UsageError("--record-baseline: the baseline is the KDTREE_VERIFY=off run; "
                         "got --kdtree on (drop it or pass --kdtree off)")
    if args.compare_baseline and kdtree != "on":
        raise UsageError("--compare-baseline: compares a KDTREE_VERIFY=on run with the off "
                         "baseline; got --kdtree off")
    baseline = None
    if args.compare_baseline:
        try:
            baseline = load_baseline(args.compare_baseline)
        except FingerprintError as e:
            raise UsageError(str(e)) from None
    if args.record_baseline and not args.record_baseline.parent.is_dir():
        raise UsageError(f"--record-baseline: folder {str(args.record_baseline.parent)!r} "
                         "does not exist")
    argv = parse_command(args.launch) if args.launch is not None else None
    url = args.url or (url_from_launch(argv) if argv else None)
    client = None
    if url:
        try:
            client = SmokeClient(url, timeout=args.timeout)
        except ValueError as e:
            raise UsageError(str(e)) from None
    return {"kdtree": kdtree, "baseline": baseline, "argv": argv, "url": url, "client": client}


def _listening(client: SmokeClient) -> bool:
    try:
        with socket.create_connection((client.host, client.port), timeout=1.0):
            return True
    except OSError:
        return False


def _server_info(client: SmokeClient, timeout: float) -> tuple[dict[str, Any] | None, str | None]:
    """A few fields of ``/server_info`` (``/get_server_info`` on older servers)."""
    errors = []
    for path in ("/server_info", "/get_server_info"):
        try:
            info = client.get_json(path, timeout=timeout)
        except HttpError as e:
            errors.append(str(e))
            continue
        if isinstance(info, dict):
            picked = {k: info[k] for k in SERVER_INFO_KEYS if k in info}
            return {"source": f"server {path}", **picked}, None
        errors.append(f"GET {path}: expected a JSON object")
    return None, "; ".join(errors)


class Run:
    """Collects what one gate run found, for the evidence record and the summary."""

    def __init__(self, args: argparse.Namespace, cfg: dict[str, Any]) -> None:
        self.args, self.cfg = args, cfg
        self.ready: Readiness | None = None
        self.results: list[C.CheckResult] = []
        self.fingerprint: dict[str, Any] | None = None
        self.reasons: list[str] = []
        self.device: dict[str, Any] | None = None
        self.details: dict[str, Any] = {}
        self.lines: list[str] = []
        self.clock = "from process start" if cfg["argv"] else "from gate start (--url)"

    def fail(self, reason: str) -> None:
        self.reasons.append(reason)


def _check_all(run: Run, client: SmokeClient, model: str) -> None:
    a = run.args
    results = [
        C.check_short(client, model, a.prompt, a.expect, a.max_tokens),
        C.check_long(client, model, a.long_tokens, a.passkey_seed),
        C.check_stream(client, model, a.prompt, a.expect, a.max_tokens, a.stream_timeout),
        C.check_concurrent(client, model, a.prompt, a.expect, a.max_tokens, a.concurrency),
        C.check_spec(client, a.prompt, a.spec_max_tokens, require=not a.allow_no_spec),
    ]
    run.results = results
    for r in results:
        if not r.passed:
            run.fail(f"check {r.name} failed: {r.detail.splitlines()[0]}")


def _fingerprint(run: Run, model: str) -> None:
    a = run.args
    by = {r.name: r for r in run.results}
    short, long_ = by["short"], by["long"]
    long_prompt = C.passkey_prompt(a.long_tokens, a.passkey_seed)
    prompts = {"short_prompt": a.prompt, "max_tokens": a.max_tokens,
               "long_tokens": a.long_tokens, "passkey_seed": a.passkey_seed,
               "long_prompt_sha256": C.sha256(long_prompt.text)}
    if "text" not in short.data or "text" not in long_.data:
        run.fingerprint = {"mode": "record" if a.record_baseline else "compare", "passed": False}
        run.fail("fingerprint not taken: the short or long-context request failed")
        return
    fp = make_fingerprint(kdtree_verify=run.cfg["kdtree"], model=model, prompts=prompts,
                          short_text=short.data["text"], long_answer=long_.data["answer"],
                          long_text=long_.data["text"])
    if a.record_baseline:
        if short.passed and long_.passed:
            save_baseline(a.record_baseline, fp)
            run.fingerprint = {"mode": "record", "passed": True, "file": str(a.record_baseline)}
            run.lines.append(f"baseline written to {a.record_baseline}")
        else:
            run.fingerprint = {"mode": "record", "passed": False, "file": str(a.record_baseline)}
            run.fail(f"baseline not written to {a.record_baseline}: the short or long-context "
                     "check failed")
        return
    res = compare(run.cfg["baseline"], fp)
    run.fingerprint = {"mode": "compare", "passed": res["passed"],
                       "file": str(a.compare_baseline), "short_match": res["short_match"],
                       "long_answer_match": res["long_answer_match"]}
    run.details["fingerprint"] = res
    run.lines += ["fingerprint vs baseline (KDTREE_VERIFY=off):", *res["side_by_side"], res["note"]]
    if not res["passed"]:
        run.fail("fingerprint differs from the baseline: " + "; ".join(res["problems"]))


def _serve_and_check(run: Run) -> None:
    """Start (if asked), wait for readiness, run the checks, stop (always)."""
    a, cfg = run.args, run.cfg
    client: SmokeClient = cfg["client"]
    server: ServerProcess | None = None
    deadline = a.ready_timeout or (1800.0 if cfg["argv"] else 60.0)
    try:
        if cfg["argv"]:
            if _listening(client):
                run.fail(f"--launch: something already listens at {client.base_url}; stop it or "
                         "give the server another --port, so the smoke test reaches the server it starts")
                return
            log = a.log or evidence.repo_root() / "build" / "smoke" / f"server-kdtree-{cfg['kdtree']}.log"
            server = ServerProcess(cfg["argv"], log, kdtree_verify=cfg["kdtree"],
                                   grace_s=a.stop_grace).start()
            run.details["launch"] = {"argv": cfg["argv"], "log": str(log), "pid": server.pid,
                                     "KDTREE_VERIFY": cfg["kdtree"]}
            run.lines.append(f"launched pid {server.pid} with KDTREE_VERIFY={cfg['kdtree']}; "
                             f"log: {log}")
        ready = wait_ready(client, deadline_s=deadline, poll_s=a.poll,
                           request_timeout_s=a.health_timeout,
                           started_at=server.started_at if server else None,
                           alive=server.exit_reason if server else None,
                           progress=lambda line: print(f"smoke: {line}", file=sys.stderr, flush=True))
        run.ready = ready
        if not ready.ready:
            seen = "; ".join(ready.error_lines()) or "none"
            if server and server.exit_reason():
                run.fail(f"{server.exit_reason()} during startup after {ready.waited_s:.1f}s, "
                         f"before {client.base_url} was ready (errors seen: {seen})")
            else:
                run.fail(f"no server was ready at {client.base_url} within {deadline:g}s "
                         f"(errors seen while waiting: {seen})")
            return
        model = a.model or ready.models[0]
        run.device, info_err = _server_info(client, a.health_timeout)
        if info_err and run.device is None:
            run.details["server_info_error"] = info_err
        if server is not None and run.device is not None:
            run.device["gpu"] = evidence.device_info()  # launched here: this host's GPU
        _check_all(run, client, model)
        if a.record_baseline or a.compare_baseline:
            _fingerprint(run, model)
        if server and server.exit_reason():
            run.fail(f"{server.exit_reason()} during the run")
    finally:
        if server is not None:
            how = server.stop()
            run.details.setdefault("launch", {})["stopped_with"] = how
            run.lines.append(f"server process group stopped ({how})")
            if run.reasons:
                tail = server.tail(a.log_lines)
                run.details["launch"]["log_tail"] = tail
                run.lines.append(f"last {a.log_lines} lines of {server.log_path}:")
                run.lines += ["  | " + ln for ln in (tail.splitlines() or ["(empty log)"])]


def _metrics(run: Run) -> dict[str, Any]:
    r = run.ready
    spec = next((x for x in run.results if x.name == "spec"), None)
    return {
        "server_reached": bool(r and r.ready),
        "time_to_ready_s": round(r.waited_s) if r and r.ready else None,
        "ready_clock": run.clock,
        "kdtree_verify": run.cfg["kdtree"],
        "kdtree_verify_source": "set by --launch" if run.cfg["argv"] else "declared (--url)",
        "checks": {x.name: x.metrics() for x in run.results},
        "spec": ({k: v for k, v in spec.data.items() if k != "error"} if spec else None),
        "fingerprint": run.fingerprint,
    }


def _headline(run: Run, passed: bool) -> str:
    if not passed:
        return "FAIL: " + run.reasons[0]
    m = {x.name: x for x in run.results}
    parts = [f"ready in {round(run.ready.waited_s)}s" if run.ready else "not ready"]
    for n in ("short", "long", "stream"):
        if n not in m:
            continue
        label = n
        if n == "long":
            toks = m[n].data.get("server_prompt_tokens") or f"~{m[n].data.get('approx_tokens')}"
            label = f"long ({toks} tok)"
        parts.append(f"{label} {m[n].latency_s:.2f}s")
    if "concurrent" in m:
        parts.append(f"{m['concurrent'].data['n']} concurrent ok")
    spec = m.get("spec")
    if spec and spec.data.get("reported"):
        acc = spec.data.get("spec_accept_length")
        parts.append(f"spec verify_ct {spec.data.get('spec_verify_ct')}" +
                     (f", accept {acc:.2f}" if isinstance(acc, (int, float)) else ""))
    if run.fingerprint:
        parts.append("baseline recorded" if run.fingerprint["mode"] == "record"
                     else "fingerprint = baseline")
    return f"KDTREE_VERIFY={run.cfg['kdtree']}: " + "; ".join(parts)


def _summary(run: Run, passed: bool, path: Path) -> str:
    out = [f"smoke: PASS - {_headline(run, passed)}" if passed else "smoke: FAIL"]
    if run.ready is not None:
        r = run.ready
        state = f"ready after {r.waited_s:.1f}s" if r.ready else f"NOT ready after {r.waited_s:.1f}s"
        out.append(f"  readiness: {state} ({r.polls} polls, clock {run.clock})")
        for line in r.error_lines():
            out.append(f"    error while waiting: {line}")
    for x in run.results:
        lat = f"{x.latency_s:.3f}s" if x.latency_s is not None else "-"
        out.append(f"  {x.name:<10} {'ok  ' if x.passed else 'FAIL'} {lat:>9}  {x.detail}")
    out += ["  " + ln for ln in run.lines]
    for reason in run.reasons:
        if not reason.startswith("check "):  # check failures are on their own lines above
            out.append(f"  reason: {reason}")
    out.append(f"  evidence: {path}")
    return "\n".join(out)


def main(argv: list[str]) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:
        return int(e.code or 0)
    try:
        cfg = validate(args)
    except (UsageError, LaunchError) as e:
        print(f"smoke: {e}", file=sys.stderr)
        return 2
    run = Run(args, cfg)
    code = None
    if cfg["client"] is None:
        run.fail("no server to test: give --url URL of a running SGLang server or --launch "
                 '"<command>" to start one, so the smoke gate did not run')
    else:
        old = None
        if threading.current_thread() is threading.main_thread():
            def _on_term(signum: int, frame: object) -> None:
                raise _Terminated()
            old = signal.signal(signal.SIGTERM, _on_term)
        try:
            _serve_and_check(run)
        except LaunchError as e:
            run.fail(str(e))
        except KeyboardInterrupt:
            run.fail("interrupted (Ctrl-C); the server was stopped")
            code = 130
        except _Terminated:
            run.fail("terminated (SIGTERM); the server was stopped")
            code = 143
        finally:
            if old is not None:
                signal.signal(signal.SIGTERM, old)
    passed = not run.reasons
    record = evidence.make_record(
        GATE, passed, _metrics(run), _headline(run, passed),
        reason=None if passed else "; ".join(run.reasons),
        variant="baseline" if args.record_baseline else None,
        details={"readiness": _readiness_details(run.ready),
                 "checks": {x.name: {"detail": x.detail, **x.data} for x in run.results},
                 "url": cfg["url"], **run.details},
        device=run.device,
    )
    path = evidence.write_record(record, args.evidence_dir)
    print(_summary(run, passed, path))
    if not passed:
        print(f"smoke: FAIL: {run.reasons[0]}", file=sys.stderr)
    return 0 if passed else (code or 1)


def _readiness_details(r: Readiness | None) -> dict[str, Any] | None:
    if r is None:
        return None
    return {"ready": r.ready, "waited_s": round(r.waited_s, 3), "polls": r.polls,
            "errors": r.errors, "models": r.models, "stopped_because": r.stopped_because}


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main(sys.argv[1:]))
