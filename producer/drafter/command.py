"""`producer drafter-report`: a candidate drafter's acceptance by category, from its run's
records, side by side with another run's."""

from __future__ import annotations

import functools

import click
import orjson
import redis

from genqueue.common.cli import friendly_errors, redis_option
from genqueue.common.errors import UserError
from genqueue.common.keepers.redisconn import connect
from genqueue.producer.drafter.compare import nothing_in_common, report, report_lines
from genqueue.producer.drafter.reading import read_answers, resolve


@click.command("drafter-report")
@click.argument("candidate", metavar="CANDIDATE")
@click.option("--against", "baseline", default=None, metavar="BASELINE",
              help="The run to compare with (the previous drafter's, or one served without speculation), named "
                   "as CANDIDATE is; the table is then over the items both answered.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of the table.")
@redis_option
@friendly_errors
def drafter_report_command(candidate: str, baseline: str | None, as_json: bool, redis_url: str) -> None:
    """The acceptance of CANDIDATE's drafter by category (source, variant, turn, answer length):
    answers, draft acceptance rate, mean acceptance length, and its weakest category; with
    --against, beside BASELINE's and the difference.

    CANDIDATE and BASELINE are each a run's output, `<output>/<run>` (a directory, or
    s3://bucket/prefix/<run>; a local one in the current directory as ./<run>), or a run's name,
    whose output Redis holds. Only the records are read: the report is the same once Redis has
    forgotten the runs. Declare an evaluation run with `producer enqueue --drafter NAME`."""
    @functools.cache
    def redis_conn() -> redis.Redis:  # only a run named by its name needs Redis
        return connect(redis_url)

    cand = read_answers(resolve(candidate, redis_conn))
    base = read_answers(resolve(baseline, redis_conn)) if baseline is not None else None
    if base is not None and (why := nothing_in_common(cand, base)) is not None:
        raise UserError(why)
    r = report(cand, base)
    if as_json:
        click.echo(orjson.dumps(r).decode())
    else:
        click.echo("\n".join(report_lines(r)))
