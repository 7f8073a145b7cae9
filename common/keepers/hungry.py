"""A consumer's call for work of a run: its queue is empty here and it has a slot free.

Key: genqueue:run:<run>:hungry  (the calling consumer's rq worker name), kept a few seconds.
Other consumers read it and give back the jobs of the run they hold with nothing sent yet
(consumer/work/intake.py), so the run's last jobs go where they can start at once.
"""

from __future__ import annotations

import redis

from genqueue.common.keepers.runs import run_key


def hungry_key(run: str) -> str:
    return run_key(run, "hungry")


def call_for_work(conn: redis.Redis, run: str, worker: str, ttl: float) -> None:
    """WORKER calls for work of RUN, for TTL seconds."""
    conn.set(hungry_key(run), worker, px=int(ttl * 1000))


def caller_for_work(conn: redis.Redis, run: str) -> str | None:
    """The consumer calling for work of RUN now, if any."""
    raw = conn.get(hungry_key(run))
    return raw.decode(errors="replace") if isinstance(raw, bytes) else None if raw is None else str(raw)


def other_caller(conn: redis.Redis, run: str, me: str) -> str | None:
    """The consumer other than ME calling for work of RUN now, if any: what it holds of the run,
    ME gives back (intake) or offers for copies (hedge), since that one would start it sooner."""
    caller = caller_for_work(conn, run)
    return None if caller == me else caller
