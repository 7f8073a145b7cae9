"""Pools sized to the work (issue 46): a consumer's checkpoint reads and writes (multi-turn
regeneration) never fail with redis-py's "Too many connections", at any documented concurrency,
in either prompt mode; and they open no more connections than the work needs, up to
checkpoints.POOL_MAX (a fleet stays far under Redis's maxclients).

was: `checkpoint of <key> not read (Too many connections); starting at turn 1`, 16 and 7 times in
two by-reference runs (1,394 times in 3,000 two-turn items at -c 1024 here): redis-py's asyncio
pool stops at 100 connections and raises past them. now: none, the pool waits a moment instead.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import orjson
import pytest
import redis

from genqueue.common import defaults
from genqueue.common.keepers.checkpoints import POOL_MAX, checkpoint_key, pool_size
from genqueue.consumer.answer.checkpoints import Checkpoints
from tests.conftest import Prompts, cli, sharegpt, write_jsonl
from tests.consumer.e2e import Proc, Sim

#: The highest --concurrency docs/consumer.md documents: --max-concurrency's default, the
#: ceiling of `-c auto`.
HIGHEST = defaults.MAX_CONCURRENCY
TOO_MANY = "Too many connections"


def test_the_pool_is_sized_to_the_requests_in_flight_up_to_its_ceiling() -> None:
    assert pool_size(8) == 8 and pool_size(0) == 1
    assert pool_size(defaults.CONCURRENCY) == pool_size(HIGHEST) == POOL_MAX
    assert POOL_MAX < 100  # redis-py's own pool raised past 100


def test_as_many_checkpoint_reads_and_writes_at_once_as_requests_in_flight_never_fail(
        redis_url: str, conn: redis.Redis, caplog: pytest.LogCaptureFixture) -> None:
    """HIGHEST reads then HIGHEST writes at once, as HIGHEST items starting together do: every
    one answered (was: all but 100 `not read (Too many connections)`), through at most
    POOL_MAX connections."""
    keys = [f"{n:032x}" for n in range(HIGHEST)]
    conn.set(checkpoint_key("r", keys[0]), orjson.dumps({"history": [], "turns": [{}], "pos": 1}))
    before = int(conn.info("clients")["connected_clients"])
    seen: list[int] = []

    async def go() -> list[object]:
        cps = Checkpoints(redis_url, HIGHEST)
        try:
            got = await asyncio.gather(*(cps.load("r", k) for k in keys))
            seen.append(int(conn.info("clients")["connected_clients"]))
            await asyncio.gather(*(cps.save("r", k, {"history": [], "turns": [{}], "pos": 1}) for k in keys))
            seen.append(int(conn.info("clients")["connected_clients"]))
            return [got[0], cps.saved]
        finally:
            await cps.close()

    with caplog.at_level(logging.WARNING):
        first, saved = asyncio.run(go())
    assert TOO_MANY not in caplog.text and "not read" not in caplog.text and "not saved" not in caplog.text
    assert first == {"history": [], "turns": [{}], "pos": 1} and saved == HIGHEST
    assert max(seen) - before <= POOL_MAX, seen


@pytest.mark.integration
def test_a_consumer_at_the_highest_documented_concurrency_reads_every_checkpoint(
        tmp_path: Path, redis_url: str, conn: redis.Redis, prompts_mode: Prompts) -> None:
    """`consumer run -c 4096` on two-turn items (regenerate reads a checkpoint as each item starts,
    and writes one after its first turn), against the stand-in batching them all: every item done,
    no `not read (Too many connections)` nor `not saved` in the consumer's log."""
    n = 1200
    data = write_jsonl(tmp_path / "pool.jsonl", [sharegpt(i, turns=2) for i in range(n)])
    cli("producer", "enqueue", str(data), "--run", "pool", "--output", str(tmp_path / "out"), "--max-tokens", "16",
        "--rejects", str(tmp_path / "rej"), *prompts_mode.args, env={"REDIS_URL": redis_url})
    sim = Sim(tmp_path, "--slots", str(HIGHEST), "--step-time", "0.01", "--mean-tokens", "8")
    try:
        consumer = Proc("consumer", ["run", "--run", "pool", "--endpoint", sim.url, "--burst", "-c", str(HIGHEST),
                                     "--shard-max-age", "1", "--spool", str(tmp_path / "spool")],
                        tmp_path / "c.log", env={"REDIS_URL": redis_url})
        assert consumer.wait(180) == 0, consumer.output()[-3000:]
    finally:
        sim.stop()
    log = consumer.output()
    assert TOO_MANY not in log and "checkpoint of" not in log, [ln for ln in log.splitlines() if "checkpoint" in ln][:5]
    status = orjson.loads(cli("producer", "status", "--run", "pool", "--json", env={"REDIS_URL": redis_url}).stdout)
    assert (status["items"], status["items_done"]) == (n, n)
