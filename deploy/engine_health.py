#!/usr/bin/env python3
"""A vLLM container's health check that also restarts a hung engine (docker-compose.yml).

Docker restarts a container whose process exits, but not one that is merely unhealthy: a vLLM
that hangs (a stuck collective, a dead engine core behind a live API server) would hold its
GPUs forever while its consumer waits. Run as the container's HEALTHCHECK with `init: true`
(docker-init is PID 1, the server its child), this script answers Docker as a health check
(exit 0 healthy, 1 not) and, once the engine has been healthy and then fails /health for
--hang-seconds, SIGKILLs the server: docker-init exits with it, and the restart policy brings
the container back. While the model loads (never healthy yet) it only reports; Docker's
start_period covers that.

    python3 engine_health.py http://127.0.0.1:8000/health --hang-seconds 120

Standard library only: it runs with the vLLM image's own python3. State between checks lives
in a small file, keyed to the watched process's start, so a restarted server starts afresh.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

#: PID 1 of a container run with `init: true` (or an image with its own init).
INITS = frozenset({"docker-init", "tini", "dumb-init", "catatonit"})

HEALTHY, LOADING, FAILING, KILL = "healthy", "loading", "failing", "kill"


def probe(url: str, timeout: float) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return bool(r.status == 200)
    except (OSError, ValueError):
        return False


def decide(state: dict[str, Any], ok: bool, now: float, hang_seconds: float, boot: str) -> tuple[dict[str, Any], str]:
    """(the state to keep, what to do) after one probe. BOOT names the watched process's life:
    a state from an earlier life is forgotten."""
    if state.get("boot") != boot:
        state = {"boot": boot, "healthy_once": False, "failing_since": None}
    if ok:
        return {**state, "healthy_once": True, "failing_since": None}, HEALTHY
    if not state["healthy_once"]:
        return state, LOADING
    since = state["failing_since"]
    since = now if since is None else float(since)
    state = {**state, "failing_since": since}
    return state, KILL if now - since >= hang_seconds else FAILING


def read_procs(proc: Path = Path("/proc")) -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, command name) of every process visible here."""
    out: dict[int, tuple[int, str]] = {}
    for d in proc.iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        comm = stat[stat.index("(") + 1:stat.rindex(")")]
        ppid = int(stat[stat.rindex(")") + 2:].split()[1])
        out[int(d.name)] = (ppid, comm)
    return out


def server_pids(procs: dict[int, tuple[int, str]], me: int) -> list[int]:
    """The children of an init PID 1 (the server docker-init started), this check excluded;
    [] when PID 1 is no init (then the server is PID 1, which nothing inside may kill)."""
    if procs.get(1, (0, ""))[1] not in INITS:
        return []
    return sorted(pid for pid, (ppid, _) in procs.items() if ppid == 1 and pid != me)


def start_time(pid: int) -> str:
    """The process's start (clock ticks since boot): its identity across pid reuse."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return "gone"
    return f"{pid}:{stat[stat.rindex(')') + 2:].split()[19]}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("url", help="the engine's /health URL")
    ap.add_argument("--hang-seconds", type=float, default=120.0,
                    help="kill the server once /health has failed this long after being healthy (default 120)")
    ap.add_argument("--timeout", type=float, default=5.0, help="seconds one probe may take (default 5)")
    ap.add_argument("--state", type=Path, default=Path("/tmp/genqueue-engine-health.json"))
    ap.add_argument("--pid", type=int, default=None,
                    help="the server's pid (default: the children of PID 1, which must be docker-init)")
    args = ap.parse_args(argv)

    boot = start_time(args.pid if args.pid is not None else 1)
    try:
        state = json.loads(args.state.read_text())
    except (OSError, ValueError):
        state = {}
    state, action = decide(state, probe(args.url, args.timeout), time.time(), args.hang_seconds, boot)
    tmp = args.state.with_suffix(".tmp")
    tmp.write_text(json.dumps(state))
    tmp.replace(args.state)
    if action == HEALTHY:
        return 0
    if action != KILL:
        print(f"engine-health: {args.url} not healthy ({action})", file=sys.stderr)
        return 1
    targets = [args.pid] if args.pid is not None else server_pids(read_procs(), os.getpid())
    failing = time.time() - float(state["failing_since"])
    if not targets:
        print("engine-health: hung, but cannot restart it: run the container with `init: true`", file=sys.stderr)
        return 1
    print(f"engine-health: /health failing for {failing:.0f} s after being healthy: hung; killing {targets}",
          file=sys.stderr)
    for pid in targets:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return 1


if __name__ == "__main__":
    sys.exit(main())
