"""Supervision of the consumer's long-lived loops: none of them dies in silence.

A loop that raises is restarted with a log line (and backoff) while its restart budget
lasts; past it, or on a user's mistake (UserError), it raises LoopFailed, which the
consumer's task group turns into a stop with a non-zero exit. A loop that returns is done.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Awaitable, Callable

from genqueue.common.backoff import compute_backoff
from genqueue.common.errors import GenqueueError, UserError

log = logging.getLogger(__name__)


class LoopFailed(GenqueueError):
    """A loop of the consumer failed past its restart budget: the consumer must stop."""

    def __init__(self, name: str, cause: BaseException) -> None:
        super().__init__(f"{name} failed: {type(cause).__name__}: {cause}")
        self.name = name
        self.cause = cause


async def supervised(name: str, loop: Callable[[], Awaitable[None]], *, restarts: int = 5,
                     window: float = 60.0) -> None:
    """Run LOOP; restart it after an exception, at most RESTARTS times within WINDOW seconds."""
    recent: collections.deque[float] = collections.deque()
    while True:
        try:
            await loop()
            return
        except asyncio.CancelledError:
            raise
        except UserError as e:
            raise LoopFailed(name, e) from e
        except Exception as e:
            now = time.monotonic()
            while recent and recent[0] < now - window:
                recent.popleft()
            if len(recent) >= restarts:
                log.error("%s failed %d times in %.0f s; stopping the consumer", name, len(recent) + 1, window,
                          exc_info=e)
                raise LoopFailed(name, e) from e
            recent.append(now)
            delay = compute_backoff(len(recent), base=0.2, cap=5.0)
            log.error("%s failed (%s: %s); restarting it in %.1f s", name, type(e).__name__, e, delay, exc_info=e)
            await asyncio.sleep(delay)
