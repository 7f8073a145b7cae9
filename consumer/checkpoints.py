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

from genqueue.common.defaults import KEY_PREFIX
from genqueue.common.redisconn import async_connect

log = logging.getLogger(__name__)

#: A checkpoint outlives any plausible job retry, then expires by itself.
TTL_SECONDS = 7 * 24 * 3600


def checkpoint_key(run: str, item_key: str) -> str:
    return f"{KEY_PREFIX}:run:{run}:ckpt:{item_key}"


class Checkpoints:
    """Async access to checkpoints, for the generator on the event loop."""

    def __init__(self, url: str) -> None:
        self._conn = async_connect(url)
        self.saved = 0
        self.resumed = 0

    async def load(self, run: str, item_key: str) -> dict[str, Any] | None:
        try:
            raw = await self._conn.get(checkpoint_key(run, item_key))
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
            await self._conn.set(checkpoint_key(run, item_key), orjson.dumps(state), ex=TTL_SECONDS)
            self.saved += 1
        except redis.exceptions.RedisError as e:
            log.warning("checkpoint of %s not saved (%s)", item_key, e)

    async def close(self) -> None:
        await self._conn.aclose()


def clear(pipe: redis.client.Pipeline, run: str, item_keys: list[str]) -> None:
    """Queue the deletion of ITEM_KEYS' checkpoints on a (sync) pipeline, at ack time."""
    if item_keys:
        pipe.delete(*[checkpoint_key(run, k) for k in item_keys])
