"""Prefix-cache locality: prefill tokens computed against prefill tokens requested, for each-mode
data (multi-turn conversations cut into one item per turn) on a fleet of stand-ins with a
prefix cache.

    python -m bench.bench_locality --conversations 600

Each turn's prompt is the conversation so far (its earlier questions and original answers):
turn k+1 starts with turn k's whole prompt, so an engine that served turn k a moment ago holds
its blocks and computes only the new part. The same data is enqueued three ways, each on four
fresh stand-ins (`--prefix-cache-blocks`, an LRU of prompt blocks counted as vLLM counts
`vllm:prefix_cache_queries_total` and `..._hits_total`), one consumer each:

- no locality: jobs of one item, so a conversation's turns go to whichever consumer dequeues
  them, on any engine;
- locality, input order: jobs of --batch-size; a job holds whole conversations
  (producer/enqueue/jobwriter.py) and a consumer sends a job's items in order;
- locality, --longest-first: conversations ordered by their summed cost, their turns kept
  together (producer/enqueue/order.py).

computed / requested = 1 - hits / queries over the four engines; "ideal" is what an engine
that held every earlier turn would compute: each conversation's last prompt once (within a
block: the stand-in caches whole 16-token blocks, and the last prompt token is always computed).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import subprocess
import tempfile
import urllib.request
from pathlib import Path

from bench.common import BIN, start_redis, start_sim, table

ENGINES = 4

VARIANTS: dict[str, tuple[str, list[str]]] = {  # label -> (jobs of, enqueue flags)
    "no locality (jobs of 1)": ("1", []),
    "locality, input order": ("batch", []),
    "locality, --longest-first": ("batch", ["--longest-first"]),
}


def counters(endpoint: str) -> dict[str, float]:
    with urllib.request.urlopen(endpoint.removesuffix("/v1") + "/metrics", timeout=5) as r:
        text = r.read().decode()
    out = {}
    for name in ("prefix_cache_queries_total", "prefix_cache_hits_total"):
        m = re.search(rf"^vllm:{name}\{{[^}}]*\}} ([0-9.e+]+)$", text, re.MULTILINE)
        out[name] = float(m.group(1)) if m else 0.0
    return out


def make_data(path: Path, n: int, seed: int) -> tuple[int, int]:
    """N conversations of 2-6 turns; returns (prompt tokens requested, ideal computed), as the
    stand-in counts prompt tokens (characters / 4 + 4 a message)."""
    rng = random.Random(seed)
    requested = ideal = 0
    with open(path, "w") as fh:
        for i in range(n):
            conv, chars, msgs = [], 0, 0
            for t in range(rng.randint(2, 6)):
                q = f"conversation {i} question {t}: " + "why " * rng.randint(20, 80)
                a = "because " * rng.randint(40, 200)
                conv += [{"from": "human", "value": q}, {"from": "gpt", "value": a}]
                chars, msgs = chars + len(q), msgs + 1
                requested += chars // 4 + 4 * msgs  # this turn's prompt: everything before its answer
                last = chars // 4 + 4 * msgs
                chars, msgs = chars + len(a), msgs + 1
            ideal += last
            fh.write(json.dumps({"conversations": conv}) + "\n")
    return requested, ideal


def one_run(label: str, args: argparse.Namespace, work: Path, env: dict[str, str], data: Path) -> dict[str, float]:
    jobs, flags = VARIANTS[label]
    run = re.sub(r"[^a-z0-9]+", "-", label.lower()).strip("-")
    sims, engines = [], []
    try:
        for i in range(ENGINES):
            proc, endpoint = start_sim(["--slots", str(args.slots), "--step-time", str(args.step_time),
                                        "--mean-tokens", str(args.mean_tokens), "--max-model-len", "100000",
                                        "--prefix-cache-blocks", str(args.cache_blocks), "--seed", str(i)], None)
            sims.append(proc)
            engines.append(endpoint)
        batch = str(args.batch_size) if jobs == "batch" else "1"
        subprocess.run([str(BIN / "producer"), "enqueue", str(data), "--run", run, "--multi-turn", "each",
                        "--output", str(work / "out"), "--max-tokens", str(args.max_tokens), "--rejects",
                        str(work / "rej"), "--batch-size", batch, *flags],
                       env=env, check=True, stdout=subprocess.DEVNULL)
        procs = [subprocess.Popen([str(BIN / "consumer"), "run", "--run", run, "--endpoint", e, "--burst", "-c",
                                   str(args.slots), "--spool", str(work / "spool" / f"{run}-{i}"),
                                   "--shard-max-age", "1"], env=env, stdout=subprocess.DEVNULL,
                                  stderr=open(work / f"{run}-{i}.log", "wb"))  # noqa: SIM115
                 for i, e in enumerate(engines)]
        codes = [p.wait() for p in procs]
        if any(codes):
            raise SystemExit(f"{label}: consumer exit codes {codes} (logs in {work})")
        per = [counters(e) for e in engines]
    finally:
        for p in sims:
            p.terminate()
            p.wait()
    q = sum(c["prefix_cache_queries_total"] for c in per)
    h = sum(c["prefix_cache_hits_total"] for c in per)
    rates = [c["prefix_cache_hits_total"] / c["prefix_cache_queries_total"] if c["prefix_cache_queries_total"]
             else 0.0 for c in per]
    return {"queries": q, "hits": h, "computed": (q - h) / q if q else 0.0, "min_rate": min(rates),
            "max_rate": max(rates)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--conversations", type=int, default=300)
    ap.add_argument("--slots", type=int, default=16)
    ap.add_argument("--step-time", type=float, default=0.001)
    ap.add_argument("--mean-tokens", type=int, default=30)
    ap.add_argument("--max-tokens", type=int, default=300)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--cache-blocks", type=int, default=4000, help="each engine's prefix cache, in 16-token blocks")
    ap.add_argument("--seed", type=int, default=5)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="gq-bench-locality-"))
    redis_proc, url = start_redis(work)
    env = {**os.environ, "REDIS_URL": url}
    data = work / "data.jsonl"
    requested, ideal = make_data(data, args.conversations, args.seed)
    rows = [("dispatch", "prompt tokens requested", "computed", "computed / requested", "hit rate per engine")]
    try:
        for label in VARIANTS:
            r = one_run(label, args, work, env, data)
            rows.append((label, f"{r['queries']:,.0f}", f"{r['queries'] - r['hits']:,.0f}", f"{r['computed']:.3f}",
                         f"{r['min_rate']:.1%}-{r['max_rate']:.1%}"))
        rows.append(("ideal (every earlier turn cached)", f"{requested:,}", f"{ideal:,}", f"{ideal / requested:.3f}",
                     ""))
    finally:
        redis_proc.terminate()
        shutil.rmtree(work, ignore_errors=True)
    print(f"{args.conversations} conversations of 2-6 turns, --multi-turn each; {ENGINES} stand-ins x {args.slots} "
          f"slots, prefix cache {args.cache_blocks} blocks of 16 tokens each, one consumer each (-c {args.slots}); "
          f"jobs of {args.batch_size} unless said\n")
    print(table(rows))


if __name__ == "__main__":
    main()
