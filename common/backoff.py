"""Pure retry policy: how long to wait before attempt N (no I/O here)."""

from __future__ import annotations

import random

#: Seconds of a request's first full-jitter wait: attempt N waits uniform in [0, min(BACKOFF_CAP, BASE * 2**N)].
BACKOFF_BASE = 0.5
#: The longest wait between a request's attempts (seconds).
BACKOFF_CAP = 30.0
#: Seconds of a failed ship's first wait (and of a run whose packs the store cannot serve now), full jitter.
STORE_BACKOFF_BASE = 0.5
#: The longest wait before a ship is tried again (seconds).
STORE_BACKOFF_CAP = 15.0
#: Doublings of the store's wait at most: 0.5 s reaches 15 s after five.
STORE_BACKOFF_DOUBLINGS = 6


def compute_backoff(attempt: int, *, base: float = BACKOFF_BASE, cap: float = BACKOFF_CAP,
                    rng: random.Random | None = None) -> float:
    """Full-jitter exponential backoff: uniform in [0, min(cap, base * 2**attempt)].

    attempt counts from 0. Jitter spreads a fleet of consumers that saw the same outage,
    so they do not all hit the endpoint again in the same instant.
    """
    if attempt < 0:
        raise ValueError("attempt must be >= 0")
    ceiling = min(cap, base * (2 ** min(attempt, 32)))
    return (rng or random).uniform(0.0, ceiling)


def store_backoff(failures: int, *, rng: random.Random | None = None) -> float:
    """The wait after FAILURES failed tries in a row at an output store (>= 1): shipping a shard
    (consumer/shipping/outbox.py) and asking a run whose packs cannot be read now again
    (consumer/work/intake.py) back off alike, up to STORE_BACKOFF_CAP."""
    return compute_backoff(min(max(failures - 1, 0), STORE_BACKOFF_DOUBLINGS),
                           base=STORE_BACKOFF_BASE, cap=STORE_BACKOFF_CAP, rng=rng)
