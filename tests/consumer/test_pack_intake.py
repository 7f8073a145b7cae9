"""The intake's side of jobs by reference (consumer/work/intake.py, issue 34) on real parts: a real
redis-server, rq's queue and the consumer's rq worker, packs in a real local store.

- a pack's name is asked of the run's pack table once per run and number (counted by Redis
  itself, INFO commandstats), a number the table lacks is asked again at each job, never kept
  as missing, and fails as pack_unreadable;
- a store that cannot serve a pack now (StoreError) is a pack outage: the job goes back without
  spending a retry, nothing fails, the run's pause reason says since when and why, the run is
  asked again after the store backoff, one log line at the start and one at the end, and the
  first pack read ends it.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import pytest
import redis
from rq import Retry
from rq.job import Job

from genqueue.common import backoff, defaults, packs
from genqueue.common.contracts import Item
from genqueue.common.keepers.packs import PackTable
from genqueue.common.keepers.rqaccess import SERIALIZER, TASK, PackRef, job_reference, queue_for, reference_meta
from genqueue.common.settings import RunSettings
from genqueue.common.storage import LocalStore, StoreError
from genqueue.common.storage.names import pack_tag
from genqueue.consumer.answer.generate import RunContext
from genqueue.consumer.rqcompat import GenWorker, Held
from genqueue.consumer.rqthread import RqThread
from genqueue.consumer.work.acker import Acker
from genqueue.consumer.work.book import Book
from genqueue.consumer.work.intake import DRY_RETRY, Intake
from genqueue.consumer.work.packs import PackOutages, PackUnreadable
from tests.doubles import IDENT

pytestmark = pytest.mark.integration

RUN = "refs"
NAME = "w-000001.gqpack"


def items(n: int, first: int = 0) -> list[Item]:
    return [{"key": f"{i:032x}", "index": i, "turn": None, "messages": [{"role": "user", "content": f"q{i}"}]}
            for i in range(first, first + n)]


def pack_of(blocks: list[list[Item]]) -> bytes:
    w = packs.PackWriter()
    for b in blocks:
        w.add_block(b)
    return w.finish()


class Served:
    """What the intake asks of the served runs: the one run here, ready, not paused."""

    def __init__(self, ctx: RunContext) -> None:
        self.contexts = {ctx.run: ctx}
        self.paused: dict[str, str] = {}
        self.priorities: dict[str, int] = {}


class Parts:
    """An intake of RUN on a real Redis and a real local output holding one pack of BLOCKS."""

    def __init__(self, conn: redis.Redis, out: Path, blocks: int = 4) -> None:
        self.conn = conn
        self.store = LocalStore(out)
        self.store.put_pack(RUN, NAME, pack_of([items(2, 2 * b) for b in range(blocks)]))
        table = PackTable(conn, RUN)
        with conn.pipeline() as p:
            table.stage(p, table.allocate(), NAME)
            p.execute()
        self.ctx = RunContext(RUN, RunSettings(output=str(out)), "m", IDENT)
        self.rq = RqThread()
        self.worker = GenWorker([queue_for(RUN, conn)], conn, lease=30)
        self.book: Book[Held] = Book()
        self.intake = Intake(self.rq, self.worker, self.book, Acker(self.rq, self.worker, conn, self.book),
                             Served(self.ctx), low_water=lambda: 8, may_fetch=lambda: True, burst=False,  # type: ignore[arg-type]
                             poll_interval=0.05, wake=asyncio.Event(), stopping=asyncio.Event(),
                             on_complete=self._complete, pack_store_for=lambda output: self.store,
                             outages=PackOutages())

    async def _complete(self, run: str) -> None:
        return None

    def pack_path(self) -> Path:
        return Path(self.store.pack_location(RUN, NAME))

    def hgets(self) -> int:
        return int(self.conn.info("commandstats").get("cmdstat_hget", {}).get("calls", 0))


@pytest.fixture
def parts(conn: redis.Redis, tmp_path: Path) -> Any:
    p = Parts(conn, tmp_path / "out")
    yield p
    p.rq.close()


def test_a_packs_name_is_asked_once_a_run_and_a_missing_number_each_time(parts: Parts) -> None:
    async def scenario() -> None:
        i = parts.intake
        parts.conn.config_resetstat()
        for block in (0, 1, 2, 3, 1):
            assert await i.read_reference(RUN, PackRef(1, block)) == items(2, 2 * block)
        assert (i.pack_names.table_reads, parts.hgets()) == (1, 1), "one HGET of the pack table for five jobs"
        for _ in range(2):  # not in the table: asked again each time, never kept as missing
            with pytest.raises(PackUnreadable, match="pack number 2 is not in run refs's pack table"):
                await i.read_reference(RUN, PackRef(2, 0))
        assert (i.pack_names.table_reads, parts.hgets()) == (3, 3)
        # once the table names it (a producer's transaction landing late), it reads and is kept
        parts.store.put_pack(RUN, "w-000002.gqpack", pack_of([items(1, 50)]))
        parts.conn.hset(PackTable.key(RUN), "2", "w-000002.gqpack")
        for _ in range(3):
            assert await i.read_reference(RUN, PackRef(2, 0)) == items(1, 50)
        assert (i.pack_names.table_reads, parts.hgets()) == (4, 4)
        # a new context of the run (resumed, re-created, new settings): asked again
        i.served.contexts[RUN] = RunContext(RUN, parts.ctx.settings, "m", IDENT)
        await i.read_reference(RUN, PackRef(1, 0))
        assert (i.pack_names.table_reads, parts.hgets()) == (5, 5)

    asyncio.run(scenario())


def test_a_pack_number_given_out_again_after_a_rewind_is_not_read_from_the_kept_name(parts: Parts) -> None:
    """Redis went back (a rewind restores the pack counter): the next enqueue gives number 1 out
    again under its own writer's name. A consumer that kept number 1's name from before reads the
    new pack, since the job carries its writer's tag; a job whose tag the table does not hold
    fails as pack_unreadable, never read from another pack."""

    async def scenario() -> None:
        i = parts.intake
        old = pack_tag(NAME)
        assert await i.read_reference(RUN, PackRef(1, 0, old)) == items(2, 0)  # name kept
        parts.store.put_pack(RUN, "x-000001.gqpack", pack_of([items(3, 100)]))
        parts.conn.hset(PackTable.key(RUN), "1", "x-000001.gqpack")  # what the rewound run's enqueue writes
        new = pack_tag("x-000001.gqpack")
        assert await i.read_reference(RUN, PackRef(1, 0, new)) == items(3, 100)
        assert i.pack_names.table_reads == 2
        assert await i.read_reference(RUN, PackRef(1, 0, new)) == items(3, 100)  # the new name kept
        assert i.pack_names.table_reads == 2
        assert await i.read_reference(RUN, PackRef(1, 0)) == items(3, 100)  # a job queued before tags
        with pytest.raises(PackUnreadable, match=f"names pack number 1 of writer {old}, but run refs's pack table "
                                                 "has x-000001.gqpack"):
            await i.read_reference(RUN, PackRef(1, 0, old))

    asyncio.run(scenario())


def test_a_job_by_reference_keeps_rqs_compact_hash(conn: redis.Redis) -> None:
    """The writer's tag in `meta` keeps the job's hash a listpack (each field under 64 bytes) at
    the largest numbers a run of a hundred million items gives (a 7-digit pack number)."""
    q = queue_for(RUN, conn)
    meta = reference_meta(defaults.BATCH_SIZE_REFERENCE, PackRef(9_999_999, 999, pack_tag(f"{'f' * 32}-9999999.gqpack")))
    q.enqueue_many([q.prepare_data(TASK, args=[], job_id="j1", meta=meta, retry=Retry(max=3), timeout=-1)])
    assert conn.object("encoding", Job.key_for("j1")) in (b"listpack", "listpack")
    assert len(SERIALIZER.dumps(meta)) <= 64
    assert job_reference([], {}, Job.fetch("j1", connection=conn, serializer=SERIALIZER).meta) == \
        PackRef(9_999_999, 999, "ffffff")


def test_a_store_outage_gives_the_job_back_pauses_with_its_reason_and_ends_at_the_first_read(
        parts: Parts, conn: redis.Redis, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    q = queue_for(RUN, conn)
    q.enqueue_many([q.prepare_data(TASK, args=[], job_id=f"gq-ref-{b}", retry=Retry(max=3),
                                   meta=reference_meta(2, PackRef(1, b)))
                    for b in range(4)])
    path = parts.pack_path()
    hidden = tmp_path / "hidden.gqpack"
    path.rename(hidden)
    path.mkdir()  # the local store cannot read a directory: a StoreError, not a missing pack
    caplog.set_level(logging.DEBUG, logger="genqueue.consumer.work.intake")

    async def scenario() -> None:
        i = parts.intake
        await parts.rq.call(parts.worker.start)
        for n in (1, 2, 3):
            assert await i.fetch_one([RUN]) is True
            outage = i.outages.runs[RUN]
            assert outage.failures == n and 0.0 <= outage.retry_in <= backoff.STORE_BACKOFF_CAP
            assert not parts.book.pending, "nothing held"
            assert q.count == 4 and q.failed_job_registry.count == 0, "given back, none failed"
            assert Job.fetch("gq-ref-0", connection=conn, serializer=SERIALIZER).retries_left == 3, "no retry spent"
        reason = i.outages.reason() or ""
        assert reason.startswith(f"run {RUN}: packs unreachable since ") and "UTC (3 failed reads in a row)" in reason
        assert "StoreError" in reason and NAME in reason, reason
        # the run is asked again after the store backoff, not at the next poll
        outage = i.outages.runs[RUN]
        outage.retry_in = 30.0
        await asyncio.sleep(max(DRY_RETRY, 0.05) + 0.1)  # past the poll and the dry retry
        assert i.wanted([RUN]) == [], "asked again only after the store backoff"
        outage.retry_in = 0.0
        assert i.wanted([RUN]) == [RUN]

        path.rmdir()
        hidden.rename(path)
        assert await i.fetch_one([RUN]) is True
        assert RUN not in i.outages.runs and i.outages.reason() is None
        assert len(parts.book) == 1 and parts.book.pending_of(RUN) == 2, "the job is held, its items wait"
        assert q.count == 3 and q.failed_job_registry.count == 0

    asyncio.run(scenario())
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len([m for m in said if "packs cannot be read now" in m]) == 1, said
    assert len([m for m in said if "packs_unreachable over" in m and "3 failed read(s)" in m]) == 1, said
    assert len(said) == 2, said  # not a line per job


def test_store_errors_are_the_stores_not_the_packs(parts: Parts) -> None:
    """The outage and PackUnreadable are told apart by the reader's own error classes."""
    path = parts.pack_path()
    path.unlink()
    path.mkdir()

    async def scenario() -> None:
        with pytest.raises(StoreError):
            await parts.intake.read_reference(RUN, PackRef(1, 0))
        path.rmdir()
        with pytest.raises(PackUnreadable):  # now missing: the pack's fault, the job fails
            await parts.intake.read_reference(RUN, PackRef(1, 0))
        assert RUN in parts.intake.outages.runs, "a missing pack neither starts nor ends an outage"

    asyncio.run(scenario())
