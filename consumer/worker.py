"""The consumer: one asyncio loop per GPU that keeps its endpoint's queue full.

This module is the composition root: it builds the parts, wires them, and runs their loops
under supervision. The parts, each in its own module with its own small interface:

- config: ConsumerConfig, how this consumer runs (built once from `consumer run`'s options);
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
import contextlib
import logging
import os
import time
from collections.abc import Awaitable, Callable
from typing import IO

import redis

from genqueue.common import defaults
from genqueue.common.contracts import ExitCode
from genqueue.common.errors import CorruptStateError, UserError
from genqueue.common.features import ShardIndex
from genqueue.common.keepers.captured import CaptureBudget
from genqueue.common.keepers.featurecounts import FeatureCounts, ShardCount
from genqueue.common.keepers.marks import ShardMarks
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
from genqueue.consumer.dispatch import Dispatcher
from genqueue.consumer.engine.admission import Limiter, Steering
from genqueue.consumer.guards.breaker import Breaker
from genqueue.consumer.guards.ended import unfinished_runs
from genqueue.consumer.guards.rewind import Rewind
from genqueue.consumer.guards.stop import Stop, Stopped, until
from genqueue.consumer.guards.supervise import LoopFailed, supervised
from genqueue.consumer.hedge import Hedger
from genqueue.consumer.rqcompat import GenWorker, Held
from genqueue.consumer.rqthread import RqThread
from genqueue.consumer.served import ServedRuns
from genqueue.consumer.shipping.outbox import Outbox
from genqueue.consumer.shipping.shards import SpoolBusyError, leftover_shards, lock_spool, release_spool
from genqueue.consumer.telemetry import Parts, PauseReason, Telemetry
from genqueue.consumer.work.acker import Acker
from genqueue.consumer.work.book import Book
from genqueue.consumer.work.intake import Intake, PackOutages
from genqueue.consumer.work.leases import Leases

log = logging.getLogger(__name__)

LEFTOVER_WAIT = defaults.WORKER_LEFTOVER_WAIT


def copies_clause(counts: dict[str, int]) -> str:
    """The end line's account of the end-of-run copies (Hedger.counts); '' when there were none."""
    if not (counts.get("sent") or counts.get("ended_elsewhere")):
        return ""
    return (f", copies: {counts.get('sent', 0)} sent for others ({counts.get('shipped', 0)} written), "
            f"{counts.get('ended_elsewhere', 0)} of ours ended by others")


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
        self.limiter = Limiter(min(defaults.AUTO_START, cfg.max_concurrency) if cfg.auto_concurrency
                               else cfg.concurrency)
        self.outbox = Outbox(cfg.spool, self.worker.name, max_bytes=cfg.shard_max_bytes,
                             max_age=cfg.shard_max_age, spool_limit=cfg.spool_limit,
                             store_for=store_for or default_store_for, output_of=self._output_of,
                             on_shipped=self._shipped, on_lost=self._shard_lost, on_no_run=self._run_gone,
                             on_features=self._features_shipped)
        # --capture: the engine's capture files become rows of the outbox's feature shards
        self.capture = CaptureKeeper(self.outbox.features.append, budget=CaptureBudget(conn),
                                     facts=EngineFactsReader(cfg.endpoint).of)
        # --logprobs: the answers' tables become rows of the same feature shards
        self.tables = TableKeeper(self.outbox.features.append_table)
        self._spool_lock: IO[str] | None = None
        # A Redis that rewinds (consumer/guards/rewind.py): stamped marks, held runs, rebuilt marks.
        self._rewind = Rewind(self.rq, conn, self.worker.name, runs=lambda: self._served.names(),
                              store_for=store_for or default_store_for, hold=defaults.renew_every(cfg.lease))
        self.worker.gate = self._rewind.allows
        self._breakers: dict[str, tuple[RunContext, Breaker]] = {}
        self._trips: set[asyncio.Task[None]] = set()
        self._registered = False  # an rq worker in Redis: its stop is reported
        self._shipped_seq: dict[str, int] = {}  # run -> the last of our shards shipped (in order)
        self._hedger: Hedger | None = None
        self._intake: Intake | None = None

    # --- wiring callbacks ----------------------------------------------------------
    async def _output_of(self, run: str) -> str | None:
        try:
            info = await self.rq.call(self.store.get, run)
        except CorruptStateError:  # its shards wait in the spool, as for a run gone from Redis
            return None
        return info.settings.output if info is not None else None

    async def _shipped(self, run: str, seq: int | None, marks: ShardMarks) -> None:
        """A shard of RUN is stored: mark its items done, then ack the jobs it completes (in
        that order: a crash in between leaves jobs that, run again, skip those items)."""
        await self.rq.call(self._rewind.mark_shipped, run, marks)
        if seq is not None:
            self._shipped_seq[run] = max(seq, self._shipped_seq.get(run, 0))
        if seq is not None and await self.acker.shipped(run, seq):
            self.wake.set()

    async def _features_shipped(self, run: str, index: ShardIndex) -> None:
        """A feature shard of RUN is stored: its rows, bytes and tokens join the run's count (status),
        once (common/keepers/featurecounts.py)."""
        await self.rq.call(FeatureCounts(self.conn, run).count, ShardCount.of(index))

    async def _ended_elsewhere(self, run: str) -> None:
        """A job of RUN completed by an item whose result another consumer shipped: ack it once
        its own records are shipped (shards ship in order: all up to the last one shipped are)."""
        if await self.acker.shipped(run, self._shipped_seq.get(run, 0)):
            self.wake.set()

    async def _complete_on_arrival(self, run: str) -> None:
        """A job arrived with every item already shipped: nothing waits for a shard; ack it."""
        await self.acker.shipped(run, 0)

    async def _shard_lost(self, run: str, seq: int) -> None:
        if await self.acker.shard_lost(run, seq):
            self.wake.set()

    async def _run_gone(self, run: str) -> None:
        for js in self.book:
            if js.run == run:
                self.book.abandon(js)

    def _on_record(self, run: str, rec: Record) -> None:
        """A record is written: count it, and let the run's breaker look at it."""
        self._telemetry.record(run, rec)
        if self._hedger is not None:
            self._hedger.observe(rec)
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

    async def _serve(self, client: EndpointClient, checkpoints: Checkpoints) -> int:
        cfg = self.cfg
        gate = Gate(client)
        gen = Generator(client, gate, max_attempts=cfg.max_attempts, checkpoints=checkpoints, features=self.capture,
                        tables=self.tables)
        served = ServedRuns(self.rq, self.store, client, gen, endpoint=cfg.endpoint, only_run=cfg.run,
                            identity=self.identity, worker=self.worker.name,
                            request_timeout=cfg.request_timeout, endpoint_wait=cfg.endpoint_wait,
                            shared_fs=cfg.shared_fs)
        # capture files carry this consumer's spool in their name; a dead predecessor's are removed
        owner = CaptureOwner.of(cfg.spool)
        gen.request_id, served.capture_owner = owner.request_id, owner
        steering = Steering(self.limiter, client.metrics, auto=cfg.auto_concurrency,
                            max_concurrency=cfg.max_concurrency, endpoint=cfg.endpoint,
                            gate_paused=lambda: gate.paused, in_flight=lambda: self.book.in_flight,
                            on_grow=self.wake.set)
        leases = Leases(self.rq, self.worker, self.book, lease=cfg.lease, runs=served.names,
                        on_swept=self.wake.set)

        outages = PackOutages()

        def paused() -> dict[str, str]:
            reasons: dict[str, str] = {}  # keyed by the plain values: a snapshot is written by orjson
            if gate.paused:
                reasons[PauseReason.ENDPOINT_DOWN.value] = f"endpoint {cfg.endpoint} is down"
            if self.outbox.disk_error is not None:
                reasons[PauseReason.SPOOL_DISK.value] = self.outbox.disk_error
            elif self.outbox.full():
                reasons[PauseReason.SPOOL_FULL.value] = f"{self.outbox.spool_bytes} unshipped bytes in the spool"
            rq = self.rq.snapshot()
            if rq.unreachable_since is not None:
                reasons[PauseReason.REDIS_UNREACHABLE.value] = "Redis is unreachable"
            if rq.full_since is not None:
                reasons[PauseReason.REDIS_FULL.value] = (
                    "Redis is full (at its maxmemory): writes wait, jobs held, results in the spool; goes on once "
                    "memory is freed")
            packs = outages.reason()
            if packs is not None:
                reasons[PauseReason.PACKS_UNREACHABLE.value] = packs
            for run, why in served.snapshot().refused.items():
                reasons[f"run {run}"] = why
            return reasons

        telemetry = self._new_telemetry(Parts(
            book=self.book.snapshot, acker=self.acker.snapshot, leases=leases.snapshot, served=served.snapshot,
            outbox=self.outbox.snapshot, admission=steering.snapshot, rq=self.rq.snapshot, paused=paused,
            stopping=self.stopping.is_set, retries=lambda: dict(gen.failures),
            copies=lambda: self._hedger.counts() if self._hedger is not None else {},
            packs=lambda: self._intake.packs.counts() if self._intake is not None else {},
            backing_off=lambda: gen.backing_off))
        self._telemetry, self._served = telemetry, served
        telemetry.only_run, telemetry.spool = cfg.run, os.path.abspath(cfg.spool)
        telemetry.start_metrics_server()  # from the start: a consumer stuck in its pre-flight is seen
        dispatcher = Dispatcher(self.book, self.limiter, gate, self.outbox, gen, on_record=self._on_record,
                                wake=self.wake, stopping=self.stopping, low_water=self._low_water,
                                on_won=self._ended_elsewhere)
        intake = Intake(self.rq, self.worker, self.book, self.acker, served, low_water=self._low_water,
                        may_fetch=lambda: not gate.paused, burst=cfg.burst, poll_interval=cfg.poll_interval,
                        wake=self.wake, stopping=self.stopping, on_complete=self._complete_on_arrival,
                        on_runs=self.outbox.unpark,
                        has_room=dispatcher.room_for_work, outages=outages,
                        pack_cache=PackCache(cfg.pack_cache, max_bytes=cfg.pack_cache_bytes)
                        if cfg.pack_cache_bytes > 0 else None, written_here=self.outbox.unshipped_results)
        self._intake = intake
        hedger = self._hedger = Hedger(self.rq, self.conn, self.worker.name, dispatcher,
                              contexts=lambda: served.contexts, tail_runs=intake.tail_runs,
                              stopped=lambda: set(served.paused) | set(served.vanished),
                              clock=self.worker.clock.now, read_reference=intake.read_reference,
                              hungry=intake.hungry, book=self.book)

        t0 = time.monotonic()
        code: int = ExitCode.DONE
        started = False
        log.info("consumer %s starting: pre-flight on endpoint %s for runs %s (`producer status` shows what it "
                 "waits on)", self.worker.name, cfg.endpoint, cfg.run or "(all open)")
        publisher = asyncio.create_task(telemetry.starting(), name="start-up snapshot")
        try:
            try:
                # Start-up waits on the endpoint and on Redis, which may never answer: a stop ends it.
                started = await until(self.stopping, self._start(served, telemetry))
            except Stopped:
                log.info("consumer %s stopping before start-up finished (nothing held)", self.worker.name)
            finally:
                publisher.cancel()
                await asyncio.gather(publisher, return_exceptions=True)
            if started:
                t0 = time.monotonic()
                code = await self._work(dispatcher, intake, leases, telemetry, steering, hedger)
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
        copies = copies_clause(self._hedger.counts() if self._hedger is not None else {})
        log.log(logging.INFO if code == ExitCode.DONE else logging.ERROR,
                "consumer %s stopped after %.1f s: %d items (%d errors), %d jobs acked, %d given back%s, "
                "%.1f items/s (exit %d%s)", self.worker.name, elapsed, items, errors, a.acked, a.given_back, copies,
                items / elapsed if elapsed > 0 else 0.0, code,
                "" if code == ExitCode.DONE else f": {ExitCode(code).name.lower().replace('_', ' ')}, not done")
        return code

    async def _start(self, served: ServedRuns, telemetry: Telemetry) -> bool:
        """Pre-flight, register, ship what an earlier consumer left; each step is the phase its
        snapshot shows (`producer status`: "pre-flight: waiting on the engine ... for 2m 39s").
        False when a --burst consumer has nothing it may serve (every run it would serve refused
        here: a failed pre-flight, another host's output, paused, gone)."""
        try:  # a Redis that evicts keys would drop the runs served here in silence
            await self.rq.call(check_policy, self.conn, warn=lambda line: log.warning("pre-flight: %s", line))
        except RedisEvictsError as e:
            e.exit_code = ExitCode.PREFLIGHT
            raise
        telemetry.set_phase("pre-flight: waiting on the engine (/v1/models)")
        await served.wait_for_models()
        telemetry.set_phase("pre-flight: waiting on the engine (the runs' probe requests)")
        runs = await served.resolve()
        if self.cfg.burst and not runs and served.unfinished():
            return False
        for run in runs:
            telemetry.start_run(run)
        telemetry.set_phase("registering its rq worker")
        await self.rq.call(self.worker.start)
        self._registered = True
        log.info("consumer %s started: endpoint %s, concurrency %s, runs %s", self.worker.name, self.cfg.endpoint,
                 "auto" if self.cfg.auto_concurrency else self.cfg.concurrency, self.cfg.run or "(all open)")
        telemetry.set_phase("shipping an earlier consumer's leftover shards")
        await self._ship_leftovers()
        telemetry.set_phase(None)
        return True

    async def _work(self, dispatcher: Dispatcher, intake: Intake, leases: Leases, telemetry: Telemetry,
                    steering: Steering, hedger: Hedger) -> int:
        """Run every loop until the intake ends (a stop, or a --burst end) and the drain is done."""
        background: dict[str, Callable[[], Awaitable[None]]] = {
            "dispatcher": dispatcher.run, "renewer": leases.renew_forever, "sweeper": leases.sweep_forever,
            "sealer": self._sealer, "shipper": self.outbox.shipper, "telemetry": telemetry.loop,
            "steering": steering.run, "rewind": self._rewind.watch, "hedger": hedger.run,
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
