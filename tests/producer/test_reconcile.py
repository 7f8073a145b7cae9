"""`producer enqueue` is the reconcile (real redis-server, the CLI as a user runs it): a re-run
queues exactly the items with no shipped result that are in no live job, once each, whatever
was lost from rq, left by a killed producer, or raced by other producers."""

from __future__ import annotations

import collections
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import orjson
import pytest
import redis

from genqueue.common.keepers.claims import CLAIM_GRACE, CLAIM_TTL
from genqueue.common.keepers.items import DONE, FAILED, ItemTable
from genqueue.common.keepers.keeper import run_key
from genqueue.common.keepers.rqaccess import LIVE_PLACES, queue_for
from genqueue.common.keepers.rqjobs import JobScan, read_jobs
from genqueue.common.keepers.runlock import LockLostError, RunLock
from genqueue.common.keepers.runs import key_digest
from genqueue.producer.enqueue.jobwriter import JobWriter
from genqueue.producer.packitems import PackItems
from tests.conftest import BIN, Prompts, both_modes_reference_slow, cli, sharegpt, write_jsonl

pytestmark = pytest.mark.integration

BUCKETS = ("enqueued", "retried_failed", "already_queued", "already_failed", "already_done", "duplicates",
           "rejected")


def enqueue(redis_url: str, data: Path, run: str, *extra: str, check: bool = True,
            output: Path | None = None) -> dict[str, Any]:
    args = ["enqueue", str(data), "--run", run, "--batch-size", "8", "--json", "--rejects", os.devnull, *extra]
    if output is not None:
        args += ["--output", str(output)]
    proc = cli("producer", *args, env={"REDIS_URL": redis_url}, check=check)
    if not check:
        return {"returncode": proc.returncode, "stderr": proc.stderr}
    s: dict[str, Any] = orjson.loads(proc.stdout)
    s["stderr"] = proc.stderr
    assert s["records"] == sum(s[b] for b in BUCKETS), s  # the accounting identity
    assert s["already_enqueued"] == s["already_queued"] + s["already_failed"] + s["already_done"]
    return s


def queued_item_keys(conn: redis.Redis, run: str, output: Path | None = None) -> list[str]:
    """The item keys of every live job of RUN, with repeats (an item twice in the queue is a bug);
    jobs by reference read from their packs in OUTPUT."""
    items_of = None if output is None else PackItems(conn, run, str(output)).items_of
    scan = JobScan()
    keys = [it["key"] for job in read_jobs(conn, run, LIVE_PLACES, scan=scan, items_of=items_of) for it in job.items]
    assert scan.count == 0, scan.to_list()  # a job whose items were not read would pass for one without items
    return keys


def item_keys(conn: redis.Redis, run: str) -> set[str]:
    return {d.hex() for d in ItemTable(conn, run).digests()}


def test_rq_empty_then_enqueue_queues_the_lost_items_once(tmp_path: Path, redis_url: str, conn: redis.Redis,
                                                          prompts_mode: Prompts) -> None:
    data = write_jsonl(tmp_path / "e.jsonl", [sharegpt(i) for i in range(300)])
    out = tmp_path / "out"
    first = enqueue(redis_url, data, "empty", *prompts_mode.args, output=out)
    assert first["enqueued"] == 300 and first["queue_view"] is None  # a new run: no view needed
    assert first["prompts"] == prompts_mode.mode
    again = enqueue(redis_url, data, "empty", *prompts_mode.args, output=out)
    assert again["already_queued"] == 300 and again["jobs"] == 0 and again["items"] == 0
    # A third of the run has results (done marks), a few have only error records.
    keys = sorted(item_keys(conn, "empty"))
    ItemTable(conn, "empty").change([key_digest(k) for k in keys[:100]], add=DONE)
    ItemTable(conn, "empty").change([key_digest(k) for k in keys[100:110]], add=FAILED)
    cli("rq", "empty", "-u", redis_url, "genqueue.empty")  # as README says; the queue is gone
    assert queue_for("empty", conn).count == 0
    (row,) = [r for r in map(orjson.loads, cli("producer", "runs", "--json", env={"REDIS_URL": redis_url})
                             .stdout.splitlines()) if r["run"] == "empty"]
    assert row["state"] == "incomplete" and row["stalled"] == (
        f"190 items are in no job (lost from the queue): `producer enqueue {data} --run empty` queues them again")
    s = enqueue(redis_url, data, "empty", *prompts_mode.args, output=out)
    assert (s["enqueued"], s["already_done"], s["already_failed"], s["already_queued"]) == (190, 100, 10, 0), s
    assert s["items"] == s["requeued"] == 190 and s["queue_view"]["live_jobs"] == 0
    queued = queued_item_keys(conn, "empty", out)
    assert len(queued) == len(set(queued)) == 190 and set(queued) == set(keys[110:])
    assert conn.get(RunLock.key("empty")) is None, "the lock is released"
    # --retry-failed takes the ten back, once; a run with nothing to do queues nothing
    r = enqueue(redis_url, data, "empty", "--retry-failed", *prompts_mode.args, output=out)
    assert (r["retried_failed"], r["retried"], r["already_queued"], r["already_done"]) == (10, 10, 190, 100), r
    assert r["enqueued"] == 0
    r2 = enqueue(redis_url, data, "empty", "--retry-failed", *prompts_mode.args, output=out)
    assert r2["already_queued"] == 200 and r2["items"] == 0
    queued = queued_item_keys(conn, "empty", out)
    assert len(queued) == len(set(queued)) == 200


def test_items_of_jobs_rq_gave_up_on_are_failed_until_retried(tmp_path: Path, redis_url: str,
                                                              conn: redis.Redis, prompts_mode: Prompts) -> None:
    data = write_jsonl(tmp_path / "f.jsonl", [sharegpt(i) for i in range(40)])
    out = tmp_path / "out"
    enqueue(redis_url, data, "gaveup", *prompts_mode.args, output=out)
    q = queue_for("gaveup", conn)
    job_ids = q.job_ids
    failed_job = q.fetch_job(job_ids[0])
    assert failed_job is not None
    with conn.pipeline() as p:  # as rq does when a job's retries are spent
        q.remove(failed_job.id, pipeline=p)
        q.failed_job_registry.add(failed_job, pipeline=p, exc_string="abandoned 4 times")
        p.execute()
    s = enqueue(redis_url, data, "gaveup", *prompts_mode.args, output=out)
    assert (s["already_failed"], s["already_queued"], s["items"]) == (8, 32, 0), s
    r = enqueue(redis_url, data, "gaveup", "--retry-failed", *prompts_mode.args, output=out)
    assert (r["retried_failed"], r["already_queued"]) == (8, 32), r
    queued = queued_item_keys(conn, "gaveup", out)
    assert len(queued) == len(set(queued)) == 40


@both_modes_reference_slow
def test_a_claim_left_by_a_killed_producer_is_taken_over_after_its_grace(tmp_path: Path, redis_url: str,
                                                                          conn: redis.Redis,
                                                                          prompts_mode: Prompts) -> None:
    # jobwriter.py's window: a producer SIGKILLed between its claim and its transaction.
    data = write_jsonl(tmp_path / "k.jsonl", [sharegpt(i) for i in range(3000)])
    out = tmp_path / "out"
    mode = [*prompts_mode.args, "--output", str(out)]
    script = f"""
import os, sys
from genqueue.producer.enqueue import jobwriter
real, calls = jobwriter.JobWriter._commit, []
def commit(self, *a, **k):
    calls.append(1)
    if len(calls) == 2:
        os._exit(9)  # the second slice is claimed, never enqueued
    return real(self, *a, **k)
jobwriter.JobWriter._commit = commit
from genqueue.producer.cli import main
main(["enqueue", {str(data)!r}, "--run", "killed", "--batch-size", "8", "--rejects", os.devnull, *{mode!r}])
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False,
                          env={**os.environ, "REDIS_URL": redis_url})
    assert proc.returncode == 9, proc.stderr
    # The slices being written when it died (slices.py WRITERS at once) left their claims; which
    # of them had queued their jobs first depends on the writers' race.
    claims = conn.keys(run_key("killed", "claim:*"))
    claimed = {d.hex() for c in claims for d in conn.smembers(c)}
    queued_first = queued_item_keys(conn, "killed", out)
    assert claims and len(claimed) == sum(conn.scard(c) for c in claims) and not claimed & set(queued_first)
    # At once: the claims may be a live producer's, about to enqueue; their items are left to it.
    s = enqueue(redis_url, data, "killed", *prompts_mode.args, output=out)
    held = len(claimed) + len(queued_first)
    assert (s["enqueued"], s["already_queued"]) == (3000 - held, held), s
    assert s["queue_view"]["claims_held_by_others"] == len(claims) and all(conn.exists(c) for c in claims)
    # Past the grace period they are orphans: taken over, their items queued, once.
    for c in claims:
        conn.expire(c, CLAIM_TTL - CLAIM_GRACE - 5)
    s = enqueue(redis_url, data, "killed", *prompts_mode.args, output=out)
    assert (s["enqueued"], s["requeued"], s["already_queued"]) == (len(claimed), len(claimed), 3000 - len(claimed)), s
    assert s["queue_view"]["claims_taken_over"] == len(claims) and not any(conn.exists(c) for c in claims)
    queued = queued_item_keys(conn, "killed", out)
    assert len(queued) == len(set(queued)) == 3000 and set(queued) == item_keys(conn, "killed")
    assert enqueue(redis_url, data, "killed", *prompts_mode.args, output=out)["already_queued"] == 3000


def test_a_run_whose_producer_died_after_its_claim_says_so_and_is_never_done(tmp_path: Path, redis_url: str,
                                                                             conn: redis.Redis) -> None:
    """A producer killed between its only claim and its transaction: every item of the run is in
    the run and in no job. The enqueue run again at once leaves them to that claim (its producer
    may be alive), and says so; `producer status` and `producer runs` say where they are and
    what queues them, and the run is never `done` (it was, with 0 of 8 items done)."""
    from genqueue.common.contracts import ExitCode
    from genqueue.producer.cli import format_summary
    from genqueue.producer.enqueue.summary import Summary
    from genqueue.producer.status import format_status, run_status
    from tests.consumer.e2e import Proc, Sim

    data = write_jsonl(tmp_path / "one.jsonl", [sharegpt(i) for i in range(8)])
    script = f"""
import os
from genqueue.producer.enqueue import jobwriter
jobwriter.JobWriter._commit = lambda self, *a, **k: os._exit(9)  # its one slice claimed, never queued
from genqueue.producer.cli import main
main(["enqueue", {str(data)!r}, "--run", "dead", "--batch-size", "8", "--rejects", os.devnull,
      "--output", {str(tmp_path / "out")!r}])
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False,
                          env={**os.environ, "REDIS_URL": redis_url})
    assert proc.returncode == 9, proc.stderr
    (claim,) = conn.keys(run_key("dead", "claim:*"))
    env = {"REDIS_URL": redis_url}

    def runs_row() -> dict[str, Any]:
        (row,) = [r for r in map(orjson.loads, cli("producer", "runs", "--json", env=env).stdout.splitlines())
                  if r["run"] == "dead"]
        return row

    s = enqueue(redis_url, data, "dead", output=tmp_path / "out")
    assert (s["enqueued"], s["already_queued"], s["queue_view"]["claimed_items_held"]) == (0, 8, 8), s
    table = format_summary(Summary(**{k: v for k, v in s.items() if k in Summary.__dataclass_fields__}))
    assert "claimed, in no job  8 items in 1 claim(s) of a producer, in no job yet" in table, table
    r = run_status(conn, "dead")
    assert (r["items_elsewhere"], r["claimed"]["items"], r["claimed"]["stale"]) == (8, 8, 0), r["claimed"]
    shown = format_status(r, color=False, width=None)
    assert "elsewhere 8 (8 claimed by a producer: below)" in shown and "an enqueue still running queues them" in shown
    assert "STALLED" not in shown
    row = runs_row()
    assert (row["state"], row["done"], row["items"]) == ("incomplete", 0, 8) and "8 items in 1 claim" in row["stalled"]
    sim = Sim(tmp_path, "--mean-tokens", "8")
    try:  # a --burst consumer finds nothing to do: not a success
        c = Proc("consumer", ["run", "--run", "dead", "--endpoint", sim.url, "--burst", "--spool",
                              str(tmp_path / "spool")], tmp_path / "c.log", env=env)
        assert c.wait(60) == ExitCode.INCOMPLETE, c.output()
    finally:
        sim.stop()
    assert "run dead was not served to the end: 8 of 8 items not done: 8 items in 1 claim(s)" in c.output()

    conn.expire(claim, CLAIM_TTL - CLAIM_GRACE - 5)  # its producer is gone for good
    r = run_status(conn, "dead")
    assert r["claimed"]["stale"] == 1 and f"`producer enqueue {data} --run dead` takes them over" in r["claimed"]["line"]
    assert format_status(r, color=False).startswith("STALLED  8 items in 1 claim(s) of a producer"), r["claimed"]
    assert "it stopped between claiming them and queueing them" in runs_row()["stalled"]
    s = enqueue(redis_url, data, "dead", output=tmp_path / "out")
    assert (s["enqueued"], s["requeued"], s["queue_view"]["claims_taken_over"]) == (8, 8, 1), s
    r = run_status(conn, "dead")
    assert (r["items_queued"], r["items_elsewhere"], r["claimed"]["items"]) == (8, 0, 0)
    assert runs_row()["state"] == "queued" and not conn.exists(claim)


@both_modes_reference_slow
def test_reconciles_racing_each_other_queue_each_lost_item_once(tmp_path: Path, redis_url: str,
                                                                  conn: redis.Redis, prompts_mode: Prompts) -> None:
    records = [sharegpt(i) for i in range(4000)]
    data = write_jsonl(tmp_path / "race.jsonl", records[:2000])
    output = tmp_path / "out"
    enqueue(redis_url, data, "rrace", *prompts_mode.args, output=output)
    cli("rq", "empty", "-u", redis_url, "genqueue.rrace")
    write_jsonl(data, records)  # the input grew meanwhile: half lost from rq, half new
    env = {**os.environ, "REDIS_URL": redis_url}
    procs = [subprocess.Popen([str(BIN / "producer"), "enqueue", str(data), "--run", "rrace", "--batch-size", "8",
                               "--json", "--rejects", os.devnull, "--output", str(output), *prompts_mode.args],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              env=env) for _ in range(4)]
    summaries = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err.decode()
        summaries.append(orjson.loads(out))
    assert sum(s["requeued"] for s in summaries) == 2000
    assert sum(s["items"] for s in summaries) == 4000
    queued = queued_item_keys(conn, "rrace", output)
    assert len(queued) == len(set(queued)) == 4000
    assert conn.keys(run_key("rrace", "claim:*")) == [] and conn.get(RunLock.key("rrace")) is None
    print(f"items queued per producer ({prompts_mode}):", sorted(s["items"] for s in summaries))


def test_producers_wait_for_the_lock_and_a_lost_lock_requeues_nothing(tmp_path: Path, redis_url: str,
                                                                      conn: redis.Redis) -> None:
    data = write_jsonl(tmp_path / "l.jsonl", [sharegpt(i) for i in range(50)])
    other = RunLock(redis.Redis.from_url(redis_url), "locked", ttl=60)
    other.acquire()
    released: list[float] = []
    err = tmp_path / "enqueue.err"
    waiting = "waiting for the producer that holds its lock"

    def release_once_waited() -> None:
        # the lock is let go once the producer said it waits for it: a fixed 2 s passed before a
        # producer started on a loaded machine, which then took a free lock and said nothing
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and waiting not in err.read_text(errors="replace"):
            time.sleep(0.1)
        released.append(time.monotonic())
        other.release()

    args = ["enqueue", str(data), "--run", "locked", "--batch-size", "8", "--json", "--rejects", os.devnull]
    with err.open("wb") as err_file:
        proc = subprocess.Popen([str(BIN / "producer"), *args], stdout=subprocess.PIPE, stderr=err_file,
                                env={**os.environ, "REDIS_URL": redis_url})
        releaser = threading.Thread(target=release_once_waited)
        releaser.start()
        out, _ = proc.communicate(timeout=180)
        releaser.join()
    assert proc.returncode == 0, err.read_text()
    s = orjson.loads(out)
    assert released and time.monotonic() - released[0] < 30
    assert s["enqueued"] == 50 and waiting in err.read_text()
    # A producer whose lock expired (it was stopped) and was taken by another re-queues nothing.
    cli("rq", "empty", "-u", redis_url, "genqueue.locked")
    lock = RunLock(conn, "locked", ttl=1)
    lock.acquire()
    writer = JobWriter("locked", conn, batch_size=8, lock=lock)
    conn.set(RunLock.key("locked"), "someone-else")  # as if it expired and another took it
    items = [{"key": k, "index": i, "turn": None, "messages": [{"role": "user", "content": "q"}]}
             for i, k in enumerate(sorted(item_keys(conn, "locked")))]
    with pytest.raises(LockLostError):
        writer.requeue(items, retry_failed=False)  # type: ignore[arg-type]
    assert queued_item_keys(conn, "locked") == [] and conn.keys(run_key("locked", "claim:*")) == []
    lock.held = False  # not ours any more: nothing to release
    conn.delete(RunLock.key("locked"))
    s = enqueue(redis_url, data, "locked")
    assert s["requeued"] == 50 and collections.Counter(queued_item_keys(conn, "locked")).most_common(1)[0][1] == 1


def test_a_finished_run_with_an_unchanged_input_is_not_read_again(tmp_path: Path, redis_url: str,
                                                                    conn: redis.Redis) -> None:
    lines = [orjson.dumps(sharegpt(i)) for i in range(500)] + [b"{broken", orjson.dumps(sharegpt(7))]
    data = tmp_path / "u.jsonl"
    data.write_bytes(b"\n".join(lines) + b"\n")
    first = enqueue(redis_url, data, "unch")
    assert first["complete"] and first["input_digest"] and not first["input_unchanged"]
    s = enqueue(redis_url, data, "unch")  # items still queued: the input has a duplicate record, so it is read
    assert not s["input_unchanged"] and s["already_queued"] == 501
    ItemTable(conn, "unch").change(list(ItemTable(conn, "unch").digests()), add=DONE)  # every item's result shipped
    ItemTable(conn, "unch").change([key_digest(min(item_keys(conn, "unch")))], add=FAILED)  # and an old error record
    fast = enqueue(redis_url, data, "unch")
    full = enqueue(redis_url, data, "unch", "--retry-failed")  # reads the input: nothing to retry
    assert fast["input_unchanged"] and not full["input_unchanged"]
    assert {b: fast[b] for b in BUCKETS} == {b: full[b] for b in BUCKETS} == {
        "enqueued": 0, "retried_failed": 0, "already_queued": 0, "already_failed": 0, "already_done": 501,
        "duplicates": 0, "rejected": 1}
    assert fast["rejected_by_reason"] == {"invalid_json": 1} and fast["items"] == 0
    # one item not done (and its record a duplicate's), another setting, or another input: read in full again
    ItemTable(conn, "unch").change([key_digest(sorted(item_keys(conn, "unch"))[1])], clear=DONE)
    assert not enqueue(redis_url, data, "unch")["input_unchanged"]
    ItemTable(conn, "unch").change(list(ItemTable(conn, "unch").digests()), add=DONE)
    assert enqueue(redis_url, data, "unch")["input_unchanged"]
    assert not enqueue(redis_url, data, "unch", "--max-record-bytes", "100000")["input_unchanged"]
    data.write_bytes(data.read_bytes() + orjson.dumps(sharegpt(1000)) + b"\n")
    grown = enqueue(redis_url, data, "unch")
    assert not grown["input_unchanged"] and grown["enqueued"] == 1 and grown["already_done"] == 501


def test_the_table_of_an_unchanged_input_says_it_was_not_read(tmp_path: Path, redis_url: str,
                                                               conn: redis.Redis) -> None:
    data = write_jsonl(tmp_path / "t.jsonl", [sharegpt(i) for i in range(11)])
    env = {"REDIS_URL": redis_url}
    args = ("enqueue", str(data), "--run", "tab", "--rejects", os.devnull)
    first = cli("producer", *args, env=env).stdout
    assert re.search(r"^records read +11$", first, re.MULTILINE), first
    ItemTable(conn, "tab").change(list(ItemTable(conn, "tab").digests()), add=DONE)  # every item's result shipped
    again = cli("producer", *args, env=env).stdout
    # not "records read 11": the records were not read, and the table says whose counts it shows
    assert re.search(r"^records read +0  \(the file is unchanged since its last complete enqueue and every item "
                     r"of the run is done: not read again\)$", again, re.MULTILINE), again
    assert re.search(r"^records at last read +11$", again, re.MULTILINE), again
    assert re.search(r"^  already done +11$", again, re.MULTILINE), again


@pytest.mark.parametrize("mode", ["inline", "reference"])
def test_an_unchanged_input_with_nothing_lost_is_not_read_again(tmp_path: Path, redis_url: str, conn: redis.Redis,
                                                                mode: str) -> None:
    """Issue 34, step 6: the input is not read while every item of the run is done, queued or
    failed, whatever the mode (by reference the live jobs' items are read from their packs); one
    item lost (in the run, not done, in no job) and it is read, and only that item queued."""
    run = f"nl{mode[:3]}"
    data = write_jsonl(tmp_path / "n.jsonl", [sharegpt(i) for i in range(300)] + [{"conversations": []}])
    out = tmp_path / "out"
    first = enqueue(redis_url, data, run, "--prompts", mode, output=out)
    assert first["enqueued"] == 300 and first["rejected"] == 1
    again = enqueue(redis_url, data, run, "--prompts", mode, output=out)  # all queued: nothing lost
    assert again["input_unchanged"] and again["items"] == 0
    assert {b: again[b] for b in BUCKETS} == {"enqueued": 0, "retried_failed": 0, "already_queued": 300,
                                              "already_failed": 0, "already_done": 0, "duplicates": 0, "rejected": 1}
    assert again["items_in_run"]["queued"] == 300 and again["queue_view"]["live_items"] == 300
    # some done, some with an error record but still in a live job (queued: the job runs again)
    keys = sorted(item_keys(conn, run))
    ItemTable(conn, run).change([key_digest(k) for k in keys[:200]], add=DONE)
    ItemTable(conn, run).change([key_digest(k) for k in keys[200:210]], add=FAILED)
    split = enqueue(redis_url, data, run, "--prompts", mode, output=out)
    assert split["input_unchanged"]
    assert (split["already_done"], split["already_failed"], split["already_queued"]) == (200, 0, 100)
    # the queue lost (a consumer took the jobs, Redis dropped them): each not-done item is lost
    queue_for(run, conn).empty()
    ItemTable(conn, run).change([key_digest(k) for k in keys[210:]], add=DONE)  # all done but ten failed
    failed = enqueue(redis_url, data, run, "--prompts", mode, output=out)
    assert failed["input_unchanged"] and (failed["already_done"], failed["already_failed"]) == (290, 10)
    ItemTable(conn, run).change([key_digest(keys[299])], clear=DONE)  # and one lost
    lost = enqueue(redis_url, data, run, "--prompts", mode, output=out)
    assert not lost["input_unchanged"] and lost["requeued"] == 1 and lost["items"] == 1
    assert lost["already_done"] == 289 and lost["already_failed"] == 10
    # a second source in the run: its records are not one item of the run each; read
    other = write_jsonl(tmp_path / "o.jsonl", [sharegpt(i) for i in range(1000, 1010)])
    enqueue(redis_url, other, run, "--prompts", mode, output=out)
    assert not enqueue(redis_url, data, run, "--prompts", mode, output=out)["input_unchanged"]
