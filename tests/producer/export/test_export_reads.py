"""The exports read a run's rows a shard at a time: the rows a window of tokens rows wants are
grouped by shard and read in few large reads (common/features/read.py read_entries), one ranged
GET a span from S3, one open a shard on disk, never a read per row; and a row that fails its
check inside such a read is still named (row, shard, offset) and kept out of the export, its
neighbours in the same read exported."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest

from genqueue.common.features import FeatureShardWriter, FeatureStore, LocalFeatureStore
from genqueue.common.features.logprobs import LogprobsManifest, LogprobsMode, LogprobsReader, LogprobsTable
from genqueue.common.features.shard import IndexEntry, ReadRange
from genqueue.producer.export.featurecheck import CheckReport
from genqueue.producer.export.featurecheckcmd import check_rows
from genqueue.producer.export.features import UNMATCHED_FILE, FeatureIndex, FeatureLayout
from genqueue.producer.export.featurescmd import FeaturePlan, export_features
from genqueue.producer.export.logprobrows import Layout
from genqueue.producer.export.logprobscmd import LogprobPlan, export_logprobs
from tests import s3server
from tests.producer.export.featurestore import RUN, features_of
from tests.producer.export.logprobtables import tables_for, token_row
from tests.s3server import S3Server

s3_server = s3server.s3_server  # fixtures
s3_env = s3server.s3_env

K = 8


class Counting:
    """A feature store that counts its reads: row by row (read_range) and in spans (read_spans,
    each span a read: a ranged GET from S3)."""

    def __init__(self, store: FeatureStore) -> None:
        self.store = store
        self.row_reads = 0
        self.opens = 0
        self.spans: list[tuple[str, int, int]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)

    def read_range(self, run: str, shard: str) -> ReadRange:
        read = self.store.read_range(run, shard)

        def counted(offset: int, length: int) -> bytes:
            self.row_reads += 1
            return read(offset, length)
        return counted

    def read_spans(self, run: str, shard: str, spans: Sequence[tuple[int, int]]) -> Iterator[bytes]:
        self.opens += 1
        self.spans.extend((shard, o, n) for o, n in spans)
        yield from self.store.read_spans(run, shard, spans)


@dataclass(frozen=True)
class Stored:
    tokens: Path
    rows: list[dict[str, Any]]
    shards: int  # feature shards (the tables' as many)


def store_run(store: FeatureStore, tmp: Path, n: int, *, shard_bytes: int = 60_000) -> Stored:
    """N tokens rows with their features and their tables, put in STORE as consumers ship them:
    shards of about SHARD_BYTES, each row's features in the order of the tokens rows."""
    from genqueue.common.features import FeatureDtype, FeatureManifest

    rows = [token_row(f"{i:032x}", 5 + i % 7, 4 + i % 5, seed=i) for i in range(n)]
    man = FeatureManifest(model="tiny", revision="r1", layer_ids=(1, 2, 3, 4), dtype=FeatureDtype.FP8_E4M3,
                          hidden_size=32, chat_template_hash="c", vllm_version="v", genqueue_version="g")
    tman = LogprobsManifest(model="tiny", k=K, mode=LogprobsMode.RAW_LOGPROBS, temperature=None,
                            genqueue_version="g")
    store.put_manifest(RUN, man)
    store.put_manifest(RUN, tman)
    feats = FeatureShardWriter(tmp / "spool", RUN, "w1", man, max_bytes=shard_bytes)
    tabs = FeatureShardWriter(tmp / "spool", RUN, "t1", tman, max_bytes=shard_bytes // 8)
    shards = 0
    for i, r in enumerate(rows):
        ids = list(r["input_ids"])
        feats.append(str(r["key"]), np.asarray(ids[:-1], np.int64), features_of(ids[:-1]))
        answer = [t for t, m in zip(ids, r["loss_mask"], strict=True) if m]
        t = tables_for(answer, K, seed=i)
        tabs.append_table(str(r["key"]), LogprobsTable.of(t.sampled_ids, t.sampled_logprobs, t.topk_ids,
                                                          t.topk_logprobs))
        for w in (feats, tabs):
            if w.full and (sealed := w.seal()) is not None:
                store.put_shard(sealed)
                shards += w is feats
    for w in (feats, tabs):
        if (sealed := w.seal()) is not None:
            store.put_shard(sealed)
            shards += w is feats
    tokens = tmp / "tokens.jsonl"
    tokens.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    return Stored(tokens, rows, shards)


def export_both(store: FeatureStore, stored: Stored, out: Path) -> tuple[Any, Any]:
    f = export_features(FeaturePlan(RUN, FeatureLayout.SPECULATORS, out / "feat", stored.tokens, False, None, None),
                        FeatureIndex(store, RUN), "here")
    reader = LogprobsReader(store, RUN)
    lp = export_logprobs(LogprobPlan(RUN, Layout.PLAIN, out / "lp", stored.tokens, False, K, None), reader, "here")
    return f, lp


def entry(n: int, offset: int, length: int, shard: str = "s") -> IndexEntry:
    from genqueue.common.features import FeatureDtype

    return IndexEntry(f"r{n}", shard, offset, length, 1, 1, 1, FeatureDtype.BF16, 0)


def test_rows_near_each_other_share_a_read_up_to_its_bound() -> None:
    from genqueue.common.features.read import plan_reads

    es = [entry(0, 100, 50), entry(1, 160, 50), entry(2, 5_000, 50), entry(3, 5_060, 900), entry(4, 0, 10, "a")]
    reads = plan_reads(reversed(es), max_bytes=1_000, max_gap=100)
    assert [(r.shard, r.offset, r.length, [e.row for e in r.entries]) for r in reads] == [
        ("a", 0, 10, ["r4"]), ("s", 100, 110, ["r0", "r1"]), ("s", 5_000, 960, ["r2", "r3"])]
    # a span never passes its bound; a row larger than it is read alone
    reads = plan_reads(es[2:4] + [entry(5, 6_000, 3_000)], max_bytes=900, max_gap=100)
    assert [(r.offset, r.length) for r in reads] == [(5_000, 50), (5_060, 900), (6_000, 3_000)]


def test_the_exports_read_each_shard_in_one_read_from_disk(tmp_path: Path) -> None:
    store = Counting(LocalFeatureStore(tmp_path / "out"))
    stored = store_run(store, tmp_path, 120)  # type: ignore[arg-type]
    assert stored.shards >= 3
    f, lp = export_both(store, stored, tmp_path)  # type: ignore[arg-type]
    assert (f.rows_exported, lp.rows_exported) == (120, 120) and f.complete and lp.complete
    assert store.row_reads == 0
    shards = {s for s, _, _ in store.spans}
    # one read and one open a shard (120 rows fit one window), not one a row
    assert len(store.spans) == store.opens == len(shards) < 40


def test_check_features_reads_its_sample_by_shard(tmp_path: Path) -> None:
    store = Counting(LocalFeatureStore(tmp_path / "out"))
    stored = store_run(store, tmp_path, 60)  # type: ignore[arg-type]
    index = FeatureIndex(store, RUN)  # type: ignore[arg-type]
    report = CheckReport(index.manifest.layer_ids)
    check_rows(index, sorted(index.by_row), lambda ids, layers: features_of(ids), report, 0.05)
    assert report.ok and report.rows_checked == 60
    assert store.row_reads == 0 and len(store.spans) == stored.shards


def test_a_corrupt_row_in_a_shared_read_is_named_and_left_out(tmp_path: Path) -> None:
    output = tmp_path / "out"
    plain = LocalFeatureStore(output)
    stored = store_run(plain, tmp_path, 40)
    bad = str(stored.rows[17]["key"])
    garbled: dict[str, IndexEntry] = {}
    for shard in plain.list_shards(RUN):
        for e in plain.get_index(RUN, shard).entries:
            if e.row == bad:
                garbled[shard] = e
                path = plain.dir(RUN) / shard
                data = bytearray(path.read_bytes())
                data[e.offset + e.length // 2] ^= 0x40
                path.write_bytes(bytes(data))
    assert len(garbled) == 2  # its features and its tables
    store = Counting(plain)
    f, lp = export_both(store, stored, tmp_path)  # type: ignore[arg-type]
    assert store.row_reads == 0 and len(store.spans) < 20  # read in spans shared with its neighbours
    for r, name in ((f, "feat"), (lp, "lp")):
        assert r.rows_exported == 39 and not r.complete
        lines = [orjson.loads(x) for x in (tmp_path / name / UNMATCHED_FILE).read_bytes().splitlines()]
        (line,) = [x for x in lines if x["reason"] != "no_row"]  # its stored row is no row's, too
        shard, e = next((s, e) for s, e in garbled.items() if (s.startswith("t1") == (name == "lp")))
        assert line["id"] == stored.rows[17]["id"]
        assert f"features of row {bad!r} in shard {shard} at offset {e.offset}: crc32" in line["detail"]
    assert f.rows_tokens_differ == 1 and lp.rows_unreadable == 1

    index = FeatureIndex(plain, RUN)
    report = CheckReport(index.manifest.layer_ids)
    check_rows(index, sorted(index.by_row), lambda ids, layers: features_of(ids), report, 0.05)
    feat_shard = next(s for s in garbled if not s.startswith("t1"))
    e = garbled[feat_shard]
    assert [p.line() for p in report.problems] == [(
        f"row {bad}: unreadable: crc32 {_crc(plain, feat_shard, e):08x}, the index says {e.crc32:08x} "
        f"(shard {feat_shard}, offset {e.offset})")]
    assert report.rows_checked == 39


def _crc(store: LocalFeatureStore, shard: str, e: IndexEntry) -> int:
    import zlib

    return zlib.crc32((store.dir(RUN) / shard).read_bytes()[e.offset:e.offset + e.length])


@pytest.mark.integration
def test_the_exports_read_s3_in_a_ranged_get_a_shard(tmp_path: Path, s3_server: S3Server,
                                                      s3_env: dict[str, str]) -> None:
    """On S3: every row of both exports in one ranged GET a shard (boto3's own calls counted)."""
    from genqueue.common.features import feature_store_for
    from genqueue.common.features.s3 import S3FeatureStore

    store = feature_store_for(s3_server.url("out"))
    assert isinstance(store, S3FeatureStore)
    stored = store_run(store, tmp_path, 120)
    ranged: list[str] = []

    def count(params: dict[str, Any], **_: Any) -> None:
        if "Range" in params:
            ranged.append(params["Key"])

    store.client.meta.events.register("provide-client-params.s3.GetObject", count)
    f, lp = export_both(store, stored, tmp_path)
    assert (f.rows_exported, lp.rows_exported) == (120, 120)
    shards = set(store.list_shards(RUN))
    assert len(ranged) == len(shards) and {k.rsplit("/", 1)[1] for k in ranged} == shards
