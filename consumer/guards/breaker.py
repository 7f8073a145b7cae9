"""The failure-storm breaker: a run whose items fail at a rate no healthy run shows is
stopped before it burns the dataset (pure policy, no I/O).

It counts every error record of the classes faults.STORM_CLASSES names (permanent,
bad_response, truncated, internal, and transient_exhausted: a 5xx, a reset or a deadline past
the item's attempts), grouped by class and the first line of their message. A storm is (a) the
first `first_n` items of the run on this consumer all failing with one such signature, (b)
`in_a_row` items in a row failing, whatever they say (an engine that broke mid-run), or (c) at
least `rate` of the last `window` items failing, with one signature making up at least `same`
of those failures. Genuine per-item failures (a few prompts too long for the context, a 5xx
now and then) are spread over many items and signatures: they do not trip it. An endpoint
that is down is not counted here: its requests wait without spending attempts (the Gate).
The trip's reason ends with what the last failure said, its status and numbers kept.
"""

from __future__ import annotations

import collections
import re
from dataclasses import dataclass

from genqueue.common.records import ErrorRecord, Record, is_error
from genqueue.consumer.answer.faults import STORM_CLASSES

#: A run pauses when its first this many items all fail with one message (by chance at 5% failing: 4e-11).
BREAKER_FIRST_N = 8
#: ... or when this many items in a row fail, whatever they say: an engine broken mid-run (6e-32 by chance).
BREAKER_IN_A_ROW = 24
#: ... or when, of the last this many items, BREAKER_RATE fail and BREAKER_SAME of those say the same:
BREAKER_WINDOW = 100
#: ... the share failing (50 of 100: a binomial tail below 1e-40 for a healthy run at 5%),
BREAKER_RATE = 0.5
#: ... and the share of those with one message (a healthy run's failures carry many messages).
BREAKER_SAME = 0.8

_DIGITS = re.compile(r"\d+")


@dataclass(frozen=True, slots=True)
class BreakerSettings:
    first_n: int = BREAKER_FIRST_N
    in_a_row: int = BREAKER_IN_A_ROW
    window: int = BREAKER_WINDOW
    rate: float = BREAKER_RATE
    same: float = BREAKER_SAME


def signature(rec: Record) -> str | None:
    """What a storm failure says (class and the first line of its message), or None when REC
    is not a failure that counts."""
    if not is_error(rec):
        return None
    err = rec["error"]
    if err["class"] not in STORM_CLASSES:
        return None
    first = (err.get("message") or "").splitlines()[0:1]
    # Numbers differ per item ("you requested 900 tokens (800 in the messages...)"): one storm.
    return f"{err['class']}: {_DIGITS.sub('N', first[0] if first else '')[:200]}"


def said(rec: ErrorRecord) -> str:
    """What the failure REC says, numbers kept: the HTTP status and the server's message."""
    err = rec["error"]
    first = (err.get("message") or "").splitlines()[0:1]
    text = (first[0] if first else "")[:200] or err["type"]
    status = err.get("status")
    return text if status is None or str(status) in text else f"status {status}: {text}"


class Breaker:
    """One per run on a consumer. `record` returns the trip reason once, then None."""

    def __init__(self, settings: BreakerSettings | None = None) -> None:
        self.s = settings or BreakerSettings()
        self.seen = 0
        self.recent: collections.deque[str | None] = collections.deque()
        self.failures: collections.Counter[str] = collections.Counter()  # signatures in `recent`
        self.failed = 0  # failures in `recent`
        self.streak = 0  # failures since the last success
        self.tripped: str | None = None

    def record(self, rec: Record) -> str | None:
        """Count REC (on the hot path: O(1) for a success)."""
        if self.tripped is not None:
            return None
        sig = signature(rec)
        self.seen += 1
        self.recent.append(sig)
        if sig is not None:
            self.failures[sig] += 1
            self.failed += 1
        if len(self.recent) > self.s.window:
            old = self.recent.popleft()
            if old is not None:
                self.failures[old] -= 1
                self.failed -= 1
        if sig is None:
            self.streak = 0
            return None  # a success never trips it
        self.streak += 1
        reason = self._storm(sig)
        if reason is not None:
            self.tripped = reason = f"{reason} (the last: {said(rec) if is_error(rec) else '?'})"
        return reason

    def _storm(self, sig: str) -> str | None:
        s = self.s
        n = self.failures[sig]
        if self.seen == s.first_n and n == s.first_n:
            return f"the first {s.first_n} items all failed with {sig}"
        if self.streak == s.in_a_row:
            top, n = collections.Counter(list(self.recent)[-s.in_a_row:]).most_common(1)[0]
            return f"{s.in_a_row} items in a row failed, {n} with {top}"
        if len(self.recent) == s.window and self.failed >= s.rate * s.window:
            top, n = self.failures.most_common(1)[0]
            if n >= s.same * self.failed:
                return f"{self.failed} of the last {s.window} items failed, {n} with {top}"
        return None
