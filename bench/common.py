"""Shared plumbing for the benchmarks: private servers on free ports, timed subprocesses."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import redis

BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pinned(cmd: list[str], core: int | None) -> list[str]:
    if core is None or shutil.which("taskset") is None or os.cpu_count() == 1:
        return cmd
    return ["taskset", "-c", str(core), *cmd]


def start_redis(workdir: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    proc = subprocess.Popen(["redis-server", "--port", str(port), "--save", "", "--appendonly", "no",
                             "--dir", str(workdir)], stdout=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    conn = redis.Redis.from_url(url)
    for _ in range(200):
        try:
            conn.ping()
            return proc, url
        except redis.exceptions.ConnectionError:
            time.sleep(0.025)
    raise RuntimeError("redis-server did not start")


def start_sim(args: list[str], core: int | None = 0) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    proc = subprocess.Popen(pinned([str(BIN / "consumer"), "simulate", "--port", str(port), *args], core),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(400):
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1):
                return proc, f"http://127.0.0.1:{port}/v1"
        except OSError:
            time.sleep(0.025)
    raise RuntimeError("stand-in did not start")


def timed(cmd: list[str], env: dict[str, str]) -> tuple[float, float, int]:
    """Run CMD to completion; returns (wall seconds, CPU seconds of it and its children, rc)."""
    # stderr goes to a file: a pipe nobody reads while the child runs fills up and blocks it.
    import tempfile

    with tempfile.TemporaryFile() as err:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=err)
        _, status, rusage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - t0
        if os.waitstatus_to_exitcode(status) != 0:
            err.seek(0)
            sys.stderr.write(err.read().decode(errors="replace")[-2000:])
    return wall, rusage.ru_utime + rusage.ru_stime, os.waitstatus_to_exitcode(status)


def table(rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)
