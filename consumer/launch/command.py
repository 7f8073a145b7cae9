"""`consumer launch`: one vLLM and one consumer per GPU (or per group of GPUs) on this node, supervised.

    consumer launch --gpus 0-7 --model /models/my-27b --run data -- --speculative-config '{...}'
    consumer launch --gpus 0-7 --gpus-per-engine 2 --model /models/big      # 4 engines, TP 2
    consumer launch --gpus 0-7 --data-parallel 8 --model /models/my-27b     # 1 engine, DP 8

Everything after `--` goes to every engine untouched. See consumer/launch/supervisor.py for
what happens when an engine or a consumer dies or hangs, and on SIGTERM.
"""

from __future__ import annotations

import logging
import shlex
import shutil
import subprocess
from pathlib import Path

import click

from genqueue.common import defaults
from genqueue.common.cli import friendly_errors, redis_option, setup_logging
from genqueue.common.errors import UserError
from genqueue.consumer.launch.plan import (
    DEVICES,
    ENGINE_HANG_TIMEOUT,
    ENGINE_START_TIMEOUT,
    ENGINES,
    LaunchConfig,
    group_gpus,
    parse_gpus,
    reserved_arg,
    resolve_engine_cmd,
)

#: Seconds a Python named by --vllm-cmd gets to say whether it has vLLM (it only looks, imports nothing).
MODULE_CHECK_TIMEOUT = 60.0


def _gpus(ctx: click.Context, param: click.Parameter, value: str) -> list[int]:
    try:
        return parse_gpus(value)
    except ValueError as e:
        raise click.BadParameter(str(e), ctx, param) from None


def has_module(python: str, module: str) -> bool:
    """Whether PYTHON finds the top-level package MODULE (found, not imported: vLLM takes seconds to import)."""
    code = "import importlib.util, sys; sys.exit(0 if importlib.util.find_spec(sys.argv[1]) else 3)"
    try:
        done = subprocess.run([python, "-c", code, module], capture_output=True, timeout=MODULE_CHECK_TIMEOUT,
                              check=False)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


@click.command("launch", context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--gpus", metavar="GPUS", callback=_gpus, required=True, envvar="GENQUEUE_GPUS", show_envvar=True,
              help='GPUs to use: "0-7", "0,2,5" or "3". One engine and one consumer per GPU, or per group '
                   "(--gpus-per-engine, --data-parallel).")
@click.option("--model", envvar="GENQUEUE_MODEL", show_envvar=True, help="Model path or name vLLM serves.")
@click.option("--served-model-name", default=None, help="Name vLLM serves the model under (default: --model).")
@click.option("--run", "run_name", help="Consumers serve only this run (default: every open run the model fits).")
@click.option("--engine", type=click.Choice(ENGINES), default="vllm", show_default=True,
              help="simulate: genqueue's stand-in vLLM instead (tests, demos; no GPU).")
@click.option("--vllm-cmd", envvar="GENQUEUE_VLLM_CMD", show_envvar=True, default=None,
              help="Engine command before its arguments, e.g. '/opt/vllm/bin/vllm serve' or '/opt/vllm/bin/python -m "
                   "vllm.entrypoints.openai.api_server' (default: `vllm serve` from PATH). Checked before anything "
                   "starts.")
@click.option("--gpus-per-engine", type=click.IntRange(1, 64), default=1, show_default=True,
              envvar="GENQUEUE_GPUS_PER_ENGINE", show_envvar=True,
              help="Tensor parallelism: each engine gets N consecutive GPUs of --gpus (CUDA_VISIBLE_DEVICES) and "
                   "--tensor-parallel-size N; one consumer per engine.")
@click.option("--data-parallel", type=click.IntRange(1, 64), default=1, show_default=True,
              envvar="GENQUEUE_DATA_PARALLEL", show_envvar=True,
              help="Data parallelism inside one engine: each engine gets D x --gpus-per-engine GPUs and "
                   "--data-parallel-size D; its one consumer's --max-concurrency grows D times.")
@click.option("--devices", type=click.Choice(DEVICES), default="gpu", show_default=True,
              help="cpu: do not set CUDA_VISIBLE_DEVICES (vLLM CPU builds).")
@click.option("--base-port", type=click.IntRange(1, 65535), default=8000, show_default=True,
              help="The engine whose first GPU is N listens on BASE+N.")
@click.option("--log-dir", type=click.Path(file_okay=False, path_type=Path), default=Path("./genqueue-logs"),
              show_default=True, help="engine-gpuN.log, consumer-gpuN.log, pids.json.")
@click.option("--spool-root", type=click.Path(file_okay=False, path_type=Path), default=Path("./genqueue-spool"),
              show_default=True, help="Consumer of GPU N spools to ROOT/gpuN (a group: ROOT/gpuA-B).")
@click.option("--concurrency", "-c", default=None,
              help="Requests each consumer keeps in flight: a number or auto (default: the consumer's).")
@click.option("--metrics-base-port", type=click.IntRange(1, 65535), default=None, envvar="GENQUEUE_METRICS_BASE_PORT",
              show_envvar=True, help="Consumer of GPU N serves Prometheus metrics on BASE+N (default: off).")
@click.option("--lease", type=click.IntRange(2, 3600), default=None,
              help=f"Consumers' job lease in seconds (consumer default {defaults.LEASE_SECONDS}).")
@click.option("--drain-timeout", type=click.FloatRange(0), default=defaults.DRAIN_TIMEOUT, show_default=True,
              help="On SIGTERM, seconds each consumer's in-flight requests get to finish.")
@click.option("--burst", is_flag=True, help="Consumers exit once the runs are drained; then launch stops.")
@click.option("--consumer-args", default="", help="More `consumer run` options, e.g. '--shard-max-age 5'.")
@click.option("--engine-start-timeout", type=click.FloatRange(1), default=ENGINE_START_TIMEOUT, show_default=True,
              help="Seconds an engine has to answer /health (large models load for minutes).")
@click.option("--engine-hang-timeout", type=click.FloatRange(0), default=ENGINE_HANG_TIMEOUT, show_default=True,
              help="An engine that answered /health and then fails it this many seconds while its process lives "
                   "is hung: it is killed and restarted (0: never).")
@click.option("-v", "--verbose", count=True, help="More logging (-vv for debug).")
@redis_option
@click.argument("engine_args", nargs=-1, type=click.UNPROCESSED)
@friendly_errors
def launch_command(gpus: list[int], model: str | None, served_model_name: str | None, run_name: str | None,
                   engine: str, vllm_cmd: str | None, gpus_per_engine: int, data_parallel: int, devices: str,
                   base_port: int, log_dir: Path, spool_root: Path, concurrency: str | None,
                   metrics_base_port: int | None, lease: int | None, drain_timeout: float, burst: bool,
                   consumer_args: str, engine_start_timeout: float, engine_hang_timeout: float, verbose: int,
                   redis_url: str, engine_args: tuple[str, ...]) -> None:
    """Start an engine and a consumer per GPU (or group of GPUs) and keep them running until SIGTERM.

    Arguments after `--` go to every engine as they are (speculative decoding, parsers,
    --max-model-len ...).
    """
    from genqueue.common.settings import check_run_name
    from genqueue.consumer.launch.supervisor import Supervisor

    setup_logging(verbose)
    logging.getLogger("genqueue.consumer.launch").setLevel(logging.DEBUG if verbose >= 2 else logging.INFO)
    if run_name:
        check_run_name(run_name)
    if engine == "vllm" and not model:
        raise UserError("--model is required with --engine vllm")
    per_group = gpus_per_engine * data_parallel
    try:
        groups = group_gpus(gpus, per_group)
    except ValueError as e:
        raise UserError(f"--gpus: {e} (--gpus-per-engine {gpus_per_engine} x --data-parallel {data_parallel})") from None
    top = max(g.first for g in groups)
    if base_port + top > 65535:
        raise UserError(f"--base-port {base_port} + GPU {top} is past port 65535")
    if metrics_base_port is not None and metrics_base_port + top > 65535:
        raise UserError(f"--metrics-base-port {metrics_base_port} + GPU {top} is past port 65535")
    if concurrency is not None and concurrency != "auto" and not (concurrency.isdigit() and int(concurrency) >= 1):
        raise UserError(f"--concurrency takes a number or auto, not {concurrency!r}")
    try:
        shlex.split(consumer_args)
    except ValueError as e:
        raise UserError(f"--consumer-args {consumer_args!r}: {e}") from None
    reserved = reserved_arg(list(engine_args))
    if reserved is not None:
        raise UserError(f"engine argument {reserved[0]} is launch's to set: use {reserved[1]} "
                        "(it sets CUDA_VISIBLE_DEVICES to match)")
    if engine == "vllm":
        try:
            vllm_cmd = shlex.join(resolve_engine_cmd(vllm_cmd, shutil.which, has_module))
        except LookupError as e:
            raise UserError(str(e)) from None
    cfg = LaunchConfig(gpus=gpus, model=model, served_model_name=served_model_name, run=run_name, engine=engine,
                       vllm_cmd=vllm_cmd, devices=devices, gpus_per_engine=gpus_per_engine,
                       data_parallel=data_parallel, base_port=base_port, log_dir=log_dir,
                       spool_root=spool_root, concurrency=concurrency,
                       metrics_base_port=metrics_base_port, lease=lease, drain_timeout=drain_timeout,
                       burst=burst, consumer_args=consumer_args, engine_args=list(engine_args),
                       engine_start_timeout=engine_start_timeout, engine_hang_timeout=engine_hang_timeout,
                       redis_url=redis_url)
    raise SystemExit(Supervisor(cfg).run())


if __name__ == "__main__":
    launch_command(prog_name="consumer launch")
