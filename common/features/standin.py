"""The stand-in engine's hidden states: a fixed function of (token id, position, layer, hidden
size, seed), so the stand-in server and the tests that check its captures compute the same
features without sharing any state.

Each vector is SplitMix64 of its key and the element's index, mapped to [-1, 1), times a
per-layer magnitude (layer id + 1: layers differ in size, as a real model's do), and rounded to
bfloat16, as vLLM hands hidden states over. The same inputs give the same bits on every machine.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from genqueue.common.features.codec import Float32Array, bf16_dtype

U64 = npt.NDArray[np.uint64]


def _splitmix(z: U64) -> U64:
    z = z + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def standin_features(token_ids: npt.ArrayLike, layer_ids: tuple[int, ...], hidden: int, seed: int = 0) -> Float32Array:
    """The stand-in's hidden states of a row: [tokens, layers, hidden] float32 (bf16 values),
    token t at position t. Raises ValueError for negative ids or a hidden size below 1."""
    ids = np.asarray(token_ids, dtype=np.int64).reshape(-1)
    return _features(ids, np.arange(ids.size, dtype=np.int64), layer_ids, hidden, seed)


def standin_vector(token_id: int, position: int, layer: int, hidden: int, seed: int = 0) -> Float32Array:
    """One token's vector of one layer at POSITION, as standin_features gives it there ([hidden])."""
    rows = _features(np.array([token_id], dtype=np.int64), np.array([position], dtype=np.int64), (layer,), hidden, seed)
    out: Float32Array = rows[0, 0]
    return out


def _features(ids: npt.NDArray[np.int64], positions: npt.NDArray[np.int64], layer_ids: tuple[int, ...], hidden: int,
              seed: int) -> Float32Array:
    if hidden < 1 or (ids < 0).any() or (positions < 0).any() or any(layer < 0 for layer in layer_ids) or seed < 0:
        raise ValueError("token ids, positions, layer ids and the seed are not negative; the hidden size is positive")
    key = _splitmix(np.full(1, seed, dtype=np.uint64) ^ np.uint64(hidden))
    key = _splitmix(key ^ ids.astype(np.uint64))[:, None]  # [T, 1]
    key = _splitmix(key ^ positions.astype(np.uint64)[:, None])
    layers = np.asarray(layer_ids, dtype=np.uint64)
    key = _splitmix(key ^ layers[None, :])[:, :, None]  # [T, L, 1]
    bits = _splitmix(key ^ np.arange(hidden, dtype=np.uint64)[None, None, :])  # [T, L, H]
    unit = (bits >> np.uint64(40)).astype(np.float64) / float(1 << 23) - 1.0  # 24 bits in [-1, 1)
    magnitude = (layers.astype(np.float64) + 1.0)[None, :, None]
    out: Float32Array = (unit * magnitude).astype(bf16_dtype()).astype(np.float32)
    return out
