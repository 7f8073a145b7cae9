"""Pure retry policy: how long to wait before attempt N (no I/O here)."""

from __future__ import annotations

import random

from genqueue.common import defaults


def compute_backoff(attempt: int, *, base: float = defaults.BACKOFF_BASE, cap: float = defaults.BACKOFF_CAP,
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
    return compute_backoff(min(max(failures - 1, 0), defaults.STORE_BACKOFF_DOUBLINGS),
                           base=defaults.STORE_BACKOFF_BASE, cap=defaults.STORE_BACKOFF_CAP, rng=rng)
