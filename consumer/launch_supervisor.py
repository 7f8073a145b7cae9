"""The supervisor behind `consumer launch`: one engine and one consumer per GPU, kept alive.

A plain poll loop in the main thread (signals set flags; nothing blocks for long):

- an engine is started, and its consumer only once the engine answers /health;
- an engine that exits is restarted with backoff; its consumer keeps running and pauses by
  itself while the endpoint refuses connections, so no job is failed or dropped meanwhile;
- a consumer that exits non-zero is restarted with backoff once its engine is healthy;
  one that exits 0 (--burst, drained) is done, and when every consumer is done launch stops;
- SIGTERM/SIGINT: every consumer drains (SIGTERM), then the engines stop (SIGTERM, then
  SIGKILL). A second signal SIGKILLs everything at once.

Every child runs in its own process group, so vLLM's engine-core processes go with it, and a
terminal's Ctrl-C reaches only launch, which stops the children in order.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from genqueue.common.errors import UserError
from genqueue.consumer.launch_plan import (
    DRAIN_SLACK,
    ENGINE_STOP_GRACE,
    MAX_START_FAILURES,
    STABLE_AFTER,
    LaunchConfig,
    consumer_argv,
    consumer_env,
    engine_argv,
    engine_env,
    restart_delay,
)

log = logging.getLogger("genqueue.consumer.launch")

POLL = 0.2
HEALTH_EVERY = 1.0


def _die_with_parent() -> None:
    """In the child: get SIGTERM if launch itself dies (even by SIGKILL), so no engine is orphaned."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class Child:
    """One supervised process writing to its own log file, in its own process group."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], log_path: Path) -> None:
        self.name = name
        self.argv = argv
        self.env = env
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None
        self.started = 0.0
        self.failures = 0
        self.next_start = 0.0
        self._fh: IO[bytes] | None = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    def start(self) -> None:
        self._fh = open(self.log_path, "ab")  # noqa: SIM115 - held while the child lives, closed in its end
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        self._fh.write(f"=== {stamp} launch: starting {self.name}: {' '.join(self.argv)}\n".encode())
        self._fh.flush()
        try:
            self.proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=self._fh,
                                         stderr=subprocess.STDOUT, env=self.env, start_new_session=True,
                                         preexec_fn=_die_with_parent)  # noqa: PLW1509 - one prctl call
        except OSError:
            self._fh.close()
            self._fh = None
            raise
        self.started = time.monotonic()
        log.info("%s started (pid %d)", self.name, self.proc.pid)

    def poll(self) -> int | None:
        """The exit code if the process has just exited (then it is forgotten), else None."""
        if self.proc is None:
            return None
        code = self.proc.poll()
        if code is None:
            return None
        self.kill_group()  # whatever it left behind (vLLM's engine core) goes with it
        self.proc = None
        if self._fh is not None:
            self._fh.close()
            self._fh = None
        return code

    def terminate(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL the process group now and reap the process."""
        self.kill_group()
        if self.proc is not None:
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                log.error("%s (pid %d) survived SIGKILL for 10 s", self.name, self.proc.pid)
        self.poll()

    def kill_group(self) -> None:
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


@dataclass
class Gpu:
    index: int
    engine: Child
    consumer: Child
    healthy_since: float | None = None
    ever_healthy: bool = False
    health_deadline: float = 0.0
    last_health: float = 0.0
    done: bool = False
    given_up: bool = False


def health_ok(url: str, timeout: float = 1.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return bool(r.status == 200)
    except (OSError, urllib.error.URLError, ValueError):
        return False


def port_in_use(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


class Supervisor:
    """Runs the plan until the consumers are done or a signal stops it; returns the exit code."""

    def __init__(self, cfg: LaunchConfig) -> None:
        self.cfg = cfg
        self.signals = 0
        self.exit_code = 0
        base_env = dict(os.environ)
        cfg.log_dir.mkdir(parents=True, exist_ok=True)
        self.gpus = [
            Gpu(g, Child(f"engine-gpu{g}", engine_argv(cfg, g), engine_env(cfg, g, base_env),
                         cfg.log_dir / f"engine-gpu{g}.log"),
                Child(f"consumer-gpu{g}", consumer_argv(cfg, g), consumer_env(cfg, base_env),
                      cfg.log_dir / f"consumer-gpu{g}.log"))
            for g in cfg.gpus
        ]
        self.pids_path = cfg.log_dir / "pids.json"
        self._last_pids = ""

    # --- entry ---------------------------------------------------------------------
    def run(self) -> int:
        busy = [f"{self.cfg.port(g.index)} (gpu {g.index})" for g in self.gpus if port_in_use(self.cfg.port(g.index))]
        if busy:
            raise UserError(f"port {', '.join(busy)} already in use: another engine running? choose --base-port")
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        log.info("launch: %d GPU(s) %s, engine %s, ports %d+, logs in %s", len(self.gpus), self.cfg.gpus,
                 self.cfg.engine, self.cfg.base_port, self.cfg.log_dir)
        try:
            while not self.signals and not self._finished():
                now = time.monotonic()
                for gpu in self.gpus:
                    self._tick(gpu, now)
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
        live = [g for g in self.gpus if not g.given_up]
        if not live:
            log.error("every engine failed to start: giving up (see the engine logs in %s)", self.cfg.log_dir)
            self.exit_code = 1
            return True
        if all(g.done for g in live):
            log.info("every consumer finished")
            return True
        return False

    # --- one step per GPU ----------------------------------------------------------
    def _tick(self, gpu: Gpu, now: float) -> None:
        if gpu.given_up:
            return
        self._tick_engine(gpu, now)
        if not gpu.done and not gpu.given_up:
            self._tick_consumer(gpu, now)

    def _tick_engine(self, gpu: Gpu, now: float) -> None:
        eng = gpu.engine
        code = eng.poll()
        if code is not None:
            up = now - eng.started
            gpu.healthy_since = None
            self._engine_failed(gpu, now, f"exited with code {code} after {up:.0f} s")
            return
        if not eng.running:
            if now >= eng.next_start:
                try:
                    eng.start()
                except OSError as e:
                    self._engine_failed(gpu, now, f"could not start: {e}")
                    return
                gpu.health_deadline = now + self.cfg.engine_start_timeout
            return
        if gpu.healthy_since is None:
            if now - gpu.last_health < HEALTH_EVERY:
                return
            gpu.last_health = now
            if health_ok(self.cfg.health_url(gpu.index)):
                gpu.healthy_since = now
                gpu.ever_healthy = True
                log.info("%s healthy after %.1f s on port %d", eng.name, now - eng.started, self.cfg.port(gpu.index))
            elif now > gpu.health_deadline:
                eng.kill()
                self._engine_failed(gpu, now, f"did not answer /health within {self.cfg.engine_start_timeout:.0f} s")
        elif eng.failures and now - gpu.healthy_since > STABLE_AFTER:
            eng.failures = 0

    def _engine_failed(self, gpu: Gpu, now: float, why: str) -> None:
        eng = gpu.engine
        eng.failures += 1
        if not gpu.ever_healthy and eng.failures >= MAX_START_FAILURES:
            log.error("%s %s; %d failed starts in a row, giving up on gpu %d (see %s)", eng.name, why,
                      eng.failures, gpu.index, eng.log_path)
            gpu.given_up = True
            gpu.consumer.terminate()
            return
        delay = restart_delay(eng.failures)
        eng.next_start = now + delay
        waiting = " (its consumer pauses meanwhile)" if gpu.consumer.running else ""
        log.warning("%s %s; restarting in %.0f s%s (see %s)", eng.name, why, delay, waiting, eng.log_path)

    def _tick_consumer(self, gpu: Gpu, now: float) -> None:
        con = gpu.consumer
        code = con.poll()
        if code == 0:
            log.info("%s finished (exit 0)", con.name)
            gpu.done = True
            return
        if code is not None:
            if code == 2 and health_ok(self.cfg.health_url(gpu.index)):
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
        elif gpu.healthy_since is not None and now >= con.next_start:
            try:
                con.start()
            except OSError as e:
                con.failures += 1
                con.next_start = now + restart_delay(con.failures)
                log.error("%s could not start: %s", con.name, e)

    # --- stopping ------------------------------------------------------------------
    def _shutdown(self) -> None:
        consumers = [g.consumer for g in self.gpus if g.consumer.running]
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
        engines = [g.engine for g in self.gpus if g.engine.running]
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
        for g in self.gpus:
            for c in (g.consumer, g.engine):
                c.kill_group()

    def _write_pids(self) -> None:
        data = {"supervisor": os.getpid(),
                "gpus": {str(g.index): {"port": self.cfg.port(g.index), "engine": g.engine.pid,
                                        "consumer": g.consumer.pid, "engine_healthy": g.healthy_since is not None}
                         for g in self.gpus}}
        text = json.dumps(data, sort_keys=True)
        if text == self._last_pids:
            return
        tmp = self.pids_path.with_suffix(".tmp")
        tmp.write_text(text)
        tmp.replace(self.pids_path)
        self._last_pids = text
