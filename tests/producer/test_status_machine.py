"""`producer status` cannot contradict itself: a stateful property test.

Hypothesis's rule-based state machine drives a few consumers of one run through start, pre-flight,
take, send, answer, seal, ship, ack, drain, crash, restart on a dead one's spool, and time passing
(leases expiring, snapshots going stale). Real Redis; the status report is built by the real
code (run_status and format_status) from what the real parts write: each model consumer is a
real consumer/telemetry.Telemetry (its snapshot, its spent counters, published through
common/keepers/snapshots.py), marks are written by common/keepers/marks.py Marks.mark_shipped and acks counted by
common/keepers/runs.py RunStore.count_acked; only the engine, rq's worker and the spool are modelled here. Time
passing is each consumer's clock falling behind Redis's (its clock_offset): status judges every
age in Redis time, so the model's shipping times, stamped with the node's clock, are read
through that offset as the real ones are.

After every step, what must hold of status at any moment (check below).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, cast

import pytest
import redis
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from rq.queue import Queue
from rq.registry import FinishedJobRegistry, StartedJobRegistry

from genqueue.common.contracts import ErrorClass, Outcome
from genqueue.common.keepers.items import IN_RUN, ItemTable
from genqueue.common.keepers.marks import Marks, ShardMarks
from genqueue.common.keepers.rqaccess import queue_name
from genqueue.common.keepers.runs import RunStore, key_digest
from genqueue.common.keepers.snapshots import STALE_AFTER
from genqueue.common.records import ConsumerInfo, Record
from genqueue.common.settings import RunSettings
from genqueue.consumer.engine.admission import AdmissionSnapshot
from genqueue.consumer.rqthread import RqSnapshot
from genqueue.consumer.served import ServedSnapshot
from genqueue.consumer.shipping.outbox import OutboxSnapshot, RunShipping
from genqueue.consumer.telemetry import Parts, Telemetry
from genqueue.consumer.work.acker import AckSnapshot
from genqueue.consumer.work.book import BookSnapshot, RunLoad
from genqueue.consumer.work.leases import LeaseSnapshot
from genqueue.producer.status import format_status, run_status
from genqueue.producer.status.screen import screen_rows

RUN = "sm"
JOBS, PER_JOB = 6, 3
CONCURRENCY = 2  # requests a consumer keeps in flight
HOLD = 2  # jobs a consumer holds at most
CAPACITY = HOLD * PER_JOB  # items a consumer can hold: in flight and waiting for a slot


class InlineRq:
    """The rq thread, inline: the test is one thread."""

    async def call(self, fn: Any, /, *args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)


@dataclass
class Job:
    id: str
    keys: list[str]


@dataclass
class Model:
    """One consumer as the test drives it; its Telemetry reads it through Parts."""

    name: str
    spool: str
    skew: float  # how far its clock is behind Redis's (its clock_offset)
    phase: str | None = "pre-flight: waiting on the engine (/v1/models)"
    alive: bool = True  # publishing (a crashed one stops without a word)
    exited: bool = False
    jobs: dict[str, Job] = field(default_factory=dict)
    pending: list[tuple[str, str]] = field(default_factory=list)  # (job, key) waiting for a slot
    flying: list[tuple[str, str]] = field(default_factory=list)
    written: list[tuple[str, Record]] = field(default_factory=list)  # the open shard
    sealed: list[list[tuple[str, Record]]] = field(default_factory=list)  # shards waiting to ship
    sealed_at: list[float] = field(default_factory=list)
    shipped_keys: set[str] = field(default_factory=set)
    shards: int = 0
    last_upload_at: float | None = None
    telemetry: Telemetry | None = None

    def parts(self) -> Parts:
        def book() -> BookSnapshot:
            load = RunLoad(len(self.jobs), len(self.pending), len(self.flying))
            return BookSnapshot(load.held_jobs, load.pending_items, load.in_flight, {RUN: load} if self.jobs else {})

        def outbox() -> OutboxSnapshot:
            waiting = len(self.sealed)
            unshipped = len(self.written) + sum(len(s) for s in self.sealed)
            oldest = min(self.sealed_at) if self.sealed_at else None
            run = RunShipping(self.shards, 100 * self.shards, waiting, unshipped, self.last_upload_at, oldest)
            return OutboxSnapshot(self.shards, 100 * self.shards, waiting, 0, self.last_upload_at, None, None, oldest,
                                  0, 0, None, {RUN: run} if self.phase is None else {})

        ctx = SimpleNamespace(fingerprint=None, reasoning_probe=None, settings=RunSettings())
        return Parts(
            book=book, acker=lambda: AckSnapshot(0, 0, 0, 0, 0), leases=lambda: LeaseSnapshot(0, 0, self.skew),
            served=lambda: ServedSnapshot(["m"], {"m": None}, {RUN: ctx} if self.phase is None else {}, {}),  # type: ignore[dict-item]
            outbox=outbox, admission=lambda: AdmissionSnapshot("fixed", CONCURRENCY, {"metrics": False}),
            rq=lambda: RqSnapshot(None, 0), paused=dict, stopping=lambda: self.exited, retries=dict)

    def held_items(self) -> int:
        return len(self.pending) + len(self.flying)


def _record(key: str, error: bool, tokens: int) -> Record:
    if error:
        return cast(Record, {"key": key, "error": {"class": ErrorClass.PERMANENT.value, "type": "http_400",
                                                   "message": "refused"}})
    return cast(Record, {"key": key, "outcome": Outcome.FINISHED.value,
                         "usage": {"prompt_tokens": 10, "completion_tokens": tokens}})


class StatusMachine(RuleBasedStateMachine):
    url = ""

    def __init__(self) -> None:
        super().__init__()
        self.conn = redis.Redis.from_url(self.url)
        self.conn.flushall()
        self.loop = asyncio.new_event_loop()
        self.consumers: list[Model] = []
        self.shipped: dict[str, bool] = {}  # item key -> shipped as an error
        self.generated = 0  # completion tokens of every result answered
        self.last: dict[str, Any] = {}
        self.seq = 0
        self.skew = 0.0  # Redis's clock ahead of every node's by this much: time passing

    # --- the run ------------------------------------------------------------------------
    @initialize()
    def enqueue(self) -> None:
        RunStore(self.conn).create_or_check(RUN, RunSettings())
        self.queued: list[Job] = [Job(f"job-{j}", [f"{j:02d}{i:030x}" for i in range(PER_JOB)]) for j in range(JOBS)]
        keys = [k for job in self.queued for k in job.keys]
        ItemTable(self.conn, RUN).change([key_digest(k) for k in keys], add=IN_RUN)
        self.conn.rpush(self._queue_key(), *[job.id for job in self.queued])

    def _queue_key(self) -> str:
        return Queue.redis_queue_namespace_prefix + queue_name(RUN)

    def _started_key(self) -> str:
        return StartedJobRegistry.key_template.format(queue_name(RUN))

    def teardown(self) -> None:
        self.loop.close()
        self.conn.close()

    # --- consumers ----------------------------------------------------------------------
    def _new(self, spool: str) -> Model:
        self.seq += 1
        m = Model(f"c{self.seq}", spool, self.skew)
        identity: ConsumerInfo = {"host": "node1", "gpu": 0, "worker": m.name, "endpoint": "http://e/v1"}
        m.telemetry = Telemetry(identity, self.conn, InlineRq(), m.parts(), gpus=2)  # type: ignore[arg-type]
        m.telemetry.only_run, m.telemetry.spool = RUN, spool
        m.telemetry.set_phase(m.phase)
        self.consumers.append(m)
        return m

    def _live(self) -> list[Model]:
        return [m for m in self.consumers if m.alive]

    def _serving(self) -> list[Model]:
        return [m for m in self._live() if m.phase is None]

    @precondition(lambda self: len(self._live()) < 3)
    @rule()
    def start(self) -> None:
        self._new(f"/spool/{self.seq + 1}")

    @precondition(lambda self: any(m.phase for m in self._live()))
    @rule(data=st.data())
    def preflight_passes(self, data: st.DataObject) -> None:
        m = data.draw(st.sampled_from([m for m in self._live() if m.phase]))
        m.phase = None
        assert m.telemetry is not None
        m.telemetry.set_phase(None)
        m.telemetry.start_run(RUN)

    @precondition(lambda self: any(len(m.jobs) < HOLD for m in self._serving()) and self.queued)
    @rule(data=st.data())
    def take(self, data: st.DataObject) -> None:
        m = data.draw(st.sampled_from([m for m in self._serving() if len(m.jobs) < HOLD]))
        job = self.queued.pop(0)
        self.conn.lpop(self._queue_key())
        self.conn.zadd(self._started_key(), {f"{job.id}:{m.name}": time.time() + 60})
        m.jobs[job.id] = job
        m.pending += [(job.id, k) for k in job.keys if k not in self.shipped]  # what shipped is skipped
        self._ack_complete(m)

    @precondition(lambda self: any(m.pending and len(m.flying) < CONCURRENCY for m in self._serving()))
    @rule(data=st.data())
    def send(self, data: st.DataObject) -> None:
        m = data.draw(st.sampled_from([m for m in self._serving() if m.pending and len(m.flying) < CONCURRENCY]))
        while m.pending and len(m.flying) < CONCURRENCY:
            m.flying.append(m.pending.pop(0))

    @precondition(lambda self: any(m.flying for m in self._serving()))
    @rule(data=st.data(), error=st.booleans(), tokens=st.integers(1, 500))
    def answer(self, data: st.DataObject, error: bool, tokens: int) -> None:
        m = data.draw(st.sampled_from([m for m in self._serving() if m.flying]))
        job, key = m.flying.pop(0)
        rec = _record(key, error and tokens % 5 == 0, tokens)
        m.written.append((job, rec))
        assert m.telemetry is not None
        m.telemetry.record(RUN, rec)
        self.generated += 0 if "error" in rec else tokens

    @precondition(lambda self: any(m.written for m in self._serving()))
    @rule(data=st.data())
    def seal(self, data: st.DataObject) -> None:
        m = data.draw(st.sampled_from([m for m in self._serving() if m.written]))
        m.sealed.append(m.written)
        m.sealed_at.append(time.time())  # the node's clock, as the outbox stamps it
        m.written = []

    def _ship(self, m: Model) -> None:
        for shard in m.sealed:
            marks = ShardMarks()
            for _, rec in shard:
                marks.add_record(rec)
                self.shipped.setdefault(rec["key"], "error" in rec)
                m.shipped_keys.add(rec["key"])
            Marks(self.conn, RUN).mark_shipped(marks)
            m.shards += 1
            m.last_upload_at = time.time()
        m.sealed, m.sealed_at = [], []

    @precondition(lambda self: any(m.sealed for m in self._serving()))
    @rule(data=st.data())
    def ship(self, data: st.DataObject) -> None:
        m = data.draw(st.sampled_from([m for m in self._serving() if m.sealed]))
        self._ship(m)
        self._ack_complete(m)

    def _ack_complete(self, m: Model) -> None:
        """Ack every job of M whose items all shipped (here or anywhere: a job re-taken after a
        crash may find its items shipped by the dead consumer's spool)."""
        for job in list(m.jobs.values()):
            if all(k in self.shipped for k in job.keys):
                del m.jobs[job.id]
                self.conn.zrem(self._started_key(), f"{job.id}:{m.name}")
                self.conn.zadd(FinishedJobRegistry.key_template.format(queue_name(RUN)), {job.id: time.time()})
                mine = [self.shipped[k] for k in job.keys if k in m.shipped_keys]
                counts = Counter(items_done=sum(not e for e in mine), items_failed=sum(mine))
                counts["completion_tokens"] = 0  # the tokens are the telemetry's; acks count items here
                # the run's start is its first acked job's (hsetnx): it moves to a later moment
                # than the GPU time spent before it, as a run's first ack at a drain does
                RunStore(self.conn).count_acked(RUN, dict(counts), time.time() + self.skew - 1)

    def _give_back(self, m: Model) -> None:
        for job in list(m.jobs.values()):
            self.conn.zrem(self._started_key(), f"{job.id}:{m.name}")
            self.conn.lpush(self._queue_key(), job.id)
            self.queued.insert(0, job)
        m.jobs, m.pending, m.flying = {}, [], []

    @precondition(lambda self: bool(self._serving()))
    @rule(data=st.data(), tokens=st.integers(1, 500))
    def drain(self, data: st.DataObject, tokens: int) -> None:
        """SIGTERM: what is in flight finishes, every shard ships, complete jobs are acked, the
        rest goes back; the consumer says it exited."""
        m = data.draw(st.sampled_from(self._serving()))
        assert m.telemetry is not None
        for job, key in m.flying:
            rec = _record(key, False, tokens)
            m.written.append((job, rec))
            m.telemetry.record(RUN, rec)
            self.generated += tokens
        m.flying = []
        if m.written:
            m.sealed.append(m.written)
            m.sealed_at.append(time.time())
            m.written = []
        self._ship(m)
        self._ack_complete(m)
        self._give_back(m)
        m.exited = True
        self.loop.run_until_complete(m.telemetry.publish(exited=True))
        m.alive = False

    @precondition(lambda self: bool(self._live()))
    @rule(data=st.data())
    def crash(self, data: st.DataObject) -> None:
        """SIGKILL: no word; its jobs stay started until their leases expire, its spool stays."""
        m = data.draw(st.sampled_from(self._live()))
        m.alive = False

    @precondition(lambda self: any(not m.alive and not m.exited and not getattr(m, "replaced", False)
                                   for m in self.consumers) and len(self._live()) < 3)
    @rule(data=st.data())
    def restart_on_its_spool(self, data: st.DataObject) -> None:
        """A new consumer on a crashed one's spool: it ships what was left there at start-up."""
        dead = data.draw(st.sampled_from([m for m in self.consumers if not m.alive and not m.exited
                                          and not getattr(m, "replaced", False)]))
        dead.replaced = True  # type: ignore[attr-defined]
        m = self._new(dead.spool)
        m.phase = "shipping an earlier consumer's leftover shards"
        assert m.telemetry is not None
        m.telemetry.set_phase(m.phase)
        m.sealed = dead.sealed + ([dead.written] if dead.written else [])
        m.sealed_at = [time.time()] * len(m.sealed)
        dead.sealed, dead.written, dead.sealed_at = [], [], []
        self._ship(m)

    @rule()
    def time_passes(self) -> None:
        """STALE_AFTER and a lease go by: the silent are stale, their jobs swept back."""
        self.skew += STALE_AFTER + 5
        for m in self.consumers:
            if m.alive:
                m.skew = self.skew
            elif not m.exited and m.jobs:
                self._give_back(m)

    # --- after every step -----------------------------------------------------------------
    @invariant()
    def status_agrees_with_itself(self) -> None:
        if not hasattr(self, "queued"):
            return
        for m in self._live():
            assert m.telemetry is not None
            self.loop.run_until_complete(m.telemetry.publish())
        r = run_status(self.conn, RUN, now=time.time() + self.skew)
        check(r, self.last, {m.name: m for m in self.consumers})
        # every answer was published before anything else happened to its consumer: all counted
        assert r["completion_tokens"] == self.generated, (r["completion_tokens"], self.generated)
        self.last = {"prompt_tokens": r["prompt_tokens"], "completion_tokens": r["completion_tokens"],
                     "gpu_hours": r["cost"]["gpu_hours_spent"]}


def check(r: Any, last: dict[str, Any], models: dict[str, Model]) -> None:
    """Status's identities at one moment (LAST: the figures of the step before)."""
    items = JOBS * PER_JOB
    where = [r[f"items_{k}"] for k in ("queued", "in_flight", "shipping", "done", "failed", "elsewhere")]
    assert r["items"] == items and sum(where) == items and min(where) >= 0, r
    live = [c for c in r["consumers"] if c["live"]]
    assert r["items_in_flight"] <= CAPACITY * len(live), r  # never more than the live can hold
    assert r["share"]["in_flight"] <= CONCURRENCY * len(live)
    assert (r["jobs"]["queued"] == 0) == (r["items_queued"] == 0), r
    # generated tokens never go down, and are never fewer than the acked jobs counted
    assert r["completion_tokens"] >= last.get("completion_tokens", 0) and r["prompt_tokens"] >= last.get(
        "prompt_tokens", 0), (r["completion_tokens"], last)
    assert r["completion_tokens"] >= r["acked_tokens"]["completion"]
    assert r["cost"]["gpu_hours_spent"] >= last.get("gpu_hours", 0.0), (r["cost"], last)
    # a rate is shown exactly when an ETA is (while items are left), each with the same reason
    remaining = items - r["items_done"] - r["items_failed"]
    rates = r["speed"]["last_minute"]
    assert all((v is None) == bool(r["speed"]["note"]) for v in rates.values()), r["speed"]
    if remaining:
        assert (r["eta_s"] is None) == bool(r["speed"]["note"]), (r["eta_s"], r["speed"])
    # spool figures are the live consumers' own
    spools = sum(len(models[c["worker"]].sealed) for c in live if models[c["worker"]].phase is None)
    assert r["shipping"]["waiting_shards"] <= spools, (r["shipping"], spools)
    waited = r["shipping"]["oldest_waiting_s"]
    assert waited is None or 0 <= waited < 60, r["shipping"]  # Redis time, not a node's clock
    # a live consumer still starting is seen, with its phase
    starting = {s["worker"] for s in r["starting"]} | {c["worker"] for c in live if c["phase"]}
    assert starting == {c for c in starting if models[c].phase}
    for name, m in models.items():
        if m.alive and m.phase and not m.telemetry.totals:  # type: ignore[union-attr]
            assert name in {s["worker"] for s in r["starting"]}, r["starting"]
    rows, _ = screen_rows(r)
    progress = dict(rows)["progress"]
    if "run complete" in progress:  # complete only when every item is done, none failed
        assert r["items_done"] == items and r["items_failed"] == 0, progress
    if remaining:
        assert ("ETA -" in progress) == bool(r["speed"]["note"]), progress
    format_status(r, color=False)


@pytest.mark.integration
def test_status_never_contradicts_itself(redis_url: str) -> None:
    StatusMachine.url = redis_url
    run_state_machine_as_test(StatusMachine, settings=settings(
        max_examples=60, stateful_step_count=40, deadline=None, derandomize=True,
        # no shrinking: the consumers' rates run on the wall clock, so a shrunk replay differs
        phases=(Phase.explicit, Phase.reuse, Phase.generate), suppress_health_check=[HealthCheck.too_slow]))
