"""The consumer: one asyncio loop per GPU that keeps its endpoint's queue full.

This module is the composition root: it builds the parts, wires them, and runs their loops
under supervision. The parts, each in its own module with its own small interface:

- rqthread: the one thread every rq/Redis call runs in (rides out Redis outages);
- rqcompat: the rq worker subclass (every touch of rq's internals);
- served: which runs this consumer serves, and their start-up probe;
- intake: dequeue jobs, check their items, hold them;
- book: held jobs, their pending items, what is in flight, what is ackable (pure);
- dispatch: admission and one guarded task per item (every item ends in a record);
- outbox: shard writing, sealing, ordered shipping with an explicit outcome per shard;
- acker: ack / redo / refuse / give back, in rq and in the book;
- leases: renew what is held (dropping leases found lost), sweep what the dead left;
- admission: the in-flight limit and --concurrency auto;
- telemetry: the snapshot for `producer status` and Prometheus, fed by the parts' snapshots.

Every long-lived loop runs in one asyncio.TaskGroup under `supervise.supervised`: a loop
that fails is restarted with a log line, or stops the consumer with a non-zero exit.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import IO

import redis

from genqueue.common import defaults
from genqueue.common.contracts import ConsumerInfo
from genqueue.common.errors import UserError
from genqueue.common.jobs import queue_for
from genqueue.common.runs import RunStore
from genqueue.consumer.acker import Acker
from genqueue.consumer.admission import Limiter, Steering
from genqueue.consumer.book import Book
from genqueue.consumer.checkpoints import Checkpoints
from genqueue.consumer.client import EndpointClient
from genqueue.consumer.dispatch import Dispatcher
from genqueue.consumer.generate import Gate, Generator
from genqueue.consumer.intake import Intake
from genqueue.consumer.leases import Leases
from genqueue.consumer.outbox import Outbox
from genqueue.consumer.rqcompat import GenWorker, Held
from genqueue.consumer.rqthread import RqThread
from genqueue.consumer.served import ServedRuns
from genqueue.consumer.shards import Sink, SpoolBusyError, leftover_shards, lock_spool
from genqueue.consumer.sinks import make_sink
from genqueue.consumer.supervise import LoopFailed, supervised
from genqueue.consumer.telemetry import Parts, Telemetry

log = logging.getLogger(__name__)


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


class Consumer:
    """Pulls jobs of the runs it serves and turns them into shipped result shards."""

    def __init__(self, cfg: ConsumerConfig, conn: redis.Redis, *, sink_for: Callable[[str], Sink] | None = None):
        self.cfg = cfg
        self.conn = conn
        self.store = RunStore(conn)
        self.rq = RqThread()
        self.worker = GenWorker([queue_for(cfg.run or "_idle", conn)], conn, lease=cfg.lease, name=cfg.name)
        self.identity: ConsumerInfo = {"host": socket.gethostname(), "gpu": cfg.gpu, "worker": self.worker.name,
                                       "endpoint": cfg.endpoint}
        self.book: Book[Held] = Book()
        self.acker = Acker(self.rq, self.worker, conn, self.book)
        self.stopping = asyncio.Event()
        self.hard_stop = False
        self.wake = asyncio.Event()
        self.limiter = Limiter(min(defaults.AUTO_START, cfg.max_concurrency) if cfg.auto_concurrency
                               else cfg.concurrency)
        self.outbox = Outbox(cfg.spool, self.worker.name, max_bytes=cfg.shard_max_bytes,
                             max_age=cfg.shard_max_age, spool_limit=cfg.spool_limit,
                             sink_for=sink_for or make_sink, output_of=self._output_of,
                             on_shipped=self._shipped, on_lost=self._shard_lost, on_no_run=self._run_gone)
        self._spool_lock: IO[str] | None = None

    # --- wiring callbacks ----------------------------------------------------------
    async def _output_of(self, run: str) -> str | None:
        info = await self.rq.call(self.store.get, run)
        return info.settings.output if info is not None else None

    async def _shipped(self, run: str, seq: int) -> None:
        if await self.acker.shipped(run, seq):
            self.wake.set()

    async def _shard_lost(self, run: str, seq: int) -> None:
        if await self.acker.shard_lost(run, seq):
            self.wake.set()

    async def _run_gone(self, run: str) -> None:
        for js in self.book:
            if js.run == run:
                self.book.abandon(js)

    def _low_water(self) -> int:
        return max(self.limiter.limit // 2, 8)

    # --- main ----------------------------------------------------------------------
    async def run(self) -> int:
        """Serve until stopped (or, with burst, until the served runs are drained). Exit code."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                loop.add_signal_handler(sig, self._on_signal, sig)
            except (NotImplementedError, RuntimeError):  # not the main thread (tests)
                pass
        try:
            self._spool_lock = lock_spool(self.cfg.spool)
        except SpoolBusyError as e:
            raise UserError(str(e)) from None
        checkpoints = Checkpoints(self.cfg.redis_url)
        try:
            async with EndpointClient(self.cfg.endpoint, request_timeout=self.cfg.request_timeout) as client:
                return await self._serve(client, checkpoints)
        finally:
            self.rq.close()
            self.outbox.close()
            await checkpoints.close()

    async def _serve(self, client: EndpointClient, checkpoints: Checkpoints) -> int:
        cfg = self.cfg
        gate = Gate(client)
        gen = Generator(client, gate, max_attempts=cfg.max_attempts, checkpoints=checkpoints)
        served = ServedRuns(self.rq, self.store, client, gen, endpoint=cfg.endpoint, only_run=cfg.run,
                            identity=self.identity, worker=self.worker.name,
                            request_timeout=cfg.request_timeout, endpoint_wait=cfg.endpoint_wait)
        steering = Steering(self.limiter, client.metrics, auto=cfg.auto_concurrency,
                            max_concurrency=cfg.max_concurrency, endpoint=cfg.endpoint,
                            gate_paused=lambda: gate.paused, in_flight=lambda: self.book.in_flight,
                            on_grow=self.wake.set)
        leases = Leases(self.rq, self.worker, self.book, lease=cfg.lease, runs=served.names,
                        on_swept=self.wake.set)

        def paused() -> dict[str, str]:
            reasons: dict[str, str] = {}
            if gate.paused:
                reasons["endpoint_down"] = f"endpoint {cfg.endpoint} is down"
            if self.outbox.full():
                reasons["spool_full"] = f"{self.outbox.spool_bytes} unshipped bytes in the spool"
            if self.rq.snapshot().unreachable_since is not None:
                reasons["redis_unreachable"] = "Redis is unreachable"
            return reasons

        telemetry = Telemetry(self.identity, self.conn, self.rq, Parts(
            book=self.book.snapshot, acker=self.acker.snapshot, leases=leases.snapshot, served=served.snapshot,
            outbox=self.outbox.snapshot, admission=steering.snapshot, rq=self.rq.snapshot, paused=paused,
            stopping=self.stopping.is_set), interval=cfg.telemetry_interval, metrics_port=cfg.metrics_port)
        dispatcher = Dispatcher(self.book, self.limiter, gate, self.outbox, gen, on_record=telemetry.record,
                                wake=self.wake, stopping=self.stopping, low_water=self._low_water)
        intake = Intake(self.rq, self.worker, self.book, self.acker, served, low_water=self._low_water,
                        may_fetch=lambda: not gate.paused, burst=cfg.burst, poll_interval=cfg.poll_interval,
                        wake=self.wake, stopping=self.stopping)

        await served.wait_for_models(self.stopping)
        for run in await served.resolve():
            telemetry.start_run(run)
        await self.rq.call(self.worker.start)
        telemetry.start_metrics_server()
        log.info("consumer %s started: endpoint %s, concurrency %s, runs %s", self.worker.name, cfg.endpoint,
                 "auto" if cfg.auto_concurrency else cfg.concurrency, cfg.run or "(all open)")
        await self._ship_leftovers()
        t0 = time.monotonic()
        background: dict[str, Callable[[], Awaitable[None]]] = {
            "dispatcher": dispatcher.run, "renewer": leases.renew_forever, "sweeper": leases.sweep_forever,
            "sealer": self._sealer, "shipper": self.outbox.shipper, "telemetry": telemetry.loop,
            "steering": steering.run,
        }
        code = 0
        try:
            async with asyncio.TaskGroup() as tg:
                tasks = [tg.create_task(supervised(name, fn), name=name) for name, fn in background.items()]
                tg.create_task(self._main(intake, dispatcher, tasks), name="intake")
        except* LoopFailed as group:
            for e in group.exceptions:
                log.error("consumer %s stopping: %s", self.worker.name, e)
            code = 1
            await self._give_back_all_best_effort()
        finally:
            try:
                await asyncio.wait_for(telemetry.publish(exited=True), timeout=5.0)
                await asyncio.wait_for(self.rq.once(self.worker.stop), timeout=5.0)
            except (TimeoutError, redis.exceptions.RedisError) as e:
                log.warning("could not report the stop to Redis (%s)", e)
        elapsed = time.monotonic() - t0
        items = sum(t["completions"] for t in telemetry.totals.values())
        errors = sum(t["errors"] for t in telemetry.totals.values())
        a = self.acker.snapshot()
        log.info("consumer %s stopped after %.1f s: %d items (%d errors), %d jobs acked, %d given back, "
                 "%.1f items/s", self.worker.name, elapsed, items, errors, a.acked, a.given_back,
                 items / elapsed if elapsed > 0 else 0.0)
        return code

    async def _main(self, intake: Intake, dispatcher: Dispatcher, background: list[asyncio.Task[None]]) -> None:
        """Fetch until it is time to stop, drain, then end the background loops."""
        await supervised("intake", intake.run, restarts=5)
        await self._drain(dispatcher)
        for t in background:
            t.cancel()

    def _on_signal(self, sig: int) -> None:
        if self.stopping.is_set():
            log.warning("second signal: stopping now")
            self.hard_stop = True
            self.rq.hard_stop = True
            self.outbox.stopping_hard = True
        else:
            log.warning("signal %s: draining (in flight finishes, the rest goes back to the queue)",
                        signal.Signals(sig).name)
            self.stopping.set()
        self.wake.set()

    async def _sealer(self) -> None:
        while True:
            await asyncio.sleep(0.2)
            self.outbox.seal_due(set(self.outbox.writers) - self.book.busy_runs())

    async def _ship_leftovers(self) -> None:
        """Ship what an earlier consumer left in this spool. The spool's lock (held since start)
        proves that consumer is dead: every shard here not of our own making is a leftover."""
        mine = self.worker.name
        shards = await self.rq.call(leftover_shards, self.cfg.spool, lambda worker: worker != mine)
        for shard in shards:
            log.warning("shipping %s left in the spool by an earlier consumer", shard.name)
            self.outbox.enqueue(shard)

    async def _drain(self, dispatcher: Dispatcher) -> None:
        deadline = time.monotonic() + self.cfg.drain_timeout
        self.stopping.set()
        self.wake.set()
        await dispatcher.finish(self.cfg.drain_timeout, lambda: self.hard_stop)
        self.book.drop_pending()
        self.outbox.seal_due(set(), force=True)
        left = 0.0 if self.hard_stop else max(deadline - time.monotonic(), 5.0)
        if not await self.outbox.flush(left):
            log.warning("stopping with %d shard(s) not shipped; they stay in %s and ship at the next start",
                        len(self.outbox.queue), self.cfg.spool)
        await self.acker.give_back_all()

    async def _give_back_all_best_effort(self) -> None:
        """After a fatal loop failure: give held jobs back if Redis answers within seconds;
        otherwise their leases expire and any consumer sweeps them back."""
        self.rq.hard_stop = True
        for js in self.book:
            try:
                await asyncio.wait_for(self.rq.once(self.worker.give_back, js.held), timeout=5.0)
                self.book.release(js)
            except (TimeoutError, redis.exceptions.RedisError) as e:
                log.warning("job %s not given back (%s); its lease expires and it is swept back", js.id, e)
                return
