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
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from genqueue.common import defaults
from genqueue.common.engineview import EngineView
from genqueue.consumer.engine.readings import engine_view

log = logging.getLogger(__name__)

#: --concurrency auto: the in-flight limit it starts from.
AUTO_START = 256
#: --concurrency auto: seconds between its reads of the engine's /metrics.
AUTO_INTERVAL = 0.5
#: --concurrency auto: the lowest limit it steers to.
AUTO_MIN = 8

#: Without --concurrency auto, the engine's /metrics are still read this often, for telemetry.
ENGINE_POLL_SECONDS = 5.0


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


@dataclass(frozen=True, slots=True)
class AdmissionSnapshot:
    mode: str  # "auto" or "fixed"
    limit: int  # the in-flight limit now (auto: the steered target)
    engine: EngineView


class Steering:
    """Reads the engine's /metrics (every AUTO_INTERVAL with --concurrency auto, every few
    seconds otherwise, for telemetry) and, with auto, moves the limiter by them."""

    def __init__(self, limiter: Limiter, metrics: Callable[[], Awaitable[str | None]], *, auto: bool,
                 max_concurrency: int, endpoint: str, gate_paused: Callable[[], bool],
                 in_flight: Callable[[], int], on_grow: Callable[[], None]) -> None:
        self.limiter = limiter
        self._metrics = metrics
        self.auto = auto
        self.max_concurrency = max_concurrency
        self.endpoint = endpoint
        self._gate_paused = gate_paused
        self._in_flight = in_flight
        self._on_grow = on_grow
        self.engine: EngineView = {"metrics": False}
        self._warned = False

    async def step(self) -> None:
        if self._gate_paused():
            return  # the endpoint is down: its silence says nothing about /metrics
        self.engine = view = engine_view(await self._metrics())
        if not self.auto:
            return
        running, waiting = view.get("running"), view.get("waiting")
        if not view["metrics"] or running is None or waiting is None:
            if not self._warned:
                log.warning("--concurrency auto: %s has no vLLM /metrics; holding %d in flight",
                            self.endpoint, defaults.CONCURRENCY)
                self.limiter.set_limit(min(defaults.CONCURRENCY, self.max_concurrency))
                self._warned = True
            return
        old = self.limiter.limit
        new = next_limit(old, self._in_flight(), running, waiting, view.get("kv_cache_usage"),
                         lo=AUTO_MIN, hi=self.max_concurrency)
        if new != old:
            self.limiter.set_limit(new)
            log.debug("concurrency %d -> %d (engine running %d, waiting %d)", old, new, running, waiting)
            if new > old:
                self._on_grow()

    async def run(self) -> None:
        interval = AUTO_INTERVAL if self.auto else ENGINE_POLL_SECONDS
        while True:
            await asyncio.sleep(interval)
            await self.step()

    def snapshot(self) -> AdmissionSnapshot:
        return AdmissionSnapshot("auto" if self.auto else "fixed", self.limiter.limit, self.engine)
