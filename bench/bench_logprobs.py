"""Log-probability table sizes: bytes per generated token at K = 20, 64 and 128, as stored and in
each `producer export-logprobs` layout, measured with the real encoders, and projected.

    python -m bench.bench_logprobs            # rows of 2,000 generated tokens
    python -m bench.bench_logprobs --quick    # rows of 200 (a smoke run)

Tables are made as a 150k-vocabulary model's look (most mass on the first few ids, the rest
falling off as a power of the rank; ids spread over the vocabulary), rounded through fp16 as the
store keeps them. For each K:
- stored: rows packed by the store's own writer (common/features/logprobs.pack_table: int32 ids,
  fp16 values, the sampled token's own), per generated token of a row;
- plain: the plain layout's Parquet (pyarrow's default snappy), per generated token, a row being
  a 200-token prompt and its answer;
- distillkit: DistillKit's layout at two configs, its README's "recommended" shape (16 exact
  values in bf16, a polynomial fit of the rest over 6 terms) and every value exact in bf16, with
  the error its decoder reads back (the largest and the mean |decoded - stored|);
and the projection for a million rows of 2,000 generated tokens. A benchmark, not a test: it
prints its tables.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq

from bench.common import table
from genqueue.common.features.logprobs import LogprobsTable, pack_table
from genqueue.producer.export import distillkit as dk
from genqueue.producer.export.features import TokenRow
from genqueue.producer.export.logprobrows import Aligned, Fidelity, distillkit_batch, plain_batch

VOCAB = 151_936
PROMPT = 200
ROWS_PROJECTED = 1_000_000
TOKENS_PROJECTED = 2_000
KS = (20, 64, 128)


def tables(t: int, k: int, rng: np.random.Generator) -> LogprobsTable:
    """T positions' top-K: a peaked head, a power-law tail, fp16 as stored."""
    head = rng.uniform(0.3, 0.95, size=(t, 1))
    ranks = np.arange(1, k + 1)[None, :]
    p = head * ranks ** -rng.uniform(1.1, 2.0, size=(t, 1))
    p[:, 1:] *= (1 - head) / p[:, 1:].sum(axis=1, keepdims=True) * rng.uniform(0.5, 0.95, size=(t, 1))
    lp = np.log(p).astype(np.float16).astype(np.float32)
    lp = -np.sort(-lp, axis=1)
    ids = rng.integers(0, VOCAB, size=(t, k))
    return LogprobsTable.of(ids[:, 0], lp[:, 0], ids, lp)


def row_of(t: int, k: int, rng: np.random.Generator, i: int) -> Aligned:
    tab = tables(t, k, rng)
    prompt = rng.integers(0, VOCAB, size=PROMPT).tolist()
    row = TokenRow(f"r{i}", f"r{i}", prompt + tab.sampled_ids.tolist(), [0] * PROMPT + [1] * t)
    return Aligned(row, tab)


def parquet_bytes(batch: Any, path: Path) -> int:
    with pq.ParquetWriter(path, batch.schema) as w:
        w.write_batch(batch)
    return path.stat().st_size


def configs(k: int) -> list[tuple[str, dk.DistillKitConfig]]:
    exact = min(16, k)
    rec = {"d": VOCAB, "k": k, "exact_k": exact, "exact_dtype": "bfloat16", "residual_bins": [],
           "delta_encoding": False, "term_dtype": "float32"}
    if exact < k:
        rec["polynomial_terms"] = [0, 1, 2, 3, 4, "sqrt"]
    full = {"d": VOCAB, "k": k, "exact_k": k, "exact_dtype": "bfloat16", "residual_bins": [], "delta_encoding": False}
    return [("recommended shape", dk.DistillKitConfig.from_mapping(rec, where="bench")),
            ("all exact, bf16", dk.DistillKitConfig.from_mapping(full, where="bench"))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="rows of 200 generated tokens, two of them")
    args = ap.parse_args()
    t, n = (200, 2) if args.quick else (2000, 8)
    rng = np.random.default_rng(0)
    out = [("K", "what", "B / generated token", "of which columns", f"{ROWS_PROJECTED:,} rows x 2,000 tokens",
            "decoded error max / mean", "time a row")]
    with tempfile.TemporaryDirectory() as tmp:
        for k in KS:
            rows = [row_of(t, k, rng, i) for i in range(n)]
            t0 = time.perf_counter()
            stored = sum(len(pack_table(r.row.feature_row, "c" * 16, r.tables)) + 16 for r in rows)  # + frame
            spent = (time.perf_counter() - t0) / n
            per = stored / (n * t)
            out.append((str(k), "stored (fp16, int32)", f"{per:,.1f}", f"formula {(k + 1) * 6}",
                        f"{per * ROWS_PROJECTED * TOKENS_PROJECTED / 1e12:,.2f} TB", "fp16 rounding",
                        f"{spent * 1000:,.1f} ms"))
            t0 = time.perf_counter()
            size = parquet_bytes(plain_batch(rows, k), Path(tmp) / f"plain{k}.parquet")
            spent = (time.perf_counter() - t0) / n
            per = size / (n * t)
            out.append((str(k), "plain Parquet", f"{per:,.1f}", f"raw {(t * (k * 8 + 4) + (t + PROMPT) * 5) / t:,.0f}",
                        f"{per * ROWS_PROJECTED * TOKENS_PROJECTED / 1e12:,.2f} TB", "0 (the stored values)",
                        f"{spent * 1000:,.1f} ms"))
            for label, cfg in configs(k):
                fid = Fidelity()
                t0 = time.perf_counter()
                batch = distillkit_batch(rows, cfg, fid)
                size = parquet_bytes(batch, Path(tmp) / f"dk{k}.parquet")
                spent = (time.perf_counter() - t0) / n
                per = size / (n * t)
                raw = (cfg.logprob_bytes + cfg.index_bytes) * (t + PROMPT - 1) / t
                out.append((str(k), f"distillkit, {label} ({cfg.logprob_bytes} + {cfg.index_bytes} B)",
                            f"{per:,.1f}", f"raw {raw:,.0f}",
                            f"{per * ROWS_PROJECTED * TOKENS_PROJECTED / 1e12:,.2f} TB",
                            f"{fid.max_error:.3g} / {fid.mean_error:.3g}", f"{spent * 1000:,.1f} ms"))
    print(f"Bytes per generated token, rows of a {PROMPT}-token prompt and {t:,} generated tokens ({n} rows), "
          f"vocabulary {VOCAB:,}; 'raw' counts the columns' bytes before Parquet's encoding (prompt positions "
          "included: the plain layout's are empty lists, DistillKit's are placeholder tables):\n")
    print(table(out))


if __name__ == "__main__":
    main()
