"""Runs in Redis: settings, the set of enqueued item keys, per-source summaries, counters.

Keys (all under genqueue:, rq's own keys keep rq's prefix):
  genqueue:runs                 zset  run -> creation time
  genqueue:run:<run>            hash  settings (JSON), fingerprint, created_at, version
  genqueue:run:<run>:keys       set   16-byte digests of every item key enqueued (idempotence)
  genqueue:run:<run>:sources    hash  source id -> JSON summary of its last enqueue
  genqueue:run:<run>:stats      hash  counters the consumers increment (items done, errors...)
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import orjson
import redis

from genqueue.common import __version__
from genqueue.common.defaults import KEY_PREFIX
from genqueue.common.errors import RunConflictError, RunNotFoundError
from genqueue.common.settings import RunSettings

RUNS = f"{KEY_PREFIX}:runs"
#: Consumers' last snapshots: a sorted set of worker names by last-seen time, and one key each.
CONSUMERS = f"{KEY_PREFIX}:consumers"


def consumer_key(worker: str) -> str:
    return f"{KEY_PREFIX}:consumer:{worker}"


def run_key(run: str, suffix: str = "") -> str:
    return f"{KEY_PREFIX}:run:{run}" + (f":{suffix}" if suffix else "")


def key_digest(item_key: str) -> bytes:
    """The 16 raw bytes of a 32-hex item key, as stored in Redis (half the memory of hex)."""
    return bytes.fromhex(item_key)


@dataclass(frozen=True, slots=True)
class RunInfo:
    name: str
    settings: RunSettings
    created_at: float
    version: str

    @property
    def fingerprint(self) -> str:
        return self.settings.fingerprint


class RunStore:
    """Thin adapter over Redis for everything genqueue keeps about runs."""

    def __init__(self, conn: redis.Redis) -> None:
        self.conn = conn

    def get(self, run: str) -> RunInfo | None:
        data = self.conn.hgetall(run_key(run))
        if not data or b"settings" not in data:
            return None
        return RunInfo(
            name=run,
            settings=RunSettings.from_json(data[b"settings"]),
            created_at=float(data.get(b"created_at", b"0")),
            version=data.get(b"version", b"?").decode(),
        )

    def require(self, run: str) -> RunInfo:
        info = self.get(run)
        if info is None:
            raise RunNotFoundError(f"no run named {run!r} in Redis (see `producer status` for the runs there)")
        return info

    def create_or_check(self, run: str, settings: RunSettings) -> bool:
        """Create RUN with SETTINGS, or check that it already has exactly them.

        Returns True when the run was created. Raises RunConflictError when the name is taken
        by other settings: re-using it would mix two recipes in one dataset.
        """
        now = time.time()
        created = self.conn.hsetnx(run_key(run), "settings", settings.to_json())
        if created:
            with self.conn.pipeline() as p:
                p.hset(run_key(run), mapping={
                    "fingerprint": settings.fingerprint,
                    "created_at": repr(now),
                    "version": __version__,
                })
                p.zadd(RUNS, {run: now}, nx=True)
                p.execute()
            return True
        existing = self.require(run)
        if existing.settings != settings:
            diff = ", ".join(settings.differences(existing.settings))
            raise RunConflictError(
                f"run {run!r} exists with other settings ({diff}); "
                "use the same options, or name a new run with --run"
            )
        return False

    def names(self) -> list[str]:
        """Every run, oldest first."""
        return [n.decode() for n in self.conn.zrange(RUNS, 0, -1)]

    def known_keys(self, run: str, digests: list[bytes]) -> list[bool]:
        """For each digest, whether the run already holds that item."""
        if not digests:
            return []
        return [bool(x) for x in self.conn.smismember(run_key(run, "keys"), digests)]

    def item_count(self, run: str) -> int:
        return int(self.conn.scard(run_key(run, "keys")))

    def record_source(self, run: str, source: str, summary: dict[str, Any]) -> None:
        self.conn.hset(run_key(run, "sources"), source, orjson.dumps(summary))

    def sources(self, run: str) -> dict[str, dict[str, Any]]:
        raw = self.conn.hgetall(run_key(run, "sources"))
        return {k.decode(): orjson.loads(v) for k, v in raw.items()}

    def stats(self, run: str) -> dict[str, int]:
        raw = self.conn.hgetall(run_key(run, "stats"))
        return {k.decode(): int(v) for k, v in raw.items()}

    def delete(self, run: str) -> None:
        """Forget a run's bookkeeping (not its rq jobs)."""
        self.conn.delete(run_key(run), run_key(run, "keys"), run_key(run, "sources"), run_key(run, "stats"))
        self.conn.zrem(RUNS, run)
