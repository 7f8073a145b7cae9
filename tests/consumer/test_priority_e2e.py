"""Runs share the fleet by priority, then evenly, end to end: real redis-server, the stand-in
over HTTP, the producer and a consumer without --run as processes.

A big run keeps the consumer's slots full; a small run enqueued behind it at the same priority
ships its first results within seconds and finishes long before the big one (oldest first, it
would wait for the whole big run); then a small run at a higher priority takes the slots as
they free up: while it has items, none of the big run's waiting items is sent.
"""

from __future__ import annotations

import signal
import time

import orjson
import pytest

from tests.conftest import cli, sharegpt, wait_for, write_jsonl
from tests.consumer.e2e import Proc, Sim, read_results

pytestmark = [pytest.mark.integration, pytest.mark.slow]

#: Seconds within which a small run's first result must ship after its enqueue returns.
FIRST_RESULT_BOUND = 10.0


def enqueue(tmp_path, redis_url, run, n, *extra):
    data = write_jsonl(tmp_path / f"{run}.jsonl", [sharegpt(i) for i in range(n)])
    cli("producer", "enqueue", str(data), "--run", run, "--output", str(tmp_path / "out"), "--batch-size", "8",
        "--max-tokens", "128", "--rejects", str(tmp_path / f"{run}.rej.jsonl"), *extra, env={"REDIS_URL": redis_url})


def shipped(tmp_path, run):
    return read_results(tmp_path / "out", run)


def test_a_small_run_shares_at_equal_priority_and_a_higher_one_takes_the_slots(tmp_path, redis_url):
    # 32 slots, ~40 tokens at 20 ms a token: ~0.8 s a request, ~40 requests/s; the big run
    # alone would take over a minute.
    sim = Sim(tmp_path, "--slots", "32", "--step-time", "0.02", "--mean-tokens", "40")
    env = {"REDIS_URL": redis_url}
    c = None
    try:
        enqueue(tmp_path, redis_url, "big", 3000)
        c = Proc("consumer", ["-v", "run", "--endpoint", sim.url, "--spool", str(tmp_path / "spool"),
                              "--shard-max-age", "1", "-c", "32"], tmp_path / "consumer.log", env=env)
        wait_for(lambda: len(shipped(tmp_path, "big")) >= 32, 60, "the big run's first results")

        # equal priority: the small run starts within seconds and does not wait for the big one
        enqueue(tmp_path, redis_url, "small", 40)
        t0 = time.monotonic()
        wait_for(lambda: shipped(tmp_path, "small"), 30, "the small run's first result")
        first = time.monotonic() - t0
        share = orjson.loads(cli("producer", "status", "--run", "small", "--json", env=env).stdout)
        wait_for(lambda: len(shipped(tmp_path, "small")) == 40, 60, "the small run's 40 results")
        whole = time.monotonic() - t0
        big_done = len(shipped(tmp_path, "big"))
        print(f"equal priority: small run's first result shipped {first:.1f} s after its enqueue, all 40 "
              f"in {whole:.1f} s; the big run had {big_done} of 3000 shipped then; small's share while "
              f"running: {share['share']}")
        assert first < FIRST_RESULT_BOUND, c.output()[-3000:]
        assert big_done < 2000  # long before the big run ends

        # a higher priority: as slots free up they go to its items, not to the big run's waiting ones
        enqueue(tmp_path, redis_url, "urgent", 40, "--priority", "5")
        t1 = time.monotonic()
        wait_for(lambda: len(shipped(tmp_path, "urgent")) == 40, 60, "the urgent run's 40 results")
        urgent_s = time.monotonic() - t1
        st = orjson.loads(cli("producer", "status", "--run", "urgent", "--json", env=env).stdout)
        assert st["priority"] == 5
        c.signal(signal.SIGTERM)
        assert c.wait(120) == 0, c.output()[-3000:]
        c = None
    finally:
        if c is not None:
            c.kill()
        sim.stop()
    urgent = shipped(tmp_path, "urgent")
    starts = sorted(r["timings"]["started_at"] for r in urgent)
    lo, hi = starts[0], starts[-1]
    big = shipped(tmp_path, "big")
    big_in_window = sum(lo < r["timings"]["started_at"] < hi for r in big)
    print(f"priority 5: urgent run done {urgent_s:.1f} s after its enqueue; its 40 items were sent within "
          f"{hi - lo:.2f} s, during which {big_in_window} of the big run's items were sent")
    assert len({r["key"] for r in urgent}) == 40
    assert big_in_window <= 2, big_in_window  # a slot freed in the instant a new urgent job was on its way
    assert hi - lo < 5.0
