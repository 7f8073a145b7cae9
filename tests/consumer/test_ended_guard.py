"""A --burst consumer's exit line and `producer status` name a run's failed items by the same
classes, counts and order (common/keepers/outcomes.py outcome_view), on a real Redis: the run
made by a real `producer enqueue`, its items marked as a consumer marks what it shipped."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest
import redis

from genqueue.common.contracts import ErrorClass, ExitCode
from genqueue.common.keepers.marks import Marks, ShardMarks
from genqueue.common.retryhint import failed_summary
from genqueue.consumer.guards.ended import _unfinished
from tests.conftest import cli, sharegpt, write_jsonl
from tests.consumer.e2e import run_keys

pytestmark = pytest.mark.integration


def _ship(conn: redis.Redis, run: str, keys: list[str], error: ErrorClass | None) -> None:
    marks = ShardMarks()
    for k in keys:
        marks.add(k, error=error is not None, kind=error.value if error else "finished", turns=1)
    Marks(conn, run).mark_shipped(marks)


def test_the_ended_guard_and_status_give_the_same_failures_by_class(tmp_path: Path, redis_url: str,
                                                                    conn: redis.Redis) -> None:
    """Old: the exit line counted the classes by itself, in the order Redis kept the counters: '6
    items ended as errors (transient_exhausted 3, permanent 3) of 16' where status said
    '(permanent 3, transient_exhausted 3)'. New: both are outcome_view's."""
    env = {"REDIS_URL": redis_url}
    data = write_jsonl(tmp_path / "f.jsonl", [sharegpt(i) for i in range(16)])
    cli("producer", "enqueue", str(data), "--run", "f", "--output", str(tmp_path / "out"), "--batch-size", "8",
        "--rejects", str(tmp_path / "f.rej"), env=env, cwd=tmp_path)
    keys = sorted(run_keys(conn, "f"))
    _ship(conn, "f", keys[:3], ErrorClass.TRANSIENT_EXHAUSTED)  # this class's counter first in Redis
    _ship(conn, "f", keys[3:6], ErrorClass.PERMANENT)
    _ship(conn, "f", keys[6:], None)

    ended = _unfinished(conn, "f")
    status = orjson.loads(cli("producer", "status", "--run", "f", "--json", env=env, cwd=tmp_path).stdout)
    said = failed_summary(status["items_failed"], status["failed_by_class"])
    assert said == "6 items ended as errors (permanent 3, transient_exhausted 3)"
    assert ended is not None and ended[0] is ExitCode.FAILED_ITEMS
    assert ended[1].startswith(f"{said} of 16; "), ended
    text = cli("producer", "status", "--run", "f", "--wide", env=env, cwd=tmp_path).stdout
    assert f"FAILED   {said}; " in text, text
