"""rq's normal life is not a fault (issue 46): a finished job's hash lives for its result TTL and
its id in the finished registry until a cleanup; a failed job's the same for its failure TTL; and
jobs by reference carry no argument. Read after that, a healthy run is what it is: complete and
done on every screen, no job of it called malformed, failed or offered for requeue, and the
dashboard names genqueue's jobs by run, items and pack or first key, not by a call string.

Real redis-server, the consumer CLI against the stand-in vLLM, the producer's commands and
`consumer dashboard` as subprocesses, rq's own `rq info`. Time moves on by a shortened result
TTL (rq expires the hashes itself) rather than by waiting RESULT_TTL (producer/enqueue/jobwriter.py).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import orjson
import pytest
import redis
from rq.job import Job
from rq.results import Result

from genqueue.common.keepers.rqaccess import JobPlace, place_key, queue_for
from genqueue.consumer.dashboard.web import job_label
from genqueue.consumer.rqcompat import GenWorker
from tests.conftest import INLINE, Prompts, cli, sharegpt, wait_for, write_jsonl
from tests.consumer.e2e import Proc, Sim
from tests.test_dashboard import Dashboard, get_json

pytestmark = pytest.mark.integration

#: The lines a healthy run's expired jobs made (what none of these tests may see again).
OLD_MALFORMED = "malformed"
OLD_DANGLING = "no job hash (a dangling id)"


def _enqueue(tmp_path: Path, url: str, run: str, n: int, prompts: Prompts) -> Path:
    data = write_jsonl(tmp_path / f"{run}.jsonl", [sharegpt(i) for i in range(n)])
    cli("producer", "enqueue", str(data), "--run", run, "--output", str(tmp_path / "out"), "--batch-size", "4",
        "--max-tokens", "16", "--rejects", str(tmp_path / f"{run}.rej"), *prompts.args, env={"REDIS_URL": url})
    return data


def _views(tmp_path: Path, url: str, run: str) -> dict[str, Any]:
    """What `producer status`, `producer export` and `producer runs` say of RUN now."""
    env = {"REDIS_URL": url}
    status = orjson.loads(cli("producer", "status", "--run", run, "--json", env=env).stdout)
    human = cli("producer", "status", "--run", run, env=env).stdout
    export = cli("producer", "export", "--run", run, "--output", str(tmp_path / f"{run}-{time.monotonic_ns()}.jsonl"),
                 "--json", env=env, check=False)
    runs = [orjson.loads(line) for line in cli("producer", "runs", "--json", env=env).stdout.splitlines()]
    return {"status": status, "status_human": human, "export": export, "runs": {r["run"]: r for r in runs}}


def test_a_finished_run_whose_job_hashes_rq_expired_is_complete_not_malformed(tmp_path: Path, redis_url: str,
                                                                                conn: redis.Redis,
                                                                                prompts_mode: Prompts) -> None:
    """was: `JOBS     10 malformed job(s) in the queue or registries: gq-… (finished: no job hash (a
    dangling id))`, export's `malformed jobs  10 malformed job(s) skipped: …`, and the dashboard's
    finished list showing each as `(malformed: no job hash …)` with its exc_info (a Requeue
    button); now: status `run complete` with no JOBS line, export exit 0 and no malformed job,
    `producer runs` `done`, the dashboard's row `(finished; rq no longer keeps it (its result TTL
    passed): …)` without exc_info. And after `rq info` cleans the registry, the same."""
    run = "expiry"
    _enqueue(tmp_path, redis_url, run, 24, prompts_mode)
    q = queue_for(run, conn)
    for jid in q.job_ids:  # time moved on: rq expires each finished job's hash 1 s after its end
        conn.hset(Job.key_for(jid), "result_ttl", "1")
    sim = Sim(tmp_path, "--step-time", "0.002", "--mean-tokens", "8")
    try:
        consumer = Proc("consumer", ["run", "--run", run, "--endpoint", sim.url, "--burst", "-c", "8",
                                     "--shard-max-age", "0.3", "--spool", str(tmp_path / "spool")],
                        tmp_path / "c.log", env={"REDIS_URL": redis_url})
        assert consumer.wait(120) == 0, consumer.output()
    finally:
        sim.stop()
    finished = [m.decode() for m in conn.zrange(place_key(run, JobPlace.FINISHED), 0, -1)]
    assert len(finished) == 6
    wait_for(lambda: not any(conn.exists(Job.key_for(j), Result.get_key(j)) for j in finished), 20,
             "rq to expire the finished jobs' hashes")
    assert conn.zcard(place_key(run, JobPlace.FINISHED)) == 6  # the ids stay until a cleanup

    dash = Dashboard(tmp_path, "dash", ("consumer", "dashboard"), env={"REDIS_URL": redis_url})
    try:
        rows = get_json(f"{dash.base}/data/jobs/genqueue.{run}/finished/100/asc/1.json")["jobs"]
        page = get_json(f"{dash.base}/data/job/{finished[0]}.json")
    finally:
        dash.stop()
    assert {r["id"] for r in rows} == set(finished)
    for r in rows:
        assert r["exc_info"] is None and r["description"].startswith("(finished; rq no longer keeps it"), r
    assert page["status"] == "expired" and page["exc_info"] is None, page

    for when in ("expired", "after rq info"):
        seen = _views(tmp_path, redis_url, run)
        st = seen["status"]
        assert st["malformed_jobs"] == [], (when, st["malformed_jobs"])
        assert (st["items"], st["items_done"]) == (24, 24)
        assert "run complete" in seen["status_human"] and OLD_MALFORMED not in seen["status_human"], when
        ex = seen["export"]
        assert ex.returncode == 0, (when, ex.stdout, ex.stderr)
        summary = orjson.loads(ex.stdout.strip().splitlines()[-1])
        assert summary["malformed_jobs"] == [] and summary["missing"] == 0 and summary["exported"] >= 1, when
        assert OLD_DANGLING not in ex.stdout + ex.stderr
        assert seen["runs"][run]["state"] == "done", (when, seen["runs"][run])
        if when == "expired":  # rq's own command line cleans the registry of expired ids
            info = cli("rq", "info", "-u", redis_url, f"genqueue.{run}")
            assert "Traceback" not in info.stderr
            assert conn.zcard(place_key(run, JobPlace.FINISHED)) == 0


def test_a_failed_job_whose_hash_expired_is_not_malformed_and_its_items_are_missing(tmp_path: Path,
                                                                                     redis_url: str,
                                                                                     conn: redis.Redis) -> None:
    """A neighbour: rq expires a failed job's hash after its failure TTL. was: `(failed: no job
    hash (a dangling id))` among the malformed jobs of status and export, and a failed row with a
    Requeue button; now: no malformed job, its 4 items counted missing by export (nothing holds
    them), and the dashboard's row `(failed; rq no longer keeps it …)` without exc_info."""
    run = "failexp"
    _enqueue(tmp_path, redis_url, run, 8, INLINE)
    q = queue_for(run, conn)
    w = GenWorker([q], conn, lease=60)
    w.start()
    held, _ = w.dequeue(q)
    assert held is not None
    w.fail(held, "Traceback...\nEngineError: gave up", retry=False)
    w.stop()
    failed = held.id
    assert conn.zscore(place_key(run, JobPlace.FAILED), failed) is not None
    # what rq's expiry does once the failure TTL passed: the hash and its result go, the id stays
    conn.delete(Job.key_for(failed), Result.get_key(failed))
    conn.zadd(place_key(run, JobPlace.FAILED), {failed: time.time() - 1})

    env = {"REDIS_URL": redis_url}
    st = orjson.loads(cli("producer", "status", "--run", run, "--json", env=env).stdout)
    assert st["malformed_jobs"] == [], st["malformed_jobs"]
    ex = cli("producer", "export", "--run", run, "--output", str(tmp_path / "x.jsonl"), "--json", "--allow-partial",
             env=env)
    summary = orjson.loads(ex.stdout.strip().splitlines()[-1])
    assert summary["malformed_jobs"] == [] and summary["missing"] == 8, summary  # 4 failed + 4 still queued
    dash = Dashboard(tmp_path, "dash", ("consumer", "dashboard"), env=env)
    try:
        (row,) = get_json(f"{dash.base}/data/jobs/genqueue.{run}/failed/100/asc/1.json")["jobs"]
    finally:
        dash.stop()
    assert row["id"] == failed and row["exc_info"] is None
    assert row["description"].startswith("(failed; rq no longer keeps it"), row


def test_the_dashboard_names_genqueue_jobs_by_run_items_and_pack_not_a_call_string(tmp_path: Path,
                                                                                   redis_url: str,
                                                                                   conn: redis.Redis,
                                                                                   prompts_mode: Prompts) -> None:
    """was: by reference, every job of every list `(malformed: a job by reference (pack 1, block 0):
    its items are in a pack, which this reader does not read)` with a Requeue button, and a held
    job on the Workers page `genqueue.consumer.task.generate([{'key': '…', 'index': 0, …` (its
    whole payload); now: `genqueue run=R items=4 pack=1 block=0` by reference and `genqueue run=R
    items=4 first_key=<32 hex>` inline, in the job lists and for the held job alike."""
    run = "names"
    _enqueue(tmp_path, redis_url, run, 12, prompts_mode)
    q = queue_for(run, conn)
    w = GenWorker([q], conn, lease=60)
    w.start()
    held, _ = w.dequeue(q)
    assert held is not None
    expected = job_label(held.job)
    assert expected is not None and expected.startswith(f"genqueue run={run} items=4 ")
    if prompts_mode.by_reference:
        assert " pack=1 block=" in expected
    else:
        assert expected == f"genqueue run={run} items=4 first_key={held.job.args[0][0]['key']}"
    env = {"REDIS_URL": redis_url}
    dash = Dashboard(tmp_path, "dash", ("consumer", "dashboard"), env=env)
    try:
        queued = get_json(f"{dash.base}/data/jobs/genqueue.{run}/queued/100/asc/1.json")["jobs"]
        started = get_json(f"{dash.base}/data/jobs/genqueue.{run}/started/100/asc/1.json")["jobs"]
        workers = get_json(f"{dash.base}/data/workers.json")["workers"]
        page = get_json(f"{dash.base}/data/job/{held.id}.json")
    finally:
        dash.stop()
        w.stop()
    assert len(queued) == 2 and [r["id"] for r in started] == [held.id]
    for r in [*queued, *started]:
        assert r["exc_info"] is None and OLD_MALFORMED not in r["description"], r
        assert r["description"].startswith(f"genqueue run={run} items=4 "), r
    assert started[0]["description"] == expected
    (mine,) = [x for x in workers if x["name"] == w.name]
    (shown,) = mine["current_jobs"]
    assert shown["call_string"] == expected and shown["description"] == expected, shown
    assert "genqueue.consumer.task.generate(" not in json.dumps(workers)
    assert page["status"] == "started" and page["origin"] == f"genqueue.{run}"
