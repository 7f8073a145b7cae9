"""Helpers for end-to-end tests: real processes for the stand-in vLLM and the consumers."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import orjson

from genqueue.common.keepers.items import ItemTable
from tests.conftest import BIN, LIVE_PROCS, free_port, http_text


def _cmd(name: str) -> list[str]:
    exe = BIN / name
    return [str(exe)] if exe.exists() else [sys.executable, "-m", name]


class Proc:
    """A background genqueue process whose output goes to a log file."""

    def __init__(self, name: str, args: list[str], log: Path, env: dict[str, str] | None = None) -> None:
        self.log = log
        self._fh = open(log, "ab")
        self.p = subprocess.Popen([*_cmd(name), *args], stdout=self._fh, stderr=subprocess.STDOUT,
                                  env={**os.environ, **(env or {})})
        LIVE_PROCS.append(self)

    def wait(self, timeout: float = 120) -> int:
        try:
            return self.p.wait(timeout=timeout)
        finally:
            self._fh.close()

    def signal(self, sig: int) -> None:
        if self.p.poll() is None:
            self.p.send_signal(sig)

    def kill(self) -> None:
        self.signal(signal.SIGKILL)
        self.p.wait(timeout=10)
        self._fh.close()

    def output(self) -> str:
        return self.log.read_text(errors="replace")


class Sim:
    """The stand-in vLLM as its own process on a fixed port (so it can die and come back)."""

    def __init__(self, tmp: Path, *args: str, port: int | None = None) -> None:
        self.port = port or free_port()
        self.args = list(args)
        self.tmp = tmp
        self.proc: Proc | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self) -> None:
        self.proc = Proc("consumer", ["simulate", "--port", str(self.port), *self.args], self.tmp / "sim.log")
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=1) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.05)
        output = self.proc.output()
        self.proc.kill()  # a stand-in that never answered is not left running for the next tests
        raise RuntimeError("stand-in did not start:\n" + output)

    def running(self) -> int:
        """Requests on the stand-in's batch now, from its own /metrics (0 if it cannot be read)."""
        text = http_text(f"http://127.0.0.1:{self.port}/metrics", timeout=1)
        if text is None:
            return 0
        return sum(int(float(line.rsplit(" ", 1)[1])) for line in text.splitlines()
                   if line.startswith("vllm:num_requests_running"))

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc = None


def read_results(out: Path, run: str) -> list[dict]:
    recs = []
    for shard in sorted((out / run / "shards").glob("*.jsonl")):
        recs += [orjson.loads(line) for line in shard.read_bytes().splitlines() if line.strip()]
    return recs


def run_keys(conn, run: str) -> set[str]:
    return {k.hex() for k in ItemTable(conn, run).digests()}
