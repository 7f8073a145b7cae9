"""Acceptance in the run's truth (issue 33) end to end: a real Redis, the stand-in speculating as
its own process with one source planted at half the acceptance, a real `consumer run --burst`;
then `producer status` (--json and text) and the consumer's doctor notes name that source at
the planted rate, a shard shipped again by a later consumer counts nothing twice, and a run
without speculation shows no section."""

from __future__ import annotations

import shutil
from pathlib import Path

import orjson
import pytest

from genqueue.common.acceptance import table_of
from genqueue.common.keepers.runs import consumer_key
from genqueue.common.keepers.spectally import SpecTallies
from genqueue.common.storage.names import shard_name
from genqueue.consumer.sim.kv import spec_yield
from tests.conftest import cli, sharegpt, write_jsonl
from tests.consumer.e2e import Proc, Sim, read_results, run_keys

pytestmark = pytest.mark.integration

K, STRONG, WEAK = 3, 0.8, 0.4
PER_SOURCE = 100


def _inputs(tmp: Path) -> tuple[Path, Path]:
    good = write_jsonl(tmp / "good.jsonl", [sharegpt(i) for i in range(PER_SOURCE)])
    weak = write_jsonl(tmp / "weak.jsonl", [{"id": f"w{i}", "conversations": [
        {"from": "human", "value": f"[weak] question {i}"}, {"from": "gpt", "value": "old"}]}
        for i in range(PER_SOURCE)])
    return good, weak


def _enqueue(tmp: Path, redis_url: str, run: str, path: Path) -> None:
    cli("producer", "enqueue", str(path), "--run", run, "--output", str(tmp / "out"), "--batch-size", "10",
        "--max-tokens", "400", "--rejects", str(tmp / f"{run}.rejects.jsonl"), env={"REDIS_URL": redis_url})


def _consume(tmp: Path, redis_url: str, sim: Sim, run: str, spool: str) -> Proc:
    c = Proc("consumer", ["-v", "run", "--run", run, "--endpoint", sim.url, "--burst", "-c", "16",
                          "--spool", str(tmp / spool), "--shard-max-age", "1"], tmp / f"{spool}.log",
             env={"REDIS_URL": redis_url})
    assert c.wait(180) == 0, c.output()
    return c


def _status(redis_url: str, run: str, *extra: str) -> str:
    return cli("producer", "status", "--run", run, *extra, env={"REDIS_URL": redis_url}).stdout


def test_a_planted_weak_source_is_named_by_status_and_the_doctor_and_nothing_counts_twice(
        tmp_path: Path, redis_url: str, conn) -> None:
    good, weak = _inputs(tmp_path)
    _enqueue(tmp_path, redis_url, "spec", good)
    _enqueue(tmp_path, redis_url, "spec", weak)
    sim = Sim(tmp_path, "--mean-tokens", "120", "--spec-tokens", str(K), "--spec-acceptance", str(STRONG),
              "--spec-acceptance-for", f"text=[weak]:{WEAK}", "--per-request-spec-decode-metrics", "summary")
    try:
        _consume(tmp_path, redis_url, sim, "spec", "spool")
    finally:
        sim.stop()
    recs = read_results(tmp_path / "out", "spec")
    assert {r["key"] for r in recs} == run_keys(conn, "spec") and len(recs) == 2 * PER_SOURCE
    truth = table_of(recs)  # export's view of the same records

    status = orjson.loads(_status(redis_url, "spec", "--json"))
    spec = status["speculation"]
    assert spec["answers"] == 2 * PER_SOURCE == truth.overall.answers
    assert (spec["drafted"], spec["accepted"], spec["steps"]) == (
        truth.overall.drafted, truth.overall.accepted, truth.overall.steps)
    sources = {row["category"]: row for row in spec["by"]["source"]}
    assert set(sources) == {str(good), str(weak)}
    assert sources[str(weak)]["rate"] == pytest.approx(spec_yield(K, WEAK) / K, rel=0.05)
    assert sources[str(good)]["rate"] == pytest.approx(spec_yield(K, STRONG) / K, rel=0.05)
    assert sources[str(weak)]["answers"] == PER_SOURCE
    w = spec["weakest"]
    assert (w["facet"], w["category"]) == ("source", str(weak))
    assert w["rate"] == pytest.approx(spec_yield(K, WEAK) / K, rel=0.05)
    assert w["overall_rate"] == pytest.approx(spec["rate"])
    (engine,) = spec["engines"]
    assert engine["answers"] == 2 * PER_SOURCE and engine["rate"] == pytest.approx(spec["rate"])
    assert {row["category"] for row in spec["by"]["turn"]} == {"1"} and spec["by"]["variant"][0]["category"] == "-"

    text = _status(redis_url, "spec", "--wide")
    weak_rate, overall = round(100 * w["rate"]), round(100 * spec["rate"])
    assert f"drafter weakest on source {weak}: {weak_rate}% vs {overall}% overall" in text
    assert f"speculation  acceptance (run, all consumers) {overall}%, mean length" in text
    plain = _status(redis_url, "spec")  # 100 columns: the weakest line wrapped whole, never clipped
    assert all(len(line) <= 100 for line in plain.splitlines())
    assert f"drafter weakest on source {weak}: {weak_rate}% vs {overall}% overall" in " ".join(plain.split())
    for path in (good, weak):  # a row per source: its answers, rate and mean length
        (row,) = [line.split() for line in text.splitlines() if line.split()[-4:-3] == [str(path)]]
        r = sources[str(path)]
        assert row[-3:] == [f"{PER_SOURCE}", f"{round(100 * r['rate'])}%", f"{r['mean_length']:.2f}"], row

    (worker,) = [e["worker"] for e in spec["engines"]]
    snap = orjson.loads(conn.get(consumer_key(worker)))
    assert snap["spec"]["answers"] == 2 * PER_SOURCE and snap["runs"]["spec"]["spec"] == snap["spec"]
    notes = [n for n in snap["engine"].get("notes", []) if n.startswith("drafter weakest")]
    assert len(notes) == 1 and notes[0].startswith(f"drafter weakest on source {weak}: {weak_rate}%"), snap["engine"]

    # A later consumer finds a shard a dead one left in its spool (shipped already: it died
    # before removing it) and ships it again: the output holds its records twice, the tallies once.
    shipped = min((tmp_path / "out" / "spec" / "shards").glob("*.jsonl"))
    sealed = tmp_path / "spool2" / "spec" / "sealed"
    sealed.mkdir(parents=True)
    shutil.copy(shipped, sealed / shard_name("gone-worker", 7))
    before = SpecTallies(conn).table("spec")
    sim = Sim(tmp_path, "--spec-tokens", str(K), "--per-request-spec-decode-metrics", "summary")
    try:
        again = _consume(tmp_path, redis_url, sim, "spec", "spool2")
    finally:
        sim.stop()
    recs = read_results(tmp_path / "out", "spec")
    assert len(recs) > 2 * PER_SOURCE, again.output()  # the copy is in the output...
    after = SpecTallies(conn).table("spec")
    assert after.overall == before.overall and after.by == before.by  # ...and counted once
    assert orjson.loads(_status(redis_url, "spec", "--json"))["speculation"]["answers"] == 2 * PER_SOURCE


def test_a_run_without_speculation_shows_no_section(tmp_path: Path, redis_url: str, conn) -> None:
    data = write_jsonl(tmp_path / "plain.jsonl", [sharegpt(i) for i in range(20)])
    _enqueue(tmp_path, redis_url, "plain", data)
    sim = Sim(tmp_path, "--mean-tokens", "30")
    try:
        _consume(tmp_path, redis_url, sim, "plain", "spool")
    finally:
        sim.stop()
    status = orjson.loads(_status(redis_url, "plain", "--json"))
    assert status["items_done"] == 20 and status["speculation"] is None
    assert not conn.exists(SpecTallies.key("plain"))
    text = _status(redis_url, "plain")
    assert not [line for line in text.splitlines() if line.startswith("speculation") or "drafter" in line], text
