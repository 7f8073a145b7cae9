"""A run's feature counters (common/keepers/featurecounts.py) against a real Redis: each shard
counted once whoever counts it, and after a Redis loss rebuilt from the output's shard indexes,
the capture budget's bytes with them (rows a spool counted before the loss come back once their
shard is stored)."""

from __future__ import annotations

import pytest
import redis

from genqueue.common.features import FeatureDtype, ShardIndex
from genqueue.common.features.shard import IndexEntry
from genqueue.common.features.tables import TableDtype
from genqueue.common.keepers.captured import SPENT, CaptureBudget
from genqueue.common.keepers.featurecounts import FeatureCounts, ShardCount
from genqueue.common.keepers.keeper import run_key
from genqueue.common.keepers.runs import FEATURE_BYTES, FEATURE_ROWS, FEATURE_TOKENS

pytestmark = pytest.mark.integration

RUN = "fc"


def index(shard: str, lengths: list[int], *, tables: bool = False) -> ShardIndex:
    dtype = TableDtype.FP16 if tables else FeatureDtype.FP8_E4M3
    entries = tuple(IndexEntry(f"{shard}-r{i}", shard, 64 + 100 * i, n, n // 10, 1 if tables else 2, 5 if tables else 32,
                               dtype, 0) for i, n in enumerate(lengths))
    return ShardIndex(shard, "cap", 64 + 100 * len(lengths), "0" * 64, entries)


class Output:
    """A FeatureStore's reads, over indexes in memory."""

    def __init__(self, *indexes: ShardIndex) -> None:
        self.indexes = {i.shard: i for i in indexes}

    def list_shards(self, run: str) -> list[str]:
        return sorted(self.indexes)

    def get_index(self, run: str, shard: str) -> ShardIndex:
        return self.indexes[shard]


def counters(conn: redis.Redis) -> tuple[int, int, int, int]:
    st = conn.hgetall(run_key(RUN, "stats"))
    return tuple(int(st.get(f.encode(), 0)) for f in (FEATURE_ROWS, FEATURE_BYTES, FEATURE_TOKENS, SPENT))  # type: ignore[return-value]


def test_a_shard_counted_twice_is_counted_once(conn: redis.Redis) -> None:
    fc = FeatureCounts(conn, RUN)
    a = index("w-1", [40, 60])
    assert fc.count(ShardCount.of(a)) and not fc.count(ShardCount.of(a))
    assert counters(conn) == (2, 264, 10, 100)
    rebuilt = fc.rebuild(Output(a, index("w-2", [30])))  # the shipper counted w-1; w-2 is new
    assert (rebuilt.shards, rebuilt.rows, rebuilt.added, rebuilt.added_rows) == (2, 3, 1, 1)
    assert counters(conn) == (3, 264 + 164, 13, 130)


def test_after_a_redis_loss_the_counters_and_the_budget_come_back_from_the_output(conn: redis.Redis) -> None:
    """Before the loss: w-1 shipped, w-2's rows counted by the budget on a spool. Redis is lost;
    a row of w-3 is counted after. The rebuild finds w-1; w-2 and w-3 ship later: every counter is
    the output's, the budget's bytes those of every row stored (none counted twice, none lost)."""
    budget, fc = CaptureBudget(conn), FeatureCounts(conn, RUN)
    w1, w2, w3, tables = index("w-1", [40, 60]), index("w-2", [70, 80]), index("w-3", [90]), index("w-4", [55], tables=True)
    for e in (*w1.entries, *w2.entries):
        budget.add(RUN, e.length, e.shard)
    fc.count(ShardCount.of(w1))
    assert counters(conn) == (2, 264, 10, 250)
    conn.flushall()
    budget.add(RUN, 90, "w-3")
    assert budget.spent(RUN) == 90  # what the old code showed from now on: the budget restarted
    fc.rebuild(Output(w1))
    assert counters(conn) == (2, 264, 10, 190)
    for shard in (w2, w3, tables):  # shipped from the spools
        fc.count(ShardCount.of(shard))
    assert counters(conn) == (6, 264 + 264 + 164 + 164, 10 + 15 + 9 + 5, 40 + 60 + 70 + 80 + 90)
    fc.rebuild(Output(w1, w2, w3, tables))  # again (a second enqueue, a rewind): nothing moves
    assert counters(conn) == (6, 856, 39, 340)
    assert not conn.exists(run_key(RUN, "spent_pending"))
