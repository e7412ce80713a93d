"""Start a server command in its own process group and stop the whole group.

The command runs with ``KDTREE_VERIFY=on|off`` added to the environment (or, with
``kdtree_verify=None``, whatever ``extra_env`` says, a bad value included), its
stdout and stderr go to a log file, and :meth:`ServerProcess.stop` sends SIGTERM
to the process group, then SIGKILL after a grace period, so that the workers a
server spawns (SGLang's scheduler and detokenizer processes) go too.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import time
from collections import deque
from pathlib import Path


class LaunchError(ValueError):
    """The ``--launch`` command cannot be parsed or started."""


def parse_command(text: str) -> list[str]:
    """Split ``--launch`` like a POSIX shell would and check the program exists."""
    try:
        argv = shlex.split(text)
    except ValueError as e:
        raise LaunchError(
            f"--launch: expected a shell-quoted command line, got {text!r} ({e})"
        ) from None
    if not argv:
        raise LaunchError("--launch: expected a command to start the server, got an empty string")
    prog = argv[0]
    if os.sep in prog:
        if not (os.path.isfile(prog) and os.access(prog, os.X_OK)):
            raise LaunchError(f"--launch: program {prog!r} is not an executable file")
    elif shutil.which(prog) is None:
        raise LaunchError(f"--launch: command {prog!r} not found on PATH")
    return argv


def log_tail(path: Path | str, lines: int = 30) -> str:
    """The last ``lines`` lines of a log file ('' when it is missing or empty)."""
    try:
        with open(path, errors="replace") as f:
            return "".join(deque(f, maxlen=lines)).rstrip("\n")
    except OSError:
        return ""


def _state(stat: str) -> list[str]:
    """The fields after ``pid (comm)`` of a ``/proc`` stat line (comm may hold spaces and parentheses)."""
    return stat[stat.rindex(")") + 2 :].split()


def _threads_live(entry: Path) -> bool:
    """Whether any thread of the process at ``entry`` (``/proc/<pid>``) is not a zombie.

    A process whose main thread has ended shows its leader as a zombie while its other threads
    still run and hold its sockets, GPU context and memory. A process that was signalled is
    seen this way for a few milliseconds while its threads end. A server with many threads
    (SGLang's scheduler, a CUDA context) can stay like this for longer.
    """
    try:
        tasks = list((entry / "task").iterdir())
    except OSError:
        return False
    for t in tasks:
        try:
            if _state((t / "stat").read_text())[0] not in ("Z", "X"):
                return True
        except (OSError, ValueError, IndexError):
            continue
    return False


def group_members(pgid: int) -> list[int]:
    """Pids of the live processes in process group ``pgid``: not zombies, and not a zombie
    leader whose other threads still run (:func:`_threads_live`).

    Reads ``/proc`` where there is one, because a zombie still answers
    ``killpg(pgid, 0)``; elsewhere falls back to that probe (``[pgid]`` or ``[]``).
    """
    proc = Path("/proc")
    if not proc.is_dir():
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return []
        except PermissionError:
            pass
        return [pgid]
    pids = []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = _state(stat)  # state ppid pgrp ...
        if len(fields) >= 3 and int(fields[2]) == pgid and (fields[0] not in ("Z", "X") or _threads_live(entry)):
            pids.append(int(entry.name))
    return pids


class ServerProcess:
    """A launched server: ``start()`` it, ``exit_reason()`` while waiting, ``stop()`` at the end.

    Use as a context manager so the group is stopped on any exit, Ctrl-C included.
    """

    def __init__(
        self,
        argv: list[str],
        log_path: Path | str,
        *,
        kdtree_verify: str | None,
        extra_env: dict[str, str] | None = None,
        grace_s: float = 30.0,
    ) -> None:
        if kdtree_verify not in ("on", "off", None):
            raise ValueError(f"kdtree_verify: expected 'on', 'off' or None (as extra_env says), got {kdtree_verify!r}")
        self.argv = argv
        self.log_path = Path(log_path)
        self.kdtree_verify = kdtree_verify
        self.extra_env = dict(extra_env or {})
        self.grace_s = grace_s
        self.proc: subprocess.Popen[bytes] | None = None
        self.started_at: float | None = None
        self.stopped_with: str | None = None

    def start(self) -> ServerProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **self.extra_env, "PYTHONUNBUFFERED": "1"}
        if self.kdtree_verify is not None:
            env["KDTREE_VERIFY"] = self.kdtree_verify
        log = open(self.log_path, "wb")  # noqa: SIM115 - the child keeps its own descriptor
        try:
            self.started_at = time.monotonic()
            self.proc = subprocess.Popen(
                self.argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                env=env, start_new_session=True,
            )
        except OSError as e:
            raise LaunchError(f"--launch: cannot start {self.argv[0]!r}: {e.strerror or e}") from None
        finally:
            log.close()
        return self

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def exit_reason(self) -> str | None:
        """None while the process runs; else a sentence with its exit status."""
        if self.proc is None:
            return "the server process was never started"
        code = self.proc.poll()
        if code is None:
            return None
        how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
        return f"the server process (pid {self.proc.pid}) {how}"

    def tail(self, lines: int = 30) -> str:
        return log_tail(self.log_path, lines)

    def _group_alive(self) -> bool:
        """Whether any live (non-zombie) process is left in the server's group."""
        assert self.proc is not None
        return bool(group_members(self.proc.pid))

    def stop(self) -> str:
        """Stop the whole process group: SIGTERM, then SIGKILL after ``grace_s``.
        Returns how it ended: ``already exited``, ``SIGTERM`` or ``SIGKILL``."""
        if self.proc is None:
            return "never started"
        if self.stopped_with:
            return self.stopped_with
        pgid = self.proc.pid  # start_new_session: the group id is the leader's pid
        self.proc.poll()
        if not self._group_alive():
            self.stopped_with = "already exited"
            return self.stopped_with
        try:
            os.killpg(pgid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        end = time.monotonic() + self.grace_s
        while time.monotonic() < end:
            self.proc.poll()  # reap the leader so it stops counting
            if not self._group_alive():
                self.stopped_with = "SIGTERM"
                return self.stopped_with
            time.sleep(0.05)
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        self.stopped_with = "SIGKILL"
        return self.stopped_with

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
