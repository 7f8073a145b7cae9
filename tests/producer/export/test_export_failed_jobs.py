"""Items of jobs rq gave up on are permanently failed in the export, with rq's reason, not missing."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest
import redis

from genqueue.common.contracts import ErrorClass
from genqueue.common.keepers.rqaccess import queue_for
from genqueue.consumer.rqcompat import GenWorker
from tests.conftest import Prompts, cli, items_of_job, sharegpt, write_jsonl

pytestmark = pytest.mark.integration


def test_failed_job_items_are_listed_as_failed(tmp_path: Path, redis_url: str, conn: redis.Redis,
                                               prompts_mode: Prompts) -> None:
    env = {"REDIS_URL": redis_url}
    data = write_jsonl(tmp_path / "fj.jsonl", [sharegpt(i) for i in range(6)])
    cli("producer", "enqueue", str(data), "--batch-size", "3", "--multi-turn", "last", "--output",
        str(tmp_path / "out"), "--rejects", str(tmp_path / "r"), *prompts_mode.args, env=env)
    q = queue_for("fj", conn)
    w = GenWorker([q], conn, lease=30)
    w.start()
    done, _ = w.dequeue(q)
    gave_up, _ = w.dequeue(q)
    assert done is not None and gave_up is not None
    w.fail(gave_up, "AbandonedJobError: abandoned 4 times", retry=False)
    shard_dir = tmp_path / "out" / "fj" / "shards"
    shard_dir.mkdir(parents=True)
    recs = [{"key": it["key"], "index": it["index"], "turn": it["turn"], "run": "fj", "messages": it["messages"],
             "content": "ok", "reasoning": None, "finish_reason": "stop", "outcome": "finished", "attempt": 1,
             "timings": {"finished_at": 1.0}} for it in items_of_job(conn, "fj", tmp_path / "out", done.job)]
    (shard_dir / "w-000001.jsonl").write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in recs))
    proc = cli("producer", "export", "--run", "fj", "--output", str(tmp_path / "fj.out.jsonl"), "--json",
               "--max-failed", "3", env=env)
    r = orjson.loads(proc.stdout)
    assert (r["enqueued"], r["exported"], r["failed"], r["missing"], r["failed_jobs"]) == (6, 3, 3, 0, 1)
    errors = [orjson.loads(x) for x in (tmp_path / "fj.out.errors.jsonl").read_bytes().splitlines()]
    assert {e["key"] for e in errors} == {it["key"] for it in items_of_job(conn, "fj", tmp_path / "out", gave_up.job)}
    assert all(e["error"]["class"] == ErrorClass.JOB_FAILED and "abandoned 4 times" in e["error"]["message"] for e in errors)


def test_export_of_one_variant_counts_the_failed_jobs_items_of_that_variant(tmp_path: Path, redis_url: str,
                                                                             conn: redis.Redis) -> None:
    from genqueue.common.variants import draw, normalised, parse_variant

    env = {"REDIS_URL": redis_url}
    mix = ['a={"reasoning_effort":"low"}:1', 'b={"reasoning_effort":"high"}:1']
    data = write_jsonl(tmp_path / "fv.jsonl", [sharegpt(i) for i in range(24)])
    cli("producer", "enqueue", str(data), "--batch-size", "12", "--multi-turn", "last", "--output",
        str(tmp_path / "out"), "--rejects", str(tmp_path / "r"), "--variant", mix[0], "--variant", mix[1], env=env)
    variants = normalised([parse_variant(t) for t in mix])

    def name(key: str) -> str:
        v = draw(key, variants)
        assert v is not None
        return v.name

    q = queue_for("fv", conn)
    w = GenWorker([q], conn, lease=30)
    w.start()
    done, _ = w.dequeue(q)
    gave_up, _ = w.dequeue(q)
    assert done is not None and gave_up is not None
    w.fail(gave_up, "AbandonedJobError: abandoned 4 times", retry=False)
    shard_dir = tmp_path / "out" / "fv" / "shards"
    shard_dir.mkdir(parents=True)
    recs = [{"key": it["key"], "index": it["index"], "turn": it["turn"], "run": "fv", "messages": it["messages"],
             "content": "ok", "reasoning": None, "finish_reason": "stop", "outcome": "finished", "attempt": 1,
             "variant": name(it["key"]), "timings": {"finished_at": 1.0}} for it in done.job.args[0]]
    (shard_dir / "w-000001.jsonl").write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in recs))
    lost = [name(it["key"]) for it in gave_up.job.args[0]]
    shipped = [r["variant"] for r in recs]
    assert set(lost + shipped) == {"a", "b"}  # the 24 keys draw both
    proc = cli("producer", "export", "--run", "fv", "--output", str(tmp_path / "fv.a.jsonl"), "--json",
               "--variant", "a", "--allow-partial", env=env)
    r = orjson.loads(proc.stdout)
    assert (r["exported"], r["failed"], r["missing"]) == (shipped.count("a"), lost.count("a"), 0)
    assert r["other_variants"] == shipped.count("b") + lost.count("b")
    errors = [orjson.loads(x) for x in (tmp_path / "fv.a.errors.jsonl").read_bytes().splitlines()]
    assert sorted(e["key"] for e in errors) == sorted(it["key"] for it in gave_up.job.args[0]
                                                      if name(it["key"]) == "a")
