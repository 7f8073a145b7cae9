"""The job contract between producer and consumer, and the rq queue a run uses.

A job carries a JSON payload (rq's JSONSerializer; never a pickle): the run name and a list
of items. Its function name is `TASK`; a consumer refuses any job naming anything else.
"""

from __future__ import annotations

import hashlib
import zlib
from typing import Any

import redis
import rq.job
from rq import Queue
from rq.serializers import JSONSerializer

from genqueue.common import defaults

#: The only function a genqueue job may name.
TASK = "genqueue.consumer.task.generate"
#: The name jobs enqueued before genqueue moved under one import namespace carry; still run.
LEGACY_TASKS = frozenset({"consumer.task.generate"})
TASKS = frozenset({TASK}) | LEGACY_TASKS

SERIALIZER = JSONSerializer


def queue_name(run: str) -> str:
    """The rq queue of a run (rq's key: rq:queue:genqueue.<run>)."""
    return f"genqueue.{run}"


def run_of_queue(name: str) -> str | None:
    return name[len("genqueue.") :] if name.startswith("genqueue.") else None


def queue_for(run: str, conn: redis.Redis) -> Queue:
    return Queue(queue_name(run), connection=conn, serializer=SERIALIZER)


def job_id(run: str, item_keys: list[str]) -> str:
    """A deterministic job id from the item keys it carries, unique within the run."""
    h = hashlib.blake2b(digest_size=10)
    h.update(run.encode())
    for k in item_keys:
        h.update(k.encode())
    return f"gq-{h.hexdigest()}"


def job_description(run: str, items: list[dict[str, Any]]) -> str:
    # rq's default description repeats every argument; with prompts inside that would double
    # the job's size in Redis.
    first = items[0]["index"] if items else "-"
    return f"genqueue run={run} items={len(items)} first_index={first}"


def job_items(job_args: Any) -> list[dict[str, Any]]:
    """The items a job carries, from its positional arguments."""
    if not isinstance(job_args, list | tuple) or len(job_args) != 1 or not isinstance(job_args[0], list):
        raise ValueError("job arguments are not a list of items")
    return job_args[0]


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
    """The producer's one touch of rq internals (the module it compresses job data with)."""
    rq.job.zlib = _FastZlib  # type: ignore[assignment]


_ = defaults  # the retry budget and TTLs live in common.defaults
