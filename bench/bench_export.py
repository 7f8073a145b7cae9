"""`producer export` at scale: records/s and the export process's peak memory, JSONL and
Parquet side by side on the same shards.

    python -m bench.bench_export --records 1000000 --records 250000
    python -m bench.bench_export --records 1000000 --suffix .jsonl --suffix .parquet

For each size: writes N result records shaped like the consumer's (regenerate mode, 1-3 turns
with reasoning, ~2 KB each) plus ~3% duplicates (re-deliveries, some of them error records)
into 64 MB shards of a local output directory, creates the run in a private redis-server
(settings, source record count, the set of enqueued keys), then runs the export as a user does
(a subprocess) and reads its peak RSS from wait4. Prints one table; a benchmark, not a test.
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

from bench.common import BIN, start_redis, table
from genqueue.common.keepers.items import IN_RUN, ItemTable

WORDS = ["the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "with", "was", "on", "be", "by", "this", "are", "from", "at", "or", "an", "have", "not", "but", "which", "model", "data", "system", "function", "value", "error", "output", "input", "process", "memory", "network", "query", "result", "token", "gradient", "layer", "batch", "sequence", "attention", "vector", "matrix", "python", "server", "request", "response"]
SHARD_BYTES = 64 * 1024 * 1024
RUN = "bench"


def _texts(rng: random.Random, n: int, lo: int, hi: int) -> list[str]:
    return [" ".join(rng.choices(WORDS, k=rng.randint(lo, hi))) for _ in range(n)]


def make_record(i: int, rng: random.Random, pool: dict[str, list[str]], attempt: int = 1) -> dict[str, Any]:
    turns = rng.choice((1, 1, 2, 3))
    messages, per_turn = [], []
    for t in range(turns):
        answer, thinking = rng.choice(pool["answer"]), rng.choice(pool["thinking"])
        messages += [{"role": "user", "content": f"{rng.choice(pool['question'])} ({i}.{t})"},
                     {"role": "assistant", "content": answer}]
        per_turn.append({"turn": t, "content": answer, "reasoning": thinking, "finish_reason": "stop",
                         "outcome": "finished", "usage": {"prompt_tokens": 40, "completion_tokens": 120}})
    last = per_turn[-1]
    return {"messages": messages, "turns": per_turn, "content": last["content"], "reasoning": last["reasoning"],
            "reasoning_form": "field", "tool_calls": [], "finish_reason": "stop", "outcome": "finished",
            "usage": {"prompt_tokens": 40 * turns, "completion_tokens": 120 * turns}, "model": "sim-model",
            "history_reasoning": "drop", "turns_total": turns, "key": f"{i:032x}", "index": i, "turn": None,
            "id": f"row-{i}", "source": "data.jsonl", "source_seq": 0,
            "run": RUN, "sampling": {"max_tokens": 4096, "temperature": 0.6, "top_p": 0.95},
            "fingerprint": "4001d2099420eed6", "version": "0.1.0",
            "consumer": {"host": "gpu-node-1", "gpu": i % 8, "worker": "gq-gpu-node-1-0a1b2c3d",
                         "endpoint": "http://127.0.0.1:8000/v1"},
            "attempt": attempt, "timings": {"enqueued_at": 1.7e9, "started_at": 1.7e9 + i, "finished_at": 1.7e9 + i,
                                            "latency_s": 2.5}}


def build(out: Path, n: int, dup_rate: float, seed: int = 0) -> tuple[int, int]:
    """Write the shards; returns (records written, bytes)."""
    rng = random.Random(seed)
    pool = {"question": _texts(rng, 500, 15, 60), "answer": _texts(rng, 500, 40, 150),
            "thinking": _texts(rng, 500, 30, 120)}
    shards = out / RUN / "shards"
    shards.mkdir(parents=True)
    seq = written = total = size = 0
    fh = None
    for i in range(n):
        lines = [orjson.dumps(make_record(i, rng, pool))]
        if rng.random() < dup_rate:
            if rng.random() < 0.2:
                lines.append(orjson.dumps({"key": f"{i:032x}", "index": i, "turn": None, "run": RUN,
                                           "messages": [], "attempt": 2, "timings": {"finished_at": 1.8e9},
                                           "error": {"class": "transient_exhausted", "type": "TransientError",
                                                     "status": 503, "message": "unavailable"}}))
            else:
                lines.append(orjson.dumps(make_record(i, rng, pool, attempt=2)))
        for line in lines:
            if fh is None or size >= SHARD_BYTES:
                if fh is not None:
                    fh.close()
                seq += 1
                fh = open(shards / f"gq-bench-{seq:06d}.jsonl", "wb", buffering=1 << 20)  # noqa: SIM115
                size = 0
            fh.write(line + b"\n")
            size += len(line) + 1
            total += len(line) + 1
            written += 1
    if fh is not None:
        fh.close()
    return written, total


def setup_run(url: str, out: Path, n: int) -> None:
    from genqueue.common.keepers.runs import RunStore
    from genqueue.common.keepers.runsources import RunSources
    from genqueue.common.settings import RunSettings

    conn = redis.Redis.from_url(url)
    store = RunStore(conn)
    store.create_or_check(RUN, RunSettings(output=str(out)))
    store.record_source(RUN, "data.jsonl", {"records": n})
    RunSources(conn, RUN).assign("data.jsonl")
    for start in range(0, n, 50_000):
        ItemTable(conn, RUN).change([bytes.fromhex(f"{i:032x}") for i in range(start, min(n, start + 50_000))], add=IN_RUN)


def export_cmd() -> list[str]:
    from genqueue.producer.cli import main

    if "export" in main.commands:
        return [str(BIN / "producer"), "export"]
    return [sys.executable, "-c", "from genqueue.producer.export.command import export_command; export_command()"]


def run_export(url: str, dest: Path, fmt: str) -> tuple[dict[str, Any], float, float, int]:
    """Run the export as a subprocess; returns (its JSON summary, wall s, CPU s, peak RSS bytes)."""
    env = {**os.environ, "REDIS_URL": url}
    t0 = time.perf_counter()
    proc = subprocess.Popen([*export_cmd(), "--run", RUN, "--output", str(dest), "--format", fmt, "--json"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    stdout, stderr = proc.stdout.read(), proc.stderr.read()
    _, status, rusage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"export failed:\n{stderr.decode(errors='replace')[-3000:]}")
    return orjson.loads(stdout), wall, rusage.ru_utime + rusage.ru_stime, rusage.ru_maxrss * 1024


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--records", type=int, action="append", help="items per run (repeatable)")
    ap.add_argument("--dup-rate", type=float, default=0.03)
    from genqueue.producer.export.formats import FORMATS

    ap.add_argument("--format", default="openai", choices=[f.value for f, spec in FORMATS.items() if not spec.only_parquet])
    ap.add_argument("--suffix", action="append",
                    help="output suffix, repeatable: .jsonl, .jsonl.gz, .jsonl.zst, .parquet (default: .jsonl and "
                         ".parquet, side by side on the same shards)")
    args = ap.parse_args()
    sizes = args.records or [1_000_000, 250_000]
    suffixes = args.suffix or [".jsonl", ".parquet"]
    rows: list[tuple[str, ...]] = [("items", "output", "records read", "shard data", "export", "records/s", "CPU",
                                    "records/CPU s", "peak RSS", "output size", "dups removed")]
    for n in sizes:
        work = Path(tempfile.mkdtemp(prefix="gq-bench-export-"))
        srv = None
        try:
            t0 = time.perf_counter()
            written, nbytes = build(work / "out", n, args.dup_rate)
            print(f"built {written:,} records ({nbytes / 1e6:,.0f} MB) in {time.perf_counter() - t0:.0f} s",
                  file=sys.stderr)
            srv, url = start_redis(work)
            setup_run(url, work / "out", n)
            for suffix in suffixes:
                dest = work / f"export{suffix}"
                summary, wall, cpu, rss = run_export(url, dest, args.format)
                assert summary["exported"] + summary["failed"] + summary["truncated"] == n, summary
                assert summary["missing"] == 0, summary
                assert summary["records_read"] == written
                rows.append((f"{n:,}", suffix, f"{written:,}", f"{nbytes / 1e6:,.0f} MB", f"{wall:.1f} s",
                             f"{written / wall:,.0f}", f"{cpu:.1f} s", f"{written / cpu:,.0f}",
                             f"{rss / 2**20:,.0f} MiB", f"{dest.stat().st_size / 1e6:,.0f} MB",
                             f"{summary['duplicates_removed']:,}"))
                for companion in work.glob("export.*"):
                    companion.unlink()  # the next output has the disk to itself
        finally:
            if srv is not None:
                srv.terminate()
                srv.wait()
            shutil.rmtree(work, ignore_errors=True)
    print(table(rows))


if __name__ == "__main__":
    main()
