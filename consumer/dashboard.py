"""`consumer dashboard`: rq-dashboard, made to read genqueue's queues, jobs and workers.

    consumer dashboard                       # REDIS_URL, http://127.0.0.1:9181
    consumer dashboard --bind 0.0.0.0 --port 9181 --username ops --password ...

rq-dashboard (0.9) out of the box fails on genqueue in three ways:

- it imports `six` without declaring it (the `dashboard` extra installs it);
- without `--json` it reads job payloads and results with pickle, and genqueue's are JSON: the
  finished-jobs and workers pages answer 500 (DeserializationError);
- even with `--json` its workers views list workers with rq's default (pickle) serializer, so
  a consumer holding jobs makes workers.json answer 500 and the Workers page shows
  "Loading..." forever (upstream `rq_dashboard/web.py`: `Worker.all(connection=...)`).

This runs rq-dashboard's own command line with `--json`, its worker listing reading jobs with
the JSON serializer, and a worker whose current job no serializer can read shown with its id
instead of failing the whole page. Every rq-dashboard option passes through; the Redis URL
comes from REDIS_URL as for genqueue's other commands, and it listens on 127.0.0.1 unless told.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
from types import ModuleType
from typing import Any

import click

from genqueue.common.cli import setup_logging
from genqueue.common.redact import redact

log = logging.getLogger(__name__)

#: The rq-dashboard series whose internals `patch` was written and tested against.
TESTED_SERIES = "0.9."

INSTALL_HINT = "pip install 'rq-dashboard==0.9.*' six (from a checkout: pip install -e '.[dashboard]')"


class DashboardMissing(Exception):
    """rq-dashboard, or a module it needs, is not installed."""


def load() -> tuple[ModuleType, ModuleType]:
    """rq-dashboard's cli and web modules; DashboardMissing naming what is absent."""
    try:
        cli = importlib.import_module("rq_dashboard.cli")
        web = importlib.import_module("rq_dashboard.web")
    except ModuleNotFoundError as e:
        raise DashboardMissing(f"rq-dashboard cannot start here ({e}): {INSTALL_HINT}") from None
    return cli, web


def patch(web: ModuleType) -> None:
    """Make rq-dashboard's worker views read genqueue's JSON jobs (see the module docstring)."""
    from rq.exceptions import DeserializationError
    from rq.serializers import JSONSerializer

    worker_cls: Any = web.Worker

    class JsonWorker(worker_cls):  # type: ignore[misc]  # rq-dashboard's Worker, untyped to mypy here
        @classmethod
        def all(cls, *args: Any, **kwargs: Any) -> Any:
            kwargs.setdefault("serializer", JSONSerializer)
            return super().all(*args, **kwargs)

    show_current = web.serialize_current_job

    def serialize_current_job(job: Any) -> Any:
        try:
            return show_current(job)
        except DeserializationError:  # a job of some other worker, not JSON: show what is readable
            return {"job_id": job.id, "description": job.description, "created_at": None,
                    "call_string": "(payload is not JSON)"}

    # setattr: mypy sees rq-dashboard's modules as plain ModuleType
    setattr(web, "Worker", JsonWorker)  # noqa: B010
    setattr(web, "serialize_current_job", serialize_current_job)  # noqa: B010


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


if __name__ == "__main__":
    dashboard_command(prog_name="consumer dashboard")
