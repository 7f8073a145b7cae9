"""`consumer launch`: the plan as pure functions, then the supervisor with the stand-in engine,
real redis-server and real processes (`python -m consumer.launch.command`)."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from genqueue.common import defaults
from genqueue.common.acceptance import PER_REQUEST_SPEC_FLAG
from genqueue.common.cli import ConsumerArgs
from genqueue.common.keepers.rqaccess import queue_for
from genqueue.common.keepers.snapshots import Snapshots
from genqueue.consumer.launch.command import launch_command
from genqueue.consumer.launch.plan import (
    Group,
    LaunchConfig,
    consumer_argv,
    consumer_env,
    engine_argv,
    engine_env,
    group_gpus,
    parse_gpus,
    reserved_arg,
    resolve_engine_cmd,
    restart_delay,
)
from genqueue.consumer.launch.supervisor import hang_probe_timing
from tests.conftest import cli, free_port, sharegpt, write_jsonl
from tests.consumer.e2e import read_results, run_keys


# --- the plan (pure) -------------------------------------------------------------------
@pytest.mark.parametrize("spec, gpus", [
    ("0-7", list(range(8))), ("0,2,5", [0, 2, 5]), ("3", [3]), ("0-3,6", [0, 1, 2, 3, 6]),
    ("5,1", [1, 5]), (" 0 , 1 ", [0, 1]), ("2-2", [2]),
])
def test_parse_gpus(spec, gpus):
    assert parse_gpus(spec) == gpus


@pytest.mark.parametrize("spec, msg", [
    ("", "empty"), ("0,,1", "empty"), ("a", "neither"), ("-1", "neither"), ("1-", "neither"), ("3-1", "backwards"),
    ("0-2,1", "twice"), ("1024", "out of range"), ("0-7-9", "neither"), ("1.5", "neither"),
])
def test_parse_gpus_refuses(spec, msg):
    with pytest.raises(ValueError, match=msg):
        parse_gpus(spec)


def test_restart_delay_doubles_up_to_the_cap():
    assert [restart_delay(n) for n in range(9)] == [0, 1, 2, 4, 8, 16, 32, 60, 60]
    assert restart_delay(10_000) == 60


def g(*gpus: int) -> Group:
    return Group(tuple(gpus))


def test_vllm_command_line_passes_extra_args_untouched():
    spec = '{"method": "eagle3", "model": "/m/draft", "num_speculative_tokens": 3}'
    cfg = LaunchConfig(gpus=[0, 3], model="/models/q27b", engine_args=["--speculative-config", spec, "--seed", "1"])
    assert engine_argv(cfg, g(3)) == ["vllm", "serve", "/models/q27b", "--host", "127.0.0.1", "--port", "8003",
                                      "--per-request-spec-decode-metrics", "summary",
                                      "--speculative-config", spec, "--seed", "1"]
    # a speculating engine answers with its per-request figures; one that sets the flag keeps its own
    own = LaunchConfig(gpus=[0], model="/m", engine_args=[f"--speculative-config={spec}",
                                                          "--per-request-spec-decode-metrics=detailed"])
    assert engine_argv(own, g(0)) == ["vllm", "serve", "/m", "--host", "127.0.0.1", "--port", "8000",
                                      f"--speculative-config={spec}", "--per-request-spec-decode-metrics=detailed"]
    assert "--per-request-spec-decode-metrics" not in engine_argv(LaunchConfig(gpus=[0], model="/m"), g(0))
    sim = LaunchConfig(gpus=[0], engine="simulate", engine_args=["--spec-tokens", "3"])
    assert engine_argv(sim, g(0))[-4:] == ["--per-request-spec-decode-metrics", "summary", "--spec-tokens", "3"]
    named = LaunchConfig(gpus=[0], model="/m", served_model_name="q", vllm_cmd="/opt/v/bin/python -m "
                         "vllm.entrypoints.openai.api_server", base_port=9000)
    assert engine_argv(named, g(0)) == ["/opt/v/bin/python", "-m", "vllm.entrypoints.openai.api_server", "--model",
                                        "/m", "--host", "127.0.0.1", "--port", "9000", "--served-model-name", "q"]
    with pytest.raises(ValueError, match="--model"):
        engine_argv(LaunchConfig(gpus=[0]), g(0))


def test_groups_of_gpus_one_engine_each():
    assert group_gpus([0, 1, 2, 3], 2) == [g(0, 1), g(2, 3)]
    assert group_gpus([0, 2, 4, 6], 2) == [g(0, 2), g(4, 6)]
    assert group_gpus([5], 1) == [g(5)]
    assert [x.key for x in group_gpus(list(range(8)), 4)] == ["0-3", "4-7"]
    assert (g(0, 2).key, g(0, 2).name, g(0, 2).cuda_visible_devices) == ("0+2", "gpu0+2", "0,2")
    assert (g(3).key, g(3).name) == ("3", "gpu3")
    with pytest.raises(ValueError, match="do not split into engines of 4"):
        group_gpus([0, 1, 2, 3, 4, 5], 4)


def test_tensor_and_data_parallel_engines():
    tp = LaunchConfig(gpus=list(range(8)), model="/m", gpus_per_engine=2, redis_url="redis://h/0")
    groups = tp.groups()
    assert groups == [g(0, 1), g(2, 3), g(4, 5), g(6, 7)]
    argv = engine_argv(tp, groups[1])
    assert argv[:3] == ["vllm", "serve", "/m"] and argv[argv.index("--port") + 1] == "8002"
    assert argv[argv.index("--tensor-parallel-size") + 1] == "2" and "--data-parallel-size" not in argv
    assert engine_env(tp, groups[1], {"CUDA_VISIBLE_DEVICES": "0"})["CUDA_VISIBLE_DEVICES"] == "2,3"
    con = consumer_argv(tp, groups[1])
    assert con[con.index("--gpu") + 1] == "2" and con[con.index("--spool") + 1] == "genqueue-spool/gpu2-3"
    assert con[con.index("--engine-gpus") + 1] == "2"  # GPU-hours count the engine's GPUs (producer/status/cost.py)
    assert con[con.index("--endpoint") + 1] == "http://127.0.0.1:8002/v1" and "--max-concurrency" not in con

    dp = LaunchConfig(gpus=list(range(8)), model="/m", data_parallel=4, gpus_per_engine=2)
    (one,) = dp.groups()
    argv = engine_argv(dp, one)
    assert argv[argv.index("--tensor-parallel-size") + 1] == "2" and argv[argv.index("--data-parallel-size") + 1] == "4"
    assert engine_env(dp, one, {})["CUDA_VISIBLE_DEVICES"] == "0,1,2,3,4,5,6,7"
    con = consumer_argv(dp, one)
    assert con[con.index("--engine-gpus") + 1] == "8"
    assert con[con.index("--max-concurrency") + 1] == str(4 * defaults.MAX_CONCURRENCY)
    dp.consumer_args = "--max-concurrency 300"
    assert consumer_argv(dp, one).count("--max-concurrency") == 1 and consumer_argv(dp, one)[-1] == "300"
    assert reserved_arg(["--seed", "1", "--tensor-parallel-size=2"]) == ("--tensor-parallel-size", "--gpus-per-engine")
    assert reserved_arg(["-dp", "2"]) == ("-dp", "--data-parallel") and reserved_arg(["--seed", "1"]) is None


def test_engine_command_is_found_or_named_before_anything_starts():
    on_path = {"vllm": "/usr/bin/vllm", "python3": "/usr/bin/python3", "/opt/v/bin/python": "/opt/v/bin/python"}
    which = on_path.get
    with_vllm = {"/opt/v/bin/python"}

    def has(python: str, module: str) -> bool:
        assert module == "vllm"
        return python in with_vllm

    assert resolve_engine_cmd(None, which, has) == ["/usr/bin/vllm", "serve"]
    assert resolve_engine_cmd("/opt/v/bin/python -m vllm.entrypoints.openai.api_server", which, has) == [
        "/opt/v/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    with pytest.raises(LookupError, match="/usr/bin/python3 has no module named 'vllm'"):
        resolve_engine_cmd("python3 -m vllm.entrypoints.openai.api_server", which, has)
    with pytest.raises(LookupError, match="no such executable 'nope'"):
        resolve_engine_cmd("nope serve", which, has)
    with pytest.raises(LookupError, match="`vllm` is not on PATH.*--vllm-cmd"):
        resolve_engine_cmd(None, {}.get, has)
    with pytest.raises(LookupError, match="empty"):
        resolve_engine_cmd("  ", which, has)


def test_simulate_command_line_and_environments():
    cfg = LaunchConfig(gpus=[1], engine="simulate", base_port=7000, engine_args=["--slots", "4"])
    assert engine_argv(cfg, g(1)) == [sys.executable, "-m", "genqueue.consumer", "simulate", "--port", "7001",
                                      "--slots", "4"]
    cfg.served_model_name = "tiny"
    assert engine_argv(cfg, g(1))[6:8] == ["--model", "tiny"]
    base = {"PATH": "/bin", "CUDA_VISIBLE_DEVICES": "0,1,2"}
    assert engine_env(cfg, g(1), base)["CUDA_VISIBLE_DEVICES"] == "1"
    cfg.devices = "cpu"
    assert engine_env(cfg, g(1), base) == base


def test_consumer_command_line():
    shared = ConsumerArgs(run_name="data", concurrency="64", lease=10, drain_timeout=20, burst=True)
    cfg = LaunchConfig(gpus=[2], base_port=8100, consumer=shared,
                       spool_root=Path("/s"), consumer_args="--shard-max-age 5", redis_url="redis://:pw@h:6379/0",
                       metrics_base_port=9400)
    argv = consumer_argv(cfg, g(2))
    assert argv[:3] == [sys.executable, "-m", "genqueue.consumer"]
    assert argv[3:] == ["-v", "run", "--gpu", "2", "--engine-gpus", "1", "--endpoint", "http://127.0.0.1:8102/v1", "--spool", "/s/gpu2",
                        "--run", "data", "--concurrency", "64", "--lease", "10", "--drain-timeout", "20", "--burst",
                        "--metrics-port", "9402", "--shard-max-age", "5"]
    assert "pw" not in " ".join(argv)
    assert consumer_env(cfg, {"A": "1", "GENQUEUE_METRICS_PORT": "9100"}) == {"A": "1", "REDIS_URL": "redis://:pw@h:6379/0"}
    plain = consumer_argv(LaunchConfig(gpus=[0]), g(0))
    assert not {"--run", "--concurrency", "--burst", "--metrics-port", "--lease", "--drain-timeout",
                "--max-concurrency"} & set(plain)
    # the consumer's own defaults are not repeated on its command line
    at_defaults = ConsumerArgs(run_name=None, concurrency=defaults.CONCURRENCY_OPTION, lease=defaults.LEASE_SECONDS,
                               drain_timeout=defaults.DRAIN_TIMEOUT, burst=False)
    same = consumer_argv(LaunchConfig(gpus=[0], consumer=at_defaults), g(0))
    assert same == plain


def test_hang_probes_are_frequent_and_short_enough_to_see_a_hang_in_time():
    assert hang_probe_timing(120) == (5.0, 5.0)
    every, timeout = hang_probe_timing(3)
    assert every + timeout < 3 and every >= 0.5 and timeout >= 1


@pytest.mark.parametrize("args, msg", [
    (["--gpus", "3-1", "--engine", "simulate"], "backwards"),
    (["--gpus", "0"], "--model is required"),
    (["--gpus", "0", "--model", "m", "--vllm-cmd", "no-such-vllm-binary serve"], "no such executable"),
    (["--gpus", "0", "--engine", "simulate", "--run", "bad name!"], "run"),
    (["--gpus", "0", "--engine", "simulate", "--consumer-args", "'open"], "--consumer-args"),
    (["--gpus", "0-9", "--engine", "simulate", "--base-port", "65530"], "65535"),
    (["--gpus", "0", "--engine", "simulate", "-c", "lots"], "number or auto"),
    (["--gpus", "0", "--engine", "simulate", "-c", "0"], "number or auto"),
    (["--gpus", "0-2", "--engine", "simulate", "--gpus-per-engine", "2"], "3 GPU(s) do not split into engines of 2"),
    (["--gpus", "0-3", "--engine", "simulate", "--gpus-per-engine", "2", "--data-parallel", "4"], "engines of 8"),
    (["--gpus", "0-1", "--engine", "simulate", "--", "--tensor-parallel-size", "2"], "use --gpus-per-engine"),
    (["--gpus", "0-1", "--model", "m", "--", "-dp=2"], "use --data-parallel"),
    (["--gpus", "0", "--model", "m", "--vllm-cmd", f"{sys.executable} -m vllm.entrypoints.openai.api_server"],
     f"{sys.executable} has no module named 'vllm'"),
])
def test_cli_refuses_mistakes_in_one_line(args, msg, tmp_path):
    assert importlib.util.find_spec("vllm") is None, "the test environment must not have vLLM"
    res = CliRunner().invoke(launch_command, [*args, "--log-dir", str(tmp_path / "logs")])
    assert res.exit_code == 2, res.output
    assert msg in res.output and "Traceback" not in res.output
    lines = res.output.strip().splitlines()
    assert msg in lines[-1]
    assert lines == [lines[-1]] if lines[-1].startswith("error: ") else lines[-1].startswith("Error: ")  # ours / click's
    assert not (tmp_path / "logs").exists(), "nothing may start before the checks pass"


def test_cli_without_vllm_on_path_names_what_is_missing(tmp_path):
    res = CliRunner().invoke(launch_command, ["--gpus", "0-7", "--model", "/models/m", "--log-dir", str(tmp_path / "l")],
                             env={"PATH": str(tmp_path)})
    assert res.exit_code == 2, res.output
    assert res.output.startswith("error: no vLLM here: `vllm` is not on PATH") and "--vllm-cmd" in res.output
    assert len(res.output.strip().splitlines()) == 1


def test_cli_refuses_a_port_in_use(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        res = CliRunner().invoke(launch_command, ["--gpus", "0", "--engine", "simulate", "--base-port", str(port),
                                                  "--log-dir", str(tmp_path / "logs")])
    assert res.exit_code == 2 and "already in use" in res.output, res.output


# --- the supervisor, end to end --------------------------------------------------------
def free_ports(n: int) -> int:
    """A base port with the n ports from it free."""
    for _ in range(100):
        base = free_port()
        if base + n > 65535:
            continue
        try:
            for p in range(base, base + n):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
    raise RuntimeError("no run of free ports")


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited


class Launch:
    """`python -m consumer.launch.command` with the stand-in engine on a free run of ports."""

    def __init__(self, tmp: Path, redis_url: str, gpus: str, *extra: str, sim: tuple[str, ...] = (),
                 engine: tuple[str, ...] = ("--engine", "simulate"), env: dict[str, str] | None = None) -> None:
        self.logs = tmp / "logs"
        self.stderr = tmp / "launch.stderr"
        n = len(parse_gpus(gpus))
        self.base = free_ports(max(parse_gpus(gpus)) + 1) if n else 0
        self._fh = open(self.stderr, "ab")  # noqa: SIM115 - held while launch runs, closed in wait()
        self.p = subprocess.Popen(
            [sys.executable, "-m", "genqueue.consumer.launch.command", "--gpus", gpus, *engine,
             "--base-port", str(self.base), "--log-dir", str(self.logs), "--spool-root", str(tmp / "spool"),
             "--consumer-args", "--shard-max-age 1", *extra, "--", *sim],
            stdout=subprocess.DEVNULL, stderr=self._fh, env={**os.environ, "REDIS_URL": redis_url, **(env or {})})
        self.seen: set[int] = set()

    def pids(self) -> dict:
        try:
            data = json.loads((self.logs / "pids.json").read_text())
        except (OSError, ValueError):
            return {}
        for g in data["gpus"].values():
            self.seen |= {p for p in (g["engine"], g["consumer"]) if p}
        return data["gpus"]

    def wait_for(self, pred, timeout: float, what: str):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            got = pred()
            if got:
                return got
            assert self.p.poll() is None, f"launch exited {self.p.returncode} while waiting for {what}:\n{self.output()}"
            time.sleep(0.05)
        raise AssertionError(f"timed out waiting for {what}:\n{self.output()}")

    def all_up(self) -> dict:
        gpus = self.pids()
        return gpus if gpus and all(g["consumer"] for g in gpus.values()) else {}

    def wait(self, timeout: float = 60) -> int:
        try:
            return self.p.wait(timeout=timeout)
        finally:
            self._fh.close()

    def output(self) -> str:
        return self.stderr.read_text(errors="replace")

    def log(self, name: str) -> str:
        return (self.logs / f"{name}.log").read_text(errors="replace")

    def stop(self) -> None:
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGKILL)
            self.p.wait(10)
        for pid in self.seen:
            if alive(pid):
                os.killpg(pid, signal.SIGKILL)


def enqueue(tmp_path: Path, redis_url: str, run: str, n: int) -> int:
    data = write_jsonl(tmp_path / f"{run}.jsonl", [sharegpt(i) for i in range(n)])
    cli("producer", "enqueue", str(data), "--run", run, "--output", str(tmp_path / "out"), "--batch-size", "8",
        "--max-tokens", "256", "--rejects", str(tmp_path / "rej.jsonl"), env={"REDIS_URL": redis_url})
    return -(-n // 8)


def assert_complete(tmp_path: Path, conn, run: str, n: int) -> None:
    recs = read_results(tmp_path / "out", run)
    keys = run_keys(conn, run)
    assert len(keys) == n and {r["key"] for r in recs} == keys
    assert not [r for r in recs if "error" in r]
    assert queue_for(run, conn).failed_job_registry.count == 0


def assert_gone(launch: Launch) -> None:
    deadline = time.monotonic() + 10
    while any(alive(p) for p in launch.seen) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [p for p in launch.seen if alive(p)], "children outlived launch"


@pytest.mark.integration
def test_two_gpus_complete_a_run_then_sigterm_stops_everything(tmp_path, redis_url, conn):
    jobs = enqueue(tmp_path, redis_url, "two", 300)
    launch = Launch(tmp_path, redis_url, "0-1", "--run", "two", "-c", "32",
                    sim=("--slots", "32", "--step-time", "0.003", "--mean-tokens", "60"))
    try:
        gpus = launch.wait_for(launch.all_up, 30, "both consumers")
        assert {int(k): v["port"] for k, v in gpus.items()} == {0: launch.base, 1: launch.base + 1}
        q = queue_for("two", conn)
        launch.wait_for(lambda: q.finished_job_registry.count == jobs, 60, "the run to finish")
        launch.p.send_signal(signal.SIGTERM)
        assert launch.wait(60) == 0, launch.output()
    finally:
        launch.stop()
    assert_complete(tmp_path, conn, "two", 300)
    assert_gone(launch)
    assert not (launch.logs / "pids.json").exists()
    for g in (0, 1):
        assert "simulate: stand-in vLLM" in launch.log(f"engine-gpu{g}")
        assert f"--gpu {g}" in launch.log(f"consumer-gpu{g}") and "stopped after" in launch.log(f"consumer-gpu{g}")
    out = launch.output()
    assert "engine-gpu1 healthy" in out and "launch stopped (exit 0)" in out


@pytest.mark.slow
@pytest.mark.integration
def test_killed_engine_and_consumer_are_restarted_and_nothing_is_lost(tmp_path, redis_url, conn):
    jobs = enqueue(tmp_path, redis_url, "crash", 300)
    launch = Launch(tmp_path, redis_url, "0-1", "--run", "crash", "--burst", "-c", "16", "--lease", "3",
                    sim=("--slots", "16", "--step-time", "0.01", "--mean-tokens", "60"))
    try:
        first = launch.wait_for(launch.all_up, 30, "both consumers")
        q = queue_for("crash", conn)
        launch.wait_for(lambda: q.finished_job_registry.count >= 3, 30, "a few jobs")
        victim = first["0"]["engine"]
        os.kill(victim, signal.SIGKILL)
        assert q.finished_job_registry.count < jobs, "the run ended before the kill: make it longer"
        os.kill(first["1"]["consumer"], signal.SIGKILL)
        again = launch.wait_for(lambda: (g := launch.pids().get("0")) and g["engine"] not in (None, victim)
                                and g["engine_healthy"] and g, 30, "engine-gpu0 back")
        assert again["consumer"] == first["0"]["consumer"], "the consumer must ride the outage out, not restart"
        launch.wait_for(lambda: launch.pids()["1"]["consumer"] not in (None, first["1"]["consumer"]), 30,
                        "consumer-gpu1 back")
        assert launch.wait(90) == 0, launch.output()  # --burst: consumers finish, then launch stops
    finally:
        launch.stop()
    assert_complete(tmp_path, conn, "crash", 300)
    assert_gone(launch)
    out = launch.output()
    assert "engine-gpu0 exited with code -9" in out and "restarting in" in out
    assert "consumer-gpu1 exited with code -9" in out
    assert "every consumer finished" in out
    con = launch.log("consumer-gpu0")
    assert "is down" in con and "is back" in con


@pytest.mark.slow
@pytest.mark.integration
def test_sigterm_mid_run_drains_consumers_before_engines(tmp_path, redis_url, conn):
    enqueue(tmp_path, redis_url, "drain", 400)
    launch = Launch(tmp_path, redis_url, "0", "--run", "drain", "-c", "8", "--drain-timeout", "20",
                    sim=("--slots", "8", "--step-time", "0.01", "--mean-tokens", "50"))
    try:
        launch.wait_for(launch.all_up, 30, "the consumer")
        q = queue_for("drain", conn)
        launch.wait_for(lambda: q.finished_job_registry.count >= 2, 30, "two jobs")
        t0 = time.monotonic()
        launch.p.send_signal(signal.SIGTERM)
        assert launch.wait(60) == 0, launch.output()
        took = time.monotonic() - t0
    finally:
        launch.stop()
    assert_gone(launch)
    assert took < 15, f"drain took {took:.1f} s: in-flight requests lost their engine?"
    con = launch.log("consumer-gpu0")
    assert "draining" in con and "is down" not in con
    assert q.started_job_registry.count == 0 and q.count > 0
    assert all(job.retries_left == 3 for job in q.get_jobs())


@pytest.mark.integration
def test_a_consumer_configuration_mistake_stops_launch(tmp_path, redis_url):
    launch = Launch(tmp_path, redis_url, "0", "--run", "nosuchrun")
    try:
        assert launch.wait(30) == 2, launch.output()
    finally:
        launch.stop()
    assert_gone(launch)
    assert "configuration mistake" in launch.output()
    assert "no run named 'nosuchrun'" in launch.log("consumer-gpu0")


@pytest.mark.integration
def test_children_follow_a_killed_launch(tmp_path, redis_url):
    enqueue(tmp_path, redis_url, "orphan", 8)
    launch = Launch(tmp_path, redis_url, "0-1", "--run", "orphan")
    try:
        launch.wait_for(launch.all_up, 30, "both consumers")
        launch.p.send_signal(signal.SIGKILL)
        launch.wait(10)
        assert_gone(launch)
    finally:
        launch.stop()


@pytest.mark.integration
def test_a_second_signal_kills_everything_at_once(tmp_path, redis_url):
    enqueue(tmp_path, redis_url, "hard", 8)
    launch = Launch(tmp_path, redis_url, "0", "--run", "hard", "--drain-timeout", "100", sim=("--hang-rate", "1"))
    try:
        launch.wait_for(launch.all_up, 30, "the consumer")
        launch.wait_for(lambda: "serves sim-model" in launch.log("consumer-gpu0"), 30, "the consumer's start")
        launch.p.send_signal(signal.SIGTERM)
        launch.wait_for(lambda: "draining" in launch.log("consumer-gpu0"), 10, "the drain")
        t0 = time.monotonic()
        launch.p.send_signal(signal.SIGTERM)
        assert launch.wait(10) == 1, launch.output()
        assert time.monotonic() - t0 < 5
    finally:
        launch.stop()
    assert_gone(launch)
    assert "second signal" in launch.output()


FAKE_VLLM = """#!{python}
# `vllm serve MODEL ...` for tests: records what launch gave it, then becomes genqueue's stand-in.
import json, os, sys
args = sys.argv[1:]
assert args[:1] == ["serve"], args
model, rest = args[1], args[2:]
known = {{"--host", "--port", "--served-model-name", "--tensor-parallel-size", "--data-parallel-size"}}
opts, extra, i = {{}}, [], 0
while i < len(rest):
    if rest[i] in known:
        opts[rest[i]] = rest[i + 1]
        i += 2
    else:
        extra.append(rest[i])
        i += 1
with open(os.environ["FAKE_VLLM_RECORD"], "a") as f:
    f.write(json.dumps({{"argv": sys.argv[1:], "cuda": os.environ.get("CUDA_VISIBLE_DEVICES")}}) + "\\n")
os.execv(sys.executable, [sys.executable, "-m", "genqueue.consumer", "simulate", "--host", opts["--host"],
                          "--port", opts["--port"], "--model", opts.get("--served-model-name", model), *extra])
"""


def fake_vllm(tmp: Path) -> tuple[Path, Path]:
    """A directory holding a `vllm` executable (see FAKE_VLLM), and the file it records its starts in."""
    bindir = tmp / "fakebin"
    bindir.mkdir()
    exe = bindir / "vllm"
    exe.write_text(FAKE_VLLM.format(python=sys.executable))
    exe.chmod(0o755)
    return bindir, tmp / "vllm-starts.jsonl"


def environ_of(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(kv.decode(errors="replace").split("=", 1) for kv in raw if b"=" in kv)


@pytest.mark.integration
def test_tensor_parallel_groups_get_their_gpus_and_one_consumer_each(tmp_path, redis_url, conn):
    """`vllm serve` found on PATH; --gpus 0-3 --gpus-per-engine 2: two engines, each with its two
    GPUs in CUDA_VISIBLE_DEVICES and --tensor-parallel-size 2, one consumer each."""
    bindir, record = fake_vllm(tmp_path)
    enqueue(tmp_path, redis_url, "tp", 200)
    launch = Launch(tmp_path, redis_url, "0-3", "--run", "tp", "--burst", "--gpus-per-engine", "2", "-c", "16",
                    engine=("--model", "tiny"), env={"PATH": f"{bindir}:{os.environ['PATH']}",
                                                     "FAKE_VLLM_RECORD": str(record)},
                    sim=("--slots", "16", "--step-time", "0.003", "--mean-tokens", "60"))
    try:
        up = launch.wait_for(launch.all_up, 60, "both consumers")
        assert {k: (v["gpus"], v["port"]) for k, v in up.items()} == {
            "0-1": ([0, 1], launch.base), "2-3": ([2, 3], launch.base + 2)}
        for key, cuda in (("0-1", "0,1"), ("2-3", "2,3")):
            assert environ_of(up[key]["engine"])["CUDA_VISIBLE_DEVICES"] == cuda
        assert launch.wait(120) == 0, launch.output()
    finally:
        launch.stop()
    assert_complete(tmp_path, conn, "tp", 200)
    assert_gone(launch)
    starts = [json.loads(line) for line in record.read_text().splitlines()]
    assert sorted(s["cuda"] for s in starts) == ["0,1", "2,3"]
    for s in starts:
        argv = s["argv"]
        assert argv[:2] == ["serve", "tiny"] and argv[argv.index("--tensor-parallel-size") + 1] == "2"
        assert "--data-parallel-size" not in argv and argv[-6:] == ["--slots", "16", "--step-time", "0.003",
                                                                     "--mean-tokens", "60"]
    assert f"--gpu 2 --engine-gpus 2 --endpoint http://127.0.0.1:{launch.base + 2}/v1" in launch.log("consumer-gpu2-3")
    gpus = {r["consumer"]["gpu"] for r in read_results(tmp_path / "out", "tp")}
    assert gpus <= {0, 2} and gpus, gpus
    # each consumer publishes its engine's 2 GPUs: `producer status` counts GPU-hours by them
    ours = {f"http://127.0.0.1:{launch.base + n}/v1" for n in (0, 2)}
    assert sorted((c.get("gpu"), c.get("gpus")) for c in Snapshots(conn).reports(time.time())
                  if c.get("endpoint") in ours) == [(0, 2), (2, 2)]


@pytest.mark.slow
@pytest.mark.integration
def test_a_hung_engine_is_killed_and_restarted_and_nothing_is_lost(tmp_path, redis_url, conn):
    """An engine that stops answering while its process lives (SIGSTOP: alive, silent) is
    killed after --engine-hang-timeout and restarted; its consumer rides it out."""
    jobs = enqueue(tmp_path, redis_url, "hang", 240)
    launch = Launch(tmp_path, redis_url, "0", "--run", "hang", "--burst", "-c", "8", "--engine-hang-timeout", "3",
                    sim=("--slots", "8", "--step-time", "0.01", "--mean-tokens", "60"))
    stopped = None
    try:
        first = launch.wait_for(launch.all_up, 30, "the consumer")["0"]
        q = queue_for("hang", conn)
        launch.wait_for(lambda: q.finished_job_registry.count >= 2, 30, "two jobs")
        stopped = first["engine"]
        os.kill(stopped, signal.SIGSTOP)
        t0 = time.monotonic()
        assert q.finished_job_registry.count < jobs, "the run ended before the hang: make it longer"
        again = launch.wait_for(lambda: (g := launch.pids().get("0")) and g["engine"] not in (None, stopped)
                                and g["engine_healthy"] and g, 40, "a new engine")
        took = time.monotonic() - t0
        assert not alive(stopped), "the hung engine must be killed, not left holding its GPU"
        assert again["consumer"] == first["consumer"], "the consumer must ride the restart out"
        assert launch.wait(120) == 0, launch.output()
    finally:
        if stopped is not None and alive(stopped):
            os.kill(stopped, signal.SIGKILL)
        launch.stop()
    assert 3 <= took < 30, took
    assert_complete(tmp_path, conn, "hang", 240)
    assert_gone(launch)
    out = launch.output()
    assert "engine-gpu0 is alive but fails /health" in out and "hung; killed" in out and "restarting in" in out


@pytest.mark.slow
@pytest.mark.integration
def test_an_engine_that_never_starts_is_given_up_with_its_last_log_line(tmp_path, redis_url):
    broken = tmp_path / "broken-vllm"
    broken.write_text(f"#!{sys.executable}\nimport sys\n"
                      "print('Traceback (most recent call last):', file=sys.stderr)\n"
                      "print(\"ModuleNotFoundError: No module named 'vllm'\", file=sys.stderr)\nsys.exit(1)\n")
    broken.chmod(0o755)
    launch = Launch(tmp_path, redis_url, "0", engine=("--model", "m", "--vllm-cmd", str(broken)))
    try:
        assert launch.wait(60) == 1, launch.output()
    finally:
        launch.stop()
    assert_gone(launch)
    out = launch.output()
    assert "5 failed starts in a row, giving up on gpu0" in out
    assert "its log ends: ModuleNotFoundError: No module named 'vllm'" in out
    assert "every engine failed to start" in out


# --- an engine that captures hidden states -------------------------------------------------
CAPTURE_SPEC = ('{"method":"extract_hidden_states","num_speculative_tokens":1,'
                '"draft_model_config":{"hf_config":{"eagle_aux_hidden_state_layer_ids":[2,16,32]}}}')


def test_a_capturing_engine_gets_no_per_request_spec_flag():
    """extract_hidden_states holds the speculative slot but runs no drafter: no figures to ask for."""
    for args in (["--speculative-config", CAPTURE_SPEC], [f"--speculative-config={CAPTURE_SPEC}"]):
        argv = engine_argv(LaunchConfig(gpus=[0], model="/m", engine_args=args), g(0))
        assert PER_REQUEST_SPEC_FLAG not in argv and argv[-len(args):] == args


def write_model(tmp_path: Path, **config: object) -> str:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 32, **config}))
    return str(model)


@pytest.mark.parametrize("config, msg", [
    ({"model_type": "deepseek_v3", "kv_lora_rank": 512, "q_lora_rank": 1536}, "uses MLA attention"),
    ({"model_type": "deepseek_v2", "kv_lora_rank": 512, "q_lora_rank": None}, "uses MLA attention"),
    ({"text_config": {"model_type": "kimi_k2", "kv_lora_rank": 512, "num_hidden_layers": 61}}, "uses MLA attention"),
    ({"num_hidden_layers": 28}, "layer id 32 is past model"),
])
def test_launch_refuses_a_model_capture_cannot_serve_before_starting_anything(tmp_path, config, msg):
    """vLLM refuses an MLA model only once its engine is up (its connector), and captures a
    layer id past the last layer as a copy of another, silently: launch refuses both, in one line,
    from the model's config.json, before a process starts."""
    model = write_model(tmp_path, **config)
    res = CliRunner().invoke(launch_command, ["--gpus", "0", "--model", model, "--vllm-cmd", "true serve",
                                              "--log-dir", str(tmp_path / "logs"), "--",
                                              "--speculative-config", CAPTURE_SPEC])
    assert res.exit_code == 2, res.output
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and msg in lines[0], res.output
    assert not (tmp_path / "logs").exists(), "nothing may start before the checks pass"


@pytest.mark.parametrize("engine, msg", [
    (["--kv-cache-dtype", "fp8"], "--kv-cache-dtype fp8: vLLM's hidden-states capture"),
    (["--kv-cache-dtype=fp8_e4m3"], "--kv-cache-dtype fp8_e4m3"),
    (["--speculative-config", CAPTURE_SPEC.replace('"num_speculative_tokens":1', '"num_speculative_tokens":3')],
     "num_speculative_tokens 3"),
])
def test_launch_refuses_engine_flags_capture_cannot_start_with(tmp_path, engine, msg):
    """What vLLM refuses only once the target's weights are loaded (an assert in its hidden-states
    cache layer, its proposer) is refused before anything starts."""
    res = CliRunner().invoke(launch_command, ["--gpus", "0", "--model", write_model(tmp_path), "--vllm-cmd", "true serve",
                                              "--log-dir", str(tmp_path / "logs"), "--",
                                              *(engine if engine[0] == "--speculative-config"
                                                else ["--speculative-config", CAPTURE_SPEC, *engine])])
    assert res.exit_code == 2, res.output
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and msg in lines[0], res.output
    assert not (tmp_path / "logs").exists()


def test_the_model_check_reads_a_folder_or_the_hub_cache(tmp_path, monkeypatch):
    from genqueue.common.capture_model import captured_layers, check_model
    assert captured_layers(["--speculative-config", CAPTURE_SPEC]) == (2, 16, 32)
    assert captured_layers(["--speculative-config", '{"method":"eagle3"}']) is None
    assert check_model(write_model(tmp_path), (2, 16, 32)) is None  # 32 is the last layer: served
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    assert check_model("org/absent", (40,)) is None  # not on this node: the engine has the last word
    snap = tmp_path / "hub" / "models--org--mla" / "snapshots" / "abc"
    snap.mkdir(parents=True)
    (snap / "config.json").write_text(json.dumps({"model_type": "deepseek_v3", "kv_lora_rank": 512}))
    (tmp_path / "hub" / "models--org--mla" / "refs").mkdir()
    (tmp_path / "hub" / "models--org--mla" / "refs" / "main").write_text("abc")
    assert "model org/mla uses MLA attention" in (check_model("org/mla", (2,)) or "")
