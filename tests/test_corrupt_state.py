"""genqueue's own keys holding what genqueue never writes (garbage, another tool's data, a hand
edit): every producer command ends in its result or one line naming the key and the way out,
never a traceback. (Malformed rq jobs are tests/test_malformed_redis.py's.)"""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest
import redis
from click.testing import CliRunner

from genqueue.common.keepers.items import ItemTable
from genqueue.producer.cli import main as producer
from tests.conftest import sharegpt, write_jsonl

pytestmark = pytest.mark.integration

RUN = "data"
GARBAGE = [b"garbage", b"", b"[1,2]", b'{"a":', b"\xff\xfe", b"null", b"5", b'"text"']
#: key -> what each garbage value is planted as (a hash field, or the value of a plain key)
PLANTED: list[tuple[str, str | None]] = [
    (f"genqueue:run:{RUN}", "settings"),
    (f"genqueue:run:{RUN}", "fingerprints"),
    (f"genqueue:run:{RUN}", "created_at"),
    (f"genqueue:run:{RUN}:sources", "garbage-source"),
    (f"genqueue:run:{RUN}:stats", "completions"),
    (f"genqueue:run:{RUN}:spec", "source\x1fa.jsonl\x1fanswers"),
    (f"genqueue:run:{RUN}:paused", None),
    ("genqueue:consumer:w-planted", None),
]
SNAPSHOTS = [
    {"worker": 5}, {"worker": "w", "runs": {RUN: 5}}, {"worker": "w", "runs": [], "last_seen": 1},
    {"worker": "w", "runs": {RUN: {}}, "last_seen": "x"}, {"worker": "w", "runs": {RUN: {}}, "engine": 3},
    {"worker": "w", "runs": {RUN: {}}, "last_seen": 1e18, "paused": ["x"]},
    {"worker": "w", "runs": {RUN: {"spec": 5}}, "last_seen": 1e18},
    {"worker": "w", "runs": {RUN: {"spec": {"answers": "x", "steps": 1}}}, "last_seen": 1e18},
]


def commands(tmp: Path) -> list[list[str]]:
    return [["status", "--run", RUN], ["status", "--run", RUN, "--json"], ["status"], ["runs"], ["runs", "--json"],
            ["export", "--run", RUN, "--output", str(tmp / "x.jsonl"), "--allow-partial"],
            ["enqueue", str(tmp / f"{RUN}.jsonl"), "--output", str(tmp / "out")],
            ["resume", "--run", RUN]]


def run_all(tmp: Path, url: str, what: str) -> None:
    runner = CliRunner()
    for args in commands(tmp):
        res = runner.invoke(producer, args, env={"REDIS_URL": url}, catch_exceptions=True)
        shown = f"{what}: producer {' '.join(args)} exited {res.exit_code}:\n{res.output}"
        assert res.exception is None or isinstance(res.exception, SystemExit), f"{shown}\n{res.exc_info}"
        assert "Traceback" not in res.output, shown
        if res.exit_code not in (0,):
            errors = [line for line in res.output.splitlines() if line.startswith("error: ")]
            assert len(errors) == 1, shown
            assert res.exit_code in (1, 2), shown


def test_every_command_survives_garbage_in_genqueue_keys(tmp_path: Path, redis_url: str, conn: redis.Redis) -> None:
    write_jsonl(tmp_path / f"{RUN}.jsonl", [sharegpt(i) for i in range(6)])
    (tmp_path / "out").mkdir()
    res = CliRunner().invoke(producer, ["enqueue", str(tmp_path / f"{RUN}.jsonl"), "--output", str(tmp_path / "out")],
                             env={"REDIS_URL": redis_url})
    assert res.exit_code == 0, res.output
    conn.zadd("genqueue:consumers", {"w-planted": 9e18})
    clean = conn.dump(f"genqueue:run:{RUN}")
    for key, fld in PLANTED:
        values: list[bytes] = [*GARBAGE, *(orjson.dumps(s) for s in SNAPSHOTS)] if "consumer:" in key else GARBAGE
        for value in values:
            if fld is None:
                conn.set(key, value)
            else:
                conn.hset(key, fld, value)
            run_all(tmp_path, redis_url, f"{key} {fld} = {value!r}")
            if fld is None:
                conn.delete(key)
            else:
                conn.hdel(key, fld)
            conn.restore(f"genqueue:run:{RUN}", 0, clean, replace=True)


def test_a_run_whose_record_is_garbage_is_named_listed_and_deletable(tmp_path: Path, redis_url: str,
                                                                     conn: redis.Redis) -> None:
    write_jsonl(tmp_path / f"{RUN}.jsonl", [sharegpt(i) for i in range(3)])
    env = {"REDIS_URL": redis_url}
    runner = CliRunner()
    assert runner.invoke(producer, ["enqueue", str(tmp_path / f"{RUN}.jsonl"), "--run", "good"], env=env).exit_code == 0
    assert runner.invoke(producer, ["enqueue", str(tmp_path / f"{RUN}.jsonl")], env=env).exit_code == 0
    conn.hset(f"genqueue:run:{RUN}", "settings", b'{"output": 5}')
    status = runner.invoke(producer, ["status", "--run", RUN], env=env)
    assert status.exit_code == 1
    assert f"genqueue:run:{RUN}" in status.output and f"producer delete --run {RUN} --yes" in status.output
    listed = runner.invoke(producer, ["runs"], env=env).output
    assert "good" in listed and "unreadable" in listed, listed
    assert runner.invoke(producer, ["delete", "--run", RUN, "--yes"], env=env).exit_code == 0
    assert RUN not in runner.invoke(producer, ["runs"], env=env).output.split()
    again = runner.invoke(producer, ["enqueue", str(tmp_path / f"{RUN}.jsonl")], env=env)
    assert again.exit_code == 0, again.output


def test_an_unreadable_pause_is_still_a_pause(redis_url: str, conn: redis.Redis, tmp_path: Path) -> None:
    from genqueue.common.keepers.pause import Pause

    conn.set(f"genqueue:run:{RUN}:paused", b"garbage")
    pause = Pause(conn, RUN).get()
    assert pause is not None and "unreadable pause record" in pause["reason"]


def test_a_consumer_serves_on_beside_a_run_whose_record_is_garbage(tmp_path: Path, redis_url: str,
                                                                  conn: redis.Redis) -> None:
    from tests.conftest import cli
    from tests.consumer.e2e import Sim

    write_jsonl(tmp_path / "a.jsonl", [sharegpt(i) for i in range(5)])
    env = {"REDIS_URL": redis_url}
    out = str(tmp_path / "out")
    cli("producer", "enqueue", str(tmp_path / "a.jsonl"), "--run", "good", "--output", out, env=env)
    cli("producer", "enqueue", str(tmp_path / "a.jsonl"), "--run", "bad", "--output", out, env=env)
    conn.hset("genqueue:run:bad", "settings", b"garbage")
    sim = Sim(tmp_path, "--mean-tokens", "5")
    try:
        done = cli("consumer", "run", "--endpoint", sim.url, "--burst", "--spool", str(tmp_path / "s"), env=env,
                   check=False, timeout=90)
        alone = cli("consumer", "run", "--run", "bad", "--endpoint", sim.url, "--burst", "--spool",
                    str(tmp_path / "s2"), env=env, check=False, timeout=90)
    finally:
        sim.stop()
    assert done.returncode == 4, done.stderr  # --burst: a run it could not serve (ExitCode.PREFLIGHT)
    assert "not serving run bad" in done.stderr and "Traceback" not in done.stderr
    assert ItemTable(conn, "good").counts().done == 5
    assert alone.returncode == 2 and "error: run bad's record in Redis" in alone.stderr, alone.stderr
