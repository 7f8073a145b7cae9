"""What `producer enqueue` knows of a run's items beyond its item table: the reconcile.

Re-running `producer enqueue` on a run enqueues exactly the items of its input that have no
shipped result and are not queued, held or scheduled in rq. An item in the run (its item table)
and not DONE is looked up in a view of the queue (QueueView), taken once, under the run's lock:
  live       the items of every live job (queued, started, scheduled, deferred, ...), from the
             jobs' payloads (by reference: their packs), and of other producers' claim sets
             younger than CLAIM_GRACE (about to be enqueued);
  failed     the items of the jobs in rq's failed registry, as FAILED as an error record;
  taken over claim sets older than CLAIM_GRACE (their producer died between claim and enqueue:
             jobwriter.py): deleted, their items queued again like any lost item.
The view stays true while the lock is held: new items are claimed only while no other producer
holds it (the claim script refuses), so an item in no live job and no claim set can get into
one only through this producer.

`same_input` and `items_in_run` let a re-run skip an input that cannot change anything
(unchanged.py). `other_input` refuses, before it is read, an input that is not a file the run
was made from (each source keeps the digest of its first records: `input_head`): an export
written over the input, read back, would grow the run and leave its failed items out of reach.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson
import redis

from genqueue.common.errors import UserError
from genqueue.common.keepers.claims import CLAIM_GRACE, Claims
from genqueue.common.keepers.items import DONE, FAILED, IN_RUN, ItemTable
from genqueue.common.keepers.marks import Marks
from genqueue.common.keepers.packs import PackTable
from genqueue.common.keepers.rqaccess import LIVE_PLACES, JobPlace
from genqueue.common.keepers.rqjobs import ItemsOf, JobScan, read_jobs, scan_jobs
from genqueue.common.keepers.runs import RunStore
from genqueue.producer.ingest.reader import RawRecord

log = logging.getLogger(__name__)

# The item state bits are the mark store's (common/keepers/marks.py); named here too for settle.py.
__all__ = ["DONE", "FAILED", "IN_RUN", "QueueView", "add_to_run", "as_int", "derivation", "input_digest",
           "input_head", "other_input", "take_view", "unchanged_input"]

#: Records of an input's head whose digest a run keeps: a retry whose file does not begin with them is refused.
HEAD_RECORDS = 64

def add_to_run(conn: redis.Redis, run: str, digests: list[bytes]) -> None:
    """Put items that have marks but are not in the run into it (marks shipped by
    consumers after a Redis loss, before this producer read their records)."""
    RunStore(conn).add_keys(run, digests)


def as_int(item_key: str) -> int:
    """An item key (32 hex) as the int the views hold (about half the memory of a str)."""
    return int(item_key, 16)


@dataclass(slots=True)
class QueueView:
    """The run's queue as seen once under its lock (module docstring)."""

    live: set[int] = field(default_factory=set)
    failed: set[int] = field(default_factory=set)
    live_jobs: int = 0
    failed_jobs: int = 0
    held_claims: int = 0
    held_items: int = 0  # in the held claims: in no job until their producer's transaction
    held_oldest_s: int = 0  # the oldest held claim's age
    taken_over_claims: int = 0
    taken_over_items: int = 0
    seconds: float = 0.0
    #: Entries of the queue and registries that are no usable job (rqjobs.BadJob dicts): skipped.
    malformed_jobs: list[dict[str, str]] = field(default_factory=list)


def take_view(conn: redis.Redis, run: str, own_prefix: str, *, grace: float = CLAIM_GRACE,
              items_of: ItemsOf | None = None) -> QueueView:
    """The view of RUN's queue. Call it holding the run's lock. Claim sets whose id starts with
    OWN_PREFIX are this producer's own (all of them ended in their transaction). ITEMS_OF reads
    the items of jobs by reference from their packs (producer/packitems.py); without it, a run
    with such jobs is refused (UserError): the view would take them for lost and queue their
    items twice."""
    if items_of is None and PackTable(conn, run).count():
        raise UserError(f"run {run} has jobs by reference (`--prompts reference`), whose items this reader cannot "
                        "read: nothing more was queued")
    t0 = time.perf_counter()
    view = QueueView()
    claims = Claims(conn)
    for claim in claims.others(run, own_prefix):
        if claim.age > grace:
            n = claims.take_over(claim)
            if n is not None:
                view.taken_over_claims += 1
                view.taken_over_items += n
                log.warning("run %s: took over claim %s of %d items, left by a producer that stopped between "
                            "claiming them and enqueueing them %.0f s ago; they are queued again",
                            run, claim.id, n, claim.age)
            continue
        held = claims.members(claim)
        view.held_claims += 1
        view.held_items += len(held)
        view.held_oldest_s = max(view.held_oldest_s, claim.age)
        view.live.update(int.from_bytes(d, "big") for d in held)
    scan = JobScan()
    for job in read_jobs(conn, run, [*LIVE_PLACES, JobPlace.FAILED], scan=scan, items_of=items_of):
        into = view.failed if job.place is JobPlace.FAILED else view.live
        into.update(as_int(it["key"]) for it in job.items)
        if job.place is JobPlace.FAILED:
            view.failed_jobs += 1
        else:
            view.live_jobs += 1
    # the places rq no longer runs from: what rq needs to load them, so the summary names them all
    scan_jobs(conn, run, [JobPlace.FINISHED, JobPlace.CANCELED], scan=scan)
    view.malformed_jobs = scan.to_list()
    view.seconds = time.perf_counter() - t0
    log.info("run %s: %d live jobs (%d items), %d failed jobs, %d claims held by other producers, read in %.2f s",
             run, view.live_jobs, len(view.live), view.failed_jobs, view.held_claims, view.seconds)
    return view


# --- nothing to do: an input that need not be read ----------------------------------------
def input_digest(path: str) -> str | None:
    """A digest of the input file's bytes (None for stdin or anything not a regular file)."""
    if path == "-" or not os.path.isfile(path):
        return None
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as fh:
        while block := fh.read(1 << 20):
            h.update(block)
    return f"{os.path.getsize(path)}:{h.hexdigest()}"


def _head_digest(head: Sequence[RawRecord], n: int) -> str:
    """A digest of the first N records of HEAD by their values (keys sorted: the same records
    written again by another tool are the same), or by their reason and first bytes when unread."""
    h = hashlib.blake2b(digest_size=16)
    for rec in head[:n]:
        if rec.error is None:
            try:
                h.update(orjson.dumps(rec.value, option=orjson.OPT_SORT_KEYS, default=str))
            except TypeError:  # a value orjson cannot write (an integer past 64 bits): its repr
                h.update(repr(rec.value).encode())
        else:
            h.update(rec.error.value.encode() + b"\0" + rec.snippet)
        h.update(b"\n")
    return h.hexdigest()


def input_head(head: Sequence[RawRecord]) -> dict[str, Any]:
    """What the run keeps of an input's first records (HEAD: those read ahead), to know the file
    again: how many (at most HEAD_RECORDS) and their digest."""
    n = min(len(head), HEAD_RECORDS)
    return {"records": n, "digest": _head_digest(head, n)}


def _begins_with(head: Sequence[RawRecord], kept: object) -> bool | None:
    """HEAD begins with the records KEPT (an input_head) describes; None: KEPT is none."""
    if not isinstance(kept, Mapping) or not isinstance(kept.get("records"), int) or not kept.get("digest"):
        return None
    n = int(kept["records"])
    return len(head) >= n and _head_digest(head, n) == kept["digest"]


def other_input(path: str, source: str, head: Sequence[RawRecord], sources: Mapping[str, Mapping[str, Any]],
                run: str, *, retry_failed: bool) -> str | None:
    """Why the input PATH (SOURCE, its source id; HEAD, its first records) is not a file RUN was
    made from, in one line, or None when it is, or when the run cannot tell (stdin, a source
    recorded by an earlier genqueue, a run whose sources are not known). SOURCES: each source
    of the run with its summary. A source enqueued again must begin with the records the run
    read from it; with RETRY_FAILED, a file the run never read must be a copy of one it did."""
    if source == "-":
        return None
    mine = sources.get(source)
    if mine is not None:
        if _begins_with(head, mine.get("input_head")) is not False:
            return None
        n = int(mine["input_head"]["records"])
        return (f"{path} is not the input run {run} was made from: its first {n:,} records are not those the run "
                "read from this path (the file was replaced or rewritten since, by an export written over it?); "
                f"nothing was read or queued: put the run's input back at {source}, or enqueue this file into "
                "another run (--run NAME)")
    if not retry_failed or not sources:
        return None
    if any(_begins_with(head, s.get("input_head")) is not False for s in sources.values()):
        return None  # a copy (or a move) of one of the run's inputs, or one this genqueue cannot tell
    names = ", ".join(sorted(sources))
    return (f"--retry-failed queues again what failed of run {run}'s inputs, and {path} is none of them (the run "
            f"read {names}): nothing was read or queued; give the file the run was made from")


def derivation(fingerprint: str, max_record_bytes: int, origin: str) -> str:
    """A digest of everything that makes a record's items and rejects, besides its bytes: the
    run's settings, the reading limit, and how items are stamped and sampled (ORIGIN's repr)."""
    return hashlib.blake2b(f"{fingerprint}|{max_record_bytes}|{origin}".encode(), digest_size=16).hexdigest()


def same_input(conn: redis.Redis, run: str, source: str, digest: str | None,
               derived: str | None) -> dict[str, Any] | None:
    """The summary of SOURCE's last enqueue into RUN when that enqueue read the whole input, the
    input has the same DIGEST and is made into items the same way (DERIVED): every item of this
    input is in the run already, so reading it again can only find items that are not done and
    in no job (lost). Else None."""
    if digest is None:
        return None
    prev = RunStore(conn).source_summary(run, source)
    if (not isinstance(prev, dict) or not prev.get("complete") or prev.get("input_digest") != digest
            or prev.get("derivation") != derived):
        return None
    return prev


def unchanged_input(conn: redis.Redis, run: str, source: str, digest: str | None,
                    derived: str | None) -> dict[str, Any] | None:
    """The summary of SOURCE's last enqueue into RUN when reading the input again cannot change
    anything because every item of the run is done (same_input, and Marks.all_done). Else None."""
    prev = same_input(conn, run, source, digest, derived)
    return prev if prev is not None and Marks(conn, run).all_done() else None


@dataclass(slots=True)
class ItemsInRun:
    """The run's items as its item table and a queue view say, without the input: done; queued
    (in a live job or another producer's young claim); failed (an error record or a failed job,
    and not retried); lost (none of those: only the input can queue them again)."""

    done: int = 0
    queued: int = 0
    failed: int = 0
    lost: int = 0
    seconds: float = 0.0


def items_in_run(conn: redis.Redis, run: str, view: QueueView) -> ItemsInRun:
    """Every item of RUN (IN_RUN in its item table) sorted by the view, as the reconcile would
    sort it reading the input (settle.py): the table is read a range of buckets a round
    trip, memory holds the view only."""
    t0 = time.perf_counter()
    out = ItemsInRun()
    live, failed = view.live, view.failed
    for d, st in ItemTable(conn, run).each():
        if not st & IN_RUN:
            continue
        if st & DONE:
            out.done += 1
            continue
        k = int.from_bytes(d, "big")
        if k in live:
            out.queued += 1
        elif st & FAILED or k in failed:
            out.failed += 1
        else:
            out.lost += 1
    out.seconds = time.perf_counter() - t0
    return out
