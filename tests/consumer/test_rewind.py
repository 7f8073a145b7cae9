"""A Redis that rewinds costs nothing already shipped (real redis-server with a real RDB
snapshot, two real consumer processes, the stand-in over HTTP, `producer export` at the end).

Mid-run Redis saves a snapshot (BGSAVE); the consumers go on shipping for a few seconds;
then Redis is SIGKILLed and started again from that snapshot, on the same port and dir: the
done marks of every item shipped since the snapshot are gone, while their shards sit in the
output. The consumers ride out the outage, find their marks stamps gone back, rebuild the
run's marks from the shipped shards (one at a time) before taking its jobs again, and the run
completes with nothing missing: items generated twice are at most what was in flight at the
crash, not what shipped in the lost window."""

from __future__ import annotations

import collections
import time
from pathlib import Path

import orjson
import pytest
import redis

from genqueue.common.keepers.items import ItemTable
from genqueue.common.keepers.keeper import run_key
from genqueue.common.keepers.marks import ShardMarks
from genqueue.common.keepers.markstamps import MarkStamp, RebuildState
from genqueue.common.keepers.rqaccess import JobPlace, place_members
from genqueue.common.keepers.rqjobs import JobScan, read_jobs
from genqueue.consumer.guards.rewind import Rebuild, Rewind
from genqueue.consumer.rqthread import RqThread
from genqueue.producer.packitems import PackItems
from tests.conftest import Prompts, RedisServer, cli, sharegpt, wait_for, write_jsonl
from tests.consumer.e2e import Proc, Sim, read_results

pytestmark = pytest.mark.integration

ITEMS = 3000
WINDOW = 3.0  # seconds of shipping after the snapshot, lost with the crash


def _consumer(tmp_path: Path, url: str, sim: Sim, name: str) -> Proc:
    return Proc("consumer", ["-v", "run", "--run", "rw", "--endpoint", sim.url, "-c", "32", "--lease", "5",
                             "--burst", "--shard-max-age", "0.5", "--spool", str(tmp_path / f"spool-{name}")],
                tmp_path / f"{name}.log", env={"REDIS_URL": url})


def _job_items(conn: redis.Redis, out: Path) -> dict[str, list[str]]:
    """Each queued job's item keys (by reference: from the packs), read before any is taken."""
    return {job.id: [item["key"] for item in job.items]
            for job in read_jobs(conn, "rw", (JobPlace.QUEUED,), scan=JobScan(),
                                 items_of=PackItems(conn, "rw", str(out)).items_of)}


def _held_jobs(conn: redis.Redis) -> set[str]:
    """The jobs dequeued and not acked now (rq's started registry and the dequeuing list), in
    one transaction: ids only, so the crash follows at once. Reading their items here, before
    the kill, took long enough on a loaded machine for the consumers to dequeue more jobs
    between the count and the crash, whose items the count then left out."""
    return {(m.decode() if isinstance(m, bytes) else str(m)).split(":")[0]
            for _place, members in place_members(conn, "rw", [JobPlace.DEQUEUING, JobPlace.STARTED])
            for m in members}


def _held(jobs: dict[str, list[str]], held: set[str], shipped: list[Path]) -> int:
    """Items in flight at the crash, in the sense a crash costs: of the jobs HELD then, the items
    no shard in the output at the crash (SHIPPED, listed right after the kill) holds. This counts
    the items generated and waiting in an outbox for their shard too, which the consumers'
    snapshots (in flight and waiting for a slot, published every 2 s) leave out: a crash costs
    those as well when their shards land after the rebuild read the output."""
    done = {orjson.loads(line)["key"] for shard in shipped for line in shard.read_bytes().splitlines() if line.strip()}
    return sum(1 for jid in held for key in jobs.get(jid, []) if key not in done)


@pytest.mark.slow
def test_redis_back_from_an_old_snapshot_regenerates_only_what_was_in_flight(tmp_path: Path,
                                                                             prompts_mode: Prompts) -> None:
    (tmp_path / "redis").mkdir()
    server = RedisServer(tmp_path / "redis")
    server.start()
    conn = redis.Redis.from_url(server.url)
    data = write_jsonl(tmp_path / "rw.jsonl", [sharegpt(i) for i in range(ITEMS)])
    cli("producer", "enqueue", str(data), "--run", "rw", "--output", str(tmp_path / "out"), "--batch-size", "16",
        "--max-tokens", "64", "--rejects", str(tmp_path / "rej.jsonl"), *prompts_mode.args,
        env={"REDIS_URL": server.url})
    jobs = _job_items(conn, tmp_path / "out")
    sim = Sim(tmp_path, "--slots", "64", "--step-time", "0.01", "--mean-tokens", "20")
    procs: list[Proc] = []
    try:
        procs = [_consumer(tmp_path, server.url, sim, name) for name in ("c1", "c2")]
        wait_for(lambda: ItemTable(conn, "rw").counts().done >= 600, 60, "600 items shipped")
        with conn.pipeline() as p:  # one MULTI: the count is the snapshot's
            p.hget(ItemTable.key("rw"), "done")
            p.bgsave()
            at_snapshot = int(p.execute()[0] or 0)
        wait_for(lambda: conn.info("persistence")["rdb_bgsave_in_progress"] == 0, 30, "the snapshot")
        assert conn.info("persistence")["rdb_last_bgsave_status"] == "ok"
        time.sleep(WINDOW)
        with conn.pipeline() as p:
            p.hget(ItemTable.key("rw"), "done")
            p.lastsave()
            at_crash = int(p.execute()[0] or 0)
        held_jobs = _held_jobs(conn)
        server.kill()
        shipped = sorted((tmp_path / "out" / "rw" / "shards").glob("*.jsonl"))
        held = _held(jobs, held_jobs, shipped)
        time.sleep(1.0)
        server.start()
        conn = redis.Redis.from_url(server.url)
        restored = int(ItemTable(conn, "rw").counts().done)
        for proc in procs:
            assert proc.wait(180) == 0, proc.output()
    finally:
        for proc in procs:
            if proc.p.poll() is None:
                proc.kill()
        sim.stop()
    try:
        proc = cli("producer", "export", "--run", "rw", "-o", str(tmp_path / "rw.out.jsonl"), "--json",
                   "--include-outcomes", "all",
                   env={"REDIS_URL": server.url})
        e = orjson.loads(proc.stdout)
    finally:
        server.stop()
    logs = "".join(p.output() for p in procs)
    results = read_results(tmp_path / "out", "rw")
    counts = collections.Counter(r["key"] for r in results)
    twice = sum(n - 1 for n in counts.values())
    # an end-of-run copy (consumer/copies.py) of an item in flight may ship beside it, fault or not
    copied = {r["key"] for r in results if r.get("copy")}
    by_fault = sum(n - 1 for k, n in counts.items() if k not in copied)
    window = at_crash - at_snapshot
    print(f"\nrewind ({prompts_mode}): {at_snapshot} items marked at the snapshot ({restored} after the restart), {window} shipped "
          f"in the {WINDOW:.0f} s lost window, {held} in flight (dequeued, not shipped) at the crash; generated twice: "
          f"{twice} (export removed {e['duplicates_removed']} duplicates), {by_fault} of them without an end-of-run copy")
    assert "Redis holds older data than this consumer wrote" in logs, logs
    assert "marks rebuilt from" in logs, logs
    assert (e["exported"], e["missing"], e["failed"]) == (ITEMS, 0, 0), e
    assert e["duplicates_removed"] == twice
    assert window > held, "the test means something only if the window shipped more than was in flight"
    assert twice <= held, f"{twice} items generated twice for {held} in flight at the crash"
    # was: 0 to 94 (51-94 in four runs of six), the records waiting in the other consumer's spool: it
    # took from the restored queue the jobs their holder still held. Now each holder takes its own
    # back (GenWorker.take_back) before the run's jobs are taken again (Rewind's hold).
    assert by_fault == 0, f"{by_fault} items generated twice by the rewind, not by an end-of-run copy"


def test_a_stamp_gone_back_holds_the_run_on_every_consumer_until_rebuilt(conn: redis.Redis,
                                                                          redis_url: str) -> None:
    """The protocol on its own (real Redis, no processes): A finds its stamp gone back and marks
    the run pending; B, which lost nothing, holds the run back too; once the state says done,
    B's attempt finds nothing to rebuild and takes the run again."""
    conn.hset(run_key("rw"), mapping={"settings": "{}"})  # present (its settings are not read here)
    rq = RqThread()
    try:
        no_store = lambda output: None  # never called: no rebuild runs here
        a = Rewind(rq, conn, "a", runs=lambda: ["rw"], store_for=no_store)  # type: ignore[arg-type]
        b = Rewind(rq, conn, "b", runs=lambda: ["rw"], store_for=no_store)  # type: ignore[arg-type]
        marks = ShardMarks()
        marks.add("ab" * 16, error=False)
        for _ in range(3):
            a.mark_shipped("rw", marks)
        b.mark_shipped("rw", marks)
        assert a.allows("genqueue.rw") and b.allows("genqueue.rw") and not a.pending
        conn.set(MarkStamp.key("a"), 1)  # Redis lost A's last two writes
        a.mark_shipped("rw", marks)  # the stamp it replaces tells at once
        assert a.pending == {"rw"} and a.rewinds == 1
        assert (conn.get(RebuildState.key("rw")) or b"").startswith(b"pending:")
        b._checked = float("-inf")
        assert not b.allows("genqueue.rw") and b.pending == {"rw"}  # B lost nothing, and holds back
        assert not a.allows("genqueue.rw")
        conn.set(RebuildState.key("rw"), "done:x")  # as the rebuilder leaves it
        assert b._rebuild("rw") is Rebuild.DONE
        conn.delete(run_key("rw"))
        assert a._rebuild("rw") is Rebuild.GONE and conn.get(RebuildState.key("rw")) is None
    finally:
        rq.close()


def test_a_run_whole_again_is_taken_only_after_its_holders_could_take_back_their_jobs(conn: redis.Redis,
                                                                                      redis_url: str) -> None:
    """was: the first consumer back rebuilt the marks and took at once, from the restored queue, the
    jobs another consumer still held (it had reconnected 0.2 s later): their records waiting in that
    one's spool were made again (most of the records twice after a rewind). Now a run whole again is
    held one renewal of leases, in which each holder takes back its jobs (GenWorker.take_back)."""
    conn.hset(run_key("rw"), mapping={"settings": "{}"})
    rq = RqThread()
    try:
        no_store = lambda output: None  # type: ignore[var-annotated]  # never called: no rebuild here
        held = Rewind(rq, conn, "a", runs=lambda: ["rw"], store_for=no_store, hold=0.5)  # type: ignore[arg-type]
        bare = Rewind(rq, conn, "b", runs=lambda: ["rw"], store_for=no_store)  # type: ignore[arg-type]
        for r in (held, bare):
            r.pending.add("rw")
            assert not r.allows("genqueue.rw")
            r.settled("rw", Rebuild.DONE)
        assert bare.allows("genqueue.rw") and not held.allows("genqueue.rw")
        assert held.allows("genqueue.other")  # other runs are not held
        time.sleep(0.6)
        assert held.allows("genqueue.rw")
        held.pending.add("gone")
        held.settled("gone", Rebuild.GONE)  # nothing to take: nothing held
        assert held.allows("genqueue.gone")
    finally:
        rq.close()
