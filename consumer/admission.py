"""How many requests a consumer keeps in flight: a limiter whose limit can move, and the
policy that moves it by the engine's own signals (`--concurrency auto`).

The aim: a small queue of waiting requests in front of the engine that never empties (so no
slot ever idles) and never grows without bound (more waiting buys nothing but latency, and
past the KV cache vLLM preempts). vLLM's /metrics gives running and waiting directly.
"""

from __future__ import annotations

import asyncio
import logging
import math

log = logging.getLogger(__name__)


class Limiter:
    """A counting semaphore whose limit may change while permits are held."""

    def __init__(self, limit: int) -> None:
        self.limit = max(1, limit)
        self.used = 0
        self._changed = asyncio.Event()

    async def acquire(self) -> None:
        while self.used >= self.limit:
            self._changed.clear()
            await self._changed.wait()
        self.used += 1

    def release(self) -> None:
        self.used -= 1
        self._changed.set()

    def set_limit(self, limit: int) -> None:
        self.limit = max(1, limit)
        self._changed.set()


def target_waiting(running: float) -> int:
    """How many requests should wait in the engine's queue: enough to refill every slot that
    frees up between two looks at the metrics, a tenth of the batch and at least 4."""
    return max(4, math.ceil(0.1 * running))


def next_limit(limit: int, in_flight: int, running: float, waiting: float, kv_usage: float | None,
               *, lo: int, hi: int) -> int:
    """The next concurrency limit, from the engine's running and waiting counts (pure)."""
    want = target_waiting(running)
    if waiting < want:
        if in_flight < 0.9 * limit:
            return limit  # we lack work, not permits: growing would change nothing
        if kv_usage is not None and kv_usage >= 0.99 and waiting > 0:
            return limit  # the KV cache binds: more requests would only be preempted
        # An empty queue in front of the engine may be idling slots right now: double.
        step = limit + 4 if waiting == 0 else limit // 4 + 2
        return min(hi, limit + step)
    if waiting > 3 * want:
        return max(lo, int(running + 2 * want), limit - int(waiting - 2 * want))
    return limit
