"""A stand-in SGLang server for testing the smoke client (loopback only).

It speaks the few endpoints the gate uses (``/health``, ``/v1/models``,
``/v1/completions`` with and without ``stream``, native ``/generate``,
``/server_info``) and misbehaves on demand: slow start, never ready, delays,
status codes, wrong answers, non-JSON bodies, dropped connections, stalls and
drops mid-stream, dying after N requests. Use it in-process
(``FakeServer(FakeConfig(...)).start()``) or as a process for ``--launch``::

    python -m kdtree_pipeline.testing.fake_server --port 8123 --ready-after 0.5 --die-after 3

It is a test double, not a model: it answers the capital-of-France prompt with
" Paris", a pass-key prompt with the key it finds in the text, anything else
with " lorem ipsum".
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

MODEL = "fake-model"


@dataclass
class FakeConfig:
    """Behaviour switches; the in-process server reads them on every request, so a
    test may change them while it runs."""

    ready_after_s: float = 0.0
    never_ready: bool = False
    health_delay_s: float = 0.0
    completion_delay_s: float = 0.0
    answer: str | None = None
    passkey_answer: str | None = None
    prompt_tokens_ratio: float = 1.25
    report_usage: bool = True
    spec: bool = True
    stream_chunk_delay_s: float = 0.0
    stream_stall_after: int | None = None
    stream_stall_s: float = 5.0
    stream_drop_after: int | None = None
    non_json: set[str] = field(default_factory=set)
    status: dict[str, tuple[int, str]] = field(default_factory=dict)
    drop: set[str] = field(default_factory=set)
    die_after: int | None = None
    differ_when_on: bool = False
    exit_process_on_die: bool = False
    context_length: int = 131072
    cuda_graph: bool = False


def token_ids(prompt_ids: list[int], n: int, verify: str, differ: bool) -> tuple[list[int], list[float]]:
    """The stand-in model: ``n`` ids and their logprobs, a function of the prompt's last ids. With
    ``differ`` and KDTREE_VERIFY=on, the fourth id is the runner-up at a wide margin (what a wrong
    kernel would do)."""
    seed = sum(prompt_ids[-4:]) if prompt_ids else 0
    ids = [1000 + (seed + 7 * i) % 1000 for i in range(n)]
    lps = [round(-1.0 - 0.01 * i, 4) for i in range(n)]
    if differ and verify == "on" and n > 3:
        ids[3] += 1  # off's runner-up, which trails by 1.0
    return ids, lps


def _answer(prompt: str, cfg: FakeConfig, verify: str) -> str:
    m = re.search(r"pass key is (\d+)", prompt)
    if m:
        return cfg.passkey_answer if cfg.passkey_answer is not None else f" {m.group(1)}."
    if "capital of France" in prompt:
        text = cfg.answer if cfg.answer is not None else " Paris. It is the largest city"
        if cfg.differ_when_on and verify == "on":
            text = text[:8] + " (changed)"
        return text
    return " lorem ipsum dolor sit amet"


class FakeServer:
    """A ThreadingHTTPServer on 127.0.0.1 (port 0 = ephemeral) in a daemon thread."""

    def __init__(self, config: FakeConfig | None = None, port: int = 0) -> None:
        self.config = config or FakeConfig()
        self.started = time.monotonic()
        self.requests = 0
        self.verify_steps = 0
        self.lock = threading.Lock()
        self.verify = os.environ.get("KDTREE_VERIFY", "unset")
        self.httpd = ThreadingHTTPServer(("127.0.0.1", port), _make_handler(self))
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._thread: threading.Thread | None = None
        self.dead = False

    def start(self) -> FakeServer:
        self._thread = threading.Thread(
            target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self._thread.start()
        return self

    def die(self) -> None:
        """Stop answering: the process exits, or the in-process listener closes."""
        if self.config.exit_process_on_die:
            print("fake server: dying as asked (--die-after)", flush=True)
            os._exit(1)
        self.dead = True
        threading.Thread(target=self.stop, daemon=True).start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def __enter__(self) -> FakeServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        if not self.dead:
            self.stop()


def _make_handler(server: FakeServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt: str, *args: Any) -> None:  # keep test output quiet
            if server.config.exit_process_on_die:
                sys.stdout.write("fake server: " + (fmt % args) + "\n")

        # -- helpers ---------------------------------------------------------------------

        def _send(self, status: int, body: str, ctype: str = "application/json") -> None:
            data = body.encode()
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(data)))
            self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(data)
            self.close_connection = True

        def _json(self, obj: Any, status: int = 200) -> None:
            self._send(status, json.dumps(obj))

        def _body(self) -> dict[str, Any]:
            n = int(self.headers.get("Content-Length") or 0)
            return json.loads(self.rfile.read(n) or b"{}")

        def _misbehave(self, path: str) -> bool:
            """Apply the configured faults for ``path``; True when the answer was given."""
            cfg = server.config
            if path in cfg.drop:
                self.close_connection = True
                return True
            if path in cfg.status:
                code, body = cfg.status[path]
                self._send(code, body, "text/plain")
                return True
            if path in cfg.non_json:
                self._send(200, "<html><body>502 Bad Gateway (proxy)</body></html>", "text/html")
                return True
            return False

        def _count(self) -> bool:
            """Count a work request; True when the server must die now."""
            with server.lock:
                server.requests += 1
                n = server.requests
            die_after = server.config.die_after
            if die_after is not None and n > die_after:
                self.close_connection = True
                server.die()
                return True
            return False

        # -- endpoints -------------------------------------------------------------------

        def do_GET(self) -> None:  # noqa: N802 - http.server's naming
            cfg = server.config
            path = self.path.split("?")[0]
            if self._misbehave(path):
                return
            if path == "/health":
                time.sleep(cfg.health_delay_s)
                up = (not cfg.never_ready
                      and time.monotonic() - server.started >= cfg.ready_after_s)
                self._send(200 if up else 503, "" if up else "starting", "text/plain")
            elif path == "/v1/models":
                self._json({"object": "list", "data": [{"id": MODEL, "object": "model"}]})
            elif path in ("/server_info", "/get_server_info"):
                self._json({"version": "fake", "model_path": MODEL, "device": "cpu",
                            "tp_size": 1, "attention_backend": "fake",
                            "speculative_algorithm": "EAGLE" if cfg.spec else None,
                            "kdtree_verify": server.verify})
            else:
                self._send(404, json.dumps({"detail": "Not Found"}))

        def do_POST(self) -> None:  # noqa: N802
            cfg = server.config
            path = self.path.split("?")[0]
            if self._count() or self._misbehave(path):
                return
            try:
                req = self._body()
            except json.JSONDecodeError as e:
                self._send(400, json.dumps({"error": f"bad JSON: {e}"}))
                return
            time.sleep(cfg.completion_delay_s)
            if path == "/v1/completions":
                prompt = str(req.get("prompt", ""))
                text = _answer(prompt, cfg, server.verify)
                ptoks = int(len(prompt.split()) * cfg.prompt_tokens_ratio)
                usage = {"prompt_tokens": ptoks, "completion_tokens": len(text.split()),
                         "total_tokens": ptoks + len(text.split())}
                if req.get("stream"):
                    self._stream(text, usage if cfg.report_usage else None)
                    return
                body: dict[str, Any] = {
                    "id": "cmpl-fake", "object": "text_completion", "model": MODEL,
                    "choices": [{"index": 0, "text": text, "finish_reason": "length"}]}
                if cfg.report_usage:
                    body["usage"] = usage
                self._json(body)
            elif path == "/generate" and "input_ids" in req:
                self._generate_ids(req)
            elif path == "/generate":
                text = _answer(str(req.get("text", "")), cfg, server.verify)
                n = max(1, len(text.split()))
                meta: dict[str, Any] = {"prompt_tokens": 5, "completion_tokens": n}
                if cfg.spec:
                    ct = max(1, n // 2)
                    meta.update(spec_verify_ct=ct, spec_accept_length=n / ct,
                                spec_accept_rate=0.5)
                self._json({"text": text, "meta_info": meta})
            else:
                self._send(404, json.dumps({"detail": "Not Found"}))

        def _generate_ids(self, req: dict[str, Any]) -> None:
            """SGLang's native /generate with token ids (a server run with --skip-tokenizer-init)."""
            cfg = server.config
            batch = req["input_ids"]
            many = bool(batch) and isinstance(batch[0], list)
            prompts = batch if many else [batch]
            sp = req.get("sampling_params") or {}
            n = int(sp.get("max_new_tokens", 16))
            for ids in prompts:
                if len(ids) > cfg.context_length:
                    msg = (f"The input ({len(ids)} tokens) is longer than the model's context length "
                           f"({cfg.context_length} tokens).")
                    self._json({"error": {"message": msg}}, status=400)
                    return
            outs = []
            for ids in prompts:
                out, lps = token_ids(ids, n, server.verify, cfg.differ_when_on)
                meta: dict[str, Any] = {"prompt_tokens": len(ids), "completion_tokens": n, "spec_verify_ct": n,
                                        "spec_accept_length": 1.0, "e2e_latency": 0.01 * n}
                if req.get("return_logprob"):
                    meta["output_token_logprobs"] = [[lp, i, None] for lp, i in zip(lps, out, strict=True)]
                    meta["output_top_logprobs"] = [[[lp, i, None], [lp - 1.0, i + 1, None]]
                                                   for lp, i in zip(lps, out, strict=True)]
                outs.append({"output_ids": out, "meta_info": meta})
            if req.get("stream"):
                self._stream_ids(outs[0])
                return
            with server.lock:
                server.verify_steps += n
            if cfg.exit_process_on_die:  # as SGLang's decode lines and the plugin's counts read
                print(f"Decode batch, #running-req: {len(outs)}, accept len: 1.00, cuda graph: {cfg.cuda_graph}, "
                      f"gen throughput (token/s): 100.0", flush=True)
                if server.verify == "on":
                    print(f"kdtree verify [tp 0]: {server.verify_steps} kernel calls (step plan made 0, read 0), "
                          "0 verify calls on SGLang's path", flush=True)
            self._json(outs if many else outs[0])

        def _stream_ids(self, out: dict[str, Any]) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            self.close_connection = True
            try:
                for i in range(len(out["output_ids"])):
                    ev = {"output_ids": out["output_ids"][: i + 1], "meta_info": {"completion_tokens": i + 1}}
                    data = f"data: {json.dumps(ev)}\n\n".encode()
                    self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                    self.wfile.flush()
                    time.sleep(server.config.stream_chunk_delay_s)
                data = b"data: [DONE]\n\n"
                self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n0\r\n\r\n")
            except (BrokenPipeError, ConnectionResetError):
                pass  # the client went away mid-stream

        def _stream(self, text: str, usage: dict[str, Any] | None) -> None:
            cfg = server.config
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            self.close_connection = True

            def chunk(s: str) -> None:
                data = s.encode()
                self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                self.wfile.flush()

            pieces = re.findall(r"\s*\S+", text) or [text]
            for i, piece in enumerate(pieces):
                if cfg.stream_drop_after is not None and i >= cfg.stream_drop_after:
                    return  # close without the terminating chunk
                if cfg.stream_stall_after is not None and i >= cfg.stream_stall_after:
                    time.sleep(cfg.stream_stall_s)
                    return
                ev = {"id": "cmpl-fake", "object": "text_completion", "model": MODEL,
                      "choices": [{"index": 0, "text": piece, "finish_reason": None}]}
                chunk(f"data: {json.dumps(ev)}\n\n")
                time.sleep(cfg.stream_chunk_delay_s)
            if usage:
                chunk(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n")
            chunk("data: [DONE]\n\n")
            self.wfile.write(b"0\r\n\r\n")

    return Handler


def main(argv: list[str] | None = None) -> int:
    """Run the fake server as a process (for ``--launch`` tests)."""
    p = argparse.ArgumentParser(prog="python -m kdtree_pipeline.testing.fake_server")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--ready-after", type=float, default=0.0, help="seconds of 503 on /health")
    p.add_argument("--never-ready", action="store_true")
    p.add_argument("--die-after", type=int, default=None,
                   help="exit after answering this many POST requests")
    p.add_argument("--exit-during-startup", type=int, default=None, metavar="CODE",
                   help="print a few log lines, then exit with CODE before listening")
    p.add_argument("--spawn-child", default=None, metavar="PIDFILE",
                   help="start a child process in the same group and write its pid here")
    p.add_argument("--ignore-sigterm", action="store_true",
                   help="ignore SIGTERM (it and its child), so only SIGKILL stops them")
    p.add_argument("--answer", default=None, help="answer to the capital-of-France prompt")
    p.add_argument("--differ-when-on", action="store_true",
                   help="change the short answer (and a token id) when KDTREE_VERIFY=on")
    p.add_argument("--cuda-graph", action="store_true", help="say so in the decode lines")
    p.add_argument("--context-length", type=int, default=131072, help="longer token-id prompts get a 400")
    p.add_argument("--stream-delay", type=float, default=0.0, help="seconds between streamed events")
    a = p.parse_args(argv)
    verify = os.environ.get("KDTREE_VERIFY", "unset")
    print(f"fake server: starting, KDTREE_VERIFY={verify}", flush=True)
    if verify not in ("on", "off", "unset", ""):  # the plugin's own refusal, as SGLang's loader lets it out
        from kdtree_engine.sglang import plugin

        try:
            plugin.read_switch()
        except plugin.KdtreeConfigError as e:
            print(f"kdtree verify: {e}; stopping (SGLang would otherwise serve without it)", flush=True)
            return 1
    if verify == "on":
        lib = os.environ.get("KDTREE_LIB")
        if lib and not os.path.exists(lib):
            print(f"kdtree verify [pid {os.getpid()}]: off: kernel library failed to load: no such file {lib} "
                  "(SGLang's path serves from now on)", flush=True)
        else:
            print("kdtree verify [pid 1]: hook registered on TritonAttnBackend.forward_extend (KDTREE_VERIFY=on; "
                  "library /x.so, built for sm_90a)", flush=True)
    elif verify == "off":  # the plugin's own load(), before any logging is configured, as SGLang calls it
        from kdtree_engine.sglang import plugin

        plugin.load()
    if a.ignore_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if a.spawn_child:
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        with open(a.spawn_child, "w") as f:
            f.write(str(child.pid))
    if a.exit_during_startup is not None:
        time.sleep(a.ready_after)
        print("fake server: loading weights ... failed: CUDA out of memory (simulated)",
              flush=True)
        return a.exit_during_startup
    cfg = FakeConfig(ready_after_s=a.ready_after, never_ready=a.never_ready,
                     die_after=a.die_after, answer=a.answer, differ_when_on=a.differ_when_on,
                     exit_process_on_die=True, cuda_graph=a.cuda_graph, stream_chunk_delay_s=a.stream_delay,
                     context_length=a.context_length)
    server = FakeServer(cfg, port=a.port)
    print(f"fake server: listening on {server.url}", flush=True)
    try:
        server.httpd.serve_forever(poll_interval=0.1)
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
