"""The jobs of a run that rq gave up on (its failed registry), as export and status count them.

A failed job's items that no shipped shard holds are failed, not missing: `failed_jobs` reads
each job's reason (the last line of rq's failure), its item count and its pack reference from
its meta and last result, a batch of jobs a round trip and no payload moved, so every status
poll can afford it; `failure_class` names the items' error class by the reason. A job by
reference whose pack cannot be read has its items found by their places in the run's item table
(`placed_keys`). An id whose hash rq expired is left out (rqjobs.py EXPIRED_WHY).
"""

from __future__ import annotations

from dataclasses import dataclass

import orjson
import redis
from rq.job import Job
from rq.results import Result

from genqueue.common.contracts import ErrorClass
from genqueue.common.keepers.rqaccess import (
    META_ITEMS,
    META_PACK,
    REASON_CHARS,
    SERIALIZER,
    JobPlace,
    PackRef,
    job_failure,
    job_id,
    job_reference,
    place_members,
)
from genqueue.common.keepers.rqjobs import FETCH_BATCH


def failed_reason(conn: redis.Redis, job_id: str) -> str:
    """Why rq gave up on the job JOB_ID, its last line (rq keeps whole tracebacks); a result
    stream that cannot be read says so instead."""
    try:
        text = job_failure(Job(job_id, connection=conn, serializer=SERIALIZER)) or "failed in rq"
    except Exception as e:  # noqa: BLE001 - a garbage result stream must not hide the job's items
        text = f"failed in rq (its result is unreadable: {type(e).__name__})"
    lines = text.strip().splitlines() or ["failed in rq"]
    return lines[-1][:REASON_CHARS]


@dataclass(frozen=True, slots=True)
class FailedJob:
    """A job of the run that rq gave up on, as its failed registry, meta and last result say."""

    id: str
    reason: str  # the last line of rq's failure (failed_reason's)
    items: int  # the items its meta counts (0: its meta does not say)
    ref: PackRef | None  # a job by reference: its pack and block

    @property
    def cls(self) -> ErrorClass:
        return failure_class(self.reason)


def failure_class(reason: str) -> ErrorClass:
    """The error class of the items of a job rq gave up on for REASON (its failed_reason):
    pack_unreadable when a consumer could not read the job's pack, else job_failed."""
    return ErrorClass.PACK_UNREADABLE if reason.startswith(ErrorClass.PACK_UNREADABLE.value) else ErrorClass.JOB_FAILED


def failed_jobs(conn: redis.Redis, run: str) -> list[FailedJob]:
    """RUN's jobs in rq's failed registry, each with why rq gave up on it, its item count and its
    reference: meta and last result read a batch of jobs a round trip, no payload moved (cheap
    enough for every status poll). An id whose hash rq expired is left out (EXPIRED_WHY)."""
    ((_, members),) = place_members(conn, run, [JobPlace.FAILED])
    ids = [m.decode(errors="replace") if isinstance(m, bytes) else str(m) for m in members]
    out: list[FailedJob] = []
    for start in range(0, len(ids), FETCH_BATCH):
        batch = ids[start:start + FETCH_BATCH]
        with conn.pipeline(transaction=False) as p:
            for jid in batch:
                p.exists(Job.key_for(jid))
                p.hget(Job.key_for(jid), "meta")
                p.xrevrange(str(Result.get_key(jid)), "+", "-", count=1)  # type: ignore[no-untyped-call]  # rq's key
            got = p.execute(raise_on_error=False)
        for jid, there, meta, last in zip(batch, got[::3], got[1::3], got[2::3], strict=True):
            if there == 1:
                out.append(_failed_job(conn, jid, meta, last))
    return out


def _failed_job(conn: redis.Redis, jid: str, raw_meta: object, last: object) -> FailedJob:
    try:
        meta = orjson.loads(raw_meta) if isinstance(raw_meta, bytes) else {}
        ref = job_reference([], {}, meta) if isinstance(meta, dict) and META_PACK in meta else None
    except (orjson.JSONDecodeError, ValueError):
        meta, ref = {}, None
    n = meta.get(META_ITEMS) if isinstance(meta, dict) else None
    text = "failed in rq"
    if isinstance(last, list) and last:
        try:
            result_id, payload = last[0]
            res = Result.restore(jid, result_id.decode(), payload, connection=conn, serializer=SERIALIZER)
            text = res.exc_string or text
        except Exception as e:  # noqa: BLE001 - a garbage result stream must not hide the job
            text = f"failed in rq (its result is unreadable: {type(e).__name__})"
    lines = text.strip().splitlines() or ["failed in rq"]
    count = n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else 0
    return FailedJob(jid, lines[-1][:REASON_CHARS], count, ref)


def placed_keys(run: str, job: FailedJob, slots: dict[int, bytes]) -> list[str] | None:
    """The item keys of JOB, a job by reference whose pack cannot be read, from SLOTS (its pack's
    items by slot, ItemTable.placed_in): the pack holds its blocks' items one after another in
    slot order, so the job's are the run of JOB.items slots whose keys make its id (job_id). The
    start where every earlier block is as long as this one is tried first. None: no run makes it
    (its items were placed elsewhere since)."""
    keys = [slots[n].hex() for n in sorted(slots)]
    n = job.items
    if job.ref is None or not n or n > len(keys):
        return None
    aligned = job.ref.block * n
    for start in [aligned, *(i for i in range(len(keys) - n + 1) if i != aligned)]:
        window = keys[start:start + n]
        if len(window) == n and job_id(run, window) == job.id:
            return window
    return None
