"""The producer by reference, its packs written to a real S3 (SeaweedFS), against inline (issue 34).

    python -m bench.bench_producer_packs --items 200000

Builds N ShareGPT records whose user turns hold 1-4 KB of text (bench_redis_items' records:
bench_packs' corpus of real prose and code, one item each in `regenerate`), starts a SeaweedFS
S3 server (`weed mini`, tests/s3server.py) and, for each mode, a private redis-server of its
own, and runs the real `producer enqueue` of the same file into a run whose output is on the
S3 server: once `--prompts inline` (the items go into the rq jobs, in Redis) and once
`--prompts reference` (each slice of up to 1,024 items written as one pack, one PUT, before
its jobs are queued). Both runs write run.json to S3 and probe it first, so what differs is
where the prompts go. Printed side by side: records/s and wall seconds of the enqueue (the
process from start to exit), its CPU seconds (the producer's own) and the S3 server's over
the same time (`weed mini` is one process: S3 gateway, filer, volume and master; Redis's CPU is
in neither), Redis bytes per item (`INFO memory` used_memory against the empty server's), the
bytes the run left on S3 (every object under its prefix) and the packs. With --rounds R the
two modes alternate R times (inline first on odd rounds), each round into fresh servers'
state. `--s3-latency MS` puts a proxy in front of the S3 server that holds back each reply MS
milliseconds (tests/netproxy.py `LatencyProxy`): a store in another region. A benchmark, not a
test.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson
import redis

from bench.bench_redis_items import make_records, used
from bench.common import BIN, start_redis, table
from tests.netproxy import LatencyProxy
from tests.s3server import S3Server

MODES = ("inline", "reference")


def s3_bytes(server: S3Server, prefix: str) -> tuple[int, int]:
    """The objects under PREFIX in SERVER's bucket: their count and bytes."""
    client = server.client()
    n = size = 0
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=server.bucket, Prefix=prefix):
        for obj in page.get("Contents", []):
            n += 1
            size += int(obj["Size"])
    return n, size


def cpu_of(pid: int) -> float:
    """CPU seconds (user + system) process PID has used so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def enqueue(data: Path, run: str, output: str, env: dict[str, str], work: Path, mode: str) -> tuple[float, float,
                                                                                                       dict[str, Any]]:
    """`producer enqueue --prompts MODE` of DATA into RUN; (wall s, CPU s, its --json summary)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run([str(BIN / "producer"), "enqueue", str(data), "--run", run, "--output", output,
                           "--max-tokens", "64", "--rejects", str(work / f"{run}.rejects"), "--prompts", mode,
                           "--json"], check=False, env=env, capture_output=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr.decode(errors="replace")[-3000:])
        raise SystemExit(f"producer enqueue --prompts {mode} failed (exit {proc.returncode})")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, orjson.loads(proc.stdout)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--items", type=int, default=200_000)
    ap.add_argument("--rounds", type=int, default=1, help="alternate the two modes this many times")
    ap.add_argument("--s3-latency", type=float, default=0.0,
                    help="milliseconds added to each S3 reply (a TCP proxy in front of the server): a store far away")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="gq-bench-producer-packs-"))
    s3 = S3Server(work / "s3")
    try:
        data = work / "data.jsonl"
        t0 = time.perf_counter()
        make_records(data, args.items)
        mb = data.stat().st_size / 1e6
        print(f"built {args.items:,} records ({mb:.0f} MB) in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
        s3.start()
        proxy = None
        s3_env = dict(s3.env)
        if args.s3_latency > 0:
            proxy = LatencyProxy(int(s3.endpoint.rsplit(":", 1)[1]), args.s3_latency / 1000)
            s3_env["AWS_ENDPOINT_URL"] = f"http://{proxy.url_host_port}"
        rows = [("prompts", "round", "records", "wall s", "records/s", "producer CPU s", "S3 server CPU s", "Redis bytes/item",
                 "S3 objects", "S3 MB", "S3 B/item", "packs", "jobs")]
        for rnd in range(1, args.rounds + 1):
            for mode in MODES if rnd % 2 else MODES[::-1]:
                srv, url = start_redis(work)
                try:
                    conn = redis.Redis.from_url(url)
                    empty = used(conn)
                    run = f"bench-{mode}-{rnd}"
                    env = {**os.environ, **s3_env, "REDIS_URL": url}
                    assert s3.proc is not None
                    weed0 = cpu_of(s3.proc.pid)
                    wall, cpu, s = enqueue(data, run, s3.url("out"), env, work, mode)
                    weed = cpu_of(s3.proc.pid) - weed0
                    queued = used(conn) - empty
                finally:
                    srv.terminate()
                    srv.wait()
                objects, size = s3_bytes(s3, f"out/{run}/")
                items = int(s["items"])
                print(f"{mode} round {rnd}: {wall:.0f} s", file=sys.stderr)
                rows.append((s["prompts"], str(rnd), f"{s['records']:,}", f"{wall:.1f}", f"{s['records'] / wall:,.0f}",
                             f"{cpu:.1f}", f"{weed:.1f}", f"{queued / items:,.0f}", f"{objects:,}", f"{size / 1e6:,.1f}",
                             f"{size / items:,.0f}", f"{s['packs']:,}", f"{s['jobs']:,}"))
        print(f"{args.items:,} records of 1-4 KB ({mb:.0f} MB of JSONL), one item each (regenerate); output on "
              f"SeaweedFS S3 (weed mini, same host{f', {args.s3_latency:g} ms added to each reply' if proxy else ''}), "
              "a fresh redis-server per enqueue")
        if proxy is not None:
            proxy.close()
        print(table(rows))
    finally:
        s3.stop(kill=True)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
