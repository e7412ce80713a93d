"""HTTP client for an OpenAI-compatible SGLang server (standard library only).

Nothing is swallowed: every failure becomes a :class:`HttpError` whose message
names the request, and for an HTTP error the status and the body. Streaming
responses (server-sent events) are read chunk by chunk with a per-read timeout,
so a server that stalls or drops the connection mid-stream is reported as such.
"""

from __future__ import annotations

import http.client
import json
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

#: How much of a response body an error message shows.
BODY_LIMIT = 1000


class HttpError(RuntimeError):
    """A request failed. ``kind`` is a short class (``connection refused``,
    ``timeout``, ``http status``, ``non-JSON``, ``dropped``, ...); ``status`` and
    ``body`` are set when the server answered."""

    def __init__(
        self,
        request: str,
        kind: str,
        detail: str,
        *,
        status: int | None = None,
        body: str | None = None,
    ) -> None:
        self.request, self.kind, self.detail, self.status, self.body = (
            request,
            kind,
            detail,
            status,
            body,
        )
        super().__init__(f"{request}: {detail}")


def clip(text: str, limit: int = BODY_LIMIT) -> str:
    """``text`` cut to ``limit`` characters, saying how much was cut."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... [{len(text) - limit} more characters]"


def describe_exception(exc: BaseException, timeout: float | None = None) -> tuple[str, str]:
    """(kind, detail) for a transport-level exception."""
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused", "connection refused"
    if isinstance(exc, TimeoutError):
        after = f" after {timeout:g}s" if timeout is not None else ""
        return "timeout", f"timed out{after}"
    if isinstance(exc, http.client.RemoteDisconnected):
        return "dropped", "connection closed by the server without a response"
    if isinstance(exc, (ConnectionResetError, BrokenPipeError, http.client.IncompleteRead)):
        return "dropped", f"connection dropped by the server ({type(exc).__name__})"
    if isinstance(exc, socket.gaierror):
        return "unresolved host", f"cannot resolve the host name ({exc})"
    if isinstance(exc, OSError):
        return "network error", f"{type(exc).__name__}: {exc}"
    return "error", f"{type(exc).__name__}: {exc}"


@dataclass
class Response:
    """A complete HTTP response whose status was 2xx."""

    status: int
    body: str
    content_type: str
    latency_s: float

    def json(self, request: str) -> Any:
        """The body as JSON, or a :class:`HttpError` (kind ``non-JSON``) showing it."""
        try:
            return json.loads(self.body)
        except json.JSONDecodeError as e:
            raise HttpError(
                request,
                "non-JSON",
                f"non-JSON response (HTTP {self.status}, content-type "
                f"{self.content_type or 'none'!r}: {e}); body: {clip(self.body)!r}",
                status=self.status,
                body=self.body,
            ) from None


@dataclass
class StreamResult:
    """What a streamed completion delivered."""

    text: str
    chunks: int
    done: bool
    usage: dict[str, Any] | None
    first_chunk_s: float | None
    latency_s: float
    events: list[dict[str, Any]] = field(default_factory=list, repr=False)


class SmokeClient:
    """Talks to one server at ``base_url`` (``http://host:port``)."""

    def __init__(self, base_url: str, timeout: float = 300.0) -> None:
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(
                f"--url: expected http://host:port or https://host:port, got {base_url!r}"
            )
        self.base_url = base_url.rstrip("/")
        self.scheme = parts.scheme
        self.host = parts.hostname
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.prefix = parts.path.rstrip("/")
        self.timeout = timeout

    # -- plumbing ---------------------------------------------------------------------------

    def _connection(self, timeout: float) -> http.client.HTTPConnection:
        cls = http.client.HTTPSConnection if self.scheme == "https" else http.client.HTTPConnection
        return cls(self.host, self.port, timeout=timeout)

    def _send(
        self, method: str, path: str, payload: Any | None, timeout: float
    ) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse, float]:
        conn = self._connection(timeout)
        headers = {"Accept": "application/json, text/event-stream"}
        body = None
        if payload is not None:
            body = json.dumps(payload).encode()
            headers["Content-Type"] = "application/json"
        t0 = time.monotonic()
        try:
            conn.request(method, self.prefix + path, body=body, headers=headers)
            resp = conn.getresponse()
        except Exception as e:
            conn.close()
            kind, detail = describe_exception(e, timeout)
            raise HttpError(f"{method} {path}", kind, detail) from None
        return conn, resp, t0

    def request(
        self, method: str, path: str, payload: Any | None = None, *, timeout: float | None = None
    ) -> Response:
        """Send one request and read the whole answer; a non-2xx status raises
        :class:`HttpError` with the status and body."""
        timeout = self.timeout if timeout is None else timeout
        name = f"{method} {path}"
        conn, resp, t0 = self._send(method, path, payload, timeout)
        try:
            raw = resp.read()
        except Exception as e:
            kind, detail = describe_exception(e, timeout)
            raise HttpError(name, kind, f"{detail} while reading the body (HTTP {resp.status})",
                            status=resp.status) from None
        finally:
            conn.close()
        latency = time.monotonic() - t0
        text = raw.decode("utf-8", errors="replace")
        if not 200 <= resp.status < 300:
            raise HttpError(
                name,
                "http status",
                f"HTTP {resp.status} {resp.reason}; body: {clip(text)!r}",
                status=resp.status,
                body=text,
            )
        return Response(resp.status, text, resp.getheader("Content-Type", ""), latency)

    def get_json(self, path: str, *, timeout: float | None = None) -> Any:
        return self.request("GET", path, timeout=timeout).json(f"GET {path}")

    def post_json(self, path: str, payload: Any, *, timeout: float | None = None) -> tuple[Any, float]:
        """(parsed JSON answer, latency in seconds)."""
        r = self.request("POST", path, payload, timeout=timeout)
        return r.json(f"POST {path}"), r.latency_s

    # -- streaming --------------------------------------------------------------------------

    def stream_completion(
        self, payload: dict[str, Any], *, read_timeout: float, total_timeout: float | None = None
    ) -> StreamResult:
        """POST ``/v1/completions`` with ``stream: true`` and parse the server-sent
        events. ``read_timeout`` bounds the wait for each piece of the stream, so a
        stall mid-stream raises :class:`HttpError` (kind ``timeout mid-stream``);
        a stream that ends without ``data: [DONE]`` raises kind ``dropped``."""
        name = "POST /v1/completions (stream)"
        payload = {**payload, "stream": True}
        total_timeout = self.timeout if total_timeout is None else total_timeout
        conn, resp, t0 = self._send("POST", "/v1/completions", payload, read_timeout)
        try:
            if not 200 <= resp.status < 300:
                body = resp.read().decode("utf-8", errors="replace")
                raise HttpError(name, "http status",
                                f"HTTP {resp.status} {resp.reason}; body: {clip(body)!r}",
                                status=resp.status, body=body)
            text_parts: list[str] = []
            events: list[dict[str, Any]] = []
            usage = None
            first = None
            done = False
            for data in _sse_data(resp, name, read_timeout, t0, total_timeout, events):
                if data.strip() == "[DONE]":
                    done = True
                    break
                try:
                    event = json.loads(data)
                except json.JSONDecodeError:
                    raise HttpError(name, "non-JSON",
                                    f"non-JSON event after {len(events)} events: {clip(data)!r}",
                                    status=resp.status, body=data) from None
                if isinstance(event, dict) and "error" in event:
                    raise HttpError(name, "stream error",
                                    f"the server sent an error event after {len(events)} events: "
                                    f"{clip(json.dumps(event))}", status=resp.status, body=data)
                if first is None:
                    first = time.monotonic() - t0
                events.append(event)
                for choice in event.get("choices") or []:
                    text_parts.append(choice.get("text") or "")
                if event.get("usage"):
                    usage = event["usage"]
            if not done:
                raise HttpError(name, "dropped",
                                f"the stream ended after {len(events)} events without "
                                "'data: [DONE]' (connection closed mid-stream)",
                                status=resp.status)
            return StreamResult("".join(text_parts), len(events), done, usage, first,
                                time.monotonic() - t0, events)
        finally:
            conn.close()


def _sse_data(
    resp: http.client.HTTPResponse,
    name: str,
    read_timeout: float,
    t0: float,
    total_timeout: float,
    events: list[dict[str, Any]],
) -> Iterator[str]:
    """Yield the ``data:`` payload of each server-sent event (multi-line data joined)."""
    buf: list[str] = []
    while True:
        if time.monotonic() - t0 > total_timeout:
            raise HttpError(name, "timeout mid-stream",
                            f"the stream took longer than {total_timeout:g}s in total "
                            f"(after {len(events)} events)", status=resp.status)
        try:
            line = resp.readline()
        except TimeoutError:
            raise HttpError(name, "timeout mid-stream",
                            f"timed out mid-stream: no data for {read_timeout:g}s after "
                            f"{len(events)} events", status=resp.status) from None
        except Exception as e:
            _, detail = describe_exception(e, read_timeout)
            raise HttpError(name, "dropped",
                            f"connection dropped mid-stream after {len(events)} events ({detail})",
                            status=resp.status) from None
        if not line:
            if buf:
                yield "\n".join(buf)
            return
        s = line.decode("utf-8", errors="replace").rstrip("\r\n")
        if not s:
            if buf:
                yield "\n".join(buf)
                buf = []
            continue
        if s.startswith(":"):
            continue  # comment / keep-alive
        if s.startswith("data:"):
            buf.append(s[5:].lstrip(" ") if s[5:6] == " " else s[5:])


# -- readiness ------------------------------------------------------------------------------


@dataclass
class Readiness:
    """Outcome of :func:`wait_ready`: ``errors`` maps each distinct error seen
    while waiting to how often it was seen and when first (seconds from start)."""

    ready: bool
    waited_s: float
    polls: int
    errors: dict[str, dict[str, float]]
    models: list[str]
    stopped_because: str | None = None

    def error_lines(self) -> list[str]:
        return [
            f"{msg} (x{int(v['count'])}, first at {v['first_s']:.1f}s)"
            for msg, v in self.errors.items()
        ]


def wait_ready(
    client: SmokeClient,
    *,
    deadline_s: float,
    poll_s: float = 1.0,
    request_timeout_s: float = 10.0,
    started_at: float | None = None,
    alive: Callable[[], str | None] | None = None,
) -> Readiness:
    """Poll ``GET /health`` then ``GET /v1/models`` every ``poll_s`` seconds until
    both answer 200 (the models list as JSON), ``deadline_s`` passes, or ``alive()``
    returns a reason the server cannot come up (a launched process exited).
    ``started_at`` (a ``time.monotonic()`` value, default now) is the zero of the
    returned ``waited_s``."""
    start = time.monotonic() if started_at is None else started_at
    errors: dict[str, dict[str, float]] = {}
    polls = 0

    def note(msg: str) -> None:
        e = errors.setdefault(msg, {"count": 0, "first_s": round(time.monotonic() - start, 3)})
        e["count"] += 1

    while True:
        tick = time.monotonic()
        if alive is not None:
            why = alive()
            if why:
                return Readiness(False, tick - start, polls, errors, [], why)
        polls += 1
        try:
            client.request("GET", "/health", timeout=request_timeout_s)
            models = client.get_json("/v1/models", timeout=request_timeout_s)
            ids = [m.get("id") for m in models.get("data", []) if isinstance(m, dict)]
            if not ids:
                raise HttpError("GET /v1/models", "no models",
                                f"no model listed; body: {clip(json.dumps(models))!r}")
            return Readiness(True, time.monotonic() - start, polls, errors, ids)
        except HttpError as e:
            note(str(e))
        except (AttributeError, TypeError):
            note("GET /v1/models: unexpected JSON shape (expected {'data': [{'id': ...}]})")
        now = time.monotonic()
        if now - start >= deadline_s:
            return Readiness(False, now - start, polls, errors, [],
                             f"not ready within the {deadline_s:g}s deadline")
        time.sleep(max(0.0, min(poll_s - (now - tick), deadline_s - (now - start))))

