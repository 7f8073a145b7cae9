"""`--token-ids` end to end and `producer export --format tokens`: real producer, consumer and
export processes, the stand-in vLLM over HTTP, real Redis. Rows in = rows out, `input_ids` =
the engine's prompt ids + its completion ids, `loss_mask` 1 on exactly the completion; a run or
a record without ids is refused in one line; a server that returns none fails the pre-flight."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import datasets
import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import redis

from genqueue.common.keepers.items import IN_RUN, ItemTable
from genqueue.common.keepers.runs import RunStore
from genqueue.common.settings import RunSettings
from genqueue.consumer.sim.text import decode_ids, prompt_token_ids
from genqueue.producer.export.formats.tokens import NoTokenIdsError, to_tokens
from tests.conftest import cli, sharegpt, write_jsonl
from tests.consumer.e2e import Proc, Sim, read_results

pytestmark = pytest.mark.integration

N, TURNS, SEED = 12, 3, 7


def speculators_kept(examples: dict[str, list[Any]], max_length: int = 8192) -> int:
    """How many rows speculators trains on, restated from vllm-project/speculators @
    04319940334981b98babb5db25d4143e63faeea9 src/speculators/data_generation/preprocessing.py:
    a batch with `input_ids` and `loss_mask` columns is pre-tokenized (_preprocess_batch) and
    passed through (_passthrough_pretokenized): a row whose lengths differ is a ValueError, one
    with no supervised token in the window is dropped (_append_row)."""
    assert "input_ids" in examples and "loss_mask" in examples, "not read as pre-tokenized rows"
    kept = 0
    for ids, mask in zip(examples["input_ids"], examples["loss_mask"], strict=True):
        if len(ids) != len(mask):
            raise ValueError(f"Pre-tokenized row shape mismatch: input_ids={len(ids)}, loss_mask={len(mask)}")
        kept += sum(mask[:max_length]) > 0
    return kept


def enqueue(tmp: Path, redis_url: str, run: str, *extra: str) -> None:
    data = write_jsonl(tmp / f"{run}.jsonl", [sharegpt(i, turns=TURNS, system="be brief") for i in range(N)])
    cli("producer", "enqueue", str(data), "--run", run, "--output", str(tmp / "out"), "--batch-size", "4",
        "--max-tokens", "400", "--rejects", str(tmp / f"{run}.rej"), *extra, env={"REDIS_URL": redis_url})


def consume(tmp: Path, redis_url: str, sim: Sim, run: str) -> tuple[int, str]:
    c = Proc("consumer", ["run", "--run", run, "--endpoint", sim.url, "--burst", "-c", "8", "--shard-max-age", "1",
                          "--spool", str(tmp / f"spool-{run}")], tmp / f"{run}.log", env={"REDIS_URL": redis_url})
    return c.wait(120), c.output()


def export(tmp: Path, redis_url: str, run: str, name: str, *extra: str) -> Any:
    return cli("producer", "export", "--run", run, "--output", str(tmp / name), "--format", "tokens", "--json",
               *extra, env={"REDIS_URL": redis_url}, check=False)


def test_token_ids_run_exports_one_exact_row_per_answer(tmp_path: Path, redis_url: str) -> None:
    sim = Sim(tmp_path, "--mean-tokens", "30", "--seed", str(SEED))
    try:
        enqueue(tmp_path, redis_url, "tok", "--token-ids")
        code, log = consume(tmp_path, redis_url, sim, "tok")
    finally:
        sim.stop()
    assert code == 0, log
    records = {r["key"]: r for r in read_results(tmp_path / "out", "tok")}
    assert len(records) == N and all(len(r["turns"]) == TURNS for r in records.values())
    answers = {(r["key"], t["turn"]): t for r in records.values() for t in r["turns"]}
    # what the stand-in rendered for each answer: the history before it, as it was sent
    rendered = {(r["key"], k): prompt_token_ids(SEED, r["messages"][: 2 + 2 * k])
                for r in records.values() for k in range(TURNS)}
    # the shards keep a conversation's history once: each later answer stores what follows
    # the ids it shares with the previous answer's prompt
    for r in records.values():
        first, *later = r["turns"]
        assert "prompt_shared" not in first["token_ids"]
        for k, t in enumerate(later, 1):
            shared = t["token_ids"]["prompt_shared"]
            assert shared > len(rendered[(r["key"], k - 1)]) - 8  # all but the generation prompt's ids
            assert len(t["token_ids"]["prompt"]) == len(rendered[(r["key"], k)]) - shared

    jsonl = export(tmp_path, redis_url, "tok", "tok.tokens.jsonl")
    assert jsonl.returncode == 0, jsonl.stderr
    assert orjson.loads(jsonl.stdout.splitlines()[-1])["exported"] == N
    rows = [orjson.loads(x) for x in (tmp_path / "tok.tokens.jsonl").read_bytes().splitlines()]
    assert len(rows) == N * TURNS == len(answers)  # rows in = rows out
    assert len({r["id"] for r in rows}) == len(rows)
    for row in rows:
        t = answers[(row["key"], row["turn"])]
        prompt, completion = rendered[(row["key"], row["turn"])], t["token_ids"]["completion"]
        assert row["input_ids"] == prompt + completion
        assert len(prompt) == t["usage"]["prompt_tokens"]
        assert len(row["loss_mask"]) == len(row["input_ids"])
        assert row["loss_mask"] == [0] * len(prompt) + [1] * len(completion)
        assert sum(row["loss_mask"]) == row["usage"]["completion_tokens"] == t["usage"]["completion_tokens"]
        said = decode_ids(row["input_ids"][len(prompt):])
        assert said == " ".join(x for x in (t["reasoning"], t["content"]) if x)

    parquet = export(tmp_path, redis_url, "tok", "tok.tokens.parquet")
    assert parquet.returncode == 0, parquet.stderr
    table = pq.read_table(tmp_path / "tok.tokens.parquet")
    assert table.num_rows == len(rows)
    assert table.column("input_ids").to_pylist() == [r["input_ids"] for r in rows]
    assert table.column("loss_mask").to_pylist() == [r["loss_mask"] for r in rows]
    assert pa.types.is_list(table.schema.field("input_ids").type)
    assert table.schema.field("input_ids").type.value_type == pa.int32()
    # read as speculators reads a dataset (Hugging Face datasets), every row is trained on
    for kind, path in (("json", "tok.tokens.jsonl"), ("parquet", "tok.tokens.parquet")):
        ds = datasets.load_dataset(kind, data_files=str(tmp_path / path), split="train",
                                   cache_dir=str(tmp_path / "hf-cache"))
        assert speculators_kept(ds[:]) == len(rows), kind


def test_a_run_without_token_ids_is_refused_in_one_line(tmp_path: Path, redis_url: str) -> None:
    enqueue(tmp_path, redis_url, "plain")
    res = export(tmp_path, redis_url, "plain", "plain.tokens.jsonl")
    assert res.returncode == 2
    assert res.stderr.strip().count("\n") == 0 and "--token-ids" in res.stderr and "Traceback" not in res.stderr
    assert not (tmp_path / "plain.tokens.jsonl").exists()


def test_a_server_without_ids_fails_the_preflight(tmp_path: Path, redis_url: str) -> None:
    sim = Sim(tmp_path, "--mean-tokens", "20", "--no-token-ids")
    try:
        enqueue(tmp_path, redis_url, "old", "--token-ids")
        code, log = consume(tmp_path, redis_url, sim, "old")
    finally:
        sim.stop()
    assert code == 4, log  # ExitCode.PREFLIGHT
    lines = [line for line in log.splitlines() if "pre-flight failed" in line]
    assert lines and "returned none to return_token_ids" in lines[0], log
    assert "Traceback" not in log
    assert read_results(tmp_path / "out", "old") == []


def test_a_record_without_ids_is_refused_never_retokenized() -> None:
    rec: dict[str, Any] = {"key": "a" * 32, "index": 0, "turn": 0, "id": "r0", "content": "x", "outcome": "finished",
                           "usage": {"completion_tokens": 2}, "token_ids": {"prompt": [1, 2, 3], "completion": [9, 8]}}
    (row,) = to_tokens(rec)  # type: ignore[arg-type]
    assert row["id"] == "r0-a0" and row["input_ids"] == [1, 2, 3, 9, 8] and row["loss_mask"] == [0, 0, 0, 1, 1]
    del rec["token_ids"]
    with pytest.raises(NoTokenIdsError, match="has no token ids"):
        to_tokens(rec)  # type: ignore[arg-type]


def test_a_record_without_ids_in_a_token_ids_run_stops_the_export_in_one_line(tmp_path: Path, redis_url: str,
                                                                              conn: redis.Redis) -> None:
    out = tmp_path / "out"
    RunStore(conn).create_or_check("mixed", RunSettings(output=str(out), token_ids=True))
    rows: list[dict[str, Any]] = [{"key": f"{i:032x}", "index": i, "turn": None, "run": "mixed", "content": "a",
                          "reasoning": None, "reasoning_form": "none", "tool_calls": [], "finish_reason": "stop",
                          "outcome": "finished", "usage": {"completion_tokens": 1}, "model": "m",
                          "fingerprint": "f", "attempt": 1, "messages": [{"role": "user", "content": "q"}]}
                         for i in range(2)]
    with_ids, without = rows
    with_ids["token_ids"] = {"prompt": [1, 2], "completion": [3]}
    ItemTable(conn, "mixed").change([bytes.fromhex(r["key"]) for r in (with_ids, without)], add=IN_RUN)
    shards = out / "mixed" / "shards"
    shards.mkdir(parents=True)
    (shards / "w-000001.jsonl").write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in (with_ids, without)))
    res = export(tmp_path, redis_url, "mixed", "mixed.tokens.jsonl")
    assert res.returncode == 2, res.stdout
    err = res.stderr.strip()
    assert "\n" not in err and "has no token ids" in err and without["key"] in err and "Traceback" not in err
    assert not (tmp_path / "mixed.tokens.jsonl").exists()


def test_text_and_token_rows_judge_each_answer_once_alike(tmp_path: Path, redis_url: str) -> None:
    """A conversation whose later answer was cut keeps its finished answers in the tokens file
    as in the text rows: the same ids in the dataset and in the truncated file, each with the
    same outcome, and the summaries and the cards count the same answers."""
    sim = Sim(tmp_path, "--mean-tokens", "40", "--seed", str(SEED))
    try:
        enqueue(tmp_path, redis_url, "cut", "--token-ids", "--max-tokens", "48")
        code, log = consume(tmp_path, redis_url, sim, "cut")
    finally:
        sim.stop()
    assert code == 0, log
    made: dict[str, tuple[dict[str, Any], dict[str, str], dict[str, str]]] = {}
    for fmt, name in (("openai", "cut.text.jsonl"), ("tokens", "cut.tokens.jsonl")):
        out = tmp_path / fmt
        out.mkdir()
        proc = cli("producer", "export", "--run", "cut", "--output", str(out / name), "--format", fmt, "--json",
                   "--allow-partial", env={"REDIS_URL": redis_url})
        summary = orjson.loads(proc.stdout.splitlines()[-1])
        kept = {r["id"]: r["outcome"] for r in map(orjson.loads, (out / name).read_bytes().splitlines())}
        cut = {r["id"]: r["outcome"] for r in map(orjson.loads, (out / name.replace(".jsonl", ".truncated.jsonl"))
                                                   .read_bytes().splitlines())}
        made[fmt] = summary, kept, cut
    (text, text_kept, text_cut), (tokens, tokens_kept, tokens_cut) = made["openai"], made["tokens"]
    # the case the rule is for: a finished answer before a cut one, in the same conversation
    assert any(rid.endswith("-a0") and rid[:-1] + "1" in text_cut for rid in text_kept), (text_kept, text_cut)
    assert tokens_kept == text_kept and tokens_cut == text_cut
    assert set(text_kept.values()) == {"finished"} and "finished" not in set(text_cut.values())
    assert tokens["rows"] == text["rows"] == len(text_kept)
    assert tokens["truncated_rows"] == text["truncated_rows"] == len(text_cut)
    assert tokens["card"]["generations"] == text["card"]["generations"] == len(text_kept)
