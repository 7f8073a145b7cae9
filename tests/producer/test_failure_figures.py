"""`producer runs` and `producer status` show a run's failures by one function over one read
(common/keepers/outcomes.py outcome_view): the same classes, the same counts, in the same order."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest
import redis

from genqueue.common.contracts import ErrorClass
from genqueue.common.keepers.marks import Marks, ShardMarks
from genqueue.common.keepers.rqaccess import queue_for
from tests.conftest import cli, sharegpt, write_jsonl
from tests.consumer.e2e import Proc, Sim, run_keys

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


def test_runs_and_status_show_the_same_pack_unreadable_failed_jobs(tmp_path: Path, redis_url: str,
                                                                   conn: redis.Redis) -> None:
    """Old: status had a row `failed jobs  pack_unreadable 40 items in 5 jobs (pack <name>); `rq
    requeue …` runs them once the pack reads again`, and `producer runs` (text and --json) said
    nothing of them: a run of 40 items, 0 done and 0 failed, its items in no queue. New: runs
    shows the same row, by the same function over the same read (outcomes.read_failed_jobs), its
    --json the same failed_jobs object as status's."""
    env = {"REDIS_URL": redis_url, "COLUMNS": "200"}
    data = write_jsonl(tmp_path / "lost.jsonl", [sharegpt(i) for i in range(40)])
    cli("producer", "enqueue", str(data), "--run", "lost", "--output", str(tmp_path / "out"), "--batch-size", "8",
        "--prompts", "reference", "--rejects", str(tmp_path / "lost.rej"), env=env, cwd=tmp_path)
    pack = next((tmp_path / "out" / "lost" / "packs").glob("*.gqpack"))
    pack.unlink()  # every job's pack is gone: a consumer fails each as pack_unreadable
    sim = Sim(tmp_path, "--slots", "16", "--step-time", "0.005", "--mean-tokens", "8")
    try:
        consumer = Proc("consumer", ["run", "--run", "lost", "--endpoint", sim.url, "--burst", "--spool",
                                     str(tmp_path / "spool")], tmp_path / "c.log", env=env)
        consumer.wait(60)
    finally:
        sim.stop()
    assert queue_for("lost", conn).failed_job_registry.count == 5

    status = orjson.loads(cli("producer", "status", "--run", "lost", "--json", env=env, cwd=tmp_path).stdout)
    row = orjson.loads(cli("producer", "runs", "--json", env=env, cwd=tmp_path).stdout.splitlines()[0])
    assert row["failed_jobs"] == status["failed_jobs"] == {"jobs": 5, "items": 40, "by_class": {
        "pack_unreadable": {"jobs": 5, "items": 40, "packs": [pack.name]}}}
    said = (f"pack_unreadable 40 items in 5 jobs (pack {pack.name}); `rq requeue --queue {status['queue']} --all` "
            "runs them once the pack reads again")
    text = cli("producer", "status", "--run", "lost", "--wide", env=env, cwd=tmp_path).stdout
    assert [ln.split(None, 2)[2] for ln in text.splitlines() if ln.startswith("  failed jobs")] == [said], text
    listed = cli("producer", "runs", env=env, cwd=tmp_path).stdout
    assert [ln.strip() for ln in listed.splitlines() if "failed jobs:" in ln] == [f"failed jobs: {said}"], listed
