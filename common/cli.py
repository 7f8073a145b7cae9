"""What the command-line programs share: the Redis option, the options of `consumer run` that
`consumer launch` passes to its consumers, logging, and error handling."""

from __future__ import annotations

import errno
import functools
import importlib
import logging
import sys
from collections.abc import Callable, Mapping
from typing import Any, TypedDict, TypeVar, cast

import click
from redis.exceptions import RedisError

from genqueue.common import defaults
from genqueue.common.errors import GenqueueError, UserError
from genqueue.common.redact import redact

F = TypeVar("F", bound=Callable[..., Any])

#: OSErrors that mean the disk or the place refused a write: a full disk, a spent quota, an I/O
#: error, a read-only or forbidden place, a file too large.
_WRITE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EROFS, errno.EACCES, errno.EFBIG})


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


#: The options `consumer run` and `consumer launch` both take, declared once (as rq's CLI shares
#: its own through pass_cli_config): launch passes each to every consumer it starts, so each means
#: the same in both, with the same type and default.
_CONSUMER_OPTIONS = (
    click.option("--run", "run_name",
                 help="Serve only this run (default: every open run the engine's model fits)."),
    click.option("--concurrency", "-c", default=defaults.CONCURRENCY_OPTION, show_default=True,
                 help="Requests kept in flight per consumer: a number, or auto (steered by vLLM's /metrics: "
                      "running and waiting)."),
    click.option("--lease", type=click.IntRange(2, 3600), default=defaults.LEASE_SECONDS, show_default=True,
                 help="Seconds a job's lease lasts without renewal; a dead consumer's jobs return after this."),
    click.option("--drain-timeout", type=click.FloatRange(0), default=defaults.DRAIN_TIMEOUT, show_default=True,
                 help="On SIGTERM or Ctrl-C, seconds in-flight requests get before their jobs go back to the queue "
                      "(a second signal stops at once)."),
    click.option("--burst", is_flag=True,
                 help="Exit once the served runs are drained and nothing is in flight (launch: once every "
                      "consumer has)."),
)


class ConsumerArgs(TypedDict):
    """The options of _CONSUMER_OPTIONS as click parses them; each command's own typed options
    (consumer/config.RunOptions, consumer/launch/plan.LaunchOptions) extend it."""

    run_name: str | None
    concurrency: str
    lease: int
    drain_timeout: float
    burst: bool


def consumer_options(f: F) -> F:
    """--run, --concurrency/-c, --lease, --drain-timeout and --burst, for `consumer run` and
    `consumer launch` (_CONSUMER_OPTIONS)."""
    for option in reversed(_CONSUMER_OPTIONS):
        f = option(f)
    return f


def _noop(**_: Any) -> None:
    pass


#: A command holding only the shared options: what forwarding them reads (their declared order
#: and defaults).
_SHARED = click.command("consumer")(consumer_options(_noop))

#: The shared options as click.Option objects, in their declared order.
CONSUMER_OPTIONS: tuple[click.Option, ...] = tuple(p for p in _SHARED.params if isinstance(p, click.Option))


def consumer_defaults() -> ConsumerArgs:
    """Every shared option at its declared default (what `consumer run` gets when none is given)."""
    with _SHARED.make_context("consumer", []) as ctx:
        return pick_consumer_args(ctx.params)


def pick_consumer_args(options: Mapping[str, Any]) -> ConsumerArgs:
    """The shared options out of a command's parsed OPTIONS (launch keeps them to forward)."""
    return cast(ConsumerArgs, {p.name: options[p.name] for p in CONSUMER_OPTIONS if p.name})


def consumer_run_args(values: ConsumerArgs) -> list[str]:
    """VALUES as `consumer run` arguments, in declaration order; an option at its default is left
    out (the consumer has the same default, from the same declaration)."""
    argv: list[str] = []
    given: Mapping[str, Any] = values
    default: Mapping[str, Any] = consumer_defaults()
    for p in CONSUMER_OPTIONS:
        name, flag = p.name or "", next(o for o in p.opts if o.startswith("--"))
        if given[name] == default[name]:
            continue
        argv += [flag] if p.is_flag else [flag, str(given[name])]
    return argv


class LazyGroup(click.Group):
    """A click group whose commands named in LAZY ("name": "module:attribute") are imported only
    when that command runs (or when help or `commands` lists them all): `producer status` does not
    pay for importing the enqueue and export paths, each a few hundred milliseconds of CPU."""

    def __init__(self, *args: Any, lazy: Mapping[str, str] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._lazy = dict(lazy or {})

    @property  # type: ignore[override]
    def commands(self) -> dict[str, click.Command]:
        for name in list(self._lazy):
            self._load(name)
        return self._commands

    @commands.setter
    def commands(self, value: dict[str, click.Command]) -> None:
        self._commands = value

    def add_command(self, cmd: click.Command, name: str | None = None) -> None:
        name = name or cmd.name
        if name is None:
            raise TypeError("Command has no name.")
        self._commands[name] = cmd
        self._lazy.pop(name, None)

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*self._commands, *self._lazy})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name in self._lazy:
            self._load(cmd_name)
        return self._commands.get(cmd_name)

    def _load(self, name: str) -> None:
        module, _, attr = self._lazy.pop(name).partition(":")
        cmd = getattr(importlib.import_module(module), attr)
        if not isinstance(cmd, click.Command):
            raise TypeError(f"{module}:{attr} is not a click command")
        self._commands[name] = cmd


class RedactingFormatter(logging.Formatter):
    """Formats as usual, then masks credentials (common.redact): a library may log the URL
    it connects to, and a traceback may quote one."""

    def format(self, record: logging.LogRecord) -> str:
        return redact(super().format(record))


def setup_logging(verbose: int) -> None:
    level = logging.WARNING if verbose <= 0 else logging.INFO if verbose == 1 else logging.DEBUG
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(RedactingFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=level, handlers=[handler])
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
            click.echo(f"error: {_one_line(e)}", err=True)
            sys.exit(e.exit_code)
        except RedisError as e:
            click.echo(f"error: Redis: {_one_line(e)}", err=True)
            sys.exit(1)
        except GenqueueError as e:
            click.echo(f"error: {_one_line(e)}", err=True)
            sys.exit(1)
        except KeyboardInterrupt:
            click.echo("interrupted", err=True)
            sys.exit(130)
        except BrokenPipeError:
            sys.exit(1)
        except OSError as e:
            # A write the command does not wrap itself (it would name the option that moves it):
            # still one line, naming the file. Other OSErrors are bugs and keep their traceback.
            if e.errno not in _WRITE_ERRNOS:
                raise
            where = f": {e.filename}" if e.filename else ""
            click.echo(f"error: {e.strerror or _one_line(e)}{where}", err=True)
            sys.exit(1)

    return wrapper  # type: ignore[return-value]


def _one_line(e: BaseException) -> str:
    """E's message on one line, credentials masked."""
    return redact(" ".join(str(e).split()) or type(e).__name__)
