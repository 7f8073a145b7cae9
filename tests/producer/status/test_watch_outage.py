"""`producer status --watch` through a Redis restart, as a user runs it (the real CLI, piped, and a
redis-server of the test's own, stopped and started again)."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import redis

from genqueue.common.keepers.runs import RunStore
from genqueue.common.settings import RunSettings
from genqueue.producer.status.command import WATCH_MARK
from tests.conftest import BIN, RedisServer
from tests.producer.test_status_watch import _lines


def _heads(lines: queue.Queue[str | None], want: Callable[[str], bool], timeout: float) -> str:
    """The first line of the next frame on LINES that WANT accepts (AssertionError when none
    comes within TIMEOUT seconds, or the watch ends)."""
    deadline = time.monotonic() + timeout
    after_mark = False
    while True:
        try:
            line = lines.get(timeout=max(deadline - time.monotonic(), 0.01))
        except queue.Empty:
            raise AssertionError(f"no frame as wanted in {timeout} s") from None
        assert line is not None, "the watch ended"
        if after_mark and want(line):
            return line
        after_mark = line.startswith(WATCH_MARK)

pytestmark = pytest.mark.integration


def test_watch_waits_through_a_redis_restart_instead_of_exiting_1(tmp_path: Path) -> None:
    # was: "error: Redis: Error 111 connecting to 127.0.0.1:P. Connection refused.", exit 1, while
    # the consumers waited and went on; now: "Redis unreachable at redis://..., retrying (for ...)",
    # then the run again once Redis is back, and Ctrl-C leaves with 0
    server = RedisServer(tmp_path, appendonly=True)
    server.start()
    try:
        conn = redis.Redis.from_url(server.url)
        RunStore(conn).create_or_check("outage", RunSettings(output=str(tmp_path / "out")))
        exe = BIN / "producer"
        cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "genqueue.producer"]
        proc = subprocess.Popen([*cmd, "status", "--run", "outage", "--watch", "--interval", "0.5"], cwd=tmp_path,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env={**os.environ, "REDIS_URL": server.url})
        try:
            lines = _lines(proc)
            assert "outage" in _heads(lines, lambda x: x.startswith("run "), timeout=30)
            server.stop()
            down = _heads(lines, lambda x: not x.startswith("run "), timeout=30)
            assert down.startswith(f"Redis unreachable at {server.url}, retrying (for "), down
            assert proc.poll() is None, "the watch left while Redis was down"
            server.start()
            assert "outage" in _heads(lines, lambda x: x.startswith("run "), timeout=30)
            proc.send_signal(signal.SIGINT)
            assert proc.wait(timeout=10) == 0
        finally:
            proc.kill()
            proc.wait(timeout=10)
        assert proc.stderr is not None and "Traceback" not in proc.stderr.read()
    finally:
        server.stop()
