"""`producer export`: one clean dataset from a run's shards, and the proof that nothing is lost.

Reads every shard of the run from its output location (a directory or s3://), keeps one record
per item (delivery is at least once), writes the dataset in input order (OpenAI chat messages
or ShareGPT conversations; gzip for .gz, zstd for .zst), the items that failed for good to an
errors file, and the enqueued items with no record at all to a missing file. Exits 1 when
anything is missing, or when more items failed for good than --max-failed, unless
--allow-partial. See producer/export_core.py for the method.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path

import click
import orjson

from genqueue.common import defaults
from genqueue.common.cli import friendly_errors, redis_option
from genqueue.common.errors import UserError
from genqueue.common.redisconn import connect
from genqueue.common.runs import RunStore
from genqueue.common.settings import check_run_name
from genqueue.producer.export_core import PARTITION_BYTES, Exporter, ExportResult
from genqueue.producer.export_formats import FORMATS
from genqueue.producer.export_sources import source_for

log = logging.getLogger(__name__)

_DATA_SUFFIXES = (".gz", ".zst", ".zstd", ".jsonl", ".json", ".ndjson")


def stem(path: Path) -> Path:
    """PATH without its data suffixes: out.jsonl.gz -> out (in the same directory)."""
    name = path.name
    changed = True
    while changed:
        changed = False
        for suffix in _DATA_SUFFIXES:
            if name.endswith(suffix) and len(name) > len(suffix):
                name = name[: -len(suffix)]
                changed = True
    return path.with_name(name)


def _writable(path: Path, what: str) -> Path:
    path = path.absolute()
    if path.is_dir():
        raise UserError(f"{what} {path} is a directory")
    probe = path.with_name(path.name + ".tmp")
    try:
        with open(probe, "wb"):
            pass
        probe.unlink()
    except OSError as e:
        raise UserError(f"cannot write {what} {path}: {e.strerror}") from None
    return path


@click.command("export")
@click.option("--run", "run_name", required=True, help="The run to export.")
@click.option("--output", "-o", "output", required=True, type=click.Path(dir_okay=False),
              help="Dataset file to write (.jsonl; .gz or .zst to compress).")
@click.option("--format", "fmt", type=click.Choice(FORMATS), default="openai", show_default=True,
              help="openai: chat `messages` with the answers (and their `reasoning`); "
                   "sharegpt: `conversations` of from/value, thinking as <think>...</think> in gpt turns.")
@click.option("--errors", "errors_path", type=click.Path(dir_okay=False), default=None,
              help="Error records of items that never succeeded (default: <output stem>.errors.jsonl).")
@click.option("--missing", "missing_path", type=click.Path(dir_okay=False), default=None,
              help="Keys (hex) of enqueued items with no record (default: <output stem>.missing.txt).")
@click.option("--allow-partial", is_flag=True, help="Exit 0 whatever is missing or failed.")
@click.option("--max-failed", default=defaults.EXPORT_MAX_FAILED, show_default=True, metavar="N|FRACTION",
              help="Exit 1 when more items than this failed for good: a count (100) or a fraction of the "
                   "enqueued items (0.01).")
@click.option("--tmp-dir", type=click.Path(file_okay=False), default=None,
              help="Where the temporary partition files go (default: beside the output; needs about "
                   "the dataset's size free).")
@click.option("--partition-mb", type=click.IntRange(1), default=PARTITION_BYTES // 2**20, show_default=True,
              help="Shard data per in-memory partition: roughly the export's peak memory.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of the table.")
@redis_option
@friendly_errors
def export_command(run_name: str, output: str, fmt: str, errors_path: str | None, missing_path: str | None,
                   allow_partial: bool, max_failed: str, tmp_dir: str | None, partition_mb: int, as_json: bool,
                   redis_url: str) -> None:
    """Write a run's results as one deduplicated JSONL dataset, ordered as the input was,
    with its error and missing files; prove coverage."""
    run = check_run_name(run_name)
    failed_limit = _failed_limit(max_failed)
    out = _writable(Path(output), "output file")
    errs = _writable(Path(errors_path) if errors_path else stem(out).with_name(stem(out).name + ".errors.jsonl"),
                     "errors file")
    miss = _writable(Path(missing_path) if missing_path else stem(out).with_name(stem(out).name + ".missing.txt"),
                     "missing file")
    if len({out, errs, miss}) < 3:
        raise UserError("--output, --errors and --missing must be three different files")
    workdir = Path(tmp_dir) if tmp_dir else out.parent
    if not os.access(workdir, os.W_OK):
        raise UserError(f"cannot write temporary files in {workdir}")
    conn = connect(redis_url)
    info = RunStore(conn).require(run)
    source = source_for(info.settings.output, run, tmpdir=str(workdir))
    result = Exporter(conn, run, source, fmt=fmt, output=out, errors_path=errs, missing_path=miss,
                      workdir=workdir, partition_bytes=partition_mb * 2**20).export()
    if as_json:
        click.echo(orjson.dumps(result.to_dict()).decode())
    else:
        click.echo(format_export(result))
    if allow_partial:
        return
    if result.missing:
        click.echo(f"error: {result.missing:,} enqueued items have no record (see {result.missing_path}); "
                   "run consumers until the run is done, or pass --allow-partial", err=True)
        raise SystemExit(1)
    limit = failed_limit(result.enqueued)
    if result.failed > limit:
        by = ", ".join(f"{k} {v:,}" for k, v in sorted(result.failed_by_class.items(), key=lambda kv: -kv[1]))
        click.echo(f"error: {result.failed:,} items failed for good ({by}), over --max-failed {max_failed} "
                   f"({limit:,} of {result.enqueued:,}); see {result.errors_path}, or pass --allow-partial",
                   err=True)
        raise SystemExit(1)


def _failed_limit(text: str) -> Callable[[int], int]:
    """--max-failed: a count, or a fraction (0 < f < 1) of the enqueued items."""
    try:
        value = float(text)
    except ValueError:
        raise UserError(f"--max-failed takes a count or a fraction, not {text!r}") from None
    if value < 0 or (value != int(value) and value >= 1):
        raise UserError(f"--max-failed takes a count (>= 0) or a fraction below 1, not {text!r}")
    if value < 1 and value != int(value):
        return lambda enqueued: int(value * enqueued)
    return lambda _enqueued: int(value)


def format_export(r: ExportResult) -> str:
    """The human summary printed after an export."""
    rate = f"{r.records_read / r.seconds:,.0f} records/s" if r.seconds > 0 else "-"
    rows: list[tuple[str, str]] = []
    if r.failed:  # failures first: they are what a reader must see
        rows.append(("FAILED for good", f"{r.failed:,}"))
        rows += [(f"  {cls}", f"{n:,}") for cls, n in sorted(r.failed_by_class.items(), key=lambda kv: -kv[1])]
    rows += [
        ("run", f"{r.run}  ({r.format} format)"),
        ("read", f"{r.records_read:,} records in {r.shards:,} shards from {r.source}"),
        ("enqueued items", f"{r.enqueued:,}"),
        ("  exported", f"{r.exported:,}"),
        ("  failed for good", f"{r.failed:,}"),
        ("  missing", f"{r.missing:,}"),
        ("duplicates removed", f"{r.duplicates_removed:,}"),
    ]
    if r.unexpected:
        rows.append(("not in the run", f"{r.unexpected:,}  (exported anyway)"))
    if r.bad_lines or r.bad_shards:
        rows.append(("unreadable", f"{r.bad_lines:,} lines; {r.bad_shards:,} shards not matching their manifest"))
    rows += [
        ("output", r.output),
        ("errors file", r.errors_path),
        ("missing file", r.missing_path),
        ("time", f"{r.seconds:.1f} s ({rate})"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k.ljust(width)}  {v}" for k, v in rows)
