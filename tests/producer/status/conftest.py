"""A run in real Redis for the status tests: items, marks written by the real marking script,
and consumer snapshots as consumer/telemetry.py writes them."""

from __future__ import annotations

from typing import Any

import orjson
import redis

from genqueue.common import __version__
from genqueue.common.keepers.items import IN_RUN, ItemTable
from genqueue.common.keepers.marks import Marks, ShardMarks
from genqueue.common.keepers.runs import CONSUMERS, RunStore, consumer_key, key_digest
from genqueue.common.settings import RunSettings

RUN = "st"


def make_run(conn: redis.Redis, items: int, started_at: float | None = None) -> list[str]:
    """RUN with ITEMS items (their keys returned), its first job started at STARTED_AT."""
    keys = [f"{i:032x}" for i in range(items)]
    RunStore(conn).create_or_check(RUN, RunSettings())
    ItemTable(conn, RUN).change([key_digest(k) for k in keys], add=IN_RUN)
    if started_at is not None:
        RunStore(conn).count_acked(RUN, {}, started_at)
    return keys


def ship(conn: redis.Redis, keys: list[str], *, spec: str = "") -> None:
    """KEYS marked done by a shipped shard, as the consumers mark them."""
    marks = ShardMarks()
    for k in keys:
        marks.add(k, error=False, kind="finished", spec=spec)
    Marks(conn, RUN).mark_shipped(marks)


def snapshot(conn: redis.Redis, worker: str, seen: float, **fields: Any) -> None:
    """A consumer's snapshot, last seen at SEEN."""
    s = {"worker": worker, "host": "node1", "gpu": 0, "last_seen": seen, "version": __version__, "in_flight": 0,
         "pending_items": 0, "paused": {}, "engine": {"metrics": False}, "shipping": {}, **fields}
    conn.set(consumer_key(worker), orjson.dumps(s))
    conn.zadd(CONSUMERS, {worker: seen})
