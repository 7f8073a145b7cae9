"""Every Redis connection genqueue makes: one place that sets its timeouts, health checks,
keepalive and retries (each value's reason beside it: here, or common/defaults.py for what a user
may set), for the sync and the asyncio client alike, and keeps the password out of every message.

Left to the client's defaults these change between redis-py releases, and a connection to a
server that vanished without a FIN (a rebooted node, a partition, a NAT that forgot the flow)
can hang a producer or a consumer's lease renewal for as long as the kernel keeps trying.
A URL's own query options (`?socket_timeout=30`) still win, for one deployment's needs.

Retries: redis-py, when told to retry, re-sends a command, a pipeline or a MULTI/EXEC
transaction on a fresh connection after a connection error or a timeout, even when the server
had applied it and only the reply was lost. genqueue's connections do not retry (RETRIES); a
caller retries what it knows to be safe. Writes that must not happen twice are idempotent anyway
(the producer's claim script) or run under WATCH, under which redis-py raises instead of
re-sending.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from typing import Any

import redis
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import NoBackoff
from redis.retry import Retry

from genqueue.common import defaults
from genqueue.common.backoff import compute_backoff
from genqueue.common.errors import RedisUnavailableError, as_clause
from genqueue.common.eta import format_duration
from genqueue.common.redact import redact

#: TCP keepalive: probe after this many seconds idle, so NATs (which drop idle flows in 4-6 min) keep it.
KEEPALIVE_IDLE = 60
#: Seconds between keepalive probes.
KEEPALIVE_INTERVAL = 10
#: Probes missed before a peer is dead: found in ~90 s, not the kernel's 2 h.
KEEPALIVE_COUNT = 3
#: The client sends a command once: a re-send after a lost reply can apply a write twice; callers
#: that know a call is safe retry it themselves, with a log line.
RETRIES = 0

#: Old name of genqueue.common.redact.redact, kept while callers move.
redact_url = redact


def keepalive_options() -> dict[int, int]:
    """TCP keepalive timing for this platform (Linux names; macOS calls the idle time TCP_KEEPALIVE)."""
    names = (
        (("TCP_KEEPIDLE", "TCP_KEEPALIVE"), KEEPALIVE_IDLE),
        (("TCP_KEEPINTVL",), KEEPALIVE_INTERVAL),
        (("TCP_KEEPCNT",), KEEPALIVE_COUNT),
    )
    options: dict[int, int] = {}
    for candidates, value in names:
        for name in candidates:
            opt = getattr(socket, name, None)
            if isinstance(opt, int):
                options[opt] = value
                break
    return options


def connection_kwargs(url: str) -> dict[str, Any]:
    """The client options genqueue sets on every connection to URL (retry excluded: the sync and
    the asyncio clients take different Retry classes)."""
    kwargs: dict[str, Any] = {
        "socket_timeout": defaults.REDIS_SOCKET_TIMEOUT,
        "socket_connect_timeout": defaults.REDIS_CONNECT_TIMEOUT,
        "health_check_interval": defaults.REDIS_HEALTH_CHECK_INTERVAL,
    }
    if not url.lower().startswith("unix:"):  # keepalive is TCP's; a unix socket refuses the options
        kwargs["socket_keepalive"] = True
        kwargs["socket_keepalive_options"] = keepalive_options()
    return kwargs


def redis_location(conn: redis.Redis | aioredis.Redis) -> str:
    """The URL of the Redis CONN talks to, its password masked: for the lines that say what was
    not found there ("no run named 'x' in Redis at redis://127.0.0.1:6379/0")."""
    pool = conn.connection_pool
    kw: dict[str, Any] = dict(getattr(pool, "connection_kwargs", {}))
    cls = getattr(pool, "connection_class", object)
    db = kw.get("db") or 0
    if kw.get("path"):
        return redact(f"unix://{kw['path']}?db={db}")
    scheme = "rediss" if issubclass(cls, (redis.SSLConnection, aioredis.SSLConnection)) else "redis"
    user, password = kw.get("username"), kw.get("password")
    auth = f"{user or ''}:{password}@" if password else (f"{user}@" if user else "")
    host = str(kw.get("host") or "localhost")
    port = kw.get("port") or 6379
    return redact(f"{scheme}://{auth}{f'[{host}]' if ':' in host else host}:{port}/{db}")


def connect(url: str, *, check: bool = True) -> redis.Redis:
    """A Redis client for URL (redis://, rediss://, unix://); pings it unless check is false."""
    try:
        conn = redis.Redis.from_url(url, retry=Retry(NoBackoff(), RETRIES), **connection_kwargs(url))
    except ValueError as e:
        raise RedisUnavailableError(f"invalid Redis URL {redact(url)}: {redact(str(e))}") from None
    if check:
        try:
            conn.ping()
        except redis.exceptions.RedisError as e:
            raise RedisUnavailableError(f"cannot reach Redis at {redact(url)}: {redact(str(e))}") from None
    return conn


def wait_for(url: str, seconds: float, *, say: Callable[[str], None]) -> redis.Redis:
    """connect(URL), waiting up to SECONDS for Redis to answer (a consumer started while Redis
    restarts must not exit: under a supervisor that would be a crash loop). Says so every 10 s."""
    t0 = time.monotonic()
    deadline = t0 + seconds
    last = 0.0
    attempt = 0
    while True:
        try:
            return connect(url)
        except RedisUnavailableError as e:
            now = time.monotonic()
            if now >= deadline or "invalid Redis URL" in str(e):
                raise
            if now - last >= 10.0:
                say(f"{as_clause(e)}; waited {format_duration(now - t0)}, waiting {format_duration(deadline - now)} more "
                    f"(--endpoint-wait {format_duration(seconds)})")
                last = now
            time.sleep(compute_backoff(min(attempt, 4), base=0.5, cap=5.0))
            attempt += 1


def async_connect(url: str, *, max_connections: int | None = None, wait: float | None = None) -> aioredis.Redis:
    """A redis.asyncio client for URL with the same options as connect(). No I/O here: it
    connects on its first command (await async_check(conn, url) to fail early). With
    MAX_CONNECTIONS, its pool opens at most that many and a command past them waits up to WAIT
    seconds for one (redis-py's own pool raises "Too many connections" past 100 instead)."""
    try:
        if max_connections is None:
            return aioredis.Redis.from_url(
                url, retry=AsyncRetry(NoBackoff(), RETRIES), **connection_kwargs(url)
            )
        pool = aioredis.BlockingConnectionPool.from_url(
            url, max_connections=max_connections, timeout=wait,
            retry=AsyncRetry(NoBackoff(), RETRIES), **connection_kwargs(url))
        return aioredis.Redis.from_pool(pool)
    except ValueError as e:
        raise RedisUnavailableError(f"invalid Redis URL {redact(url)}: {redact(str(e))}") from None


async def async_check(conn: aioredis.Redis, url: str) -> None:
    """PING through CONN; RedisUnavailableError (with URL redacted) when Redis does not answer."""
    try:
        await conn.ping()
    except redis.exceptions.RedisError as e:
        raise RedisUnavailableError(f"cannot reach Redis at {redact(url)}: {redact(str(e))}") from None
