"""Saturation: how close genqueue keeps the engine to "every slot busy all the time".

    python -m bench.bench_saturation --slots 64 256 --items 4000

Against the stand-in vLLM (S slots, a per-step time, heavy-tailed output lengths), side by
side in one run: (a) genqueue's consumer (fixed concurrencies and auto), (b) a
batch-at-a-time client (send K, wait for all K, repeat), (c) a bare client holding a fixed
number of requests in flight with no Redis, no files (the ideal feed). Reported: completion
tokens/s and mean busy slots as a fraction of S, over the whole run including its tail.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from bench.common import BIN, pinned, start_redis, start_sim, table, timed

QUESTION = "Question %d: explain the idea of item %d in a few paragraphs, with an example."


def sim_stats(url: str, reset: bool = False) -> dict:
    root = url.rsplit("/v1", 1)[0]
    req = urllib.request.Request(f"{root}/sim/stats", method="POST" if reset else "GET")
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())


async def _bare(url: str, n: int, inflight: int, max_tokens: int, batch: bool) -> None:
    from genqueue.consumer.answer.client import EndpointClient

    async with EndpointClient(url) as client:
        def body(i: int) -> dict:
            return {"model": "sim-model", "messages": [{"role": "user", "content": QUESTION % (i, i)}],
                    "max_tokens": max_tokens, "temperature": 0.6, "top_p": 0.95}

        if batch:  # send K, wait for all K
            for start in range(0, n, inflight):
                await asyncio.gather(*(client.chat(body(i)) for i in range(start, min(n, start + inflight))))
            return
        sem = asyncio.Semaphore(inflight)

        async def one(i: int) -> None:
            async with sem:
                await client.chat(body(i))

        # bounded: at most `inflight` tasks exist beyond the queue of not-yet-started coroutines
        it = iter(range(n))
        running: set[asyncio.Task[None]] = set()
        for i in it:
            await sem.acquire()
            sem.release()
            t = asyncio.create_task(one(i))
            running.add(t)
            t.add_done_callback(running.discard)
            if len(running) >= inflight:
                await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
        await asyncio.gather(*running)


def child(kind: str, url: str, n: int, inflight: int, max_tokens: int) -> None:
    import uvloop

    uvloop.run(_bare(url, n, inflight, max_tokens, batch=(kind == "batch")))


def measure(url: str, slots: int, fn) -> dict:
    sim_stats(url, reset=True)
    t0 = time.perf_counter()
    cpu = fn()
    wall = time.perf_counter() - t0
    st = sim_stats(url)
    active = st["active_seconds"] or wall
    # Saturation over the engine's active window (first admission to last completion): the
    # client's own start-up is not engine idle time a GPU would see in a days-long run.
    return {"wall": wall, "active": active, "tokens_per_s": st["tokens"] / active,
            "busy": st["busy_slot_seconds"] / (active * slots), "cpu": cpu, "completed": st["completed"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--slots", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--items-per-slot", type=int, default=60, help="items per run = this x S")
    ap.add_argument("--step-time", type=float, default=0.002)
    ap.add_argument("--mean-tokens", type=int, default=100)
    ap.add_argument("--max-tokens", type=int, default=2000)
    ap.add_argument("--child", nargs=5)
    args = ap.parse_args()
    if args.child:
        kind, url, n, inflight, mt = args.child
        child(kind, url, int(n), int(inflight), int(mt))
        return
    work = Path(tempfile.mkdtemp(prefix="gq-bench-sat-"))
    redis_proc, rurl = start_redis(work)
    env = {**os.environ, "REDIS_URL": rurl}
    results: list[tuple[int, str, dict]] = []
    runs = 0
    try:
        for slots in args.slots:
            n_items = args.items_per_slot * slots
            data = work / f"data{slots}.jsonl"
            with open(data, "w") as fh:
                fh.writelines(json.dumps({"messages": [{"role": "user", "content": QUESTION % (i, i)}]}) + "\n" for i in range(n_items))
            sim, url = start_sim(["--slots", str(slots), "--step-time", str(args.step_time),
                                  "--mean-tokens", str(args.mean_tokens), "--max-model-len", "100000"])
            ideal_c = slots + max(4, slots // 10)

            def consumer(conc: str) -> float:
                nonlocal runs
                runs += 1
                run = f"s{slots}-{runs}"
                subprocess.run([str(BIN / "producer"), "enqueue", str(data), "--run", run, "--multi-turn", "last",
                                "--output", str(work / "out"), "--max-tokens", str(args.max_tokens),
                                "--rejects", str(work / "rej")], env=env, check=True, stdout=subprocess.DEVNULL)
                cmd = pinned([str(BIN / "consumer"), "run", "--run", run, "--endpoint", url, "--burst",
                              "-c", conc, "--spool", str(work / "spool" / run), "--shard-max-age", "2"], 1)
                wall, cpu, rc = timed(cmd, env)
                if rc != 0:
                    raise SystemExit(f"consumer exited {rc}")
                return cpu

            def bare(kind: str, c: int) -> float:
                cmd = pinned([sys.executable, "-m", "bench.bench_saturation", "--child", kind, url,
                              str(n_items), str(c), str(args.max_tokens)], 1)
                return timed(cmd, env)[1]

            try:
                results.append((slots, f"(c) bare client, {ideal_c} in flight", measure(url, slots, lambda: bare("bare", ideal_c))))
                results.append((slots, f"(b) batch-at-a-time, K={slots}", measure(url, slots, lambda: bare("batch", slots))))
                for c in sorted({slots // 2, slots, ideal_c, 2 * slots}):
                    results.append((slots, f"(a) genqueue, concurrency {c}",
                                    measure(url, slots, lambda c=c: consumer(str(c)))))
                results.append((slots, "(a) genqueue, concurrency auto", measure(url, slots, lambda: consumer("auto"))))
            finally:
                sim.terminate()
    finally:
        redis_proc.terminate()
        shutil.rmtree(work, ignore_errors=True)
    rows = [("slots", "client", "wall s", "engine active s", "completion tok/s", "busy slots / S", "client CPU s")]
    for slots, name, r in results:
        rows.append((str(slots), name, f"{r['wall']:.1f}", f"{r['active']:.1f}", f"{r['tokens_per_s']:,.0f}",
                     f"{r['busy']:.3f}", f"{r['cpu']:.1f}"))
    print(table(rows))
    print()
    for slots in args.slots:
        mine = {n: r for s, n, r in results if s == slots}
        c = next(r for n, r in mine.items() if n.startswith("(c)"))
        b = next(r for n, r in mine.items() if n.startswith("(b)"))
        fixed = {n: r for n, r in mine.items() if n.startswith("(a)") and "auto" not in n}
        best_name, best = max(fixed.items(), key=lambda kv: kv[1]["tokens_per_s"])
        auto = mine["(a) genqueue, concurrency auto"]
        ideal = next(r for n, r in fixed.items() if n.endswith(f" {slots + max(4, slots // 10)}"))
        print(f"S={slots}: (a)/(c) = {ideal['tokens_per_s'] / c['tokens_per_s']:.3f} (genqueue at the bare client's "
              f"concurrency), (a)/(b) = {ideal['tokens_per_s'] / b['tokens_per_s']:.2f}, "
              f"auto / best fixed ({best_name.split()[-1]}) = {auto['tokens_per_s'] / best['tokens_per_s']:.3f}")


if __name__ == "__main__":
    main()
