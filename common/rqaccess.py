"""Everything genqueue reads or writes through rq, outside the consumer's worker.

The job contract: a job carries a JSON payload (rq's JSONSerializer; never a pickle): one
positional argument, the list of items. Its function name is `TASK`; a consumer refuses any
job naming anything else. Queues, job ids and descriptions, the payload's compression, and
every read of rq's keys that the producer, status, export and tools make live here, built
from rq's own key templates: a key spelled in four modules drifts. (The worker subclass and
its internals stay in consumer/rqcompat.py.)
"""

from __future__ import annotations

import hashlib
import logging
import zlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypedDict

import orjson
import redis
import rq.job
from rq import Queue
from rq.executions import WORKER_EXECUTIONS_KEY_TEMPLATE, ExecutionRegistry
from rq.intermediate_queue import IntermediateQueue
from rq.job import Job
from rq.registry import (
    DeferredJobRegistry,
    FailedJobRegistry,
    FinishedJobRegistry,
    ReadyJobRegistry,
    ScheduledJobRegistry,
    StartedJobRegistry,
)
from rq.results import Result
from rq.serializers import JSONSerializer
from rq.utils import utcparse

from genqueue.common.contracts import Item

log = logging.getLogger(__name__)

#: The only function a genqueue job may name.
TASK = "genqueue.consumer.task.generate"
#: The name jobs enqueued before genqueue moved under one import namespace carry; still run.
LEGACY_TASKS = frozenset({"consumer.task.generate"})
TASKS = frozenset({TASK}) | LEGACY_TASKS

SERIALIZER = JSONSerializer

#: Failed-job reasons longer than this are cut (rq keeps whole tracebacks).
REASON_CHARS = 500
_FETCH_BATCH = 500


# --- queues and jobs ---------------------------------------------------------------------
def queue_name(run: str) -> str:
    """The rq queue of a run (rq's key: rq:queue:genqueue.<run>)."""
    return f"genqueue.{run}"


def queue_for(run: str, conn: redis.Redis) -> Queue:
    return Queue(queue_name(run), connection=conn, serializer=SERIALIZER)


def job_id(run: str, item_keys: list[str]) -> str:
    """A deterministic job id from the item keys it carries, unique within the run."""
    h = hashlib.blake2b(digest_size=10)
    h.update(run.encode())
    for k in item_keys:
        h.update(k.encode())
    return f"gq-{h.hexdigest()}"


def job_description(run: str, items: Sequence[Mapping[str, Any]]) -> str:
    # rq's default description repeats every argument; with prompts inside that would double
    # the job's size in Redis.
    first = items[0]["index"] if items else "-"
    return f"genqueue run={run} items={len(items)} first_index={first}"


def job_items(job_args: Any) -> list[Item]:
    """The items a job carries, from its positional arguments."""
    if not isinstance(job_args, list | tuple) or len(job_args) != 1 or not isinstance(job_args[0], list):
        raise ValueError("job arguments are not a list of items")
    items: list[Item] = job_args[0]
    return items


class _FastZlib:
    """zlib with level 1 compression: rq compresses every job's payload at level 6, which was
    a quarter of the producer's time at a million records; level 1 is ~4x faster and
    still shrinks prompt text about 2.5x. Decompression is unchanged, so every rq reader
    (consumers, `rq info`, rq-dashboard) reads these jobs as usual."""

    error = zlib.error
    decompress = staticmethod(zlib.decompress)

    @staticmethod
    def compress(data: bytes, level: int = 1) -> bytes:
        return zlib.compress(data, 1)


def use_fast_job_compression() -> None:
    """Compress job payloads at zlib level 1 in this process (the producer calls it before
    enqueueing; see _FastZlib for the measured reason). rq's Job serialises through the zlib
    module it imported, and offers no setting for the level: this swaps that module."""
    rq.job.zlib = _FastZlib  # type: ignore[attr-defined,assignment]


# --- results of finished and failed jobs -------------------------------------------------
def job_result(job: Job) -> Any:
    """The manifest a finished job returned (for tests and status)."""
    res = Result.fetch_latest(job, serializer=SERIALIZER)
    return res.return_value if res else None


def job_failure(job: Job) -> str | None:
    """Why a failed job failed, as rq recorded it."""
    res = Result.fetch_latest(job, serializer=SERIALIZER)
    return res.exc_string if res else None


@dataclass(frozen=True, slots=True)
class FailedJob:
    """A genqueue job in rq's failed registry: its items and rq's reason, in one line."""

    id: str
    items: list[Item]
    reason: str


def failed_jobs(conn: redis.Redis, run: str) -> Iterator[FailedJob]:
    """Every genqueue job of RUN that rq gave up on (its retries spent). Foreign jobs (another
    function, a pickle) and jobs whose hash expired are skipped: they carry no items of ours."""
    ids = [_text(m) for m in conn.zrange(FailedJobRegistry.key_template.format(queue_name(run)), 0, -1)]
    for job, items in _our_jobs(conn, ids):
        reason = (job_failure(job) or "failed in rq").strip().splitlines() or ["failed in rq"]
        yield FailedJob(job.id, items, reason[-1][:REASON_CHARS])


def _our_jobs(conn: redis.Redis, ids: list[str]) -> Iterator[tuple[Job, list[Item]]]:
    """The genqueue jobs among IDS with their items, fetched in batches. Foreign jobs (another
    function, a pickle, garbage) and jobs whose hash expired are skipped: no items of ours."""
    for start in range(0, len(ids), _FETCH_BATCH):
        for job in Job.fetch_many(ids[start:start + _FETCH_BATCH], connection=conn, serializer=SERIALIZER):
            if job is None:
                continue
            try:
                if job.func_name not in TASKS:
                    continue
                items = job_items(job.args)
            except Exception as e:  # noqa: BLE001 - undecodable (a pickle, garbage): not ours
                log.debug("job %s skipped: not a genqueue job (%s)", job.id, type(e).__name__)
                continue
            yield job, items


def run_job_items(conn: redis.Redis, run: str) -> Iterator[list[Item]]:
    """The items of every genqueue job of RUN that rq still holds: queued, being dequeued,
    started, failed, deferred, scheduled, then finished (until its hash expires). Read in
    batches; foreign or undecodable jobs are skipped. For the export's missing file."""
    q = queue_for(run, conn)
    lists = [q.key, q.intermediate_queue_key]
    registries = [q.started_job_registry, q.failed_job_registry, q.deferred_job_registry,
                  q.scheduled_job_registry, q.finished_job_registry]
    seen: set[str] = set()
    for key in lists + [reg.key for reg in registries]:
        if key in lists:
            ids = [_text(x) for x in conn.lrange(key, 0, -1)]
        else:  # the started registry holds "<job id>:<execution id>"
            ids = [_text(m).rsplit(":", 1)[0] if key == q.started_job_registry.key else _text(m)
                   for m in conn.zrange(key, 0, -1)]
        ids = [i for i in ids if i not in seen]
        seen.update(ids)
        for _job, items in _our_jobs(conn, ids):
            yield items


# --- raw reads for status and tools ------------------------------------------------------
class JobCounts(TypedDict):
    """How many of a run's jobs are in each of rq's places (executions, for `started`)."""

    queued: int
    dequeuing: int
    started: int
    finished: int
    failed: int


def job_counts(conn: redis.Redis, run: str) -> JobCounts:
    """Raw LLEN/ZCARD counts, one round trip. Not rq's `registry.count`: that also cleans the
    registry up (re-queueing or failing expired jobs) outside the maintenance lock the
    consumers' sweeps hold, which a read must never do."""
    name = queue_name(run)
    queue_key = Queue.redis_queue_namespace_prefix + name
    with conn.pipeline(transaction=False) as p:
        p.llen(queue_key)
        p.llen(IntermediateQueue.get_intermediate_queue_key(queue_key))
        p.zcard(StartedJobRegistry.key_template.format(name))
        p.zcard(FinishedJobRegistry.key_template.format(name))
        p.zcard(FailedJobRegistry.key_template.format(name))
        queued, dequeuing, started, finished, failed = (int(n) for n in p.execute())
    return {"queued": queued, "dequeuing": dequeuing, "started": started, "finished": finished, "failed": failed}


def started_executions(conn: redis.Redis, run: str) -> set[str]:
    """The `<job id>:<execution id>` entries of RUN's started registry (the leases held now)."""
    return {_text(m) for m in conn.zrange(StartedJobRegistry.key_template.format(queue_name(run)), 0, -1)}


def worker_executions(conn: redis.Redis, worker: str) -> set[str]:
    """The `<job id>:<execution id>` entries the rq worker named WORKER holds."""
    return {_text(m) for m in conn.smembers(WORKER_EXECUTIONS_KEY_TEMPLATE.format(worker))}


def job_status(conn: redis.Redis, job_id: str) -> str:
    """A job's status as stored (`queued`, `started`, `finished`, `failed`...), or `gone`."""
    raw = conn.hget(Job.key_for(job_id), "status")
    return _text(raw) if raw else "gone"


def job_started_at(conn: redis.Redis, job_id: str) -> float | None:
    """When a job last started (epoch seconds), or None."""
    raw = conn.hget(Job.key_for(job_id), "started_at")
    return utcparse(_text(raw)).timestamp() if raw else None


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


@dataclass(frozen=True, slots=True)
class JobIds:
    """A run's job ids at one instant: `live` (queued, being dequeued, started, scheduled,
    deferred, ready: rq will run them) and `failed` (rq gave up on them)."""

    live: list[str]
    failed: list[str]


def run_job_ids(conn: redis.Redis, run: str) -> JobIds:
    """The ids of RUN's live and failed jobs, read in one transaction: a job moving between
    rq's lists and registries meanwhile is seen in exactly one of them."""
    name = queue_name(run)
    queue_key = Queue.redis_queue_namespace_prefix + name
    with conn.pipeline(transaction=True) as p:
        p.lrange(queue_key, 0, -1)
        p.lrange(IntermediateQueue.get_intermediate_queue_key(queue_key), 0, -1)
        p.zrange(StartedJobRegistry.key_template.format(name), 0, -1)
        for registry in (ScheduledJobRegistry, DeferredJobRegistry, ReadyJobRegistry):
            p.zrange(registry.key_template.format(name), 0, -1)
        p.zrange(FailedJobRegistry.key_template.format(name), 0, -1)
        queued, dequeuing, started, *waiting, failed = p.execute()
    live = [_text(j) for j in (*queued, *dequeuing)]
    # the started registry holds "<job id>:<execution id>"; the others, job ids
    live += [StartedJobRegistry.parse_job_id(_text(e)) for e in started]
    live += [_text(j) for group in waiting for j in group]
    return JobIds(live=live, failed=[_text(j) for j in failed])


def job_item_keys(conn: redis.Redis, job_ids: Sequence[str]) -> Iterator[list[str]]:
    """The item keys each of JOB_IDS carries, read from the jobs' JSON payloads (zlib), a batch
    of jobs per round trip. Jobs that are gone, foreign (another function, a pickle) or
    undecodable carry no items of ours and are skipped."""
    for start in range(0, len(job_ids), _FETCH_BATCH):
        with conn.pipeline(transaction=False) as p:
            for jid in job_ids[start:start + _FETCH_BATCH]:
                p.hget(Job.key_for(jid), "data")
            raws = p.execute()
        for raw in raws:
            if raw is None:
                continue
            try:
                try:
                    data = zlib.decompress(raw)
                except zlib.error:
                    data = raw  # rq's own fallback: stored uncompressed
                func, _instance, args, _kwargs = orjson.loads(data)  # SERIALIZER's JSON, read faster
                if func not in TASKS:
                    continue
                yield [str(it["key"]) for it in job_items(args)]
            except Exception as e:  # noqa: BLE001 - a pickle or garbage: not a genqueue job
                log.debug("job payload skipped: not a genqueue job (%s)", type(e).__name__)


def run_rq_keys(conn: redis.Redis, run: str) -> list[str]:
    """Every rq key of RUN: its queue, intermediate list and registries, and the hash, results
    and executions of every job found in them (for `producer delete`)."""
    q = queue_for(run, conn)
    registries = [q.started_job_registry, q.finished_job_registry, q.failed_job_registry,
                  q.deferred_job_registry, q.scheduled_job_registry, q.canceled_job_registry]
    job_ids: set[str] = set()
    for key in (q.key, q.intermediate_queue_key):
        job_ids.update(_text(x) for x in conn.lrange(key, 0, -1))
    for reg in registries:
        for member in conn.zrange(reg.key, 0, -1):
            text = _text(member)
            # the started registry holds "<job id>:<execution id>"; the others, job ids
            job_ids.add(text.rsplit(":", 1)[0] if reg is q.started_job_registry else text)
    keys = [q.key, q.intermediate_queue_key, *(reg.key for reg in registries)]
    for j in job_ids:
        keys += [Job.key_for(j), Result.get_key(j), ExecutionRegistry.key_template.format(j)]  # type: ignore[no-untyped-call]
    return keys


def forget_queue(conn: redis.Redis, run: str) -> None:
    """Drop RUN's queue from rq's list of queues (`rq info` stops listing it)."""
    conn.srem(Queue.redis_queues_keys, queue_for(run, conn).key)
