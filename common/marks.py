"""Per-item done marks: which items of a run have a record in a shipped shard.

When a shard is shipped, the keys of the records it holds are added to the run's `done` set
(results) or `failed` set (error records), in one round trip, before any job is acked on it.
A job that runs again (after a crash, a sweep, a requeue) skips the items already marked:
their records are shipped already. The marks are an optimisation over the truth, which stays
in the shipped shards: if they are lost (Redis flushed), nothing breaks, work is only redone.

Keys (16-byte digests of the item keys, as in genqueue:run:<run>:keys):
  genqueue:run:<run>:done     set   items with a result record in a shipped shard
  genqueue:run:<run>:failed   set   items with an error record in a shipped shard
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

import redis

from genqueue.common.runs import key_digest, run_key


def done_key(run: str) -> str:
    return run_key(run, "done")


def failed_key(run: str) -> str:
    return run_key(run, "failed")


@dataclass(slots=True)
class ShardMarks:
    """The item digests one shard holds, split by record kind."""

    done: list[bytes] = field(default_factory=list)
    failed: list[bytes] = field(default_factory=list)

    def add(self, item_key: str, *, error: bool) -> None:
        (self.failed if error else self.done).append(key_digest(item_key))


def mark_shipped(conn: redis.Redis, run: str, marks: ShardMarks) -> None:
    """Record MARKS of a shipped shard of RUN (one round trip)."""
    if not marks.done and not marks.failed:
        return
    with conn.pipeline(transaction=False) as p:
        if marks.done:
            p.sadd(done_key(run), *marks.done)
        if marks.failed:
            p.sadd(failed_key(run), *marks.failed)
        p.execute()


class Mark(StrEnum):
    DONE = "done"
    FAILED = "failed"


def marks_of(conn: redis.Redis, run: str, item_keys: list[str]) -> list[Mark | None]:
    """For each item key, whether a shipped shard already holds its result (DONE), only an
    error record (FAILED), or nothing (None). One round trip."""
    if not item_keys:
        return []
    digests = [key_digest(k) for k in item_keys]
    with conn.pipeline(transaction=False) as p:
        p.smismember(done_key(run), digests)
        p.smismember(failed_key(run), digests)
        done, failed = p.execute()
    return [Mark.DONE if d else Mark.FAILED if f else None for d, f in zip(done, failed, strict=True)]
