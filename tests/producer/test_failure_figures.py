"""`producer runs` and `producer status` show a run's failures by one function over one read
(common/keepers/outcomes.py outcome_view): the same classes, the same counts, in the same order."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest
import redis

from genqueue.common.contracts import ErrorClass
from genqueue.common.keepers.marks import Marks, ShardMarks
from tests.conftest import cli, sharegpt, write_jsonl
from tests.consumer.e2e import run_keys

pytestmark = pytest.mark.integration


def _ship(conn: redis.Redis, run: str, keys: list[str], error: ErrorClass | None) -> None:
    """KEYS marked as a consumer marks a shipped shard of them (error records of class ERROR)."""
    marks = ShardMarks()
    for k in keys:
        marks.add(k, error=error is not None, kind=error.value if error else "finished", turns=1)
    Marks(conn, run).mark_shipped(marks)


def test_runs_and_status_show_the_same_failed_by_class_in_the_same_order(
        tmp_path: Path, redis_url: str, conn: redis.Redis) -> None:
    """Old: `producer runs --json` built its own failed_by_class from the stats hash, in the
    order Redis kept the counters ({"transient_exhausted": 3, "permanent": 5}), where status
    said {"permanent": 5, "transient_exhausted": 3}. New: both are outcome_view's."""
    env = {"REDIS_URL": redis_url}
    data = write_jsonl(tmp_path / "f.jsonl", [sharegpt(i) for i in range(16)])
    cli("producer", "enqueue", str(data), "--run", "f", "--output", str(tmp_path / "out"), "--batch-size", "8",
        "--rejects", str(tmp_path / "f.rej"), env=env, cwd=tmp_path)
    keys = sorted(run_keys(conn, "f"))
    _ship(conn, "f", keys[:3], ErrorClass.TRANSIENT_EXHAUSTED)  # this class's counter first in Redis
    _ship(conn, "f", keys[3:8], ErrorClass.PERMANENT)
    _ship(conn, "f", keys[8:], None)

    row = orjson.loads(cli("producer", "runs", "--json", env=env, cwd=tmp_path).stdout.splitlines()[0])
    status = orjson.loads(cli("producer", "status", "--run", "f", "--json", env=env, cwd=tmp_path).stdout)
    assert (row["failed"], list(row["failed_by_class"].items())) == \
        (status["items_failed"], list(status["failed_by_class"].items())) == \
        (8, [("permanent", 5), ("transient_exhausted", 3)])
    said = "8 items ended as errors (permanent 5, transient_exhausted 3)"
    assert said in cli("producer", "runs", env=env, cwd=tmp_path).stdout
    assert said in cli("producer", "status", "--run", "f", env=env, cwd=tmp_path).stdout
