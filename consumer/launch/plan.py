"""What `consumer launch` starts on a node, as pure functions: its config checked from the
options, GPU groups, ports, command lines, the engine command, backoff.

Nothing here starts a process or touches the network, so all of it is tested without a GPU.
"""

from __future__ import annotations

import shlex
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from genqueue.common import defaults
from genqueue.common.acceptance import PER_REQUEST_SPEC_FLAG
from genqueue.common.capture_model import captured_layers, check_model, engine_refusal
from genqueue.common.cli import ConsumerArgs, consumer_defaults, consumer_run_args, pick_consumer_args
from genqueue.common.errors import UserError
from genqueue.common.settings import check_run_name, parse_concurrency

ENGINES = ("vllm", "simulate")
DEVICES = ("gpu", "cpu")

#: The module behind vLLM's OpenAI server, for the `python -m` form of --vllm-cmd (vLLM's CPU
#: builds need it: their `vllm serve` entry point fails on the package name).
VLLM_MODULE = "vllm.entrypoints.openai.api_server"

#: Restart backoff: 1, 2, 4 ... seconds, never more than this.
RESTART_CAP = 60.0

#: A process up this long is healthy again: its next crash restarts at once.
STABLE_AFTER = 120.0

#: An engine that never answered /health and failed this many starts in a row is given up.
MAX_START_FAILURES = 5

#: Seconds engines get between SIGTERM and SIGKILL once the consumers are done.
ENGINE_STOP_GRACE = 30.0

#: Seconds launch waits for its consumers on SIGTERM on top of their own --drain-timeout.
DRAIN_SLACK = 30.0

#: Engine arguments launch sets itself (it must, to match CUDA_VISIBLE_DEVICES), with the
#: launch option that sets each.
RESERVED_ENGINE_ARGS = {
    "--tensor-parallel-size": "--gpus-per-engine",
    "-tp": "--gpus-per-engine",
    "--data-parallel-size": "--data-parallel",
    "-dp": "--data-parallel",
}


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


@dataclass(frozen=True, slots=True)
class Group:
    """The GPUs one engine uses (one, or a tensor/data-parallel group), known by its first GPU:
    its engine listens on BASE+first, its consumer runs as `--gpu first`."""

    gpus: tuple[int, ...]

    @property
    def first(self) -> int:
        return self.gpus[0]

    @property
    def key(self) -> str:
        """"3" for one GPU, "0-1" for a run of GPUs, "0+2" otherwise (pids.json, file names)."""
        g = self.gpus
        if len(g) == 1:
            return str(g[0])
        if list(g) == list(range(g[0], g[-1] + 1)):
            return f"{g[0]}-{g[-1]}"
        return "+".join(map(str, g))

    @property
    def name(self) -> str:
        return f"gpu{self.key}"

    @property
    def cuda_visible_devices(self) -> str:
        return ",".join(map(str, self.gpus))


def group_gpus(gpus: list[int], per_engine: int) -> list[Group]:
    """GPUS in groups of PER_ENGINE consecutive entries; ValueError when they do not divide."""
    if per_engine < 1:
        raise ValueError("an engine needs at least one GPU")
    if len(gpus) % per_engine:
        raise ValueError(f"{len(gpus)} GPU(s) do not split into engines of {per_engine}")
    return [Group(tuple(gpus[i:i + per_engine])) for i in range(0, len(gpus), per_engine)]


def reserved_arg(engine_args: list[str]) -> tuple[str, str] | None:
    """The first engine argument launch sets itself, with the launch option to use instead."""
    for arg in engine_args:
        name = arg.split("=", 1)[0]
        if name in RESERVED_ENGINE_ARGS:
            return name, RESERVED_ENGINE_ARGS[name]
    return None


def python_module(head: list[str]) -> str | None:
    """The module of a `python -m MODULE` command head, else None."""
    for i, part in enumerate(head[:-1]):
        if part == "-m":
            return head[i + 1]
    return None


def resolve_engine_cmd(vllm_cmd: str | None, which: Callable[[str], str | None],
                       has_module: Callable[[str, str], bool]) -> list[str]:
    """The vLLM command before its arguments: --vllm-cmd as given, else `vllm serve` from PATH.

    Checked before anything starts, so a node without vLLM gets one line naming what is
    missing instead of engines restarting until launch gives up. WHICH finds an executable
    (shutil.which); HAS_MODULE(python, top_level_package) says whether that Python has it.
    Raises LookupError with that line.
    """
    if vllm_cmd is None:
        exe = which("vllm") or which(str(Path(sys.executable).with_name("vllm")))
        if exe is None:
            raise LookupError("no vLLM here: `vllm` is not on PATH. Install vLLM, or name its command with "
                              "--vllm-cmd (env GENQUEUE_VLLM_CMD), e.g. '/opt/vllm/bin/vllm serve' or "
                              f"'/opt/vllm/bin/python -m {VLLM_MODULE}'")
        return [exe, "serve"]
    try:
        head = shlex.split(vllm_cmd)
    except ValueError as e:
        raise LookupError(f"--vllm-cmd {vllm_cmd!r}: {e}") from None
    if not head:
        raise LookupError("--vllm-cmd is empty")
    exe = which(head[0])
    if exe is None:
        raise LookupError(f"--vllm-cmd {vllm_cmd!r}: no such executable {head[0]!r}")
    module = python_module(head)
    if module is not None and not has_module(exe, module.split(".")[0]):
        raise LookupError(f"--vllm-cmd {vllm_cmd!r}: {exe} has no module named {module.split('.')[0]!r}")
    return [exe, *head[1:]]


def restart_delay(failures: int, *, base: float = 1.0, cap: float = RESTART_CAP) -> float:
    """Seconds to wait before restarting a process that has failed `failures` times in a row (>= 1)."""
    if failures < 1:
        return 0.0
    return float(min(cap, base * 2 ** min(failures - 1, 32)))


class LaunchOptions(ConsumerArgs):
    """`consumer launch`'s options as click parses them (one key per option, by its parameter name):
    those it passes to its consumers (ConsumerArgs), then its own."""

    gpus: list[int]
    model: str | None
    served_model_name: str | None
    engine: str
    vllm_cmd: str | None
    gpus_per_engine: int
    data_parallel: int
    devices: str
    base_port: int
    log_dir: Path
    spool_root: Path
    metrics_base_port: int | None
    consumer_args: str
    engine_start_timeout: float
    engine_hang_timeout: float
    redis_url: str
    engine_args: tuple[str, ...]


@dataclass
class LaunchConfig:
    """Everything `consumer launch` was asked for; argv for each process is derived from it."""

    gpus: list[int]
    model: str | None = None
    served_model_name: str | None = None
    engine: str = defaults.ENGINE
    #: the engine command before its arguments (launch resolves it: resolve_engine_cmd)
    vllm_cmd: str | None = None
    devices: str = defaults.DEVICE
    gpus_per_engine: int = defaults.GPUS_PER_ENGINE
    data_parallel: int = defaults.DATA_PARALLEL
    base_port: int = defaults.ENGINE_PORT
    log_dir: Path = Path(defaults.LOG_DIR)
    spool_root: Path = Path(defaults.SPOOL_ROOT)
    metrics_base_port: int | None = None
    #: the options of `consumer run` launch shares (common/cli.py), passed to every consumer as
    #: given; checked here (run name, parse_concurrency) before anything starts
    consumer: ConsumerArgs = field(default_factory=consumer_defaults)
    consumer_args: str = ""
    engine_args: list[str] = field(default_factory=list)
    engine_start_timeout: float = defaults.ENGINE_START_TIMEOUT
    engine_hang_timeout: float = defaults.ENGINE_HANG_TIMEOUT
    redis_url: str = ""

    @classmethod
    def from_options(cls, options: LaunchOptions, *, engine_cmd: Callable[[str | None], list[str]]) -> LaunchConfig:
        """The config `consumer launch` OPTIONS ask for, checked before anything starts; UserError
        for a mistake in them. ENGINE_CMD resolves --vllm-cmd (resolve_engine_cmd with the
        node's PATH; LookupError when vLLM is not there), for --engine vllm only."""
        run, engine, model = options["run_name"], options["engine"], options["model"]
        if run:
            check_run_name(run)
        if engine == "vllm" and not model:
            raise UserError("--model is required with --engine vllm")
        gpus_per_engine, data_parallel = options["gpus_per_engine"], options["data_parallel"]
        try:
            groups = group_gpus(options["gpus"], gpus_per_engine * data_parallel)
        except ValueError as e:
            raise UserError(f"--gpus: {e} (--gpus-per-engine {gpus_per_engine} x --data-parallel "
                            f"{data_parallel})") from None
        top = max(g.first for g in groups)
        base_port, metrics_base_port = options["base_port"], options["metrics_base_port"]
        if base_port + top > 65535:
            raise UserError(f"--base-port {base_port} + GPU {top} is past port 65535")
        if metrics_base_port is not None and metrics_base_port + top > 65535:
            raise UserError(f"--metrics-base-port {metrics_base_port} + GPU {top} is past port 65535")
        parse_concurrency(options["concurrency"])
        consumer_args = options["consumer_args"]
        try:
            shlex.split(consumer_args)
        except ValueError as e:
            raise UserError(f"--consumer-args {consumer_args!r}: {e}") from None
        engine_args = list(options["engine_args"])
        reserved = reserved_arg(engine_args)
        if reserved is not None:
            raise UserError(f"engine argument {reserved[0]} is launch's to set: use {reserved[1]} "
                            "(it sets CUDA_VISIBLE_DEVICES to match)")
        vllm_cmd = options["vllm_cmd"]
        layers = captured_layers(engine_args) if engine == "vllm" else None
        # before any GPU time: vLLM refuses an MLA model only once up, and captures a copy for a layer past the last
        if layers is not None and (refused := engine_refusal(engine_args) or (model and check_model(model, layers))):
            raise UserError(refused)
        if engine == "vllm":
            try:
                vllm_cmd = shlex.join(engine_cmd(vllm_cmd))
            except LookupError as e:
                raise UserError(str(e)) from None
        return cls(gpus=options["gpus"], model=model, served_model_name=options["served_model_name"],
                   engine=engine, vllm_cmd=vllm_cmd, devices=options["devices"], gpus_per_engine=gpus_per_engine,
                   data_parallel=data_parallel, base_port=base_port, log_dir=options["log_dir"],
                   spool_root=options["spool_root"], metrics_base_port=metrics_base_port,
                   consumer=pick_consumer_args(options), consumer_args=consumer_args, engine_args=engine_args,
                   engine_start_timeout=options["engine_start_timeout"],
                   engine_hang_timeout=options["engine_hang_timeout"], redis_url=options["redis_url"])

    @property
    def drain_timeout(self) -> float:
        """The consumers' --drain-timeout: launch waits that long (and DRAIN_SLACK) for them on SIGTERM."""
        return self.consumer["drain_timeout"]

    @property
    def gpus_per_group(self) -> int:
        return self.gpus_per_engine * self.data_parallel

    def groups(self) -> list[Group]:
        return group_gpus(self.gpus, self.gpus_per_group)

    def port(self, group: Group) -> int:
        return self.base_port + group.first

    def endpoint(self, group: Group) -> str:
        return f"http://127.0.0.1:{self.port(group)}/v1"

    def health_url(self, group: Group) -> str:
        return f"http://127.0.0.1:{self.port(group)}/health"


def engine_argv(cfg: LaunchConfig, group: Group) -> list[str]:
    """The engine's command line. The user's extra arguments come last and pass through
    untouched (speculative decoding etc.); the parallel sizes are launch's, to match the GPUs
    it gives the engine."""
    port = str(cfg.port(group))
    if cfg.engine == "simulate":
        argv = [sys.executable, "-m", "genqueue.consumer", "simulate", "--port", port]
        name = cfg.served_model_name or cfg.model
        if name:
            argv += ["--model", name]
        return [*argv, *spec_metrics_args(cfg.engine_args, "--spec-tokens"), *cfg.engine_args]
    if cfg.model is None:
        raise ValueError("--model is required with --engine vllm")
    head = shlex.split(cfg.vllm_cmd) if cfg.vllm_cmd else ["vllm", "serve"]
    # `vllm serve` takes the model as its first argument; the api_server module takes --model.
    model = [cfg.model] if head[-1] == "serve" else ["--model", cfg.model]
    argv = [*head, *model, "--host", "127.0.0.1", "--port", port]
    if cfg.gpus_per_engine > 1:
        argv += ["--tensor-parallel-size", str(cfg.gpus_per_engine)]
    if cfg.data_parallel > 1:
        argv += ["--data-parallel-size", str(cfg.data_parallel)]
    if cfg.served_model_name:
        argv += ["--served-model-name", cfg.served_model_name]
    return [*argv, *spec_metrics_args(cfg.engine_args, "--speculative-config"), *cfg.engine_args]


def spec_metrics_args(engine_args: list[str], drafter: str) -> list[str]:
    """`--per-request-spec-decode-metrics summary` for an engine whose arguments start a drafter
    (DRAFTER: vLLM's --speculative-config, the stand-in's --spec-tokens) and do not set the flag:
    each answer then carries its acceptance figures, which the records keep (consumer/answer/spec.py).
    An engine that captures hidden states (extract_hidden_states) runs no drafter: none for it."""
    def given(name: str) -> bool:
        return any(a == name or a.startswith(name + "=") for a in engine_args)
    if captured_layers(engine_args) is not None:  # extract_hidden_states holds the slot: no drafter
        return []
    return [PER_REQUEST_SPEC_FLAG, "summary"] if given(drafter) and not given(PER_REQUEST_SPEC_FLAG) else []


def engine_env(cfg: LaunchConfig, group: Group, base: dict[str, str]) -> dict[str, str]:
    """The engine's environment: its GPUs only (with --devices cpu, the environment as it is)."""
    env = dict(base)
    if cfg.devices == "gpu":
        env["CUDA_VISIBLE_DEVICES"] = group.cuda_visible_devices
    return env


def consumer_argv(cfg: LaunchConfig, group: Group) -> list[str]:
    """The consumer's command line; Redis comes through the environment, so no password shows in ps.
    In front of a data-parallel engine the --concurrency auto ceiling grows with its replicas."""
    argv = [sys.executable, "-m", "genqueue.consumer", "-v", "run", "--gpu", str(group.first),
            "--engine-gpus", str(cfg.gpus_per_group), "--endpoint", cfg.endpoint(group), "--spool", str(cfg.spool_root / group.name),
            *consumer_run_args(cfg.consumer)]
    if cfg.metrics_base_port is not None:
        argv += ["--metrics-port", str(cfg.metrics_base_port + group.first)]
    extra = shlex.split(cfg.consumer_args)
    if cfg.data_parallel > 1 and not any(a.split("=", 1)[0] == "--max-concurrency" for a in extra):
        argv += ["--max-concurrency", str(cfg.data_parallel * defaults.MAX_CONCURRENCY)]
    return [*argv, *extra]


def consumer_env(cfg: LaunchConfig, base: dict[str, str]) -> dict[str, str]:
    """Redis for every consumer; a metrics port from the environment would be one port for all, so it goes."""
    env = {k: v for k, v in base.items() if k != "GENQUEUE_METRICS_PORT"}
    return {**env, "REDIS_URL": cfg.redis_url}
