"""Stored features against the model (pure: arrays in, findings out): which rows a check
samples, how far a stored row may be from a reference forward pass, and where it first is not.

The reference is a transformers forward pass over the row's own token ids with the same weights,
in float32 (featureforward.py). The engine computes in bf16, so its hidden states stray from
float32's by bf16 arithmetic (up to ~0.045 of a token's vector at the last layer of the random
tiny model over 300 tokens; a real model's outliers are in the norm too), and the stored row
strays from the engine's by its dtype's bound (codec.error_bound). So one token's vector in one
layer, x (stored, decoded) against r (the reference), is within reach when

    |x - r| / |r|  <=  T + rel (1 + T) + scaled * s * sqrt(hidden) / |r|

(|.| the vector's 2-norm; T the arithmetic tolerance, --tolerance; rel and scaled the dtype's
bound, s the token's fp8 scale, 1 for bf16): the engine's vector within T |r| of r, so at most
(1 + T)|r| long, then each stored element within rel |x| + scaled s of the engine's. The wrong
layer, another token's features or a position off by one are 0.7 and more away.

Layer ids as the capture names them (vLLM's eagle_aux_hidden_state_layer_ids): k < L is
transformers' hidden_states[k] (0: the embeddings); L, the layer count, the last decoder layer's
output before the final norm.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field

import numpy as np

from genqueue.common.features.codec import Float32Array, error_bound
from genqueue.common.features.row import FeatureRow

#: A reference vector shorter than this is taken as this long (an all-zero state: no division by 0).
NORM_FLOOR = 1e-6


def rank(row: str) -> float:
    """ROW's place in [0, 1) by the sha256 of its id: the same on every check, spread evenly."""
    return int.from_bytes(hashlib.sha256(row.encode()).digest()[:8], "big") / 2.0**64


def sampled(rows: list[str], *, share: float | None = None, count: int | None = None) -> list[str]:
    """The rows a check reads of ROWS: those whose rank is below SHARE, or the COUNT lowest in
    rank (one of the two); in rank order. The same rows every time, and a larger share or
    count only adds rows."""
    if (share is None) == (count is None):
        raise ValueError("a sample is a share or a count")
    ordered = sorted(rows, key=lambda r: (rank(r), r))
    if share is not None:
        return [r for r in ordered if rank(r) < share]
    return ordered[:count]


@dataclass(frozen=True, slots=True)
class LayerMismatch:
    """A row's layer that leaves the reference's reach: first at POSITION (of TOKENS), OFF
    positions in all, with relative ERROR there against its REACH."""

    row: str
    shard: str
    layer: int
    position: int
    tokens: int
    off: int
    error: float
    reach: float

    def line(self) -> str:
        return (f"row {self.row}: layer {self.layer} differs first at position {self.position} ({self.off} of "
                f"{self.tokens} positions off): relative error {self.error:.4f} > tolerance {self.reach:.4f} "
                f"(shard {self.shard})")


@dataclass(frozen=True, slots=True)
class RowProblem:
    """A row that could not be compared, or whose token ids are not its tokens row's: WHY."""

    row: str
    why: str

    def line(self) -> str:
        return f"row {self.row}: {self.why}"


def relative_error(got: Float32Array, want: Float32Array) -> Float32Array:
    """[tokens, layers]: |got - want| / |want| of each token's vector in each layer."""
    diff = np.linalg.norm(got.astype(np.float64) - want.astype(np.float64), axis=2)
    norm = np.maximum(np.linalg.norm(want.astype(np.float64), axis=2), NORM_FLOOR)
    out: Float32Array = (diff / norm).astype(np.float32)
    return out


def reach(row: FeatureRow, want: Float32Array, tolerance: float) -> Float32Array:
    """[tokens, layers]: how far each token's vector in each layer of ROW may be from WANT (the
    module's docstring)."""
    bound = error_bound(row.encoded.dtype)
    scales = row.encoded.scales if row.encoded.scales is not None else np.ones(row.encoded.tokens, np.float32)
    norm = np.maximum(np.linalg.norm(want.astype(np.float64), axis=2), NORM_FLOOR)
    hidden = math.sqrt(row.encoded.hidden)
    out: Float32Array = (tolerance + bound.rel * (1 + tolerance)
                         + bound.scaled * scales.astype(np.float64)[:, None] * hidden / norm).astype(np.float32)
    return out


@dataclass(frozen=True, slots=True)
class RowComparison:
    """One stored row against its reference: the largest relative error per layer and each
    layer's first departure (none when the row matches)."""

    worst: tuple[float, ...]
    mismatches: tuple[LayerMismatch, ...]


def compare_row(row: FeatureRow, shard: str, want: Float32Array, tolerance: float) -> RowComparison:
    """ROW (stored in SHARD) against WANT, the reference's [tokens, layers, hidden] over its ids
    and layers. Raises ValueError when the shapes differ (another model)."""
    got = row.features()
    if got.shape != want.shape:
        raise ValueError(f"the reference's features are {list(want.shape)}, the row's {list(got.shape)}")
    err = relative_error(got, want)
    limit = reach(row, want, tolerance)
    found = []
    for j, layer in enumerate(row.layer_ids):
        off = np.flatnonzero(err[:, j] > limit[:, j])
        if off.size:
            t = int(off[0])
            found.append(LayerMismatch(row.row, shard, layer, t, got.shape[0], int(off.size), float(err[t, j]),
                                       float(limit[t, j])))
    return RowComparison(tuple(float(v) for v in err.max(axis=0)), tuple(found))


@dataclass
class CheckReport:
    """What a check found: rows and tokens compared, the largest relative error per layer id,
    every mismatch, and the ids check against the tokens export (when given)."""

    layer_ids: tuple[int, ...]
    rows_stored: int = 0
    rows_checked: int = 0
    tokens_checked: int = 0
    worst: dict[int, float] = field(default_factory=dict)
    mismatches: list[LayerMismatch] = field(default_factory=list)
    problems: list[RowProblem] = field(default_factory=list)
    ids_checked: int = 0  # tokens rows whose features' ids were compared with theirs
    ids_differ: int = 0
    rows_without_features: int = 0  # tokens rows no stored row is named for (not a capture's fault)
    features_without_rows: int = 0  # stored rows no tokens row names (an outcome the export leaves out)

    def add(self, comparison: RowComparison, tokens: int) -> None:
        self.rows_checked += 1
        self.tokens_checked += tokens
        for layer, value in zip(self.layer_ids, comparison.worst, strict=True):
            self.worst[layer] = max(self.worst.get(layer, 0.0), value)
        self.mismatches.extend(comparison.mismatches)

    @property
    def rows_failed(self) -> int:
        return len({m.row for m in self.mismatches} | {p.row for p in self.problems})

    @property
    def ok(self) -> bool:
        return not (self.mismatches or self.problems)

    def lines(self) -> list[str]:
        """One line per mismatch and problem, in the order found."""
        return [m.line() for m in self.mismatches] + [p.line() for p in self.problems]

    def summary(self, tolerance: float) -> str:
        worst = ", ".join(f"{k} {v:.4f}" for k, v in sorted(self.worst.items())) or "none"
        ids = ""
        if self.ids_checked or self.rows_without_features or self.features_without_rows:
            ids = f"; token ids: {self.ids_checked:,} tokens rows checked, {self.ids_differ:,} differ"
            if self.rows_without_features:
                ids += f", {self.rows_without_features:,} without features"
            if self.features_without_rows:
                ids += f", {self.features_without_rows:,} stored rows no tokens row names"
        verdict = "all match" if self.ok else f"{self.rows_failed:,} rows fail"
        return (f"{verdict}: {self.rows_checked:,} of {self.rows_stored:,} rows checked ({self.tokens_checked:,} "
                f"tokens), largest relative error by layer: {worst} (tolerance {tolerance} + the dtype's bound)"
                f"{ids}")
