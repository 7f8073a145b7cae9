"""Everything genqueue reads or writes through rq, outside the consumer's worker.

The job contract: a job carries a JSON payload (rq's JSONSerializer; never a pickle): one
positional argument, the list of items. Its function name is `TASK`; a consumer refuses any
job naming anything else. Queues, job ids and descriptions, the payload's compression, and
every read of rq's keys that the producer, status, export and tools make live here, built
from rq's own key templates: a key spelled in four modules drifts. (The worker subclass and
its internals stay in consumer/rqcompat.py; reading jobs whatever Redis holds is
common/keepers/rqjobs.py, on top of the places listed here.)
"""

from __future__ import annotations

import hashlib
import logging
import zlib
from collections.abc import Mapping, Sequence
from enum import StrEnum
from typing import Any, NamedTuple, TypedDict, cast

import redis
import rq.job
from redis.client import Pipeline
from rq import Queue
from rq.executions import WORKER_EXECUTIONS_KEY_TEMPLATE, ExecutionRegistry
from rq.intermediate_queue import IntermediateQueue
from rq.job import Job
from rq.registry import (
    BaseRegistry,
    CanceledJobRegistry,
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
from genqueue.common.keepers.keeper import KEY_PREFIX
from genqueue.common.keepers.redismem import pipeline_read
from genqueue.common.storage.names import pack_tag

log = logging.getLogger(__name__)

#: The only function a genqueue job may name.
TASK = "genqueue.consumer.task.generate"
#: The name jobs enqueued before genqueue moved under one import namespace carry; still run.
LEGACY_TASKS = frozenset({"consumer.task.generate"})
TASKS = frozenset({TASK}) | LEGACY_TASKS

SERIALIZER = JSONSerializer

#: Retry budget of a job: how many times an abandoned or failed job goes back to the queue.
JOB_RETRIES = 3

#: Failed-job reasons longer than this are cut (rq keeps whole tracebacks).
REASON_CHARS = 500


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
    """The items an inline job carries, from its positional arguments (job_reference tells an
    inline job from one by reference)."""
    if not isinstance(job_args, list | tuple) or len(job_args) != 1 or not isinstance(job_args[0], list):
        raise ValueError("job arguments are not a list of items")
    items: list[Item] = job_args[0]
    return items


# --- jobs by reference --------------------------------------------------------------------
#: The fields of a job's `meta` that name its items by reference: the pack's number in the
#: run (common/keepers/packs.py's table names it) and the block's number in the pack. In `meta`,
#: not the argument: rq keeps a job's hash compact only while each field is at most 64 bytes,
#: which `meta` keeps and the payload with a function name and two numbers does not always
#: (docs/decisions.md, "A job by reference names its pack in `meta`").
META_ITEMS = "items"
META_PACK = "pack"
META_BLOCK = "block"
#: The first characters of the pack's writer (common/storage/names.py's pack_tag): a pack number
#: is unique in the run only while Redis does not go back (a rewind restores the number counter,
#: so the next enqueue gives out a number again, under another writer's name); with the tag a
#: reader that kept a number's name from before tells the two packs apart. Jobs queued before
#: the tag have none ("").
META_WRITER = "pw"


class PackRef(NamedTuple):
    """Where a job by reference finds its items: block BLOCK of the run's pack number PACK."""

    pack: int
    block: int
    writer: str = ""  # the pack's writer tag (META_WRITER); "" when the job does not say

    def names(self, name: str) -> bool:
        """Whether pack NAME can be the one this reference means (its writer tag, when it has one)."""
        return not self.writer or pack_tag(name) == self.writer


def reference_meta(items: int, ref: PackRef) -> dict[str, int | str]:
    """The `meta` of a job by reference of ITEMS items at REF (as rq writes it, JSON under the
    64 bytes a compact hash field holds: storage/names.py PACK_TAG_CHARS)."""
    meta: dict[str, int | str] = {META_ITEMS: items, META_PACK: ref.pack, META_BLOCK: ref.block}
    if ref.writer:
        meta[META_WRITER] = ref.writer
    return meta


def job_reference(job_args: Any, job_kwargs: Any, meta: Any) -> PackRef | None:
    """What shape a job is: None for an inline job (one argument, whatever it holds: the
    item reader judges it), its PackRef for a job by reference (no argument, no keyword
    argument, a pack and a block number in META). ValueError for a job with no argument and
    no usable reference."""
    if isinstance(job_args, list | tuple) and len(job_args) == 0 and not job_kwargs:
        m = meta if isinstance(meta, dict) else {}
        pack, block = _count(m.get(META_PACK), first=1), _count(m.get(META_BLOCK), first=0)
        if pack is None or block is None:
            raise ValueError(f"job has no items and no usable reference in its meta "
                             f"({META_PACK}={m.get(META_PACK)!r}, {META_BLOCK}={m.get(META_BLOCK)!r})")
        writer = m.get(META_WRITER)
        return PackRef(pack, block, writer if isinstance(writer, str) else "")
    return None


def _count(value: Any, *, first: int) -> int | None:
    """VALUE when it is an integer at least FIRST (not a bool), else None."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= first else None


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


# --- where a run's jobs are --------------------------------------------------------------
class JobPlace(StrEnum):
    """The list or registry of a run's queue that holds a job id."""

    QUEUED = "queued"
    DEQUEUING = "dequeuing"  # rq's intermediate list, between dequeue and start
    STARTED = "started"
    SCHEDULED = "scheduled"
    DEFERRED = "deferred"
    READY = "ready"
    FAILED = "failed"
    FINISHED = "finished"
    CANCELED = "canceled"


#: Where rq will still run a job from.
LIVE_PLACES = (JobPlace.QUEUED, JobPlace.DEQUEUING, JobPlace.STARTED, JobPlace.SCHEDULED, JobPlace.DEFERRED,
               JobPlace.READY)
_LISTS = frozenset({JobPlace.QUEUED, JobPlace.DEQUEUING})
_REGISTRIES: dict[JobPlace, type[BaseRegistry]] = {JobPlace.STARTED: StartedJobRegistry, JobPlace.SCHEDULED: ScheduledJobRegistry,
               JobPlace.DEFERRED: DeferredJobRegistry, JobPlace.READY: ReadyJobRegistry,
               JobPlace.FAILED: FailedJobRegistry, JobPlace.FINISHED: FinishedJobRegistry,
               JobPlace.CANCELED: CanceledJobRegistry}


def place_key(run: str, place: JobPlace) -> str:
    """The Redis key of RUN's PLACE (a list for queued and dequeuing, else a sorted set)."""
    queue_key = Queue.redis_queue_namespace_prefix + queue_name(run)
    if place is JobPlace.QUEUED:
        return queue_key
    if place is JobPlace.DEQUEUING:
        return IntermediateQueue.get_intermediate_queue_key(queue_key)
    return str(_REGISTRIES[place].key_template.format(queue_name(run)))


def place_members(conn: redis.Redis, run: str, places: list[JobPlace]) -> list[tuple[JobPlace, list[bytes]]]:
    """The raw members of RUN's PLACES, read in one transaction (a job moving between them
    meanwhile is seen in exactly one). Members are as stored: the started registry's are
    `<job id>:<execution id>`. A key of another type (garbage) reads as empty."""
    def build(p: Any) -> None:
        for place in places:
            key = place_key(run, place)
            if place in _LISTS:
                p.lrange(key, 0, -1)
            else:
                p.zrange(key, 0, -1)

    out = pipeline_read(conn, build, raise_on_error=False)  # a full Redis refuses the MULTI
    return [(place, list(m) if isinstance(m, list) else []) for place, m in zip(places, out, strict=True)]


def refused_key(queue: str) -> str:
    """Where the consumers keep the jobs of QUEUE they refused (job id -> reason): jobs rq
    cannot load are dropped from the queue, foreign ones failed (consumer/rqcompat.py)."""
    return f"{KEY_PREFIX}:refused:{queue}"


def refused_jobs(conn: redis.Redis, run: str) -> dict[str, str]:
    """The jobs of RUN the consumers refused, with their reasons, sorted by id."""
    raw = conn.hgetall(refused_key(queue_name(run))) if conn.type(refused_key(queue_name(run))) == b"hash" else {}
    return dict(sorted((_lenient(k), _lenient(v)[:REASON_CHARS]) for k, v in raw.items()))


def clear_refused(conn: redis.Redis, run: str) -> dict[str, str]:
    """Forget the refused jobs of RUN: their record, and the refused jobs themselves where rq
    will not run them (a refused job is never in a live place unless it was enqueued again,
    e.g. by the reconcile under the same id: that one is kept). Returns what was cleared."""
    refused = refused_jobs(conn, run)
    if not refused:
        conn.delete(refused_key(queue_name(run)))
        return {}
    live: set[str] = set()
    for place, members in place_members(conn, run, list(LIVE_PLACES)):
        for m in members:
            text = _lenient(m)
            live.add(text.rsplit(":", 1)[0] if place is JobPlace.STARTED and ":" in text else text)
    gone = [j for j in refused if j not in live]
    with conn.pipeline(transaction=True) as p:
        for j in gone:
            p.zrem(place_key(run, JobPlace.FAILED), j)
            p.delete(Job.key_for(j), Result.get_key(j), ExecutionRegistry.key_template.format(j))  # type: ignore[no-untyped-call]
        p.delete(refused_key(queue_name(run)))
        p.execute()
    return refused


def _lenient(value: object) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


# --- raw reads for status and tools ------------------------------------------------------
class JobCounts(TypedDict):
    """How many of a run's jobs are in each of rq's places (executions, for `started`)."""

    queued: int
    dequeuing: int
    started: int
    finished: int
    failed: int


def drained(conn: redis.Redis, run: str) -> tuple[bool, int]:
    """Whether no job of RUN is live (queued, being dequeued, started, scheduled, deferred or
    ready: LIVE_PLACES), and how many rq gave up on (its failed registry). Raw counts."""
    with conn.pipeline(transaction=False) as p:
        for place in (*LIVE_PLACES, JobPlace.FAILED):
            (p.llen if place in _LISTS else p.zcard)(place_key(run, place))
        *live, failed = (int(n) for n in p.execute())
    return not any(live), failed


def job_counts(conn: redis.Redis, run: str) -> JobCounts:
    """Raw LLEN/ZCARD counts, one round trip. Not rq's `registry.count`: that also cleans the
    registry up (re-queueing or failing expired jobs) outside the maintenance lock the
    consumers' sweeps hold, which a read must never do."""
    with conn.pipeline(transaction=False) as p:
        stage_job_counts(p, run)
        return job_counts_of(p.execute())


def stage_job_counts(p: Pipeline, run: str) -> None:
    """Queue the reads of RUN's JobCounts on P (five replies, for job_counts_of)."""
    for place in (JobPlace.QUEUED, JobPlace.DEQUEUING, JobPlace.STARTED, JobPlace.FINISHED, JobPlace.FAILED):
        (p.llen if place in _LISTS else p.zcard)(place_key(run, place))


def job_counts_of(replies: Sequence[object]) -> JobCounts:
    """The JobCounts from the five replies stage_job_counts queued (a key of another type,
    garbage read with raise_on_error=False, counts 0)."""
    queued, dequeuing, started, finished, failed = (n if isinstance(n, int) else 0 for n in replies)
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


def job_payload(conn: redis.Redis, job_id: str) -> tuple[object, object, object] | None:
    """A job's positional and keyword arguments and its meta as rq loads them (job_reference
    tells the shapes apart), or None when the job is gone or cannot be loaded (the end of a
    run's copies read the items of a job another consumer holds)."""
    try:
        job = Job.fetch(job_id, connection=conn, serializer=SERIALIZER)
        return job.args, job.kwargs, job.meta
    except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError):
        raise
    except Exception as e:  # noqa: BLE001 - a job rq cannot load is simply not copied
        log.debug("job %s not loaded (%s: %s)", job_id, type(e).__name__, e)
        return None


def job_started_at(conn: redis.Redis, job_id: str) -> float | None:
    """When a job last started (epoch seconds), or None."""
    raw = conn.hget(Job.key_for(job_id), "started_at")
    return utcparse(_text(raw)).timestamp() if raw else None


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def run_rq_keys(conn: redis.Redis, run: str) -> list[str]:
    """Every rq key of RUN: its queue, intermediate list and registries, and the hash, results
    and executions of every job found in them (for `producer delete`). Entries that are not
    text name no job key and are dropped with their list or registry."""
    places = place_members(conn, run, list(JobPlace))
    job_ids: set[str] = set()
    for place, members in places:
        for member in members:
            try:
                text = member.decode() if isinstance(member, bytes) else str(member)
            except UnicodeDecodeError:
                continue
            # the started registry holds "<job id>:<execution id>"; the others, job ids
            job_ids.add(text.rsplit(":", 1)[0] if place is JobPlace.STARTED and ":" in text else text)
    keys = [place_key(run, p) for p in JobPlace]
    for j in sorted(job_ids):
        keys += [Job.key_for(j), Result.get_key(j), ExecutionRegistry.key_template.format(j)]  # type: ignore[no-untyped-call]
    return keys


def forget_queue(conn: redis.Redis, run: str) -> None:
    """Drop RUN's queue from rq's list of queues (`rq info` stops listing it)."""
    conn.srem(Queue.redis_queues_keys, queue_for(run, conn).key)


# --- queue lengths -----------------------------------------------------------------------
class QueueLength(NamedTuple):
    """What a run's queue holds for the consumers: jobs waiting in rq's list, and jobs the
    consumers refused (refused_key)."""

    waiting: int
    refused: int


def stage_queue_lengths(p: Pipeline, runs: Sequence[str]) -> None:
    """Queue the reads of RUNS' queue lengths on P, for queue_lengths_of to read back from its
    replies (two each, in RUNS' order): a caller's other commands share the round trip."""
    for run in runs:
        p.llen(place_key(run, JobPlace.QUEUED))
        p.hlen(refused_key(queue_name(run)))


def queue_lengths_of(replies: Sequence[object], runs: Sequence[str]) -> dict[str, QueueLength]:
    """RUNS' queue lengths from the replies stage_queue_lengths queued (read with
    raise_on_error=False: a key of another type, garbage, counts 0)."""
    counts = [n if isinstance(n, int) else 0 for n in replies]
    return {run: QueueLength(counts[2 * i], counts[2 * i + 1]) for i, run in enumerate(runs)}


def queue_lengths(conn: redis.Redis, runs: Sequence[str]) -> dict[str, QueueLength]:
    """Each of RUNS' queue lengths, one round trip."""
    with conn.pipeline(transaction=False) as p:
        stage_queue_lengths(p, runs)
        return queue_lengths_of(p.execute(raise_on_error=False), runs)


def place_page(conn: redis.Redis, run: str, place: JobPlace, offset: int, per_page: int, *,
               newest_first: bool) -> tuple[int, list[bytes]]:
    """How many members RUN's PLACE holds, and the PER_PAGE of them from OFFSET on (counted from
    the newest end when NEWEST_FIRST, and then listed newest first): the dashboard's job lists."""
    key = place_key(run, place)
    listed = place in _LISTS
    total = int(conn.llen(key) if listed else conn.zcard(key))
    start = max(0, total - offset - per_page) if newest_first else offset
    stop = (total - offset if newest_first else offset + per_page) - 1
    # genqueue's connections answer bytes (common/keepers/redisconn.py)
    members = cast(list[bytes], conn.lrange(key, start, stop) if listed else conn.zrange(key, start, stop))
    if newest_first:
        members.reverse()
    return total, members
