"""The consumer's events: what its parts report, by name, and who hears it.

A part reports through one named hook of `Events` (the outbox `shipped`, the dispatcher
`recorded`, ...), handed to it where its `on_*` callback goes. A hook has at most one duty, the
consumer's own handling (acks, redo), run first: its error reaches the part that reported, as a
direct callback's would. Then each listener hears it, in the order added. A listener that raises
is logged (its traceback the first time, then a line at its 10th, 100th, ... failure) and
counted in genqueue_observer_failures{event}; the consumer and the other listeners go on. A listener is any callable of the hook's signature: `events.shipped.add(fn)` (mypy checks
it), so a new observer is its own module and one registration line in the worker.

The events, and who reports them: `recorded` (the dispatcher: a record of an item or a copy is
written), `shipped` / `features_shipped` / `shard_lost` / `run_gone` (the outbox: a result or
feature shard stored, a shard lost, a shard's run gone from Redis), `ended_elsewhere` (the
dispatcher: a job completed by items whose results another consumer shipped), `arrived_done`
(the intake: a job taken with every item shipped), `runs_resolved` (the intake: the runs served
now), `swept` (the leases: dead consumers' jobs back in a queue), `limit_raised` (admission),
and from the worker's start-up `phase` (what it waits on; None: it serves) and `serving`.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Generic, ParamSpec

from genqueue.common.features import ShardIndex
from genqueue.common.keepers.marks import ShardMarks
from genqueue.common.records import Record
from genqueue.consumer.metrics import OBSERVER_FAILURES

log = logging.getLogger(__name__)

P = ParamSpec("P")

def listener_name(fn: object) -> str:
    """FN as a log line names it: its qualified name (`Telemetry.record`)."""
    return str(getattr(fn, "__qualname__", None) or repr(fn))


class Failures:
    """The listeners that raised, counted by (event, listener); each logged at its 1st failure (with
    the traceback), then at its 10th, 100th, ...: a listener failing on every record cannot flood
    the log, and one failing still is seen there."""

    def __init__(self) -> None:
        self.counts: Counter[tuple[str, str]] = Counter()
        self._next: dict[tuple[str, str], int] = {}  # the count at which it is logged next

    def failed(self, event: str, fn: object, e: Exception) -> None:
        key = (event, listener_name(fn))
        n = self.counts[key] = self.counts[key] + 1
        OBSERVER_FAILURES.labels(event).inc()
        if n < self._next.get(key, 1):
            return
        self._next[key] = n * 10
        if n == 1:
            log.error("%s, a listener of the consumer's %r event, failed (the consumer and the other listeners go "
                      "on; genqueue_observer_failures counts it)", key[1], event, exc_info=e)
        else:
            log.error("%s, a listener of the consumer's %r event, has failed %d times, the last with %s: %s",
                      key[1], event, n, type(e).__name__, e)


class Hook(Generic[P]):
    """A named event heard synchronously (the hot path's `recorded`): duty first, then listeners."""

    __slots__ = ("_duty", "_failures", "listeners", "name")

    def __init__(self, name: str, failures: Failures) -> None:
        self.name = name
        self._failures = failures
        self._duty: Callable[P, object] | None = None
        self.listeners: list[Callable[P, object]] = []

    def duty(self, fn: Callable[P, object]) -> None:
        """FN is the consumer's own handling of the event: run first, its errors not caught."""
        if self._duty is not None:
            raise ValueError(f"event {self.name!r} has a duty already")
        self._duty = fn

    def add(self, fn: Callable[P, object]) -> None:
        self.listeners.append(fn)

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> None:
        if self._duty is not None:
            self._duty(*args, **kwargs)
        for fn in self.listeners:
            try:
                fn(*args, **kwargs)
            except Exception as e:  # noqa: BLE001 - a listener never breaks the consumer: logged and counted
                self._failures.failed(self.name, fn, e)


class AsyncHook(Generic[P]):
    """A named event its reporter awaits: the duty first, then each listener in turn."""

    __slots__ = ("_duty", "_failures", "listeners", "name")

    def __init__(self, name: str, failures: Failures) -> None:
        self.name = name
        self._failures = failures
        self._duty: Callable[P, Awaitable[object]] | None = None
        self.listeners: list[Callable[P, Awaitable[object]]] = []

    def duty(self, fn: Callable[P, Awaitable[object]]) -> None:
        """FN is the consumer's own handling of the event: run first, its errors not caught."""
        if self._duty is not None:
            raise ValueError(f"event {self.name!r} has a duty already")
        self._duty = fn

    def add(self, fn: Callable[P, Awaitable[object]]) -> None:
        self.listeners.append(fn)

    async def __call__(self, *args: P.args, **kwargs: P.kwargs) -> None:
        if self._duty is not None:
            await self._duty(*args, **kwargs)
        for fn in self.listeners:
            try:
                await fn(*args, **kwargs)
            except Exception as e:  # noqa: BLE001 - a listener never breaks the consumer: logged and counted
                self._failures.failed(self.name, fn, e)


class Events:
    """The consumer's named events (module docstring), each a typed hook."""

    def __init__(self) -> None:
        f = self.failures = Failures()
        self.recorded: Hook[[str, Record]] = Hook("recorded", f)
        self.shipped: AsyncHook[[str, int | None, ShardMarks]] = AsyncHook("shipped", f)
        self.features_shipped: AsyncHook[[str, ShardIndex]] = AsyncHook("features_shipped", f)
        self.shard_lost: AsyncHook[[str, int]] = AsyncHook("shard_lost", f)
        self.run_gone: AsyncHook[[str]] = AsyncHook("run_gone", f)
        self.ended_elsewhere: AsyncHook[[str]] = AsyncHook("ended_elsewhere", f)
        self.arrived_done: AsyncHook[[str]] = AsyncHook("arrived_done", f)
        self.runs_resolved: Hook[[list[str]]] = Hook("runs_resolved", f)
        self.swept: Hook[[]] = Hook("swept", f)
        self.limit_raised: Hook[[]] = Hook("limit_raised", f)
        self.phase: Hook[[str | None]] = Hook("phase", f)
        self.serving: Hook[[str]] = Hook("serving", f)

    def hooks(self) -> list[Hook[...] | AsyncHook[...]]:
        """Every event's hook, in the order above."""
        return [h for h in vars(self).values() if isinstance(h, Hook | AsyncHook)]
