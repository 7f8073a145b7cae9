"""Run the benchmark suite and write BENCHMARKS.md (date, machine, every table).

    python -m bench                 # the full suite (about 15 minutes here)
    python -m bench --quick         # small sizes: a smoke run that keeps the suite from rotting
    python -m bench --only saturation consumer

Benchmarks are not tests: nothing here asserts a speed. Each one prints its table; this
runner collects them with the command that made them.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

FULL = {
    "saturation": ["bench.bench_saturation", "--slots", "64", "256"],
    "consumer": ["bench.bench_consumer", "--items", "20000", "--concurrency", "64", "256", "1024"],
    "clients": ["bench.bench_clients", "--requests", "5000", "--in-flight", "256"],
    # needs the git history: the consumer before the redesign of issue 11 against this one
    "revisions": ["bench.bench_revisions", "ef25ede", "HEAD", "--items", "20000", "--rounds", "5"],
    "producer": ["bench.bench_producer", "--records", "1000000"],
    "export": ["bench.bench_export", "--records", "1000000", "--records", "250000"],
    "longest_first": ["bench.bench_longest_first", "--items", "2000"],
    "fleet": ["bench.bench_fleet", "--items", "8000", "--slots", "16", "--mean-tokens", "100", "--max-tokens", "1000",
              "--rounds", "2"],
    "locality": ["bench.bench_locality", "--conversations", "300"],
    "packs": ["bench.bench_packs", "--items", "16384"],
    "redis_items": ["bench.bench_redis_items", "--items", "200000", "--finish", "emulated"],
    "packcache": ["bench.bench_packcache", "--packs", "16"],
    "producer_packs": ["bench.bench_producer_packs", "--items", "200000"],
    "chatter": ["bench.bench_chatter", "--seconds", "60", "--warmup", "15"],
    "real_vllm": ["tests.vllm.bench_real", "--items", "2000", "--concurrency", "32", "--rounds", "4", "--pin"],
    "logprobs_cost": ["bench.bench_logprobs_cost", "--items", "400", "--rounds", "3"],
    "capture_cost": ["bench.bench_capture_cost", "--items", "400", "--rounds", "3"],
    "real_vllm_logprobs": ["tests.vllm.bench_logprobs", "--requests", "128", "--concurrency", "32", "--rounds", "3"],
}
QUICK = {
    # a faster stand-in (step 0.5 ms, not 2 ms): the smoke run checks that each bench runs
    "saturation": ["bench.bench_saturation", "--slots", "16", "--items-per-slot", "12", "--step-time", "0.0005"],
    "consumer": ["bench.bench_consumer", "--items", "500", "--concurrency", "64"],
    "clients": ["bench.bench_clients", "--requests", "300", "--in-flight", "64"],
    "revisions": ["bench.bench_revisions", "HEAD", ".", "--items", "300", "--concurrency", "64", "--rounds", "1"],
    "producer": ["bench.bench_producer", "--records", "2000"],
    "export": ["bench.bench_export", "--records", "3000"],
    "longest_first": ["bench.bench_longest_first", "--items", "150", "--slots", "16", "--step-time", "0.0005"],
    "fleet": ["bench.bench_fleet", "--items", "400", "--slots", "8", "--step-time", "0.0005", "--mean-tokens", "50",
              "--max-tokens", "500"],
    "locality": ["bench.bench_locality", "--conversations", "24", "--step-time", "0.0005", "--mean-tokens", "10"],
    "packs": ["bench.bench_packs", "--items", "512", "--reads", "20"],
    "redis_items": ["bench.bench_redis_items", "--items", "500", "--finish", "real"],
    "packcache": ["bench.bench_packcache", "--packs", "2", "--items-per-pack", "128"],
    "producer_packs": ["bench.bench_producer_packs", "--items", "500"],
    "chatter": ["bench.bench_chatter", "--items", "300", "--seconds", "4", "--warmup", "4", "--step-time", "0.01",
                "--mean-tokens", "20"],
    "logprobs_cost": ["bench.bench_logprobs_cost", "--items", "40", "--rounds", "1", "--mean-tokens", "32"],
    "capture_cost": ["bench.bench_capture_cost", "--items", "40", "--rounds", "1", "--mean-tokens", "32"],
}
#: Run only where scripts/vllm-tier has built its virtualenv and model (not in --quick).
NEEDS_VLLM = {"real_vllm", "real_vllm_logprobs"}
TITLES = {
    "saturation": "1. Saturation: genqueue vs a batch-at-a-time client vs a bare client (stand-in vLLM)",
    "consumer": "2. Cost: consumer CPU per completion, whole path on, stand-in with zero delay",
    "clients": "Client CPU per completion: raw aiohttp (genqueue's hot path) vs the openai package",
    "revisions": "2b. Consumer CPU per completion against the consumer before the redesign (ef25ede), side by side",
    "producer": "3a. Producer at a million records",
    "export": "3b. Export at a million records",
    "longest_first": "Longest first: makespan with and without",
    "fleet": "Fleet end of run: 4 engines (one half as fast), makespan against its lower bound",
    "locality": "Prefix-cache locality: each-mode turns, prefill tokens computed against requested",
    "packs": "Packs: the format of prompts by reference (issue 34)",
    "redis_items": "Redis bytes per item, inline (baseline) and by reference (projection; issue 34)",
    "packcache": "Pack cache, 4 consumers on one host (issue 34)",
    "producer_packs": "Producer by reference, packs on S3 (issue 34)",
    "chatter": "What a consumer sends Redis a second on a slow engine (issue 34)",
    "real_vllm": "4. Real vLLM on CPU (the tiny model): genqueue vs a bare client at the same concurrency",
    "logprobs_cost": "Log-probability tables (--logprobs K): throughput and consumer CPU at K = 0, 20 and the engine's "
                     "maximum (stand-in)",
    "capture_cost": "Hidden-state capture (--capture): throughput and consumer CPU with capture off, fp8 and bf16 "
                    "(stand-in)",
    "real_vllm_logprobs": "Log-probability tables on real vLLM (the tiny model): K = 0, 20 and the engine's maximum",
}


def vllm_env() -> dict[str, str] | None:
    """The real-vLLM tier's python and model, when scripts/vllm-tier has built them."""
    cache = Path(os.environ.get("GENQUEUE_CACHE", Path.home() / ".cache" / "genqueue"))
    py = Path(os.environ.get("GENQUEUE_VLLM_PYTHON", cache / "vllm-venv" / "bin" / "python"))
    model = Path(os.environ.get("GENQUEUE_TINY_MODEL", cache / "tiny-qwen2"))
    if not py.exists() or not (model / "config.json").exists():
        return None
    return {"GENQUEUE_VLLM_PYTHON": str(py), "GENQUEUE_TINY_MODEL": str(model),
            "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}"}


def machine() -> str:
    cpu = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{platform.node()}: {os.cpu_count()} cores ({cpu}), {mem:.0f} GiB, Python {platform.python_version()}"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", nargs="+", choices=sorted(FULL))
    ap.add_argument("--out", default="BENCHMARKS.md")
    args = ap.parse_args()
    plan = QUICK if args.quick else FULL
    names = args.only or list(plan)
    parts = [f"# Benchmarks\n\n{datetime.date.today().isoformat()}, {machine()}"
             f"{' (quick smoke sizes)' if args.quick else ''}.\n\nMade by `python -m bench"
             f"{' --quick' if args.quick else ''}`; each section names its command. The machine is shared "
             "and noisy: compare rows of one table (one run, side by side), not across runs.\n"]
    failed = 0
    for name in names:
        if name not in plan:
            continue
        env = None
        if name in NEEDS_VLLM:
            extra = vllm_env()
            if extra is None:
                parts.append(f"## {TITLES[name]}\n\nskipped: run `scripts/vllm-tier` once to build vLLM's "
                             "virtualenv and the tiny model.\n")
                continue
            env = {**os.environ, **extra}
        cmd = [sys.executable, "-m", *plan[name]]
        print(f"== {name}: {' '.join(plan[name])}", file=sys.stderr, flush=True)
        t0 = time.monotonic()
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        took = time.monotonic() - t0
        body = proc.stdout.strip() if proc.returncode == 0 else f"FAILED (exit {proc.returncode}):\n{proc.stderr[-2000:]}"
        failed += proc.returncode != 0
        print(body, file=sys.stderr)
        parts.append(f"## {TITLES[name]}\n\n`python -m {' '.join(plan[name])}` ({took:.0f} s)\n\n```\n{body}\n```\n")
    Path(args.out).write_text("\n".join(parts))
    print(f"wrote {args.out}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
