"""rq's own tools see what genqueue does (issue 25): a consumer serving several runs (no --run, the
README's normal case) is listed by `rq info` for every queue it takes from, busy while it holds
jobs, and by none once it stops; rq-dashboard's workers data lists every job it holds. Real
redis-server, the stand-in vLLM, a real consumer, the real `rq` CLI and `consumer dashboard` as
subprocesses."""

from __future__ import annotations

import re
import signal
import subprocess

import pytest
from rq import Worker

from genqueue.common.keepers.rqaccess import queue_for
from tests.conftest import BIN, cli, sharegpt, wait_for, write_jsonl
from tests.consumer.e2e import Proc, Sim
from tests.test_dashboard import DASHBOARD, Dashboard, get, get_json

pytestmark = [pytest.mark.integration, pytest.mark.slow]

RUNS = ("alpha", "beta")
JOBS_PER_RUN = 2


def rq_info(redis_url: str, queue: str) -> str:
    """`rq info -u URL QUEUE` as the README's operations section runs it."""
    done = subprocess.run([str(BIN / "rq"), "info", "-u", redis_url, queue], capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 0, f"rq info {queue}:\n{done.stdout}\n{done.stderr}"
    return re.sub(r"\x1b\[[0-9;]*m", "", done.stdout)  # rq colours the states


def held_ids(conn) -> set[str]:
    """The jobs started and not ended in either run: the one consumer holds them all."""
    ids: set[str] = set()
    for run in RUNS:
        ids |= {j.rsplit(":", 1)[0] if ":" in j else j for j in queue_for(run, conn).started_job_registry.get_job_ids()}
    return ids


def test_a_consumer_of_two_runs_is_seen_by_rq_info_and_the_dashboard_with_every_job_it_holds(
        tmp_path, redis_url, conn, prompts_mode):
    env = {"REDIS_URL": redis_url}
    for n, run in enumerate(RUNS):
        data = write_jsonl(tmp_path / f"{run}.jsonl", [sharegpt(100 * n + i) for i in range(2 * JOBS_PER_RUN)])
        cli("producer", "enqueue", str(data), "--run", run, "--batch-size", "2", "--output", str(tmp_path / "out"),
            "--rejects", str(tmp_path / f"rej-{run}"), *prompts_mode.args, env=env)
    # minutes per answer (the 64-token probe of each run takes seconds): every job stays held
    sim = Sim(tmp_path, "--step-time", "0.1", "--mean-tokens", "4000")
    consumer = Proc("consumer", ["run", "--endpoint", sim.url, "-c", "8", "--drain-timeout", "2",
                                 "--spool", str(tmp_path / "spool")], tmp_path / "consumer.log", env=env)
    dash = None
    try:
        wait_for(lambda: all(queue_for(r, conn).started_job_registry.count == JOBS_PER_RUN for r in RUNS), 60,
                 f"the consumer holding every job of {RUNS}")
        (worker,) = Worker.all(connection=conn)
        held = held_ids(conn)
        assert len(held) == len(RUNS) * JOBS_PER_RUN

        for run in RUNS:
            info = rq_info(redis_url, f"genqueue.{run}")
            (line,) = [x for x in info.splitlines() if x.startswith(f"{worker.name} ")]
            assert ": busy " in line and all(f"genqueue.{r}" in line for r in RUNS), info
            assert "1 workers, 1 queues" in info, info

        dash = Dashboard(tmp_path, "dash", DASHBOARD, env=env)
        (row,) = [w for w in get_json(f"{dash.base}/data/workers.json")["workers"] if w["name"] == worker.name]
        assert set(row["queues"]) == {f"genqueue.{r}" for r in RUNS} and row["state"] == "busy"
        assert {j["job_id"] for j in row["current_jobs"]} == held
        assert all(j["description"].startswith("genqueue run=") for j in row["current_jobs"])
        assert row["current_job"]["job_id"] in held  # rq-dashboard's own field: one of them
        status, page = get(f"{dash.base}/view/workers")
        assert status == 200 and b"d.current_jobs" in page and b"Jobs&nbsp;held" in page

        consumer.signal(signal.SIGTERM)
        assert consumer.wait(30) == 0, consumer.output()
        for run in RUNS:
            info = rq_info(redis_url, f"genqueue.{run}")
            assert "0 workers, 1 queues" in info and worker.name not in info, info
        assert [w["name"] for w in get_json(f"{dash.base}/data/workers.json")["workers"]] == []
    finally:
        if dash is not None:
            dash.stop()
        consumer.kill()
        sim.stop()
