"""Checkpoints of multi-turn regeneration in Redis: the store under consumer/answer/checkpoints.py.

Key: genqueue:run:<run>:ckpt:<item key>  (JSON of the history so far), kept TTL_SECONDS; saved
after each finished turn that leaves more to do, deleted once the item's job is acked (in the
transaction that counts the acked jobs right after: common/keepers/runs.py `RunStore.count_acked`).
"""

from __future__ import annotations

from typing import Any

import orjson
import redis

from genqueue.common import defaults
from genqueue.common.keepers.keeper import KEY_PREFIX
from genqueue.common.keepers.redisconn import async_connect

#: A checkpoint outlives any plausible job retry, then expires by itself.
TTL_SECONDS = 7 * 24 * 3600
#: Connections a consumer's checkpoint pool opens at most (a request past them waits): a fleet stays
#: far under Redis's maxclients.
POOL_MAX = 64
#: Seconds a checkpoint read or write waits for a connection before it is given up (best effort).
POOL_WAIT = 20.0


def pool_size(in_flight: int) -> int:
    """Connections for the checkpoints of IN_FLIGHT requests at once: one each (an item reads its
    checkpoint as it starts and writes one after each turn), up to POOL_MAX;
    past that a read or write waits a moment for one."""
    return max(1, min(in_flight, POOL_MAX))


def checkpoint_key(run: str, item_key: str) -> str:
    return f"{KEY_PREFIX}:run:{run}:ckpt:{item_key}"


class CheckpointStore:
    """Async reads and writes of checkpoints, for the generator on the event loop, by up to
    IN_FLIGHT requests at once (pool_size). Raises what redis-py raises: the caller decides what
    a failure costs."""

    def __init__(self, url: str, in_flight: int = defaults.CONCURRENCY) -> None:
        self._conn = async_connect(url, max_connections=pool_size(in_flight), wait=POOL_WAIT)

    async def load(self, run: str, item_key: str) -> bytes | str | None:
        """The checkpoint of ITEM_KEY, as stored (None when there is none)."""
        return await self._conn.get(checkpoint_key(run, item_key))

    async def save(self, run: str, item_key: str, state: dict[str, Any]) -> None:
        await self._conn.set(checkpoint_key(run, item_key), orjson.dumps(state), ex=TTL_SECONDS)

    async def close(self) -> None:
        await self._conn.aclose()

    @staticmethod
    def clear(pipe: redis.client.Pipeline, run: str, item_keys: list[str]) -> None:
        """Queue the deletion of ITEM_KEYS' checkpoints on a (sync) pipeline, at ack time (the
        transaction that counts the acked jobs right after: RunStore.count_acked)."""
        if item_keys:
            pipe.delete(*[checkpoint_key(run, k) for k in item_keys])
