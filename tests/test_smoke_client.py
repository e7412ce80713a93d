"""The smoke HTTP client against the in-process fake server (loopback only)."""

from __future__ import annotations

import socket
import time

import pytest

from kdtree_pipeline.smoke.client import HttpError, SmokeClient, wait_ready
from kdtree_pipeline.testing.fake_server import FakeConfig, FakeServer


@pytest.fixture
def fake():
    with FakeServer(FakeConfig()) as srv:
        yield srv


def closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def test_bad_url_is_refused():
    with pytest.raises(ValueError, match="--url: expected http://host:port"):
        SmokeClient("localhost:30000")


def test_http_error_shows_status_and_body(fake):
    fake.config.status["/v1/completions"] = (500, "CUDA error: an illegal memory access")
    c = SmokeClient(fake.url, timeout=5)
    with pytest.raises(HttpError) as ei:
        c.post_json("/v1/completions", {"prompt": "x"})
    e = ei.value
    assert e.status == 500 and e.kind == "http status"
    assert "HTTP 500" in str(e) and "illegal memory access" in str(e)


def test_non_json_shows_status_content_type_and_body(fake):
    fake.config.non_json.add("/v1/models")
    with pytest.raises(HttpError) as ei:
        SmokeClient(fake.url).get_json("/v1/models")
    msg = str(ei.value)
    assert ei.value.kind == "non-JSON"
    assert "HTTP 200" in msg and "text/html" in msg and "502 Bad Gateway" in msg


def test_dropped_connection_is_named(fake):
    fake.config.drop.add("/generate")
    with pytest.raises(HttpError) as ei:
        SmokeClient(fake.url).post_json("/generate", {"text": "x"})
    assert ei.value.kind == "dropped"
    assert "without a response" in str(ei.value)


def test_connection_refused_is_named():
    with pytest.raises(HttpError) as ei:
        SmokeClient(f"http://127.0.0.1:{closed_port()}").get_json("/health")
    assert ei.value.kind == "connection refused"


def test_stream_collects_text_and_usage(fake):
    r = SmokeClient(fake.url).stream_completion(
        {"prompt": "The capital of France is", "max_tokens": 8}, read_timeout=2)
    assert r.done and r.text == " Paris. It is the largest city"
    assert r.chunks == len(r.text.split()) + 1  # one event per word, then the usage event
    assert r.usage and r.usage["prompt_tokens"] > 0
    assert r.first_chunk_s is not None and r.first_chunk_s <= r.latency_s


def test_stream_stall_is_a_timeout_mid_stream(fake):
    fake.config.stream_stall_after = 2
    fake.config.stream_stall_s = 1.5
    t0 = time.monotonic()
    with pytest.raises(HttpError) as ei:
        SmokeClient(fake.url).stream_completion(
            {"prompt": "The capital of France is"}, read_timeout=0.3)
    assert ei.value.kind == "timeout mid-stream"
    assert "after 2 events" in str(ei.value)
    assert time.monotonic() - t0 < 1.4  # gave up at the read timeout, not at the stall's end


def test_stream_drop_is_reported(fake):
    fake.config.stream_drop_after = 3
    with pytest.raises(HttpError) as ei:
        SmokeClient(fake.url).stream_completion(
            {"prompt": "The capital of France is"}, read_timeout=2)
    assert ei.value.kind == "dropped"
    assert "3 events" in str(ei.value)


def test_stream_http_error_shows_body(fake):
    fake.config.status["/v1/completions"] = (429, "too many requests")
    with pytest.raises(HttpError, match="HTTP 429.*too many requests"):
        SmokeClient(fake.url).stream_completion({"prompt": "x"}, read_timeout=2)


def test_wait_ready_slow_start_records_distinct_errors():
    with FakeServer(FakeConfig(ready_after_s=0.3)) as srv:
        r = wait_ready(SmokeClient(srv.url), deadline_s=5, poll_s=0.05, request_timeout_s=1,
                       started_at=srv.started)
    assert r.ready and r.models == ["fake-model"]
    assert 0.3 <= r.waited_s < 2
    (msg, seen), = r.errors.items()
    assert "HTTP 503" in msg and "starting" in msg and seen["count"] >= 2


def test_wait_ready_never_ready_lists_every_error_kind():
    srv = FakeServer(FakeConfig(never_ready=True, health_delay_s=0.0)).start()
    try:
        client = SmokeClient(srv.url)
        # first a timeout (slow /health), then plain 503s
        srv.config.health_delay_s = 0.3

        def speed_up() -> None:
            srv.config.health_delay_s = 0.0

        import threading
        threading.Timer(0.35, speed_up).start()
        r = wait_ready(client, deadline_s=0.8, poll_s=0.05, request_timeout_s=0.1)
    finally:
        srv.stop()
    assert not r.ready and "deadline" in (r.stopped_because or "")
    kinds = " | ".join(r.errors)
    assert "timed out after 0.1s" in kinds and "HTTP 503" in kinds
    assert 0.8 <= r.waited_s < 1.5


def test_wait_ready_stops_when_process_exits():
    calls = []

    def alive() -> str | None:
        calls.append(1)
        return "the server process (pid 1) exited with code 3" if len(calls) > 2 else None

    r = wait_ready(SmokeClient(f"http://127.0.0.1:{closed_port()}"), deadline_s=10,
                   poll_s=0.01, alive=alive)
    assert not r.ready and "exited with code 3" in r.stopped_because
    assert any("connection refused" in k for k in r.errors)


def test_wait_ready_reports_progress_while_waiting():
    lines: list[str] = []
    url = f"http://127.0.0.1:{closed_port()}"
    r = wait_ready(SmokeClient(url), deadline_s=0.5, poll_s=0.02, request_timeout_s=0.1,
                   progress=lines.append, progress_every_s=0.1)
    assert not r.ready
    assert 2 <= len(lines) <= 6  # about one line per 0.1 s of a 0.5 s wait, not one per poll
    assert lines[0].startswith(f"waiting for {url}: not ready after ")
    assert "polls; last: GET /health: connection refused)" in lines[0]
