"""docker-compose.yml: the structure a GPU node relies on, read as YAML; and `docker compose
config` itself where compose is installed (it validates without a Docker engine)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")

COMPOSE = Path(__file__).resolve().parent.parent / "docker-compose.yml"
GPU_SERVICE = re.compile(r"^vllm-gpu(\d+)$")


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


def gpu_indices(services: dict) -> list[int]:
    return sorted(int(m.group(1)) for name in services if (m := GPU_SERVICE.match(name)))


def test_redis_persists_and_reports_health(services):
    redis = services["redis"]
    cmd = redis["command"]
    assert flag(cmd, "--appendonly") == "yes"
    assert any(v.endswith(":/data") for v in redis["volumes"]), "the AOF must live on a volume"
    assert "redis-cli" in redis["healthcheck"]["test"] and "ping" in redis["healthcheck"]["test"]


def test_every_vllm_has_one_device_a_long_health_check_and_a_restart_policy(services):
    gpus = gpu_indices(services)
    assert gpus, "no vllm-gpuN service"
    claimed = []
    for n in gpus:
        svc = services[f"vllm-gpu{n}"]
        devices = svc["deploy"]["resources"]["reservations"]["devices"]
        assert len(devices) == 1 and "count" not in devices[0]
        assert devices[0]["device_ids"] == [str(n)], f"vllm-gpu{n} must reserve exactly GPU {n}"
        assert "gpu" in devices[0]["capabilities"]
        claimed.append(devices[0]["device_ids"][0])
        check = svc["healthcheck"]
        port = flag(svc["command"], "--port")
        assert any(f"127.0.0.1:{port}/health" in part for part in check["test"]), check["test"]
        assert seconds(check["start_period"]) >= 600, "a large model loads for minutes"
        assert svc["restart"] in ("unless-stopped", "always", "on-failure")
    assert len(set(claimed)) == len(claimed), "two engines on one GPU"


def test_every_vllm_has_its_consumer_waiting_for_it(services):
    for n in gpu_indices(services):
        consumer = services.get(f"consumer-gpu{n}")
        assert consumer is not None, f"vllm-gpu{n} has no consumer-gpu{n}"
        assert consumer["depends_on"][f"vllm-gpu{n}"]["condition"] == "service_healthy"
        assert consumer["depends_on"]["redis"]["condition"] == "service_healthy"
        cmd = consumer["command"]
        port = flag(services[f"vllm-gpu{n}"]["command"], "--port")
        assert cmd[:2] == ["consumer", "run"]
        assert flag(cmd, "--endpoint") == f"http://vllm-gpu{n}:{port}/v1"
        assert flag(cmd, "--gpu") == str(n)
        spool = flag(cmd, "--spool")
        assert spool and any(spool.startswith(v.split(":")[1]) for v in consumer["volumes"]), "spool off a volume"
        assert consumer["environment"]["REDIS_URL"].startswith("redis://redis:")
        drain = float(flag(cmd, "--drain-timeout") or 60)
        assert seconds(consumer["stop_grace_period"]) > drain, "SIGKILL before the drain ends"
        assert consumer["restart"] == "unless-stopped"
    consumers = [s for s in services if s.startswith("consumer-gpu")]
    assert len(consumers) == len(gpu_indices(services)), "a consumer without its vLLM"


def test_results_land_on_a_mounted_volume(services):
    producer = services["producer"]
    out = producer["environment"]["GENQUEUE_OUTPUT"]
    mounts = {v.split(":")[1] for v in producer["volumes"]}
    assert out in mounts, "results would be written inside the container"
    for n in gpu_indices(services):
        assert out in {v.split(":")[1] for v in services[f"consumer-gpu{n}"]["volumes"]}
    assert producer["working_dir"] in mounts, "rejects files would be written inside the container"


def test_producer_and_dashboard_only_run_when_asked(services):
    assert services["producer"]["profiles"] and services["producer"]["entrypoint"] == ["producer"]
    if "rq-dashboard" in services:
        assert services["rq-dashboard"]["profiles"]
        assert "build" in services["rq-dashboard"], "genqueue:latest is not on any registry: it must be built"


def compose_cmd() -> list[str] | None:
    docker = shutil.which("docker")
    if docker and subprocess.run([docker, "compose", "version"], capture_output=True, check=False).returncode == 0:
        return [docker, "compose"]
    legacy = shutil.which("docker-compose")
    return [legacy] if legacy else None


def test_docker_compose_accepts_the_file(tmp_path):
    cmd = compose_cmd()
    if cmd is None:
        pytest.skip("neither the docker compose plugin nor docker-compose is installed")
    base = [*cmd, "-f", str(COMPOSE), "--project-directory", str(COMPOSE.parent)]
    env = {k: v for k, v in os.environ.items() if k != "MODEL"}
    missing = subprocess.run([*base, "config", "-q"], capture_output=True, text=True, env=env, check=False)
    assert missing.returncode != 0 and "set MODEL" in missing.stderr
    env["MODEL"] = "/models/test"
    ok = subprocess.run([*base, "config", "-q"], capture_output=True, text=True, env=env, check=False)
    assert ok.returncode == 0, ok.stderr
    if cmd[-1] == "compose":  # the v2 plugin; docker-compose 1.x lists services whatever their profile
        listed = subprocess.run([*base, "config", "--services"], capture_output=True, text=True, env=env, check=True)
        assert "producer" not in listed.stdout.split() and "redis" in listed.stdout.split()
