"""A fleet's makespan against its lower bound: 4 stand-in engines, one twice as slow per token,
heavy-tailed output lengths (the stand-in's lognormal), one consumer each, one run.

    python -m bench.bench_fleet --items 3000 --slots 64

Lower bound = max(total output tokens / fleet capacity, the longest item alone on a fast
engine), capacity = sum of slots / step time. Makespan = from the first request any engine
receives to the last one answered (the engines' own counters, sampled every 20 ms). The same
data runs twice in one invocation: with the end-of-run give-back and with it off
(GENQUEUE_TAIL_BALANCE=0, the behaviour before it).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from bench.common import BIN, start_redis, start_sim, table


def stats(endpoint: str, reset: bool = False) -> dict[str, float]:
    url = endpoint.removesuffix("/v1") + "/sim/stats"
    req = urllib.request.Request(url, method="POST" if reset else "GET")
    with urllib.request.urlopen(req, timeout=5) as r:
        out: dict[str, float] = json.loads(r.read())
        return out


def longest(out: Path, run: str) -> int:
    n = 0
    for shard in (out / run / "shards").glob("*.jsonl"):
        for line in shard.read_bytes().splitlines():
            if line.strip():
                n = max(n, json.loads(line).get("usage", {}).get("completion_tokens", 0))
    return n


def one_run(label: str, balance: bool, args: argparse.Namespace, work: Path, env: dict[str, str],
            engines: list[str], data: Path) -> dict[str, float]:
    run = label.replace(" ", "-")
    subprocess.run([str(BIN / "producer"), "enqueue", str(data), "--run", run, "--multi-turn", "last",
                    "--output", str(work / "out"), "--max-tokens", str(args.max_tokens),
                    "--rejects", str(work / "rej"), "--batch-size", str(args.batch_size)],
                   env=env, check=True, stdout=subprocess.DEVNULL)
    for e in engines:
        stats(e, reset=True)
    samples: list[tuple[float, list[int], list[int]]] = []  # time, requests and completed per engine
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            s = [stats(e) for e in engines]
            samples.append((time.monotonic(), [int(x["requests"]) for x in s], [int(x["completed"]) for x in s]))
            time.sleep(0.02)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    cenv = {**env, "GENQUEUE_TAIL_BALANCE": "1" if balance else "0"}
    with contextlib.ExitStack() as logs:
        procs = [subprocess.Popen([str(BIN / "consumer"), "run", "--run", run, "--endpoint", e, "--burst",
                                   "-c", str(args.slots), "--spool", str(work / "spool" / f"{run}-{i}"),
                                   "--shard-max-age", "1"], env=cenv, stdout=subprocess.DEVNULL,
                                  stderr=logs.enter_context(open(work / f"{run}-{i}.log", "wb")))
                 for i, e in enumerate(engines)]
        codes = [p.wait() for p in procs]
    done.set()
    sampler.join()
    if any(codes):
        raise SystemExit(f"{label}: consumer exit codes {codes}")
    final = [stats(e) for e in engines]
    tokens = sum(x["tokens"] for x in final)
    start = min(t for t, req, _ in samples if sum(req))
    # the last answer anywhere (the pre-flight probes are answers too: count to the final total)
    end = min(t for t, _, comp in samples if sum(comp) == sum(samples[-1][2]))
    firsts = [min(t for t, req, _ in samples if req[i]) for i in range(len(engines))]
    lasts = [min(t for t, _, comp in samples if comp[i] == samples[-1][2][i]) for i in range(len(engines))]
    steps = [args.step_time] * 3 + [2 * args.step_time]
    capacity = sum(args.slots / s for s in steps)
    bound_work = tokens / capacity
    bound_item = longest(work / "out", run) * args.step_time
    bound = max(bound_work, bound_item)
    return {"makespan": end - start, "work": bound_work, "item": bound_item, "ratio": (end - start) / bound,
            "skew": max(firsts) - start, "idle": sum(end - t for t in lasts),
            "busy": sum(x["busy_slot_seconds"] for x in final) / (len(engines) * args.slots * (end - start))}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--items", type=int, default=3000)
    ap.add_argument("--slots", type=int, default=64)
    ap.add_argument("--step-time", type=float, default=0.002, help="the fast engines'; the slow one's is twice it")
    ap.add_argument("--mean-tokens", type=int, default=200)
    ap.add_argument("--max-tokens", type=int, default=4000)
    ap.add_argument("--batch-size", type=int, default=32)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="gq-bench-fleet-"))
    redis_proc, url = start_redis(work)
    sims, engines = [], []
    for i, step in enumerate([args.step_time] * 3 + [2 * args.step_time]):
        proc, endpoint = start_sim(["--slots", str(args.slots), "--step-time", str(step), "--mean-tokens",
                                    str(args.mean_tokens), "--max-model-len", "100000", "--seed", str(i)], None)
        sims.append(proc)
        engines.append(endpoint)
    env = {**os.environ, "REDIS_URL": url}
    data = work / "data.jsonl"
    with open(data, "w") as fh:
        for i in range(args.items):
            fh.write(json.dumps({"conversations": [{"from": "human", "value": f"question {i}"},
                                                   {"from": "gpt", "value": "answer"}]}) + "\n")
    rows = [("end of run", "makespan s", "bound s", "work/capacity s", "longest item s", "makespan/bound",
             "slots busy", "start skew s", "idle at end engine-s")]
    try:
        for label, balance in (("give back off", False), ("give back on", True)):
            r = one_run(label, balance, args, work, env, engines, data)
            rows.append((label, f"{r['makespan']:.2f}", f"{max(r['work'], r['item']):.2f}", f"{r['work']:.2f}",
                         f"{r['item']:.2f}", f"{r['ratio']:.3f}", f"{r['busy']:.1%}", f"{r['skew']:.2f}", f"{r['idle']:.2f}"))
    finally:
        for p in sims:
            p.terminate()
        redis_proc.terminate()
        shutil.rmtree(work, ignore_errors=True)
    print(f"4 engines x {args.slots} slots (steps {args.step_time * 1000:g} ms x3, {2 * args.step_time * 1000:g} ms "
          f"x1), {args.items} items, mean {args.mean_tokens} tokens (lognormal, sigma 1, cap {args.max_tokens}), "
          f"jobs of {args.batch_size}, -c {args.slots} each\n")
    print(table(rows))


if __name__ == "__main__":
    main()
