"""The one thread every synchronous rq and Redis call of the consumer runs in.

rq is synchronous; the consumer is one asyncio loop. Every rq/Redis call goes through
`RqThread.call`, which runs it in a single dedicated thread (so calls never block the
loop and never run concurrently with each other) and rides out Redis being unreachable:
it retries with jittered backoff until Redis answers, or until a hard stop. A Redis at its
maxmemory (common/keepers/redismem.py: a refused write is not applied) is ridden out the same way:
every write waits, held jobs stay held and results stay in the spool, until memory is freed. The call is
typed with ParamSpec, so a call with the wrong arguments fails type-checking.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import ParamSpec, TypeVar

import redis

from genqueue.common.backoff import compute_backoff
from genqueue.common.keepers.redismem import is_oom

log = logging.getLogger(__name__)

P = ParamSpec("P")
T = TypeVar("T")

#: Errors that say "Redis is not answering", as opposed to "Redis said no".
UNREACHABLE = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)


@dataclass(frozen=True, slots=True)
class RqSnapshot:
    """What the rq thread tells telemetry."""

    unreachable_since: float | None  # epoch seconds; None while Redis answers
    retries: int  # calls retried because Redis was unreachable, since start
    full_since: float | None = None  # epoch seconds; None while Redis takes writes
    full_ended: float | None = None  # monotonic time the last full spell ended


class RqThread:
    """Runs synchronous rq/Redis calls one at a time in a thread of their own."""

    def __init__(self, *, name: str = "rq", quiet: bool = False) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self.quiet = quiet  # a second thread beside the rq one: its Redis trouble is that one's to log
        self.hard_stop = False
        self._unreachable_since: float | None = None
        self._retries = 0
        self._full_since: float | None = None
        self._full_ended: float | None = None
        # set when Redis answers again after being out of reach: the lease renewer renews at once
        # (a Redis back from an older snapshot put the jobs taken since back in their queue)
        self.answers_again = asyncio.Event()

    async def call(self, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T:
        """FN(*args, **kwargs) in the rq thread; retried while Redis is unreachable."""
        return await self.call_until(None, fn, *args, **kwargs)

    async def call_until(self, deadline: float | None, fn: Callable[P, T], /, *args: P.args,
                         **kwargs: P.kwargs) -> T:
        """As call, but retried only until DEADLINE (loop time): then the last error is raised.
        For what a stopping consumer may skip (its leases expire and are swept back)."""
        loop = asyncio.get_running_loop()
        attempt = 0
        while True:
            try:
                result = await loop.run_in_executor(self._pool, lambda: fn(*args, **kwargs))
            except UNREACHABLE as e:
                if self.hard_stop or (deadline is not None and loop.time() >= deadline):
                    raise
                delay = compute_backoff(min(attempt, 5), base=0.5, cap=5.0)
                if self._unreachable_since is None:
                    self._unreachable_since = time.time()
                    self._warn("Redis unreachable (%s: %s); retrying until it answers", type(e).__name__, e)
                attempt += 1
                self._retries += 1
                await asyncio.sleep(delay)
                continue
            except redis.exceptions.ResponseError as e:
                if not is_oom(e) or self.hard_stop or (deadline is not None and loop.time() >= deadline):
                    raise
                if self._full_since is None:
                    self._full_since = time.time()
                    self._warn("Redis is full (it refused a write: used memory > maxmemory): paused; writes wait, "
                                "held jobs stay held and results stay in the spool; going on by itself once memory "
                                "is freed or maxmemory raised (`redis-cli CONFIG SET maxmemory ...`)")
                attempt += 1
                await asyncio.sleep(compute_backoff(min(attempt, 5), base=0.5, cap=5.0))
                continue
            if self._unreachable_since is not None:
                self._warn("Redis answers again after %.1f s", time.time() - self._unreachable_since)
                self._unreachable_since = None
                self.answers_again.set()
            if self._full_since is not None and attempt:  # a write went through: there is room again
                self._warn("Redis takes writes again after %.1f s full; going on", time.time() - self._full_since)
                self._full_since = None
                self._full_ended = time.monotonic()
            return result

    async def once(self, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T:
        """FN in the rq thread, not retried: for best-effort calls at shutdown."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, lambda: fn(*args, **kwargs))

    def _warn(self, msg: str, *args: object) -> None:
        if not self.quiet:
            log.warning(msg, *args)

    def snapshot(self) -> RqSnapshot:
        return RqSnapshot(self._unreachable_since, self._retries, self._full_since, self._full_ended)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
