"""Feature sizes: bytes per token by dtype and layer count, measured in real shards, and projected.

    python -m bench.bench_features            # rows of 2,000 tokens
    python -m bench.bench_features --quick    # rows of 200 tokens (a smoke run)

For the tiny test model (hidden 128, 3 layers) and a 27B target (hidden 5120, 4 layers: EAGLE-3's
three aux layers and the last), in fp8 e4m3 (a scale per token) and bf16:
- bytes a token takes by the formula (common/features/codec.bytes_per_token), by layer count;
- the same measured: rows of the stand-in's features written by the real shard writer to a spool
  (safetensors header, frame and padding included), per token of a 2,000-token row;
- the projection for a million rows of 2,000 tokens, and the time to encode and write a row;
- the fp8 error measured (decoded against the input): the largest relative error where fp8 keeps
  its full precision (|x| >= amax / 28672), and the relative RMS error of whole rows and of their
  quietest layer (a scale shared by a token's layers is set by its loudest), on the stand-in's
  features and on Gaussian states with a few massive activations.
A benchmark, not a test: it prints its tables.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.common import table
from genqueue.common.features import (
    FeatureDtype,
    FeatureManifest,
    FeatureShardWriter,
    bytes_per_token,
    encode,
    standin_features,
)

MODELS = (("tiny (hidden 128)", 128, 3), ("27B (hidden 5120)", 5120, 4))
ROWS = 1_000_000


def measured(hidden: int, layers: int, dtype: FeatureDtype, tokens: int, rows: int) -> tuple[float, float]:
    """(bytes a token takes in a real shard, seconds to encode and write one row) for ROWS rows of
    TOKENS tokens."""
    ids = np.arange(tokens) % 50_000
    x = standin_features(ids, tuple(range(layers)), hidden)
    man = FeatureManifest("bench", "r", tuple(range(layers)), dtype, hidden, "t", "v", "g")
    with tempfile.TemporaryDirectory() as spool:
        w = FeatureShardWriter(Path(spool), "run", "bench", man)
        t0 = time.perf_counter()
        for i in range(rows):
            w.append(f"row-{i}", ids, x)
        spent = (time.perf_counter() - t0) / rows
        size = w.open_bytes
        w.seal()
    return size / (rows * tokens), spent


def fp8_error(x: np.ndarray) -> tuple[float, float, float]:
    """(largest relative error where fp8 is normal, relative RMS error, the same of the layer of
    smallest magnitude) of X encoded in fp8."""
    enc = encode(x, FeatureDtype.FP8_E4M3)
    back = enc.decode()
    normal = np.abs(x) >= np.abs(x).max(axis=(1, 2), keepdims=True) / 28672
    rel = (np.abs(back - x)[normal] / np.abs(x)[normal]).max()
    rms = np.sqrt(np.mean((back - x) ** 2) / np.mean(x**2))
    quiet = int(np.argmin(np.abs(x).max(axis=(0, 2))))
    rms_quiet = np.sqrt(np.mean((back - x)[:, quiet] ** 2) / np.mean(x[:, quiet] ** 2))
    return float(rel), float(rms), float(rms_quiet)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="rows of 200 tokens, one each")
    args = ap.parse_args()
    tokens = 200 if args.quick else 2000

    rows = [("model", "layers", "fp8 B/token", "bf16 B/token")]
    for name, hidden, _ in MODELS:
        for layers in range(1, 6):
            rows.append((name, str(layers), f"{bytes_per_token(layers, hidden, FeatureDtype.FP8_E4M3):,}",
                         f"{bytes_per_token(layers, hidden, FeatureDtype.BF16):,}"))
    print("Bytes a token takes by the formula (features + fp8 scale + int64 token id):\n")
    print(table(rows))

    rows = [("model", "dtype", "formula B/token", f"measured B/token ({tokens}-token rows)", "per row",
             f"{ROWS:,} rows x 2,000 tokens", "encode+write a row")]
    for name, hidden, layers in MODELS:
        for dtype in FeatureDtype:
            formula = bytes_per_token(layers, hidden, dtype)
            per_token, spent = measured(hidden, layers, dtype, tokens, 1 if args.quick or hidden > 1000 else 20)
            total = per_token * ROWS * 2000 if not args.quick else formula * ROWS * 2000
            rows.append((f"{name}, {layers} layers", dtype.value, f"{formula:,}", f"{per_token:,.1f}",
                         f"{(per_token - formula) * tokens:,.0f} B over", f"{total / 1e12:,.2f} TB",
                         f"{spent * 1000:,.0f} ms"))
    print(f"\nIn real shards (the shard writer, fsync per row), and projected to {ROWS:,} rows of 2,000 tokens:\n")
    print(table(rows))

    rng = np.random.default_rng(0)
    cases = [("stand-in, tiny model's layers 0-2", standin_features(np.arange(tokens), (0, 1, 2), 128)),
             ("Gaussian, 4 layers x 1024", rng.normal(size=(tokens, 4, 1024)).astype(np.float32))]
    for times in (300, 10_000):
        gauss = rng.normal(size=(tokens, 4, 1024)).astype(np.float32)
        gauss[:, 1:, rng.integers(0, 1024, size=4)] *= times  # massive activations in 4 channels of layers 1-3
        cases.append((f"the same, 4 channels of layers 1-3 x{times:,}", gauss))
    rows = [("fp8 e4m3, a scale per token", "max relative error (normal range)", "relative RMS error",
             "the quietest layer's")]
    for label, x in cases:
        rel, rms, quiet = fp8_error(x)
        rows.append((label, f"{rel:.4f} (bound 1/17 = {1 / 17:.4f})", f"{rms:.4f}", f"{quiet:.4f}"))
    print("\nfp8 error measured (decoded float32 against the input):\n")
    print(table(rows))


if __name__ == "__main__":
    main()
