"""Hidden-states capture's cost on real vLLM: the same requests with capture on and off (not a test).

    GENQUEUE_VLLM_PYTHON=~/.cache/genqueue/vllm-venv/bin/python \
    GENQUEUE_TINY_MODEL=~/.cache/genqueue/tiny-qwen2 \
    GENQUEUE_TINY_RANDOM_MODEL=~/.cache/genqueue/tiny-qwen2-random \
    .venv/bin/python -m tests.vllm.bench_capture --requests 256 --concurrency 32 --rounds 3

vLLM serves the random tiny model twice, one start after the other: with genqueue's connector
capturing layers 1, 2 and 4 (consumer/capture/engine_args.py), then without. Each round sends
the same chat requests (a fresh prompt each, MAX_TOKENS generated, end of text ignored so every
answer has the same length) keeping C in flight; with capture on, each request asks for its
output tokens' hidden states too and the client reads every captured file back (read_capture,
in a thread) and removes it, as a consumer would. Reported: requests/s and tokens/s per round and
their medians, and the captured bytes per token; and capture on with the files removed unread
(the engine's share of the cost).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import orjson

from bench.common import table
from genqueue.consumer.capture.captured import read_capture, remove_capture
from genqueue.consumer.capture.engine_args import CaptureEngine, request_fields
from tests.vllm.conftest import SERVED_NAME, TINY_MODEL, VllmServer

LAYERS = (1, 2, 4)
MAX_TOKENS = 32


def prompt(i: int) -> str:
    return f"Question {i}: explain the idea of item {i} in a few paragraphs, with an example."


async def _round(endpoint: str, first: int, n: int, concurrency: int, capture: bool, read: bool) -> dict[str, float]:
    sem = asyncio.Semaphore(concurrency)
    totals = {"tokens": 0.0, "bytes": 0.0, "captured_tokens": 0.0}
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:
        async def one(i: int) -> None:
            body = {"model": SERVED_NAME, "messages": [{"role": "user", "content": prompt(i)}],
                    "max_tokens": MAX_TOKENS, "temperature": 0.8, "ignore_eos": True,
                    **request_fields(with_output=capture)}
            async with sem:
                async with session.post(f"{endpoint}/chat/completions", data=orjson.dumps(body),
                                        headers={"Content-Type": "application/json"}) as r:
                    data = orjson.loads(await r.read())
                    if r.status != 200:
                        raise RuntimeError(f"HTTP {r.status}: {data}")
                totals["tokens"] += data["usage"]["completion_tokens"]
                if capture:
                    path = data["kv_transfer_params"]["hidden_states_path"]
                    if read:
                        got = await asyncio.to_thread(read_capture, path)
                        totals["bytes"] += Path(path).stat().st_size
                        totals["captured_tokens"] += got.token_ids.size
                    await asyncio.to_thread(remove_capture, path)

        t0 = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(first, first + n)))
        return {"wall": time.perf_counter() - t0, **totals}


def measure(server: VllmServer, label: str, n: int, concurrency: int, rounds: int, capture: bool, read: bool,
            rows: list[tuple[str, ...]], summary: dict[str, list[float]]) -> None:
    asyncio.run(_round(server.url, 10**9, 2 * concurrency, concurrency, capture, read))  # warm-up
    for rnd in range(1, rounds + 1):
        r = asyncio.run(_round(server.url, rnd * n, n, concurrency, capture, read))
        rate = n / r["wall"]
        summary.setdefault(label, []).append(rate)
        per_token = f"{r['bytes'] / r['captured_tokens']:.0f}" if r["captured_tokens"] else ""
        rows.append((label, str(rnd), f"{r['wall']:.2f}", f"{rate:.1f}", f"{r['tokens'] / r['wall']:.0f}", per_token))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    model = os.environ.get("GENQUEUE_TINY_RANDOM_MODEL") or str(Path(TINY_MODEL).parent / "tiny-qwen2-random")
    if not (os.environ.get("GENQUEUE_VLLM_PYTHON") and Path(model, "config.json").exists()):
        sys.exit("set GENQUEUE_VLLM_PYTHON and GENQUEUE_TINY_RANDOM_MODEL (scripts/vllm-tier prepares both)")
    work = Path(tempfile.mkdtemp(prefix="gq-bench-capture-"))
    engine = CaptureEngine(LAYERS, work / "captured")
    rows: list[tuple[str, ...]] = [("engine", "round", "wall s", "requests/s", "tokens/s", "file B/token")]
    summary: dict[str, list[float]] = {}
    try:
        for label, extra, env, capture in (("capture on", tuple(engine.argv()), engine.env(os.environ), True),
                                           ("capture off", (), None, False)):
            server = VllmServer(work, extra, model=model, env=env)
            server.start()
            try:
                measure(server, label, args.requests, args.concurrency, args.rounds, capture, True, rows, summary)
                if capture:  # the engine's share of the cost: files removed unread
                    measure(server, "capture on, unread", args.requests, args.concurrency, args.rounds, capture,
                            False, rows, summary)
            finally:
                server.stop()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"{args.requests} chat requests a round, concurrency {args.concurrency}, {MAX_TOKENS} tokens each, "
          f"random tiny model, layers {list(LAYERS)} captured with the answer")
    print(table(rows))
    on, off = statistics.median(summary["capture on"]), statistics.median(summary["capture off"])
    unread = statistics.median(summary["capture on, unread"])
    print(f"median requests/s: capture on {on:.1f} (files unread {unread:.1f}), off {off:.1f} "
          f"(on/off {on / off:.2f}; unread/off {unread / off:.2f})")


if __name__ == "__main__":
    main()
