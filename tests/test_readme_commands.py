"""The README is a test: the commands it tells a user to type run here as written.

Each test reads a code block of the README (or of the docs/ page that holds it) and runs its
lines through bash, in order, against a private redis-server as REDIS_URL and the stand-in vLLM
in place of `vllm serve`. A line is run verbatim unless the test's table names it, with why; a
line the test does not know fails it, so a README that changes its commands without this test
following fails CI. (docs/operations.md's rq block is tests/test_operations.py's, docs/metrics.md's
queries tests/test_grafana.py's; the README's first lines are .ci/run's: tests/test_readme_contract.py.)
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import orjson
import pyarrow.parquet as pq
import pytest
import redis

from genqueue.common.keepers.snapshots import Snapshots
from tests.conftest import BIN, free_gpu, free_port, sharegpt, wait_for, write_jsonl
from tests.consumer.e2e import Sim
from tests.s3server import S3Server, s3_server  # noqa: F401 - fixture

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()

pytestmark = pytest.mark.integration


def block(heading: str, nth: int = 0, page: str = "README.md") -> list[str]:
    """The command lines (comments and continuation-free) of the NTH bash block under HEADING."""
    text = README if page == "README.md" else (ROOT / page).read_text()
    section = text[text.index(heading + "\n"):]
    for _ in range(nth + 1):
        section = section[section.index("```bash") + len("```bash"):]
    body = section[:section.index("```")]
    lines = [re.sub(r"\s+#.*$", "", line).strip() for line in body.splitlines()]
    return [line for line in lines if line]


def has_socket(pid: int) -> bool:
    """Whether process PID holds a socket open (its Redis connection)."""
    try:
        return any(os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:") for fd in os.listdir(f"/proc/{pid}/fd"))
    except OSError:  # a descriptor closed while we looked
        return False


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


def wait_healthy(sh: Shell, port: int) -> None:
    wait_for(lambda: sh.run(f"curl -sf http://127.0.0.1:{port}/health", ok=(0, 7)).returncode == 0, 30, "the stand-in")


def test_install_as_written() -> None:
    """The install block in one shell, in the checkout: setup (a no-op when .venv is current),
    then the activation puts the three commands on PATH."""
    lines = block("## 1. Install")
    assert lines == ["scripts/setup", "scripts/setup --tests", ". .venv/bin/activate"], "the install block changed"
    venv = ROOT / ".venv"
    stamp = venv / ".genqueue-installed"
    want = hashlib.sha256((ROOT / "pyproject.toml").read_bytes()).hexdigest()
    if Path(sys.prefix) != venv or not stamp.exists() or stamp.read_text().strip() != want:
        pytest.skip("scripts/setup would reinstall .venv here: run scripts/setup")
    env = {k: v for k, v in os.environ.items() if k != "GENQUEUE_VENV"}
    script = " && ".join([*lines, "command -v producer consumer rq"])
    done = subprocess.run(["bash", "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
                          check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert [Path(p).name for p in done.stdout.split()] == ["producer", "consumer", "rq"], done.stdout
    assert all(Path(p).parent == venv / "bin" for p in done.stdout.split()), done.stdout


def test_first_run_on_the_sample_as_written(tmp_path: Path, redis_url: str) -> None:
    lines = block("## 2. A first run on the sample")
    port = free_port()
    as_run = {
        # the tests' own Redis (on a free port) is already REDIS_URL in the shell's environment
        'redis-server --port 6380 --bind 127.0.0.1 --save "" --daemonize yes': None,
        "export REDIS_URL=redis://127.0.0.1:6380/0": None,
        # the stand-in on a free port in 8000's place (and the consumer's endpoint with it)
        "consumer simulate --port 8000 --mean-tokens 50 &": f"consumer simulate --port {port} --mean-tokens 50 &",
        "producer enqueue samples/sample.jsonl --run sample": "producer enqueue samples/sample.jsonl --run sample",
        "consumer run --run sample --endpoint http://127.0.0.1:8000/v1 --burst":
            f"consumer run --run sample --endpoint http://127.0.0.1:{port}/v1 --burst",
        "producer status --run sample": "producer status --run sample",
        "producer export --run sample --output sample.regen.jsonl": "producer export --run sample --output sample.regen.jsonl",
    }
    assert lines == list(as_run), "the first run changed: make this test run what it says now"
    (tmp_path / "samples").mkdir()
    shutil.copy(ROOT / "samples" / "sample.jsonl", tmp_path / "samples" / "sample.jsonl")
    shutil.copy(ROOT / "README.md", tmp_path / "README.md")  # run in the checkout, as a user would
    sh = Shell(tmp_path, {"REDIS_URL": redis_url})
    seen: dict[str, str] = {}
    try:
        for line in lines:
            typed = as_run[line]
            if typed is None:
                continue
            if typed.endswith("&"):
                sh.start(typed.rstrip("& "))
                wait_healthy(sh, port)
                continue
            done = sh.run(typed)
            assert "Traceback" not in done.stderr, done.stderr
            seen[line.split()[1]] = done.stdout + done.stderr
    finally:
        sh.stop()
    # what the README says you should see
    enqueue = seen["enqueue"]
    for said in ("records read            247", "enqueued              240", "duplicates            1",
                 "rejected              6", "invalid_json", "not_object", "unknown_role", "items queued            240",
                 "jobs                    8", "estimated output"):
        assert said in enqueue, f"enqueue no longer says {said!r}:\n{enqueue}"
    assert len((tmp_path / "sample.rejects.jsonl").read_text().splitlines()) == 6
    run = seen["run"]
    assert "burst: nothing left to take; stopping" in run and "240 items (0 errors), 8 jobs acked" in run, run
    assert list((tmp_path / "genqueue-out" / "sample" / "shards").glob("*.jsonl"))
    status = seen["status"]
    for said in ("sample.jsonl: 247 of 247 records read (complete), rejected 6",
                 "61 of 241 records have more than one user turn", "conversations complete 240",
                 "temperature 0.6, top_p 0.95, max_tokens 4096", "100.0%: 240 of 240 items; run complete",
                 "240: queued 0, in flight 0, shipping 0, done 240, failed 0",
                 "done 240 = complete 240 (finished) + partial 0 + cut 0"):
        assert said in status, f"status no longer says {said!r}:\n{status}"
    assert re.search(r"^shipping +\d+ shards, ", status, re.MULTILINE), status
    export = seen["export"]
    assert re.search(r"complete +240", export) and re.search(r"missing +0", export), export
    assert re.search(r"exported +240", export), export
    # one row per generated answer: the 355 turns status counted
    assert re.search(r"^rows +355 generation rows from 240 items", export, re.MULTILINE), export
    assert len((tmp_path / "sample.regen.jsonl").read_text().splitlines()) == 355
    for side in ("sample.regen.truncated.jsonl", "sample.regen.errors.jsonl", "sample.regen.missing.txt"):
        assert (tmp_path / side).exists(), side
    # the project's README.md is no dataset card: the card goes beside it, and says so
    assert (tmp_path / "README.md").read_text() == README
    assert re.search(r"^card +.*sample\.regen\.card\.md$", export, re.MULTILINE), export
    card = (tmp_path / "sample.regen.card.md").read_text()
    assert "| conversations (items exported) | 240 |" in card
    for png in ("sample.regen.lengths.png", "sample.regen.generations.png"):
        assert (tmp_path / png).read_bytes().startswith(b"\x89PNG") and f"]({png})" in card


def test_quick_start_as_written(tmp_path: Path, redis_url: str) -> None:
    lines = block("## 3. A real GPU node")
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
    said: dict[str, str] = {}  # each command's stderr
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
                # Ctrl-C once it is drawing (its Redis connection is open, so it is past its
                # imports: on a loaded machine that takes seconds), after a few redraws
                wait_for(lambda: has_socket(watch.pid), 60, "status --watch to connect")
                time.sleep(1.5)
                watch.send_signal(signal.SIGINT)
                assert watch.wait(timeout=10) == 0, "Ctrl-C is how --watch is left: not an error"
                screen = (tmp_path / f"bg{len(sh.background) - 1}.log").read_text()
                assert "data" in screen and "Traceback" not in screen, screen
            else:
                done = sh.run(typed)
                assert "Traceback" not in done.stderr, done.stderr
                said[typed.split()[0]] = said.get(typed.split()[0], "") + done.stderr
    finally:
        sh.stop()
    rows = [orjson.loads(x) for x in (tmp_path / "data.regen.jsonl").read_bytes().splitlines()]
    assert len(rows) == 45  # a row per generated answer: 15 conversations of one user turn, 15 of two
    # the README says a consumer's spool is ./genqueue-spool/<gpu>: all shipped, it was removed at exit
    assert f"spool ./genqueue-spool/gpu{gpu} held nothing to ship: removed" in said["consumer"], said["consumer"]
    assert not (tmp_path / "genqueue-spool" / f"gpu{gpu}").exists()


def test_consumer_run_block_as_written(tmp_path: Path, redis_url: str) -> None:
    lines = block("## `consumer run`", page="docs/consumer.md")
    assert lines == ["consumer run --endpoint http://127.0.0.1:8000/v1 [--run NAME] [--concurrency 256] [--burst]",
                     "consumer run --gpu 3", "consumer run --gpu 0 --engine-gpus 2"], \
        "the consumer run block changed: make this test run what it says now"
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
        # --engine-gpus 2: the same engine, counted as 2 GPUs in the snapshot cost reads
        write_jsonl(tmp_path / "last.jsonl", [sharegpt(i) for i in range(200, 204)])
        sh.run("producer enqueue last.jsonl --run data --output genqueue-out")
        sh.run(f"consumer run --gpu {gpu} --engine-gpus 2 --burst")
    finally:
        sh.stop()
    conn = redis.Redis.from_url(redis_url)
    assert 2 in [r.get("gpus") for r in Snapshots(conn).reports(time.time())], "--engine-gpus 2 is not in the snapshot"
    export = sh.run("producer export --run data --output d.jsonl --json")
    assert orjson.loads(export.stdout)["exported"] == 20


def test_runs_block_as_written(tmp_path: Path, redis_url: str) -> None:
    lines = block("## 7. Recover", nth=1)
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
    """The README's one command for a run several nodes share."""
    lines = block("## 4. Several nodes")
    assert lines == ["producer enqueue data.jsonl --output s3://bucket/prefix"], "the several-nodes block changed"
    return lines[0]


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


def test_several_nodes_on_an_existing_run_offers_no_update_settings_that_cannot_work(tmp_path: Path,
                                                                                    redis_url: str) -> None:
    """Section 4's command on the run section 3 made (`data`, default output).

    old: "... exists with other settings (output); leave those options out to keep the run's, name a new
         run with --run, or add --update-settings ...", and with it: "--update-settings cannot change output"
    new: "error: run 'data' exists with other settings (output); its output cannot change (the run's
         <cwd>/genqueue-out, this command's s3://bucket/prefix: the results already shipped are under the old
         output): leave --output out to keep the run's, or name a new run with --run" """
    (first,) = [line for line in block("## 3. A real GPU node") if line.startswith("producer enqueue")]
    write_jsonl(tmp_path / "data.jsonl", [sharegpt(i) for i in range(6)])
    sh = Shell(tmp_path, {"REDIS_URL": redis_url})
    sh.run(first)
    refused = sh.run(multi_node_line(), ok=(2,))
    assert refused.stderr.splitlines() == [(
        "error: run 'data' exists with other settings (output); its output cannot change (the run's "
        f"{tmp_path}/genqueue-out, this command's s3://bucket/prefix: the results already shipped are under the old "
        "output): leave --output out to keep the run's, or name a new run with --run")], refused.stderr
    # a setting --update-settings can change beside it: still not offered, the output is named
    both = sh.run(multi_node_line() + " --max-tokens 99", ok=(2,)).stderr
    assert "(output, sampling.max_tokens); its output cannot change" in both and "--update-settings" not in both
    # offered where it works, and it does
    offered = sh.run("producer enqueue data.jsonl --max-tokens 99", ok=(2,)).stderr
    assert "add --update-settings" in offered, offered
    assert "settings updated (sampling.max_tokens)" in sh.run("producer enqueue data.jsonl --max-tokens 99 "
                                                              "--update-settings").stderr


def test_one_command_per_node_as_written(tmp_path: Path, redis_url: str) -> None:
    (line,) = block("## 3. A real GPU node", nth=1)
    assert line == "consumer launch --gpus 0-7 --model /models/my-27b", "the launch line changed"
    gpu = free_gpu()
    # no GPUs: one GPU whose port 8000+N is free, the stand-in as its engine, and --burst so
    # launch ends when the run is done (the rest of the line as written)
    typed = line.replace("--gpus 0-7", f"--gpus {gpu}") + " --engine simulate --burst -- --mean-tokens 10"
    write_jsonl(tmp_path / "data.jsonl", [sharegpt(i) for i in range(20)])
    sh = Shell(tmp_path, {"REDIS_URL": redis_url})
    sh.run("producer enqueue data.jsonl")
    done = sh.run(typed, timeout=240)
    assert "Traceback" not in done.stderr, done.stderr
    assert (tmp_path / "genqueue-logs" / f"engine-gpu{gpu}.log").exists(), "the README says logs go to ./genqueue-logs"
    export = sh.run("producer export --run data --output d.jsonl --json")
    assert orjson.loads(export.stdout)["exported"] == 20


def test_export_and_recover_as_written(tmp_path: Path, redis_url: str) -> None:
    lines = block("## 6. Export for your trainer")
    assert lines == [
        "producer export --run data --output data.regen.jsonl",
        "producer export --run data --output data.sg.jsonl --format sharegpt",
        "producer export --run data --output data.sf.jsonl --format specforge",
        "producer export --run data --output data.parquet",
    ], "the export block changed: make this test run what it says now"
    (recover,) = block("## 7. Recover")
    assert recover == "producer enqueue data.jsonl", "the recover block changed"
    write_jsonl(tmp_path / "data.jsonl", [sharegpt(i, turns=1 + i % 2) for i in range(12)])
    sh = Shell(tmp_path, {"REDIS_URL": redis_url})
    sh.run("producer enqueue data.jsonl")
    sim = Sim(tmp_path, "--mean-tokens", "10")
    try:
        sh.run(f"consumer run --endpoint {sim.url} --burst")
    finally:
        sim.stop()
    for line in lines:
        sh.run(line)
    assert len((tmp_path / "data.regen.jsonl").read_text().splitlines()) == 18  # 6 items of 1 answer, 6 of 2
    first = orjson.loads((tmp_path / "data.regen.jsonl").read_text().splitlines()[0])
    assert "messages" in first
    sg = orjson.loads((tmp_path / "data.sg.jsonl").read_text().splitlines()[0])
    assert "conversations" in sg and {t["from"] for t in sg["conversations"]} >= {"human", "gpt"}
    info = orjson.loads((tmp_path / "data.sg.dataset_info.json").read_bytes())
    assert info["data.sg"]["formatting"] == "sharegpt", info
    sf = orjson.loads((tmp_path / "data.sf.jsonl").read_text().splitlines()[0])
    assert {t["role"] for t in sf["conversations"]} >= {"user", "assistant"}, sf
    assert pq.read_table(tmp_path / "data.parquet").num_rows == 18
    # the recover line on a finished run queues nothing again
    again = sh.run(recover)
    assert re.search(r"^  enqueued +0$", again.stdout, re.MULTILINE), again.stdout
    # "an unchanged file of a finished run is hashed, not read again: its summary says `records read 0`"
    assert "is hashed, not read again: its summary says `records read 0`" in " ".join(README.split())
    assert re.search(r"^records read +0  \(.*not read again\)$", again.stdout, re.MULTILINE), again.stdout
    assert re.search(r"^  already done +12$", again.stdout, re.MULTILINE), again.stdout
    # and with a grown input, the same line queues exactly the new items
    write_jsonl(tmp_path / "data.jsonl", [sharegpt(i, turns=1 + i % 2) for i in range(15)])
    grown = sh.run(recover)
    assert re.search(r"^  enqueued +3$", grown.stdout, re.MULTILINE), grown.stdout
