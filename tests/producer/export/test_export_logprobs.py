"""`producer export-logprobs`: a run's top-k tables joined by id to its tokens rows, read back.

The plain layout through `datasets` (as a trainer loads a folder) and pyarrow: rows in = rows
accepted, in order, every table at its generated token with the stored values exactly, and an
empty list at every other token. DistillKit's layout through this module's decoder (the same
format as DistillKit's torch code: tests/vllm/test_logprob_layouts.py reads it with DistillKit's
own loader): its labels select exactly the positions whose table is a stored one, and those
decode to the stored values within the config's quantisation. Rows without tables, with tables
of other tokens, and tables without rows are counted and named; refusals are one line."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import datasets
import numpy as np
import orjson
import pyarrow.parquet as pq
import pytest
import redis
import yaml

from genqueue.common.errors import UserError
from genqueue.common.features import FeatureShardWriter, LocalFeatureStore
from genqueue.common.features.logprobs import LogprobsManifest, LogprobsMode, LogprobsReader, LogprobsTable
from genqueue.common.keepers.runs import RunStore
from genqueue.common.settings import RunSettings
from genqueue.producer.export import distillkit as dk
from genqueue.producer.export.featurescmd import check_folder
from genqueue.producer.export.logprobrows import IGNORE, Layout, table_row_id
from genqueue.producer.export.logprobscmd import (
    CONFIG_FILE,
    ROWS_FILE,
    UNMATCHED_FILE,
    LogprobPlan,
    export_logprobs,
    mode_notes,
    plan_k,
)
from tests.conftest import cli
from tests.producer.export.logprobtables import VOCAB, MemorySource, run_of, tables_for, token_row, write_tokens

K = 20
#: exact values in bf16, no fit: each decoded log-probability within bf16's rounding of the stored
LOSSLESS_BF16 = {"d": VOCAB, "k": K, "exact_k": K, "exact_dtype": "bfloat16", "residual_bins": [],
                 "delta_encoding": False}
#: DistillKit's README "recommended" shape at this K: 8 exact in bf16, a fit of the rest
RECOMMENDED = {"d": VOCAB, "k": K, "exact_k": 8, "exact_dtype": "bfloat16", "polynomial_terms": [0, 1, 2, 3, 4, "sqrt"],
               "term_dtype": "float32", "residual_bins": [], "delta_encoding": False}


def export(tmp_path: Path, rows: list[dict[str, Any]], src: MemorySource, layout: Layout,
           config: dict[str, Any] | None = None, name: str = "out") -> Any:
    tokens = write_tokens(tmp_path / "tokens.jsonl", rows)
    cfg = dk.DistillKitConfig.from_mapping(config, where="test") if config else None
    plan = LogprobPlan("lp-run", layout, tmp_path / name, tokens, False, plan_k(layout, cfg, src.manifest), cfg)
    return export_logprobs(plan, src, "memory")


def with_faults(n: int) -> tuple[list[dict[str, Any]], MemorySource]:
    """N good rows, then one without tables, one whose tables are of other tokens, and tables no row names."""
    rows, src = run_of(n, K)
    rows.append(token_row("lost", 6, 5, seed=90))
    other = token_row("other", 6, 5, seed=91)
    rows.append(other)
    src.tables["other"] = tables_for([1, 2, 3, 4, 5], K, seed=92)
    src.tables["orphan"] = tables_for([7, 8], K, seed=93)
    return rows, src


def stored(src: MemorySource, row: dict[str, Any]) -> Any:
    return src.tables[row["key"]]


def test_plain_layout_reads_back_through_datasets_and_pyarrow(tmp_path: Path) -> None:
    rows, src = with_faults(5)
    r = export(tmp_path, rows, src, Layout.PLAIN)
    assert (r.rows_read, r.rows_exported, r.rows_without_tables, r.rows_tokens_differ, r.tables_without_rows) == \
        (7, 5, 1, 1, 2)  # "other" is named twice: its row's tokens differ, so its tables have no row
    good = rows[:5]
    assert r.tables_exported == sum(sum(x["loss_mask"]) for x in good)
    assert r.named == {"no_tables": ["lost-a0"], "tokens_differ": ["other-a0"], "no_row": ["orphan", "other"]}
    out = tmp_path / "out"
    ds = datasets.load_dataset(str(out), split="train")  # the folder, as a trainer names it
    table = pq.read_table(out / "data").to_pylist()
    assert len(ds) == len(table) == 5  # rows in = rows accepted
    assert ds["id"] == [x["id"] for x in good] == [orjson.loads(line)["id"] for line in
                                                  (out / ROWS_FILE).read_bytes().splitlines()]
    for got, theirs, row in zip(table, ds, good, strict=True):
        assert got["input_ids"] == theirs["input_ids"] == row["input_ids"]
        assert got["loss_mask"] == theirs["loss_mask"] == row["loss_mask"]
        t = stored(src, row)
        at = [p for p, m in enumerate(row["loss_mask"]) if m]
        # a table exactly at each loss-masked token, nothing elsewhere
        assert [len(x) > 0 for x in got["topk_ids"]] == [bool(m) for m in row["loss_mask"]]
        assert [len(x) for x in theirs["topk_logprobs"]] == [K if m else 0 for m in row["loss_mask"]]
        assert np.array_equal([got["topk_ids"][p] for p in at], t.topk_ids)
        assert np.array_equal(np.asarray([theirs["topk_logprobs"][p] for p in at], np.float32), t.topk_logprobs)
        assert [got["sampled_logprobs"][p] for p in at] == t.sampled_logprobs.tolist()
        assert all(got["sampled_logprobs"][p] is None for p, m in enumerate(row["loss_mask"]) if not m)
        # the table at token p is the one token p was sampled from: the sampled id is in it
        assert all(row["input_ids"][p] in got["topk_ids"][p] for p in at)
    lines = [orjson.loads(x) for x in (out / UNMATCHED_FILE).read_bytes().splitlines()]
    assert sorted((x["reason"], x.get("id") or x["table_row"]) for x in lines) == \
        [("no_row", "orphan"), ("no_row", "other"), ("no_tables", "lost-a0"), ("tokens_differ", "other-a0")]


@pytest.mark.parametrize(("config", "bound"), [(LOSSLESS_BF16, "bf16"), (RECOMMENDED, "fit")])
def test_distillkit_layout_labels_select_the_stored_tables(tmp_path: Path, config: dict[str, Any], bound: str) -> None:
    rows, src = with_faults(4)
    r = export(tmp_path, rows, src, Layout.DISTILLKIT, config)
    assert (r.rows_read, r.rows_exported, r.rows_without_tables, r.rows_tokens_differ) == (6, 4, 1, 1)
    out = tmp_path / "out"
    cfg = dk.DistillKitConfig.from_mapping(yaml.safe_load((out / CONFIG_FILE).read_text()), where="written")
    assert cfg == dk.DistillKitConfig.from_mapping(config, where="given")
    table = pq.read_table(out / "data")
    assert table.schema.names == ["input_ids", "labels", "compressed_logprobs", "bytepacked_indices"]
    assert len(datasets.load_dataset(str(out), split="train")) == table.num_rows == 4
    worst = 0.0
    for got, row in zip(table.to_pylist(), rows[:4], strict=True):
        ids, mask, n = row["input_ids"], row["loss_mask"], len(row["input_ids"])
        assert got["input_ids"] == ids and len(got["labels"]) == n
        assert len(got["compressed_logprobs"]) == len(got["bytepacked_indices"]) == n - 1  # vLLM's prompt_logprobs
        assert {len(x) for x in got["compressed_logprobs"]} == {cfg.logprob_bytes}
        assert {len(x) for x in got["bytepacked_indices"]} == {cfg.index_bytes}
        # DistillKit's KL mask (labels >= 0) at table j is exactly "token j + 1 was generated"
        assert [x >= 0 for x in got["labels"]] == [bool(m) for m in mask[1:]] + [False]
        assert all(x in (IGNORE, ids[j]) for j, x in enumerate(got["labels"]))
        dec_ids, dec_lp = dk.decode(cfg, np.asarray(got["compressed_logprobs"], np.uint8),
                                    np.asarray(got["bytepacked_indices"], np.uint8))
        t = stored(src, row)
        real = [j for j, x in enumerate(got["labels"]) if x >= 0]
        assert np.array_equal(dec_ids[real], t.topk_ids)
        err = np.abs(dec_lp[real] - t.topk_logprobs)
        if bound == "bf16":  # round to nearest: half an ulp of an 8-bit significand
            assert np.all(err <= np.abs(t.topk_logprobs) * 2.0**-8 + 1e-30)
        worst = max(worst, float(err.max()))
        # the prompt's placeholders: all mass on the next token
        for j in range(len(real) and real[0]):
            assert dec_ids[j][0] == ids[j + 1] and dec_lp[j][0] == 0 and dec_lp[j][1] <= -99
    assert r.max_error == pytest.approx(worst, abs=1e-6)
    assert r.max_error is not None and r.max_error < (0.05 if bound == "bf16" else 1.0)


def test_encoder_round_trips_every_kind_of_config() -> None:
    rng = np.random.default_rng(3)
    logits = rng.normal(size=(40, VOCAB)) * 3
    lp = (logits - np.log(np.exp(logits).sum(-1, keepdims=True))).astype(np.float32)
    ids = np.argsort(-lp, axis=-1)
    for raw in (LOSSLESS_BF16, RECOMMENDED,
                {"d": VOCAB, "k": 50, "exact_k": 1, "exact_dtype": "bfloat16", "polynomial_terms": [0, 1, 2, "sqrt"],
                 "residual_bins": [{"scale_dtype": "float16", "element_bits": 4, "num_elements": 24},
                                   {"scale_dtype": "bfloat16", "element_bits": 2, "num_elements": 25}],
                 "delta_encoding": True, "error_diffusion": True},
                {"d": VOCAB, "k": 20, "exact_k": 20, "exact_dtype": "float32", "residual_bins": [], "delta_encoding": False}):
        cfg = dk.DistillKitConfig.from_mapping(raw, where="t")
        sid, slp = dk.sort_tables(ids, np.take_along_axis(lp, ids, -1), cfg.k)
        packed, index = dk.encode(cfg, sid, slp)
        assert packed.shape == (40, cfg.logprob_bytes) and index.shape == (40, cfg.index_bytes)
        back_ids, back = dk.decode(cfg, packed, index)
        assert np.array_equal(back_ids, sid)
        if raw["exact_k"] == raw["k"] and raw["exact_dtype"] == "float32":
            assert np.array_equal(back, slp)  # float32 exact: lossless
        assert np.abs(back - slp).max() < 1.0


def test_refusals(tmp_path: Path) -> None:
    src = MemorySource(K)
    with pytest.raises(UserError, match="k = 64, the run stored top-20"):
        plan_k(Layout.DISTILLKIT, dk.DistillKitConfig.from_mapping({**RECOMMENDED, "k": 64}, where="x"), src.manifest)
    with pytest.raises(UserError, match="DistillKit's offline teacher reads log-probabilities"):
        plan_k(Layout.DISTILLKIT, dk.DistillKitConfig.from_mapping(RECOMMENDED, where="x"),
               MemorySource(K, mode="raw_logits").manifest)
    for bad, words in (({**RECOMMENDED, "topk": 3}, "topk is no field"), ({"k": 3, "exact_k": 3}, "d missing"),
                       ({**RECOMMENDED, "exact_k": 30}, "k must be >= exact_k"),
                       ({**RECOMMENDED, "polynomial_terms": []}, "needs polynomial_terms"),
                       ({**RECOMMENDED, "exact_dtype": "int8"}, "int8")):
        with pytest.raises(UserError, match=words):
            dk.DistillKitConfig.from_mapping(bad, where="cfg")
    rows, src = run_of(2, K)
    with pytest.raises(dk.VocabularyError, match=r"past the config's vocabulary \(d = 100\)"):
        export(tmp_path, rows, src, Layout.DISTILLKIT, {**LOSSLESS_BF16, "d": 100})
    assert not (tmp_path / "out").exists() and [p.name for p in tmp_path.iterdir()] == ["tokens.jsonl"]


def test_a_folder_genqueue_did_not_write_is_refused_and_its_own_replaced(tmp_path: Path) -> None:
    rows, src = run_of(3, K)
    export(tmp_path, rows, src, Layout.PLAIN)
    out = tmp_path / "out"
    check_folder(out)  # its own export: may be replaced
    export(tmp_path, rows, src, Layout.DISTILLKIT, LOSSLESS_BF16)
    assert (out / CONFIG_FILE).exists()
    (out / "data" / "notes.txt").write_text("mine")
    with pytest.raises(UserError, match="genqueue did not write"):
        check_folder(out)
    assert (out / "data" / "notes.txt").read_text() == "mine"


def test_cli_refusals_are_one_line(tmp_path: Path, conn: redis.Redis, redis_url: str) -> None:
    RunStore(conn).create_or_check("lp-run", RunSettings(output=str(tmp_path / "gq"), multi_turn="first"))
    tokens = write_tokens(tmp_path / "tokens.jsonl", run_of(1, K)[0])
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "keep.txt").write_text("x")
    cfg = tmp_path / "dk.yaml"
    cfg.write_text(yaml.safe_dump(LOSSLESS_BF16))
    badcfg = tmp_path / "bad.yaml"
    badcfg.write_text("k: [")
    base = ["export-logprobs", "--run", "lp-run", "--tokens", str(tokens), "-u", redis_url]
    for extra, words in ((["-o", str(mine), "--layout", "plain"], "genqueue did not write"),
                         (["-o", str(tmp_path / "a"), "--layout", "distillkit"], "needs --distillkit-config"),
                         (["-o", str(tmp_path / "b"), "--layout", "plain", "--distillkit-config", str(cfg)],
                          "is for --layout distillkit"),
                         (["-o", str(tmp_path / "c"), "--layout", "distillkit", "--distillkit-config", str(badcfg)],
                          "not YAML"),
                         (["-o", str(tmp_path / "d"), "--layout", "plain"], "has no log-probability tables"),
                         (["-o", str(tmp_path / "e"), "--layout", "plain", "--run", "nope"], "nope")):
        res = cli("producer", *base, *extra, check=False)
        assert res.returncode == 2, (extra, res.stdout, res.stderr)
        assert len(res.stderr.strip().splitlines()) == 1 and words in res.stderr, res.stderr
    assert sorted(p.name for p in mine.iterdir()) == ["keep.txt"]
    assert not any((tmp_path / x).exists() for x in "abcde")


def test_cli_exports_a_stored_run_and_exits_1_for_rows_without_tables(tmp_path: Path, conn: redis.Redis,
                                                                     redis_url: str) -> None:
    """The real store: tables written by the consumer's shard writer, read by LogprobsReader; one
    row's bytes flipped (unreadable), one row never stored (no tables)."""
    rows, fake = run_of(4, K)
    output = tmp_path / "gq"
    RunStore(conn).create_or_check("lp-run", RunSettings(output=str(output), multi_turn="first"))
    store = LocalFeatureStore(output)
    manifest = LogprobsManifest(model="tiny", k=K, mode=LogprobsMode.RAW_LOGPROBS, temperature=None,
                                genqueue_version="test")
    w = FeatureShardWriter(tmp_path / "spool", "lp-run", "w1", manifest)
    entries = {}
    for r in rows[:3]:
        t = fake.tables[r["key"]]
        entries[r["key"]] = w.append_table(r["key"], LogprobsTable.of(t.sampled_ids, t.sampled_logprobs, t.topk_ids,
                                                                      t.topk_logprobs))
    sealed = w.seal()
    assert sealed is not None
    store.put_manifest("lp-run", manifest)
    store.put_shard(sealed)
    shard = output / "lp-run" / "features" / sealed.name
    data = bytearray(shard.read_bytes())
    bad = entries[rows[2]["key"]]
    data[bad.offset + bad.length - 3] ^= 0xFF
    shard.write_bytes(bytes(data))
    tokens = write_tokens(tmp_path / "tokens.jsonl", rows)
    out = tmp_path / "lp"
    args = ["export-logprobs", "--run", "lp-run", "--tokens", str(tokens), "-o", str(out), "--layout", "plain",
            "-u", redis_url]
    res = cli("producer", *args, "--json", check=False)
    assert res.returncode == 1, res.stderr
    summary = orjson.loads(res.stdout)
    assert (summary["rows_read"], summary["rows_exported"], summary["rows_unreadable"],
            summary["rows_without_tables"]) == (4, 2, 1, 1)
    assert res.stderr.strip().splitlines()[-1].startswith("error: 2 of 4 tokens rows have no tables")
    kept = orjson.loads((out / "genqueue-logprobs.json").read_bytes())
    assert (kept["files"], kept["bytes"], kept["rows_exported"]) == (summary["files"], summary["bytes"], 2)
    assert summary["bytes"] == sum(p.stat().st_size for p in out.rglob("*") if p.is_file()
                                   and p.name not in (".genqueue-files.json", "genqueue-logprobs.json"))
    got = pq.read_table(out / "data").to_pylist()
    reader = LogprobsReader(store, "lp-run")
    for g, r in zip(got, rows[:2], strict=True):
        t = reader.row(r["key"])
        at = [p for p, m in enumerate(r["loss_mask"]) if m]
        assert np.array_equal(np.asarray([g["topk_logprobs"][p] for p in at], np.float32), t.topk_logprobs)
        assert np.array_equal([g["topk_ids"][p] for p in at], t.topk_ids)
    res = cli("producer", *args, "--allow-partial", check=False)  # over its own folder: replaced
    assert res.returncode == 0, res.stderr
    assert "without tables" in res.stdout and "item3-a0" in res.stdout and "item2-a0" in res.stdout


def test_a_row_naming_its_tables_is_joined_to_them_and_modes_are_said(tmp_path: Path) -> None:
    rows, src = run_of(2, K)
    src.tables["elsewhere"] = src.tables.pop(rows[1]["key"])
    rows[1]["logprobs"] = {"row": "elsewhere", "tokens": sum(rows[1]["loss_mask"]), "k": K, "dtype": "fp16"}
    r = export(tmp_path, rows, src, Layout.PLAIN)
    assert (r.rows_exported, r.tables_without_rows, r.notes) == (2, 0, [])
    assert table_row_id({"key": "a", "turn": 1}, regenerate=True) == "a:1"
    assert mode_notes(Layout.PLAIN, "raw_logits", None) == [
        "the tables are raw_logits (the engine's --logprobs-mode): topk_logprobs holds logits"]
    assert "temperature 0.7" in mode_notes(Layout.DISTILLKIT, "processed_logprobs", 0.7)[0]
    assert mode_notes(Layout.DISTILLKIT, "raw_logprobs", 0.7) == []
