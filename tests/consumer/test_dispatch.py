"""The dispatcher's item guard (consumer/dispatch.py) in-process: an item that raises becomes an internal error record."""

from __future__ import annotations

import asyncio
from typing import Any

from genqueue.common.contracts import ErrorClass, Item
from genqueue.consumer.answer.generate import RunContext
from genqueue.consumer.dispatch import Dispatcher
from genqueue.consumer.engine.admission import Limiter
from genqueue.consumer.work.book import Book
from tests.doubles import FakeGate, FakeOutbox, item, job, result

# --- dispatcher: the item guard ----------------------------------------------------------


class ExplodingGenerator:
    """Answers every item, except that item 1 raises like a bug would."""

    async def answer(self, ctx: RunContext, it: Item, *, attempt: int, enqueued_at: float | None) -> Any:
        await asyncio.sleep(0)
        if it["index"] == 1:
            raise TypeError("'NoneType' object is not subscriptable")
        return result(it)


def test_an_item_that_raises_becomes_an_internal_error_record_and_its_job_completes() -> None:
    async def scenario() -> None:
        book: Book[Any] = Book()
        js = job("a", 3)
        book.hold(js)
        outbox = FakeOutbox()
        stopping, wake = asyncio.Event(), asyncio.Event()
        seen: list[Any] = []
        d = Dispatcher(book, Limiter(8), FakeGate(), outbox, ExplodingGenerator(),  # type: ignore[arg-type]
                       on_record=lambda run, rec: seen.append(rec), wake=wake, stopping=stopping,
                       low_water=lambda: 8)
        task = asyncio.create_task(d.run())
        for _ in range(200):
            if js.complete:
                break
            await asyncio.sleep(0.01)
        task.cancel()
        assert js.complete, "the job must complete although one item raised"
        errors = [r for r in outbox.records if "error" in r]
        assert len(outbox.records) == 3 and len(errors) == 1
        assert errors[0]["error"]["class"] == ErrorClass.INTERNAL
        assert "TypeError" in errors[0]["error"]["message"] and errors[0]["key"] == item(1)["key"]
        assert js.counts["failed_internal"] == 1 and d.internal_errors == 1 and book.in_flight == 0
        assert len(seen) == 3

    asyncio.run(scenario())
