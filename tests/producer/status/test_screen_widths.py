"""`producer status`'s screen drawn as a terminal shows it (rich's Console, as --watch draws it) at
80, 100 and 110 columns: nothing that matters is cut (the PAUSED reason, the ETA line, the
consumers, the engine doctor's advice), and no line is wider than the screen."""

from __future__ import annotations

import io
import re
from typing import Any

import pytest
import redis
from rich.console import Console

from genqueue.common.keepers.pause import Pause
from genqueue.producer.status import format_status, run_status
from genqueue.producer.status.command import MIN_WIDTH, _watch_frame
from genqueue.producer.status.screen import WIDTH
from tests.producer.status.conftest import RUN, make_run, ship, snapshot

REASON = ("breaker: 24 items in a row failed with http_5xx (500 Internal Server Error: the engine answered "
          "'CUDA error: an illegal memory access was encountered'); fix the engine, then resume")
ADVICE = ("memory binds: KV cache 97% used and 12 requests waiting; lower --max-num-seqs or give the engine "
          "more GPU memory (--gpu-memory-utilization)")


def _busy(conn: redis.Redis) -> dict[str, Any]:
    """A paused run of two million items mid-way, with three consumers, as run_status reports it."""
    now = conn.time()[0]
    keys = make_run(conn, 40, started_at=now - 3600)
    ship(conn, keys[:20])
    Pause(conn, RUN).pause(REASON, "gq-node-a-gpu3-4f2a9c1e")
    for n in range(3):
        runs = {RUN: {"completions_per_s": 12.5, "completion_tokens_per_s": 1885.3, "in_flight": 250,
                      "held_jobs": 9}}
        engine = {"metrics": True, "running": 250.0, "waiting": 12.0, "kv_cache_usage": 0.97, "spec_decode": False,
                  "advice": ADVICE}
        snapshot(conn, f"gq-node-a-gpu{n}-4f2a9c1e", now - 1, runs=runs, engine=engine, models=["Qwen/Qwen3-32B"],
                 max_model_len={"Qwen/Qwen3-32B": 40960})
    r: dict[str, Any] = dict(run_status(conn, RUN))
    # the figures of a big run (the screen is what is tested here, not how they are counted)
    r.update(items=2_000_000, items_done=1_234_567, items_failed=0, items_queued=700_000, items_in_flight=750,
             items_shipping=64_683, items_elsewhere=0, done=1_234_567, complete=1_234_567, outcomes_counted=1_234_567,
             eta_s=99_871.0, eta_basis="completion_tokens", eta_assumes_completion_tokens_per_s=5656.0,
             paused=None)
    r["speed"] = {**r["speed"], "note": None,
                  "last_minute": {"completions_per_s": 37.5, "completion_tokens_per_s": 5656.0,
                                  "prompt_tokens_per_s": 21_034.0}}
    return r


@pytest.mark.parametrize("columns", [80, 100, 110])
def test_nothing_that_matters_is_cut_at_80_100_or_110_columns(conn: redis.Redis, columns: int) -> None:
    # was, at 110 columns: "... ETA 1d 3h 44m at 5,656 completion tok/…" and "PAUSED   breaker: 24 items in a
    # row…" (cut at 100 by status itself), and at 80 the terminal wrapped every long line again;
    # now: lines wrapped to the screen, the reason on lines of its own, nothing cut
    r = _busy(conn)
    paused = {**r, "paused": run_status(conn, RUN)["paused"]}
    flat = _drawn(r, columns)
    assert "ETA 1d 3h 44m at 5,656 tok/s (last minute)" in flat, flat
    for n in range(3):
        assert f"gq-node-a-gpu{n}-4f2a9c1e gpu 0 live 12.5/s 1,885 tok/s in flight " in flat
    assert flat.count("held 9 jobs") == 3 and flat.count(f"engine: {ADVICE}") == 3
    flat = _drawn(paused, columns)
    assert f"PAUSED {REASON} (by gq-node-a-gpu3-4f2a9c1e, " in flat and f"`producer resume --run {RUN}`)" in flat


def _drawn(r: dict[str, Any], columns: int) -> str:
    """R's screen as a terminal of COLUMNS shows it, in words (after checking that no line was
    cut and that none was wider than the screen)."""
    text = format_status(r, color=True, width=max(min(columns, WIDTH), MIN_WIDTH))  # type: ignore[arg-type]
    out = io.StringIO()
    Console(file=out, force_terminal=True, width=columns, color_system="standard").print(_watch_frame(text))
    drawn = _plain(out.getvalue())
    assert drawn == _plain(text + "\n"), "rich wrapped a line again: it was wider than the screen"
    assert all(len(line) <= columns for line in drawn)
    assert not any("…" in line for line in drawn), [x for x in drawn if "…" in x]
    return " ".join(" ".join(drawn).split())


def _plain(text: str) -> list[str]:
    """TEXT's lines without colour codes (the last, after the final newline, left out)."""
    return [line.rstrip() for line in re.sub(r"\x1b\[[0-9;]*m", "", text).split("\n")][:-1]
