"""A consumer that has gone (its last report says it exited, or it has not reported for
STALE_AFTER) is reported as gone on both of `producer status`'s screens: its engine's last verdict
is kept as last-known in --json, never as the engine's verdict now (real Redis, snapshots as the
consumer writes them)."""

from __future__ import annotations

import time

import orjson
import redis
from click.testing import CliRunner

from genqueue.common.keepers.snapshots import STALE_AFTER
from genqueue.producer.cli import main as producer_main
from genqueue.producer.status import format_status, run_status
from tests.producer.status.conftest import RUN, make_run, snapshot

#: The engine doctor's verdict each consumer last published.
VERDICT = {"metrics": True, "running": 0.0, "waiting": 0.0, "verdict": "genqueue",
           "advice": "genqueue binds: the consumer is out of work", "notes": ["1 long request running for 26 s so far"]}


def _three(conn: redis.Redis, now: float) -> None:
    """One consumer live, one that exited (Ctrl-C), one silent past STALE_AFTER (killed)."""
    make_run(conn, 8)
    runs = {RUN: {"completions_per_s": 2.0, "completion_tokens_per_s": 90.0, "in_flight": 3}}
    snapshot(conn, "up", now - 1, runs=runs, engine=VERDICT)
    snapshot(conn, "quit", now - 30, runs=runs, engine=VERDICT, exited=True)
    snapshot(conn, "killed", now - STALE_AFTER - 20, runs=runs, engine=VERDICT)


def test_a_gone_consumers_verdict_is_last_known_in_json_not_current(conn: redis.Redis, redis_url: str) -> None:
    # was: {"worker": "quit", "live": false, "exited": true, "engine": {"verdict": "genqueue",
    # "advice": "genqueue binds: the consumer is out of work", ...}}: the verdict read as the
    # engine's now; now: {"state": "exited", "gone": true, "engine": null, "last_engine": {...}}
    now = time.time()
    _three(conn, now)
    res = CliRunner().invoke(producer_main, ["status", "--run", RUN, "--json"], env={"REDIS_URL": redis_url},
                             catch_exceptions=False)
    assert res.exit_code == 0, res.output
    rows = {c["worker"]: c for c in orjson.loads(res.stdout)["consumers"]}
    assert {w: (c["state"], c["gone"], c["live"]) for w, c in rows.items()} == {
        "up": ("live", False, True), "quit": ("exited", True, False), "killed": ("silent", True, False)}
    assert rows["up"]["engine"]["verdict"] == "genqueue" and rows["up"]["last_engine"] is None
    for w in ("quit", "killed"):
        assert rows[w]["engine"] is None, rows[w]
        assert rows[w]["last_engine"]["verdict"] == "genqueue", rows[w]  # kept, as what it last said
        assert rows[w]["last_engine"]["advice"] == VERDICT["advice"]


def test_the_text_screen_reads_the_same_state(conn: redis.Redis) -> None:
    # one function (snapshots.consumer_state) decides, the JSON carries it, and the screen is drawn
    # from the JSON: a consumer the JSON calls gone has no engine line and no verdict in the text
    now = time.time()
    _three(conn, now)
    r = run_status(conn, RUN, now=now)
    text = format_status(r, color=False, width=None).splitlines()
    for c in r["consumers"]:
        (i,) = [n for n, ln in enumerate(text) if ln.startswith(f"  {c['worker']} ")]
        under = text[i + 1] if i + 1 < len(text) else ""
        if c["gone"]:
            assert ("exited" if c["state"] == "exited" else "STOPPED REPORTING") in text[i], text[i]
            assert not under.startswith("      "), (c["worker"], under)
        else:
            assert under.startswith("      engine ") and "live" in text[i], text[i:i + 2]
    assert sum("genqueue binds" in ln for ln in text) == 1, text  # the live consumer's, only
