"""The consumer: one asyncio loop per GPU that keeps its endpoint's queue full.

Admission counts prompts, not jobs: `concurrency` items are in flight at all times, and a
finished item's slot is refilled at once from whatever job has work left, so a job waiting
on one slow prompt holds nothing back. A job is acked in rq only when every one of its
results sits in a shipped shard. rq calls run in one dedicated thread (consumer.rqcompat).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import signal
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, TypeVar

import redis

from genqueue.common import defaults
from genqueue.common.backoff import compute_backoff
from genqueue.common.errors import UserError
from genqueue.common.jobs import job_items, queue_for
from genqueue.common.runs import RunStore
from genqueue.consumer.admission import Limiter, next_limit
from genqueue.consumer.checkpoints import Checkpoints
from genqueue.consumer.client import EndpointClient
from genqueue.consumer.engine import engine_view
from genqueue.consumer.generate import Gate, Generator, RunContext
from genqueue.consumer.rqcompat import GenWorker, Held
from genqueue.consumer.outbox import Outbox
from genqueue.consumer.shards import Sink, SpoolBusyError, lock_spool
from genqueue.consumer.sinks import make_sink
from genqueue.consumer.acks import AckMixin
from genqueue.consumer.startup import StartupMixin
from genqueue.consumer.telemetry import Telemetry

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass
class ConsumerConfig:
    """How one consumer runs. The recipe (model, sampling, mode, output) is the run's, not here."""

    endpoint: str
    redis_url: str
    run: str | None = None
    concurrency: int = defaults.CONCURRENCY
    auto_concurrency: bool = False
    max_concurrency: int = defaults.MAX_CONCURRENCY
    burst: bool = False
    spool: str = "./genqueue-spool"
    lease: int = defaults.LEASE_SECONDS
    gpu: int | None = None
    drain_timeout: float = defaults.DRAIN_TIMEOUT
    request_timeout: float = 1800.0
    max_attempts: int = 6
    shard_max_bytes: int = defaults.SHARD_MAX_BYTES
    shard_max_age: float = defaults.SHARD_MAX_AGE
    poll_interval: float = 0.2
    name: str | None = None
    spool_limit: int = defaults.SPOOL_LIMIT
    metrics_port: int | None = None
    endpoint_wait: float = 1800.0
    telemetry_interval: float = 2.0


@dataclass
class JobState:
    held: Held
    ctx: RunContext
    items: list[dict[str, Any]]
    remaining: int
    attempt: int
    enqueued_at: float | None
    started: float = field(default_factory=time.monotonic)
    max_seq: int = 0
    counts: collections.Counter[str] = field(default_factory=collections.Counter)
    abandoned: bool = False

    @property
    def complete(self) -> bool:
        return self.remaining == 0


class Consumer(StartupMixin, AckMixin):
    """Pulls jobs of the runs it serves and turns them into shipped result shards."""

    def __init__(self, cfg: ConsumerConfig, conn: redis.Redis, *, sink_for: Callable[[str], Sink] | None = None):
        self.cfg = cfg
        self.conn = conn
        self.store = RunStore(conn)
        self.worker = GenWorker([queue_for(cfg.run or "_idle", conn)], conn, lease=cfg.lease, name=cfg.name)
        self._rq_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rq")
        self.outbox = Outbox(cfg.spool, self.worker.name, max_bytes=cfg.shard_max_bytes, max_age=cfg.shard_max_age,
                             spool_limit=cfg.spool_limit, sink_for=sink_for or make_sink,
                             output_of=self._output_of, on_shipped=self._ack_shipped, on_lost=self._redo_lost)
        self.jobs: dict[str, JobState] = {}
        self.pending: collections.deque[tuple[JobState, dict[str, Any]]] = collections.deque()
        self.contexts: dict[str, RunContext] = {}
        self.served_models: list[str] = []
        self.model_lens: dict[str, int | None] = {}
        self.checkpoints: Checkpoints | None = None
        self.in_flight = 0
        self.stopping = False
        self.hard_stop = False
        self.stats: collections.Counter[str] = collections.Counter()
        self._wake = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()
        self._sem: Limiter | None = None
        self._client: EndpointClient | None = None
        self._gate: Gate | None = None
        self._gen: Generator | None = None
        self._queues_served: list[str] = []
        self.host = socket.gethostname()
        self.telemetry = Telemetry(self, interval=cfg.telemetry_interval, metrics_port=cfg.metrics_port)

    @property
    def client(self) -> EndpointClient | None:
        return self._client

    @property
    def limit(self) -> int:
        return self._sem.limit if self._sem is not None else self.cfg.concurrency

    @property
    def gate_paused(self) -> bool:
        return self._gate is not None and self._gate.paused

    async def rq_call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run a synchronous Redis call in the rq thread (for telemetry and other helpers)."""
        return await self._rq(fn, *args)

    # --- plumbing ------------------------------------------------------------------
    async def _rq(self, fn: Callable[..., T], *args: Any) -> T:
        """Run a synchronous rq/Redis call in the rq thread; retry while Redis is unreachable."""
        loop = asyncio.get_running_loop()
        attempt = 0
        while True:
            try:
                return await loop.run_in_executor(self._rq_pool, fn, *args)
            except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as e:
                if self.hard_stop:
                    raise
                delay = compute_backoff(min(attempt, 5), base=0.5, cap=5.0)
                log.warning("Redis unreachable (%s); retrying in %.1f s", type(e).__name__, delay)
                attempt += 1
                await asyncio.sleep(delay)

    def _consumer_info(self) -> dict[str, Any]:
        return {"host": self.host, "gpu": self.cfg.gpu, "worker": self.worker.name,
                "endpoint": self.cfg.endpoint}

    # --- main ----------------------------------------------------------------------
    async def run(self) -> int:
        """Serve until stopped (or, with burst, until the served runs are drained). Exit code."""
        start = min(defaults.AUTO_START, self.cfg.max_concurrency) if self.cfg.auto_concurrency else self.cfg.concurrency
        self._sem = Limiter(start)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                loop.add_signal_handler(sig, self._on_signal, sig)
            except (NotImplementedError, RuntimeError):  # not the main thread (tests)
                pass
        async with EndpointClient(self.cfg.endpoint, request_timeout=self.cfg.request_timeout) as client:
            self._client = client
            self._gate = Gate(client)
            self.checkpoints = Checkpoints(self.cfg.redis_url)
            self._gen = Generator(client, self._gate, max_attempts=self.cfg.max_attempts,
                                  checkpoints=self.checkpoints)
            try:
                self._spool_lock = lock_spool(self.cfg.spool)
            except SpoolBusyError as e:
                raise UserError(str(e)) from None
            await self._probe_models(client)
            await self._resolve_runs()
            await self._rq(self.worker.start)
            self.telemetry.start_metrics_server()
            log.info("consumer %s started: endpoint %s, concurrency %s, runs %s", self.worker.name,
                     self.cfg.endpoint, "auto" if self.cfg.auto_concurrency else self.cfg.concurrency,
                     self.cfg.run or "(all open)")
            await self._ship_leftovers()
            t0 = time.monotonic()
            loops = [
                asyncio.create_task(self._fetcher(), name="fetcher"),
                asyncio.create_task(self._dispatcher(), name="dispatcher"),
                asyncio.create_task(self._renewer(), name="renewer"),
                asyncio.create_task(self._sealer(), name="sealer"),
                asyncio.create_task(self.outbox.shipper(), name="shipper"),
                asyncio.create_task(self.telemetry.loop(), name="telemetry"),
                asyncio.create_task(self._steer(), name="steer"),
                asyncio.create_task(self._sweeper(), name="sweeper"),
            ]
            try:
                await loops[0]  # the fetcher returns when it is time to stop
                await self._drain()
            finally:
                for t in loops[1:]:
                    t.cancel()
                await asyncio.gather(*loops[1:], return_exceptions=True)
                await self.telemetry.publish(exited=True)
                await self._rq(self.worker.stop)
            elapsed = time.monotonic() - t0
            log.warning(
                "consumer %s stopped after %.1f s: %d items (%d errors), %d jobs acked, %d given back, "
                "%.1f items/s", self.worker.name, elapsed, self.stats["items"], self.stats["item_errors"],
                self.stats["jobs_acked"], self.stats["jobs_given_back"],
                self.stats["items"] / elapsed if elapsed > 0 else 0.0)
        self._rq_pool.shutdown(wait=True)
        self.outbox.close()
        if self.checkpoints is not None:
            await self.checkpoints.close()
        return 0

    def _on_signal(self, sig: int) -> None:
        if self.stopping:
            log.warning("second signal: stopping now")
            self.hard_stop = True
            self.outbox.stopping_hard = True
        else:
            log.warning("signal %s: draining (in flight finishes, the rest goes back to the queue)",
                        signal.Signals(sig).name)
            self.stopping = True
        self._wake.set()

    def request_stop(self) -> None:
        """Begin a graceful drain, as SIGTERM does."""
        self._on_signal(signal.SIGTERM)

    # --- fetching ------------------------------------------------------------------
    def _low_water(self) -> int:
        limit = self._sem.limit if self._sem is not None else self.cfg.concurrency
        return max(limit // 2, 8)

    async def _fetcher(self) -> None:
        last_resolve = 0.0
        runs: list[str] = []
        while not self.stopping:
            if time.monotonic() - last_resolve > 5.0 or not runs:
                runs = await self._resolve_runs()
                self._serve(runs)
                last_resolve = time.monotonic()
            if len(self.pending) < self._low_water() and self._gate is not None and not self._gate.paused:
                got = await self._fetch_one(runs)
                if got:
                    continue
                if self.cfg.burst and await self._drained(runs):
                    log.info("burst: served runs drained; stopping")
                    return
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), timeout=self.cfg.poll_interval)
            except asyncio.TimeoutError:
                pass

    def _serve(self, runs: list[str]) -> None:
        names = [queue_for(r, self.conn).name for r in runs]
        if names != self._queues_served:
            self._queues_served = names
            self.worker.set_queues([queue_for(r, self.conn) for r in runs] or [queue_for("_idle", self.conn)])

    async def _fetch_one(self, runs: list[str]) -> bool:
        for run in runs:
            held, refused = await self._rq(self.worker.dequeue, queue_for(run, self.conn))
            if refused:
                log.warning("%s", refused)
                self.stats["jobs_refused"] += 1
                return True
            if held is None:
                continue
            try:
                items = job_items(held.job.args)
            except ValueError as e:
                await self._rq(self.worker.fail, held, f"refused: {e}", False)
                return True
            ctx = self.contexts[run]
            retries_left = held.job.retries_left
            attempt = 1 + (defaults.JOB_RETRIES - retries_left if retries_left is not None else 0)
            enq = held.job.enqueued_at.timestamp() if held.job.enqueued_at else None
            js = JobState(held, ctx, items, len(items), attempt, enq)
            self.jobs[held.id] = js
            if not items:
                continue
            self.pending.extend((js, it) for it in items)
            self._wake.set()
            return True
        return False

    async def _drained(self, runs: list[str]) -> bool:
        if self.pending or self.in_flight or self.jobs:
            return False

        def check() -> bool:
            # Raw ZCARD/LLEN: rq's registry.count would also sweep, outside the maintenance lock.
            for run in runs:
                q = queue_for(run, self.conn)
                if self.conn.zcard(q.started_job_registry.key) or self.conn.llen(q.key):
                    return False
            return True

        return await self._rq(check)

    # --- dispatching ---------------------------------------------------------------
    async def _dispatcher(self) -> None:
        assert self._sem is not None and self._gate is not None
        while True:
            if not self.pending or self.stopping:
                self._wake.clear()
                await self._wake.wait()
                continue
            await self._sem.acquire()
            await self._gate.up.wait()
            if self.outbox.full():
                await self._wait_for_spool()
            if not self.pending or self.stopping:
                self._sem.release()
                continue
            js, item = self.pending.popleft()
            self.in_flight += 1
            task = asyncio.create_task(self._run_item(js, item))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            if len(self.pending) < self._low_water():
                self._wake.set()

    async def _run_item(self, js: JobState, item: dict[str, Any]) -> None:
        assert self._gen is not None and self._sem is not None
        try:
            rec = await self._gen.answer(js.ctx, item, attempt=js.attempt, enqueued_at=js.enqueued_at)
        finally:
            self._sem.release()
            self.in_flight -= 1
        seq = self.outbox.append(js.ctx.run, rec)
        self.telemetry.record(js.ctx.run, rec)
        js.max_seq = max(js.max_seq, seq)
        js.remaining -= 1
        self.stats["items"] += 1
        if "error" in rec:
            js.counts["items_failed"] += 1
            js.counts[f"failed_{rec['error']['class']}"] += 1
            self.stats["item_errors"] += 1
        else:
            js.counts["items_done"] += 1
            js.counts[f"outcome_{rec.get('outcome')}"] += 1
            if rec.get("outcome") not in (None, "finished"):
                js.counts["items_truncated"] += 1
            usage = rec.get("usage") or {}
            js.counts["prompt_tokens"] += int(usage.get("prompt_tokens") or 0)
            js.counts["completion_tokens"] += int(usage.get("completion_tokens") or 0)
        self._wake.set()

    async def _wait_for_spool(self) -> None:
        log.warning("local spool holds %d bytes (limit %d): pausing admission until shards ship",
                    self.outbox.spool_bytes, self.cfg.spool_limit)
        self.stats["spool_pauses"] += 1
        while self.outbox.full() and not self.stopping:
            await asyncio.sleep(0.2)

    async def _steer(self) -> None:
        """--concurrency auto: move the limit by the engine's running/waiting counts."""
        if not self.cfg.auto_concurrency or self._sem is None or self._client is None:
            return
        warned = False
        while True:
            await asyncio.sleep(defaults.AUTO_INTERVAL)
            if self.gate_paused:
                continue  # the endpoint is down: its silence says nothing about /metrics
            view = engine_view(await self._client.metrics())
            if not view["metrics"] or view["running"] is None or view["waiting"] is None:
                if not warned:
                    log.warning("--concurrency auto: %s has no vLLM /metrics; holding %d in flight",
                                self.cfg.endpoint, defaults.CONCURRENCY)
                    self._sem.set_limit(min(defaults.CONCURRENCY, self.cfg.max_concurrency))
                    warned = True
                continue
            self.telemetry.engine = view
            old = self._sem.limit
            new = next_limit(old, self.in_flight, view["running"], view["waiting"], view["kv_cache_usage"],
                             lo=defaults.AUTO_MIN, hi=self.cfg.max_concurrency)
            if new != old:
                self._sem.set_limit(new)
                log.debug("concurrency %d -> %d (engine running %d, waiting %d)", old, new,
                          view["running"], view["waiting"])
                if new > old:
                    self._wake.set()

    # --- leases, sweeps ------------------------------------------------------------
    async def _renewer(self) -> None:
        interval = max(self.cfg.lease / 3.0, 0.5)
        while True:
            await asyncio.sleep(interval)
            held = [js.held for js in self.jobs.values()]
            await self._rq(self.worker.renew, held)

    async def _sweeper(self) -> None:
        interval = max(self.cfg.lease / 2.0, 1.0)
        while True:
            for run in list(self.contexts):
                swept = await self._rq(self.worker.sweep, queue_for(run, self.conn))
                if swept:
                    self.stats["jobs_swept"] += swept
                    self._wake.set()
            await asyncio.sleep(interval)

    # --- sealing, shipping, acking -------------------------------------------------
    async def _sealer(self) -> None:
        while True:
            await asyncio.sleep(0.2)
            self.outbox.seal_due(self._idle_runs())

    def _idle_runs(self) -> set[str]:
        """Runs with nothing unfinished here: their open shards need not wait for the age limit."""
        busy = {js.ctx.run for js in self.jobs.values() if not js.complete}
        return set(self.outbox.writers) - busy

    # --- stopping ------------------------------------------------------------------
    async def _drain(self) -> None:
        deadline = time.monotonic() + self.cfg.drain_timeout
        while self._tasks and not self.hard_stop and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*list(self._tasks), return_exceptions=True)
        self.pending.clear()
        self.outbox.seal_due(set(), force=True)
        left = 0.0 if self.hard_stop else max(deadline - time.monotonic(), 5.0)
        if not await self.outbox.flush(left):
            log.warning("stopping with %d shard(s) not shipped; they stay in %s and ship at the next start",
                        len(self.outbox.queue), self.cfg.spool)
        for js in list(self.jobs.values()):
            await self._rq(self.worker.give_back, js.held)
            del self.jobs[js.held.id]
            self.stats["jobs_given_back"] += 1
