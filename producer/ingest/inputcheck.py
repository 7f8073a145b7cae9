"""Refuse an input that is not chat records at all, before a run is made of it.

A CSV, a binary file or a text dump read as JSONL has every line rejected (invalid_json), and
so has a file of JSON objects in another format (Alpaca's instruction/input/output: every line
no_conversation): either would leave behind a run of no items. So the first records are read
ahead (at most SNIFF_RECORDS, the whole input when shorter, stopping at the first one that holds
a conversation): when none does, the input is refused with one line saying what was expected
and what it looks like (InputError, exit 2). An input with bad lines among good ones goes on as
before: its bad lines are rejected, with their reasons.

Memory: the records held back are bad ones (the reader keeps a snippet of each, and the value of
one that parsed), plus the one good record that ends the look-ahead.
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Iterator

from genqueue.common.contracts import RejectReason
from genqueue.common.errors import InputError
from genqueue.producer.ingest.reader import RawRecord

#: Keys named of JSON objects of an unknown format: enough to recognise it by, short enough for one line.
INPUTCHECK_KEYS_SHOWN = 6

#: Records read ahead, at most, to find one that holds a conversation.
SNIFF_RECORDS = 100

EXPECTED = "JSONL of ShareGPT/OpenAI chat records, a .json array of them, or Parquet (each may be .gz/.zst)"

_MAGIC = ((b"PK\x03\x04", "a zip archive"), (b"BZh", "bzip2 data"), (b"\xfd7zXZ\x00", "xz data"),
          (b"%PDF", "a PDF"), (b"SQLite format 3", "an SQLite database"))
_JSON_KINDS = {list: "arrays", str: "strings", int: "numbers", float: "numbers", bool: "booleans",
               type(None): "nulls"}
#: Formats of JSON objects that are not chat records, by the keys that tell them, first match named.
_OBJECT_FORMATS = (({"instruction", "output"}, "Alpaca's format: instruction/input/output"),
                   ({"prompt", "chosen", "rejected"}, "preference pairs: prompt/chosen/rejected"),
                   ({"prompt", "completion"}, "prompt/completion pairs"),
                   ({"question", "answer"}, "question/answer pairs"),
                   ({"text"}, "plain text records: text"))


def checked(records: Iterator[RawRecord], name: str, *, limit: int = SNIFF_RECORDS) -> Iterator[RawRecord]:
    """RECORDS, every one of them, once one of the first LIMIT holds a conversation
    (holds_conversation); InputError (naming NAME) when there are none at all, or when none of
    the first LIMIT holds one: not a JSON object, or an object of another format (named)."""
    head: list[RawRecord] = []
    for rec in records:
        head.append(rec)
        if rec.error is None and holds_conversation(rec.value):
            return itertools.chain(head, records)
        if len(head) >= limit:
            break
    if not head:
        raise InputError(f"{name} holds no records: nothing to enqueue")
    some = f"none of its first {len(head)} records" if len(head) >= limit else \
        ("its only record" if len(head) == 1 else f"none of its {len(head)} records")
    objects = [r.value for r in head if r.error is None and isinstance(r.value, dict)]
    if objects:
        has = "has no" if len(head) == 1 else "has a"
        raise InputError(f"{name} does not hold chat records: {some} {has} 'conversations' or 'messages' list "
                         f"(it looks like {object_format(objects)}); expected {EXPECTED}")
    is_ = "is not" if len(head) == 1 else "is"
    raise InputError(f"{name} does not hold chat records: {some} {is_} a JSON object "
                     f"(it looks like {looks_like(head)}); expected {EXPECTED}")


def holds_conversation(value: object) -> bool:
    """VALUE is a record convert.normalize reads a conversation from: an object with a
    'conversations' (else 'messages') list, or an OpenAI Batch line whose body has one."""
    if not isinstance(value, dict):
        return False
    raw = value.get("conversations")
    if raw is None:
        raw = value.get("messages")
    body = value.get("body")
    if raw is None and isinstance(body, dict):
        raw = body.get("conversations")
        if raw is None:
            raw = body.get("messages")
    return isinstance(raw, list)


def object_format(objects: list[dict[str, object]]) -> str:
    """What JSON objects without a conversation are, for a person ("Alpaca's format: ..."), or
    their most common keys."""
    seen: collections.Counter[str] = collections.Counter(str(k) for obj in objects for k in obj)
    for keys, kind in _OBJECT_FORMATS:
        if all(keys <= obj.keys() for obj in objects):
            return kind
    if not seen:
        return "empty JSON objects"
    shown = [k for k, _ in seen.most_common(INPUTCHECK_KEYS_SHOWN)]
    more = ", ..." if len(seen) > INPUTCHECK_KEYS_SHOWN else ""
    return f"JSON objects with the keys {', '.join(repr(k) for k in shown)}{more}"


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
