"""`producer export-logprobs`: a run's top-k tables joined by id to the rows of its tokens export,
and each joined row laid out as a distillation trainer reads it (pure: arrays in, Arrow out).

The join. A tokens row names the table row its answer was stored under: its own `logprobs.row`,
else export-features' rule (features.feature_row_id). Its tables cover the last T input_ids: table t is the distribution
token L - T + t was sampled from. A row is accepted when its tables' sampled ids are exactly
those last T ids and every loss-masked token is among them; anything else is counted and named
(Unmatched), never dropped silently.

The layouts (Layout):
- plain: one row per answer, a list entry per token: `input_ids` int32, `loss_mask` int8,
  `topk_ids` int32 [K] and `topk_logprobs` float32 [K] at each generated token (the distribution
  it was sampled from), empty elsewhere, `sampled_logprobs` (null where no table), and `id`.
- distillkit: DistillKit's own (sample_logits_vllm.py at distillkit.DISTILLKIT_COMMIT):
  `input_ids` uint64 [L], `compressed_logprobs` and `bytepacked_indices` uint8 [L - 1][bytes]
  (position j's table is the distribution of token j + 1, as vLLM's prompt_logprobs without its
  empty first), and `labels` int64 [L]. DistillKit's trainer masks its KL term by `labels >= 0`
  at the table's own position, so labels[j] is input_ids[j] where token j + 1 has a table and
  -100 elsewhere; the prompt's positions hold a one-hot table on the next token. No `id` column:
  genqueue-rows.jsonl maps each row index to its id. docs/export.md says why, layout by layout.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt
import pyarrow as pa

from genqueue.producer.export import distillkit as dk
from genqueue.producer.export.features import TokenRow, feature_row_id

IGNORE = dk.Theirs.IGNORE
#: The other entries of DistillKit's one-hot table at a prompt position: finite (its fit takes no -inf), exp(-100) ~ 0.
PLACEHOLDER_LOGPROB = -100.0


class Layout(StrEnum):
    """`--layout`: whose Parquet the export writes."""

    PLAIN = "plain"
    DISTILLKIT = "distillkit"


class Unmatched(StrEnum):
    """Why a tokens row or a stored table is not in the export."""

    NO_TABLES = "no_tables"  # the tokens row's answer has no stored tables
    TOKENS_DIFFER = "tokens_differ"  # its tables were sampled as other ids than the row's
    UNREADABLE = "unreadable"  # its stored tables fail their check (crc32, layout)
    NO_ROW = "no_row"  # stored tables no row of the tokens export names


class Tables(Protocol):
    """One answer's tables (common/features/logprobs.py LogprobsTable)."""

    @property
    def sampled_ids(self) -> npt.NDArray[np.int32]: ...

    @property
    def sampled_logprobs(self) -> npt.NDArray[np.float32]: ...

    @property
    def topk_ids(self) -> npt.NDArray[np.int32]: ...

    @property
    def topk_logprobs(self) -> npt.NDArray[np.float32]: ...


@dataclass(frozen=True, slots=True)
class Aligned:
    """A tokens row with its tables: they cover input_ids[start:]."""

    row: TokenRow
    tables: Tables

    @property
    def start(self) -> int:
        return len(self.row.input_ids) - int(self.tables.sampled_ids.shape[0])

    @property
    def tokens(self) -> int:
        return len(self.row.input_ids)

    @property
    def positions(self) -> int:
        """Tokens with a table."""
        return int(self.tables.sampled_ids.shape[0])


def table_row_id(raw: Mapping[str, Any], *, regenerate: bool) -> str | None:
    """The table row a tokens export row RAW's answer was stored under (see the module docstring)."""
    ref = raw.get("logprobs")
    if isinstance(ref, Mapping) and isinstance(ref.get("row"), str):
        return str(ref["row"])
    return feature_row_id(dict(raw), regenerate=regenerate)


def align(row: TokenRow, tables: Tables) -> tuple[Aligned | None, str]:
    """ROW with TABLES when they are its answer's (see the module docstring); else why not."""
    ids, t = row.input_ids, int(tables.sampled_ids.shape[0])
    if not 1 <= t < len(ids):
        return None, f"tables of {t} tokens, the row has {len(ids)} input_ids"
    start = len(ids) - t
    sampled = tables.sampled_ids.tolist()
    if ids[start:] != sampled:
        at = next(i for i in range(t) if ids[start + i] != sampled[i])
        return None, f"table {at} sampled id {sampled[at]}, the row's token {start + at} is {ids[start + at]}"
    masked = [i for i, m in enumerate(row.loss_mask) if m]
    if masked and masked[0] < start:
        return None, f"token {masked[0]} is loss-masked, the tables begin at token {start}"
    return Aligned(row, tables), ""


def _list(offsets: list[int], values: pa.Array) -> pa.Array:
    return pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), values)


def _offsets(lengths: list[int]) -> list[int]:
    return np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]).tolist()  # type: ignore[no-any-return]


PLAIN_SCHEMA = pa.schema([
    ("id", pa.string()), ("input_ids", pa.list_(pa.int32())), ("loss_mask", pa.list_(pa.int8())),
    ("topk_ids", pa.list_(pa.list_(pa.int32()))), ("topk_logprobs", pa.list_(pa.list_(pa.float32()))),
    ("sampled_logprobs", pa.list_(pa.float32())),
])

#: DistillKit's compressed_logit_schema() (sample_common.py) and the labels its trainer reads.
DISTILLKIT_SCHEMA = pa.schema([
    ("input_ids", pa.list_(pa.uint64())), ("labels", pa.list_(pa.int64())),
    ("compressed_logprobs", pa.list_(pa.list_(pa.uint8()))), ("bytepacked_indices", pa.list_(pa.list_(pa.uint8()))),
])


def plain_batch(rows: list[Aligned], k: int) -> pa.RecordBatch:
    """ROWS in the plain layout, each table's first K entries."""
    lengths = [r.tokens for r in rows]
    ids = np.concatenate([np.asarray(r.row.input_ids, np.int32) for r in rows])
    mask = np.concatenate([np.asarray(r.row.loss_mask, np.int8) for r in rows])
    # per token: K entries where a table is, none elsewhere
    per_token = np.concatenate([np.r_[np.zeros(r.start, np.int64), np.full(r.positions, k, np.int64)] for r in rows])
    inner = pa.array(np.concatenate([[0], np.cumsum(per_token)]).astype(np.int32))
    topk_ids = np.concatenate([np.asarray(r.tables.topk_ids)[:, :k].reshape(-1) for r in rows]).astype(np.int32)
    topk_lp = np.concatenate([np.asarray(r.tables.topk_logprobs)[:, :k].reshape(-1) for r in rows]).astype(np.float32)
    sampled = np.concatenate([np.r_[np.zeros(r.start, np.float32), np.asarray(r.tables.sampled_logprobs, np.float32)]
                              for r in rows])
    has = np.concatenate([np.r_[np.zeros(r.start, bool), np.ones(r.positions, bool)] for r in rows])
    outer = _offsets(lengths)
    return pa.RecordBatch.from_arrays([
        pa.array([r.row.id for r in rows], pa.string()),
        _list(outer, pa.array(ids)), _list(outer, pa.array(mask)),
        _list(outer, pa.ListArray.from_arrays(inner, pa.array(topk_ids))),
        _list(outer, pa.ListArray.from_arrays(inner, pa.array(topk_lp))),
        _list(outer, pa.array(sampled, mask=~has)),
    ], schema=PLAIN_SCHEMA)


@dataclass
class Fidelity:
    """How far the tables DistillKit decompresses are from the stored ones, over what was encoded."""

    entries: int = 0
    max_error: float = 0.0
    sum_error: float = 0.0

    def add(self, err: npt.NDArray[np.float64]) -> None:
        if err.size:
            self.entries += int(err.size)
            self.max_error = max(self.max_error, float(err.max()))
            self.sum_error += float(err.sum())

    @property
    def mean_error(self) -> float:
        return self.sum_error / self.entries if self.entries else 0.0


def distillkit_batch(rows: list[Aligned], cfg: dk.DistillKitConfig, fidelity: Fidelity) -> pa.RecordBatch:
    """ROWS in DistillKit's layout under CFG (its first cfg.k entries of each table); the error
    of what its decoder will read back is added to FIDELITY. Raises dk.VocabularyError for an id
    at or past cfg.d."""
    k = cfg.k
    tids, tlps, labels, positions = [], [], [], []
    for r in rows:
        ids = np.asarray(r.row.input_ids, np.int64)
        n = len(ids) - 1  # tables: one per position but the last
        nxt = ids[1: r.start]  # the prompt's next tokens, one-hot
        rest = np.arange(k - 1, dtype=np.int64)[None, :]
        rest = rest + (rest >= nxt[:, None])  # k - 1 other ids, none the next token
        tids.append(np.concatenate([nxt[:, None], rest], axis=1))
        tlps.append(np.concatenate([np.zeros((len(nxt), 1), np.float32),
                                    np.full((len(nxt), k - 1), PLACEHOLDER_LOGPROB, np.float32)], axis=1))
        sid, slp = dk.sort_tables(np.asarray(r.tables.topk_ids), np.asarray(r.tables.topk_logprobs, np.float32), k)
        tids.append(sid)
        tlps.append(slp)
        mask = np.asarray(r.row.loss_mask[1:], bool) & (np.arange(1, n + 1) >= r.start)
        labels.append(np.r_[np.where(mask, ids[:-1], IGNORE), IGNORE])
        positions.append(n)
    all_ids, all_lps = np.concatenate(tids), np.concatenate(tlps)
    if all_ids.size and int(all_ids.max()) >= cfg.d:
        raise dk.VocabularyError(f"token id {int(all_ids.max())} is past the config's vocabulary (d = {cfg.d}): "
                                 "give d, the model's vocabulary size, in --distillkit-config")
    packed, indices = dk.encode(cfg, all_ids, all_lps)
    real = np.concatenate([np.r_[np.zeros(r.start - 1, bool), np.ones(r.positions, bool)] for r in rows])
    _, back = dk.decode(cfg, packed[real], indices[real])
    fidelity.add(np.abs(back - all_lps[real].astype(np.float64)))
    outer = _offsets(positions)
    token_offsets = _offsets([r.tokens for r in rows])
    return pa.RecordBatch.from_arrays([
        _list(token_offsets, pa.array(np.concatenate([np.asarray(r.row.input_ids, np.uint64) for r in rows]))),
        _list(token_offsets, pa.array(np.concatenate(labels).astype(np.int64))),
        _list(outer, _fixed(packed)), _list(outer, _fixed(indices)),
    ], schema=DISTILLKIT_SCHEMA)


def _fixed(a: npt.NDArray[np.uint8]) -> pa.Array:
    """[N, m] bytes as N lists of m uint8."""
    n, m = a.shape
    return pa.ListArray.from_arrays(pa.array(np.arange(n + 1, dtype=np.int32) * m), pa.array(a.reshape(-1)))


def manifest_dict(manifest: Any) -> Mapping[str, Any]:
    """What the summary says of the tables' manifest."""
    return {"model": getattr(manifest, "model", None), "k": getattr(manifest, "k", None),
            "mode": str(getattr(manifest, "mode", "")), "temperature": getattr(manifest, "temperature", None)}
