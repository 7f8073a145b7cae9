"""The acker (consumer/work/acker.py) in-process, with the shared doubles: acks, zombie acks, lost shards."""

from __future__ import annotations

import asyncio
from typing import Any

from genqueue.consumer.rqthread import RqThread
from genqueue.consumer.work.acker import Acker
from genqueue.consumer.work.book import Book
from tests.doubles import FakeConn, FakeWorker, complete, held_job

# --- acker ---------------------------------------------------------------------------------


def test_acker_acks_shipped_jobs_and_counts_run_stats() -> None:
    async def scenario() -> None:
        book: Book[Any] = Book()
        w, conn, rq = FakeWorker(), FakeConn(), RqThread()
        acker = Acker(rq, w, conn, book)  # type: ignore[arg-type]
        js = held_job("a", 2)
        complete(book, js, 3)
        assert await acker.shipped("r", 2) == 0  # its last shard (3) is not shipped yet
        assert await acker.shipped("r", 3) == 1
        assert [c[0] for c in w.calls] == ["finish"] and w.calls[0][2]["items_done"] == 2
        assert ("hincrby", "genqueue:run:r:stats", "items_done", 2) in conn.pipe.ops
        assert len(book) == 0 and acker.snapshot().acked == 1
        rq.close()

    asyncio.run(scenario())


def test_the_jobs_one_shard_acks_are_counted_in_one_transaction() -> None:
    """Three jobs whose last results shipped in one shard: three acks, one MULTI of the run's
    counters holding their sum (it was one a job: about 8 commands each)."""
    async def scenario() -> None:
        book: Book[Any] = Book()
        w, conn, rq = FakeWorker(), FakeConn(), RqThread()
        acker = Acker(rq, w, conn, book)  # type: ignore[arg-type]
        for name, n in (("a", 2), ("b", 1), ("c", 3)):
            complete(book, held_job(name, n), 3)
        assert await acker.shipped("r", 3) == 3
        assert [c[0] for c in w.calls] == ["finish"] * 3
        assert conn.pipe.executed == 1
        assert [op for op in conn.pipe.ops if op[:3] == ("hincrby", "genqueue:run:r:stats", "items_done")] == [
            ("hincrby", "genqueue:run:r:stats", "items_done", 6)]
        assert sum(op[0] == "hsetnx" for op in conn.pipe.ops) == 1
        rq.close()

    asyncio.run(scenario())


def test_a_zombie_ack_is_refused_and_forgotten() -> None:
    async def scenario() -> None:
        book: Book[Any] = Book()
        w, conn, rq = FakeWorker(ours=False), FakeConn(), RqThread()
        acker = Acker(rq, w, conn, book)  # type: ignore[arg-type]
        complete(book, held_job("a", 1), 1)
        assert await acker.shipped("r", 1) == 0
        assert conn.pipe.ops == [], "no run stats for an ack that did not happen"
        assert len(book) == 0 and acker.snapshot().lease_lost == 1
        rq.close()

    asyncio.run(scenario())


def test_a_lost_shard_sends_its_jobs_back_with_a_retry_spent() -> None:
    async def scenario() -> None:
        book: Book[Any] = Book()
        w, conn, rq = FakeWorker(), FakeConn(), RqThread()
        acker = Acker(rq, w, conn, book)  # type: ignore[arg-type]
        complete(book, held_job("a", 1), 5)
        complete(book, held_job("b", 1), 2)
        assert await acker.shard_lost("r", 5) == 1
        fails = [c for c in w.calls if c[0] == "fail"]
        assert len(fails) == 1 and fails[0][1].id == "a" and fails[0][2]["retry"] is True
        assert "shard 5" in fails[0][2]["reason"]
        assert list(book.jobs) == ["b"]
        rq.close()

    asyncio.run(scenario())
