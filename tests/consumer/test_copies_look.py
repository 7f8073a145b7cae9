"""One look of the end-of-run loop (consumer/copies.py) reads each run's marks at most once: a run
both taken again here and with items set aside for copies elsewhere was looked at by two loops,
each reading the marks of every item held (a round trip and a script over up to thousands of
keys, per run, per look). In-process: a book and a dispatcher of their own, the Redis calls
counted as the rq thread would make them."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable
from typing import Any

import redis

from genqueue.consumer.copies import Copier
from tests.doubles import run_context


class CountingRq:
    """The rq thread's call(), counting each Redis read by name and answering it empty."""

    def __init__(self) -> None:
        self.calls: Counter[tuple[str, str]] = Counter()

    async def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        run = getattr(getattr(fn, "__self__", None), "run", "")
        self.calls[(fn.__name__, run)] += 1
        return {"done_of": set(), "claimed_by_others": set(), "offer": None, "offers": []}.get(fn.__name__)


class Book:
    """A book holding a job of run r taken again, and items of r set aside for copies elsewhere;
    run s only taken again, run t only set aside."""

    def retaken_runs(self) -> set[str]:
        return {"r", "s"}

    def aside_runs(self) -> set[str]:
        return {"r", "t"}

    def pending_of(self, run: str) -> list[str]:
        return []

    def aside_keys(self, run: str) -> set[str]:
        return {f"{run}-k"}

    def set_aside(self, run: str, claimed: set[str]) -> int:
        return 0

    def put_back(self, run: str, claimed: set[str]) -> int:
        return 0


class Holding:
    """A dispatcher holding items of r, s and t (nothing in flight to offer, no copy slot)."""

    def __init__(self) -> None:
        self.unclaimed: list[tuple[str, str]] = []
        self.copies_failed: set[tuple[str, str]] = set()

    def cut_copies(self, runs: set[str]) -> int:
        return 0

    def held_runs(self) -> set[str]:
        return set()  # none asked of others' calls for work: that read is not the one counted here

    def held_keys(self, run: str) -> list[str]:
        return [f"{run}-k"]

    def held_items(self, run: str) -> list[Any]:
        return []

    def copy_slots(self) -> int:
        return 0


def _looks(tail: list[str]) -> Counter[tuple[str, str]]:
    rq = CountingRq()
    contexts = {run: run_context(run) for run in ("r", "s", "t")}
    h = Copier(rq, redis.Redis(), "me", Holding(), contexts=lambda: contexts,  # type: ignore[arg-type]
               tail_runs=lambda: tail, stopped=set, book=Book())  # type: ignore[arg-type]
    asyncio.run(h.look())
    return rq.calls


def test_a_run_retaken_and_with_items_set_aside_has_its_marks_read_once_a_look() -> None:
    # was: done_of 2 times for r (once as retaken, once as set aside); now: once for each run
    calls = _looks(tail=[])
    assert {run: n for (name, run), n in calls.items() if name == "done_of"} == {"r": 1, "s": 1, "t": 1}, calls
    # the set-aside runs still have their claims looked at; the run only retaken does not
    assert {run for (name, run) in calls if name == "claimed_by_others"} == {"r", "t"}, calls


def test_a_run_at_its_end_has_its_marks_read_once_a_look_too() -> None:
    calls = _looks(tail=["r"])
    assert {run: n for (name, run), n in calls.items() if name == "done_of"} == {"r": 1, "s": 1, "t": 1}, calls
