"""The failure-storm breaker (consumer/breaker.py)."""

from __future__ import annotations

from typing import Any

from genqueue.consumer.breaker import Breaker, BreakerSettings
from tests.doubles import item, result


# --- the failure-storm breaker -------------------------------------------------------------
def error_rec(i: int, cls: str, message: str) -> Any:
    return {"key": item(i)["key"], "error": {"class": cls, "type": "E", "status": 400, "message": message}}


def test_a_storm_of_identical_permanent_failures_trips_the_breaker_within_the_first_items() -> None:
    b = Breaker(BreakerSettings(first_n=8, window=100, rate=0.5, same=0.8))
    trips = [b.record(error_rec(i, "permanent", f"HTTP 400: you requested {9000 + i} tokens")) for i in range(20)]
    assert trips[:7] == [None] * 7
    assert trips[7] is not None and "first 8 items all failed" in trips[7] and "HTTP N" in trips[7]
    assert trips[8:] == [None] * 12, "it trips once"


def test_a_storm_after_a_healthy_start_trips_on_the_window() -> None:
    b = Breaker(BreakerSettings(first_n=8, window=20, rate=0.5, same=0.8))
    for i in range(30):
        assert b.record(result(item(i))) is None
    trips = [b.record(error_rec(i, "bad_response", "choices is empty")) for i in range(10)]
    assert trips[-1] is not None and "10 of the last 20" in trips[-1]


def test_healthy_runs_with_genuine_failures_and_transient_faults_never_trip() -> None:
    import random

    rng = random.Random(7)
    b = Breaker()
    for i in range(20_000):
        r = rng.random()
        if r < 0.04:  # genuine permanent failures, each its own prompt (messages differ in words)
            rec = error_rec(i, "permanent", f"prompt {rng.choice(['too long', 'has bad tool', 'rejected'])} x{i}")
        elif r < 0.10:  # transient faults that exhausted their attempts: never counted
            rec = error_rec(i, "transient_exhausted", "HTTP 503")
        else:
            rec = result(item(i))
        assert b.record(rec) is None, f"tripped at item {i}"
    # and an opening run of failures that disagree is no storm
    b2 = Breaker()
    assert all(b2.record(error_rec(i, "permanent", m)) is None
               for i, m in enumerate(["a", "b", "c", "d", "e", "f", "g", "h"]))
