"""What top-K log-probabilities cost real vLLM: the same requests at K = 0, 20 and the engine's
maximum, side by side on one engine (not a test).

    GENQUEUE_VLLM_PYTHON=~/.cache/genqueue/vllm-venv/bin/python \
    GENQUEUE_TINY_MODEL=~/.cache/genqueue/tiny-qwen2 \
    GENQUEUE_TINY_RANDOM_MODEL=~/.cache/genqueue/tiny-qwen2-random \
    .venv/bin/python -m tests.vllm.bench_logprobs --requests 128 --concurrency 32 --rounds 3

vLLM serves the random tiny model once, started with --max-logprobs M (128 by default:
DistillKit's recommended K; vLLM's own default is 20). Each round sends the same kind of chat
requests (a fresh prompt each, MAX_TOKENS generated, end of text ignored so every answer has the
same length) keeping C in flight, once per K, the K order rotating from round to round: K = 0
asks for no log-probabilities; K > 0 asks as a run of --logprobs K does (common/logprobs.py's
request_fields: logprobs, top_logprobs, tokens named by id). The largest K is the largest a run
may ask for of an engine started with M. Reported: requests/s and tokens/s per round, the answer's
bytes on the wire per generated token, the client's CPU per request (reading the JSON), and the
medians over rounds of each K's requests/s over K = 0's in the same round.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import orjson

from bench.bench_logprobs_cost import largest_k
from bench.common import table
from genqueue.common.logprobs import request_fields
from tests.vllm.conftest import SERVED_NAME, TINY_MODEL, VllmServer

MAX_TOKENS = 32


def prompt(i: int) -> str:
    return f"Question {i}: explain the idea of item {i} in a few paragraphs, with an example."


def _cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


async def _round(endpoint: str, first: int, n: int, concurrency: int, k: int) -> dict[str, float]:
    sem = asyncio.Semaphore(concurrency)
    totals = {"tokens": 0.0, "bytes": 0.0, "tables": 0.0}
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    fields = request_fields(k) if k else {}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:
        async def one(i: int) -> None:
            body = {"model": SERVED_NAME, "messages": [{"role": "user", "content": prompt(i)}],
                    "max_tokens": MAX_TOKENS, "temperature": 0.8, "ignore_eos": True, **fields}
            async with sem, session.post(f"{endpoint}/chat/completions", data=orjson.dumps(body),
                                         headers={"Content-Type": "application/json"}) as r:
                raw = await r.read()
                data = orjson.loads(raw)
                if r.status != 200:
                    raise RuntimeError(f"HTTP {r.status}: {data}")
            totals["tokens"] += data["usage"]["completion_tokens"]
            totals["bytes"] += len(raw)
            if k:
                content = data["choices"][0]["logprobs"]["content"]
                totals["tables"] += sum(len(t["top_logprobs"]) for t in content) / len(content)

        cpu0, t0 = _cpu(), time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(first, first + n)))
        return {"wall": time.perf_counter() - t0, "cpu": _cpu() - cpu0, **totals}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-logprobs", type=int, default=128, help="the engine's --max-logprobs")
    args = ap.parse_args()
    model = os.environ.get("GENQUEUE_TINY_RANDOM_MODEL") or str(Path(TINY_MODEL).parent / "tiny-qwen2-random")
    if not (os.environ.get("GENQUEUE_VLLM_PYTHON") and Path(model, "config.json").exists()):
        sys.exit("set GENQUEUE_VLLM_PYTHON and GENQUEUE_TINY_RANDOM_MODEL (scripts/vllm-tier prepares both)")
    ks = [0, 20, largest_k(args.max_logprobs)]
    work = Path(tempfile.mkdtemp(prefix="gq-bench-logprobs-"))
    rows: list[tuple[str, ...]] = [("K", "round", "wall s", "requests/s", "tokens/s", "wire B/token",
                                    "client CPU ms/request", "entries/token")]
    rates: dict[int, list[float]] = {k: [] for k in ks}
    server = VllmServer(work, ("--max-logprobs", str(args.max_logprobs)), model=model)
    server.start()
    try:
        asyncio.run(_round(server.url, 10**9, 2 * args.concurrency, args.concurrency, ks[-1]))  # warm-up
        for rnd in range(args.rounds):
            for k in ks[rnd % len(ks):] + ks[:rnd % len(ks)]:
                r = asyncio.run(_round(server.url, (rnd * len(ks) + k + 1) * args.requests, args.requests,
                                       args.concurrency, k))
                rates[k].append(args.requests / r["wall"])
                rows.append((str(k), str(rnd + 1), f"{r['wall']:.2f}", f"{args.requests / r['wall']:.1f}",
                             f"{r['tokens'] / r['wall']:.0f}", f"{r['bytes'] / r['tokens']:.0f}",
                             f"{1000 * r['cpu'] / args.requests:.2f}",
                             f"{r['tables'] / args.requests:.0f}" if k else ""))
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)
    print(f"{args.requests} chat requests a round a K, concurrency {args.concurrency}, {MAX_TOKENS} tokens each, "
          f"random tiny model, one engine started with --max-logprobs {args.max_logprobs}")
    print(table([rows[0], *sorted(rows[1:], key=lambda row: (int(row[0]), int(row[1])))]))
    base = rates[0]
    print("median requests/s: " + "; ".join(
        f"K = {k} {statistics.median(v):.1f} (x K=0 {statistics.median(a / b for a, b in zip(v, base, strict=True)):.2f})"
        for k, v in rates.items()))


if __name__ == "__main__":
    main()
