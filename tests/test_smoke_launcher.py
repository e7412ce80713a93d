"""``--launch``: the fake server as a real process group, started and stopped by the gate."""

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

from kdtree_pipeline.evidence import load_record
from kdtree_pipeline.smoke import gate
from kdtree_pipeline.smoke.launcher import (
    LaunchError,
    ServerProcess,
    group_members,
    log_tail,
    parse_command,
)

PY = shlex.quote(sys.executable)
FAST = ["--poll", "0.05", "--ready-timeout", "20", "--health-timeout", "1", "--timeout", "5",
        "--stream-timeout", "1", "--long-tokens", "400", "--stop-grace", "5"]


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def fake_cmd(port: int, *extra: str) -> str:
    return " ".join([PY, "-m", "kdtree_pipeline.testing.fake_server", "--port", str(port), *extra])


def launch(tmp_path: Path, command: str, *args: str) -> tuple[int, dict]:
    code = gate.main([*FAST, "--launch", command, "--log", str(tmp_path / "server.log"),
                      "--evidence-dir", str(tmp_path), *args])
    return code, load_record(sorted(tmp_path.glob("smoke*.json"))[-1])


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


def test_environment_carries_kdtree_verify(tmp_path):
    srv = ServerProcess([sys.executable, "-c", "import os; print(os.environ['KDTREE_VERIFY'])"],
                        tmp_path / "log", kdtree_verify="off").start()
    srv.proc.wait(10)
    assert srv.stop() == "already exited" and log_tail(tmp_path / "log") == "off"
    with pytest.raises(ValueError, match="kdtree_verify"):
        ServerProcess(["x"], tmp_path / "log", kdtree_verify="yes")


# -- the gate with --launch ----------------------------------------------------------------

def test_launch_passes_and_stops_the_whole_group(tmp_path, capsys):
    port, pidfile = free_port(), tmp_path / "child.pid"
    code, rec = launch(tmp_path, fake_cmd(port, "--ready-after", "0.3", "--spawn-child",
                                          str(pidfile)), "--url", f"http://127.0.0.1:{port}")
    out = capsys.readouterr().out
    assert code == 0, out
    launch_info = rec["details"]["launch"]
    assert launch_info["stopped_with"] == "SIGTERM"
    assert group_members(launch_info["pid"]) == []  # the server and its child are gone
    child = int(pidfile.read_text())
    assert not Path(f"/proc/{child}").exists() or "Z" in Path(f"/proc/{child}/stat").read_text()
    assert rec["metrics"]["kdtree_verify"] == "on" and rec["device"]["kdtree_verify"] == "on"
    assert rec["metrics"]["ready_clock"] == "from process start"
    assert rec["details"]["readiness"]["waited_s"] >= 0.3
    assert "KDTREE_VERIFY=on" in (tmp_path / "server.log").read_text()


def test_launch_url_defaults_from_the_command_port(tmp_path):
    port = free_port()
    code, rec = launch(tmp_path, fake_cmd(port))
    assert code == 0 and rec["details"]["url"] == f"http://127.0.0.1:{port}"


def test_server_that_exits_during_startup_shows_its_log_tail(tmp_path, capsys):
    port = free_port()
    code, rec = launch(tmp_path, fake_cmd(port, "--exit-during-startup", "3", "--ready-after",
                                          "0.2"))
    out = capsys.readouterr().out
    assert code == 1
    assert "exited with code 3 during startup" in rec["reason"]
    assert "connection refused" in rec["reason"]
    assert "CUDA out of memory (simulated)" in rec["details"]["launch"]["log_tail"]
    assert "| fake server: loading weights ... failed: CUDA out of memory (simulated)" in out
    assert rec["details"]["readiness"]["waited_s"] < 10  # did not wait for the deadline


def test_server_that_exits_during_the_run(tmp_path, capsys):
    port = free_port()
    code, rec = launch(tmp_path, fake_cmd(port, "--die-after", "1"))
    out = capsys.readouterr().out
    assert code == 1
    assert "exited with code 1 during the run" in rec["reason"]
    assert rec["metrics"]["checks"]["short"]["passed"]
    assert not rec["metrics"]["checks"]["long"]["passed"]
    assert "dying as asked" in out  # log tail shown


def test_sigterm_ignored_server_is_killed(tmp_path):
    port, pidfile = free_port(), tmp_path / "child.pid"
    code, rec = launch(tmp_path, fake_cmd(port, "--ignore-sigterm", "--spawn-child",
                                          str(pidfile)), "--stop-grace", "0.3")
    assert code == 0
    assert rec["details"]["launch"]["stopped_with"] == "SIGKILL"
    assert group_members(rec["details"]["launch"]["pid"]) == []


def test_fingerprint_mismatch_between_off_and_on_launches(tmp_path, capsys):
    port, base = free_port(), tmp_path / "base.json"
    cmd = fake_cmd(port, "--differ-when-on")
    code, rec = launch(tmp_path, cmd, "--record-baseline", str(base))
    assert code == 0 and rec["details"]["launch"]["KDTREE_VERIFY"] == "off"
    code, rec = launch(tmp_path, cmd, "--compare-baseline", str(base))
    out = capsys.readouterr().out
    assert code == 1 and "short prompt's text differs" in rec["reason"]
    assert "(changed)" in out and "baseline (KDTREE_VERIFY=off)" in out


def test_launch_refuses_when_the_port_is_taken(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        code, rec = launch(tmp_path, fake_cmd(port))
    assert code == 1 and "something already listens" in rec["reason"]
    assert "launch" not in rec["details"] or "pid" not in rec["details"]["launch"]


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_interrupt_stops_the_server_group(tmp_path, sig, code):
    port, pidfile = free_port(), tmp_path / "child.pid"
    cmd = [sys.executable, "-m", "kdtree_pipeline", "smoke", *FAST, "--ready-timeout", "60",
           "--launch", fake_cmd(port, "--never-ready", "--spawn-child", str(pidfile)),
           "--log", str(tmp_path / "server.log"), "--evidence-dir", str(tmp_path)]
    gate_proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        child = int(wait_for(pidfile, timeout=30))
        server_group = pgid_of(child)
        assert server_group != os.getpgid(gate_proc.pid)
        time.sleep(0.2)
        gate_proc.send_signal(sig)
        out, err = gate_proc.communicate(timeout=30)
    finally:
        if gate_proc.poll() is None:
            gate_proc.kill()
    assert gate_proc.returncode == code, out + err
    assert group_members(server_group) == []
    rec = load_record(tmp_path / "smoke.json")
    assert not rec["passed"] and "the server was stopped" in rec["reason"]
