"""Stream raw records out of an input file with memory flat whatever the file size.

Formats: JSONL, one top-level JSON array (the original ShareGPT dumps), either of them gzip
or zstd compressed, and parquet. ``-`` reads stdin. The name decides where it can
(``.gz``/``.zst`` compression, ``.jsonl``/``.ndjson`` JSONL, ``.parquet``); stdin and other
names are sniffed by their magic bytes (gzip, zstd, parquet). A ``.json`` file, stdin or an
unknown name is sniffed again once decompressed: ``[`` starts an array, anything else is
JSONL, except that one pretty-printed object (a first line that is not JSON by itself) is
read as that one record.

Each record is parsed here (orjson first, stdlib json only to tell a lone UTF-16 surrogate
from broken JSON); a record that cannot be parsed still comes out, with ``error`` set to a
reject reason name, so the producer can account for every record of the input.

What the reader never does: hold a whole file, hold a record longer than
``max_record_bytes`` (it skips to the next newline and reports ``record_too_large``), or lose
records silently. A file that breaks mid-stream (truncated gzip/zstd, junk after the array)
raises :class:`~genqueue.common.errors.InputError` after every record before the break was yielded.
"""

from __future__ import annotations

import itertools
import json
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, BinaryIO

import orjson

from genqueue.common import defaults
from genqueue.common.contracts import RejectReason
from genqueue.common.errors import InputError
from genqueue.producer.ingest.splitter import NON_SPACE, SNIPPET_BYTES, split_array, split_lines
from genqueue.producer.ingest.streams import (
    GZIP_MAGIC,
    ZSTD_MAGIC,
    Prefixed,
    StreamError,
    decompressed_chunks,
    describe_error,
    read_head,
    strip_bom,
)

#: Bytes read from the input at a time: one syscall per MiB, memory bounded whatever the file's size.
CHUNK_SIZE = 1 << 20

#: Rows read per batch of a Parquet input: a few MB of conversations, wide rows stay cheap in memory.
PARQUET_BATCH_ROWS = 1024

_PARQUET_MAGIC = b"PAR1"
_COMPRESSED_SUFFIXES = ((".gz", "gzip"), (".gzip", "gzip"), (".zst", "zstd"), (".zstd", "zstd"))


@dataclass(slots=True)
class RawRecord:
    """One record of the input, parsed or marked with the reason it could not be."""

    index: int  # 0-based among non-blank records
    line: int | None  # 1-based physical line for JSONL, None for arrays and parquet
    value: Any  # parsed JSON value, None when error is set
    error: RejectReason | None  # INVALID_JSON, INVALID_UNICODE or RECORD_TOO_LARGE
    snippet: bytes  # first SNIPPET_BYTES of the raw record
    size: int  # raw size in bytes


def iter_records(path: str, *, max_record_bytes: int = defaults.MAX_RECORD_BYTES) -> Iterator[RawRecord]:
    """Yield every non-blank record of ``path`` ("-" for stdin) in input order.

    The file is opened before this returns, so a missing or unreadable file raises
    InputError at the call; a stream that breaks later raises InputError from the iterator
    after the records before the break were yielded.
    """
    if max_record_bytes < 1:
        raise ValueError("max_record_bytes must be positive")
    if path == "-":
        name, fh, owned = "stdin", sys.stdin.buffer, False
    else:
        name, owned = path, True
        if path.lower().endswith(".parquet"):
            return _parquet(path, max_record_bytes)
        fh = _open(path)
    compression, text_format = _kind(path)
    if compression == "sniff":
        try:
            head = read_head(fh)
        except OSError as e:
            if owned:
                fh.close()
            raise InputError(f"cannot read {name}: {describe_error(e)}") from e
        if head == _PARQUET_MAGIC:
            if owned:
                fh.close()
                return _parquet(path, max_record_bytes)
            raise InputError("cannot read stdin: parquet input must be a named .parquet file")
        compression = "none"
        if head.startswith(GZIP_MAGIC):
            compression = "gzip"
        elif head.startswith(ZSTD_MAGIC):
            compression = "zstd"
        source: Any = Prefixed(head, fh)
    else:
        source = fh
    records = _text_records(source, compression, text_format, max_record_bytes)
    return _guard(name, records, fh if owned else None)


def _kind(path: str) -> tuple[str, str]:
    """(compression, text format) that the name promises; "sniff" where it promises none."""
    if path == "-":
        return "sniff", "sniff"
    name = path.lower()
    compression = "none"
    for suffix, kind in _COMPRESSED_SUFFIXES:
        if name.endswith(suffix):
            name, compression = name[: -len(suffix)], kind
            break
    if name.endswith((".jsonl", ".ndjson")):
        return compression, "jsonl"
    if name.endswith(".json"):
        return compression, "json"
    return ("sniff" if compression == "none" else compression), "sniff"


def parse_record(raw: bytes) -> tuple[Any, RejectReason | None]:
    """Parse one record's bytes: (value, None), or (None, reject reason)."""
    try:
        return orjson.loads(raw), None
    except orjson.JSONDecodeError:
        pass
    # orjson refuses valid JSON that is not valid text (lone surrogate escapes); stdlib json
    # accepts it, which is how the two cases are told apart. This path is rare, so its
    # cost does not matter.
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return None, RejectReason.INVALID_UNICODE
    try:
        value = json.loads(text, parse_constant=_refuse_constant)
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return None, RejectReason.INVALID_UNICODE
    except (ValueError, RecursionError, TypeError):
        return None, RejectReason.INVALID_JSON
    # Valid text that orjson still refuses, such as 1e400 (stdlib reads it as infinity).
    return None, RejectReason.INVALID_JSON


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _record(index: int, line: int | None, raw: bytes) -> RawRecord:
    value, error = parse_record(raw)
    return RawRecord(index, line, value, error, raw[:SNIPPET_BYTES], len(raw))


def _too_large(index: int, line: int | None, snippet: bytes, size: int) -> RawRecord:
    return RawRecord(index, line, None, RejectReason.RECORD_TOO_LARGE, snippet[:SNIPPET_BYTES], size)


def _open(path: str) -> BinaryIO:
    try:
        return open(path, "rb")
    except OSError as e:
        raise InputError(f"cannot read {path}: {describe_error(e)}") from e


def _guard(
    name: str, records: Iterator[RawRecord], fh: BinaryIO | None
) -> Iterator[RawRecord]:
    count = 0
    try:
        for record in records:
            yield record
            count += 1
    except StreamError as e:
        raise InputError(f"cannot read {name}: {e} (stopped at record index {count})") from e
    finally:
        if fh is not None:
            fh.close()


def _text_records(
    source: Any, compression: str, text_format: str, max_bytes: int
) -> Iterator[RawRecord]:
    chunks = strip_bom(decompressed_chunks(source, compression, CHUNK_SIZE))
    if text_format == "jsonl":
        return _jsonl(chunks, max_bytes)
    return _sniffed(chunks, max_bytes)


def _sniffed(chunks: Iterator[bytes], max_bytes: int) -> Iterator[RawRecord]:
    # Leading white space is dropped as it streams by (only its newlines are counted, for
    # line numbers): a stream of a billion blank lines must not be held while sniffing.
    skipped_lines = 0
    first = b""
    chunk = b""
    for chunk in chunks:
        m = NON_SPACE.search(chunk)
        if m is not None:
            first = chunk[m.start() : m.start() + 1]
            break
        skipped_lines += chunk.count(b"\n")
    if not first:
        return
    stream = itertools.chain([chunk], chunks)
    if first == b"[":
        yield from _array(stream, max_bytes)
        return
    records = _json_document(stream, max_bytes) if first == b"{" else _jsonl(stream, max_bytes)
    for rec in records:
        if skipped_lines and rec.line is not None:
            rec.line += skipped_lines
        yield rec


def _array(chunks: Iterable[bytes], max_bytes: int) -> Iterator[RawRecord]:
    index = 0
    try:
        for raw, size, snippet in split_array(chunks, max_bytes):
            if raw is None:
                yield _too_large(index, None, snippet, size)
            else:
                yield _record(index, None, raw)
            index += 1
    except ValueError as e:  # the splitter's verdict on the array's framing
        raise StreamError(str(e)) from e


def _json_document(chunks: Iterator[bytes], max_bytes: int) -> Iterator[RawRecord]:
    """Sniffed input starting with '{': JSONL, unless its first line is not JSON by itself.

    Then it is one pretty-printed object, read whole (bounded by max_bytes like any record);
    if the whole does not parse either, it is JSONL after all and its lines are rejected.
    """
    seen: list[bytes] = []
    total = 0
    first_line: bytes | None = None
    started = False
    for chunk in chunks:
        # Search each chunk once from where the first line starts: no re-joining.
        begin = 0
        if not started:
            m = NON_SPACE.search(chunk)
            started = m is not None
            begin = m.start() if m is not None else len(chunk)
        newline = chunk.find(b"\n", begin) if started else -1
        seen.append(chunk)
        total += len(chunk)
        if newline >= 0:
            first_line = b"".join(seen)[: total - len(chunk) + newline]
            break
        if total > max_bytes:
            break
    if first_line is None or parse_record(first_line)[1] is None:
        yield from _jsonl(itertools.chain(seen, chunks), max_bytes)
        return
    for chunk in chunks:
        seen.append(chunk)
        total += len(chunk)
        if total > max_bytes:
            yield from _jsonl(itertools.chain(seen, chunks), max_bytes)
            return
    whole = b"".join(seen)
    value, error = parse_record(whole)
    if error is not None:
        yield from _jsonl(iter([whole]), max_bytes)
        return
    start = NON_SPACE.search(whole)
    line = 1 + whole.count(b"\n", 0, start.start() if start else 0)
    whole = whole.strip()
    yield RawRecord(0, line, value, None, whole[:SNIPPET_BYTES], len(whole))


def _jsonl(chunks: Iterable[bytes], max_bytes: int) -> Iterator[RawRecord]:
    for index, (line, raw, size, snippet) in enumerate(split_lines(chunks, max_bytes)):
        if raw is None:
            yield _too_large(index, line, snippet, size)
        else:
            yield _record(index, line, raw)


def _parquet(path: str, max_bytes: int) -> Iterator[RawRecord]:
    # pyarrow is imported here, not at the top: it costs a third of a second that JSONL
    # runs should not pay.
    import pyarrow as pa
    import pyarrow.parquet as pq

    fh = _open(path)
    try:
        pf = pq.ParquetFile(fh)
    except (OSError, pa.ArrowException) as e:
        fh.close()
        raise InputError(f"cannot read {path}: {describe_error(e)}") from e
    return _guard(path, _parquet_rows(pf, pa, max_bytes), fh)


def _parquet_rows(pf: Any, pa: Any, max_bytes: int) -> Iterator[RawRecord]:
    batches = pf.iter_batches(batch_size=PARQUET_BATCH_ROWS)
    index = 0
    while True:
        try:
            batch = next(batches)
            rows = batch.to_pylist()
        except StopIteration:
            return
        except (OSError, pa.ArrowException) as e:
            raise StreamError(describe_error(e)) from e
        for row in rows:
            # Serialised only for the size limit and the rejects snippet.
            try:
                raw = orjson.dumps(row, default=str)
            except TypeError:
                raw = repr(row).encode("utf-8", "backslashreplace")
            if len(raw) > max_bytes:
                yield _too_large(index, None, raw, len(raw))
            else:
                yield RawRecord(index, None, row, None, raw[:SNIPPET_BYTES], len(raw))
            index += 1
