"""Endings of held jobs: ack once their results are shipped, send back what a lost shard
held, refuse what cannot be run, give back what a drain leaves unfinished.

Every ending goes through rq in the rq thread and through the book, so a job is never both
held and ended. Run counters (`genqueue:run:<run>:stats`) are added right after the acks of
the jobs one shipped shard completed, in one MULTI for all of them, and only for jobs whose ack
went through: a job is never counted twice. A consumer killed between the acks and that MULTI
leaves those jobs out of the counters; the done marks, written before any ack, still hold
their items.
"""

from __future__ import annotations

import collections
import logging
import time
from dataclasses import dataclass

import redis

from genqueue.common.contracts import Mode
from genqueue.common.keepers.runs import RunStore
from genqueue.consumer.rqcompat import GenWorker, Held
from genqueue.consumer.rqthread import UNREACHABLE, RqThread
from genqueue.consumer.work.book import Book, JobState

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class AckSnapshot:
    acked: int
    lease_lost: int  # acks refused: the lease had been swept meanwhile (a zombie ack)
    redone: int  # jobs sent back because a shard holding their results was lost
    refused: int  # jobs genqueue cannot run (failed or dropped with their reason)
    given_back: int


class Acker:
    """Ends held jobs in rq and in the book."""

    def __init__(self, rq: RqThread, worker: GenWorker, conn: redis.Redis, book: Book[Held]) -> None:
        self.rq = rq
        self.worker = worker
        self.conn = conn
        self.runs = RunStore(conn)
        self.book = book
        self.acked = self.lease_lost = self.redone = self.refused = self.given_back = 0

    async def shipped(self, run: str, shipped_seq: int) -> int:
        """Ack every complete job of RUN whose last result is in a shard shipped by now, then
        count them in the run's record in one MULTI (not one a job: a shard's jobs share it).
        Returns how many were acked."""
        acked: list[JobState[Held]] = []
        try:
            for js in self.book.ackable(run, shipped_seq):
                ok = await self.rq.call(self._ack, js)
                self.book.release(js)
                if ok:
                    acked.append(js)
                    log.debug("job %s done: %d items in %.2f s", js.id, len(js.items), time.monotonic() - js.started)
                else:
                    self.lease_lost += 1
        finally:  # what was acked is counted, whatever stopped the rest
            if acked:
                await self.rq.call(self._count, run, acked)
        self.acked += len(acked)
        return len(acked)

    def _ack(self, js: JobState[Held]) -> bool:
        manifest = {"items": len(js.items), **dict(js.counts), "shard_seq": js.max_seq, "worker": self.worker.name}
        return self.worker.finish(js.held, manifest)

    def _count(self, run: str, acked: list[JobState[Held]]) -> None:
        """ACKED's part of RUN's record: their counts summed, the earliest start, the regenerate
        checkpoints of their multi-turn items cleared."""
        counts: collections.Counter[str] = collections.Counter()
        starts, multi = [], []
        for js in acked:
            counts.update(js.counts)
            started = js.held.job.started_at
            starts.append(started.timestamp() if started else time.time())
            if js.ctx.settings.multi_turn == Mode.REGENERATE:
                multi += [it["key"] for it in js.items if sum(m["role"] == "user" for m in it["messages"]) > 1]
        self.runs.count_acked(run, counts, min(starts), clear_checkpoints=multi)

    async def shard_lost(self, run: str, lost_seq: int) -> int:
        """A shard of RUN vanished before shipping: every job that may have results in it goes
        back to the queue (spending a retry; a spool that loses files is a real fault), and
        its items still waiting here are dropped. Returns how many jobs were sent back."""
        lost = self.book.lose_shard(run, lost_seq)
        for js in lost:
            await self.rq.call(self.worker.fail, js.held, f"results lost from the spool (shard {lost_seq})",
                               retry=True)
        self.redone += len(lost)
        return len(lost)

    async def refuse(self, held: Held, reason: str) -> None:
        """HELD names genqueue's task but cannot be run (its items do not parse): failed for
        good with REASON, never retried (a retry would only fail again, on another consumer)."""
        log.warning("job %s: %s", held.id, reason)
        await self.rq.call(self.worker.fail, held, reason, retry=False)
        self.refused += 1

    def count_refused(self) -> None:
        """A job the rq layer refused on its own (a foreign function, an unloadable job)."""
        self.refused += 1

    async def give_back_held(self, held: list[Held]) -> int:
        """HELD (already dropped from the book) go back without spending a retry; those no longer
        ours (acked or swept meanwhile) stay as they are. Returns how many went back."""
        n = 0
        for h in held:
            n += await self.rq.call(self.worker.give_back, h)
        self.given_back += n
        return n

    async def give_back_jobs(self, jobs: list[JobState[Held]]) -> int:
        """JOBS (held, nothing of them sent) go back to the front of their queue without
        spending a retry, for an idle consumer to take (the end of a run). One that meanwhile had
        an item sent or was ended another way (a pause gives it back too) stays as it is."""
        jobs = [js for js in jobs if js.sent == 0 and not js.abandoned and js.id in self.book.jobs]
        for js in jobs:
            self.book.abandon(js)
        return await self.give_back_held([js.held for js in jobs])

    async def give_back_run(self, run: str) -> int:
        """Every held job of RUN goes back without spending a retry (the run was paused)."""
        n = 0
        for js in self.book:
            if js.run == run:
                self.book.abandon(js)
                n += await self.rq.call(self.worker.give_back, js.held)
        self.given_back += n
        return n

    async def give_back_all(self, deadline: float | None = None) -> int:
        """Every held job goes back to the front of its queue without spending a retry (a
        drain). Past DEADLINE (loop time) with Redis unreachable, the rest are left: their
        leases expire and any consumer sweeps them back. Returns how many were given back."""
        n = 0
        for js in self.book:
            self.book.abandon(js)
            try:
                n += await self.rq.call_until(deadline, self.worker.give_back, js.held)
            except UNREACHABLE as e:
                log.warning("Redis unreachable (%s): %d held job(s) left to their leases, which expire and are "
                            "swept back", type(e).__name__, len(self.book) + 1)
                break
        self.given_back += n
        return n

    def snapshot(self) -> AckSnapshot:
        return AckSnapshot(self.acked, self.lease_lost, self.redone, self.refused, self.given_back)
