"""Servers as real process groups: ServerProcess, and the live run's launches of a stand-in SGLang
(kdtree_pipeline.testing.fake_server speaking /generate with token ids) on CPU."""

from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kdtree_pipeline.smoke import gate, live
from kdtree_pipeline.smoke.launcher import (
    LaunchError,
    ServerProcess,
    group_members,
    log_tail,
    parse_command,
)

PY = shlex.quote(sys.executable)
ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def pgid_of(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat[stat.rindex(")") + 2:].split()[2])


def wait_for(path: Path, timeout: float = 10.0) -> str:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if path.exists() and path.read_text().strip():
            return path.read_text().strip()
        time.sleep(0.02)
    raise AssertionError(f"{path} never appeared")


# -- parse_command / ServerProcess ---------------------------------------------------------

def test_parse_command():
    assert parse_command(f"{PY} -m x --flag 'a b'") == [sys.executable, "-m", "x", "--flag", "a b"]
    with pytest.raises(LaunchError, match="No closing quotation"):
        parse_command('python -c "print(1)')
    with pytest.raises(LaunchError, match="not found on PATH"):
        parse_command("kdtree-no-such-binary --port 1")
    with pytest.raises(LaunchError, match="not an executable file"):
        parse_command("/nonexistent/dir/server --port 1")
    with pytest.raises(LaunchError, match="empty string"):
        parse_command("")


def test_stop_escalates_to_sigkill_when_sigterm_is_ignored(tmp_path):
    code = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "print('up', flush=True); time.sleep(60)")
    srv = ServerProcess([sys.executable, "-c", code], tmp_path / "log", kdtree_verify="off",
                        grace_s=0.3).start()
    try:
        wait_for(tmp_path / "log")
    finally:
        how = srv.stop()
    assert how == "SIGKILL" and group_members(srv.pid) == []
    assert srv.exit_reason() == f"the server process (pid {srv.pid}) was killed by signal 9"
    assert log_tail(tmp_path / "log") == "up"


LEADER_EXITS_FIRST = (
    "import ctypes, threading, time\n"
    "threading.Thread(target=time.sleep, args=(60,)).start()\n"
    "ctypes.CDLL(None).pthread_exit(None)  # the main thread ends, the other one runs on\n"
)


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc")
def test_a_zombie_leader_with_a_running_thread_is_still_a_live_member():
    """A server whose main thread has ended while other threads still run (and hold its port
    and GPU memory) shows its leader as a zombie: it is still a member, and only after the kill
    is the group empty."""
    p = subprocess.Popen([sys.executable, "-c", LEADER_EXITS_FIRST], start_new_session=True)
    try:
        end = time.monotonic() + 30
        while time.monotonic() < end:
            stat = Path(f"/proc/{p.pid}/stat").read_text()
            if stat[stat.rindex(")") + 2] == "Z":
                break
            time.sleep(0.02)
        else:
            pytest.fail("the leader never became a zombie")
        assert group_members(p.pid) == [p.pid]
    finally:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait(timeout=30)
    assert group_members(p.pid) == []


def test_environment_carries_kdtree_verify(tmp_path):
    srv = ServerProcess([sys.executable, "-c", "import os; print(os.environ['KDTREE_VERIFY'])"],
                        tmp_path / "log", kdtree_verify="off").start()
    srv.proc.wait(10)
    assert srv.stop() == "already exited" and log_tail(tmp_path / "log") == "off"
    with pytest.raises(ValueError, match="kdtree_verify"):
        ServerProcess(["x"], tmp_path / "log", kdtree_verify="yes")


# -- launches of a stand-in SGLang through the live run ---------------------------------------


@pytest.fixture
def small(monkeypatch):
    """Small prompts and few tokens: the stand-in answers at once."""
    monkeypatch.setattr(live, "OUTPUT_LENGTHS", (64, 128))
    monkeypatch.setattr(live, "SPEED_LENGTHS", (256, 512, 1024))
    monkeypatch.setattr(live, "CONCURRENT_LENGTHS", (16,) * 8)
    monkeypatch.setattr(live, "CONTEXT_LENGTH", 4096)


def fake_run(tmp_path: Path, *extra: str, code: str = "c") -> live.Run:
    def argv(launch, model, port):
        flags = ["--cuda-graph"] if launch.graphs else []
        return [sys.executable, "-m", "kdtree_pipeline.testing.fake_server", "--port", str(port),
                "--stream-delay", "0.01", "--context-length", str(live.CONTEXT_LENGTH), *flags, *extra]

    return live.Run(tmp_path / "run", tmp_path / "model", [], root=ROOT, port=free_port(), ready_timeout=30,
                    request_timeout=10, code=code, argv=argv)


def test_a_live_run_of_every_default_launch_passes_on_the_stand_in(tmp_path, small):
    run = fake_run(tmp_path)
    results = live.run_launches(run, list(live.DEFAULT_LAUNCHES), progress=lambda line: None)
    assert {n: r.problems for n, r in results.items() if r.problems} == {}
    ev = gate.evaluate(results, list(live.DEFAULT_LAUNCHES))
    assert [p for p in ev["problems"] if not p.startswith("decode at")] == []  # the stand-in is no faster on
    assert ev["comparisons"]["eager"]["matched"] == ev["comparisons"]["eager"]["tokens"] == 64
    typo = results["typo"]
    assert "exited with code 1" in typo.checks["refuse"]["exit"] and "KDTREE_VERIFY='typo'" in typo.plugin["refusal"]
    on = results["on-eager"]
    assert on.plugin["hooked"] and on.plugin["kernel_calls"] > 0 and on.plugin["verify_fallbacks"] == 0
    assert on.checks["faults"]["too_long"]["status"] == 400 and on.checks["faults"]["after"]["tokens"] == 16
    assert all(r.cleanup["processes_left"] == [] for r in results.values())
    # a second invocation on the same code starts nothing
    again = live.run_launches(run, list(live.DEFAULT_LAUNCHES), progress=lambda line: None)
    assert {n: r.seconds for n, r in again.items()} == {n: r.seconds for n, r in results.items()}


def test_a_kernel_that_changes_a_token_at_a_wide_margin_fails_the_comparison(tmp_path, small):
    run = fake_run(tmp_path, "--differ-when-on")
    results = live.run_launches(run, ["off-eager", "on-eager"], progress=lambda line: None)
    ev = gate.evaluate(results, ["off-eager", "on-eager"])
    bad = [p for p in ev["problems"] if p.startswith("outputs eager")]
    assert bad and "led its runner-up by 1.000 (> 0.25, not a bf16 tie)" in bad[0]


def test_a_launch_refuses_a_port_that_something_else_holds(tmp_path, small):
    run = fake_run(tmp_path)
    with socket.socket() as s:
        s.bind(("127.0.0.1", run.port))
        s.listen()
        r = run.run(live.LAUNCHES["off-eager"], progress=lambda line: None)
    assert r.problems == [f"something already listens on port {run.port}: stop it or pass another --port, so that "
                          "the checks reach the server this launch starts"]
    assert not r.started
    assert run.done("off-eager") is None  # the next invocation, the port freed, runs it


def test_a_server_that_dies_at_start_is_reported_with_its_log(tmp_path, small):
    run = fake_run(tmp_path, "--exit-during-startup", "3")
    r = run.run(live.LAUNCHES["off-eager"], progress=lambda line: None)
    assert r.problems and "exited with code 3" in r.problems[0]
    assert "CUDA out of memory (simulated)" in r.log_tail


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_interrupting_the_gate_stops_the_server_group(tmp_path, sig, code):
    """The gate in its own process, its server never ready: Ctrl-C or SIGTERM to the gate stops
    the server's whole process group (its own session, which the signal alone never reaches)."""
    pidfile = tmp_path / "child.pid"
    script = f"""
import sys
sys.argv = ["x"]
from pathlib import Path
from kdtree_pipeline.smoke import gate, live
argv = lambda launch, model, port: [sys.executable, "-m", "kdtree_pipeline.testing.fake_server", "--port",
                                    str(port), "--never-ready", "--spawn-child", {str(pidfile)!r}]
run = live.Run(Path({str(tmp_path / "run")!r}), Path("m"), [], root=Path({str(ROOT)!r}), port={free_port()},
               ready_timeout=60, argv=argv)
try:
    with gate._stop_on_sigterm():
        live.run_launches(run, ["off-eager"], progress=print)
except KeyboardInterrupt:
    sys.exit(130)
except gate._Terminated:
    sys.exit(143)
"""
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    try:
        child = int(wait_for(pidfile, timeout=30))
        server_group = pgid_of(child)
        assert server_group != os.getpgid(proc.pid)
        time.sleep(0.3)
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == code, out + err
    assert group_members(server_group) == []
