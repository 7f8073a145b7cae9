"""A consumer's call for work of a run: its queue is empty here and it has a slot free.

Key: genqueue:run:<run>:hungry  (the calling consumer's rq worker name), kept a few seconds.
Other consumers read it and give back the jobs of the run they hold with nothing sent yet
(consumer/work/intake.py), so the run's last jobs go where they can start at once.
"""

from __future__ import annotations

import redis

from genqueue.common.keepers.runs import run_key


class Hungry:
    """RUN's call for work on CONN: its key, the call, and who calls."""

    def __init__(self, conn: redis.Redis, run: str) -> None:
        self.conn = conn
        self.run = run

    @staticmethod
    def key(run: str) -> str:
        return run_key(run, "hungry")

    def call(self, worker: str, ttl: float) -> None:
        """WORKER calls for work of the run, for TTL seconds."""
        self.conn.set(self.key(self.run), worker, px=int(ttl * 1000))

    def caller(self) -> str | None:
        """The consumer calling for work of the run now, if any."""
        raw = self.conn.get(self.key(self.run))
        return raw.decode(errors="replace") if isinstance(raw, bytes) else None if raw is None else str(raw)

    def other_caller(self, me: str) -> str | None:
        """The consumer other than ME calling for work of the run now, if any: what it holds of
        the run, ME gives back (intake) or offers for copies (hedge), since that one would start
        it sooner."""
        caller = self.caller()
        return None if caller == me else caller
