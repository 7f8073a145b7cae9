"""The README's operations section, as a user runs it: rq's own tools on genqueue queues."""

from __future__ import annotations

import pytest

from genqueue.common.rqaccess import queue_for
from genqueue.consumer.rqcompat import GenWorker
from tests.conftest import cli, sharegpt, write_jsonl
from tests.consumer.e2e import Proc, Sim, read_results, run_keys

pytestmark = pytest.mark.integration


def test_requeue_failures_with_rq_then_resume_and_empty(tmp_path, redis_url, conn):
    env = {"REDIS_URL": redis_url}
    data = write_jsonl(tmp_path / "ops.jsonl", [sharegpt(i) for i in range(40)])
    cli("producer", "enqueue", str(data), "--batch-size", "10", "--output", str(tmp_path / "out"),
        "--rejects", str(tmp_path / "r"), env=env)
    q = queue_for("ops", conn)
    # a job that failed for good (say, its retries were spent while consumers kept dying)
    w = GenWorker([q], conn, lease=30)
    w.start()
    held, _ = w.dequeue(q)
    w.fail(held, "gave up", retry=False)
    w.stop()
    assert q.failed_job_registry.get_job_ids() == [held.id]
    info = cli("rq", "info", "-u", redis_url, "genqueue.ops").stdout
    assert "genqueue.ops" in info
    # README: rq requeue with the JSON serializer puts it back
    cli("rq", "requeue", "-u", redis_url, "-S", "rq.serializers.JSONSerializer", "--queue", "genqueue.ops", "--all")
    assert q.failed_job_registry.count == 0 and held.id in q.job_ids
    # resume: every consumer had stopped; starting one again is all it takes
    sim = Sim(tmp_path, "--mean-tokens", "10")
    try:
        c = Proc("consumer", ["run", "--run", "ops", "--endpoint", sim.url, "--burst", "--spool", str(tmp_path / "s")],
                 tmp_path / "c.log", env=env)
        assert c.wait(60) == 0, c.output()
    finally:
        sim.stop()
    assert {r["key"] for r in read_results(tmp_path / "out", "ops")} == run_keys(conn, "ops")
    # README: emptying a queue drops what is queued
    cli("producer", "enqueue", str(data), "--run", "ops2", "--batch-size", "10", "--rejects", str(tmp_path / "r2"),
        env=env)
    assert queue_for("ops2", conn).count == 4
    cli("rq", "empty", "-u", redis_url, "genqueue.ops2")
    assert queue_for("ops2", conn).count == 0
