"""Sending items: admission (the in-flight limit, the endpoint gate, the spool), one task per
item, and the guard that makes every item end in a record.

Whatever goes wrong while an item is answered, the item ends in a record: the generator
never raises for a request's failure, and anything else (a bug) becomes an error record of
class `internal` with its message. So every held job completes, is acked, and a `--burst`
consumer always finishes.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from genqueue.common.contracts import Item, Record
from genqueue.consumer.admission import Limiter
from genqueue.consumer.book import Book, JobState
from genqueue.consumer.generate import Gate, Generator
from genqueue.consumer.outbox import Outbox
from genqueue.consumer.records import internal_error
from genqueue.consumer.rqcompat import Held

log = logging.getLogger(__name__)


class Dispatcher:
    """Keeps `limiter.limit` items in flight, refilling a slot the moment it frees up."""

    def __init__(self, book: Book[Held], limiter: Limiter, gate: Gate, outbox: Outbox, gen: Generator, *,
                 on_record: Callable[[str, Record], None], wake: asyncio.Event, stopping: asyncio.Event,
                 low_water: Callable[[], int]) -> None:
        self.book = book
        self.limiter = limiter
        self.gate = gate
        self.outbox = outbox
        self.gen = gen
        self._on_record = on_record
        self.wake = wake
        self.stopping = stopping
        self._low_water = low_water
        self.tasks: set[asyncio.Task[None]] = set()
        self.internal_errors = 0
        self.spool_pauses = 0

    async def run(self) -> None:
        while True:
            if not self.book.pending or self.stopping.is_set():
                self.wake.clear()
                await self.wake.wait()
                continue
            await self.limiter.acquire()
            await self.gate.up.wait()
            if self.outbox.full():
                await self._wait_for_spool()
            taken = None if self.stopping.is_set() else self.book.take()
            if taken is None:
                self.limiter.release()
                continue
            js, item = taken
            task = asyncio.create_task(self._item(js, item))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)
            if self.book.below_share or self.book.pending < self._low_water():
                self.wake.set()  # the intake fetches for the run that fell under its share

    async def _item(self, js: JobState[Held], item: Item) -> None:
        try:
            rec: Record = await self.gen.answer(js.ctx, item, attempt=js.attempt, enqueued_at=js.enqueued_at)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            self.internal_errors += 1
            log.exception("item %s of job %s: unexpected error; recorded as an internal error", item["key"], js.id)
            rec = internal_error(js.ctx.for_item(item), item, js.attempt, e)
        finally:
            self.limiter.release()
            self.book.answered(js)
        if js.abandoned:
            return  # its job went back to the queue meanwhile: its new run writes this again
        seq = self.outbox.append(js.run, rec)
        self.book.recorded(js, rec, seq)
        self._on_record(js.run, rec)
        self.wake.set()

    async def _wait_for_spool(self) -> None:
        if self.outbox.disk_error is None:
            log.warning("local spool holds %d bytes (limit %d): pausing admission until shards ship",
                        self.outbox.spool_bytes, self.outbox.spool_limit)
        self.spool_pauses += 1
        while self.outbox.full() and not self.stopping.is_set():
            await asyncio.sleep(0.2)

    async def finish(self, timeout: float, hard: Callable[[], bool]) -> int:
        """Wait up to TIMEOUT for the items in flight, then cancel the rest. Returns how many
        were cancelled (their jobs go back to the queue)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.tasks and not hard() and loop.time() < deadline:
            await asyncio.sleep(0.05)
        left = list(self.tasks)
        for t in left:
            t.cancel()
        await asyncio.gather(*left, return_exceptions=True)
        return len(left)
