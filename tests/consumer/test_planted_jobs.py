"""Jobs the consumer cannot use, planted in a healthy run's queue (real Redis, real consumer
process, the stand-in vLLM over HTTP): each is failed or dropped with its reason, and the
consumer serves the healthy run to the end and exits 0 (`--burst`). Before, each of these
crashed the consumer at start (and the next one) or left a --burst consumer running forever."""

from __future__ import annotations

import pickle

import pytest
import redis
from rq import Queue

from genqueue.common.keepers.rqaccess import SERIALIZER, TASK, queue_for
from tests.conftest import cli, sharegpt, write_jsonl
from tests.consumer.e2e import Proc, Sim, read_results, run_keys

pytestmark = pytest.mark.integration

RUN = "healthy"


def good_item(i: int) -> dict[str, object]:
    return {"key": f"{0xabc000 + i:032x}", "index": 1000 + i, "turn": None,
            "messages": [{"role": "user", "content": f"planted question {i}"}]}


def plant(conn: redis.Redis) -> dict[str, str]:
    """Plant one job of each bad kind; returns job id -> what it is."""
    q = queue_for(RUN, conn)
    planted: dict[str, str] = {}

    def task_job(jid: str, args: tuple[object, ...], what: str, **kwargs: object) -> None:
        q.enqueue_call(TASK, args=args, kwargs=kwargs or None, job_id=jid)
        planted[jid] = what

    task_job("bad-args", ("not a list",), "arguments that are not a list of items")
    task_job("bad-fields", ([{"key": "nothex", "messages": "hi"}],), "items with missing or wrong fields")
    task_job("bad-kwargs", ([good_item(0)],), "keyword arguments", extra=1)
    task_job("too-big", ([{**good_item(1), "messages": [{"role": "user", "content": "x" * (17 * 1024 * 1024)}]}],),
             "an item over the size limit")
    task_job("bad-json", ([good_item(2)],), "a payload that is not JSON")
    conn.hset("rq:job:bad-json", "data", b"\x00\x01 not zlib, not json")
    task_job("no-data", ([good_item(3)],), "a hash without data")
    conn.hdel("rq:job:no-data", "data")
    task_job("bad-status", ([good_item(4)],), "a status rq does not parse")
    conn.hset("rq:job:bad-status", "status", "exploded")
    task_job("bad-date", ([good_item(5)],), "a date rq does not parse")
    conn.hset("rq:job:bad-date", "created_at", "yesterday-ish")
    conn.rpush(q.key, "ghost")
    planted["ghost"] = "a queue entry whose job hash is missing"
    pq = Queue(q.name, connection=conn)  # rq's default serializer: pickle
    planted[pq.enqueue("os.getcwd").id] = "a pickled payload"
    planted[Queue(q.name, connection=conn, serializer=SERIALIZER).enqueue("os.system", "echo pwned").id] = \
        "a foreign function"
    task_job("list-func", ([good_item(8)],), "a function name that is not text")
    import zlib

    import orjson
    conn.hset("rq:job:list-func", "data", zlib.compress(orjson.dumps([[1], None, [[good_item(8)]], {}])))
    # and one the consumer must run: a job queued under the task's name before the namespace move
    q.enqueue_call("consumer.task.generate", args=([good_item(6), good_item(7)],), job_id="legacy-task")
    return planted


def test_planted_jobs_are_refused_with_reasons_and_the_healthy_run_completes(tmp_path, redis_url, conn):
    data = write_jsonl(tmp_path / "healthy.jsonl", [sharegpt(i) for i in range(40)])
    cli("producer", "enqueue", str(data), "--run", RUN, "--output", str(tmp_path / "out"), "--batch-size", "8",
        "--max-tokens", "64", "--rejects", str(tmp_path / "rej.jsonl"), env={"REDIS_URL": redis_url})
    planted = plant(conn)
    assert b"pwned" not in pickle.dumps(planted)
    sim = Sim(tmp_path, "--slots", "16", "--step-time", "0.002", "--mean-tokens", "20")
    try:
        c = Proc("consumer", ["-v", "run", "--run", RUN, "--endpoint", sim.url, "--burst", "--shard-max-age", "1",
                              "--spool", str(tmp_path / "spool")], tmp_path / "c.log", env={"REDIS_URL": redis_url})
        assert c.wait(120) == 0, c.output()
    finally:
        sim.stop()
    log = c.output()
    assert "Traceback" not in log, log
    recs = read_results(tmp_path / "out", RUN)
    keys = {r["key"] for r in recs}
    assert run_keys(conn, RUN) <= keys, "every healthy item has a record"
    assert {good_item(6)["key"], good_item(7)["key"]} <= keys, "the legacy task name still runs"
    assert not any(r.get("index", 0) >= 1000 and r["key"] not in (good_item(6)["key"], good_item(7)["key"])
                   for r in recs), "nothing of a refused job was generated"
    q = queue_for(RUN, conn)
    assert conn.llen(q.key) == 0 and conn.llen(q.intermediate_queue_key) == 0
    assert conn.zcard(q.started_job_registry.key) == 0
    failed = set(q.failed_job_registry.get_job_ids())
    refused = {k.decode(): v.decode() for k, v in conn.hgetall(f"genqueue:refused:{q.name}").items()}
    for jid, what in planted.items():
        assert jid in failed or jid in refused, f"{what} ({jid}) was neither failed nor recorded as refused"
        assert jid in refused or jid in failed
        assert jid in log, f"the log does not name {what} ({jid})"
    for jid in ("bad-args", "bad-fields", "bad-kwargs", "too-big"):
        assert jid in failed, jid
        assert conn.hget(f"rq:job:{jid}", "status") == b"failed"
    for jid in ("no-data", "bad-status", "bad-date", "ghost"):
        assert "rq cannot load the job" in refused[jid], refused[jid]
