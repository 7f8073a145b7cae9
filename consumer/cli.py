"""`consumer`: run a consumer against one endpoint (one per GPU), or the stand-in vLLM."""

from __future__ import annotations

import asyncio
import gc
import logging
import sys
from collections.abc import Coroutine
from typing import Any, Unpack

import click

from genqueue.common import __version__, defaults
from genqueue.common.cli import LazyGroup, consumer_options, friendly_errors, redis_option, setup_logging
from genqueue.common.keepers.redisconn import wait_for
from genqueue.consumer.config import ConsumerConfig, RunOptions

#: The youngest GC generation's threshold (Python's: 700): collected 14x less often, GC time per item falls ~6x.
GC_YOUNG_THRESHOLD = 10_000

#: The commands imported only when they run (common.cli.LazyGroup).
_LAZY = {
    "simulate": "genqueue.consumer.sim.server:simulate_command",
    "launch": "genqueue.consumer.launch.command:launch_command",
    "dashboard": "genqueue.consumer.dashboard.command:dashboard_command",
}


@click.group(cls=LazyGroup, lazy=_LAZY, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="genqueue consumer")
@click.option("-v", "--verbose", count=True, help="More logging on stderr (-vv for debug).")
@click.option("-q", "--quiet", is_flag=True, help="Warnings and errors only.")
@click.pass_context
def main(ctx: click.Context, verbose: int, quiet: bool) -> None:
    """Generate completions for genqueue runs, one consumer per GPU."""
    ctx.obj = {"verbose": verbose, "quiet": quiet}
    setup_logging(verbose)


def _talk(verbose: int, quiet: bool) -> None:
    """A consumer talks at default verbosity: its start line, a progress line a minute, one line
    per notable event (pause, resume, drain, sweep) and a summary at exit. -q: warnings only."""
    if verbose:
        setup_logging(verbose)
    level = logging.WARNING if quiet else logging.DEBUG if verbose >= 2 else logging.INFO
    logging.getLogger("genqueue.consumer").setLevel(level)


@main.command("run")
@consumer_options
@click.option("--endpoint", envvar="GENQUEUE_ENDPOINT", show_envvar=True, help="vLLM OpenAI API base URL, e.g. http://127.0.0.1:8000/v1.")
@click.option("--gpu", type=click.IntRange(0, 1023), default=None,
              help=f"Short for --endpoint http://127.0.0.1:<{defaults.ENGINE_PORT}+N>/v1; also recorded in results.")
@click.option("--engine-gpus", "gpus", type=click.IntRange(1, 1024), default=defaults.GPUS_PER_ENGINE,
              show_default=True, envvar="GENQUEUE_ENGINE_GPUS", show_envvar=True,
              help="GPUs the engine behind --endpoint runs on (tensor x data parallel): `producer status` "
                   "counts GPU-hours by it. `consumer launch` sets it.")
@click.option("--max-concurrency", type=click.IntRange(1, 100_000), default=defaults.MAX_CONCURRENCY,
              show_default=True, help="Ceiling for --concurrency auto.")
@click.option("--spool", default=None, help=f"Local spool directory (default: {defaults.SPOOL_ROOT}/<gpu or port>).")
@click.option("--shared-fs", is_flag=True,
              help="Runs whose output is a local path: this host mounts it as the filesystem every node shares, "
                   "so serve them though another host created them (without it they are refused; hosts are named "
                   "by GENQUEUE_HOST, else their hostname).")
@click.option("--request-timeout", type=float, default=defaults.REQUEST_TIMEOUT, show_default=True,
              help="Seconds to wait for one completion (a long reasoning trace can take many minutes).")
@click.option("--max-attempts", type=click.IntRange(1, 100), default=defaults.MAX_ATTEMPTS, show_default=True,
              help="Attempts per request: every failed one counts (refused or reset connections, timeouts, "
                   "408/429/5xx, unusable 200s), whatever /health says; requests wait without spending "
                   "attempts only while /health fails.")
@click.option("--shard-max-bytes", type=click.IntRange(1), default=defaults.SHARD_MAX_BYTES, show_default=True)
@click.option("--shard-max-age", type=float, default=defaults.SHARD_MAX_AGE, show_default=True,
              help="Seconds before an open shard is sealed and shipped (its jobs are acked then).")
@click.option("--spool-limit", type=click.IntRange(1), default=defaults.SPOOL_LIMIT, show_default=True,
              help="Bytes of unshipped results on local disk past which admission pauses.")
@click.option("--endpoint-wait", type=click.FloatRange(0), default=defaults.ENDPOINT_WAIT, show_default=True,
              help="Seconds to wait at start for the endpoint (vLLM loads a large model for minutes) and for Redis.")
@click.option("--metrics-port", type=click.IntRange(1, 65535), default=None, envvar="GENQUEUE_METRICS_PORT",
              show_envvar=True,
              help="Serve Prometheus metrics on this port (default: off), on every interface of the host "
                   "(--metrics-host) for a Prometheus elsewhere to scrape.")
@click.option("--metrics-host", default=defaults.METRICS_HOST, show_default=True, envvar="GENQUEUE_METRICS_HOST",
              show_envvar=True,
              help="The address the metrics port listens on: 127.0.0.1 keeps it to this host.")
@click.option("--pack-cache", default=defaults.PACK_CACHE_DIR, show_default=True, envvar="GENQUEUE_PACK_CACHE",
              show_envvar=True,
              help="Directory of the host's cache of whole packs (runs enqueued with --prompts reference): every "
                   "consumer of the host given the same one reads a pack another fetched.")
@click.option("--pack-cache-bytes", type=click.IntRange(0), default=defaults.PACK_CACHE_BYTES, show_default=True,
              envvar="GENQUEUE_PACK_CACHE_BYTES", show_envvar=True,
              help="Bytes of packs the cache keeps (least recently used out); 0 turns it off: one ranged GET "
                   "of the store per job instead.")
@click.option("-v", "--verbose", count=True, help="More logging on stderr (-vv for debug).")
@click.option("-q", "--quiet", is_flag=True, help="Warnings and errors only.")
@redis_option
@click.pass_context
@friendly_errors
def run_cmd(ctx: click.Context, verbose: int, quiet: bool, **options: Unpack[RunOptions]) -> None:
    """Pull jobs from Redis and generate them against ENDPOINT, C requests in flight."""
    from genqueue.common.contracts import ExitCode
    from genqueue.consumer.guards.stop import Stop, Stopped
    from genqueue.consumer.metrics import serve_metrics
    from genqueue.consumer.worker import Consumer

    outer = ctx.obj or {}
    _talk(verbose + outer.get("verbose", 0), quiet or outer.get("quiet", False))
    cfg = ConsumerConfig.from_options(options)
    stop = Stop(cfg.drain_timeout)
    stop.install_early()  # the loop's handlers do not exist yet: a signal here must still end it
    # the metrics and the first line come before any wait (on Redis, then on the engine); a port
    # that cannot be listened on is refused before the consumer starts at all
    serve_metrics(cfg.metrics_port, cfg.metrics_host)
    logging.getLogger("genqueue.consumer").info("consumer starting: endpoint %s, gpu %s, runs %s", cfg.endpoint,
                                                "-" if cfg.gpu is None else cfg.gpu, cfg.run or "(all open)")
    try:
        conn = wait_for(cfg.redis_url, cfg.endpoint_wait,
                        say=lambda msg: logging.getLogger("genqueue.consumer").warning(msg))
        _tune_gc()
        code = _run_loop(Consumer(cfg, conn, stop=stop).run())
    except Stopped:
        code = ExitCode.INTERRUPTED if stop.hard else ExitCode.DONE
    stop.exit(code)
    if code:
        sys.exit(code)


def _tune_gc() -> None:
    """Make the cyclic collector cheap for a process that allocates a few dicts per item.

    Everything imported so far lives for the whole run, so it is frozen out of every later
    collection; and the youngest generation is collected every GC_YOUNG_THRESHOLD net
    allocations, since almost everything an item allocates is freed by reference counting
    anyway (the collector's time: BENCHMARKS.md, "What limited each figure"). Memory is
    unchanged but for the few cycles an item makes, which wait a little longer.
    """
    gc.collect()
    gc.freeze()
    _, second, third = gc.get_threshold()
    gc.set_threshold(GC_YOUNG_THRESHOLD, second, third)


def _run_loop(coro: Coroutine[Any, Any, int]) -> int:
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)
