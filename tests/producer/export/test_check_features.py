"""`producer check-features` without a model: stored rows (made with common/features from the
stand-in's features) against a reference that is those features themselves, so a row matches
only within its dtype's bound, and an error planted in a stored row (rewritten with a valid
crc32: only the comparison can tell) is named by its row, its layer and its first position. The
ids check against the tokens export, the sample, and the command's one-line refusals. The real
forward pass (transformers over vLLM's captures) is tests/vllm/test_check_features.py's."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import orjson
import pytest
import redis

from genqueue.common.features import FeatureDtype, LocalFeatureStore
from genqueue.common.keepers.runs import RunStore
from genqueue.common.settings import RunSettings
from genqueue.producer.export.featurecheck import CheckReport, compare_row, rank, sampled
from genqueue.producer.export.featurecheckcmd import check_ids, check_rows
from genqueue.producer.export.features import FeatureIndex
from tests.conftest import cli
from tests.producer.export.featurestore import LAYERS, RUN, Made, features_of, make_run, token_rows
from tests.producer.export.featuretamper import rewrite_row

TOLERANCE = 0.1


def reference(ids: list[int], layers: tuple[int, ...]) -> np.ndarray:
    assert layers == LAYERS
    return features_of(ids).astype(np.float32)


def check(made: Made) -> CheckReport:
    index = FeatureIndex(LocalFeatureStore(made.output), RUN)
    report = CheckReport(index.manifest.layer_ids, rows_stored=len(index.by_row))
    check_rows(index, sampled(list(index.by_row), share=1.0), reference, report, TOLERANCE)
    return report


@pytest.mark.parametrize("dtype", list(FeatureDtype))
def test_stored_rows_match_their_reference_within_the_dtypes_bound(tmp_path: Path, dtype: FeatureDtype) -> None:
    made = make_run(tmp_path, token_rows(6), dtype=dtype)
    report = check(made)
    assert report.ok, report.lines()
    assert report.rows_checked == 6 and report.tokens_checked == sum(len(r["input_ids"]) - 1 for r in made.rows)
    worst = max(report.worst.values())
    # fp8's error is a few percent of a vector, bf16's a fraction of one: the bound is the dtype's
    assert (0.005 < worst < 0.06) if dtype is FeatureDtype.FP8_E4M3 else (worst < 0.005), report.worst
    assert "all match: 6 of 6 rows checked" in report.summary(TOLERANCE)


@pytest.mark.parametrize("dtype", list(FeatureDtype))
def test_a_planted_error_names_the_row_the_layer_and_the_first_position(tmp_path: Path, dtype: FeatureDtype) -> None:
    rows = token_rows(6)
    made = make_run(tmp_path, rows, dtype=dtype)
    bad, swapped = str(rows[2]["key"]), str(rows[4]["key"])

    def shift(x: np.ndarray) -> np.ndarray:  # layer 3's positions 5 and after: the next token's state
        x[5:-1, 2] = x[6:, 2]
        return x

    rewrite_row(made.output, RUN, bad, shift)
    rewrite_row(made.output, RUN, swapped, lambda x: x[:, [1, 0, 2, 3]])  # layers 1 and 2 swapped
    report = check(made)
    assert not report.ok and report.rows_failed == 2
    lines = sorted(report.lines())  # found in the sample's order; named by row here
    assert len(lines) == 3 and bad < swapped, lines
    n = len(rows[2]["input_ids"]) - 1  # type: ignore[arg-type]
    assert lines[0].startswith(f"row {bad}: layer 3 differs first at position 5 ({n - 6} of {n} positions off): "
                               "relative error "), lines[0]
    assert lines[1].startswith(f"row {swapped}: layer 1 differs first at position 0 ")
    assert lines[2].startswith(f"row {swapped}: layer 2 differs first at position 0 ")
    m = next(m for m in report.mismatches if m.row == bad)
    assert m.error > 0.5 > TOLERANCE < m.reach < 0.2 and m.shard.endswith(".gqfeat")
    assert report.summary(TOLERANCE).startswith("2 rows fail: 6 of 6 rows checked")


def test_the_reach_is_the_tolerance_plus_the_dtypes_bound() -> None:
    made_ids = list(range(3, 40))
    from genqueue.common.features import encode
    from genqueue.common.features.row import FeatureRow

    x = features_of(made_ids).astype(np.float32)
    for dtype in FeatureDtype:
        row = FeatureRow("r", "c", LAYERS, np.asarray(made_ids, np.int64), encode(x, dtype))
        # the engine off by 9 % in one direction: within; by 30 %: out, at every position
        assert compare_row(row, "s", x * 1.09, TOLERANCE).mismatches == (), dtype
        far = compare_row(row, "s", x * 1.3, TOLERANCE).mismatches
        assert [(m.layer, m.position, m.off) for m in far] == [(k, 0, len(made_ids)) for k in LAYERS]
        with pytest.raises(ValueError, match="reference's features are"):
            compare_row(row, "s", x[:, :3], TOLERANCE)


def test_token_ids_are_checked_against_every_row_of_the_tokens_export(tmp_path: Path) -> None:
    rows = token_rows(5)
    made = make_run(tmp_path, rows, skip=frozenset({1}), extra={"orphan": [5, 6, 7]})
    rows[3]["input_ids"][4] += 1  # type: ignore[index]
    made.tokens.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    index = FeatureIndex(LocalFeatureStore(made.output), RUN)
    report = CheckReport(LAYERS, rows_stored=len(index.by_row))
    check_ids(index, made.tokens, report, regenerate=False)
    assert (report.ids_checked, report.ids_differ, report.rows_without_features, report.features_without_rows) == \
        (4, 1, 1, 1)
    assert report.summary(TOLERANCE).endswith("token ids: 4 tokens rows checked, 1 differ, 1 without features, "
                                              "1 stored rows no tokens row names")
    assert report.lines() == [(f"row {rows[3]['key']}: token ids are not those of tokens row rec3-a0: features in "
                              f"{index.by_row[str(rows[3]['key'])][0].shard}: token 4 is id "
                              f"{rows[3]['input_ids'][4] - 1}, the row's is {rows[3]['input_ids'][4]}")]  # type: ignore[index]
    assert not report.ok


def test_the_sample_is_the_same_every_time_and_grows_by_adding() -> None:
    rows = [f"row-{i}" for i in range(400)]
    half = sampled(rows, share=0.5)
    assert sampled(list(reversed(rows)), share=0.5) == half and 150 < len(half) < 250
    assert set(half) <= set(sampled(rows, share=0.6)) and sampled(rows, share=1.0) == sorted(rows, key=rank)
    assert sampled(rows, count=10) == half[:10] and len(sampled(rows, count=1000)) == 400


@pytest.fixture
def registered(tmp_path: Path, conn: redis.Redis) -> Made:
    made = make_run(tmp_path, token_rows(3))
    RunStore(conn).create_or_check(RUN, RunSettings(output=str(made.output), multi_turn="first"))
    return made


def test_cli_refusals_are_one_line(registered: Made, tmp_path: Path, redis_url: str) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"num_hidden_layers": 4, "hidden_size": 32}')
    base = ["check-features", "--run", RUN, "-u", redis_url]
    for extra, words in ((["--model-dir", str(tmp_path / "none")], "--model-dir"),
                         (["--model-dir", str(tmp_path)], "no readable config.json"),
                         (["--model-dir", str(model), "--share", "0.5", "--rows", "3"], "give one"),
                         (["--model-dir", str(model), "--torch-python", str(tmp_path / "py")], "cannot run it"),
                         (["--model-dir", str(model)], "give --torch-python"),
                         (["--model-dir", str(model), "--tokens", str(tmp_path / "t.jsonl")], "no such file")):
        res = cli("producer", *base, *extra, check=False, env={"GENQUEUE_TORCH_PYTHON": ""})
        assert res.returncode == 2, (extra, res.stderr)
        assert len(res.stderr.strip().splitlines()) == 1 and words in res.stderr, res.stderr
