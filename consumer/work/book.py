"""The book of held jobs: which jobs this consumer holds, which of their items wait for a
slot, which are in flight, and which jobs are complete and ready to ack (pure, no I/O).

Admission counts prompts, not jobs: items wait in one queue per run whatever job they came
from, so a job waiting on one slow prompt holds nothing back. Which run's item a free slot
takes: the highest priority with an item waiting, then, among runs of equal priority, the one
with the fewest requests in flight here (so equal runs share the slots evenly, a small run's
items go out as soon as it has any, and a higher run takes every slot that frees up without
cutting a request short). That choice looks at the runs with items waiting: a handful, not
the items. A job is complete when every item has a record in the spool; it is ackable once
the shard holding its last record (its `max_seq`) is shipped.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Generic, TypeVar, cast

from genqueue.common.contracts import ErrorClass, Item, Outcome
from genqueue.common.keepers.marks import Place
from genqueue.common.records import Record, ResultRecord, is_error

if TYPE_CHECKING:
    from genqueue.consumer.answer.generate import RunContext

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
    sent: int = 0  # items taken to send: a job with none is whole here, and can be given back
    places: dict[str, Place] | None = None  # by reference: each item's place (its pack, its slot), by key
    retaken: bool = False  # taken before, or with items done already: its marks are looked at again while held

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
        # Items waiting for a slot, per run; a run is a key only while it has some waiting.
        self._queues: dict[str, collections.deque[tuple[JobState[H], Item]]] = {}
        self._waiting = 0
        self.in_flight = 0
        self._flying: collections.Counter[str] = collections.Counter()  # in flight per run
        self._priority: dict[str, int] = {}
        self._share: dict[str, int] = {}  # items each run may hold waiting (the intake's, shares.py)
        self.below_share = False  # the last take left its run under its share: time to fetch
        # Waiting items another consumer is copying (claimed, consumer/copies.py), per run and key:
        # not sent here while the copy lives, back in the queue when it ends without a result.
        self._aside: dict[str, dict[str, tuple[JobState[H], Item]]] = {}

    # --- taking work ---------------------------------------------------------------
    def hold(self, js: JobState[H]) -> None:
        """Start holding JS; its items wait for a slot. A job held here already (taken again after
        a Redis rewind) is held once: the earlier hold is abandoned, so its waiting items are not
        sent twice."""
        before = self.jobs.get(js.id)
        if before is not None and before is not js:
            self.abandon(before)
        self.jobs[js.id] = js
        todo = js.items if js.todo is None else js.todo
        if todo:
            q = self._queues.get(js.run)
            if q is None:
                q = self._queues[js.run] = collections.deque()
            q.extend((js, it) for it in todo)
            self._waiting += len(todo)

    def set_priorities(self, priorities: dict[str, int]) -> None:
        """Each run's priority (absent: 0), as Redis has it now."""
        self._priority = dict(priorities)

    def set_shares(self, shares: dict[str, int]) -> None:
        """How many items each run may hold waiting, as the intake last computed it."""
        self._share = shares

    @property
    def pending(self) -> int:
        return self._waiting

    def pending_of(self, run: str) -> int:
        q = self._queues.get(run)
        return len(q) if q is not None else 0

    def in_flight_of(self, run: str) -> int:
        return self._flying[run]

    def take(self) -> tuple[JobState[H], Item] | None:
        """The next item to send (counted in flight), or None when none waits."""
        while self._waiting:
            run = self._next_run()
            q = self._queues[run]
            js, item = q.popleft()
            self._waiting -= 1
            self.below_share = len(q) < self._share.get(run, 0)
            if not q:
                del self._queues[run]
            if js.abandoned:
                continue
            self.in_flight += 1
            self._flying[run] += 1
            js.sent += 1
            return js, item
        return None

    def _next_run(self) -> str:
        """The run whose item takes the next slot (module docstring); one run waiting: it."""
        queues = self._queues
        if len(queues) == 1:
            return next(iter(queues))
        prio, flying = self._priority, self._flying
        best, key = "", (0, 0)
        for run in queues:
            k = (prio.get(run, 0), -flying[run])
            if not best or k > key:
                best, key = run, k
        return best

    def answered(self, js: JobState[H]) -> None:
        """An item of JS taken with take() is no longer in flight (its record may still be unwritten)."""
        self.in_flight -= 1
        self._flying[js.run] -= 1

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

    def won_elsewhere(self, js: JobState[H]) -> None:
        """An item of JS needs no record here: a result of it is in a shard shipped by another
        consumer (a copy at the end of the run, consumer/copies.py), so the item is done."""
        js.remaining -= 1
        js.counts["items_done"] += 1
        js.counts["items_won_elsewhere"] += 1

    def pending_items(self, run: str) -> list[tuple[JobState[H], Item]]:
        """RUN's items waiting here for a slot, in the order they go."""
        q = self._queues.get(run)
        return [(js, it) for js, it in q if not js.abandoned] if q is not None else []

    def waiting_runs(self) -> set[str]:
        """The runs with items waiting here."""
        return set(self._queues)

    def drop_done(self, run: str, keys: set[str]) -> list[JobState[H]]:
        """Drop RUN's waiting items (set aside or not) whose KEYS are marked done elsewhere
        (won_elsewhere each); returns their jobs, once per item."""
        if not keys:
            return []
        ended = self._drop_waiting(run, lambda js, it: it["key"] in keys and not js.abandoned)
        aside = self._aside.get(run)
        if aside:
            for key in keys & aside.keys():
                js, _ = aside.pop(key)
                if not js.abandoned:
                    ended.append(js)
            if not aside:
                del self._aside[run]
        for js in ended:
            self.won_elsewhere(js)
        return ended

    def set_aside(self, run: str, claimed: set[str]) -> int:
        """RUN's waiting items whose copy another consumer runs (their keys CLAIMED) are not sent
        here while it does: a copy of an item that waits is its transfer, and sending it here too
        would make it twice. Returns how many were set aside."""
        if not claimed:
            return 0
        moved = self._take_waiting(run, lambda js, it: it["key"] in claimed and not js.abandoned)
        if moved:
            aside = self._aside.setdefault(run, {})
            for js, it in moved:
                aside[it["key"]] = (js, it)
        return len(moved)

    def put_back(self, run: str, claimed: set[str]) -> int:
        """RUN's items set aside whose copy is no longer claimed (it ended without a result, or its
        consumer is gone) wait for a slot here again, first. Returns how many."""
        aside = self._aside.get(run)
        if not aside:
            return 0
        back = [(js, it) for key, (js, it) in aside.items() if key not in claimed and not js.abandoned]
        for key in [key for key, (js, _) in aside.items() if key not in claimed or js.abandoned]:
            del aside[key]
        if not aside:
            del self._aside[run]
        if back:
            q = self._queues.get(run)
            if q is None:
                q = self._queues[run] = collections.deque()
            q.extendleft(reversed(back))
            self._waiting += len(back)
        return len(back)

    def aside_keys(self, run: str) -> list[str]:
        """The keys of RUN's items set aside here (set_aside)."""
        return list(self._aside.get(run, ()))

    def aside_runs(self) -> set[str]:
        """The runs with items set aside here."""
        return set(self._aside)

    def _drop_waiting(self, run: str, drop: Callable[[JobState[H], Item], bool]) -> list[JobState[H]]:
        """Take RUN's waiting items for which DROP holds out of its queue (in order, the count kept
        right); returns their jobs, once per item."""
        return [js for js, _ in self._take_waiting(run, drop)]

    def _take_waiting(self, run: str, drop: Callable[[JobState[H], Item], bool]) -> list[tuple[JobState[H], Item]]:
        """`_drop_waiting`, returning the items taken out with their jobs."""
        q = self._queues.get(run)
        if q is None:
            return []
        kept: collections.deque[tuple[JobState[H], Item]] = collections.deque()
        dropped: list[tuple[JobState[H], Item]] = []
        for js, it in q:
            if drop(js, it):
                dropped.append((js, it))
            else:
                kept.append((js, it))
        if dropped:
            self._waiting -= len(dropped)
            if kept:
                self._queues[run] = kept
            else:
                del self._queues[run]
        return dropped

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
        self._drop_waiting(js.run, lambda owner, _it: owner is js)
        aside = self._aside.get(js.run)
        if aside:
            for key in [key for key, (owner, _) in aside.items() if owner is js]:
                del aside[key]
            if not aside:
                del self._aside[js.run]

    def retaken_runs(self) -> set[str]:
        """The runs with a job held here taken again (JobState.retaken) whose records are not all written."""
        return {js.run for js in self.jobs.values() if js.retaken and not js.complete and not js.abandoned}

    def unsent(self, run: str) -> list[JobState[H]]:
        """Jobs of RUN of which nothing was sent yet (whole jobs: only those can go back to the
        queue without losing work or redoing any)."""
        return [js for js in self.jobs.values()
                if js.run == run and js.sent == 0 and not js.complete and not js.abandoned]

    def release(self, js: JobState[H]) -> None:
        """JS is acked or given back: forget it."""
        self.jobs.pop(js.id, None)

    # --- stopping ------------------------------------------------------------------
    def drop_pending(self) -> int:
        """Drop every waiting item (a drain gives their jobs back); returns how many."""
        n = self._waiting
        self._queues.clear()
        self._aside.clear()
        self._waiting = 0
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
        pending = collections.Counter(js.run for queue in self._queues.values() for js, _ in queue
                                      if not js.abandoned)
        runs = {run: RunLoad(held[run], pending[run], self._flying[run])
                for run in sorted(set(held) | set(pending) | {r for r, n in self._flying.items() if n})}
        return BookSnapshot(len(self.jobs), self._waiting, self.in_flight, runs)
