"""Redis bytes per item today (prompts inline), queued and finished, and the by-reference job's
size: the baseline and the projection of issue 34.

    python -m bench.bench_redis_items --items 200000
    python -m bench.bench_redis_items --items 20000 --finish

Builds N ShareGPT records whose user turns hold 1-4 KB of text (one item each in the default
`regenerate` mode; real prose and code from bench/bench_packs.py's corpus), enqueues them with
the real `producer enqueue` into a private redis-server, and reads `INFO memory` used_memory
against the empty server's: the run queued. With --finish, the stand-in vLLM and one
`consumer run --burst` answer every item (slowly here: each conversation's 1-4 turns are
answered in turn, and the stand-in's prefill of 1-4 KB prompts is the limit, about 150 items/s
on this machine), and the same is read again: the run finished (rq keeps
a finished job, its payload included, for RESULT_TTL). Redis commands per item are
`INFO stats` total_commands_processed over each phase. Where the bytes go is `MEMORY USAGE` of
each key of the run (job hashes sampled).

Then the job of a run by reference: the same rq job the producer makes (queue.prepare_data, as
producer/enqueue/jobwriter.py calls it, with rq's JSON serializer and the producer's zlib level), its
one argument naming a pack, a block and a range of items instead of carrying them; 2,000 of
them are enqueued into an empty server and measured the same way. That is a projection, not
a run by reference (the producer does not write packs yet): its per-item figure is the job's
bytes over its 32 items, beside what else today's run keeps per item. A benchmark, not a test.
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
from typing import Any

import orjson
import redis
from rq import Retry

from bench.bench_packs import SYSTEM, corpus
from bench.common import BIN, start_redis, start_sim, table
from genqueue.common import defaults
from genqueue.common.keepers.marks import Marks, Place, ShardMarks
from genqueue.common.keepers.packs import PackTable
from genqueue.common.keepers.rqaccess import (
    JOB_RETRIES,
    TASK,
    JobPlace,
    job_description,
    job_id,
    queue_for,
    use_fast_job_compression,
)
from genqueue.common.keepers.rqjobs import JobScan, RunJob, read_jobs
from genqueue.common.storage import pack_name
from genqueue.producer.enqueue.jobwriter import RESULT_TTL
from genqueue.producer.packitems import PackItems


def turn_pool(size: int, seed: int) -> list[str]:
    """SIZE distinct user turns of 250-1,000 characters (one word in six swapped, as in bench_packs)."""
    rng = random.Random(seed)
    sentences = corpus()
    words = [w for s in sentences[::7] for w in s.split()]
    pool = []
    for _ in range(size):
        target, parts, n = rng.randint(250, 1000), [], 0
        while n < target:
            parts.append(" ".join(w if rng.random() > 1 / 6 else rng.choice(words) for w in rng.choice(sentences).split()))
            n += len(parts[-1]) + 1
        pool.append(" ".join(parts)[:target])
    return pool


def make_records(path: Path, n: int, seed: int = 0) -> int:
    """N records whose user turns hold 1-4 KB in all; returns the characters of user text."""
    rng = random.Random(seed)
    pool = turn_pool(20_000, seed)
    chars = 0
    with open(path, "wb") as fh:
        buf: list[bytes] = []
        for i in range(n):
            target, conv, got, t = rng.randint(1000, 4000), [], 0, 0
            while got < target:
                q = f"{rng.choice(pool)} ({i}.{t})"
                conv += [{"from": "human", "value": q}, {"from": "gpt", "value": "An earlier answer."}]
                got += len(q)
                t += 1
            chars += got
            rec: dict[str, Any] = {"id": str(i), "conversations": conv}
            if i % 5 == 0:
                rec["system"] = SYSTEM
            buf.append(orjson.dumps(rec))
            if len(buf) >= 10_000:
                fh.write(b"\n".join(buf) + b"\n")
                buf = []
        if buf:
            fh.write(b"\n".join(buf) + b"\n")
    return chars


def used(conn: redis.Redis) -> int:
    return int(conn.info("memory")["used_memory"])


def commands(conn: redis.Redis) -> int:
    return int(conn.info("stats")["total_commands_processed"])


def calls(conn: redis.Redis) -> dict[str, int]:
    """INFO commandstats: the calls of each command so far (a script's calls counted)."""
    return {name.removeprefix("cmdstat_").upper(): int(v["calls"]) for name, v in conn.info("commandstats").items()}


def where_calls(before: dict[str, int], after: dict[str, int], items: int, top: int = 12) -> list[tuple[str, str, str]]:
    """The commands called most between BEFORE and AFTER, with their calls an item, then the
    rest's and the sum."""
    diff = sorted(((n, after[n] - before.get(n, 0)) for n in after), key=lambda x: -x[1])
    rows = [(n, f"{c:,}", f"{c / items:.3f}") for n, c in diff[:top] if c > 0]
    rest, total = sum(c for _, c in diff[top:]), sum(c for _, c in diff)
    return [*rows, ("(the rest)", f"{rest:,}", f"{rest / items:.3f}"), ("(all)", f"{total:,}", f"{total / items:.3f}")]


def breakdown(conn: redis.Redis, items: int, sample: int = 2000) -> list[tuple[str, int]]:
    """Bytes of Redis by kind of key (MEMORY USAGE), job hashes and result streams sampled."""
    kinds: dict[str, list[int]] = {}
    for key in conn.scan_iter(count=10_000):
        k = key.decode()
        kind = ("rq job hash" if k.startswith("rq:job:") else "rq result stream" if k.startswith("rq:results:")
                else "genqueue run item table buckets" if k.startswith("genqueue:run:") and ":items:" in k
                else "genqueue run packs' bits" if k.startswith("genqueue:run:") and ":pk:" in k
                else "genqueue run " + k.split(":")[-1] if k.startswith("genqueue:run:")
                else k.split(":")[0] + ":" + k.split(":")[1] if ":" in k else k)
        kinds.setdefault(kind, []).append(0)
        counts = kinds[kind]
        if len(counts) <= sample:
            counts[-1] = int(conn.memory_usage(key, samples=0) or 0)
    out = []
    for kind, sizes in kinds.items():
        measured = sizes[:sample]
        total = sum(measured) * len(sizes) / len(measured)
        out.append((f"{kind} ({len(sizes):,} keys)", int(total)))
    return sorted(out, key=lambda kv: -kv[1])


#: What a job by reference could carry, as (its argument list, its meta): a pack's name, its
#: block (offset, length, crc32) and the items' range; only the pack's number in the run and the
#: block's in the pack; or those two numbers in the job's meta, with no argument at all.
REFERENCES: dict[str, Any] = {
    "args: named pack, block, range": lambda writer, j: (
        [{"pack": pack_name(writer, j // 2048), "block": [8 + j * 40_000, 38_000, 2_876_543_210],
          "items": [(j % 2048) * defaults.BATCH_SIZE, defaults.BATCH_SIZE]}], {"items": defaults.BATCH_SIZE}),
    "args: pack number, block number": lambda writer, j: ([[j // 2048, j % 2048]], {"items": defaults.BATCH_SIZE}),
    "meta: pack number, block number": lambda writer, j: ([], {"items": defaults.BATCH_SIZE,
                                                                "pack": [j // 2048, j % 2048]}),
}


def reference_jobs(url: str, jobs: int = 2000) -> list[tuple[str, ...]]:
    """Rows: for each REFERENCES shape and Redis's default hash encoding limit and a raised one,
    used_memory per job, MEMORY USAGE of one job hash, its encoding and payload bytes, and the
    bytes per item, of JOBS queued jobs that name BATCH_SIZE items instead of carrying them."""
    conn = redis.Redis.from_url(url)
    use_fast_job_compression()
    rng = random.Random(3)
    n = defaults.BATCH_SIZE
    writer = os.urandom(16).hex()
    default_limit = conn.config_get("hash-max-listpack-value")["hash-max-listpack-value"]
    rows = [("reference", "hash-max-listpack-value", "bytes/job", "job hash", "encoding", "payload B", "bytes/item")]
    for limit in (default_limit, "256"):
        for shape, ref in REFERENCES.items():
            conn.flushall()
            conn.config_set("hash-max-listpack-value", limit)
            queue = queue_for("ref", conn)
            base = used(conn)
            for start in range(0, jobs, 500):
                datas = []
                for j in range(start, min(start + 500, jobs)):
                    keys = [rng.getrandbits(128).to_bytes(16).hex() for _ in range(n)]
                    args, meta = ref(writer, j)
                    datas.append(queue.prepare_data(TASK, args=args, job_id=job_id("ref", keys),
                                                    description=job_description("ref", [{"index": j * n}]),
                                                    retry=Retry(max=JOB_RETRIES),
                                                    result_ttl=RESULT_TTL, timeout=-1, meta=meta))
                queue.enqueue_many(datas)
            per_job = (used(conn) - base) / jobs
            one = conn.lindex(queue.key, 0)
            assert one is not None
            hkey = f"rq:job:{one.decode()}"
            rows.append((shape, str(limit), f"{per_job:.0f}", str(conn.memory_usage(hkey, samples=0)),
                         conn.object("encoding", hkey).decode(), str(conn.hstrlen(hkey, "data")),
                         f"{per_job / n:.1f}"))
    conn.config_set("hash-max-listpack-value", default_limit)
    return rows


def emulate_finish(conn: redis.Redis, run: str, output: str) -> None:
    """What a finished run leaves in Redis, without answering every item: each job's items
    marked done by the consumers' own marking script (Marks.mark_shipped, one call per 4,096
    items, as shards ship), and every job gone, as RESULT_TTL after it finished (the consumer's
    sweep cleans the finished registry). Checked against a real finish (--finish) at 20,000."""
    marks = ShardMarks()
    jobs = [job for job in read_jobs(conn, run, [JobPlace.QUEUED], scan=JobScan(),
                                     items_of=PackItems(conn, run, output).items_of) if isinstance(job, RunJob)]
    # by reference each item's place, as the consumer knows it from its job: the pack's name, and
    # the block's first slot (the items of the blocks before it)
    names = PackTable(conn, run).names()
    sizes = {(job.ref.pack, job.ref.block): len(job.items) for job in jobs if job.ref is not None}
    firsts: dict[tuple[int, int], int] = {}
    for pack, block in sorted(sizes):
        firsts[(pack, block)] = firsts.get((pack, block - 1), 0) + sizes.get((pack, block - 1), 0) if block else 0
    for job in jobs:
        ref = job.ref
        for i, it in enumerate(job.items):
            place = None if ref is None else Place(ref.pack, names[ref.pack], firsts[(ref.pack, ref.block)] + i)
            marks.add_record({"key": it["key"], "outcome": "finished", "turns": [{"content": "a"}]}, place)
        if len(marks.done) >= 4096:
            Marks(conn, run).mark_shipped(marks)
            marks = ShardMarks()
    Marks(conn, run).mark_shipped(marks)
    queue_for(run, conn).empty()


def phase_row(label: str, items: int, secs: float, bytes_: int, prompt_chars: int, cmds: int) -> tuple[str, ...]:
    return (label, f"{items:,}", f"{secs:.0f}", f"{bytes_:,}", f"{bytes_ / items:.1f}",
            f"{bytes_ / prompt_chars:.3f}", f"{cmds / items:.3f}")


def measure(work: Path, data: Path, mode: str, finish: str, batch: list[str]) -> tuple[list[tuple[str, ...]], list[tuple[str, list[tuple[str, int]]]], int, int]:
    """One run of DATA enqueued with `--prompts MODE` into a fresh redis-server: its rows, where
    the bytes go, its items and Redis's empty baseline. A real finish also prints where its
    commands went (INFO commandstats)."""
    (work / f"redis-{mode}").mkdir()
    srv, url = start_redis(work / f"redis-{mode}")
    try:
        conn = redis.Redis.from_url(url)
        env = {**os.environ, "REDIS_URL": url}
        out_dir = str(work / f"out-{mode}")
        empty, cmd0 = used(conn), commands(conn)
        t0 = time.perf_counter()
        out = subprocess.run([str(BIN / "producer"), "enqueue", str(data), "--run", "bench", "--output", out_dir,
                              "--max-tokens", "64", "--rejects", str(work / f"rej-{mode}"), "--json",
                              "--prompts", mode, *batch], env=env, check=True, capture_output=True)
        enq_s = time.perf_counter() - t0
        summary = orjson.loads(out.stdout)
        print(f"{mode}: enqueued in {enq_s:.0f} s", file=sys.stderr)
        items, chars = int(summary["items"]), int(summary["prompt_chars"])
        queued, cmd1 = used(conn) - empty, commands(conn)
        rows = [phase_row(f"queued ({mode})", items, enq_s, queued, chars, cmd1 - cmd0)]
        parts = [(f"queued, {mode}", breakdown(conn, items))]
        if finish == "real":
            calls0 = calls(conn)
            sim, endpoint = start_sim(["--slots", "100000", "--step-time", "0", "--mean-tokens", "8"], core=None)
            t0 = time.perf_counter()
            subprocess.run([str(BIN / "consumer"), "run", "--run", "bench", "--endpoint", endpoint, "--burst",
                            "-c", "256", "--spool", str(work / f"spool-{mode}")], env=env, check=True,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            fin_s = time.perf_counter() - t0
            sim.terminate()
            cmd2 = commands(conn)
            print(f"\nwhere the commands of the finish went, {mode} (INFO commandstats)")
            print(table([("command", "calls", "calls/item"), *where_calls(calls0, calls(conn), items)]))
            rows.append(phase_row(f"finished ({mode})", items, fin_s, used(conn) - empty, chars, cmd2 - cmd1))
            parts.append((f"finished, {mode}", breakdown(conn, items)))
            # what RESULT_TTL does next: the finished jobs expire, the sweep cleans their registry
            for key in conn.scan_iter(match="rq:job:*", count=10_000):
                conn.delete(key)
            for key in conn.scan_iter(match="rq:results:*", count=10_000):
                conn.delete(key)
            queue_for("bench", conn).finished_job_registry.cleanup(time.time() + 2 * RESULT_TTL)
            label = f"finished, after RESULT_TTL ({mode})"
        elif finish == "emulated":
            t0 = time.perf_counter()
            emulate_finish(conn, "bench", out_dir)
            fin_s = time.perf_counter() - t0
            label = f"finished, emulated ({mode})"
        else:
            return rows, parts, items, empty
        cmd3 = commands(conn)
        after = used(conn) - empty
        rows.append(phase_row(label, items, fin_s, after, chars, cmd3 - cmd1))
        parts.append((label, breakdown(conn, items)))
        return rows, parts, items, empty
    finally:
        srv.terminate()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--items", type=int, default=200_000)
    ap.add_argument("--prompts", choices=["inline", "reference", "both"], default="both")
    ap.add_argument("--finish", choices=["no", "real", "emulated"], default="no",
                    help="also measure the run finished: answered by the stand-in (real, slow) or marked (emulated)")
    ap.add_argument("--short", action="store_true",
                    help="records of one short turn (by reference the prompt's size does not reach Redis)")
    ap.add_argument("--batch-size", type=int, default=0, help="items per job (default: the producer's)")
    ap.add_argument("--projection", action="store_true", help="also print the by-reference job shapes measured")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="gq-bench-redis-items-"))
    try:
        data = work / "data.jsonl"
        t0 = time.perf_counter()
        chars = make_short(data, args.items) if args.short else make_records(data, args.items)
        print(f"built {args.items:,} records ({data.stat().st_size / 1e6:.0f} MB) in {time.perf_counter() - t0:.0f} s",
              file=sys.stderr)
        rows: list[tuple[str, ...]] = [("phase", "items", "wall s", "Redis bytes", "bytes/item", "bytes/prompt byte",
                                        "commands/item")]
        parts: list[tuple[str, list[tuple[str, int]]]] = []
        modes = ["inline", "reference"] if args.prompts == "both" else [args.prompts]
        items = empty = 0
        for mode in modes:
            r, p, items, empty = measure(work, data, mode, args.finish,
                                         ["--batch-size", str(args.batch_size)] if args.batch_size else [])
            rows += r
            parts += p
        print(f"{items:,} items ({chars / args.items:,.0f} characters of user text per record), jobs of "
              f"{args.batch_size or 'the default'}; Redis {empty:,} bytes empty; RESULT_TTL {RESULT_TTL} s")
        print(table(rows))
        for phase, kinds in parts:
            print(f"\nwhere the bytes go, {phase} (MEMORY USAGE; job hashes and result streams sampled)")
            print(table([("key kind", "bytes", "bytes/item")]
                        + [(k, f"{b:,}", f"{b / items:.1f}") for k, b in kinds]))
        if args.projection:
            (work / "redis-projection").mkdir()
            srv, url = start_redis(work / "redis-projection")
            try:
                print(f"\nby reference, job shapes: rq jobs that name {defaults.BATCH_SIZE} items instead of "
                      "carrying them, 2,000 queued into an empty server")
                print(table(reference_jobs(url)))
            finally:
                srv.terminate()
    finally:
        shutil.rmtree(work, ignore_errors=True)


def make_short(path: Path, n: int) -> int:
    """N records of one user turn of about 60 characters each; returns the characters."""
    chars = 0
    with open(path, "wb") as fh:
        for start in range(0, n, 10_000):
            lines = [orjson.dumps({"id": str(i), "conversations": [{"from": "human", "value": f"Question {i}: say why."}]})
                     for i in range(start, min(n, start + 10_000))]
            chars += sum(len(f"Question {i}: say why.") for i in range(start, min(n, start + 10_000)))
            fh.write(b"\n".join(lines) + b"\n")
    return chars


if __name__ == "__main__":
    main()
