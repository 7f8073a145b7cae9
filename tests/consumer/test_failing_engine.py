"""An engine that fails every request: the run stops early and says so, and nothing is lost (real
redis-server, real consumer processes, the stand-in vLLM over HTTP answering 500/502/503).

- the probe fails at pre-flight: the --burst consumer does not start (exit 4), 0 items burned;
- the engine breaks after the probe (at once, or mid-run): the breaker pauses the run within a
  few dozen items (exit 5); `producer runs` and `producer status` say paused or failed, never
  done or complete, with the commands that go on; a fixed engine, `producer resume` and
  `producer enqueue --retry-failed` bring every item back and the run completes (0 missing);
- a few scattered genuine failures do not trip it, but the run is not called done either.
"""

from __future__ import annotations

import re
import shlex
import urllib.request

import orjson
import pytest

from genqueue.common.contracts import ExitCode
from tests.conftest import cli, sharegpt, write_jsonl
from tests.consumer.e2e import Proc, Sim, read_results, run_keys

pytestmark = pytest.mark.integration


def enqueue(tmp_path, redis_url, run, n, *extra):
    data = write_jsonl(tmp_path / f"{run}.jsonl", [sharegpt(i) for i in range(n)])
    return cli("producer", "enqueue", str(data), "--run", run, "--output", str(tmp_path / "out"), "--batch-size", "8",
               "--max-tokens", "32", *extra, env={"REDIS_URL": redis_url})


def burst(tmp_path, redis_url, sim, run, name):
    c = Proc("consumer", ["run", "--run", run, "--endpoint", sim.url, "--burst", "-c", "8", "--shard-max-age", "0.5",
                          "--max-attempts", "2", "--spool", str(tmp_path / "spool")], tmp_path / f"{name}.log",
             env={"REDIS_URL": redis_url})
    return c.wait(120), c.output()


def chats(sim: Sim) -> int:
    """Chat requests the stand-in answered with an error (injected)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{sim.port}/sim/stats", timeout=5) as r:
        return int(orjson.loads(r.read())["errors"])


def screens(redis_url, run):
    env = {"REDIS_URL": redis_url}
    runs = [orjson.loads(line) for line in cli("producer", "runs", "--json", env=env).stdout.splitlines()]
    return ({r["run"]: r for r in runs}[run], cli("producer", "runs", env=env).stdout,
            cli("producer", "status", "--run", run, env=env).stdout)


def test_a_probe_that_fails_at_pre_flight_stops_the_burst_consumer_with_exit_4(tmp_path, redis_url, conn):
    enqueue(tmp_path, redis_url, "dead", 40)
    sim = Sim(tmp_path, "--error-rate", "1.0", "--mean-tokens", "10")
    try:
        code, log = burst(tmp_path, redis_url, sim, "dead", "c")
        failed = chats(sim)
    finally:
        sim.stop()
    assert code == ExitCode.PREFLIGHT, log
    line = ("run dead: pre-flight failed, not serving it on this consumer: the engine failed the probe request "
            "(HTTP 500: injected failure; 2 attempts)")
    assert line in log, log
    assert "did not start" in log and "0 items sent (exit 4)" in log and "Traceback" not in log
    assert "started: endpoint" not in log, "it does not start"
    assert failed == 2, f"{failed} requests failed: the probe's 2 attempts, no item"
    assert read_results(tmp_path / "out", "dead") == []
    assert conn.llen("rq:queue:genqueue.dead") == 5, "every job waits for the fix"
    row, _, status = screens(redis_url, "dead")
    assert row["state"] == "queued" and row["failed"] == 0
    assert "run complete" not in status


@pytest.mark.parametrize(("status", "after"), [  # 16 s each: one in the default suite, the rest in the slow tier
    pytest.param(500, 1, marks=pytest.mark.slow), pytest.param(502, 60, marks=pytest.mark.slow), (503, 1)])
def test_an_engine_failing_every_request_pauses_the_run_and_every_item_comes_back(
        tmp_path, redis_url, conn, status, after):
    n = 240
    enqueue(tmp_path, redis_url, "brk", n)
    # the probe passes (its one request is answered); then every request fails (after AFTER: mid-run)
    sim = Sim(tmp_path, "--error-rate", "1.0", "--error-status", str(status), "--error-after", str(after),
              "--mean-tokens", "10")
    try:
        code, log = burst(tmp_path, redis_url, sim, "brk", "c1")
        failed = chats(sim)
    finally:
        sim.stop()
    assert code == ExitCode.PAUSED, log
    pause = orjson.loads(conn.get("genqueue:run:brk:paused"))
    reason = pause["reason"]
    assert f"(the last: HTTP {status}: injected failure)" in reason, reason
    if after == 1:
        assert reason.startswith("breaker: the first 8 items all failed with transient_exhausted"), reason
    else:
        assert reason.startswith("breaker: 24 items in a row failed, 24 with transient_exhausted"), reason
    assert "Traceback" not in log and "(exit 5: paused, not done)" in log
    # within a few dozen items: those that tripped it, and what was in flight then (2 attempts each)
    assert failed <= 2 * (24 + 8 + 8), f"{failed} requests failed before the run paused"
    row, runs, status_text = screens(redis_url, "brk")
    print(f"HTTP {status} after {after} requests: paused after {failed} failed requests; {row['failed']} items "
          f"ended as errors in jobs acked before the trip")
    assert row["state"] == "paused", row
    assert "done" not in runs.split("\n")[1].split() and "run complete" not in status_text
    assert status_text.startswith("PAUSED   breaker:"), status_text
    assert "`producer resume --run brk`" in row["next_steps"]
    if row["failed"]:  # items of jobs acked before the trip: --retry-failed brings them back
        assert "--retry-failed" in row["next_steps"] and "FAILED   " in status_text
        assert f"{row['failed']} items ended as errors (transient_exhausted {row['failed']})" in runs

    # the engine is fixed: a new stand-in without errors; resume, retry the failed, and it completes
    sim = Sim(tmp_path, "--mean-tokens", "10")
    env = {"REDIS_URL": redis_url}
    try:
        assert "run brk resumed" in cli("producer", "resume", "--run", "brk", env=env).stdout
        # the retry as the run's screens print it, no option repeated (those left out keep the run's)
        retry = [c for c in re.findall(r"`([^`]+)`", row["next_steps"]) if "--retry-failed" in c]
        if retry:
            assert retry == [f"producer enqueue {tmp_path / 'brk.jsonl'} --run brk --retry-failed"], retry
            cli(*shlex.split(retry[0]), env=env)
        else:
            enqueue(tmp_path, redis_url, "brk", n, "--retry-failed")
        code, log = burst(tmp_path, redis_url, sim, "brk", "c2")
    finally:
        sim.stop()
    assert code == ExitCode.DONE, log
    row, runs, status_text = screens(redis_url, "brk")
    assert (row["state"], row["done"], row["failed"]) == ("done", n, 0), row
    assert "run complete" in status_text and "FAILED" not in status_text and "PAUSED" not in status_text
    out = tmp_path / "brk.export.jsonl"
    e = cli("producer", "export", "--run", "brk", "-o", str(out), "--include-outcomes", "all", "--json", env=env)
    summary = orjson.loads(e.stdout)
    assert (summary["exported"], summary["missing"], summary["failed"]) == (n, 0, 0), summary
    assert {orjson.loads(line)["key"] for line in out.read_bytes().splitlines()} == run_keys(conn, "brk")
