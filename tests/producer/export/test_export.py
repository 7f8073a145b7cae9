"""`producer export`: dedupe, order, formats, coverage and exit codes, on hand-built shards."""

from __future__ import annotations

import gzip
import hashlib
from pathlib import Path
from typing import Any

import orjson
import pytest
import redis
import zstandard
from click.testing import CliRunner, Result

from genqueue.common.contracts import Mode
from genqueue.common.keepers.items import IN_RUN, ItemTable
from genqueue.common.keepers.keeper import run_key
from genqueue.common.keepers.runs import RunStore
from genqueue.common.settings import RunSettings
from genqueue.producer.export.command import export_command
from genqueue.producer.export.core import Exporter
from genqueue.producer.export.formats import ExportFormat
from genqueue.producer.export.formats.openai import to_openai
from genqueue.producer.export.formats.sharegpt import to_sharegpt
from genqueue.producer.export.plan import ExportPlan
from genqueue.producer.export.sinks import stem
from genqueue.producer.export.sources import source_for
from tests import s3server
from tests.conftest import cli
from tests.s3server import S3Server

s3_server = s3server.s3_server  # fixtures
s3_env = s3server.s3_env

pytestmark = pytest.mark.integration

RUN = "exp"


def key(i: int, turn: int | None = None) -> str:
    return f"{i:016x}{(turn if turn is not None else 0xFFFF):016x}"


def success(i: int, *, turn: int | None = None, attempt: int = 1, finished: float = 100.0,
            tag: str = "") -> dict[str, Any]:
    return {"key": key(i, turn), "index": i, "turn": turn, "run": RUN,
            "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": f"q{i}.{turn}"}],
            "content": f"answer {i}.{turn}{tag}", "reasoning": f"thinking {i}", "reasoning_form": "field",
            "tool_calls": [], "finish_reason": "stop", "outcome": "finished",
            "usage": {"prompt_tokens": 5, "completion_tokens": 7}, "model": "m", "fingerprint": "fp",
            "attempt": attempt, "timings": {"finished_at": finished}}


def regenerated(i: int) -> dict[str, Any]:
    rec = success(i)
    rec["messages"] = [{"role": "user", "content": "u0"}, {"role": "assistant", "content": "a0"},
                       {"role": "user", "content": "u1"}, {"role": "assistant", "content": "a1"}]
    rec["turns"] = [{"turn": 0, "content": "a0", "reasoning": "r0"}, {"turn": 1, "content": "a1", "reasoning": None}]
    rec["content"], rec["reasoning"] = "a1", None
    return rec


def error(i: int, *, attempt: int = 1, message: str = "too long") -> dict[str, Any]:
    return {"key": key(i), "index": i, "turn": None, "run": RUN, "messages": [{"role": "user", "content": "x"}],
            "error": {"class": "permanent", "type": "PermanentError", "status": 400, "message": message},
            "attempt": attempt, "timings": {"finished_at": 50.0}}


def write_shard(out: Path, name: str, records: list[dict[str, Any]], manifest: bool = True) -> None:
    d = out / RUN / "shards"
    d.mkdir(parents=True, exist_ok=True)
    data = b"".join(orjson.dumps(r) + b"\n" for r in records)
    (d / name).write_bytes(data)
    if manifest:
        (d / name.replace(".jsonl", ".manifest.json")).write_bytes(orjson.dumps(
            {"run": RUN, "shard": name, "records": len(records), "bytes": len(data),
             "sha256": hashlib.sha256(data).hexdigest()}))


@pytest.fixture
def run_dir(tmp_path: Path, conn: redis.Redis) -> Path:
    """A run of 10 enqueued items (index 0-9): 0-7 succeed (some twice), 8 fails twice, 9 missing."""
    out = tmp_path / "out"
    RunStore(conn).create_or_check(RUN, RunSettings(output=str(out)))
    RunStore(conn).record_source(RUN, "data.jsonl", {"records": 10})
    ItemTable(conn, RUN).change([bytes.fromhex(key(i)) for i in range(10)], add=IN_RUN)
    write_shard(out, "w2-000001.jsonl", [success(7), success(6), success(5, attempt=2, tag="-late"),
                                         error(8, attempt=2, message="second"), regenerated(4)])
    write_shard(out, "w1-000001.jsonl", [success(3), success(2), success(1), success(0), error(5),
                                         success(5, attempt=1, finished=300.0, tag="-first"),
                                         error(8, attempt=1, message="first")], manifest=False)
    write_shard(out, "w1-000002.jsonl", [success(3, tag="-dup")])
    return tmp_path


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    raw = path.read_bytes()
    if path.suffix == ".gz":
        raw = gzip.decompress(raw)
    elif path.suffix == ".zst":
        raw = zstandard.ZstdDecompressor().stream_reader(raw).read()
    return [orjson.loads(x) for x in raw.splitlines() if x.strip()]


def run_export(tmp_path: Path, redis_url: str, *args: str) -> Result:
    return CliRunner().invoke(export_command, ["--run", RUN, *args], env={"REDIS_URL": redis_url},
                              catch_exceptions=False)


def test_openai_export_dedupes_orders_and_proves_coverage(run_dir: Path, redis_url: str, conn: redis.Redis) -> None:
    res = run_export(run_dir, redis_url, "--output", str(run_dir / "ds.jsonl"), "--json", "--rows", "conversation")
    assert res.exit_code == 1, res.output  # item 9 is missing
    summary = orjson.loads(res.stdout.strip().splitlines()[-1])
    assert {k: summary[k] for k in ("enqueued", "exported", "failed", "missing", "duplicates_removed",
                                    "records_read", "shards", "unexpected", "bad_shards")} == {
        "enqueued": 10, "exported": 8, "failed": 1, "missing": 1, "duplicates_removed": 4,
        "records_read": 13, "shards": 3, "unexpected": 0, "bad_shards": 0}
    rows = read_jsonl(run_dir / "ds.jsonl")
    assert [r["index"] for r in rows] == list(range(8))
    by = {r["index"]: r for r in rows}
    assert by[3]["messages"][-1]["content"] == "answer 3.None"  # the earlier shard's copy
    assert by[5]["messages"][-1]["content"] == "answer 5.None-first"  # success beats error; attempt 1 beats 2
    assert by[0]["messages"] == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "q0.None"},
                                 {"role": "assistant", "content": "answer 0.None", "reasoning_content": "thinking 0",
                                  "generated_by_target": True}]
    assert {"key", "index", "model", "fingerprint", "usage"} <= by[0].keys() and "turn" not in by[0]
    assert by[4]["messages"] == [{"role": "user", "content": "u0"},
                                 {"role": "assistant", "content": "a0", "reasoning_content": "r0",
                                  "generated_by_target": True},
                                 {"role": "user", "content": "u1"},
                                 {"role": "assistant", "content": "a1", "generated_by_target": True}]
    errors = read_jsonl(run_dir / "ds.errors.jsonl")
    assert [(e["index"], e["error"]["message"]) for e in errors] == [(8, "first")]
    assert (run_dir / "ds.missing.txt").read_text().split() == [key(9)]
    assert not list(conn.scan_iter(run_key(RUN, "export:*")))  # temporary sets are gone
    assert not [p for p in run_dir.iterdir() if p.name.startswith(".gq-export") or p.name.endswith(".tmp")]


def test_allow_partial_table_and_paths(run_dir: Path, redis_url: str) -> None:
    res = run_export(run_dir, redis_url, "--output", str(run_dir / "ds.jsonl.gz"), "--allow-partial",
                     "--errors", str(run_dir / "e.jsonl"), "--missing", str(run_dir / "m.txt"), "--rows", "conversation")
    assert res.exit_code == 0, res.output
    assert "exported" in res.output and "missing" in res.output and "duplicates removed" in res.output
    assert [r["index"] for r in read_jsonl(run_dir / "ds.jsonl.gz")] == list(range(8))
    assert len(read_jsonl(run_dir / "e.jsonl")) == 1 and (run_dir / "m.txt").read_text().strip() == key(9)


def test_sharegpt_and_zstd(run_dir: Path, redis_url: str) -> None:
    res = run_export(run_dir, redis_url, "--output", str(run_dir / "sg.jsonl.zst"), "--format", "sharegpt",
                     "--allow-partial", "--rows", "conversation")
    assert res.exit_code == 0, res.output
    rows = read_jsonl(run_dir / "sg.jsonl.zst")
    shape = {"conversations": [{"from": "system", "value": "be brief"}, {"from": "human", "value": "q0.None"},
                               {"from": "gpt", "value": "<think>\nthinking 0\n</think>\n\nanswer 0.None"}],
             "key": key(0), "index": 0}
    assert {k: rows[0][k] for k in shape} == shape
    # every line also says what made it (issue 14); without an input id, the key is its id
    assert {k: rows[0][k] for k in ("id", "model", "fingerprint", "outcome")} == {
        "id": key(0), "model": "m", "fingerprint": "fp", "outcome": "finished"}
    assert rows[4]["conversations"] == [{"from": "human", "value": "u0"},
                                        {"from": "gpt", "value": "<think>\nr0\n</think>\n\na0"},
                                        {"from": "human", "value": "u1"}, {"from": "gpt", "value": "a1"}]
    assert (run_dir / "sg.errors.jsonl").exists()


def test_each_mode_turns_order_and_small_partitions(tmp_path: Path, conn: redis.Redis) -> None:
    out = tmp_path / "out"
    RunStore(conn).create_or_check(RUN, RunSettings(output=str(out), multi_turn=Mode.EACH))
    keys = [key(i, t) for i in range(300) for t in range(3)]
    ItemTable(conn, RUN).change([bytes.fromhex(k) for k in keys], add=IN_RUN)
    recs = [success(i, turn=t) for i in range(300) for t in range(3)]
    write_shard(out, "a-000001.jsonl", recs[::-1][:500])  # reversed, split over two shards
    write_shard(out, "a-000002.jsonl", recs[::-1][400:])  # 100 duplicates
    plan = ExportPlan(fmt=ExportFormat.OPENAI, output=tmp_path / "d.jsonl", errors_path=tmp_path / "e.jsonl",
                      missing_path=tmp_path / "m.txt", workdir=tmp_path, partition_bytes=20_000)
    ex = Exporter(conn, RUN, source_for(str(out), RUN), plan)
    r = ex.export()
    assert (r.exported, r.missing, r.duplicates_removed, r.failed) == (900, 0, 100, 0)
    rows = read_jsonl(tmp_path / "d.jsonl")
    assert [(x["index"], x["turn"]) for x in rows] == [(i, t) for i in range(300) for t in range(3)]
    assert (tmp_path / "m.txt").read_text() == ""


def test_unexpected_keys_and_bad_lines(run_dir: Path, redis_url: str) -> None:
    out = run_dir / "out"
    stray = success(4)
    stray["key"] = "ff" * 16
    write_shard(out, "z-000001.jsonl", [stray])
    huge = orjson.dumps({**success(2), "index": -1}).replace(b'"index":-1', b'"index":' + str(2**70).encode())
    (out / RUN / "shards" / "z-000002.jsonl").write_bytes(b'{"key": "torn\n\n' + huge + b"\n")
    with open(out / RUN / "shards" / "w1-000002.jsonl", "ab") as fh:  # no longer what its manifest says
        fh.write(orjson.dumps(success(3, tag="-extra")) + b"\n")
    res = run_export(run_dir, redis_url, "--output", str(run_dir / "ds.jsonl"), "--json", "--allow-partial")
    s = orjson.loads(res.stdout)
    assert (s["unexpected"], s["bad_lines"], s["bad_shards"], s["exported"], s["missing"]) == (1, 2, 1, 9, 1)
    assert s["records_read"] == 13 + 2  # the stray record and the extra line; blank and bad lines not


def test_user_mistakes_are_one_line(run_dir: Path, redis_url: str, tmp_path: Path) -> None:
    res = CliRunner().invoke(export_command, ["--run", "nope", "--output", str(tmp_path / "x.jsonl")],
                             env={"REDIS_URL": redis_url})
    assert res.exit_code == 2 and "no run named 'nope'" in res.output and "Traceback" not in res.output
    res = run_export(run_dir, redis_url, "--output", str(tmp_path / "no" / "such" / "dir.jsonl"))
    assert res.exit_code == 2 and "cannot write output file" in res.output
    res = run_export(run_dir, redis_url, "--output", str(tmp_path / "a.jsonl"), "--errors", str(tmp_path / "a.jsonl"))
    assert res.exit_code == 2


def test_stem_and_converters() -> None:
    assert stem(Path("/d/out.jsonl.gz")) == Path("/d/out") and stem(Path("x.zst")) == Path("x")
    rec = success(1)
    rec["tool_calls"] = [{"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]
    rec["content"], rec["reasoning"] = "", None
    assert to_openai(rec)["messages"][-1] == {"role": "assistant", "content": "", "tool_calls": rec["tool_calls"],
                                              "generated_by_target": True}
    assert to_sharegpt(rec)["conversations"][-1] == {"from": "function_call", "value": '{"name":"f","arguments":{"a":1}}'}


def test_real_cli(run_dir: Path, redis_url: str) -> None:
    from genqueue.producer.cli import main

    if "export" not in main.commands:
        pytest.skip("producer export is not registered in producer/cli.py yet")
    proc = cli("producer", "export", "--run", RUN, "--output", str(run_dir / "cli.jsonl"), "--json",
               env={"REDIS_URL": redis_url}, check=False)
    assert proc.returncode == 1, proc.stderr
    s = orjson.loads(proc.stdout)
    assert (s["exported"], s["failed"], s["missing"]) == (8, 1, 1)
    proc = cli("producer", "export", "--run", RUN, "--output", str(run_dir / "cli.jsonl"), "--allow-partial",
               env={"REDIS_URL": redis_url})
    assert "duplicates removed" in proc.stdout


def test_export_from_s3_matches_local(run_dir: Path, redis_url: str, conn: redis.Redis, s3_server: S3Server,
                                      s3_env: dict[str, str]) -> None:
    assert isinstance(s3_server, S3Server)
    local = run_export(run_dir, redis_url, "--output", str(run_dir / "local.jsonl"), "--allow-partial", "--json")
    client = s3_server.client()
    for path in sorted((run_dir / "out" / RUN / "shards").iterdir()):
        client.put_object(Bucket=s3_server.bucket, Key=f"pre/{RUN}/shards/{path.name}", Body=path.read_bytes())
    conn.hset(run_key(RUN), "settings", RunSettings(output=s3_server.url("pre")).to_json())
    remote = run_export(run_dir, redis_url, "--output", str(run_dir / "s3.jsonl"), "--allow-partial", "--json")
    a, b = orjson.loads(local.stdout), orjson.loads(remote.stdout)
    assert b["source"] == f"s3://{s3_server.bucket}/pre/{RUN}/shards/"
    assert {k: v for k, v in a.items() if k in ("exported", "failed", "missing", "duplicates_removed", "shards", "bad_shards")} == \
        {k: v for k, v in b.items() if k in ("exported", "failed", "missing", "duplicates_removed", "shards", "bad_shards")}
    assert (run_dir / "local.jsonl").read_bytes() == (run_dir / "s3.jsonl").read_bytes()
    assert not [p for p in run_dir.iterdir() if p.name.startswith(".gq-export")]
    conn.hset(run_key(RUN), "settings", RunSettings(output="s3://no-such-bucket/x").to_json())
    res = CliRunner().invoke(export_command, ["--run", RUN, "--output", str(run_dir / "n.jsonl")],
                             env={"REDIS_URL": redis_url})
    assert res.exit_code == 2 and res.output.startswith("error: cannot list s3://no-such-bucket/x/exp/shards/: no such bucket")
    assert "Traceback" not in res.output and not (run_dir / "n.jsonl").exists()


def test_the_original_beats_an_end_of_run_copy_that_ended_first(tmp_path: Path, redis_url: str,
                                                                 conn: redis.Redis) -> None:
    """Both answers to a copied item shipped: the copy ended first (of two answers racing to one
    prompt the shorter tends to), so a rule by finish time alone would lean the dataset short.
    The original is kept; a copy still beats an original that is not a dataset row, and stands
    alone where it is the only answer."""
    out = tmp_path / "out"
    RunStore(conn).create_or_check(RUN, RunSettings(output=str(out)))
    RunStore(conn).record_source(RUN, "data.jsonl", {"records": 3})
    ItemTable(conn, RUN).change([bytes.fromhex(key(i)) for i in range(3)], add=IN_RUN)
    cut = {**success(1, finished=100.0, tag="-cut"), "finish_reason": "length", "outcome": "cut_in_answer"}
    write_shard(out, "slow-000001.jsonl", [success(0, finished=100.0, tag="-original"), cut])
    write_shard(out, "fast-000001.jsonl", [{**success(i, finished=10.0, tag="-copy"), "copy": True} for i in range(3)])
    res = run_export(tmp_path, redis_url, "--output", str(tmp_path / "ds.jsonl"), "--json")
    assert res.exit_code == 0, res.output
    summary = orjson.loads(res.stdout.strip().splitlines()[-1])
    assert (summary["exported"], summary["duplicates_removed"]) == (3, 2)
    got = [r["messages"][-1]["content"] for r in read_jsonl(tmp_path / "ds.jsonl")]
    assert got == ["answer 0.None-original", "answer 1.None-copy", "answer 2.None-copy"]


def test_generation_rows_are_the_default_and_the_summary_counts_both_layouts(run_dir: Path, redis_url: str) -> None:
    res = run_export(run_dir, redis_url, "--output", str(run_dir / "g.jsonl"), "--json", "--allow-partial")
    summary = orjson.loads(res.stdout.strip().splitlines()[-1])
    rows = read_jsonl(run_dir / "g.jsonl")
    # item 4 is a regenerated conversation of two answers: two rows, the rest one each
    assert [r["id"] for r in rows if r["index"] == 4] == [f"{key(4)}-a0", f"{key(4)}-a1"]
    assert (summary["rows_layout"], summary["rows"], summary["exported"]) == ("generation", len(rows), 8)
    assert (summary["generation_rows"], summary["conversation_rows"]) == (len(rows), 8) and len(rows) == 9
    table = run_export(run_dir, redis_url, "--output", str(run_dir / "t.jsonl"), "--allow-partial").output
    assert "9 generation rows from 8 items (--rows conversation: 8)" in table
    bad = run_export(run_dir, redis_url, "--output", str(run_dir / "b.jsonl"), "--format", "batch", "--rows",
                     "conversation")
    assert bad.exit_code == 2 and "--format batch has rows of its own" in bad.output
