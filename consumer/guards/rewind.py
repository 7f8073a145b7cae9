"""A Redis that went back in time costs nothing already shipped.

Redis restarted from an RDB snapshot, or a replica promoted after a failover, has lost its last
seconds of writes, among them the done marks of items shipped then (common/keepers/marks.py);
their jobs come back and would generate those items again. So:

- Every marks write of this consumer carries a stamp of its own, in the same pipeline after the
  marks (`genqueue:marks_stamp:<worker>`, a counter, set with GET): a stamp lower than the last
  one written, or none, means Redis holds older data than this consumer has seen, found by the
  next marks write or look, whichever comes first. Redis's `run_id` (read every SERVER_EVERY
  seconds, and at once after Redis was out of reach) only tells the log of a restart.
- The consumer that finds its stamp gone back marks each run it serves rebuilding
  (`genqueue:run:<run>:rebuild` = "pending:<nonce>"). Every consumer reads that state (at most
  once a second, with the stamp, before it dequeues; every WATCH_EVERY seconds while it takes
  nothing) and takes no job of a pending run. Under the run's lock (common/keepers/runlock.py)
  the first rebuilds the marks from the shipped shards (Marks.rebuild) and sets "done:<nonce>";
  a rebuilder that dies leaves it pending, and the next one rebuilds.
- With the marks whole again, a consumer takes the run's jobs only after one renewal of its
  leases, so each live holder first takes back its own jobs the snapshot put back in the queue
  (GenWorker.take_back). What is lost is only what was in flight at the crash.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable
from enum import StrEnum

import redis

from genqueue.common.features import feature_store_for
from genqueue.common.keepers.marks import Marks, ShardMarks
from genqueue.common.keepers.markstamps import KEEP, MarkStamp, RebuildState
from genqueue.common.keepers.rqaccess import queue_name
from genqueue.common.keepers.runlock import RunLock
from genqueue.common.keepers.runs import RunStore
from genqueue.common.storage import ShardStore
from genqueue.consumer.rqthread import RqThread

log = logging.getLogger(__name__)

#: Seconds a dequeue lets pass between two looks at Redis (this consumer's stamp, the rebuild states).
CHECK_EVERY = 1.0
#: Seconds between those looks while nothing is dequeued: a stamp gone back is found by the next write anyway.
WATCH_EVERY = 5.0
#: Seconds between reads of Redis's run_id, which only tell the log Redis restarted (read at once after an outage).
SERVER_EVERY = 30.0
#: Seconds a rebuild waits for the run's lock before the loop looks again (a reconcile may hold it long).
LOCK_WAIT = 10.0


class Rebuild(StrEnum):
    """What one attempt at rebuilding a pending run's marks came to."""

    REBUILT = "rebuilt"  # here
    DONE = "done"  # by another consumer meanwhile
    GONE = "gone"  # the run is not in Redis: `producer enqueue` re-creates it and rebuilds
    LOCKED = "locked"  # the run's lock stayed taken: try again later


class Rewind:
    """Notices a Redis older than what this consumer wrote, and has the marks rebuilt."""

    def __init__(self, rq: RqThread, conn: redis.Redis, worker: str, *, runs: Callable[[], list[str]],
                 store_for: Callable[[str], ShardStore], hold: float = 0.0) -> None:
        self.rq = rq
        self.conn = conn
        self.worker = worker
        self._runs = runs
        self._store_for = store_for
        self.run_id: str | None = None
        self._seq = 0  # the last stamp this consumer sent
        self._written = 0  # the last stamp Redis confirmed
        self._checked = float("-inf")
        self._server_at = float("-inf")  # when Redis's run_id was last read
        self._retries = 0
        self.pending: set[str] = set()  # runs whose marks are being rebuilt (here or elsewhere)
        # Seconds a run's jobs are still not taken once its marks are whole again (a renewal of
        # leases): the jobs the rewind put back in the queue go back to their holders first
        # (GenWorker.take_back), not to another consumer that would make again what they made.
        self._hold = hold
        self._held_until: dict[str, float] = {}  # run -> time.monotonic() its jobs may be taken again
        self.rewinds = 0  # rewinds this consumer found
        self.rebuilt = 0  # runs this consumer rebuilt

    # --- in the rq thread ------------------------------------------------------------
    def mark_shipped(self, run: str, marks: ShardMarks) -> None:
        """Marks.mark_shipped, stamped (in the same pipeline, after the marks). The
        stamp it replaces tells at once whether Redis lost this consumer's last writes."""
        self._seq += 1
        replaced = Marks(self.conn, run).mark_shipped(marks, stamp=(MarkStamp.key(self.worker), self._seq, KEEP))
        if replaced is None:
            return
        if replaced < self._written:
            self._found_rewind(self._runs(), replaced)
        self._written = self._seq

    def allows(self, queue: str) -> bool:
        """Whether a job of QUEUE may be taken now (GenWorker.dequeue asks first): not while
        its run's marks are rebuilt. Looks at Redis first when the last look is a second old,
        or when Redis was out of reach since, so the first dequeue after an outage sees a rewind
        before it takes anything."""
        if self._due(CHECK_EVERY):
            self.check()
        now = time.monotonic()
        for run in [r for r, until in self._held_until.items() if until <= now]:
            del self._held_until[run]
        return not any(queue == queue_name(run) for run in self.pending | self._held_until.keys())

    def _due(self, every: float) -> bool:
        """Whether the last look is EVERY seconds old, or the rq thread retried since (Redis was
        out: look again, its run_id too)."""
        retries = self.rq.snapshot().retries
        if retries != self._retries:
            self._retries = retries
            self._server_at = float("-inf")
            return True
        return time.monotonic() - self._checked >= every

    def check(self) -> None:
        """One round trip: this consumer's stamp, the runs' rebuild states, and Redis's run_id
        when SERVER_EVERY seconds have passed since it was read."""
        runs = self._runs()
        now = time.monotonic()
        server = now - self._server_at >= SERVER_EVERY
        seen = MarkStamp(self.conn, self.worker).look(runs, server=server)
        self._checked = now
        if server:
            self._server_at = now
        run_id = seen.run_id
        if self.run_id is not None and run_id is not None and run_id != self.run_id:
            log.warning("Redis restarted (run_id %s -> %s)", self.run_id[:8], run_id[:8])
        self.run_id = run_id or self.run_id
        found = seen.stamp
        if self._written and found < self._written:
            self._found_rewind(runs, found)
            return
        for run, state in zip(runs, seen.states, strict=True):
            if state.startswith("pending:"):
                if run not in self.pending:
                    log.warning("run %s: its marks are being rebuilt after a Redis rewind; not taking its jobs "
                                "until done", run)
                self.pending.add(run)

    def _found_rewind(self, runs: list[str], found: int) -> None:
        self.rewinds += 1
        log.warning("Redis holds older data than this consumer wrote (its marks stamp is %d, %d was written): "
                    "writes were lost (a restart from an RDB snapshot, a failover); rebuilding the marks of %s "
                    "from the shipped shards before taking their jobs again", found, self._written,
                    ", ".join(runs) or "no run")
        MarkStamp(self.conn, self.worker).mark_pending(runs, uuid.uuid4().hex[:12], self._seq)
        self._written = self._seq
        self.pending.update(runs)

    # --- the loop --------------------------------------------------------------------
    async def watch(self) -> None:
        """Look at Redis every WATCH_EVERY seconds (a dequeue looks first when its look is
        CHECK_EVERY old); rebuild (or wait for) pending runs."""
        while True:
            if self._due(WATCH_EVERY):
                await self.rq.call(self.check)
            for run in sorted(self.pending):
                # A thread of its own: the rq thread keeps renewing leases meanwhile.
                outcome = await asyncio.to_thread(self._rebuild, run)
                if outcome is Rebuild.LOCKED:
                    continue
                self.settled(run, outcome)
            await asyncio.sleep(CHECK_EVERY)

    def settled(self, run: str, outcome: Rebuild) -> None:
        """RUN's marks are whole again (rebuilt here or elsewhere) or the run is gone: its jobs
        are taken again once the hold has passed."""
        self.rebuilt += outcome is Rebuild.REBUILT
        self.pending.discard(run)
        if outcome is Rebuild.GONE:
            return
        if self._hold > 0:
            self._held_until[run] = time.monotonic() + self._hold
            log.info("run %s: its marks are whole again; taking its jobs in %.1f s, once their holders have taken "
                     "back those the rewind put back in the queue", run, self._hold)
        else:
            log.info("run %s: its marks are whole again; taking its jobs", run)

    def _rebuild(self, run: str) -> Rebuild:
        """Rebuild RUN's marks under its lock unless another consumer did."""
        info = RunStore(self.conn).get(run)
        if info is None:
            RebuildState(self.conn, run).forget()
            return Rebuild.GONE
        lock = RunLock(self.conn, run)
        deadline = time.monotonic() + LOCK_WAIT
        while lock.holder() is not None:  # bounded, so a stopping consumer never hangs here
            if time.monotonic() > deadline:
                return Rebuild.LOCKED
            time.sleep(0.1)
        lock.acquire()
        try:
            state = RebuildState(self.conn, run).get()
            if not state.startswith("pending:"):
                return Rebuild.DONE
            t0 = time.monotonic()
            rebuilt = Marks(self.conn, run).rebuild(self._store_for(info.settings.output),
                                                    feature_store_for(info.settings.output))
            RebuildState(self.conn, run).rebuilt(state)
            log.warning("run %s: marks rebuilt from %s in %.1f s", run, rebuilt.line(), time.monotonic() - t0)
            return Rebuild.REBUILT
        finally:
            lock.release()
