"""Refuse an input that is not chat records at all, before a run is made of it.

A CSV, a binary file or a text dump read as JSONL has every line rejected (invalid_json), and
would leave behind a run of no items. So the first records are read ahead (at most
SNIFF_RECORDS, the whole input when shorter, stopping at the first JSON object): when none of
them is a JSON object, the input is refused with one line saying what was expected and what it
looks like (InputError, exit 2). An input with bad lines among good ones goes on as before: its
bad lines are rejected, with their reasons.

Memory: the records held back are bad ones (their value is None or not an object; the reader
keeps a snippet of each), plus the one good record that ends the look-ahead.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

from genqueue.common import defaults
from genqueue.common.contracts import RejectReason
from genqueue.common.errors import InputError
from genqueue.producer.ingest.reader import RawRecord

SNIFF_RECORDS = defaults.INPUTCHECK_SNIFF_RECORDS

EXPECTED = "JSONL of ShareGPT/OpenAI chat records, a .json array of them, or Parquet (each may be .gz/.zst)"

_MAGIC = ((b"PK\x03\x04", "a zip archive"), (b"BZh", "bzip2 data"), (b"\xfd7zXZ\x00", "xz data"),
          (b"%PDF", "a PDF"), (b"SQLite format 3", "an SQLite database"))
_JSON_KINDS = {list: "arrays", str: "strings", int: "numbers", float: "numbers", bool: "booleans",
               type(None): "nulls"}


def checked(records: Iterator[RawRecord], name: str, *, limit: int = SNIFF_RECORDS) -> Iterator[RawRecord]:
    """RECORDS, every one of them, once one of the first LIMIT is a JSON object; InputError
    (naming NAME) when there are none at all, or when none of the first LIMIT is one."""
    head: list[RawRecord] = []
    for rec in records:
        head.append(rec)
        if rec.error is None and isinstance(rec.value, dict):
            return itertools.chain(head, records)
        if len(head) >= limit:
            break
    if not head:
        raise InputError(f"{name} holds no records: nothing to enqueue")
    some = f"its first {len(head)} records" if len(head) >= limit else \
        ("its only record" if len(head) == 1 else f"its {len(head)} records")
    raise InputError(f"{name} does not hold chat records: none of {some} is a JSON object "
                     f"(it looks like {looks_like(head)}); expected {EXPECTED}")


def looks_like(head: list[RawRecord]) -> str:
    """What records that are not JSON objects look like, for a person: 'CSV: "id,text"'."""
    first = head[0].snippet
    for magic, kind in _MAGIC:
        if first.startswith(magic):
            return kind
    sample = b"".join(r.snippet for r in head[:10])
    if b"\0" in sample or any(r.error is RejectReason.INVALID_UNICODE for r in head) or _binary(sample):
        return "binary data"
    if all(r.error is RejectReason.RECORD_TOO_LARGE for r in head):
        return "records larger than --max-record-bytes"
    line = first.decode("utf-8", "replace").splitlines()[0] if first.strip() else ""
    shown = repr(line[:60] + ("..." if len(line) > 60 else ""))
    parsed = [r.value for r in head if r.error is None]
    if len(parsed) == len(head):
        kinds = sorted({_JSON_KINDS.get(type(v), "values") for v in parsed})
        return f"JSON {' and '.join(kinds)}, not objects: {shown}"
    for sep, kind in ((",", "CSV"), ("\t", "tab-separated text"), (";", "CSV")):
        if _separated(head, sep):
            return f"{kind}: {shown}"
    return f"text that is not JSON: {shown}"


def _binary(data: bytes) -> bool:
    """More than a tenth of DATA's bytes are control characters other than white space."""
    if not data:
        return False
    controls = sum(1 for b in data if b < 32 and b not in (9, 10, 13))
    return controls * 10 > len(data)


def _separated(head: list[RawRecord], sep: str) -> bool:
    """The first lines (a header and rows) hold SEP, the same number of times or more."""
    lines = [r.snippet.decode("utf-8", "replace").splitlines()[0] for r in head[:5] if r.snippet.strip()]
    counts = [line.count(sep) for line in lines]
    return bool(counts) and counts[0] > 0 and all(c >= counts[0] for c in counts)
