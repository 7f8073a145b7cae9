"""A crash redoes only what was in flight (real redis-server, real consumer processes, the
stand-in vLLM over HTTP): a consumer is SIGKILLed mid-run holding many requests; a
replacement starts on the same spool, ships what the dead one left, and the jobs swept back
skip every item a shipped shard already holds."""

from __future__ import annotations

import collections
import hashlib
import os
import re
import signal
import time

import orjson
import pytest

from genqueue.common.keepers.items import ItemTable
from genqueue.common.keepers.marks import Marks
from genqueue.common.storage import LocalStore, SealedShard, shard_name
from tests.conftest import cli, sharegpt, write_jsonl
from tests.consumer.e2e import Proc, Sim, read_results, run_keys

pytestmark = pytest.mark.integration

LEASE = 3
SHARD_AGE = 1.0


def _consumer(tmp_path, redis_url, sim, name):
    return Proc("consumer", ["-v", "run", "--run", "crash", "--endpoint", sim.url, "--lease", str(LEASE),
                             "-c", "32", "--burst", "--shard-max-age", str(SHARD_AGE),
                             "--spool", str(tmp_path / "spool")], tmp_path / f"{name}.log",
                env={"REDIS_URL": redis_url})


@pytest.mark.slow
@pytest.mark.parametrize("prompts", ["inline", "reference"])  # issue 34: the items in the job, or in packs
def test_a_killed_consumer_costs_at_most_its_work_in_flight(tmp_path, redis_url, conn, prompts):
    data = write_jsonl(tmp_path / "crash.jsonl", [sharegpt(i) for i in range(1000)])
    cli("producer", "enqueue", str(data), "--run", "crash", "--output", str(tmp_path / "out"), "--batch-size", "16",
        "--max-tokens", "64", "--rejects", str(tmp_path / "rej.jsonl"), "--prompts", prompts,
        env={"REDIS_URL": redis_url})
    sim = Sim(tmp_path, "--slots", "32", "--step-time", "0.02", "--mean-tokens", "30")
    try:
        first = _consumer(tmp_path, redis_url, sim, "first")
        in_flight = 0
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # kill it mid-run, once something has shipped
            snaps = [orjson.loads(conn.get(k)) for k in conn.keys("genqueue:consumer:*")]
            live = [s for s in snaps if not s.get("exited")]
            if live and live[0]["shipping"]["shards"] >= 3 and live[0]["in_flight"] >= 16:
                in_flight = live[0]["in_flight"]
                break
            time.sleep(0.05)
        assert in_flight, "the consumer never got busy"
        first.signal(signal.SIGKILL)
        first.wait(10)
        written_last_window = sum(1 for _ in (tmp_path / "spool").rglob("*.jsonl.open"))
        second = _consumer(tmp_path, redis_url, sim, "second")
        assert second.wait(120) == 0, second.output()
    finally:
        sim.stop()
    recs = read_results(tmp_path / "out", "crash")
    counts = collections.Counter(r["key"] for r in recs)
    assert run_keys(conn, "crash") <= set(counts), "every item has a record"
    duplicates = sum(n - 1 for n in counts.values())
    print(f"{prompts}: in flight at the kill: {in_flight}; open shards left: {written_last_window}; "
          f"duplicate records: {duplicates}; records {len(recs)} for {len(counts)} items")
    assert "already shipped" in second.output() or duplicates == 0
    assert duplicates <= in_flight, f"{duplicates} duplicates for {in_flight} requests in flight at the kill"


def test_a_job_all_shipped_says_nothing_left_to_generate_not_generating_the_rest(tmp_path, redis_url, conn):
    """A job taken again whose every item a shipped shard holds (its marks rebuilt while it waited).

    old: "job J (attempt 1): 32 of 32 items already shipped; generating the rest"
    new: "job J (attempt 1): all 32 items already shipped; nothing left to generate" """
    out = tmp_path / "out"
    data = write_jsonl(tmp_path / "all.jsonl", [sharegpt(i) for i in range(32)])
    cli("producer", "enqueue", str(data), "--run", "all", "--output", str(out), "--rejects", os.devnull,
        env={"REDIS_URL": redis_url})
    body = b"".join(orjson.dumps({"key": d.hex(), "index": 0, "content": "x"}) + b"\n"
                    for d in ItemTable(conn, "all").digests())
    spool = tmp_path / "shipped.jsonl"
    spool.write_bytes(body)
    store = LocalStore(str(out))
    store.ship(SealedShard("all", 1, spool, shard_name("w0", 1), 32, len(body), hashlib.sha256(body).hexdigest(), 32))
    assert Marks(conn, "all").rebuild(store).done == 32
    sim = Sim(tmp_path, "--mean-tokens", "5")
    try:
        c = Proc("consumer", ["-v", "run", "--run", "all", "--endpoint", sim.url, "--burst", "--spool",
                              str(tmp_path / "spool")], tmp_path / "c.log", env={"REDIS_URL": redis_url})
        assert c.wait(60) == 0, c.output()
    finally:
        sim.stop()
    log = c.output()
    assert re.search(r"job \S+ \(attempt 1\): all 32 items already shipped; nothing left to generate", log), log
    assert "generating the rest" not in log and "0 items (0 errors), 1 jobs acked" in log, log
