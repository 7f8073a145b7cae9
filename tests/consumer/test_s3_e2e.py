"""Runs shipping to a real S3 server (SeaweedFS): a clean run, an S3 outage, a kill in between.

Real redis-server, the stand-in vLLM over HTTP, consumers as subprocesses that get their S3
credentials from the environment (boto3's standard chain), and `producer export` at the end.
Each test runs in both prompt modes (issue 34): by reference the run's packs are in S3 too, and
the consumers read them through a pack cache on disk.
"""

from __future__ import annotations

import collections
import time
from pathlib import Path

import orjson
import pytest
from rq.job import Job

from genqueue.common.keepers.rqaccess import SERIALIZER, queue_for
from genqueue.producer.packitems import PackItems
from tests.conftest import Prompts, cli, items_of_job, sharegpt, write_jsonl
from tests.consumer.e2e import Proc, Sim, run_keys
from tests.s3server import S3Server, s3_env, s3_server  # noqa: F401 - fixtures

pytestmark = pytest.mark.integration

PREFIX = "runs/e2e"


def enqueue(tmp_path: Path, redis_url: str, s3: S3Server, run: str, n: int, prompts: Prompts) -> None:
    data = write_jsonl(tmp_path / f"{run}.jsonl", [sharegpt(i, turns=1 + i % 2) for i in range(n)])
    cli("producer", "enqueue", str(data), "--run", run, "--output", s3.url(PREFIX), "--batch-size", "8",
        "--max-tokens", "256", "--rejects", str(tmp_path / "rej.jsonl"), *prompts.args,
        env={"REDIS_URL": redis_url, **s3.env})


def consumer(tmp_path: Path, redis_url: str, s3: S3Server, sim: Sim, run: str, *extra: str, name: str,
             spool: str | None = None) -> Proc:
    env = {"REDIS_URL": redis_url, **s3.env, "GENQUEUE_S3_ABORT_AFTER": "0"}
    return Proc("consumer", ["-v", "run", "--run", run, "--endpoint", sim.url,
                             "--spool", str(tmp_path / "spool" / (spool or name)), "--shard-max-age", "1", *extra],
                tmp_path / f"{name}.log", env=env)


def s3_records(s3: S3Server, run: str) -> tuple[list[dict], set[str]]:
    """Every record in the run's shards in S3, and the shard names."""
    client = s3.client()
    prefix = f"{PREFIX}/{run}/shards/"
    recs: list[dict] = []
    names: set[str] = set()
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=s3.bucket, Prefix=prefix):
        for obj in page.get("Contents", []):
            if obj["Key"].endswith(".jsonl"):
                names.add(obj["Key"][len(prefix):])
                body = client.get_object(Bucket=s3.bucket, Key=obj["Key"])["Body"].read()
                recs += [orjson.loads(x) for x in body.splitlines() if x.strip()]
    return recs, names


def job_keys(conn, s3: S3Server, run: str, job_ids) -> set[str]:
    """The keys of the items of RUN's jobs JOB_IDS, in either mode (by reference: read from the
    run's packs in S3, which must be up)."""
    packs = PackItems(conn, run, s3.url(PREFIX))
    keys: set[str] = set()
    for jid in job_ids:
        job = Job.fetch(jid, connection=conn, serializer=SERIALIZER)
        keys |= {it["key"] for it in items_of_job(conn, run, s3.url(PREFIX), job, packs)}
    return keys


def export(tmp_path: Path, redis_url: str, s3: S3Server, run: str) -> tuple[dict, list[dict]]:
    from genqueue.producer.cli import main

    out = tmp_path / f"{run}.export.jsonl"
    # every outcome: these runs prove delivery, not which answers make good samples (by default a
    # cut answer goes to the truncated file), one row per item (--rows conversation: a line per
    # conversation, not per answer)
    args = ["--run", run, "--output", str(out), "--json", "--include-outcomes", "all", "--rows", "conversation"]
    env = {"REDIS_URL": redis_url, **s3.env}
    assert "export" in main.commands
    proc = cli("producer", "export", *args, env=env, check=False)
    code, stdout = proc.returncode, proc.stdout
    assert stdout.strip(), f"export exited {code} with nothing on stdout:\n{proc.stderr}"
    summary = orjson.loads(stdout)
    assert code == (1 if summary["missing"] else 0)
    return summary, [orjson.loads(x) for x in out.read_bytes().splitlines()]


def assert_acked_are_shipped(conn, s3: S3Server, run: str) -> int:
    """Every item of every job rq calls finished is in a shard in S3. The finished set is read
    first: a job in it was acked before the listing, so its shard must already be there."""
    finished = queue_for(run, conn).finished_job_registry.get_job_ids()
    recs, _ = s3_records(s3, run)
    missing = job_keys(conn, s3, run, finished) - {r["key"] for r in recs}
    assert not missing, f"{len(missing)} items of acked jobs are not in S3"
    return len(finished)


def test_run_to_s3_completes_and_exports(tmp_path, redis_url, conn, s3_server: S3Server, prompts_mode: Prompts):
    sim = Sim(tmp_path, "--slots", "32", "--step-time", "0.002", "--mean-tokens", "40")
    try:
        enqueue(tmp_path, redis_url, s3_server, "s3run", 120, prompts_mode)
        c = consumer(tmp_path, redis_url, s3_server, sim, "s3run", "--burst", "-c", "32", name="c")
        assert c.wait(90) == 0, c.output()
    finally:
        sim.stop()
    recs, names = s3_records(s3_server, "s3run")
    assert {r["key"] for r in recs} == run_keys(conn, "s3run") and len(recs) == 120
    client = s3_server.client()
    packs = client.list_objects_v2(Bucket=s3_server.bucket, Prefix=f"{PREFIX}/s3run/packs/").get("KeyCount", 0)
    assert bool(packs) == prompts_mode.by_reference, "by reference the prompts are in S3, in packs"
    for name in names:  # every shard has its manifest
        man = client.get_object(Bucket=s3_server.bucket,
                                Key=f"{PREFIX}/s3run/shards/{name.removesuffix('.jsonl')}.manifest.json")
        assert orjson.loads(man["Body"].read())["shard"] == name
    summary, rows = export(tmp_path, redis_url, s3_server, "s3run")
    assert (summary["enqueued"], summary["exported"], summary["missing"], summary["failed"]) == (120, 120, 0, 0)
    assert summary["source"].startswith(f"s3://{s3_server.bucket}/{PREFIX}/s3run/shards")
    assert [r["index"] for r in rows] == list(range(120))
    assert all(r["messages"][-1]["role"] == "assistant" for r in rows)


@pytest.mark.slow
def test_s3_down_twenty_seconds_nothing_acked_early_nothing_lost(tmp_path, redis_url, conn, s3_server: S3Server,
                                                                 s3_env, prompts_mode: Prompts):
    sim = Sim(tmp_path, "--slots", "16", "--step-time", "0.004", "--mean-tokens", "60")
    run = "s3down"
    # By reference the consumer reads the run's one pack once and then from its disk cache, which
    # outlives the outage: the test empties it (a cache of the consumer's own) as S3 goes down, so
    # the jobs still queued need their pack from S3 while it is out (as on a host whose cache lost
    # the pack, or a consumer started during the outage).
    cache = tmp_path / "packs"
    try:
        enqueue(tmp_path, redis_url, s3_server, run, 400, prompts_mode)
        c = consumer(tmp_path, redis_url, s3_server, sim, run, "--burst", "-c", "16", "--lease", "6",
                     "--pack-cache", str(cache), name="c")
        q = queue_for(run, conn)
        deadline = time.monotonic() + 60
        while q.finished_job_registry.count < 3 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert q.finished_job_registry.count >= 3, c.output()
        assert_acked_are_shipped(conn, s3_server, run)

        s3_server.stop()  # returns once the server process is gone
        cached = list(cache.glob("*.gqpack"))
        for pack in cached:
            pack.unlink()
        queued_at_stop = q.count
        if prompts_mode.by_reference:
            assert cached and queued_at_stop, "no job left to need its pack while S3 is down"
        time.sleep(1.0)  # an upload that finished just before the stop may still be acked now
        acked_at_stop = conn.zcard(q.finished_job_registry.key)
        sealed_dir = tmp_path / "spool" / "c" / run / "sealed"
        saw_unshipped = False
        down_until = time.monotonic() + 19
        while time.monotonic() < down_until:
            assert conn.zcard(q.finished_job_registry.key) == acked_at_stop, "a job was acked while S3 was down"
            saw_unshipped |= any(sealed_dir.glob("*.jsonl"))
            assert c.p.poll() is None, "the consumer gave up while S3 was down"
            time.sleep(0.25)
        assert saw_unshipped, "the consumer sealed nothing while S3 was down: the outage proved nothing"
        if prompts_mode.by_reference:
            assert "packs cannot be read now" in c.output(), "no job needed its pack while S3 was down"
        assert q.failed_job_registry.count == 0, "a job failed while S3 was down"
        s3_server.start()

        while c.p.poll() is None:
            assert_acked_are_shipped(conn, s3_server, run)
            time.sleep(0.5)
        assert c.wait(120) == 0, c.output()
    finally:
        sim.stop()
    assert_acked_are_shipped(conn, s3_server, run)
    log = c.output()
    assert "shipping" in log and "failed" in log
    if prompts_mode.by_reference:
        assert "packs_unreachable over" in log and "pack_unreadable" not in log
    assert q.failed_job_registry.count == 0
    assert conn.zcard(q.finished_job_registry.key) == 400 // 8
    summary, rows = export(tmp_path, redis_url, s3_server, run)
    assert (summary["exported"], summary["missing"], summary["failed"]) == (400, 0, 0)
    assert len({r["key"] for r in rows}) == len(rows) == 400
    print(f"\n{prompts_mode}: {acked_at_stop} of {400 // 8} jobs acked and {queued_at_stop} queued when S3 stopped; "
          f"export removed {summary['duplicates_removed']} duplicates")


@pytest.mark.slow
def test_consumer_killed_between_sealing_and_upload(tmp_path, redis_url, conn, s3_server: S3Server, s3_env,
                                                    prompts_mode: Prompts):
    sim = Sim(tmp_path, "--slots", "16", "--step-time", "0.004", "--mean-tokens", "60")
    run = "s3kill"
    try:
        enqueue(tmp_path, redis_url, s3_server, run, 240, prompts_mode)
        a = consumer(tmp_path, redis_url, s3_server, sim, run, "-c", "16", "--lease", "3", name="a", spool="shared")
        q = queue_for(run, conn)
        deadline = time.monotonic() + 60
        while q.finished_job_registry.count < 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        s3_server.stop(kill=True)
        sealed_dir = tmp_path / "spool" / "shared" / run / "sealed"
        deadline = time.monotonic() + 30
        while not any(sealed_dir.glob("*.jsonl")) and time.monotonic() < deadline:
            time.sleep(0.1)
        stranded = {p.name for p in sealed_dir.glob("*.jsonl")}
        assert stranded, "no shard was sealed while S3 was down"
        a.kill()
        acked_before = set(q.finished_job_registry.get_job_ids())
        s3_server.start()
        b = consumer(tmp_path, redis_url, s3_server, sim, run, "--burst", "-c", "32", "--lease", "3", name="b",
                     spool="shared")
        assert b.wait(120) == 0, b.output()
    finally:
        sim.stop()
    _, names = s3_records(s3_server, run)
    assert stranded <= names, "the shard left in the spool was not shipped by the next consumer"
    assert "left in the spool" in b.output()
    assert not any(sealed_dir.glob("*.jsonl"))
    recs, _ = s3_records(s3_server, run)
    counts = collections.Counter(r["key"] for r in recs)
    assert set(counts) == run_keys(conn, run)
    dup = {k for k, n in counts.items() if n > 1}
    acked_keys = job_keys(conn, s3_server, run, acked_before)
    assert not (dup & acked_keys), "an item acked before the kill was generated again"
    assert q.failed_job_registry.count == 0
    summary, rows = export(tmp_path, redis_url, s3_server, run)
    assert (summary["exported"], summary["missing"], summary["failed"]) == (240, 0, 0)
    assert summary["duplicates_removed"] == sum(counts.values()) - 240
    assert sorted(r["key"] for r in rows) == sorted(counts)  # every item exactly once
    print(f"\n{prompts_mode}: {len(stranded)} shard(s) stranded, {len(acked_before)} job(s) acked before the kill; "
          f"export removed {summary['duplicates_removed']} duplicates")
