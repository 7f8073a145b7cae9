"""The export formats' registry: each `--format` name and the FormatSpec its module declares.

A format is one module of this package (its converters, Arrow schema, generation rows, side
file: spec.py says what a spec holds) and one member and one row here; the CLI's choices and
help, the refusals, the Parquet schema and the generation rows all follow from the spec.
Shared line rules (ids, provenance, acceptance, the conversation) are lines.py's.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from enum import StrEnum

from genqueue.common.records import ErrorRecord, JobFailedRecord, ResultRecord
from genqueue.producer.export.formats import batch, openai, sharegpt, specforge, tokens
from genqueue.producer.export.formats.spec import FormatSpec, Line


class ExportFormat(StrEnum):
    """`--format`: the shape of the dataset's lines (parquet: the openai shape in Parquet)."""

    OPENAI = "openai"
    SHAREGPT = "sharegpt"
    SPECFORGE = "specforge"
    BATCH = "batch"
    PARQUET = "parquet"
    TOKENS = "tokens"


FORMATS: dict[ExportFormat, FormatSpec] = {
    ExportFormat.OPENAI: openai.SPEC,
    ExportFormat.SHAREGPT: sharegpt.SPEC,
    ExportFormat.SPECFORGE: specforge.SPEC,
    ExportFormat.BATCH: batch.SPEC,
    ExportFormat.PARQUET: dataclasses.replace(
        openai.SPEC, help="the openai shape in Parquet (any shape is Parquet when the output is named .parquet)",
        lines=ExportFormat.OPENAI, only_parquet=True),
    ExportFormat.TOKENS: tokens.SPEC,
}

#: A format's converter with its ids chosen (see converter, error_converter).
Converter = Callable[[ResultRecord], Line]
RowsConverter = Callable[[ResultRecord], list[Line]]
ErrorConverter = Callable[[ErrorRecord | JobFailedRecord], Line]


def shape_of(fmt: ExportFormat) -> ExportFormat:
    """The format whose lines FMT writes (parquet: openai's; else FMT itself)."""
    lines = FORMATS[fmt].lines
    return fmt if lines is None else ExportFormat(lines)


def format_help() -> str:
    """--format's help: each format and what it writes."""
    return "; ".join(f"{fmt}: {spec.help}" for fmt, spec in FORMATS.items()) + "."


def converter(fmt: ExportFormat, *, per_turn: bool = False) -> Converter:
    """FMT's converter of success records; PER_TURN: ids unique per turn (mode each, lines.line_id)."""
    fn = FORMATS[fmt].convert
    return functools.partial(fn, per_turn=True) if per_turn else fn


def rows_converter(fmt: ExportFormat, *, per_turn: bool = False) -> RowsConverter:
    """FMT's converter of a success record to its lines: one, or one per generated answer."""
    spec = FORMATS[fmt]
    rows, convert = spec.rows, spec.convert
    if rows is not None:
        return functools.partial(rows, per_turn=per_turn)
    return lambda rec: [convert(rec, per_turn=per_turn)]


def error_converter(fmt: ExportFormat, *, per_turn: bool = False) -> ErrorConverter | None:
    """FMT's converter of error records to its errors-file lines; None: they are written as read."""
    fn = FORMATS[fmt].error_line
    if fn is None:
        return None
    return functools.partial(fn, per_turn=True) if per_turn else fn
