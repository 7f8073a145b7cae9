"""Leases: renew what this consumer holds, sweep what dead consumers left.

Held jobs are renewed every lease/3 seconds. A renewal also finds out which leases were lost
(swept by another consumer while this one could not reach Redis, or stood still): those jobs
are dropped here, since their new owner redoes them; one that waits in its queue again, taken
by no one (a Redis back from an older snapshot, a sweep not followed by a take yet), is taken
back instead (GenWorker.take_back), so what this consumer made of it is not made again. Any
consumer sweeps expired leases of the runs it serves under rq's maintenance lock
(consumer.rqcompat.GenWorker.sweep).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from genqueue.common import defaults
from genqueue.common.keepers.rqaccess import queue_for
from genqueue.consumer.rqcompat import GenWorker, Held
from genqueue.consumer.rqthread import RqThread
from genqueue.consumer.work.book import Book

log = logging.getLogger(__name__)

#: Leases the sweeper waits, once Redis has memory again, before it sweeps: live holders renew theirs first.
REDIS_FULL_SWEEP_HOLD = 1.0
#: Held jobs are renewed this often, as a share of the lease: two renewals can fail before the lease runs out.
LEASE_RENEW_FRACTION = 1 / 3
#: A renewal never runs more often than this (seconds), whatever the lease.
LEASE_RENEW_FLOOR = 0.5
#: Expired leases are swept this often, as a share of the lease: an abandoned job waits at most half a lease more.
LEASE_SWEEP_FRACTION = 1 / 2
#: A sweep never runs more often than this (seconds).
LEASE_SWEEP_FLOOR = 1.0


def renew_every(lease: float) -> float:
    """Seconds between renewals of leases of LEASE seconds."""
    return max(lease * LEASE_RENEW_FRACTION, LEASE_RENEW_FLOOR)


def sweep_every(lease: float) -> float:
    """Seconds between sweeps of leases of LEASE seconds."""
    return max(lease * LEASE_SWEEP_FRACTION, LEASE_SWEEP_FLOOR)


def shortest_lease(socket_timeout: float = defaults.REDIS_SOCKET_TIMEOUT) -> float:
    """The shortest lease a Redis command's SOCKET_TIMEOUT allows: a hung command must surface
    within one renewal period (REDIS_SOCKET_TIMEOUT < lease * LEASE_RENEW_FRACTION)."""
    return socket_timeout / LEASE_RENEW_FRACTION


@dataclass(frozen=True, slots=True)
class LeaseSnapshot:
    swept: int  # jobs of dead consumers this one sent back to the queue
    lost: int  # leases of this consumer found swept by another
    clock_offset: float | None  # Redis's clock - this node's, seconds (common/keepers/clock.py)


class Leases:
    """The renewer and the sweeper."""

    def __init__(self, rq: RqThread, worker: GenWorker, book: Book[Held], *, lease: float,
                 runs: Callable[[], list[str]], on_swept: Callable[[], None]) -> None:
        self.rq = rq
        self.worker = worker
        self.book = book
        self.lease = lease
        self._runs = runs
        self._on_swept = on_swept
        self.swept = 0
        self.lost = 0

    async def renew_once(self) -> int:
        """Renew every held job; drop the ones whose lease was lost. Returns how many were lost."""
        held = {js.held.id: js for js in self.book}
        found = await self.rq.call(self.worker.renew, [js.held for js in held.values()])
        # A job acked or given back here while the renewal waited its turn in the rq thread is
        # gone from the registry too: ended by us, not lost.
        lost = [h for h in found if self.book.jobs.get(h.id) is held[h.id]]
        by_run: collections.Counter[str] = collections.Counter()
        for h in lost:
            js = held[h.id]
            self.book.abandon(js)
            by_run[js.run] += 1
        for run, n in by_run.items():
            log.warning("run %s: %d lease(s) lost (swept while this consumer could not renew them, or the run "
                        "is gone): their jobs are not ours any more", run, n)
        self.lost += len(lost)
        return len(lost)

    async def renew_forever(self) -> None:
        """Renew every lease/3 seconds, and at once when Redis answers again after an outage:
        a Redis back from an older snapshot put the jobs taken since in their queue, and the
        renewal takes them back (GenWorker.take_back) before another consumer takes them."""
        interval = renew_every(self.lease)
        back = self.rq.answers_again
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(back.wait(), timeout=interval)
            back.clear()
            await self.renew_once()

    async def sweep_once(self) -> int:
        rq = self.rq.snapshot()
        if rq.full_since is not None or (rq.full_ended is not None and time.monotonic() - rq.full_ended
                                         < self.lease * REDIS_FULL_SWEEP_HOLD):
            # Every lease ran out while Redis refused writes (renewals too): their live holders
            # renew first, or a live consumer's jobs would be taken for a dead one's and done twice.
            return 0
        n = 0
        for run in self._runs():
            n += await self.rq.call(self.worker.sweep, queue_for(run, self.worker.connection))
        if n:
            self.swept += n
            self._on_swept()
        return n

    async def sweep_forever(self) -> None:
        interval = sweep_every(self.lease)
        while True:
            await self.sweep_once()
            await asyncio.sleep(interval)

    def snapshot(self) -> LeaseSnapshot:
        return LeaseSnapshot(self.swept, self.lost, self.worker.clock.offset)
