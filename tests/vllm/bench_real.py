"""genqueue's consumer against a bare aiohttp client, both on the same real vLLM (not a test).

    GENQUEUE_VLLM_PYTHON=~/.cache/genqueue/vllm-venv/bin/python \
    GENQUEUE_TINY_MODEL=~/.cache/genqueue/tiny-qwen2 PATH=$PWD/.venv/bin:$PATH \
    .venv/bin/python -m tests.vllm.bench_real --items 400 --concurrency 32 --rounds 3 [--pin]

Both send the same kind of single-turn requests (same prompt shape, sampling and max_tokens;
fresh numbers in every prompt, so vLLM's prefix cache favours neither) keeping C requests in
flight. The bare client is the floor of client overhead: one aiohttp session, a semaphore,
orjson, nothing else. genqueue runs the whole path: `producer enqueue` (not timed), then
`consumer run --burst` (Redis dequeue, leases, records, shards shipped to a local dir, acks).

Reported per round: completions/s and completion tokens/s, for genqueue over the consumer's
whole process life (start-up and final shard included) and over its busy span (first request
started to last finished, from the records' timings); the throughput ratio genqueue/bare; and
the client CPU per completion (the figure a shared machine disturbs least). On 2 cores vLLM
and the client compete for CPU: --pin puts vLLM on core 0 and the clients on core 1, closer
to a GPU node where the client's CPU does not slow the engine.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import orjson

from bench.common import BIN, start_redis, table
from tests.vllm.conftest import SERVED_NAME, VllmServer

SAMPLING = {"max_tokens": 128, "temperature": 0.6, "top_p": 0.95}


def prompt(i: int) -> str:
    return f"Question {i}: explain the idea of item {i} in a few paragraphs, with an example."


def _cpu_self() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


async def _bare(endpoint: str, n: int, concurrency: int, first: int) -> tuple[float, int]:
    sem = asyncio.Semaphore(concurrency)
    tokens = 0
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        async def one(i: int) -> None:
            nonlocal tokens
            body = {"model": SERVED_NAME, "messages": [{"role": "user", "content": prompt(i)}], **SAMPLING}
            async with sem, session.post(f"{endpoint}/chat/completions", data=orjson.dumps(body),
                                    headers={"Content-Type": "application/json"}) as r:
                data = orjson.loads(await r.read())
                if r.status != 200:
                    raise RuntimeError(f"HTTP {r.status}: {data}")
                tokens += data["usage"]["completion_tokens"]

        t0 = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(first, first + n)))
        return time.perf_counter() - t0, tokens


def bare(endpoint: str, n: int, concurrency: int, first: int = 0) -> dict[str, float]:
    """N completions with CONCURRENCY in flight, from this process."""
    cpu0 = _cpu_self()
    wall, tokens = asyncio.run(_bare(endpoint, n, concurrency, first))
    return {"wall": wall, "tokens": tokens, "cpu": _cpu_self() - cpu0}


def genqueue(endpoint: str, n: int, concurrency: int, work: Path, redis_url: str, run: str,
             first: int = 0, core: int | None = None) -> dict[str, float]:
    env = {**os.environ, "REDIS_URL": redis_url}
    data = work / f"{run}.jsonl"
    data.write_bytes(b"".join(orjson.dumps({"conversations": [{"from": "human", "value": prompt(i)}]}) + b"\n"
                              for i in range(first, first + n)))
    subprocess.run([str(BIN / "producer"), "enqueue", str(data), "--run", run, "--output", str(work / "out"),
                    "--multi-turn", "first", "--max-tokens", str(SAMPLING["max_tokens"]),
                    "--temperature", str(SAMPLING["temperature"]), "--top-p", str(SAMPLING["top_p"]),
                    "--rejects", str(work / f"{run}.rej")], env=env, check=True, stdout=subprocess.DEVNULL)
    cmd = [str(BIN / "consumer"), "run", "--run", run, "--endpoint", endpoint, "--burst",
           "-c", str(concurrency), "--spool", str(work / "spool" / run), "--shard-max-age", "1"]
    if core is not None:
        cmd = ["taskset", "-c", str(core), *cmd]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _, status, rusage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"consumer exited {os.waitstatus_to_exitcode(status)}")
    recs = []
    for shard in (work / "out" / run / "shards").glob("*.jsonl"):
        recs += [orjson.loads(x) for x in shard.read_bytes().splitlines() if x.strip()]
    if len(recs) != n or any("error" in r for r in recs):
        raise RuntimeError(f"genqueue wrote {len(recs)} records for {n} items (or errors)")
    busy = max(r["timings"]["finished_at"] for r in recs) - min(r["timings"]["started_at"] for r in recs)
    return {"wall": wall, "busy": busy, "tokens": sum(r["usage"]["completion_tokens"] for r in recs),
            "cpu": rusage.ru_utime + rusage.ru_stime}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--items", type=int, default=400)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--pin", action="store_true", help="vLLM on core 0, the clients on core 1")
    ap.add_argument("--endpoint", help="use a running vLLM serving the tiny model as 'tiny' instead of starting one")
    args = ap.parse_args()
    pin = args.pin and shutil.which("taskset") is not None and (os.cpu_count() or 1) > 1
    work = Path(tempfile.mkdtemp(prefix="gq-bench-real-"))
    server = None
    endpoint = args.endpoint
    if endpoint is None:
        if not (os.environ.get("GENQUEUE_VLLM_PYTHON") and os.environ.get("GENQUEUE_TINY_MODEL")):
            sys.exit("set GENQUEUE_VLLM_PYTHON and GENQUEUE_TINY_MODEL (scripts/vllm-tier prepares both)")
        server = VllmServer(work, (), prefix=("taskset", "-c", "0") if pin else ())
        server.start()
        endpoint = server.url
    if pin:
        os.sched_setaffinity(0, {1})
    redis_proc, redis_url = start_redis(work)
    n, c = args.items, args.concurrency
    rows = [("round", "client", "wall s", "completions/s", "tokens/s", "genqueue/bare", "client CPU ms/completion")]
    ratios = []
    try:
        bare(endpoint, 2 * c, c, first=10**9)  # warm-up
        for rnd in range(1, args.rounds + 1):
            base = 2 * rnd * n
            if rnd % 2:  # alternate who goes first
                b = bare(endpoint, n, c, first=base)
                g = genqueue(endpoint, n, c, work, redis_url, f"bench{rnd}", first=base + n, core=1 if pin else None)
            else:
                g = genqueue(endpoint, n, c, work, redis_url, f"bench{rnd}", first=base + n, core=1 if pin else None)
                b = bare(endpoint, n, c, first=base)
            b_rate = b["tokens"] / b["wall"]
            rows.append((str(rnd), "bare aiohttp", f"{b['wall']:.2f}", f"{n / b['wall']:.1f}", f"{b_rate:.0f}", "",
                         f"{1000 * b['cpu'] / n:.2f}"))
            for label, span in (("genqueue (process life)", g["wall"]), ("genqueue (busy span)", g["busy"])):
                ratio = (g["tokens"] / span) / b_rate
                rows.append((str(rnd), label, f"{span:.2f}", f"{n / span:.1f}", f"{g['tokens'] / span:.0f}",
                             f"{ratio:.2f}", f"{1000 * g['cpu'] / n:.2f}" if label.endswith("life)") else ""))
                ratios.append((label, ratio))
    finally:
        redis_proc.terminate()
        if server is not None:
            server.stop()
        shutil.rmtree(work, ignore_errors=True)
    where = " (vLLM on core 0, clients on core 1)" if pin else " (all on both cores)"
    print(f"{n} single-turn items, concurrency {c}, max_tokens {SAMPLING['max_tokens']}, real vLLM{where}; "
          "ratio = tokens/s genqueue / bare")
    print(table(rows))
    for label in ("genqueue (process life)", "genqueue (busy span)"):
        rs = sorted(r for lab, r in ratios if lab == label)
        print(f"median ratio, {label}: {rs[len(rs) // 2]:.2f}")


if __name__ == "__main__":
    main()
