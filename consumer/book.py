"""The book of held jobs: which jobs this consumer holds, which of their items wait for a
slot, which are in flight, and which jobs are complete and ready to ack (pure, no I/O).

Admission counts prompts, not jobs: items wait in one queue (`pending`) whatever job they
came from, so a job waiting on one slow prompt holds nothing back. A job is complete when
every item has a record in the spool; it is ackable once the shard holding its last record
(its `max_seq`) is shipped.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Generic, TypeVar, cast

from genqueue.common.contracts import ErrorClass, Item, Outcome, Record, ResultRecord, is_error

if TYPE_CHECKING:
    from genqueue.consumer.generate import RunContext

H = TypeVar("H")  # the rq handle of a held job (consumer.rqcompat.Held); any object in unit tests


@dataclass(eq=False)
class JobState(Generic[H]):
    """One held job and its progress here."""

    id: str
    held: H
    ctx: RunContext
    items: list[Item]
    attempt: int
    enqueued_at: float | None
    remaining: int = -1
    started: float = field(default_factory=time.monotonic)
    max_seq: int = 0
    counts: collections.Counter[str] = field(default_factory=collections.Counter)
    abandoned: bool = False
    todo: list[Item] | None = None  # the items still to generate, when not all of them

    def __post_init__(self) -> None:
        if self.remaining < 0:
            self.remaining = len(self.items)

    @property
    def run(self) -> str:
        return self.ctx.run

    @property
    def complete(self) -> bool:
        return self.remaining == 0


# The counter names, made once (recorded() runs for every item).
_OUTCOME_KEY: dict[str, str] = {o: f"outcome_{o}" for o in Outcome}
_FAILED_KEY: dict[str, str] = {c: f"failed_{c}" for c in ErrorClass}


@dataclass(frozen=True, slots=True)
class RunLoad:
    """What this consumer holds of one run: jobs, items waiting for a slot, requests in flight."""

    held_jobs: int = 0
    pending_items: int = 0
    in_flight: int = 0


@dataclass(frozen=True, slots=True)
class BookSnapshot:
    held_jobs: int
    pending_items: int
    in_flight: int
    runs: dict[str, RunLoad] = field(default_factory=dict)


class Book(Generic[H]):
    """Held jobs and their pending items. Every change of state goes through a method here."""

    def __init__(self) -> None:
        self.jobs: dict[str, JobState[H]] = {}
        self._pending: collections.deque[tuple[JobState[H], Item]] = collections.deque()
        self.in_flight = 0
        # per run, so a consumer serving a big and a tiny run reports each its own figures
        self._in_flight_by_run: collections.Counter[str] = collections.Counter()

    # --- taking work ---------------------------------------------------------------
    def hold(self, js: JobState[H]) -> None:
        """Start holding JS; its items wait for a slot."""
        self.jobs[js.id] = js
        self._pending.extend((js, it) for it in (js.items if js.todo is None else js.todo))

    @property
    def pending(self) -> int:
        return len(self._pending)

    def take(self) -> tuple[JobState[H], Item] | None:
        """The next item to send (counted in flight), or None when none waits."""
        while self._pending:
            js, item = self._pending.popleft()
            if js.abandoned:
                continue
            self.in_flight += 1
            self._in_flight_by_run[js.run] += 1
            return js, item
        return None

    def answered(self, run: str | None = None) -> None:
        """An item of RUN taken with take() is no longer in flight (its record may still be
        unwritten). Without RUN only the consumer's total is kept (unit tests)."""
        self.in_flight -= 1
        if run is not None:
            self._in_flight_by_run[run] -= 1
            if self._in_flight_by_run[run] <= 0:
                del self._in_flight_by_run[run]

    # --- results -------------------------------------------------------------------
    def recorded(self, js: JobState[H], rec: Record, seq: int) -> None:
        """REC, a record of one of JS's items, sits in shard SEQ of the spool."""
        js.max_seq = max(js.max_seq, seq)
        js.remaining -= 1
        c = js.counts
        if is_error(rec):
            c["items_failed"] += 1
            cls = rec["error"]["class"]
            c[_FAILED_KEY.get(cls) or f"failed_{cls}"] += 1
            return
        ok = cast(ResultRecord, rec)
        outcome = ok["outcome"]
        c["items_done"] += 1
        c[_OUTCOME_KEY.get(outcome) or f"outcome_{outcome}"] += 1
        usage = ok["usage"]
        c["prompt_tokens"] += usage.get("prompt_tokens", 0)
        c["completion_tokens"] += usage.get("completion_tokens", 0)

    def ackable(self, run: str, shipped_seq: int) -> list[JobState[H]]:
        """Complete jobs of RUN whose last record is in a shard shipped by now (seq <= shipped_seq)."""
        return [js for js in self.jobs.values()
                if js.run == run and js.complete and not js.abandoned and js.max_seq <= shipped_seq]

    def lose_shard(self, run: str, lost_seq: int) -> list[JobState[H]]:
        """Shard LOST_SEQ of RUN is gone before shipping: every job of RUN that may have a
        record in it (max_seq >= lost_seq) is abandoned here and returned (to be redone)."""
        lost = [js for js in self.jobs.values() if js.run == run and js.max_seq >= lost_seq]
        for js in lost:
            self.abandon(js)
        return lost

    def abandon(self, js: JobState[H]) -> None:
        """Stop working on JS: its waiting items are dropped, late records are not written."""
        js.abandoned = True
        self.jobs.pop(js.id, None)
        if any(p[0] is js for p in self._pending):
            self._pending = collections.deque(p for p in self._pending if p[0] is not js)

    def release(self, js: JobState[H]) -> None:
        """JS is acked or given back: forget it."""
        self.jobs.pop(js.id, None)

    # --- stopping ------------------------------------------------------------------
    def drop_pending(self) -> int:
        """Drop every waiting item (a drain gives their jobs back); returns how many."""
        n = len(self._pending)
        self._pending.clear()
        return n

    def busy_runs(self) -> set[str]:
        """Runs with a job whose records are not all written yet."""
        return {js.run for js in self.jobs.values() if not js.complete}

    def runs_held(self) -> set[str]:
        return {js.run for js in self.jobs.values()}

    def __iter__(self) -> Iterator[JobState[H]]:
        return iter(list(self.jobs.values()))

    def __len__(self) -> int:
        return len(self.jobs)

    def snapshot(self) -> BookSnapshot:
        held = collections.Counter(js.run for js in self.jobs.values())
        pending = collections.Counter(js.run for js, _ in self._pending if not js.abandoned)
        runs = {run: RunLoad(held[run], pending[run], self._in_flight_by_run[run])
                for run in sorted(set(held) | set(pending) | set(self._in_flight_by_run))}
        return BookSnapshot(len(self.jobs), len(self._pending), self.in_flight, runs)
