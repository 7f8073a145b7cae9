"""The order of a run's sources: a run fed from several files exports them in that order.

Each input gets its place (0, 1, 2...) the first time it is enqueued into a run, atomically,
so two producers racing on two files never share one, and enqueueing a file again keeps its
place. Items carry the place as `source_seq`; the export sorts by it, then by position.

Keys: genqueue:run:<run>:source-order  zset  source id (see enqueue.source_id) -> place
      genqueue:run:<run>:reading       hash  source id -> when an enqueue began reading it (gone
                                             when it ends; `producer status` says "still reading")
"""

from __future__ import annotations

from dataclasses import replace

import redis

from genqueue.common.runs import run_key
from genqueue.common.settings import RunSettings
from genqueue.producer.ingest.items import Origin

# KEYS: the zset. ARGV: the source id. Its place, given now if it had none.
_ASSIGN = """
local s = redis.call('ZSCORE', KEYS[1], ARGV[1])
if s then return tonumber(s) end
local n = redis.call('ZCARD', KEYS[1])
redis.call('ZADD', KEYS[1], n, ARGV[1])
return n
"""


def order_key(run: str) -> str:
    return run_key(run, "source-order")


def assign(conn: redis.Redis, run: str, source_id: str) -> int:
    """SOURCE_ID's place among RUN's sources (given now when it is new)."""
    return int(conn.eval(_ASSIGN, 1, order_key(run), source_id))


def places(conn: redis.Redis, run: str) -> dict[str, int]:
    """Every source id of RUN with its place."""
    pairs: list[tuple[bytes, float]] = conn.zrange(order_key(run), 0, -1, withscores=True)  # type: ignore[assignment]
    return {k.decode(): int(v) for k, v in pairs}


def bind(origin: Origin | None, path: str, source_id: str, run: str, settings: RunSettings,
         conn: redis.Redis | None) -> Origin:
    """ORIGIN (the enqueue command's --id-field and --samples) completed for one input of RUN:
    its name as given, its place (0 in a dry run: nothing is written), the run's seed and
    request parameters."""
    return replace(origin or Origin(), source=path, source_seq=assign(conn, run, source_id) if conn else 0,
                   base_seed=settings.sampling.seed or 0, run_params=settings.sampling.request_params())


#: A reading mark outlives a producer killed mid-read by at most this long (status shows its age).
READING_TTL = 24 * 3600


def reading_key(run: str) -> str:
    return run_key(run, "reading")


def start_reading(conn: redis.Redis, run: str, source_id: str, at: float) -> None:
    with conn.pipeline(transaction=False) as p:
        p.hset(reading_key(run), source_id, repr(at))
        p.expire(reading_key(run), READING_TTL)
        p.execute()


def end_reading(conn: redis.Redis, run: str, source_id: str) -> None:
    conn.hdel(reading_key(run), source_id)


def reading(conn: redis.Redis, run: str) -> dict[str, float]:
    """The sources of RUN an enqueue is reading now, with when it began (garbage left out)."""
    out: dict[str, float] = {}
    for k, v in conn.hgetall(reading_key(run)).items():
        try:
            out[k.decode() if isinstance(k, bytes) else str(k)] = float(v)
        except ValueError:
            continue
    return out
