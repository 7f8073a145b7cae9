"""Lease renewal (consumer/work/leases.py) in-process, with the shared doubles."""

from __future__ import annotations

import asyncio
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
