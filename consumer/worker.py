"""The consumer: one asyncio loop per GPU that keeps its endpoint's queue full.

This module is the composition root: it builds the parts, wires them to the consumer's named
events (events.py), and runs their loops under supervision. The parts, each in its own module:

- config: ConsumerConfig, how this consumer runs (built once from `consumer run`'s options);
- rqthread, rqcompat: the one thread every rq/Redis call runs in; the rq worker subclass;
- served: which runs this consumer serves, and their start-up probe;
- intake, book, dispatch: take jobs, hold them, send their items (every item ends in a record);
- outbox: shard writing, sealing, ordered shipping with an explicit outcome per shard;
- settle, acker, leases: what a shard's outcome does to held jobs; acks and give-backs; leases;
- admission: the in-flight limit and --concurrency auto;
- copies: the end-of-run copies of items other consumers hold;
- telemetry, metrics: the snapshot for `producer status`, and Prometheus.

A part reports through an event: the consumer's duty on it runs first (settle), then its
listeners (telemetry, the copies' rate, the breaker), each isolated from the others. Every
long-lived loop runs in one asyncio.TaskGroup under `supervise.supervised`: a loop that fails
is restarted with a log line, or stops the consumer with a non-zero exit.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import IO

import redis

from genqueue.common.contracts import ExitCode
from genqueue.common.errors import CorruptStateError, UserError
from genqueue.common.features import ShardIndex
from genqueue.common.keepers.captured import CaptureBudget
from genqueue.common.keepers.featurecounts import FeatureCounts, ShardCount
from genqueue.common.keepers.pause import Pause
from genqueue.common.keepers.redisconn import connect
from genqueue.common.keepers.redismem import RedisEvictsError, check_policy
from genqueue.common.keepers.rqaccess import queue_for
from genqueue.common.keepers.runs import RunStore
from genqueue.common.placement import this_host
from genqueue.common.records import ConsumerInfo, Record
from genqueue.common.storage import ShardStore
from genqueue.common.storage import store_for as default_store_for
from genqueue.common.storage.packcache import PackCache
from genqueue.consumer.answer.checkpoints import Checkpoints
from genqueue.consumer.answer.client import EndpointClient
from genqueue.consumer.answer.generate import Gate, Generator, RunContext
from genqueue.consumer.capture.facts import EngineFactsReader
from genqueue.consumer.capture.features import CaptureKeeper
from genqueue.consumer.capture.owner import CaptureOwner
from genqueue.consumer.capture.tables import TableKeeper
from genqueue.consumer.config import ConsumerConfig
from genqueue.consumer.copies import Copier, copies_clause
from genqueue.consumer.dispatch import Dispatcher
from genqueue.consumer.engine.admission import AUTO_START, Limiter, Steering
from genqueue.consumer.events import Events
from genqueue.consumer.guards.breaker import Breaker
from genqueue.consumer.guards.ended import unfinished_runs
from genqueue.consumer.guards.rewind import Rewind
from genqueue.consumer.guards.stop import Stop, Stopped, until
from genqueue.consumer.guards.supervise import LoopFailed, supervised
from genqueue.consumer.rqcompat import GenWorker, Held
from genqueue.consumer.rqthread import RqThread
from genqueue.consumer.served import ServedRuns
from genqueue.consumer.shipping.outbox import Outbox
from genqueue.consumer.shipping.shards import SpoolBusyError, leftover_shards, lock_spool, release_spool
from genqueue.consumer.telemetry import Parts, PauseReasons, Telemetry
from genqueue.consumer.work.acker import Acker
from genqueue.consumer.work.book import Book
from genqueue.consumer.work.intake import Intake
from genqueue.consumer.work.leases import Leases, renew_every
from genqueue.consumer.work.packs import PackOutages
from genqueue.consumer.work.settle import Settler

log = logging.getLogger(__name__)

#: Seconds a starting consumer waits for an earlier one's leftover shards to ship (the jobs swept back skip them).
LEFTOVER_WAIT = 30.0


@dataclass(frozen=True, slots=True)
class Assembly:
    """The parts `_serve` builds once the endpoint's client is open, wired to the events."""

    gate: Gate
    served: ServedRuns
    steering: Steering
    leases: Leases
    dispatcher: Dispatcher
    intake: Intake
    copier: Copier
    telemetry: Telemetry


class Consumer:
    """Pulls jobs of the runs it serves and turns them into shipped result shards."""

    def __init__(self, cfg: ConsumerConfig, conn: redis.Redis, *,
                 store_for: Callable[[str], ShardStore] | None = None, stop: Stop | None = None) -> None:
        self.cfg = cfg
        self.conn = conn
        self.store = RunStore(conn)
        self.rq = RqThread()
        # The snapshot writer's own thread and Redis connection: a snapshot never waits behind rq
        # work (a dequeue, a renewal, a slow pipeline), which held them up to ~8 s apart under load.
        self._snap_rq = RqThread(name="snapshots", quiet=True)
        self._snap_conn = connect(cfg.redis_url, check=False)  # the URL and settings `consumer run` connected with
        self.worker = GenWorker([queue_for(cfg.run or "_idle", conn)], conn, lease=cfg.lease, name=cfg.name)
        self.identity: ConsumerInfo = {"host": this_host(), "gpu": cfg.gpu, "worker": self.worker.name,
                                       "endpoint": cfg.endpoint}
        self.book: Book[Held] = Book()
        self.acker = Acker(self.rq, self.worker, conn, self.book)
        self.stop = stop if stop is not None else Stop(cfg.drain_timeout)
        self.stopping = self.stop.stopping
        self.stop.on_hard(self._go_hard)
        self.wake = asyncio.Event()
        self.limiter = Limiter(min(AUTO_START, cfg.max_concurrency) if cfg.auto_concurrency
                               else cfg.concurrency)
        ev = self.events = Events()
        self.outbox = Outbox(cfg.spool, self.worker.name, max_bytes=cfg.shard_max_bytes,
                             max_age=cfg.shard_max_age, spool_limit=cfg.spool_limit,
                             store_for=store_for or default_store_for, output_of=self._output_of,
                             on_shipped=ev.shipped, on_lost=ev.shard_lost, on_no_run=ev.run_gone,
                             on_features=ev.features_shipped)
        # --capture: the engine's capture files become rows of the outbox's feature shards
        self.capture = CaptureKeeper(self.outbox.features.append, budget=CaptureBudget(conn),
                                     facts=EngineFactsReader(cfg.endpoint).of)
        # --logprobs: the answers' tables become rows of the same feature shards
        self.tables = TableKeeper(self.outbox.features.append_table)
        self._spool_lock: IO[str] | None = None
        # A Redis that rewinds (consumer/guards/rewind.py): stamped marks, held runs, rebuilt marks.
        self._rewind = Rewind(self.rq, conn, self.worker.name, runs=lambda: self._served.names(),
                              store_for=store_for or default_store_for, hold=renew_every(cfg.lease))
        self.worker.gate = self._rewind.allows
        # the consumer's own handling of what its parts report (consumer/events.py)
        settle = Settler(self.rq, self._rewind, self.acker, self.book, self.wake)
        ev.shipped.duty(settle.shipped)
        ev.shard_lost.duty(settle.shard_lost)
        ev.run_gone.duty(settle.run_gone)
        ev.ended_elsewhere.duty(settle.ended_elsewhere)
        ev.arrived_done.duty(settle.arrived_done)
        ev.runs_resolved.duty(self.outbox.unpark)
        ev.swept.duty(self.wake.set)
        ev.limit_raised.duty(self.wake.set)
        ev.features_shipped.add(self._count_features)
        self._breakers: dict[str, tuple[RunContext, Breaker]] = {}
        self._trips: set[asyncio.Task[None]] = set()
        self._registered = False  # an rq worker in Redis: its stop is reported

    # --- what the outbox asks, and the consumer's own listeners -----------------------
    async def _output_of(self, run: str) -> str | None:
        try:
            info = await self.rq.call(self.store.get, run)
        except CorruptStateError:  # its shards wait in the spool, as for a run gone from Redis
            return None
        return info.settings.output if info is not None else None

    async def _count_features(self, run: str, index: ShardIndex) -> None:
        """A feature shard of RUN is stored: its rows, bytes and tokens join the run's count (status),
        once (common/keepers/featurecounts.py)."""
        await self.rq.call(FeatureCounts(self.conn, run).count, ShardCount.of(index))

    def _check_breaker(self, run: str, rec: Record) -> None:
        """A record is written: the run's breaker looks at it, and a storm pauses the run."""
        ctx = self._served.contexts.get(run)
        if ctx is None:
            return
        kept = self._breakers.get(run)
        if kept is None or kept[0] is not ctx:  # a new context (the run resumed): a fresh breaker
            kept = self._breakers[run] = (ctx, Breaker())
        reason = kept[1].record(rec)
        if reason is None:
            return
        # Stop at once, before the next record: nothing more of the run is sent, written or
        # acked here; its jobs (complete or not) go back and their items are redone after resume.
        reason = f"breaker: {reason}"
        log.error("run %s: %s; pausing the run (its jobs go back to the queue without spending a retry; "
                  "fix the cause, then `producer resume --run %s`)", run, reason, run)
        self._served.pause(run, reason)
        held = [js for js in self.book if js.run == run]
        for js in held:
            self.book.abandon(js)
        task = asyncio.create_task(self._trip(run, reason, [js.held for js in held]), name=f"trip {run}")
        self._trips.add(task)
        task.add_done_callback(self._trips.discard)

    async def _trip(self, run: str, reason: str, held: list[Held]) -> None:
        """Pause RUN in Redis for every consumer and give back the jobs it held here."""
        try:
            await self.rq.call(Pause(self.conn, run).pause, reason, self.worker.name)
            n = await self.acker.give_back_held(held)
            log.info("run %s: %d held job(s) given back", run, n)
        except Exception:
            log.exception("run %s: pausing failed; its held jobs go back when their leases expire", run)
        self.wake.set()

    def _low_water(self) -> int:
        return max(self.limiter.limit // 2, 8)

    # --- main ----------------------------------------------------------------------
    async def run(self) -> int:
        """Serve until stopped (or, with burst, until the served runs are drained). Exit code."""
        self.stop.install(asyncio.get_running_loop())
        try:
            self._spool_lock = lock_spool(self.cfg.spool)
        except SpoolBusyError as e:
            raise UserError(str(e)) from None
        # as many at once as requests in flight: the ceiling of --concurrency (auto: its
        # --max-concurrency); the end of a run's copies take slots of the same limiter
        cfg = self.cfg
        checkpoints = Checkpoints(cfg.redis_url, cfg.max_concurrency if cfg.auto_concurrency else cfg.concurrency)
        try:
            async with EndpointClient(self.cfg.endpoint, request_timeout=self.cfg.request_timeout) as client:
                return await self._serve(client, checkpoints)
        finally:
            self.rq.close()
            self._snap_rq.close()
            with contextlib.suppress(Exception):
                self._snap_conn.close()
            self.outbox.close()
            self.capture.close()
            self.tables.close()
            self._release_spool()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(checkpoints.close(), timeout=max(self.stop.left(), 0.5))

    def _new_telemetry(self, parts: Parts) -> Telemetry:
        """The consumer's telemetry, writing its snapshots through their own thread and Redis
        connection (the rq thread's state is still what it reports: parts.rq)."""
        cfg = self.cfg
        return Telemetry(self.identity, self._snap_conn, self._snap_rq, parts, interval=cfg.telemetry_interval,
                         metrics_port=cfg.metrics_port, gpus=cfg.gpus)

    def _release_spool(self) -> None:
        """At exit, however it came: a spool left with nothing to ship is removed (a failed
        start would leave an empty genqueue-spool/<port> behind); one with shards stays."""
        lock, self._spool_lock = self._spool_lock, None
        if lock is not None and release_spool(self.cfg.spool, lock):
            log.info("spool %s held nothing to ship: removed", self.cfg.spool)

    def _assemble(self, client: EndpointClient, checkpoints: Checkpoints) -> Assembly:
        """Build the parts that need the endpoint's client, each reporting through self.events,
        and add the listeners: telemetry counts records and shows the start-up, the copies learn
        this engine's rate, the breaker watches for storms."""
        cfg, ev = self.cfg, self.events
        gate = Gate(client)
        gen = Generator(client, gate, max_attempts=cfg.max_attempts, checkpoints=checkpoints, features=self.capture,
                        tables=self.tables)
        served = self._served = ServedRuns(self.rq, self.store, client, gen, endpoint=cfg.endpoint, only_run=cfg.run,
                                           identity=self.identity, worker=self.worker.name,
                                           request_timeout=cfg.request_timeout, endpoint_wait=cfg.endpoint_wait,
                                           shared_fs=cfg.shared_fs)
        # capture files carry this consumer's spool in their name; a dead predecessor's are removed
        owner = CaptureOwner.of(cfg.spool)
        gen.request_id, served.capture_owner = owner.request_id, owner
        steering = Steering(self.limiter, client.metrics, auto=cfg.auto_concurrency,
                            max_concurrency=cfg.max_concurrency, endpoint=cfg.endpoint,
                            gate_paused=lambda: gate.paused, in_flight=lambda: self.book.in_flight,
                            on_grow=ev.limit_raised)
        leases = Leases(self.rq, self.worker, self.book, lease=cfg.lease, runs=served.names, on_swept=ev.swept)
        outages = PackOutages()
        dispatcher = Dispatcher(self.book, self.limiter, gate, self.outbox, gen, on_record=ev.recorded,
                                wake=self.wake, stopping=self.stopping, low_water=self._low_water,
                                on_won=ev.ended_elsewhere)
        intake = Intake(self.rq, self.worker, self.book, self.acker, served, low_water=self._low_water,
                        may_fetch=lambda: not gate.paused, burst=cfg.burst, poll_interval=cfg.poll_interval,
                        wake=self.wake, stopping=self.stopping, on_complete=ev.arrived_done,
                        on_runs=ev.runs_resolved, has_room=dispatcher.room_for_work, outages=outages,
                        pack_cache=PackCache(cfg.pack_cache, max_bytes=cfg.pack_cache_bytes)
                        if cfg.pack_cache_bytes > 0 else None, written_here=self.outbox.unshipped_results)
        copier = Copier(self.rq, self.conn, self.worker.name, dispatcher, contexts=lambda: served.contexts,
                        tail_runs=intake.tail_runs, stopped=lambda: set(served.paused) | set(served.vanished),
                        clock=self.worker.clock.now, read_reference=intake.read_reference,
                        hungry=intake.hungry, book=self.book)
        telemetry = self._new_telemetry(Parts(
            book=self.book.snapshot, acker=self.acker.snapshot, leases=leases.snapshot, served=served.snapshot,
            outbox=self.outbox.snapshot, admission=steering.snapshot, rq=self.rq.snapshot,
            paused=PauseReasons(cfg.endpoint, gate, self.outbox, self.rq, outages, served),
            stopping=self.stopping.is_set, retries=gen.failures.copy, copies=copier.counts,
            packs=intake.packs.counts, backing_off=lambda: gen.backing_off))
        telemetry.only_run, telemetry.spool = cfg.run, os.path.abspath(cfg.spool)
        ev.recorded.add(telemetry.record)
        ev.recorded.add(copier.recorded)
        ev.recorded.add(self._check_breaker)
        ev.phase.add(telemetry.set_phase)
        ev.serving.add(telemetry.start_run)
        return Assembly(gate, served, steering, leases, dispatcher, intake, copier, telemetry)

    async def _serve(self, client: EndpointClient, checkpoints: Checkpoints) -> int:
        cfg = self.cfg
        parts = self._assemble(client, checkpoints)
        gate, served, telemetry = parts.gate, parts.served, parts.telemetry
        telemetry.start_metrics_server()  # from the start: a consumer stuck in its pre-flight is seen
        t0 = time.monotonic()
        code: int = ExitCode.DONE
        started = False
        log.info("consumer %s starting: pre-flight on endpoint %s for runs %s (`producer status` shows what it "
                 "waits on)", self.worker.name, cfg.endpoint, cfg.run or "(all open)")
        publisher = asyncio.create_task(telemetry.starting(), name="start-up snapshot")
        try:
            try:
                # Start-up waits on the endpoint and on Redis, which may never answer: a stop ends it.
                started = await until(self.stopping, self._start(served))
            except Stopped:
                log.info("consumer %s stopping before start-up finished (nothing held)", self.worker.name)
            finally:
                publisher.cancel()
                await asyncio.gather(publisher, return_exceptions=True)
            if started:
                t0 = time.monotonic()
                code = await self._work(parts)
        finally:
            await gate.aclose()
            if self._registered:
                await self._report_stop(telemetry)
            else:  # seen starting: say it is gone, not that it stopped reporting
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(telemetry.publish(exited=True), timeout=min(self.stop.left(floor=0.5), 2.0))
        left = self.outbox.unshipped()
        gone = sorted({shard.run for shard in left} & set(self.outbox.parked_runs()))
        if left:
            log.warning("stopping with %d shard(s) not shipped; they stay in %s and ship at the next start%s",
                        len(left), self.cfg.spool, f" (runs gone from Redis: {', '.join(gone)}: once `producer "
                        "enqueue` re-creates them)" if gone else "")
        if code == ExitCode.DONE and cfg.burst and not self.stop.signalled:
            ends = served.unfinished()
            for run, (_, why) in ends.items():
                log.error("run %s was not served to the end: %s", run, why)
            code = max((c for c, _ in ends.values()), default=ExitCode.DONE)
        if code == ExitCode.DONE and cfg.burst and started and not self.stop.signalled:
            runs = sorted(set(served.names()) | set(telemetry.totals))
            for run, (ended, why) in (await unfinished_runs(self.rq, self.conn, runs,
                                                             self.stop.left(floor=1.0))).items():
                log.error("run %s was not served to the end: %s", run, why)
                code = max(code, ended)
        if code == ExitCode.DONE and self.stop.hard:
            code = ExitCode.INTERRUPTED
        if not started and not self.stop.signalled and code != ExitCode.DONE:
            log.error("consumer %s did not start: nothing here it may serve; 0 items sent (exit %d)",
                      self.worker.name, code)
            return code
        elapsed = time.monotonic() - t0
        items = sum(t["completions"] for t in telemetry.totals.values())
        errors = sum(t["errors"] for t in telemetry.totals.values())
        a = self.acker.snapshot()
        copies = copies_clause(parts.copier.counts())
        log.log(logging.INFO if code == ExitCode.DONE else logging.ERROR,
                "consumer %s stopped after %.1f s: %d items (%d errors), %d jobs acked, %d given back%s, "
                "%.1f items/s (exit %d%s)", self.worker.name, elapsed, items, errors, a.acked, a.given_back, copies,
                items / elapsed if elapsed > 0 else 0.0, code,
                "" if code == ExitCode.DONE else f": {ExitCode(code).name.lower().replace('_', ' ')}, not done")
        return code

    async def _start(self, served: ServedRuns) -> bool:
        """Pre-flight, register, ship what an earlier consumer left; each step is the phase its
        snapshot shows (`producer status`: "pre-flight: waiting on the engine ... for 2m 39s").
        False when a --burst consumer has nothing it may serve (every run it would serve refused
        here: a failed pre-flight, another host's output, paused, gone)."""
        try:  # a Redis that evicts keys would drop the runs served here in silence
            await self.rq.call(check_policy, self.conn, warn=lambda line: log.warning("pre-flight: %s", line))
        except RedisEvictsError as e:
            e.exit_code = ExitCode.PREFLIGHT
            raise
        phase = self.events.phase
        phase("pre-flight: waiting on the engine (/v1/models)")
        await served.wait_for_models()
        phase("pre-flight: waiting on the engine (the runs' probe requests)")
        runs = await served.resolve()
        if self.cfg.burst and not runs and served.unfinished():
            return False
        for run in runs:
            self.events.serving(run)
        phase("registering its rq worker")
        await self.rq.call(self.worker.start)
        self._registered = True
        log.info("consumer %s started: endpoint %s, concurrency %s, runs %s", self.worker.name, self.cfg.endpoint,
                 "auto" if self.cfg.auto_concurrency else self.cfg.concurrency, self.cfg.run or "(all open)")
        phase("shipping an earlier consumer's leftover shards")
        await self._ship_leftovers()
        phase(None)
        return True

    async def _work(self, parts: Assembly) -> int:
        """Run every loop until the intake ends (a stop, or a --burst end) and the drain is done."""
        dispatcher, intake, leases, telemetry = parts.dispatcher, parts.intake, parts.leases, parts.telemetry
        background: dict[str, Callable[[], Awaitable[None]]] = {
            "dispatcher": dispatcher.run, "renewer": leases.renew_forever, "sweeper": leases.sweep_forever,
            "sealer": self._sealer, "shipper": self.outbox.shipper, "telemetry": telemetry.loop,
            "steering": parts.steering.run, "rewind": self._rewind.watch, "copies": parts.copier.run,
            "loop-lag": telemetry.lag.run,
        }
        code = ExitCode.DONE
        try:
            async with asyncio.TaskGroup() as tg:
                tasks = [tg.create_task(supervised(name, fn), name=name) for name, fn in background.items()]
                tg.create_task(self._main(intake, dispatcher, tasks), name="intake")
        except* LoopFailed as group:
            for e in group.exceptions:
                log.error("consumer %s stopping: %s", self.worker.name, e)
            code = ExitCode.FATAL
            await self._give_back_all_best_effort()
        return code

    async def _report_stop(self, telemetry: Telemetry) -> None:
        """Say in Redis that this consumer stopped; best effort within what is left of the stop
        (a moment when Redis is out: status ages a silent consumer out anyway)."""
        cap = 0.5 if self.rq.snapshot().unreachable_since is not None else 5.0
        try:
            await asyncio.wait_for(telemetry.publish(exited=True), timeout=min(self.stop.left(floor=0.5), cap))
            await asyncio.wait_for(self.rq.once(self.worker.stop), timeout=min(self.stop.left(floor=0.5), cap))
        except Exception as e:  # noqa: BLE001 - the stop goes on; status ages the consumer out
            log.warning("could not report the stop to Redis (%s: %s)", type(e).__name__, e)

    async def _main(self, intake: Intake, dispatcher: Dispatcher, background: list[asyncio.Task[None]]) -> None:
        """Fetch until it is time to stop, drain, then end the background loops."""
        await supervised("intake", intake.run, restarts=5)
        await self._drain(dispatcher)
        for t in background:
            t.cancel()

    def _go_hard(self) -> None:
        """A second signal: every wait gives up at once."""
        self.rq.hard_stop = True
        self._snap_rq.hard_stop = True
        self.outbox.stopping_hard = True
        self.wake.set()

    async def _sealer(self) -> None:
        while True:
            await asyncio.sleep(0.2)
            self.outbox.seal_due(set(self.outbox.writers) - self.book.busy_runs())

    async def _ship_leftovers(self) -> None:
        """Ship what an earlier consumer left in this spool, before taking any job: shipped, its
        records mark their items done, so the jobs swept back from that consumer skip them.
        The spool's lock (held since start) proves that consumer is dead: every shard here not
        of our own making is a leftover. With the store unreachable, they wait in the queue."""
        mine = self.worker.name
        features = await self.rq.call(self.outbox.features.leftovers, lambda worker: worker != mine)
        shards = await self.rq.call(leftover_shards, self.cfg.spool, lambda worker: worker != mine)
        if not shards and not features:
            return
        for feature_shard in features:  # first: the records name them
            self.outbox.enqueue(feature_shard)
        for shard in shards:
            self.outbox.enqueue(shard)
        log.info("shipping %d shard(s) left in the spool by an earlier consumer", len(shards))
        shipper = asyncio.create_task(self.outbox.shipper())
        try:
            if not await self.outbox.flush(LEFTOVER_WAIT):
                log.warning("leftover shards not shipped within %.0f s; starting work, they ship meanwhile",
                            LEFTOVER_WAIT)
        finally:
            shipper.cancel()
            await asyncio.gather(shipper, return_exceptions=True)

    async def _drain(self, dispatcher: Dispatcher) -> None:
        """In flight finishes until the drain deadline; then what is complete ships and the rest
        goes back, within the stop's grace (a --burst end drains the same way)."""
        stop = self.stop
        stop.begin()
        self.wake.set()
        dispatcher.cancel_copies()  # copies of what others hold: their originals go on there
        await dispatcher.finish(max(stop.drain_deadline - time.monotonic(), 0.0), lambda: stop.hard)
        self.book.drop_pending()
        if not self.outbox.seal_due(set(), force=True):
            log.error("the spool refuses writes (%s): results not written are lost with this process; their "
                      "jobs go back to the queue", self.outbox.disk_error)
        # Shipping needs Redis (the run's output, done marks, acks) and a store that takes
        # shards: with either failing now, a moment only (the shards ship at the next start).
        redis_out = self.rq.snapshot().unreachable_since is not None
        failing = redis_out or self.outbox.last_error is not None
        ship = 0.0 if stop.hard else min(stop.left(reserve=4.0), 1.0 if failing else
                                         max(stop.drain_deadline - time.monotonic(), 5.0))
        await self.outbox.flush(ship)
        back = 0.0 if stop.hard else min(stop.left(reserve=2.0), 1.0 if redis_out else 10.0)
        loop = asyncio.get_running_loop()
        try:
            await asyncio.wait_for(self.acker.give_back_all(loop.time() + back), timeout=back + 1.0)
        except TimeoutError:
            log.warning("held jobs not all given back within %.1f s; the rest return when their leases expire",
                        back + 1.0)

    async def _give_back_all_best_effort(self) -> None:
        """After a fatal loop failure: give held jobs back if Redis answers within seconds;
        otherwise their leases expire and any consumer sweeps them back."""
        loop = asyncio.get_running_loop()
        try:
            await asyncio.wait_for(self.acker.give_back_all(loop.time() + 5.0), timeout=15.0)
        except (TimeoutError, redis.exceptions.RedisError) as e:
            log.warning("held jobs not given back (%s); their leases expire and they are swept back", e)
