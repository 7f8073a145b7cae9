"""Producer at scale: records/s for --dry-run and a real enqueue, and Redis bytes per item.

    python -m bench.bench_producer --records 1000000

Builds N ShareGPT records of realistic size (1-4 turns, ~1.6 KB of text on average, some
with system prompts), then runs `producer enqueue` as a user does, against a private
redis-server on a free port. Prints one table; a benchmark, not a test.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import orjson
import redis

from bench.common import start_redis

WORDS = ["the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "with", "was", "on", "be", "by", "this", "are", "from", "at", "or", "an", "have", "not", "but", "which", "model", "data", "system", "function", "value", "error", "output", "input", "process", "memory", "network", "query", "result", "token", "gradient", "layer", "batch", "sequence", "attention", "vector", "matrix", "python", "server", "request", "response"]


def make_records(path: Path, n: int, seed: int = 0) -> int:
    """Write N records; returns the number of bytes of conversation text."""
    rng = random.Random(seed)
    text_bytes = 0
    with open(path, "wb") as fh:
        buf = []
        for i in range(n):
            turns = rng.choice((1, 1, 1, 2, 2, 3, 4))
            conv = []
            for t in range(turns):
                q = " ".join(rng.choices(WORDS, k=rng.randint(20, 120))) + f" ({i}.{t})"
                a = " ".join(rng.choices(WORDS, k=rng.randint(40, 200)))
                conv += [{"from": "human", "value": q}, {"from": "gpt", "value": a}]
                text_bytes += len(q) + len(a)
            rec = {"id": str(i), "conversations": conv}
            if i % 5 == 0:
                rec["system"] = "You are a helpful assistant that answers precisely."
            buf.append(orjson.dumps(rec))
            if len(buf) >= 10000:
                fh.write(b"\n".join(buf) + b"\n")
                buf = []
        if buf:
            fh.write(b"\n".join(buf) + b"\n")
    return text_bytes


def producer(*args: str, env: dict[str, str]) -> tuple[dict, float]:
    exe = Path(sys.executable).parent / "producer"
    t0 = time.perf_counter()
    out = subprocess.run([str(exe), "enqueue", *args, "--json"], capture_output=True, check=True, env=env)
    return orjson.loads(out.stdout), time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--records", type=int, default=1_000_000)
    ap.add_argument("--batch-size", type=int, default=32)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="gq-bench-producer-"))
    try:
        data = work / "data.jsonl"
        t0 = time.perf_counter()
        make_records(data, args.records)
        print(f"built {args.records:,} records ({data.stat().st_size / 1e6:.0f} MB) in {time.perf_counter() - t0:.1f} s",
              file=sys.stderr)
        srv, url = start_redis(work)
        conn = redis.Redis.from_url(url)
        env = {**os.environ, "REDIS_URL": url}
        # its own output folder: the default (./genqueue-out, where run.json goes at the first
        # enqueue) is the checkout when the suite's smoke test runs the benches there
        common = [str(data), "--run", "bench", "--batch-size", str(args.batch_size), "--rejects", str(work / "rej"),
                  "--output", str(work / "out")]
        dry, dry_s = producer(*common, "--dry-run", env=env)
        before = conn.info("memory")["used_memory"]
        real, real_s = producer(*common, env=env)
        after = conn.info("memory")["used_memory"]
        srv.terminate()
        used = after - before
        rows = [
            ("records", f"{args.records:,}"),
            ("items / jobs", f"{real['items']:,} / {real['jobs']:,}"),
            ("dry run", f"{dry_s:.1f} s = {args.records / dry_s:,.0f} records/s"),
            ("real enqueue", f"{real_s:.1f} s = {args.records / real_s:,.0f} records/s"),
            ("prompt text enqueued", f"{real['prompt_chars'] / 1e6:.0f} MB ({real['prompt_chars'] / real['items']:.0f} B/item)"),
            ("Redis memory used", f"{used / 1e6:.0f} MB = {used / real['items']:.0f} B/item"),
            ("Redis bytes per prompt byte", f"{used / real['prompt_chars']:.2f}"),
        ]
        assert dry["records"] == real["records"] == args.records
        w = max(len(k) for k, _ in rows)
        print("\n".join(f"{k.ljust(w)}  {v}" for k, v in rows))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
