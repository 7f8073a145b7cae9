"""The supervisor behind `consumer launch`: one engine and one consumer per GPU (or per group
of GPUs), kept alive by a plain poll loop in the main thread (signals set flags; /health probes
run in a small thread pool, so nothing blocks for long):

- an engine is started, its consumer once it answers /health; an engine that exits is restarted
  with backoff, its consumer pausing by itself while the endpoint refuses (no job failed);
- an engine that answered /health and then fails it for --engine-hang-timeout, its process
  alive (hung), is killed and restarted the same way;
- an engine that never answers /health is given up after a few starts, its log's last line
  (`No module named 'vllm'`) in launch's own error;
- a consumer that exits non-zero is restarted with backoff once its engine is healthy; one that
  exits 0 (--burst, drained) is done, and when every consumer is done launch stops; one that
  exits 3-8 (--burst: a run refused, failed pre-flight, paused, gone from Redis, or drained with
  errors or items in no job) is done too, its reason logged, and launch exits with the highest
  such code, so a scheduler does not take the job for a success;
- SIGTERM/SIGINT: every consumer drains, then the engines stop (SIGTERM, then SIGKILL); a
  second signal SIGKILLs everything at once.

Every child runs in its own process group, so vLLM's engine-core processes go with it, and a
terminal's Ctrl-C reaches only launch, which stops the children in order."""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from genqueue.common.contracts import ExitCode
from genqueue.common.errors import UserError
from genqueue.consumer.launch.children import Child, Probe, health_ok, last_line, port_in_use
from genqueue.consumer.launch.plan import (
    DRAIN_SLACK,
    ENGINE_STOP_GRACE,
    MAX_START_FAILURES,
    STABLE_AFTER,
    Group,
    LaunchConfig,
    consumer_argv,
    consumer_env,
    engine_argv,
    engine_env,
    restart_delay,
)

log = logging.getLogger("genqueue.consumer.launch")

#: Seconds between looks at the children: an exit is seen within a fifth of a second, at negligible CPU.
POLL = 0.2
#: Seconds between health checks of a launched engine: a dead engine is found within a second.
HEALTH_EVERY = 1.0

#: Consumer exits that no restart can change (consumer/cli.py's codes), and what each means.
NOT_RESTARTED = {
    ExitCode.REFUSED: "a run is not served on this host (its output is another host's local path)",
    ExitCode.PREFLIGHT: "a run failed the consumer's pre-flight (fix it with `producer enqueue ... --update-settings`)",
    ExitCode.PAUSED: "a run is paused (fix the cause, then `producer resume --run NAME`)",
    ExitCode.VANISHED: "a run is gone from Redis (its results stay in the spool until the run is re-created)",
    ExitCode.FAILED_ITEMS: "items of a run ended as errors (fix the cause, then `producer enqueue ... --retry-failed`)",
    ExitCode.INCOMPLETE: "a run drained with items in no job (the consumer's log says where, and what queues them)",
}


@dataclass
class Slot:
    """One engine (one GPU or a group) and its consumer."""

    group: Group
    engine: Child
    consumer: Child
    probe: Probe
    healthy_since: float | None = None
    failing_since: float | None = None
    ever_healthy: bool = False
    health_deadline: float = 0.0
    next_probe: float = 0.0
    done: bool = False
    given_up: bool = False

    @property
    def name(self) -> str:
        return self.group.name


def hang_probe_timing(hang_timeout: float) -> tuple[float, float]:
    """(seconds between /health probes of a healthy engine, each probe's timeout) for a hang timeout."""
    return max(0.5, min(5.0, hang_timeout / 4)), max(1.0, min(5.0, hang_timeout / 2))


class Supervisor:
    """Runs the plan until the consumers are done or a signal stops it; returns the exit code."""

    def __init__(self, cfg: LaunchConfig) -> None:
        self.cfg = cfg
        self.signals = 0
        self.exit_code = 0
        self.unfinished = 0  # the highest NOT_RESTARTED code a consumer exited with
        base_env = dict(os.environ)
        cfg.log_dir.mkdir(parents=True, exist_ok=True)
        groups = cfg.groups()
        self.pool = ThreadPoolExecutor(max_workers=min(len(groups), 64), thread_name_prefix="health")
        self.slots = [
            Slot(g, Child(f"engine-{g.name}", engine_argv(cfg, g), engine_env(cfg, g, base_env),
                          cfg.log_dir / f"engine-{g.name}.log"),
                 Child(f"consumer-{g.name}", consumer_argv(cfg, g), consumer_env(cfg, base_env),
                       cfg.log_dir / f"consumer-{g.name}.log"),
                 Probe(self.pool, cfg.health_url(g)))
            for g in groups
        ]
        self.probe_every, self.probe_timeout = hang_probe_timing(cfg.engine_hang_timeout)
        self.pids_path = cfg.log_dir / "pids.json"
        self._last_pids = ""

    # --- entry ---------------------------------------------------------------------
    def run(self) -> int:
        busy = [f"{self.cfg.port(s.group)} ({s.name})" for s in self.slots if port_in_use(self.cfg.port(s.group))]
        if busy:
            raise UserError(f"port {', '.join(busy)} already in use: another engine running? choose --base-port")
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        log.info("launch: %d engine(s) on GPU(s) %s, engine %s, ports %d+, logs in %s", len(self.slots),
                 ", ".join(s.group.cuda_visible_devices for s in self.slots), self.cfg.engine, self.cfg.base_port,
                 self.cfg.log_dir)
        try:
            while not self.signals and not self._finished():
                now = time.monotonic()
                for slot in self.slots:
                    self._tick(slot, now)
                self._write_pids()
                time.sleep(POLL)
            self._shutdown()
        except BaseException:
            self._kill_all()  # never leave GPUs held by orphans
            raise
        finally:
            if self.signals > 1:
                self._kill_all()
            self.pids_path.unlink(missing_ok=True)
            self.pool.shutdown(wait=False, cancel_futures=True)
        log.info("launch stopped (exit %d)", self.exit_code)
        return self.exit_code

    def _on_signal(self, sig: int, _frame: Any) -> None:
        self.signals += 1
        if self.signals == 1:
            log.warning("%s: draining the consumers, then stopping the engines", signal.Signals(sig).name)
        else:
            log.warning("second signal: killing everything now")
            self.exit_code = 1
            self._kill_all()

    def _finished(self) -> bool:
        if self.exit_code:
            return True
        live = [s for s in self.slots if not s.given_up]
        if not live:
            log.error("every engine failed to start: giving up (see the engine logs in %s)", self.cfg.log_dir)
            self.exit_code = 1
            return True
        if all(s.done for s in live):
            log.info("every consumer finished")
            self.exit_code = self.unfinished
            return True
        return False

    # --- one step per engine -------------------------------------------------------
    def _tick(self, slot: Slot, now: float) -> None:
        if slot.given_up:
            return
        self._tick_engine(slot, now)
        if not slot.done and not slot.given_up:
            self._tick_consumer(slot, now)

    def _tick_engine(self, slot: Slot, now: float) -> None:
        eng = slot.engine
        code = eng.poll()
        if code is not None:
            self._engine_failed(slot, now, f"exited with code {code} after {now - eng.started:.0f} s")
            return
        if not eng.running:
            if now >= eng.next_start:
                try:
                    eng.start()
                except OSError as e:
                    self._engine_failed(slot, now, f"could not start: {e}")
                    return
                slot.health_deadline = now + self.cfg.engine_start_timeout
                slot.next_probe = now
            return
        answer = slot.probe.answer()
        if answer is not None:
            self._heard(slot, now, answer)
        watching = slot.healthy_since is None or self.cfg.engine_hang_timeout > 0
        if watching and slot.probe.idle and now >= slot.next_probe:
            loading = slot.healthy_since is None
            slot.probe.ask(now, 1.0 if loading else self.probe_timeout)
            slot.next_probe = now + (HEALTH_EVERY if loading else self.probe_every)
        if slot.healthy_since is None:
            if now > slot.health_deadline:
                self._engine_failed(slot, now, f"did not answer /health within {self.cfg.engine_start_timeout:.0f} s",
                                    kill=True)
        elif slot.failing_since is not None and now - slot.failing_since >= self.cfg.engine_hang_timeout:
            self._engine_failed(slot, now, f"is alive but has failed /health for {now - slot.failing_since:.0f} s: "
                                           "hung; killed", kill=True)
        elif eng.failures and now - slot.healthy_since > STABLE_AFTER:
            eng.failures = 0

    def _heard(self, slot: Slot, now: float, ok: bool) -> None:
        """A /health answer from a running engine."""
        eng = slot.engine
        if ok:
            if slot.healthy_since is None:
                slot.healthy_since = now
                slot.ever_healthy = True
                log.info("%s healthy after %.1f s on port %d", eng.name, now - eng.started, self.cfg.port(slot.group))
            elif slot.failing_since is not None:
                log.info("%s answers /health again after %.0f s", eng.name, now - slot.failing_since)
                slot.failing_since = None
        elif slot.healthy_since is not None and slot.failing_since is None:
            slot.failing_since = slot.probe.asked_at
            log.warning("%s is alive but fails /health; restarted if that lasts %.0f s", eng.name,
                        self.cfg.engine_hang_timeout)

    def _engine_failed(self, slot: Slot, now: float, why: str, *, kill: bool = False) -> None:
        eng = slot.engine
        if kill:
            eng.kill()
        slot.healthy_since = slot.failing_since = None
        slot.probe.forget()
        eng.failures += 1
        if not slot.ever_healthy and eng.failures >= MAX_START_FAILURES:
            line = last_line(eng.log_path)
            log.error("%s %s; %d failed starts in a row, giving up on %s (see %s)%s", eng.name, why, eng.failures,
                      slot.name, eng.log_path, f"; its log ends: {line}" if line else "")
            slot.given_up = True
            slot.consumer.terminate()
            return
        delay = restart_delay(eng.failures)
        eng.next_start = now + delay
        waiting = " (its consumer pauses meanwhile)" if slot.consumer.running else ""
        log.warning("%s %s; restarting in %.0f s%s (see %s)", eng.name, why, delay, waiting, eng.log_path)

    def _tick_consumer(self, slot: Slot, now: float) -> None:
        con = slot.consumer
        code = con.poll()
        if code == 0:
            log.info("%s finished (exit 0)", con.name)
            slot.done = True
            return
        if code in NOT_RESTARTED:
            log.error("%s exited %d: %s; not restarting it (see %s)", con.name, code, NOT_RESTARTED[ExitCode(code)],
                      con.log_path)
            slot.done = True
            self.unfinished = max(self.unfinished, code)
            return
        if code is not None:
            if code == 2 and health_ok(self.cfg.health_url(slot.group)):
                log.error("%s exited 2 with its engine healthy: a configuration mistake, stopping (see %s)",
                          con.name, con.log_path)
                self.exit_code = 2
                return
            con.failures += 1
            delay = restart_delay(con.failures)
            con.next_start = now + delay
            log.warning("%s exited with code %d; restarting in %.0f s (see %s)", con.name, code, delay, con.log_path)
            return
        if con.running:
            if con.failures and now - con.started > STABLE_AFTER:
                con.failures = 0
        elif slot.healthy_since is not None and now >= con.next_start:
            try:
                con.start()
            except OSError as e:
                con.failures += 1
                con.next_start = now + restart_delay(con.failures)
                log.error("%s could not start: %s", con.name, e)

    # --- stopping ------------------------------------------------------------------
    def _shutdown(self) -> None:
        consumers = [s.consumer for s in self.slots if s.consumer.running]
        for c in consumers:
            c.terminate()
        deadline = time.monotonic() + self.cfg.drain_timeout + DRAIN_SLACK
        self._wait(consumers, deadline)
        if self.signals > 1:
            return
        for c in consumers:
            if c.running:
                log.error("%s did not drain in time: killing it (its leases expire and its jobs return)", c.name)
                c.kill_group()
        self._wait(consumers, time.monotonic() + 5)
        engines = [s.engine for s in self.slots if s.engine.running]
        for e in engines:
            e.terminate()
        self._wait(engines, time.monotonic() + ENGINE_STOP_GRACE)
        if self.signals > 1:
            return
        for e in engines:
            if e.running:
                log.warning("%s ignored SIGTERM for %.0f s: killing it", e.name, ENGINE_STOP_GRACE)
                e.kill_group()
        self._wait(engines, time.monotonic() + 5)

    def _wait(self, children: list[Child], deadline: float) -> None:
        while self.signals < 2 and time.monotonic() < deadline:
            for c in children:
                code = c.poll()
                if code is not None:
                    log.info("%s exited with code %d", c.name, code)
            if not any(c.running for c in children):
                return
            time.sleep(POLL)

    def _kill_all(self) -> None:
        for s in self.slots:
            for c in (s.consumer, s.engine):
                c.kill_group()

    def _write_pids(self) -> None:
        data = {"supervisor": os.getpid(),
                "gpus": {s.group.key: {"port": self.cfg.port(s.group), "gpus": list(s.group.gpus),
                                       "engine": s.engine.pid, "consumer": s.consumer.pid,
                                       "engine_healthy": s.healthy_since is not None and s.failing_since is None}
                         for s in self.slots}}
        text = json.dumps(data, sort_keys=True)
        if text == self._last_pids:
            return
        tmp = self.pids_path.with_suffix(".tmp")
        tmp.write_text(text)
        tmp.replace(self.pids_path)
        self._last_pids = text
