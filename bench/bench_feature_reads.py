"""Reads of an export on S3: ranged GETs and wall time of `export-features` and `export-logprobs`
over a run of a few thousand rows on a local SeaweedFS (tests/s3server.py).

    python -m bench.bench_feature_reads                 # 3,000 rows, 4 workers' shards
    python -m bench.bench_feature_reads --rows 300      # a smoke run

The run: ROWS tokens rows (prompts of 40-100 tokens, answers of 20-60), each with its hidden
states (4 layers x HIDDEN, fp8) and its top-20 tables, stored as WORKERS consumers ship them
(rows dealt round robin, shards sealed at 8 MB), so a window of tokens rows touches every
worker's shards. Exported as speculators' folder and as plain Parquet. GETs are boto3's own
GetObject calls (ranged: a row's or a span's bytes; plain: manifests and indexes). Runs against
whatever genqueue is on the path: PYTHONPATH=<an older tree> measures that one.
A benchmark, not a test: it prints its table.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from bench.common import table
from genqueue.common.features import (
    FeatureDtype,
    FeatureManifest,
    FeatureShardWriter,
    feature_store_for,
    standin_features,
)
from genqueue.common.features.logprobs import LogprobsManifest, LogprobsMode, LogprobsReader, LogprobsTable
from genqueue.producer.export.features import FeatureIndex, FeatureLayout
from genqueue.producer.export.featurescmd import FeaturePlan, export_features
from genqueue.producer.export.logprobrows import Layout
from genqueue.producer.export.logprobscmd import LogprobPlan, export_logprobs
from tests.s3server import S3Server

RUN = "bench-run"
K = 20
LAYERS = (1, 2, 3, 4)
VOCAB = 32_000


def store_run(store: Any, spool: Path, rows: int, hidden: int, workers: int) -> list[dict[str, Any]]:
    rng = np.random.default_rng(0)
    man = FeatureManifest("bench", "r", LAYERS, FeatureDtype.FP8_E4M3, hidden, "t", "v", "g")
    tman = LogprobsManifest(model="bench", k=K, mode=LogprobsMode.RAW_LOGPROBS, temperature=None,
                            genqueue_version="g")
    store.put_manifest(RUN, man)
    store.put_manifest(RUN, tman)
    writers = [(FeatureShardWriter(spool, RUN, f"w{w}", man, max_bytes=8 << 20),
                FeatureShardWriter(spool, RUN, f"t{w}", tman, max_bytes=8 << 20)) for w in range(workers)]
    out = []
    for i in range(rows):
        prompt, answer = int(rng.integers(40, 100)), int(rng.integers(20, 60))
        ids = rng.integers(0, VOCAB, size=prompt + answer)
        key = f"{i:032x}"
        out.append({"id": f"rec{i}-a0", "key": key, "turn": 0, "input_ids": ids.tolist(),
                    "loss_mask": [0] * prompt + [1] * answer})
        feats, tabs = writers[i % workers]
        feats.append(key, ids[:-1], standin_features(ids[:-1], LAYERS, hidden, seed=1))
        top = np.argsort(-rng.random((answer, VOCAB // 100)), axis=1)[:, :K].astype(np.int32)
        top[:, 0] = ids[prompt:]
        lp = -np.sort(rng.random((answer, K)).astype(np.float32) * 10, axis=1)
        tabs.append_table(key, LogprobsTable.of(top[:, 0], lp[:, 0], top, lp))
        for w in (feats, tabs):
            if w.full and (sealed := w.seal()) is not None:
                store.put_shard(sealed)
    for pair in writers:
        for w in pair:
            if (sealed := w.seal()) is not None:
                store.put_shard(sealed)
    return out


def measure(server: S3Server, rows: int, hidden: int, workers: int) -> list[tuple[str, ...]]:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        store: Any = feature_store_for(server.url(f"out-{hidden}"))
        made = store_run(store, root / "spool", rows, hidden, workers)
        tokens = root / "tokens.jsonl"
        tokens.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in made))
        shards = len(store.list_shards(RUN))
        gets = {"ranged": 0, "whole": 0}

        def count(params: dict[str, Any], **_: Any) -> None:
            gets["ranged" if "Range" in params else "whole"] += 1

        store.client.meta.events.register("provide-client-params.s3.GetObject", count)
        out = []
        for name, run in (
                ("export-features (speculators)", lambda: export_features(
                    FeaturePlan(RUN, FeatureLayout.SPECULATORS, root / "feat", tokens, False, None, None),
                    FeatureIndex(store, RUN), "s3")),
                ("export-logprobs (plain)", lambda: export_logprobs(
                    LogprobPlan(RUN, Layout.PLAIN, root / "lp", tokens, False, K, None), LogprobsReader(store, RUN),
                    "s3"))):
            gets.update(ranged=0, whole=0)
            t0 = time.perf_counter()
            r = run()
            spent = time.perf_counter() - t0
            out.append((name, f"{hidden}", f"{rows:,}", f"{r.rows_exported:,}", f"{shards}", f"{gets['ranged']:,}",
                        f"{gets['whole']:,}", f"{spent:.2f}"))
        return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=3000)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--hidden", type=int, action="append")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        server = S3Server(Path(tmp))
        server.start()
        os.environ.update(server.env)
        try:
            rows = [("export", "hidden", "tokens rows", "exported", "shards (both kinds)", "ranged GETs",
                     "other GETs", "seconds")]
            for hidden in args.hidden or [256, 2048]:
                rows += measure(server, args.rows, hidden, args.workers)
        finally:
            server.stop(kill=True)
    print(table(rows))


if __name__ == "__main__":
    main()
