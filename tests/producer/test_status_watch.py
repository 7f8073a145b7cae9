"""`producer status --watch` as a user runs it: on a terminal it redraws in place; into a pipe
(`| tee`, `> log`) it prints each frame whole, one after another (real Redis, the real CLI)."""

from __future__ import annotations

import io
import os
import queue
import signal
import subprocess
import sys
import threading
import time

import pytest
import redis
from rich.console import Console

from genqueue.common.keepers.runs import RunStore
from genqueue.common.settings import RunSettings
from genqueue.producer.status.command import WATCH_MARK, _watch_frame
from tests.conftest import BIN, cli

RUN = "piped"


def _lines(proc: subprocess.Popen[str]) -> queue.Queue[str | None]:
    """PROC's stdout, a line at a time, from a thread (None at its end), so the test reads it
    with a timeout and never blocks on a watch that prints nothing."""
    out: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            out.put(line.rstrip("\n"))
        out.put(None)

    threading.Thread(target=pump, daemon=True).start()
    return out


def _frames(lines: queue.Queue[str | None], n: int, timeout: float) -> list[list[str]]:
    """The first N frames on LINES (each: the lines under a WATCH_MARK line, up to the next);
    AssertionError when they do not come within TIMEOUT seconds."""
    deadline = time.monotonic() + timeout
    frames: list[list[str]] = []
    while len(frames) <= n:  # frame N is whole once frame N+1's mark is read
        try:
            line = lines.get(timeout=max(deadline - time.monotonic(), 0.01))
        except queue.Empty:
            raise AssertionError(f"{len(frames)} frame marks in {timeout} s, wanted {n + 1}: {frames}") from None
        if line is None:
            raise AssertionError(f"the watch ended after {len(frames)} frame marks: {frames}")
        if line.startswith(WATCH_MARK):
            frames.append([])
        elif frames:
            frames[-1].append(line)
        else:
            raise AssertionError(f"output before the first frame mark: {line!r}")
    return [f[:-1] if f and f[-1] == "" else f for f in frames[:n]]  # the blank line between frames


@pytest.mark.integration
def test_a_piped_watch_prints_whole_frames(conn: redis.Redis, redis_url: str) -> None:
    # was: rich's Live on a pipe printed nothing until Ctrl-C, then one frame wrapped at 80 columns
    RunStore(conn).create_or_check(RUN, RunSettings(output="s3://bucket/out"))
    RunStore(conn).record_source(RUN, "/data/input.jsonl", {"records": 3, "complete": True})
    env = {**os.environ, "REDIS_URL": redis_url}
    once = cli("producer", "status", "--run", RUN, env=env).stdout.rstrip("\n").splitlines()
    assert max(len(x) for x in once) > 80 and "consumers  (this run's share" in "\n".join(once)
    exe = BIN / "producer"
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "genqueue.producer"]
    proc = subprocess.Popen([*cmd, "status", "--run", RUN, "--watch", "--interval", "0.5"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        frames = _frames(_lines(proc), 2, timeout=30)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=10) == 0, "Ctrl-C is how --watch is left: not an error"
    finally:
        proc.kill()
        proc.wait(timeout=10)
    assert proc.stderr is not None and "Traceback" not in proc.stderr.read()
    for frame in frames:
        # each frame is what `producer status` prints, line for line: none wrapped, none cut
        assert frame == once, "\n".join(frame)


def test_red_lines_take_only_their_columns_on_a_terminal() -> None:
    # was: Text(frame) counted a red line's escape codes as columns: a 96-column line wrapped at 100
    line = "x" * 96
    out = io.StringIO()
    Console(file=out, force_terminal=True, width=100).print(_watch_frame(f"\x1b[31m{line}\x1b[0m\nnext"))
    assert [x for x in out.getvalue().splitlines()] == [f"\x1b[31m{line}\x1b[0m", "next"]
