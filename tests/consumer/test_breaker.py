"""The failure-storm breaker (consumer/guards/breaker.py)."""

from __future__ import annotations

from typing import Any

from genqueue.consumer.guards.breaker import Breaker, BreakerSettings
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
        elif r < 0.10:  # transient faults that exhausted their attempts: counted, scattered
            rec = error_rec(i, "transient_exhausted", "HTTP 503")
        else:
            rec = result(item(i))
        assert b.record(rec) is None, f"tripped at item {i}"
    # and an opening run of failures that disagree is no storm
    b2 = Breaker()
    assert all(b2.record(error_rec(i, "permanent", m)) is None
               for i, m in enumerate(["a", "b", "c", "d", "e", "f", "g", "h"]))


def status_rec(i: int, status: int, message: str = "injected failure") -> Any:
    return {"key": item(i)["key"], "error": {"class": "transient_exhausted", "type": "TransientError",
                                             "status": status, "message": f"HTTP {status}: {message}"}}


def test_an_engine_answering_5xx_to_every_request_trips_it_within_the_first_items() -> None:
    for status in (500, 502, 503):
        b = Breaker()
        trips = [b.record(status_rec(i, status)) for i in range(8)]
        assert trips[:7] == [None] * 7
        reason = trips[7]
        assert reason is not None and "the first 8 items all failed with transient_exhausted" in reason
        assert f"(the last: HTTP {status}: injected failure)" in reason, reason


def test_an_engine_that_breaks_mid_run_trips_it_on_failures_in_a_row() -> None:
    b = Breaker()  # the defaults: 24 in a row
    for i in range(500):
        assert b.record(result(item(i))) is None
    msgs = ["HTTP 502: bad gateway", "HTTP 503: overloaded", "ClientOSError: reset"]  # whatever they say
    trips = [b.record(error_rec(500 + i, "transient_exhausted", msgs[i % 3])) for i in range(40)]
    assert trips[:23] == [None] * 23, "a healthy window would not see it for 26 more items"
    reason = trips[23]
    assert reason is not None and reason.startswith("24 items in a row failed, 8 with transient_exhausted"), reason
    assert trips[24:] == [None] * 16


def test_a_success_between_failures_restarts_the_count() -> None:
    b = Breaker(BreakerSettings(first_n=8, in_a_row=5, window=1000, rate=0.9, same=0.9))
    for i in range(8):
        b.record(result(item(i)))
    for i in range(40):  # four failures, then a success, over and over: 80% failing, never 5 in a row
        rec = result(item(i)) if i % 5 == 4 else status_rec(i, 500)
        assert b.record(rec) is None, i
    assert [b.record(status_rec(100 + i, 500)) for i in range(5)][-1] is not None
