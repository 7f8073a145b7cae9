"""The consumer snapshot in Redis: written by every consumer every few seconds (its telemetry),
read back by `producer status`. Its keys, its lifetime and its shape are spelled here only.

Keys: genqueue:consumer:<worker>  str   the snapshot (JSON, a contracts.ConsumerSnapshot), for a day
      genqueue:consumers          zset  worker -> last seen (Redis time, as the leases keep it)

A snapshot is read back as a ConsumerReport: what the consumer wrote, which may be less than a
ConsumerSnapshot (consumers of an earlier shape wrote fewer fields; tools and hand edits may
write anything), with its age and whether it is live. One that is not a snapshot where status
reads it without a default (garbage under its key) is left out: there is nothing to show.
"""

from __future__ import annotations

from typing import Required, TypedDict, cast

import orjson
import redis

from genqueue.common.contracts import ConsumerSnapshot, EngineView, RunCounters, ShippingView
from genqueue.common.rqaccess import QueueLength, queue_lengths_of, stage_queue_lengths
from genqueue.common.runs import CONSUMERS, consumer_key

#: A snapshot lives this long after its consumer's last report; status reads the last day's.
SNAPSHOT_TTL = 24 * 3600

#: A consumer that has not reported for this long is not live (it stopped reporting).
STALE_AFTER = 15.0


class ConsumerReport(TypedDict, total=False):
    """A consumer's snapshot as read back: the fields of a ConsumerSnapshot it holds, checked
    where they are read without a default (`worker` a text, `runs` a dict of dicts, `last_seen`
    a number, `engine`, `paused`, `shipping` and `jobs` dicts), and the reader's age and
    liveness. `gpus`: the GPUs the consumer fronts, where it says (producer/cost.py)."""

    worker: Required[str]
    runs: Required[dict[str, RunCounters]]  # {} when the snapshot has none
    age_s: Required[float]  # seconds since its last report (never negative)
    live: Required[bool]  # reported within STALE_AFTER and did not exit
    host: str
    gpu: int | None
    gpus: int
    pid: int
    endpoint: str
    version: str
    started_at: float
    last_seen: float
    exited: bool
    concurrency: int
    concurrency_mode: str
    in_flight: int
    pending_items: int
    held_jobs: int
    stopping: bool
    paused: dict[str, str | bool]  # consumers of the first shape wrote every reason, False when not in force
    models: list[str]
    max_model_len: dict[str, int | None]
    engine: EngineView
    shipping: ShippingView
    jobs: dict[str, int]
    copies: dict[str, int]
    redis_unreachable_since: float | None
    clock_offset: float | None


def publish(conn: redis.Redis, snap: ConsumerSnapshot, now: float) -> dict[str, QueueLength]:
    """Write SNAP as its consumer's last report at NOW (Redis time), drop the reports of
    consumers silent for a day, and read the queue lengths of the runs SNAP serves: one round
    trip for all of it."""
    runs = list(snap["runs"])
    with conn.pipeline() as p:
        p.set(consumer_key(snap["worker"]), orjson.dumps(snap), ex=SNAPSHOT_TTL)
        p.zadd(CONSUMERS, {snap["worker"]: now})
        p.zremrangebyscore(CONSUMERS, 0, now - SNAPSHOT_TTL)
        stage_queue_lengths(p, runs)
        out = p.execute(raise_on_error=False)
    return queue_lengths_of(out[3:], runs)


def reports(conn: redis.Redis, now: float) -> list[ConsumerReport]:
    """Every consumer's last snapshot (the last day's), with its age and liveness at NOW;
    unreadable ones left out."""
    names = [_text(n) for n in conn.zrangebyscore(CONSUMERS, now - SNAPSHOT_TTL, "+inf")]
    if not names:
        return []
    out = []
    for raw in conn.mget([consumer_key(n) for n in names]):
        if raw is None:
            continue
        report = read_report(raw, now)
        if report is not None:
            out.append(report)
    return out


def read_report(raw: bytes | str, now: float) -> ConsumerReport | None:
    """The snapshot RAW as a report at NOW, or None when it is not one."""
    try:
        snap = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    seen = _last_seen(snap)
    if seen is None:
        return None
    snap.setdefault("runs", {})
    snap["age_s"] = max(0.0, now - seen)
    snap["live"] = snap["age_s"] <= STALE_AFTER and not snap.get("exited")
    return cast(ConsumerReport, snap)  # the fields read without a default were checked


def _last_seen(snap: object) -> float | None:
    """SNAP's last report time (0 when it has none), or None when SNAP is not a snapshot where
    status reads it without a default."""
    if not isinstance(snap, dict) or not isinstance(snap.get("worker"), str):
        return None
    runs, seen = snap.get("runs", {}), snap.get("last_seen", 0.0)
    if not isinstance(runs, dict) or not all(isinstance(r, dict) for r in runs.values()):
        return None
    if not isinstance(seen, int | float) or isinstance(seen, bool):
        return None
    if not all(isinstance(snap.get(k, {}), dict) for k in ("engine", "paused", "shipping", "jobs")):
        return None
    return float(seen)


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
