"""Property tests: whatever the input, the reader yields records and the converter rejects.

Nothing an input file holds may crash a run: every record either converts or is rejected
with a named reason.
"""

from __future__ import annotations

import re
import tempfile
from pathlib import Path
from typing import Any

import orjson
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from genqueue.common.contracts import Mode
from genqueue.common.errors import InputError
from genqueue.producer.ingest import reader
from genqueue.producer.ingest.convert import normalize
from genqueue.producer.ingest.items import make_items
from genqueue.producer.ingest.rejects import REJECT_REASONS, Rejected
from genqueue.producer.ingest.splitter import SNIPPET_BYTES, split_array

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
KEY = re.compile(r"[0-9a-f]{32}")

# Text with the characters real dumps trip on: surrogates, BOMs, newlines, quotes, escapes.
nasty_text = st.one_of(
    st.text(max_size=20),
    st.sampled_from(["", " ", "\ud800", "a\udfffb", "\ufeff", "\r\n", '"', "\\", "\x00", "😀"]),
)
roles = st.sampled_from(
    ["human", "user", "gpt", "assistant", "chatgpt", "bing", "bard", "model", "system",
     "developer", "function_call", "observation", "tool", "HUMAN ", "robot", ""]
)
scalars = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True), nasty_text,
)
json_ish = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.dictionaries(st.one_of(nasty_text, st.sampled_from(["type", "text", "name"])), inner, max_size=4),
    ),
    max_leaves=12,
)
function_call = st.one_of(
    st.builds(lambda n, a: orjson.dumps({"name": n, "arguments": a}).decode(),
              st.text(max_size=5), st.dictionaries(st.text(max_size=3), st.integers(-(2**63), 2**63 - 1), max_size=2)),
    st.builds(lambda n: [{"name": n}], nasty_text),
)
message = st.fixed_dictionaries(
    {},
    optional={
        "from": st.one_of(roles, json_ish),
        "role": roles,
        "value": st.one_of(nasty_text, function_call, json_ish),
        "content": st.one_of(
            nasty_text,
            st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"]), "text": nasty_text}),
                     max_size=3),
        ),
        "tool_calls": st.one_of(json_ish, st.lists(st.fixed_dictionaries(
            {"function": st.fixed_dictionaries({"name": nasty_text, "arguments": json_ish})}), max_size=2)),
        "tool_call_id": st.one_of(nasty_text, json_ish),
    },
)
records = st.one_of(
    json_ish,
    st.fixed_dictionaries(
        {},
        optional={
            "conversations": st.one_of(st.lists(message, max_size=8), json_ish),
            "messages": st.lists(message, max_size=8),
            "system": st.one_of(nasty_text, json_ish),
            "tools": st.one_of(json_ish, st.just('[{"name": "f"}]'), st.just("[")),
        },
    ),
)


@FUZZ
@given(st.lists(st.binary(max_size=60), max_size=12), st.sampled_from([1, 3, 16, 1 << 20]))
def test_reader_never_raises_on_jsonl(lines: list[bytes], chunk: int) -> None:
    original = reader.CHUNK_SIZE
    reader.CHUNK_SIZE = chunk  # monkeypatch is function-scoped; hypothesis reruns the body
    try:
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "fuzz.jsonl"
            path.write_bytes(b"\n".join(lines))
            out = list(reader.iter_records(str(path), max_record_bytes=40))
    finally:
        reader.CHUNK_SIZE = original
    assert [r.index for r in out] == list(range(len(out)))
    for r in out:
        assert (r.value is None) or r.error is None
        assert r.error in (None, "invalid_json", "invalid_unicode", "record_too_large")
        assert len(r.snippet) <= SNIPPET_BYTES
    data = b"\n".join(lines).removeprefix(b"\xef\xbb\xbf")  # a BOM only counts at the start
    assert len(out) == sum(1 for line in data.split(b"\n") if line.strip())


@FUZZ
@given(st.binary(max_size=200), st.sampled_from([".json", ".data", ".json.gz"]))
def test_reader_on_arbitrary_files_yields_or_input_error(data: bytes, suffix: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"fuzz{suffix}"
        path.write_bytes(data)
        try:
            for r in reader.iter_records(str(path), max_record_bytes=50):
                assert r.error is None or r.value is None
        except InputError:
            pass  # a broken stream (junk after an array, bad compression): one-line error


@FUZZ
@given(
    st.lists(json_ish.filter(lambda v: _dumpable(v)), max_size=6),
    st.integers(min_value=1, max_value=17),
    st.sampled_from([b"", b" ", b"\n", b"\r\n\t"]),
)
def test_splitter_returns_every_element(items: list[Any], chunk: int, ws: bytes) -> None:
    parts = [orjson.dumps(v) for v in items]
    data = ws + b"[" + ws + (ws + b"," + ws).join(parts) + ws + b"]" + ws
    chunks = [data[i : i + chunk] for i in range(0, len(data), chunk)]
    out = list(split_array(chunks, 1 << 20))
    assert [raw for raw, _, _ in out] == parts


def _dumpable(value: Any) -> bool:
    try:
        orjson.dumps(value)
    except TypeError:
        return False
    return True


@FUZZ
@given(records)
def test_normalize_converts_or_rejects(value: Any) -> None:
    try:
        conv = normalize(value)
    except Rejected as e:
        assert e.reason in REJECT_REASONS
        return
    assert any(m["role"] == "user" for m in conv.messages)
    assert conv.text_chars() >= 0
    for mode in Mode:
        try:
            items = make_items(conv, mode, 3)
        except Rejected as e:
            assert (mode, e.reason) == ("regenerate", "tool_turn_first")
            continue
        assert items
        for item in items:
            assert KEY.fullmatch(item["key"])
            assert item["index"] == 3
            assert item["messages"][-1]["role"] == "user"
            orjson.loads(orjson.dumps(item))
