"""The live run: SGLang serving HTTP through the plugin, kernel off then on, eager and with graphs.

Each *launch* starts one server (``python -m sglang.launch_server``, its own process group, its
log kept), waits until it answers, sends its requests as token ids to the native ``/generate``
(the model has no tokenizer), and stops it (SIGTERM, then SIGKILL), then checks that no process
and no GPU memory of it is left. What one launch found is saved as ``launch-<name>.json`` in the
run's folder as soon as it ends, so a run cut short (a device call's time limit) resumes with the
launches not yet done when the same command runs again on the same code.

:func:`evaluate` then compares the launches: greedy outputs of kernel on against off (:mod:`.compare`),
decode speed on against off, and the faults.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .client import HttpError, SmokeClient, wait_ready
from .launcher import ServerProcess

#: Prompt lengths of the output comparison (tokens) and the tokens generated for each.
OUTPUT_LENGTHS = (4096, 23000, 65536, 91000)
OUTPUT_TOKENS = 32
#: Prompt lengths and batch sizes of the decode-speed runs, and the tokens each request decodes.
SPEED_LENGTHS = (23000, 65536, 91000)
SPEED_BATCHES = (1, 8)
SPEED_TOKENS = 48
#: The mixed batch of the concurrency check (eight requests at once).
CONCURRENT_LENGTHS = (1024, 2048, 4096, 8192, 16384, 23000, 32768, 65536)
CONTEXT_LENGTH = 131072
#: Seconds a server may take to answer after its start (the gate's wait, and SGLang's warmup limit).
READY_TIMEOUT_S = 1500.0
#: Token ids drawn for prompts: clear of the special ids at the top of Kimi's vocabulary.
TOKEN_RANGE = (1000, 160000)
#: What every server gets (see docs/design.md, "Live in SGLang", for why each flag is there).
COMMON_FLAGS = (
    "--skip-tokenizer-init", "--attention-backend", "triton", "--context-length", str(CONTEXT_LENGTH),
    "--chunked-prefill-size", "16384", "--max-running-requests", "8", "--mem-fraction-static", "0.8",
    "--grammar-backend", "none", "--sampling-backend", "pytorch", "--disable-custom-all-reduce",
    "--decode-log-interval", "1", "--log-level", "info", "--watchdog-timeout", "1800",
)
SPEC_FLAGS = {
    "EAGLE": ("--speculative-algorithm", "EAGLE", "--speculative-num-steps", "3", "--speculative-eagle-topk", "4",
              "--speculative-num-draft-tokens", "16"),
    "NGRAM": ("--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "16",
              "--speculative-ngram-max-bfs-breadth", "4"),
}
GRAPH_FLAGS = {False: ("--disable-cuda-graph",), True: ("--cuda-graph-max-bs", "8", "--disable-prefill-cuda-graph")}


@dataclass(frozen=True)
class Launch:
    """One server start: the switch as given, CUDA graphs or eager, the speculative algorithm,
    extra environment, and which checks run (``refuse``: the launch must stop with the plugin's
    message instead of serving)."""

    name: str
    kdtree: str
    graphs: bool = False
    spec: str = "EAGLE"
    env: tuple[tuple[str, str], ...] = ()
    checks: tuple[str, ...] = ("outputs", "spec", "stream", "concurrent", "speed")

    @property
    def mode(self) -> str:
        return "graphs" if self.graphs else "eager"


FULL = ("outputs", "spec", "stream", "concurrent", "speed")
LAUNCHES: dict[str, Launch] = {x.name: x for x in (
    Launch("typo", "typo", checks=("refuse",)),
    Launch("off-eager", "off"),
    Launch("on-eager", "on", checks=(*FULL, "faults")),
    Launch("no-library", "on", env=(("KDTREE_LIB", "/nonexistent/libkdtree_verify.so"),), checks=("serve",)),
    Launch("off-graphs", "off", graphs=True),
    Launch("on-graphs", "on", graphs=True),
    Launch("on-ngram", "on", spec="NGRAM", checks=("spec", "speed")),
)}
DEFAULT_LAUNCHES = ("typo", "off-eager", "on-eager", "no-library", "off-graphs", "on-graphs")


class LiveError(RuntimeError):
    """The live run cannot start: no GPU, no SGLang, no model."""


def prompt(length: int, seed: int) -> list[int]:
    """``length`` token ids drawn from ``seed``: the same prompt in every launch."""
    r = random.Random(f"{length}-{seed}")
    return [r.randrange(*TOKEN_RANGE) for _ in range(length)]


def server_argv(launch: Launch, model_dir: Path, port: int, python: str = sys.executable) -> list[str]:
    return [python, "-m", "sglang.launch_server", "--model-path", str(model_dir), "--host", "127.0.0.1",
            "--port", str(port), *COMMON_FLAGS, *SPEC_FLAGS[launch.spec], *GRAPH_FLAGS[launch.graphs]]


def entry_point_dir(root: Path, out: Path) -> Path:
    """A ``kdtree_engine-<version>.dist-info`` holding the entry points pyproject.toml declares,
    so that SGLang's ``load_plugins`` finds the plugin of this checkout's ``src/`` (what
    ``pip install -e .`` registers, without installing into the host's Python)."""
    import tomllib

    meta = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    d = out / "entry-points" / f"kdtree_engine-{meta['version']}.dist-info"
    d.mkdir(parents=True, exist_ok=True)
    (d / "METADATA").write_text(f"Metadata-Version: 2.1\nName: kdtree-engine\nVersion: {meta['version']}\n")
    lines = []
    for group, eps in meta.get("entry-points", {}).items():
        lines += [f"[{group}]", *(f"{k} = {v}" for k, v in eps.items()), ""]
    (d / "entry_points.txt").write_text("\n".join(lines))
    return d.parent


def server_env(launch: Launch, paths: list[Path], cache: Path, ready_timeout: float = READY_TIMEOUT_S) -> dict[str, str]:
    env = {
        # SGLang's warmup request (the first forward: a fresh host JIT-compiles its kernels with nvcc
        # there) kills the server after 600 s by default; the gate's own wait is the limit
        "SGLANG_WARMUP_TIMEOUT": str(int(ready_timeout)),
        "PYTHONPATH": os.pathsep.join(str(p) for p in paths),
        "KDTREE_VERIFY": launch.kdtree,
        # DeepGEMM's stand-in is importable; this keeps SGLang from reaching for its kernels
        "SGLANG_ENABLE_JIT_DEEPGEMM": "0",
        # compiled kernels are kept across the run's launches (a fresh host compiles each once)
        "TRITON_CACHE_DIR": str(cache / "triton"),
        "TVM_FFI_CACHE_DIR": str(cache / "tvm-ffi"),
        "PYTHONUNBUFFERED": "1",
    }
    env.update(dict(launch.env))
    return env


# -- GPU state ---------------------------------------------------------------------------------


def gpu_memory_used_mib() -> int | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30)
        return int(out.stdout.split()[0]) if out.returncode == 0 else None
    except (OSError, ValueError, IndexError, subprocess.SubprocessError):
        return None


def gpu_processes() -> list[int]:
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
        return [int(x) for x in out.stdout.split()] if out.returncode == 0 else []
    except (OSError, ValueError, subprocess.SubprocessError):
        return []


# -- requests ----------------------------------------------------------------------------------


def _payload(ids: list[int], max_new: int, logprobs: bool) -> dict[str, Any]:
    p: dict[str, Any] = {"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": max_new,
                                                               "ignore_eos": True}}
    if logprobs:
        p.update(return_logprob=True, top_logprobs_num=2)
    return p


def generate(client: SmokeClient, ids: list[int], max_new: int, logprobs: bool = True) -> dict[str, Any]:
    """One greedy request: its output ids, the chosen tokens' logprobs, the top two per position
    (id, logprob) and SGLang's speculative figures."""
    body, lat = client.post_json("/generate", _payload(ids, max_new, logprobs))
    if isinstance(body, list):
        body = body[0]
    meta = body.get("meta_info") or {}
    out = {"ids": list(body.get("output_ids") or []), "latency_s": round(lat, 4),
           "prompt_tokens": meta.get("prompt_tokens"), "completion_tokens": meta.get("completion_tokens"),
           "spec_verify_ct": meta.get("spec_verify_ct"), "spec_accept_length": meta.get("spec_accept_length"),
           "e2e_latency": meta.get("e2e_latency")}
    if logprobs:
        out["logprobs"] = [row[0] for row in meta.get("output_token_logprobs") or []]
        out["top2"] = [[[c[0], c[1]] for c in (row or [])[:2]] for row in meta.get("output_top_logprobs") or []]
    return out


def _tokens(event: dict[str, Any]) -> int:
    meta = event.get("meta_info") or {}
    n = meta.get("completion_tokens")
    return int(n) if isinstance(n, int) else len(event.get("output_ids") or [])


def _tokens_per_step(stream: Any) -> float | None:
    """Tokens one verify step of the request produced, from SGLang's count of its verify steps in
    the last event (the first token comes from the prefill, not from a verify step)."""
    meta = (stream.events[-1].get("meta_info") or {}) if stream.events else {}
    ct, n = meta.get("spec_verify_ct"), meta.get("completion_tokens")
    if isinstance(ct, int) and isinstance(n, int) and ct > 0 and n > 1:
        return (n - 1) / ct
    return None


def decode_window(streams: list[Any]) -> dict[str, Any]:
    """Decode speed of requests streamed together: the window from the last first token (every
    request is past its prefill) to the first end (all still decoding); tokens each produced in
    it, the verify steps of one request in it, tokens per second and the verify step's time.

    The steps come from SGLang's own count (``spec_verify_ct``, in a request's last event): its
    tokens in the window over its tokens per step. Counting events would undercount them,
    because a stream sends one event for several steps when they queue up. Without that count,
    each event counts as one step (``steps_from`` says which was used)."""
    firsts = [s.times[0] for s in streams if s.times]
    lasts = [s.times[-1] for s in streams if s.times]
    if len(firsts) != len(streams) or not streams:
        return {"error": "a request streamed no tokens"}
    lo, hi = max(firsts), min(lasts)
    if hi <= lo:
        return {"error": f"no window where all {len(streams)} requests decode (first end {hi:.3f}s before "
                         f"the last first token {lo:.3f}s)"}
    tokens, steps, per_step = 0, [], [_tokens_per_step(s) for s in streams]
    counted = all(p is not None for p in per_step)
    for s, p in zip(streams, per_step, strict=True):
        inside = [(t, _tokens(e)) for t, e in zip(s.times, s.events, strict=True) if lo <= t <= hi]
        if len(inside) >= 2:
            made = inside[-1][1] - inside[0][1]
            tokens += made
            steps.append(made / p if counted else len(inside) - 1)
    window = hi - lo
    mean_steps = sum(steps) / len(steps) if steps else 0
    return {"window_s": round(window, 4), "tokens": tokens, "tokens_per_s": round(tokens / window, 2),
            "steps": round(mean_steps, 1), "step_ms": round(1000 * window / mean_steps, 3) if mean_steps else None,
            "accept_length": round(tokens / len(streams) / mean_steps, 3) if mean_steps else None,
            "steps_from": "spec_verify_ct" if counted else "events"}


def speed_run(client: SmokeClient, length: int, bs: int, timeout: float) -> dict[str, Any]:
    ids = [prompt(length, 1000 + i) for i in range(bs)]
    with ThreadPoolExecutor(max_workers=bs) as pool:
        streams = list(pool.map(lambda x: client.stream_generate(
            _payload(x, SPEED_TOKENS, False), read_timeout=timeout, total_timeout=4 * timeout), ids))
    got = decode_window(streams)
    got.update(length=length, bs=bs, wall_s=round(max(s.latency_s for s in streams), 3))
    return got


# -- one launch --------------------------------------------------------------------------------


@dataclass
class LaunchResult:
    name: str
    launch: dict[str, Any]
    started: bool = False
    ready_s: float | None = None
    exit: str | None = None
    checks: dict[str, Any] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)  # seconds each check took
    plugin: dict[str, Any] = field(default_factory=dict)
    cleanup: dict[str, Any] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    log: str = ""
    log_tail: str = ""
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        return not self.problems


def _listening(port: int) -> bool:
    import socket

    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1.0):
            return True
    except OSError:
        return False


def read_plugin_lines(log: Path) -> dict[str, Any]:
    """What the plugin wrote in a server's log: its decision lines and its last counts line."""
    text = log.read_text(errors="replace") if log.is_file() else ""
    lines = [ln for ln in text.splitlines() if "kdtree verify" in ln]
    counts = [ln for ln in lines if "kernel calls (step plan" in ln]
    last = counts[-1] if counts else ""
    out: dict[str, Any] = {
        "hooked": any("hook registered on TritonAttnBackend.forward_extend" in ln for ln in lines),
        "on_device": any("]: on, sm_" in ln for ln in lines),
        "off": [ln.split("kdtree verify", 1)[1][:300] for ln in lines if ": off" in ln][:4],
        "fallback_kinds": sorted({ln.split("falling back to SGLang's path: ", 1)[1].split(" (logged once")[0]
                                  for ln in lines if "falling back to SGLang's path: " in ln}),
        "kernel_calls": None, "verify_fallbacks": None, "counts_line": last.split("kdtree verify", 1)[-1][:300],
        "refusal": next((ln[:300] for ln in text.splitlines() if "is not valid: expected 'on' or 'off'" in ln), None),
        "cuda_graph_steps": sum(1 for ln in text.splitlines() if "Decode batch" in ln and "cuda graph: True" in ln),
    }
    if last:
        try:
            after = last.split("]: ", 1)[1]
            out["kernel_calls"] = int(after.split()[0])
            out["verify_fallbacks"] = int(after.split("), ")[1].split()[0])
        except (IndexError, ValueError):
            pass
    return out


class Run:
    """A live run: where its files go, what the servers get, and the launches done so far."""

    def __init__(self, out: Path, model_dir: Path, site: list[Path], *, root: Path, port: int = 30117,
                 ready_timeout: float = READY_TIMEOUT_S, request_timeout: float = 600.0, code: str = "",
                 python: str = sys.executable, argv=None) -> None:
        self.out, self.model_dir, self.root, self.port = out, model_dir, root, port
        #: (launch, model_dir, port) -> the server's command line (a test puts a stand-in server here)
        self.argv = argv or (lambda launch, model, port: server_argv(launch, model, port, python))
        self.ready_timeout, self.request_timeout, self.code, self.python = ready_timeout, request_timeout, code, python
        self.out.mkdir(parents=True, exist_ok=True)
        ep = entry_point_dir(root, out)
        standins = Path(__file__).resolve().parent / "standins"
        # the bundle first (SGLang 0.5.17 and its pins over the host's), then the stand-ins for what
        # it lacks, the plugin's entry point, and this checkout's product
        self.paths = [*site, standins, ep, root / "src"]
        self.cache = out / "cache"

    def saved(self, name: str) -> Path:
        return self.out / f"launch-{name}.json"

    def done(self, name: str) -> LaunchResult | None:
        """The result a previous invocation saved for this launch, on this code."""
        p = self.saved(name)
        if not p.is_file():
            return None
        try:
            d = json.loads(p.read_text())
        except ValueError:
            return None
        if d.get("code") != self.code:
            return None
        d.pop("code", None)
        return LaunchResult(**d)

    def save(self, r: LaunchResult) -> None:
        tmp = self.saved(r.name).with_suffix(".tmp")
        tmp.write_text(json.dumps({**asdict(r), "code": self.code}, indent=1, default=str))
        tmp.replace(self.saved(r.name))

    def run(self, launch: Launch, progress=print) -> LaunchResult:
        r = LaunchResult(launch.name, asdict(launch))
        t0 = time.monotonic()
        log = self.out / f"server-{launch.name}.log"
        r.log = str(log)
        base_mem = gpu_memory_used_mib()
        if _listening(self.port):
            r.problems.append(f"something already listens on port {self.port}: stop it or pass another --port, "
                              "so that the checks reach the server this launch starts")
            return r  # not saved: a port held by something else says nothing of this code; run it again
        argv = self.argv(launch, self.model_dir, self.port)
        env = server_env(launch, self.paths, self.cache, self.ready_timeout)
        server = ServerProcess(argv, log, kdtree_verify=None, extra_env=env, grace_s=60.0)
        client = SmokeClient(f"http://127.0.0.1:{self.port}", timeout=self.request_timeout)
        try:
            server.start()
            r.started = True
            if "refuse" in launch.checks:
                self._refused(server, r)
                return r
            ready = wait_ready(client, deadline_s=self.ready_timeout, poll_s=2.0, request_timeout_s=60.0,
                               started_at=server.started_at, alive=server.exit_reason,
                               progress=lambda line: progress(f"  {launch.name}: {line}"))
            if not ready.ready:
                r.problems.append(f"not ready: {ready.stopped_because} ({'; '.join(ready.error_lines()[-2:])})")
                return r
            r.ready_s = round(ready.waited_s, 1)
            progress(f"  {launch.name}: ready in {r.ready_s}s")
            for check in launch.checks:
                c0 = time.monotonic()
                try:
                    r.checks[check] = getattr(self, f"_check_{check}")(client, launch)
                except HttpError as e:
                    r.checks[check] = {"error": str(e)}
                    r.problems.append(f"{check}: {e}")
                r.timings[check] = round(time.monotonic() - c0, 1)
                progress(f"  {launch.name}: {check} done in {r.timings[check]}s")
                if server.exit_reason():
                    r.problems.append(f"{server.exit_reason()} during the {check} check")
                    break
        finally:
            r.exit = server.stop()
            r.plugin = read_plugin_lines(log)
            r.cleanup = self._cleanup(server, base_mem)
            r.log_tail = server.tail(40)
            r.seconds = round(time.monotonic() - t0, 1)
            self._judge(launch, r)
            self.save(r)
        return r

    # each check returns what it measured; a wrong answer is a problem, an HTTP error too (raised)

    def _refused(self, server: ServerProcess, r: LaunchResult) -> None:
        deadline = time.monotonic() + 300
        while server.exit_reason() is None and time.monotonic() < deadline:
            time.sleep(1.0)
        r.checks["refuse"] = {"exit": server.exit_reason(), "seconds": round(time.monotonic() - server.started_at, 1)}

    def _check_outputs(self, client: SmokeClient, launch: Launch) -> dict[str, Any]:
        return {str(n): generate(client, prompt(n, 0), OUTPUT_TOKENS) for n in OUTPUT_LENGTHS}

    def _check_spec(self, client: SmokeClient, launch: Launch) -> dict[str, Any]:
        g = generate(client, prompt(2048, 7), 64, logprobs=False)
        info = {}
        try:
            info = client.get_json("/server_info", timeout=60)
        except HttpError:
            pass
        states = info.get("internal_states") or [{}]
        return {"spec_verify_ct": g["spec_verify_ct"], "spec_accept_length": g["spec_accept_length"],
                "completion_tokens": g["completion_tokens"],
                "avg_spec_accept_length": (states[0] or {}).get("avg_spec_accept_length"),
                "version": info.get("version")}

    def _check_stream(self, client: SmokeClient, launch: Launch) -> dict[str, Any]:
        s = client.stream_generate(_payload(prompt(1024, 3), 16, False), read_timeout=self.request_timeout)
        return {"events": len(s.events), "done": s.done, "tokens": _tokens(s.events[-1]) if s.events else 0,
                "first_event_s": round(s.times[0], 3) if s.times else None, "latency_s": round(s.latency_s, 3)}

    def _check_concurrent(self, client: SmokeClient, launch: Launch) -> dict[str, Any]:
        t0 = time.monotonic()
        with ThreadPoolExecutor(max_workers=len(CONCURRENT_LENGTHS)) as pool:
            got = list(pool.map(lambda n: generate(client, prompt(n, 5), 16, logprobs=False), CONCURRENT_LENGTHS))
        return {"lengths": list(CONCURRENT_LENGTHS), "tokens": [len(g["ids"]) for g in got],
                "wall_s": round(time.monotonic() - t0, 3)}

    def _check_speed(self, client: SmokeClient, launch: Launch) -> dict[str, Any]:
        lengths = SPEED_LENGTHS if launch.spec == "EAGLE" else SPEED_LENGTHS[:1]
        return {f"{n}x{bs}": speed_run(client, n, bs, self.request_timeout) for n in lengths for bs in SPEED_BATCHES}

    def _check_serve(self, client: SmokeClient, launch: Launch) -> dict[str, Any]:
        g = generate(client, prompt(2048, 9), 16, logprobs=False)
        return {"tokens": len(g["ids"]), "spec_verify_ct": g["spec_verify_ct"]}

    def _check_faults(self, client: SmokeClient, launch: Launch) -> dict[str, Any]:
        out: dict[str, Any] = {}
        try:
            generate(client, prompt(CONTEXT_LENGTH + 64, 11), 4, logprobs=False)
            out["too_long"] = {"status": 200, "answer": "served a prompt over the context length"}
        except HttpError as e:
            out["too_long"] = {"status": e.status, "answer": (e.body or str(e))[:300]}
        try:
            s = client.stream_generate(_payload(prompt(4096, 12), 512, False), read_timeout=self.request_timeout,
                                       stop_after=3)
            out["disconnect"] = {"events_read": len(s.events)}
        except HttpError as e:
            out["disconnect"] = {"error": str(e)}
        time.sleep(3.0)  # SGLang aborts a dropped stream's request two seconds after the drop
        g = generate(client, prompt(2048, 13), 16, logprobs=False)
        out["after"] = {"tokens": len(g["ids"])}
        return out

    def _cleanup(self, server: ServerProcess, base_mem: int | None) -> dict[str, Any]:
        pid = server.pid
        deadline = time.monotonic() + 60
        from .launcher import group_members

        while time.monotonic() < deadline:
            left = group_members(pid) if pid else []
            mem = gpu_memory_used_mib()
            near = base_mem is None or mem is None or mem <= base_mem + 1024
            if not left and near:
                break
            time.sleep(1.0)
        return {"processes_left": group_members(pid) if pid else [], "gpu_processes": gpu_processes(),
                "gpu_mem_before_mib": base_mem, "gpu_mem_after_mib": gpu_memory_used_mib()}

    def _judge(self, launch: Launch, r: LaunchResult) -> None:
        """The launch's own checks (comparisons between launches are :func:`evaluate`'s)."""
        p, c, pl = r.problems, r.checks, r.plugin
        if r.cleanup.get("processes_left"):
            p.append(f"processes left after the stop: {r.cleanup['processes_left']}")
        before, after = r.cleanup.get("gpu_mem_before_mib"), r.cleanup.get("gpu_mem_after_mib")
        if before is not None and after is not None and after > before + 1024:
            p.append(f"GPU memory not given back: {after} MiB used after the stop, {before} before the start")
        if "refuse" in launch.checks:
            exit_ = c.get("refuse", {}).get("exit") or ""
            if "exited with code" not in exit_ or exit_.endswith("code 0"):
                p.append(f"KDTREE_VERIFY={launch.kdtree!r} did not stop the launch ({exit_ or 'still running'})")
            if not pl.get("refusal"):
                p.append("the log does not carry the plugin's message naming KDTREE_VERIFY and its value")
            return
        if r.ready_s is None:
            return  # the readiness problem is recorded
        if launch.kdtree == "on" and not dict(launch.env).get("KDTREE_LIB"):
            if not pl.get("hooked"):
                p.append("the plugin did not log that it hooked TritonAttnBackend.forward_extend")
            if not pl.get("kernel_calls"):
                p.append(f"no kernel calls logged ({pl.get('counts_line') or 'no counts line'})")
            if pl.get("verify_fallbacks"):
                p.append(f"{pl['verify_fallbacks']} verify calls went to SGLang's path: {pl.get('fallback_kinds')}")
        if launch.kdtree == "off" and not any("KDTREE_VERIFY=off" in ln for ln in pl.get("off", [])):
            p.append("the plugin did not log its 'off: KDTREE_VERIFY=off' line")
        if dict(launch.env).get("KDTREE_LIB"):
            if not any("kernel library failed to load" in ln for ln in pl.get("off", [])):
                p.append("a missing kernel library was not logged as the plugin's 'off' line")
            if c.get("serve", {}).get("tokens") != 16:
                p.append(f"with the library missing the server did not serve: {c.get('serve')}")
        if launch.graphs and not pl.get("cuda_graph_steps"):
            p.append("no decode step ran from a CUDA graph ('cuda graph: True' in SGLang's decode lines)")
        spec = c.get("spec", {})
        if "spec" in c and not (spec.get("spec_verify_ct") or 0) > 0:
            p.append(f"no speculative verify steps reported: {spec}")
        st = c.get("stream", {})
        if "stream" in c and not (st.get("done") and st.get("tokens") == 16 and st.get("events", 0) > 1):
            p.append(f"the streamed request did not deliver 16 tokens in several events and [DONE]: {st}")
        cc = c.get("concurrent", {})
        if "concurrent" in c and cc.get("tokens") != [16] * len(CONCURRENT_LENGTHS):
            p.append(f"the concurrent requests did not each deliver 16 tokens: {cc.get('tokens')}")
        for key, run in (c.get("speed") or {}).items():
            if isinstance(run, dict) and run.get("error"):
                p.append(f"speed {key}: {run['error']}")
        f = c.get("faults", {})
        if "faults" in c:
            if (f.get("too_long") or {}).get("status") != 400 or "context length" not in str(f.get("too_long")):
                p.append(f"a prompt over the context length did not get SGLang's 400 answer: {f.get('too_long')}")
            if (f.get("after") or {}).get("tokens") != 16:
                p.append(f"the server did not serve after the faults: {f.get('after')}")


def prepare_site(bundle: Path, dest: Path) -> Path:
    """Unpack the live bundle (``tools/live_site.py``) once; a folder already unpacked from the
    same bundle (by its bytes, wherever it lies: a device call gets a copy) is kept."""
    stamp = dest / ".from"
    digest = hashlib.sha256()
    with open(bundle, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    want = f"sha256:{digest.hexdigest()}"
    if stamp.is_file() and stamp.read_text() == want:
        return dest
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    subprocess.run(["tar", "-xJf", str(bundle), "-C", str(dest)], check=True)
    stamp.write_text(want)
    return dest


def site_stamp(site: Path) -> str:
    """Which bundle a site folder was unpacked from (:func:`prepare_site`), or the folder itself."""
    stamp = site / ".from"
    return stamp.read_text() if stamp.is_file() else str(site.resolve())


def run_launches(run: Run, names: list[str], *, budget_s: float | None = None, progress=print
                 ) -> dict[str, LaunchResult]:
    """Run each named launch not already done on this code, in order; stop starting new ones
    when less than the slowest launch so far is left of ``budget_s``."""
    t0 = time.monotonic()
    results: dict[str, LaunchResult] = {}
    slowest = 0.0
    for name in names:
        prev = run.done(name)
        if prev is not None:
            progress(f"live: {name}: done earlier on this code ({'pass' if prev.passed else 'FAIL'})")
            results[name] = prev
            continue
        left = None if budget_s is None else budget_s - (time.monotonic() - t0)
        if left is not None and left < max(slowest, 120.0):
            progress(f"live: {name}: not started, {left:.0f}s of the budget left (the slowest launch took "
                     f"{slowest:.0f}s); run the same command again to go on")
            break
        progress(f"live: {name}: starting ({LAUNCHES[name]})")
        r = run.run(LAUNCHES[name], progress=progress)
        slowest = max(slowest, r.seconds)
        progress(f"live: {name}: {'pass' if r.passed else 'FAIL: ' + '; '.join(r.problems)} ({r.seconds}s)")
        results[name] = r
    return results

