"""One exit code per way a consumer ends (common/contracts.ExitCode, docs/consumer.md `consumer run`), so a
scheduler can trust it: real redis-server, the stand-in vLLM over HTTP, the consumer CLI as a
subprocess. A signal's drain (0) and a second signal (130) are in test_sigterm.py."""

from __future__ import annotations

import os
import re
import socket
import subprocess
from pathlib import Path

import pytest
import redis

from genqueue.common.contracts import ExitCode
from genqueue.common.keepers.pause import Pause
from tests.conftest import BIN, RedisServer, cli, free_gpu, free_port, sharegpt, wait_for, write_jsonl
from tests.consumer.e2e import Proc, Sim, read_results, run_keys
from tests.consumer.launch.test_launch import Launch

pytestmark = pytest.mark.integration


def enqueue(tmp_path: Path, redis_url: str, run: str, n: int, *extra: str, env: dict[str, str] | None = None) -> None:
    data = write_jsonl(tmp_path / f"{run}.jsonl", [sharegpt(i) for i in range(n)])
    cli("producer", "enqueue", str(data), "--run", run, "--output", str(tmp_path / "out"), "--batch-size", "8",
        "--max-tokens", "64", "--rejects", str(tmp_path / f"{run}.rej"), *extra,
        env={"REDIS_URL": redis_url, **(env or {})})


def burst(tmp_path: Path, redis_url: str, sim: Sim, *extra: str, env: dict[str, str] | None = None,
          timeout: float = 120) -> tuple[int, str]:
    c = Proc("consumer", ["run", "--endpoint", sim.url, "--burst", "-c", "8", "--shard-max-age", "0.5",
                          "--spool", str(tmp_path / "spool"), *extra], tmp_path / "c.log",
             env={"REDIS_URL": redis_url, **(env or {})})
    return c.wait(timeout), c.output()


def test_gpu_n_burst_as_in_the_quick_start_serves_the_run(tmp_path, redis_url, conn):
    enqueue(tmp_path, redis_url, "quick", 40)
    n = free_gpu()
    sim = Sim(tmp_path, "--slots", "16", "--step-time", "0.002", "--mean-tokens", "30", port=8000 + n)
    try:
        exe = BIN / "consumer"
        done = subprocess.run([str(exe), "run", "--gpu", str(n), "--burst"], check=False, cwd=tmp_path,
                              capture_output=True, text=True, timeout=120, env={**os.environ, "REDIS_URL": redis_url})
    finally:
        sim.stop()
    assert done.returncode == ExitCode.DONE, done.stderr
    assert "Traceback" not in done.stderr
    assert {r["key"] for r in read_results(tmp_path / "out", "quick")} == run_keys(conn, "quick")
    # the default spool is named by the GPU; all shipped, it held nothing more and went at exit
    assert f"genqueue-spool/gpu{n} held nothing to ship: removed" in done.stderr, done.stderr
    assert not (tmp_path / "genqueue-spool" / f"gpu{n}").exists()


@pytest.mark.slow
def test_a_loop_failing_past_its_restarts_exits_1(tmp_path, redis_url, conn):
    enqueue(tmp_path, redis_url, "broken", 40)
    conn.set("rq:wip:genqueue.broken", "not a sorted set")  # every dequeue and sweep fails: WRONGTYPE
    sim = Sim(tmp_path, "--slots", "8", "--mean-tokens", "10")
    try:
        code, log = burst(tmp_path, redis_url, sim, "--run", "broken", "--lease", "2")
    finally:
        sim.stop()
    assert code == ExitCode.FATAL, log
    assert "stopping the consumer" in log and "WRONGTYPE" in log


def test_a_run_that_does_not_exist_exits_2(tmp_path, redis_url):
    sim = Sim(tmp_path, "--mean-tokens", "10")
    try:
        code, log = burst(tmp_path, redis_url, sim, "--run", "nosuch")
    finally:
        sim.stop()
    assert code == ExitCode.USAGE, log
    assert "error: no run named 'nosuch' in Redis" in log and "Traceback" not in log


def test_a_taken_port_is_one_line_exit_2_not_a_traceback(tmp_path, redis_url):
    """`consumer run --metrics-port P` and `consumer simulate --port P` with P taken.

    old: "Traceback (most recent call last): ... OSError: [Errno 98] Address already in use", exit 1
    new: "error: metrics: cannot listen on 0.0.0.0:P: the port is taken by another process (another
         consumer?); give another --metrics-port" and "error: cannot listen on 127.0.0.1:P: the port
         is taken by another process; give another --port", each the command's only line, exit 2"""
    with socket.socket() as held:
        held.bind(("", 0))  # every interface: both the consumer's and the stand-in's address
        held.listen()
        port = held.getsockname()[1]
        sim = Sim(tmp_path, "--mean-tokens", "10")
        try:
            code, log = burst(tmp_path, redis_url, sim, "--run", "any", "--metrics-port", str(port))
        finally:
            sim.stop()
        assert code == ExitCode.USAGE, log
        assert log.splitlines() == [(f"error: metrics: cannot listen on 0.0.0.0:{port}: the port is taken by another "
                                     "process (another consumer?); give another --metrics-port")], log
        proc = cli("consumer", "simulate", "--port", str(port), check=False, timeout=30)
        assert proc.returncode == 2 and proc.stderr.splitlines() == [
            f"error: cannot listen on 127.0.0.1:{port}: the port is taken by another process; give another --port"], \
            proc.stderr


def test_the_metrics_port_listens_where_metrics_host_says(tmp_path, redis_url):
    """--metrics-host (GENQUEUE_METRICS_HOST) narrows the metrics port from every interface (the
    default, for a Prometheus on another host) to the one address named."""
    port = free_port()
    sim = Sim(tmp_path, "--mean-tokens", "10")
    try:
        code, log = burst(tmp_path, redis_url, sim, "-v", "--run", "nosuch", "--metrics-port", str(port),
                          env={"GENQUEUE_METRICS_HOST": "127.0.0.1"})
        assert f"Prometheus metrics on 127.0.0.1:{port}/metrics" in log, log
        code, log = burst(tmp_path, redis_url, sim, "-v", "--run", "nosuch", "--metrics-port", str(port))
        assert f"Prometheus metrics on 0.0.0.0:{port}/metrics" in log, log
    finally:
        sim.stop()
    assert code == ExitCode.USAGE


def test_a_run_refused_on_this_host_exits_3(tmp_path, redis_url, conn):
    enqueue(tmp_path, redis_url, "elsewhere", 16, env={"GENQUEUE_HOST": "node-a"})
    sim = Sim(tmp_path, "--mean-tokens", "10")
    try:
        code, log = burst(tmp_path, redis_url, sim, env={"GENQUEUE_HOST": "node-b"})
    finally:
        sim.stop()
    assert code == ExitCode.REFUSED, log
    assert "run elsewhere was not served to the end" in log and "node-a" in log


def test_a_run_failing_pre_flight_exits_4(tmp_path, redis_url, conn):
    enqueue(tmp_path, redis_url, "big", 16, "--max-tokens", "50000")
    sim = Sim(tmp_path, "--max-model-len", "8192", "--mean-tokens", "10")
    try:
        code, log = burst(tmp_path, redis_url, sim, "--run", "big")
    finally:
        sim.stop()
    assert code == ExitCode.PREFLIGHT, log
    assert "pre-flight failed" in log and "run big was not served to the end: max_tokens 50000" in log
    assert conn.llen("rq:queue:genqueue.big") == 2, "its jobs wait for the fix"
    assert not (tmp_path / "spool").exists(), "a refused start leaves no empty spool behind"


def test_an_endpoint_that_never_came_up_leaves_no_empty_spool(tmp_path, redis_url, conn):
    from tests.conftest import free_port

    enqueue(tmp_path, redis_url, "nobody", 8)
    c = Proc("consumer", ["run", "--endpoint", f"http://127.0.0.1:{free_port()}/v1", "--burst",
                          "--endpoint-wait", "1", "--spool", str(tmp_path / "spool")], tmp_path / "c.log",
             env={"REDIS_URL": redis_url})
    code, log = c.wait(60), c.output()
    assert code == ExitCode.USAGE and "is not reachable after" in log, log
    assert not (tmp_path / "spool").exists(), log


def test_a_paused_run_exits_5(tmp_path, redis_url, conn):
    enqueue(tmp_path, redis_url, "held", 16)
    Pause(conn, "held").pause("breaker: the first 8 items all failed", "gq-test")
    sim = Sim(tmp_path, "--mean-tokens", "10")
    try:
        code, log = burst(tmp_path, redis_url, sim, "--run", "held")
    finally:
        sim.stop()
    assert code == ExitCode.PAUSED, log
    assert "run held was not served to the end: paused: breaker" in log
    assert conn.llen("rq:queue:genqueue.held") == 2


def test_a_run_gone_after_redis_restarted_empty_exits_6_not_0(tmp_path):
    server = RedisServer(tmp_path)  # no persistence: a restart comes back empty
    server.start()
    conn = redis.Redis.from_url(server.url)
    sim = Sim(tmp_path, "--slots", "8", "--step-time", "0.01", "--mean-tokens", "40")
    try:
        enqueue(tmp_path, server.url, "lost", 400)
        c = Proc("consumer", ["run", "--run", "lost", "--endpoint", sim.url, "--burst", "-c", "8",
                              "--shard-max-age", "0.5", "--spool", str(tmp_path / "spool")], tmp_path / "c.log",
                 env={"REDIS_URL": server.url})
        wait_for(lambda: conn.zcard("rq:finished:genqueue.lost") >= 2, 60, "a few jobs acked")
        server.stop()
        server.start()
        code = c.wait(60)
    finally:
        sim.stop()
        server.stop()
    log = c.output()
    assert code == ExitCode.VANISHED, log
    assert "run lost was not served to the end: gone from Redis" in log


def test_launch_does_not_restart_a_consumer_whose_run_is_paused(tmp_path, redis_url, conn):
    enqueue(tmp_path, redis_url, "stuck", 16)
    Pause(conn, "stuck").pause("breaker: the first 8 items all failed", "gq-test")
    launch = Launch(tmp_path, redis_url, "0", "--run", "stuck", "--burst", "-c", "8",
                    sim=("--mean-tokens", "10"))
    try:
        code = launch.wait(90)
    finally:
        launch.stop()
    out = launch.output()
    assert code == ExitCode.PAUSED, out
    assert "consumer-gpu0 exited 5: a run is paused" in out and "not restarting it" in out
    started = launch.log("consumer-gpu0").count("launch: starting consumer-gpu0")
    assert started == 1, f"started {started} times"


def test_the_readme_table_has_every_exit_code() -> None:
    text = (Path(__file__).resolve().parents[2] / "docs" / "consumer.md").read_text()
    section = text[text.index("## `consumer run`"):text.index("### Why raw aiohttp")]
    rows = {int(m) for m in re.findall(r"^  \| (\d+) \|", section, re.MULTILINE)}
    assert rows == {int(c) for c in ExitCode}
