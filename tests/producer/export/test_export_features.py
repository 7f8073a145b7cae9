"""`producer export-features`: a run's captured features joined by id to its tokens rows, in each
layout, read back: the generic layout through `datasets` and safetensors' own parser, speculators'
folder through `datasets` (its Arrow rows) and safetensors (its hs_{i} files); every row accepted,
its features equal to the stored ones (fp8 within its bound) and as long as its input_ids. Rows
without features and features without rows are counted and named. SpecForge's files and
speculators' own loader need torch: tests/vllm/test_feature_layouts.py reads them there."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import datasets
import ml_dtypes
import numpy as np
import orjson
import pytest
import redis
import safetensors

from genqueue.common.features import FP8_ERROR, FeatureDtype, LocalFeatureStore, unpack_row
from genqueue.common.features.codec import BF16_ERROR
from genqueue.common.keepers.runs import RunStore
from genqueue.common.settings import RunSettings
from genqueue.producer.export.featurelayouts import ARROW_FILE
from genqueue.producer.export.features import (
    UNMATCHED_FILE,
    FeatureIndex,
    FeatureLayout,
    feature_row_id,
)
from genqueue.producer.export.featurescmd import FeaturePlan, check_folder, export_features
from tests.conftest import cli
from tests.producer.export.featurestore import LAYERS, RUN, Made, features_of, make_run, token_rows


def export(made: Made, layout: FeatureLayout, out: Path) -> Any:
    index = FeatureIndex(LocalFeatureStore(made.output), RUN)
    plan = FeaturePlan(RUN, layout, out, made.tokens, False, None, None)
    return export_features(plan, index, str(made.output))


def within(decoded: np.ndarray, ids: list[int], dtype: FeatureDtype) -> bool:
    x = features_of(ids)
    scales = np.abs(x).max(axis=(1, 2)) / 448 if dtype is FeatureDtype.FP8_E4M3 else np.ones(len(ids))
    bound = FP8_ERROR if dtype is FeatureDtype.FP8_E4M3 else BF16_ERROR
    return decoded.shape == x.shape and bound.allows(x, decoded.astype(np.float32), scales.astype(np.float32))


@pytest.mark.parametrize("dtype", list(FeatureDtype))
def test_generic_layout_reads_back_through_datasets(tmp_path: Path, dtype: FeatureDtype) -> None:
    rows = token_rows(6)
    made = make_run(tmp_path, rows, dtype=dtype, full=frozenset({2}))
    out = tmp_path / "feat"
    r = export(made, FeatureLayout.GENERIC, out)
    assert (r.rows_read, r.rows_exported, r.rows_without_features, r.features_without_rows) == (6, 6, 0, 0)
    table = datasets.load_dataset("parquet", data_files=str(out / "rows.parquet"), split="train")
    assert table["id"] == [row["id"] for row in rows]  # rows in = rows accepted, in order
    shards = {p.name for p in (out / "features").glob("*.gqfeat")}
    assert len(shards) > 1 and set(table["shard"]) == shards
    for row, got in zip(rows, table, strict=True):
        n = len(row["input_ids"]) - (0 if row["id"] == "rec2-a0" else 1)  # a prefill pass covers every id
        assert got["tokens"] == n == len(got["input_ids"]) == len(got["loss_mask"])
        assert got["input_ids"] == row["input_ids"][:n] and got["loss_mask"] == row["loss_mask"][:n]
        assert (got["layers"], got["dtype"], got["feature_row"]) == (list(LAYERS), dtype.value, row["key"])
        with open(out / "features" / got["shard"], "rb") as fh:
            fh.seek(got["offset"])
            blob = fh.read(got["length"])
        tensors = dict(safetensors.deserialize(blob))  # a trainer without genqueue reads the range so
        assert np.frombuffer(tensors["token_ids"]["data"], dtype="<i8").tolist() == got["input_ids"]
        assert within(unpack_row(blob).features(), got["input_ids"], dtype)
    freq = json.loads((out / "token_freq.json").read_text())
    want: dict[str, int] = {}
    for got in table:
        for t, m in zip(got["input_ids"], got["loss_mask"], strict=True):
            if m:
                want[str(t)] = want.get(str(t), 0) + 1
    assert freq == want and r.token_freq_tokens == sum(want.values())


def test_speculators_layout_is_its_data_folder(tmp_path: Path) -> None:
    rows = token_rows(5)
    made = make_run(tmp_path, rows)
    out = tmp_path / "spec"
    r = export(made, FeatureLayout.SPECULATORS, out)
    assert r.rows_exported == 5 and r.notes  # token_freq.pt needs torch: said, not silently skipped
    ds = datasets.Dataset.from_file(str(out / ARROW_FILE))
    assert ds.column_names == ["id", "input_ids", "loss_mask", "seq_len"]
    state = json.loads((out / "state.json").read_text())
    assert state["_format_type"] == "torch" and state["_data_files"] == [{"filename": ARROW_FILE}]
    # the features and the files `datasets` itself writes for the same rows
    ref = datasets.Dataset.from_dict({c: ds[c] for c in ds.column_names}, features=ds.features)
    ref.save_to_disk(str(tmp_path / "ref"))
    assert json.loads((tmp_path / "ref" / "dataset_info.json").read_text()) == json.loads(
        (out / "dataset_info.json").read_text())
    for i, (row, got) in enumerate(zip(rows, ds, strict=True)):
        n = len(row["input_ids"]) - 1
        assert (got["id"], got["input_ids"], got["loss_mask"], got["seq_len"]) == (
            row["id"], row["input_ids"][:n], row["loss_mask"][:n], n)
        tensors = dict(safetensors.deserialize((out / "hidden_states" / f"hs_{i}.safetensors").read_bytes()))
        assert set(tensors) == {"hidden_states", "token_ids"}
        hs = tensors["hidden_states"]
        assert (hs["dtype"], hs["shape"]) == ("BF16", [n, len(LAYERS), 32])
        assert np.frombuffer(tensors["token_ids"]["data"], dtype="<i8").tolist() == got["input_ids"]
        decoded = np.frombuffer(hs["data"], dtype=ml_dtypes.bfloat16).reshape(hs["shape"]).astype(np.float32)
        stored = features_of(got["input_ids"])
        # fp8 within its bound, then rounded to bf16 (half a bf16 ulp more)
        assert np.all(np.abs(decoded - stored) <= np.abs(stored) * (1 / 17 + 2**-8) * 1.01 + 2**-10 * (
            np.abs(stored).max(axis=(1, 2), keepdims=True) / 448) * 1.01)


def test_rows_without_features_and_features_without_rows_are_named(tmp_path: Path) -> None:
    rows = token_rows(6)
    other = [5, 6, 7, 8]
    made = make_run(tmp_path, rows, skip=frozenset({1}), extra={"orphan": other, rows[3]["key"]: other})
    # row 4's stored features are of other tokens: written under its key, after the right ones of row 3
    bad = dict(rows[4], input_ids=[9, 9, 9, 9, 9, 9], loss_mask=[0, 0, 1, 1, 1, 1])
    made.tokens.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in [*rows[:4], bad, rows[5]]))
    out = tmp_path / "feat"
    r = export(made, FeatureLayout.GENERIC, out)
    assert (r.rows_read, r.rows_exported, r.rows_without_features, r.rows_tokens_differ) == (6, 4, 1, 1)
    assert r.duplicate_features == 1  # row 3 stored twice: the copy of its tokens is the one used
    # row 4's own features, of its old tokens, are stored and in no row: named too
    assert r.features_without_rows == 2 and r.named == {"no_features": ["rec1-a0"], "tokens_differ": ["rec4-a0"],
                                                        "no_row": [rows[4]["key"], "orphan"]}
    lines = [json.loads(x) for x in (out / UNMATCHED_FILE).read_text().splitlines()]
    assert [(x["reason"], x.get("id", x.get("feature_row"))) for x in lines] == [
        ("no_features", "rec1-a0"), ("tokens_differ", "rec4-a0"), ("no_row", rows[4]["key"]), ("no_row", "orphan")]
    assert "token 0 is id" in lines[1]["detail"] and "other tokens" in lines[2]["detail"]
    table = datasets.load_dataset("parquet", data_files=str(out / "rows.parquet"), split="train")
    assert table["id"] == ["rec0-a0", "rec2-a0", "rec3-a0", "rec5-a0"]


def test_feature_row_ids_follow_the_consumers_naming() -> None:
    from genqueue.consumer.answer.generate import feature_row

    key = "ab" * 16
    assert feature_row_id({"key": key, "turn": 2}, regenerate=False) == key
    for turn, step in ((0, 0), (1, 0), (1, 2)):
        row = {"key": key, "turn": turn, **({"step": step} if step else {})}
        assert feature_row_id(row, regenerate=True) == feature_row(key, turn, step)
    assert feature_row_id({"key": key, "features": {"row": "x:1"}}, regenerate=True) == "x:1"


def test_a_folder_genqueue_did_not_write_is_refused_and_its_own_replaced(tmp_path: Path) -> None:
    made = make_run(tmp_path, token_rows(3))
    out = tmp_path / "feat"
    export(made, FeatureLayout.GENERIC, out)
    check_folder(out)  # its own export: may be replaced
    export(made, FeatureLayout.SPECULATORS, out)
    assert not (out / "rows.parquet").exists() and (out / "hidden_states").is_dir()
    (out / "hidden_states" / "notes.txt").write_text("mine")
    with pytest.raises(Exception, match="genqueue did not write"):
        check_folder(out)
    assert (out / "hidden_states" / "notes.txt").read_text() == "mine"


@pytest.fixture
def registered(tmp_path: Path, conn: redis.Redis) -> Made:
    made = make_run(tmp_path, token_rows(3), skip=frozenset({0}))
    RunStore(conn).create_or_check(RUN, RunSettings(output=str(made.output), multi_turn="first"))
    return made


def test_cli_writes_the_folder_and_exits_1_for_rows_without_features(registered: Made, tmp_path: Path,
                                                                       redis_url: str) -> None:
    out = tmp_path / "feat"
    args = ["export-features", "--run", RUN, "--tokens", str(registered.tokens), "-o", str(out), "--layout",
            "generic", "-u", redis_url]
    res = cli("producer", *args, "--json", check=False)
    assert res.returncode == 1, res.stderr
    summary = orjson.loads(res.stdout)
    assert (summary["rows_exported"], summary["rows_without_features"]) == (2, 1)
    # the folder's own summary says what the printed one says (it read 0 files, 0 bytes when it was
    # written before the count)
    kept = orjson.loads((out / "genqueue-features.json").read_bytes())
    assert summary["files"] > 0 and summary["bytes"] > 0
    assert (kept["files"], kept["bytes"], kept["rows_exported"]) == (summary["files"], summary["bytes"], 2)
    assert res.stderr.strip().splitlines()[-1].startswith("error: 1 of 3 tokens rows have no features")
    res = cli("producer", *args, "--allow-partial", check=False)
    assert res.returncode == 0, res.stderr
    assert "without features" in res.stdout and "rec0-a0" in res.stdout


def test_cli_refusals_are_one_line(registered: Made, tmp_path: Path, redis_url: str) -> None:
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "keep.txt").write_text("x")
    base = ["export-features", "--run", RUN, "--tokens", str(registered.tokens), "-u", redis_url]
    for extra, words in ((["-o", str(mine), "--layout", "generic"], "genqueue did not write"),
                         (["-o", str(tmp_path / "a"), "--layout", "specforge"], "give --model-dir"),
                         (["-o", str(tmp_path / "b"), "--layout", "generic", "--run", "nope"], "nope")):
        res = cli("producer", *base, *extra, check=False)
        assert res.returncode == 2, (extra, res.stderr)
        assert len(res.stderr.strip().splitlines()) == 1 and words in res.stderr, res.stderr
    assert (mine / "keep.txt").read_text() == "x" and sorted(p.name for p in mine.iterdir()) == ["keep.txt"]
