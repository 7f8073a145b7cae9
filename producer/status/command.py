"""`producer status`: the click command, its options, and --watch (redrawn in place on a
terminal, frame after frame into a pipe or file)."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

import click
import orjson

from genqueue.common import defaults
from genqueue.common.cli import friendly_errors, redis_option
from genqueue.common.keepers.redisconn import connect
from genqueue.common.settings import check_run_name
from genqueue.producer.rungone import run_gone

if TYPE_CHECKING:
    from rich.text import Text

    from genqueue.producer.status.frame import Block

#: The line above each frame of a piped `producer status --watch` (then ` at <time> ---`).
WATCH_MARK = "--- producer status"
#: The narrowest terminal status draws for (down to it lines wrap to the terminal; narrower, the terminal wraps).
MIN_WIDTH = 80


@click.command()
@click.option("--run", "run_name", help="Run to show (default: every run).")
@click.option("--watch", is_flag=True, help=("Redraw in place every --interval seconds (Ctrl-C to leave), no taller "
                                             "than the terminal (the headline, progress, coverage and failures first; "
                                             "the last line counts what was left out); into a pipe or file, print "
                                             "each frame whole under a `--- producer status at` line."))
@click.option("--interval", type=click.FloatRange(0.5), default=defaults.STATUS_INTERVAL, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.option("--wide", is_flag=True, help="Clip no line to 100 columns; full input paths, a row per rejected reason.")
@click.option("--output", default=defaults.OUTPUT, show_default=True, envvar="GENQUEUE_OUTPUT", show_envvar=True,
              help="The run's output, where its run.json is looked for when Redis does not hold the run.")
@click.option("--gpu-hour-price", type=click.FloatRange(0), default=None, envvar="GENQUEUE_GPU_HOUR_PRICE",
              show_envvar=True, help="Money a GPU-hour costs: the run's cost is shown in money too (any currency).")
@redis_option
@friendly_errors
def status_command(run_name: str | None, watch: bool, interval: float, as_json: bool, wide: bool, output: str,
           gpu_hour_price: float | None, redis_url: str) -> None:
    """Coverage, speed, ETA, consumers, shipping and engines, per run."""
    import shutil

    from genqueue.common.keepers.redismem import full_line, full_now
    from genqueue.common.keepers.runs import RunStore
    from genqueue.producer.status.core import run_status, status_blocks
    from genqueue.producer.status.frame import Block, Rank, fit_height, joined
    from genqueue.producer.status.screen import WIDTH

    conn = connect(redis_url)
    names = [check_run_name(run_name)] if run_name else RunStore(conn).names()
    if run_name and RunStore(conn).get(run_name) is None:  # Redis lost it? its output may hold run.json
        raise run_gone(run_name, output if "://" in output else os.path.abspath(output), conn)

    def blocks() -> list[Block]:
        reports = [run_status(conn, name, gpu_hour_price=gpu_hour_price) for name in names]
        full = full_now(conn)  # a full Redis still answers reads: status says so, above the runs
        head = [(f"{full_line(full)}: consumers hold their jobs and wait; free memory or raise maxmemory "
                 "(`redis-cli CONFIG SET maxmemory ...`) and the run goes on by itself")] if full is not None else []
        width = None if wide else screen_width()
        screens = [status_blocks(r, width=width) for r in reports] or [[Block(Rank.HEADLINE, ("no runs in Redis",))]]
        return apart([[Block(Rank.HEADLINE, (line,))] for line in head] + screens)

    def render() -> str:
        return joined(blocks())

    def fitted() -> str:  # a frame no taller than the terminal: its top neither scrolls away nor is cut
        size = shutil.get_terminal_size((WIDTH, 24))
        return fit_height(blocks(), size.lines - 1, size.columns,
                          f"producer status --run {run_name}" if run_name else "producer status")

    if as_json:
        reports = [run_status(conn, name, gpu_hour_price=gpu_hour_price) for name in names]
        full = full_now(conn)
        memory = {"full": full is not None, **({"used": full.used, "maxmemory": full.maxmemory} if full else {})}
        click.echo(orjson.dumps({**reports[0], "redis_memory": memory} if run_name
                                else {"runs": reports, "redis_memory": memory}).decode())
    elif watch:
        try:
            if sys.stdout.isatty():
                _watch_terminal(through_outages(fitted, redis_url), interval)
            else:  # a pipe or a file has no height: each frame whole
                _watch_piped(through_outages(render, redis_url), interval)
        except KeyboardInterrupt:  # Ctrl-C is how --watch is left: not an error
            return
    else:
        click.echo(render())


def apart(screens: list[list[Block]]) -> list[Block]:
    """SCREENS one after the other, a blank line between two (on the first block of the next)."""
    from genqueue.producer.status.frame import Block

    out: list[Block] = []
    for n, screen in enumerate(screens):
        if n and screen:
            screen = [Block(screen[0].rank, ("", *screen[0].lines)), *screen[1:]]
        out += screen
    return out


def screen_width() -> int:
    """The columns a screen is drawn in: WIDTH, or a terminal's when it is narrower (down to 80:
    lines wrap there, never cut); into a pipe or file, WIDTH."""
    import shutil

    from genqueue.producer.status.screen import WIDTH

    if not sys.stdout.isatty():
        return WIDTH
    return max(min(shutil.get_terminal_size((WIDTH, 24)).columns, WIDTH), MIN_WIDTH)


def through_outages(render: Callable[[], str], url: str) -> Callable[[], str]:
    """RENDER, drawing a line that says so while Redis does not answer (restarting, loading its
    data, a network cut) instead of leaving: --watch waits and goes on, as the consumers do."""
    import time

    import redis

    from genqueue.common.eta import format_duration
    from genqueue.common.redact import redact
    from genqueue.producer.status.screen import WIDTH, fit

    since: float | None = None

    def frame() -> str:
        nonlocal since
        try:
            text = render()
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as e:
            since = time.monotonic() if since is None else since
            why = " ".join(str(e).split()) or type(e).__name__
            return (f"Redis unreachable at {redact(url)}, retrying (for {format_duration(time.monotonic() - since)})\n"
                    + fit(f"  {redact(why)}", WIDTH))
        since = None
        return text

    return frame


def _watch_terminal(render: Callable[[], str], interval: float) -> None:
    """--watch on a terminal: the frame redrawn in place every INTERVAL seconds. Its red lines
    take their columns only (_watch_frame)."""
    import time

    from rich.live import Live

    with Live(_watch_frame(render()), refresh_per_second=4, screen=False) as live:
        while True:
            time.sleep(interval)
            live.update(_watch_frame(render()))


def _watch_frame(text: str) -> Text:
    """TEXT (format_status's, red lines painted with ANSI codes) as rich draws it: the codes
    read as colour, so they take no columns (Text(text) counted them, wrapping red lines early)."""
    from rich.text import Text

    return Text.from_ansi(text)


def _watch_piped(render: Callable[[], str], interval: float) -> None:
    """--watch into a pipe or a file (`| tee`, `> log`): no redraw in place, which a pipe cannot
    show (rich's Live printed one frame at exit there, wrapped at 80 columns), but each frame
    whole, as `producer status` prints it, under a `--- producer status at <time> ---` line,
    flushed as it is drawn. A reader that leaves (`| head`) ends it quietly."""
    import time

    try:
        while True:
            frame = render()
            sys.stdout.write(f"{WATCH_MARK} at {time.strftime('%Y-%m-%d %H:%M:%S %Z')} ---\n{frame}\n\n")
            sys.stdout.flush()
            time.sleep(interval)
    except BrokenPipeError:
        # stdout is gone: point it at /dev/null so that the flush at exit does not raise again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
