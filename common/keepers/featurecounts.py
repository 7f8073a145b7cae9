"""A run's feature counters (--capture's hidden states, --logprobs's tables), counted once a shard.

Keys: genqueue:run:<run>:stats            FEATURE_ROWS, FEATURE_BYTES, FEATURE_TOKENS, SPENT
      genqueue:run:<run>:features_counted  the feature shards whose rows are in those counters (a set)
      genqueue:run:<run>:spent_pending     shard -> the bytes of its rows SPENT holds while it is on a spool

A feature shard stored in the run's output is counted by one script (`FeatureCounts.count`): its
name joins the counted set, and only if it was not there do its rows, bytes and tokens join the
counters, so counting a shard twice (its consumer's shipper, then a rebuild; two rebuilds) adds
it once. SPENT, the capture budget's count (captured.py), is added to row by row as rows are
stored on a spool, each row's bytes also under its shard in the pending hash; once its shard is
counted, SPENT gets the shard's hidden-state row bytes less what the pending hash held for it (and
the field goes). So SPENT ends as the bytes of every row stored, whatever Redis lost meanwhile:
rows whose counting a flush lost are added back when their shard is counted.

After a Redis loss (or a rewind to an older snapshot) `rebuild` counts every shard of the run's
output from its index (one read of each index), with the same script: the shards the counted set
lacks are added, so the counters are those of the output, plus the shards shipped since.
"""

from __future__ import annotations

from dataclasses import dataclass

import redis
from redis.commands.core import Script

from genqueue.common.features.shard import ShardIndex
from genqueue.common.features.store import FeatureStore
from genqueue.common.features.tables import TableDtype
from genqueue.common.keepers.keeper import RunKeeper, run_key
from genqueue.common.keepers.runs import FEATURE_BYTES, FEATURE_ROWS, FEATURE_TOKENS

#: The field of the run's stats hash that counts the bytes of the hidden-state rows captured (as stored).
SPENT = "capture_spent_bytes"

# KEYS: stats, counted set, pending hash; ARGV: shard, rows, bytes, tokens, hidden-state row bytes.
_COUNT = """
if redis.call('SADD', KEYS[2], ARGV[1]) == 0 then return 0 end
redis.call('HINCRBY', KEYS[1], '""" + FEATURE_ROWS + """', ARGV[2])
redis.call('HINCRBY', KEYS[1], '""" + FEATURE_BYTES + """', ARGV[3])
redis.call('HINCRBY', KEYS[1], '""" + FEATURE_TOKENS + """', ARGV[4])
local pending = tonumber(redis.call('HGET', KEYS[3], ARGV[1]) or '0') or 0
redis.call('HDEL', KEYS[3], ARGV[1])
local add = (tonumber(ARGV[5]) or 0) - pending
if add ~= 0 then redis.call('HINCRBY', KEYS[1], '""" + SPENT + """', add) end
return 1
"""


def pending_key(run: str) -> str:
    return run_key(run, "spent_pending")


def counted_key(run: str) -> str:
    return run_key(run, "features_counted")


@dataclass(frozen=True, slots=True)
class ShardCount:
    """What one feature shard adds to its run's counters."""

    shard: str
    rows: int
    bytes: int  # the shard's, as stored
    tokens: int
    captured: int  # its hidden-state rows' bytes (a table's row counts nowhere in the budget)

    @classmethod
    def of(cls, index: ShardIndex) -> ShardCount:
        return cls(index.shard, len(index.entries), index.size, sum(e.tokens for e in index.entries),
                   sum(e.length for e in index.entries if not isinstance(e.dtype, TableDtype)))


@dataclass
class Recounted:
    """What FeatureCounts.rebuild read: the shards of the output, and those it added."""

    shards: int = 0
    rows: int = 0
    added: int = 0  # shards the counters lacked
    added_rows: int = 0

    def line(self) -> str:
        return f"{self.rows:,} feature rows in {self.shards:,} feature shards ({self.added:,} of them not counted before)"


class FeatureCounts(RunKeeper):
    """RUN's feature counters on CONN. Raises what redis-py raises."""

    def __init__(self, conn: redis.Redis, run: str) -> None:
        super().__init__(conn, run)
        self._script: Script = conn.register_script(_COUNT)

    def _keys(self) -> list[str]:
        return [run_key(self.run, "stats"), counted_key(self.run), pending_key(self.run)]

    def count(self, c: ShardCount) -> bool:
        """Shard C is stored in the output: count it, once. Whether it was new."""
        return bool(self._script(keys=self._keys(), args=[c.shard, c.rows, c.bytes, c.tokens, c.captured]))

    def rebuild(self, store: FeatureStore) -> Recounted:
        """Count every feature shard of the run in STORE (its index: one read each); idempotent."""
        out = Recounted()
        for shard in store.list_shards(self.run):
            c = ShardCount.of(store.get_index(self.run, shard))
            out.shards += 1
            out.rows += c.rows
            if self.count(c):
                out.added += 1
                out.added_rows += c.rows
        return out
