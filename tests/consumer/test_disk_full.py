"""A spool whose disk fills up is a pause, not a stall (real redis-server, a real consumer
process, the stand-in vLLM, and a real size-limited filesystem: a tmpfs mounted by the test,
which needs root; skipped otherwise)."""

from __future__ import annotations

import os
import time

import orjson
import pytest

from tests.conftest import cli, sharegpt, small_tmpfs, write_jsonl
from tests.consumer.e2e import Proc, Sim, read_results, run_keys

pytestmark = pytest.mark.integration


@pytest.fixture
def small_fs(tmp_path):
    with small_tmpfs(tmp_path / "spoolfs", "1m") as mnt:
        yield mnt


@pytest.mark.slow
def test_a_full_spool_disk_pauses_and_resumes_by_itself(tmp_path, redis_url, conn, small_fs):
    data = write_jsonl(tmp_path / "full.jsonl", [sharegpt(i) for i in range(300)])
    cli("producer", "enqueue", str(data), "--run", "full", "--output", str(tmp_path / "out"), "--batch-size", "8",
        "--max-tokens", "256", "--rejects", str(tmp_path / "rej.jsonl"), env={"REDIS_URL": redis_url})
    filler = small_fs / "filler"
    with open(filler, "wb") as fh:  # leave about 64 KiB: a few shards, then the disk is full
        fh.write(b"\0" * (os.statvfs(small_fs).f_bavail * os.statvfs(small_fs).f_frsize - 64 * 1024))
    sim = Sim(tmp_path, "--slots", "16", "--step-time", "0.002", "--mean-tokens", "150")
    try:
        c = Proc("consumer", ["run", "--run", "full", "--endpoint", sim.url, "--burst", "-c", "16",
                              "--shard-max-age", "1", "--spool", str(small_fs / "spool"), "--lease", "5"],
                 tmp_path / "c.log", env={"REDIS_URL": redis_url})
        deadline = time.monotonic() + 60
        snap = None
        while time.monotonic() < deadline and c.p.poll() is None:
            for k in conn.keys("genqueue:consumer:*"):
                s = orjson.loads(conn.get(k))
                if "spool_disk" in s["paused"]:
                    snap = s
            if snap is not None:
                break
            time.sleep(0.2)
        assert snap is not None, "the consumer never reported the full disk:\n" + c.output()
        assert "spool disk full" in snap["paused"]["spool_disk"], snap["paused"]
        assert snap["shipping"]["disk_error"] == snap["paused"]["spool_disk"]
        held = snap["held_jobs"]
        time.sleep(3 * 5 / 3)  # a lease and more: the paused consumer keeps its leases
        assert conn.zcard("rq:failed:genqueue.full") == 0
        status = cli("producer", "status", "--run", "full", env={"REDIS_URL": redis_url}).stdout
        assert "spool_disk" in status, status
        filler.unlink()  # space comes back: the consumer resumes by itself
        assert c.wait(120) == 0, c.output()
    finally:
        sim.stop()
    log = c.output()
    assert "spool disk full" in log and "writable again" in log, log
    recs = read_results(tmp_path / "out", "full")
    assert run_keys(conn, "full") <= {r["key"] for r in recs}, "nothing lost"
    assert not [r for r in recs if "error" in r]
    assert held > 0
