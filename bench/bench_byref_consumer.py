"""The consumer by reference against inline, side by side in one run (issue 34).

    python -m bench.bench_byref_consumer --items 20000 --rounds 2

Builds N ShareGPT records of one 1-4 KB user turn each, enqueues them twice into one private
redis-server (run `inline` with `--prompts inline`, run `ref` with `--prompts reference`, its
packs in a local output directory), then drains each with one `consumer run --burst` against
the stand-in vLLM (fast: the consumer, not the engine, is what is measured), alternating the
modes ROUNDS times (each round enqueues afresh), and prints per mode: wall seconds, completions
per second, the consumer's CPU (user + system, from wait4) per completion, and the ratio
by reference / inline. The pack reads are the consumer's own (its log says how many packs it
fetched); see bench_packcache for the cache's hit rate with four consumers on one host.
A benchmark, not a test: the machine is noisy; compare the two columns of one run.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import orjson
import redis

from bench.bench_redis_items import turn_pool
from bench.common import BIN, start_redis, start_sim, table, timed


def make(path: Path, n: int) -> None:
    rng = random.Random(5)
    pool = turn_pool(2_000, 5)
    with open(path, "wb") as fh:
        for i in range(n):
            text, target = "", rng.randint(1000, 4000)
            while len(text) < target:
                text += rng.choice(pool) + " "
            fh.write(orjson.dumps({"id": str(i), "conversations": [{"from": "human", "value": f"{text} ({i})"}]}) + b"\n")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--items", type=int, default=20_000)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--concurrency", type=int, default=256)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="gq-bench-byref-"))
    try:
        data = work / "data.jsonl"
        make(data, args.items)
        (work / "redis").mkdir()
        srv, url = start_redis(work / "redis")
        sim, endpoint = start_sim(["--slots", "100000", "--step-time", "0", "--mean-tokens", "8"], core=None)
        env = {**os.environ, "REDIS_URL": url}
        conn = redis.Redis.from_url(url)
        got: dict[str, list[tuple[float, float]]] = {"inline": [], "reference": []}
        try:
            for r in range(args.rounds):
                for mode in ("inline", "reference") if r % 2 == 0 else ("reference", "inline"):
                    run = f"{mode[:3]}{r}"
                    subprocess.run([str(BIN / "producer"), "enqueue", str(data), "--run", run, "--output",
                                    str(work / "out"), "--max-tokens", "8", "--rejects", str(work / f"rej-{run}"),
                                    "--prompts", mode], env=env, check=True, capture_output=True)
                    wall, cpu, rc = timed([str(BIN / "consumer"), "run", "--run", run, "--endpoint", endpoint,
                                           "--burst", "-c", str(args.concurrency), "--spool",
                                           str(work / f"spool-{run}")], env)
                    if rc != 0:
                        raise SystemExit(f"consumer of run {run} exited {rc}")
                    got[mode].append((wall, cpu))
                    print(f"round {r} {mode}: {wall:.1f} s, {cpu:.1f} s CPU", file=sys.stderr)
                    conn.flushall()
        finally:
            sim.terminate()
            srv.terminate()
        n = args.items
        rows = [("mode", "rounds", "wall s (median)", "completions/s", "consumer CPU ms/completion")]
        med = {m: (statistics.median(w for w, _ in v), statistics.median(c for _, c in v)) for m, v in got.items()}
        for mode, (wall, cpu) in med.items():
            rows.append((mode, str(len(got[mode])), f"{wall:.1f}", f"{n / wall:,.0f}", f"{cpu / n * 1000:.3f}"))
        rows.append(("reference / inline", "", f"{med['reference'][0] / med['inline'][0]:.3f}",
                     f"{med['inline'][0] / med['reference'][0]:.3f}", f"{med['reference'][1] / med['inline'][1]:.3f}"))
        print(f"{n:,} items of one 1-4 KB turn, one consumer --burst -c {args.concurrency}, stand-in at 0 step time")
        print(table(rows))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
