"""Jobs the consumers refused are shown (status, export, a consumer metric) and can be cleared;
a run Redis lost is pointed back to by its run.json, with the command that re-creates it.
Real Redis, the real consumer against the stand-in vLLM over HTTP, the CLIs as subprocesses."""

from __future__ import annotations

import shlex
import urllib.request
from itertools import takewhile
from pathlib import Path

import orjson
import pytest
import redis
from rq.job import Job

from genqueue.common.keepers.items import ItemTable
from genqueue.common.keepers.redisconn import redis_location
from genqueue.common.keepers.rqaccess import SERIALIZER, TASK, JobPlace, place_key, queue_for, refused_key
from tests.conftest import RedisServer, cli, free_port, sharegpt, wait_for, write_jsonl
from tests.consumer.e2e import Proc, Sim

pytestmark = pytest.mark.integration


def plant_refusable(conn: redis.Redis, run: str) -> set[str]:
    """Three jobs a consumer refuses: rq cannot load two (no data, a bad status), one is foreign."""
    q = queue_for(run, conn)
    item = {"key": "cd" * 16, "index": 99, "turn": None, "messages": [{"role": "user", "content": "x"}]}
    for jid in ("no-data", "bad-status"):
        q.enqueue_call(TASK, args=([item],), job_id=jid)
    conn.hdel(Job.key_for("no-data"), "data")
    conn.hset(Job.key_for("bad-status"), "status", "exploded")
    foreign = queue_for(run, conn).enqueue_call("os.getcwd", job_id="foreign")
    assert q.serializer is SERIALIZER and foreign.id == "foreign"
    return {"no-data", "bad-status", "foreign"}


def metric(port: int, name: str, run: str) -> float | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
            text = r.read().decode()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith(f'{name}{{run="{run}"}}'):
            return float(line.split()[-1])
    return None


def test_refused_jobs_are_counted_named_and_cleared(tmp_path: Path, redis_url: str, conn: redis.Redis) -> None:
    env = {"REDIS_URL": redis_url}
    data = write_jsonl(tmp_path / "rf.jsonl", [sharegpt(i) for i in range(8)])
    cli("producer", "enqueue", str(data), "--batch-size", "4", "--max-tokens", "32", "--output",
        str(tmp_path / "out"), "--rejects", str(tmp_path / "r"), env=env)
    refusable = plant_refusable(conn, "rf")
    port = free_port()
    sim = Sim(tmp_path, "--step-time", "0.002", "--mean-tokens", "10")
    consumer = Proc("consumer", ["run", "--run", "rf", "--endpoint", sim.url, "--shard-max-age", "1", "--metrics-port",
                                 str(port), "--spool", str(tmp_path / "spool")], tmp_path / "c.log", env=env)
    try:
        wait_for(lambda: metric(port, "genqueue_refused_jobs", "rf") == 3.0, 60, "genqueue_refused_jobs 3")
        wait_for(lambda: ItemTable(conn, "rf").counts().done == 8, 60, "the genuine run done")
    finally:
        consumer.kill()
        sim.stop()
    assert {k.decode() for k in conn.hkeys(refused_key(queue_for("rf", conn).name))} == refusable

    status = orjson.loads(cli("producer", "status", "--run", "rf", "--json", env=env).stdout)
    assert status["refused"] == 3 and set(status["refused_jobs"]) == refusable
    assert "rq cannot load the job" in status["refused_jobs"]["no-data"]
    assert "os.getcwd" in status["refused_jobs"]["foreign"]
    human = cli("producer", "status", "--run", "rf", env=env).stdout
    lines = human.splitlines()
    (line,) = [x for x in lines if x.startswith("REFUSED")]
    assert "3 job(s) refused by consumers: bad-status (" in line and len(line) <= 100
    # at 100 columns the reasons wrap under it, and the command that clears them ends the block on
    # its own line, never clipped nor broken
    block = [line, *takewhile(lambda x: x.startswith(" " * 9), lines[lines.index(line) + 1:])]
    assert block[-1].strip() == "clear them with `producer delete --run rf --refused-only`", block
    assert all(len(x) <= 100 for x in block), block

    out = tmp_path / "rf.out.jsonl"
    export = orjson.loads(cli("producer", "export", "--run", "rf", "--output", str(out), "--json", env=env).stdout)
    assert set(export["refused_jobs"]) == refusable and export["missing"] == 0
    # every genuine item answered: in the dataset, or (cut by the 32-token budget) in the truncated file
    assert export["exported"] + export["truncated"] == 8 and export["complete"] + export["cut"] == 8
    human = cli("producer", "export", "--run", "rf", "--output", str(out), env=env).stdout
    assert "3 job(s) refused by consumers" in human and "--refused-only" in human

    cleared = cli("producer", "delete", "--run", "rf", "--refused-only", env=env).stdout
    assert cleared.startswith("run rf: 3 refused job(s) cleared: bad-status, foreign, no-data"), cleared
    status = orjson.loads(cli("producer", "status", "--run", "rf", "--json", env=env).stdout)
    assert status["refused"] == 0 and status["items_done"] == 8, "the run itself stays"
    assert not conn.zscore(place_key("rf", JobPlace.FAILED), "foreign") and not conn.exists(Job.key_for("foreign"))
    assert "REFUSED" not in cli("producer", "status", "--run", "rf", env=env).stdout


def test_a_run_redis_lost_points_to_its_run_json_and_the_command_that_brings_it_back(
        tmp_path: Path, redis_url: str, conn: redis.Redis) -> None:
    env = {"REDIS_URL": redis_url}
    out = tmp_path / "out"
    out.mkdir()  # run.json is written where the output exists
    data = write_jsonl(tmp_path / "lost.jsonl", [sharegpt(i) for i in range(5)])
    made = orjson.loads(cli("producer", "enqueue", str(data), "--run", "lost", "--max-tokens", "77", "--temperature",
                            "0.3", "--multi-turn", "last", "--output", str(out), "--rejects", str(tmp_path / "r"),
                            "--json", env=env).stdout)
    assert (out / "lost" / "run.json").is_file()
    conn.flushall()  # Redis restarted empty

    gone = cli("producer", "status", "--run", "lost", "--output", str(out), env=env, check=False)
    assert gone.returncode != 0 and "Traceback" not in gone.stderr
    (line,) = gone.stderr.splitlines()
    assert line.startswith(f"error: no run named 'lost' in Redis at {redis_url} (see `producer runs` for the runs "
                           "there), but "
                           f"{out}/lost/run.json holds it (fingerprint {made['fingerprint']}, created "), line
    command = line.split("re-create it with `", 1)[1].rstrip("`")
    assert command == shlex.join(["producer", "enqueue", str(data), "--run", "lost", "--multi-turn", "last",
                                  "--temperature", "0.3", "--max-tokens", "77", "--output", str(out)])

    # export looks in the usual place: $GENQUEUE_OUTPUT (else ./genqueue-out)
    exported = cli("producer", "export", "--run", "lost", "--output", str(tmp_path / "ds.jsonl"),
                   env={**env, "GENQUEUE_OUTPUT": str(out)}, check=False)
    assert exported.returncode != 0 and exported.stderr.strip() == line, exported.stderr

    # the printed command brings the run back, as it was
    argv = shlex.split(command)
    back = cli(argv[0], *argv[1:], "--rejects", str(tmp_path / "r2"), "--json", env=env)
    assert "re-created from" in back.stderr and orjson.loads(back.stdout)["fingerprint"] == made["fingerprint"]
    status = orjson.loads(cli("producer", "status", "--run", "lost", "--json", env=env).stdout)
    assert status["fingerprint"] == made["fingerprint"] and status["items"] == made["items"]

    # a run that was never anywhere: the list of runs is `producer runs`
    nosuch = cli("producer", "export", "--run", "nosuch", "--output", str(tmp_path / "n.jsonl"),
                 env={**env, "GENQUEUE_OUTPUT": str(out)}, check=False)
    assert nosuch.returncode != 0
    assert "see `producer runs`" in nosuch.stderr and "holds no run.json of it" in nosuch.stderr, nosuch.stderr


def test_no_run_named_x_in_redis_names_the_redis_it_asked_its_password_masked(tmp_path: Path) -> None:
    """Every command that finds no run names the Redis it asked (REDIS_URL unset asks 127.0.0.1:6379,
    perhaps someone else's).

    old: "error: no run named 'x' in Redis (see `producer runs` for the runs there)..."
    new: "error: no run named 'x' in Redis at redis://***@127.0.0.1:P/0 (see `producer runs` for the runs there)..."
    """
    server = RedisServer(tmp_path, password="s3cret")
    server.start()
    try:
        env = {"REDIS_URL": server.url}
        asked = f"error: no run named 'x' in Redis at redis://***@127.0.0.1:{server.port}/0 (see `producer runs` "
        for command in (("producer", "status", "--run", "x"), ("producer", "export", "--run", "x", "-o", "x.jsonl"),
                        ("producer", "priority", "--run", "x", "3"), ("producer", "delete", "--run", "x", "--yes"),
                        ("producer", "resume", "--run", "x")):
            proc = cli(*command, env=env, check=False, cwd=tmp_path)
            assert proc.returncode == 2 and proc.stderr.startswith(asked) and "s3cret" not in proc.stderr, \
                (command, proc.stderr)
        sim = Sim(tmp_path, "--mean-tokens", "5")
        try:
            c = Proc("consumer", ["run", "--run", "x", "--endpoint", sim.url, "--burst", "--spool",
                                  str(tmp_path / "spool")], tmp_path / "c.log", env=env)
            assert c.wait(60) == 2 and asked in c.output() and "s3cret" not in c.output(), c.output()
        finally:
            sim.stop()
    finally:
        server.stop()
    # the forms a URL takes, the credentials masked
    assert redis_location(redis.Redis.from_url("rediss://u:pw@cache.example:6380/2")) == \
        "rediss://***@cache.example:6380/2"
    assert redis_location(redis.Redis.from_url("unix:///run/redis.sock?db=1")) == "unix:///run/redis.sock?db=1"
    assert redis_location(redis.Redis.from_url("redis://[::1]:6379")) == "redis://[::1]:6379/0"
