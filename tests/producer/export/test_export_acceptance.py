"""Export and the drafter (issue 33): each row's `acceptance`, `--weight-by-acceptance`,
`--keep-lowest-acceptance` and the card's acceptance tables, on hand-built shards (a real Redis;
the stand-in end to end is test_export_acceptance_e2e.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pyarrow.parquet as pq
import pytest
import redis
from click.testing import CliRunner, Result

from genqueue.common.keepers.items import IN_RUN, ItemTable
from genqueue.common.keepers.runs import RunStore
from genqueue.common.settings import RunSettings
from genqueue.producer.export.command import export_command
from genqueue.producer.export.formats import ExportFormat
from genqueue.producer.export.formats.batch import to_batch
from genqueue.producer.export.formats.lines import acceptance
from genqueue.producer.export.formats.openai import to_openai
from genqueue.producer.export.formats.spec import RowLayout
from genqueue.producer.export.formats.tokens import to_tokens
from genqueue.producer.export.genrows import record_rows
from genqueue.producer.export.stage import WEIGHT_COLUMN
from tests.conftest import cli
from tests.producer.export.test_export import RUN, key, read_jsonl, regenerated, success, write_shard

pytestmark = pytest.mark.integration


def spec(steps: int, accepted: int, k: int = 3) -> dict[str, Any]:
    return {"k": k, "steps": steps, "drafted": k * steps, "accepted": accepted, "hist": [0] * (k + 1)}


def with_spec(rec: dict[str, Any], steps: int, accepted: int) -> dict[str, Any]:
    rec["spec"] = spec(steps, accepted)
    return rec


# --- each row's acceptance (pure) -------------------------------------------------------------
def test_acceptance_is_the_counts_and_vllms_two_rates_and_absent_without_figures() -> None:
    assert acceptance([spec(10, 15)]) == {"rate": 0.5, "mean_length": 2.5, "steps": 10, "drafted": 30,
                                          "accepted": 15}
    assert acceptance([spec(10, 15), None, spec(5, 0)]) == {"rate": round(15 / 45, 4), "mean_length": 2.0,
                                                            "steps": 15, "drafted": 45, "accepted": 15}
    assert acceptance([None]) is None and acceptance([]) is None
    assert acceptance([spec(0, 0)]) is None  # nothing drafted: nothing to say, no null-filled object
    plain = success(1)
    assert "acceptance" not in to_openai(plain) and "acceptance" not in to_batch(plain)  # type: ignore[arg-type]


def test_a_conversation_row_sums_its_answers_and_each_generation_row_has_its_own() -> None:
    rec = regenerated(4)
    rec["turns"][0]["spec"], rec["turns"][1]["spec"] = spec(10, 27), spec(10, 3)
    rec["spec"] = spec(20, 30)  # the record's sum, as the consumer writes it
    conv = to_openai(rec)  # type: ignore[arg-type]
    assert conv["acceptance"] == {"rate": round(30 / 60, 4), "mean_length": 2.5, "steps": 20, "drafted": 60,
                                  "accepted": 30}
    for fmt in (ExportFormat.OPENAI, ExportFormat.SHAREGPT, ExportFormat.SPECFORGE):
        rows = record_rows(fmt, rec, layout=RowLayout.GENERATION,  # type: ignore[arg-type]
                           include=frozenset({"finished"}), conversation_line={}).included
        assert [r["acceptance"]["accepted"] for r in rows] == [27, 3], fmt
        assert [r["acceptance"]["rate"] for r in rows] == [0.9, 0.1]
    assert to_batch(rec)["acceptance"]["accepted"] == 3  # type: ignore[arg-type]  # the body's answer: the last
    rec["turns"][0]["token_ids"] = {"prompt": [1, 2], "completion": [3]}
    rec["turns"][1]["token_ids"] = {"prompt": [3, 4], "completion": [5], "prompt_shared": 2}
    tokens = to_tokens(rec)  # type: ignore[arg-type]
    assert [r["acceptance"]["accepted"] for r in tokens] == [27, 3]


# --- the export: selection by acceptance --------------------------------------------------------
#: Items 0-9: 0-4 from strong.jsonl at 80%, 5-9 from weak.jsonl at 10-50%; item 10 without figures.
RATES = {0: 24, 1: 24, 2: 24, 3: 24, 4: 24, 5: 3, 6: 6, 7: 9, 8: 12, 9: 15}


@pytest.fixture
def spec_run(tmp_path: Path, conn: redis.Redis) -> Path:
    out = tmp_path / "out"
    RunStore(conn).create_or_check(RUN, RunSettings(output=str(out)))
    ItemTable(conn, RUN).change([bytes.fromhex(key(i)) for i in range(11)], add=IN_RUN)
    recs = []
    for i, accepted in RATES.items():
        rec = with_spec(success(i), 10, accepted)
        rec["source"] = "strong.jsonl" if i < 5 else "weak.jsonl"
        recs.append(rec)
    plain = success(10)
    plain["source"] = "weak.jsonl"
    recs.append(plain)
    dup = with_spec(success(5, attempt=2), 10, 30)  # a later copy of item 5: not kept, not counted
    dup["source"] = "weak.jsonl"
    write_shard(out, "w1-000001.jsonl", recs)
    write_shard(out, "w2-000001.jsonl", [dup])
    return tmp_path


def export(tmp: Path, redis_url: str, *args: str) -> Result:
    return CliRunner().invoke(export_command, ["--run", RUN, *args], env={"REDIS_URL": redis_url},
                              catch_exceptions=False)


def summary(res: Result) -> dict[str, Any]:
    return orjson.loads(res.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def test_every_row_carries_its_acceptance_and_the_summary_tables_it_each_item_once(spec_run: Path,
                                                                                    redis_url: str) -> None:
    res = export(spec_run, redis_url, "-o", str(spec_run / "d.jsonl"), "--json")
    assert res.exit_code == 0, res.output
    rows = read_jsonl(spec_run / "d.jsonl")
    assert [r["index"] for r in rows] == list(range(11))
    assert [r.get("acceptance", {}).get("accepted") for r in rows] == [*RATES.values(), None]
    assert "acceptance" not in rows[10] and WEIGHT_COLUMN not in rows[0]
    s = summary(res)
    acc = s["acceptance"]
    assert acc["answers"] == 10 and acc["accepted"] == sum(RATES.values())  # the duplicate counted once
    by = {c["category"]: c for c in acc["by"]["source"]}
    assert by["strong.jsonl"]["rate"] == pytest.approx(0.8) and by["weak.jsonl"]["rate"] == pytest.approx(0.3)
    assert by["weak.jsonl"]["mean_length"] == pytest.approx(1 + 45 / 50)
    assert s["selection"] == {} and s["rows"] == 11
    card = (spec_run / "README.md").read_text()
    assert "### Speculative decoding: the drafter's acceptance" in card
    assert "| weak.jsonl | 5 | 30.0% | 1.90 |" in card and "| strong.jsonl | 5 | 80.0% | 3.40 |" in card
    assert "drafter weakest" not in card  # 5 answers a source: below SPEC_MIN_ANSWERS, no category named
    text = export(spec_run, redis_url, "-o", str(spec_run / "t.jsonl"), "--no-card").output
    assert "acceptance" in text and "strong.jsonl: 80.0%, mean length 3.40, 5 answers" in text


def test_keep_lowest_keeps_the_weakest_rows_and_counts_the_rest_apart_from_missing(spec_run: Path,
                                                                                    redis_url: str) -> None:
    res = export(spec_run, redis_url, "-o", str(spec_run / "low.jsonl"), "--keep-lowest-acceptance", "0.3",
                 "--json")
    assert res.exit_code == 0, res.output
    rows = read_jsonl(spec_run / "low.jsonl")
    assert [r["index"] for r in rows] == [5, 6, 7]  # ceil(0.3 x 10) lowest, in dataset order
    s = summary(res)
    assert (s["missing"], s["exported"], s["rows"]) == (0, 3, 3)  # what was exported: the rows kept, their items
    sel = s["selection"]
    assert {k: sel[k] for k in ("rows_in", "rows_with_figures", "rows_kept", "rows_left_out", "rate_min",
                                "rate_max", "keep_lowest_acceptance", "weight_by_acceptance")} == {
        "rows_in": 11, "rows_with_figures": 10, "rows_kept": 3, "rows_left_out": 8, "rate_min": 0.1,
        "rate_max": 0.3, "keep_lowest_acceptance": 0.3, "weight_by_acceptance": False}
    assert sel["by_source"] == {"strong.jsonl": {"rows": 5, "with_figures": 5, "kept": 0},
                                "weak.jsonl": {"rows": 6, "with_figures": 5, "kept": 3}}
    assert WEIGHT_COLUMN not in rows[0]
    text = export(spec_run, redis_url, "-o", str(spec_run / "low2.jsonl"), "--keep-lowest-acceptance", "0.3",
                  "--no-card").output
    assert "selection" in text and "8 left out (not missing: their items are covered)" in text
    assert "weak.jsonl: 3 of 6 rows kept" in text
    # ties at the threshold are kept in dataset order: 0.5 keeps the five weak rows exactly
    res = export(spec_run, redis_url, "-o", str(spec_run / "half.jsonl"), "--keep-lowest-acceptance", "0.6",
                 "--json", "--no-card")
    assert [r["index"] for r in read_jsonl(spec_run / "half.jsonl")] == [0, 5, 6, 7, 8, 9]


def test_weights_are_higher_where_acceptance_is_lower_in_jsonl_and_parquet(spec_run: Path, redis_url: str) -> None:
    res = export(spec_run, redis_url, "-o", str(spec_run / "w.jsonl"), "--weight-by-acceptance", "--json")
    assert res.exit_code == 0, res.output
    rows = read_jsonl(spec_run / "w.jsonl")
    w = {r["index"]: r[WEIGHT_COLUMN] for r in rows}
    assert len(rows) == 11 and w[10] == 1.0
    assert w[5] > w[6] > w[7] > w[8] > w[9] > w[0] == w[4]
    assert sum(w[i] for i in RATES) / len(RATES) == pytest.approx(1.0, abs=1e-3)
    assert all(m.get("weight") in (None, 0, 1) for r in rows for m in r["messages"])  # the turns' own, untouched
    sel = summary(res)["selection"]
    assert sel["rows_kept"] == 11 and sel["weight_column"] == WEIGHT_COLUMN
    # both options: weights average 1 over the rows kept; Parquet has the column
    res = export(spec_run, redis_url, "-o", str(spec_run / "w.parquet"), "--weight-by-acceptance",
                 "--keep-lowest-acceptance", "0.5", "--json", "--no-card")
    assert res.exit_code == 0, res.output
    table = pq.read_table(spec_run / "w.parquet").to_pylist()
    assert [r["index"] for r in table] == [5, 6, 7, 8, 9]
    assert sum(r[WEIGHT_COLUMN] for r in table) / 5 == pytest.approx(1.0, abs=1e-3)
    assert table[0]["acceptance"] == {"rate": 0.1, "mean_length": 1.3, "steps": 10, "drafted": 30, "accepted": 3}


def test_group_samples_with_selection_groups_what_is_kept(tmp_path: Path, conn: redis.Redis, redis_url: str) -> None:
    out = tmp_path / "out"
    RunStore(conn).create_or_check(RUN, RunSettings(output=str(out)))
    recs = []
    for i in range(3):
        for sample in range(2):
            rec = with_spec(success(i), 10, 3 + 10 * sample)
            rec["key"] = f"{i:016x}{sample:016x}"
            rec["sample"] = sample
            recs.append(rec)
    ItemTable(conn, RUN).change([bytes.fromhex(r["key"]) for r in recs], add=IN_RUN)
    write_shard(out, "w1-000001.jsonl", recs)
    res = export(tmp_path, redis_url, "-o", str(tmp_path / "g.jsonl"), "--group-samples", "--rows", "conversation",
                 "--weight-by-acceptance",
                 "--keep-lowest-acceptance", "0.5", "--json", "--no-card")
    assert res.exit_code == 0, res.output
    lines = read_jsonl(tmp_path / "g.jsonl")
    assert [len(g["samples"]) for g in lines] == [1, 1, 1] and summary(res)["groups"] == 3
    assert all(g["samples"][0]["sample"] == 0 and WEIGHT_COLUMN in g["samples"][0] for g in lines)


@pytest.mark.parametrize("share", ["0", "1.5", "-1", "half", "nan"])
def test_a_bad_share_is_one_line_and_exit_2(spec_run: Path, redis_url: str, share: str) -> None:
    proc = cli("producer", "export", "--run", RUN, "-o", str(spec_run / "x.jsonl"), "--keep-lowest-acceptance",
               share, env={"REDIS_URL": redis_url}, check=False)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().count("\n") == 0 and "--keep-lowest-acceptance takes a share in (0, 1]" in proc.stderr
    assert not (spec_run / "x.jsonl").exists()


def test_a_run_without_figures_exports_as_before_and_refuses_selection(tmp_path: Path, conn: redis.Redis,
                                                                        redis_url: str) -> None:
    out = tmp_path / "out"
    RunStore(conn).create_or_check(RUN, RunSettings(output=str(out)))
    ItemTable(conn, RUN).change([bytes.fromhex(key(i)) for i in range(3)], add=IN_RUN)
    write_shard(out, "w1-000001.jsonl", [success(i) for i in range(3)])
    res = export(tmp_path, redis_url, "-o", str(tmp_path / "d.jsonl"), "--json")
    assert res.exit_code == 0
    assert not any("acceptance" in r for r in read_jsonl(tmp_path / "d.jsonl"))
    s = summary(res)
    assert s["acceptance"] == {} and s["selection"] == {}
    assert "Speculative decoding" not in (tmp_path / "README.md").read_text()
    assert "acceptance" not in export(tmp_path, redis_url, "-o", str(tmp_path / "e.jsonl"), "--no-card").output
    for opts in (["--keep-lowest-acceptance", "0.5"], ["--weight-by-acceptance"]):
        proc = cli("producer", "export", "--run", RUN, "-o", str(tmp_path / "sel.jsonl"), *opts,
                   env={"REDIS_URL": redis_url}, check=False)
        assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0, proc.stderr
        assert f"{opts[0]}: no record of run {RUN} carries speculative-decoding figures" in proc.stderr
        assert "--per-request-spec-decode-metrics" in proc.stderr
        assert not (tmp_path / "sel.jsonl").exists() and not list(tmp_path.glob(".gq-export-*"))


def test_the_summary_lists_turns_and_lengths_in_their_own_order() -> None:
    from genqueue.common.acceptance import AcceptanceTable, Answer
    from genqueue.producer.export.reduce import acceptance_summary

    table = AcceptanceTable()
    for turn, length in (("4+", "4k+"), ("10", "<256"), ("2", "256-1k"), ("1", "1k-4k"), ("-", "<256")):
        table.add(Answer("s", "-", turn, length, spec(10, 5)))  # type: ignore[arg-type]
    by = acceptance_summary(table)["by"]
    assert [c["category"] for c in by["length"]] == ["<256", "256-1k", "1k-4k", "4k+"]  # type: ignore[index]
    assert [c["category"] for c in by["turn"]] == ["1", "2", "4+", "10", "-"]  # type: ignore[index]
    assert acceptance_summary(AcceptanceTable()) == {}
