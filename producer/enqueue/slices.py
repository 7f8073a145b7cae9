"""The slice pipeline: the items to queue, cut into slices and written while the input is read on.

A slice is SLICE_ITEMS items at most (a whole number of jobs), never splitting a record's items
(they stay in one job: jobwriter.py). New items are written by WRITERS threads, at most
WRITES_IN_FLIGHT slices at once: each claims its items, writes its pack, and queues its jobs in
its turn (the order the slices were handed out, each waiting on the event of the one before).
Once a slice fails, the ones after it are not tried, and those not yet claimed when the reading
stops are abandoned; a claim that did not end in its transaction is given back. A record's
bucket is counted from its slice's answer only (`settle_written`), in the order the slices were
handed out. Items already in the run (lost from rq, or failed with --retry-failed) are requeued
in the caller's thread, once the slices before them are written.

With no JobWriter (a dry run) nothing is written: each slice counts the jobs it would make.
"""

from __future__ import annotations

import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor

from genqueue.common.contracts import Item
from genqueue.producer.enqueue.jobwriter import JobWriter, Requeue, record_batches, same_record
from genqueue.producer.enqueue.reconcile import as_int
from genqueue.producer.enqueue.summary import Flag, Tally

#: Items claimed and enqueued per slice: bounds what a producer killed between the two leaves behind.
SLICE_ITEMS = 1024
#: Slices handed to the writers before the reader waits: a chunk's PUTs overlap the next chunk's reading.
WRITES_IN_FLIGHT = 8
#: Threads writing slices at once: a far store's PUTs overlap; transactions stay in queue order.
WRITERS = 4

#: The flag a record gets for an item a requeue did not put in a job.
_REQUEUE_OUTCOME = {Requeue.SKIPPED: Flag.QUEUED, Requeue.DONE: Flag.DONE, Requeue.FAILED: Flag.FAILED}


class _SliceNotTried(Exception):
    """A slice handed to the writer's thread after one before it failed: nothing of it was
    claimed or queued."""


class Slices:
    """The items on their way to jobs, written through WRITER (None: a dry run), counted in TALLY."""

    def __init__(self, writer: JobWriter | None, tally: Tally, *, batch_size: int, retry_failed: bool) -> None:
        self.writer = writer
        self.tally = tally
        self.batch_size = batch_size
        self.retry_failed = retry_failed
        self.size = max(batch_size, SLICE_ITEMS - SLICE_ITEMS % batch_size)
        self._pending: list[Item] = []
        # Items already in the run that this invocation puts in jobs again -> Flag.NEW (lost) or
        # Flag.RETRIED (failed, --retry-failed); written through JobWriter.requeue.
        self._requeue: dict[int, int] = {}
        # The slices being written (claim, pack, transaction), in order, in the writers' threads
        # while the caller reads on: each one's items and its write's answer.
        self._writing: deque[tuple[list[Item], Future[tuple[list[bool], int]]]] = deque()
        self._pool: ThreadPoolExecutor | None = None
        self._write_failed = threading.Event()  # a slice's write failed: the ones after it are not tried
        self._abandoned = threading.Event()  # the reading stopped: slices not yet claimed are not
        self._last_written: threading.Event | None = None  # set once the last slice handed out is written

    def add(self, it: Item) -> None:
        self._pending.append(it)

    def extend(self, items: list[Item]) -> None:
        self._pending.extend(items)

    def requeue_as(self, it: Item, flag: int) -> None:
        """IT is in the run already: requeue it (JobWriter.requeue), its record to get FLAG."""
        self._requeue[as_int(it["key"])] = flag

    def write(self, *, final: bool) -> None:
        """Write whole slices of the pending items (and, when FINAL, the rest, then wait for all)."""
        while self._pending and (final or len(self._pending) >= self.size):
            end, pend = self.size, self._pending
            while end < len(pend) and same_record(pend[end], pend[end - 1]):
                end += 1  # a record's items stay in one slice, so in one job (jobwriter.py)
            ready, self._pending = pend[:end], pend[end:]
            if self.writer is None:
                self.tally.counts["jobs"] += len(record_batches(ready, self.batch_size))
                for it in ready:
                    self.tally.queued(it, Flag.NEW)
                continue
            new = [it for it in ready if as_int(it["key"]) not in self._requeue]
            if new:
                while len(self._writing) >= WRITES_IN_FLIGHT:
                    self.settle_written(oldest=True)
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(max_workers=WRITERS, thread_name_prefix="gq-enqueue-write")
                written = threading.Event()
                self._writing.append((new, self._pool.submit(self._write_slice, new, self._last_written, written)))
                self._last_written = written
            again = [it for it in ready if as_int(it["key"]) in self._requeue]
            if again:
                self.settle_written()
                codes, jobs = self.writer.requeue(again, retry_failed=self.retry_failed)
                self.tally.counts["jobs"] += jobs
                for it, code in zip(again, codes, strict=True):
                    kind = self._requeue.pop(as_int(it["key"]))
                    if code is Requeue.QUEUED:
                        self.tally.queued(it, kind)
                        self.tally.counts["retried" if kind == Flag.RETRIED else "requeued"] += 1
                    else:
                        self.tally.flags[it["index"]] |= _REQUEUE_OUTCOME[code]

        if final:
            self.settle_written()

    def _write_slice(self, items: list[Item], before: threading.Event | None,
                     written: threading.Event) -> tuple[list[bool], int]:
        """A writer's thread: claim ITEMS, write their pack, and enqueue their jobs once the slice
        handed out BEFORE them is written (JobWriter.write's turn), then set WRITTEN; unless a
        slice before them failed (then nothing of them is claimed: _SliceNotTried)."""
        assert self.writer is not None
        try:
            if self._write_failed.is_set() or self._abandoned.is_set():
                raise _SliceNotTried
            try:
                return self.writer.write(items, turn=None if before is None else lambda: self._turn(before))
            except BaseException:
                self._write_failed.set()
                raise
        finally:
            written.set()

    def _turn(self, before: threading.Event) -> None:
        """A slice's turn to queue its jobs: once the slice before it is written; not at all
        once a slice failed (JobWriter.write gives its claim back; its pack is left unnamed)."""
        before.wait()
        if self._write_failed.is_set():
            raise _SliceNotTried

    def settle_written(self, *, oldest: bool = False) -> None:
        """Wait for the slices in flight (OLDEST: the oldest only) and count what they queued, in
        the order they were written; raises what a write raised (its claim given back, as
        JobWriter.write does). A record's bucket is settled only here, from the write's answer,
        so the counts never hold a slice that did not land."""
        while self._writing:
            new, fut = self._writing[0]
            try:
                won, jobs = fut.result()
            except _SliceNotTried:
                new, won, jobs = [], [], 0  # never claimed: an earlier slice's error is the one raised
            finally:
                if fut.done():  # not on a Ctrl-C while it waits: close() waits for it again
                    self._writing.popleft()
            self.tally.counts["jobs"] += jobs
            for it, ok in zip(new, won, strict=True):
                if ok:
                    self.tally.queued(it, Flag.NEW)
                else:  # another producer racing on the run claimed it first
                    self.tally.flags[it["index"]] |= Flag.QUEUED
            if oldest:
                return

    def close(self, *, abandon: bool = False) -> None:
        """Wait for the slices in flight (an invocation that stops on an error still waits for
        the writes it started: their jobs land, or their claims are given back, and what landed
        is counted); the first error among them, if any, is raised here. ABANDON (the reading
        stopped on an error or Ctrl-C): slices not yet claimed are not; those claimed are
        written to the end."""
        if abandon:
            self._abandoned.set()
        error: BaseException | None = None
        try:
            while self._writing:
                try:
                    self.settle_written(oldest=True)
                except Exception as e:  # noqa: BLE001 - raised below, once the others settled and counted
                    error = error or e
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None
        if error is not None:
            raise error
