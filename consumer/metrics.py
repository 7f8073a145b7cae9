"""The consumer's Prometheus metrics: each series it exports, how a snapshot sets them, and the
port they are served on.

Telemetry (consumer/telemetry.py) sets the gauges from each snapshot it publishes and counts
records into the counters; docs/metrics.md lists every name. A series that has no reading (the
engine gave none) is absent, not 0 (ReadingGauge).
"""

from __future__ import annotations

import errno
import logging
from collections.abc import Callable, Iterator, Mapping

from prometheus_client import REGISTRY, CollectorRegistry, Gauge, Histogram, start_http_server
from prometheus_client import Counter as PCounter
from prometheus_client.core import GaugeMetricFamily, Metric

from genqueue.common import defaults
from genqueue.common.acceptance import AcceptanceTable, Answer, Facet, Tally, weakest_line
from genqueue.common.engineview import ENGINE_READINGS
from genqueue.common.errors import UserError
from genqueue.common.snapshot import RunCounters, SpecTotals

log = logging.getLogger(__name__)

#: Categories of one facet with their own acceptance series per run: every label value is a series Prometheus keeps.
SPEC_METRIC_CATEGORIES = 50


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
COPIES = Gauge("genqueue_copies", "End-of-run copies since start (consumer/copies.py)", ["kind"])
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
#: The category of the categories of one facet past SPEC_METRIC_CATEGORIES.
OTHER_CATEGORY = "other"


#: Listeners of the consumer's events that raised (consumer/events.py), by event: each is logged too.
OBSERVER_FAILURES = PCounter("genqueue_observer_failures", "Listeners of a consumer event that raised (logged; the "
                             "consumer and the other listeners go on)", ["event"])


class SpecCounts:
    """This consumer's acceptance: a table per run of what it wrote (its snapshot's `spec`, the
    doctor's note on the weakest category) and the genqueue_spec_* counters, with at most
    CAP categories of a facet per run (the rest count as "other")."""

    def __init__(self, cap: int = SPEC_METRIC_CATEGORIES) -> None:
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
