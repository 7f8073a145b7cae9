"""`consumer launch`: one vLLM and one consumer per GPU (or per group of GPUs) on this node, supervised.

    consumer launch --gpus 0-7 --model /models/my-27b --run data -- --speculative-config '{...}'
    consumer launch --gpus 0-7 --gpus-per-engine 2 --model /models/big      # 4 engines, TP 2
    consumer launch --gpus 0-7 --data-parallel 8 --model /models/my-27b     # 1 engine, DP 8

Everything after `--` goes to every engine untouched. See consumer/launch/supervisor.py for
what happens when an engine or a consumer dies or hangs, and on SIGTERM.
"""

from __future__ import annotations

import logging
import shutil
import subprocess
from pathlib import Path
from typing import Unpack

import click

from genqueue.common import defaults
from genqueue.common.cli import consumer_options, friendly_errors, redis_option, setup_logging
from genqueue.consumer.launch.plan import DEVICES, ENGINES, LaunchConfig, LaunchOptions, parse_gpus, resolve_engine_cmd

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
@click.option("--engine", type=click.Choice(ENGINES), default=defaults.ENGINE, show_default=True,
              help="simulate: genqueue's stand-in vLLM instead (tests, demos; no GPU).")
@click.option("--vllm-cmd", envvar="GENQUEUE_VLLM_CMD", show_envvar=True, default=None,
              help="Engine command before its arguments, e.g. '/opt/vllm/bin/vllm serve' or '/opt/vllm/bin/python -m "
                   "vllm.entrypoints.openai.api_server' (default: `vllm serve` from PATH). Checked before anything "
                   "starts.")
@click.option("--gpus-per-engine", type=click.IntRange(1, 64), default=defaults.GPUS_PER_ENGINE, show_default=True,
              envvar="GENQUEUE_GPUS_PER_ENGINE", show_envvar=True,
              help="Tensor parallelism: each engine gets N consecutive GPUs of --gpus (CUDA_VISIBLE_DEVICES) and "
                   "--tensor-parallel-size N; one consumer per engine.")
@click.option("--data-parallel", type=click.IntRange(1, 64), default=defaults.DATA_PARALLEL, show_default=True,
              envvar="GENQUEUE_DATA_PARALLEL", show_envvar=True,
              help="Data parallelism inside one engine: each engine gets D x --gpus-per-engine GPUs and "
                   "--data-parallel-size D; its one consumer's --max-concurrency grows D times.")
@click.option("--devices", type=click.Choice(DEVICES), default=defaults.DEVICE, show_default=True,
              help="cpu: do not set CUDA_VISIBLE_DEVICES (vLLM CPU builds).")
@click.option("--base-port", type=click.IntRange(1, 65535), default=defaults.ENGINE_PORT, show_default=True,
              help="The engine whose first GPU is N listens on BASE+N.")
@click.option("--log-dir", type=click.Path(file_okay=False, path_type=Path), default=Path(defaults.LOG_DIR),
              show_default=True, help="engine-gpuN.log, consumer-gpuN.log, pids.json.")
@click.option("--spool-root", type=click.Path(file_okay=False, path_type=Path), default=Path(defaults.SPOOL_ROOT),
              show_default=True, help="Consumer of GPU N spools to ROOT/gpuN (a group: ROOT/gpuA-B).")
@click.option("--metrics-base-port", type=click.IntRange(1, 65535), default=None, envvar="GENQUEUE_METRICS_BASE_PORT",
              show_envvar=True, help="Consumer of GPU N serves Prometheus metrics on BASE+N (default: off).")
@consumer_options
@click.option("--consumer-args", default="", help="More `consumer run` options, e.g. '--shard-max-age 5'.")
@click.option("--engine-start-timeout", type=click.FloatRange(1), default=defaults.ENGINE_START_TIMEOUT,
              show_default=True,
              help="Seconds an engine has to answer /health (large models load for minutes).")
@click.option("--engine-hang-timeout", type=click.FloatRange(0), default=defaults.ENGINE_HANG_TIMEOUT,
              show_default=True,
              help="An engine that answered /health and then fails it this many seconds while its process lives "
                   "is hung: it is killed and restarted (0: never).")
@click.option("-v", "--verbose", count=True, help="More logging (-vv for debug).")
@redis_option
@click.argument("engine_args", nargs=-1, type=click.UNPROCESSED)
@friendly_errors
def launch_command(verbose: int, **options: Unpack[LaunchOptions]) -> None:
    """Start an engine and a consumer per GPU (or group of GPUs) and keep them running until SIGTERM.

    Arguments after `--` go to every engine as they are (speculative decoding, parsers,
    --max-model-len ...).
    """
    from genqueue.consumer.launch.supervisor import Supervisor

    setup_logging(verbose)
    logging.getLogger("genqueue.consumer.launch").setLevel(logging.DEBUG if verbose >= 2 else logging.INFO)
    cfg = LaunchConfig.from_options(options, engine_cmd=node_engine_cmd)
    raise SystemExit(Supervisor(cfg).run())


def node_engine_cmd(vllm_cmd: str | None) -> list[str]:
    """--vllm-cmd resolved on this node: as given, else `vllm serve` from PATH (resolve_engine_cmd)."""
    return resolve_engine_cmd(vllm_cmd, shutil.which, has_module)


if __name__ == "__main__":
    launch_command(prog_name="consumer launch")
