"""How a --burst consumer's served runs ended: a run drained with items whose only record is
an error did not succeed, and the consumer's exit says so (ExitCode.FAILED_ITEMS), naming the
command that queues those items again once the cause is fixed."""

from __future__ import annotations

import asyncio

import redis

from genqueue.common.errors import CorruptStateError
from genqueue.common.keepers.marks import SHIPPED_FAILED, Marks
from genqueue.common.keepers.runs import RunStore
from genqueue.common.redact import redact
from genqueue.common.retryhint import failed_summary, next_steps
from genqueue.consumer.rqthread import RqThread


def _failed(conn: redis.Redis, run: str) -> str | None:
    """RUN's failed-for-good line, or None when none of its items ended as an error."""
    p = Marks(conn, run).progress()
    if not p.failed_only:
        return None
    by_class = {k[len(SHIPPED_FAILED):]: v for k, v in p.stats.items() if k.startswith(SHIPPED_FAILED)}
    store = RunStore(conn)
    info = store.get(run)
    output = redact(info.settings.output) if info is not None else None
    steps = next_steps(run, paused=False, failed=p.failed_only, sources=store.sources(run), output=output)
    return f"{failed_summary(p.failed_only, by_class)} of {p.items:,}; {steps}"


async def failed_runs(rq: RqThread, conn: redis.Redis, runs: list[str], timeout: float) -> dict[str, str]:
    """The runs among RUNS with items that ended as errors, with what to say of each. Best
    effort within TIMEOUT: a Redis that does not answer at the end says nothing here."""
    out: dict[str, str] = {}
    for run in runs:
        try:
            line = await asyncio.wait_for(rq.once(_failed, conn, run), timeout=timeout)
        except (TimeoutError, redis.exceptions.RedisError, CorruptStateError):
            continue
        if line is not None:
            out[run] = line
    return out
