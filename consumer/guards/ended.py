"""How a --burst consumer's served runs ended: a run drained with items whose only record is
an error did not succeed, and the consumer's exit says so (ExitCode.FAILED_ITEMS), naming the
command that queues those items again once the cause is fixed; nor did a run drained with
items in no job (ExitCode.INCOMPLETE: a producer's claim not queued, jobs rq gave up on, items
lost from the queue), named with where they are and what queues them. The failed items by class
are `producer status`'s and `producer runs`' (common/keepers/outcomes.py outcome_view), so the
exit line and those screens say the same classes, counts and order."""

from __future__ import annotations

import asyncio

import redis

from genqueue.common.contracts import ExitCode
from genqueue.common.errors import CorruptStateError
from genqueue.common.keepers.claims import stalled_line
from genqueue.common.keepers.marks import Marks
from genqueue.common.keepers.outcomes import outcome_view
from genqueue.common.keepers.runs import RunStore
from genqueue.common.redact import redact
from genqueue.common.retryhint import failed_summary, next_steps
from genqueue.consumer.rqthread import RqThread


def _unfinished(conn: redis.Redis, run: str) -> tuple[ExitCode, str] | None:
    """How RUN ended, when it did not succeed: items whose only record is an error
    (FAILED_ITEMS), or, drained, items neither done nor failed (INCOMPLETE: in a producer's
    claim not queued, in jobs rq gave up on, or lost from the queue); with what to say of it."""
    p = Marks(conn, run).progress()
    store = RunStore(conn)
    sources = store.sources(run)
    if p.failed_only:
        by_class = outcome_view(p.stats, p.done, p.failed_only)["failed_by_class"]
        info = store.get(run)
        output = redact(info.settings.output) if info is not None else None
        steps = next_steps(run, paused=False, failed=p.failed_only, sources=sources, output=output)
        return ExitCode.FAILED_ITEMS, f"{failed_summary(p.failed_only, by_class)} of {p.items:,}; {steps}"
    left = p.items - p.done
    if left <= 0:
        return None
    line = stalled_line(conn, run, left, sources)
    if line is None:  # another consumer holds some of its jobs, or they wait: not this consumer's to judge
        return None
    return ExitCode.INCOMPLETE, f"{left:,} of {p.items:,} items not done: {line}"


async def unfinished_runs(rq: RqThread, conn: redis.Redis, runs: list[str],
                          timeout: float) -> dict[str, tuple[ExitCode, str]]:
    """The runs among RUNS that did not succeed (_unfinished), with their exit code and what to
    say of each. Best effort within TIMEOUT: a Redis that does not answer at the end says
    nothing here."""
    out: dict[str, tuple[ExitCode, str]] = {}
    for run in runs:
        try:
            ended = await asyncio.wait_for(rq.once(_unfinished, conn, run), timeout=timeout)
        except (TimeoutError, redis.exceptions.RedisError, CorruptStateError):
            continue
        if ended is not None:
            out[run] = ended
    return out
