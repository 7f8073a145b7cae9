"""The fault policy (consumer/answer/faults.py), pure: statuses, kinds, classes, the step after a failure."""

from __future__ import annotations

import random

import pytest

from genqueue.common.contracts import ErrorClass
from genqueue.consumer.answer.faults import (
    STORM_CLASSES,
    BadResponseError,
    DeadlineExceeded,
    EndpointDown,
    EndpointError,
    PermanentError,
    RetryKind,
    RetryPolicy,
    TransientError,
    classify_status,
    error_class,
    retry_kind,
)
from genqueue.consumer.guards.breaker import signature


def test_status_classes() -> None:
    for s in (400, 404, 413, 422):
        assert classify_status(s) is PermanentError
    for s in (408, 429, 500, 502, 503, 504):
        assert classify_status(s) is TransientError


def test_the_retry_kinds_keep_the_series_names_dashboards_read() -> None:
    # genqueue_request_retries{kind=...}: the names predate the enum and must not move
    assert sorted(RetryKind) == ["BadResponseError", "DeadlineExceeded", "EndpointDown", "TransientError"]


@pytest.mark.parametrize(("error", "kind", "cls"), [
    (TransientError("HTTP 503: busy", status=503), RetryKind.TRANSIENT, ErrorClass.TRANSIENT_EXHAUSTED),
    (EndpointDown("ClientConnectorError"), RetryKind.ENDPOINT_DOWN, ErrorClass.TRANSIENT_EXHAUSTED),
    (DeadlineExceeded("no complete response within 1 s"), RetryKind.DEADLINE, ErrorClass.TRANSIENT_EXHAUSTED),
    (BadResponseError("empty body", snippet=""), RetryKind.BAD_RESPONSE, ErrorClass.BAD_RESPONSE),
])
def test_each_transient_fault_has_its_kind_and_class(error: TransientError, kind: RetryKind, cls: ErrorClass) -> None:
    assert retry_kind(error) is kind
    assert error_class(error) is cls
    # the kind is the exception's own name: a log line and a metric say the same thing
    assert kind == type(error).__name__


def test_a_refused_request_is_permanent() -> None:
    e: EndpointError = classify_status(400)("HTTP 400: too long", status=400)
    assert error_class(e) is ErrorClass.PERMANENT


def test_every_attempt_but_the_last_backs_off_and_asks_the_gate() -> None:
    policy = RetryPolicy(max_attempts=4, backoff_base=0.5, backoff_cap=3.0)
    random.seed(7)
    e = EndpointDown("reset")
    steps = [policy.after(e, attempt) for attempt in (1, 2, 3, 4)]
    assert [s.give_up for s in steps] == [False, False, False, True]
    assert all(s.kind is RetryKind.ENDPOINT_DOWN for s in steps)
    assert [s.ask_gate for s in steps] == [True, True, True, False]
    for attempt, s in zip((1, 2, 3), steps, strict=False):
        assert 0.0 <= s.delay <= min(3.0, 0.5 * 2 ** (attempt - 1))
    assert steps[-1].delay == 0.0
    # full jitter: the waits are spread, not one fixed sleep
    assert len({policy.after(e, 3).delay for _ in range(20)}) > 1


def test_one_attempt_gives_up_at_once() -> None:
    step = RetryPolicy(max_attempts=1).after(TransientError("HTTP 500", status=500), 1)
    assert step.give_up and step.kind is RetryKind.TRANSIENT


def test_the_breaker_counts_only_the_storm_classes() -> None:
    # transient trouble past its attempts counts too: a 500 for every request is a storm
    assert ErrorClass.TRANSIENT_EXHAUSTED in STORM_CLASSES and ErrorClass.INTERNAL in STORM_CLASSES
    assert ErrorClass.INVALID_ITEM not in STORM_CLASSES and ErrorClass.JOB_FAILED not in STORM_CLASSES
    for cls in ErrorClass:
        rec = {"key": "k", "error": {"class": cls.value, "type": "T", "status": None, "message": "m 1"}}
        assert (signature(rec) is not None) == (cls in STORM_CLASSES), cls  # type: ignore[arg-type]
