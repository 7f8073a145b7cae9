"""A run that vanishes from Redis mid-run (Redis restarted empty, or flushed): the consumer
says so once, keeps its results in the spool, does not crash or crash-loop, and when the
customer's own `producer enqueue` re-creates the run, ships what it kept and serves the run to
the end (real redis-server, a real consumer process, the stand-in vLLM over HTTP)."""

from __future__ import annotations

import collections
import time

import pytest

from tests.conftest import cli, sharegpt, write_jsonl
from tests.consumer.e2e import Proc, Sim, read_results, run_keys

pytestmark = pytest.mark.integration


@pytest.mark.slow
def test_a_run_flushed_from_redis_is_said_once_and_comes_back_with_enqueue(tmp_path, redis_url, conn):
    data = write_jsonl(tmp_path / "gone.jsonl", [sharegpt(i) for i in range(400)])
    env = {"REDIS_URL": redis_url}

    def enqueue():
        return cli("producer", "enqueue", str(data), "--run", "gone", "--output", str(tmp_path / "out"),
                   "--batch-size", "8", "--max-tokens", "64", "--rejects", str(tmp_path / "rej.jsonl"), env=env)

    enqueue()
    sim = Sim(tmp_path, "--slots", "16", "--step-time", "0.01", "--mean-tokens", "30")
    try:
        c = Proc("consumer", ["run", "--run", "gone", "--endpoint", sim.url, "--shard-max-age", "1", "-c", "16",
                              "--lease", "5", "--spool", str(tmp_path / "spool")], tmp_path / "c.log", env=env)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not list((tmp_path / "out" / "gone" / "shards").glob("*.jsonl")):
            time.sleep(0.1)
        conn.flushall()  # Redis lost everything: the run, its queue, its jobs, the done marks
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and "gone from Redis" not in c.output():
            time.sleep(0.2)
        time.sleep(6)  # more than a resolve period and a lease: no crash, no loop, said once
        assert c.p.poll() is None, c.output()
        log = c.output()
        assert log.count("run gone is gone from Redis") == 1, log
        assert "Traceback" not in log
        enqueue()  # the customer's own command brings the run back
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            keys = run_keys(conn, "gone")
            if keys and keys <= {r["key"] for r in read_results(tmp_path / "out", "gone")}:
                break
            time.sleep(0.5)
        c.signal(15)
        assert c.wait(60) == 0, c.output()
    finally:
        sim.stop()
    log = c.output()
    assert "is back in Redis: serving it again" in log, log
    recs = read_results(tmp_path / "out", "gone")
    counts = collections.Counter(r["key"] for r in recs)
    assert run_keys(conn, "gone") <= set(counts), "every item has a record"
    export = cli("producer", "export", "--run", "gone", "-o", str(tmp_path / "gone.out.jsonl"), env=env)
    assert "missing" in export.stdout
    print(f"records {len(recs)} for {len(counts)} items after a flush mid-run")
