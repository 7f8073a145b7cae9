"""A re-run that need not read its input: the Summary a full reconcile would give, from Redis.

A re-run reads its input and asks Redis each item's state (one round trip per chunk of
records), and reads the queue view only when an item in the run is not done. When nothing can
need doing it reads no input at all: the input file is byte for byte the one of this source's
last complete enqueue (same digest), made into items the same way (settings, options:
reconcile.same_input), and either every item of the run is done (then every record that was not
rejected is already_done), or, under the run's lock, none of them is lost: every item that is
not done is queued (a live job, a young claim) or failed, as the queue view and the item table
say (reconcile.items_in_run), where each record is one item of the run (this source alone in the
run, no duplicates); each record is then counted by its item's state. The summary says
`input_unchanged`: the input's digest was read (a second or two per GB) instead of converting it.
"""

from __future__ import annotations

import logging
import uuid

import redis

from genqueue.common.keepers.marks import Marks
from genqueue.common.keepers.runlock import RunLock
from genqueue.common.keepers.runs import RunStore
from genqueue.producer.enqueue.reconcile import QueueView, items_in_run, same_input, take_view
from genqueue.producer.enqueue.summary import Summary, view_summary
from genqueue.producer.packitems import PackItems

log = logging.getLogger(__name__)


def settled_unread(conn: redis.Redis, run: str, summary: Summary, output: str,
                   lock: RunLock) -> tuple[bool, QueueView | None]:
    """Fill SUMMARY as a full reconcile would when its input need not be read, and say whether
    it did (module docstring; the jobs by reference read from their packs in OUTPUT). An item
    lost needs the input: then the input is read, and the view taken here is returned with the
    LOCK still held (the view stays true while it is held, and it may have taken over claims),
    for the reconcile to use instead of taking another."""
    prev = same_input(conn, run, summary.source, summary.input_digest, summary.derivation)
    if prev is None:
        return False, None
    if not Marks(conn, run).all_done():
        # The records are accounted for by their items' states only where an item is a record:
        # this source alone in the run, and its last read counted as many items as records
        # kept (no duplicates); else the input is read.
        kept = int(prev["records"]) - int(prev["rejected"])
        if set(RunStore(conn).sources(run)) != {summary.source} or int(prev.get("duplicates", 0)):
            return False, None
        lock.acquire()
        view = take_view(conn, run, uuid.uuid4().hex, items_of=PackItems(conn, run, output).items_of)
        counted = items_in_run(conn, run, view)
        if counted.lost or counted.done + counted.queued + counted.failed != kept:
            if counted.lost:
                log.info("run %s: %d items are in the run, not done and in no job: the input is read to queue them "
                         "again", run, counted.lost)
            return False, view
        lock.release()
        summary.queue_view = view_summary(view)
        summary.items_in_run = {"done": counted.done, "queued": counted.queued, "failed": counted.failed,
                                "seconds": round(counted.seconds, 3)}
    summary.records = int(prev["records"])
    summary.rejected = int(prev["rejected"])
    summary.rejected_by_reason = dict(prev["rejected_by_reason"])
    for k in ("user_turns", "multi_turn_records", "stopped_at_tool_turn"):
        setattr(summary, k, int(prev.get(k, 0)))
    est = prev.get("estimated_output_tokens")
    summary.estimated_output_tokens = est if isinstance(est, int) else None
    summary.already_enqueued = summary.records - summary.rejected
    if summary.items_in_run is None:  # every item done: so is every record's
        summary.already_done = summary.already_enqueued
    else:  # an item a record (above)
        summary.already_done = int(summary.items_in_run["done"])
        summary.already_queued = int(summary.items_in_run["queued"])
        summary.already_failed = int(summary.items_in_run["failed"])
    summary.input_unchanged = summary.complete = True
    return True, None
