"""How many waiting items a consumer holds per run, so that runs share it by priority, then
evenly (pure, no I/O).

The consumer holds about `budget` items waiting for a slot (the intake's low-water mark). If
one run could fill all of it, a run enqueued later would not even be fetched until the first
one's held items drained: so the budget is split. Runs of the highest priority that have work
split it evenly; what they leave (a run whose queue is empty holds only what it has) goes to
the next priority down, and so on. The book then gives each free slot to the highest priority
with an item waiting (consumer/work/book.py): the split only makes sure those items are here.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RunDemand:
    run: str
    priority: int
    waiting: int  # items held here, not yet sent
    live: bool  # its queue may have jobs (it was not found empty a moment ago)


def targets(budget: int, runs: list[RunDemand]) -> dict[str, int]:
    """Items each run may hold waiting here: fetch a job of RUN while it holds fewer. Runs with
    no work (queue empty, nothing waiting) get nothing and take nothing from the others."""
    out: dict[str, int] = {}
    left = budget
    for level in _levels([r for r in runs if r.live or r.waiting]):
        share = max(left // len(level), 1) if left > 0 else 0
        if not out:
            share = max(share, 1)  # the top priority always gets to fetch
        for r in level:
            out[r.run] = share
            # a live run will fill its share; an empty-queue one holds what it has
            left -= max(r.waiting, share) if r.live else r.waiting
    return out


def fetch_order(runs: list[RunDemand], shares: dict[str, int]) -> list[str]:
    """The live runs below their share, the one that needs a job most first: highest priority,
    then the emptiest relative to its share."""
    wanted = [r for r in runs if r.live and r.waiting < shares.get(r.run, 0)]
    wanted.sort(key=lambda r: (-r.priority, r.waiting / shares[r.run]))
    return [r.run for r in wanted]


def _levels(runs: list[RunDemand]) -> list[list[RunDemand]]:
    """RUNS grouped by priority, highest first (order within a group kept)."""
    by: dict[int, list[RunDemand]] = {}
    for r in runs:
        by.setdefault(r.priority, []).append(r)
    return [by[p] for p in sorted(by, reverse=True)]
