"""A multi-node run whose output is a local path cannot silently split over the nodes' disks.

The run records the host that made it; a consumer on another host refuses it with one line that
names the fix; `--shared-fs` declares the path shared; status says which hosts ship where.
Hosts are told apart with GENQUEUE_HOST (real processes, a real redis-server, the stand-in
vLLM over HTTP); the placement rule itself is tested without them first."""

from __future__ import annotations

import urllib.request
from pathlib import Path

import orjson
import pytest

from genqueue.common.keepers.runs import RunStore
from genqueue.common.placement import Placement, this_host
from genqueue.common.settings import RunSettings
from genqueue.common.storage import LocalStore
from genqueue.common.storage.runfile import read_run_file
from tests.conftest import cli, free_port, sharegpt, wait_for, write_jsonl
from tests.consumer.e2e import Proc, Sim, read_results, run_keys


# --- the rule -------------------------------------------------------------------------------
def test_a_local_output_belongs_to_the_host_that_made_the_run() -> None:
    p = Placement.new("/data/out", shared_fs=False, host="node-a")
    assert p == Placement("node-a", False)
    assert p.refusal("r", "/data/out", "node-a") is None
    why = p.refusal("r", "/data/out", "node-b")
    assert why is not None and "\n" not in why
    assert "node-a" in why and "node-b" in why and "s3://" in why and "--shared-fs" in why


def test_s3_shared_and_old_runs_are_refused_nowhere() -> None:
    assert Placement.new("s3://bucket/out", shared_fs=False, host="node-a") == Placement()
    assert Placement.new("/nfs/out", shared_fs=True, host="node-a") == Placement(None, True)
    for p in (Placement(), Placement(None, True)):
        assert p.refusal("r", "/nfs/out", "node-b") is None
    # a run recorded on node-a whose output became s3 (it cannot: output is fixed) is not refused
    assert Placement("node-a").refusal("r", "s3://b/p", "node-b") is None


def test_placement_round_trips_through_redis_fields() -> None:
    for p in (Placement(), Placement("node-a"), Placement(None, True)):
        raw = {k.encode(): v.encode() for k, v in p.fields().items()}
        assert Placement.from_fields(raw) == p
        assert Placement.from_fields(p.fields()) == p
    assert Placement.from_fields({}) == Placement()  # a run made before placements


def test_this_host_is_the_hostname_unless_named(monkeypatch: pytest.MonkeyPatch) -> None:
    import socket

    monkeypatch.delenv("GENQUEUE_HOST", raising=False)
    assert this_host() == socket.gethostname()
    monkeypatch.setenv("GENQUEUE_HOST", "  ")
    assert this_host() == socket.gethostname()
    monkeypatch.setenv("GENQUEUE_HOST", "node-a")
    assert this_host() == "node-a"


def test_create_records_the_host_and_run_json_keeps_it(tmp_path: Path, conn, monkeypatch) -> None:
    monkeypatch.setenv("GENQUEUE_HOST", "node-a")
    store = RunStore(conn)
    store.create_or_check("loc", RunSettings(output=str(tmp_path)))
    store.create_or_check("s3", RunSettings(output="s3://bucket/out"))
    assert store.require("loc").placement == Placement("node-a")
    assert store.require("s3").placement == Placement()
    store.declare_shared("loc")
    assert store.require("loc").placement == Placement(None, True)


# --- real processes ---------------------------------------------------------------------------


def _status(env: dict[str, str], run: str) -> dict:
    return orjson.loads(cli("producer", "status", "--run", run, "--json", env=env).stdout)


def _metrics(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        return r.read().decode()


@pytest.mark.integration
@pytest.mark.slow  # 15 s: in the slow tier, which CI runs too
def test_another_host_is_refused_until_the_output_is_declared_shared(tmp_path: Path, redis_url, conn) -> None:
    data = write_jsonl(tmp_path / "split.jsonl", [sharegpt(i) for i in range(120)])
    out = tmp_path / "out"
    out.mkdir()  # run.json is written to an output directory that exists
    base = {"REDIS_URL": redis_url}
    a, b = {**base, "GENQUEUE_HOST": "node-a"}, {**base, "GENQUEUE_HOST": "node-b"}
    enqueue = ["enqueue", str(data), "--run", "split", "--output", str(out), "--batch-size", "8",
               "--max-tokens", "64", "--rejects", str(tmp_path / "rej.jsonl")]
    cli("producer", *enqueue, env=a)
    assert RunStore(conn).require("split").placement == Placement("node-a")
    rf = read_run_file(LocalStore(str(out)), "split")
    assert rf is not None and rf.placement == Placement("node-a")
    jobs_before = _status(a, "split")["jobs"]

    # the producer on node-b: refused before it reads or writes anything
    p = cli("producer", *enqueue, env=b, check=False)
    assert p.returncode != 0 and "Traceback" not in p.stderr
    assert p.stderr.count("\n") == 1 and "node-a" in p.stderr and "--shared-fs" in p.stderr, p.stderr
    # export and purge on node-b would read or delete node-b's directory of that name
    for cmd in (["export", "--run", "split", "-o", str(tmp_path / "x.jsonl")],
                ["delete", "--run", "split", "--yes", "--purge-output"]):
        p = cli("producer", *cmd, env=b, check=False)
        assert p.returncode != 0 and "node-a" in p.stderr and "Traceback" not in p.stderr, p.stderr
    assert RunStore(conn).get("split") is not None, "the refused delete deleted nothing"

    sim = Sim(tmp_path, "--slots", "16", "--step-time", "0.01", "--mean-tokens", "20")
    spool = tmp_path / "spool"
    try:
        # a consumer on node-b told to serve the run: one line, non-zero, no job taken
        c = cli("consumer", "run", "--run", "split", "--endpoint", sim.url, "--burst", "--spool",
                str(spool / "b1"), env=b, check=False, timeout=60)
        assert c.returncode != 0, c.stderr
        assert "error: run split's output" in c.stderr and "s3://" in c.stderr and "--shared-fs" in c.stderr
        assert "Traceback" not in c.stderr
        assert _status(a, "split")["jobs"] == jobs_before
        # a consumer on node-b serving every run: refuses this one, says why in status, takes nothing
        port = free_port()
        cb = Proc("consumer", ["run", "--endpoint", sim.url, "--spool", str(spool / "b2"), "-c", "8",
                               "--shard-max-age", "1", "--metrics-port", str(port)], tmp_path / "b.log", env=b)
        wait_for(lambda: "node-b" in _status(a, "split")["hosts"], 60, "node-b's refusal in status")
        st = _status(a, "split")
        assert st["hosts"]["node-b"]["refusing"] == 1 and st["hosts"]["node-b"]["serving"] == 0
        assert "node-a" in st["hosts"]["node-b"]["reason"]
        assert st["output_placement"] == {"host": "node-a", "shared_fs": False,
                                          "where": "the local disk of host node-a: only consumers on node-a "
                                                   "ship to it"}
        human = cli("producer", "status", "--run", "split", env=a).stdout
        assert "hosts" in human and "node-b: 1 REFUSING" in human, human
        assert st["jobs"] == jobs_before and cb.p.poll() is None
        assert cb.output().count("not serving run split") == 1, cb.output()
        wait_for(lambda: 'genqueue_run_refused{run="split"} 1.0' in _metrics(port), 30, "the refusal in metrics")
        # node-a serves it; then node-b's path is declared one shared filesystem: node-b joins
        ca = Proc("consumer", ["run", "--endpoint", sim.url, "--spool", str(spool / "a"), "-c", "4",
                               "--shard-max-age", "1"], tmp_path / "a.log", env=a)
        wait_for(lambda: _status(a, "split")["hosts"].get("node-a", {}).get("serving") == 1, 60, "node-a serving")
        note = cli("producer", *enqueue, "--shared-fs", env=b)
        assert "declared a shared filesystem" in note.stderr, note.stderr
        assert RunStore(conn).require("split").placement == Placement(None, True)
        rf = read_run_file(LocalStore(str(out)), "split")
        assert rf is not None and rf.placement == Placement(None, True)
        wait_for(lambda: _status(a, "split")["hosts"].get("node-b", {}).get("serving") == 1, 60, "node-b serving")
        wait_for(lambda: 'genqueue_run_refused{run="split"} 0.0' in _metrics(port), 30, "the refusal lifted")
        keys = run_keys(conn, "split")
        wait_for(lambda: keys <= {r["key"] for r in read_results(out, "split")}, 120, "every item shipped")
        for proc in (ca, cb):
            proc.signal(15)
        assert ca.wait(60) == 0 and cb.wait(60) == 0, cb.output()
    finally:
        sim.stop()
    hosts = {r["consumer"]["host"] for r in read_results(out, "split")}
    assert hosts <= {"node-a", "node-b"} and "node-b" in hosts, hosts
    assert "Traceback" not in cb.output() + ca.output()
    # declared shared: export on node-b reads it
    cli("producer", "export", "--run", "split", "-o", str(tmp_path / "split.out.jsonl"), env=b)


@pytest.mark.integration
def test_a_run_recreated_from_run_json_keeps_its_shared_declaration(tmp_path: Path, redis_url, conn) -> None:
    data = write_jsonl(tmp_path / "keep.jsonl", [sharegpt(i) for i in range(10)])
    out = tmp_path / "out"
    out.mkdir()
    env = {"REDIS_URL": redis_url, "GENQUEUE_HOST": "node-a"}
    enqueue = ["enqueue", str(data), "--run", "keep", "--output", str(out), "--rejects", str(tmp_path / "r.jsonl")]
    cli("producer", *enqueue, "--shared-fs", env=env)
    rf = read_run_file(LocalStore(str(out)), "keep")
    assert rf is not None and rf.placement == Placement(None, True)
    conn.flushall()
    p = cli("producer", *enqueue, env={**env, "GENQUEUE_HOST": "node-c"})
    assert "re-created" in p.stderr, p.stderr
    assert RunStore(conn).require("keep").placement == Placement(None, True)
