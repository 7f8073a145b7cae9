"""Connecting to Redis, and keeping its password out of every message."""

from __future__ import annotations

import re

import redis

from genqueue.common.errors import RedisUnavailableError

_USERINFO = re.compile(r"(?P<scheme>[a-z][a-z0-9+.-]*://)(?P<userinfo>[^@/]*)@", re.IGNORECASE)


def redact_url(url: str) -> str:
    """Return the URL with any user:password replaced by ***, safe to log or print."""
    return _USERINFO.sub(lambda m: f"{m['scheme']}***@", url)


def connect(url: str, *, check: bool = True) -> redis.Redis:
    """A Redis client for URL (redis://, rediss://, unix://); pings it unless check is false."""
    try:
        conn = redis.Redis.from_url(url, health_check_interval=30, socket_keepalive=True)
    except ValueError as e:
        raise RedisUnavailableError(f"invalid Redis URL {redact_url(url)}: {e}") from None
    if check:
        try:
            conn.ping()
        except redis.exceptions.RedisError as e:
            raise RedisUnavailableError(
                f"cannot reach Redis at {redact_url(url)}: {redact_url(str(e))}"
            ) from None
    return conn
