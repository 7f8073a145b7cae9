"""`consumer dashboard`: the click command, rq-dashboard's own command line run with `--json`,
a local bind and Redis from REDIS_URL (see the wing's docstring, consumer/dashboard/).

    consumer dashboard                       # REDIS_URL, http://127.0.0.1:9181
    consumer dashboard --bind 0.0.0.0 --port 9181 --username ops --password ...
"""

from __future__ import annotations

import importlib
import logging
import os
import sys

import click

from genqueue.common.cli import setup_logging
from genqueue.common.redact import redact
from genqueue.consumer.dashboard.web import TESTED_SERIES, DashboardMissing, load, patch

log = logging.getLogger(__name__)


class _StartLineIsNotAnError(logging.Filter):
    """rq-dashboard logs its normal "Running on" line at ERROR (so that werkzeug, which it sets to
    ERROR, lets it through): say it at INFO, as the start line it is."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno == logging.ERROR and str(record.msg).lstrip().startswith("* Running on"):
            record.levelno, record.levelname = logging.INFO, logging.getLevelName(logging.INFO)
        return True


def redis_help(env: dict[str, str]) -> str:
    """What --redis-url defaults to under genqueue: REDIS_URL, as for every genqueue command."""
    now = f"now {redact(env['REDIS_URL'])}" if env.get("REDIS_URL") else "unset here, so redis://127.0.0.1:6379"
    return f"Redis URL. Can be specified multiple times. Default: $REDIS_URL ({now})."


def help_args(args: list[str]) -> list[str]:
    """-h is --help here too, as for every other genqueue command."""
    return ["--help" if a == "-h" else a for a in args]


def dashboard_args(args: list[str], env: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """rq-dashboard's argv and environment: --json always, 127.0.0.1 unless --bind/-b is given, and
    Redis from REDIS_URL unless --redis-url/-u or RQ_DASHBOARD_REDIS_URL say otherwise (through
    the environment, so the URL and its password never show in ps)."""
    names = {a.split("=", 1)[0] for a in args}
    head = ["--json"]
    if not names & {"--bind", "-b"}:
        head += ["--bind", "127.0.0.1"]
    extra: dict[str, str] = {}
    if not names & {"--redis-url", "-u"} and "RQ_DASHBOARD_REDIS_URL" not in env and env.get("REDIS_URL"):
        extra["RQ_DASHBOARD_REDIS_URL"] = env["REDIS_URL"]
    return [*head, *args], extra


@click.command("dashboard", add_help_option=False, short_help="rq-dashboard for genqueue's queues, jobs and workers.",
               context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def dashboard_command(args: tuple[str, ...]) -> None:
    """rq-dashboard for genqueue's queues, jobs and workers: rq-dashboard's own options pass
    through (--help lists them); Redis from REDIS_URL; 127.0.0.1:9181 unless --bind/--port."""
    setup_logging(0)
    try:
        cli, web = load()
    except DashboardMissing as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(2)
    version = str(getattr(importlib.import_module("rq_dashboard.version"), "VERSION", "?"))
    if not version.startswith(TESTED_SERIES):
        log.warning("rq-dashboard %s: genqueue's fix for its workers page was written for %sx", version, TESTED_SERIES)
    patch(web)
    given = help_args(list(args))
    argv, extra = dashboard_args(given, dict(os.environ))
    os.environ.update(extra)
    for param in cli.run.params:
        if param.name == "redis_url":
            param.help = redis_help(dict(os.environ))
    logging.getLogger("werkzeug").addFilter(_StartLineIsNotAnError())
    if "--help" not in given:
        click.echo(f"dashboard: rq-dashboard {version} reading genqueue's JSON jobs and workers", err=True)
    cli.run.main(args=argv, prog_name="consumer dashboard", auto_envvar_prefix="RQ_DASHBOARD")
