"""The consumer end to end: real redis-server, the stand-in vLLM over HTTP, real processes."""

from __future__ import annotations

import collections
import signal
import time

import pytest
from rq import Queue
from rq.job import Job

from genqueue.common.keepers.rqaccess import SERIALIZER, job_failure, queue_for
from tests.conftest import cli, free_port, http_text, sharegpt, write_jsonl
from tests.consumer.e2e import Proc, Sim, read_results, run_keys

pytestmark = pytest.mark.integration


def enqueue(tmp_path, redis_url, run, records, *extra):
    data = write_jsonl(tmp_path / f"{run}.jsonl", records)
    cli("producer", "enqueue", str(data), "--run", run, "--output", str(tmp_path / "out"),
        "--batch-size", "8", "--max-tokens", "256", "--rejects", str(tmp_path / "rej.jsonl"), *extra,
        env={"REDIS_URL": redis_url})


def consumer(tmp_path, redis_url, sim, run, *extra, name="c1"):
    return Proc("consumer", ["-v", "run", "--run", run, "--endpoint", sim.url, "--spool", str(tmp_path / "spool" / name),
                             "--shard-max-age", "1", *extra], tmp_path / f"{name}.log", env={"REDIS_URL": redis_url})


def test_run_completes_and_rq_sees_the_worker(tmp_path, redis_url, conn):
    sim = Sim(tmp_path, "--slots", "32", "--step-time", "0.003", "--mean-tokens", "60")
    try:
        enqueue(tmp_path, redis_url, "e2e", [sharegpt(i, turns=1 + i % 3) for i in range(300)])
        mport = free_port()
        c = consumer(tmp_path, redis_url, sim, "e2e", "--burst", "-c", "64", "--metrics-port", str(mport))
        seen_worker = False
        metrics = ""
        deadline = time.monotonic() + 60
        while c.p.poll() is None and time.monotonic() < deadline:
            info = cli("rq", "info", "-u", redis_url, "genqueue.e2e", check=False)
            if "gq-" in info.stdout and "busy" in info.stdout:
                seen_worker = True
            page = http_text(f"http://127.0.0.1:{mport}/metrics", timeout=2)
            if page is not None and "genqueue_completions_total{" in page:
                metrics = page
            time.sleep(0.2)
        assert c.wait(60) == 0, c.output()
        assert seen_worker, "rq info never listed the consumer as busy"
        assert 'genqueue_completions_total{outcome="finished",run="e2e"}' in metrics
        for name in ("genqueue_in_flight", "genqueue_tokens_total", "genqueue_item_latency_seconds_bucket",
                     "genqueue_paused"):
            assert name in metrics, name
    finally:
        sim.stop()
    recs = read_results(tmp_path / "out", "e2e")
    keys = run_keys(conn, "e2e")
    assert len(keys) == 300
    assert {r["key"] for r in recs} == keys
    assert len(recs) == 300  # no crash, so no duplicates
    q = queue_for("e2e", conn)
    assert q.failed_job_registry.count == 0
    assert q.finished_job_registry.count == len(set(q.finished_job_registry.get_job_ids())) == 300 // 8 + 1
    multi = [r for r in recs if len(r["turns"]) == 3]
    assert multi and all(m["messages"][1]["role"] == "assistant" and "old answer" not in m["messages"][1]["content"]
                         for m in multi)
    r = recs[0]
    for field in ("key", "index", "run", "messages", "content", "reasoning", "finish_reason", "usage", "model",
                  "sampling", "fingerprint", "version", "consumer", "timings", "attempt"):
        assert field in r, field
    status = cli("producer", "status", "--run", "e2e", "--json", env={"REDIS_URL": redis_url})
    import orjson

    st = orjson.loads(status.stdout)
    assert st["items_done"] == 300 and st["jobs"]["finished"] == 38 and st["jobs"]["failed"] == 0
    assert st["items_queued"] == 0 and st["eta_s"] == 0.0 and len(st["consumers"]) == 1
    assert st["consumers"][0]["exited"] and not st["consumers"][0]["live"]
    assert st["consumers"][0]["shipping"]["shards"] >= 1 and not st["drift"]


@pytest.mark.slow
def test_sigkill_mid_run_loses_nothing(tmp_path, redis_url, conn):
    sim = Sim(tmp_path, "--slots", "16", "--step-time", "0.004", "--mean-tokens", "80")
    try:
        enqueue(tmp_path, redis_url, "kill", [sharegpt(i) for i in range(240)])
        a = consumer(tmp_path, redis_url, sim, "kill", "-c", "32", "--lease", "3", name="a")
        q = queue_for("kill", conn)
        deadline = time.monotonic() + 30
        while q.finished_job_registry.count < 5 and time.monotonic() < deadline:
            time.sleep(0.05)
        a.kill()
        finished_at_kill = set(q.finished_job_registry.get_job_ids())
        assert 0 < len(finished_at_kill) < 30
        b = consumer(tmp_path, redis_url, sim, "kill", "--burst", "-c", "32", "--lease", "3", name="b")
        assert b.wait(90) == 0, b.output()
    finally:
        sim.stop()
    recs = read_results(tmp_path / "out", "kill")
    keys = run_keys(conn, "kill")
    assert {r["key"] for r in recs} == keys and len(keys) == 240
    counts = collections.Counter(r["key"] for r in recs)
    dup = {k for k, n in counts.items() if n > 1}
    acked_keys = set()
    for jid in finished_at_kill:
        job = Job.fetch(jid, connection=conn, serializer=SERIALIZER)
        acked_keys |= {it["key"] for it in job.args[0]}
    assert not (dup & acked_keys), "an item acked before the kill was generated again"
    assert q.failed_job_registry.count == 0
    assert "abandoned" in b.output()


@pytest.mark.slow
def test_sigterm_drains_and_gives_back_without_spending_retries(tmp_path, redis_url, conn):
    sim = Sim(tmp_path, "--slots", "8", "--step-time", "0.01", "--mean-tokens", "50")
    try:
        enqueue(tmp_path, redis_url, "term", [sharegpt(i) for i in range(200)])
        a = consumer(tmp_path, redis_url, sim, "term", "-c", "8", "--drain-timeout", "20", name="a")
        q = queue_for("term", conn)
        deadline = time.monotonic() + 30
        while q.finished_job_registry.count < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        a.signal(signal.SIGTERM)
        assert a.wait(30) == 0, a.output()
        assert q.started_job_registry.count == 0
        assert q.count > 0
        for job in q.get_jobs():
            assert job.retries_left == 3
        b = consumer(tmp_path, redis_url, sim, "term", "--burst", "-c", "32", name="b")
        assert b.wait(90) == 0, b.output()
    finally:
        sim.stop()
    assert {r["key"] for r in read_results(tmp_path / "out", "term")} == run_keys(conn, "term")


@pytest.mark.slow
def test_endpoint_down_ten_seconds_nothing_fails(tmp_path, redis_url, conn):
    sim = Sim(tmp_path, "--slots", "16", "--step-time", "0.003", "--mean-tokens", "60")
    try:
        enqueue(tmp_path, redis_url, "down", [sharegpt(i) for i in range(200)])
        c = consumer(tmp_path, redis_url, sim, "down", "--burst", "-c", "16", "--lease", "4", name="c")
        q = queue_for("down", conn)
        deadline = time.monotonic() + 30
        while q.finished_job_registry.count < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        sim.stop()  # vLLM dies: connections refused
        time.sleep(10)
        assert c.p.poll() is None, "the consumer gave up while the endpoint was down"
        sim.start()
        assert c.wait(90) == 0, c.output()
    finally:
        sim.stop()
    recs = read_results(tmp_path / "out", "down")
    assert {r["key"] for r in recs} == run_keys(conn, "down")
    assert not [r for r in recs if "error" in r]
    assert q.failed_job_registry.count == 0
    assert "is down" in c.output() and "is back" in c.output()


def test_permanent_errors_become_error_records_and_foreign_jobs_are_refused(tmp_path, redis_url, conn):
    sim = Sim(tmp_path, "--max-model-len", "1024", "--mean-tokens", "20")
    try:
        records = [sharegpt(i) for i in range(20)]
        records.append({"conversations": [{"from": "human", "value": "word " * 5000}]})
        enqueue(tmp_path, redis_url, "perm", records)
        Queue("genqueue.perm", connection=conn, serializer=SERIALIZER).enqueue("os.system", "echo pwned")
        c = consumer(tmp_path, redis_url, sim, "perm", "--burst", name="c")
        assert c.wait(60) == 7, c.output()  # ExitCode.FAILED_ITEMS: drained, one item ended as an error
    finally:
        sim.stop()
    recs = read_results(tmp_path / "out", "perm")
    errors = [r for r in recs if "error" in r]
    assert len(errors) == 1 and errors[0]["error"]["class"] == "permanent"
    assert "maximum context length" in errors[0]["error"]["message"]
    assert len(recs) == 21
    q = queue_for("perm", conn)
    failed = q.failed_job_registry.get_job_ids()
    assert len(failed) == 1
    assert "os.system" in job_failure(Job.fetch(failed[0], connection=conn, serializer=SERIALIZER))
    assert sim.proc is None  # stopped; the stand-in saw no request for the foreign job


def test_refuses_a_model_the_endpoint_does_not_serve(tmp_path, redis_url):
    sim = Sim(tmp_path)
    try:
        enqueue(tmp_path, redis_url, "wrongmodel", [sharegpt(1)], "--model", "llama-405b")
        c = consumer(tmp_path, redis_url, sim, "wrongmodel", "--burst")
        assert c.wait(30) == 2
    finally:
        sim.stop()
    out = c.output()
    assert "llama-405b" in out and "sim-model" in out and "Traceback" not in out


def test_a_thinking_run_on_a_server_without_thinking_is_reported(tmp_path, redis_url, conn):
    sim = Sim(tmp_path, "--reasoning", "none", "--mean-tokens", "10")
    try:
        enqueue(tmp_path, redis_url, "nothink", [sharegpt(i) for i in range(5)], "--expect-reasoning")
        c = consumer(tmp_path, redis_url, sim, "nothink", "--burst", name="c")
        assert c.wait(30) == 0, c.output()
    finally:
        sim.stop()
    assert "expects thinking" in c.output()
    st = cli("producer", "status", "--run", "nothink", env={"REDIS_URL": redis_url}).stdout
    assert "WARNING" in st and "expects thinking" in st
    assert "outcomes" in st and "complete 5 (finished)" in st


@pytest.mark.slow
def test_an_unwritable_output_pauses_admission_and_loses_nothing(tmp_path, redis_url, conn):
    """The store is unreachable (here: the output path is blocked by a file): shards wait on
    disk, nothing is acked, admission pauses at --spool-limit, and all ships once it is back.
    (The blocker is the run's shards/ directory: the pre-flight's probe, beside it, passes; an
    output blocked above it is refused at pre-flight, tests/consumer/test_output_probe.py.)"""
    sim = Sim(tmp_path, "--mean-tokens", "200")
    blocker = tmp_path / "out" / "spoolfull" / "shards"
    try:
        enqueue(tmp_path, redis_url, "spoolfull", [sharegpt(i) for i in range(120)])
        blocker.parent.mkdir(parents=True, exist_ok=True)
        blocker.write_text("not a directory")
        c = consumer(tmp_path, redis_url, sim, "spoolfull", "--burst", "-c", "16", "--spool-limit", "20000", name="c")
        deadline = time.monotonic() + 30
        while "pausing admission" not in c.output() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert "pausing admission" in c.output(), c.output()
        q = queue_for("spoolfull", conn)
        assert q.finished_job_registry.count == 0  # nothing acked while nothing shipped
        blocker.unlink()
        assert c.wait(90) == 0, c.output()
    finally:
        sim.stop()
    recs = read_results(tmp_path / "out", "spoolfull")
    assert {r["key"] for r in recs} == run_keys(conn, "spoolfull") and len(recs) == 120
