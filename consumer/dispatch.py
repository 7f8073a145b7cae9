"""Sending items: admission (the in-flight limit, the endpoint gate, the spool), one task per
item, and the guard that makes every item end in a record.

Whatever goes wrong while an item is answered, the item ends in a record: the generator
never raises for a request's failure, and anything else (a bug) becomes an error record of
class `internal` with its message. So every held job completes, is acked, and a `--burst`
consumer always finishes.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Awaitable, Callable

from genqueue.common.contracts import Item
from genqueue.common.keepers.flights import Flight
from genqueue.common.records import Record, is_error
from genqueue.consumer.answer.generate import Gate, Generator, RunContext
from genqueue.consumer.answer.records import internal_error
from genqueue.consumer.engine.admission import Limiter
from genqueue.consumer.rqcompat import Held
from genqueue.consumer.shipping.outbox import Outbox
from genqueue.consumer.work.book import Book, JobState

log = logging.getLogger(__name__)


class Dispatcher:
    """Keeps `limiter.limit` items in flight, refilling a slot the moment it frees up."""

    def __init__(self, book: Book[Held], limiter: Limiter, gate: Gate, outbox: Outbox, gen: Generator, *,
                 on_record: Callable[[str, Record], None], wake: asyncio.Event, stopping: asyncio.Event,
                 low_water: Callable[[], int],
                 on_won: Callable[[str], Awaitable[object]] | None = None) -> None:
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
        self._on_won = on_won
        # The end of a run (consumer/copies.py): what is in flight here, by (run, item key), so a
        # copy that shipped first elsewhere cancels ours; and the copies this consumer runs.
        self._flying: dict[tuple[str, str], tuple[asyncio.Task[None], JobState[Held], float]] = {}
        self._won: set[tuple[str, str]] = set()
        self.copies: dict[tuple[str, str], asyncio.Task[bool]] = {}
        self.copies_shipped = self.copies_lost = self.cancelled_won = self.copies_yielded = 0
        # Copies that ended here without a result, whose claims the copier gives back (oldest
        # first); and those that ended in an error, which this consumer does not copy again.
        self.unclaimed: collections.deque[tuple[str, str]] = collections.deque()
        self.copies_failed: set[tuple[str, str]] = set()

    async def run(self) -> None:
        while True:
            if not self.book.pending or self.stopping.is_set():
                self.wake.clear()
                await self.wake.wait()
                continue
            if self.limiter.used >= self.limiter.limit and self.copies:
                self._yield_copies()
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
            self._flying[(js.run, item["key"])] = (task, js, time.monotonic())
            if self.book.below_share or self.book.pending < self._low_water():
                self.wake.set()  # the intake fetches for the run that fell under its share

    async def _item(self, js: JobState[Held], item: Item) -> None:
        where = (js.run, item["key"])
        rec: Record | None
        try:
            rec = await self.gen.answer(js.ctx, item, attempt=js.attempt, enqueued_at=js.enqueued_at)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if where not in self._won or task is None or task.uncancel() > 0:
                raise  # a stop: the job goes back
            rec = None
        except Exception as e:
            self.internal_errors += 1
            log.exception("item %s of job %s: unexpected error; recorded as an internal error", item["key"], js.id)
            rec = internal_error(js.ctx.for_item(item), item, js.attempt, e)
        finally:
            self.limiter.release()
            self.book.answered(js)
            self._flying.pop(where, None)
        if where in self._won:
            # A result of this item shipped first elsewhere (it is marked done): ours is not needed.
            # (No cancel reaches this task any more: it left _flying above.)
            self._won.discard(where)
            if not js.abandoned:
                self.book.won_elsewhere(js)
                self.cancelled_won += 1
                if js.complete and self._on_won is not None:
                    await self._on_won(js.run)
                self.wake.set()
            return
        if js.abandoned or rec is None:
            return  # its job went back to the queue meanwhile: its new run writes this again
        seq = self.outbox.append(js.run, rec, place=js.places.get(item["key"]) if js.places else None)
        self.book.recorded(js, rec, seq)
        self._on_record(js.run, rec)
        self.wake.set()

    # --- the end of a run: copies (consumer/copies.py) ----------------------------------
    def held_items(self, run: str) -> list[Flight]:
        """What this consumer holds of RUN: its items in flight (with how long) and those waiting."""
        now = time.monotonic()
        out = [Flight(js.id, key, now - t) for (r, key), (_, js, t) in self._flying.items()
               if r == run and (r, key) not in self._won]
        out += [Flight(js.id, item["key"], None) for js, item in self.book.pending_items(run)]
        return out

    def held_runs(self) -> set[str]:
        """The runs with items in flight or waiting here."""
        return {r for r, _ in self._flying} | self.book.waiting_runs()

    def held_keys(self, run: str) -> list[str]:
        """The item keys of RUN in flight or waiting here (set aside for a copy elsewhere too), and
        of the copies running here."""
        keys = [key for (r, key) in self._flying if r == run]
        keys += [item["key"] for _, item in self.book.pending_items(run)]
        keys += self.book.aside_keys(run)
        keys += [key for (r, key) in self.copies if r == run]
        return keys

    async def done_elsewhere(self, run: str, keys: set[str]) -> int:
        """KEYS of RUN are marked done (a result shipped, here or by another consumer): cancel
        what still runs of them here and drop what waits. Returns how many were ended."""
        n = 0
        for key in keys:
            copy = self.copies.get((run, key))
            if copy is not None:
                copy.cancel()
                n += 1
            flying = self._flying.get((run, key))
            if flying is not None and (run, key) not in self._won:
                self._won.add((run, key))
                flying[0].cancel()
                n += 1
        completed = self.book.drop_done(run, keys)
        n += len(completed)
        self.cancelled_won += len(completed)
        if any(js.complete for js in completed) and self._on_won is not None:
            await self._on_won(run)
        if completed:
            self.wake.set()
        return n

    def copy_slots(self) -> int:
        """Slots a copy may take now: none while an item of a held job waits for one (a copy would
        give its slot up at once), the spool is past its limit or refuses writes (admission is
        paused then, and so are copies), or a stop is under way."""
        if self.book.pending or self.stopping.is_set() or self.outbox.full():
            return 0
        return max(0, self.limiter.limit - self.limiter.used)

    def room_for_work(self) -> bool:
        """Whether a slot is free for this consumer's own work: the slots copies take count as
        free, since a copy gives its slot up the moment an item of a held job waits for one."""
        return self.limiter.used - len(self.copies) < self.limiter.limit

    def _yield_copies(self) -> None:
        """An item of a held job waits and every slot is taken: the youngest copies (the least
        spent on them) are cut to free one. Their originals go on where they are held."""
        cut = sum(1 for t in self.copies.values() if t.cancelling())
        for where in reversed(self.copies):
            if self.limiter.used - cut < self.limiter.limit:
                return
            task = self.copies[where]
            if not task.cancelling():
                task.cancel()
                cut += 1
                self.copies_yielded += 1
                log.debug("copy of item %s of run %s cut: its slot goes to an item held here", where[1], where[0])

    def start_copy(self, ctx: RunContext, item: Item) -> bool:
        """Send a copy of ITEM (held by another consumer) in a free slot: its result is written
        and shipped like any; an error or a cancelled copy writes nothing (the original goes
        on). False when no slot may take a copy (copy_slots)."""
        where = (ctx.run, item["key"])
        if where in self.copies or self.copy_slots() <= 0:
            return False
        self.limiter.used += 1  # a free slot, taken without waiting
        task = asyncio.create_task(self._copy(ctx, item))
        self.copies[where] = task
        task.add_done_callback(lambda t: self._copy_ended(where, t))
        return True

    def _copy_ended(self, where: tuple[str, str], task: asyncio.Task[bool]) -> None:
        # Here, not in the copy's own finally: a copy cancelled before it first ran never enters it.
        self.copies.pop(where, None)
        self.limiter.release()
        if task.cancelled() or task.exception() is not None or not task.result():
            self.unclaimed.append(where)

    async def _copy(self, ctx: RunContext, item: Item) -> bool:
        """Whether the copy's result was written."""
        try:
            rec = await self.gen.answer(ctx, item, attempt=1, copy=True)  # its record says it is a copy
        except asyncio.CancelledError:
            return False  # its original (or another copy) shipped first, a stop, or it gave way
        except Exception:
            log.exception("copy of item %s of run %s: unexpected error; dropped (the original goes on)",
                          item["key"], ctx.run)
            self.copies_lost += 1  # counted as failed in the status counts, as an error record is
            self.copies_failed.add((ctx.run, item["key"]))
            return False
        if is_error(rec):
            self.copies_lost += 1
            self.copies_failed.add((ctx.run, item["key"]))
            log.debug("copy of item %s of run %s ended in an error; dropped (the original goes on)", item["key"],
                      ctx.run)
            return False
        self.outbox.append(ctx.run, rec)
        self.copies_shipped += 1
        self._on_record(ctx.run, rec)
        return True

    def cut_copies(self, runs: set[str]) -> int:
        """Cancel the copies running here of RUNS (paused or gone); how many were cut."""
        cut = [t for (run, _), t in self.copies.items() if run in runs and not t.cancelling()]
        for task in cut:
            task.cancel()
        return len(cut)

    def cancel_copies(self) -> None:
        for task in list(self.copies.values()):
            task.cancel()

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
