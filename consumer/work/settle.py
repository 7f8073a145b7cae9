"""What a shard's fate settles for the jobs held here: the consumer's duties on the outbox's,
the dispatcher's and the intake's reports (consumer/events.py runs them before any listener).

- shipped: its items are marked done, then the jobs it completes are acked (in that order: a
  crash in between leaves jobs that, run again, skip those items);
- lost: the jobs whose records it held are redone;
- its run gone from Redis: the run's held jobs are abandoned (nothing to give them back to);
- a job completed by items another consumer shipped, or taken with every item shipped: acked
  once its own records are shipped (shards ship in order: all up to the last shipped are).
Whatever frees work or a slot wakes the intake and the dispatcher.
"""

from __future__ import annotations

import asyncio

from genqueue.common.keepers.marks import ShardMarks
from genqueue.consumer.guards.rewind import Rewind
from genqueue.consumer.rqcompat import Held
from genqueue.consumer.rqthread import RqThread
from genqueue.consumer.work.acker import Acker
from genqueue.consumer.work.book import Book


class Settler:
    """The duties of the shipped, shard_lost, run_gone, ended_elsewhere and arrived_done events."""

    def __init__(self, rq: RqThread, rewind: Rewind, acker: Acker, book: Book[Held], wake: asyncio.Event) -> None:
        self.rq = rq
        self.rewind = rewind
        self.acker = acker
        self.book = book
        self.wake = wake
        self.shipped_seq: dict[str, int] = {}  # run -> the last of our shards shipped (in order)

    async def shipped(self, run: str, seq: int | None, marks: ShardMarks) -> None:
        """A shard of RUN is stored (SEQ None: an earlier consumer's): mark its items done, then
        ack the jobs it completes."""
        await self.rq.call(self.rewind.mark_shipped, run, marks)
        if seq is not None:
            self.shipped_seq[run] = max(seq, self.shipped_seq.get(run, 0))
        if seq is not None and await self.acker.shipped(run, seq):
            self.wake.set()

    async def shard_lost(self, run: str, seq: int) -> None:
        if await self.acker.shard_lost(run, seq):
            self.wake.set()

    async def run_gone(self, run: str) -> None:
        for js in self.book:
            if js.run == run:
                self.book.abandon(js)

    async def ended_elsewhere(self, run: str) -> None:
        """A job of RUN completed by an item whose result another consumer shipped."""
        if await self.acker.shipped(run, self.shipped_seq.get(run, 0)):
            self.wake.set()

    async def arrived_done(self, run: str) -> None:
        """A job of RUN arrived with every item already shipped: nothing waits for a shard."""
        await self.acker.shipped(run, 0)
