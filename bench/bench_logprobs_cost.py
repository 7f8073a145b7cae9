"""What `--logprobs K` costs the whole genqueue path: throughput and consumer CPU per completion at
K = 0, 20 and the engine's maximum, side by side in one run (stand-in vLLM).

    python -m bench.bench_logprobs_cost                       # 400 items a run, 3 rounds
    python -m bench.bench_logprobs_cost --items 40 --rounds 1 --mean-tokens 32   # a smoke run

One Redis and one stand-in (zero step time, so the engine is never the bottleneck; pinned to core
0, started with --max-logprobs M, 128 by default: DistillKit's recommended K). Each round enqueues
the same items as one run per K, every run with --token-ids, the K > 0 ones with --logprobs K, and
runs a consumer (pinned to core 1, -c 64, --burst) on each in turn, the order rotating from round
to round. K = 0 is a run without tables; the largest K is the largest the engine's M lets a run
ask for. Measured per run: completions a second (wall, the consumer's start to its exit, the
stand-in's own JSON for K tables a token included), the consumer's CPU per completion (its
rusage), how busy that kept its core (CPU seconds over wall seconds: well under 100 %, the
consumer was not what limited the rate) and the table bytes shipped per generated token (status). The last columns are the medians
over rounds of each K's figure over K = 0's in the same round.

A benchmark, not a test: it prints its table. Ratios, not the absolute figures, carry from this
shared 2-core machine to another.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.common import BIN, pinned, start_redis, start_sim, table, timed
from genqueue.common.logprobs import request_fields

CONSUMER_CORE = 1


def largest_k(max_logprobs: int) -> int:
    """The largest --logprobs K an engine started with --max-logprobs MAX_LOGPROBS serves (a run
    asks for request_fields(K)'s top_logprobs)."""
    k = max_logprobs
    while k > 1 and request_fields(k)["top_logprobs"] > max_logprobs:
        k -= 1
    return k


def _status(run: str, env: dict[str, str]) -> dict[str, object]:
    out = subprocess.run([str(BIN / "producer"), "status", "--run", run, "--json"], env=env, capture_output=True,
                         text=True, check=True)
    st: dict[str, object] = json.loads(out.stdout)
    return st


def measure(args: argparse.Namespace, ks: list[int], work: Path) -> dict[int, list[dict[str, float]]]:
    """Per K, per round: completions/s, consumer CPU ms a completion, table bytes a token."""
    redis_proc, url = start_redis(work)
    env = {**os.environ, "REDIS_URL": url}
    data = work / "data.jsonl"
    with open(data, "w") as fh:
        fh.writelines(f'{{"conversations":[{{"from":"human","value":"Question {i}: explain the idea of item {i} '
                      f'in a few paragraphs, with an example."}}]}}\n' for i in range(args.items))
    figures: dict[int, list[dict[str, float]]] = {k: [] for k in ks}
    sim = None
    try:
        sim, endpoint = start_sim(["--slots", "100000", "--step-time", "0", "--mean-tokens", str(args.mean_tokens),
                                   "--max-logprobs", str(args.max_logprobs)])
        for r in range(args.rounds):
            order = ks[r % len(ks):] + ks[:r % len(ks)]
            for k in order:
                run = f"r{r}k{k}"
                subprocess.run([str(BIN / "producer"), "enqueue", str(data), "--run", run, "--output",
                                str(work / "out"), "--max-tokens", str(4 * args.mean_tokens), "--token-ids",
                                *(["--logprobs", str(k)] if k else []), "--rejects", str(work / "rej")],
                               env=env, check=True, stdout=subprocess.DEVNULL)
                cmd = pinned([str(BIN / "consumer"), "run", "--run", run, "--endpoint", endpoint, "--burst", "-c",
                              str(args.concurrency), "--spool", str(work / "spool" / run)], CONSUMER_CORE)
                wall, cpu, rc = timed(cmd, env)
                if rc != 0:
                    raise SystemExit(f"the consumer of K = {k} exited {rc}")
                tables = _status(run, env).get("logprobs")
                per_token = float(tables["bytes_per_token"] or 0) if isinstance(tables, dict) else 0.0
                figures[k].append({"rate": args.items / wall, "cpu": 1000 * cpu / args.items, "bytes": per_token,
                                   "busy": cpu / wall})
                print(f"round {r + 1} K = {k}: {args.items / wall:.1f} completions/s, "
                      f"{1000 * cpu / args.items:.2f} CPU ms/completion", file=sys.stderr, flush=True)
    finally:
        if sim is not None:
            sim.terminate()
        redis_proc.terminate()
    return figures


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--items", type=int, default=400)
    ap.add_argument("--mean-tokens", type=int, default=128)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-logprobs", type=int, default=128, help="the stand-in's --max-logprobs (vLLM's)")
    args = ap.parse_args()
    ks = [0, 20, largest_k(args.max_logprobs)]
    work = Path(tempfile.mkdtemp(prefix="gq-bench-logprobs-"))
    try:
        figures = measure(args, ks, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    base = figures[0]
    rows: list[tuple[str, ...]] = [("K", "rounds", "completions/s", "CPU ms/completion", "consumer busy",
                                    "table B/token", "throughput x K=0", "CPU x K=0")]
    for k, v in figures.items():
        rows.append((str(k), str(len(v)), f"{statistics.median(f['rate'] for f in v):.1f}",
                     f"{statistics.median(f['cpu'] for f in v):.2f}",
                     f"{statistics.median(f['busy'] for f in v):.0%}",
                     f"{statistics.median(f['bytes'] for f in v):.0f}" if k else "",
                     f"{statistics.median(f['rate'] / b['rate'] for f, b in zip(v, base, strict=True)):.2f}",
                     f"{statistics.median(f['cpu'] / b['cpu'] for f, b in zip(v, base, strict=True)):.2f}"))
    print(f"{args.items} items a run (single-turn, ~{args.mean_tokens} generated tokens each), consumer -c "
          f"{args.concurrency} pinned to one core, stand-in with zero step time and --max-logprobs "
          f"{args.max_logprobs}; medians over {args.rounds} rounds, the K order rotating")
    print(table(rows))


if __name__ == "__main__":
    main()
