"""Checkpoints of multi-turn regeneration: a conversation killed in turn 7 of 9 resumes at 7.

After each finished turn that leaves more to do, the history so far is saved in Redis under
the item's key; the next attempt at the item starts from it. The checkpoint is deleted when
the item's job is acked. Checkpoints are best effort: a failed save or load only costs the
redone turns, never the item.
"""

from __future__ import annotations

import logging
from typing import Any

import orjson
import redis

from genqueue.common import defaults
from genqueue.common.keepers.checkpoints import CheckpointStore

log = logging.getLogger(__name__)


class Checkpoints:
    """Best-effort checkpoints, for the generator on the event loop, of up to IN_FLIGHT requests
    at once (common/keepers/checkpoints.py stores them, its pool sized to that)."""

    def __init__(self, url: str, in_flight: int = defaults.CONCURRENCY) -> None:
        self._store = CheckpointStore(url, in_flight)
        self.saved = 0
        self.resumed = 0

    async def load(self, run: str, item_key: str) -> dict[str, Any] | None:
        try:
            raw = await self._store.load(run, item_key)
        except redis.exceptions.RedisError as e:
            log.warning("checkpoint of %s not read (%s); starting at turn 1", item_key, e)
            return None
        if raw is None:
            return None
        state = orjson.loads(raw)
        if not isinstance(state, dict):
            log.warning("checkpoint of %s is not an object; starting at turn 1", item_key)
            return None
        self.resumed += 1
        return state

    async def save(self, run: str, item_key: str, state: dict[str, Any]) -> None:
        try:
            await self._store.save(run, item_key, state)
            self.saved += 1
        except redis.exceptions.RedisError as e:
            log.warning("checkpoint of %s not saved (%s)", item_key, e)

    async def close(self) -> None:
        await self._store.close()
