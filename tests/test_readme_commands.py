"""The README is a test: the commands it tells a user to type run here as written.

Each test reads a code block of the README and runs its lines through bash, in order, against a
private redis-server as REDIS_URL and the stand-in vLLM in place of `vllm serve`. A line is run
verbatim unless SUBSTITUTED names it, with why; a line the test does not know fails it, so a
README that changes its commands without this test following fails CI. (The operations block is
tests/test_operations.py's, the monitoring queries tests/test_grafana.py's.)
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import orjson
import pytest

from tests.conftest import BIN, free_gpu, sharegpt, wait_for, write_jsonl
from tests.consumer.e2e import Sim
from tests.s3server import S3Server, s3_server  # noqa: F401 - fixture

README = (Path(__file__).resolve().parent.parent / "README.md").read_text()

pytestmark = pytest.mark.integration


def block(heading: str, nth: int = 0) -> list[str]:
    """The command lines (comments and continuation-free) of the NTH bash block under HEADING."""
    section = README[README.index(heading + "\n"):]
    for _ in range(nth + 1):
        section = section[section.index("```bash") + len("```bash"):]
    body = section[:section.index("```")]
    lines = [re.sub(r"\s+#.*$", "", line).strip() for line in body.splitlines()]
    return [line for line in lines if line]


class Shell:
    """Runs README lines as a user's shell would: one working directory, one environment."""

    def __init__(self, cwd: Path, env: dict[str, str]) -> None:
        self.cwd = cwd
        self.env = {**os.environ, **env, "PATH": f"{BIN}:{os.environ['PATH']}"}
        self.background: list[subprocess.Popen[bytes]] = []

    def run(self, line: str, *, timeout: float = 180, ok: tuple[int, ...] = (0,)) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(["bash", "-c", line], cwd=self.cwd, env=self.env, capture_output=True, text=True,
                              timeout=timeout, check=False)
        assert done.returncode in ok, f"`{line}` exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
        return done

    def start(self, line: str) -> subprocess.Popen[bytes]:
        with open(self.cwd / f"bg{len(self.background)}.log", "wb") as log:
            proc = subprocess.Popen(["bash", "-c", f"exec {line}"], cwd=self.cwd, env=self.env, stdout=log,
                                    stderr=subprocess.STDOUT)
        self.background.append(proc)
        return proc

    def stop(self) -> None:
        for proc in self.background:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)


def test_quick_start_as_written(tmp_path: Path, redis_url: str) -> None:
    lines = block("## Quick start on a GPU node")
    gpu = free_gpu()
    # Each README line and what the test types for it. Verbatim unless the comment says otherwise.
    as_run = {
        # the head node's Redis is the tests' own: REDIS_URL is set in the shell's environment
        "export REDIS_URL=redis://head-node:6379/0": None,
        "producer enqueue data.jsonl": "producer enqueue data.jsonl",
        # no GPU: the stand-in vLLM serves port 8000+N in vLLM's place (N free here, not 0)
        "vllm serve /models/my-27b --port 8000 &": f"consumer simulate --port {8000 + gpu} --mean-tokens 20 &",
        # a GPU number whose port is free here; --burst so the consumer ends when the run is done
        "consumer run --gpu 0": f"consumer run --gpu {gpu} --burst",
        # --watch redraws until Ctrl-C: the test presses it after a few redraws
        "producer status --run data --watch": "producer status --run data --watch --interval 0.5",
        "producer export --run data --output data.regen.jsonl": "producer export --run data --output data.regen.jsonl",
    }
    assert lines == list(as_run), "the quick start changed: make this test run what it says now"
    write_jsonl(tmp_path / "data.jsonl", [sharegpt(i, turns=1 + i % 2) for i in range(30)])
    sh = Shell(tmp_path, {"REDIS_URL": redis_url})
    try:
        for line in lines:
            typed = as_run[line]
            if typed is None:
                continue
            if typed.endswith("&"):
                sh.start(typed.rstrip("& "))
                wait_for(lambda: sh.run(f"curl -sf http://127.0.0.1:{8000 + gpu}/health", ok=(0, 7)).returncode == 0,
                         30, "the stand-in")
            elif "--watch" in typed:
                watch = sh.start(typed)
                time.sleep(2.5)
                watch.send_signal(signal.SIGINT)
                assert watch.wait(timeout=10) == 0, "Ctrl-C is how --watch is left: not an error"
                screen = (tmp_path / f"bg{len(sh.background) - 1}.log").read_text()
                assert "data" in screen and "Traceback" not in screen, screen
            else:
                done = sh.run(typed)
                assert "Traceback" not in done.stderr, done.stderr
    finally:
        sh.stop()
    rows = [orjson.loads(x) for x in (tmp_path / "data.regen.jsonl").read_bytes().splitlines()]
    assert len(rows) == 30
    spool = tmp_path / "genqueue-spool" / f"gpu{gpu}"
    assert spool.is_dir(), "the README says a consumer's spool is ./genqueue-spool/<gpu>"


def test_consumer_run_block_as_written(tmp_path: Path, redis_url: str) -> None:
    lines = block("## `consumer run`")
    assert lines == ["consumer run --endpoint http://127.0.0.1:8000/v1 [--run NAME] [--concurrency 256] [--burst]",
                     "consumer run --gpu 3"], "the consumer run block changed: make this test run what it says now"
    write_jsonl(tmp_path / "data.jsonl", [sharegpt(i) for i in range(12)])
    sh = Shell(tmp_path, {"REDIS_URL": redis_url})
    sh.run("producer enqueue data.jsonl --batch-size 4")
    gpu = free_gpu()
    sim = Sim(tmp_path, "--mean-tokens", "10")
    try:
        # the synopsis with its options filled in, on the stand-in's port; then --gpu N on 8000+N
        sh.run(f"consumer run --endpoint {sim.url} --run data --concurrency 256 --burst --spool s1")
    finally:
        sim.stop()
    write_jsonl(tmp_path / "more.jsonl", [sharegpt(i) for i in range(100, 104)])
    sh.run("producer enqueue more.jsonl --run data --output genqueue-out")
    sh.start(f"consumer simulate --port {8000 + gpu} --mean-tokens 10")
    try:
        wait_for(lambda: sh.run(f"curl -sf http://127.0.0.1:{8000 + gpu}/health", ok=(0, 7)).returncode == 0,
                 30, "the stand-in")
        done = sh.run(f"consumer run --gpu {gpu} --burst")
        assert f"http://127.0.0.1:{8000 + gpu}/v1" in done.stderr, done.stderr
    finally:
        sh.stop()
    export = sh.run("producer export --run data --output d.jsonl --json")
    assert orjson.loads(export.stdout)["exported"] == 16


def test_runs_block_as_written(tmp_path: Path, redis_url: str) -> None:
    lines = block("## Runs: `producer runs`, `producer resume`, `producer delete`")
    assert lines == ["producer runs [--json]", "producer resume --run NAME",
                     "producer delete --run NAME [--yes] [--purge-output]",
                     "producer delete --run NAME --refused-only"], "the runs block changed"
    write_jsonl(tmp_path / "data.jsonl", [sharegpt(i) for i in range(5)])
    sh = Shell(tmp_path, {"REDIS_URL": redis_url})
    sh.run("producer enqueue data.jsonl")
    assert "data" in sh.run("producer runs").stdout
    assert [orjson.loads(x)["run"] for x in sh.run("producer runs --json").stdout.splitlines()] == ["data"]
    sh.run("producer resume --run data")
    assert "0 refused job(s) cleared" in sh.run("producer delete --run data --refused-only").stdout
    assert "data" in sh.run("producer runs").stdout, "--refused-only keeps the run"
    (tmp_path / "genqueue-out" / "data").mkdir(parents=True, exist_ok=True)
    sh.run("producer delete --run data --yes --purge-output")
    assert "data" not in sh.run("producer runs").stdout.split()
    assert not (tmp_path / "genqueue-out" / "data").exists()


def multi_node_line() -> str:
    """The README's one command for a run several nodes share (in its quick start's prose)."""
    text = " ".join(README[README.index("**More than one node:**"):].split())
    found = re.search(r"`(producer enqueue data\.jsonl --output s3://bucket/prefix)`", text)
    assert found, "the quick start no longer shows the multi-node enqueue line"
    return found[1]


def test_several_nodes_as_written(tmp_path: Path, redis_url: str, s3_server: S3Server) -> None:  # noqa: F811 - fixture
    """More than one node: an s3:// output is served from any host; a local one only from its own."""
    line = multi_node_line()
    write_jsonl(tmp_path / "data.jsonl", [sharegpt(i) for i in range(6)])
    env = {"REDIS_URL": redis_url, **s3_server.env}
    node_a = Shell(tmp_path, {**env, "GENQUEUE_HOST": "node-a"})
    node_b = Shell(tmp_path, {**env, "GENQUEUE_HOST": "node-b"})
    # the test server's bucket in place of the README's `bucket`
    node_a.run(line.replace("s3://bucket/prefix", s3_server.url("prefix")))
    sim = Sim(tmp_path, "--mean-tokens", "5")
    try:
        node_b.run(f"consumer run --endpoint {sim.url} --burst --spool sb")
        assert orjson.loads(node_a.run("producer export --run data --output d.jsonl --json").stdout)["exported"] == 6
        # the default local output belongs to the host that made the run
        write_jsonl(tmp_path / "local.jsonl", [sharegpt(i) for i in range(3)])
        node_a.run("producer enqueue local.jsonl")
        done = node_b.run(f"consumer run --run local --endpoint {sim.url} --burst --spool sl", ok=(2,))
        assert "node-a" in done.stderr and "--shared-fs" in done.stderr and "Traceback" not in done.stderr
    finally:
        sim.stop()
