"""The output holds what is needed to rebuild a run (run.json beside its shards, local and S3),
a run Redis lost comes back from it, and a run's settings change only when asked
(--update-settings). Real redis-server, real S3 server, the CLI as a user runs it."""

from __future__ import annotations

import hashlib
import os
from itertools import takewhile
from pathlib import Path
from typing import Any

import orjson
import pytest
import redis

from genqueue.common.keepers.items import DONE, FAILED, IN_RUN, ItemTable
from genqueue.common.keepers.keeper import run_key
from genqueue.common.keepers.marks import Marks, ShardMarks
from genqueue.common.keepers.packs import PackTable
from genqueue.common.keepers.pause import Pause
from genqueue.common.keepers.runs import RunStore, key_digest
from genqueue.common.settings import RunSettings
from genqueue.common.storage import LocalStore, SealedShard, shard_name
from genqueue.producer.status import format_status, run_status
from tests.conftest import Prompts, cli, sharegpt, write_jsonl
from tests.consumer.e2e import Proc, Sim, read_results
from tests.s3server import S3Server, s3_server  # noqa: F401 - fixture

pytestmark = pytest.mark.integration


def enqueue(redis_url: str, data: Path, run: str, output: str, *extra: str, env: dict[str, str] | None = None,
            check: bool = True) -> tuple[dict[str, Any], str]:
    proc = cli("producer", "enqueue", str(data), "--run", run, "--output", output, "--json", "--rejects", os.devnull,
               *extra, env={"REDIS_URL": redis_url, **(env or {})}, check=check)
    return (orjson.loads(proc.stdout) if proc.returncode == 0 else {"returncode": proc.returncode}), proc.stderr


def one_line_error(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in stderr, stderr
    return lines[0]


def test_run_json_holds_settings_history_and_sources(tmp_path: Path, redis_url: str, conn: redis.Redis) -> None:
    out = tmp_path / "out"
    out.mkdir()
    a = write_jsonl(tmp_path / "a.jsonl", [sharegpt(i) for i in range(20)])
    b = write_jsonl(tmp_path / "b.jsonl", [sharegpt(i) for i in range(10, 30)])
    s, _ = enqueue(redis_url, a, "rj", str(out), "--max-tokens", "512")
    rf = orjson.loads((out / "rj" / "run.json").read_bytes())
    info = RunStore(conn).require("rj")
    assert rf["run"] == "rj" and rf["fingerprint"] == s["fingerprint"] == info.fingerprint
    assert rf["settings"] == info.settings.to_dict() and rf["settings"]["sampling"]["max_tokens"] == 512
    assert rf["created_at"] == info.created_at and rf["version"] == info.version
    assert [e["fingerprint"] for e in rf["fingerprints"]] == [info.fingerprint]
    assert set(rf["sources"]) == {str(a)} and rf["sources"][str(a)]["enqueued"] == 20
    enqueue(redis_url, b, "rj", str(out), "--max-tokens", "512")
    rf = orjson.loads((out / "rj" / "run.json").read_bytes())
    assert set(rf["sources"]) == {str(a), str(b)} and rf["sources"][str(b)]["enqueued"] == 10

    # other settings: refused as before (one line, naming them), with the way to change them
    s, err = enqueue(redis_url, a, "rj", str(out), "--max-tokens", "64", check=False)
    line = one_line_error(err)
    assert s["returncode"] == 2 and "sampling.max_tokens" in line and "--update-settings" in line
    # --update-settings: a new fingerprint, remembered with the old one, in Redis and run.json
    s, err = enqueue(redis_url, a, "rj", str(out), "--max-tokens", "64", "--update-settings")
    assert s["settings_updated"]["from"] == info.fingerprint and s["fingerprint"] == s["settings_updated"]["to"]
    assert s["settings_updated"]["changed"] == ["sampling.max_tokens"] and "settings updated" in err
    assert s["already_queued"] == 20  # its items keep their place in the queue
    now = RunStore(conn).require("rj")
    assert now.settings.sampling.max_tokens == 64 and now.fingerprint == s["fingerprint"]
    assert conn.hget(run_key("rj"), "fingerprint") == now.fingerprint.encode()  # what consumers watch
    assert [e["fingerprint"] for e in now.fingerprints] == [info.fingerprint, now.fingerprint]
    rf = orjson.loads((out / "rj" / "run.json").read_bytes())
    assert rf["fingerprint"] == now.fingerprint and len(rf["fingerprints"]) == 2
    st = run_status(conn, "rj")
    assert [f["fingerprint"] for f in st["fingerprints"]] == [info.fingerprint, now.fingerprint]
    text = format_status(st, color=False)
    row = next(x for x in text.splitlines() if x.startswith("fingerprints "))
    assert row.split(None, 1)[1].startswith(f"2 (settings updated): {info.fingerprint} (")
    assert f"-> {now.fingerprint} (" in row
    # the same command again is not a change; a mode change is refused even so
    s, _ = enqueue(redis_url, a, "rj", str(out), "--max-tokens", "64", "--update-settings")
    assert s["settings_updated"] is None and len(RunStore(conn).require("rj").fingerprints) == 2
    s, err = enqueue(redis_url, a, "rj", str(out), "--max-tokens", "64", "--multi-turn", "first",
                     "--update-settings", check=False)
    assert s["returncode"] == 2 and "multi_turn" in one_line_error(err)


def test_options_left_out_keep_an_existing_runs_settings(tmp_path: Path, redis_url: str, conn: redis.Redis) -> None:
    out = tmp_path / "out"
    out.mkdir()
    data = write_jsonl(tmp_path / "data.jsonl", [sharegpt(i) for i in range(20)])
    made, _ = enqueue(redis_url, data, "data", str(out), "--temperature", "0.3", "--seed", "7")
    # README: `producer enqueue data.jsonl --run data --max-tokens 2048 --update-settings` changes
    # that one setting (the run's temperature and seed stay, not reset to the options' defaults)
    s, err = enqueue(redis_url, data, "data", str(out), "--max-tokens", "2048", "--update-settings")
    assert s["settings_updated"]["changed"] == ["sampling.max_tokens"], err
    updated = RunStore(conn).require("data")
    sp = updated.settings.sampling
    assert (sp.temperature, sp.seed, sp.max_tokens) == (0.3, 7, 2048) and updated.fingerprint != made["fingerprint"]
    # one item failed for good, the others are done
    cli("rq", "empty", "-u", redis_url, "genqueue.data")
    keys = sorted(ItemTable(conn, "data").digests())
    ItemTable(conn, "data").change([*keys[1:]], add=DONE)
    ItemTable(conn, "data").change([keys[0]], add=FAILED)
    # README's `producer enqueue data.jsonl --retry-failed`, as written (no --output: the run's own)
    proc = cli("producer", "enqueue", "data.jsonl", "--retry-failed", "--json", "--rejects", os.devnull,
               env={"REDIS_URL": redis_url}, cwd=tmp_path, check=False)
    assert proc.returncode == 0, proc.stderr
    s = orjson.loads(proc.stdout)
    assert (s["run"], s["retried_failed"], s["already_done"]) == ("data", 1, 19)
    assert s["settings_updated"] is None and s["fingerprint"] == updated.fingerprint
    assert RunStore(conn).require("data").settings == updated.settings
    assert not (tmp_path / "genqueue-out").exists()  # the run's output, not the default one
    # an option given with another value is still refused, in one line naming it (it alone);
    # given at its default value is given all the same
    for option, value, name in (("--max-tokens", "64", "sampling.max_tokens"),
                                ("--temperature", "0.6", "sampling.temperature")):
        s, err = enqueue(redis_url, data, "data", str(out), option, value, check=False)
        line = one_line_error(err)
        assert s["returncode"] == 2 and f"with other settings ({name}); leave those options out" in line, line
    assert RunStore(conn).require("data").settings == updated.settings
    # a flag left out keeps the run's too; its --no- form turns it off
    s, _ = enqueue(redis_url, data, "data", str(out), "--expect-reasoning", "--update-settings")
    assert s["settings_updated"]["changed"] == ["expect_reasoning"]
    assert enqueue(redis_url, data, "data", str(out))[0]["settings_updated"] is None
    assert RunStore(conn).require("data").settings.expect_reasoning
    s, _ = enqueue(redis_url, data, "data", str(out), "--no-expect-reasoning", "--update-settings")
    assert s["settings_updated"]["changed"] == ["expect_reasoning"] and s["fingerprint"] == updated.fingerprint
    # Redis lost the run: what is left out is its run.json's
    conn.flushall()
    s, err = enqueue(redis_url, data, "data", str(out))
    assert s["recreated_run"] and s["fingerprint"] == updated.fingerprint, err
    assert RunStore(conn).require("data").settings == updated.settings


def ship(store: LocalStore, run: str, seq: int, records: list[dict[str, Any]], tmp: Path) -> None:
    """A shard as a consumer ships it, through the same store."""
    path = tmp / f"spool-{seq}.jsonl"
    body = b"".join(orjson.dumps(r) + b"\n" for r in records)
    path.write_bytes(body)
    name = shard_name("w0", seq)
    store.ship(SealedShard(run, seq, path, name, len(records), len(body), hashlib.sha256(body).hexdigest(),
                           len(records)))


def test_a_run_redis_lost_comes_back_from_its_output(tmp_path: Path, redis_url: str, conn: redis.Redis,
                                                      prompts_mode: Prompts) -> None:
    out = tmp_path / "out"
    out.mkdir()
    data = write_jsonl(tmp_path / "lost.jsonl", [sharegpt(i) for i in range(100)])
    first, _ = enqueue(redis_url, data, "lost", str(out), "--temperature", "0.3", *prompts_mode.args)
    packs_before = PackTable(conn, "lost").names()
    assert len(packs_before) == first["packs"] == (1 if prompts_mode.by_reference else 0)
    info = RunStore(conn).require("lost")
    keys = sorted(d.hex() for d in ItemTable(conn, "lost").digests())
    # 60 results and 5 error records shipped, one item with both (retried), then Redis is lost
    recs = [{"key": k, "index": 0, "content": "x"} for k in keys[:60]]
    recs += [{"key": k, "index": 0, "error": {"class": "permanent"}} for k in [*keys[60:65], keys[0]]]
    ship(LocalStore(str(out)), "lost", 1, recs[:30], tmp_path)
    ship(LocalStore(str(out)), "lost", 2, recs[30:], tmp_path)
    conn.flushall()

    s, err = enqueue(redis_url, data, "lost", str(out), "--temperature", "0.5", check=False)
    line = one_line_error(err)  # the output remembers the run's settings
    assert s["returncode"] == 2 and "is not in Redis" in line and "sampling.temperature" in line
    assert conn.dbsize() == 0
    s, err = enqueue(redis_url, data, "lost", str(out), "--temperature", "0.3", *prompts_mode.args)
    assert f"run lost was not in Redis: re-created from {out / 'lost' / 'run.json'}" in err, err
    assert s["recreated_run"] and not s["created_run"] and s["fingerprint"] == first["fingerprint"]
    assert s["marks_rebuilt"] == {"shards": 2, "records": 66, "done": 60, "failed": 6}
    assert (s["already_done"], s["already_failed"], s["enqueued"]) == (60, 5, 35), s
    back = RunStore(conn).require("lost")
    assert (back.settings, back.created_at, back.fingerprints) == (info.settings, info.created_at, info.fingerprints)
    assert ItemTable(conn, "lost").counts().done == 60 and ItemTable(conn, "lost").counts().failed == 6
    assert ItemTable(conn, "lost").counts().in_run == 100
    st = run_status(conn, "lost")
    assert (st["items"], st["items_done"], st["items_failed"]) == (100, 60, 5)  # failed: error record, no result
    assert RunStore(conn).names() == ["lost"]
    assert [int(bool(s & IN_RUN)) for s in ItemTable(conn, "lost").states([key_digest(keys[0])])] == [1]
    # by reference: the packs are re-found from run.json, the first enqueue's beside the new one's
    packs = PackTable(conn, "lost").names()
    assert len(packs) == len(packs_before) + s["packs"] and packs.items() >= packs_before.items(), packs
    rf = orjson.loads((out / "lost" / "run.json").read_bytes())
    assert {int(k): v for k, v in rf.get("packs", {}).items()} == packs
    assert sorted(p.name for p in (out / "lost" / "packs").glob("*.gqpack")) == sorted(packs.values())


def test_first_enqueue_into_no_folder_yet_writes_run_json_not_holds_no_run_json_after_a_redis_loss(
        tmp_path: Path, redis_url: str, conn: redis.Redis) -> None:
    """The default output (./genqueue-out, not made yet) gets its run.json from the run's first
    enqueue, so a Redis loss after the run shipped is told and undone from it.

    old: status and export after the loss: "... and <cwd>/genqueue-out holds no run.json of it
         (another output? ...)"; the re-enqueue made a new run from the shards alone
    new: "... but <cwd>/genqueue-out/fresh/run.json holds it (...): re-create it with ...", and the
         re-enqueue re-creates the run from it: 0 items queued again, 512 already done."""
    data = write_jsonl(tmp_path / "fresh.jsonl", [sharegpt(i) for i in range(512)])
    env = {"REDIS_URL": redis_url}
    out = tmp_path / "genqueue-out"

    def enqueue_default() -> tuple[dict[str, Any], str]:
        proc = cli("producer", "enqueue", str(data), "--run", "fresh", "--json", "--rejects", os.devnull, env=env,
                   cwd=tmp_path)
        return orjson.loads(proc.stdout), proc.stderr

    first, _ = enqueue_default()
    assert first["created_run"]
    sim = Sim(tmp_path, "--mean-tokens", "8")
    try:
        c = Proc("consumer", ["run", "--run", "fresh", "--endpoint", sim.url, "-c", "32", "--burst",
                              "--shard-max-age", "0.5", "--spool", str(tmp_path / "spool")],
                 tmp_path / "c.log", env=env)
        assert c.wait(120) == 0, c.output()
    finally:
        sim.stop()
    assert len(read_results(out, "fresh")) == 512
    created = RunStore(conn).require("fresh").created_at
    conn.flushall()  # Redis lost the run

    held = f"but {out / 'fresh' / 'run.json'} holds it (fingerprint {first['fingerprint']}"
    for command in (("status", "--run", "fresh"), ("export", "--run", "fresh", "-o", str(tmp_path / "x.jsonl"))):
        line = one_line_error(cli("producer", *command, env=env, cwd=tmp_path, check=False).stderr)
        assert held in line and "holds no run.json" not in line, line
    s, err = enqueue_default()
    assert f"run fresh was not in Redis: re-created from {out / 'fresh' / 'run.json'}" in err, err
    assert s["recreated_run"] and s["fingerprint"] == first["fingerprint"]
    assert (s["enqueued"], s["already_done"], s["jobs"]) == (0, 512, 0), s  # nothing generated again
    assert RunStore(conn).require("fresh").created_at == created  # the same run, not a new one of its shards


def test_run_json_keeps_its_packs_when_the_settings_change(tmp_path: Path, redis_url: str, conn: redis.Redis) -> None:
    """run.json is written again when the run's settings change: the mode and the packs the
    enqueues by reference named stay in it (a Redis loss after that would lose them)."""
    out = tmp_path / "out"
    data = write_jsonl(tmp_path / "upd.jsonl", [sharegpt(i) for i in range(20)])
    enqueue(redis_url, data, "upd", str(out), "--prompts", "reference")
    packs = {str(n): name for n, name in PackTable(conn, "upd").names().items()}
    assert len(packs) == 1
    s, _ = enqueue(redis_url, data, "upd", str(out), "--max-tokens", "99", "--update-settings")
    assert s["settings_updated"] is not None
    rf = orjson.loads((out / "upd" / "run.json").read_bytes())
    assert (rf["prompts"], rf["packs"]) == ("reference", packs)


def _figures(conn: redis.Redis, run: str) -> tuple[dict[str, int], list[str]]:
    """Status's outcome, turn and tool-turn figures of RUN, and its turns and tools rows."""
    st = run_status(conn, run)
    keys = ("items_done", "items_failed", "complete", "partial", "cut", "outcomes_counted", "turns_generated",
            "tool_turns_to_end", "tool_call_diverged", "stopped_at_tool_turn")
    rows = [x for x in format_status(st, color=False).splitlines() if x.lstrip().startswith(("turns", "tools"))]
    return {k: st[k] for k in keys}, rows  # type: ignore[literal-required]


def test_a_rebuild_after_a_redis_loss_recounts_outcomes_turns_and_tool_turns(
        tmp_path: Path, redis_url: str, conn: redis.Redis) -> None:
    """The marks rebuilt from the shards bump the counters the consumers' marks bumped as the
    shards shipped: status after a Redis loss shows the tool-turn (and outcome, turn) figures
    it showed before it, once however often the marks are rebuilt."""
    out = tmp_path / "out"
    out.mkdir()
    data = write_jsonl(tmp_path / "tools.jsonl", [sharegpt(i) for i in range(10)])
    enqueue(redis_url, data, "tl", str(out), "--multi-turn", "regenerate")
    keys = sorted(d.hex() for d in ItemTable(conn, "tl").digests())
    spliced = [{"turn": 0, "tool_results_spliced": True}, {"turn": 0, "step": 1}]
    diverged = {"note": "tool_call_diverged", "stopped": {"turn": 0, "reason": "tool_call_diverged"}}
    recs: list[dict[str, Any]] = [{"key": k, "outcome": "finished", "turns": spliced} for k in keys[:3]]
    recs += [{"key": keys[3], "outcome": "finished", "turns": [{"turn": 0, "tool_results_spliced": False}],
              **diverged},
             {"key": keys[4], "outcome": "partial", "turns": spliced, "stopped": {"turn": 0, "step": 1}},
             {"key": keys[5], "outcome": "cut_in_answer", "turns": [{"turn": 0}]},
             {"key": keys[6], "error": {"class": "permanent"}}, {"key": keys[0], "error": {"class": "permanent"}}]
    store = LocalStore(str(out))
    for seq, part in ((1, recs[:4]), (2, recs[4:])):
        ship(store, "tl", seq, part, tmp_path)
        marks = ShardMarks()
        for rec in part:
            marks.add_record(rec)
        Marks(conn, "tl").mark_shipped(marks)  # as the consumer that shipped it
    before, rows = _figures(conn, "tl")
    assert (before["tool_turns_to_end"], before["tool_call_diverged"], before["stopped_at_tool_turn"]) == (3, 1, 1)
    assert before["outcomes_counted"] == before["items_done"] == 6 and before["turns_generated"] == 6
    conn.flushall()

    s, _ = enqueue(redis_url, data, "tl", str(out), "--multi-turn", "regenerate")
    assert s["recreated_run"] and s["marks_rebuilt"] == {"shards": 2, "records": 8, "done": 6, "failed": 2}
    assert _figures(conn, "tl") == (before, rows), rows
    assert Marks(conn, "tl").rebuild(store).done == 6  # again: nothing counted twice
    assert _figures(conn, "tl") == (before, rows)


def test_run_json_on_s3_and_in_a_local_output_not_made_yet(tmp_path: Path, redis_url: str, conn: redis.Redis,
                                                           s3_server: S3Server) -> None:  # noqa: F811
    data = write_jsonl(tmp_path / "s3.jsonl", [sharegpt(i) for i in range(10)])
    url = s3_server.url("runs/rf")
    s, _ = enqueue(redis_url, data, "s3rj", url, env=s3_server.env)
    body = s3_server.client().get_object(Bucket=s3_server.bucket, Key="runs/rf/s3rj/run.json")["Body"].read()
    rf = orjson.loads(body)
    assert rf["fingerprint"] == s["fingerprint"] and rf["settings"]["output"] == url
    assert list(rf["sources"]) == [str(data)]
    conn.flushall()
    s, err = enqueue(redis_url, data, "s3rj", url, env=s3_server.env)
    assert s["recreated_run"] and s["enqueued"] == 10 and "re-created from s3://" in err
    # A producer without the output's credentials (consumers' nodes have them) enqueues with
    # --no-output-check (without it, the output's probe refuses: tests/consumer/test_output_probe.py).
    no_creds = {**s3_server.env, "AWS_ACCESS_KEY_ID": "nobody", "AWS_SECRET_ACCESS_KEY": "wrong"}
    s, err = enqueue(redis_url, data, "nocreds", url, "--no-output-check", env=no_creds)
    assert s["created_run"] and s["enqueued"] == 10
    assert err.startswith("warning: cannot read s3://genqueue-test/runs/rf/nocreds/run.json") and err.count("\n") == 1
    # A run.json that is not one is said and written again.
    (tmp_path / "o2" / "bad").mkdir(parents=True)
    (tmp_path / "o2" / "bad" / "run.json").write_text("{not json")
    s, err = enqueue(redis_url, data, "bad", str(tmp_path / "o2"))
    assert s["created_run"] and "is not a genqueue run file" in err
    assert orjson.loads((tmp_path / "o2" / "bad" / "run.json").read_bytes())["fingerprint"] == s["fingerprint"]
    # A local output that does not exist yet is made by the run's first enqueue, for its run.json.
    missing = tmp_path / "not-yet"
    enqueue(redis_url, data, "local", str(missing))
    assert (missing / "local" / "run.json").exists()


def test_status_says_a_paused_run_first_in_red(tmp_path: Path, redis_url: str, conn: redis.Redis) -> None:
    data = write_jsonl(tmp_path / "p.jsonl", [sharegpt(i) for i in range(10)])
    enqueue(redis_url, data, "pz", str(tmp_path / "o"))
    assert Pause(conn, "pz").pause("breaker: 8 of the first 8 items failed: HTTP 400", "w1")
    st = run_status(conn, "pz")
    assert st["paused"]["reason"].startswith("breaker") and st["paused"]["by"] == "w1"
    painted = format_status(st, color=True).splitlines()
    assert painted[0].startswith("\x1b[31mPAUSED")
    # the reason wraps under it, all red, and the command that resumes the run is whole on one line
    block = [painted[0], *takewhile(lambda x: x.startswith("\x1b[31m         "), painted[1:])]
    assert any("`producer resume --run pz`" in x for x in block), block
    plain = cli("producer", "status", "--run", "pz", env={"REDIS_URL": redis_url}).stdout
    assert plain.splitlines()[0].startswith("PAUSED   breaker: 8 of the first 8") and "\x1b[" not in plain
    as_json = orjson.loads(cli("producer", "status", "--run", "pz", "--json", env={"REDIS_URL": redis_url}).stdout)
    assert as_json["paused"]["by"] == "w1"
    conn.delete(run_key("pz", "paused"))
    assert run_status(conn, "pz")["paused"] is None
    assert not format_status(run_status(conn, "pz"), color=True).startswith("\x1b")


def test_a_run_recreated_from_run_json_keeps_its_priority(tmp_path: Path, redis_url: str, conn: redis.Redis) -> None:
    out = tmp_path / "out"
    out.mkdir()
    data = write_jsonl(tmp_path / "prio.jsonl", [sharegpt(i) for i in range(10)])
    env = {"REDIS_URL": redis_url}

    def kept() -> object:
        return orjson.loads((out / "pr" / "run.json").read_bytes())["priority"]

    s, _ = enqueue(redis_url, data, "pr", str(out), "--priority", "4")
    assert s["priority"] == 4 and kept() == 4
    # changed later: run.json follows
    cli("producer", "priority", "--run", "pr", "7", env=env)
    assert kept() == 7
    conn.flushall()  # Redis lost the run: the enqueue that re-creates it gives it its priority back
    s, err = enqueue(redis_url, data, "pr", str(out))
    assert s["recreated_run"] and s["priority"] == 7 and "priority 7, as its run.json kept it" in err, err
    assert RunStore(conn).priorities(["pr"]) == {"pr": 7}
    # the command's own --priority wins over run.json's, and is kept in turn
    conn.flushall()
    s, _ = enqueue(redis_url, data, "pr", str(out), "--priority", "-1")
    assert s["recreated_run"] and s["priority"] == -1 and kept() == -1
    # a run.json from before priorities reads 0
    rf = orjson.loads((out / "pr" / "run.json").read_bytes())
    del rf["priority"]
    (out / "pr" / "run.json").write_bytes(orjson.dumps(rf))
    conn.flushall()
    s, _ = enqueue(redis_url, data, "pr", str(out))
    assert s["recreated_run"] and s["priority"] == 0 and kept() == 0
    # an output with no run.json (removed by hand): the change is said, not lost silently
    p = cli("producer", "enqueue", str(data), "--run", "fresh", "--output", str(tmp_path / "none-yet"), "--rejects",
            os.devnull, env=env)
    assert p.returncode == 0
    (tmp_path / "none-yet" / "fresh" / "run.json").unlink()
    p = cli("producer", "priority", "--run", "fresh", "2", env=env)
    assert "run.json is not updated" in p.stderr and RunStore(conn).priorities(["fresh"]) == {"fresh": 2}


def test_an_output_another_commands_probe_made_and_removed_is_taken_as_empty(
        tmp_path: Path, conn: redis.Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    """Enqueues of many runs into one output directory that does not exist yet run at once: each
    one's probe makes the directory and removes it again. An enqueue that saw it there a moment
    ago then lists it after it went (the 30-run start-up test, once in a CI run: "the run's
    output directory ... does not exist", exit 2). That is an empty output, not an error; and
    run.json, written into a directory a probe removes under it, is written all the same."""
    from genqueue.common.storage import local
    from genqueue.producer.enqueue.runsetup import prepare

    out = tmp_path / "not-yet"
    setup = prepare(conn, "raced", RunSettings(output=str(out)), update=False)
    out.mkdir()  # the other command's probe made it ...
    listed: list[str] = []

    def list_after_the_probe_is_gone(run: str) -> list[Any]:
        out.rmdir()  # ... and removed it again, just after this command looked
        listed.append(run)
        return LocalStore.list_shards(setup.output, run)  # type: ignore[arg-type]

    monkeypatch.setattr(setup.output, "list_shards", list_after_the_probe_is_gone)
    lines: list[str] = []
    setup.apply(lines.append)
    assert listed == ["raced"] and RunStore(conn).get("raced") is not None, lines
    assert not any("warning" in line for line in lines), lines

    # run.json's write: the directory goes between its making and the write, once
    real_write = Path.write_bytes
    gone: list[Path] = []

    def write_after_a_probe_removed_it(self: Path, data: bytes) -> int:  # type: ignore[override]
        if not gone:
            gone.append(self.parent)
            self.parent.rmdir()
        return real_write(self, data)

    monkeypatch.setattr(Path, "write_bytes", write_after_a_probe_removed_it)
    where_ = local._put_whole(tmp_path / "fresh" / "raced" / "run.json", b"{}")
    monkeypatch.undo()
    assert gone == [tmp_path / "fresh" / "raced"] and Path(where_).read_bytes() == b"{}"
