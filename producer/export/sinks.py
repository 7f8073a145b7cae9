"""Where the export's lines go: a JSONL file (gzip or zstd by its suffix), or Parquet, and,
with --group-samples, one line per prompt holding its samples; the names of the files beside
the dataset; and what the export reports of its progress."""

from __future__ import annotations

from pathlib import Path
from typing import IO, Protocol, cast

import orjson

from genqueue.producer.export.formats.spec import Line
from genqueue.producer.export.rowstats import RowStats
from genqueue.producer.outfiles import OUTPUT, GuardedWriter, Target, write_failed

#: Bytes buffered before a dataset file is written: one write per 256 KB, not per row.
WRITE_BUFFER = 256 * 1024
_DATA_SUFFIXES = (".gz", ".zst", ".zstd", ".jsonl", ".json", ".ndjson", ".parquet")

#: What identifies the prompt of a sample: (source place, position, turn).
Group = tuple[int, int, int]


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


def beside(output: Path, suffix: str) -> Path:
    """The companion file of OUTPUT: out.jsonl.gz -> out<suffix>."""
    base = stem(output)
    return base.with_name(base.name + suffix)


class Progress(Protocol):
    """What the export reports as it goes (the CLI draws a bar from it)."""

    wants_total: bool

    def reading(self, records: int | None, shards: int) -> None: ...

    def read(self, records: int) -> None: ...

    def writing(self, partitions: int) -> None: ...

    def wrote(self) -> None: ...


class NoProgress:
    wants_total = False

    def reading(self, records: int | None, shards: int) -> None:
        pass

    def read(self, records: int) -> None:
        pass

    def writing(self, partitions: int) -> None:
        pass

    def wrote(self) -> None:
        pass


class Sink(Protocol):
    def write(self, line: bytes | memoryview, group: Group | None = None) -> None: ...

    def close(self) -> None: ...

    def abort(self) -> None:
        """Release the file after a failure, writing nothing more."""


def open_writer(path: Path, target: Target) -> IO[bytes]:
    """A binary writer for PATH, compressed by its suffix: .gz (gzip), .zst (zstd), else plain;
    a failed write raises WriteFailedError naming PATH as TARGET's file (outfiles)."""
    # Typed as the IO it stands for: callers write and close it, nothing else.
    return cast(IO[bytes], guarded_writer(path, target))


def guarded_writer(path: Path, target: Target) -> GuardedWriter:
    try:
        raw = open(path, "wb", buffering=WRITE_BUFFER)  # noqa: SIM115 - closed by the GuardedWriter
    except OSError as e:
        raise write_failed(e, path, target) from None
    name = path.name  # a temporary name ends with the file's own (tempnames): its suffix says how
    outer: object = raw
    if name.endswith(".gz"):
        import gzip

        # Level 1: ~160 MB/s against ~75 at 3 for nearly the same size; .zst is better at both.
        outer = gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=1)
    elif name.endswith((".zst", ".zstd")):
        import zstandard

        outer = zstandard.ZstdCompressor(level=3).stream_writer(raw, closefd=False)
    return GuardedWriter(outer, raw, path, target)


class JsonlSink:
    """JSON lines to PATH (compressed by its suffix)."""

    def __init__(self, path: Path, target: Target = OUTPUT) -> None:
        self._fh = guarded_writer(path, target)

    def write(self, line: bytes | memoryview, group: Group | None = None) -> None:
        self._fh.write(line)

    def close(self) -> None:
        self._fh.close()

    def abort(self) -> None:
        self._fh.discard()


class CountingSink:
    """INNER, with every line it is handed counted into STATS (the rows of the dataset as
    written: rowstats.RowStats)."""

    def __init__(self, inner: Sink, stats: RowStats) -> None:
        self.inner = inner
        self.stats = stats

    def write(self, line: bytes | memoryview, group: Group | None = None) -> None:
        self.stats.add_lines(line)
        self.inner.write(line, group)

    def close(self) -> None:
        self.inner.close()
        self.stats.done()

    def abort(self) -> None:
        self.inner.abort()


class GroupingSink:
    """Gathers consecutive lines of one prompt (its samples) into one line for INNER:
    `{"id", "key", "source", "index", "turn", "samples": [line, ...]}`, the samples in order
    (a prompt with one sample is a group of one). Lines without a group pass through."""

    def __init__(self, inner: Sink) -> None:
        self.inner = inner
        self._group: Group | None = None
        self._lines: list[Line] = []
        self.groups = 0

    def write(self, line: bytes | memoryview, group: Group | None = None) -> None:
        if group is None or group != self._group:
            self._emit()
        if group is None:
            self.inner.write(line)
            return
        self._group = group
        self._lines.append(orjson.loads(line))

    def _emit(self) -> None:
        if not self._lines:
            return
        first = self._lines[0]
        merged: Line = {"id": first.get("custom_id", first.get("id")), "key": first.get("key")}
        for name in ("source", "index", "turn"):
            if first.get(name) is not None:
                merged[name] = first[name]
        merged["samples"] = self._lines
        self.inner.write(orjson.dumps(merged) + b"\n")
        self.groups += 1
        self._lines, self._group = [], None

    def close(self) -> None:
        self._emit()
        self.inner.close()

    def abort(self) -> None:
        self.inner.abort()
