"""One clock for every time another process judges: Redis's own (`TIME`).

A lease's expiry is written by the consumer that holds it and compared by every consumer that
sweeps; with each using its own clock, one node without NTP (or a VM back from a suspend) sees
live leases of others as expired, or its own are swept while it works them. Redis's clock is
the one they all share, so every score written and every expiry compared is in Redis time:
the local clock plus an offset (redis time - local time) measured at the midpoint of a `TIME`
round trip, at start and again at each lease renewal.
"""

from __future__ import annotations

import logging
import time

import redis

log = logging.getLogger(__name__)

#: A round trip longer than this (seconds) says little about the clock offset.
MAX_TRUSTED_RTT = 0.5


def redis_time(conn: redis.Redis) -> float:
    """Redis's clock now, in seconds since the epoch (one round trip)."""
    sec, usec = conn.time()
    return int(sec) + int(usec) / 1e6


class RedisClock:
    """Local time corrected to Redis's. `measure()` does I/O; `now()` never does."""

    def __init__(self, conn: redis.Redis, *, warn_above: float, name: str = "") -> None:
        self.conn = conn
        self.warn_above = warn_above  # |offset| past which the node's clock is worth a warning
        self.name = name
        self.offset: float | None = None  # redis - local, seconds; None until first measured
        self.rtt: float | None = None
        self._warned = False

    def measure(self) -> float:
        """Measure the offset again (one round trip) and return it."""
        t0 = time.time()
        server = redis_time(self.conn)
        t1 = time.time()
        rtt = t1 - t0
        if self.offset is None or rtt <= MAX_TRUSTED_RTT or (self.rtt is not None and rtt <= self.rtt):
            self.offset, self.rtt = server - (t0 + t1) / 2, rtt
        if abs(self.offset) > self.warn_above and not self._warned:
            self._warned = True
            log.warning("%sthis node's clock is %.1f s %s Redis's: leases and sweeps use Redis's clock, but "
                        "fix the node's time (NTP)", f"{self.name}: " if self.name else "", abs(self.offset),
                        "behind" if self.offset > 0 else "ahead of")
        return self.offset

    def now(self) -> float:
        """Redis's time now, by the last measured offset (measured once first if never)."""
        if self.offset is None:
            self.measure()
        return time.time() + (self.offset or 0.0)
