"""The smoke gate end to end against the in-process fake server: every branch
of the gate (pass, slow start, never ready, wrong answers, stream faults, non-JSON,
HTTP errors, server death, spec metrics, fingerprints, bad input)."""

from __future__ import annotations

import json
import socket

import pytest

from kdtree_pipeline.evidence import load_record
from kdtree_pipeline.smoke import gate
from kdtree_pipeline.testing.fake_server import FakeConfig, FakeServer

FAST = ["--poll", "0.05", "--ready-timeout", "3", "--health-timeout", "1", "--timeout", "5",
        "--stream-timeout", "1", "--long-tokens", "400"]


@pytest.fixture
def fake():
    srv = FakeServer(FakeConfig()).start()
    yield srv
    if not srv.dead:
        srv.stop()


def run_gate(tmp_path, *args: str) -> tuple[int, dict | None]:
    """Run the gate; return (exit code, evidence record or None when none was written)."""
    code = gate.main([*FAST, "--evidence-dir", str(tmp_path), *args])
    recs = sorted(tmp_path.glob("smoke*.json"))
    return code, (load_record(recs[-1]) if recs else None)


def test_pass_with_default_long_context_size(fake, tmp_path, capsys):
    code, rec = run_gate(tmp_path, "--url", fake.url, "--long-tokens", "23000")
    out = capsys.readouterr().out
    assert code == 0, out
    assert rec["gate"] == "smoke" and rec["passed"] and rec["reason"] is None
    m = rec["metrics"]
    assert set(m["checks"]) == {"short", "long", "stream", "concurrent", "spec"}
    assert all(c["passed"] and c["latency_s"] >= 0 for c in m["checks"].values())
    assert m["server_reached"] and m["time_to_ready_s"] == 0
    assert m["spec"]["reported"] and m["spec"]["spec_verify_ct"] > 0
    long_ = rec["details"]["checks"]["long"]
    assert long_["server_prompt_tokens"] >= 23000 and long_["answer"] == long_["passkey"]
    assert rec["device"]["source"] == "server /server_info" and rec["device"]["model_path"]
    assert "smoke: PASS" in out and "spec_verify_ct=" in out
    assert len(rec["details"]["checks"]["concurrent"]["latencies_s"]) == 4


def test_slow_start_passes_and_lists_the_503s(tmp_path, capsys):
    with FakeServer(FakeConfig(ready_after_s=0.3)) as srv:
        code, rec = run_gate(tmp_path, "--url", srv.url)
    out = capsys.readouterr().out
    assert code == 0, out
    errors = rec["details"]["readiness"]["errors"]
    assert any("HTTP 503" in k and "starting" in k for k in errors)
    assert "error while waiting: GET /health: HTTP 503" in out


def test_never_ready_fails_with_every_error(tmp_path, capsys):
    with FakeServer(FakeConfig(never_ready=True)) as srv:
        code, rec = run_gate(tmp_path, "--url", srv.url, "--ready-timeout", "0.4")
    assert code == 1
    assert not rec["passed"] and not rec["metrics"]["server_reached"]
    assert "no server was ready" in rec["reason"] and "HTTP 503" in rec["reason"]
    assert rec["metrics"]["time_to_ready_s"] is None and rec["metrics"]["checks"] == {}
    assert "smoke: FAIL" in capsys.readouterr().err


def test_no_server_given_fails_in_one_sentence(tmp_path, capsys):
    code = gate.main(["--evidence-dir", str(tmp_path)])
    rec = load_record(tmp_path / "smoke.json")
    assert code == 1 and not rec["passed"]
    assert rec["reason"].startswith("no server to test: give --url")
    assert rec["reason"].count(". ") == 0  # one sentence
    assert "did not run" in capsys.readouterr().err


def test_unreachable_url_fails(tmp_path):
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    code, rec = run_gate(tmp_path, "--url", f"http://127.0.0.1:{port}", "--ready-timeout", "0.3")
    assert code == 1 and "connection refused" in rec["reason"]


@pytest.mark.parametrize(
    "change, failed, words",
    [
        ({"answer": " Berlin is"}, {"short", "stream", "concurrent"}, "wrong answer"),
        ({"passkey_answer": " 12345."}, {"long"}, "expected pass key"),
        ({"prompt_tokens_ratio": 0.5}, {"long"}, "fewer than the 400 target"),
        ({"spec": False}, {"spec"}, "no speculative metrics"),
        ({"stream_stall_after": 1, "stream_stall_s": 2.0}, {"stream"}, "timed out mid-stream"),
        ({"stream_drop_after": 2}, {"stream"}, "mid-stream"),
        ({"non_json": {"/v1/completions"}}, {"short", "long", "stream", "concurrent"},
         "non-JSON response (HTTP 200"),
        ({"status": {"/generate": (500, "CUDA error: illegal memory access")}}, {"spec"},
         "HTTP 500 Internal Server Error; body: 'CUDA error: illegal memory access'"),
        ({"drop": {"/v1/completions"}}, {"short", "long", "stream", "concurrent"},
         "connection closed by the server without a response"),
    ],
)
def test_failing_checks(fake, tmp_path, capsys, change, failed, words):
    for k, v in change.items():
        setattr(fake.config, k, v)
    code, rec = run_gate(tmp_path, "--url", fake.url)
    captured = capsys.readouterr()
    assert code == 1
    got = {n for n, c in rec["metrics"]["checks"].items() if not c["passed"]}
    assert got == failed
    assert words in rec["reason"]
    assert words in captured.out and "smoke: FAIL" in captured.err


def test_spec_optional_with_allow_no_spec(fake, tmp_path):
    fake.config.spec = False
    code, rec = run_gate(tmp_path, "--url", fake.url, "--allow-no-spec")
    assert code == 0 and rec["metrics"]["spec"]["reported"] is False


def test_no_usage_reported_uses_the_approximate_count(fake, tmp_path):
    fake.config.report_usage = False
    code, rec = run_gate(tmp_path, "--url", fake.url)
    long_ = rec["details"]["checks"]["long"]
    assert code == 0 and long_["server_prompt_tokens"] is None
    assert long_["approx_tokens"] >= 400 and "approximate" in long_["detail"]


def test_server_dies_during_the_run(fake, tmp_path, capsys):
    fake.config.die_after = 1  # answers the short prompt, then goes away
    code, rec = run_gate(tmp_path, "--url", fake.url)
    assert code == 1
    checks = rec["metrics"]["checks"]
    assert checks["short"]["passed"]
    assert not any(checks[n]["passed"] for n in ("long", "stream", "concurrent", "spec"))
    details = rec["details"]["checks"]
    assert details["long"]["error_kind"] == "dropped"
    assert details["spec"]["error_kind"] == "connection refused"


def test_non_json_models_during_readiness(fake, tmp_path):
    fake.config.non_json.add("/v1/models")
    code, rec = run_gate(tmp_path, "--url", fake.url, "--ready-timeout", "0.3")
    assert code == 1 and "GET /v1/models: non-JSON response (HTTP 200" in rec["reason"]


def test_fingerprint_record_then_compare(fake, tmp_path, capsys):
    base = tmp_path / "baseline.json"
    code, rec = run_gate(tmp_path, "--url", fake.url, "--record-baseline", str(base))
    assert code == 0 and rec["variant"] == "baseline" and rec["metrics"]["kdtree_verify"] == "off"
    saved = json.loads(base.read_text())
    assert saved["kdtree_verify"] == "off" and saved["short_text"].startswith(" Paris")
    (tmp_path / "smoke-baseline.json").unlink()

    code, rec = run_gate(tmp_path, "--url", fake.url, "--compare-baseline", str(base))
    assert code == 0, capsys.readouterr().out
    assert rec["metrics"]["fingerprint"] == {
        "mode": "compare", "passed": True, "file": str(base), "short_match": True,
        "long_answer_match": True}

    fake.config.answer = " Paris, the capital"
    code, rec = run_gate(tmp_path, "--url", fake.url, "--compare-baseline", str(base))
    out = capsys.readouterr().out
    assert code == 1 and "fingerprint differs from the baseline" in rec["reason"]
    assert rec["metrics"]["fingerprint"]["short_match"] is False
    assert "' Paris. It is the largest city'" in out and "' Paris, the capital'" in out
    assert "bf16" in out


def test_compare_with_other_prompt_settings_fails(fake, tmp_path):
    base = tmp_path / "baseline.json"
    assert run_gate(tmp_path, "--url", fake.url, "--record-baseline", str(base))[0] == 0
    code, rec = run_gate(tmp_path, "--url", fake.url, "--compare-baseline", str(base),
                         "--long-tokens", "500")
    assert code == 1 and "different prompt settings (long_prompt_sha256, long_tokens)" in rec["reason"]


def test_baseline_not_written_when_a_check_fails(fake, tmp_path):
    fake.config.passkey_answer = " no idea"
    base = tmp_path / "baseline.json"
    code, rec = run_gate(tmp_path, "--url", fake.url, "--record-baseline", str(base))
    assert code == 1 and not base.exists() and "baseline not written" in rec["reason"]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--compare-baseline", "{tmp}/missing.json"], "does not exist"),
        (["--compare-baseline", "{tmp}/bad.json"], "is not valid JSON"),
        (["--record-baseline", "{tmp}/b.json", "--kdtree", "on"], "--record-baseline: the baseline"),
        (["--record-baseline", "{tmp}/nodir/b.json"], "does not exist"),
        (["--url", "localhost:30000"], "--url: expected http://host:port"),
        (["--poll", "0"], "--poll: expected a positive number, got 0.0"),
        (["--concurrency", "-1"], "--concurrency: expected a positive number"),
        (["--launch", "python 'oops"], "--launch: expected a shell-quoted command line"),
        (["--launch", "no-such-program-kdtree --port 1"], "'no-such-program-kdtree' not found"),
        (["--launch", "  "], "--launch: expected a command"),
    ],
)
def test_bad_input_exits_2_and_writes_nothing(tmp_path, capsys, args, message):
    (tmp_path / "bad.json").write_text("{oops")
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    code = gate.main(["--evidence-dir", str(tmp_path), *args])
    assert code == 2
    assert message in capsys.readouterr().err
    assert not list(tmp_path.glob("smoke*.json"))


def test_record_and_compare_together_is_usage_error(tmp_path, capsys):
    code = gate.main(["--record-baseline", "a", "--compare-baseline", "b"])
    assert code == 2 and "not allowed with argument" in capsys.readouterr().err


def test_url_from_launch():
    assert gate.url_from_launch(["python", "-m", "x", "--port", "8000"]) == "http://127.0.0.1:8000"
    assert gate.url_from_launch(["x", "--host=0.0.0.0", "--port=9"]) == "http://127.0.0.1:9"
    assert gate.url_from_launch(["x", "--host", "10.0.0.2"]) == "http://10.0.0.2:30000"
