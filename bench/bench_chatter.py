"""What consumers send Redis a second while their engine is slow: the commands a run's items
cost when a GPU completes a few items a second, not thousands.

    python -m bench.bench_chatter --consumers 1 --seconds 60

A private redis-server, the stand-in vLLM made slow (`--step-time 0.05 --mean-tokens 100`, 16
slots: about 3 completions a second a consumer at `-c 16`), a run of short items enqueued with
the real `producer enqueue` (by reference unless `--prompts inline`), then CONSUMERS real
`consumer run` processes against it. After a warm-up, Redis's `total_commands_processed` and
the stand-in's completed requests are read over SECONDS, and MONITOR counts each command by
its name and key (run names, worker names and numbers folded to `*`), Lua's calls included,
the bench's own connections left out. It prints commands a second a consumer, commands a
completion, and where they go. A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import redis

from bench.bench_redis_items import make_short
from bench.common import BIN, start_redis, start_sim, table

_FOLD = re.compile(r"[0-9a-f]{8,}|\d+")


def requests_done(endpoint: str) -> int:
    with urllib.request.urlopen(endpoint.removesuffix("/v1") + "/sim/stats", timeout=5) as r:
        stats = json.loads(r.read())
    return int(stats["requests"]) - int(stats.get("running", 0)) - int(stats.get("waiting", 0))


def fold(words: list[str], names: list[str]) -> str:
    """A command's name and its first key, with the workers' names and numbers folded."""
    name = words[0].upper()
    if name == "EVAL":  # the script's text, split at its spaces: named as a whole
        return "EVAL (a script sent whole)"
    at = 3 if name == "EVALSHA" else 1  # EVALSHA sha numkeys key ...
    key = words[at] if len(words) > at else ""
    for n in names:
        key = key.replace(n, "<worker>")
    return f"{name} {_FOLD.sub('*', key)}".strip()


def monitor(url: str, until: float, counts: collections.Counter[str], mine: set[str], names: list[str]) -> None:
    conn = redis.Redis.from_url(url)
    with conn.monitor() as m:
        while time.time() < until:
            try:
                cmd = m.next_command()
            except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError):
                return
            addr = f"{cmd.get('client_address')}:{cmd.get('client_port')}"
            if addr in mine:
                continue
            where = "lua " if cmd.get("client_type") == "lua" else ""
            words = str(cmd["command"]).split(" ")
            counts[where + fold(words, names)] += 1


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--consumers", type=int, default=1)
    ap.add_argument("--items", type=int, default=4000)
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--warmup", type=float, default=15.0)
    ap.add_argument("--prompts", choices=["reference", "inline"], default="reference")
    ap.add_argument("--step-time", default="0.05")
    ap.add_argument("--mean-tokens", default="100")
    ap.add_argument("--concurrency", default="16")
    ap.add_argument("--top", type=int, default=16)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        srv, url = start_redis(work)
        sim, endpoint = start_sim(["--slots", args.concurrency, "--step-time", args.step_time,
                                   "--mean-tokens", args.mean_tokens], core=None)
        procs: list[subprocess.Popen[bytes]] = []
        try:
            env = {**os.environ, "REDIS_URL": url}
            data = work / "data.jsonl"
            make_short(data, args.items)
            subprocess.run([str(BIN / "producer"), "enqueue", str(data), "--run", "bench", "--output",
                            str(work / "out"), "--max-tokens", "256", "--prompts", args.prompts],
                           env=env, check=True, capture_output=True)
            for i in range(args.consumers):
                procs.append(subprocess.Popen(
                    [str(BIN / "consumer"), "run", "--run", "bench", "--endpoint", endpoint, "-c", args.concurrency,
                     "--spool", str(work / f"spool-{i}")], env=env,
                    stdout=subprocess.DEVNULL, stderr=open(work / f"consumer-{i}.log", "wb")))
            time.sleep(args.warmup)
            conn = redis.Redis.from_url(url)
            mine = {str(conn.client_info()["addr"])}
            names = [w.decode() if isinstance(w, bytes) else str(w)
                     for w in conn.smembers("rq:workers")]
            names = [n.removeprefix("rq:worker:") for n in names]
            counts: collections.Counter[str] = collections.Counter()
            until = time.time() + args.seconds
            watcher = threading.Thread(target=monitor, args=(url, until, counts, mine, names), daemon=True)
            watcher.start()
            time.sleep(0.2)
            mine |= {f"{c['addr']}" for c in conn.client_list() if c.get("cmd") == "monitor"}
            c0, r0, t0 = int(conn.info("stats")["total_commands_processed"]), requests_done(endpoint), time.time()
            time.sleep(max(0.0, until - time.time()))
            c1, r1, t1 = int(conn.info("stats")["total_commands_processed"]), requests_done(endpoint), time.time()
            watcher.join(timeout=5)
            secs, cmds, done = t1 - t0, c1 - c0 - 2, r1 - r0
            left = conn.llen("rq:queue:genqueue.bench")
            held = conn.zcard("rq:wip:genqueue.bench")
            print(f"{args.consumers} consumer(s), -c {args.concurrency}, stand-in step {args.step_time} s, "
                  f"{args.mean_tokens} tokens a completion, {args.prompts}; {secs:.0f} s measured, "
                  f"{left} job(s) still queued and {held} held at the end")
            print(table([
                ("figure", "value"),
                ("completions a second", f"{done / secs:.2f}"),
                ("Redis commands a second (total_commands_processed)", f"{cmds / secs:.2f}"),
                ("  a consumer", f"{cmds / secs / args.consumers:.2f}"),
                ("Redis commands a completion", f"{cmds / max(done, 1):.3f}"),
                ("commands MONITOR saw (Lua's calls included)", f"{sum(counts.values()) / secs:.2f} a second"),
            ]))
            print()
            rows = [("command, key", "a second", "a completion")]
            for what, n in counts.most_common(args.top):
                rows.append((what, f"{n / secs:.2f}", f"{n / max(done, 1):.3f}"))
            print(table(rows))
        finally:
            for p in procs:
                p.terminate()
            for p in procs:
                try:
                    p.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    p.kill()
            sim.terminate()
            srv.terminate()
            if any(p.returncode not in (0, -15) for p in procs):
                for i in range(len(procs)):
                    sys.stderr.write((work / f"consumer-{i}.log").read_text(errors="replace")[-2000:])


if __name__ == "__main__":
    main()
