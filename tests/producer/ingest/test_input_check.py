"""An input that is not chat records is refused before a run is made of it; `--id-field`.

Refused: none of the first records (100, or the whole input when shorter) is a JSON object,
or there are no records: one `error:` line saying what was expected and what the input looks
like, exit 2, nothing in Redis, no rejects file; `--dry-run` and stdin say the same. An input
with some bad lines among good ones is enqueued as before, its bad lines rejected.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import orjson
import pytest
import redis

from genqueue.common.contracts import RejectReason
from genqueue.producer.export.formats.openai import to_openai
from genqueue.producer.ingest.inputcheck import looks_like
from genqueue.producer.ingest.items import Origin
from genqueue.producer.ingest.reader import RawRecord
from tests.conftest import cli, sharegpt, write_jsonl
from tests.producer.export.test_export import success

pytestmark = pytest.mark.integration

EXPECTED = "expected JSONL of ShareGPT/OpenAI chat records, a .json array of them, or Parquet"


def enqueue(redis_url: str, *args: str, stdin: bytes | None = None) -> subprocess.CompletedProcess[str]:
    return cli("producer", "enqueue", *args, env={"REDIS_URL": redis_url}, check=False, input=stdin)


def refused(proc: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in proc.stderr, proc.stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


def csv_file(path: Path, rows: int = 500) -> Path:
    path.write_text("id,prompt,answer\n" + "".join(f"{i},what is {i}?,it is {i}\n" for i in range(rows)))
    return path


@pytest.mark.parametrize("dry", [False, True])
def test_csv_binary_and_empty_inputs_are_refused_before_a_run(tmp_path: Path, redis_url: str, conn: redis.Redis,
                                                             dry: bool) -> None:
    rej = str(tmp_path / "r.jsonl")
    flags = ["--rejects", rej] + (["--dry-run"] if dry else [])
    refused(enqueue(redis_url, str(csv_file(tmp_path / "data.csv")), *flags),
            "data.csv does not hold chat records: none of its first 100 records is a JSON object",
            "looks like CSV: 'id,prompt,answer'", EXPECTED)
    binary = tmp_path / "blob.jsonl"
    binary.write_bytes(b"\x89PNG\r\n\x1a\n" + os.urandom(200_000))  # a PNG header: never JSON framing
    refused(enqueue(redis_url, str(binary), *flags), "blob.jsonl does not hold chat records", "binary data", EXPECTED)
    short = tmp_path / "short.txt"
    short.write_text("hello\nworld\n")
    refused(enqueue(redis_url, str(short), *flags), "none of its 2 records", "text that is not JSON: 'hello'")
    empty = tmp_path / "empty.jsonl"
    empty.write_bytes(b"\n  \n")
    refused(enqueue(redis_url, str(empty), *flags), "empty.jsonl holds no records")
    # stdin is read ahead the same way
    refused(enqueue(redis_url, "-", "--run", "piped", *flags, stdin=(tmp_path / "data.csv").read_bytes()),
            "stdin does not hold chat records", "CSV")
    assert conn.dbsize() == 0 and not [p for p in os.listdir(tmp_path) if p.startswith("r.jsonl")]


def test_alpaca_objects_are_refused_not_a_run_of_done_0_of_0(tmp_path: Path, redis_url: str,
                                                             conn: redis.Redis) -> None:
    """JSON objects without a conversation (Alpaca's instruction/input/output) made a run of no items.

    old: exit 0, `rejected 5 / no_conversation 5`, then status "done 0 of 0", "ETA 0m 00s at 0.0 items/s"
    new: "error: alpaca.jsonl does not hold chat records: none of its 5 records has a 'conversations' or
         'messages' list (it looks like Alpaca's format: instruction/input/output); expected ...", exit 2"""
    alpaca = write_jsonl(tmp_path / "alpaca.jsonl", [{"instruction": f"say {i}", "input": "", "output": f"{i}"}
                                                     for i in range(5)])
    rej = tmp_path / "r.jsonl"
    for flags in ((), ("--dry-run",)):
        refused(enqueue(redis_url, str(alpaca), "--rejects", str(rej), "--output", str(tmp_path / "out"), *flags),
                "alpaca.jsonl does not hold chat records: none of its 5 records has a 'conversations' or 'messages' "
                "list (it looks like Alpaca's format: instruction/input/output)", EXPECTED)
    other = write_jsonl(tmp_path / "other.jsonl", [{"q": "one", "a": 1}, {"q": "two", "a": 2, "src": "x"}])
    refused(enqueue(redis_url, str(other)), "(it looks like JSON objects with the keys 'q', 'a', 'src')")
    one = write_jsonl(tmp_path / "one.jsonl", [{"prompt": "p", "completion": "c"}])
    refused(enqueue(redis_url, str(one)), "its only record has no 'conversations' or 'messages' list",
            "prompt/completion pairs")
    assert conn.dbsize() == 0 and not rej.exists() and not (tmp_path / "out").exists(), "no run, nothing written"
    # some lines hold conversations: those are enqueued, the others rejected with their reason, as before
    mixed = write_jsonl(tmp_path / "mixed.jsonl", [orjson.loads(line) for line in alpaca.read_bytes().splitlines()]
                        + [sharegpt(i) for i in range(3)])
    proc = enqueue(redis_url, str(mixed), "--rejects", str(rej), "--json", "--output", str(tmp_path / "out"))
    assert proc.returncode == 0, proc.stderr
    s = orjson.loads(proc.stdout)
    assert (s["records"], s["enqueued"], s["rejected_by_reason"]) == (8, 3, {"no_conversation": 5})
    # a Batch API line's body holds its conversation
    batch = write_jsonl(tmp_path / "batch.jsonl", [{"custom_id": "b1", "method": "POST", "url": "/v1/chat/completions",
                                                   "body": {"messages": [{"role": "user", "content": "hi"}]}}])
    assert enqueue(redis_url, str(batch), "--dry-run").returncode == 0


def test_bad_lines_first_then_good_ones_are_enqueued_as_before(tmp_path: Path, redis_url: str,
                                                               conn: redis.Redis) -> None:
    data = tmp_path / "mixed.jsonl"
    data.write_bytes(b"".join(f"garbage {i}\n".encode() for i in range(5)) +
                     b"".join(orjson.dumps(sharegpt(i)) + b"\n" for i in range(20)))
    proc = enqueue(redis_url, str(data), "--rejects", str(tmp_path / "r.jsonl"), "--json")
    assert proc.returncode == 0, proc.stderr
    s = orjson.loads(proc.stdout)
    assert (s["records"], s["enqueued"], s["rejected_by_reason"]) == (25, 20, {"invalid_json": 5})
    assert [orjson.loads(x)["line"] for x in (tmp_path / "r.jsonl").read_bytes().splitlines()] == [1, 2, 3, 4, 5]
    # 100 bad lines and then good ones: the look-ahead ends at 100, so that is refused
    many = tmp_path / "many.jsonl"
    many.write_bytes(b"x\n" * 100 + orjson.dumps(sharegpt(1)) + b"\n")
    refused(enqueue(redis_url, str(many), "--dry-run"), "none of its first 100 records")
    many.write_bytes(b"x\n" * 99 + orjson.dumps(sharegpt(1)) + b"\n")
    assert enqueue(redis_url, str(many), "--dry-run").returncode == 0


def test_what_an_input_looks_like() -> None:
    def recs(*raw: bytes, error: RejectReason | None = RejectReason.INVALID_JSON) -> list[RawRecord]:
        return [RawRecord(i, i + 1, None, error, r, len(r)) for i, r in enumerate(raw)]

    assert looks_like(recs(b"PK\x03\x04rest")) == "a zip archive"
    assert looks_like(recs(b"a\tb\tc", b"1\t2\t3")) == "tab-separated text: 'a\\tb\\tc'"
    assert looks_like(recs(b"x" * 10, error=RejectReason.RECORD_TOO_LARGE)) == "records larger than --max-record-bytes"
    numbers = [RawRecord(0, 1, 1, None, b"1", 1), RawRecord(1, 2, [2], None, b"[2]", 3)]
    assert looks_like(numbers) == "JSON arrays and numbers, not objects: '1'"


def test_id_field_named_explicitly_is_required_the_default_is_not(tmp_path: Path, redis_url: str) -> None:
    data = write_jsonl(tmp_path / "ids.jsonl", [
        {"uid": "u0", "messages": [{"role": "user", "content": "zero"}]},
        {"messages": [{"role": "user", "content": "one, no id at all"}]},
        {"id": "i2", "messages": [{"role": "user", "content": "two, id but no uid"}]},
    ])
    rej = tmp_path / "r.jsonl"
    s = orjson.loads(enqueue(redis_url, str(data), "--dry-run", "--json", "--id-field", "uid",
                             "--rejects", str(rej)).stdout)
    assert (s["enqueued"], s["rejected_by_reason"]) == (1, {"missing_id": 2})
    assert [orjson.loads(x)["index"] for x in rej.read_bytes().splitlines()] == [1, 2]
    # by default (id, else custom_id) a record with neither is accepted
    s = orjson.loads(enqueue(redis_url, str(data), "--dry-run", "--json").stdout)
    assert (s["enqueued"], s["rejected"]) == (3, 0)
    # ... with no id of its own: its exported line's id is its item key, its position stays
    assert Origin().of({"messages": []}).id is None and Origin().of({"custom_id": "c"}).id == "c"
    assert to_openai({**success(1), "id": None})["id"] == success(1)["key"]
    assert to_openai({**success(1), "id": None})["index"] == 1
