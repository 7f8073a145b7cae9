"""Consumer CPU per completion of several git revisions, side by side in one run.

    python -m bench.bench_revisions ef25ede HEAD . --items 20000 --concurrency 256 --rounds 7

Each revision (`.` is the working tree) is checked out in a temporary git worktree and runs
the whole path of bench.bench_consumer with its own producer and consumer, against one Redis
and one stand-in. By default the revisions' consumers run at the same time, pinned to the same
core, each on its own run of the same items: whatever the (shared, noisy) machine does to one
it does to the others, so their ratio holds to a percent or two from round to round, where
consumers run one after the other (--one-at-a-time, in reverse order every other round) see
rounds differ by 15% and paired ratios spread by 10%. Sharing a core costs each consumer more
CPU per completion than running alone (cache and switches), so compare the absolute figures
only within one table. The raw aiohttp client of bench.bench_clients runs alone once per
round as the yardstick. The last column is the median over rounds of each revision's CPU
over the first revision's in the same round.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.common import pinned, start_redis, start_sim, table, timed

HERE = Path(__file__).resolve().parent.parent


def _module(tree: Path, prog: str) -> str:
    """PROG's CLI module in TREE (trees from before the `genqueue.` namespace use plain names)."""
    return f"genqueue.{prog}.cli" if (tree / "genqueue").exists() else f"{prog}.cli"


def _entry(tree: Path, prog: str) -> list[str]:
    # sys.path[0] is the working directory under -c, ahead of PYTHONPATH: point it at TREE, or
    # every revision would import the code of the directory this runs in.
    code = (f"import sys; sys.path[0] = {str(tree)!r}; sys.argv[0] = {prog!r}; "
            f"from {_module(tree, prog)} import main; main()")
    return [sys.executable, "-c", code]


def _check_imports(tree: Path) -> None:
    """Refuse to measure a revision whose consumer would not be its own code."""
    code = (f"import sys, importlib; sys.path[0] = {str(tree)!r}; "
            f"print(importlib.import_module({_module(tree, 'consumer')!r}).__file__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    where = out.stdout.strip()
    if out.returncode != 0 or not where.startswith(str(tree) + os.sep):
        raise SystemExit(f"{tree}: its consumer does not import from its own tree "
                         f"({where or out.stderr.strip().splitlines()[-1]})")


def _checkout(rev: str, work: Path) -> Path:
    if rev == ".":
        return HERE
    dest = work / "trees" / rev.replace("/", "_")
    out = subprocess.run(["git", "-C", str(HERE), "worktree", "add", "--detach", str(dest), rev],
                         capture_output=True, text=True, check=False)
    if out.returncode != 0:  # not a git checkout, a shallow clone, a revision that does not exist
        raise SystemExit(f"cannot check out {rev}: {(out.stderr.strip().splitlines() or ['git failed'])[-1]}")
    return dest


def _together(cmds: dict[str, tuple[list[str], dict[str, str]]]) -> dict[str, float]:
    """Start every consumer at once on the same core; the CPU seconds of each."""
    procs = {rev: subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
             for rev, (cmd, env) in cmds.items()}
    seconds = {}
    for rev, proc in procs.items():
        _, status, rusage = os.wait4(proc.pid, 0)
        if os.waitstatus_to_exitcode(status) != 0:
            raise SystemExit(f"the consumer of {rev} exited {os.waitstatus_to_exitcode(status)}")
        seconds[rev] = rusage.ru_utime + rusage.ru_stime
    return seconds


def _measure(args: argparse.Namespace, trees: dict[str, Path], work: Path) -> tuple[dict[str, list[float]], list[float]]:
    """CPU ms per completion of each revision's consumer, and of the raw client, per round."""
    redis_proc, url = start_redis(work)
    if shutil.which("taskset") and (os.cpu_count() or 1) > 1:  # off the consumer's core, beside the stand-in
        subprocess.run(["taskset", "-p", "-c", "0", str(redis_proc.pid)], check=False, stdout=subprocess.DEVNULL)
    data = work / "data.jsonl"
    with open(data, "w") as fh:
        fh.writelines(f'{{"conversations":[{{"from":"human","value":"Question {i}: explain the idea of item {i} '
                      f'in a few paragraphs, with an example."}}]}}\n' for i in range(args.items))
    cpu: dict[str, list[float]] = {rev: [] for rev in trees}
    raw: list[float] = []
    sim = None
    try:
        sim, endpoint = start_sim(["--slots", "100000", "--step-time", "0", "--mean-tokens", "512"])
        for r in range(args.rounds):
            order = list(trees.items()) if r % 2 == 0 else list(reversed(trees.items()))
            cmds = {}
            for n, (rev, tree) in enumerate(order):
                env = {**os.environ, "REDIS_URL": url, "PYTHONPATH": str(tree)}
                run = f"r{r}t{n}"
                subprocess.run([*_entry(tree, "producer"), "enqueue", str(data), "--run", run,
                                "--output", str(work / "out"), "--max-tokens", "2048", "--rejects", str(work / "rej")],
                               env=env, cwd=tree, check=True, stdout=subprocess.DEVNULL)
                cmds[rev] = (pinned([*_entry(tree, "consumer"), "run", "--run", run, "--endpoint", endpoint,
                                     "--burst", "-c", str(args.concurrency), "--spool", str(work / "spool" / run)], 1),
                             env)
            if args.together:
                seconds_of = _together(cmds)
            else:
                seconds_of = {}
                for rev, (cmd, env) in cmds.items():
                    _, seconds, rc = timed(cmd, env)
                    if rc != 0:
                        raise SystemExit(f"the consumer of {rev} exited {rc}")
                    seconds_of[rev] = seconds
            for rev, seconds in seconds_of.items():
                cpu[rev].append(1000 * seconds / args.items)
            out = subprocess.run(pinned([sys.executable, "-m", "bench.bench_clients", "--child", "raw-aiohttp",
                                         endpoint, str(args.items), str(args.concurrency)], 1),
                                 cwd=HERE, capture_output=True, text=True, check=True)
            raw.append(1000 * float(out.stdout.split()[1]) / args.items)
            print(f"round {r + 1}: " + "  ".join(f"{rev} {v[-1]:.3f}" for rev, v in cpu.items())
                  + f"  raw aiohttp {raw[-1]:.3f} ms/completion", file=sys.stderr, flush=True)
    finally:
        if sim is not None:
            sim.terminate()
        redis_proc.terminate()
    return cpu, raw


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("revisions", nargs="+", help="git revisions; . is the working tree")
    ap.add_argument("--items", type=int, default=20000)
    ap.add_argument("--concurrency", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--one-at-a-time", dest="together", action="store_false",
                    help="run the consumers one after the other (default: all at once on one core)")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="gq-bench-revs-"))
    trees: dict[str, Path] = {}
    try:
        for rev in args.revisions:
            trees[rev] = _checkout(rev, work)
            _check_imports(trees[rev])
        cpu, raw = _measure(args, trees, work)
    finally:
        for tree in trees.values():
            if tree != HERE:
                subprocess.run(["git", "-C", str(HERE), "worktree", "remove", "--force", str(tree)], check=False,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        shutil.rmtree(work, ignore_errors=True)
    yard = statistics.median(raw)
    first = cpu[args.revisions[0]]
    rows = [("revision", "rounds", "CPU ms/completion, median", "min", "max", "x raw aiohttp",
             f"x {args.revisions[0]}, paired")]
    for rev, v in cpu.items():
        paired = statistics.median(a / b for a, b in zip(v, first, strict=True))
        rows.append((rev, str(len(v)), f"{statistics.median(v):.3f}", f"{min(v):.3f}", f"{max(v):.3f}",
                     f"{statistics.median(v) / yard:.2f}", f"{paired:.3f}"))
    rows.append(("raw aiohttp", str(len(raw)), f"{yard:.3f}", f"{min(raw):.3f}", f"{max(raw):.3f}", "1.00", ""))
    print(table(rows))


if __name__ == "__main__":
    main()
