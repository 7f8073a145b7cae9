"""A run's progress as Redis counts it: its items (the keys set, runs.py), its done and failed
marks (marks.py), and the outcome counters the marks' script bumps (the run's stats hash).
Read together, for `producer status` and `producer runs`.
"""

from __future__ import annotations

from typing import NamedTuple

import redis

from genqueue.common.marks import done_key, failed_key
from genqueue.common.runs import run_key


class Progress(NamedTuple):
    """RUN's items, those done, those failed (an error record and no result), and its counters."""

    items: int
    done: int
    failed: int
    stats: dict[str, int]


class Totals(NamedTuple):
    """The sizes of RUN's keys set and mark sets, as stored (an item may be in both marks)."""

    items: int
    done: int
    failed: int


def progress(conn: redis.Redis, run: str) -> Progress:
    """RUN's progress in one transaction: the marks and the outcome counters the same script
    bumps (common/marks.py) are read at one moment, so they agree. Failed counts the items with
    an error record and no result."""
    with conn.pipeline(transaction=True) as p:
        p.scard(run_key(run, "keys"))
        p.scard(done_key(run))
        p.scard(failed_key(run))
        p.sintercard(2, [failed_key(run), done_key(run)])
        p.hgetall(run_key(run, "stats"))
        items, done, failed, both, raw = p.execute(raise_on_error=False)
    if isinstance(both, Exception):  # Redis before 7.0: no SINTERCARD
        both = 0
    stats: dict[str, int] = {}
    for k, v in (raw.items() if isinstance(raw, dict) else []):
        try:
            stats[_text(k)] = int(v)
        except ValueError:  # garbage in the hash: left out, as RunStore.stats does
            continue
    return Progress(int(items), int(done), max(int(failed) - int(both), 0), stats)


def totals(conn: redis.Redis, run: str) -> Totals:
    """The sizes of RUN's keys set and of its done and failed marks, one round trip."""
    with conn.pipeline(transaction=False) as p:
        p.scard(run_key(run, "keys"))
        p.scard(done_key(run))
        p.scard(failed_key(run))
        items, done, failed = p.execute()
    return Totals(int(items), int(done), int(failed))


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
