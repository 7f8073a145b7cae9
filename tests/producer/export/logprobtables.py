"""A run's top-k tables held in memory (no store), in the shape common/features/logprobs.py's reader returns
(sampled_ids int32 [T], sampled_logprobs float32 [T], topk_ids int32 [T, K], topk_logprobs
float32 [T, K], sorted descending), and the tokens rows they belong to."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import orjson

VOCAB = 300


@dataclass(frozen=True)
class MemoryTables:
    sampled_ids: np.ndarray
    sampled_logprobs: np.ndarray
    topk_ids: np.ndarray
    topk_logprobs: np.ndarray


@dataclass
class MemorySource:
    """LogprobsReader's surface (entries, duplicates, manifest, row(id), read_tables(ids)) over tables in a dict."""

    k: int
    tables: dict[str, MemoryTables] = field(default_factory=dict)
    duplicates: int = 0
    mode: str = "raw_logprobs"

    @property
    def entries(self) -> dict[str, Any]:
        return dict.fromkeys(self.tables)

    @property
    def manifest(self) -> Any:
        return SimpleNamespace(model="tiny", k=self.k, mode=self.mode, temperature=None)

    def row(self, row: str) -> MemoryTables:
        return self.tables[row]

    def read_tables(self, rows: Iterable[str]) -> dict[str, MemoryTables]:
        return {r: self.tables[r] for r in rows if r in self.tables}


def tables_for(completion: list[int], k: int, *, seed: int) -> MemoryTables:
    """Tables of a softmax over VOCAB at each position, the sampled id put in its top-k (as a
    sampler at temperature 1 mostly draws), values rounded through fp16 as the store keeps them."""
    rng = np.random.default_rng(seed)
    t = len(completion)
    logits = rng.normal(size=(t, VOCAB)) * 3
    logits[np.arange(t), completion] += 15
    lp = logits - np.log(np.exp(logits).sum(axis=-1, keepdims=True))
    lp = lp.astype(np.float16).astype(np.float32)
    order = np.argsort(-lp, axis=-1, kind="stable")[:, :k]
    return MemoryTables(np.asarray(completion, np.int32), lp[np.arange(t), completion].astype(np.float32),
                      order.astype(np.int32), np.take_along_axis(lp, order, axis=-1))


def token_row(key: str, prompt: int, answer: int, *, seed: int) -> dict[str, Any]:
    """A tokens-export row (producer export --format tokens) of key KEY (mode first)."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, VOCAB, size=prompt + answer).tolist()
    return {"id": f"{key}-a0", "key": key, "turn": 0, "input_ids": ids, "loss_mask": [0] * prompt + [1] * answer}


def write_tokens(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    return path


def run_of(n: int, k: int, *, seed: int = 0) -> tuple[list[dict[str, Any]], MemorySource]:
    """N tokens rows, each with its tables (K entries)."""
    rows = [token_row(f"item{i}", 5 + 3 * i, 4 + 2 * i, seed=seed + i) for i in range(n)]
    src = MemorySource(k)
    for i, r in enumerate(rows):
        answer = [t for t, m in zip(r["input_ids"], r["loss_mask"], strict=True) if m]
        src.tables[r["key"]] = tables_for(answer, k, seed=seed + 100 + i)
    return rows, src
