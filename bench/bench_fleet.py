"""A fleet's makespan against its lower bound: 4 stand-in engines, one twice as slow per token,
heavy-tailed output lengths (the stand-in's lognormal), one consumer each, one run.

    python -m bench.bench_fleet --items 8000 --slots 16 --mean-tokens 100 --max-tokens 1000 --rounds 3

Lower bound = max(total output tokens / fleet capacity, the longest item alone on a fast
engine), capacity = sum of slots / step time; the tokens are the records' (each item once,
so copies cannot inflate the bound). Makespan = from the first request any engine receives to
the last one answered (the engines' own counters, sampled every 20 ms). Beside it, "ideal":
the makespan of a dispatcher with no overhead at all, on the same lengths in the order the run
was enqueued (every free slot takes the next item the moment it frees; "with copies": then
copies the youngest item running on a slower engine): what is left between it and the
makespan is genqueue's own cost, what is left between it and the bound is the heavy tail's.

The same data runs once per variant in each round, the variants alternating (the machine is
shared and noisy): the end-of-run give-back off (GENQUEUE_TAIL_BALANCE=0) and on, copies off
(GENQUEUE_TAIL_COPIES=0) and on ("copies"), each at `-c` = the engine's slots, `-c auto`, or
`-c +4` (4 requests waiting in each engine). "steady busy" is the slots' use while every
engine has work (from the last engine's first request to the first engine's last answer):
what the refill between a finished request and the next costs. All stand-ins answer a request
alike (one seed), so a copy is as long as its original: what copies buy is never a lucky
shorter draw. "tokens redone": what the engines generated beyond the records' tokens (copies
and pre-flight probes); "records twice": items with two results shipped (export keeps one).

With --hints each record's original answer has a length drawn from a heavy-tailed
distribution, its prompt carries "[len=N]" (the stand-ins run with --length-hints: the answer
they generate is drawn around N, with their usual lognormal noise) and the run is enqueued
with --longest-first: what a run whose lengths can be estimated gets.
"""

from __future__ import annotations

import argparse
import contextlib
import heapq
import json
import math
import os
import random
import shutil
import statistics
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


def output_tokens(out: Path, run: str) -> tuple[dict[int, int], int]:
    """(each item's output tokens by its input index, records written): each item counted once,
    whatever copies of it shipped too (export keeps one)."""
    per_item: dict[str, tuple[int, int]] = {}
    records = 0
    for shard in (out / run / "shards").glob("*.jsonl"):
        for line in shard.read_bytes().splitlines():
            if line.strip():
                rec = json.loads(line)
                records += 1
                if "error" not in rec:
                    per_item[rec["key"]] = (rec["index"], rec.get("usage", {}).get("completion_tokens", 0))
    return dict(per_item.values()), records


def floor(lengths: list[int], steps: list[float], slots: int, *, copies: bool) -> float:
    """The makespan of an ideal dispatcher with no overhead at all (pure): every free slot of the
    fleet takes the next item in input order the moment it frees; with COPIES, once none is left,
    a free slot copies the youngest item running on a slower engine (the consumer's own rule),
    whichever copy ends first ends the item. What no dispatcher that does not know the lengths can
    beat (without copies), against which genqueue's own overhead is what is left."""
    free = [(0.0, e) for e, _ in enumerate(steps) for _ in range(slots)]
    heapq.heapify(free)
    running: list[tuple[float, float, int, int]] = []  # start, end, tokens, engine
    for n in lengths:
        t, e = heapq.heappop(free)
        running.append((t, t + n * steps[e], n, e))
        heapq.heappush(free, (t + n * steps[e], e))
    ends = [r[1] for r in running]
    if copies:
        copied: set[int] = set()
        while free:
            t, e = heapq.heappop(free)
            cands = [i for i, (s, _, _, on) in enumerate(running)
                     if ends[i] > t and i not in copied and steps[on] > steps[e]]
            if not cands:
                continue
            i = max(cands, key=lambda i: running[i][0])
            copied.add(i)
            ends[i] = min(ends[i], t + running[i][2] * steps[e])
            heapq.heappush(free, (ends[i], e))
    return max(ends)


VARIANTS: dict[str, tuple[bool, str, bool]] = {  # label -> (give-back on, -c, copies on)
    "give back off": (False, "slots", False),
    "give back on": (True, "slots", False),
    "give back off, -c auto": (False, "auto", False),
    "give back on, -c auto": (True, "auto", False),
    "give back on, -c +4": (True, "+4", False),
    "copies": (True, "slots", True),
    "copies, -c auto": (True, "auto", True),
    "copies, -c +4": (True, "+4", True),
}


def concurrency(conc: str, slots: int) -> str:
    """-c for a variant: the engine's slots, auto, or +N: N requests waiting in each engine."""
    return str(slots) if conc == "slots" else conc if conc == "auto" else str(slots + int(conc))


def one_run(label: str, n: int, args: argparse.Namespace, work: Path, env: dict[str, str],
            engines: list[str], data: Path) -> dict[str, float]:
    balance, conc, copies = VARIANTS[label]
    run = f"{label.replace(' ', '-').replace(',', '').replace('+', 'plus')}-{n}"
    order = ["--longest-first"] if args.hints else []
    subprocess.run([str(BIN / "producer"), "enqueue", str(data), "--run", run, "--multi-turn", "last",
                    "--output", str(work / "out"), "--max-tokens", str(args.max_tokens),
                    "--rejects", str(work / "rej"), "--batch-size", str(args.batch_size), "--prompts", args.prompts,
                    *order],
                   env=env, check=True, stdout=subprocess.DEVNULL)
    for e in engines:
        stats(e, reset=True)
    # time, requests, completed per engine, and busy slot-seconds of them all (the engines' own integral)
    samples: list[tuple[float, list[int], list[int], float]] = []
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            s = [stats(e) for e in engines]
            samples.append((time.monotonic(), [int(x["requests"]) for x in s], [int(x["completed"]) for x in s],
                            sum(x["busy_slot_seconds"] for x in s)))
            time.sleep(0.02)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    cenv = {**env, "GENQUEUE_TAIL_BALANCE": "1" if balance else "0", "GENQUEUE_TAIL_COPIES": "1" if copies else "0"}
    with contextlib.ExitStack() as logs:
        procs = [subprocess.Popen([str(BIN / "consumer"), "run", "--run", run, "--endpoint", e, "--burst",
                                   "-c", concurrency(conc, args.slots), "--spool", str(work / "spool" / f"{run}-{i}"),
                                   "--shard-max-age", "1"], env=cenv, stdout=subprocess.DEVNULL,
                                  stderr=logs.enter_context(open(work / f"{run}-{i}.log", "wb")))
                 for i, e in enumerate(engines)]
        codes = [p.wait() for p in procs]
    done.set()
    sampler.join()
    if any(codes):
        raise SystemExit(f"{label}: consumer exit codes {codes}")
    final = [stats(e) for e in engines]
    by_index, records = output_tokens(work / "out", run)
    # in the order the run was enqueued: input order, or with --hints longest hint first
    lengths = [by_index[i] for i in (args.order or sorted(by_index)) if i in by_index]
    longest, tokens, items = max(lengths, default=0), sum(lengths), len(lengths)
    if items != args.items:
        raise SystemExit(f"{label}: {items} of {args.items} items have a result")
    engine_tokens = sum(x["tokens"] for x in final)
    start = min(t for t, req, _, _ in samples if sum(req))
    # the last answer anywhere (the pre-flight probes are answers too: count to the final total)
    end = min(t for t, _, comp, _ in samples if sum(comp) == sum(samples[-1][2]))
    firsts = [min(t for t, req, _, _ in samples if req[i]) for i in range(len(engines))]
    lasts = [min(t for t, _, comp, _ in samples if comp[i] == samples[-1][2][i]) for i in range(len(engines))]
    # the pre-flight probe is one request: an engine has work from its second on
    fed = [min((t for t, req, _, _ in samples if req[i] > 1), default=end) for i in range(len(engines))]
    window = [(t, b) for t, _, _, b in samples if max(fed) <= t <= min(lasts)]
    steady = ((window[-1][1] - window[0][1]) / (len(engines) * args.slots * (window[-1][0] - window[0][0]))
              if len(window) > 1 and window[-1][0] > window[0][0] else 0.0)
    steps = [args.step_time] * 3 + [2 * args.step_time]
    capacity = sum(args.slots / s for s in steps)
    bound_work = tokens / capacity
    bound_item = longest * args.step_time
    bound = max(bound_work, bound_item)
    ideal = floor(lengths, steps, args.slots, copies=False) / bound
    ideal_copies = floor(lengths, steps, args.slots, copies=True) / bound
    return {"ideal": ideal, "ideal_copies": ideal_copies, "makespan": end - start, "work": bound_work, "item": bound_item, "ratio": (end - start) / bound,
            "skew": max(firsts) - start, "idle": sum(end - t for t in lasts),
            "steady": steady, "extra": engine_tokens / tokens - 1, "dups": records - items,
            "busy": sum(x["busy_slot_seconds"] for x in final) / (len(engines) * args.slots * (end - start))}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--items", type=int, default=3000)
    ap.add_argument("--slots", type=int, default=16)
    ap.add_argument("--step-time", type=float, default=0.002, help="the fast engines'; the slow one's is twice it")
    ap.add_argument("--mean-tokens", type=int, default=100)
    ap.add_argument("--max-tokens", type=int, default=1000)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--prompts", choices=["auto", "inline", "reference"], default="auto",
                    help="how the run's prompts are queued (producer enqueue --prompts)")
    ap.add_argument("--rounds", type=int, default=1, help="each variant once per round, alternating")
    ap.add_argument("--variants", default="give back on;copies;copies, -c +4",
                    help=f"separated by ';', of: {'; '.join(VARIANTS)}")
    ap.add_argument("--hints", action="store_true",
                    help="answer lengths known roughly in advance: [len=N] hints and --longest-first")
    args = ap.parse_args()
    chosen = [v.strip() for v in args.variants.split(";") if v.strip()]
    for v in chosen:
        if v not in VARIANTS:
            ap.error(f"unknown variant {v!r}; known: {'; '.join(VARIANTS)}")
    work = Path(tempfile.mkdtemp(prefix="gq-bench-fleet-"))
    redis_proc, url = start_redis(work)
    sims, engines = [], []
    for i, step in enumerate([args.step_time] * 3 + [2 * args.step_time]):
        hints = ["--length-hints"] if args.hints else []
        proc, endpoint = start_sim(["--slots", str(args.slots), "--step-time", str(step), "--mean-tokens",
                                    str(args.mean_tokens), "--max-model-len", "100000", "--seed", "0", *hints],
                                   None)
        sims.append(proc)
        engines.append(endpoint)
    env = {**os.environ, "REDIS_URL": url}
    data = work / "data.jsonl"
    rng = random.Random(7)
    hint_lens: list[int] = []
    with open(data, "w") as fh:
        for i in range(args.items):
            if args.hints:  # the original answer's length: heavy-tailed around the mean, capped
                mu = math.log(args.mean_tokens) - 0.5
                n = min(args.max_tokens, max(1, int(rng.lognormvariate(mu, 1.0))))
                hint_lens.append(n)
                q, a = f"question {i} [len={n}]", "w " * n
            else:
                q, a = f"question {i}", "answer"
            fh.write(json.dumps({"conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": a}]}) + "\n")
    # --longest-first orders by the estimate (the original answer's length), stably
    args.order = sorted(range(args.items), key=lambda i: -hint_lens[i]) if args.hints else None
    rows = [("round", "end of run", "makespan s", "bound s", "work/capacity s", "longest item s", "makespan/bound",
             "ideal/bound", "ideal with copies/bound", "slots busy", "steady busy", "start skew s", "idle at end engine-s", "tokens redone", "records twice")]
    ratios: dict[str, list[float]] = {v: [] for v in chosen}
    try:
        for n in range(args.rounds):
            # alternate which variant goes first, so drift on the machine does not favour one
            for label in (chosen if n % 2 == 0 else chosen[::-1]):
                r = one_run(label, n, args, work, env, engines, data)
                ratios[label].append(r["ratio"])
                rows.append((str(n + 1), label, f"{r['makespan']:.2f}", f"{max(r['work'], r['item']):.2f}",
                             f"{r['work']:.2f}", f"{r['item']:.2f}", f"{r['ratio']:.3f}", f"{r['ideal']:.3f}",
                             f"{r['ideal_copies']:.3f}", f"{r['busy']:.1%}",
                             f"{r['steady']:.1%}", f"{r['skew']:.2f}", f"{r['idle']:.2f}", f"{r['extra']:.2%}",
                             str(int(r["dups"]))))
    finally:
        for p in sims:
            p.terminate()
        redis_proc.terminate()
        shutil.rmtree(work, ignore_errors=True)
    print(f"4 engines x {args.slots} slots (steps {args.step_time * 1000:g} ms x3, {2 * args.step_time * 1000:g} ms "
          f"x1), {args.items} items, mean {args.mean_tokens} tokens (lognormal, sigma 1, cap {args.max_tokens}), "
          f"jobs of {args.batch_size}, prompts {args.prompts}{', length hints, --longest-first' if args.hints else ''}\n")
    print(table(rows))
    print()
    for label, rs in ratios.items():
        print(f"{label}: makespan/bound median {statistics.median(rs):.3f} (rounds: "
              f"{', '.join(f'{x:.3f}' for x in rs)})")


if __name__ == "__main__":
    main()
