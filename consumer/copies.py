"""The end-of-run copies: copies of what other consumers still hold, sent by one that sits idle.

At the end of a run here (its queue seen empty lately, intake.tail_runs, or another consumer
calling for work of it):
- each consumer offers what it holds of the run (common/keepers/flights.py): each item's job, how
  long it has been in flight or that it waits unsent, and its rate (output tokens/s per request);
- a consumer with a slot free and nothing of the run waiting copies an offered item it would
  likely finish sooner: a waiting one from a consumer not over UNSENT_FASTER times as fast, one in
  flight from a consumer FASTER times slower, the youngest first; one copy per item across the
  fleet (a claim in Redis, given back when the copy ends without a result, taken over from a
  consumer no longer live), never again by a consumer whose copy of it ended in an error;
- a copy of a waiting item is its transfer: the holder offers its waiting items from the last to
  go and sets aside those a live consumer claimed, sending them only if that copy ends unanswered;
- a copy's result is written and shipped like any; an error or a cancel writes nothing;
- each consumer reads the marks of what it holds: an item with a result shipped (anyone's) is
  cancelled in flight or dropped waiting, and counts as done in its job.
A shipped result is the only thing that ends an item elsewhere, so a lost copy costs its tokens
only; export keeps the original when both ship. Conversations regenerated turn by turn are not
copied (their checkpoints would interleave). GENQUEUE_TAIL_COPIES=0 turns copies off.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import time
from collections.abc import Awaitable, Callable

import redis

from genqueue.common.contracts import Item, Mode
from genqueue.common.keepers.flights import Flight, Flights, Offer
from genqueue.common.keepers.hungry import HungryLook
from genqueue.common.keepers.marks import Marks
from genqueue.common.keepers.rqaccess import PackRef, job_payload, job_reference
from genqueue.common.records import Record, is_error
from genqueue.common.storage import StoreError
from genqueue.consumer.answer.generate import RunContext
from genqueue.consumer.dispatch import Dispatcher
from genqueue.consumer.rqcompat import Held
from genqueue.consumer.rqthread import RqThread
from genqueue.consumer.work.book import Book
from genqueue.consumer.work.intake import parse_items
from genqueue.consumer.work.packs import PackUnreadable

log = logging.getLogger(__name__)

#: Seconds between looks at the end of a run: marks of what is held, offers, copies.
LOOK_EVERY = 0.25
#: Seconds between looks at the marks of items of jobs taken again mid-run, dropping what another shipped.
RETAKEN_LOOK_EVERY = 0.5
#: A copy of an item in flight elsewhere is sent only by a consumer this many times faster per request.
FASTER = 1.5
#: An item waiting unsent elsewhere is copied by an idle consumer at least this fast relative to its holder.
UNSENT_FASTER = 0.5
#: Items an offer lists at most (the youngest in flight and the unsent first).
MAX_OFFER = 512
#: Results the rate per request is measured over.
RATE_WINDOW = 64
COPIES = os.environ.get("GENQUEUE_TAIL_COPIES", "1") != "0"


class Rate:
    """Output tokens per second per request, over the last RATE_WINDOW results (0: none yet)."""

    def __init__(self) -> None:
        self._window: collections.deque[tuple[int, float]] = collections.deque(maxlen=RATE_WINDOW)

    def observe(self, tokens: int, seconds: float) -> None:
        if tokens > 0 and seconds > 0:
            self._window.append((tokens, seconds))

    @property
    def value(self) -> float:
        seconds = sum(s for _, s in self._window)
        return sum(t for t, _ in self._window) / seconds if seconds > 0 else 0.0


def choose(offers: list[Offer], me: str, my_rate: float, slots: int, exclude: set[str]) -> list[tuple[Offer, Flight]]:
    """Which offered items to copy here now (pure): unsent ones first, then those in flight on
    an engine FASTER times slower than this one, the youngest first; at most SLOTS."""
    if slots <= 0 or my_rate <= 0:
        return []
    unsent: list[tuple[Offer, Flight]] = []
    flying: list[tuple[float, Offer, Flight]] = []
    for o in offers:
        if o.worker == me or o.rate <= 0:
            continue
        for f in o.flights:
            if f.key in exclude:
                continue
            if f.age is None:
                if my_rate >= UNSENT_FASTER * o.rate:
                    unsent.append((o, f))
            elif my_rate >= FASTER * o.rate:
                flying.append((f.age, o, f))
    flying.sort(key=lambda c: c[0])
    return (unsent + [(o, f) for _, o, f in flying])[:slots]


class Copier:
    """The end-of-run copies' loop (module docstring)."""

    def __init__(self, rq: RqThread, conn: redis.Redis, worker: str, dispatcher: Dispatcher, *,
                 contexts: Callable[[], dict[str, RunContext]], tail_runs: Callable[[], list[str]],
                 stopped: Callable[[], set[str]], clock: Callable[[], float] = time.time,
                 read_reference: Callable[[str, PackRef], Awaitable[list[object]]] | None = None,
                 hungry: HungryLook | None = None, book: Book[Held] | None = None) -> None:
        self.rq = rq
        # the book of held jobs: its jobs taken again, and its waiting items others copy (None: neither looked at)
        self.book = book
        # the calls for work of other consumers: the intake's look, so both read Redis as one
        self._hungry = hungry if hungry is not None else HungryLook(conn, worker)
        # the items of a job by reference: the intake's pack reader; None copies none of them
        self._read_reference = read_reference
        self.conn = conn
        self.worker = worker
        self.dispatcher = dispatcher
        self._contexts = contexts
        self._tail_runs = tail_runs
        self._stopped = stopped  # the runs paused or gone from Redis
        # Redis's clock as this node reads it (rqcompat's RedisClock): offers are stamped and
        # judged by it, so nodes whose clocks differ by more than OFFER_TTL still see each other's
        self._clock = clock
        self.rate = Rate()
        self._offered: set[str] = set()
        self.copies_sent = 0
        self._retaken_looked = 0.0  # time.monotonic() of the last look at the marks of jobs taken again

    def recorded(self, run: str, rec: Record) -> None:
        """A record of RUN written here (the `recorded` event): its tokens and latency feed the rate
        per request."""
        if is_error(rec):
            return
        usage, timings = rec.get("usage"), rec.get("timings")
        if isinstance(usage, dict) and isinstance(timings, dict):
            self.rate.observe(int(usage.get("completion_tokens", 0) or 0), float(timings.get("latency_s", 0) or 0))

    async def run(self) -> None:
        failing: str | None = None
        while True:
            await asyncio.sleep(LOOK_EVERY)
            try:
                await self.look()
                failing = None
            except redis.exceptions.ResponseError as e:
                # Odd content under a run's keys (a key of another type, written by hand): copies
                # stop until it is gone, while every original goes on; said once, and when it clears.
                if failing != str(e):
                    log.warning("end-of-run copies paused: Redis answered %s (%s); the items held go on as usual",
                                type(e).__name__, e)
                failing = str(e)

    async def look(self) -> None:
        # A run paused (the breaker, `producer pause`) or gone from Redis gets no copies, and those
        # running here are cut: its own items went back to the queue, or have nowhere to go.
        stopped = self._stopped()
        if stopped and (n := self.dispatcher.cut_copies(stopped)):
            log.info("%d copies cut: their run is paused or gone (%s)", n, ", ".join(sorted(stopped)))
        tail = set(self._tail_runs()) - stopped
        # A run whose queue this consumer has not seen empty (it holds enough to not ask) is at its
        # end all the same when another consumer calls for work of it (common/keepers/hungry.py).
        for run in sorted(set(self.dispatcher.held_runs()) - tail - stopped):
            if await self.rq.call(self._hungry.other_caller, run) is not None:
                tail.add(run)
        for run in sorted(self._offered - tail):  # no longer at its end here: withdraw the offer
            await self.rq.call(Flights(self.conn, run).offer, self.worker, 0.0, [])
            self._offered.discard(run)
        book = self.book
        retaken: set[str] = set()
        now = time.monotonic()
        if book is not None and now - self._retaken_looked >= RETAKEN_LOOK_EVERY:
            # A job taken again mid-run holds items its last holder may have made: their results
            # may ship now (a consumer that stood still goes on, a restart on its spool), and what
            # waits of them here is dropped then, not made twice.
            self._retaken_looked = now
            retaken = book.retaken_runs()
        # items set aside here for copies elsewhere: done when a copy ships, back if none does
        aside = book.aside_runs() if book is not None else set()
        for run in sorted((retaken | aside) - tail - stopped):  # the marks of each run read once a look
            await self._ended_elsewhere(run)
            if run in aside:
                await self._yield_claimed(run)
        contexts = self._contexts()
        for run in sorted(tail):
            ctx = contexts.get(run)
            if ctx is None:
                continue
            await self._ended_elsewhere(run)
            await self._yield_claimed(run)
            await self._offer(run)
            if COPIES and self.dispatcher.copy_slots() > 0:
                await self._copy(ctx)
        await self._give_back()

    async def _give_back(self) -> None:
        """Give back the claims of the copies that ended here without a result (an error, cut
        to make room, a pause), so another consumer may copy those items."""
        q = self.dispatcher.unclaimed
        while q:
            run, key = q[0]
            try:
                await self.rq.call(Flights(self.conn, run).release, key, self.worker)
            except redis.exceptions.ResponseError:
                q.popleft()  # odd content under the claims' key: not tried again (claims expire)
                raise
            q.popleft()  # only once given back: a lost connection leaves it for the next look

    async def _ended_elsewhere(self, run: str) -> None:
        keys = self.dispatcher.held_keys(run)
        if not keys:
            return
        done = await self.rq.call(Marks(self.conn, run).done_of, keys)
        if done:
            n = await self.dispatcher.done_elsewhere(run, done)
            if n:
                log.info("run %s: %d item(s) held here already have a result shipped; ended here", run, n)

    async def _yield_claimed(self, run: str) -> None:
        """The items of RUN waiting here that another consumer copies (its claim) are set aside
        while it does, so they are made once (a copy of an item that waits is its transfer); those
        whose copy ended without a result (its claim given back, or its consumer gone) wait here
        again."""
        book = self.book
        if book is None or (not book.pending_of(run) and not book.aside_keys(run)):
            return
        claimed = await self.rq.call(Flights(self.conn, run).claimed_by_others, self.worker)
        aside, back = book.set_aside(run, claimed), book.put_back(run, claimed)
        if back:
            self.dispatcher.wake.set()
        if aside or back:
            log.debug("run %s: %d item(s) waiting here set aside for their copies elsewhere, %d back", run, aside,
                      back)

    async def _offer(self, run: str) -> None:
        held = self.dispatcher.held_items(run)
        if not held and run not in self._offered:
            return
        # the items waiting here offered from the last to go: a copy of one about to be sent here
        # would make it twice (those copied are set aside here at the next look, _yield_claimed)
        unsent = [f for f in held if f.age is None][::-1]
        flying = sorted((f for f in held if f.age is not None), key=lambda f: f.age or 0.0)
        await self.rq.call(Flights(self.conn, run).offer, self.worker, self.rate.value, (unsent + flying)[:MAX_OFFER],
                           now=self._clock())
        if held:
            self._offered.add(run)
        else:
            self._offered.discard(run)

    async def _copy(self, ctx: RunContext) -> None:
        run = ctx.run
        offers = await self.rq.call(Flights(self.conn, run).offers, now=self._clock())
        failed_here = {key for (r, key) in self.dispatcher.copies_failed if r == run}
        picks = choose(offers, self.worker, self.rate.value, self.dispatcher.copy_slots(),
                       set(self.dispatcher.held_keys(run)) | failed_here)
        payloads: dict[str, list[Item] | None] = {}
        sent = 0
        for offer, f in picks:
            if f.job_id not in payloads:
                payloads[f.job_id] = await self._items_of(run, f.job_id)
            item = next((it for it in payloads[f.job_id] or [] if it["key"] == f.key), None)
            if item is None or not copyable(ctx, item):
                continue
            if not await self.rq.call(Flights(self.conn, run).claim, f.key, self.worker):
                continue
            if not self.dispatcher.start_copy(ctx, item):
                await self.rq.call(Flights(self.conn, run).release, f.key, self.worker)
                break
            sent += 1
            log.debug("run %s: copy of item %s sent (held by %s, %s)", run, f.key, offer.worker,
                      "unsent" if f.age is None else f"in flight {f.age:.1f} s at {offer.rate:.0f} tokens/s")
        if sent:
            self.copies_sent += sent
            log.info("run %s: its queue is empty and this engine has slots free: %d copies of items other "
                     "consumers hold sent (first result shipped wins)", run, sent)

    async def _items_of(self, run: str, job_id: str) -> list[Item] | None:
        payload = await self.rq.call(job_payload, self.conn, job_id)
        if payload is None:
            return None
        args, kwargs, meta = payload
        try:
            ref = job_reference(args, kwargs, meta)
            if ref is None:
                return parse_items(args, kwargs)
            if self._read_reference is None:
                return None
            return parse_items([await self._read_reference(run, ref)], None)
        except (ValueError, PackUnreadable, StoreError) as e:  # not copied: its holder answers it
            log.debug("run %s: job %s not copied (%s: %s)", run, job_id, type(e).__name__, e)
            return None

    def counts(self) -> dict[str, int]:
        """Since start: copies sent here of items other consumers held; of them, results written
        (shipped), errors (dropped, nothing written) and those cut to free a slot for an item
        held here (yielded); items held here that a result shipped elsewhere ended (cut in
        flight, or dropped while waiting)."""
        d = self.dispatcher
        return {"sent": self.copies_sent, "shipped": d.copies_shipped, "dropped": d.copies_lost,
                "yielded": d.copies_yielded, "ended_elsewhere": d.cancelled_won}


def copyable(ctx: RunContext, item: Item) -> bool:
    """Whether a copy of ITEM may run beside its original (module docstring: not a conversation
    regenerated turn by turn)."""
    if ctx.settings.multi_turn != Mode.REGENERATE:
        return True
    users: int = sum(m["role"] == "user" for m in item["messages"])
    return users <= 1


def copies_clause(counts: dict[str, int]) -> str:
    """The end line's account of the end-of-run copies (Copier.counts); '' when there were none."""
    if not (counts.get("sent") or counts.get("ended_elsewhere")):
        return ""
    return (f", copies: {counts.get('sent', 0)} sent for others ({counts.get('shipped', 0)} written), "
            f"{counts.get('ended_elsewhere', 0)} of ours ended by others")
