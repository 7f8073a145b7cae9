"""Datasets people can train on directly (issue 14), with real parts: redis-server, the
stand-in vLLM over HTTP, `producer enqueue`, `consumer run` and `producer export` as a user
runs them, and the files read back with the libraries trainers use (pyarrow, pandas, Hugging
Face `datasets`).
"""

from __future__ import annotations

import hashlib
import os
import pty
import select
import subprocess
import time
from pathlib import Path
from typing import Any

import orjson
import pyarrow.parquet as pq
import pytest
import redis
from click.testing import CliRunner
from openai.types.chat import ChatCompletion

from genqueue.common.contracts import ExitCode
from genqueue.common.keepers.items import IN_RUN, ItemTable
from genqueue.common.keepers.runs import RunStore
from genqueue.common.settings import RunSettings
from genqueue.producer.export import parquet as export_parquet
from genqueue.producer.export.command import export_command
from genqueue.producer.export.core import Exporter
from genqueue.producer.export.formats import ExportFormat
from genqueue.producer.export.formats.spec import RowLayout
from genqueue.producer.export.plan import ExportPlan
from genqueue.producer.export.sources import source_for
from tests.conftest import BIN, Prompts, both_modes_reference_slow, cli, sharegpt, write_jsonl
from tests.consumer.e2e import Proc, Sim, read_results
from tests.producer.export import loaders

pytestmark = pytest.mark.integration


def enqueue(env: dict[str, str], path: Path, run: str, *extra: str) -> dict[str, Any]:
    proc = cli("producer", "enqueue", str(path), "--run", run, "--batch-size", "4", "--max-tokens", "256",
               "--rejects", str(path.with_suffix(".rejects.jsonl")), "--json", *extra, env=env)
    return orjson.loads(proc.stdout)  # type: ignore[no-any-return]


def consume(tmp: Path, env: dict[str, str], sim: Sim, run: str, code: int = ExitCode.DONE) -> None:
    c = Proc("consumer", ["run", "--run", run, "--endpoint", sim.url, "--spool", str(tmp / "spool" / run),
                          "--shard-max-age", "0.5", "--burst", "-c", "16"], tmp / f"consumer-{run}.log", env=env)
    assert c.wait(120) == code, c.output()


def generate(tmp: Path, env: dict[str, str], run: str, *sim_args: str, code: int = ExitCode.DONE) -> None:
    """RUN generated to the end by one --burst consumer on a stand-in started with SIM_ARGS (CODE:
    its exit, FAILED_ITEMS where an item is meant to fail)."""
    sim = Sim(tmp, "--step-time", "0.001", *sim_args)
    try:
        consume(tmp, env, sim, run, code)
    finally:
        sim.stop()


def export(env: dict[str, str], *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return cli("producer", "export", *args, env=env, check=check)


def lines(path: Path) -> list[dict[str, Any]]:
    return [orjson.loads(x) for x in path.read_bytes().splitlines() if x.strip()]


# --- provenance: two files, one run ----------------------------------------------------------
@both_modes_reference_slow  # issue 34: the missing items' provenance read from their packs too
def test_two_files_export_in_source_order_with_ids_and_missing_lists_provenance(
        tmp_path: Path, redis_url: str, conn: redis.Redis, prompts_mode: Prompts) -> None:
    env = {"REDIS_URL": redis_url}
    a = write_jsonl(tmp_path / "a.jsonl", [sharegpt(i) for i in range(30)])  # ids r0.. (sharegpt's `id`)
    b = write_jsonl(tmp_path / "b.jsonl", [{"uid": f"b-{i}", "messages": [{"role": "user", "content": f"b asks {i}"}]}
                                           for i in range(25)])
    out = ["--output", str(tmp_path / "out"), *prompts_mode.args]
    assert enqueue(env, a, "two", *out)["enqueued"] == 30
    assert enqueue(env, b, "two", "--id-field", "uid", *out)["enqueued"] == 25
    generate(tmp_path, env, "two", "--slots", "16", "--mean-tokens", "30")
    records = read_results(tmp_path / "out", "two")
    assert {(r["source"], r["source_seq"]) for r in records} == {(str(a), 0), (str(b), 1)}
    assert all(r["id"] == (f"r{r['index']}" if r["source"] == str(a) else f"b-{r['index']}") for r in records)

    export(env, "--rows", "conversation", "--run", "two", "-o", str(tmp_path / "two.jsonl"), "--include-outcomes", "all")
    rows = lines(tmp_path / "two.jsonl")
    # indexes restart at 0 in each file; the dataset is file a in order, then file b in order
    assert [(r["source"], r["index"], r["id"]) for r in rows] == (
        [(str(a), i, f"r{i}") for i in range(30)] + [(str(b), i, f"b-{i}") for i in range(25)])
    # the same order from many small partitions (each partition a slice of the run's order)
    plan = ExportPlan(fmt=ExportFormat.OPENAI, output=tmp_path / "small.jsonl", errors_path=tmp_path / "small.e",
                      missing_path=tmp_path / "small.m", workdir=tmp_path, partition_bytes=2_000,
                      include=frozenset({"finished", "cut_in_answer", "cut_in_thinking", "no_answer"}),
                      rows=RowLayout.CONVERSATION)
    ex = Exporter(conn, "two", source_for(str(tmp_path / "out"), "two"), plan)
    assert ex.export().exported == 55
    assert (tmp_path / "small.jsonl").read_bytes() == (tmp_path / "two.jsonl").read_bytes()

    # a third file, enqueued and not generated: the missing file says which records they are
    c = write_jsonl(tmp_path / "c.jsonl", [{"id": f"c{i}", "messages": [{"role": "user", "content": f"c {i}"}]}
                                           for i in range(3)])
    enqueue(env, c, "two", *out)
    proc = export(env, "--rows", "conversation", "--run", "two", "-o", str(tmp_path / "three.jsonl"), "--include-outcomes", "all", check=False)
    assert proc.returncode == 1 and "3 enqueued items have no record" in proc.stderr
    missing = sorted(x.split("\t") for x in (tmp_path / "three.missing.txt").read_text().splitlines())
    assert [(m[1], m[2], m[3]) for m in missing] == [(f"c{i}", str(c), str(i)) for i in range(3)]
    assert all(len(m[0]) == 32 for m in missing)


# --- outcomes that tell the truth ------------------------------------------------------------
def test_a_conversation_whose_later_turn_failed_is_partial_and_stays_out(tmp_path: Path, redis_url: str) -> None:
    """regenerate on the stand-in: three conversations' second user turn overflows the context
    (a 400 after a good first turn). They are `partial`, never `finished`, go to the truncated
    file, count apart, and count against --max-failed."""
    env = {"REDIS_URL": redis_url}
    recs: list[dict[str, Any]] = [sharegpt(i, turns=2) for i in range(10)]
    for i in (2, 5, 8):
        recs[i]["conversations"][2]["value"] = "word " * 3000  # type: ignore[index]
    data = write_jsonl(tmp_path / "p.jsonl", recs)
    assert enqueue(env, data, "part", "--output", str(tmp_path / "out"))["enqueued"] == 10
    generate(tmp_path, env, "part", "--slots", "8", "--mean-tokens", "20", "--max-model-len", "2048")
    by_id = {r["id"]: r for r in read_results(tmp_path / "out", "part")}
    for i in (2, 5, 8):
        r = by_id[f"r{i}"]
        assert r["outcome"] == "partial" and len(r["turns"]) == 1 and r["turns"][0]["outcome"] == "finished"
        assert r["stopped"]["turn"] == 1 and r["stopped"]["error"]["class"] == "permanent"
    assert all(by_id[f"r{i}"]["outcome"] == "finished" for i in range(10) if i not in (2, 5, 8))

    proc = export(env, "--rows", "conversation", "--run", "part", "-o", str(tmp_path / "d.jsonl"), "--json", check=False)
    s = orjson.loads(proc.stdout)
    assert (s["complete"], s["partial"], s["cut"], s["failed"], s["missing"]) == (7, 3, 0, 0, 0)
    assert (s["exported"], s["truncated"], s["truncated_by_outcome"]) == (7, 3, {"partial": 3})
    assert proc.returncode == 1 and "3 are partial" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert [r["id"] for r in lines(tmp_path / "d.jsonl")] == [f"r{i}" for i in range(10) if i not in (2, 5, 8)]
    cut = lines(tmp_path / "d.truncated.jsonl")
    assert [(r["id"], r["outcome"]) for r in cut] == [("r2", "partial"), ("r5", "partial"), ("r8", "partial")]
    table = export(env, "--rows", "conversation", "--run", "part", "-o", str(tmp_path / "t.jsonl"), "--max-failed", "3").stdout
    assert "complete" in table and "partial" in table
    # opted in, they are in the dataset, and still count against --max-failed
    opt = export(env, "--run", "part", "-o", str(tmp_path / "o.jsonl"), "--include-outcomes", "finished,partial",
                 "--max-failed", "3", "--format", "batch", "--json")
    assert orjson.loads(opt.stdout)["exported"] == 10
    rows = {r["custom_id"]: r for r in lines(tmp_path / "o.jsonl")}
    assert rows["r2"]["outcome"] == "partial" and rows["r2"]["stopped"]["error"]["class"] == "permanent"


def test_records_written_before_partial_existed_export_as_partial(tmp_path: Path, conn: redis.Redis,
                                                                  redis_url: str) -> None:
    out = tmp_path / "out"
    RunStore(conn).create_or_check(RUN, RunSettings(output=str(out)))
    old = [_answer(0, "finished"), _answer(1, "finished"), _answer(2, "finished")]
    old[1]["stopped"] = {"turn": 1, "reason": "error", "error": {"class": "transient_exhausted"}}
    old[2]["stopped"] = {"turn": 1, "reason": "cut_in_answer", "dropped": True}
    ItemTable(conn, RUN).change([bytes.fromhex(r["key"]) for r in old], add=IN_RUN)
    _shard(out, RUN, "w-000001.jsonl", old)
    s = orjson.loads(export({"REDIS_URL": redis_url}, "--run", RUN, "-o", str(tmp_path / "d.jsonl"), "--json",
                            "--allow-partial").stdout)
    assert (s["complete"], s["partial"], s["exported"]) == (1, 2, 1)
    assert [r["outcome"] for r in lines(tmp_path / "d.truncated.jsonl")] == ["partial", "partial"]


# --- nothing fabricated ----------------------------------------------------------------------
RUN = "cuts"


def _key(i: int) -> str:
    return hashlib.blake2b(str(i).encode(), digest_size=16).hexdigest()


def _answer(i: int, outcome: str, *, attempt: int = 1, content: str | None = None) -> dict[str, Any]:
    unclosed = outcome in ("cut_in_thinking", "no_answer")
    return {"key": _key(i), "index": i, "turn": None, "run": RUN, "id": f"q{i}", "source": "in.jsonl",
            "source_seq": 0, "messages": [{"role": "user", "content": f"question {i}"}],
            "content": ("" if unclosed else f"answer {i}") if content is None else content,
            "reasoning": f"thinking {i}", "reasoning_form": "field", "tool_calls": [],
            "finish_reason": "length" if outcome.startswith("cut") else "stop", "outcome": outcome,
            "usage": {"prompt_tokens": 3, "completion_tokens": 5}, "model": "m", "fingerprint": "fp",
            "attempt": attempt, "timings": {"finished_at": 10.0 + i}}


def _shard(out: Path, run: str, name: str, recs: list[dict[str, Any]]) -> None:
    d = out / run / "shards"
    d.mkdir(parents=True, exist_ok=True)
    data = b"".join(orjson.dumps(r) + b"\n" for r in recs)
    (d / name).write_bytes(data)
    (d / name.replace(".jsonl", ".manifest.json")).write_bytes(orjson.dumps(
        {"run": run, "shard": name, "records": len(recs), "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}))


@pytest.fixture
def cut_run(tmp_path: Path, conn: redis.Redis) -> Path:
    """Five items: 0 finished, 1 cut in its thinking, 2 no answer, 3 cut while answering, 4 cut
    in its thinking once and finished on a later attempt."""
    out = tmp_path / "out"
    RunStore(conn).create_or_check(RUN, RunSettings(output=str(out)))
    ItemTable(conn, RUN).change([bytes.fromhex(_key(i)) for i in range(5)], add=IN_RUN)
    _shard(out, RUN, "w-000001.jsonl", [_answer(0, "finished"), _answer(1, "cut_in_thinking"),
                                        _answer(2, "no_answer"), _answer(3, "cut_in_answer", content="answer 3 is"),
                                        _answer(4, "cut_in_thinking")])
    _shard(out, RUN, "w-000002.jsonl", [_answer(4, "finished", attempt=2)])
    return tmp_path


def test_cut_in_thinking_stays_out_of_the_dataset_by_default(cut_run: Path, redis_url: str) -> None:
    env = {"REDIS_URL": redis_url}
    proc = export(env, "--rows", "conversation", "--run", RUN, "-o", str(cut_run / "d.jsonl"), "--format", "sharegpt", "--json")
    s = orjson.loads(proc.stdout)
    assert (s["enqueued"], s["exported"], s["truncated"], s["failed"], s["missing"]) == (5, 2, 3, 0, 0)
    assert s["truncated_by_outcome"] == {"cut_in_answer": 1, "cut_in_thinking": 1, "no_answer": 1}
    assert (s["complete"], s["partial"], s["cut"]) == (2, 0, 3) and s["cut_by_outcome"] == s["truncated_by_outcome"]
    rows = lines(cut_run / "d.jsonl")
    # only complete answers by default: a cut one would teach a drafter to stop mid-sentence
    assert [(r["id"], r["outcome"]) for r in rows] == [("q0", "finished"), ("q4", "finished")]
    assert all(loaders.llamafactory_sharegpt(r) == [] for r in rows)
    cut = lines(cut_run / "d.truncated.jsonl")
    assert [(r["id"], r["outcome"]) for r in cut] == [("q1", "cut_in_thinking"), ("q2", "no_answer"),
                                                      ("q3", "cut_in_answer")]
    assert all("</think>" not in r["conversations"][-1]["value"] for r in cut[:2])  # never a close it did not write
    table = export(env, "--rows", "conversation", "--run", RUN, "-o", str(cut_run / "t.jsonl")).stdout
    assert "truncated" in table and "cut_in_thinking" in table and "t.truncated.jsonl" in table


def test_include_outcomes_puts_them_in_flagged(cut_run: Path, redis_url: str) -> None:
    env = {"REDIS_URL": redis_url}
    export(env, "--rows", "conversation", "--run", RUN, "-o", str(cut_run / "all.jsonl"), "--format", "sharegpt",
           "--include-outcomes", "finished,cut_in_answer,cut_in_thinking")
    rows = {r["id"]: r for r in lines(cut_run / "all.jsonl")}
    assert sorted(rows) == ["q0", "q1", "q3", "q4"] and rows["q1"]["outcome"] == "cut_in_thinking"
    assert rows["q1"]["conversations"][-1]["value"] == "<think>\nthinking 1"
    assert [r["id"] for r in lines(cut_run / "all.truncated.jsonl")] == ["q2"]
    only = export(env, "--rows", "conversation", "--run", RUN, "-o", str(cut_run / "f.jsonl"), "--include-outcomes", "finished", "--json")
    assert orjson.loads(only.stdout)["truncated"] == 3  # q1, q2 and q3; q4's finished copy wins
    bad = export(env, "--rows", "conversation", "--run", RUN, "-o", str(cut_run / "x.jsonl"), "--include-outcomes", "finished,done", check=False)
    assert bad.returncode == 2 and bad.stderr.strip().startswith("error: --include-outcomes") \
        and "Traceback" not in bad.stderr and len(bad.stderr.strip().splitlines()) == 1


# --- Parquet ---------------------------------------------------------------------------------
def test_parquet_streams_row_groups_and_reads_back_everywhere(tmp_path: Path, conn: redis.Redis, redis_url: str,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    run = "pq"
    out = tmp_path / "out"
    RunStore(conn).create_or_check(run, RunSettings(output=str(out)))
    n = 600
    recs = []
    for i in range(n):
        rec = _answer(i, "finished")
        rec["run"] = run
        if i % 7 == 0:  # some carry tools and a call, some a stop note
            rec["tools"] = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
            rec["tool_calls"] = [{"id": "call_0", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
        if i % 11 == 0:
            rec["stopped"] = {"turn": 1, "reason": "cut_in_answer"}
        if i % 3:  # speculative-decoding figures on two rows in three: `acceptance` there, absent (null) elsewhere
            rec["spec"] = {"k": 3, "steps": 4, "drafted": 12, "accepted": i % 13, "hist": [0, 0, 0, 4]}
        recs.append(rec)
    ItemTable(conn, run).change([bytes.fromhex(r["key"]) for r in recs], add=IN_RUN)
    _shard(out, run, "w-000001.jsonl", recs[::2])
    _shard(out, run, "w-000002.jsonl", recs[1::2])
    monkeypatch.setattr(export_parquet, "ROW_GROUP_BYTES", 16_000)  # many row groups from a small run
    runner = CliRunner()
    for fmt in ("openai", "sharegpt", "specforge"):
        for suffix in (".parquet", ".jsonl"):
            res = runner.invoke(export_command, ["--run", run, "-o", str(tmp_path / f"{fmt}{suffix}"), "--format", fmt,
                                                 "--json", "--rows", "conversation"], env={"REDIS_URL": redis_url}, catch_exceptions=False)
            assert res.exit_code == 0, res.output
        table = pq.read_table(tmp_path / f"{fmt}.parquet")
        assert pq.ParquetFile(tmp_path / f"{fmt}.parquet").num_row_groups > 3
        from_parquet = table.to_pylist()
        from_jsonl = lines(tmp_path / f"{fmt}.jsonl")
        assert len(from_parquet) == n and [r["index"] for r in from_parquet] == list(range(n))
        assert [("acceptance" in r) for r in from_jsonl] == [bool(i % 3) for i in range(n)]
        for p_row, j_row in zip(from_parquet, from_jsonl, strict=True):
            for name, value in j_row.items():  # every JSONL field is in the Parquet row
                if name in ("tools", "stopped") and not isinstance(value, str):
                    assert orjson.loads(p_row[name]) == value
                else:
                    assert _prune(p_row[name]) == value, (fmt, name)
    # --format parquet: the openai shape
    res = runner.invoke(export_command, ["--run", run, "-o", str(tmp_path / "p.parquet"), "--format", "parquet",
                                         "--rows", "conversation"],
                        env={"REDIS_URL": redis_url})
    assert res.exit_code == 0 and pq.read_table(tmp_path / "p.parquet").equals(pq.read_table(tmp_path / "openai.parquet"))
    import pandas as pd

    df = pd.read_parquet(tmp_path / "sharegpt.parquet")
    assert len(df) == n and list(df["id"][:2]) == ["q0", "q1"] and df["conversations"][0][0]["from"] == "human"
    import datasets  # the Hugging Face loader trainers use (a dev dependency)
    cache = str(tmp_path / "hf")
    ds = datasets.load_dataset("parquet", data_files=str(tmp_path / "specforge.parquet"), split="train", cache_dir=cache)
    assert ds.num_rows == n and ds[0]["conversations"][-1]["role"] == "assistant"
    # the JSONL shapes load as the tools load them: load_dataset("json", ...)
    for fmt in ("openai", "sharegpt", "specforge"):
        ds = datasets.load_dataset("json", data_files=str(tmp_path / f"{fmt}.jsonl"), split="train", cache_dir=cache)
        assert ds.num_rows == n and ds[0]["id"] == "q0"
        assert ds[0]["acceptance"] is None and ds[1]["acceptance"]["accepted"] == 1


def _prune(value: Any) -> Any:
    """A Parquet row's value without the nulls its fixed schema adds for absent fields."""
    if isinstance(value, dict):
        return {k: _prune(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_prune(v) for v in value]
    return value


# --- OpenAI Batch in, Batch out --------------------------------------------------------------
def test_batch_input_to_batch_output_keeps_custom_ids(tmp_path: Path, redis_url: str) -> None:
    env = {"REDIS_URL": redis_url}
    reqs = [{"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions",
             "body": {"model": "gpt-4o-mini", "max_tokens": 256,
                      "messages": [{"role": "system", "content": "Answer briefly."},
                                   {"role": "user", "content": f"Name a prime above {i * 10}."}]}} for i in range(12)]
    reqs.append({"custom_id": "req-too-long", "method": "POST", "url": "/v1/chat/completions",
                 "body": {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "word " * 9000}]}})
    reqs.append({"custom_id": "req-hot", "method": "POST", "url": "/v1/chat/completions",
                 "body": {"messages": [{"role": "user", "content": "hi"}], "temperature": 1.3}})
    reqs.append({"custom_id": "req-embed", "method": "POST", "url": "/v1/embeddings", "body": {"input": "hi"}})
    data = write_jsonl(tmp_path / "batch.jsonl", reqs)
    s = enqueue(env, data, "bt", "--output", str(tmp_path / "out"), "--multi-turn", "last")
    assert (s["enqueued"], s["rejected"], s["rejected_by_reason"]) == (13, 2, {"sampling_differs": 1,
                                                                               "unsupported_request": 1})
    rejects = lines(tmp_path / "batch.rejects.jsonl")
    assert "temperature=1.3, the run's is 0.6" in rejects[0]["detail"]
    generate(tmp_path, env, "bt", "--slots", "8", "--mean-tokens", "20", code=ExitCode.FAILED_ITEMS)
    proc = export(env, "--run", "bt", "-o", str(tmp_path / "bt.jsonl"), "--format", "batch", "--json",
                  "--max-failed", "1", "--include-outcomes", "all")
    s = orjson.loads(proc.stdout)
    assert (s["exported"], s["failed"], s["missing"]) == (12, 1, 0)
    out = lines(tmp_path / "bt.jsonl")
    assert [o["custom_id"] for o in out] == [f"req-{i}" for i in range(12)]
    for o in out:
        assert o["error"] is None and o["id"].startswith("batch_req_") and o["response"]["status_code"] == 200
        assert isinstance(o["response"]["request_id"], str)
        body = ChatCompletion.model_validate(o["response"]["body"])
        assert body.model == "sim-model" and body.choices[0].message.role == "assistant"
        assert body.choices[0].finish_reason in ("stop", "length") and body.usage is not None
        assert o["outcome"] in ("finished", "cut_in_answer", "cut_in_thinking", "no_answer") and o["fingerprint"]
    [err] = lines(tmp_path / "bt.errors.jsonl")
    assert err["custom_id"] == "req-too-long" and err["error"] is None and err["id"].startswith("batch_req_")
    assert err["response"]["status_code"] == 400
    assert "maximum context length" in err["response"]["body"]["error"]["message"]


# --- unique ids in every row ----------------------------------------------------------------
def test_each_mode_ids_are_unique_per_turn_in_every_format(tmp_path: Path, redis_url: str) -> None:
    """Mode each makes one item per user turn of a record, all with the record's id: every line
    gets its own (`<id>-t<turn>`), so a join on custom_id overwrites nothing."""
    env = {"REDIS_URL": redis_url}
    data = write_jsonl(tmp_path / "e.jsonl", [sharegpt(i, turns=1 + i % 3) for i in range(12)])
    s = enqueue(env, data, "each", "--output", str(tmp_path / "out"), "--multi-turn", "each")
    turns = [1 + i % 3 for i in range(12)]
    assert (s["enqueued"], s["items"]) == (12, sum(turns))  # records; items: one per user turn
    generate(tmp_path, env, "each", "--slots", "8", "--mean-tokens", "20")
    want = [f"r{i}-t{t}" for i in range(12) for t in range(turns[i])]
    for fmt, name in (("batch", "custom_id"), ("openai", "id"), ("sharegpt", "id"), ("specforge", "id")):
        out = tmp_path / f"each-{fmt}.jsonl"
        rows = ("--rows", "conversation") if fmt != "batch" else ()
        export(env, *rows, "--run", "each", "-o", str(out), "--format", fmt, "--include-outcomes", "all")
        ids = [r[name] for r in lines(out)]
        assert ids == want and len(set(ids)) == len(ids) == sum(turns), fmt
    batch = lines(tmp_path / "each-batch.jsonl")
    assert len({r["id"] for r in batch}) == len(batch)  # the Batch request ids too


# --- system prompts and tools survive every loader -------------------------------------------
TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]


def test_system_prompts_and_tools_survive_every_sharegpt_loader(tmp_path: Path, redis_url: str) -> None:
    """A stand-in run mixing system prompts and tools, exported as sharegpt with the
    LLaMA-Factory entry export writes beside it: every loader keeps every row, with its system
    prompt and its tools (the loaders' rules: tests/producer/export/loaders.py)."""
    env = {"REDIS_URL": redis_url}
    recs = [sharegpt(i, turns=1 + i % 2, system=f"Be brief, {i}." if i % 3 == 0 else None) for i in range(24)]
    for i in range(0, 24, 4):
        recs[i]["tools"] = orjson.dumps(TOOLS).decode()  # LLaMA-Factory's own input form
    data = write_jsonl(tmp_path / "st.jsonl", recs)
    enqueue(env, data, "st", "--output", str(tmp_path / "out"))
    generate(tmp_path, env, "st", "--slots", "8", "--mean-tokens", "20")
    s = orjson.loads(export(env, "--rows", "conversation", "--run", "st", "-o", str(tmp_path / "st.sg.jsonl"), "--format", "sharegpt",
                            "--include-outcomes", "all", "--json").stdout)
    info_path = tmp_path / "st.sg.dataset_info.json"
    assert s["dataset_info_path"] == str(info_path)
    info = orjson.loads(info_path.read_bytes())
    assert list(info) == ["st.sg"] and info["st.sg"]["file_name"] == "st.sg.jsonl"
    assert info["st.sg"]["columns"] == {"messages": "conversations", "tools": "tools"}
    import datasets  # the loaders read the file through `datasets`: every row has every column

    rows = list(datasets.load_dataset("json", data_files=str(tmp_path / "st.sg.jsonl"), split="train",
                                      cache_dir=str(tmp_path / "hf")))
    systems = {f"r{i}": f"Be brief, {i}." for i in range(24) if i % 3 == 0}
    tooled = {f"r{i}" for i in range(0, 24, 4)}
    assert len(rows) == 24 and len(systems) == 8 and len(tooled) == 6
    lf = [loaders.llamafactory_read(r, info["st.sg"]) for r in rows]
    assert all(loaders.llamafactory_sharegpt(r) == [] for r in rows)
    assert {r["id"]: sys_ for r, (sys_, _, _) in zip(rows, lf, strict=True) if sys_} == systems
    assert {r["id"] for r, (_, tools, _) in zip(rows, lf, strict=True) if tools} == tooled
    sf = [loaders.specforge_read(r) for r in rows]
    assert {r["id"]: sys_ for r, (sys_, _) in zip(rows, sf, strict=True) if sys_ != loaders.SPECFORGE_DEFAULT_SYSTEM} \
        == systems
    assert {r["id"] for r, (_, tools) in zip(rows, sf, strict=True) if tools == TOOLS} == tooled
    sp = [loaders.speculators_read(r) for r in rows]
    assert {r["id"] for r, (roles, _) in zip(rows, sp, strict=True) if roles[0] == "system"} == set(systems)
    assert all(roles.count("user") == roles.count("assistant") for roles, _ in sp)
    assert loaders.eagle3(rows) == []
    # a compressed export gets no entry: LLaMA-Factory cannot load it
    gz = orjson.loads(export(env, "--rows", "conversation", "--run", "st", "-o", str(tmp_path / "z.jsonl.gz"), "--format", "sharegpt",
                             "--include-outcomes", "all", "--json").stdout)
    assert gz["dataset_info_path"] == "" and not (tmp_path / "z.dataset_info.json").exists()


# --- several samples per prompt --------------------------------------------------------------
def test_samples_have_their_own_seeds_and_export_as_lines_or_groups(tmp_path: Path, redis_url: str) -> None:
    env = {"REDIS_URL": redis_url}
    data = write_jsonl(tmp_path / "s.jsonl", [sharegpt(i) for i in range(6)])
    out = ["--output", str(tmp_path / "out"), "--seed", "40"]
    first = enqueue(env, data, "smp", *out)  # one sample each, then grown to three
    grown = enqueue(env, data, "smp", "--samples", "3", *out)
    again = enqueue(env, data, "smp", "--samples", "3", *out)
    assert (first["items"], grown["items"], again["items"]) == (6, 12, 0)
    generate(tmp_path, env, "smp", "--slots", "8", "--mean-tokens", "30")
    records = read_results(tmp_path / "out", "smp")
    by_sample = {(r["index"], r.get("sample")): r for r in records}
    assert len(records) == 18
    for i in range(6):
        seeds = [by_sample[(i, k)]["sampling"]["seed"] for k in (1, 2)]
        assert seeds == [41, 42] and by_sample[(i, 1)]["seed"] == 41
        answers = {by_sample[(i, k)]["content"] for k in (None, 1, 2)}
        assert len(answers) == 3  # three draws, not one answer three times
    export(env, "--rows", "conversation", "--run", "smp", "-o", str(tmp_path / "n.jsonl"), "--include-outcomes", "all")
    rows = lines(tmp_path / "n.jsonl")
    assert [(r["index"], r.get("sample")) for r in rows] == [(i, k) for i in range(6) for k in (None, 1, 2)]
    assert [r["id"] for r in rows] == [f"r{i}{s}" for i in range(6) for s in ("", "-s1", "-s2")]  # unique
    export(env, "--rows", "conversation", "--run", "smp", "-o", str(tmp_path / "g.jsonl"), "--include-outcomes", "all", "--group-samples")
    groups = lines(tmp_path / "g.jsonl")
    assert [g["id"] for g in groups] == [f"r{i}" for i in range(6)]
    # sample 0 was enqueued before --samples: it has the plain key and no per-item seed
    assert [s.get("sample") for s in groups[0]["samples"]] == [None, 1, 2] and len(groups[0]["samples"]) == 3


# --- progress --------------------------------------------------------------------------------
def test_progress_bar_on_a_terminal_and_quiet_otherwise(cut_run: Path, redis_url: str) -> None:
    env = {**os.environ, "REDIS_URL": redis_url, "COLUMNS": "120"}
    quiet = export({"REDIS_URL": redis_url}, "--run", RUN, "-o", str(cut_run / "q.jsonl"))
    assert quiet.stderr == ""  # stderr is a pipe here: no bar
    master, slave = pty.openpty()
    proc = subprocess.Popen([str(BIN / "producer"), "export", "--run", RUN, "-o", str(cut_run / "tty.jsonl")],
                            env=env, stdout=subprocess.PIPE, stderr=slave)
    os.close(slave)
    seen = b""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        ready, _, _ = select.select([master], [], [], 0.5)
        if ready:
            try:
                chunk = os.read(master, 65536)
            except OSError:
                break
            if not chunk:
                break
            seen += chunk
        elif proc.poll() is not None:
            break
    proc.wait(30)
    os.close(master)
    assert proc.returncode == 0
    text = seen.decode(errors="replace")
    assert "reading 2 shards" in text and "6/6" in text  # records read of the manifests' total
    with_json = subprocess.run([str(BIN / "producer"), "export", "--run", RUN, "-o", str(cut_run / "j.jsonl"),
                                "--json"], env=env, capture_output=True, text=True, check=True)
    assert with_json.stderr == ""
