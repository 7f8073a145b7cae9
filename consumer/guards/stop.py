"""How a consumer stops: the first SIGTERM or SIGINT drains within --drain-timeout, a second
stops at once, and whatever the consumer is waiting on, it is gone soon after.

Every phase of a consumer's life can wait on something that may never answer: an endpoint that
died (start-up, pre-flight, a request on a closed gate), Redis (before the loop, at every rq
call), a store that hangs. Each wait that can outlive a stop is raced against it (`until`);
and, should one be missed, a watchdog thread armed by the first signal ends the process at the
drain's deadline plus STOP_GRACE (at once after a second signal). Held jobs that were not given
back by then return to the queue when their leases expire.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from types import FrameType
from typing import TypeVar

from genqueue.common.contracts import ExitCode

log = logging.getLogger(__name__)

#: Seconds after --drain-timeout to ship what is complete, give back the rest and report the stop; then exit anyway.
STOP_GRACE = 10.0
#: Seconds after a second signal to give back the jobs held (one round trip each) before exiting.
HARD_STOP_GRACE = 2.0

T = TypeVar("T")

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Stopped(BaseException):
    """A stop was asked while this waited; what it waited for was cancelled. A BaseException,
    as KeyboardInterrupt is: raised by a signal handler inside a library's `except Exception`
    (redis-py wraps what its connect raises), it must not become an error that is retried."""


async def until(stopping: asyncio.Event, aw: Awaitable[T]) -> T:
    """AW's result, unless STOPPING is set first: then AW is cancelled and Stopped raised."""
    task = asyncio.ensure_future(aw)
    if stopping.is_set():
        task.cancel()
        raise Stopped
    stop = asyncio.ensure_future(stopping.wait())
    try:
        await asyncio.wait({task, stop}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stop.cancel()
        if not task.done():
            task.cancel()
            # A cancelled rq call returns at once (its thread finishes on its own); bounded anyway.
            await asyncio.wait({task}, timeout=1.0)
    if task.cancelled() or not task.done():
        raise Stopped
    return task.result()


class Stop:
    """The consumer's stop: one per process, from the CLI's first line to its exit."""

    def __init__(self, drain_timeout: float, *, grace: float = STOP_GRACE) -> None:
        self.drain_timeout = drain_timeout
        self.grace = grace
        self.stopping = asyncio.Event()
        self.hard = False
        self.signalled = False  # a signal (not a --burst end) stopped this consumer
        self.code: int | None = None  # the exit code, once known: the watchdog exits with it
        self._at: float | None = None  # monotonic time of the first stop
        self._deadline = float("inf")
        self._moved = threading.Event()
        self._watchdog: threading.Thread | None = None
        self._on_hard: list[Callable[[], None]] = []

    # --- before the asyncio loop ---------------------------------------------------
    def install_early(self) -> None:
        """Signals before the loop's own handlers exist (waiting for Redis at start): nothing is
        held yet, so a signal raises Stopped wherever the main thread is, and the process ends.
        The loop's handlers replace these (install)."""

        def handler(sig: int, _frame: FrameType | None) -> None:
            self.signalled = True
            log.warning("signal %s before start-up finished: stopping (nothing held)", signal.Signals(sig).name)
            raise Stopped

        for sig in SIGNALS:
            signal.signal(sig, handler)

    # --- in the loop ---------------------------------------------------------------
    def install(self, loop: asyncio.AbstractEventLoop) -> None:
        for sig in SIGNALS:
            try:
                loop.add_signal_handler(sig, self.on_signal, sig)
            except (NotImplementedError, RuntimeError, ValueError):  # not the main thread (tests)
                pass

    def on_hard(self, fn: Callable[[], None]) -> None:
        """Call FN when the stop becomes a hard one (every wait gives up at once)."""
        self._on_hard.append(fn)

    def on_signal(self, sig: int) -> None:
        self.signalled = True
        if self.stopping.is_set():
            log.warning("second signal (%s): stopping now; jobs not given back return to the queue when their "
                        "leases expire", signal.Signals(sig).name)
            self.go_hard()
        else:
            log.warning("signal %s: draining for up to %s (in flight finishes, the rest goes back to the queue); "
                        "a second Ctrl-C or SIGTERM stops at once", signal.Signals(sig).name,
                        _seconds(self.drain_timeout))
            self.begin()

    def begin(self) -> None:
        """Stop taking work and drain (a signal, or a --burst end): arms the watchdog."""
        if self._at is None:
            self._at = time.monotonic()
            self._arm(self._at + self.drain_timeout + self.grace)
        self.stopping.set()

    def go_hard(self) -> None:
        self.begin()
        if self.hard:
            return
        self.hard = True
        for fn in self._on_hard:
            fn()
        self._arm(time.monotonic() + HARD_STOP_GRACE)

    @property
    def drain_deadline(self) -> float:
        """Monotonic time by which in-flight requests must be done (now + drain timeout when
        no stop was asked: a --burst end)."""
        return (self._at if self._at is not None else time.monotonic()) + self.drain_timeout

    @property
    def end(self) -> float:
        """Monotonic time by which everything after the drain (shipping, giving back, the stop
        report) must be done."""
        return time.monotonic() if self.hard else self.drain_deadline + self.grace

    def left(self, *, reserve: float = 0.0, floor: float = 0.0) -> float:
        """Seconds until `end` less RESERVE (kept for the steps after), at least FLOOR."""
        return max(self.end - reserve - time.monotonic(), floor)

    # --- the watchdog --------------------------------------------------------------
    def _arm(self, deadline: float) -> None:
        if deadline >= self._deadline:
            return
        self._deadline = deadline
        self._moved.set()
        if self._watchdog is None:
            self._watchdog = threading.Thread(target=self._watch, name="stop-watchdog", daemon=True)
            self._watchdog.start()

    def _watch(self) -> None:
        while True:
            self._moved.clear()
            wait = self._deadline - time.monotonic()
            if wait <= 0:
                break
            self._moved.wait(wait)
        code = self.code if self.code is not None else ExitCode.INTERRUPTED
        log.error("not stopped %.1f s after the stop began: exiting now (exit %d); jobs still held return to "
                  "the queue when their leases expire", time.monotonic() - (self._at or time.monotonic()), code)
        exit_now(code)

    def exit(self, code: int) -> None:
        """The consumer is done: after a signal, end the process at once with CODE (a thread
        blocked on I/O that no longer matters, say an upload to a dead store, must not hold the
        exit); else return and let the CLI exit as usual."""
        self.code = code
        if self.signalled:
            exit_now(code)


def exit_now(code: int) -> None:
    """End the process with CODE, logs and output flushed, without waiting for any thread."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def _seconds(s: float) -> str:
    return f"{s:g} s" if s < 120 else f"{s / 60:g} min"
