"""What a consumer tells the world: a snapshot in Redis for `producer status`, and
Prometheus metrics on a port.

Telemetry listens; it does not reach in. Items are counted as their records are written
(`record`), and the rest comes from the snapshots the consumer's parts expose, handed over
as one `Parts` of callables. The snapshot, refreshed every few seconds, is a
contracts.ConsumerSnapshot, written (and read back by `producer status`) through
common/keepers/snapshots.py.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, replace
from enum import StrEnum

import redis
from prometheus_client import REGISTRY, CollectorRegistry, Gauge, Histogram, start_http_server
from prometheus_client import Counter as PCounter
from prometheus_client.core import GaugeMetricFamily, Metric

from genqueue.common import __version__, defaults
from genqueue.common.acceptance import AcceptanceTable, Answer, Facet, Tally, answers_of, weakest_line
from genqueue.common.contracts import ErrorClass, Mode, Outcome
from genqueue.common.engineview import ENGINE_READINGS, EngineBound
from genqueue.common.errors import UserError
from genqueue.common.eta import RateWindow, Sample, format_duration
from genqueue.common.keepers.snapshots import Snapshots, Spent
from genqueue.common.records import ConsumerInfo, Record, ResultRecord, is_error
from genqueue.common.snapshot import ConsumerSnapshot, RunCounters, SpecTotals
from genqueue.consumer.answer.faults import RetryKind
from genqueue.consumer.engine.admission import AdmissionSnapshot
from genqueue.consumer.engine.doctor import Doctor
from genqueue.consumer.rqthread import RqSnapshot, RqThread
from genqueue.consumer.served import ServedSnapshot
from genqueue.consumer.shipping.outbox import OutboxSnapshot, RunShipping
from genqueue.consumer.work.acker import AckSnapshot
from genqueue.consumer.work.book import BookSnapshot, RunLoad
from genqueue.consumer.work.leases import LeaseSnapshot

log = logging.getLogger(__name__)


class ReadingGauge:
    """A gauge with no sample until there is a reading: `set(None)` (the engine gave none)
    takes its series off the page, so PromQL sees an absent series, not a made-up 0."""

    def __init__(self, name: str, documentation: str, registry: CollectorRegistry = REGISTRY) -> None:
        self.name = name
        self.documentation = documentation
        self._value: float | None = None
        registry.register(self)

    def set(self, value: float | None) -> None:
        self._value = None if value is None else float(value)

    def describe(self) -> list[Metric]:
        return [GaugeMetricFamily(self.name, self.documentation)]

    def collect(self) -> Iterator[Metric]:
        value = self._value
        if value is not None:
            yield GaugeMetricFamily(self.name, self.documentation, value=value)


IN_FLIGHT = Gauge("genqueue_in_flight", "Requests in flight to the endpoint")
LOOP_LAG = Gauge("genqueue_event_loop_lag_seconds",
                 "How late the consumer's event loop woke at most since the last publish (CPU starvation)")
PENDING = Gauge("genqueue_pending_items", "Items dequeued and waiting for a slot")
PAUSED = Gauge("genqueue_paused", "1 while admission is paused", ["reason"])
REFUSED = Gauge("genqueue_run_refused", "1 while this consumer does not serve a run: paused, failed pre-flight, "
                "gone from Redis, or its local output is another host's", ["run"])
COMPLETIONS = PCounter("genqueue_completions", "Items answered", ["run", "outcome"])
TOKENS = PCounter("genqueue_tokens", "Tokens", ["run", "kind"])
ERRORS = PCounter("genqueue_errors", "Error records by class", ["run", "error_class"])
LATENCY = Histogram("genqueue_item_latency_seconds", "Wall time per item (all its turns and retries)",
                    buckets=(0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600, 1800, float("inf")))
SPOOL = Gauge("genqueue_spool_bytes", "Unshipped result bytes on local disk")
SHIPPED = Gauge("genqueue_shards_shipped", "Shards shipped to the output since start")
SHIP_FAILURES = Gauge("genqueue_ship_failures", "Failed shard uploads since start (each is retried)")
LIMIT = Gauge("genqueue_concurrency_limit", "In-flight limit now (with --concurrency auto: the steered target)")
JOBS = Gauge("genqueue_jobs", "Job endings since start", ["ending"])
COPIES = Gauge("genqueue_copies", "End-of-run copies since start (consumer/hedge.py)", ["kind"])
PACK_READS = Gauge("genqueue_pack_reads", "Reading jobs by reference since start (common/storage/packreader.py): "
                   "GETs, bytes fetched, disk cache hits and misses", ["kind"])
#: The engine's readings the consumer exports, one gauge each (common.contracts.ENGINE_READINGS):
#: those that read 0 without a reading, and those with no sample then
ENGINE_GAUGES: dict[str, Gauge] = {r.key: Gauge(r.exported.name, r.exported.help) for r in ENGINE_READINGS
                                   if r.exported is not None and not r.exported.absent_without_reading}
ENGINE_READING_GAUGES: dict[str, ReadingGauge] = {
    r.key: ReadingGauge(r.exported.name, r.exported.help) for r in ENGINE_READINGS
    if r.exported is not None and r.exported.absent_without_reading}
ENGINE_BOUND = Gauge("genqueue_engine_bound", "1 for what binds the engine now (the engine doctor's verdict), "
                     "0 for the others", ["reason"])
RETRIES = PCounter("genqueue_request_retries", "Failed request attempts (each retried or, last, recorded)",
                   ["kind"])
QUEUE_DEPTH = Gauge("genqueue_queue_depth", "Jobs waiting in a served run's rq queue", ["run"])
REFUSED_JOBS = Gauge("genqueue_refused_jobs", "Jobs of a served run that consumers refused (genqueue:refused:<queue>; "
                     "`producer status` names them)", ["run"])
# Each run's share of this consumer's load and shipping (its snapshot's `runs`, what `producer
# status` shows under the run); a run's items done, errors and tokens are the counters above.
RUN_IN_FLIGHT = Gauge("genqueue_run_in_flight", "A run's requests in flight to the endpoint", ["run"])
RUN_PENDING = Gauge("genqueue_run_pending_items", "A run's items dequeued and waiting for a slot", ["run"])
RUN_HELD = Gauge("genqueue_run_held_jobs", "A run's jobs this consumer holds", ["run"])
RUN_UNSHIPPED = Gauge("genqueue_run_unshipped_records", "A run's records written to the spool, not shipped yet",
                      ["run"])
RUN_WAITING = Gauge("genqueue_run_shards_waiting", "A run's sealed shards waiting on local disk to ship", ["run"])
RUN_SHIPPED = Gauge("genqueue_run_shards_shipped", "A run's shards shipped since start", ["run"])
RUN_SHIPPED_BYTES = Gauge("genqueue_run_shipped_bytes", "A run's bytes shipped since start", ["run"])
#: The per-run gauges, each with its figure of a run's counters in the snapshot.
RUN_GAUGES: tuple[tuple[Gauge, Callable[[RunCounters], int]], ...] = (
    (RUN_IN_FLIGHT, lambda r: r.get("in_flight", 0)),
    (RUN_PENDING, lambda r: r.get("pending_items", 0)),
    (RUN_HELD, lambda r: r.get("held_jobs", 0)),
    (RUN_UNSHIPPED, lambda r: r["shipping"]["unshipped_records"] if "shipping" in r else 0),
    (RUN_WAITING, lambda r: r["shipping"]["waiting_shards"] if "shipping" in r else 0),
    (RUN_SHIPPED, lambda r: r["shipping"]["shards"] if "shipping" in r else 0),
    (RUN_SHIPPED_BYTES, lambda r: r["shipping"]["bytes"] if "shipping" in r else 0),
)

# Speculative-decoding acceptance of the answers this consumer wrote, by run and category of each
# facet (common/acceptance.py): rate = accepted / drafted, mean length = 1 + accepted / steps.
SPEC_LABELS = ["run", "facet", "category"]
SPEC_ANSWERS = PCounter("genqueue_spec_answers", "Answers with speculative-decoding figures", SPEC_LABELS)
SPEC_STEPS = PCounter("genqueue_spec_steps", "Speculative-decoding verify steps of the answers", SPEC_LABELS)
SPEC_DRAFTED = PCounter("genqueue_spec_drafted_tokens", "Draft tokens proposed for the answers", SPEC_LABELS)
SPEC_ACCEPTED = PCounter("genqueue_spec_accepted_tokens", "Draft tokens accepted in the answers", SPEC_LABELS)
#: The category of the categories of one facet past defaults.SPEC_METRIC_CATEGORIES.
OTHER_CATEGORY = "other"


class SpecCounts:
    """This consumer's acceptance: a table per run of what it wrote (its snapshot's `spec`, the
    doctor's note on the weakest category) and the genqueue_spec_* counters, with at most
    CAP categories of a facet per run (the rest count as "other")."""

    def __init__(self, cap: int = defaults.SPEC_METRIC_CATEGORIES) -> None:
        self.cap = cap
        self.tables: dict[str, AcceptanceTable] = {}
        self._labels: dict[tuple[str, Facet], set[str]] = {}
        self._children: dict[tuple[str, Facet, str], tuple[PCounter, PCounter, PCounter, PCounter]] = {}

    def add(self, run: str, answer: Answer) -> None:
        self.tables.setdefault(run, AcceptanceTable()).add(answer)
        spec = answer.spec
        for facet in Facet:
            label = answer.label(facet)
            seen = self._labels.setdefault((run, facet), set())
            if label not in seen:
                if len(seen) >= self.cap:
                    label = OTHER_CATEGORY
                else:
                    seen.add(label)
            c = self._children.get((run, facet, label))
            if c is None:
                c = (SPEC_ANSWERS.labels(run, facet.value, label), SPEC_STEPS.labels(run, facet.value, label),
                     SPEC_DRAFTED.labels(run, facet.value, label), SPEC_ACCEPTED.labels(run, facet.value, label))
                self._children[(run, facet, label)] = c
            c[0].inc()
            c[1].inc(spec["steps"])
            c[2].inc(spec["drafted"])
            c[3].inc(spec["accepted"])

    def totals(self, run: str | None = None) -> SpecTotals | None:
        """RUN's figures (None: every run's), None when it has none."""
        t = Tally()
        for name, table in self.tables.items():
            if run is None or name == run:
                t.merge(table.overall)
        return None if not t.answers else {"answers": t.answers, "steps": t.steps, "drafted": t.drafted,
                                           "accepted": t.accepted}

    def notes(self) -> list[str]:
        """The drafter's weakest category of each run, in words (the run named when there are several)."""
        out = []
        for run, table in sorted(self.tables.items()):
            line = weakest_line(table)
            if line is not None:
                out.append(line if len(self.tables) == 1 else f"{line} (run {run})")
        return out


STARTING = Gauge("genqueue_starting", "1 while the consumer starts (waiting on Redis or the engine, its pre-flight, "
                 "leftover shards): it takes no job yet")
#: The ports metrics are served on in this process (start_http_server once per port).
_SERVING: set[int] = set()


def serve_metrics(port: int | None, host: str = defaults.METRICS_HOST) -> None:
    """Serve the Prometheus metrics on HOST:PORT (port None: not at all), once per process: from
    the consumer's first line on, so a consumer stuck in its start-up is seen there too. A port
    that cannot be listened on (taken, or HOST not this machine's) is a UserError, in one line."""
    if port is None or port in _SERVING:
        return
    try:
        start_http_server(port, addr=host)
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            why = "the port is taken by another process (another consumer?); give another --metrics-port"
        elif e.errno == errno.EADDRNOTAVAIL:
            why = f"{host} is not an address of this host; give another --metrics-host"
        else:
            why = e.strerror or str(e)
        raise UserError(f"metrics: cannot listen on {host}:{port}: {why}") from None
    _SERVING.add(port)
    STARTING.set(1)
    log.info("Prometheus metrics on %s:%d/metrics", host, port)


class PauseReason(StrEnum):
    """Why a consumer is paused (its snapshot's `paused`, `genqueue_paused{reason}`; docs/metrics.md).
    A snapshot's keys are the plain values: orjson writes no str subclass as a key."""

    ENDPOINT_DOWN = "endpoint_down"
    SPOOL_FULL = "spool_full"
    SPOOL_DISK = "spool_disk"
    REDIS_UNREACHABLE = "redis_unreachable"
    REDIS_FULL = "redis_full"
    #: the output store cannot serve a run's packs now (consumer/work/intake.py's PackOutages)
    PACKS_UNREACHABLE = "packs_unreachable"


#: Every pause reason a consumer knows, so each has a series from the start.
PAUSE_REASONS = tuple(r.value for r in PauseReason)


PROGRESS_EVERY = defaults.TELEMETRY_PROGRESS_EVERY
PRUNE_EVERY = defaults.TELEMETRY_PRUNE_EVERY


class LoopLag:
    """How late this process's event loop runs: a task asks to wake every LOOP_LAG_EVERY seconds
    and keeps the most it overslept. A loop that wakes late is not scheduled (the host's cores
    are taken) or is blocked by a long step; either way what the consumer holds waits."""

    def __init__(self, every: float = defaults.LOOP_LAG_EVERY) -> None:
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


def set_run_gauges(runs: dict[str, RunCounters], before: set[str]) -> set[str]:
    """Set the RUN_GAUGES of each of RUNS (a snapshot's `runs`); the runs of BEFORE (the runs
    set last time) no longer in RUNS lose their series. Returns the runs with series now."""
    for run, r in runs.items():
        for gauge, figure in RUN_GAUGES:
            gauge.labels(run).set(figure(r))
    for run in before - runs.keys():
        for gauge, _ in RUN_GAUGES:
            gauge.remove(run)
    return set(runs)


def set_engine_gauges(engine: Mapping[str, object]) -> None:
    """The engine's own figures (a snapshot's `engine`). A reading exported absent without a
    reading (KV cache usage) has no sample while the engine gave none (no /metrics, or no KV gauge
    on it): 0 would read as an idle cache; the others read 0 then."""
    for key, gauge in ENGINE_GAUGES.items():
        gauge.set(_number(engine.get(key)) or 0)
    for key, reading in ENGINE_READING_GAUGES.items():
        reading.set(_number(engine.get(key)))


def _number(v: object) -> float | None:
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None


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
    copies: Callable[[], dict[str, int]] = dict  # the end of a run's copies (consumer/hedge.py)
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
