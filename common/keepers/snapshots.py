"""The consumer snapshot in Redis: written by every consumer every few seconds (its telemetry),
read back by `producer status`. Its keys and its lifetime are spelled here only (its shape:
common/snapshot.py).

Keys: genqueue:consumer:<worker>  str   the snapshot (JSON, a snapshot.ConsumerSnapshot), for a day
      genqueue:consumers          zset  worker -> last seen (Redis time, as the leases keep it)
      genqueue:run:<run>:spent    hash  a consumer process (its worker name and a tag of its
                                        own) -> its totals for the run: records written, tokens,
                                        GPU-seconds (a JSON list in the order of SPENT_FIELDS)

A snapshot is live figures, gone with its consumer; what was spent is not: each publish sets
its consumer's totals in each run's spent hash when they changed, so status shows tokens
generated before they ship and GPU-hours that never go down. Totals, not additions: a publish
retried after a lost answer counts nothing twice. Times a consumer stamps with its own clock
are moved to Redis time on reading, by the snapshot's `clock_offset`. A snapshot is read back as
a ConsumerReport, with its age and liveness; one that is not a snapshot where status reads it
without a default is left out. Earlier layouts read here: a spent field named as a counter of
SPENT_FIELDS (an earlier consumer added to it), and `paused` holding False (ConsumerReport).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Required, cast

import orjson
import redis

from genqueue.common.keepers.keeper import run_key
from genqueue.common.keepers.rqaccess import QueueLength, queue_lengths_of, stage_queue_lengths
from genqueue.common.keepers.runs import CONSUMERS, consumer_key
from genqueue.common.snapshot import ConsumerFields, ConsumerSnapshot

#: A snapshot lives this long after its consumer's last report; status reads the last day's.
SNAPSHOT_TTL = 24 * 3600

#: A consumer silent this long (seconds) is not live.
STALE_AFTER = 15.0


class ConsumerReport(ConsumerFields, total=False):
    """A consumer's snapshot as read back: the fields of a ConsumerSnapshot it holds, checked
    where they are read without a default (`worker` a text, `runs` a dict of dicts, `last_seen`
    a number, `engine`, `paused`, `shipping` and `jobs` dicts), and the reader's age and
    liveness. `gpus`: the GPUs the consumer fronts, where it says (producer/status/cost.py)."""

    paused: dict[str, str | bool]  # consumers of the first shape wrote every reason, False when not in force
    age_s: Required[float]  # seconds since its last report (never negative)
    live: Required[bool]  # reported within STALE_AFTER and did not exit


class ConsumerState(StrEnum):
    """Whether a consumer is there, as its last report and its age say (consumer_state)."""

    LIVE = "live"  # reported within STALE_AFTER and did not exit
    EXITED = "exited"  # its last report said it exited
    SILENT = "silent"  # no report within STALE_AFTER (killed, frozen, cut off), or replaced on its spool


def consumer_state(c: ConsumerReport) -> ConsumerState:
    """C's state: every screen that tells a live consumer from a gone one asks this. A gone
    consumer's figures and engine verdict are what it last said, not what is so now."""
    if c["live"]:
        return ConsumerState.LIVE
    return ConsumerState.EXITED if c.get("exited") else ConsumerState.SILENT


#: The counters of a run's spent hash: records written (errors among them), tokens, GPU-seconds.
SPENT_FIELDS = ("completions", "errors", "prompt_tokens", "completion_tokens", "gpu_seconds")


@dataclass(frozen=True, slots=True)
class Spent:
    """What a run's consumers generated for it and the GPU time they spent on it, so far."""

    completions: int = 0
    errors: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    gpu_seconds: float = 0.0


def spent_value(totals: Spent) -> bytes:
    """A consumer's field of a run's spent hash: its TOTALS, in the order of SPENT_FIELDS."""
    return orjson.dumps([totals.completions, totals.errors, totals.prompt_tokens, totals.completion_tokens,
                         round(totals.gpu_seconds, 3)])


def spent_totals(raw: object) -> tuple[float, ...]:
    """A consumer's field RAW read back: its totals in the order of SPENT_FIELDS (zeros when it
    is not five non-negative numbers)."""
    zero = (0.0,) * len(SPENT_FIELDS)
    try:
        got = orjson.loads(raw) if isinstance(raw, bytes | str) else None
    except orjson.JSONDecodeError:
        return zero
    if not isinstance(got, list) or len(got) != len(SPENT_FIELDS):
        return zero
    if not all(isinstance(x, int | float) and not isinstance(x, bool) and x >= 0 for x in got):
        return zero
    return tuple(float(x) for x in got)


class Snapshots:
    """The consumers' snapshots on CONN, and the runs' spent hashes they keep their totals in:
    their keys, the publish, and the reads `producer status` makes."""

    def __init__(self, conn: redis.Redis) -> None:
        self.conn = conn

    @staticmethod
    def spent_key(run: str) -> str:
        return run_key(run, "spent")

    def publish(self, snap: ConsumerSnapshot, now: float, spent: Mapping[str, Spent] | None = None, *,
                spender: str = "", prune: bool = True) -> dict[str, QueueLength]:
        """Write SNAP as its consumer's last report at NOW (Redis time), set SPENDER's field of
        each run's spent hash in SPENT (run -> the consumer's totals of it) to those totals, with
        PRUNE drop the reports of consumers silent for a day, and read the queue lengths of the
        runs SNAP serves: one round trip for all of it."""
        runs = list(snap["runs"])
        with self.conn.pipeline(transaction=False) as p:
            p.set(consumer_key(snap["worker"]), orjson.dumps(snap), ex=SNAPSHOT_TTL)
            p.zadd(CONSUMERS, {snap["worker"]: now})
            if prune:
                p.zremrangebyscore(CONSUMERS, 0, now - SNAPSHOT_TTL)
            stage_queue_lengths(p, runs)
            for run, totals in (spent or {}).items():
                p.hset(self.spent_key(run), spender or snap["worker"], spent_value(totals))
            out = p.execute(raise_on_error=False)
        first = 3 if prune else 2
        lengths = out[first:first + 2 * len(runs)]
        for answer in out[:first] + out[first + 2 * len(runs):]:  # a write refused (Redis full) is the caller's
            if isinstance(answer, Exception):
                raise answer
        return queue_lengths_of(lengths, runs)

    def spent(self, run: str) -> Spent:
        """RUN's spent hash: the consumers' totals summed (garbage fields count 0)."""
        raw = cast(dict[Any, Any], self.conn.hgetall(self.spent_key(run)))
        got = dict.fromkeys(SPENT_FIELDS, 0.0)
        for k, v in raw.items():
            name = _text(k)
            if name in SPENT_FIELDS:  # a counter, as an earlier consumer added to
                try:
                    got[name] += float(v)
                except ValueError:
                    continue
                continue
            for field, x in zip(SPENT_FIELDS, spent_totals(v), strict=True):
                got[field] += x

        def n(field: str) -> int:
            return max(int(got[field]), 0)

        return Spent(n("completions"), n("errors"), n("prompt_tokens"), n("completion_tokens"),
                     max(got["gpu_seconds"], 0.0))

    def reports(self, now: float) -> list[ConsumerReport]:
        """Every consumer's last snapshot (the last day's), with its age and liveness at NOW;
        unreadable ones left out."""
        conn = self.conn
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
        return superseded(out)


def superseded(found: list[ConsumerReport]) -> list[ConsumerReport]:
    """FOUND with every consumer that a later one on its host and spool replaced marked not
    live: the later one took the spool's lock, which only a dead consumer lets go (it ships
    what the earlier one left, and reports what is left of it)."""
    latest: dict[tuple[str, str], float] = {}
    for c in found:
        where = (str(c.get("host")), c.get("spool"))
        if isinstance(where[1], str):
            latest[(where[0], where[1])] = max(latest.get((where[0], where[1]), 0.0), float(c.get("started_at") or 0.0))
    for c in found:
        spool = c.get("spool")
        if isinstance(spool, str) and float(c.get("started_at") or 0.0) < latest[(str(c.get("host")), spool)]:
            c["live"] = False
    return found


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
    _to_redis_time(snap)
    snap["age_s"] = max(0.0, now - seen)
    snap["live"] = snap["age_s"] <= STALE_AFTER and not snap.get("exited")
    return cast(ConsumerReport, snap)  # the fields read without a default were checked


#: The times a consumer stamps with its own clock: its start, and its shipping's.
_NODE_TIMES = ("last_upload_at", "oldest_waiting_at", "last_error_at")


def _to_redis_time(snap: dict[str, Any]) -> None:
    """Move SNAP's node-clock times to Redis time by its clock_offset (Redis - node)."""
    offset = snap.get("clock_offset")
    if not isinstance(offset, int | float) or isinstance(offset, bool) or not offset:
        return

    def shift(d: object, keys: tuple[str, ...]) -> None:
        if isinstance(d, dict):
            for k in keys:
                v = d.get(k)
                if isinstance(v, int | float) and not isinstance(v, bool) and v:
                    d[k] = v + offset

    shift(snap, ("started_at",))
    shift(snap.get("shipping"), _NODE_TIMES)
    for r in snap["runs"].values():
        shift(r.get("shipping"), _NODE_TIMES)


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
