"""Consumer cost: completions/s and CPU per completion against the stand-in with zero delay.

    python -m bench.bench_consumer --items 20000 --concurrency 64 256 1024

The whole path is on: Redis (dequeue, leases, acks), HTTP to the stand-in, parsing,
result records, shards shipped to a local directory. The stand-in runs on core 0 and the
consumer on core 1, so the consumer's CPU time is its own.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from bench.common import BIN, pinned, start_redis, start_sim, table, timed


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--items", type=int, default=20000)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[64, 256, 1024])
    ap.add_argument("--mean-tokens", type=int, default=512)
    args = ap.parse_args()
    rows = [("concurrency", "items", "wall s", "completions/s", "consumer CPU s", "CPU ms/completion")]
    work = Path(tempfile.mkdtemp(prefix="gq-bench-consumer-"))
    redis_proc, url = start_redis(work)
    sim, endpoint = start_sim(["--slots", "100000", "--step-time", "0", "--mean-tokens", str(args.mean_tokens)])
    env = {**os.environ, "REDIS_URL": url}
    data = work / "data.jsonl"
    with open(data, "w") as fh:
        fh.writelines('{"conversations":[{"from":"human","value":"Question %d: explain the idea of item %d '
                     'in a few paragraphs, with an example."}]}\n' % (i, i) for i in range(args.items))
    try:
        for c in args.concurrency:
            run = f"c{c}"
            subprocess.run([str(BIN / "producer"), "enqueue", str(data), "--run", run, "--output", str(work / "out"),
                            "--max-tokens", "2048", "--rejects", str(work / "rej")], env=env, check=True,
                           stdout=subprocess.DEVNULL)
            cmd = pinned([str(BIN / "consumer"), "run", "--run", run, "--endpoint", endpoint, "--burst",
                          "-c", str(c), "--spool", str(work / "spool" / run)], 1)
            wall, cpu, rc = timed(cmd, env)
            if rc != 0:
                raise SystemExit(f"consumer exited {rc}")
            rows.append((str(c), f"{args.items:,}", f"{wall:.1f}", f"{args.items / wall:,.0f}", f"{cpu:.1f}",
                         f"{1000 * cpu / args.items:.3f}"))
    finally:
        sim.terminate()
        redis_proc.terminate()
        shutil.rmtree(work, ignore_errors=True)
    print(table(rows))


if __name__ == "__main__":
    main()
