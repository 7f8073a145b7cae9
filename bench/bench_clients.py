"""Client CPU per completion: the consumer's raw aiohttp client vs the `openai` package.

    python -m bench.bench_clients --requests 5000 --in-flight 256

Each client runs in its own process pinned to core 1 (the stand-in on core 0) and sends the
same non-streaming requests (~2.4 KB responses); CPU time is measured with
resource.getrusage around the request loop only.
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import subprocess
import sys
import time

from bench.common import pinned, start_sim, table

BODY = {"model": "sim-model", "messages": [{"role": "user", "content": "Explain item 1 briefly."}],
        "max_tokens": 1024}


async def _raw(url: str, n: int, inflight: int) -> None:
    from genqueue.consumer.answer.client import EndpointClient

    async with EndpointClient(url) as client:
        await _drive(lambda i: client.chat({**BODY, "seed": i}), n, inflight)


async def _openai(url: str, n: int, inflight: int, transport: str) -> None:
    import openai

    kwargs = {}
    if transport == "aiohttp":
        kwargs["http_client"] = openai.DefaultAioHttpClient()
    client = openai.AsyncOpenAI(base_url=url, api_key="x", max_retries=0, **kwargs)
    async with client:
        await _drive(lambda i: client.chat.completions.create(**BODY, seed=i), n, inflight)


async def _drive(call, n: int, inflight: int) -> None:
    sem = asyncio.Semaphore(inflight)

    async def one(i: int) -> None:
        async with sem:
            await call(i)

    await asyncio.gather(*(one(i) for i in range(n)))


def child(kind: str, url: str, n: int, inflight: int) -> None:
    import uvloop

    r0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    if kind == "raw-aiohttp":
        uvloop.run(_raw(url, n, inflight))
    else:
        uvloop.run(_openai(url, n, inflight, kind.split("-", 1)[1]))
    wall = time.perf_counter() - t0
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
    print(f"{wall} {cpu}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=5000)
    ap.add_argument("--in-flight", type=int, default=256)
    ap.add_argument("--child", nargs=4)
    args = ap.parse_args()
    if args.child:
        kind, url, n, inflight = args.child
        child(kind, url, int(n), int(inflight))
        return
    sim, url = start_sim(["--slots", "100000", "--step-time", "0", "--mean-tokens", "512"])
    rows = [("client", "requests", "in flight", "req/s", "CPU ms/completion")]
    try:
        for kind in ("raw-aiohttp", "openai-aiohttp", "openai-httpx"):
            out = subprocess.run(pinned([sys.executable, "-m", "bench.bench_clients", "--child", kind, url,
                                         str(args.requests), str(args.in_flight)], 1),
                                 capture_output=True, text=True)
            if out.returncode != 0:
                rows.append((kind, "-", "-", "failed", out.stderr.strip().splitlines()[-1][:60]))
                continue
            wall, cpu = map(float, out.stdout.split())
            rows.append((kind, f"{args.requests:,}", str(args.in_flight), f"{args.requests / wall:,.0f}",
                         f"{1000 * cpu / args.requests:.3f}"))
    finally:
        sim.terminate()
    print(table(rows))


if __name__ == "__main__":
    main()
