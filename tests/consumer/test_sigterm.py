"""SIGTERM always ends a consumer within --drain-timeout and a few seconds, whatever the endpoint,
Redis or the spool are doing, and gives its jobs back; a second signal ends it at once (real
redis-server, the stand-in vLLM as its own process, the consumer CLI as a subprocess)."""

from __future__ import annotations

import shutil
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import orjson
import pytest
import redis

from tests.conftest import (
    INLINE,
    Prompts,
    RedisServer,
    both_modes_reference_slow,
    cli,
    free_port,
    sharegpt,
    wait_for,
    write_jsonl,
)
from tests.consumer.e2e import Proc, Sim
from tests.consumer.test_disk_full import small_fs  # noqa: F401 - a fixture

pytestmark = pytest.mark.integration

DRAIN = 3.0
#: What a stop may take past --drain-timeout in these tests: shipping, giving back and the stop
#: report each get a moment (the stop's hard ceiling, consumer/guards/stop.py STOP_GRACE, is 10 s more).
SLACK = 5.0


def enqueue(tmp_path: Path, redis_url: str, run: str, n: int, *extra: str) -> None:
    data = write_jsonl(tmp_path / f"{run}.jsonl", [sharegpt(i) for i in range(n)])
    cli("producer", "enqueue", str(data), "--run", run, "--output", str(tmp_path / "out"), "--batch-size", "8",
        "--max-tokens", "256", "--rejects", str(tmp_path / f"{run}.rej"), *extra, env={"REDIS_URL": redis_url})


def start(tmp_path: Path, redis_url: str, endpoint: str, *extra: str, name: str = "c") -> Proc:
    return Proc("consumer", ["run", "--endpoint", endpoint, "--drain-timeout", str(DRAIN), "--lease", "30",
                             "--spool", str(tmp_path / "spool" / name), "--shard-max-age", "0.5", *extra],
                tmp_path / f"{name}.log", env={"REDIS_URL": redis_url})


def held(conn: redis.Redis, run: str) -> int:
    return int(conn.zcard(f"rq:wip:genqueue.{run}"))


def paused(conn: redis.Redis) -> dict[str, str]:
    reasons: dict[str, str] = {}
    for k in conn.keys("genqueue:consumer:*"):
        raw = conn.get(k)
        if raw:
            reasons.update(orjson.loads(raw).get("paused") or {})
    return reasons


def stop_within(c: Proc, seconds: float, sig: int = signal.SIGTERM) -> tuple[int, float]:
    """Signal C; its exit code and how long it took, failing past SECONDS (then SIGKILLed)."""
    t0 = time.monotonic()
    c.signal(sig)
    try:
        code = c.p.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        c.kill()
        raise AssertionError(f"still alive {seconds:.0f} s after the signal:\n{c.output()}") from None
    return code, time.monotonic() - t0


def assert_given_back(conn: redis.Redis, run: str, jobs: int) -> None:
    """Nothing of RUN is leased any more: every job not acked waits in the queue, retries unspent."""
    assert held(conn, run) == 0
    queued = conn.llen(f"rq:queue:genqueue.{run}")
    finished = conn.zcard(f"rq:finished:genqueue.{run}")
    assert queued + finished == jobs, (queued, finished, jobs)
    assert conn.zcard(f"rq:failed:genqueue.{run}") == 0
    for jid in conn.lrange(f"rq:queue:genqueue.{run}", 0, -1):
        assert int(conn.hget(b"rq:job:" + jid, "retries_left") or 3) == 3, "a drain spends no retry"


def busy(tmp_path: Path, redis_url: str, conn: redis.Redis, run: str, *extra: str,
         sim_args: tuple[str, ...] = ("--slots", "8", "--step-time", "0.05", "--mean-tokens", "200"),
         prompts: Prompts = INLINE) -> tuple[Sim, Proc]:
    """A consumer holding jobs of RUN (80 items, 10 jobs) with requests on a slow stand-in (held
    jobs alone are not enough: a drain before the first request is sent ends at once)."""
    enqueue(tmp_path, redis_url, run, 80, *prompts.args)
    sim = Sim(tmp_path, *sim_args)
    c = start(tmp_path, redis_url, sim.url, "--run", run, "-c", "8", *extra)
    wait_for(lambda: held(conn, run) > 0 and sim.running() > 0, 30, "jobs held and requests running")
    return sim, c


@pytest.mark.slow
def test_endpoint_killed_just_before_the_signal(tmp_path, redis_url, conn, prompts_mode):
    sim, c = busy(tmp_path, redis_url, conn, "dead", prompts=prompts_mode)
    sim.stop()
    code, took = stop_within(c, DRAIN + SLACK + 10)
    log = c.output()
    assert code == 0, log
    assert took < DRAIN + SLACK, f"{took:.1f} s\n{log}"
    assert_given_back(conn, "dead", 10)
    assert "a second Ctrl-C or SIGTERM stops at once" in log and "draining for up to 3 s" in log


@pytest.mark.slow
def test_endpoint_down_pause(tmp_path, redis_url, conn, prompts_mode):
    sim, c = busy(tmp_path, redis_url, conn, "down", prompts=prompts_mode)
    sim.stop()
    wait_for(lambda: "endpoint_down" in paused(conn), 30, "the endpoint_down pause")
    code, took = stop_within(c, DRAIN + SLACK + 10)
    assert code == 0 and took < DRAIN + SLACK, (code, took, c.output())
    assert_given_back(conn, "down", 10)


@pytest.mark.slow
def test_spool_full_pause_with_an_unreachable_output(tmp_path, redis_url, conn, prompts_mode):
    enqueue(tmp_path, redis_url, "full", 80, *prompts_mode.args)
    shards = tmp_path / "out" / "full" / "shards"  # a file where the shards go: every ship fails
    shutil.rmtree(shards, ignore_errors=True)
    shards.parent.mkdir(parents=True, exist_ok=True)
    shards.write_text("")
    sim = Sim(tmp_path, "--slots", "8", "--step-time", "0.002", "--mean-tokens", "40")
    try:
        c = start(tmp_path, redis_url, sim.url, "--run", "full", "-c", "8", "--spool-limit", "1")
        wait_for(lambda: "spool_full" in paused(conn), 30, "the spool_full pause")
        code, took = stop_within(c, DRAIN + SLACK + 10)
    finally:
        sim.stop()
    log = c.output()
    assert code == 0 and took < DRAIN + SLACK, (code, took, log)
    assert_given_back(conn, "full", 10)
    left = list((tmp_path / "spool" / "c").rglob("*.jsonl"))
    assert left, "the unshipped shards stay in the spool"
    assert f"stopping with {len(left)} shard(s) not shipped" in log, log


@pytest.mark.slow
def test_redis_unreachable_pause(tmp_path, prompts_mode):
    server = RedisServer(tmp_path, appendonly=True)
    server.start()
    conn = redis.Redis.from_url(server.url)
    sim = None
    try:
        sim, c = busy(tmp_path, server.url, conn, "nored", prompts=prompts_mode)
        server.stop()
        wait_for(lambda: "Redis unreachable" in c.output(), 30, "the consumer to find Redis unreachable")
        code, took = stop_within(c, DRAIN + SLACK + 10)
        assert code == 0 and took < DRAIN + SLACK, (code, took, c.output())
    finally:
        if sim is not None:
            sim.stop()
        server.stop()


@pytest.mark.slow
def test_spool_disk_pause(tmp_path, redis_url, conn, small_fs):  # noqa: F811 - the fixture
    import os

    enqueue(tmp_path, redis_url, "disk", 80)
    with open(small_fs / "filler", "wb") as fh:  # the spool's disk is full from the start
        st = os.statvfs(small_fs)
        fh.write(b"\0" * (st.f_bavail * st.f_frsize - 4096))
    sim = Sim(tmp_path, "--slots", "8", "--step-time", "0.002", "--mean-tokens", "150")
    try:
        c = Proc("consumer", ["run", "--run", "disk", "--endpoint", sim.url, "--drain-timeout", str(DRAIN),
                              "-c", "8", "--spool", str(small_fs / "spool"), "--shard-max-age", "0.5"],
                 tmp_path / "c.log", env={"REDIS_URL": redis_url})
        wait_for(lambda: "spool_disk" in paused(conn), 30, "the spool_disk pause")
        code, took = stop_within(c, DRAIN + SLACK + 10)
    finally:
        sim.stop()
    assert code == 0 and took < DRAIN + SLACK, (code, took, c.output())
    assert_given_back(conn, "disk", 10)


@both_modes_reference_slow
def test_shipping_leftovers_at_start(tmp_path, redis_url, conn, prompts_mode):
    enqueue(tmp_path, redis_url, "left", 80, *prompts_mode.args)
    shards = tmp_path / "out" / "left" / "shards"  # every ship fails: shards stay in the spool
    shutil.rmtree(shards, ignore_errors=True)
    shards.parent.mkdir(parents=True, exist_ok=True)
    shards.write_text("")
    sim = Sim(tmp_path, "--slots", "8", "--step-time", "0.002", "--mean-tokens", "40")
    try:
        first = start(tmp_path, redis_url, sim.url, "--run", "left", "-c", "8", name="a")
        spool = tmp_path / "spool" / "a"
        wait_for(lambda: list(spool.rglob("sealed/*.jsonl")), 30, "a sealed shard")
        first.kill()
        c = start(tmp_path, redis_url, sim.url, "--run", "left", "-c", "8", name="a")
        wait_for(lambda: "left in the spool by an earlier consumer" in c.output(), 30, "leftover shipping")
        code, took = stop_within(c, DRAIN + SLACK + 10)
    finally:
        sim.stop()
    assert code == 0 and took < DRAIN + SLACK, (code, took, c.output())
    assert list(spool.rglob("sealed/*.jsonl")), "the leftovers stay for the next start"


@pytest.mark.slow
def test_start_up_with_many_runs_and_the_endpoint_dying_in_pre_flight(tmp_path, redis_url, conn):
    runs = [f"open{i:02d}" for i in range(30)]
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda r: enqueue(tmp_path, redis_url, r, 8), runs))
    # each probe takes ~64 decode steps: pre-flight of 30 runs would take minutes
    sim = Sim(tmp_path, "--slots", "4", "--step-time", "0.05", "--mean-tokens", "64")
    c = start(tmp_path, redis_url, sim.url, "-c", "8")
    wait_for(lambda: "the server returns thinking as" in c.output(), 60, "the first probe")
    sim.stop()  # the next probe finds the endpoint down and waits for it (the tester's silence)
    wait_for(lambda: "is down" in c.output(), 30, "the endpoint found down in pre-flight")
    time.sleep(1.0)
    code, took = stop_within(c, DRAIN + SLACK + 10)
    log = c.output()
    assert code == 0 and took < DRAIN + SLACK, (code, took, log)
    assert all(held(conn, r) == 0 for r in runs)
    assert sum(conn.llen(f"rq:queue:genqueue.{r}") for r in runs) == 30


def test_waiting_for_the_endpoint_at_start(tmp_path, redis_url):
    c = start(tmp_path, redis_url, f"http://127.0.0.1:{free_port()}/v1", "--endpoint-wait", "600")
    wait_for(lambda: "waiting for endpoint" in c.output(), 30, "the wait line")
    code, took = stop_within(c, 10)
    log = c.output()
    assert code == 0 and took < 3, (code, took, log)
    assert "waited 0m 0" in log and "more (--endpoint-wait 10m 00s)" in log, log  # how long it still waits


def test_waiting_for_redis_at_start(tmp_path):
    c = start(tmp_path, f"redis://127.0.0.1:{free_port()}/0", "http://127.0.0.1:9/v1", "--endpoint-wait", "600")
    wait_for(lambda: "cannot reach Redis" in c.output(), 30, "the Redis wait line")
    code, took = stop_within(c, 10)
    log = c.output()
    assert code == 0 and took < 3, (code, took, log)
    assert "Traceback" not in log


@pytest.mark.slow
def test_a_second_signal_ends_it_at_once(tmp_path, redis_url, conn, prompts_mode):
    sim, c = busy(tmp_path, redis_url, conn, "twice", "--drain-timeout", "60", prompts=prompts_mode)
    try:
        c.signal(signal.SIGTERM)
        wait_for(lambda: "draining for up to 60 s" in c.output(), 10, "the drain line")
        time.sleep(0.5)
        code, took = stop_within(c, 10, signal.SIGINT)
    finally:
        sim.stop()
    log = c.output()
    assert code == 130 and took < 3, (code, took, log)
    assert "second signal (SIGINT): stopping now" in log
    assert_given_back(conn, "twice", 10)
    left = list((tmp_path / "spool" / "c").rglob("*.jsonl"))
    assert ("not shipped" in log) == bool(left), (left, log)
