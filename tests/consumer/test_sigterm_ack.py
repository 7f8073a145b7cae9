"""A SIGTERM during an ack (issue 46): the stop's give-back of held jobs runs in the rq thread
behind an ack already on its way there, and used to put the just-finished job back in the queue:
finished and queued at once (`producer runs` said `queued`, `producer status` "run complete";
another consumer cleared it). Now a give-back leaves a job that is no longer ours as it is, and
`producer runs` and `producer status` name a run's state by one function over one read
(common/keepers/runstate.py), whatever rq still holds.

Real redis-server, rq and genqueue's worker, acker, book and rq thread; the producer's commands
as a user runs them.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import orjson
import pytest
import redis
from rq.job import Job, JobStatus

from genqueue.common.keepers.marks import Marks, ShardMarks
from genqueue.common.keepers.pause import Pause
from genqueue.common.keepers.rqaccess import JobPlace, place_key, queue_for
from genqueue.consumer.rqcompat import GenWorker, Held
from genqueue.consumer.rqthread import RqThread
from genqueue.consumer.work.acker import Acker
from genqueue.consumer.work.book import Book, JobState
from tests.conftest import cli, sharegpt, write_jsonl
from tests.doubles import complete, run_context

pytestmark = pytest.mark.integration


def _enqueue(tmp_path: Path, url: str, run: str, n: int, batch: int = 4) -> None:
    data = write_jsonl(tmp_path / f"{run}.jsonl", [sharegpt(i) for i in range(n)])
    cli("producer", "enqueue", str(data), "--run", run, "--output", str(tmp_path / "out"), "--batch-size",
        str(batch), "--max-tokens", "16", "--rejects", str(tmp_path / f"{run}.rej"), env={"REDIS_URL": url})


def _mark_done(conn: redis.Redis, run: str, items: list[Any], *, error: bool = False) -> None:
    marks = ShardMarks()
    for it in items:
        marks.add(it["key"], error=error)
    Marks(conn, run).mark_shipped(marks)


def test_a_give_back_queued_behind_an_ack_leaves_the_job_finished_not_queued_again(
        tmp_path: Path, redis_url: str, conn: redis.Redis) -> None:
    """was: the ack finished the job, then the stop's give-back (queued behind it in the rq thread,
    the job still in the book) pushed it back: `rq:queue:genqueue.ack` [job], the job's status
    `queued`, and its id in the finished registry too. now: finished, the queue empty, nothing
    counted as given back."""
    run = "ack"
    _enqueue(tmp_path, redis_url, run, 4)
    q = queue_for(run, conn)
    w = GenWorker([q], conn, lease=60)
    w.start()
    held, _ = w.dequeue(q)
    assert held is not None and conn.llen(q.key) == 0

    async def stop_mid_ack() -> Acker:
        rq, book = RqThread(), Book[Held]()
        acker = Acker(rq, w, conn, book)
        js = JobState(held.id, held, run_context(run), list(held.job.args[0]), 1, None)
        complete(book, js, 1)  # every result in shard 1, which has shipped
        busy = threading.Event()
        blocker = asyncio.create_task(rq.call(busy.wait, 10))  # the rq thread is busy a moment
        await asyncio.sleep(0.05)
        ack = asyncio.create_task(acker.shipped(run, 1))  # the ack: queued in the rq thread
        await asyncio.sleep(0.05)
        drain = asyncio.create_task(acker.give_back_all())  # SIGTERM's drain: the job still in the book
        await asyncio.sleep(0.05)
        busy.set()
        await asyncio.gather(blocker, ack, drain)
        rq.close()
        return acker

    acker = asyncio.run(stop_mid_ack())
    w.stop()
    assert acker.snapshot().acked == 1 and acker.snapshot().given_back == 0
    assert conn.llen(q.key) == 0, "the finished job was queued again"
    assert Job.fetch(held.id, connection=conn).get_status() == JobStatus.FINISHED
    assert conn.zscore(place_key(run, JobPlace.FINISHED), held.id) is not None


def _states(url: str, run: str) -> tuple[str, str, dict[str, Any]]:
    env = {"REDIS_URL": url}
    (row,) = [orjson.loads(line) for line in cli("producer", "runs", "--json", env=env).stdout.splitlines()
              if orjson.loads(line)["run"] == run]
    status = orjson.loads(cli("producer", "status", "--run", run, "--json", env=env).stdout)
    human = cli("producer", "status", "--run", run, env=env).stdout
    progress = next(line for line in human.splitlines() if line.startswith("progress"))
    return row["state"], progress, status


def test_producer_runs_and_status_name_one_state_for_a_run(tmp_path: Path, redis_url: str,
                                                            conn: redis.Redis) -> None:
    """One state, read once, on both screens, through the run's life. was: every item done while
    a job of it still waited in the queue (a job finished and queued again, or swept back after its
    results shipped): runs `queued`, status `run complete`. now: `done` and `run complete`."""
    run = "agree"
    _enqueue(tmp_path, redis_url, run, 8)
    q = queue_for(run, conn)
    assert _states(redis_url, run)[0] == "queued"
    w = GenWorker([q], conn, lease=60)
    w.start()
    first, _ = w.dequeue(q)
    assert first is not None
    state, progress, status = _states(redis_url, run)
    assert state == status["state"] == "running" and "run complete" not in progress
    Pause(conn, run).pause("breaker: test", "w")
    state, progress, status = _states(redis_url, run)
    assert state == status["state"] == "paused" and "ETA - (paused)" in progress
    Pause(conn, run).resume()

    # every item done while the second job still waits in the queue
    _mark_done(conn, run, list(first.job.args[0]))
    assert w.finish(first, {"items": 4})
    (waiting,) = q.job_ids
    _mark_done(conn, run, list(Job.fetch(waiting, connection=conn, serializer=q.serializer).args[0]))
    assert conn.llen(q.key) == 1
    state, progress, status = _states(redis_url, run)
    assert state == status["state"] == "done", (state, status["state"])
    assert "run complete" in progress and status["jobs"]["queued"] == 1

    # the same with some items ended as errors only: failed on both
    other = "agree2"
    _enqueue(tmp_path, redis_url, other, 4)
    (job_id,) = queue_for(other, conn).job_ids
    items = list(Job.fetch(job_id, connection=conn, serializer=q.serializer).args[0])
    _mark_done(conn, other, items[:2])
    _mark_done(conn, other, items[2:], error=True)
    state, progress, status = _states(redis_url, other)
    assert state == status["state"] == "failed" and "run over, NOT complete: 2 items failed" in progress
    w.stop()
