"""common/keepers/rqaccess.py against a real Redis: raw counts, failed jobs and their reasons, key reads."""

from __future__ import annotations

import time
import zlib
from typing import Any

import pytest
import redis
import rq.job
from rq import Queue, Retry

from genqueue.common.keepers.rqaccess import (
    LEGACY_TASKS,
    TASK,
    JobPlace,
    job_counts,
    job_started_at,
    job_status,
    queue_for,
    started_executions,
    use_fast_job_compression,
    worker_executions,
)
from genqueue.common.keepers.rqfailed import failed_reason
from genqueue.common.keepers.rqjobs import JobScan, read_jobs
from genqueue.consumer.rqcompat import GenWorker

pytestmark = pytest.mark.integration


def items(n: int, first: int = 0) -> list[dict[str, Any]]:
    return [{"key": f"{i:032x}", "index": i, "turn": None, "messages": [{"role": "user", "content": f"q{i}"}]}
            for i in range(first, first + n)]


def enqueue(q: Queue, func: str, job_id: str, payload: list[dict[str, Any]]) -> None:
    q.enqueue_many([q.prepare_data(func, args=[payload], job_id=job_id, retry=Retry(max=3))])


def test_counts_are_raw_and_never_clean_the_registry(conn: redis.Redis) -> None:
    q = queue_for("cnt", conn)
    for i in range(3):
        enqueue(q, TASK, f"gq-cnt-{i}", items(1, i))
    assert job_counts(conn, "cnt") == {"queued": 3, "dequeuing": 0, "started": 0, "finished": 0, "failed": 0}
    w = GenWorker([q], conn, lease=30)
    w.start()
    held, _ = w.dequeue(q)
    assert held is not None
    assert job_counts(conn, "cnt") == {"queued": 2, "dequeuing": 0, "started": 1, "finished": 0, "failed": 0}
    assert started_executions(conn, "cnt") == worker_executions(conn, w.name) == {held.execution.composite_key}
    assert job_status(conn, held.id) == "started" and job_status(conn, "gq-no-such-job") == "gone"
    started = job_started_at(conn, held.id)
    assert started is not None and abs(time.time() - started) < 60
    assert job_started_at(conn, "gq-cnt-1") is None
    # The consumer died: its lease expired. A status read must leave that to the sweeper, which
    # holds the maintenance lock; rq's own registry.count would clean it up on the spot.
    conn.zadd(q.started_job_registry.key, {held.execution.composite_key: time.time() - 100})
    for _ in range(2):
        assert job_counts(conn, "cnt")["started"] == 1
    assert job_status(conn, held.id) == "started"
    assert q.started_job_registry.count == 0  # why job_counts does not use it
    w.stop()


def test_failed_jobs_lists_ours_with_their_reasons(conn: redis.Redis) -> None:
    q = queue_for("fail", conn)
    enqueue(q, TASK, "gq-fail-new", items(2))
    enqueue(q, next(iter(LEGACY_TASKS)), "gq-fail-old", items(1, 2))  # enqueued before the namespace move
    enqueue(q, "os.system", "gq-fail-foreign", [{"key": "x"}])
    enqueue(q, TASK, "gq-fail-expired", items(1, 3))
    w = GenWorker([q], conn, lease=30)
    w.start()
    for _ in range(4):
        held, refused = w.dequeue(q)
        if held is not None:
            w.fail(held, "Traceback (most recent call last):\n  ...\nAbandonedJobError: abandoned 4 times\n",
                   retry=False)
        else:
            assert refused is not None and "os.system" in refused
    assert job_counts(conn, "fail")["failed"] == 4
    conn.delete(rq.job.Job.key_for("gq-fail-expired"))  # its hash expired; the registry entry remains
    scan = JobScan()
    found = {j.id: j for j in read_jobs(conn, "fail", [JobPlace.FAILED], scan=scan)}
    assert set(found) == {"gq-fail-new", "gq-fail-old"}
    assert [it["index"] for it in found["gq-fail-new"].items] == [0, 1]
    assert failed_reason(conn, "gq-fail-old") == "AbandonedJobError: abandoned 4 times"
    assert set(scan.bad) == {"gq-fail-foreign"}  # named, not silently dropped
    # rq's own expiry, not a defect: kept apart (its items count as missing), never called malformed
    assert scan.expired == {"gq-fail-expired": JobPlace.FAILED}
    assert list(read_jobs(conn, "nothing-here", [JobPlace.FAILED], scan=scan)) == []
    w.stop()


def test_fast_compression_is_level_one_and_rq_still_reads_it(conn: redis.Redis,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rq.job, "zlib", zlib)  # restored after the test
    q = queue_for("z", conn)
    enqueue(q, TASK, "gq-z-slow", items(1))
    use_fast_job_compression()
    enqueue(q, TASK, "gq-z-fast", items(1))
    slow, fast = (conn.hget(rq.job.Job.key_for(i), "data") for i in ("gq-z-slow", "gq-z-fast"))
    assert isinstance(slow, bytes) and isinstance(fast, bytes)
    assert slow[:2] == b"\x78\x9c" and fast[:2] == b"\x78\x01"  # zlib headers: level 6, level 1
    job = q.fetch_job("gq-z-fast")
    assert job is not None and job.func_name == TASK and job.args[0][0]["key"] == items(1)[0]["key"]
