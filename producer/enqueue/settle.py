"""Settle: what becomes of each converted item, a chunk of records at a time.

Each item is taken at most once per invocation (by a 64-bit prefix of its key), then sorted by
its state in the run's item table (one Redis round trip a chunk; none when the table was empty
as the invocation began): done (its record flagged DONE, and marked in the run if it was not);
new to the run (taken, to be queued); or in the run and not done, then looked up in the queue
view (reconcile.QueueView, taken once, under the run's lock, when first needed): in a live job
or another producer's young claim (QUEUED), failed (FAILED, or taken to be retried with
--retry-failed), or lost (taken, to be queued again). A dry run takes every item as new.

Items taken go to the slices (slices.py) in input order, or, longest first, to the order
(order.py): each record's items as one group, at the sum of their costs, written from the
costliest down once the input is read (`drain`).
"""

from __future__ import annotations

from genqueue.common.contracts import Item
from genqueue.common.keepers.marks import Marks
from genqueue.common.keepers.runs import key_digest
from genqueue.producer.enqueue.jobwriter import JobWriter
from genqueue.producer.enqueue.order import LongestFirst
from genqueue.producer.enqueue.reconcile import DONE, FAILED, IN_RUN, QueueView, add_to_run, as_int, take_view
from genqueue.producer.enqueue.slices import Slices
from genqueue.producer.enqueue.summary import Flag, Tally, view_summary
from genqueue.producer.packitems import PackItems


class Settler:
    """Settles RUN's items for one enqueue: writes through WRITER (None: a dry run) via SLICES,
    flags in TALLY. OUTPUT: the run's output (jobs by reference are read from their packs).
    VIEW: a queue view taken already, under the run's lock, which is held since."""

    def __init__(self, run: str, output: str, writer: JobWriter | None, slices: Slices, tally: Tally, *,
                 order: LongestFirst | None, retry_failed: bool, view: QueueView | None = None) -> None:
        self.run = run
        self.output = output
        self.writer = writer
        self.slices = slices
        self.tally = tally
        self.order = order
        self.retry_failed = retry_failed
        self.view = view
        self.queue_view = view_summary(view) if view is not None else None
        # 64-bit prefixes of the item keys this invocation has yielded as new: ~60 bytes each
        # in memory, collision odds ~3e-8 at a million items.
        self._seen: set[int] = set()
        # Whether the run's item table was empty when this invocation began (read once, before
        # its first claim; None until then): then no item state needs reading (settle).
        self._fresh: bool | None = None
        self._group: list[Item] = []  # longest first: the items taken of the record at hand

    def settle(self, chunk: list[tuple[int, list[Item]]], estimates: dict[str, int]) -> None:
        """Sort a chunk's items (one Redis round trip): done, new to the run, or in the run and
        not done (then the queue view says queued, failed or lost); take what is to be queued.
        ESTIMATES: the items' costs by key (longest first)."""
        flat = [(index, it) for index, items in chunk for it in items]
        if self.writer is None:
            for pos, (index, it) in enumerate(flat):
                self._take(index, it, None)
                self._close_group(flat, pos, estimates)
            return
        conn = self.writer.conn
        if self._fresh is None:  # before this invocation's first claim
            self._fresh = not any(Marks(conn, self.run).totals())
        # A run whose table held nothing when this invocation began holds only what it
        # claimed since (each once: _seen), or what a racing producer claimed (its claim
        # answers that): its states need no read, which is one Redis command an item.
        states = bytes(len(flat)) if self._fresh else Marks(conn, self.run).item_states(
            [key_digest(it["key"]) for _, it in flat])
        if self.view is None and any(st & (IN_RUN | DONE) == IN_RUN for st in states):
            self._take_view()
        flags = self.tally.flags
        orphans: list[bytes] = []
        for pos, ((index, it), st) in enumerate(zip(flat, states, strict=True)):
            if st & DONE:
                flags[index] |= Flag.DONE
                if not st & IN_RUN:
                    orphans.append(key_digest(it["key"]))
            elif not st & IN_RUN:
                self._take(index, it, None)
            else:
                assert self.view is not None
                k = as_int(it["key"])
                if k in self.view.live:
                    flags[index] |= Flag.QUEUED
                elif st & FAILED or k in self.view.failed:
                    if self.retry_failed:
                        self._take(index, it, Flag.RETRIED)
                    else:
                        flags[index] |= Flag.FAILED
                else:  # in the run, no result, no job: lost from rq, or an abandoned claim
                    self._take(index, it, Flag.NEW)
            self._close_group(flat, pos, estimates)
        add_to_run(conn, self.run, orphans)

    def drain(self) -> None:
        """Write what longest-first ordering held back, longest first; then the rest."""
        if self.order is not None:
            for items in self.order.longest_first():
                self.slices.extend(items)
                self.slices.write(final=False)
            self.order.close()
        self.slices.write(final=True)

    def _close_group(self, flat: list[tuple[int, Item]], pos: int, estimates: dict[str, int]) -> None:
        """Longest first: after a record's last item (FLAT[POS]), hand what was taken of it to
        the order as one group, at the sum of its items' costs (order.py)."""
        if self.order is None or not self._group:
            return
        if pos + 1 < len(flat) and flat[pos + 1][0] == flat[pos][0]:
            return
        self.order.add_group(self._group, sum(estimates.get(it["key"], 0) for it in self._group))
        self._group = []

    def _take(self, index: int, it: Item, requeue: int | None) -> None:
        """Put IT on the way to a job (new to the run: REQUEUE None), once per invocation."""
        h = int(it["key"][:16], 16)
        if h in self._seen:
            return
        self._seen.add(h)
        if requeue is not None:
            self.slices.requeue_as(it, requeue)
        if self.order is not None:
            self._group.append(it)  # a record's items go to the order together (_close_group)
        else:
            self.slices.add(it)

    def _take_view(self) -> None:
        assert self.writer is not None
        self.slices.settle_written()  # a claim in flight would wait on the lock taken below for ever
        self.writer.lock.acquire()
        items_of = PackItems(self.writer.conn, self.run, self.output).items_of  # jobs by reference: their packs
        self.view = take_view(self.writer.conn, self.run, self.writer.claim_prefix, items_of=items_of)
        self.queue_view = view_summary(self.view)
