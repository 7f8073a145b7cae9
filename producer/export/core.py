"""The export engine: every shard of a run in, one deduplicated dataset out, in bounded memory.

Pass 1 streams every shard line once, converts it to the output shape, and appends it with a
small binary header (key digest, source place, position, turn, sample, kind, tie-break
fields) to one of K partition files chosen by the record's place in the run's order (source
place, then position: layout.py). Every record of one key shares one place, so all
copies of an item land in the same partition. Pass 2 takes the partitions in order: one at a
time in memory, keeps one record per key, sorts by (source place, position, turn, sample,
key) and sends each kept record where it belongs: the dataset (an answer whose outcome is
included), the truncated file (an answer whose outcome is not: by default, anything but a
complete conversation whose every answer finished), or the errors file (keys that only have
error records). K is sized so a partition holds about `partition_bytes` of shard data:
memory stays flat as the run grows.

Which copy of a duplicated item is kept (deterministic, whatever order shards are read in):
an included answer beats an excluded one, which beats an error record; then the original
beats an end-of-run copy (`copy: true`: of two answers racing to one prompt the shorter tends
to end first, so keeping the original where both shipped keeps lengths unbiased); then the
lowest `attempt`; then the earliest `timings.finished_at`; then the first in shard-name order, then
line order.

A run with request variants (common/variants.py): the summary counts the exported rows by the
variant each key draws under the run's mix (`by_variant`; exact unless the mix was changed
with --update-settings while the run was live), and `variant` keeps one variant's records
only, by the variant each record names: the others take the lowest rank, are written nowhere
and counted apart (`other_variants`), and still count as covered.

Acceptance (issue 33): every answered item kept after dedupe (whichever file it went to)
adds its answers' speculative-decoding figures to one table by source, variant, turn and length
(common/acceptance.py), the summary's `acceptance` and the dataset card's: pass 1 packs each
record's answers compactly after its lines (the header's trailer length), pass 2 reads them
for the copy it keeps, so a duplicate counts once. With --weight-by-acceptance or
--keep-lowest-acceptance, pass 2 stages the dataset's rows and a pass 3 selects them
(stage.py); the rows selection leaves out are counted in the summary's `selection` and their
items are still covered (they had records: they are no missing items).

What the dataset holds (`rows`, `exported` items, the traces its layout keeps, `by_variant`) is
counted from the rows as the sink writes them, after dedupe, the gates and selection
(rowstats.RowStats, Exporter.written): one count, which the card reads too.

Coverage is computed by Redis, not in client memory (coverage.py): the exported keys are
SADDed in batches to a temporary set, and SDIFFSTORE against the run's key set yields the
missing items.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import shutil
import struct
import tempfile
import time
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, TypedDict, cast

import orjson
import redis

from genqueue.common import defaults
from genqueue.common.acceptance import (
    AcceptanceTable,
    Answer,
    Facet,
    answers_of,
    category_order,
    figures,
    weakest_line,
)
from genqueue.common.contracts import Item, Outcome, ToolTurns
from genqueue.common.errors import JobItemsUnreadableError, UserError
from genqueue.common.keepers.exportsets import ExportSets, ScratchSet
from genqueue.common.keepers.items import ItemTable
from genqueue.common.keepers.marks import record_tool_turns
from genqueue.common.keepers.packs import PackTable
from genqueue.common.keepers.rqaccess import JobPlace, PackRef, refused_jobs
from genqueue.common.keepers.rqfailed import FailedJob, failed_jobs, failed_reason, failure_class, placed_keys
from genqueue.common.keepers.rqjobs import ItemsOf, JobScan, read_jobs
from genqueue.common.records import ErrorInfo, JobFailedRecord, Record, ResultRecord, error_info
from genqueue.common.storage import ShardInfo
from genqueue.common.variants import Variant, draw
from genqueue.producer.export.coverage import coverage
from genqueue.producer.export.formats import (
    FORMATS,
    ExportFormat,
    RowLayout,
    converter,
    error_converter,
    has_original_turns,
    record_outcome,
    rows_converter,
)
from genqueue.producer.export.gates import BIT, REASONS, Duplicates, FlagReason, reasons, record_flags
from genqueue.producer.export.genrows import RecordRows, record_rows
from genqueue.producer.export.layout import Layout, layout_for
from genqueue.producer.export.records import BAD_LINE, read_line
from genqueue.producer.export.rowstats import RowStats
from genqueue.producer.export.sinks import (
    WRITE_BUFFER,
    CountingSink,
    GroupingSink,
    JsonlSink,
    NoProgress,
    Progress,
    Sink,
    beside,
    open_writer,
    stem,
)
from genqueue.producer.export.sources import OpenShard, ShardSource
from genqueue.producer.export.stage import StageSink
from genqueue.producer.export.tempnames import sweep_dead, temp_beside
from genqueue.producer.outfiles import ERRORS, FLAGGED, MISSING, PARTITIONS, TRUNCATED, disk_full, write_failed

__all__ = ["DEFAULT_OUTCOMES", "PARTITION_BYTES", "ExportResult", "Exporter", "NoProgress", "Progress", "beside",
           "stem"]

log = logging.getLogger(__name__)

PARTITION_BYTES = defaults.EXPORT_PARTITION_BYTES
MAX_PARTITIONS = defaults.EXPORT_MAX_PARTITIONS
SADD_BATCH = defaults.EXPORT_SADD_BATCH
#: What the dataset holds by default: complete conversations whose every answer ended on its
#: own. A cut answer (every trainer closes each assistant turn with an end-of-turn token, so a
#: drafter would learn to stop mid-sentence) and a partial conversation go to the truncated
#: file; --include-outcomes opts them in.
DEFAULT_OUTCOMES = frozenset({Outcome.FINISHED.value})
#: An answer's outcome travels in the partition header's kind byte (kind | code << 2), so
#: pass 2 counts outcomes without parsing lines. Code 0: none known.
_OUTCOME_NAMES = ("unknown", *(o.value for o in Outcome))
_OUTCOME_CODE = {name: code for code, name in enumerate(_OUTCOME_NAMES)}
#: A regenerate conversation's tool turns ride in the same byte (code << 5; the outcome's code
#: has bits 2-4): 0 none, then regenerated to the end, stopped at a divergence, stopped at a
#: tool turn for another reason.
_TOOLS_TO_END, _TOOLS_DIVERGED, _TOOLS_STOPPED = 1, 2, 3
_TOOLS_CODE = {ToolTurns.TO_END: _TOOLS_TO_END, ToolTurns.DIVERGED: _TOOLS_DIVERGED, ToolTurns.STOPPED: _TOOLS_STOPPED}
_COPY = defaults.EXPORT_COPY
if len(_OUTCOME_NAMES) > 8:  # pragma: no cover - a new outcome must not spill into the tool bits
    raise RuntimeError("outcome codes need more than 3 bits of the partition header's kind byte")

# What a kept record becomes; also its rank among copies of one key (lower wins). _OTHER: a
# record of another variant than the one exported (written nowhere).
_INCLUDED, _EXCLUDED, _ERROR, _OTHER = 0, 1, 2, 3
# key digest, source place, position, turn (-1: none), sample (-1: none), kind, attempt,
# finished_at, shard ordinal, line, the quality gates' flags (gates.BIT) and the digest of the
# generated text (gates.record_flags; 0: none); the rows (genrows.RecordRows): the bytes of
# the blob bound for the dataset (the rest goes to the truncated file), the rows in each part,
# the dataset rows under --rows generation and (0/1) conversation, the thinking traces and
# those each layout keeps; the length of its answers' acceptance trailer (_trailer; 0: no
# figures), and the length of the blob that follows: the lines in the output shape (or, for
# an error record, its errors-file line), then the trailer.
_HEADER = struct.Struct("<16sIqiiBIdIIBQIIIIBIIIII")
#: The header fields after the flags and digest, zero for a record that is no success record.
_NO_ROWS = (0, 0, 0, 0, 0, 0, 0, 0)


@dataclass
class ExportResult:
    """What an export did: the coverage numbers, and where everything was written."""

    run: str
    format: str
    output: str
    errors_path: str
    missing_path: str
    source: str
    truncated_path: str = ""
    container: str = "jsonl"
    include_outcomes: list[str] = field(default_factory=list)
    shards: int = 0
    records_read: int = 0
    enqueued: int = 0
    exported: int = 0  # items with a row in the dataset (Exporter.written)
    truncated: int = 0
    complete: int = 0  # answered items by outcome, whichever file they went to: finished
    partial: int = 0  # regenerate: a later turn failed
    cut: int = 0  # any other outcome (cut by max_tokens, or no answer)
    # regenerate conversations with tool turns: regenerated to the end through the recorded
    # results, stopped at a divergence, stopped at a tool turn for another reason
    tool_turns_to_end: int = 0
    tool_call_diverged: int = 0
    stopped_at_tool_turn: int = 0
    failed: int = 0
    missing: int = 0
    duplicates_removed: int = 0
    failed_jobs: int = 0
    unexpected: int = 0
    bad_lines: int = 0
    bad_shards: int = 0
    groups: int = 0
    seconds: float = 0.0
    failed_by_class: dict[str, int] = field(default_factory=dict)
    truncated_by_outcome: dict[str, int] = field(default_factory=dict)
    #: Entries of the run's queue and registries that are no usable job (rqjobs.BadJob dicts).
    malformed_jobs: list[dict[str, str]] = field(default_factory=list)
    #: Jobs the consumers refused (job id -> reason), from genqueue:refused:<queue>.
    refused_jobs: dict[str, str] = field(default_factory=dict)
    cut_by_outcome: dict[str, int] = field(default_factory=dict)
    with_tools: bool = False  # a dataset row carries tools (LLaMA-Factory's entry then names the column)
    variant: str | None = None  # only this request variant's records were exported (--variant)
    by_variant: dict[str, int] = field(default_factory=dict)  # exported rows by request variant
    other_variants: int = 0  # items of the other variants, left out by --variant
    dataset_info_path: str = ""
    #: Quality gates (gates.py): dataset rows flagged, per reason (a row may have several);
    #: with --drop-flagged (and --only-target-turns) they went to the flagged file instead.
    flagged: int = 0
    flagged_by_reason: dict[str, int] = field(default_factory=dict)
    flagged_dropped: int = 0
    flagged_path: str = ""
    #: Dataset rows holding assistant turns the target did not write (modes each and last:
    #: the input's history answers), whichever file they went to.
    original_turns: int = 0
    #: --rows (genrows.py): the layout written; the dataset's rows (exported counts items) and the
    #: truncated file's; the dataset rows each layout makes of the same items; the generated
    #: thinking traces of the answered items and those each layout's dataset rows keep (a
    #: conversation row keeps those after its last user message, as Qwen3-style templates render).
    rows_layout: str = ""
    rows: int = 0
    truncated_rows: int = 0
    generation_rows: int = 0
    conversation_rows: int = 0
    traces: int = 0
    traces_kept_generation: int = 0
    traces_kept_conversation: int = 0
    #: Speculative-decoding acceptance of the answered items kept (each once), overall and by
    #: source, variant, turn and length (acceptance_summary); empty when no answer has figures.
    acceptance: dict[str, object] = field(default_factory=dict)
    #: What --weight-by-acceptance / --keep-lowest-acceptance did (stage.write_selected); empty
    #: without them. Its rows_left_out are out of the dataset (and of `rows`), not missing.
    selection: dict[str, object] = field(default_factory=dict)

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class ExportPlan:
    """What one export writes, and where: `producer export`'s settings once checked
    (command.export_plan builds it from the options and the run)."""

    #: the lines' shape (formats.FORMATS); PARQUET: the dataset file is Parquet
    fmt: ExportFormat
    output: Path
    errors_path: Path
    missing_path: Path
    #: where the partition files go (about the dataset's size)
    workdir: Path
    truncated_path: Path | None = None  # None: beside the output
    #: the outcomes the dataset holds; answers with another go to the truncated file
    include: frozenset[str] = DEFAULT_OUTCOMES
    parquet: bool = False
    group_samples: bool = False
    partition_bytes: int = PARTITION_BYTES
    #: mode each: a line's id names its turn (formats.line_id)
    per_turn_ids: bool = False
    #: the run's request variants, and the one whose records are kept (None: all)
    variants: tuple[Variant, ...] = ()
    variant: str | None = None
    drop_flagged: bool = False
    only_target_turns: bool = False
    flagged_path: Path | None = None  # None: beside the output, when rows are kept out
    #: --rows: a conversation-level format's lines per generation or per conversation (genrows.py)
    rows: RowLayout = RowLayout.GENERATION
    #: --weight-by-acceptance: a `sample_weight` per row; --keep-lowest-acceptance: the share of
    #: the rows with figures kept, lowest acceptance first (stage.py; None: every row)
    weight_by_acceptance: bool = False
    keep_lowest_acceptance: float | None = None

    @property
    def selects(self) -> bool:
        """The dataset's rows go through selection by acceptance (pass 3)."""
        return self.weight_by_acceptance or self.keep_lowest_acceptance is not None


class Exporter:
    """Exports one run from SOURCE as PLAN says; see the module docstring."""

    def __init__(self, conn: redis.Redis, run: str, source: ShardSource, plan: ExportPlan, *,
                 progress: Progress | None = None, items_of: ItemsOf | None = None) -> None:
        self.conn = conn
        self.items_of = items_of  # the items of jobs by reference (issue 34), for failed and missing items
        self.run = run
        self.source = source
        self.plan = plan
        output = plan.output
        self.shape = fmt = ExportFormat(plan.fmt)
        self.per_turn_ids = plan.per_turn_ids
        self.convert = converter(fmt, per_turn=plan.per_turn_ids)
        self.convert_rows = rows_converter(fmt, per_turn=plan.per_turn_ids)  # its lines: one, or one per answer
        self.error_line = error_converter(fmt, per_turn=plan.per_turn_ids)  # None: error records as read
        self.layout = RowLayout(plan.rows) if FORMATS[fmt].conversation_rows else None
        self.include = plan.include
        self.parquet = plan.parquet
        self.group_samples = plan.group_samples
        self.progress: Progress = progress or NoProgress()
        truncated = plan.truncated_path or beside(output, ".truncated.jsonl")
        self.paths = {"output": output, "errors": plan.errors_path, "missing": plan.missing_path,
                      "truncated": truncated}
        # Flagged rows kept out of the dataset go to a side file, never nowhere.
        self.drop_flagged = plan.drop_flagged
        self.only_target_turns = plan.only_target_turns
        self.drop_mask = (sum(BIT.values()) if plan.drop_flagged else 0) | (
            BIT[FlagReason.ORIGINAL_TURNS] if plan.only_target_turns else 0)
        self.duplicates = Duplicates()
        if self.drop_mask:
            self.paths["flagged"] = plan.flagged_path or beside(output, ".flagged.jsonl")
        self.workdir = plan.workdir
        self.partition_bytes = plan.partition_bytes
        self.variants, self.variant = plan.variants, plan.variant
        self.scan = JobScan()
        #: The dataset's rows as written, after dedupe, the gates and selection: the one count of
        #: what the export holds (its rows, items, traces kept, variants), the card's too.
        self.written = RowStats()
        self.table = AcceptanceTable()  # the kept answers' acceptance (pass 2)
        self.figures = False  # a record read in pass 1 has figures
        self.result = ExportResult(run, fmt.value, str(output), str(plan.errors_path), str(plan.missing_path),
                                   source.where, truncated_path=str(truncated),
                                   container="parquet" if plan.parquet else "jsonl",
                                   include_outcomes=sorted(plan.include), variant=plan.variant,
                                   flagged_path=str(self.paths.get("flagged", "")),
                                   rows_layout=self.layout.value if self.layout is not None else "")

    def export(self) -> ExportResult:
        """Run both passes and the coverage check; the files appear only on success."""
        t0 = time.monotonic()
        shards = self.source.list_shards()
        self.result.shards = len(shards)
        try:
            tmp = Path(tempfile.mkdtemp(prefix=".gq-export-", dir=self.workdir))
        except OSError as e:
            raise write_failed(e, self.workdir, PARTITIONS, room_in=self.workdir) from None
        scratch = ExportSets(self.conn, self.run)
        seen_key, missing_key = scratch.keys
        sweep_dead(list(self.paths.values()))
        finals = {k: temp_beside(p) for k, p in self.paths.items()}
        try:
            total = self.source.count_records(shards) if self.progress.wants_total else None
            self.progress.reading(total, len(shards))
            parts = self._partition(shards, tmp)
            if self.plan.selects and not self.figures:
                raise _nothing_to_select(self.plan, self.run)
            self.progress.writing(len(parts))
            out = StageSink(tmp / "stage") if self.plan.selects else self._sink(finals["output"])
            try:
                flagged_file: AbstractContextManager[IO[bytes] | None] = (
                    open_writer(finals["flagged"], FLAGGED) if "flagged" in finals else nullcontext(None))
                with (open_writer(finals["errors"], ERRORS) as errs,
                      open_writer(finals["truncated"], TRUNCATED) as cut,
                      flagged_file as flagged):
                    for i, part in enumerate(parts):
                        self._reduce(part, out, errs, cut, seen_key, flagged)
                        part.unlink()
                        self.progress.wrote()
                        log.info("partition %d/%d done", i + 1, len(parts))
                    self._failed_jobs(errs, seen_key)
            except BaseException:
                out.abort()
                raise
            out.close()
            if isinstance(out, GroupingSink):
                self.result.groups = out.groups
            self.result.acceptance = acceptance_summary(self.table)
            if isinstance(out, StageSink):
                self._select(out, finals["output"])
            self._count_written()
            try:
                self._coverage(seen_key, missing_key, finals["missing"])
            except OSError as e:
                raise write_failed(e, finals["missing"], MISSING) from None
            self.result.malformed_jobs = self.scan.to_list()
            self.result.refused_jobs = refused_jobs(self.conn, self.run)
            for k, p in self.paths.items():
                os.replace(finals[k], p)
        finally:
            scratch.drop()
            shutil.rmtree(tmp, ignore_errors=True)
            for p in finals.values():
                p.unlink(missing_ok=True)
        self.result.seconds = round(time.monotonic() - t0, 3)
        return self.result

    def _select(self, stage: StageSink, path: Path) -> None:
        """Pass 3: the staged rows into the dataset, as --weight-by-acceptance and
        --keep-lowest-acceptance say (stage.py)."""
        plan, r = self.plan, self.result
        if all(math.isnan(x) for x in stage.rates):  # NaN: a row without figures
            stage.path.unlink(missing_ok=True)
            raise _nothing_to_select(plan, self.run, rows=True)
        r.selection, groups = stage.write_selected(lambda weighted: self._sink(path, weighted=weighted),
                                                   weigh=plan.weight_by_acceptance,
                                                   share=plan.keep_lowest_acceptance)
        stage.path.unlink(missing_ok=True)
        r.groups = groups

    def _sink(self, path: Path, *, weighted: bool = False) -> Sink:
        inner: Sink
        if self.parquet:
            from genqueue.producer.export.parquet import ParquetSink, schema_for

            inner = ParquetSink(path, schema_for(self.shape, self.group_samples, weighted=weighted))
        else:
            inner = JsonlSink(path)
        inner = CountingSink(inner, self.written)
        return GroupingSink(inner) if self.group_samples else inner

    def _count_written(self) -> None:
        """The summary's figures of what the dataset holds, from the rows written (self.written):
        its rows, its items, the traces its layout keeps, its items by variant. What the other
        --rows layout would make is pass 2's count, before any selection."""
        r, s = self.result, self.written
        r.rows, r.exported = s.entries, s.conversations
        if self.layout is RowLayout.GENERATION:
            r.generation_rows, r.traces_kept_generation = s.entries, s.traces
        elif self.layout is RowLayout.CONVERSATION:
            r.conversation_rows, r.traces_kept_conversation = s.entries, s.traces
        if self.variants:
            r.by_variant = dict(s.variants)

    # --- pass 1 --------------------------------------------------------------------
    def _partitions_for(self, shards: list[ShardInfo]) -> tuple[int, int, Layout]:
        total = sum(s.bytes for s in shards)
        k = max(1, min(MAX_PARTITIONS, math.ceil(total / self.partition_bytes)))
        layout = layout_for(self.conn, self.run)
        return k, max(1, math.ceil(layout.total / k)), layout

    def _partition(self, shards: list[ShardInfo], tmp: Path) -> list[Path]:
        k, span, layout = self._partitions_for(shards)
        paths = [tmp / f"part-{i:04d}" for i in range(k)]
        files: list[IO[bytes]] = []
        log.info("reading %d shards from %s into %d partitions of %d positions", len(shards),
                 self.source.where, k, span)
        # A full --tmp-dir shows as an OSError from a write or from a close (its buffer), or from
        # an S3 shard's download there: only those are the partitions' failure; a shard that
        # cannot be read is another error.
        try:
            try:
                for p in paths:
                    files.append(open(p, "wb", buffering=WRITE_BUFFER))  # noqa: SIM115
            except OSError as e:
                raise _PartitionWriteError(e) from None
            try:
                for ordinal, shard in enumerate(self.source.each(shards)):
                    self._split(shard, ordinal, files, span, layout)
            except OSError as e:  # an S3 shard is downloaded to the same place: full is full
                if not disk_full(e):
                    raise
                raise _PartitionWriteError(e) from None
            try:
                while files:
                    files.pop().close()
            except OSError as e:
                raise _PartitionWriteError(e) from None
        except _PartitionWriteError as e:
            raise write_failed(e.cause, tmp, PARTITIONS, needed=sum(s.bytes for s in shards)) from None
        finally:
            for f in files:
                try:
                    f.close()
                except OSError:
                    pass  # the failure being handled is the one reported
        return paths

    def _blob(self, rec: Record, line: bytes) -> tuple[int, bytes, int, int, tuple[int, ...], int]:
        """What one record becomes: its kind, its lines (those bound for the dataset first, then
        its answers' acceptance trailer), for a dataset row its quality gates' flags and the
        digest of its generated text (gates.py), its rows' header fields (_NO_ROWS for a record
        that is no success) and the trailer's length."""
        if self.variant is not None and rec.get("variant") != self.variant:
            return _OTHER, b"", 0, 0, _NO_ROWS, 0
        if "error" in rec:
            if self.error_line is not None:
                return _ERROR, orjson.dumps(self.error_line(rec)) + b"\n", 0, 0, _NO_ROWS, 0
            return _ERROR, line if line.endswith(b"\n") else line + b"\n", 0, 0, _NO_ROWS, 0
        trailer = _trailer(rec)
        if trailer:
            self.figures = True
        outcome = rec["outcome"] = record_outcome(rec)
        split = self._rows(rec, outcome)
        code = _OUTCOME_CODE.get(outcome, 0) << 2 | _tool_turns(rec) << 5 | (_COPY if rec.get("copy") else 0)
        excluded = b"".join(orjson.dumps(row) + b"\n" for row in split.excluded)
        counts = (len(split.included), len(split.excluded), split.generation_rows, int(split.conversation_row),
                  split.traces, split.kept_generation, split.kept_conversation)
        if not split.included:
            return _EXCLUDED | code, excluded + trailer, 0, 0, (0, *counts), len(trailer)
        flags, digest = record_flags(rec)
        if has_original_turns(rec):  # counted always; a reason to keep it out with --only-target-turns
            flags |= BIT[FlagReason.ORIGINAL_TURNS]
        rows = split.included
        if any("tools" in row for row in rows):
            self.result.with_tools = True
        if self.parquet:
            from genqueue.producer.export.parquet import arrow_row

            rows = [arrow_row(row) for row in rows]
        included = b"".join(orjson.dumps(row) + b"\n" for row in rows)
        return _INCLUDED | code, included + excluded + trailer, flags, digest, (len(included), *counts), len(trailer)

    def _rows(self, rec: ResultRecord, outcome: str) -> RecordRows:
        """REC's lines split between the dataset and the truncated file, under --rows."""
        if self.layout is None:  # a format of its own rows (tokens: per answer; batch: the last answer)
            rows = self.convert_rows(rec)
            if FORMATS[self.shape].rows is not None:  # one row per answer: each its own fate, as text rows
                inside = [row.get("outcome") in self.include for row in rows]
            else:
                inside = [outcome in self.include] * len(rows)
            included = [row for row, ok in zip(rows, inside, strict=True) if ok]
            return RecordRows(included=included, excluded=[row for row, ok in zip(rows, inside, strict=True) if not ok],
                              generation_rows=len(included), conversation_row=outcome in self.include)
        conversation = self.convert(rec) if self.layout is RowLayout.CONVERSATION else {}
        return record_rows(self.shape, rec, layout=self.layout, include=self.include,
                           conversation_line=conversation, per_turn=self.per_turn_ids)

    def _split(self, shard: OpenShard, ordinal: int, files: Sequence[IO[bytes]], span: int, layout: Layout) -> None:
        last = len(files) - 1
        pack = _HEADER.pack
        digest = hashlib.sha256()
        size = records = bad = blank = 0
        tick = self.progress.read
        for lineno, line in enumerate(shard.fh):
            digest.update(line)
            size += len(line)
            records += 1
            if not records & 4095:
                tick(4096)
            try:
                rec, key, place, index, turn, sample, attempt, finished = read_line(line)
                kind, blob, flags, text_digest, rows, tlen = self._blob(rec, line)
                header = pack(key, place, index, turn, sample, kind, attempt, finished, ordinal, lineno, flags,
                              text_digest, *rows, tlen, len(blob))
            except (*BAD_LINE, struct.error):
                if line.strip():
                    bad += 1
                else:
                    blank += 1
                continue
            f = files[min(layout.position(place, index) // span, last)]
            try:
                f.write(header)
                f.write(blob)
            except OSError as e:
                raise _PartitionWriteError(e) from None
        tick(records & 4095)
        self.result.records_read += records - bad - blank
        self.result.bad_lines += bad
        name, man = shard.info.name, shard.manifest
        if bad:
            log.warning("%s: %d unreadable lines skipped", name, bad)
        if man is not None and (man["sha256"] != digest.hexdigest() or size != shard.info.bytes
                                or man["records"] != records):
            self.result.bad_shards += 1
            log.warning("%s does not match its manifest (sha256, size or record count): read anyway", name)

    # --- pass 2 --------------------------------------------------------------------
    def _reduce(self, part: Path, out: Sink, errs: IO[bytes], cut: IO[bytes], seen_key: str,
                flagged: IO[bytes] | None = None) -> None:
        data = part.read_bytes()
        view = memoryview(data)
        unpack = _HEADER.unpack_from
        hsize = _HEADER.size
        best: dict[bytes, tuple[tuple[int, int, int, float, int, int], tuple[int, int, int, int], int, int, int,
                                int, int, tuple[int, ...], int]] = {}
        pos = n = 0
        end_all = len(data)
        while pos < end_all:
            (key, place, index, turn, sample, kind, attempt, finished, ordinal, lineno, flags, digest,
             *rows, tlen, blen) = unpack(data, pos)
            start = pos + hsize
            pos = start + blen
            n += 1
            rank = (kind & 3, kind >> 7, attempt, finished, ordinal, lineno)
            cur = best.get(key)
            if cur is None or rank < cur[0]:
                best[key] = (rank, (place, index, turn, sample), start, pos, (kind >> 2) & 31, flags, digest,
                             tuple(rows), tlen)
        self.result.duplicates_removed += n - len(best)
        batch: list[bytes] = []
        r = self.result
        kept = sorted(best.items(), key=lambda kv: (kv[1][1], kv[0]))
        # Duplicates across items, in the dataset's order: the first of a text stays clean.
        dups = iter(self.duplicates.check([v[6] for _, v in kept if v[0][0] == _INCLUDED]))
        duplicate, original = BIT[FlagReason.DUPLICATE_ANSWER], BIT[FlagReason.ORIGINAL_TURNS]
        for key, (rank, order, start, end, code, flags, _digest, counts, tlen) in kept:
            split, rows_in, rows_out, gen_rows, conv_row, traces, kept_gen, kept_conv = counts
            stop = end - tlen
            if tlen and rank[0] < _ERROR:
                self._add_answers(view[stop:end])
            if rank[0] < _ERROR:
                self._count_outcome(_OUTCOME_NAMES[code & 7], included=rank[0] == _INCLUDED)
                self._count_tool_turns(code >> 3)
                r.traces += traces
                if rows_out:
                    cut.write(view[start + split:stop])
                    r.truncated_rows += rows_out
            if rank[0] == _INCLUDED:
                line = view[start:start + split]
                if next(dups):
                    flags |= duplicate
                if flags & original:
                    r.original_turns += 1
                    if not self.only_target_turns:
                        flags &= ~original
                if not (flags and self._flag(flags, line, flagged, rows_in)):
                    out.write(line, order[:3])  # the prompt: the samples of one are grouped on request
                    self._count_layouts(gen_rows, conv_row, kept_gen, kept_conv)
            elif rank[0] == _EXCLUDED:  # no row in this layout; the other may have some
                self._count_layouts(gen_rows, conv_row, kept_gen, kept_conv)
            elif rank[0] == _OTHER:
                r.other_variants += 1
            elif rank[0] == _ERROR:
                line = view[start:stop]
                errs.write(line)
                r.failed += 1
                cls = _error_class(bytes(line))
                r.failed_by_class[cls] = r.failed_by_class.get(cls, 0) + 1
            batch.append(key)
            if len(batch) >= SADD_BATCH:
                self._sadd(seen_key, batch)
                batch = []
        if batch:
            self._sadd(seen_key, batch)
        view.release()

    def _add_answers(self, trailer: memoryview) -> None:
        """A kept record's answers (its _trailer) into the acceptance table."""
        for source, variant, turn, length, steps, drafted, accepted in orjson.loads(bytes(trailer)):
            self.table.add(Answer(source, variant, turn, length,
                                  {"k": 0, "steps": steps, "drafted": drafted, "accepted": accepted, "hist": []}))

    def _flag(self, flags: int, line: memoryview, flagged: IO[bytes] | None, rows: int = 1) -> bool:
        """Count a flagged record's dataset ROWS (its LINE: gates judge a conversation, so its
        flags go on every row it becomes); True when they go to the flagged file (each with
        the reasons as `flags`) rather than the dataset."""
        r = self.result
        r.flagged += rows
        by = r.flagged_by_reason
        for reason in REASONS:
            if flags & BIT[reason]:
                by[reason.value] = by.get(reason.value, 0) + rows
        if flagged is None or not flags & self.drop_mask:
            return False
        r.flagged_dropped += rows
        prefix = b'{"flags":' + orjson.dumps(reasons(flags)) + b","
        for one in bytes(line).splitlines():
            flagged.write(prefix + one[1:] + b"\n")
        return True

    def _count_layouts(self, gen_rows: int, conv_row: int, kept_gen: int, kept_conv: int) -> None:
        """The dataset rows and kept traces each --rows layout makes of one item."""
        r = self.result
        r.generation_rows += gen_rows
        r.conversation_rows += conv_row
        r.traces_kept_generation += kept_gen
        r.traces_kept_conversation += kept_conv

    def _count_outcome(self, outcome: str, *, included: bool) -> None:
        """Coverage counts complete, partial and cut apart, whichever file each went to."""
        r = self.result
        if not included:
            r.truncated += 1
            r.truncated_by_outcome[outcome] = r.truncated_by_outcome.get(outcome, 0) + 1
        if outcome == Outcome.FINISHED:
            r.complete += 1
        elif outcome == Outcome.PARTIAL:
            r.partial += 1
        else:
            r.cut += 1
            r.cut_by_outcome[outcome] = r.cut_by_outcome.get(outcome, 0) + 1

    def _count_tool_turns(self, code: int) -> None:
        r = self.result
        if code == _TOOLS_TO_END:
            r.tool_turns_to_end += 1
        elif code == _TOOLS_DIVERGED:
            r.tool_call_diverged += 1
        elif code == _TOOLS_STOPPED:
            r.stopped_at_tool_turn += 1

    def _sadd(self, seen_key: str, digests: list[bytes]) -> None:
        ScratchSet(self.conn, seen_key).add(digests)

    def _failed_jobs(self, errs: IO[bytes], seen_key: str) -> None:
        """Items of jobs that rq gave up on (their retries spent: abandoned by consumer after
        consumer) and that no shard holds are permanently failed, not missing: each gets an
        error record with rq's reason, of class pack_unreadable when a consumer could not read
        the job's pack, else job_failed (rqjobs.failure_class, status's too). A job whose pack
        this export cannot read either has its items found by their places in the run's item
        table (rqjobs.placed_keys). `rq requeue` brings them back; a later export sees them.
        Entries that are no usable job are noted in the scan (rqjobs), not exported."""
        failed = {j.id: j for j in failed_jobs(self.conn, self.run)}
        by_ref = {j.ref: j for j in failed.values() if j.ref is not None}
        unread: dict[str, tuple[FailedJob, str]] = {}
        inner = self.items_of

        def items_of(ref: PackRef) -> list[Item]:
            assert inner is not None  # read_jobs calls it only when given
            try:
                return inner(ref)
            except JobItemsUnreadableError as e:
                job = by_ref.get(ref)
                if job is None:
                    raise
                unread[job.id] = (job, str(e))
                return []  # its items by their places, below

        for job in read_jobs(self.conn, self.run, [JobPlace.FAILED], scan=self.scan,
                             items_of=items_of if inner is not None else None):
            if job.id in unread:
                continue
            why = failed[job.id].reason if job.id in failed else failed_reason(self.conn, job.id)
            self._fail(errs, seen_key, job.id, why, [(it["key"], it) for it in job.items])
        if not unread:
            return
        places = ItemTable(self.conn, self.run).placed_in({j.ref.pack for j, _ in unread.values() if j.ref})
        names = PackTable(self.conn, self.run).names()
        found: set[PackRef] = set()
        for fj, e in unread.values():
            assert fj.ref is not None  # by_ref holds jobs by reference only
            slots = places.get(fj.ref.pack, {})
            keys = placed_keys(self.run, fj, slots)
            if keys is None:  # as read_jobs notes it: its items stay missing
                self.scan.note(fj.id, JobPlace.FAILED,
                               f"a job by reference (pack {fj.ref.pack}, block {fj.ref.block}): {e}")
                continue
            found.add(fj.ref)
            slot_of = {d.hex(): n for n, d in slots.items()}
            pack = names.get(fj.ref.pack, str(fj.ref.pack))
            self._fail(errs, seen_key, fj.id, fj.reason, [(k, (pack, slot_of[k])) for k in keys])
        if inner is not None and found:  # coverage reads the failed jobs again: these have no more to say
            self.items_of = lambda ref: [] if ref in found else inner(ref)

    def _fail(self, errs: IO[bytes], seen_key: str, job_id: str, reason: str,
              items: list[tuple[str, Item | tuple[str, int]]]) -> None:
        """The ITEMS (key, and the item, or its pack and slot when its pack does not read) of
        the job JOB_ID that rq gave up on for REASON, those no shard holds: failed, each with
        its error record."""
        digests = [bytes.fromhex(k) for k, _ in items]
        present = ScratchSet(self.conn, seen_key).members(digests)
        lost = [(k, it) for (k, it), seen in zip(items, present, strict=True) if not seen]
        if self.variant is not None:  # no record says its variant: the key's draw does
            mine = {k: _drawn_name(k, self.variants) == self.variant for k, _ in lost}
            others = [bytes.fromhex(k) for k, ok in mine.items() if not ok]
            if others:
                self._sadd(seen_key, others)
                self.result.other_variants += len(others)
                lost = [(k, it) for k, it in lost if mine[k]]
        cls = failure_class(reason)
        error = error_info(cls, "rq", f"job {job_id} failed in rq: {reason}")
        for key, it in lost:
            rec = (_pack_failed(key, it, self.run, error) if isinstance(it, tuple) else
                   _job_failed(it, self.run, error))
            errs.write(orjson.dumps(rec if self.error_line is None else self.error_line(rec)) + b"\n")
        if lost:
            self._sadd(seen_key, [bytes.fromhex(k) for k, _ in lost])
            self.result.failed += len(lost)
            self.result.failed_jobs += 1
            by = self.result.failed_by_class
            by[cls.value] = by.get(cls.value, 0) + len(lost)

    # --- coverage ------------------------------------------------------------------
    def _coverage(self, seen_key: str, missing_key: str, missing_path: Path) -> None:
        r = self.result
        r.enqueued, r.missing, r.unexpected = coverage(self.conn, self.run, seen_key, missing_key, missing_path,
                                                       self.scan, self.items_of)
        if r.unexpected:
            log.warning("%d keys in the shards were never enqueued in run %s (an older run of the same "
                        "name?); they are exported too", r.unexpected, self.run)


def _trailer(rec: ResultRecord) -> bytes:
    """REC's answers with figures, compactly, for the acceptance table of the copy pass 2 keeps:
    [source, variant, turn, length, steps, drafted, accepted] each (empty: none)."""
    answers = [[a.source, a.variant, a.turn, a.length, a.spec["steps"], a.spec["drafted"], a.spec["accepted"]]
               for a in answers_of(rec)]
    return orjson.dumps(answers) if answers else b""


def _nothing_to_select(plan: ExportPlan, run: str, *, rows: bool = False) -> UserError:
    what = " and ".join(o for o, on in (("--weight-by-acceptance", plan.weight_by_acceptance),
                                        ("--keep-lowest-acceptance", plan.keep_lowest_acceptance is not None)) if on)
    where = "no row bound for the dataset" if rows else "no record"
    return UserError(f"{what}: {where} of run {run} carries speculative-decoding figures (the engine did not "
                     f"speculate, or was not started with {defaults.PER_REQUEST_SPEC_FLAG}): nothing to select by; "
                     "export without it")


def acceptance_summary(table: AcceptanceTable) -> dict[str, object]:
    """TABLE as the summary's `acceptance` (empty when no answer had figures): overall, then per
    facet its categories by label, each with its answers, rate, mean length and counts, and the
    weakest category in words (common.acceptance.weakest_line; None: none stands out)."""
    if not table.overall.answers:
        return {}

    return {**figures(table.overall),
            "by": {f.value: [{"category": label, **figures(table.by[f][label])}
                             for label in category_order(f, table.by[f], table)] for f in Facet},
            "weakest": weakest_line(table)}




class _PartitionWriteError(Exception):
    """A partition file could not be written (carries the OSError); _partition says where."""

    def __init__(self, cause: OSError) -> None:
        super().__init__(str(cause))
        self.cause = cause


class _Provenance(TypedDict, total=False):
    id: str
    source: str
    source_seq: int
    sample: int
    seed: int


def _job_failed(it: Item, run: str, error: ErrorInfo) -> JobFailedRecord:
    """The errors-file record of item IT of a job rq gave up on: its provenance in the item's
    own order, then its messages and the error."""
    prov: _Provenance = {}
    for name in it:
        match name:
            case "id":
                prov["id"] = it["id"]
            case "source":
                prov["source"] = it["source"]
            case "source_seq":
                prov["source_seq"] = it["source_seq"]
            case "sample":
                prov["sample"] = it["sample"]
            case "seed":
                prov["seed"] = it["seed"]
    rec = {"key": it["key"], "index": it["index"], "turn": it.get("turn"), "run": run, **prov,
           "messages": it["messages"], "error": error}
    return cast(JobFailedRecord, rec)


def _pack_failed(key: str, place: tuple[str, int], run: str, error: ErrorInfo) -> JobFailedRecord:
    """The errors-file record of the item KEY of a job whose pack does not read: its PLACE
    (pack name, slot) instead of its fields, which are in the pack."""
    return {"key": key, "run": run, "pack": place[0], "slot": place[1], "error": error}


def _tool_turns(rec: ResultRecord) -> int:
    """What became of a regenerate conversation's tool turns, as a _TOOLS_ code (0: it had none,
    or it stopped elsewhere): marks.record_tool_turns, the rule status counts by too."""
    tools = record_tool_turns(rec)
    return 0 if tools is None else _TOOLS_CODE[tools]


def _drawn_name(key: str, variants: Sequence[Variant]) -> str | None:
    drawn = draw(key, variants)
    return None if drawn is None else drawn.name


def _error_class(line: bytes) -> str:
    try:
        rec = orjson.loads(line)
        err = rec.get("error") or {}
        if "class" in err:
            return str(err["class"])
        if "code" in err:  # a Batch error line
            return str(err["code"])
        return str(rec["response"]["body"]["error"]["code"])
    except (orjson.JSONDecodeError, KeyError, TypeError, AttributeError):
        return "unknown"
