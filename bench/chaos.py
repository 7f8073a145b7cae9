"""The chaos run: prove that nothing is lost while everything that can go wrong does.

    python -m bench.chaos                 # the size CI runs (a few minutes)
    python -m bench.chaos --items 20000 --consumers 3 --chaos-seconds 300

Three consumers against the stand-in vLLM (a few percent 500s, some hung requests, one
15 s outage), a real Redis with append-only persistence on its own port, a real S3 server
(SeaweedFS). During the run: a random consumer is SIGKILLed every few seconds and a new one
started; Redis is restarted twice; S3 is stopped for 20 s. Then `producer export` must show
every enqueued item exactly once or permanently failed with its reason, none missing, and
records read = exported + failed + rejected + duplicates. Local addresses only; bounded in
time. Prints the figures as JSON; exits non-zero if an invariant fails.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import redis

from genqueue.common.keepers.rqaccess import (
    job_counts,
    job_started_at,
    job_status,
    started_executions,
    worker_executions,
)
from tests.conftest import RedisServer
from tests.consumer.e2e import Proc, Sim
from tests.s3server import S3Server

BIN = Path(sys.executable).parent


def log(msg: str) -> None:
    print(f"[chaos {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def make_data(path: Path, n: int, seed: int) -> None:
    rng = random.Random(seed)
    with open(path, "w") as fh:
        for i in range(n):
            turns = rng.choice((1, 1, 2, 3))
            conv = []
            for t in range(turns):
                conv += [{"from": "human", "value": f"chaos question {i}.{t}: tell me about topic {rng.random():.6f}"},
                         {"from": "gpt", "value": "old"}]
            fh.write(json.dumps({"conversations": conv}) + "\n")
        # a few records the producer must reject, and a duplicate, so the identity is exercised
        fh.write("{broken json\n")
        fh.write(json.dumps({"conversations": [{"from": "gpt", "value": "no user"}]}) + "\n")
        fh.write(json.dumps({"conversations": [{"from": "human", "value": "chaos question 0.0: dup"}]}) + "\n")
        fh.write(json.dumps({"conversations": [{"from": "human", "value": "chaos question 0.0: dup"}]}) + "\n")


class Fleet:
    """The consumers: start, kill at random, replace; recovery time per kill."""

    def __init__(self, work: Path, env: dict[str, str], endpoint: str, run: str, lease: int) -> None:
        self.work, self.env, self.endpoint, self.run, self.lease = work, env, endpoint, run, lease
        self.procs: list[Proc] = []
        self.n = 0
        self.kills: list[dict[str, float]] = []

    def start_one(self) -> Proc:
        self.n += 1
        name = f"c{self.n}"
        # Each node keeps its spool: a replacement starts on the dead one's spool, as on a real
        # node (one spool per live consumer; a consumer refuses a spool another one holds).
        taken = {getattr(p, "slot", None) for p in self.procs if p.p.poll() is None}
        slot = next(i for i in range(len(self.procs) + 1) if i not in taken)
        spool = self.work / "spool" / f"slot{slot}"
        p = Proc("consumer", ["-v", "run", "--run", self.run, "--endpoint", self.endpoint, "--lease", str(self.lease),
                              "--shard-max-age", "2", "--request-timeout", "4", "--max-attempts", "4",
                              "--spool", str(spool), "--drain-timeout", "10"], self.work / f"{name}.log", env=self.env)
        p.name = name  # type: ignore[attr-defined]
        p.slot = slot  # type: ignore[attr-defined]
        self.procs.append(p)
        return p

    def replace_exited(self) -> int:
        """Like a supervisor (consumer launch, compose's restart policy): start a new consumer
        for each one that exited by itself. Returns how many were replaced."""
        gone = [p for p in self.procs if p.p.poll() is not None]
        for p in gone:
            log(f"{p.name} exited by itself with {p.p.returncode}; starting another")  # type: ignore[attr-defined]
            self.procs.remove(p)
            self.start_one()
        return len(gone)

    def kill_random(self, rng: random.Random, conn: redis.Redis) -> bool:
        live = [p for p in self.procs if p.p.poll() is None]
        if not live:
            return False
        victim = rng.choice(live)
        worker = worker_name(victim)
        leases = worker_executions(conn, worker) if worker else set()
        held = {m.split(":")[0] for m in leases}
        victim.kill()
        self.procs.remove(victim)  # its slot (spool) is free for the replacement
        t_kill = time.monotonic()
        self.kills.append({"at": t_kill, "held_jobs": len(held), "requeued_s": -1.0, "recovered_s": -1.0})
        log(f"SIGKILL {victim.name} {worker} holding {len(held)} jobs")  # type: ignore[attr-defined]
        self.start_one()
        threading.Thread(target=self._watch_recovery, args=(conn, leases, self.kills[-1]), daemon=True).start()
        return True

    def _watch_recovery(self, conn: redis.Redis, leases: set[str], rec: dict[str, float]) -> None:
        """requeued: every lease the dead consumer held is gone from rq's started registry (swept
        back to the queue, or finished by nobody else's hand); recovered: every one of its jobs
        has since been finished or started again by another consumer."""
        held = {m.split(":")[0] for m in leases}
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            try:
                wip = started_executions(conn, self.run)
                if rec["requeued_s"] < 0 and not (leases & wip):
                    rec["requeued_s"] = round(time.monotonic() - rec["at"], 2)
                if rec["requeued_s"] >= 0 and all(
                        job_status(conn, j) in ("finished", "failed") or restarted(conn, j, rec["at"])
                        for j in held):
                    rec["recovered_s"] = round(time.monotonic() - rec["at"], 2)
                    return
            except redis.exceptions.RedisError:
                pass
            time.sleep(0.25)


def worker_name(proc: Proc) -> str | None:
    """The rq worker name a consumer logged at start."""
    import re

    m = re.search(r"consumer (gq-\S+) started", proc.output())
    return m.group(1) if m else None


def restarted(conn: redis.Redis, job_id: str, since: float) -> bool:
    """Whether the job started again after the monotonic time SINCE."""
    started = job_started_at(conn, job_id)
    return started is not None and time.time() - started < time.monotonic() - since


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--items", type=int, default=1500)
    ap.add_argument("--consumers", type=int, default=3)
    ap.add_argument("--kill-every", type=float, default=6.0)
    ap.add_argument("--chaos-seconds", type=float, default=60.0)
    ap.add_argument("--lease", type=int, default=5)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--limit-seconds", type=float, default=600.0, help="give up (and fail) after this long")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--prompts", choices=["inline", "reference"], default="inline",
                    help="where the jobs keep their items (producer enqueue --prompts; issue 34)")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="gq-chaos-"))
    work.mkdir(parents=True, exist_ok=True)
    t_start = time.monotonic()
    figures: dict[str, Any] = {"items_requested": args.items, "consumers": args.consumers, "kills": 0, "redis_restarts": 0,
                     "s3_outage_s": 20, "endpoint_outage_s": 15}
    rds = RedisServer(work / "redis-data", appendonly=True)
    (work / "redis-data").mkdir(exist_ok=True)
    rds.start()
    s3 = S3Server(work / "s3")
    s3.start()
    sim = Sim(work, "--error-rate", "0.03", "--hang-rate", "0.01", "--slots", "32", "--step-time", "0.01",
              "--mean-tokens", "40")
    env = {**os.environ, **s3.env, "REDIS_URL": rds.url}
    conn = redis.Redis.from_url(rds.url, socket_timeout=5)
    fleet = Fleet(work, env, sim.url, "chaos", args.lease)
    failures: list[str] = []
    try:
        data = work / "chaos.jsonl"
        make_data(data, args.items, args.seed)
        enq = subprocess.run([str(BIN / "producer"), "enqueue", str(data), "--run", "chaos", "--batch-size", "8",
                              "--output", s3.url("chaos-out"), "--max-tokens", "200", "--json",
                              "--rejects", str(work / "rejects.jsonl"), "--prompts", args.prompts], env=env,
                             capture_output=True, text=True, check=True)
        summary = json.loads(enq.stdout)
        figures["prompts"] = summary["prompts"]
        figures["records_read"] = summary["records"]
        figures["enqueued"] = summary["items"]
        log(f"enqueued {summary['items']} items in {summary['jobs']} jobs")
        for _ in range(args.consumers):
            fleet.start_one()

        events = sorted([
            (args.chaos_seconds * 0.25, "redis"), (args.chaos_seconds * 0.65, "redis"),
            (args.chaos_seconds * 0.40, "s3"), (args.chaos_seconds * 0.10, "endpoint"),
        ])
        t0 = time.monotonic()
        next_kill = t0 + args.kill_every
        pending_events = list(events)
        s3_back_at = endpoint_back_at = None
        while time.monotonic() - t0 < args.chaos_seconds:
            now = time.monotonic()
            if pending_events and now - t0 >= pending_events[0][0]:
                _, what = pending_events.pop(0)
                if what == "redis":
                    log("restarting Redis")
                    rds.stop()
                    time.sleep(1.0)
                    rds.start()
                    figures["redis_restarts"] += 1
                elif what == "s3":
                    log("stopping S3 for 20 s")
                    s3.stop()
                    s3_back_at = now + 20
                elif what == "endpoint":
                    log("stopping the endpoint for 15 s")
                    sim.stop()
                    endpoint_back_at = now + 15
            if s3_back_at and now >= s3_back_at:
                log("S3 back")
                s3.start()
                s3_back_at = None
            if endpoint_back_at and now >= endpoint_back_at:
                log("endpoint back")
                sim.start()
                endpoint_back_at = None
            if now >= next_kill:
                try:
                    if fleet.kill_random(rng, conn):
                        figures["kills"] += 1
                except redis.exceptions.RedisError as e:
                    log(f"kill skipped: {e}")
                next_kill = now + args.kill_every
            figures["unexpected_exits"] = figures.get("unexpected_exits", 0) + fleet.replace_exited()
            time.sleep(0.2)
        if s3_back_at:
            s3.start()
        if endpoint_back_at:
            sim.start()
        log("chaos over; waiting for the run to complete")
        # Complete = nothing queued, between dequeue and start, or leased, three polls in a row
        # (a job moves between them for an instant while it is dequeued or swept back).
        quiet = 0
        while time.monotonic() - t_start < args.limit_seconds:
            try:
                st = json.loads(subprocess.run([str(BIN / "producer"), "status", "--run", "chaos", "--json"],
                                               env=env, capture_output=True, text=True, check=True).stdout)
            except subprocess.CalledProcessError:
                time.sleep(1)
                continue
            figures["unexpected_exits"] = figures.get("unexpected_exits", 0) + fleet.replace_exited()
            j = st["jobs"]
            quiet = quiet + 1 if j["queued"] == 0 and j["started"] == 0 and j["dequeuing"] == 0 else 0
            if quiet >= 3:
                break
            time.sleep(1)
        else:
            failures.append("the run did not complete within --limit-seconds")
        for p in fleet.procs:
            p.signal(signal.SIGTERM)
        for p in fleet.procs:
            p.wait(60)
        # Every outcome in the dataset: this run proves delivery, not which answers make good samples
        # (by default an answer cut in its thinking goes to the truncated file).
        exp = subprocess.run([str(BIN / "producer"), "export", "--run", "chaos", "--output", str(work / "final.jsonl"),
                              "--include-outcomes", "all", "--json"], env=env, capture_output=True, text=True,
                             check=False)
        if exp.returncode not in (0, 1) or not exp.stdout.strip():
            failures.append(f"export failed: {exp.stderr[-500:]}")
            report = {}
        else:
            report = json.loads(exp.stdout)
        figures.update({k: report.get(k) for k in ("exported", "failed", "failed_jobs", "missing",
                                                   "duplicates_removed", "records_read")})
        if summary["items"]:
            # the work a GPU did per item asked for: 1.0 is each item generated exactly once
            figures["records_per_item"] = round((report.get("records_read") or 0) / summary["items"], 3)
        q_failed = job_counts(conn, "chaos")["failed"]
        figures["rq_failed_jobs"] = q_failed
        figures["requeued_s"] = [k["requeued_s"] for k in fleet.kills]
        figures["recovery_s"] = [k["recovered_s"] for k in fleet.kills]
        figures["jobs_held_at_kill"] = [k["held_jobs"] for k in fleet.kills]
        figures["seconds"] = round(time.monotonic() - t_start, 1)
        rejected = summary["rejected"]
        duplicates = summary["duplicates"]
        if report:
            if report.get("missing"):
                failures.append(f"{report['missing']} items missing")
            if report.get("exported", 0) + report.get("failed", 0) != summary["items"]:
                failures.append("exported + failed != enqueued")
            if summary["records"] != report.get("exported", 0) + report.get("failed", 0) + rejected + duplicates:
                failures.append("records read != exported + failed + rejected + duplicates")
        if any(r < 0 for r in figures["recovery_s"] + figures["requeued_s"]):
            failures.append("a kill was never recovered from")
        figures["invariants"] = "hold" if not failures else failures
    finally:
        for p in fleet.procs:
            if p.p.poll() is None:
                p.kill()
        sim.stop()
        s3.stop(kill=True)
        rds.stop()
    print(json.dumps(figures, indent=1))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
