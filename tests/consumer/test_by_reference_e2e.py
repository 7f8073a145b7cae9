"""Prompts by reference end to end (issue 34): a real redis-server, a real `producer enqueue
--prompts reference` writing packs into the run's output, real `consumer run --burst` processes
against the stand-in vLLM over HTTP, and `producer export`'s coverage proving every item
exactly once. Then a pack deleted under a queued job: the job fails with `pack_unreadable`,
and rq's own `rq requeue` runs it again once the pack is back."""

from __future__ import annotations

import collections
import shutil
from pathlib import Path

import orjson
import pytest
import redis
from rq.job import Job

from genqueue.common.keepers.packs import PackTable
from genqueue.common.keepers.rqaccess import SERIALIZER, job_failure, queue_for
from tests.conftest import cli, sharegpt, write_jsonl
from tests.consumer.e2e import Proc, Sim, read_results, run_keys

pytestmark = pytest.mark.integration


def _enqueue(tmp_path: Path, redis_url: str, run: str, n: int, *extra: str) -> dict:
    data = write_jsonl(tmp_path / f"{run}.jsonl", [sharegpt(i, turns=1 + i % 2) for i in range(n)])
    proc = cli("producer", "enqueue", str(data), "--run", run, "--output", str(tmp_path / "out"), "--batch-size", "8",
               "--max-tokens", "32", "--rejects", str(tmp_path / f"{run}.rej.jsonl"), "--json", *extra,
               env={"REDIS_URL": redis_url})
    summary: dict = orjson.loads(proc.stdout)
    return summary


def _consume(tmp_path: Path, redis_url: str, sim: Sim, run: str, name: str) -> Proc:
    return Proc("consumer", ["-v", "run", "--run", run, "--endpoint", sim.url, "-c", "16", "--burst",
                             "--shard-max-age", "0.5", "--spool", str(tmp_path / f"spool-{name}")],
                tmp_path / f"{name}.log", env={"REDIS_URL": redis_url})


def _export(tmp_path: Path, redis_url: str, run: str) -> dict:
    proc = cli("producer", "export", "--run", run, "--output", str(tmp_path / f"{run}.export.jsonl"), "--json",
               env={"REDIS_URL": redis_url}, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary: dict = orjson.loads(proc.stdout.strip().splitlines()[-1])
    return summary


def test_a_run_by_reference_completes_every_item_once(tmp_path: Path, redis_url: str, conn: redis.Redis) -> None:
    s = _enqueue(tmp_path, redis_url, "byref", 300, "--prompts", "reference")
    assert s["prompts"] == "reference" and s["items"] == 300 and s["packs"] >= 1
    # the jobs carry no prompt: no argument, their pack and block in meta; the pack table names each pack
    q = queue_for("byref", conn)
    job = Job.fetch(q.job_ids[0], connection=conn, serializer=SERIALIZER)
    assert job.args == [] and set(job.meta) == {"items", "pack", "block"}
    table = PackTable(conn, "byref").names()
    assert len(table) == s["packs"] and job.meta["pack"] in table
    packs = sorted((tmp_path / "out" / "byref" / "packs").glob("*.gqpack"))
    assert [p.name for p in packs] == sorted(table.values())
    assert not any(b"q1" in (conn.hget(Job.key_for(j), "data") or b"") for j in q.job_ids)
    # the mode and the packs survive in run.json (a run re-created after a Redis loss knows them)
    rf = orjson.loads((tmp_path / "out" / "byref" / "run.json").read_bytes())
    assert rf["prompts"] == "reference" and {int(k): v for k, v in rf["packs"].items()} == table

    sim = Sim(tmp_path, "--slots", "16", "--step-time", "0.005", "--mean-tokens", "8")
    try:
        consumers = [_consume(tmp_path, redis_url, sim, "byref", f"c{i}") for i in range(2)]
        for c in consumers:
            assert c.wait(120) == 0, c.output()
    finally:
        sim.stop()
    recs = read_results(tmp_path / "out", "byref")
    counts = collections.Counter(r["key"] for r in recs)
    assert set(counts) == run_keys(conn, "byref") and len(counts) == 300
    assert max(counts.values()) == 1, "no item answered twice"
    assert {r["index"] for r in recs} == set(range(300))
    e = _export(tmp_path, redis_url, "byref")
    # every item once: exported, or set aside as cut by max_tokens; none missing, failed or unexpected
    assert e["enqueued"] == e["exported"] + e["truncated"] == e["records_read"] == 300
    assert (e["missing"], e["failed"], e["unexpected"], e["duplicates_removed"], e["malformed_jobs"]) == (0, 0, 0, 0, [])


def test_an_inline_run_is_unchanged_and_says_so(tmp_path: Path, redis_url: str, conn: redis.Redis) -> None:
    s = _enqueue(tmp_path, redis_url, "inl", 20)
    assert s["prompts"] == "inline" and s["packs"] == 0
    job = Job.fetch(queue_for("inl", conn).job_ids[0], connection=conn, serializer=SERIALIZER)
    assert len(job.args) == 1 and len(job.args[0]) == 8 and job.meta == {"items": 8}
    assert PackTable(conn, "inl").count() == 0 and not (tmp_path / "out" / "inl" / "packs").exists()


def test_a_missing_pack_fails_its_jobs_and_rq_requeue_runs_them_once_it_is_back(
        tmp_path: Path, redis_url: str, conn: redis.Redis) -> None:
    s = _enqueue(tmp_path, redis_url, "gone", 40, "--prompts", "reference")
    assert s["packs"] == 1 and s["jobs"] == 5
    pack = next((tmp_path / "out" / "gone" / "packs").glob("*.gqpack"))
    hidden = tmp_path / "hidden.gqpack"
    shutil.move(pack, hidden)
    sim = Sim(tmp_path, "--slots", "16", "--step-time", "0.005", "--mean-tokens", "8")
    try:
        first = _consume(tmp_path, redis_url, sim, "gone", "first")
        first.wait(60)
        failed = queue_for("gone", conn).failed_job_registry.get_job_ids()
        assert len(failed) == 5, first.output()
        why = job_failure(Job.fetch(failed[0], connection=conn, serializer=SERIALIZER)) or ""
        assert why.startswith("pack_unreadable: ") and pack.name in why
        assert not read_results(tmp_path / "out", "gone"), "nothing was answered, nothing skipped in silence"

        shutil.move(hidden, pack)
        cli("rq", "requeue", "-u", redis_url, "--queue", "genqueue.gone", "--all")
        second = _consume(tmp_path, redis_url, sim, "gone", "second")
        assert second.wait(60) == 0, second.output()
    finally:
        sim.stop()
    counts = collections.Counter(r["key"] for r in read_results(tmp_path / "out", "gone"))
    assert set(counts) == run_keys(conn, "gone") and len(counts) == 40 and max(counts.values()) == 1
    e = _export(tmp_path, redis_url, "gone")
    assert e["exported"] + e["truncated"] == e["enqueued"] == 40 and (e["missing"], e["failed"]) == (0, 0)
