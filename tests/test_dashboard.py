"""`consumer dashboard`: rq-dashboard against a live run (real Redis, a real consumer against the
stand-in vLLM, rq-dashboard as its own process on a free port), read through its JSON endpoints
as its pages' scripts read them."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from rq import Worker

from genqueue.common.keepers.rqaccess import queue_for
from genqueue.consumer.dashboard import command as dash_command
from genqueue.consumer.dashboard import web as dash_web
from tests.conftest import cli, free_port, sharegpt, wait_for, write_jsonl
from tests.consumer.e2e import Proc, Sim

#: The command the README gives.
DASHBOARD = ("consumer", "dashboard")


def get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def get_json(url: str) -> dict:
    status, body = get(url)
    assert status == 200, f"{url} answered {status}: {body[:300]!r}"
    return json.loads(body)


class Dashboard:
    def __init__(self, tmp: Path, name: str, cmd: tuple[str, ...], *args: str, env: dict[str, str]) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}/0"
        self.proc = Proc(cmd[0], [*cmd[1:], "--port", str(self.port), *args], tmp / f"{name}.log", env=env)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            assert self.proc.p.poll() is None, f"{name} exited:\n{self.proc.output()}"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/", timeout=2):
                    return
            except OSError:
                time.sleep(0.1)
        raise AssertionError(f"{name} did not answer:\n{self.proc.output()}")

    def stop(self) -> None:
        self.proc.kill()


@pytest.mark.integration
def test_dashboard_shows_genqueue_queues_jobs_and_busy_workers(tmp_path, redis_url, conn):
    env = {"REDIS_URL": redis_url}
    # ~100 s of work at 4 in flight: jobs are still queued when the two dashboards are up on a loaded machine
    # (at 60 items the run was done before they were), and the consumer is killed once the pages are read
    data = write_jsonl(tmp_path / "dash.jsonl", [sharegpt(i) for i in range(400)])
    cli("producer", "enqueue", str(data), "--batch-size", "4", "--output", str(tmp_path / "out"),
        "--rejects", str(tmp_path / "r"), env=env)
    q = queue_for("dash", conn)
    queued_id = q.job_ids[-1]
    sim = Sim(tmp_path, "--step-time", "0.05", "--mean-tokens", "20")
    consumer = Proc("consumer", ["run", "--run", "dash", "--endpoint", sim.url, "-c", "4", "--shard-max-age", "1",
                                 "--spool", str(tmp_path / "spool")], tmp_path / "consumer.log", env=env)
    ours = raw = None
    try:
        # busy (holding jobs) with some finished: the state that broke the Workers page
        wait_for(lambda: q.finished_job_registry.count >= 1 and q.started_job_registry.count >= 1, 60,
                 "a finished job while others are held")
        worker_names = {w.name for w in Worker.all(connection=conn)}
        assert len(worker_names) == 1
        (worker_name,) = worker_names

        # rq-dashboard as it comes, even with --json: the workers data fails (why the launcher exists)
        raw = Dashboard(tmp_path, "raw", ("rq-dashboard",), "--json", "--redis-url", redis_url, env=env)
        status, body = get(f"{raw.base}/data/workers.json")
        assert status == 500, body[:300]
        raw.stop()
        raw = None

        ours = Dashboard(tmp_path, "ours", DASHBOARD, env=env)  # Redis from REDIS_URL
        queues = get_json(f"{ours.base}/data/queues.json")["queues"]
        (mine,) = [x for x in queues if x["name"] == "genqueue.dash"]
        assert mine["finished_job_registry_count"] >= 1 and mine["count"] >= 1

        workers = get_json(f"{ours.base}/data/workers.json")["workers"]
        (w,) = [x for x in workers if x["name"] == worker_name]
        assert w["queues"] == ["genqueue.dash"]
        if w["state"] == "busy":  # it may be between jobs at this very moment
            assert w["current_job"]["description"].startswith("genqueue run=dash")
            assert "genqueue" in w["current_job"]["call_string"]

        for registry in ("queued", "started", "finished"):
            listed = get_json(f"{ours.base}/data/jobs/genqueue.dash/{registry}/8/asc/1.json")
            assert listed["name"] == "genqueue.dash"
        queued = get_json(f"{ours.base}/data/jobs/genqueue.dash/queued/100/asc/1.json")["jobs"]
        assert queued_id in {j["id"] for j in queued} or queued_id in q.finished_job_registry.get_job_ids()
        finished = get_json(f"{ours.base}/data/jobs/genqueue.dash/finished/8/asc/1.json")["jobs"]
        assert finished and all(j["description"].startswith("genqueue run=dash") for j in finished)
        job = get_json(f"{ours.base}/data/job/{finished[0]['id']}.json")
        assert job["status"] == "finished" and job["origin"] == "genqueue.dash"
        assert job["result"]["items_done"] == job["result"]["items"] >= 1

        for page in ("view/workers", "view/jobs", f"view/job/{finished[0]['id']}"):
            assert get(f"{ours.base}/{page}")[0] == 200, page
        assert "127.0.0.1" in ours.proc.output() and redis_url not in ours.proc.output()
    finally:
        for d in (raw, ours):
            if d is not None:
                d.stop()
        consumer.kill()
        sim.stop()


def test_dashboard_args_force_json_a_local_bind_and_redis_from_the_environment():
    argv, env = dash_command.dashboard_args(["--port", "9999"], {"REDIS_URL": "redis://:pw@h:6379/0"})
    assert argv == ["--json", "--bind", "127.0.0.1", "--port", "9999"]
    assert env == {"RQ_DASHBOARD_REDIS_URL": "redis://:pw@h:6379/0"}
    argv, env = dash_command.dashboard_args(["-b", "0.0.0.0", "-u", "redis://x:1/0"], {"REDIS_URL": "redis://h/0"})
    assert argv == ["--json", "-b", "0.0.0.0", "-u", "redis://x:1/0"] and env == {}
    assert dash_command.dashboard_args([], {"RQ_DASHBOARD_REDIS_URL": "redis://a/0", "REDIS_URL": "redis://b/0"})[1] == {}


def test_a_missing_dependency_is_one_line_naming_it(monkeypatch):
    def no_six(name: str):
        raise ModuleNotFoundError("No module named 'six'", name="six")

    monkeypatch.setattr(dash_web.importlib, "import_module", no_six)
    with pytest.raises(dash_web.DashboardMissing, match="No module named 'six'.*pip install 'rq-dashboard==0.9.\\*' six"):
        dash_web.load()


def test_the_workers_page_lists_every_held_job_or_is_left_as_rq_dashboard_made_it(tmp_path):
    from rq_dashboard import web

    page = dash_web.workers_page(Path(web.__file__).parent / "templates" / dash_web.WORKERS_TEMPLATE)
    assert page is not None and "_.each(d.current_jobs" in page and "Jobs&nbsp;held" in page
    assert "d.current_job !== 'idle'" not in page
    other = tmp_path / "workers.html"
    other.write_text("<td><%= d.current_job.name %></td>")  # some other rq-dashboard's page
    assert dash_web.workers_page(other) is None
    assert dash_web.workers_page(tmp_path / "absent.html") is None


def test_the_dashboards_sweeps_use_redis_time_not_a_fast_host_clock(conn, monkeypatch):
    """A live lease (scored in Redis's clock) survives the dashboard's registry reads on a host
    whose clock runs 1,000 s ahead; rq's own cleanup there would have swept it."""
    import rq.registry
    from rq.registry import StartedJobRegistry

    from genqueue.consumer.rqcompat import sweep_in_redis_time

    secs, micros = conn.time()
    redis_now = secs + micros / 1_000_000
    monkeypatch.setattr(rq.registry, "current_timestamp", lambda: int(redis_now + 1000))
    monkeypatch.setattr(StartedJobRegistry, "cleanup", StartedJobRegistry.cleanup)  # rq's own, back after the test
    registry = StartedJobRegistry("genqueue.clock", connection=conn)
    conn.zadd(registry.key, {"live-job:exec-1": redis_now + 30})
    assert "live-job" in registry.get_expired_job_ids(rq.registry.current_timestamp())  # rq's clock: expired
    sweep_in_redis_time()
    assert registry.count == 1 and conn.zscore(registry.key, "live-job:exec-1") is not None
