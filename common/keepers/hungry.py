"""A consumer's call for work of a run: its queue is empty here and it has a slot free.

Key: genqueue:run:<run>:hungry  (the calling consumer's rq worker name), kept a few seconds.
Other consumers read it and give back the jobs of the run they hold with nothing sent yet
(consumer/work/intake.py), so the run's last jobs go where they can start at once. A consumer
reads each run's key at most once every LOOK_EVERY seconds (HungryLook), whoever of it asks:
the call lives intake.py HUNGRY_TTL seconds after each empty dequeue, so a look every half of that
misses none, and a busy consumer does not ask Redis several times a second for each run it holds.
"""

from __future__ import annotations

import time

import redis

from genqueue.common.keepers.keeper import RUN_KEY, RunKeeper

#: Seconds between reads of a run's call for work: half its life (consumer/work/intake.py HUNGRY_TTL).
LOOK_EVERY = 1.0


class Hungry(RunKeeper):
    """RUN's call for work on CONN: its key, the call, and who calls."""

    key_template = RUN_KEY + ":hungry"

    def call(self, worker: str, ttl: float) -> None:
        """WORKER calls for work of the run, for TTL seconds."""
        self.conn.set(self.key(self.run), worker, px=int(ttl * 1000))

    def caller(self) -> str | None:
        """The consumer calling for work of the run now, if any."""
        raw = self.conn.get(self.key(self.run))
        return raw.decode(errors="replace") if isinstance(raw, bytes) else None if raw is None else str(raw)


class HungryLook:
    """The calls for work as consumer ME sees them: each run's key read at most once every EVERY
    seconds, the answer shared by whoever asks meanwhile (the intake's balance, the copies' look).
    Called from one thread (the rq thread)."""

    def __init__(self, conn: redis.Redis, me: str, every: float = LOOK_EVERY) -> None:
        self.conn = conn
        self.me = me
        self.every = every
        self._seen: dict[str, tuple[float, str | None]] = {}

    def other_caller(self, run: str) -> str | None:
        """The consumer other than ME calling for work of RUN, as last read, if any: what it
        holds of the run, ME gives back (consumer/work/intake.py) or offers for copies
        (consumer/copies.py), since that one would start it sooner."""
        now = time.monotonic()
        seen = self._seen.get(run)
        if seen is None or now - seen[0] >= self.every:
            seen = self._seen[run] = (now, Hungry(self.conn, run).caller())
        return None if seen[1] == self.me else seen[1]
