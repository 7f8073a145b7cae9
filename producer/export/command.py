"""`producer export`: one clean dataset from a run's shards, and the proof that nothing is lost.

Reads every shard of the run from its output location (a directory or s3://), keeps one record
per item (delivery is at least once), writes the dataset in input order (source by source,
position by position) in the shape a training tool reads (formats/, one module per
--format), as JSONL (gzip for .gz, zstd for .zst) or Parquet (.parquet or --format
parquet); the answers that never ended on their own to a truncated file; the items that
failed for good to an errors file; and the enqueued items with no record at all to a missing
file. Exits 1 when anything is missing, or when more items failed for good or are partial
(a regenerated conversation whose later turn failed) than --max-failed, unless
--allow-partial. See producer/export/core.py (and its phases: partition.py, reduce.py) for the method.
"""

from __future__ import annotations

import logging
import math
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple, TypedDict, Unpack

import click
import orjson
import redis

from genqueue.common import defaults
from genqueue.common.cli import friendly_errors, redis_option
from genqueue.common.contracts import Mode, Outcome
from genqueue.common.errors import UserError
from genqueue.common.keepers.captured import read_capture_figures, read_logprobs_figures
from genqueue.common.keepers.redisconn import connect
from genqueue.common.keepers.runs import RunInfo, RunStore
from genqueue.common.placement import this_host
from genqueue.common.settings import check_run_name
from genqueue.producer.export import selection
from genqueue.producer.export.card import CARD, PICTURE, CardResult, card_files, card_rows, write_card
from genqueue.producer.export.core import Exporter
from genqueue.producer.export.formats import FORMATS, ExportFormat, format_help, shape_of
from genqueue.producer.export.formats.spec import RowLayout, SideFile
from genqueue.producer.export.plan import DEFAULT_OUTCOMES, ExportPlan, ExportResult
from genqueue.producer.export.sinks import beside, stem
from genqueue.producer.export.sources import source_for
from genqueue.producer.export.stage import WEIGHT_COLUMN
from genqueue.producer.export.summary import format_export, progress_bar
from genqueue.producer.export.tempnames import sweep_dead, temp_beside
from genqueue.producer.outfiles import (
    ERRORS,
    FLAGGED,
    MISSING,
    OUTPUT,
    PARTITIONS,
    TRUNCATED,
    Target,
    probe,
    record_written,
    refuse_replacing,
)
from genqueue.producer.packitems import PackItems, Unreadable
from genqueue.producer.rungone import run_gone

__all__ = ["export_command"]

log = logging.getLogger(__name__)


def _writable(path: Path, target: Target) -> Path:
    """PATH made absolute, once its place took one block (outfiles.probe, which opens no file
    that exists): a read-only, missing or already full place is refused before anything is
    read."""
    path = Path(os.path.abspath(path))
    if path.is_dir():
        raise UserError(f"{target.what} {path} is a directory")
    if path.exists() and not path.is_file():  # renaming the finished file onto a device replaces it
        raise UserError(f"{target.what} {path} is not a regular file: the export renames a finished file into place")
    probe(temp_beside(path), target, shown=path)
    return path


def _shape_and_container(fmt: ExportFormat, output: Path) -> tuple[ExportFormat, bool]:
    """(the lines' shape, whether the file is Parquet) from --format and the output's name."""
    spec = FORMATS[fmt]
    named_parquet = output.name.lower().endswith(".parquet")
    if spec.only_parquet:
        if not named_parquet:
            raise UserError(f"--format {fmt} writes Parquet: name the output *.parquet, not {output.name}")
        return shape_of(fmt), True
    if named_parquet and not spec.parquet:
        raise UserError(f"--format {fmt} writes {spec.not_parquet}: name the output *.jsonl")
    return shape_of(fmt), named_parquet


def _layout(conversation_rows: bool, fmt: ExportFormat, rows: str | None) -> RowLayout:
    """--rows: generation by default; conversation only for a format whose lines are conversations."""
    if rows is None:
        return RowLayout.GENERATION
    if rows == RowLayout.CONVERSATION and not conversation_rows:
        raise UserError(f"--rows conversation: --format {fmt} has rows of its own (one per answer, or the last "
                        "answer); it applies to openai, parquet, sharegpt and specforge")
    return RowLayout(rows)


def _outcomes(text: str | None) -> frozenset[str]:
    if text is None:
        return DEFAULT_OUTCOMES
    names = {t.strip() for t in text.split(",") if t.strip()}
    if "all" in names:
        return frozenset(o.value for o in Outcome)
    unknown = sorted(names - {o.value for o in Outcome})
    if unknown or not names:
        raise UserError(f"--include-outcomes takes outcomes among {', '.join(o.value for o in Outcome)} (or all), "
                        f"not {', '.join(unknown) or repr(text)}")
    return frozenset(names)


class ExportArgs(TypedDict):
    """`producer export`'s options as click parses them (one key per option, by its parameter
    name) but for --json and --redis-url, which are the command's own."""

    run_name: str
    output: str
    fmt: str
    include: str | None
    variant: str | None
    rows: str | None
    group_samples: bool
    errors_path: str | None
    truncated_path: str | None
    missing_path: str | None
    drop_flagged: bool
    only_target_turns: bool
    flagged_path: str | None
    allow_partial: bool
    max_failed: str
    tmp_dir: str | None
    partition_mb: int
    card: bool
    card_images: str | None
    weight_by_acceptance: bool
    keep_lowest_acceptance: str | None
    overwrite: bool


class _Files(NamedTuple):
    """The files an export writes, each made absolute and its place probed (`_writable`)."""

    output: Path
    parquet: bool
    shape: ExportFormat
    errors: Path
    truncated: Path
    missing: Path
    flagged: Path | None
    workdir: Path
    side: Path | None  # the format's side file (sharegpt: LLaMA-Factory's entry), when one is written
    card: Path | None  # the dataset card (None: --no-card, or nowhere to put it)
    pictures: tuple[Path, ...]  # the card's pictures it may draw

    def written(self) -> list[tuple[Path, Target]]:
        """Every file the export may write, and what it is (the card apart: card.card_path
        names only a genqueue card or a free name)."""
        side = _SIDE if self.side is not None else None
        return [(self.output, OUTPUT), (self.errors, ERRORS), (self.truncated, TRUNCATED), (self.missing, MISSING),
                *([(self.flagged, FLAGGED)] if self.flagged is not None else []),
                *([(self.side, side)] if self.side is not None and side is not None else []),
                *((p, PICTURE) for p in self.pictures)]


_SIDE = Target("side file", "pass another --output (the side file is named after it)")


def _side_path(side: SideFile | None, out: Path) -> Path | None:
    """Where the format's SIDE file goes beside OUT (None: it has none, or OUT is compressed)."""
    if side is None or not out.name.endswith(side.loads):
        return None
    return beside(out, side.suffix)


_URL = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://")


def _local(options: ExportArgs) -> None:
    """Refuse a file option that names a URL (s3://bucket/ds.jsonl): export writes local files,
    and the path such a URL makes (./s3:/bucket) is no place the user meant."""
    for option, text in (("--output", options["output"]), ("--errors", options["errors_path"]),
                         ("--truncated", options["truncated_path"]), ("--missing", options["missing_path"]),
                         ("--flagged", options["flagged_path"])):
        m = _URL.match(text or "")
        if m is None or text is None:
            continue
        copy = (f"; to put it in S3, export to a local file and copy it (aws s3 cp {text.rsplit('/', 1)[-1]} {text})"
                if m[1].lower() == "s3" else "")
        raise UserError(f"{option} {text}: export writes local files, not URLs: name a path on this host{copy}")


def _files(options: ExportArgs) -> _Files:
    """The files OPTIONS name (or their defaults beside the output), refused before anything
    is read when one cannot be written or two are the same."""
    _local(options)
    out = _writable(Path(options["output"]), OUTPUT)
    shape, parquet = _shape_and_container(ExportFormat(options["fmt"]), out)
    errs = _writable(Path(options["errors_path"] or beside(out, ".errors.jsonl")), ERRORS)
    cut = _writable(Path(options["truncated_path"] or beside(out, ".truncated.jsonl")), TRUNCATED)
    miss = _writable(Path(options["missing_path"] or beside(out, ".missing.txt")), MISSING)
    flagged = (_writable(Path(options["flagged_path"] or beside(out, ".flagged.jsonl")), FLAGGED)
               if options["drop_flagged"] or options["only_target_turns"] else None)
    if len({out, errs, cut, miss, *([flagged] if flagged else [])}) < 4 + bool(flagged):
        raise UserError("--output, --errors, --truncated, --missing and --flagged must be different files")
    tmp_dir = options["tmp_dir"]
    workdir = Path(tmp_dir).absolute() if tmp_dir else out.parent
    probe(workdir / f".gq-probe-{os.getpid()}", PARTITIONS, shown=workdir)
    images = options["card_images"]
    card, pictures = card_files(out, Path(images).absolute() if images else None) if options["card"] else (None, [])
    return _Files(out, parquet, shape, errs, cut, miss, flagged, workdir, _side_path(FORMATS[shape].side_file, out),
                  card, tuple(pictures))


def _refuse_replacing(files: _Files, conn: redis.Redis, run: str, *, overwrite: bool) -> None:
    """Before anything is written: no file of the export is one the run reads (its inputs, by
    resolved path and inode; --overwrite does not lift it), nor one genqueue did not write
    (unless OVERWRITE): outfiles.refuse_replacing. The card is checked against the inputs only
    (card.card_path names a genqueue card or a free name)."""
    inputs = {source: f"the input run {run} was enqueued from" for source in RunStore(conn).sources(run)}
    card = [(files.card, CARD)] if files.card is not None else []
    refuse_replacing([*files.written(), *card], inputs=inputs, overwrite=True)
    refuse_replacing(files.written(), overwrite=overwrite)


def _share(text: str | None) -> float | None:
    """--keep-lowest-acceptance SHARE: a fraction in (0, 1] (None: not given)."""
    if text is None:
        return None
    try:
        value = float(text)
    except ValueError:
        raise UserError(f"--keep-lowest-acceptance takes a share in (0, 1], not {text!r}") from None
    if math.isnan(value):
        raise UserError(f"--keep-lowest-acceptance takes a share in (0, 1], not {text!r}")
    return selection.check_share(value)


def export_plan(options: ExportArgs, info: RunInfo, files: _Files, outcomes: frozenset[str]) -> ExportPlan:
    """What `producer export` OPTIONS ask to write of the run INFO describes, to FILES, with the
    OUTCOMES the dataset holds; every option checked against the run (UserError)."""
    run, shape = info.name, files.shape
    variant = options["variant"]
    names = [v.name for v in info.settings.variants]
    if variant is not None and variant not in names:
        raise UserError(f"--variant {variant}: run {run} has " + (f"the variants {', '.join(names)}" if names
                                                                   else "no request variants"))
    refusal = info.placement.refusal(run, info.settings.output, this_host())
    if refusal is not None:  # this host's directory of that name holds none of the run's shards
        raise UserError(refusal)
    if info.settings.prefill is not None:  # a capture pass (producer capture): features, no text
        src = info.settings.prefill.source
        rows = ("tables with producer export-logprobs" if info.settings.logprobs is not None
                else "features with producer export-features")
        raise UserError(f"run {run} is a capture pass over run {src}: its records hold no text; export run {src}, "
                        f"and this run's {rows} --run {run}")
    spec = FORMATS[shape]
    if spec.token_ids and not info.settings.token_ids:
        raise UserError(f"--format {shape} needs the token ids the engine returned, and run {run} kept none: "
                        "enqueue it with --token-ids (a new run, or --update-settings for the items not done yet)")
    group_samples = options["group_samples"]
    if spec.rows is not None and group_samples:
        raise UserError(f"--format {shape} writes one row per generated answer; --group-samples does not apply")
    layout = _layout(spec.conversation_rows, ExportFormat(options["fmt"]), options["rows"])
    if group_samples and layout is RowLayout.GENERATION and info.settings.multi_turn == Mode.REGENERATE:
        raise UserError("--group-samples puts a prompt's samples in one line, and with --rows generation a "
                        "regenerated conversation is one row per answer: pass --rows conversation to group them")
    return ExportPlan(fmt=shape, output=files.output, errors_path=files.errors, missing_path=files.missing,
                      truncated_path=files.truncated, include=outcomes, parquet=files.parquet,
                      group_samples=group_samples, workdir=files.workdir,
                      partition_bytes=options["partition_mb"] * 2**20,
                      per_turn_ids=info.settings.multi_turn == Mode.EACH, variants=tuple(info.settings.variants),
                      variant=variant, drop_flagged=options["drop_flagged"],
                      only_target_turns=options["only_target_turns"], flagged_path=files.flagged, rows=layout,
                      weight_by_acceptance=options["weight_by_acceptance"],
                      keep_lowest_acceptance=_share(options["keep_lowest_acceptance"]))


@click.command("export")
@click.option("--run", "run_name", required=True, help="The run to export.")
@click.option("--output", "-o", "output", required=True, type=click.Path(dir_okay=False),
              help="Dataset file to write: .jsonl (.gz or .zst to compress) or .parquet.")
@click.option("--format", "fmt", type=click.Choice([f.value for f in ExportFormat]), default=ExportFormat.OPENAI.value,
              show_default=True, help=format_help())
@click.option("--include-outcomes", "include", default=None, metavar="OUTCOME,...",
              help="Outcomes the dataset holds (default: finished; e.g. finished,cut_in_answer,partial; `all` "
                   "for every one). Answers with another outcome go to the truncated file.")
@click.option("--variant", "variant", default=None, metavar="NAME",
              help="Runs enqueued with --variant: keep only the records of this request variant (the others "
                   "are written nowhere, counted apart, and still covered).")
@click.option("--rows", "rows", type=click.Choice([r.value for r in RowLayout]), default=None,
              help="openai, parquet, sharegpt, specforge: one row per answer the target generated, after the "
                   "history exactly as the server was sent it, the answer its one training target (generation, "
                   "the default: no thinking is lost to a chat template that renders it only after the last user "
                   "message), or one row per conversation with every answer's thinking (conversation). batch "
                   "and tokens have rows of their own.")
@click.option("--group-samples", is_flag=True,
              help="Runs enqueued with --samples N: one line per prompt holding its N samples, not N lines.")
@click.option("--errors", "errors_path", type=click.Path(dir_okay=False), default=None,
              help="Items that never succeeded (default: <output stem>.errors.jsonl; Batch error lines with "
                   "--format batch, else their error records).")
@click.option("--truncated", "truncated_path", type=click.Path(dir_okay=False), default=None,
              help="Answers whose outcome the dataset leaves out (default: <output stem>.truncated.jsonl).")
@click.option("--missing", "missing_path", type=click.Path(dir_okay=False), default=None,
              help="Enqueued items with no record: key, id, source, position, tab-separated "
                   "(default: <output stem>.missing.txt).")
@click.option("--drop-flagged", is_flag=True,
              help="Keep the rows the quality gates flag (thinking markers in the content, empty answers, "
                   "repetition loops, exact duplicates of an earlier item's answer) out of the dataset, in the "
                   "flagged file. Without it they are counted and kept.")
@click.option("--only-target-turns", is_flag=True,
              help="Keep out of the dataset (in the flagged file, reason original_turns) every row whose "
                   "conversation holds assistant turns the target did not write (modes each and last: the "
                   "input's history answers), for trainers that train on every assistant turn (SpecForge, "
                   "speculators).")
@click.option("--flagged", "flagged_path", type=click.Path(dir_okay=False), default=None,
              help="Rows kept out by --drop-flagged or --only-target-turns, each with its `flags` "
                   "(default: <output stem>.flagged.jsonl).")
@click.option("--weight-by-acceptance", is_flag=True,
              help="Runs whose engine speculated (records with speculative-decoding figures): give every dataset "
                   f"row a `{WEIGHT_COLUMN}`, higher where the drafter accepted less (1 - rate + "
                   f"{selection.EPS}, averaging 1 over the rows with figures; 1 for a row "
                   "without), so a trainer samples the drafter's weak rows more often. Refused on a run without "
                   "figures.")
@click.option("--keep-lowest-acceptance", "keep_lowest_acceptance", default=None, metavar="SHARE",
              help="Runs whose engine speculated: keep only the SHARE (0 < SHARE <= 1) of the dataset rows with "
                   "figures whose acceptance is lowest (rows without figures are left out too); the rows left "
                   "out are counted in the summary's selection, and their items still covered. Refused on a run "
                   "without figures.")
@click.option("--allow-partial", is_flag=True, help="Exit 0 whatever is missing or failed.")
@click.option("--max-failed", default=defaults.EXPORT_MAX_FAILED, show_default=True, metavar="N|FRACTION",
              help="Exit 1 when more items than this failed for good or are partial: a count (100) or a "
                   "fraction of the enqueued items (0.01).")
@click.option("--tmp-dir", type=click.Path(file_okay=False), default=None,
              help="Where the temporary partition files go (default: beside the output; needs about "
                   "the dataset's size free).")
@click.option("--partition-mb", type=click.IntRange(1), default=defaults.EXPORT_PARTITION_BYTES // 2**20,
              show_default=True, help="Shard data per in-memory partition: roughly the export's peak memory.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of the table.")
@click.option("--card/--no-card", "card", default=True, show_default=True,
              help="Write a dataset card beside the dataset: README.md in the Hugging Face Hub's convention "
                   "(load_dataset(<folder>) reads the dataset, not its side files), or <stem>.card.md beside a "
                   "README.md genqueue did not write.")
@click.option("--card-images", "card_images", type=click.Path(file_okay=False), default=None,
              help="Where the card's pictures (PNG histograms; needs genqueue[card]) go (default: beside the card).")
@click.option("--overwrite", is_flag=True,
              help="Replace files of these names that genqueue did not write (or that were changed since it "
                   "did). Without it such a file is refused before anything is written; a file the run reads "
                   "(its input) is never replaced.")
@redis_option
@friendly_errors
def export_command(as_json: bool, redis_url: str, **options: Unpack[ExportArgs]) -> None:
    """Write a run's results as one deduplicated dataset, ordered as the input was, with its
    truncated, error and missing files; prove coverage."""
    run = check_run_name(options["run_name"])
    max_failed = options["max_failed"]
    failed_limit = _failed_limit(max_failed)
    outcomes = _outcomes(options["include"])  # what needs no run is checked before Redis is read
    _share(options["keep_lowest_acceptance"])
    files = _files(options)
    conn = connect(redis_url)
    info = RunStore(conn).get(run)
    if info is None:  # Redis lost it? the usual output may hold its run.json
        raise run_gone(run, _absolute(os.environ.get("GENQUEUE_OUTPUT") or defaults.OUTPUT), conn)
    _refuse_replacing(files, conn, run, overwrite=options["overwrite"])
    plan = export_plan(options, info, files, outcomes)
    source = source_for(info.settings.output, run, tmpdir=str(plan.workdir))
    with progress_bar(enabled=not as_json and sys.stderr.isatty()) as progress:
        # jobs by reference: their failed and missing items read from the run's packs
        packs = PackItems(conn, run, info.settings.output, unreadable=Unreadable.NOTE)
        exporter = Exporter(conn, run, source, plan, progress=progress, items_of=packs.items_of)
        result = exporter.export()
    card_images = options["card_images"]
    side_file = FORMATS[plan.fmt].side_file
    if side_file is not None:
        _write_side_file(side_file, result, files.output)
    shortfall = _shortfall(result, failed_limit(result.enqueued), max_failed)
    made: CardResult | None = None
    try:
        made = (write_card(result, info, images_dir=Path(card_images).absolute() if card_images else None,
                           incomplete=shortfall.card if shortfall is not None else "", stats=exporter.written,
                           capture=read_capture_figures(conn, run, info.settings),
                           logprobs=read_logprobs_figures(conn, run, info.settings))
                if options["card"] else None)
    finally:  # what is in place is genqueue's, even when the card failed
        record_written([p for p, target in files.written() if target is not PICTURE and p.exists()]
                       + ([Path(made.path), *map(Path, made.images)] if made is not None and made.path else []))
    if as_json:
        click.echo(orjson.dumps({**result.to_dict(), **({"card": made.to_dict()} if made else {})}).decode())
    else:
        click.echo(format_export(result, card_rows(made)))
    if options["allow_partial"] or shortfall is None:
        return
    click.echo(f"error: {shortfall.line}", err=True)
    raise SystemExit(1)


class _Shortfall(NamedTuple):
    """What an incomplete export lacks: the error line it exits 1 with, and the card's words."""

    line: str
    card: str


def _shortfall(result: ExportResult, limit: int, max_failed: str) -> _Shortfall | None:
    """RESULT's shortfall (None: complete): items missing, or more failed for good or partial
    than LIMIT (--max-failed MAX_FAILED). A partial conversation is a failure the dataset does not
    hold, as a failed item is; a cut answer is the run's max_tokens at work, counted apart and
    not held against the run."""
    r = result
    if r.missing:
        line = (f"{r.missing:,} enqueued items have no record (see {r.missing_path}); run consumers until the run "
                "is done, or pass --allow-partial")
        card = (f"{r.missing:,} of the run's {r.enqueued:,} enqueued items have no record (listed in the missing "
                f"file), and {r.failed:,} failed for good: the run was not done when this dataset was exported. "
                "Export again once it is (`producer status` shows how far it is).")
        return _Shortfall(line, card)
    if r.failed + r.partial <= limit:
        return None
    by = ", ".join(f"{k} {v:,}" for k, v in sorted(r.failed_by_class.items(), key=lambda kv: -kv[1]))
    what = f"{r.failed:,} items failed for good" + (f" ({by})" if by else "")
    if r.partial:
        what += f" and {r.partial:,} are partial (a later turn failed; see {r.truncated_path})"
    line = (f"{what}, over --max-failed {max_failed} ({limit:,} of {r.enqueued:,}), {r.complete:,} complete; see "
            f"{r.errors_path}, or pass --allow-partial")
    card = (f"{r.failed:,} of the run's {r.enqueued:,} enqueued items failed for good"
            + (f" and {r.partial:,} are partial" if r.partial else "")
            + f", more than --max-failed {max_failed} allows ({limit:,}): this dataset lacks them (the errors file "
            "lists them). `producer enqueue <input> --retry-failed` queues them again; export once they are done.")
    return _Shortfall(line, card)


def _absolute(output: str) -> str:
    return output if "://" in output else os.path.abspath(output)


def _write_side_file(side: SideFile, result: ExportResult, out: Path) -> None:
    """The format's side file beside the dataset (sharegpt: LLaMA-Factory's dataset_info.json
    entry, without whose `columns` LLaMA-Factory reads no tools)."""
    path = _side_path(side, out)
    if path is None:
        log.warning("%s is compressed: %s loads only %s, so no %s is written",
                    out.name, side.reader, ", ".join(side.loads), side.what)
        return
    entry = side.entry(stem(out).name, out.name, result.with_tools)
    sweep_dead([path])
    tmp = temp_beside(path)
    try:
        tmp.write_bytes(orjson.dumps(entry, option=orjson.OPT_INDENT_2) + b"\n")
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    result.dataset_info_path = str(path)


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


