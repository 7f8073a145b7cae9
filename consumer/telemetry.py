"""What a consumer tells the world: a snapshot in Redis for `producer status`, and its
Prometheus metrics (consumer/metrics.py) set from it.

Telemetry listens; it does not reach in. It hears the consumer's events (consumer/events.py):
each record written (`recorded`: counted on the hot path), the start-up's phase and the runs
served from the start. The rest comes from the snapshots the consumer's parts expose, handed
over as one `Parts` of callables and read at each publish. The snapshot, refreshed every few
seconds, is a contracts.ConsumerSnapshot with the engine doctor's verdict in it
(consumer/engine/doctor.py), written (and read back by `producer status`) through
common/keepers/snapshots.py, with this consumer's share of each run's spent totals.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from enum import StrEnum

import redis
from prometheus_client import Counter as PCounter

from genqueue.common import __version__, defaults
from genqueue.common.acceptance import answers_of
from genqueue.common.contracts import ErrorClass, Mode, Outcome
from genqueue.common.engineview import EngineBound
from genqueue.common.eta import RateWindow, Sample, format_duration
from genqueue.common.keepers.snapshots import Snapshots, Spent
from genqueue.common.records import ConsumerInfo, Record, ResultRecord, is_error
from genqueue.common.snapshot import ConsumerSnapshot, RunCounters
from genqueue.consumer.answer.client import Gate
from genqueue.consumer.answer.faults import RetryKind
from genqueue.consumer.engine.admission import AdmissionSnapshot
from genqueue.consumer.engine.doctor import Doctor
from genqueue.consumer.metrics import (
    COMPLETIONS,
    COPIES,
    ENGINE_BOUND,
    ERRORS,
    IN_FLIGHT,
    JOBS,
    LATENCY,
    LIMIT,
    LOOP_LAG,
    PACK_READS,
    PAUSED,
    PENDING,
    QUEUE_DEPTH,
    REFUSED,
    REFUSED_JOBS,
    RETRIES,
    SHIP_FAILURES,
    SHIPPED,
    SPOOL,
    STARTING,
    TOKENS,
    SpecCounts,
    serve_metrics,
    set_engine_gauges,
    set_run_gauges,
)
from genqueue.consumer.rqthread import RqSnapshot, RqThread
from genqueue.consumer.served import ServedRuns, ServedSnapshot
from genqueue.consumer.shipping.outbox import Outbox, OutboxSnapshot, RunShipping
from genqueue.consumer.work.acker import AckSnapshot
from genqueue.consumer.work.book import BookSnapshot, RunLoad
from genqueue.consumer.work.leases import LeaseSnapshot
from genqueue.consumer.work.packs import PackOutages

log = logging.getLogger(__name__)

#: Seconds between the wake-ups that measure the event loop's lag.
LOOP_LAG_EVERY = 0.05


class PauseReason(StrEnum):
    """Why a consumer is paused (its snapshot's `paused`, `genqueue_paused{reason}`; docs/metrics.md).
    A snapshot's keys are the plain values: orjson writes no str subclass as a key."""

    ENDPOINT_DOWN = "endpoint_down"
    SPOOL_FULL = "spool_full"
    SPOOL_DISK = "spool_disk"
    REDIS_UNREACHABLE = "redis_unreachable"
    REDIS_FULL = "redis_full"
    #: the output store cannot serve a run's packs now (consumer/work/packs.py's PackOutages)
    PACKS_UNREACHABLE = "packs_unreachable"


#: Every pause reason a consumer knows, so each has a series from the start.
PAUSE_REASONS = tuple(r.value for r in PauseReason)


class PauseReasons:
    """Why admission is paused now (the snapshot's `paused`), asked of the parts that pause it:
    the endpoint's gate, the spool, the rq thread, the pack reads and the served runs."""

    def __init__(self, endpoint: str, gate: Gate, outbox: Outbox, rq: RqThread, outages: PackOutages,
                 served: ServedRuns) -> None:
        self.endpoint, self.gate, self.outbox, self.rq, self.outages, self.served = (
            endpoint, gate, outbox, rq, outages, served)

    def __call__(self) -> dict[str, str]:
        reasons: dict[str, str] = {}  # keyed by the plain values: a snapshot is written by orjson
        if self.gate.paused:
            reasons[PauseReason.ENDPOINT_DOWN.value] = f"endpoint {self.endpoint} is down"
        outbox = self.outbox
        if outbox.disk_error is not None:
            reasons[PauseReason.SPOOL_DISK.value] = outbox.disk_error
        elif outbox.full():
            reasons[PauseReason.SPOOL_FULL.value] = f"{outbox.spool_bytes} unshipped bytes in the spool"
        rq = self.rq.snapshot()
        if rq.unreachable_since is not None:
            reasons[PauseReason.REDIS_UNREACHABLE.value] = "Redis is unreachable"
        if rq.full_since is not None:
            reasons[PauseReason.REDIS_FULL.value] = (
                "Redis is full (at its maxmemory): writes wait, jobs held, results in the spool; goes on once "
                "memory is freed")
        packs = self.outages.reason()
        if packs is not None:
            reasons[PauseReason.PACKS_UNREACHABLE.value] = packs
        for run, why in self.served.snapshot().refused.items():
            reasons[f"run {run}"] = why
        return reasons


#: Seconds between two progress lines in the consumer's log.
PROGRESS_EVERY = 60.0
#: Seconds between prunes of the consumers' set (reports gone silent): any live consumer's prune does for all.
PRUNE_EVERY = 60.0


class LoopLag:
    """How late this process's event loop runs: a task asks to wake every LOOP_LAG_EVERY seconds
    and keeps the most it overslept. A loop that wakes late is not scheduled (the host's cores
    are taken) or is blocked by a long step; either way what the consumer holds waits."""

    def __init__(self, every: float = LOOP_LAG_EVERY) -> None:
        self.every = every
        self._max = 0.0

    async def run(self) -> None:
        while True:
            t = time.monotonic()
            await asyncio.sleep(self.every)
            self._max = max(self._max, time.monotonic() - t - self.every)

    def take(self) -> float:
        """Seconds late at most since the last take."""
        most, self._max = self._max, 0.0
        return most


def progress_line(snap: ConsumerSnapshot) -> str:
    """One line: what this consumer did and does (the log's once-a-minute line)."""
    runs = snap["runs"].values()
    done = sum(r.get("completions", 0) for r in runs)
    errors = sum(r.get("errors", 0) for r in runs)
    per_s = sum(r.get("completions_per_s", 0.0) for r in runs)
    tok_s = sum(r.get("completion_tokens_per_s", 0.0) for r in runs)
    paused = ", ".join(f"{k}: {v}" for k, v in snap["paused"].items())
    flying, limit = snap["in_flight"], snap["concurrency"]
    of = f"of {limit}" if flying <= limit else f"(over its limit, lowered to {limit}: none sent until under it)"
    return (f"progress: {done} items ({errors} errors), {per_s:.1f}/s, {tok_s:,.0f} completion tok/s, "
            f"in flight {flying} {of}, {snap['held_jobs']} jobs held, "
            f"{snap['shipping']['waiting_shards']} shards waiting to ship" + (f"; PAUSED ({paused})" if paused else ""))


def spent_since(totals: dict[str, Counter[str]], spent: Mapping[str, Spent], snap: ConsumerSnapshot,
                dt: float, gpus: int) -> dict[str, Spent]:
    """Each run's totals of this consumer (what its field of the run's spent hash is to hold):
    the records and tokens of TOTALS, and the GPU-seconds of SPENT (the totals before) plus GPUS
    x DT for the runs whose work this consumer held (in flight, waiting, jobs held, or records
    written in DT), split by the completion tokens each generated in DT (evenly when none did).
    Time with no run's work held is no run's: an idle consumer spends no run's GPU-hours."""
    out: dict[str, Spent] = {}
    grew: dict[str, int] = {}  # the runs whose records or tokens grew in DT: the completion tokens it generated
    for run in totals.keys() | spent.keys():
        before = spent.get(run, Spent())
        t = totals.get(run)
        total = before if t is None else Spent(t["completions"], t["errors"], t["prompt_tokens"],
                                                t["completion_tokens"], before.gpu_seconds)
        out[run] = total
        if total != before:
            grew[run] = total.completion_tokens - before.completion_tokens
    busy = [run for run, r in snap["runs"].items()
            if r.get("in_flight") or r.get("pending_items") or r.get("held_jobs") or run in grew]
    if busy and dt > 0:
        generated = sum(grew.get(run, 0) for run in busy)
        for run in busy:
            share = grew.get(run, 0) / generated if generated else 1.0 / len(busy)
            held = out.get(run, Spent())
            out[run] = replace(held, gpu_seconds=held.gpu_seconds + gpus * dt * share)
    return out


@dataclass(frozen=True, slots=True)
class Parts:
    """The snapshot of each part of the consumer, as callables (read at publish time)."""

    book: Callable[[], BookSnapshot]
    acker: Callable[[], AckSnapshot]
    leases: Callable[[], LeaseSnapshot]
    served: Callable[[], ServedSnapshot]
    outbox: Callable[[], OutboxSnapshot]
    admission: Callable[[], AdmissionSnapshot]
    rq: Callable[[], RqSnapshot]
    paused: Callable[[], dict[str, str]]
    stopping: Callable[[], bool]
    retries: Callable[[], dict[RetryKind, int]]
    copies: Callable[[], dict[str, int]] = dict  # the end of a run's copies (consumer/copies.py)
    packs: Callable[[], dict[str, int]] = dict  # reading jobs by reference (PackReader.counts)
    backing_off: Callable[[], int] = int  # requests in flight sleeping before a retry (0 by default)


class Telemetry:
    """Counts what the consumer does and publishes it."""

    def __init__(self, identity: ConsumerInfo, conn: redis.Redis, rq: RqThread, parts: Parts, *,
                 interval: float = defaults.TELEMETRY_INTERVAL, metrics_port: int | None = None,
                 gpus: int = defaults.GPUS_PER_ENGINE) -> None:
        self.identity = identity
        self.gpus = gpus
        self.conn = conn
        self.rq = rq
        self.parts = parts
        self.interval = interval
        self.metrics_port = metrics_port
        self.totals: dict[str, Counter[str]] = {}
        self.windows: dict[str, RateWindow] = {}
        self.started_at = time.time()
        self._retries_seen: dict[RetryKind, int] = {}
        self._refused: set[str] = set()  # runs whose genqueue_run_refused series is 1
        self._run_series: set[str] = set()  # runs with series of the RUN_GAUGES
        # labels() looks a child up by its label values on every call: cached, off the hot path
        self._children: dict[tuple[str, str], tuple[PCounter, PCounter, PCounter]] = {}
        for reason in PAUSE_REASONS:
            PAUSED.labels(reason).set(0)
        for kind in RetryKind:  # a series at 0 from the start, so rate() and dashboards work
            RETRIES.labels(kind)
        self.doctor = Doctor(identity["endpoint"])
        self._depth: int | None = None  # jobs left in the served runs' queues, as last published
        self._cpu_at = (time.monotonic(), time.process_time())
        self.lag = LoopLag()
        # this consumer's totals of each run (its field of the run's spent hash, common/keepers/snapshots.py),
        # what Redis was last told of them, and when GPU time was last charged
        self._spent: dict[str, Spent] = {}
        self._told: dict[str, Spent] = {}
        self._charged_at: float | None = None
        self.spender = f"{identity['worker']}@{uuid.uuid4().hex[:8]}"  # its field: one a consumer process
        self._pruned_at = float("-inf")
        self._phase: str | None = None
        self._phase_at = time.monotonic()
        self.only_run: str | None = None
        self.spool: str | None = None  # its spool directory (the snapshot's `spool`)
        self.spec = SpecCounts()

    def start_run(self, run: str) -> None:
        """Give RUN's labelled counters a series at zero, so a rate() works from the start."""
        if run in self.totals:
            return
        self.totals[run] = Counter()
        for cls in ErrorClass:
            ERRORS.labels(run, cls.value)
        for outcome in Outcome:
            COMPLETIONS.labels(run, outcome.value)
        TOKENS.labels(run, "prompt")
        TOKENS.labels(run, "completion")
        REFUSED.labels(run).set(0)

    def record(self, run: str, rec: Record) -> None:
        """Count one written record (called on the hot path: cheap)."""
        t = self.totals.get(run)
        if t is None:
            self.start_run(run)
            t = self.totals[run]
        t["completions"] += 1
        if is_error(rec):
            t["errors"] += 1
            ERRORS.labels(run, rec["error"]["class"]).inc()
            return
        ok: ResultRecord = rec  # type: ignore[assignment]  # not an error record: a result
        usage = ok["usage"]
        pt, ct = usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0)
        t["prompt_tokens"] += pt
        t["completion_tokens"] += ct
        children = self._children.get((run, ok["outcome"]))
        if children is None:
            children = self._children[(run, ok["outcome"])] = (
                COMPLETIONS.labels(run, ok["outcome"]), TOKENS.labels(run, "prompt"), TOKENS.labels(run, "completion"))
        children[0].inc()
        children[1].inc(pt)
        children[2].inc(ct)
        if "spec" in ok or "turns" in ok:
            for answer in answers_of(ok):
                self.spec.add(run, answer)
        timings = ok.get("timings")
        if timings is not None:
            LATENCY.observe(timings["latency_s"])

    def start_metrics_server(self) -> None:
        serve_metrics(self.metrics_port)

    def set_phase(self, phase: str | None) -> None:
        """What the starting consumer waits on now (None: it serves); said in its snapshot and
        in the log, with how long it has waited there."""
        if phase != self._phase:
            self._phase, self._phase_at = phase, time.monotonic()
        STARTING.set(0 if phase is None else 1)

    async def starting(self) -> None:
        """Publish the snapshot every interval while the consumer starts (its work loop publishes
        from then on); a failed publish (Redis not there yet) is tried again at the next."""
        said = time.monotonic()
        while True:
            try:
                await self.publish()
            except Exception as e:  # noqa: BLE001 - start-up goes on; the next publish may pass
                log.debug("start-up snapshot not published (%s: %s)", type(e).__name__, e)
            if self._phase is not None and time.monotonic() - said >= PROGRESS_EVERY:
                said = time.monotonic()
                log.info("still starting: %s for %s", self._phase, format_duration(said - self._phase_at))
            await asyncio.sleep(self.interval)

    async def loop(self) -> None:
        last_line = time.monotonic()
        while True:
            snap = await self.publish()
            if time.monotonic() - last_line >= PROGRESS_EVERY:
                last_line = time.monotonic()
                log.info("%s", progress_line(snap))
            await asyncio.sleep(self.interval)

    async def publish(self, *, exited: bool = False) -> ConsumerSnapshot:
        # last_seen is judged by `producer status` elsewhere: in Redis time, like the leases
        now = time.time() + (self.parts.leases().clock_offset or 0.0)
        for run, t in self.totals.items():
            w = self.windows.get(run)
            if w is None:
                w = self.windows[run] = RateWindow(60.0)
            w.add(Sample(now, t["completions"], t["prompt_tokens"], t["completion_tokens"]))
        snap = self.snapshot(now, exited=exited)
        # The engine doctor: what binds the engine now, from its samples and our own view.
        wall, cpu = time.monotonic(), time.process_time()
        cores = (cpu - self._cpu_at[1]) / max(wall - self._cpu_at[0], 1e-3)
        self._cpu_at = (wall, cpu)
        lag = self.lag.take()
        LOOP_LAG.set(lag)
        related = any(ctx.settings.multi_turn == Mode.EACH for ctx in self.parts.served().runs.values())
        capturing = any(ctx.settings.capture is not None for ctx in self.parts.served().runs.values())
        snap["engine"] = self.doctor.check(now, snap, related_prompts=related, queue_depth=self._depth, cpu=cores,
                                           backing_off=self.parts.backing_off(), loop_lag=lag, capturing=capturing)
        if spec_notes := self.spec.notes():  # the drafter's weakest category, beside the doctor's notes
            snap["engine"] = {**snap["engine"], "notes": [*snap["engine"].get("notes", []), *spec_notes]}
        for bound in EngineBound:
            ENGINE_BOUND.labels(bound.value).set(1 if snap["engine"].get("verdict") == bound else 0)
        IN_FLIGHT.set(snap["in_flight"])
        PENDING.set(snap["pending_items"])
        for reason in PAUSE_REASONS:
            PAUSED.labels(reason).set(1 if reason in snap["paused"] else 0)
        refused = {k[4:] for k in snap["paused"] if k.startswith("run ")}
        for run in refused | self._refused:
            REFUSED.labels(run).set(1 if run in refused else 0)
        self._refused = refused
        SPOOL.set(snap["shipping"]["spool_bytes"])
        SHIPPED.set(snap["shipping"]["shards"])
        SHIP_FAILURES.set(snap["shipping"]["failures"])
        LIMIT.set(snap["concurrency"])
        for ending, n in snap["jobs"].items():
            JOBS.labels(ending).set(n)
        for kind, n in snap["copies"].items():
            COPIES.labels(kind).set(n)
        for kind, n in self.parts.packs().items():
            PACK_READS.labels(kind).set(n)
        self._run_series = set_run_gauges(snap["runs"], self._run_series)
        set_engine_gauges(snap["engine"])
        for kind, n in self.parts.retries().items():
            RETRIES.labels(kind).inc(n - self._retries_seen.get(kind, 0))
            self._retries_seen[kind] = n
        self._spent = spent_since(self.totals, self._spent, snap, now - (self._charged_at or now), self.gpus)
        self._charged_at = now
        # the totals that changed since Redis was last told (totals, not additions: telling again is harmless),
        # and the served runs' queue lengths; the day-old reports of other consumers are dropped once every
        # PRUNE_EVERY seconds, not at each publish
        tell = {run: s for run, s in self._spent.items() if self._told.get(run) != s}
        prune = time.monotonic() - self._pruned_at >= PRUNE_EVERY
        lengths = await self.rq.call(Snapshots(self.conn).publish, snap, now, tell, spender=self.spender, prune=prune)
        if prune:
            self._pruned_at = time.monotonic()
        self._told.update(tell)
        self._depth = sum(q.waiting for q in lengths.values())
        for run, q in lengths.items():
            QUEUE_DEPTH.labels(run).set(q.waiting)
            REFUSED_JOBS.labels(run).set(q.refused)
        return snap

    def snapshot(self, now: float | None = None, *, exited: bool = False) -> ConsumerSnapshot:
        now = time.time() if now is None else now
        p = self.parts
        served, book, adm, ob = p.served(), p.book(), p.admission(), p.outbox()
        acks, leases = p.acker(), p.leases()
        runs: dict[str, RunCounters] = {}
        for run, t in self.totals.items():
            ctx = served.runs.get(run)
            rates = self.windows[run].rates() if run in self.windows else {}
            runs[run] = {"completions": t["completions"], "errors": t["errors"],
                         "prompt_tokens": t["prompt_tokens"], "completion_tokens": t["completion_tokens"],
                         **rates,  # type: ignore[typeddict-item]  # the three *_per_s rates
                         "fingerprint": ctx.fingerprint if ctx else None,
                         "reasoning_probe": ctx.reasoning_probe if ctx else None}
        for run, ctx in served.runs.items():
            runs.setdefault(run, {"fingerprint": ctx.fingerprint, "reasoning_probe": ctx.reasoning_probe})
        for run, r in runs.items():
            if (spec := self.spec.totals(run)) is not None:
                r["spec"] = spec
            load = book.runs.get(run) or RunLoad()
            ship = ob.runs.get(run) or RunShipping()
            r["in_flight"], r["pending_items"], r["held_jobs"] = load.in_flight, load.pending_items, load.held_jobs
            r["shipping"] = {"shards": ship.shards, "bytes": ship.bytes, "waiting_shards": ship.waiting_shards,
                             "unshipped_records": ship.unshipped_records,
                             "last_upload_at": ship.last_upload_at, "oldest_waiting_at": ship.oldest_waiting_at}
        snap: ConsumerSnapshot = {
            "worker": self.identity["worker"],
            "host": self.identity["host"],
            "gpu": self.identity["gpu"],
            "gpus": self.gpus,
            "pid": os.getpid(),
            "endpoint": self.identity["endpoint"],
            "version": __version__,
            "started_at": self.started_at,
            "last_seen": now,
            "exited": exited,
            "concurrency": adm.limit,
            "concurrency_mode": adm.mode,
            "in_flight": book.in_flight,
            "pending_items": book.pending_items,
            "held_jobs": book.held_jobs,
            "stopping": p.stopping(),
            "paused": p.paused(),
            "runs": runs,
            "models": served.models,
            "max_model_len": served.max_model_len,
            "engine": adm.engine,
            "shipping": {
                "shards": ob.shards, "bytes": ob.bytes, "waiting_shards": ob.waiting_shards,
                "spool_bytes": ob.spool_bytes, "last_upload_at": ob.last_upload_at,
                "last_error": ob.last_error, "last_error_at": ob.last_error_at,
                "oldest_waiting_at": ob.oldest_waiting_at, "failures": ob.failures, "lost": ob.lost,
                "disk_error": ob.disk_error,
            },
            "jobs": {"acked": acks.acked, "lease_lost": acks.lease_lost, "redone": acks.redone,
                     "refused": acks.refused, "given_back": acks.given_back, "swept": leases.swept,
                     "leases_lost": leases.lost},
            "copies": p.copies(),
            "redis_unreachable_since": p.rq().unreachable_since,
            "clock_offset": leases.clock_offset,
            "phase": self._phase,
            "phase_s": round(time.monotonic() - self._phase_at, 1),
            "only_run": self.only_run,
            "spool": self.spool,
        }
        if (spec := self.spec.totals()) is not None:
            snap["spec"] = spec
        return snap
