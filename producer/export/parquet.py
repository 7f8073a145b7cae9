"""Writing the dataset as Parquet: the shape's own Arrow schema, row groups as it streams.

The export's pass 2 hands over JSON lines already in the dataset's shape; they are parsed by
Arrow's own JSON reader against the schema the shape's FormatSpec builds (C++, no Python object
per field) and written as one row group per ~ROW_GROUP_BYTES of JSON, so memory stays bounded
by a row group whatever the dataset's size. Fields whose content is arbitrary JSON (tool
schemas, the `stopped` note) are JSON strings in Parquet: a column has one type.
A field the schema does not know is an error, not a silent loss.
"""

from __future__ import annotations

from pathlib import Path

import orjson
import pyarrow as pa
import pyarrow.json as pa_json
import pyarrow.parquet as pq

from genqueue.common.errors import WriteFailedError
from genqueue.producer.export.formats import FORMATS, ExportFormat
from genqueue.producer.export.formats.arrow import USAGE
from genqueue.producer.export.formats.spec import Line
from genqueue.producer.export.stage import WEIGHT_COLUMN
from genqueue.producer.outfiles import OUTPUT, write_failed

#: JSON bytes per row group, held in Arrow form at once (docs/decisions.md, "Measured tunables").
ROW_GROUP_BYTES = 16 * 1024 * 1024


def schema_for(shape: ExportFormat, grouped: bool = False, *, weighted: bool = False) -> pa.Schema:
    """The Arrow schema of SHAPE's lines, or of the grouped lines (--group-samples) holding them;
    WEIGHTED: each line has its `sample_weight` (--weight-by-acceptance, stage.py)."""
    build = FORMATS[shape].schema
    if build is None:
        raise ValueError(f"--format {shape} is never written as Parquet")
    schema = build()
    if weighted:
        schema = schema.append(pa.field(WEIGHT_COLUMN, pa.float64()))
    if not grouped:
        return schema
    return pa.schema([("id", pa.string()), ("key", pa.string()), ("source", pa.string()), ("index", pa.int64()),
                      ("turn", pa.int64()), ("samples", pa.list_(pa.struct(list(schema))))])


#: Fields holding arbitrary JSON, stored as JSON text.
_AS_JSON = ("tools", "stopped")
_USAGE_KEYS = frozenset(USAGE.names)


def arrow_row(row: Line) -> Line:
    """ROW with its free-form fields turned into JSON text, and usage held to the counts the
    schema has (done in pass 1, per record)."""
    for name in _AS_JSON:
        value = row.get(name)
        if value is not None and not isinstance(value, str):
            row[name] = orjson.dumps(value).decode()
    usage = row.get("usage")
    if isinstance(usage, dict) and not usage.keys() <= _USAGE_KEYS:
        row["usage"] = {k: v for k, v in usage.items() if k in _USAGE_KEYS}
    return row


class ParquetSink:
    """Buffers JSON lines of one schema and writes them to PATH as Parquet row groups. A failed
    write (Arrow raises OSError with its errno) raises WriteFailedError naming PATH."""

    def __init__(self, path: Path, schema: pa.Schema, *, row_group_bytes: int | None = None) -> None:
        self.path = path
        self.schema = schema
        self.row_group_bytes = ROW_GROUP_BYTES if row_group_bytes is None else row_group_bytes
        try:
            self._writer = pq.ParquetWriter(str(path), self.schema, compression="zstd")
        except OSError as e:
            raise write_failed(e, path, OUTPUT) from None
        self._buf = bytearray()
        self._longest = 0
        self.rows = 0
        self.row_groups = 0

    def write(self, line: bytes | memoryview, group: tuple[int, int, int] | None = None) -> None:
        self._buf += line
        self._longest = max(self._longest, len(line))
        if len(self._buf) >= self.row_group_bytes:
            self.flush()

    def flush(self) -> None:
        if not self._buf:
            return
        data, self._buf = self._buf, bytearray()
        # A block must hold the longest line; blocks are parsed in parallel.
        block = max(1 << 20, 2 * self._longest)
        table = pa_json.read_json(
            pa.BufferReader(pa.py_buffer(data)),
            read_options=pa_json.ReadOptions(block_size=block),
            parse_options=pa_json.ParseOptions(explicit_schema=self.schema, unexpected_field_behavior="error"),
        )
        table = table.select(self.schema.names).cast(self.schema)
        try:
            self._writer.write_table(table, row_group_size=max(1, table.num_rows))
        except OSError as e:
            raise self._failed(e) from None
        self.rows += table.num_rows
        self.row_groups += 1

    def close(self) -> None:
        self.flush()
        try:
            self._writer.close()
        except OSError as e:
            raise self._failed(e) from None

    def abort(self) -> None:
        self._buf = bytearray()
        try:
            self._writer.close()
        except OSError:
            pass  # the failure being handled is the one reported

    def _failed(self, e: OSError) -> WriteFailedError:
        self.abort()
        return write_failed(e, self.path, OUTPUT)
