"""The items of jobs rq gave up on, after pass 2: failed for good, each with its error record.

A job whose retries are spent (abandoned by consumer after consumer) has items that no shard may
hold: those are permanently failed, not missing. Each gets an errors-file line (in the format's
error shape) with rq's reason, of class pack_unreadable when a consumer could not read the job's
pack, else job_failed (rqjobs.failure_class, status's rule too). A job by reference whose pack
this export cannot read either has its items found by their places in the run's item table
(rqjobs.placed_keys), and is written with its pack and slot instead of its fields. With
--variant, an item of another variant (by its key's draw) is left out and counted apart.
`rq requeue` brings the jobs back; a later export sees them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import IO, TypedDict, cast

import orjson
import redis

from genqueue.common.contracts import Item
from genqueue.common.errors import JobItemsUnreadableError
from genqueue.common.keepers.exportsets import ScratchSet
from genqueue.common.keepers.items import ItemTable
from genqueue.common.keepers.packs import PackTable
from genqueue.common.keepers.rqaccess import JobPlace, PackRef
from genqueue.common.keepers.rqfailed import FailedJob, failed_jobs, failed_reason, failure_class, placed_keys
from genqueue.common.keepers.rqjobs import ItemsOf, JobScan, read_jobs
from genqueue.common.records import ErrorInfo, JobFailedRecord, error_info
from genqueue.common.variants import Variant, draw
from genqueue.producer.export.formats import error_converter
from genqueue.producer.export.plan import ExportPlan, ExportResult


class FailedJobs:
    """The failed jobs of RUN on CONN as PLAN's export writes them, counted in RESULT: their
    keys are added to SEEN, entries that are no usable job noted in SCAN. ITEMS_OF reads the
    items of jobs by reference (None: none)."""

    def __init__(self, conn: redis.Redis, run: str, plan: ExportPlan, result: ExportResult, seen: ScratchSet,
                 scan: JobScan, items_of: ItemsOf | None) -> None:
        self.conn = conn
        self.run = run
        self.result = result
        self.seen = seen
        self.scan = scan
        self.items_of = items_of
        self.variants, self.variant = plan.variants, plan.variant
        self.error_line = error_converter(plan.fmt, per_turn=plan.per_turn_ids)  # None: error records as read

    def write(self, errs: IO[bytes]) -> ItemsOf | None:
        """Write the failed items no shard holds to ERRS; the items_of coverage reads the jobs
        with next (a job whose pack does not read, its items found by place, reads as none)."""
        failed = {j.id: j for j in failed_jobs(self.conn, self.run)}
        by_ref = {j.ref: j for j in failed.values() if j.ref is not None}
        unread: dict[str, tuple[FailedJob, str]] = {}
        inner = self.items_of

        def items_of(ref: PackRef) -> list[Item]:
            assert inner is not None  # read_jobs calls it only when given
            try:
                return inner(ref)
            except JobItemsUnreadableError as e:
                job = by_ref.get(ref)
                if job is None:
                    raise
                unread[job.id] = (job, str(e))
                return []  # its items by their places, below

        for job in read_jobs(self.conn, self.run, [JobPlace.FAILED], scan=self.scan,
                             items_of=items_of if inner is not None else None):
            if job.id in unread:
                continue
            why = failed[job.id].reason if job.id in failed else failed_reason(self.conn, job.id)
            self._fail(errs, job.id, why, [(it["key"], it) for it in job.items])
        if not unread:
            return inner
        places = ItemTable(self.conn, self.run).placed_in({j.ref.pack for j, _ in unread.values() if j.ref})
        names = PackTable(self.conn, self.run).names()
        found: set[PackRef] = set()
        for fj, e in unread.values():
            assert fj.ref is not None  # by_ref holds jobs by reference only
            slots = places.get(fj.ref.pack, {})
            keys = placed_keys(self.run, fj, slots)
            if keys is None:  # as read_jobs notes it: its items stay missing
                self.scan.note(fj.id, JobPlace.FAILED,
                               f"a job by reference (pack {fj.ref.pack}, block {fj.ref.block}): {e}")
                continue
            found.add(fj.ref)
            slot_of = {d.hex(): n for n, d in slots.items()}
            pack = names.get(fj.ref.pack, str(fj.ref.pack))
            self._fail(errs, fj.id, fj.reason, [(k, (pack, slot_of[k])) for k in keys])
        if inner is not None and found:  # coverage reads the failed jobs again: these have no more to say
            return lambda ref: [] if ref in found else inner(ref)
        return inner

    def _fail(self, errs: IO[bytes], job_id: str, reason: str, items: list[tuple[str, Item | tuple[str, int]]]) -> None:
        """The ITEMS (key, and the item, or its pack and slot when its pack does not read) of
        the job JOB_ID that rq gave up on for REASON, those no shard holds: failed, each with
        its error record."""
        digests = [bytes.fromhex(k) for k, _ in items]
        present = self.seen.members(digests)
        lost = [(k, it) for (k, it), seen in zip(items, present, strict=True) if not seen]
        if self.variant is not None:  # no record says its variant: the key's draw does
            mine = {k: _drawn_name(k, self.variants) == self.variant for k, _ in lost}
            others = [bytes.fromhex(k) for k, ok in mine.items() if not ok]
            if others:
                self.seen.add(others)
                self.result.other_variants += len(others)
                lost = [(k, it) for k, it in lost if mine[k]]
        cls = failure_class(reason)
        error = error_info(cls, "rq", f"job {job_id} failed in rq: {reason}")
        for key, it in lost:
            rec = (_pack_failed(key, it, self.run, error) if isinstance(it, tuple) else
                   _job_failed(it, self.run, error))
            errs.write(orjson.dumps(rec if self.error_line is None else self.error_line(rec)) + b"\n")
        if lost:
            self.seen.add([bytes.fromhex(k) for k, _ in lost])
            self.result.failed += len(lost)
            self.result.failed_jobs += 1
            by = self.result.failed_by_class
            by[cls.value] = by.get(cls.value, 0) + len(lost)


class _Provenance(TypedDict, total=False):
    id: str
    source: str
    source_seq: int
    sample: int
    seed: int


def _job_failed(it: Item, run: str, error: ErrorInfo) -> JobFailedRecord:
    """The errors-file record of item IT of a job rq gave up on: its provenance in the item's
    own order, then its messages and the error."""
    prov: _Provenance = {}
    for name in it:
        match name:
            case "id":
                prov["id"] = it["id"]
            case "source":
                prov["source"] = it["source"]
            case "source_seq":
                prov["source_seq"] = it["source_seq"]
            case "sample":
                prov["sample"] = it["sample"]
            case "seed":
                prov["seed"] = it["seed"]
    rec = {"key": it["key"], "index": it["index"], "turn": it.get("turn"), "run": run, **prov,
           "messages": it["messages"], "error": error}
    return cast(JobFailedRecord, rec)


def _pack_failed(key: str, place: tuple[str, int], run: str, error: ErrorInfo) -> JobFailedRecord:
    """The errors-file record of the item KEY of a job whose pack does not read: its PLACE
    (pack name, slot) instead of its fields, which are in the pack."""
    return {"key": key, "run": run, "pack": place[0], "slot": place[1], "error": error}


def _drawn_name(key: str, variants: Sequence[Variant]) -> str | None:
    drawn = draw(key, variants)
    return None if drawn is None else drawn.name
