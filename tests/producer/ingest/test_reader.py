"""The streaming reader: every format, the awkward bytes real dumps hold, broken files."""

from __future__ import annotations

import gzip
import io
import sys
from pathlib import Path
from types import SimpleNamespace

import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from genqueue.common.errors import InputError
from genqueue.producer.ingest import reader
from genqueue.producer.ingest.reader import RawRecord, iter_records
from genqueue.producer.ingest.splitter import SNIPPET_BYTES

RECORDS = [
    {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]},
    {"conversations": [{"from": "human", "value": "a, ]} \" \\ [{"}], "id": 2},
    {"messages": [{"role": "user", "content": "ü 😀"}]},
]
JSONL = b"".join(orjson.dumps(r) + b"\n" for r in RECORDS)
ARRAY = orjson.dumps(RECORDS, option=orjson.OPT_INDENT_2)


def read(path: Path | str, **kw: int) -> list[RawRecord]:
    return list(iter_records(str(path), **kw))


def values(records: list[RawRecord]) -> list[object]:
    return [r.value for r in records]


def write(tmp_path: Path, name: str, data: bytes) -> Path:
    path = tmp_path / name
    path.write_bytes(data)
    return path


# --- formats ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "data"),
    [
        ("d.jsonl", JSONL),
        ("d.json", ARRAY),
        ("d.json", JSONL),  # a .json that is really JSONL
        ("d.jsonl.gz", gzip.compress(JSONL, mtime=0)),
        ("d.json.gz", gzip.compress(ARRAY, mtime=0)),
        ("d.jsonl.zst", zstandard.ZstdCompressor().compress(JSONL)),
        ("d.json.zst", zstandard.ZstdCompressor().compress(ARRAY)),
        ("d.data", gzip.compress(ARRAY, mtime=0)),  # unknown extension: sniffed
        ("d.json.gz", gzip.compress(JSONL[:100], mtime=0) + gzip.compress(JSONL[100:], mtime=0)),  # multi-member
    ],
)
def test_formats(tmp_path: Path, name: str, data: bytes) -> None:
    records = read(write(tmp_path, name, data))
    assert values(records) == RECORDS
    assert [r.index for r in records] == [0, 1, 2]
    assert all(r.error is None for r in records)


def test_jsonl_lines_and_sizes(tmp_path: Path) -> None:
    records = read(write(tmp_path, "d.jsonl", JSONL))
    assert [r.line for r in records] == [1, 2, 3]
    first = orjson.dumps(RECORDS[0])
    assert records[0].snippet == first and records[0].size == len(first)


def test_array_has_no_line_numbers(tmp_path: Path) -> None:
    assert {r.line for r in read(write(tmp_path, "d.json", ARRAY))} == {None}


def test_zstd_multi_frame(tmp_path: Path) -> None:
    z = zstandard.ZstdCompressor()
    assert values(read(write(tmp_path, "d.zst", z.compress(JSONL[:50]) + z.compress(JSONL[50:])))) == RECORDS


def test_single_pretty_object_json(tmp_path: Path) -> None:
    data = orjson.dumps(RECORDS[0], option=orjson.OPT_INDENT_2)
    assert data.count(b"\n") > 3
    assert values(read(write(tmp_path, "one.json", b"\n\n" + data))) == [RECORDS[0]]


def test_json_array_of_non_objects_still_yields(tmp_path: Path) -> None:
    records = read(write(tmp_path, "d.json", b'[1, "two", null, [3], {"a": {}}]'))
    assert values(records) == [1, "two", None, [3], {"a": {}}]
    assert read(write(tmp_path, "e.json", b"  [ ]  \n")) == []


def test_parquet(tmp_path: Path) -> None:
    path = tmp_path / "d.parquet"
    table = pa.Table.from_pylist(
        [
            {"id": "a", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]},
            {"id": "b", "conversations": [{"from": "human", "value": "x" * 500}]},
        ]
    )
    pq.write_table(table, path)
    records = read(path)
    assert values(records)[0] == {
        "id": "a",
        "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}],
    }
    assert [(r.index, r.line, r.error) for r in records] == [(0, None, None), (1, None, None)]
    assert len(records[1].snippet) == SNIPPET_BYTES
    assert records[1].size > 500
    # Without its extension, parquet is recognised by its magic bytes.
    other = write(tmp_path, "d.bin", path.read_bytes())
    assert values(read(other)) == values(records)
    # A row over the limit is rejected, not loaded into the job.
    assert [r.error for r in read(path, max_record_bytes=200)] == [None, "record_too_large"]


def test_parquet_unreadable(tmp_path: Path) -> None:
    with pytest.raises(InputError, match=r"^cannot read .*bad\.parquet: "):
        read(write(tmp_path, "bad.parquet", b"PAR1 this is not parquet"))


def fake_stdin(monkeypatch: pytest.MonkeyPatch, data: bytes) -> None:
    monkeypatch.setattr(sys, "stdin", SimpleNamespace(buffer=io.BytesIO(data)))


@pytest.mark.parametrize(
    "data",
    [JSONL, ARRAY, gzip.compress(JSONL, mtime=0), zstandard.ZstdCompressor().compress(ARRAY)],
)
def test_stdin(monkeypatch: pytest.MonkeyPatch, data: bytes) -> None:
    fake_stdin(monkeypatch, data)
    assert values(read("-")) == RECORDS


def test_stdin_parquet_refused(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    path = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist([{"a": 1}]), path)
    fake_stdin(monkeypatch, path.read_bytes())
    with pytest.raises(InputError, match="stdin"):
        read("-")


def test_empty_inputs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert read(write(tmp_path, "e.jsonl", b"")) == []
    assert read(write(tmp_path, "e.json", b" \n\r\n")) == []
    fake_stdin(monkeypatch, b"")
    assert read("-") == []


# --- awkward bytes ---------------------------------------------------------------------


def test_bom_crlf_blank_lines(tmp_path: Path) -> None:
    data = b"\xef\xbb\xbf" + b'{"a": 1}\r\n' + b"\r\n   \n\t\n" + b'{"b": 2}  \r\n\n' + b'{"c": 3}'
    records = read(write(tmp_path, "d.jsonl", data))
    assert values(records) == [{"a": 1}, {"b": 2}, {"c": 3}]
    assert [r.index for r in records] == [0, 1, 2]  # blank lines are not records
    assert [r.line for r in records] == [1, 5, 7]
    assert records[1].snippet == b'{"b": 2}'


def test_bom_before_array(tmp_path: Path) -> None:
    assert values(read(write(tmp_path, "d.json", b"\xef\xbb\xbf\n[{\"a\": 1}]"))) == [{"a": 1}]


def test_bad_records_are_reported_not_raised(tmp_path: Path) -> None:
    lines = [
        b'{"ok": 1}',
        b'{"t": "\\ud800"}',  # valid JSON, not valid text
        b'{"t": "\xff\xfe"}',  # not UTF-8
        b"{not json",
        b'{"n": NaN}',
        b"[" * 100_000,
        b"[" * 100_000 + b"]" * 100_000,
        b'{"ok": 2}',
    ]
    records = read(write(tmp_path, "d.jsonl", b"\n".join(lines)))
    assert [r.error for r in records] == [
        None, "invalid_unicode", "invalid_unicode", "invalid_json", "invalid_json",
        "invalid_json", "invalid_json", None,
    ]
    assert [r.value for r in records][-1] == {"ok": 2}
    assert all(r.value is None for r in records if r.error)
    assert all(len(r.snippet) <= SNIPPET_BYTES for r in records)
    assert records[3].snippet == b"{not json"


def test_parse_record() -> None:
    assert reader.parse_record(b'{"a": "\\ud83d\\ude00"}') == ({"a": "😀"}, None)
    assert reader.parse_record(b'"\\udc00"') == (None, "invalid_unicode")
    assert reader.parse_record(b"[1e400]") == (None, "invalid_json")  # stdlib says inf


def test_oversize_line_skipped(tmp_path: Path) -> None:
    big = b'{"x": "' + b"a" * (5 * 1024 * 1024) + b'"}'
    data = b'{"a": 1}\n' + big + b"\r\n" + b'{"b": 2}\n'
    records = read(write(tmp_path, "d.jsonl", data), max_record_bytes=1024 * 1024)
    assert [r.error for r in records] == [None, "record_too_large", None]
    assert [r.line for r in records] == [1, 2, 3]
    assert records[1].size >= len(big)
    assert records[1].snippet == big[: SNIPPET_BYTES]
    assert records[2].value == {"b": 2}


def test_oversize_last_line_and_array_element(tmp_path: Path) -> None:
    big = b'{"x": "' + b"a" * 300_000 + b'"}'
    records = read(write(tmp_path, "d.jsonl", b'{"a": 1}\n' + big), max_record_bytes=100_000)
    assert [r.error for r in records] == [None, "record_too_large"]
    records = read(write(tmp_path, "d.json", b"[" + big + b', {"b": 2}]'), max_record_bytes=100_000)
    assert [r.error for r in records] == ["record_too_large", None]
    assert records[0].snippet == big[: SNIPPET_BYTES]


@pytest.mark.parametrize("chunk", [1, 2, 3, 7, 64])
def test_tiny_chunks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, chunk: int) -> None:
    # Every boundary case (escapes, quotes, BOM, CRLF split across reads) at once.
    monkeypatch.setattr(reader, "CHUNK_SIZE", chunk)
    assert values(read(write(tmp_path, "d.json", b"\xef\xbb\xbf" + ARRAY))) == RECORDS
    crlf = b"\xef\xbb\xbf\r\n" + JSONL.replace(b"\n", b"\r\n\r\n")
    records = read(write(tmp_path, "d.jsonl", crlf))
    assert values(records) == RECORDS
    assert [r.line for r in records] == [2, 4, 6]
    big = read(write(tmp_path, "b.jsonl", JSONL), max_record_bytes=70)  # lines: 80, 68, 50
    assert [r.error for r in big] == ["record_too_large", None, None]
    assert big[0].size == 80 and big[1].value == RECORDS[1]
    big = read(write(tmp_path, "b.json", b"[" + JSONL.replace(b"\n", b",") + b"]"), max_record_bytes=70)
    assert [r.error for r in big] == ["record_too_large", None, None]


def test_many_blank_lines_stream(tmp_path: Path) -> None:
    path = tmp_path / "blank.jsonl"
    with path.open("wb") as f:
        f.write(b'{"a": 1}\n')
        for _ in range(16):
            f.write(b"\n" * (1 << 20))
        f.write(b'{"b": 2}\n')
    records = read(path)
    assert [(r.index, r.line) for r in records] == [(0, 1), (1, 2 + 16 * (1 << 20))]


# --- broken files ----------------------------------------------------------------------


def test_missing_file() -> None:
    with pytest.raises(InputError) as info:
        iter_records("no/such/data.jsonl")
    assert str(info.value) == "cannot read no/such/data.jsonl: No such file or directory"


def test_directory(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="cannot read"):
        read(tmp_path)


def _many_lines(n: int) -> bytes:
    return b"".join(orjson.dumps({"i": i, "pad": "x" * 100}) + b"\n" for i in range(n))


@pytest.mark.parametrize(
    ("name", "compress"),
    [("d.jsonl.gz", gzip.compress), ("d.jsonl.zst", zstandard.ZstdCompressor().compress)],
)
def test_truncated_compressed_file(tmp_path: Path, name: str, compress: object) -> None:
    data = compress(_many_lines(20_000))  # type: ignore[operator]
    path = write(tmp_path, name, data[: len(data) * 2 // 3])
    seen: list[RawRecord] = []
    with pytest.raises(InputError) as info:
        seen.extend(iter_records(str(path)))  # keeps what came before the break
    assert len(seen) > 1000  # records before the break were yielded, nothing lost silently
    assert [r.value["i"] for r in seen[:-1]] == list(range(len(seen) - 1))
    message = str(info.value)
    assert message.startswith(f"cannot read {path}: ")
    assert f"record index {len(seen)}" in message
    assert "\n" not in message


def test_corrupt_gzip(tmp_path: Path) -> None:
    data = bytearray(gzip.compress(_many_lines(2000)))
    data[len(data) // 2 : len(data) // 2 + 64] = b"\x00" * 64
    with pytest.raises(InputError, match="cannot read"):
        read(write(tmp_path, "d.jsonl.gz", bytes(data)))


def test_junk_after_array(tmp_path: Path) -> None:
    seen: list[RawRecord] = []
    with pytest.raises(InputError, match="after the top-level array"):
        seen.extend(iter_records(str(write(tmp_path, "d.json", b'[{"a": 1}] {"b": 2}'))))
    assert values(seen) == [{"a": 1}]


def test_truncated_array_reports_last_element(tmp_path: Path) -> None:
    records = read(write(tmp_path, "d.json", b'[{"a": 1}, {"b": [2, '))
    assert [r.error for r in records] == [None, "invalid_json"]
    assert records[1].snippet == b'{"b": [2,'
