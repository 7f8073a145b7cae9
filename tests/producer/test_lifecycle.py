"""Runs have a lifecycle (real redis-server, the real CLI): `producer runs` in each state,
`producer resume`, `producer delete` (with and without --purge-output)."""

from __future__ import annotations

import orjson
import pytest

from genqueue.common.keepers.pause import Pause
from genqueue.common.keepers.rqaccess import queue_for
from tests.conftest import cli, sharegpt, write_jsonl
from tests.consumer.e2e import Proc, Sim

pytestmark = pytest.mark.integration


def enqueue(tmp_path, redis_url, run, n=16):
    data = write_jsonl(tmp_path / f"{run}.jsonl", [sharegpt(i) for i in range(n)])
    cli("producer", "enqueue", str(data), "--run", run, "--output", str(tmp_path / "out"), "--batch-size", "8",
        "--max-tokens", "32", "--rejects", str(tmp_path / f"{run}.rej"), env={"REDIS_URL": redis_url})


def runs(redis_url):
    out = cli("producer", "runs", "--json", env={"REDIS_URL": redis_url}).stdout
    return {r["run"]: r for r in map(orjson.loads, out.splitlines())}


def test_runs_in_each_state_resume_and_delete(tmp_path, redis_url, conn):
    assert cli("producer", "runs", env={"REDIS_URL": redis_url}).stdout.strip() == "no runs in Redis"
    enqueue(tmp_path, redis_url, "done")
    enqueue(tmp_path, redis_url, "waiting")
    enqueue(tmp_path, redis_url, "held")
    enqueue(tmp_path, redis_url, "stopped")
    sim = Sim(tmp_path, "--mean-tokens", "8")
    try:
        c = Proc("consumer", ["run", "--run", "done", "--endpoint", sim.url, "--burst", "--shard-max-age", "1",
                              "--spool", str(tmp_path / "spool")], tmp_path / "c.log", env={"REDIS_URL": redis_url})
        assert c.wait(60) == 0, c.output()
    finally:
        sim.stop()
    from genqueue.consumer.rqcompat import GenWorker

    w = GenWorker([queue_for("held", conn)], conn, lease=60)
    w.start()
    held, _ = w.dequeue(queue_for("held", conn))
    assert held is not None
    Pause(conn, "stopped").pause("breaker: the first 8 items all failed with permanent: HTTP N", "gq-test")
    rows = runs(redis_url)
    assert {r: rows[r]["state"] for r in rows} == {"done": "done", "waiting": "queued", "held": "running",
                                                   "stopped": "paused"}
    assert rows["done"]["done"] == rows["done"]["items"] == 16 and rows["waiting"]["done"] == 0
    assert rows["stopped"]["paused"].startswith("breaker:")
    table = cli("producer", "runs", env={"REDIS_URL": redis_url}).stdout
    assert "16 of 16" in table and "paused: breaker" in table and str(tmp_path / "out") in table

    out = cli("producer", "resume", "--run", "stopped", env={"REDIS_URL": redis_url}).stdout
    assert "resumed" in out and "gq-test" in out
    assert runs(redis_url)["stopped"]["state"] == "queued"
    assert "not paused" in cli("producer", "resume", "--run", "stopped", env={"REDIS_URL": redis_url}).stdout
    bad = cli("producer", "resume", "--run", "nosuch", env={"REDIS_URL": redis_url}, check=False)
    assert bad.returncode == 2 and bad.stderr.startswith("error: ") and "Traceback" not in bad.stderr

    # delete asks first; "no" keeps everything
    no = cli("producer", "delete", "--run", "waiting", env={"REDIS_URL": redis_url}, check=False, input=b"n\n")
    assert no.returncode != 0 and "waiting" in runs(redis_url)
    cli("producer", "delete", "--run", "waiting", "--yes", env={"REDIS_URL": redis_url})
    assert "waiting" not in runs(redis_url)
    assert not [k for k in conn.keys("*") if b"waiting" in k], "every key of the run is gone"
    assert (tmp_path / "out" / "done" / "shards").is_dir()
    cli("producer", "delete", "--run", "done", "--yes", env={"REDIS_URL": redis_url})
    assert (tmp_path / "out" / "done" / "shards").is_dir(), "the output is kept without --purge-output"
    enqueue(tmp_path, redis_url, "done")
    cli("producer", "delete", "--run", "done", "--yes", "--purge-output", env={"REDIS_URL": redis_url})
    assert not (tmp_path / "out" / "done").exists()
    # a held run can be deleted; its rq keys go with it, the other runs' stay
    cli("producer", "delete", "--run", "held", "--yes", env={"REDIS_URL": redis_url})
    assert set(runs(redis_url)) == {"stopped"}
    assert conn.llen("rq:queue:genqueue.stopped") == 2


def test_delete_declined_or_unanswered_exits_1_nothing_deleted(tmp_path, redis_url, conn):
    """The delete prompt, declined or left unanswered (a script without --yes), ends alike.

    old: `n` -> "error: not deleted", exit 2; the end of the input -> "Aborted!", exit 1
    new: both -> "nothing deleted", exit 1 (click's Abort: declined, not a usage mistake)"""
    enqueue(tmp_path, redis_url, "kept")
    env = {"REDIS_URL": redis_url}
    for answer in (b"n\n", b"\n", b""):
        proc = cli("producer", "delete", "--run", "kept", env=env, check=False, input=answer)
        assert (proc.returncode, proc.stderr) == (1, "nothing deleted\n"), (answer, proc.stderr)
        assert proc.stdout.startswith("delete run kept (its queue, jobs and counters in Redis; its output is kept)? ")
        assert "kept" in runs(redis_url)
    yes = cli("producer", "delete", "--run", "kept", env=env, input=b"y\n")
    assert "run kept deleted" in yes.stdout and "kept" not in runs(redis_url)
