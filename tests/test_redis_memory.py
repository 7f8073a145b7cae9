"""Redis memory, planned and survived (common/keepers/redismem.py), on a redis-server of the test's own
with a small maxmemory: a policy that evicts keys is refused at enqueue and at a consumer's
pre-flight; a run that does not fit is refused before anything is written; a Redis that fills
up mid-run pauses the consumer (no exit), status still answers, and once memory is raised the
run completes with every item exported once; an enqueue that fills Redis says how far it got,
and the same command finishes it without queueing anything twice."""

from __future__ import annotations

import gzip
import time
from pathlib import Path

import orjson
import pytest
import redis

from genqueue.common.keepers.claims import Claims
from genqueue.common.keepers.items import ItemTable
from genqueue.common.keepers.marks import Marks
from tests.conftest import (
    RedisServer,
    both_modes_reference_slow,
    cli,
    free_port,
    http_text,
    sharegpt,
    wait_for,
    write_jsonl,
)
from tests.consumer.e2e import Proc, Sim

pytestmark = pytest.mark.integration

EVICTING = ["allkeys-lru", "allkeys-lfu", "allkeys-random", "volatile-lru", "volatile-lfu", "volatile-random",
            "volatile-ttl"]


@pytest.fixture
def server(tmp_path: Path):
    s = RedisServer(tmp_path)
    s.start()
    try:
        yield s
    finally:
        s.stop()


def _used(conn: redis.Redis) -> int:
    return int(conn.info("memory")["used_memory"])


#: One allkeys and one volatile policy in the default tier; every other in the slow tier (one
#: membership check refuses them all: the tier is CPU-bound, two commands a policy cost ~12 s).
SAMPLED = ("allkeys-lru", "volatile-ttl")


@pytest.mark.parametrize("policies", [
    pytest.param(SAMPLED, id="sampled"),
    pytest.param(tuple(p for p in EVICTING if p not in SAMPLED), id="the-rest", marks=pytest.mark.slow)])
def test_every_evicting_policy_is_refused_at_enqueue_and_at_preflight(tmp_path, server, policies):
    assert set(SAMPLED) < set(EVICTING)
    conn = redis.Redis.from_url(server.url)
    env = {"REDIS_URL": server.url}
    data = write_jsonl(tmp_path / "ev.jsonl", [sharegpt(i) for i in range(20)])
    cli("producer", "enqueue", str(data), "--run", "ev", "--output", str(tmp_path / "out"), env=env)
    keys = conn.dbsize()
    conn.config_set("maxmemory", 64 << 20)
    dead = f"http://127.0.0.1:{free_port()}/v1"  # the policy is checked before the engine is waited for
    for policy in policies:
        conn.config_set("maxmemory-policy", policy)
        keys = conn.dbsize()  # a refused consumer before this one is seen starting (its snapshot)
        enq = cli("producer", "enqueue", str(data), "--run", f"ev-{policy}", "--output", str(tmp_path / "out"),
                  env=env, check=False)
        assert enq.returncode == 2, (policy, enq.stdout, enq.stderr)
        line = enq.stderr.strip()
        assert len(line.splitlines()) == 1 and f"maxmemory-policy is {policy}" in line, line
        assert "CONFIG SET maxmemory-policy noeviction" in line and "redis.conf" in line, line
        assert conn.dbsize() == keys, f"{policy}: nothing written"
        run = cli("consumer", "run", "--run", "ev", "--endpoint", dead, "--burst", "--endpoint-wait", "2",
                  "--spool", str(tmp_path / "spool"), env=env, check=False, timeout=60)
        assert run.returncode == 4, (policy, run.stdout, run.stderr)
        assert f"maxmemory-policy is {policy}" in run.stderr and "noeviction" in run.stderr, run.stderr
        assert "Traceback" not in run.stderr
    conn.config_set("maxmemory-policy", "noeviction")
    ok = cli("producer", "enqueue", str(data), "--run", "ev", "--output", str(tmp_path / "out"), env=env)
    assert "Redis memory" in ok.stdout


def test_a_run_that_does_not_fit_is_refused_with_the_numbers_before_anything_is_written(tmp_path, server):
    conn = redis.Redis.from_url(server.url)
    env = {"REDIS_URL": server.url}
    data = write_jsonl(tmp_path / "big.jsonl", [sharegpt(i) for i in range(20_000)])
    conn.config_set("maxmemory", _used(conn) + (2 << 20))  # 2 MB to spare: the run needs about 8
    before = conn.dbsize()
    proc = cli("producer", "enqueue", str(data), "--run", "big", "--output", str(tmp_path / "out"), env=env,
               check=False)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    line = proc.stderr.strip()
    assert len(line.splitlines()) == 1 and "needs about" in line and " items)" in line, line
    assert "maxmemory" in line and "nothing was written" in line, line
    assert conn.dbsize() == before
    conn.config_set("maxmemory", 0)
    ok = cli("producer", "enqueue", str(data), "--run", "big", "--output", str(tmp_path / "out"), "--json", env=env)
    summary = orjson.loads(ok.stdout)
    assert summary["items"] == 20_000 and summary["redis_estimate_bytes"] > 0
    assert "no maxmemory limit" in summary["redis_memory"]
    print(f"\nestimate {summary['redis_estimate_bytes']:,} bytes for 20,000 items; used after: {_used(conn):,}")


def test_auto_queues_by_reference_a_run_that_fits_redis_only_so(tmp_path, server):
    """--prompts auto (the default) chooses by size, and then by room: a run under the size
    threshold whose prompts do not fit Redis's room, where by reference they do, is queued by
    reference and the summary says why; --prompts inline is still refused with the numbers."""
    conn = redis.Redis.from_url(server.url)
    env = {"REDIS_URL": server.url}
    data = write_jsonl(tmp_path / "room.jsonl", [{"conversations": [{"from": "human", "value": f"{i} " + "x" * 1500}]}
                                                 for i in range(10_000)])
    conn.config_set("maxmemory", _used(conn) + (4 << 20))  # inline needs about 10 MB, by reference 1.2
    try:
        args = ["producer", "enqueue", str(data), "--output", str(tmp_path / "out")]
        refused = cli(*args, "--run", "inl", "--prompts", "inline", env=env, check=False)
        assert refused.returncode == 2 and "queue it by reference (`--prompts reference`" in refused.stderr, \
            refused.stderr
        summary = orjson.loads(cli(*args, "--run", "room", "--json", env=env).stdout)
        choice = summary["prompts_choice"]
        assert (summary["prompts"], choice["asked"], choice["reason"]) == ("reference", "auto", "room"), summary
        assert "auto: inline needs about" in choice["why"] and "by reference" in choice["why"], choice
        print(f"\n{choice['why']}")
        assert summary["items"] == ItemTable(conn, "room").counts().in_run == 10_000
        text = cli(*args, "--run", "room2", env=env, check=False)  # the text summary says it too
        assert text.returncode == 0 and "auto: inline needs about" in text.stdout, (text.stdout, text.stderr)
    finally:
        conn.config_set("maxmemory", 0)


@both_modes_reference_slow
def test_an_enqueue_that_fills_redis_says_how_far_it_got_and_the_same_command_finishes_it(tmp_path, server,
                                                                                          prompts_mode):
    conn = redis.Redis.from_url(server.url)
    env = {"REDIS_URL": server.url}
    n = 40_000 if prompts_mode.by_reference else 20_000
    data = tmp_path / "fill.jsonl.gz"  # compressed: the up-front estimate sees only its first records
    data.write_bytes(gzip.compress(b"".join(orjson.dumps(sharegpt(i)) + b"\n" for i in range(n))))
    # by reference Redis holds no prompt text (about 105 bytes an item): more items, in less room,
    # yet more than the estimate of the first records asks (1.2 MB for 4,096 items)
    conn.config_set("maxmemory", _used(conn) + ((2 << 20) if prompts_mode.by_reference else (3 << 20)))
    args = ["producer", "enqueue", str(data), "--run", "fill", "--output", str(tmp_path / "out"), "--batch-size", "32",
            *prompts_mode.args]
    first = cli(*args, env=env, check=False)
    assert first.returncode == 1, (first.stdout, first.stderr)
    last = first.stderr.strip().splitlines()[-1]
    assert last.startswith("error: Redis is full: used") and "of maxmemory" in last, last
    assert "items were queued" in last and "the same command queues the rest" in last, last
    assert "Command #" not in last
    assert cli("producer", "status", "--run", "fill", env=env).returncode == 0
    conn.config_set("maxmemory", 0)
    again = cli(*args, "--json", env=env)
    summary = orjson.loads(again.stdout)
    assert summary["complete"], summary
    assert Marks(conn, "fill").progress().items == ItemTable(conn, "fill").counts().in_run == n
    assert conn.llen("rq:queue:genqueue.fill") == n // 32, "every item in exactly one job: none queued twice"


def test_a_claim_that_took_redis_past_maxmemory_is_still_given_back(server) -> None:
    """A claim's own writes can take Redis past maxmemory (a script runs to its end once
    started); then every script that writes is refused, the release too. It only frees memory,
    so it runs anyway: its items leave the run, none is left in it and in no job."""
    conn = redis.Redis.from_url(server.url)
    digests = [bytes([i % 256, i // 256]) * 8 for i in range(2000)]
    Claims(conn).claim_slots("full", "c", digests, pack=1)
    conn.config_set("maxmemory", _used(conn) // 2)
    with pytest.raises(redis.exceptions.OutOfMemoryError):
        Claims(conn).claim_slots("full", "d", [b"x" * 16], pack=2)  # full: a write is refused
    assert Claims(conn).release("full", "c") == 2000
    assert ItemTable(conn, "full").counts().in_run == 0 and not Claims(conn).exists("full", "c")
    conn.config_set("maxmemory", 0)


@pytest.mark.slow  # 48 s inline: both modes in the slow tier
@both_modes_reference_slow
def test_redis_full_mid_run_pauses_the_consumer_and_it_completes_once_memory_is_raised(tmp_path, server, prompts_mode):
    conn = redis.Redis.from_url(server.url)
    env = {"REDIS_URL": server.url}
    n = 240
    data = write_jsonl(tmp_path / "mid.jsonl", [sharegpt(i) for i in range(n)])
    cli("producer", "enqueue", str(data), "--run", "mid", "--output", str(tmp_path / "out"), "--batch-size", "4",
        "--max-tokens", "400", *prompts_mode.args, env=env)
    sim = Sim(tmp_path, "--slots", "8", "--step-time", "0.02", "--mean-tokens", "40")
    mport = free_port()
    consumer = Proc("consumer", ["-v", "run", "--run", "mid", "--endpoint", sim.url, "--burst", "--lease", "3",
                                 "-c", "8", "--shard-max-age", "0.5", "--spool", str(tmp_path / "spool"),
                                 "--metrics-port", str(mport)], tmp_path / "c.log", env=env)
    try:
        wait_for(lambda: ItemTable(conn, "mid").counts().done >= 16, 60, "some items done")
        conn.config_set("maxmemory", max(_used(conn) // 2, 1 << 20))  # writes refused from now on
        wait_for(lambda: "Redis is full" in consumer.output(), 30, "the consumer to see Redis full")
        done_at_full = ItemTable(conn, "mid").counts().done
        time.sleep(4 * 3)  # four leases: every lease runs out while renewals are refused
        assert consumer.p.poll() is None, consumer.output()[-3000:]
        metrics = http_text(f"http://127.0.0.1:{mport}/metrics", timeout=2) or ""
        assert 'genqueue_paused{reason="redis_full"} 1.0' in metrics, metrics[-2000:]
        status = cli("producer", "status", "--run", "mid", env=env)
        assert status.stdout.startswith("Redis is full: used"), status.stdout[:500]
        assert ItemTable(conn, "mid").counts().done == done_at_full, "nothing was written while full"
        conn.config_set("maxmemory", 0)
        assert consumer.wait(120) == 0, consumer.output()[-3000:]
    finally:
        if consumer.p.poll() is None:
            consumer.kill()
        sim.stop()
    log = consumer.output()
    assert "Redis takes writes again" in log, log[-3000:]
    assert "Traceback" not in log
    proc = cli("producer", "export", "--run", "mid", "-o", str(tmp_path / "mid.out.jsonl"), "--json", env=env)
    e = orjson.loads(proc.stdout)
    assert (e["exported"], e["missing"], e["failed"]) == (n, 0, 0), e
    keys = [orjson.loads(line)["key"] for line in (tmp_path / "mid.out.jsonl").read_bytes().splitlines()]
    assert len(keys) == len(set(keys)) == n
    print(f"\n{prompts_mode}: full at {done_at_full} of {n} done; export removed {e['duplicates_removed']} duplicates")
