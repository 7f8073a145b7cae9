"""Every command survives whatever Redis holds beside a genuine run (real Redis, the real rq
worker class, the commands as a user runs them).

A genuine run (12 items in 4 jobs: one done with its shard shipped, one failed in rq, two
queued) is built once and kept as a Redis dump. Each hypothesis example restores it, plants a
random set of malformed jobs (every shape, in every rq list and registry of the run), and runs
`producer export`, `status`, the reconcile (`producer enqueue` again on the same input),
`resume`, `delete` and the dashboard's JSON endpoints: the genuine run's result is the clean
run's (export's coverage and files byte for byte), every bad entry the command reads is named
with its reason, and nothing ends in a traceback. The examples run the producer's commands in
process (click's runner) and the dashboard through Flask's test client; one more run drives the
real CLIs and `consumer dashboard` as subprocesses.
"""

from __future__ import annotations

import pickle
import time
import urllib.request
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import pytest
import redis
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rq.job import Job, JobStatus

from genqueue.common.keepers import rqjobs
from genqueue.common.keepers.marks import Marks, ShardMarks
from genqueue.common.keepers.rqaccess import SERIALIZER, TASK, JobPlace, place_key, queue_for, queue_name
from genqueue.consumer.rqcompat import GenWorker
from genqueue.producer.cli import main as producer
from genqueue.producer.outfiles import MANIFEST
from tests.conftest import cli, free_port, sharegpt, write_jsonl
from tests.consumer.e2e import Proc

pytestmark = pytest.mark.integration

RUN = "gen"
QUEUE = queue_name(RUN)
GOOD_ITEM = {"key": "ab" * 16, "index": 7, "turn": None, "messages": [{"role": "user", "content": "hi"}]}
RQ_DATE = "2026-01-01T00:00:00.000000Z"


# --- the malformed shapes ----------------------------------------------------------------
def payload(func: object, args: object, kwargs: object = None) -> bytes:
    return zlib.compress(orjson.dumps([func, None, args, kwargs or {}]))


#: shape -> (fields of its hash, or None for no hash; found by reading headers only?)
SHAPES: dict[str, tuple[dict[str, bytes | str] | None, bool]] = {
    "dangling": (None, True),
    "no-data": ({"status": "queued", "created_at": RQ_DATE, "origin": QUEUE}, True),
    "bad-status": ({"data": payload(TASK, [[GOOD_ITEM]]), "status": "exploded"}, True),
    "bad-date": ({"data": payload(TASK, [[GOOD_ITEM]]), "status": "queued", "created_at": "yesterday-ish"}, True),
    "bad-number": ({"data": payload(TASK, [[GOOD_ITEM]]), "status": "queued", "result_ttl": "forever"}, True),
    "pickle": ({"data": zlib.compress(pickle.dumps(("os.getcwd", None, (), {}))), "status": "queued"}, False),
    "zlib-garbage": ({"data": zlib.compress(b"\x00 not json at all"), "status": "queued"}, False),
    "raw-garbage": ({"data": b"\x13\x37 neither zlib nor json", "status": "queued"}, False),
    "not-rq-shape": ({"data": zlib.compress(b'{"a": 1}'), "status": "queued"}, False),
    "foreign-func": ({"data": payload("os.system", ["echo pwned"]), "status": "queued"}, False),
    "kwargs": ({"data": payload(TASK, [[GOOD_ITEM]], {"extra": 1}), "status": "queued"}, False),
    "args-not-list": ({"data": payload(TASK, "not a list"), "status": "queued"}, False),
    "items-not-list": ({"data": payload(TASK, [{"key": "x"}]), "status": "queued"}, False),
    "no-items": ({"data": payload(TASK, [[]]), "status": "queued"}, False),
    "item-not-dict": ({"data": payload(TASK, [[GOOD_ITEM, 5]]), "status": "queued"}, False),
    "item-no-key": ({"data": payload(TASK, [[{"index": 1, "messages": [{"role": "user"}]}]]), "status": "queued"},
                    False),
    "item-bad-key": ({"data": payload(TASK, [[{**GOOD_ITEM, "key": "nothex"}]]), "status": "failed"}, False),
    "item-bad-types": ({"data": payload(TASK, [[{"key": 5, "index": "3", "messages": "hi"}]]), "status": "failed"},
                       False),
    "item-bad-index": ({"data": payload(TASK, [[{**GOOD_ITEM, "index": True}]]), "status": "queued"}, False),
    "item-no-messages": ({"data": payload(TASK, [[{**GOOD_ITEM, "messages": []}]]), "status": "queued"}, False),
    "func-not-text": ({"data": payload([1], [[GOOD_ITEM]]), "status": "queued"}, False),
    "not-a-hash": (None, True),
    "non-utf8-id": (None, True),
}
PLACES = list(JobPlace)


def plant(conn: redis.Redis, planted: list[tuple[str, JobPlace]]) -> dict[str, tuple[str, JobPlace]]:
    """Plant each (shape, place); returns job id -> (shape, place)."""
    out: dict[str, tuple[str, JobPlace]] = {}
    for n, (shape, place) in enumerate(planted):
        jid = f"mal-{n}-{shape}"
        fields, _ = SHAPES[shape]
        member: bytes = jid.encode()
        if shape == "non-utf8-id":
            member = b"\xff\xfe" + member
        elif shape == "not-a-hash":
            conn.set(Job.key_for(jid), b"a string where a job hash belongs")
        elif fields is not None:
            conn.hset(Job.key_for(jid), mapping=fields)  # type: ignore[arg-type]
        if place is JobPlace.STARTED:
            member += b":exec-1"
        key = place_key(RUN, place)
        if place in (JobPlace.QUEUED, JobPlace.DEQUEUING):
            conn.rpush(key, member)
        else:
            conn.zadd(key, {member: time.time() + 3600})
        out[jid] = (shape, place)
    return out


# --- the genuine run, built once ---------------------------------------------------------
def build_genuine(tmp: Path, conn: redis.Redis, url: str) -> dict[str, Any]:
    data = write_jsonl(tmp / "gen.jsonl", [sharegpt(i) for i in range(12)])
    enqueue = ["enqueue", str(data), "--run", RUN, "--batch-size", "3", "--output", str(tmp / "out"),
               "--max-tokens", "64", "--rejects", str(tmp / "rej.jsonl"), "--json"]
    cli("producer", *enqueue, env={"REDIS_URL": url})
    q = queue_for(RUN, conn)
    w = GenWorker([q], conn, lease=3600)
    w.start()
    done, _ = w.dequeue(q)
    gave_up, _ = w.dequeue(q)
    assert done is not None and gave_up is not None
    shards = tmp / "out" / RUN / "shards"
    shards.mkdir(parents=True)
    marks = ShardMarks()
    recs = []
    for it in done.job.args[0]:
        recs.append({"key": it["key"], "index": it["index"], "turn": it["turn"], "run": RUN,
                     "messages": it["messages"], "content": "ok", "reasoning": None, "finish_reason": "stop",
                     "outcome": "finished", "attempt": 1, "timings": {"finished_at": 1.0}})
        marks.add(it["key"], error=False)
    (shards / "w-000001.jsonl").write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in recs))
    Marks(conn, RUN).mark_shipped(marks)
    assert w.finish(done, {"items": 3, "items_done": 3})
    w.fail(gave_up, "Traceback...\nAbandonedJobError: abandoned 4 times", retry=False)
    w.stop()
    dump = {k: (conn.dump(k), conn.pttl(k)) for k in conn.keys("*")}
    return {"enqueue": enqueue, "dump": dump}


def restore(conn: redis.Redis, dump: dict[bytes, tuple[bytes, int]]) -> None:
    conn.flushall()
    with conn.pipeline() as p:
        for k, (blob, ttl) in dump.items():
            p.restore(k, max(ttl, 0), blob)
        p.execute()


# --- running the commands ----------------------------------------------------------------
Runner = Callable[..., tuple[int, str, str]]


def in_process(url: str) -> Runner:
    runner = CliRunner()

    def run(*args: str) -> tuple[int, str, str]:
        r = runner.invoke(producer, list(args), env={"REDIS_URL": url}, catch_exceptions=True)
        assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
        return r.exit_code, r.stdout, r.stderr

    return run


def as_subprocess(url: str) -> Runner:
    def run(*args: str) -> tuple[int, str, str]:
        p = cli("producer", *args, env={"REDIS_URL": url}, check=False)
        return p.returncode, p.stdout, p.stderr

    return run


COVERAGE = ("shards", "records_read", "enqueued", "exported", "truncated", "failed", "missing",
            "duplicates_removed", "failed_jobs", "unexpected", "bad_lines", "failed_by_class")
STATUS = ("items", "items_done", "items_failed", "records", "rejected", "fingerprint")
RECONCILE = ("records", "enqueued", "already_queued", "already_failed", "already_done", "duplicates", "rejected",
             "items", "jobs")


def run_all(run: Runner, tmp: Path, genuine: dict[str, Any], dash: Callable[[str], tuple[int, Any]] | None
            ) -> dict[str, Any]:
    """Every command against the state in Redis now; what each said, as plain data."""
    out = tmp / "export"
    out.mkdir(exist_ok=True)
    seen: dict[str, Any] = {}
    code, stdout, stderr = run("export", "--run", RUN, "--output", str(out / "ds.jsonl"), "--json",
                               "--allow-partial")
    assert code == 0 and "Traceback" not in stderr, stderr
    seen["export"] = orjson.loads(stdout)
    # the manifest of what genqueue wrote holds each file's mtime and inode: compared by the names it lists
    seen["export_files"] = {p.name: sorted(orjson.loads(p.read_bytes())["files"]) if p.name == MANIFEST
                            else p.read_bytes() for p in sorted(out.iterdir())}
    code, human, stderr = run("export", "--run", RUN, "--output", str(out / "ds.jsonl"), "--allow-partial")
    assert code == 0 and "Traceback" not in stderr, stderr
    seen["export_human"] = human
    code, stdout, stderr = run("status", "--run", RUN, "--json")
    assert code == 0 and "Traceback" not in stderr, stderr
    seen["status"] = orjson.loads(stdout)
    code, human, stderr = run("status", "--run", RUN)
    assert code == 0 and "Traceback" not in stderr, stderr
    seen["status_human"] = human
    code, stdout, stderr = run(*genuine["enqueue"])
    assert code == 0 and "Traceback" not in stderr, stderr
    seen["reconcile"] = orjson.loads(stdout)
    code, human, stderr = run(*genuine["enqueue"][:-1])  # the table
    assert code == 0 and "Traceback" not in stderr, stderr
    seen["reconcile_human"] = human
    code, stdout, stderr = run("resume", "--run", RUN)
    assert code == 0 and "not paused" in stdout, stdout + stderr
    if dash is not None:
        seen["dashboard"] = dashboard_view(dash)
    code, stdout, stderr = run("delete", "--run", RUN, "--yes")
    assert code == 0 and "Traceback" not in stderr, stderr
    seen["delete"] = stdout
    return seen


REGISTRIES = ("queued", "started", "failed", "finished", "deferred", "scheduled", "canceled")


def dashboard_view(get: Callable[[str], tuple[int, Any]]) -> dict[str, Any]:
    """rq-dashboard's JSON endpoints for the run's queue: every list, and each job listed."""
    view: dict[str, Any] = {}
    for path in ("queues.json", "workers.json"):
        status, body = get(f"/0/data/{path}")
        assert status == 200, (path, body)
    for registry in REGISTRIES:
        status, body = get(f"/0/data/jobs/{QUEUE}/{registry}/100/asc/1.json")
        assert status == 200, (registry, body)
        view[registry] = {j["id"]: j["description"] for j in body["jobs"]}
        for jid in view[registry]:
            if jid.isascii() and jid.isprintable():
                status, job = get(f"/0/data/job/{jid}.json")
                assert status == 200, (jid, job)
                assert job["id"] == jid
    return view


def expect(seen: dict[str, Any], clean: dict[str, Any], planted: dict[str, tuple[str, JobPlace]]) -> None:
    """The genuine run's results are the clean ones; each planted job is named where it is read."""
    ex, base = seen["export"], clean["export"]
    assert {k: ex[k] for k in COVERAGE} == {k: base[k] for k in COVERAGE}
    assert seen["export_files"] == clean["export_files"], "export files differ from the clean run's"
    st_, sb = seen["status"], clean["status"]
    assert {k: st_[k] for k in STATUS} == {k: sb[k] for k in STATUS}
    rc, rb = seen["reconcile"], clean["reconcile"]
    assert {k: rc[k] for k in RECONCILE} == {k: rb[k] for k in RECONCILE}

    def named(found: list[dict[str, str]]) -> set[str]:
        return {jid for jid in planted if any(jid in f["id"] for f in found)}

    # an id without a hash where rq ends jobs is rq's own expiry of it (its result or failure
    # TTL passed), not a defect: never named malformed (tests/test_rq_normal_life.py)
    expired = {j for j, (shape, place) in planted.items() if shape == "dangling" and place in rqjobs.EXPIRED_WHY}
    planted = {j: where for j, where in planted.items() if j not in expired}
    everyone = set(planted)
    headers = {j for j, (shape, _) in planted.items() if SHAPES[shape][1]}
    # export read every payload (the run has missing items); status and delete read headers
    assert named(ex["malformed_jobs"]) == everyone, ex["malformed_jobs"]
    assert named(st_["malformed_jobs"]) == headers, st_["malformed_jobs"]
    # the reconcile reads the payloads of live and failed jobs, and the headers of the others
    read_items = {j for j, (_, place) in planted.items() if place not in (JobPlace.FINISHED, JobPlace.CANCELED)}
    assert named(rc["queue_view"]["malformed_jobs"]) == headers | read_items, rc["queue_view"]["malformed_jobs"]
    assert all(f["reason"] and f["place"] in set(JobPlace) for f in ex["malformed_jobs"])
    assert not planted or f"{len(planted)} malformed job(s) skipped" in seen["export_human"], seen["export_human"]
    if headers:
        assert f"{len(headers)} malformed job(s) in the queue or registries" in seen["status_human"]
        assert f"{len(headers)} malformed job(s) deleted with it" in seen["delete"], seen["delete"]
    if headers | read_items:
        assert f"{len(headers | read_items)} malformed job(s) skipped" in seen["reconcile_human"]
    if "dashboard" in seen:
        for registry, rows in seen["dashboard"].items():
            mine = {j for j, (_, place) in planted.items() if place.value == registry}
            bad = {jid for jid, desc in rows.items() if desc.startswith("(malformed")}
            assert {j for j in mine if any(j in b for b in bad)} == mine, (registry, rows)
            assert all(any(j in b for j in planted) for b in bad), (registry, rows)
            assert all(rows[j].startswith(f"({registry}; rq no longer keeps it") for j in expired if j in rows)


# --- the dashboard, in process -----------------------------------------------------------
_PATCHED: list[Any] = []


def flask_dashboard(url: str) -> Callable[[str], tuple[int, Any]]:
    from rq.serializers import JSONSerializer

    from genqueue.consumer.dashboard import web as dashboard

    if not _PATCHED:
        cli_mod, web = dashboard.load()
        dashboard.patch(web)
        app = cli_mod.make_flask_app(None, None, None, "")
        app.config["RQ_DASHBOARD_REDIS_URL"] = url
        web.config.serializer = JSONSerializer
        web.setup_rq_connection(app)
        _PATCHED.append(app.test_client())
    client = _PATCHED[0]

    def get(path: str) -> tuple[int, Any]:
        r = client.get(path)
        return r.status_code, r.get_json(silent=True)

    return get


# --- the tests ---------------------------------------------------------------------------
shape_places = st.lists(st.tuples(st.sampled_from(sorted(SHAPES)), st.sampled_from(PLACES)), min_size=1, max_size=8)


@pytest.mark.slow  # 20 s: in the slow tier, which CI runs too
def test_every_command_survives_malformed_jobs_beside_a_genuine_run(tmp_path, redis_url, conn):
    genuine = build_genuine(tmp_path, conn, redis_url)
    run = in_process(redis_url)
    dash = flask_dashboard(redis_url)
    restore(conn, genuine["dump"])
    clean = run_all(run, tmp_path, genuine, dash)
    assert clean["export"]["malformed_jobs"] == [] and clean["status"]["malformed_jobs"] == []
    assert (clean["export"]["exported"], clean["export"]["failed"], clean["export"]["missing"]) == (3, 3, 6)

    @settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(shape_places)
    def example(planted_shapes: list[tuple[str, JobPlace]]) -> None:
        restore(conn, genuine["dump"])
        planted = plant(conn, planted_shapes)
        seen = run_all(run, tmp_path, genuine, dash)
        expect(seen, clean, planted)
        assert not [k for k in conn.keys("*") if QUEUE.encode() in k or b"mal-" in k], "delete left keys"

    example()
    # every shape in every place at once, through the CLIs and the dashboard as their own processes
    restore(conn, genuine["dump"])
    planted = plant(conn, [(s, p) for s in sorted(SHAPES) for p in PLACES])
    port = free_port()
    proc = Proc("consumer", ["dashboard", "--port", str(port)], tmp_path / "dash.log", env={"REDIS_URL": redis_url})
    try:
        seen = run_all(as_subprocess(redis_url), tmp_path, genuine, http_get(port, proc))
    finally:
        proc.kill()
    expect(seen, clean, planted)
    assert "Traceback" not in proc.output(), proc.output()


def http_get(port: int, proc: Proc) -> Callable[[str], tuple[int, Any]]:
    deadline = time.monotonic() + 30
    while True:
        assert proc.p.poll() is None, proc.output()
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=2).close()
            break
        except OSError:
            assert time.monotonic() < deadline, proc.output()
            time.sleep(0.1)

    def get(path: str) -> tuple[int, Any]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as r:
                return r.status, orjson.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, e.read()[:500]

    return get


# --- the fast check in Redis never accepts what rq's loader refuses ---------------------------
RQ_FIELDS = ("status", "created_at", "enqueued_at", "started_at", "ended_at", "last_heartbeat", "timeout",
             "result_ttl", "retries_left", "enqueue_at_front", "retry_intervals", "dependency_ids", "worker_name",
             "description", "success_callback_timeout")
field_values = st.one_of(
    st.text(max_size=12).map(str.encode),
    st.binary(max_size=8),
    st.from_regex(r"\A\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(\.\d{1,7})?Z?\Z").map(str.encode),
    st.integers(-5, 10**6).map(lambda n: str(n).encode()),
    st.sampled_from([b"queued", b"finished", b"[0, 60]", b"[]", b"[1, ", b"{}", b"\xff", b""]),
)


def test_the_fast_check_agrees_with_rqs_own_loader(conn):
    q = queue_for("agree", conn)
    q.enqueue_call(TASK, args=([GOOD_ITEM],), job_id="base")
    base = conn.hgetall(Job.key_for("base"))
    fast = conn.register_script(rqjobs._FAST)
    statuses = [s.value for s in JobStatus]
    # jobs as rq writes them, at every step, take the fast path
    w = GenWorker([q], conn, lease=60)
    w.start()
    held, _ = w.dequeue(q)
    assert held is not None
    assert fast(keys=[Job.key_for("base")], args=["0", *statuses])[0] == b"ok"
    w.finish(held, {"items": 1})
    assert fast(keys=[Job.key_for("base")], args=["0", *statuses])[0] == b"ok"
    w.stop()

    @settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(st.dictionaries(st.sampled_from(RQ_FIELDS), field_values, min_size=1, max_size=3))
    def agree(fields: dict[str, bytes]) -> None:
        conn.delete(Job.key_for("probe"))
        conn.hset(Job.key_for("probe"), mapping={**base, **fields})
        verdict = fast(keys=[Job.key_for("probe")], args=["0", *statuses])[0]
        try:
            Job("probe", connection=conn, serializer=SERIALIZER).restore(conn.hgetall(Job.key_for("probe")))
            loads = True
        except Exception:  # noqa: BLE001 - whatever rq refuses
            loads = False
        assert loads or verdict != b"ok", f"the fast check accepts {fields} that rq cannot load"
        found = list(rqjobs.read_jobs(conn, "agree", [JobPlace.QUEUED], scan=rqjobs.JobScan(), depth=rqjobs.Depth.HEADERS))
        assert ("probe" in {j.id for j in found}) == loads

    conn.delete(q.key)
    conn.rpush(q.key, "probe")
    agree()
