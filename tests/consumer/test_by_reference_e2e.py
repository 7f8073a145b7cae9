"""Prompts by reference end to end (issue 34): a real redis-server, a real `producer enqueue
--prompts reference` writing packs into the run's output, real `consumer run --burst` processes
against the stand-in vLLM over HTTP, and `producer export`'s coverage proving every item
exactly once. Then a pack deleted under a queued job: the job fails with `pack_unreadable`
(status names it, export counts its items failed), and rq's own `rq requeue` runs it again once
the pack is back."""

from __future__ import annotations

import collections
import re
import shutil
import time
from pathlib import Path

import orjson
import pytest
import redis
from rq.job import Job

from genqueue.common.contracts import ExitCode
from genqueue.common.keepers.items import ItemTable
from genqueue.common.keepers.packs import PackTable
from genqueue.common.keepers.rqaccess import SERIALIZER, job_failure, queue_for
from genqueue.common.keepers.snapshots import Snapshots
from genqueue.common.packs import read_index
from genqueue.common.storage.names import pack_tag
from tests.conftest import cli, free_port, http_text, sharegpt, write_jsonl
from tests.consumer.e2e import Proc, Sim, read_results, run_keys
from tests.s3server import S3Server, s3_server  # noqa: F401 - fixture

pytestmark = pytest.mark.integration


def _enqueue(tmp_path: Path, redis_url: str, run: str, n: int, *extra: str, output: str | None = None,
             env: dict[str, str] | None = None) -> dict:
    data = write_jsonl(tmp_path / f"{run}.jsonl", [sharegpt(i, turns=1 + i % 2) for i in range(n)])
    proc = cli("producer", "enqueue", str(data), "--run", run, "--output", output or str(tmp_path / "out"),
               "--batch-size", "8", "--max-tokens", "32", "--rejects", str(tmp_path / f"{run}.rej.jsonl"), "--json",
               *extra, env={"REDIS_URL": redis_url, **(env or {})})
    summary: dict = orjson.loads(proc.stdout)
    return summary


def _consume(tmp_path: Path, redis_url: str, sim: Sim, run: str, name: str,
             env: dict[str, str] | None = None, extra: tuple[str, ...] = ("-c", "16")) -> Proc:
    return Proc("consumer", ["-v", "run", "--run", run, "--endpoint", sim.url, "--burst",
                             "--shard-max-age", "0.5", "--spool", str(tmp_path / f"spool-{name}"), *extra],
                tmp_path / f"{name}.log", env={"REDIS_URL": redis_url, **(env or {})})


def _export(tmp_path: Path, redis_url: str, run: str, env: dict[str, str] | None = None) -> dict:
    proc = cli("producer", "export", "--run", run, "--output", str(tmp_path / f"{run}.export.jsonl"), "--json",
               env={"REDIS_URL": redis_url, **(env or {})}, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary: dict = orjson.loads(proc.stdout.strip().splitlines()[-1])
    return summary


def test_a_run_by_reference_completes_every_item_once(tmp_path: Path, redis_url: str, conn: redis.Redis) -> None:
    s = _enqueue(tmp_path, redis_url, "byref", 300, "--prompts", "reference")
    assert s["prompts"] == "reference" and s["items"] == 300 and s["packs"] >= 1
    # the jobs carry no prompt: no argument, their pack and block in meta; the pack table names each pack
    q = queue_for("byref", conn)
    job = Job.fetch(q.job_ids[0], connection=conn, serializer=SERIALIZER)
    assert job.args == [] and set(job.meta) == {"items", "pack", "block", "pw"}
    table = PackTable(conn, "byref").names()
    assert len(table) == s["packs"] and job.meta["pack"] in table
    assert job.meta["pw"] == pack_tag(table[job.meta["pack"]])  # its pack writer's tag (a number may come again)
    packs = sorted((tmp_path / "out" / "byref" / "packs").glob("*.gqpack"))
    assert [p.name for p in packs] == sorted(table.values())
    assert not any(b"q1" in (conn.hget(Job.key_for(j), "data") or b"") for j in q.job_ids)
    # the mode and the packs survive in run.json (a run re-created after a Redis loss knows them)
    rf = orjson.loads((tmp_path / "out" / "byref" / "run.json").read_bytes())
    assert rf["prompts"] == "reference" and {int(k): v for k, v in rf["packs"].items()} == table

    sim = Sim(tmp_path, "--slots", "16", "--step-time", "0.005", "--mean-tokens", "8")
    conn.config_resetstat()
    try:
        consumers = [_consume(tmp_path, redis_url, sim, "byref", f"c{i}") for i in range(2)]
        for c in consumers:
            assert c.wait(120) == 0, c.output()
    finally:
        sim.stop()
    recs = read_results(tmp_path / "out", "byref")
    counts = collections.Counter(r["key"] for r in recs)
    assert set(counts) == run_keys(conn, "byref") and len(counts) == 300
    # each item marked at its place (its pack, its slot, known from its job): a BITFIELD a pack a
    # shard shipped (small shards here: a few dozen), where a mark by entry costs two an item
    bitfields = int(conn.info("commandstats").get("cmdstat_bitfield", {}).get("calls", 0))
    assert 1 <= bitfields < 300, bitfields
    assert ItemTable(conn, "byref").counts().in_run_done == 300
    # an item answered twice only by an end-of-run copy (consumer/copies.py: the race is said on the record)
    originals = collections.Counter(r["key"] for r in recs if not r.get("copy"))
    assert max(originals.values()) == 1, "no job's item answered twice"
    copies = len(recs) - 300
    assert {r["index"] for r in recs} == set(range(300))
    e = _export(tmp_path, redis_url, "byref")
    # every item once: exported, or set aside as cut by max_tokens; none missing, failed or unexpected
    assert e["enqueued"] == e["exported"] + e["truncated"] == 300 and e["records_read"] == 300 + copies
    assert (e["missing"], e["failed"], e["unexpected"], e["duplicates_removed"], e["malformed_jobs"]) == \
        (0, 0, 0, copies, [])


def test_an_inline_run_is_unchanged_and_says_so(tmp_path: Path, redis_url: str, conn: redis.Redis) -> None:
    s = _enqueue(tmp_path, redis_url, "inl", 20)
    assert s["prompts"] == "inline" and s["packs"] == 0
    job = Job.fetch(queue_for("inl", conn).job_ids[0], connection=conn, serializer=SERIALIZER)
    assert len(job.args) == 1 and len(job.args[0]) == 8 and job.meta == {"items": 8}
    assert PackTable(conn, "inl").count() == 0 and not (tmp_path / "out" / "inl" / "packs").exists()


def _export_any(tmp_path: Path, redis_url: str, run: str) -> dict:
    """`producer export --json` whatever its exit (1 when items are missing or failed)."""
    proc = cli("producer", "export", "--run", run, "--output", str(tmp_path / f"{run}.export.jsonl"), "--json",
               env={"REDIS_URL": redis_url}, check=False)
    assert proc.returncode in (0, 1), proc.stdout + proc.stderr
    summary: dict = orjson.loads(proc.stdout.strip().splitlines()[-1])
    return summary


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

        # export meanwhile: with the pack still gone its jobs' items are failed all the same (found
        # by their places in the item table), of class pack_unreadable (rq's reason), not missing;
        # once it is back, read from the pack, the same
        gone = _export_any(tmp_path, redis_url, "gone")
        assert (gone["missing"], gone["failed"], gone["failed_by_class"], gone["malformed_jobs"]) == \
            (0, 40, {"pack_unreadable": 40}, []), gone
        shutil.move(hidden, pack)
        back = _export_any(tmp_path, redis_url, "gone")
        assert (back["missing"], back["failed"], back["failed_by_class"]) == (0, 40, {"pack_unreadable": 40}), back
        cli("rq", "requeue", "-u", redis_url, "--queue", "genqueue.gone", "--all")
        second = _consume(tmp_path, redis_url, sim, "gone", "second")
        assert second.wait(60) == 0, second.output()
    finally:
        sim.stop()
    counts = collections.Counter(r["key"] for r in read_results(tmp_path / "out", "gone"))
    assert set(counts) == run_keys(conn, "gone") and len(counts) == 40 and max(counts.values()) == 1
    e = _export(tmp_path, redis_url, "gone")
    assert e["exported"] + e["truncated"] == e["enqueued"] == 40 and (e["missing"], e["failed"]) == (0, 0)


def test_a_gone_packs_items_are_pack_unreadable_on_status_and_failed_at_export_not_elsewhere_and_missing(
        tmp_path: Path, redis_url: str, conn: redis.Redis) -> None:
    """Old: status said only `elsewhere 40 (failed jobs, or moved since the last report)`, never
    pack_unreadable nor the pack, and export counted the 40 items missing. New: status has a row
    `pack_unreadable 40 items in 5 jobs (pack <name>)`, and export counts them failed, class
    pack_unreadable (found by their places in the item table), so done + failed + missing adds
    up to what was enqueued, as docs/enqueue.md says."""
    s = _enqueue(tmp_path, redis_url, "lost", 40, "--prompts", "reference")
    assert (s["packs"], s["jobs"]) == (1, 5)
    pack = next((tmp_path / "out" / "lost" / "packs").glob("*.gqpack"))
    pack.unlink()
    sim = Sim(tmp_path, "--slots", "16", "--step-time", "0.005", "--mean-tokens", "8")
    try:
        _consume(tmp_path, redis_url, sim, "lost", "c").wait(60)
    finally:
        sim.stop()
    assert queue_for("lost", conn).failed_job_registry.count == 5

    env = {"REDIS_URL": redis_url, "COLUMNS": "100"}
    text = cli("producer", "status", "--run", "lost", env=env, cwd=tmp_path).stdout
    said = " ".join(text.split())  # rows wrap at the default width
    assert "elsewhere 40 (in failed jobs: below)" in said, text
    assert f"failed jobs pack_unreadable 40 items in 5 jobs (pack {pack.name}); `rq requeue" in said, text
    assert all(len(x) <= 100 for x in text.splitlines()), "wrapped to the default width, nothing cut"
    report = orjson.loads(cli("producer", "status", "--run", "lost", "--json", env=env, cwd=tmp_path).stdout)
    assert report["failed_jobs"] == {"jobs": 5, "items": 40, "by_class": {
        "pack_unreadable": {"jobs": 5, "items": 40, "packs": [pack.name]}}}

    e = _export_any(tmp_path, redis_url, "lost")
    assert (e["missing"], e["failed"], e["failed_by_class"], e["malformed_jobs"]) == \
        (0, 40, {"pack_unreadable": 40}, []), e
    assert e["enqueued"] == e["exported"] + e["truncated"] + e["failed"] + e["missing"] == 40
    errors = [orjson.loads(x) for x in Path(e["errors_path"]).read_bytes().splitlines()]
    assert {r["key"] for r in errors} == run_keys(conn, "lost")
    assert {(r["pack"], r["error"]["class"]) for r in errors} == {(pack.name, "pack_unreadable")}
    assert sorted(r["slot"] for r in errors) == list(range(40))


@pytest.mark.slow  # over 10 s: two consumers' starts and three exports
def test_a_corrupt_block_fails_only_its_job_and_rq_requeue_runs_it_once_the_pack_is_mended(
        tmp_path: Path, redis_url: str, conn: redis.Redis) -> None:
    """One byte flipped in the frame of a pack's first block: that block's job fails as
    pack_unreadable (its items never skipped in silence), the others complete; export counts its
    items failed (pack_unreadable), before and after the pack's bytes are good again;
    `rq requeue` runs the job, and every item is exported once."""
    s = _enqueue(tmp_path, redis_url, "bad", 40, "--prompts", "reference")
    assert (s["packs"], s["jobs"]) == (1, 5)
    pack = next((tmp_path / "out" / "bad" / "packs").glob("*.gqpack"))
    good = pack.read_bytes()
    first = read_index(good, pack.name).blocks[0]
    assert first.count == 8
    spoilt = bytearray(good)
    spoilt[first.offset + first.length // 2] ^= 0xFF
    pack.write_bytes(bytes(spoilt))
    sim = Sim(tmp_path, "--slots", "16", "--step-time", "0.005", "--mean-tokens", "8")
    try:
        c = _consume(tmp_path, redis_url, sim, "bad", "first")
        assert c.wait(60) == ExitCode.INCOMPLETE, c.output()  # drained, with a job rq gave up on: not done
        assert "8 of 40 items not done: 8 items are in 1 job rq gave up on" in c.output()
        q = queue_for("bad", conn)
        failed = q.failed_job_registry.get_job_ids()
        assert len(failed) == 1 and q.finished_job_registry.count == 4, c.output()
        job = Job.fetch(failed[0], connection=conn, serializer=SERIALIZER)
        assert job.meta["block"] == 0
        why = job_failure(job) or ""
        assert why.startswith("pack_unreadable: ") and pack.name in why, why
        answered = {r["key"] for r in read_results(tmp_path / "out", "bad")}
        assert len(answered) == 32, "the other four jobs' items, and none of the spoilt block's"
        # export reads the same spoilt block: its 8 items failed by their places (pack_unreadable,
        # rq's reason), not missing; with the pack mended, read from it, the same
        e = _export_any(tmp_path, redis_url, "bad")
        assert (e["missing"], e["failed"], e["failed_by_class"], e["malformed_jobs"]) == \
            (0, 8, {"pack_unreadable": 8}, []), e
        pack.write_bytes(good)
        e = _export_any(tmp_path, redis_url, "bad")
        assert (e["missing"], e["failed"], e["failed_by_class"]) == (0, 8, {"pack_unreadable": 8}), e
        cli("rq", "requeue", "-u", redis_url, "--queue", "genqueue.bad", "--all")
        again = _consume(tmp_path, redis_url, sim, "bad", "second")
        assert again.wait(60) == 0, again.output()
    finally:
        sim.stop()
    counts = collections.Counter(r["key"] for r in read_results(tmp_path / "out", "bad"))
    assert len(counts) == 40 and max(counts.values()) == 1
    e = _export(tmp_path, redis_url, "bad")
    assert e["exported"] + e["truncated"] == e["enqueued"] == 40 and (e["missing"], e["failed"]) == (0, 0)
    assert e["duplicates_removed"] == 0


def test_a_pack_the_store_cannot_serve_now_gives_its_jobs_back_not_failed(
        tmp_path: Path, redis_url: str, conn: redis.Redis) -> None:
    """A StoreError (here: a directory where the pack's file should be, which the local store cannot
    read) is the store's trouble, not the pack's: the jobs wait in their queue, none fails, and the
    run completes once the pack reads again."""
    s = _enqueue(tmp_path, redis_url, "wait", 24, "--prompts", "reference")
    assert s["packs"] == 1
    pack = next((tmp_path / "out" / "wait" / "packs").glob("*.gqpack"))
    hidden = tmp_path / "hidden.gqpack"
    shutil.move(pack, hidden)
    pack.mkdir()
    sim = Sim(tmp_path, "--slots", "16", "--step-time", "0.005", "--mean-tokens", "8")
    try:
        c = _consume(tmp_path, redis_url, sim, "wait", "c")
        deadline = time.monotonic() + 30
        while "packs cannot be read now" not in c.output() and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(1.5)  # several attempts meanwhile
        assert "packs cannot be read now" in c.output(), c.output()
        assert queue_for("wait", conn).failed_job_registry.count == 0
        pack.rmdir()
        shutil.move(hidden, pack)
        assert c.wait(60) == 0, c.output()
    finally:
        sim.stop()
    counts = collections.Counter(r["key"] for r in read_results(tmp_path / "out", "wait"))
    assert len(counts) == 24 and max(counts.values()) == 1
    log = c.output()
    assert "pack_unreadable" not in log
    # one line where the outage starts, one where it ends, whatever the attempts in between
    assert log.count("packs cannot be read now") == 1 and log.count("packs_unreachable over") == 1, log
    tries = re.search(r"packs_unreachable over after [0-9.]+ s and (\d+) failed read", log)
    assert tries and int(tries[1]) >= 2, log


def test_a_run_by_reference_on_s3(tmp_path: Path, redis_url: str, conn: redis.Redis, s3_server: S3Server) -> None:
    env = dict(s3_server.env)
    output = s3_server.url("runs/byref")
    s = _enqueue(tmp_path, redis_url, "s3ref", 120, "--prompts", "reference", output=output, env=env)
    assert s["prompts"] == "reference" and s["packs"] == 1
    client = s3_server.client()
    listed = client.list_objects_v2(Bucket=s3_server.bucket, Prefix="runs/byref/s3ref/packs/")
    assert [o["Key"].rsplit("/", 1)[-1] for o in listed.get("Contents", [])] == \
        list(PackTable(conn, "s3ref").names().values())
    sim = Sim(tmp_path, "--slots", "16", "--step-time", "0.005", "--mean-tokens", "8")
    try:
        c = _consume(tmp_path, redis_url, sim, "s3ref", "c", env={**env, "GENQUEUE_S3_ABORT_AFTER": "0"})
        assert c.wait(90) == 0, c.output()
    finally:
        sim.stop()
    e = _export(tmp_path, redis_url, "s3ref", env=env)
    assert e["enqueued"] == e["exported"] + e["truncated"] == e["records_read"] == 120
    assert (e["missing"], e["failed"], e["duplicates_removed"], e["malformed_jobs"]) == (0, 0, 0, [])


def test_the_reconcile_reads_jobs_by_reference_from_their_packs(
        tmp_path: Path, redis_url: str, conn: redis.Redis) -> None:
    """Enqueueing again into a run by reference: the reconcile reads the live jobs' items from
    their packs, so nothing is queued twice; a grown input adds only its new items (inline here:
    the modes mix); a job lost from rq is queued again, in a new pack; the run then completes
    with every item once."""
    s = _enqueue(tmp_path, redis_url, "again", 16, "--prompts", "reference")
    assert (s["jobs"], s["packs"]) == (2, 1)
    data = tmp_path / "again.jsonl"
    q = queue_for("again", conn)

    def enqueue(*extra: str) -> dict:
        proc = cli("producer", "enqueue", str(data), "--run", "again", "--output", str(tmp_path / "out"),
                   "--batch-size", "8", "--max-tokens", "32", "--rejects", str(tmp_path / "r.jsonl"), "--json",
                   *extra, env={"REDIS_URL": redis_url})
        out: dict = orjson.loads(proc.stdout)
        return out

    same = enqueue("--prompts", "reference")
    assert (same["enqueued"], same["already_queued"], same["jobs"], same["packs"]) == (0, 16, 0, 0)
    assert same["queue_view"]["live_items"] == 16 and same["queue_view"]["malformed_jobs"] == []
    write_jsonl(data, [sharegpt(i, turns=1 + i % 2) for i in range(24)])
    grown = enqueue("--prompts", "inline")  # given: the modes mix (auto would keep the run's, by reference)
    assert (grown["enqueued"], grown["already_queued"], grown["jobs"], grown["prompts"]) == (8, 16, 1, "inline")
    lost = q.job_ids[0]
    conn.lrem(q.key, 0, lost)  # a job by reference lost from rq
    back = enqueue("--prompts", "reference")
    assert (back["requeued"], back["jobs"], back["packs"]) == (8, 1, 1) and q.count == 3
    assert PackTable(conn, "again").count() == 2

    sim = Sim(tmp_path, "--slots", "16", "--step-time", "0.005", "--mean-tokens", "8")
    try:
        c = _consume(tmp_path, redis_url, sim, "again", "c")
        assert c.wait(60) == 0, c.output()
    finally:
        sim.stop()
    counts = collections.Counter(r["key"] for r in read_results(tmp_path / "out", "again"))
    assert set(counts) == run_keys(conn, "again") and len(counts) == 24 and max(counts.values()) == 1
    e = _export(tmp_path, redis_url, "again")
    assert e["exported"] + e["truncated"] == e["enqueued"] == 24 and (e["missing"], e["failed"]) == (0, 0)


def test_a_reconcile_that_cannot_read_a_pack_stops_and_queues_nothing_twice(
        tmp_path: Path, redis_url: str, conn: redis.Redis) -> None:
    s = _enqueue(tmp_path, redis_url, "nopack", 16, "--prompts", "reference")
    assert s["jobs"] == 2
    next((tmp_path / "out" / "nopack" / "packs").glob("*.gqpack")).unlink()
    proc = cli("producer", "enqueue", str(tmp_path / "nopack.jsonl"), "--run", "nopack", "--output",
               str(tmp_path / "out"), "--batch-size", "8", "--max-tokens", "32", "--rejects", str(tmp_path / "r.jsonl"),
               env={"REDIS_URL": redis_url}, check=False)
    assert proc.returncode == 2 and "cannot be read" in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr
    assert queue_for("nopack", conn).count == 2


def test_a_pack_that_cannot_be_written_queues_nothing_and_the_same_command_queues_all_later(
        tmp_path: Path, redis_url: str, conn: redis.Redis) -> None:
    """A pack is written before the transaction that names it: when the write fails, no job of its
    slice exists, the slice's claim is given back, and the command ends with one line; once the
    output takes packs again the same command queues every item, each once."""
    data = write_jsonl(tmp_path / "nowrite.jsonl", [sharegpt(i) for i in range(20)])
    (tmp_path / "out" / "nowrite").mkdir(parents=True)
    (tmp_path / "out" / "nowrite" / "packs").write_text("a file where the packs' directory goes")
    args = ("producer", "enqueue", str(data), "--run", "nowrite", "--output", str(tmp_path / "out"), "--batch-size",
            "8", "--rejects", str(tmp_path / "r.jsonl"), "--prompts", "reference")
    proc = cli(*args, env={"REDIS_URL": redis_url}, check=False)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()  # the claim given back (a warning), then the error's one line
    assert lines[-1].startswith("error: cannot write ") and "released 20 claimed items" in lines[0], proc.stderr
    assert queue_for("nowrite", conn).count == 0 and PackTable(conn, "nowrite").count() == 0
    (tmp_path / "out" / "nowrite" / "packs").unlink()
    proc = cli(*args, "--json", env={"REDIS_URL": redis_url})
    s = orjson.loads(proc.stdout)
    assert (s["enqueued"], s["jobs"], s["packs"]) == (20, 3, 1) and queue_for("nowrite", conn).count == 3


def _paused(conn: redis.Redis) -> dict[str, str]:
    """The pause reasons in the one consumer's last snapshot (what `producer status` reads)."""
    reports = Snapshots(conn).reports(time.time())
    assert len(reports) <= 1, reports
    return dict(reports[0].get("paused") or {}) if reports else {}


@pytest.mark.slow  # 16 s: in the slow tier, which CI runs too
def test_an_s3_outage_while_a_run_by_reference_is_consumed_is_a_paused_state_and_loses_nothing(
        tmp_path: Path, redis_url: str, conn: redis.Redis, s3_server: S3Server) -> None:
    """S3 stopped while one consumer takes a run by reference from it: the consumer says it is
    paused with packs_unreachable (its snapshot, `producer status`, genqueue_paused) for as long
    as the packs cannot be read, gives their jobs back (none fails, none spends a retry), and
    once S3 is back every item is done exactly once (export's coverage, no duplicates)."""
    env = dict(s3_server.env)
    run = "s3out"
    s = _enqueue(tmp_path, redis_url, run, 160, "--prompts", "reference", output=s3_server.url("runs/out"), env=env)
    assert (s["packs"], s["jobs"]) == (1, 20)
    q = queue_for(run, conn)
    port = free_port()
    sim = Sim(tmp_path, "--slots", "8", "--step-time", "0.01", "--mean-tokens", "16")
    # without the host's disk cache: a cached pack reads through an outage (one GET a pack, then
    # the disk), so each job's ranged GET is what meets the outage here
    c = _consume(tmp_path, redis_url, sim, run, "c", env={**env, "GENQUEUE_S3_ABORT_AFTER": "0"},
                 extra=("-c", "8", "--metrics-port", str(port), "--pack-cache-bytes", "0"))
    try:
        deadline = time.monotonic() + 30
        while q.finished_job_registry.count < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert q.finished_job_registry.count >= 2, c.output()
        s3_server.stop()
        t_down = time.monotonic()
        detail, metric = "", ""
        while time.monotonic() - t_down < 25 and not (detail and 'reason="packs_unreachable"} 1.0' in metric):
            assert q.failed_job_registry.count == 0 and c.p.poll() is None, c.output()[-3000:]
            detail = _paused(conn).get("packs_unreachable", "")  # the consumer's snapshot in Redis
            metric = http_text(f"http://127.0.0.1:{port}/metrics", timeout=2) or ""
            time.sleep(0.1)
        assert detail.startswith(f"run {run}: packs unreachable since ") and "failed read" in detail, \
            detail + c.output()[-3000:]
        assert 'genqueue_paused{reason="packs_unreachable"} 1.0' in metric
        text = cli("producer", "status", "--run", run, "--wide", env={"REDIS_URL": redis_url, **env}).stdout
        assert "(paused: packs_unreachable)" in text and f"run {run}: packs unreachable since" in text, text
        down_for = time.monotonic() - t_down
        time.sleep(max(0.0, 3.0 - down_for))  # jobs keep being given back meanwhile
        assert q.failed_job_registry.count == 0, "a store outage fails no job"
        s3_server.start()
        t_up = time.monotonic()
        assert c.wait(90) == 0, c.output()[-3000:]
        took = time.monotonic() - t_up
    finally:
        if c.p.poll() is None:
            c.kill()
        sim.stop()
    log = c.output()
    assert log.count("packs cannot be read now") == 1, "one line where the outage starts, not one per job"
    assert log.count("packs_unreachable over") == 1 and "a pack reads again" in log
    assert "pack_unreadable" not in log
    assert "packs_unreachable" not in _paused(conn), "its last snapshot: the pause ended"
    assert q.failed_job_registry.count == 0 and conn.zcard(q.finished_job_registry.key) == 20
    e = _export(tmp_path, redis_url, run, env=env)
    assert e["enqueued"] == e["exported"] + e["truncated"] == e["records_read"] == 160
    assert (e["missing"], e["failed"], e["duplicates_removed"], e["malformed_jobs"]) == (0, 0, 0, [])
    print(f"paused state seen {down_for:.1f} s after S3 stopped; done {took:.1f} s after it was back")
