"""One clock for leases (real redis-server, real consumer processes, the stand-in over HTTP):
a consumer whose clock is two minutes behind (its wall clock and rq's set back by a test hook,
consumer/rqcompat.py TEST_CLOCK_BEHIND: libfaketime breaks Python's sleeps) works long jobs,
each outlasting several lease periods, beside a consumer with the right time and one two
minutes ahead, all sweeping the run all along. Leases are scored and swept in Redis's time, so
no live job is swept: each consumer acks every job it took, nothing is generated twice, and
the skewed ones report their clock's offset in `producer status`."""

from __future__ import annotations

import collections
import signal

import orjson
import pytest

from tests.conftest import cli, sharegpt, wait_for, write_jsonl
from tests.consumer.e2e import Proc, Sim, read_results

pytestmark = pytest.mark.integration

LEASE = 4
SKEW = 120  # seconds the skewed consumer's clock is behind
ITEMS, BATCH = 24, 2
TOKENS, STEP = 10, 1.0  # every item takes TOKENS x STEP = 10 s: 2.5 leases


def _consumer(tmp_path, redis_url, sim, name, env=None) -> Proc:
    return Proc("consumer", ["-vv", "run", "--run", "skew", "--endpoint", sim.url, "--lease", str(LEASE),
                             "-c", "8", "--shard-max-age", "0.5", "--spool", str(tmp_path / f"spool-{name}")],
                tmp_path / f"{name}.log",
                env={"REDIS_URL": redis_url, **(env or {})})


def _long(rec):
    rec["conversations"][0]["value"] += " [len=500]"
    return rec


def _snapshot(conn, proc):
    """The last snapshot the consumer process PROC published (found by its pid)."""
    for key in conn.keys("genqueue:consumer:*"):
        snap = orjson.loads(conn.get(key))
        if snap["pid"] == proc.p.pid:
            return snap
    return None


@pytest.mark.slow
def test_a_consumer_two_minutes_behind_keeps_its_live_jobs(tmp_path, redis_url, conn):
    # "[len=500]": every item runs to its TOKENS budget; the start-up probe (no hint) is short.
    data = write_jsonl(tmp_path / "skew.jsonl", [_long(sharegpt(i)) for i in range(ITEMS)])
    cli("producer", "enqueue", str(data), "--run", "skew", "--output", str(tmp_path / "out"), "--batch-size",
        str(BATCH), "--max-tokens", str(TOKENS), "--rejects", str(tmp_path / "rej.jsonl"),
        env={"REDIS_URL": redis_url})
    sim = Sim(tmp_path, "--slots", "64", "--step-time", str(STEP), "--mean-tokens", "1", "--length-hints")
    behind = {"GENQUEUE_TEST_CLOCK_BEHIND": str(SKEW)}
    skewed = _consumer(tmp_path, redis_url, sim, "skewed", behind)
    others: list[Proc] = []
    try:
        # The skewed one takes its jobs first (up to twice its concurrency); the others then
        # take the rest, and every one sweeps the run all along.
        wait_for(lambda: (s := _snapshot(conn, skewed)) is not None and s["held_jobs"] >= 4, 30,
                 "the skewed consumer to hold jobs")
        others = [_consumer(tmp_path, redis_url, sim, "normal"),
                  _consumer(tmp_path, redis_url, sim, "ahead", {"GENQUEUE_TEST_CLOCK_BEHIND": str(-SKEW)})]
        wait_for(lambda: conn.llen("rq:queue:genqueue.skew") == 0 and not conn.zcard("rq:wip:genqueue.skew")
                 and (s := _snapshot(conn, skewed)) is not None and s["in_flight"] == 0, 35,
                 "every job to be acked")
        status = cli("producer", "status", "--run", "skew", env={"REDIS_URL": redis_url}).stdout
    finally:
        for p in (skewed, *others):
            p.signal(signal.SIGTERM)
        for p in (skewed, *others):
            p.wait(30)
        sim.stop()
    skew_log = skewed.output()
    logs = skew_log + "".join(p.output() for p in others)
    snap = _snapshot(conn, skewed)
    assert snap is not None
    jobs = snap["jobs"]
    print(f"skewed consumer: offset {snap['clock_offset']:+.1f} s, jobs {jobs}")
    assert snap["clock_offset"] == pytest.approx(SKEW, abs=2), snap["clock_offset"]
    assert "s behind Redis's" in skew_log, skew_log  # the warning, once
    assert "lease lost" not in logs and "lease(s) lost" not in logs, logs
    assert "abandoned job" not in logs, logs
    assert jobs["acked"] >= 4 and jobs["lease_lost"] == 0 and jobs["leases_lost"] == 0, jobs
    ahead = _snapshot(conn, others[1])
    assert ahead is not None and ahead["clock_offset"] == pytest.approx(-SKEW, abs=2), ahead
    counts = collections.Counter(r["key"] for r in read_results(tmp_path / "out", "skew"))
    assert len(counts) == ITEMS and max(counts.values()) == 1, counts
    line = next(ln for ln in status.splitlines() if ln.strip().startswith(snap["worker"]))
    assert "behind Redis" in line, status
