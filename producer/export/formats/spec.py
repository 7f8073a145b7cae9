"""What a `--format` is: the FormatSpec its module declares, and the shapes the specs share.

A format is one module of this package (openai.py, sharegpt.py, ...) declaring one FormatSpec:
how a record becomes its lines, whether (with which Arrow schema) they may be written as
Parquet, how a conversation becomes one row per generation (--rows generation, genrows.py),
and the side file its trainer reads. The registry (formats/__init__.py) names each spec under
its --format; the command, the export's passes, parquet.py and genrows.py read the spec alone.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Protocol

from genqueue.common.records import ErrorRecord, JobFailedRecord, ResultRecord

if TYPE_CHECKING:
    import pyarrow as pa

#: One line of the export as a converter builds it: a JSON object, serialised as it is.
Line = dict[str, object]


class RowLayout(StrEnum):
    """`--rows`: what one line of a conversation-level format holds (FormatSpec.conversation_rows).
    GENERATION: one answer the target generated, after the history exactly as the server was sent
    it (genrows.py); CONVERSATION: the whole conversation, every answer with its thinking."""

    GENERATION = "generation"
    CONVERSATION = "conversation"


class Convert(Protocol):
    """A success record's line in a format (PER_TURN: ids unique per turn, see lines.line_id)."""

    def __call__(self, rec: ResultRecord, /, *, per_turn: bool = False) -> Line: ...


class ConvertMarked(Protocol):
    """A conversation's line in a format, MARKS saying who wrote each assistant message (None:
    lines.target_turns): the converter of a generation row (genrows.py)."""

    def __call__(self, rec: ResultRecord, /, *, per_turn: bool = False, marks: list[bool] | None = None) -> Line: ...


class ConvertRows(Protocol):
    """A success record's lines in a format of one line per generated answer."""

    def __call__(self, rec: ResultRecord, /, *, per_turn: bool = False) -> list[Line]: ...


class ConvertError(Protocol):
    """An error record's line in a format's errors file."""

    def __call__(self, rec: ErrorRecord | JobFailedRecord, /, *, per_turn: bool = False) -> Line: ...


@dataclass(frozen=True, slots=True)
class SideFile:
    """A file written beside the dataset for the tool that reads it (`<stem><suffix>`)."""

    suffix: str
    what: str  # what it holds, in words
    label: str  # its row in the export's summary
    reader: str  # the tool that reads it
    loads: tuple[str, ...]  # the dataset file types that tool loads: beside another, none is written
    entry: Callable[[str, str, bool], dict[str, object]]  # (dataset name, file name, rows have tools)


@dataclass(frozen=True, slots=True)
class FormatSpec:
    """What `--format` F writes: CONVERT makes a success record's line, ERROR_LINE an error
    record's errors-file line (None: the record as read). LINES: the --format whose lines these
    are, when another's (parquet: openai's). SCHEMA: the Arrow schema of its lines, built when
    called (pyarrow is imported then); None: it is never Parquet, and NOT_PARQUET says what it
    writes instead. ONLY_PARQUET: always Parquet. SIDE_FILE: a file written beside the dataset.
    ROWS: a format of one line per generated answer makes them with ROWS (CONVERT then names
    none of them: it is its first line); TOKEN_IDS: only runs made with --token-ids have them.
    GENERATION_LINE: a format whose line is a conversation makes a generation row's line with it
    (--rows generation, the default; or one line per conversation, --rows conversation);
    WEIGHTED: the field of such a line whose messages carry the generation row's `weight`."""

    help: str  # its part of --format's help
    convert: Convert
    error_line: ConvertError | None = None
    lines: str | None = None
    schema: Callable[[], pa.Schema] | None = None
    not_parquet: str = ""
    only_parquet: bool = False
    side_file: SideFile | None = None
    rows: ConvertRows | None = None
    token_ids: bool = False
    generation_line: ConvertMarked | None = None
    weighted: str | None = None

    @property
    def parquet(self) -> bool:
        """The lines may be written as Parquet (the format has an Arrow schema)."""
        return self.schema is not None

    @property
    def conversation_rows(self) -> bool:
        """A line is a conversation, written one row per generation or one per conversation."""
        return self.generation_line is not None
