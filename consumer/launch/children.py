"""The processes `consumer launch` runs, and how it looks at them: a child in its own process
group writing to its own log, a /health probe that never blocks the supervisor's loop, and the
small checks around them (see consumer/launch/supervisor.py)."""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import IO

log = logging.getLogger("genqueue.consumer.launch")


def _die_with_parent() -> None:
    """In the child: get SIGTERM if launch itself dies (even by SIGKILL), so no engine is orphaned."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class Child:
    """One supervised process writing to its own log file, in its own process group."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], log_path: Path) -> None:
        self.name = name
        self.argv = argv
        self.env = env
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None
        self.started = 0.0
        self.failures = 0
        self.next_start = 0.0
        self._fh: IO[bytes] | None = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    def start(self) -> None:
        self._fh = open(self.log_path, "ab")  # noqa: SIM115 - held while the child lives, closed in its end
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        self._fh.write(f"=== {stamp} launch: starting {self.name}: {' '.join(self.argv)}\n".encode())
        self._fh.flush()
        try:
            self.proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=self._fh,
                                         stderr=subprocess.STDOUT, env=self.env, start_new_session=True,
                                         preexec_fn=_die_with_parent)  # noqa: PLW1509 - one prctl call
        except OSError:
            self._fh.close()
            self._fh = None
            raise
        self.started = time.monotonic()
        log.info("%s started (pid %d)", self.name, self.proc.pid)

    def poll(self) -> int | None:
        """The exit code if the process has just exited (then it is forgotten), else None."""
        if self.proc is None:
            return None
        code = self.proc.poll()
        if code is None:
            return None
        self.kill_group()  # whatever it left behind (vLLM's engine core) goes with it
        self.proc = None
        if self._fh is not None:
            self._fh.close()
            self._fh = None
        return code

    def terminate(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL the process group now and reap the process."""
        self.kill_group()
        if self.proc is not None:
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                log.error("%s (pid %d) survived SIGKILL for 10 s", self.name, self.proc.pid)
        self.poll()

    def kill_group(self) -> None:
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


class Probe:
    """One /health request at a time, in a pool thread: a hung engine never stalls the loop."""

    def __init__(self, pool: ThreadPoolExecutor, url: str) -> None:
        self.pool = pool
        self.url = url
        self.fut: Future[bool] | None = None
        self.asked_at = 0.0

    @property
    def idle(self) -> bool:
        return self.fut is None

    def ask(self, now: float, timeout: float) -> None:
        self.fut = self.pool.submit(health_ok, self.url, timeout)
        self.asked_at = now

    def answer(self) -> bool | None:
        """The finished probe's answer (then it is forgotten), or None while it runs or none was asked."""
        if self.fut is None or not self.fut.done():
            return None
        ok = self.fut.result()
        self.fut = None
        return ok

    def forget(self) -> None:
        """Drop the probe of an engine that is gone (its thread ends within its timeout)."""
        self.fut = None


def health_ok(url: str, timeout: float = 1.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return bool(r.status == 200)
    except (OSError, urllib.error.URLError, ValueError):
        return False


def port_in_use(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def last_line(path: Path) -> str:
    """The last non-blank line of a log (why an engine would not start), at most 300 characters."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 8192))
            lines = [ln.strip() for ln in f.read().decode(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    return lines[-1][:300] if lines else ""
