"""A run that cannot succeed stops itself before it burns the dataset (real redis-server, real
consumer processes, the stand-in vLLM over HTTP with a short context)."""

from __future__ import annotations

import orjson
import pytest

from tests.conftest import cli, sharegpt, write_jsonl
from tests.consumer.e2e import Proc, Sim, read_results

pytestmark = pytest.mark.integration


def enqueue(tmp_path, redis_url, run, records, *extra):
    data = write_jsonl(tmp_path / f"{run}.jsonl", records)
    cli("producer", "enqueue", str(data), "--run", run, "--output", str(tmp_path / "out"), "--batch-size", "8",
        "--rejects", str(tmp_path / f"{run}.rej"), *extra, env={"REDIS_URL": redis_url})


def consume(tmp_path, redis_url, sim, run, *extra):
    c = Proc("consumer", ["run", "--run", run, "--endpoint", sim.url, "--burst", "-c", "8", "--shard-max-age", "1",
                          "--spool", str(tmp_path / f"spool-{run}"), *extra], tmp_path / f"{run}.log",
             env={"REDIS_URL": redis_url})
    return c.wait(120), c.output()


def stats(conn, run):
    return {k.decode(): int(v) for k, v in conn.hgetall(f"genqueue:run:{run}:stats").items()}


def sim_requests(sim: Sim) -> int:
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{sim.port}/sim/stats", timeout=5) as r:
        return int(orjson.loads(r.read())["requests"])


def test_max_tokens_over_the_context_is_stopped_by_the_preflight(tmp_path, redis_url, conn):
    sim = Sim(tmp_path, "--max-model-len", "8192", "--mean-tokens", "20")
    try:
        enqueue(tmp_path, redis_url, "big", [sharegpt(i) for i in range(50)], "--max-tokens", "50000")
        code, log = consume(tmp_path, redis_url, sim, "big")
        served = sim_requests(sim)
    finally:
        sim.stop()
    assert code == 4, log  # ExitCode.PREFLIGHT
    assert "pre-flight failed" in log and "max_tokens 50000 does not fit the model's context of 8192" in log
    assert "Traceback" not in log
    assert served <= 1, f"{served} requests reached the engine"
    assert read_results(tmp_path / "out", "big") == []
    assert stats(conn, "big").get("items_failed", 0) == 0
    assert conn.llen("rq:queue:genqueue.big") == 7, "every job still waits for the fix"


@pytest.mark.slow
def test_every_item_refused_trips_the_breaker_and_pauses_the_run(tmp_path, redis_url, conn):
    # the probe's short prompt fits a 400-token context; every item of this run does not
    long = [{"conversations": [{"from": "human", "value": f"item {i}: " + "word " * 600}]} for i in range(64)]
    sim = Sim(tmp_path, "--max-model-len", "400", "--mean-tokens", "10")
    try:
        enqueue(tmp_path, redis_url, "storm", long, "--max-tokens", "16")
        code, log = consume(tmp_path, redis_url, sim, "storm")
        served = sim_requests(sim)
    finally:
        sim.stop()
    assert code == 5, log  # ExitCode.PAUSED
    pause = conn.get("genqueue:run:storm:paused")
    assert pause is not None, log
    reason = orjson.loads(pause)["reason"]
    assert reason.startswith("breaker: the first 8 items all failed with permanent: HTTP N"), reason
    assert "maximum context length" in reason
    assert "pausing the run" in log and "Traceback" not in log
    assert served <= 8 + 8 + 3, f"{served} requests reached the engine (8 to trip, 8 more in flight at most)"
    assert stats(conn, "storm").get("items_failed", 0) == 0, "the storm is not counted as the dataset's failures"
    assert conn.zcard("rq:failed:genqueue.storm") == 0
    q_len = conn.llen("rq:queue:genqueue.storm")
    assert q_len == 8, f"every job back in the queue ({q_len})"
    for jid in conn.lrange("rq:queue:genqueue.storm", 0, -1):
        assert int(conn.hget(b"rq:job:" + jid, "retries_left") or 3) == 3, "no retry spent"


@pytest.mark.slow
def test_a_few_percent_of_genuine_permanent_errors_do_not_trip_it(tmp_path, redis_url, conn):
    records = [sharegpt(i) for i in range(200)]
    for i in range(0, 200, 33):  # 7 prompts (3.5%) too long for the context, spread over the run
        records[i] = {"conversations": [{"from": "human", "value": f"long {i}: " + "word " * 600}]}
    sim = Sim(tmp_path, "--max-model-len", "400", "--mean-tokens", "10")
    try:
        enqueue(tmp_path, redis_url, "mostly", records, "--max-tokens", "16")
        code, log = consume(tmp_path, redis_url, sim, "mostly")
    finally:
        sim.stop()
    # drained, not tripped; but not a success either: 7 items ended as errors, and it says how to retry them
    assert code == 7, log  # ExitCode.FAILED_ITEMS
    assert ("run mostly was not served to the end: 7 items ended as errors (permanent 7) of 200; once the cause is "
            "fixed: `producer enqueue") in log and "--run mostly --retry-failed`" in log
    assert conn.get("genqueue:run:mostly:paused") is None
    env = {"REDIS_URL": redis_url}
    runs = [orjson.loads(line) for line in cli("producer", "runs", "--json", env=env).stdout.splitlines()]
    assert [(r["state"], r["done"], r["failed"]) for r in runs] == [("failed", 193, 7)], runs
    status = cli("producer", "status", "--run", "mostly", env=env).stdout
    assert status.startswith("FAILED   7 items ended as errors (permanent 7); once the cause is fixed"), status
    assert "run complete" not in status and "run over, NOT complete" in status
    recs = read_results(tmp_path / "out", "mostly")
    errors = [r for r in recs if "error" in r]
    assert len({r["key"] for r in recs}) == 200 and len({r["key"] for r in errors}) == 7
    assert stats(conn, "mostly")["items_failed"] == 7
    # export tells the truth by its exit code: 7 of 200 (3.5%) failed for good
    env = {"REDIS_URL": redis_url}
    out = str(tmp_path / "mostly.export.jsonl")
    over = cli("producer", "export", "--run", "mostly", "-o", out, env=env, check=False)
    assert over.returncode == 1, over.stdout + over.stderr
    assert "7 items failed for good (permanent 7), over --max-failed 0.01 (2 of 200)" in over.stderr
    assert over.stdout.splitlines()[0].startswith("FAILED for good") and "permanent" in over.stdout.splitlines()[1]
    for ok in (["--max-failed", "7"], ["--max-failed", "0.05"], ["--allow-partial"]):
        assert cli("producer", "export", "--run", "mostly", "-o", out, *ok, env=env, check=False).returncode == 0, ok
    assert cli("producer", "export", "--run", "mostly", "-o", out, "--max-failed", "6", env=env,
               check=False).returncode == 1
    bad = cli("producer", "export", "--run", "mostly", "-o", out, "--max-failed", "1.5", env=env, check=False)
    assert bad.returncode == 2 and bad.stderr.startswith("error: --max-failed") and "Traceback" not in bad.stderr
