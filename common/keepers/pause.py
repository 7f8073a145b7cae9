"""A run's paused state: set by a consumer whose failure-storm breaker tripped, cleared by
`producer resume`. While a run is paused no consumer takes its jobs; other runs go on.

Key: genqueue:run:<run>:paused  (JSON: reason, by, at), absent while the run is not paused.
"""

from __future__ import annotations

from typing import Any, TypedDict

import orjson
import redis

from genqueue.common.keepers.clock import redis_time
from genqueue.common.keepers.keeper import RUN_KEY, RunKeeper


class PauseInfo(TypedDict):
    reason: str  # one line, what tripped and why ("breaker: 8 of the first 8 items failed: ...")
    by: str  # the consumer (rq worker name) that paused it
    at: float  # epoch seconds, Redis's clock (common/keepers/clock.py): status on any node says how long ago


class Pause(RunKeeper):
    """RUN's paused state on CONN: its key, pausing, the reason, resuming."""

    key_template = RUN_KEY + ":paused"

    def pause(self, reason: str, by: str) -> bool:
        """Pause the run with REASON; True if this call paused it (False: it was paused already)."""
        info: PauseInfo = {"reason": reason, "by": by, "at": redis_time(self.conn)}
        return bool(self.conn.set(self.key(self.run), orjson.dumps(info), nx=True))

    def get(self) -> PauseInfo | None:
        """Why the run is paused, or None."""
        return self.of(self.conn.get(self.key(self.run)))

    def stage_get(self, p: Any) -> None:
        """Queue the read of the pause on P (one reply, for `of`): read in one transaction with a
        caller's other reads (common/keepers/runstate.py)."""
        p.get(self.key(self.run))

    @staticmethod
    def of(raw: Any) -> PauseInfo | None:
        """The PauseInfo of the reply stage_get queued, or None (not paused)."""
        if raw is None:
            return None
        if isinstance(raw, Exception):  # a key of another type, read with raise_on_error=False
            return _pause_info(b"(not a string)")
        return _pause_info(raw)

    def resume(self) -> PauseInfo | None:
        """Clear the run's pause; returns what it was (None: it was not paused)."""
        with self.conn.pipeline() as p:
            p.get(self.key(self.run))
            p.delete(self.key(self.run))
            raw, _ = p.execute()
        if raw is None:
            return None
        return _pause_info(raw)

    @classmethod
    def reasons(cls, conn: redis.Redis, names: list[str]) -> dict[str, str]:
        """The runs among NAMES that are paused in Redis, with their reasons (one round trip)."""
        if not names:
            return {}
        raws = conn.mget([cls.key(n) for n in names])
        out: dict[str, str] = {}
        for name, raw in zip(names, raws, strict=True):
            if raw is not None:
                try:
                    out[name] = str(orjson.loads(raw).get("reason", "?"))
                except (orjson.JSONDecodeError, AttributeError):
                    out[name] = "?"
        return out


def _pause_info(raw: bytes | str) -> PauseInfo:
    """A pause as stored; one that cannot be read is still a pause (fail closed), saying so."""
    try:
        data = orjson.loads(raw)
        if isinstance(data, dict):
            return {"reason": str(data.get("reason", "?")), "by": str(data.get("by", "?")),
                    "at": float(data.get("at", 0))}
    except (orjson.JSONDecodeError, TypeError, ValueError):
        pass
    shown = raw[:80].decode("utf-8", "replace") if isinstance(raw, bytes) else raw[:80]
    return {"reason": f"unreadable pause record {shown!r} (`producer resume` clears it)", "by": "?", "at": 0.0}

