"""Faults of the generation endpoint and what to do about each (pure policy, no I/O).

The one room for a rule about a failed request: the endpoint's exceptions (EndpointError:
TransientError, retried; PermanentError, recorded; and their kinds), the HTTP status table, the
name a failed attempt is counted under (`RetryKind`, the `genqueue_request_retries` series),
the decision after a failed attempt (retry or give up, how long to wait, whether to ask the
Gate), the `ErrorClass` an item's error record gets once the attempts are spent, and which
classes the failure-storm breaker counts. client.py raises what is defined here, generate.py
asks `RetryPolicy` what to do, records.py writes `error_class`, consumer/guards/breaker.py
counts `STORM_CLASSES`, consumer/telemetry.py names `RetryKind`; the capture wing raises the
capture's and the tables' kinds (BadCaptureError, BadLogprobsError).

Fail closed: every failed attempt (refused, reset, deadline, 5xx, a 200 that is not a usable
completion) spends one of `max_attempts` and backs off with jitter, whatever /health says, so
a misbehaving server gets a bounded number of requests per item.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from genqueue.common.backoff import BACKOFF_BASE, BACKOFF_CAP, compute_backoff
from genqueue.common.contracts import ErrorClass
from genqueue.common.errors import GenqueueError

__all__ = ["PERMANENT_STATUSES", "STORM_CLASSES", "BadCaptureError", "BadLogprobsError", "BadResponseError",
           "DeadlineExceeded", "EndpointDown", "EndpointError", "NextStep", "PermanentError", "RetryKind",
           "RetryPolicy", "TransientError", "classify_status", "error_class", "retry_kind"]


class EndpointError(GenqueueError):
    """Trouble talking to the generation endpoint."""

    def __init__(self, message: str, *, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class TransientError(EndpointError):
    """Connection refused or reset, timeout, 408/429/5xx: retried with jittered backoff."""


class BadResponseError(TransientError):
    """A 200 whose body is not a usable chat completion (empty, not JSON, cut short, or missing
    or mistyped fields): never counted as an answer. Retried like any transient fault, since a
    proxy or a restarting server can garble one response; recorded as `bad_response` once the
    attempts are spent, with `snippet` (at most 200 characters of the body) in the message."""

    def __init__(self, reason: str, *, snippet: str, status: int | None = 200) -> None:
        super().__init__(f"{reason}: {snippet!r}" if snippet else reason, status=status)
        self.reason = reason
        self.snippet = snippet


class PermanentError(EndpointError):
    """400/404/413/422 and the like: the request itself is wrong; recorded, never retried."""


class BadCaptureError(PermanentError):
    """--capture: the hidden states the engine captured for an answer do not fit it (their token
    ids are not the answer's prompt and completion ids but the last, their layers or width are
    not the capture's, or the file cannot be read). Never stored as a row: the item's record is
    an error of class bad_capture, and the request is not sent again."""


class BadLogprobsError(PermanentError):
    """--logprobs: the log-probability tables the engine returned for an answer do not fit it (none,
    sampled ids that are not its completion ids, a table of another width, unsorted, NaN, or
    summing past 1). Never stored as a row: the item's record is an error of class
    bad_logprobs, and the request is not sent again."""

#: Statuses that say the request itself is wrong: retrying cannot help.
PERMANENT_STATUSES = frozenset({400, 404, 413, 422})


def classify_status(status: int) -> type[TransientError | PermanentError]:
    """Which error class an HTTP status belongs to (408, 429, 5xx and anything odd retry)."""
    return PermanentError if status in PERMANENT_STATUSES else TransientError


class EndpointDown(TransientError):
    """The endpoint could not be reached or dropped the connection (refused, reset, closed
    before answering). Spends an attempt like any transient fault; whether the endpoint is
    really down is for the Gate's /health check to say."""


class EndpointRefused(EndpointDown):
    """The endpoint refused the connection (nothing listens): the one failure no healthy
    /health answer given a moment ago can outweigh, so the Gate checks again at once."""


class DeadlineExceeded(TransientError):
    """No complete response within request_timeout (a hung or trickling server)."""


class RetryKind(StrEnum):
    """What a failed attempt is counted as (the `kind` label of genqueue_request_retries and
    the keys of Generator.failures). The values are the exception names: the label values
    dashboards and tests read."""

    TRANSIENT = "TransientError"  # 5xx, 408/429, a body cut off, a server-aborted request
    ENDPOINT_DOWN = "EndpointDown"
    DEADLINE = "DeadlineExceeded"
    BAD_RESPONSE = "BadResponseError"


def retry_kind(e: TransientError) -> RetryKind:
    """The kind a failed attempt that raised E is counted under (the most specific class)."""
    if isinstance(e, EndpointDown):
        return RetryKind.ENDPOINT_DOWN
    if isinstance(e, DeadlineExceeded):
        return RetryKind.DEADLINE
    if isinstance(e, BadResponseError):
        return RetryKind.BAD_RESPONSE
    return RetryKind.TRANSIENT


def error_class(e: EndpointError) -> ErrorClass:
    """The class of the error record an item gets when its request ended in E (a permanent
    refusal, or the last transient failure once the attempts are spent)."""
    if isinstance(e, BadCaptureError):
        return ErrorClass.BAD_CAPTURE
    if isinstance(e, BadLogprobsError):
        return ErrorClass.BAD_LOGPROBS
    if isinstance(e, PermanentError):
        return ErrorClass.PERMANENT
    if isinstance(e, BadResponseError):
        return ErrorClass.BAD_RESPONSE
    return ErrorClass.TRANSIENT_EXHAUSTED


#: The error classes the failure-storm breaker counts: every way an item's request can end in
#: an error record, transient trouble past its attempts included (an engine answering 500 to
#: every request burns the dataset as surely as one answering 400). Left out: invalid_item (what
#: a job carried, not what the engine said), job_failed and pack_unreadable (export's, never a
#: record's).
STORM_CLASSES = frozenset(ErrorClass) - {ErrorClass.INVALID_ITEM, ErrorClass.JOB_FAILED, ErrorClass.PACK_UNREADABLE}


@dataclass(frozen=True, slots=True)
class NextStep:
    """What to do after a failed attempt."""

    kind: RetryKind  # what the attempt is counted as
    give_up: bool  # the attempts are spent: the error goes into the record
    delay: float  # seconds to wait before the next attempt (0 when giving up)
    ask_gate: bool  # ask the Gate whether the endpoint is down before waiting


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """Bounded retries with full-jitter exponential backoff (common/backoff.py)."""

    max_attempts: int
    backoff_base: float = BACKOFF_BASE
    backoff_cap: float = BACKOFF_CAP

    def after(self, e: TransientError, attempt: int) -> NextStep:
        """The step after ATTEMPT (counted from 1) failed with E. Every failed attempt asks
        the Gate: its /health check is shared by every request failing at once and trusted
        for a probe interval, so asking costs one check per outage, not one per request."""
        kind = retry_kind(e)
        if attempt >= self.max_attempts:
            return NextStep(kind, give_up=True, delay=0.0, ask_gate=False)
        delay = compute_backoff(attempt - 1, base=self.backoff_base, cap=self.backoff_cap)
        return NextStep(kind, give_up=False, delay=delay, ask_gate=True)
