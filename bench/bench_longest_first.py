"""Longest first: a run's makespan with and without `producer enqueue --longest-first`.

    python -m bench.bench_longest_first --items 2000 --slots 32

The stand-in runs with --length-hints: each request's mean output length is its record's
original answer length (what longest-first orders by), drawn with the stand-in's usual
heavy-tailed noise. Same data, same engine, one consumer; makespan = the consumer's wall time
from start to drained.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import tempfile
from pathlib import Path

from bench.common import BIN, pinned, start_redis, start_sim, table, timed


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--items", type=int, default=2000)
    ap.add_argument("--slots", type=int, default=32)
    ap.add_argument("--step-time", type=float, default=0.002)
    ap.add_argument("--seed", type=int, default=3)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    work = Path(tempfile.mkdtemp(prefix="gq-bench-lf-"))
    redis_proc, url = start_redis(work)
    sim, endpoint = start_sim(["--slots", str(args.slots), "--step-time", str(args.step_time), "--length-hints",
                               "--max-model-len", "100000"])
    env = {**os.environ, "REDIS_URL": url}
    data = work / "data.jsonl"
    with open(data, "w") as fh:
        for i in range(args.items):
            n = max(1, int(rng.lognormvariate(4.6, 1.1)))  # original answer tokens: median ~100, heavy tail
            fh.write(json.dumps({"conversations": [
                {"from": "human", "value": f"question {i} [len={n}]"},
                {"from": "gpt", "value": "w " * n}]}) + "\n")
    rows = [("order", "makespan s", "items/s")]
    results = {}
    try:
        for label, flag in (("input order", []), ("longest first", ["--longest-first"])):
            run = "lf" if flag else "plain"
            subprocess.run([str(BIN / "producer"), "enqueue", str(data), "--run", run, "--multi-turn", "last",
                            "--output", str(work / "out"), "--max-tokens", "20000", "--rejects", str(work / "rej"),
                            *flag], env=env, check=True, stdout=subprocess.DEVNULL)
            cmd = pinned([str(BIN / "consumer"), "run", "--run", run, "--endpoint", endpoint, "--burst",
                          "-c", str(args.slots + 8), "--spool", str(work / "spool" / run), "--shard-max-age", "1"], 1)
            wall, _, rc = timed(cmd, env)
            if rc != 0:
                raise SystemExit(f"consumer exited {rc}")
            results[label] = wall
            rows.append((label, f"{wall:.1f}", f"{args.items / wall:,.0f}"))
    finally:
        sim.terminate()
        redis_proc.terminate()
        shutil.rmtree(work, ignore_errors=True)
    print(table(rows))
    print(f"\nlongest first / input order makespan = {results['longest first'] / results['input order']:.3f}")


if __name__ == "__main__":
    main()
