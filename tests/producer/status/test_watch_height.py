"""`producer status --watch` on a terminal draws frames no taller than the terminal: the real CLI in
a pseudo-terminal of 80 x 24 (COLUMNS and LINES set, as a shell sets them), a paused run with
failed items and twelve consumers (a screen of some 80 lines at 80 columns), real Redis."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import select
import signal
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest
import redis

from genqueue.common.keepers.marks import Marks, ShardMarks
from genqueue.common.keepers.pause import Pause
from genqueue.producer.status import format_status, run_status
from genqueue.producer.status.frame import Block, Rank, fit_height
from tests.conftest import BIN
from tests.producer.status.conftest import RUN, make_run, ship, snapshot

pytestmark = pytest.mark.integration

CONSUMERS = 12
NOTE = re.compile(r"^\.\.\. (\d+) lines left out to fit the terminal: `producer status --run st` shows all$")


def _busy_run(conn: redis.Redis) -> None:
    """RUN paused after 3 of its 40 items failed and 20 shipped, served by CONSUMERS consumers."""
    now = conn.time()[0]
    keys = make_run(conn, 40, started_at=now - 600)
    ship(conn, keys[:20])
    marks = ShardMarks()
    for k in keys[20:23]:
        marks.add(k, error=True, kind="http_5xx")
    Marks(conn, RUN).mark_shipped(marks)
    Pause(conn, RUN).pause("breaker: 24 items in a row failed with http_5xx", "w0")
    for n in range(CONSUMERS):
        snapshot(conn, f"gq-node-a-gpu{n}-4f2a9c1e", now - 1, runs={RUN: {"completions_per_s": 1.5, "in_flight": 4}},
                 engine={"metrics": True, "running": 4.0, "waiting": 0.0, "advice": "the engine binds"})


def _first_frame(url: str, cwd: Path, columns: int, lines: int) -> list[str]:
    """The first frame `producer status --run RUN --watch` draws on a terminal of COLUMNS x LINES,
    as its lines, colour and cursor codes taken out (rich's Live draws a frame, then moves the
    cursor up over it, erasing each line, before the next)."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", lines, columns, 0, 0))
    exe = BIN / "producer"
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "genqueue.producer"]
    env = {**os.environ, "REDIS_URL": url, "COLUMNS": str(columns), "LINES": str(lines), "TERM": "xterm"}
    env.pop("NO_COLOR", None)
    proc = subprocess.Popen([*cmd, "status", "--run", RUN, "--watch", "--interval", "0.5"],
                            stdin=slave, stdout=slave, stderr=slave, env=env, cwd=cwd)
    os.close(slave)
    out = b""
    try:
        deadline = time.monotonic() + 30
        while b"\x1b[2K" not in out and time.monotonic() < deadline:  # the first redraw: frame one is whole
            if select.select([master], [], [], 0.2)[0]:
                try:
                    out += os.read(master, 1 << 16)
                except OSError:  # the terminal's other end closed: the watch ended
                    break
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=10) == 0, out.decode(errors="replace")
    finally:
        proc.kill()
        proc.wait(timeout=10)
        os.close(master)
    text = out.decode()
    assert "\x1b[2K" in text and "Traceback" not in text, text
    first = text.split("\r\x1b[2K", 1)[0]
    return re.sub(r"\x1b\[\??[0-9;]*[A-Za-z]", "", first).split("\r\n")


def _steady(lines: list[str]) -> list[str]:
    """LINES with their ages ("0m 01s ago") blanked: the watch draws its frame a second or so after
    the test made the screen it is compared with."""
    return [re.sub(r"\d+m \d\ds ago", "_m __s ago", x) for x in lines]


def test_a_watch_frame_fits_a_24_row_terminal_headline_first(conn: redis.Redis, redis_url: str,
                                                             tmp_path: Path) -> None:
    # was: a frame of some 80 lines on a 24-row terminal (rich cut it to 23 and a last "...", the
    # consumers and the rest gone without a word); now: 23 rows, the headline (PAUSED, FAILED, the
    # run, progress and its ETA), coverage and failures first, and a last line counting what was
    # left out and naming the command that shows it all
    _busy_run(conn)
    whole = _steady(format_status(run_status(conn, RUN), color=False, width=80).split("\n"))
    assert len(whole) > 3 * 24, len(whole)
    frame = _steady(_first_frame(redis_url, tmp_path, 80, 24))
    assert len(frame) <= 23 and all(len(x) <= 80 for x in frame), frame
    note = NOTE.match(frame[-1])
    assert note, frame[-1]
    shown = frame[:-1]
    assert int(note.group(1)) == len(whole) - len(shown), (note.group(1), len(whole), len(shown))
    it = iter(whole)  # what is shown is the screen's own lines, in its order
    assert all(any(line == w for w in it) for line in shown), shown
    flat = " ".join(" ".join(shown).split())
    for words in ("PAUSED breaker: 24 items in a row", "FAILED 3 items ended as errors", "run st (queue",
                  "progress [", "23 of 40 items; ETA - (paused)", "items 40: queued", "outcomes done 20",
                  "failed 3 (http_5xx 3)"):
        assert words in flat, (words, shown)
    assert not any(x.startswith("  gq-node-a-gpu") for x in shown)  # the consumers wait for a taller terminal


def test_a_watch_frame_that_fits_is_drawn_whole(conn: redis.Redis, redis_url: str, tmp_path: Path) -> None:
    _busy_run(conn)
    whole = _steady(format_status(run_status(conn, RUN), color=False, width=100).split("\n"))
    frame = _steady(_first_frame(redis_url, tmp_path, 100, len(whole) + 1))
    assert frame == whole


def test_blocks_are_kept_by_rank_and_drawn_in_order() -> None:
    """The ranks decide what is kept; the screen's order decides where it is drawn; a block kept
    whole or not at all; a line wider than the terminal counts the rows it wraps to."""
    blocks = [Block(Rank.DETAIL, ("input a",)), Block(Rank.HEADLINE, ("run r",)),
              Block(Rank.CONSUMERS, ("c1", "  engine")), Block(Rank.FAILURES, ("x" * 130,)),  # 3 rows at 60 columns
              Block(Rank.COVERAGE, ("items 9",))]
    assert fit_height(blocks, 8, 60, "s") == "input a\nrun r\nc1\n  engine\n" + "x" * 130 + "\nitems 9"
    assert fit_height(blocks, 7, 60, "s").split("\n") == [
        "input a", "run r", "x" * 130, "items 9", "... 2 lines left out to fit the terminal: `s` shows all"]
    assert fit_height(blocks, 5, 60, "s").split("\n") == [  # the failure's 3 rows wait, and what ranks lower
        "run r", "items 9", "... 4 lines left out to fit the terminal: `s` shows all"]
    assert fit_height(blocks, 3, 50, "s").split("\n") == [  # the note on two lines where one does not fit
        "run r", "... 5 lines left out to fit the terminal:", "    `s` shows all"]
