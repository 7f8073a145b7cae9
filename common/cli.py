"""What both command-line programs share: the Redis option, logging, and error handling."""

from __future__ import annotations

import functools
import logging
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import click
import redis

from genqueue.common import defaults
from genqueue.common.errors import GenqueueError, UserError
from genqueue.common.redisconn import redact_url

F = TypeVar("F", bound=Callable[..., Any])


def redis_option(f: F) -> F:
    """--redis-url/-u, read from REDIS_URL as rq's own tools do."""
    return click.option(
        "--redis-url",
        "-u",
        envvar="REDIS_URL",
        default=defaults.REDIS_URL,
        show_default=True,
        help="Redis URL (redis://, rediss://, unix://); env REDIS_URL.",
    )(f)


def setup_logging(verbose: int) -> None:
    level = logging.WARNING if verbose <= 0 else logging.INFO if verbose == 1 else logging.DEBUG
    logging.basicConfig(
        level=level,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    # rq logs every job at INFO (and sets rq.worker to INFO when imported); genqueue logs its
    # own line per job, so rq speaks at -vv only.
    for name in ("rq", "rq.worker", "rq.job", "rq.queue", "rq.registry", "rq.intermediate_queue"):
        logging.getLogger(name).setLevel(logging.DEBUG if verbose >= 2 else logging.WARNING)


def friendly_errors(f: F) -> F:
    """Turn a user's mistake into one line on stderr and a non-zero exit, never a traceback."""

    @functools.wraps(f)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return f(*args, **kwargs)
        except UserError as e:
            click.echo(f"error: {e}", err=True)
            sys.exit(e.exit_code)
        except redis.exceptions.RedisError as e:
            click.echo(f"error: Redis: {redact_url(str(e))}", err=True)
            sys.exit(1)
        except GenqueueError as e:
            click.echo(f"error: {e}", err=True)
            sys.exit(1)
        except KeyboardInterrupt:
            click.echo("interrupted", err=True)
            sys.exit(130)
        except BrokenPipeError:
            sys.exit(1)

    return wrapper  # type: ignore[return-value]
