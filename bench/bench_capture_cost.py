"""What `--capture hidden-states` costs the genqueue side: throughput and consumer CPU per completion
with capture off, in fp8 and in bf16, side by side in one run (stand-in vLLM). The engine's own
cost of capture is measured on real vLLM by tests/vllm/bench_capture.py.

    python -m bench.bench_capture_cost                       # 400 items a run, 3 rounds
    python -m bench.bench_capture_cost --items 40 --rounds 1 --mean-tokens 32   # a smoke run

One Redis and one stand-in (zero step time, so the engine is never the bottleneck; pinned to core
0, started with --capture-dir and --hidden-size H, 1,024 by default, capturing layers 2 and 4 as
vLLM's connector writes them: bf16 safetensors a request). Each round enqueues the same items as
one run per mode, every run with --token-ids, the capturing ones with --capture hidden-states
--capture-layers 2,4 and their --capture-dtype, and runs a consumer (pinned to core 1, -c 64,
--burst) on each in turn, the order rotating from round to round. Measured per run: completions a
second (the consumer's start to its exit), the consumer's CPU per completion (its rusage: reading
each capture file, checking its ids, encoding and storing the row, shipping the feature shard),
how busy that kept its core, and the feature bytes stored a row (status). The last columns are the
medians over rounds of each mode's figure over capture off's in the same round.

A benchmark, not a test: it prints its table. Ratios, not the absolute figures, carry from this
shared 2-core machine to another.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.common import BIN, pinned, start_redis, start_sim, table, timed

CONSUMER_CORE = 1
LAYERS = "2,4"
#: The modes compared: capture off, and the two stored dtypes.
MODES = ("off", "fp8", "bf16")


def _status(run: str, env: dict[str, str]) -> dict[str, object]:
    out = subprocess.run([str(BIN / "producer"), "status", "--run", run, "--json"], env=env, capture_output=True,
                         text=True, check=True)
    st: dict[str, object] = json.loads(out.stdout)
    return st


def measure(args: argparse.Namespace, work: Path) -> dict[str, list[dict[str, float]]]:
    """Per mode, per round: completions/s, consumer CPU ms a completion, feature bytes a row."""
    redis_proc, url = start_redis(work)
    env = {**os.environ, "REDIS_URL": url}
    data = work / "data.jsonl"
    with open(data, "w") as fh:
        fh.writelines(f'{{"conversations":[{{"from":"human","value":"Question {i}: explain the idea of item {i} '
                      f'in a few paragraphs, with an example."}}]}}\n' for i in range(args.items))
    figures: dict[str, list[dict[str, float]]] = {m: [] for m in MODES}
    sim = None
    try:
        sim, endpoint = start_sim(["--slots", "100000", "--step-time", "0", "--mean-tokens", str(args.mean_tokens),
                                   "--capture-dir", str(work / "captures"), "--capture-layers", LAYERS,
                                   "--hidden-size", str(args.hidden_size)])
        for r in range(args.rounds):
            order = MODES[r % len(MODES):] + MODES[:r % len(MODES)]
            for mode in order:
                run = f"r{r}{mode}"
                capture = [] if mode == "off" else ["--capture", "hidden-states", "--capture-layers", LAYERS,
                                                    "--capture-dtype", mode]
                subprocess.run([str(BIN / "producer"), "enqueue", str(data), "--run", run, "--output",
                                str(work / "out"), "--max-tokens", str(4 * args.mean_tokens), "--token-ids",
                                *capture, "--rejects", str(work / "rej")],
                               env=env, check=True, stdout=subprocess.DEVNULL)
                cmd = pinned([str(BIN / "consumer"), "run", "--run", run, "--endpoint", endpoint, "--burst", "-c",
                              str(args.concurrency), "--spool", str(work / "spool" / run)], CONSUMER_CORE)
                wall, cpu, rc = timed(cmd, env)
                if rc != 0:
                    raise SystemExit(f"the consumer of capture {mode} exited {rc}")
                cap = _status(run, env).get("capture")
                per_row = float(cap["bytes_per_row"] or 0) if isinstance(cap, dict) else 0.0
                if mode != "off" and not (isinstance(cap, dict) and cap.get("rows") == args.items):
                    raise SystemExit(f"capture {mode}: {cap.get('rows') if isinstance(cap, dict) else None} rows "
                                     f"captured of {args.items}")
                figures[mode].append({"rate": args.items / wall, "cpu": 1000 * cpu / args.items, "bytes": per_row,
                                      "busy": cpu / wall})
                print(f"round {r + 1} capture {mode}: {args.items / wall:.1f} completions/s, "
                      f"{1000 * cpu / args.items:.2f} CPU ms/completion", file=sys.stderr, flush=True)
    finally:
        if sim is not None:
            sim.terminate()
        redis_proc.terminate()
    return figures


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--items", type=int, default=400)
    ap.add_argument("--mean-tokens", type=int, default=128)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--hidden-size", type=int, default=1024, help="the stand-in's width of a captured layer")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="gq-bench-capture-"))
    try:
        figures = measure(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    base = figures["off"]
    rows: list[tuple[str, ...]] = [("capture", "rounds", "completions/s", "CPU ms/completion", "consumer busy",
                                    "feature B/row", "throughput x off", "CPU x off")]
    for mode, v in figures.items():
        rows.append((mode, str(len(v)), f"{statistics.median(f['rate'] for f in v):.1f}",
                     f"{statistics.median(f['cpu'] for f in v):.2f}",
                     f"{statistics.median(f['busy'] for f in v):.0%}",
                     f"{statistics.median(f['bytes'] for f in v):.0f}" if mode != "off" else "",
                     f"{statistics.median(f['rate'] / b['rate'] for f, b in zip(v, base, strict=True)):.2f}",
                     f"{statistics.median(f['cpu'] / b['cpu'] for f, b in zip(v, base, strict=True)):.2f}"))
    print(f"{args.items} items a run (single-turn, ~{args.mean_tokens} generated tokens each), consumer -c "
          f"{args.concurrency} pinned to one core, stand-in with zero step time capturing layers {LAYERS} at "
          f"hidden size {args.hidden_size}; medians over {args.rounds} rounds, the mode order rotating")
    print(table(rows))


if __name__ == "__main__":
    main()
