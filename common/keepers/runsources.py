"""A run's sources in Redis: the place each input takes in the run's order, and the inputs an
enqueue is reading now. (Each source's summary is the run store's: RunStore.sources.)

Each input gets its place (0, 1, 2...) the first time it is enqueued into a run, atomically,
so two producers racing on two files never share one, and enqueueing a file again keeps its
place. Items carry the place as `source_seq`; the export sorts by it, then by position.

Keys: genqueue:run:<run>:source-order  zset  source id (see enqueue.source_id) -> place
      genqueue:run:<run>:reading       hash  source id -> when an enqueue began reading it (gone
                                             when it ends; `producer status` says "still reading")
"""

from __future__ import annotations

from genqueue.common.keepers.keeper import RUN_KEY, RunKeeper, run_key

# KEYS: the zset. ARGV: the source id. Its place, given now if it had none.
_ASSIGN = """
local s = redis.call('ZSCORE', KEYS[1], ARGV[1])
if s then return tonumber(s) end
local n = redis.call('ZCARD', KEYS[1])
redis.call('ZADD', KEYS[1], n, ARGV[1])
return n
"""

#: A reading mark outlives a producer killed mid-read by at most this long.
READING_TTL = 24 * 3600


class RunSources(RunKeeper):
    """RUN's sources on CONN: their order (its key) and the inputs being read, keys and operations."""

    key_template = RUN_KEY + ":source-order"

    @staticmethod
    def reading_key(run: str) -> str:
        return run_key(run, "reading")

    def assign(self, source_id: str) -> int:
        """SOURCE_ID's place among the run's sources (given now when it is new)."""
        return int(self.conn.eval(_ASSIGN, 1, self.key(self.run), source_id))

    def places(self) -> dict[str, int]:
        """Every source id of the run with its place."""
        pairs: list[tuple[bytes, float]] = self.conn.zrange(  # type: ignore[assignment]
            self.key(self.run), 0, -1, withscores=True)
        return {k.decode(): int(v) for k, v in pairs}

    def start_reading(self, source_id: str, at: float) -> None:
        key = self.reading_key(self.run)
        with self.conn.pipeline(transaction=False) as p:
            p.hset(key, source_id, repr(at))
            p.expire(key, READING_TTL)
            p.execute()

    def end_reading(self, source_id: str) -> None:
        self.conn.hdel(self.reading_key(self.run), source_id)

    def reading(self) -> dict[str, float]:
        """The sources of the run an enqueue is reading now, with when it began (garbage left out)."""
        out: dict[str, float] = {}
        for k, v in self.conn.hgetall(self.reading_key(self.run)).items():
            try:
                out[k.decode() if isinstance(k, bytes) else str(k)] = float(v)
            except ValueError:
                continue
        return out
