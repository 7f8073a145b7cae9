"""A fault redoes at most what was in flight, in both prompt modes (issue 46): jobs by reference
hold 128+ items where inline ones hold 32, and a consumer that holds a job must not make the
fault cost the whole job. Real redis-server, real consumer processes, the stand-in vLLM."""

from __future__ import annotations

import collections
import signal
import time

import orjson
import pytest

from tests.conftest import Prompts, cli, sharegpt, write_jsonl
from tests.consumer.e2e import Proc, Sim, read_results, run_keys

pytestmark = [pytest.mark.integration, pytest.mark.slow]

LEASE = 3
RUN = "redo"


def _enqueue(tmp_path, redis_url, prompts: Prompts, n: int) -> None:
    data = write_jsonl(tmp_path / "in.jsonl", [sharegpt(i) for i in range(n)])
    cli("producer", "enqueue", str(data), "--run", RUN, "--output", str(tmp_path / "out"), "--max-tokens", "64",
        "--rejects", str(tmp_path / "rej.jsonl"), *prompts.args, env={"REDIS_URL": redis_url})


def _consumer(tmp_path, redis_url, sim, name: str, *, shard_age: float = 1.0) -> Proc:
    """A consumer on spool NAME (a second one on the same spool logs to NAME-again.log)."""
    log = tmp_path / f"{name}.log"
    log = log if not log.exists() else tmp_path / f"{name}-again.log"
    return Proc("consumer", ["-v", "run", "--run", RUN, "--endpoint", sim.url, "--lease", str(LEASE), "-c", "32",
                             "--burst", "--shard-max-age", str(shard_age), "--spool", str(tmp_path / f"spool-{name}")],
                log, env={"REDIS_URL": redis_url})


def _snapshot(conn, proc: Proc) -> dict | None:
    """PROC's live snapshot (by its pid), or None."""
    for k in conn.keys("genqueue:consumer:*"):
        s = orjson.loads(conn.get(k))
        if s.get("pid") == proc.p.pid and not s.get("exited"):
            return s
    return None


def _sent_not_shipped(snap: dict) -> int:
    """What a consumer had sent to the engine and not shipped: its requests in flight and the
    records in its spool not shipped yet."""
    run = snap["runs"].get(RUN, {})
    return int(snap["in_flight"]) + int(run.get("shipping", {}).get("unshipped_records", 0))


def _busy(conn, proc: Proc, deadline: float) -> dict:
    """PROC's snapshot once it has shipped a few shards and keeps many requests in flight."""
    while time.monotonic() < deadline:
        s = _snapshot(conn, proc)
        if s is not None and s["shipping"]["shards"] >= 3 and s["in_flight"] >= 16:
            return s
        time.sleep(0.05)
    raise AssertionError("the consumer never got busy")


def _duplicates(tmp_path, conn) -> collections.Counter[str]:
    """Records beyond one an item, by item key, in the run's shipped shards."""
    counts = collections.Counter(r["key"] for r in read_results(tmp_path / "out", RUN))
    assert run_keys(conn, RUN) <= set(counts), "every item has a record"
    return collections.Counter({k: n - 1 for k, n in counts.items() if n > 1})


def _spooled(spool) -> set[str]:
    """The item keys of the records in a spool (written, not shipped: shipped shards leave it)."""
    return {orjson.loads(line)["key"] for f in spool.rglob("*.jsonl*") if f.is_file()
            for line in f.read_bytes().splitlines() if line.strip() and line.startswith(b"{")}


def test_a_stopped_then_resumed_consumer_costs_at_most_its_work_in_flight(tmp_path, redis_url, conn,
                                                                          prompts_mode: Prompts) -> None:
    """A consumer stands still (SIGSTOP) past its lease while another serves the run: the other
    sweeps its jobs and takes them; then it goes on (SIGCONT), ships what it had made and finds its
    leases lost. Items made twice are at most what it had sent and not shipped when it stopped."""
    _enqueue(tmp_path, redis_url, prompts_mode, 1500)
    sim = Sim(tmp_path, "--slots", "64", "--step-time", "0.02", "--mean-tokens", "30")
    try:
        a = _consumer(tmp_path, redis_url, sim, "a")
        b = _consumer(tmp_path, redis_url, sim, "b")
        deadline = time.monotonic() + 60
        snap = _busy(conn, a, deadline)
        a.signal(signal.SIGSTOP)
        in_flight = _sent_not_shipped(snap)
        while time.monotonic() < deadline:  # b sweeps a's jobs back and takes them
            s = _snapshot(conn, b)
            if s is not None and s["jobs"]["swept"] > 0:
                break
            time.sleep(0.05)
        time.sleep(1.0)
        a.signal(signal.SIGCONT)
        assert a.wait(120) == 0, a.output()
        assert b.wait(120) == 0, b.output()
    finally:
        sim.stop()
    twice = _duplicates(tmp_path, conn)
    duplicates = sum(twice.values())
    copies = sum(1 for r in read_results(tmp_path / "out", RUN) if r.get("copy") and r["key"] in twice)
    print(f"stopped then resumed ({prompts_mode}): sent and not shipped at the stop {in_flight}; "
          f"duplicate records {duplicates} ({copies} with an end-of-run copy)")
    assert duplicates <= in_flight, f"{duplicates} items made twice for {in_flight} in flight at the stop"
    # By reference the other held the stopped one's jobs whole (128 items) at the end of the run,
    # and its end-of-run copies of the items waiting there were sent there too: 61 records twice
    # against 8 inline. A copy of an item that waits is its transfer (consumer/copies.py).
    assert duplicates <= snap["in_flight"], f"{duplicates} items made twice for {snap['in_flight']} requests " \
                                            f"in flight at the stop ({copies} with an end-of-run copy)"


def test_a_killed_consumer_costs_at_most_its_work_in_flight(tmp_path, redis_url, conn, prompts_mode: Prompts) -> None:
    """A consumer is SIGKILLed mid-run while another serves the run: the other sweeps its jobs once
    their leases expire and takes them; then a fresh consumer starts on the dead one's spool, ships
    what it had written and finishes the run. Items made twice are at most what the dead one had
    sent to the engine and not shipped."""
    _enqueue(tmp_path, redis_url, prompts_mode, 1500)
    sim = Sim(tmp_path, "--slots", "64", "--step-time", "0.02", "--mean-tokens", "30")
    try:
        a = _consumer(tmp_path, redis_url, sim, "a", shard_age=3.0)
        b = _consumer(tmp_path, redis_url, sim, "b")
        deadline = time.monotonic() + 60
        snap = _busy(conn, a, deadline)
        a.signal(signal.SIGKILL)
        a.wait(10)
        in_flight = _sent_not_shipped(snap)
        written = _spooled(tmp_path / "spool-a")
        while time.monotonic() < deadline:  # b sweeps a's jobs back and takes them
            s = _snapshot(conn, b)
            if s is not None and s["jobs"]["swept"] > 0:
                break
            time.sleep(0.05)
        time.sleep(0.5)
        fresh = _consumer(tmp_path, redis_url, sim, "a")  # on the dead one's spool
        assert fresh.wait(120) == 0, fresh.output()
        assert b.wait(120) == 0, b.output()
    finally:
        sim.stop()
    twice = _duplicates(tmp_path, conn)
    beyond = sorted(set(twice) - written)
    print(f"killed ({prompts_mode}): sent and not shipped at the kill {in_flight} ({snap['in_flight']} requests, "
          f"{len(written)} records in its spool); duplicate records {sum(twice.values())}, "
          f"of items it had not made {len(beyond)}")
    assert sum(twice.values()) <= in_flight, f"{sum(twice.values())} items made twice for {in_flight} in flight"
    assert not beyond, f"{len(beyond)} items made twice that the killed consumer had not made: {beyond[:5]}"


def test_items_a_consumer_holds_unsent_are_made_once_at_the_end_of_a_run(tmp_path, redis_url, conn,
                                                                          prompts_mode: Prompts) -> None:
    """A slow consumer (4 slots) holds a whole job while a fast one (32) runs out of work and
    copies what waits there (consumer/copies.py). A copy of an item that waits is its transfer:
    the holder sets it aside instead of sending it too.

    old: the holder offered its waiting items from the next to go and sent them as well (by
         reference, a job of 128 items: most of the end-of-run records twice, 61 after a
         stopped consumer went on against 8 inline)
    new: offered from the last to go, and set aside while copied: at most what the holder had
         in flight when the copies began is made twice"""
    _enqueue(tmp_path, redis_url, prompts_mode, 384)
    sim = Sim(tmp_path, "--slots", "64", "--step-time", "0.02", "--mean-tokens", "30")
    try:
        slow = Proc("consumer", ["-v", "run", "--run", RUN, "--endpoint", sim.url, "-c", "4", "--burst",
                                 "--shard-max-age", "1", "--spool", str(tmp_path / "spool-slow")],
                    tmp_path / "slow.log", env={"REDIS_URL": redis_url})
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not ((s := _snapshot(conn, slow)) and s["held_jobs"]):
            time.sleep(0.05)
        fast = _consumer(tmp_path, redis_url, sim, "fast")
        assert fast.wait(120) == 0, fast.output()
        assert slow.wait(120) == 0, slow.output()
    finally:
        sim.stop()
    twice = _duplicates(tmp_path, conn)
    copies = sum(1 for r in read_results(tmp_path / "out", RUN) if r.get("copy"))
    print(f"end of run ({prompts_mode}): copies written {copies}; records twice {sum(twice.values())}")
    assert sum(twice.values()) <= 4, f"{sum(twice.values())} items made twice ({copies} copies written)"
