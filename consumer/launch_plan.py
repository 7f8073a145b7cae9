"""What `consumer launch` starts on a node, as pure functions: GPU lists, ports, command lines, backoff.

Nothing here starts a process or touches the network, so all of it is tested without a GPU.
"""

from __future__ import annotations

import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

ENGINES = ("vllm", "simulate")
DEVICES = ("gpu", "cpu")

#: The default engine command: the python -m form also works on vLLM's CPU builds, where the
#: `vllm serve` entry point can fail on the package name.
VLLM_MODULE = "vllm.entrypoints.openai.api_server"

#: Seconds an engine waits for /health by default: a 27B model loads for minutes.
ENGINE_START_TIMEOUT = 1200.0

#: Restart backoff: 1, 2, 4 ... seconds, never more than this.
RESTART_CAP = 60.0

#: A process that has stayed up this long is healthy again: its next crash restarts at once.
STABLE_AFTER = 120.0

#: An engine that never answered /health and failed this many starts in a row is given up.
MAX_START_FAILURES = 5

#: After the consumers are done, engines get this long between SIGTERM and SIGKILL.
ENGINE_STOP_GRACE = 30.0

#: On top of the consumers' own --drain-timeout, how long launch waits for them on SIGTERM.
DRAIN_SLACK = 30.0


def parse_gpus(spec: str) -> list[int]:
    """"0-7", "0,2,5", "3" or a mix ("0-3,6") -> sorted device indices; ValueError if malformed."""
    gpus: list[int] = []
    for part in spec.replace(" ", "").split(","):
        if not part:
            raise ValueError(f"empty item in GPU list {spec!r}")
        lo, sep, hi = part.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"{part!r} is neither a GPU index nor a range like 0-7")
        first, last = int(lo), int(hi) if sep else int(lo)
        if last < first:
            raise ValueError(f"range {part!r} runs backwards")
        gpus.extend(range(first, last + 1))
    if len(set(gpus)) != len(gpus):
        raise ValueError(f"GPU list {spec!r} names a device twice")
    if max(gpus) > 1023:
        raise ValueError(f"GPU index {max(gpus)} is out of range (0-1023)")
    return sorted(gpus)


def restart_delay(failures: int, *, base: float = 1.0, cap: float = RESTART_CAP) -> float:
    """Seconds to wait before restarting a process that has failed `failures` times in a row (>= 1)."""
    if failures < 1:
        return 0.0
    return float(min(cap, base * 2 ** min(failures - 1, 32)))


@dataclass
class LaunchConfig:
    """Everything `consumer launch` was asked for; argv for each process is derived from it."""

    gpus: list[int]
    model: str | None = None
    served_model_name: str | None = None
    run: str | None = None
    engine: str = "vllm"
    vllm_cmd: str | None = None
    devices: str = "gpu"
    base_port: int = 8000
    log_dir: Path = Path("./genqueue-logs")
    spool_root: Path = Path("./genqueue-spool")
    concurrency: str | None = None
    metrics_base_port: int | None = None
    lease: int | None = None
    drain_timeout: float = 60.0
    burst: bool = False
    consumer_args: str = ""
    engine_args: list[str] = field(default_factory=list)
    engine_start_timeout: float = ENGINE_START_TIMEOUT
    redis_url: str = ""

    def port(self, gpu: int) -> int:
        return self.base_port + gpu

    def endpoint(self, gpu: int) -> str:
        return f"http://127.0.0.1:{self.port(gpu)}/v1"

    def health_url(self, gpu: int) -> str:
        return f"http://127.0.0.1:{self.port(gpu)}/health"


def engine_argv(cfg: LaunchConfig, gpu: int) -> list[str]:
    """The engine's command line. The user's extra arguments come last, so theirs win
    (argparse keeps the last value), and pass through untouched (speculative decoding etc.)."""
    port = str(cfg.port(gpu))
    if cfg.engine == "simulate":
        argv = [sys.executable, "-m", "genqueue.consumer", "simulate", "--port", port]
        name = cfg.served_model_name or cfg.model
        if name:
            argv += ["--model", name]
        return [*argv, *cfg.engine_args]
    if cfg.model is None:
        raise ValueError("--model is required with --engine vllm")
    head = shlex.split(cfg.vllm_cmd) if cfg.vllm_cmd else [sys.executable, "-m", VLLM_MODULE]
    argv = [*head, "--model", cfg.model, "--host", "127.0.0.1", "--port", port]
    if cfg.served_model_name:
        argv += ["--served-model-name", cfg.served_model_name]
    return [*argv, *cfg.engine_args]


def engine_env(cfg: LaunchConfig, gpu: int, base: dict[str, str]) -> dict[str, str]:
    """The engine's environment: one visible GPU (with --devices cpu, the environment as it is)."""
    env = dict(base)
    if cfg.devices == "gpu":
        env["CUDA_VISIBLE_DEVICES"] = str(gpu)
    return env


def consumer_argv(cfg: LaunchConfig, gpu: int) -> list[str]:
    """The consumer's command line; Redis comes through the environment, so no password shows in ps."""
    argv = [sys.executable, "-m", "genqueue.consumer", "-v", "run", "--gpu", str(gpu), "--endpoint", cfg.endpoint(gpu),
            "--spool", str(cfg.spool_root / f"gpu{gpu}"), "--drain-timeout", str(cfg.drain_timeout)]
    if cfg.run:
        argv += ["--run", cfg.run]
    if cfg.concurrency is not None:
        argv += ["--concurrency", cfg.concurrency]
    if cfg.metrics_base_port is not None:
        argv += ["--metrics-port", str(cfg.metrics_base_port + gpu)]
    if cfg.lease is not None:
        argv += ["--lease", str(cfg.lease)]
    if cfg.burst:
        argv.append("--burst")
    return [*argv, *shlex.split(cfg.consumer_args)]


def consumer_env(cfg: LaunchConfig, base: dict[str, str]) -> dict[str, str]:
    """Redis for every consumer; a metrics port from the environment would be one port for all, so it goes."""
    env = {k: v for k, v in base.items() if k != "GENQUEUE_METRICS_PORT"}
    return {**env, "REDIS_URL": cfg.redis_url}
