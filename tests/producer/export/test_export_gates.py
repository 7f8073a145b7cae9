"""`producer export`'s quality gates and --only-target-turns on planted shards: what each gate
counts, what --drop-flagged keeps out and where it goes, duplicates across partitions."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest
import redis

from genqueue.common.keepers.items import IN_RUN, ItemTable
from genqueue.common.keepers.runs import RunStore
from genqueue.common.settings import RunSettings
from genqueue.producer.export.core import Exporter
from genqueue.producer.export.formats import ExportFormat
from genqueue.producer.export.plan import ExportPlan
from genqueue.producer.export.sources import source_for
from tests.producer.export.test_export import RUN, key, read_jsonl, run_export, success, write_shard

pytestmark = pytest.mark.integration

LOOP = "Let me think about the cache and the batch. " * 3 + "I think " * 300


def planted() -> list[dict[str, Any]]:
    """Items 0-8: 0, 5 and 7 clean; 1 a thinking tag in the content; 2 empty; 3 ends in a loop;
    4 the same text as 0; 6 the same text as 1 (two reasons); 8 cut by max_tokens (not in the
    dataset, so not gated); 7 delivered twice (one item, not a duplicate answer)."""
    recs = [success(i) for i in range(9)]
    recs[1]["content"] = "<think>\nstill thinking</think>\n\nIt is 4."
    recs[2]["content"] = "   "
    recs[3]["content"] = LOOP
    recs[4]["content"], recs[4]["reasoning"] = recs[0]["content"], recs[0]["reasoning"]
    recs[6]["content"], recs[6]["reasoning"] = recs[1]["content"], recs[1]["reasoning"]
    recs[8].update(content="", outcome="cut_in_answer", finish_reason="length")
    return recs


@pytest.fixture
def gated(tmp_path: Path, conn: redis.Redis) -> Path:
    out = tmp_path / "out"
    RunStore(conn).create_or_check(RUN, RunSettings(output=str(out)))
    RunStore(conn).record_source(RUN, "data.jsonl", {"records": 9})
    ItemTable(conn, RUN).change([bytes.fromhex(key(i)) for i in range(9)], add=IN_RUN)
    recs = planted()
    write_shard(out, "w1-000001.jsonl", recs[:5])
    write_shard(out, "w2-000001.jsonl", [*recs[5:], success(7, attempt=2)])
    return tmp_path


def summary(res: Any) -> dict[str, Any]:
    return orjson.loads(res.stdout.strip().splitlines()[-1])


EXPECTED = {"thinking_marker": 2, "empty_answer": 1, "repetition_loop": 1, "duplicate_answer": 2}


def test_gates_count_per_reason_and_keep_the_rows_by_default(gated: Path, redis_url: str) -> None:
    res = run_export(gated, redis_url, "-o", str(gated / "ds.jsonl"), "--json")
    assert res.exit_code == 0, res.output
    s = summary(res)
    assert s["flagged"] == 5 and s["flagged_by_reason"] == EXPECTED
    assert s["flagged_dropped"] == 0 and s["flagged_path"] == ""
    assert s["exported"] == 8 and s["truncated"] == 1 and s["duplicates_removed"] == 1 and s["original_turns"] == 0
    assert [r["index"] for r in read_jsonl(gated / "ds.jsonl")] == list(range(8))
    assert not (gated / "ds.flagged.jsonl").exists()
    text = run_export(gated, redis_url, "-o", str(gated / "ds2.jsonl")).output
    assert any(line.split()[:2] == ["flagged", "5"] and line.endswith("keeps them out)") for line in text.splitlines())
    for reason, n in EXPECTED.items():
        assert f"  {reason}" in text and any(line.split() == [reason, str(n)] for line in text.splitlines())


def test_drop_flagged_moves_them_to_the_flagged_file_with_their_reasons(gated: Path, redis_url: str) -> None:
    res = run_export(gated, redis_url, "-o", str(gated / "ds.jsonl"), "--drop-flagged", "--json")
    assert res.exit_code == 0, res.output
    s = summary(res)
    assert s["flagged"] == 5 and s["flagged_dropped"] == 5 and s["exported"] == 3
    assert s["flagged_path"] == str(gated / "ds.flagged.jsonl")
    assert [r["index"] for r in read_jsonl(gated / "ds.jsonl")] == [0, 5, 7]
    flagged = read_jsonl(gated / "ds.flagged.jsonl")
    assert [(r["index"], r["flags"]) for r in flagged] == [
        (1, ["thinking_marker"]), (2, ["empty_answer"]), (3, ["repetition_loop"]), (4, ["duplicate_answer"]),
        (6, ["thinking_marker", "duplicate_answer"])]
    assert flagged[0]["messages"][-1]["content"].startswith("<think>")  # the row as the dataset had it
    assert [r["index"] for r in read_jsonl(gated / "ds.truncated.jsonl")] == [8]
    # --flagged names the file; it must differ from the others
    res = run_export(gated, redis_url, "-o", str(gated / "p.parquet"), "--drop-flagged",
                     "--flagged", str(gated / "kept-out.jsonl"), "--json")
    assert res.exit_code == 0, res.output
    assert len(read_jsonl(gated / "kept-out.jsonl")) == 5
    import pyarrow.parquet as pq

    assert pq.read_table(gated / "p.parquet").column("index").to_pylist() == [0, 5, 7]
    res = run_export(gated, redis_url, "-o", str(gated / "x.jsonl"), "--drop-flagged",
                     "--flagged", str(gated / "x.errors.jsonl"))
    assert res.exit_code == 2 and "must be different files" in res.output


def test_duplicates_are_found_across_partitions_and_the_first_in_order_is_kept(
        gated: Path, conn: redis.Redis) -> None:
    plan = ExportPlan(fmt=ExportFormat.OPENAI, output=gated / "small.jsonl", errors_path=gated / "small.e",
                      missing_path=gated / "small.m", workdir=gated, partition_bytes=400, drop_flagged=True)
    ex = Exporter(conn, RUN, source_for(str(gated / "out"), RUN), plan)
    r = ex.export()
    assert r.flagged_by_reason == EXPECTED and r.exported == 3
    assert [x["index"] for x in read_jsonl(gated / "small.flagged.jsonl")] == [1, 2, 3, 4, 6]


@pytest.fixture
def each_run(tmp_path: Path, conn: redis.Redis) -> Path:
    """Mode each on two user turns: turn 0 has no history answer, turn 1 has the input's own."""
    out = tmp_path / "out"
    RunStore(conn).create_or_check(RUN, RunSettings(output=str(out), multi_turn="each"))
    RunStore(conn).record_source(RUN, "data.jsonl", {"records": 1})
    first, second = success(0, turn=0), success(0, turn=1)
    first["messages"] = [{"role": "user", "content": "u0"}]
    second["messages"] = [{"role": "user", "content": "u0"}, {"role": "assistant", "content": "the input's a0"},
                          {"role": "user", "content": "u1"}]
    ItemTable(conn, RUN).change([bytes.fromhex(key(0, 0)), bytes.fromhex(key(0, 1))], add=IN_RUN)
    write_shard(out, "w1-000001.jsonl", [first, second])
    return tmp_path


def test_each_rows_say_which_turn_is_the_targets_and_only_target_turns_keeps_the_others_out(
        each_run: Path, redis_url: str) -> None:
    res = run_export(each_run, redis_url, "-o", str(each_run / "sf.jsonl"), "--format", "specforge", "--json")
    assert res.exit_code == 0, res.output
    rows = read_jsonl(each_run / "sf.jsonl")
    assert [[t.get("generated_by_target") for t in r["conversations"]] for r in rows] == [
        [None, True], [None, False, None, True]]
    assert summary(res)["flagged"] == 0 and summary(res)["original_turns"] == 1
    text = run_export(each_run, redis_url, "-o", str(each_run / "t.jsonl")).output
    assert any(line.split()[:4] == ["original", "turns", "1", "(rows"] for line in text.splitlines())
    res = run_export(each_run, redis_url, "-o", str(each_run / "only.jsonl"), "--format", "specforge",
                     "--only-target-turns", "--json")
    assert res.exit_code == 0, res.output
    s = summary(res)
    assert s["flagged_by_reason"] == {"original_turns": 1} and s["exported"] == 1 and s["original_turns"] == 1
    assert [r["turn"] for r in read_jsonl(each_run / "only.jsonl")] == [0]
    assert [(r["turn"], r["flags"]) for r in read_jsonl(each_run / "only.flagged.jsonl")] == [(1, ["original_turns"])]
    res = run_export(each_run, redis_url, "-o", str(each_run / "sg.jsonl"), "--format", "sharegpt", "--json")
    assert [r["target_turns"] for r in read_jsonl(each_run / "sg.jsonl")] == [[1], [3]]


# --- the bundled sample, as scripts/demo runs it ---------------------------------------------
SAMPLE = Path(__file__).resolve().parents[3] / "samples" / "sample.jsonl"
#: The stand-in writes ordinary text: no gate fires on it, in whichever form the server puts
#: the thinking (inline: `<think>` in the content, which the consumer splits off).
SAMPLE_FLAGS: dict[str, int] = {}


@pytest.mark.parametrize("reasoning", ["field", "inline"])
def test_gate_counts_on_the_bundled_sample(tmp_path: Path, redis_url: str, reasoning: str) -> None:
    """samples/sample.jsonl through the stand-in as scripts/demo runs it (--max-tokens 512,
    --mean-tokens 120, the thinking as a field, the stand-in's default), and with the thinking
    inline in the content: the counts are the ones docs/export.md states (none), on every row
    of the dataset (the rows are there)."""
    from tests.producer.export.test_export_datasets import enqueue, export, generate

    env = {"REDIS_URL": redis_url}
    sample = tmp_path / "sample.jsonl"
    sample.write_bytes(SAMPLE.read_bytes())
    enqueue(env, sample, "demo", "--output", str(tmp_path / "out"), "--max-tokens", "512")
    generate(tmp_path, env, "demo", "--slots", "64", "--mean-tokens", "120", "--reasoning", reasoning)
    s = orjson.loads(export(env, "--run", "demo", "-o", str(tmp_path / "demo.jsonl"), "--json",
                            check=False).stdout)
    assert s["exported"] > 200 and s["flagged_by_reason"] == SAMPLE_FLAGS and s["flagged"] == sum(SAMPLE_FLAGS.values())
