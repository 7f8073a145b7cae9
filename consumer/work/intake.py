"""Taking work: dequeue jobs of the served runs, check what they carry, hold them.

A job whose payload genqueue cannot use is failed (or, when rq cannot even load it, dropped
from the queue) with its reason, and the consumer serves on: a malformed job must never crash
a consumer, or it would walk through the whole fleet as its lease expires and it is swept to
the next one. A job carries its items in its argument (inline) or names them by reference: its
`meta` naming a pack of the run and a block of it, read here from the run's output store
(packs.py: what an unreadable pack or an unreachable store does to the job and the run).

Each served run is fetched for by its share of the low-water mark (shares.py). At a run's end
here (its queue seen empty lately) a job is taken only when it can start at once, and jobs not
started are given back when another consumer calls for work of their run. A job taken again
skips the items a shipped shard holds, and those written here and not shipped yet.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable

from genqueue.common.contracts import Item, ItemError, parse_item
from genqueue.common.errors import PackError
from genqueue.common.keepers.hungry import Hungry, HungryLook
from genqueue.common.keepers.marks import Marks, Place
from genqueue.common.keepers.packs import PackTable
from genqueue.common.keepers.rqaccess import PackRef, job_counts, job_reference, queue_for
from genqueue.common.redact import redact
from genqueue.common.storage import PackNotFoundError, PackStore, StoreError
from genqueue.common.storage import store_for as default_store_for
from genqueue.common.storage.packcache import PackCache
from genqueue.common.storage.packreader import PackReader
from genqueue.consumer.guards.stop import Stopped, until
from genqueue.consumer.rqcompat import GenWorker, Held
from genqueue.consumer.rqthread import RqThread
from genqueue.consumer.served import ServedRuns
from genqueue.consumer.work.acker import Acker
from genqueue.consumer.work.book import Book, JobState
from genqueue.consumer.work.packs import JOB_FAILURE_PACK, PackNames, PackOutages, PackUnreadable
from genqueue.consumer.work.shares import RunDemand, fetch_order, targets

log = logging.getLogger(__name__)

#: A job with an item of more message characters than this is refused: far above any model's context, low enough
#: that a hand-made or corrupted job cannot make a consumer hold gigabytes.
MAX_ITEM_CHARS = 16 * 1024 * 1024

#: Seconds a dequeue under way when a stop comes may take to land in the book.
FETCH_GRACE = 1.0

#: Seconds between full looks at the runs in Redis (served, paused, settings changed).
RESOLVE_EVERY = 5.0
#: Seconds between looks for newly enqueued runs: a new run is served within a second, at one small read.
NEW_RUN_EVERY = 1.0

#: Seconds before a run whose queue was empty is asked again (at least the poll interval); its share goes elsewhere.
DRY_RETRY = 0.5

#: Seconds a consumer with a free slot and nothing of its run waiting calls for that run's work (docs/consumer.md).
HUNGRY_TTL = 2.0
#: Seconds after a run's queue was seen empty in which its jobs are taken only by a consumer with a free slot.
TAIL_WINDOW = 5.0
#: GENQUEUE_TAIL_BALANCE=0 turns both off, to measure what they buy (bench/bench_fleet.py).
TAIL_BALANCE = os.environ.get("GENQUEUE_TAIL_BALANCE", "1") != "0"

class InvalidJob(ValueError):
    """A job naming genqueue's task whose arguments are not a list of valid items."""


def parse_items(args: object, kwargs: object, *, max_chars: int = MAX_ITEM_CHARS) -> list[Item]:
    """The items a job carries, each read through the contract's typed reader (contracts.parse_item:
    the producer writes them; anything else put on the queue by hand is checked here, once,
    before any request is made)."""
    if kwargs:
        raise InvalidJob("job has keyword arguments; genqueue jobs carry one list of items")
    if not isinstance(args, list | tuple) or len(args) != 1 or not isinstance(args[0], list):
        raise InvalidJob("job arguments are not a list of items")
    raw: list[object] = args[0]
    if not raw:
        raise InvalidJob("job carries no items")
    try:
        return [parse_item(item, max_chars=max_chars, where=f"item {n}") for n, item in enumerate(raw)]
    except ItemError as e:
        raise InvalidJob(str(e)) from None


class Intake:
    """The fetch loop: keeps the book's pending items above a low-water mark."""

    def __init__(self, rq: RqThread, worker: GenWorker, book: Book[Held], acker: Acker, served: ServedRuns, *,
                 low_water: Callable[[], int], may_fetch: Callable[[], bool], burst: bool,
                 poll_interval: float, wake: asyncio.Event, stopping: asyncio.Event,
                 on_complete: Callable[[str], Awaitable[object]],
                 on_runs: Callable[[list[str]], None] = lambda runs: None,
                 has_room: Callable[[], bool] = lambda: True,
                 pack_store_for: Callable[[str], PackStore] = default_store_for,
                 outages: PackOutages | None = None, pack_cache: PackCache | None = None,
                 written_here: Callable[[str, list[str]], dict[str, int]] = lambda run, keys: {}) -> None:
        self.rq = rq
        # the items of a run whose result this consumer wrote and has not shipped yet, with their
        # shard's sequence (Outbox.unshipped_results)
        self._written_here = written_here
        self.packs = PackReader(pack_store_for, disk=pack_cache)
        self.pack_names = PackNames()
        self.outages = outages if outages is not None else PackOutages()
        self.worker = worker
        # the calls for work of other consumers, read at most once a second a run (the copies read them too)
        self.hungry = HungryLook(worker.connection, worker.name)
        self.book = book
        self.acker = acker
        self.served = served
        self._low_water = low_water
        self._may_fetch = may_fetch
        self.burst = burst
        self.poll_interval = poll_interval
        self.wake = wake
        self.stopping = stopping
        self._queues_served: list[str] = []
        self._on_complete = on_complete
        self._on_runs = on_runs
        self.skipped = 0
        self._dry: dict[str, float] = {}  # run -> when a dequeue last found its queue empty
        self._has_room = has_room  # a request slot is free
        self._empty_at: dict[str, float] = {}  # run -> when its queue was last seen empty (kept)
        self._looked: dict[str, float] = {}  # run -> when a call for work was last looked for
        self._fed_at: dict[str, float] = {}  # run -> when a dequeue last found a job

    async def run(self) -> None:
        """Fetch until stopping (or, with burst, until the served runs are drained). A stop ends
        any wait at once (a pre-flight on a dead endpoint, a Redis call while Redis is out)."""
        try:
            await self._run()
        except Stopped:
            return

    async def _run(self) -> None:
        last_resolve = last_look = 0.0
        runs: list[str] = []
        while not self.stopping.is_set():
            now = time.monotonic()
            look = now - last_look >= NEW_RUN_EVERY
            if look:
                last_look = now
            if now - last_resolve > RESOLVE_EVERY or not runs or (look and await until(
                    self.stopping, self.served.new_runs())):
                runs = await until(self.stopping, self.served.resolve())
                await self._serve(runs)
                for run in self.book.runs_held() & set(self.served.paused):
                    n = await self.acker.give_back_run(run)
                    log.info("run %s is paused: %d held job(s) given back", run, n)
                for run in self.book.runs_held() & set(self.served.vanished):
                    for js in self.book:  # nothing to give back to: their queue is gone
                        if js.run == run:
                            self.book.abandon(js)
                self.book.set_priorities(self.served.priorities)
                self.pack_names.keep_only(set(self.served.contexts))
                for run in set(self.outages.runs) - set(runs):  # not served here now: nothing to prove
                    self._outage_over(run, "the run is not served here now")
                self._on_runs(runs)
                last_resolve = time.monotonic()
            wanted = self.wanted(runs)
            if wanted and self._may_fetch():
                # Raced against the stop: with Redis unreachable a dequeue waits for it, and a
                # SIGTERM must still drain what is held.
                fetch = asyncio.ensure_future(self.fetch_one(wanted))
                stop = asyncio.ensure_future(self.stopping.wait())
                await asyncio.wait({fetch, stop}, return_when=asyncio.FIRST_COMPLETED)
                stop.cancel()
                if not fetch.done():
                    # A dequeue on its way lands in the book, where the drain gives it back; cut
                    # only if Redis hangs (then its lease expires and it is swept back).
                    await asyncio.wait({fetch}, timeout=FETCH_GRACE)
                    if not fetch.done():
                        fetch.cancel()
                    return
                if fetch.result() or self.wanted(runs):
                    continue  # a run found empty just now leaves its share to the others: at once
            await until(self.stopping, self._balance(runs))
            if self.burst and not self.book.pending and self._may_fetch() \
                    and await until(self.stopping, self._drained(runs)):
                log.info("burst: nothing left to take; stopping")
                return
            self.wake.clear()
            try:
                await asyncio.wait_for(self.wake.wait(), timeout=self.poll_interval)
            except TimeoutError:
                pass

    async def _serve(self, runs: list[str]) -> None:
        conn = self.worker.connection
        names = [queue_for(r, conn).name for r in runs]
        if names != self._queues_served:
            self._queues_served = names
            queues = [queue_for(r, conn) for r in runs] or [queue_for("_idle", conn)]
            await self.rq.call(self.worker.set_queues, queues)

    def wanted(self, runs: list[str]) -> list[str]:
        """The runs to fetch a job of now, the neediest first (consumer/work/shares.py): each run holds
        its share of the low-water mark, so a run enqueued behind a big one is fetched at once."""
        now = time.monotonic()
        prio = self.served.priorities
        demand = [RunDemand(run, prio.get(run, 0), self.book.pending_of(run),
                            now - self._dry.get(run, -DRY_RETRY) >= self._retry(run, now) and self._may_take(run, now))
                  for run in runs if run not in self.served.paused]
        shares = targets(self._low_water(), demand)
        self.book.set_shares(shares)
        return fetch_order(demand, shares)

    def tail_runs(self) -> list[str]:
        """The runs at their end here: a dequeue found their queue empty within TAIL_WINDOW."""
        now = time.monotonic()
        return [run for run, at in self._empty_at.items() if now - at < TAIL_WINDOW and run in self.served.contexts]

    def _retry(self, run: str, now: float) -> float:
        """Seconds before an empty queue is asked again: at each poll while the run's last jobs
        are being given back and taken (one was taken lately), else DRY_RETRY. A run in a pack
        outage is asked again after the store backoff (its jobs given back are no work to take)."""
        outage = self.outages.runs.get(run)
        if outage is not None:
            return max(self.poll_interval, outage.retry_in)
        if TAIL_BALANCE and now - self._fed_at.get(run, -TAIL_WINDOW) < TAIL_WINDOW:
            return self.poll_interval
        return max(self.poll_interval, DRY_RETRY)

    def _may_take(self, run: str, now: float) -> bool:
        """At the end of RUN (its queue seen empty lately), a job is taken only when it can be
        started here at once; before, the low-water mark rules."""
        if not TAIL_BALANCE or now - self._empty_at.get(run, -TAIL_WINDOW) >= TAIL_WINDOW:
            return True
        # Other runs' items waiting here: the book gives this run's items the next slots by its
        # priority and share, so its last jobs are not starved by slots other runs refill.
        return not self.book.pending_of(run) and (self._has_room() or self.book.pending > 0)

    async def _balance(self, runs: list[str]) -> None:
        """Give back the jobs held here with nothing sent yet when another consumer calls for
        work of their run: it has a slot free now, this one has none (or it would have sent them)."""
        if not TAIL_BALANCE:
            return
        now = time.monotonic()
        for run in runs:
            if now - self._looked.get(run, -DRY_RETRY) < DRY_RETRY:
                continue
            jobs = self.book.unsent(run)
            if not jobs:
                continue
            self._looked[run] = now
            caller = await self.rq.call(self.hungry.other_caller, run)
            if caller is None:
                continue
            self._empty_at[run] = now  # its queue is empty: taking them back here would hoard them
            n = await self.acker.give_back_jobs(jobs)
            if n:
                log.info("run %s: its queue is empty and consumer %s has a slot free: %d job(s) not started "
                         "here given back", run, caller, n)

    def _call_for_work(self, run: str) -> None:
        Hungry(self.worker.connection, run).call(self.worker.name, HUNGRY_TTL)

    async def fetch_one(self, runs: list[str]) -> bool:
        """Dequeue one job of the first of RUNS that has one; True when a job was taken (or
        refused). A run found empty is not asked again for DRY_RETRY seconds."""
        conn = self.worker.connection
        for run in runs:
            if run in self.served.paused:  # paused since the last resolve (the breaker)
                continue
            held, refused = await self.rq.call(self.worker.dequeue, queue_for(run, conn))
            if refused:
                self.acker.count_refused()
                return True
            if held is None:
                self._dry[run] = self._empty_at[run] = time.monotonic()
                if run in self.outages.runs:
                    self._outage_over(run, "its queue is empty here: no pack left to read")
                if TAIL_BALANCE and not self.book.pending_of(run) and self._has_room():
                    await self.rq.call(self._call_for_work, run)
                continue
            self._dry.pop(run, None)
            self._fed_at[run] = time.monotonic()
            places: dict[str, Place] | None = None
            try:
                ref = job_reference(held.job.args, held.job.kwargs, held.job.meta)
                if ref is None:
                    items = parse_items(held.job.args, held.job.kwargs)
                else:
                    raw, name, first = await self._read_placed(run, ref)
                    items = parse_items([raw], None)
                    places = {it["key"]: Place(ref.pack, name, first + i) for i, it in enumerate(items)}
            except ValueError as e:  # InvalidJob, or no usable reference
                await self.acker.refuse(held, f"refused: {e}")
                return True
            except PackUnreadable as e:
                await self.acker.refuse(held, f"{JOB_FAILURE_PACK}: {e}")
                return True
            except StoreError:  # the store now, not the pack: the job waits for it in its queue
                await self.acker.give_back_held([held])  # no retry spent; the outage is said in read_reference
                self._dry[run] = time.monotonic()
                outage = self.outages.runs.get(run)
                log.debug("job %s of run %s: its pack cannot be fetched now; given back, the run is asked again "
                          "in %.1f s", held.id, run, outage.retry_in if outage is not None else DRY_RETRY)
                return True
            attempt = held.attempt
            enq = held.job.enqueued_at.timestamp() if held.job.enqueued_at else None
            js = JobState(held.id, held, self.served.contexts[run], items, attempt, enq, places=places)
            await self._skip_shipped(js)
            self._skip_written_here(js)
            if run in self.served.paused:  # paused (the breaker) while this job was on its way
                await self.acker.give_back_held([held])
                return True
            self.book.hold(js)  # no await between the check and here
            if js.complete:
                await self._on_complete(run)
            self.wake.set()
            return True
        return False

    async def read_reference(self, run: str, ref: PackRef) -> list[object]:
        """The raw items of the job by reference REF of RUN, from its pack. Raises PackUnreadable,
        StoreError (after noting the run's pack outage: PackOutages). The end-of-run copies read
        through here too (consumer/copies.py)."""
        return (await self._read_placed(run, ref))[0]

    async def _read_placed(self, run: str, ref: PackRef) -> tuple[list[object], str, int]:
        """`read_reference`, with the pack's name and the slot of the block's first item: the
        items' places, where their marks go when their shard ships."""
        ctx = self.served.contexts[run]
        name = self.pack_names.known(ctx, ref.pack)
        if name is None or not ref.names(name):  # not kept, or kept from before a rewind
            self.pack_names.table_reads += 1
            name = await self.rq.call(PackTable(self.worker.connection, run).name_of, ref.pack)
            if name is None:
                raise PackUnreadable(f"pack number {ref.pack} is not in run {run}'s pack table")
            if not ref.names(name):
                raise PackUnreadable(f"the job names pack number {ref.pack} of writer {ref.writer}, but run {run}'s "
                                     f"pack table has {name} under that number")
            self.pack_names.keep(ctx, ref.pack, name)
        output = ctx.settings.output
        try:
            got, first = await asyncio.to_thread(self.packs.placed_block, output, run, name, ref.block)
            items: list[object] = list(got)
        except PackNotFoundError as e:
            raise PackUnreadable(f"{e}") from None
        except PackError as e:
            raise PackUnreadable(f"{type(e).__name__}: {e}") from None
        except StoreError as e:
            outage = self.outages.failed(run, redact(f"{type(e).__name__}: {e}")[:500])
            if outage.failures == 1:
                log.warning("run %s: its packs cannot be read now (%s); paused for its jobs by reference "
                            "(packs_unreachable): they go back to their queue, no retry spent, nothing failed, and "
                            "the queue is asked again with the store backoff until a pack reads", run, outage.error)
            raise
        self._outage_over(run, "a pack reads again")
        return items, name, first

    def _outage_over(self, run: str, why: str) -> None:
        outage = self.outages.end(run)
        if outage is not None:
            log.warning("run %s: packs_unreachable over after %.1f s and %d failed read(s) in a row: %s",
                        run, time.monotonic() - outage.began, outage.failures, why)

    async def _skip_shipped(self, js: JobState[Held]) -> None:
        """A job that runs again (after a crash, a sweep, a requeue) skips the items whose
        results a shipped shard already holds: only the rest is generated. Items with only an
        error record are tried again: the run may have been paused by a storm and fixed since
        (export keeps a result over an error record of the same item). A job's first take reads
        one command, not one an item: its items can be done only if the run's marks were rebuilt
        while it waited (Marks.done_of's first_take); a job by reference taken again reads its
        items' bits at their places, a few commands for the job (Marks.done_of's places)."""
        done = await self.rq.call(Marks(self.worker.connection, js.run).done_of, [it["key"] for it in js.items],
                                  first_take=js.held.first_take, places=js.places)
        if not done:
            return
        keep = [it for it in js.items if it["key"] not in done]
        js.counts["items_done"] += len(js.items) - len(keep)
        js.counts["items_skipped_shipped"] += len(js.items) - len(keep)
        self.skipped += len(js.items) - len(keep)
        if keep:
            log.info("job %s (attempt %d): %d of %d items already shipped; generating the rest", js.id, js.attempt,
                     len(js.items) - len(keep), len(js.items))
        else:
            log.info("job %s (attempt %d): all %d items already shipped; nothing left to generate", js.id,
                     js.attempt, len(js.items))
        js.todo = keep
        js.remaining = len(keep)

    def _skip_written_here(self, js: JobState[Held]) -> None:
        """A job taken again skips the items whose result this consumer wrote and has not shipped
        yet (a Redis rewind or loss gives back jobs whose records wait in this spool): each counts
        as recorded in its shard, so the job is acked once that shard ships, and redone if it is
        lost (Book.lose_shard). A job taken before (a sweep, a give-back, a requeue) or with items
        done or written already is retaken: items its last holder made may still ship (a consumer
        that stood still and goes on, a restart on the same spool), so the marks of what it holds
        here are looked at again while it is held (consumer/copies.py)."""
        todo = js.items if js.todo is None else js.todo
        written = self._written_here(js.run, [it["key"] for it in todo]) if todo else {}
        if written:
            keep = [it for it in todo if it["key"] not in written]
            js.max_seq = max(js.max_seq, *written.values())
            js.counts["items_done"] += len(written)
            js.counts["items_written_here"] += len(written)
            self.skipped += len(written)
            log.info("job %s (attempt %d): %d of its items already written here, shipping; not generated again",
                     js.id, js.attempt, len(written))
            js.todo = keep
            js.remaining = len(keep)
        js.retaken = not js.held.first_take or js.todo is not None

    async def _drained(self, runs: list[str]) -> bool:
        """Whether nothing of RUNS waits, is held, or sits between dequeue and start anywhere (a
        job left there by a dequeue whose reply was lost comes back after a lease: not done)."""
        if self.book.pending or self.book.in_flight or len(self.book):
            return False
        conn = self.worker.connection

        def check() -> bool:
            for run in runs:
                c = job_counts(conn, run)
                if c["queued"] or c["started"] or c["dequeuing"]:
                    return False
            return True

        if not await self.rq.call(check):
            return False
        # Empty queues are not a finished run when the run itself is gone (Redis restarted
        # empty, or flushed): resolve again, which says so; and a run fed meanwhile is served.
        return set(await self.served.resolve()) <= set(runs)
