"""The reconcile at scale: a re-run of `producer enqueue` on a finished N-item run, and what the
done marks cost in Redis.

    python -m bench.bench_reconcile --records 1000000

Builds N ShareGPT records (bench_producer's), enqueues them as a user does against a private
redis-server, then makes the run finished the way consumers leave it: every job consumed (the
queue emptied) and every item marked done (its DONE bit in the run's item table).
Then it times:

- re-run on the finished run: nothing to do (every item is already_done): the input is the one
  of the last complete enqueue, so it is not read (only digested); then the same re-run made to
  read and reconcile every record (--retry-failed, which never takes that path);
- re-run on a run nothing of which is done: every item is already queued (the queue view, every
  live job's payload, is read once, under the run's lock);
- re-run after `rq empty` on that run: every item is queued again.

Prints one table; a benchmark, not a test.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path

import redis

from bench.bench_producer import make_records, producer
from bench.common import start_redis
from genqueue.common.keepers.itemlayout import bucket_key
from genqueue.common.keepers.items import DONE, ItemTable


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--records", type=int, default=1_000_000)
    ap.add_argument("--batch-size", type=int, default=32)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="gq-bench-reconcile-"))
    srv = None
    try:
        data = work / "data.jsonl"
        make_records(data, args.records)
        srv, url = start_redis(work)
        conn = redis.Redis.from_url(url)
        env = {**os.environ, "REDIS_URL": url}
        common = [str(data), "--batch-size", str(args.batch_size), "--rejects", str(work / "rej"),
                  "--output", str(work / "out")]
        (work / "out").mkdir()
        first, first_s = producer(*common, "--run", "fin", env=env)
        n = first["items"]
        # Finished: every job consumed, every item's result shipped (the consumers' done marks).
        before = conn.info("memory")["used_memory"]
        ItemTable(conn, "fin").change(list(ItemTable(conn, "fin").digests()), add=DONE)
        marks = conn.info("memory")["used_memory"] - before
        table = ItemTable(conn, "fin")
        keys_set = sum(conn.memory_usage(bucket_key("fin", b), samples=0) or 0 for b in range(table.buckets()))
        conn.delete("rq:queue:genqueue.fin")
        again, again_s = producer(*common, "--run", "fin", env=env)
        assert again["already_done"] == first["enqueued"] and again["input_unchanged"], again
        # The same, reading the input anyway (--retry-failed never takes the unchanged-input path).
        full, full_s = producer(*common, "--run", "fin", "--retry-failed", env=env)
        assert full["already_done"] == first["enqueued"] and not full["input_unchanged"], full
        # Queued, then lost: the same input as another run; a re-run while every item is queued
        # (the queue view reads every job's payload), then its queue emptied before anything was done.
        producer(*common, "--run", "lost", env=env)
        queued, queued_s = producer(*common, "--run", "lost", env=env)
        assert queued["already_queued"] == first["enqueued"] and queued["items"] == 0, queued
        conn.delete("rq:queue:genqueue.lost")
        lost, lost_s = producer(*common, "--run", "lost", env=env)
        assert lost["requeued"] == n, lost
        rows = [
            ("records / items", f"{args.records:,} / {n:,}"),
            ("first enqueue", f"{first_s:.1f} s"),
            ("re-run on the finished run (input unchanged: not read)", f"{again_s:.1f} s"),
            ("re-run on the finished run, input read and reconciled",
             f"{full_s:.1f} s = {args.records / full_s:,.0f} records/s"),
            ("re-run on a run whose items are all queued",
             f"{queued_s:.1f} s (queue view {queued['queue_view']['seconds']:.1f} s)"),
            ("re-run after rq empty (every item queued again)",
             f"{lost_s:.1f} s (queue view {lost['queue_view']['seconds']:.1f} s)"),
            ("Redis: done marks", f"{marks / 1e6:.1f} MB = {marks / n:.0f} B/item"),
            ("Redis: the run's item table (items, done and failed)", f"{keys_set / 1e6:.1f} MB = {keys_set / n:.0f} B/item"),
        ]
        w = max(len(k) for k, _ in rows)
        print("\n".join(f"{k.ljust(w)}  {v}" for k, v in rows))
        sys.stdout.flush()
    finally:
        if srv is not None:
            srv.terminate()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
