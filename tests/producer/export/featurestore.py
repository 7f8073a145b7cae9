"""A run's captured features made directly with common/features (no consumer): rows of the
stand-in's features over token ids, stored as a consumer ships them, and the tokens export rows
they belong to. Shared by the features export tests and the real-vLLM tier's trainer readback."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import orjson

from genqueue.common.features import (
    FeatureDtype,
    FeatureManifest,
    FeatureShardWriter,
    LocalFeatureStore,
    standin_features,
)

RUN = "feat-run"
LAYERS = (1, 2, 3, 4)  # the aux layers, then the final one (a 4-layer model)
HIDDEN = 32


@dataclass(frozen=True)
class Made:
    output: Path  # the run's output (its feature store's root)
    tokens: Path  # the tokens export file
    rows: list[dict[str, object]]  # the tokens rows, as written
    manifest: FeatureManifest


def token_rows(n: int, *, seed: int = 0) -> list[dict[str, object]]:
    """N tokens export rows of answers to prompts of different lengths (mode first)."""
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        prompt = rng.integers(3, 1000, size=5 + i).tolist()
        answer = rng.integers(3, 1000, size=4 + 2 * i).tolist()
        rows.append({"id": f"rec{i}-a0", "key": f"{i:032x}", "turn": 0, "input_ids": prompt + answer,
                     "loss_mask": [0] * len(prompt) + [1] * len(answer), "outcome": "finished"})
    return rows


def features_of(ids: list[int], hidden: int = HIDDEN) -> np.ndarray:
    return standin_features(ids, LAYERS, hidden, seed=7)


def make_run(tmp: Path, rows: list[dict[str, object]], *, dtype: FeatureDtype = FeatureDtype.FP8_E4M3,
             skip: frozenset[int] = frozenset(), extra: dict[str, list[int]] | None = None,
             full: frozenset[int] = frozenset(), hidden: int = HIDDEN) -> Made:
    """Store the features of ROWS (all but the last input id each, as vLLM captures during
    generation; the rows in FULL all of them, as a prefill pass) but those in SKIP, plus EXTRA
    (feature row -> token ids) no row names; write ROWS as a tokens export."""
    manifest = FeatureManifest(model="tiny", revision="r1", layer_ids=LAYERS, dtype=dtype, hidden_size=hidden,
                               chat_template_hash="c", vllm_version="v", genqueue_version="g")
    output = tmp / "out"
    writer = FeatureShardWriter(tmp / "spool", RUN, "w1", manifest, max_bytes=6_000)
    store = LocalFeatureStore(output)
    store.put_manifest(RUN, manifest)

    def put(row: str, ids: list[int]) -> None:
        writer.append(row, np.asarray(ids, dtype=np.int64), features_of(ids, hidden))
        if writer.full:
            store.put_shard(writer.seal())  # type: ignore[arg-type]

    for i, r in enumerate(rows):
        if i in skip:
            continue
        ids = list(r["input_ids"])  # type: ignore[call-overload]
        put(str(r["key"]), ids if i in full else ids[:-1])
    for row, ids in (extra or {}).items():
        put(row, ids)
    sealed = writer.seal()
    if sealed is not None:
        store.put_shard(sealed)
    tokens = tmp / "tokens.jsonl"
    tokens.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    return Made(output, tokens, rows, manifest)
