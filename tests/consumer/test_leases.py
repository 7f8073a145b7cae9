"""Lease renewal (consumer/work/leases.py) in-process, with the shared doubles."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from genqueue.consumer.rqthread import RqThread
from genqueue.consumer.work.book import Book
from genqueue.consumer.work.leases import Leases
from tests.doubles import FakeWorker, held_job


# --- leases --------------------------------------------------------------------------------
def test_renewal_drops_leases_found_swept() -> None:
    async def scenario() -> None:
        book: Book[Any] = Book()
        rq = RqThread()
        a, b = held_job("a", 2), held_job("b", 2)
        book.hold(a)
        book.hold(b)
        b.held.swept = True
        leases = Leases(rq, FakeWorker(), book, lease=30, runs=list, on_swept=lambda: None)  # type: ignore[arg-type]
        assert await leases.renew_once() == 1
        assert list(book.jobs) == ["a"] and b.abandoned
        assert [t[0].id for t in iter(book.take, None)] == ["a", "a"]
        rq.close()

    asyncio.run(scenario())


def test_leases_are_renewed_at_once_when_redis_answers_again() -> None:
    """A Redis back from an older snapshot put the jobs taken since back in their queue: the renewal
    that takes them back (GenWorker.take_back) runs as Redis answers, not up to lease/3 later, when
    another consumer may have taken them (was: the next renewal on its timer, 10 s at the default lease)."""
    renewed: list[float] = []

    class Counting(FakeWorker):
        def renew(self, held: list[Any]) -> list[Any]:
            renewed.append(time.monotonic())
            return []

    async def scenario() -> None:
        rq = RqThread()
        leases = Leases(rq, Counting(), Book(), lease=30, runs=list, on_swept=lambda: None)  # type: ignore[arg-type]
        task = asyncio.create_task(leases.renew_forever())
        await asyncio.sleep(0.2)
        assert renewed == []  # the timer: every 10 s
        rq.answers_again.set()  # as the rq thread does when a call goes through after an outage
        await asyncio.sleep(0.2)
        assert len(renewed) == 1 and not rq.answers_again.is_set()
        task.cancel()
        rq.close()

    asyncio.run(scenario())
