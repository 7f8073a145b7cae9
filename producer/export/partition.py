"""Pass 1 of the export: every shard line read once, converted to the output shape, and written
with its header (parts.py) to one of K partition files, chosen by the record's place in the
run's order (source place, then position: layout.py).

Every record of one key shares one place, so all copies of an item land in one partition. K is
sized so a partition holds about `partition_bytes` of shard data: pass 2 holds one at a time, and
memory stays flat as the run grows. A record of another variant than the one exported is written
as OTHER with no lines; an error record as its errors-file line; a success record as its lines
split between the dataset and the truncated file (--include-outcomes, --rows), with the quality
gates' flags and its answers' acceptance trailer. A line that is no record is counted, not
exported; a shard that does not match its manifest is read anyway and counted.
"""

from __future__ import annotations

import hashlib
import logging
import math
import struct
from collections.abc import Sequence
from pathlib import Path
from typing import IO

import orjson

from genqueue.common.records import Record, ResultRecord
from genqueue.common.storage import ShardInfo
from genqueue.producer.export.formats import FORMATS, ExportFormat, converter, error_converter, rows_converter
from genqueue.producer.export.formats.lines import has_original_turns, record_outcome
from genqueue.producer.export.formats.spec import RowLayout
from genqueue.producer.export.gates import BIT, FlagReason, record_flags
from genqueue.producer.export.genrows import RecordRows, record_rows
from genqueue.producer.export.layout import Layout
from genqueue.producer.export.parts import (
    COPY,
    ERROR,
    EXCLUDED,
    HEADER,
    INCLUDED,
    NO_ROWS,
    OTHER,
    OUTCOME_CODE,
    tool_turns_code,
    trailer,
)
from genqueue.producer.export.plan import ExportPlan, ExportResult
from genqueue.producer.export.records import BAD_LINE, read_line
from genqueue.producer.export.sinks import WRITE_BUFFER, Progress
from genqueue.producer.export.sources import OpenShard, ShardSource
from genqueue.producer.outfiles import PARTITIONS, disk_full, write_failed

log = logging.getLogger(__name__)

#: The most partitions an export splits the shards into: each an open file, well under 1,024 descriptors.
MAX_PARTITIONS = 512


class _PartitionWriteError(Exception):
    """A partition file could not be written (carries the OSError); partition() says where."""

    def __init__(self, cause: OSError) -> None:
        super().__init__(str(cause))
        self.cause = cause


class Partitioner:
    """Pass 1 of PLAN's export of the shards of SOURCE, counted in RESULT (lines read, bad lines
    and shards, rows with tools); `figures`: a record read has speculative-decoding figures."""

    def __init__(self, plan: ExportPlan, source: ShardSource, result: ExportResult, progress: Progress) -> None:
        self.plan = plan
        self.source = source
        self.result = result
        self.progress = progress
        self.shape = fmt = ExportFormat(plan.fmt)
        self.convert = converter(fmt, per_turn=plan.per_turn_ids)
        self.convert_rows = rows_converter(fmt, per_turn=plan.per_turn_ids)  # its lines: one, or one per answer
        self.error_line = error_converter(fmt, per_turn=plan.per_turn_ids)  # None: error records as read
        self.layout = plan.layout
        self.include = plan.include
        self.figures = False

    def partition(self, shards: list[ShardInfo], tmp: Path, layout: Layout) -> list[Path]:
        """Split SHARDS into partition files in TMP by their records' places in LAYOUT (the
        run's order); their paths, in order."""
        total = sum(s.bytes for s in shards)
        k = max(1, min(MAX_PARTITIONS, math.ceil(total / self.plan.partition_bytes)))
        span = max(1, math.ceil(layout.total / k))
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
        digest of its generated text (gates.py), its rows' header fields (NO_ROWS for a record
        that is no success) and the trailer's length."""
        if self.plan.variant is not None and rec.get("variant") != self.plan.variant:
            return OTHER, b"", 0, 0, NO_ROWS, 0
        if "error" in rec:
            if self.error_line is not None:
                return ERROR, orjson.dumps(self.error_line(rec)) + b"\n", 0, 0, NO_ROWS, 0
            return ERROR, line if line.endswith(b"\n") else line + b"\n", 0, 0, NO_ROWS, 0
        answers = trailer(rec)
        if answers:
            self.figures = True
        outcome = rec["outcome"] = record_outcome(rec)
        split = self._rows(rec, outcome)
        code = OUTCOME_CODE.get(outcome, 0) << 2 | tool_turns_code(rec) << 5 | (COPY if rec.get("copy") else 0)
        excluded = b"".join(orjson.dumps(row) + b"\n" for row in split.excluded)
        counts = (len(split.included), len(split.excluded), split.generation_rows, int(split.conversation_row),
                  split.traces, split.kept_generation, split.kept_conversation)
        if not split.included:
            return EXCLUDED | code, excluded + answers, 0, 0, (0, *counts), len(answers)
        flags, digest = record_flags(rec)
        if has_original_turns(rec):  # counted always; a reason to keep it out with --only-target-turns
            flags |= BIT[FlagReason.ORIGINAL_TURNS]
        rows = split.included
        if any("tools" in row for row in rows):
            self.result.with_tools = True
        if self.plan.parquet:
            from genqueue.producer.export.parquet import arrow_row

            rows = [arrow_row(row) for row in rows]
        included = b"".join(orjson.dumps(row) + b"\n" for row in rows)
        return INCLUDED | code, included + excluded + answers, flags, digest, (len(included), *counts), len(answers)

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
                           conversation_line=conversation, per_turn=self.plan.per_turn_ids)

    def _split(self, shard: OpenShard, ordinal: int, files: Sequence[IO[bytes]], span: int, layout: Layout) -> None:
        last = len(files) - 1
        pack = HEADER.pack
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
