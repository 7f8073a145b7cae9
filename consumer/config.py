"""How one consumer runs: `consumer run`'s options, checked and resolved once into a ConsumerConfig.

The recipe (model, sampling, mode, output) is the run's, read from Redis (common/settings.py),
not here. Every default is a common/defaults.py constant.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from urllib.parse import parse_qs, urlparse

from genqueue.common import defaults
from genqueue.common.cli import ConsumerArgs
from genqueue.common.errors import UserError
from genqueue.common.settings import check_run_name, parse_concurrency
from genqueue.consumer.work.leases import renew_every, shortest_lease

log = logging.getLogger(__name__)


class RunOptions(ConsumerArgs):
    """`consumer run`'s options as click parses them (one key per option, by its parameter name):
    those it shares with `consumer launch` (ConsumerArgs), then its own."""

    endpoint: str | None
    gpu: int | None
    gpus: int
    max_concurrency: int
    spool: str | None
    shared_fs: bool
    request_timeout: float
    max_attempts: int
    shard_max_bytes: int
    shard_max_age: float
    spool_limit: int
    endpoint_wait: float
    metrics_port: int | None
    metrics_host: str
    redis_url: str
    pack_cache: str
    pack_cache_bytes: int


@dataclass(frozen=True, slots=True)
class ConsumerConfig:
    """How one consumer runs: built from `consumer run`'s options by from_options."""

    endpoint: str
    redis_url: str
    run: str | None = None
    concurrency: int = defaults.CONCURRENCY
    auto_concurrency: bool = False
    max_concurrency: int = defaults.MAX_CONCURRENCY
    burst: bool = False
    spool: str = defaults.SPOOL_ROOT
    lease: int = defaults.LEASE_SECONDS
    gpu: int | None = None
    gpus: int = defaults.GPUS_PER_ENGINE  # --engine-gpus: GPU-hours count by it (producer/status/cost.py)
    drain_timeout: float = defaults.DRAIN_TIMEOUT
    request_timeout: float = defaults.REQUEST_TIMEOUT
    max_attempts: int = defaults.MAX_ATTEMPTS
    shard_max_bytes: int = defaults.SHARD_MAX_BYTES
    shard_max_age: float = defaults.SHARD_MAX_AGE
    poll_interval: float = defaults.POLL_INTERVAL
    name: str | None = None
    spool_limit: int = defaults.SPOOL_LIMIT
    metrics_port: int | None = None
    metrics_host: str = defaults.METRICS_HOST
    endpoint_wait: float = defaults.ENDPOINT_WAIT
    telemetry_interval: float = defaults.TELEMETRY_INTERVAL
    shared_fs: bool = False  # local outputs are a filesystem every node shares (common/placement.py)
    pack_cache: str = defaults.PACK_CACHE_DIR  # the host's disk cache of whole packs (common/storage/packcache.py)
    pack_cache_bytes: int = defaults.PACK_CACHE_BYTES  # its bound; 0: no disk cache, a ranged GET per job

    @classmethod
    def from_options(cls, options: RunOptions) -> ConsumerConfig:
        """The config `consumer run` OPTIONS ask for; UserError for a mistake in them. The
        endpoint comes from --endpoint or --gpu, the spool from --spool or the endpoint."""
        gpu = options["gpu"]
        endpoint = options["endpoint"]
        if endpoint is None:
            if gpu is None:
                raise UserError("give --endpoint URL or --gpu N")
            endpoint = f"http://127.0.0.1:{defaults.ENGINE_PORT + gpu}/v1"
        check_endpoint(endpoint)
        run = options["run_name"]
        if run:
            check_run_name(run)
        spool = options["spool"]
        if spool is None:
            tag = f"gpu{gpu}" if gpu is not None else endpoint.rstrip("/").rsplit(":", 1)[-1].split("/")[0]
            spool = f"{defaults.SPOOL_ROOT}/{tag}"
        fixed = parse_concurrency(options["concurrency"])
        if (short := lease_too_short(options["lease"], options["redis_url"])) is not None:
            log.warning(short)
        return cls(endpoint=endpoint, redis_url=options["redis_url"], run=run,
                   concurrency=defaults.CONCURRENCY if fixed is None else fixed, auto_concurrency=fixed is None,
                   max_concurrency=options["max_concurrency"], burst=options["burst"], spool=spool,
                   lease=options["lease"], gpu=gpu, gpus=options["gpus"], drain_timeout=options["drain_timeout"],
                   request_timeout=options["request_timeout"], max_attempts=options["max_attempts"],
                   shard_max_bytes=options["shard_max_bytes"], shard_max_age=options["shard_max_age"],
                   spool_limit=options["spool_limit"], metrics_port=options["metrics_port"],
                   metrics_host=options["metrics_host"],
                   endpoint_wait=options["endpoint_wait"], shared_fs=options["shared_fs"],
                   pack_cache=options["pack_cache"], pack_cache_bytes=options["pack_cache_bytes"])


def check_endpoint(url: str) -> str:
    """URL if it is an http(s) URL with a host and a valid port; UserError otherwise."""
    parts = urlparse(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise UserError(f"--endpoint must be an http(s) URL such as http://127.0.0.1:8000/v1, not {url!r}")
    try:
        _ = parts.port
    except ValueError:
        raise UserError(f"--endpoint {url!r} has an invalid port") from None
    return url


def lease_too_short(lease: float, redis_url: str) -> str | None:
    """The one-line warning for a LEASE shorter than the Redis socket timeout allows (the URL's
    own `?socket_timeout=` or genqueue's default), None when it is long enough: a Redis command
    that hangs until the socket timeout must surface within one renewal period, or a stalled
    Redis costs the consumer its leases (shortest_lease). A warning, not a refusal:
    short leases are for tests and fast failovers, and a healthy Redis answers in milliseconds."""
    timeout = defaults.REDIS_SOCKET_TIMEOUT
    given = parse_qs(urlparse(redis_url).query).get("socket_timeout")
    if given:
        try:
            timeout = float(given[-1])
        except ValueError:
            pass  # redis-py refuses it when it connects, with its own message
    need = shortest_lease(timeout)
    if lease >= need:
        return None
    return (f"--lease {lease:g} s is shorter than the {need:g} s a Redis socket timeout of {timeout:g} s needs "
            f"(a hung command must end within one renewal, every {renew_every(lease):g} s): a stalled "
            f"Redis can cost held leases; raise --lease or lower ?socket_timeout= in the Redis URL")
