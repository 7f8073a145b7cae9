"""Deleting a run from Redis: every key genqueue and rq keep for it (`producer delete`)."""

from __future__ import annotations

import redis

from genqueue.common.keepers.keeper import run_key
from genqueue.common.keepers.pause import Pause
from genqueue.common.keepers.rqaccess import forget_queue, queue_name, refused_key, run_rq_keys
from genqueue.common.keepers.runs import RUNS

#: Keys deleted per DEL.
_BATCH = 500


def delete_run(conn: redis.Redis, run: str) -> int:
    """Delete every Redis key of RUN: genqueue's and rq's (its queue, registries, jobs).
    Consumers holding its jobs find the run gone and stop serving it. Returns how many keys
    were deleted."""
    ours = [k.decode() for k in conn.scan_iter(match=f"{run_key(run)}:*", count=1000)]
    keys = [*run_rq_keys(conn, run), run_key(run), Pause.key(run), refused_key(queue_name(run)), *ours]
    n = 0
    for i in range(0, len(keys), _BATCH):
        n += int(conn.delete(*keys[i:i + _BATCH]))
    conn.zrem(RUNS, run)
    forget_queue(conn, run)
    return n
