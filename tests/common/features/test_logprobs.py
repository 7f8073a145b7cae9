"""Log-probability tables as feature rows: packed, checked, stored beside hidden states and read back."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from genqueue.common.errors import FeatureCorruptError, FeatureManifestConflictError, FeatureValueError
from genqueue.common.features import FeatureDtype, FeatureManifest, FeatureReader, FeatureShardWriter, LocalFeatureStore
from genqueue.common.features.logprobs import (
    LogprobsManifest,
    LogprobsMode,
    LogprobsReader,
    LogprobsTable,
    bytes_per_token,
    check_table,
    pack_table,
    unpack_table,
)
from genqueue.common.features.scan import scan

RAW = LogprobsMode.RAW_LOGPROBS


def table(t: int = 6, k: int = 5, seed: int = 0) -> LogprobsTable:
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(t, 50)) * 3
    lp = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
    top = np.argsort(-lp, axis=1)[:, :k]
    sampled = top[:, min(1, k - 1)]
    return LogprobsTable.of(sampled, lp[np.arange(t), sampled], top, np.take_along_axis(lp, top, axis=1))


def manifest(k: int = 5) -> LogprobsManifest:
    return LogprobsManifest(model="m", k=k, mode=RAW, temperature=0.7, genqueue_version="test")


def test_a_row_reads_back_in_its_shapes_within_fp16() -> None:
    tab = table()
    back = unpack_table(pack_table("r1", "00" * 8, tab))
    assert back.row == "r1" and back.capture == "00" * 8
    got = back.table
    assert got.sampled_ids.dtype == np.int32 and got.sampled_ids.shape == (6,)
    assert got.topk_ids.dtype == np.int32 and got.topk_ids.shape == (6, 5)
    assert got.sampled_logprobs.dtype == np.float32 and got.topk_logprobs.dtype == np.float32
    assert (got.sampled_ids == tab.sampled_ids).all() and (got.topk_ids == tab.topk_ids).all()
    # fp16: within half an ulp of an 11-bit significand
    assert np.all(np.abs(got.topk_logprobs - tab.topk_logprobs) <= np.abs(tab.topk_logprobs) * 2.0**-11 + 1e-7)
    check_table(got, k=5, mode=RAW, expected_ids=tab.sampled_ids.tolist())
    assert bytes_per_token(20) == 126


def test_a_row_is_a_plain_safetensors_file() -> None:
    safetensors = pytest.importorskip("safetensors.numpy")
    tab = table()
    loaded = safetensors.load(pack_table("r1", "00" * 8, tab))
    assert sorted(loaded) == ["sampled_ids", "sampled_logprobs", "topk_ids", "topk_logprobs"]
    assert loaded["topk_logprobs"].dtype == np.float16 and (loaded["topk_ids"] == tab.topk_ids).all()


@pytest.mark.parametrize(("garble", "says"), [
    (lambda t: LogprobsTable.of(t.sampled_ids[::-1].copy(), t.sampled_logprobs, t.topk_ids, t.topk_logprobs),
     "sampled token 0 is id"),
    (lambda t: LogprobsTable.of(t.sampled_ids, t.sampled_logprobs, t.topk_ids[:, ::-1].copy(),
                                t.topk_logprobs[:, ::-1].copy()), "not sorted descending"),
    (lambda t: LogprobsTable.of(t.sampled_ids, t.sampled_logprobs, t.topk_ids,
                                np.where(np.arange(5) == 4, np.nan, t.topk_logprobs)), "is NaN"),
    (lambda t: LogprobsTable.of(t.sampled_ids, t.sampled_logprobs, t.topk_ids, np.full((6, 5), -0.1)),
     "sums to probability"),
    (lambda t: LogprobsTable.of(t.sampled_ids, t.sampled_logprobs + 50, t.topk_ids, t.topk_logprobs), "above 0"),
    (lambda t: LogprobsTable.of(t.sampled_ids, t.sampled_logprobs, t.topk_ids[:, :4].copy(), t.topk_logprobs[:, :4].copy()),
     "tables of 4 entries"),
])
def test_a_table_that_does_not_fit_is_refused(garble, says) -> None:  # type: ignore[no-untyped-def]
    tab = table()
    with pytest.raises(FeatureValueError, match=says):
        check_table(garble(tab), k=5, mode=RAW, expected_ids=tab.sampled_ids.tolist())


def test_logits_modes_skip_the_probability_checks() -> None:
    tab = table()
    logits = LogprobsTable.of(tab.sampled_ids, tab.sampled_logprobs + 5, tab.topk_ids, tab.topk_logprobs + 5)
    check_table(logits, k=5, mode=LogprobsMode.RAW_LOGITS, expected_ids=None)


def test_tables_beside_hidden_states_in_one_store(tmp_path: Path) -> None:
    spool, out = tmp_path / "spool", LocalFeatureStore(tmp_path / "out")
    lpm = manifest()
    w = FeatureShardWriter(spool, "run", "w1", lpm)
    tabs = {f"k{i}": table(t=3 + i, seed=i) for i in range(4)}
    for row, tab in tabs.items():
        w.append_table(row, tab)
    sealed = w.seal()
    assert sealed is not None
    assert scan(sealed.path).entries == sealed.index.entries  # a crash's leftover is rebuilt the same
    out.put_manifest("run", lpm)
    out.put_shard(sealed)
    # the run's hidden states, another capture in the same folder
    hm = FeatureManifest("m", "", (0, 1), FeatureDtype.BF16, 4, "", "", "test")
    hw = FeatureShardWriter(spool, "run", "w2", hm)
    hw.append("k0", np.arange(3), np.ones((3, 2, 4), dtype=np.float32))
    hsealed = hw.seal()
    assert hsealed is not None
    out.put_manifest("run", hm)
    out.put_shard(hsealed)

    reader = LogprobsReader(out, "run")
    assert reader.manifest == lpm and sorted(reader.entries) == sorted(tabs)
    for row, got in reader.rows():
        assert (got.topk_ids == tabs[row].topk_ids).all() and (got.sampled_ids == tabs[row].sampled_ids).all()
    assert reader.row("k2").tokens == 5
    assert FeatureReader(out, "run").row("k0").encoded.tokens == 3  # only on its own shards
    with pytest.raises(FeatureManifestConflictError):
        out.put_manifest("run", manifest(k=6))
    with pytest.raises(FeatureValueError):
        w.append_table("x", table(k=6))


def test_a_flipped_byte_is_named(tmp_path: Path) -> None:
    out = LocalFeatureStore(tmp_path / "out")
    w = FeatureShardWriter(tmp_path / "spool", "run", "w1", manifest())
    entry = w.append_table("k0", table())
    sealed = w.seal()
    assert sealed is not None
    out.put_manifest("run", manifest())
    out.put_shard(sealed)
    path = tmp_path / "out" / "run" / "features" / sealed.name
    data = bytearray(path.read_bytes())
    data[entry.offset + entry.length - 3] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(FeatureCorruptError, match="crc32"):
        LogprobsReader(out, "run").row("k0")
