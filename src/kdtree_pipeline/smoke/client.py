"""HTTP client for an OpenAI-compatible SGLang server, on httpx (streaming included).

Nothing is swallowed: every failure becomes a :class:`HttpError` whose message
names the request, and for an HTTP error the status and the body. Streaming
responses (server-sent events, read with httpx's streaming API) have a
per-read timeout, so a server that stalls or drops the connection mid-stream
is reported as such. :func:`wait_ready` reports its progress every few seconds.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httpx

#: How much of a response body an error message shows.
BODY_LIMIT = 1000
#: How often :func:`wait_ready` reports that it is still waiting, seconds.
PROGRESS_EVERY_S = 5.0


class HttpError(RuntimeError):
    """A request failed. ``kind`` is a short class (``connection refused``,
    ``timeout``, ``http status``, ``non-JSON``, ``dropped``, ...); ``status`` and
    ``body`` are set when the server answered."""

    def __init__(self, request: str, kind: str, detail: str, *, status: int | None = None,
                 body: str | None = None) -> None:
        self.request, self.kind, self.detail, self.status, self.body = request, kind, detail, status, body
        super().__init__(f"{request}: {detail}")


def clip(text: str, limit: int = BODY_LIMIT) -> str:
    """``text`` cut to ``limit`` characters, saying how much was cut."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... [{len(text) - limit} more characters]"


def _causes(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        e = e.__cause__ or e.__context__


def describe_exception(exc: BaseException, timeout: float | None = None) -> tuple[str, str]:
    """(kind, detail) for a transport-level exception (httpx's, or the OS error under it)."""
    chain = list(_causes(exc))
    if any(isinstance(e, ConnectionRefusedError) for e in chain) or "refused" in str(exc).lower():
        return "connection refused", "connection refused"
    if any(isinstance(e, (httpx.TimeoutException, TimeoutError)) for e in chain):
        after = f" after {timeout:g}s" if timeout is not None else ""
        return "timeout", f"timed out{after}"
    if any(isinstance(e, socket.gaierror) for e in chain):
        return "unresolved host", f"cannot resolve the host name ({exc})"
    if isinstance(exc, httpx.RemoteProtocolError):
        if "without sending" in str(exc) and "response" in str(exc):
            return "dropped", "connection closed by the server without a response"
        return "dropped", f"connection dropped by the server ({exc})"
    if isinstance(exc, (httpx.ReadError, httpx.WriteError, ConnectionResetError, BrokenPipeError)):
        return "dropped", f"connection dropped by the server ({type(exc).__name__})"
    if isinstance(exc, (httpx.TransportError, OSError)):
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
                request, "non-JSON",
                f"non-JSON response (HTTP {self.status}, content-type "
                f"{self.content_type or 'none'!r}: {e}); body: {clip(self.body)!r}",
                status=self.status, body=self.body,
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


def _status_error(name: str, resp: httpx.Response, body: str) -> HttpError:
    return HttpError(name, "http status", f"HTTP {resp.status_code} {resp.reason_phrase}; body: {clip(body)!r}",
                     status=resp.status_code, body=body)


class SmokeClient:
    """Talks to one server at ``base_url`` (``http://host:port``); one httpx
    client per request, so concurrent checks share nothing."""

    def __init__(self, base_url: str, timeout: float = 300.0) -> None:
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"--url: expected http://host:port or https://host:port, got {base_url!r}")
        self.base_url = base_url.rstrip("/")
        self.host = parts.hostname
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.timeout = timeout

    def _client(self, timeout: float) -> httpx.Client:
        return httpx.Client(base_url=self.base_url, timeout=httpx.Timeout(timeout),
                            headers={"Accept": "application/json, text/event-stream"})

    def request(self, method: str, path: str, payload: Any | None = None, *,
                timeout: float | None = None) -> Response:
        """Send one request and read the whole answer; a non-2xx status raises
        :class:`HttpError` with the status and body."""
        timeout = self.timeout if timeout is None else timeout
        name = f"{method} {path}"
        t0 = time.monotonic()
        try:
            with self._client(timeout) as c:
                resp = c.request(method, path, json=payload)
        except httpx.HTTPError as e:
            kind, detail = describe_exception(e, timeout)
            raise HttpError(name, kind, detail) from None
        text = resp.text
        if not resp.is_success:
            raise _status_error(name, resp, text)
        return Response(resp.status_code, text, resp.headers.get("Content-Type", ""), time.monotonic() - t0)

    def get_json(self, path: str, *, timeout: float | None = None) -> Any:
        return self.request("GET", path, timeout=timeout).json(f"GET {path}")

    def post_json(self, path: str, payload: Any, *, timeout: float | None = None) -> tuple[Any, float]:
        """(parsed JSON answer, latency in seconds)."""
        r = self.request("POST", path, payload, timeout=timeout)
        return r.json(f"POST {path}"), r.latency_s

    def stream_completion(self, payload: dict[str, Any], *, read_timeout: float,
                          total_timeout: float | None = None) -> StreamResult:
        """POST ``/v1/completions`` with ``stream: true`` and parse the server-sent
        events. ``read_timeout`` bounds the wait for each piece of the stream, so a
        stall mid-stream raises :class:`HttpError` (kind ``timeout mid-stream``);
        a stream that ends without ``data: [DONE]`` raises kind ``dropped``."""
        name = "POST /v1/completions (stream)"
        total_timeout = self.timeout if total_timeout is None else total_timeout
        t0 = time.monotonic()
        events: list[dict[str, Any]] = []
        try:
            with self._client(read_timeout) as c, c.stream("POST", "/v1/completions",
                                                           json={**payload, "stream": True}) as resp:
                if not resp.is_success:
                    raise _status_error(name, resp, resp.read().decode("utf-8", errors="replace"))
                return _read_stream(name, resp, t0, total_timeout, events)
        except httpx.HTTPError as e:
            if not events and isinstance(e, httpx.ConnectError | httpx.ConnectTimeout):
                kind, detail = describe_exception(e, read_timeout)
                raise HttpError(name, kind, detail) from None
            if isinstance(e, httpx.TimeoutException):
                raise HttpError(name, "timeout mid-stream", f"timed out mid-stream: no data for "
                                f"{read_timeout:g}s after {len(events)} events") from None
            _, detail = describe_exception(e, read_timeout)
            raise HttpError(name, "dropped", f"connection dropped mid-stream after {len(events)} "
                            f"events ({detail})") from None


    def stream_generate(self, payload: dict[str, Any], *, read_timeout: float, total_timeout: float | None = None,
                        stop_after: int | None = None) -> GenerateStream:
        """POST ``/generate`` (SGLang's native API) with ``stream: true``; every event's arrival
        time is kept. ``stop_after`` closes the connection after that many events (a client
        that goes away mid-stream). Errors as :meth:`stream_completion`'s."""
        name = "POST /generate (stream)"
        total_timeout = self.timeout if total_timeout is None else total_timeout
        t0 = time.monotonic()
        out = GenerateStream([], [], False, 0.0)
        try:
            with self._client(read_timeout) as c, c.stream("POST", "/generate",
                                                           json={**payload, "stream": True}) as resp:
                if not resp.is_success:
                    raise _status_error(name, resp, resp.read().decode("utf-8", errors="replace"))
                for data in _sse_data(resp.iter_lines()):
                    now = time.monotonic() - t0
                    if now > total_timeout:
                        raise HttpError(name, "timeout mid-stream", f"the stream took longer than "
                                        f"{total_timeout:g}s in total (after {len(out.events)} events)")
                    if data.strip() == "[DONE]":
                        out.done = True
                        break
                    try:
                        event = json.loads(data)
                    except json.JSONDecodeError:
                        raise HttpError(name, "non-JSON", f"non-JSON event after {len(out.events)} events: "
                                        f"{clip(data)!r}", body=data) from None
                    if isinstance(event, dict) and "error" in event:
                        raise HttpError(name, "stream error", f"the server sent an error event after "
                                        f"{len(out.events)} events: {clip(json.dumps(event))}", body=data)
                    out.events.append(event)
                    out.times.append(now)
                    if stop_after is not None and len(out.events) >= stop_after:
                        break  # leaving the with-block closes the connection
        except httpx.HTTPError as e:
            if isinstance(e, httpx.TimeoutException):
                raise HttpError(name, "timeout mid-stream", f"timed out mid-stream: no data for "
                                f"{read_timeout:g}s after {len(out.events)} events") from None
            kind, detail = describe_exception(e, read_timeout)
            raise HttpError(name, kind, f"{detail} after {len(out.events)} events") from None
        if not out.done and stop_after is None:
            raise HttpError(name, "dropped", f"the stream ended after {len(out.events)} events without "
                            "'data: [DONE]' (connection closed mid-stream)")
        out.latency_s = time.monotonic() - t0
        return out


@dataclass
class GenerateStream:
    """What a streamed ``/generate`` delivered: each event and when it arrived (seconds from
    the request), whether ``[DONE]`` came, and the total time."""

    events: list[dict[str, Any]]
    times: list[float]
    done: bool
    latency_s: float


def _sse_data(lines: Iterator[str]) -> Iterator[str]:
    """The ``data:`` payload of each server-sent event (multi-line data joined)."""
    buf: list[str] = []
    for line in lines:
        if not line:
            if buf:
                yield "\n".join(buf)
                buf = []
        elif line.startswith("data:"):
            buf.append(line[6:] if line[5:6] == " " else line[5:])
        # ":" comments (keep-alives) and other fields are ignored
    if buf:
        yield "\n".join(buf)


def _read_stream(name: str, resp: httpx.Response, t0: float, total_timeout: float,
                 events: list[dict[str, Any]]) -> StreamResult:
    text_parts: list[str] = []
    usage = None
    first = None
    for data in _sse_data(resp.iter_lines()):
        if time.monotonic() - t0 > total_timeout:
            raise HttpError(name, "timeout mid-stream", f"the stream took longer than {total_timeout:g}s "
                            f"in total (after {len(events)} events)", status=resp.status_code)
        if data.strip() == "[DONE]":
            return StreamResult("".join(text_parts), len(events), True, usage, first,
                                time.monotonic() - t0, events)
        try:
            event = json.loads(data)
        except json.JSONDecodeError:
            raise HttpError(name, "non-JSON", f"non-JSON event after {len(events)} events: {clip(data)!r}",
                            status=resp.status_code, body=data) from None
        if isinstance(event, dict) and "error" in event:
            raise HttpError(name, "stream error", f"the server sent an error event after {len(events)} "
                            f"events: {clip(json.dumps(event))}", status=resp.status_code, body=data)
        if first is None:
            first = time.monotonic() - t0
        events.append(event)
        for choice in event.get("choices") or []:
            text_parts.append(choice.get("text") or "")
        if event.get("usage"):
            usage = event["usage"]
    raise HttpError(name, "dropped", f"the stream ended after {len(events)} events without "
                    "'data: [DONE]' (connection closed mid-stream)", status=resp.status_code)


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
        return [f"{msg} (x{int(v['count'])}, first at {v['first_s']:.1f}s)" for msg, v in self.errors.items()]


def wait_ready(
    client: SmokeClient,
    *,
    deadline_s: float,
    poll_s: float = 1.0,
    request_timeout_s: float = 10.0,
    started_at: float | None = None,
    alive: Callable[[], str | None] | None = None,
    progress: Callable[[str], None] | None = None,
    progress_every_s: float | None = None,
) -> Readiness:
    """Poll ``GET /health`` then ``GET /v1/models`` every ``poll_s`` seconds until
    both answer 200 (the models list as JSON), ``deadline_s`` passes, or ``alive()``
    returns a reason the server cannot come up (a launched process exited).
    ``started_at`` (a ``time.monotonic()`` value, default now) is the zero of the
    returned ``waited_s``. ``progress`` gets a line every ``progress_every_s``
    seconds (default :data:`PROGRESS_EVERY_S`) while waiting: how long, how many
    polls, the last error."""
    progress_every_s = PROGRESS_EVERY_S if progress_every_s is None else progress_every_s
    start = time.monotonic() if started_at is None else started_at
    errors: dict[str, dict[str, float]] = {}
    polls = 0
    last_error = ""
    next_report = time.monotonic() + progress_every_s

    def note(msg: str) -> None:
        nonlocal last_error
        last_error = msg
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
                raise HttpError("GET /v1/models", "no models", f"no model listed; body: {clip(json.dumps(models))!r}")
            return Readiness(True, time.monotonic() - start, polls, errors, ids)
        except HttpError as e:
            note(str(e))
        except (AttributeError, TypeError):
            note("GET /v1/models: unexpected JSON shape (expected {'data': [{'id': ...}]})")
        now = time.monotonic()
        if now - start >= deadline_s:
            return Readiness(False, now - start, polls, errors, [], f"not ready within the {deadline_s:g}s deadline")
        if progress is not None and now >= next_report:
            progress(f"waiting for {client.base_url}: not ready after {now - start:.0f}s of {deadline_s:g}s "
                     f"({polls} polls; last: {last_error})")
            next_report = now + progress_every_s
        time.sleep(max(0.0, min(poll_s - (now - tick), deadline_s - (now - start))))
