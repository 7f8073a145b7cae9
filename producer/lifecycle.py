"""Runs have a lifecycle: `producer runs` lists them, `producer resume` clears a pause,
`producer delete` removes a run's state from Redis (its output only with --purge-output).

A run's state is common/keepers/runstate.py's, the one `producer status` shows: done or
failed once every item has its record (failed: some only an error, which `producer enqueue INPUT
--run NAME --retry-failed` queues again), else paused, running, queued or incomplete.
A paused or failed run's row says its errors and the command that goes on once the cause is
fixed (common/retryhint.py). Its failed items by class, and the jobs rq gave up on (a pack that
did not read named), are status's figures by status's functions (common/keepers/outcomes.py).
"""

from __future__ import annotations

import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import click
import orjson
import redis

from genqueue.common.cli import friendly_errors, redis_option
from genqueue.common.errors import CorruptStateError, UserError
from genqueue.common.keepers.outcomes import FailedJobsView, failed_jobs_line, outcome_view, read_failed_jobs
from genqueue.common.keepers.pause import Pause
from genqueue.common.keepers.redisconn import connect
from genqueue.common.keepers.rqaccess import clear_refused, queue_name
from genqueue.common.keepers.rqjobs import scan_jobs
from genqueue.common.keepers.rundelete import delete_run
from genqueue.common.keepers.runs import RunStore
from genqueue.common.keepers.runstate import RunState, read_pulse, settle
from genqueue.common.placement import this_host
from genqueue.common.redact import redact
from genqueue.common.retryhint import failed_summary, next_steps
from genqueue.common.settings import check_run_name


@dataclass(frozen=True, slots=True)
class RunRow:
    name: str
    created_at: float
    state: RunState
    items: int
    done: int
    failed: int
    output: str
    paused: str | None
    priority: int = 0
    failed_by_class: dict[str, int] = field(default_factory=dict)
    next_steps: str = ""  # what to run once the cause of a pause or of failed items is fixed
    stalled: str = ""  # INCOMPLETE: where its items are, and what queues them
    #: the jobs rq gave up on, by class (status's `failed jobs` row)
    failed_jobs: FailedJobsView = field(default_factory=lambda: FailedJobsView(jobs=0, items=0, by_class={}))


def run_rows(conn: redis.Redis) -> list[RunRow]:
    """Every run in Redis, oldest first, with its state."""
    store = RunStore(conn)
    rows = []
    names = store.names()
    priorities = store.priorities(names) if names else {}
    for name in names:
        try:
            info = store.get(name)
        except CorruptStateError as e:  # one bad record must not hide the other runs
            rows.append(RunRow(name, 0.0, RunState.UNREADABLE, 0, 0, 0, "?", str(e)))
            continue
        if info is None:
            continue
        pulse = read_pulse(conn, name)  # the state status shows too: one read, one function
        pause, counted = pulse.pause, pulse.progress
        items, done, failed = counted.items, counted.done, counted.failed_only
        sources = store.sources(name)
        state, stalled = settle(conn, name, pulse, sources)
        # status's figures, by status's function: the same classes, counts and order on both screens
        by_class = outcome_view(counted.stats, done, failed)["failed_by_class"]
        gave_up = read_failed_jobs(conn, name)
        steps = next_steps(name, paused=pause is not None, failed=failed, sources=sources,
                           output=redact(info.settings.output))
        rows.append(RunRow(name, info.created_at, state, items, done, failed,
                           redact(info.settings.output), pause["reason"] if pause else None,
                           priorities.get(name, 0), by_class, steps, stalled or "", gave_up))
    return rows


@click.command("runs")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per run on stdout.")
@redis_option
@friendly_errors
def runs_command(as_json: bool, redis_url: str) -> None:
    """List the runs in Redis: created, state, items done of total, output."""
    rows = run_rows(connect(redis_url))
    if as_json:
        for r in rows:
            click.echo(orjson.dumps({"run": r.name, "created_at": r.created_at, "state": r.state.value,
                                     "items": r.items, "done": r.done, "failed": r.failed,
                                     "output": r.output, "paused": r.paused, "priority": r.priority,
                                     "failed_by_class": r.failed_by_class, "next_steps": r.next_steps,
                                     "stalled": r.stalled, "failed_jobs": r.failed_jobs}).decode())
        return
    if not rows:
        click.echo("no runs in Redis")
        return
    width = max(len(r.name) for r in rows)
    click.echo(f"{'run':<{width}}  {'created':<16}  {'state':<10}  {'priority':>8}  {'done of items':>17}  output")
    for r in rows:
        created = time.strftime("%Y-%m-%d %H:%M", time.localtime(r.created_at))
        done = f"{r.done:,} of {r.items:,}"
        click.echo(f"{r.name:<{width}}  {created:<16}  {r.state.value:<10}  {r.priority:>8}  {done:>17}  {r.output}")
        if r.paused:
            click.secho(f"{'':<{width}}  paused: {r.paused}", fg="red")
        if r.failed:
            click.secho(f"{'':<{width}}  {failed_summary(r.failed, r.failed_by_class)}", fg="red")
        if r.failed_jobs["jobs"]:
            click.secho(f"{'':<{width}}  failed jobs: {failed_jobs_line(r.failed_jobs, queue_name(r.name))}", fg="red")
        if r.stalled:
            click.secho(f"{'':<{width}}  {r.stalled}", fg="red")
        if r.next_steps:
            click.echo(f"{'':<{width}}  {r.next_steps}")


@click.command("resume")
@click.option("--run", "run_name", required=True, help="The run to resume.")
@redis_option
@friendly_errors
def resume_command(run_name: str, redis_url: str) -> None:
    """Clear a run's pause (after fixing its cause): consumers take its jobs again."""
    conn = connect(redis_url)
    RunStore(conn).require(check_run_name(run_name))
    was = Pause(conn, run_name).resume()
    if was is None:
        click.echo(f"run {run_name} is not paused")
        return
    click.echo(f"run {run_name} resumed (it was paused by {was['by']}: {was['reason']})")


def _confirm(question: str) -> None:
    """Ask QUESTION; a no, or no answer at all (the end of the input), ends the command: nothing
    deleted, exit 1 (click's Abort: declined, not a mistake of usage)."""
    try:
        if click.confirm(question, default=False):
            return
    except click.Abort:  # the end of the input (or Ctrl-C) at the prompt
        click.echo()
    click.echo("nothing deleted", err=True)
    sys.exit(1)


@click.command("delete")
@click.option("--run", "run_name", required=True, help="The run to delete.")
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
@click.option("--purge-output", is_flag=True,
              help="Also delete the run's results under its output (a local directory only).")
@click.option("--refused-only", is_flag=True,
              help="Only clear the jobs consumers refused (and their reasons); the run stays.")
@redis_option
@friendly_errors
def delete_command(run_name: str, yes: bool, purge_output: bool, refused_only: bool, redis_url: str) -> None:
    """Remove a run's state from Redis: its settings, queue, jobs and counters. The results
    already shipped stay where they are unless --purge-output.

    Asks first, unless --yes: a no (n, or Enter), or no answer at all (the end of the input, as
    in a script without --yes), deletes nothing and exits 1, as click's own confirmations do."""
    conn = connect(redis_url)
    if refused_only:
        if purge_output:
            raise UserError("--refused-only clears refused jobs alone; it does not go with --purge-output")
        cleared = clear_refused(conn, check_run_name(run_name))
        click.echo(f"run {run_name}: {len(cleared)} refused job(s) cleared" + (
            ": " + ", ".join(cleared) if cleared else ""))
        return
    try:
        info = RunStore(conn).get(check_run_name(run_name))
    except CorruptStateError:
        if purge_output:  # where its output is cannot be read from it
            raise
        info = None
        if not yes:
            _confirm(f"delete run {run_name} (its record in Redis is unreadable)?")
    else:
        if info is None:
            raise RunStore(conn).not_found(run_name)
    output = info.settings.output if info is not None else ""
    if purge_output and output.startswith("s3://"):
        raise UserError("--purge-output removes local outputs only; delete s3:// objects with your S3 tools")
    refusal = info.placement.refusal(run_name, output, this_host()) if purge_output and info else None
    if refusal is not None:  # this host's directory of that name is not the run's
        raise UserError(refusal)
    if not yes and info is not None:
        what = f"run {run_name} (its queue, jobs and counters in Redis"
        what += f", and its results under {redact(output)})" if purge_output else "; its output is kept)"
        _confirm(f"delete {what}?")
    scan = scan_jobs(conn, run_name)  # named before they go: no entry Redis holds may stop the delete
    n = delete_run(conn, run_name)
    click.echo(f"run {run_name} deleted: {n} Redis keys")
    if scan.count:
        click.echo(scan.line("deleted with it"))
    if purge_output:
        target = Path(output) / run_name
        if target.is_dir():
            shutil.rmtree(target)
            click.echo(f"removed {target}")

