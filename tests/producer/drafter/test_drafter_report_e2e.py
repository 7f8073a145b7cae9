"""A drafter compared against another, side by side (issue 33), end to end: a real Redis, real
`consumer run --burst`s, the stand-in speculating as its own process over HTTP. The same
held-out slice (two source files) is served twice: by engines with the previous drafter
(every draft token accepted with P = 0.6) and with the candidate (0.8, one source planted weak at
0.4). `producer drafter-report` names the candidate's drafter and its weak source, with each
figure within a few percent of the planted rate, beside the previous drafter's; then Redis is
flushed and the report, read from the output directories alone, is the same byte for byte.
A run served without speculation is "none"; bad input is one line and a non-zero exit."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from genqueue.consumer.sim.kv import spec_yield
from tests.conftest import cli, sharegpt, write_jsonl
from tests.consumer.e2e import Proc, Sim, read_results

pytestmark = pytest.mark.integration

K, OLD, NEW, NEW_WEAK = 3, 0.6, 0.8, 0.4
PER_SOURCE = 100
#: No Redis listens here: a report that needed one would fail.
NO_REDIS = "redis://127.0.0.1:1/0"


def rate(p: float) -> float:
    """The draft acceptance rate of K drafts a step, each accepted with P given the ones before."""
    return spec_yield(K, p) / K


def _inputs(tmp: Path) -> tuple[Path, Path]:
    good = write_jsonl(tmp / "good.jsonl", [sharegpt(i) for i in range(PER_SOURCE)])
    weak = write_jsonl(tmp / "weak.jsonl", [{"id": f"w{i}", "conversations": [
        {"from": "human", "value": f"[weak] question {i}"}, {"from": "gpt", "value": "old"}]}
        for i in range(PER_SOURCE)])
    return good, weak


def _enqueue(tmp: Path, redis_url: str, run: str, path: Path, *extra: str) -> None:
    cli("producer", "enqueue", str(path), "--run", run, "--output", str(tmp / "out"), "--batch-size", "10",
        "--max-tokens", "400", "--rejects", str(tmp / f"{run}.rejects.jsonl"), *extra, env={"REDIS_URL": redis_url})


def _serve(tmp: Path, redis_url: str, run: str, *sim_args: str) -> None:
    sim = Sim(tmp, "--mean-tokens", "120", *sim_args)
    try:
        c = Proc("consumer", ["run", "--run", run, "--endpoint", sim.url, "--burst", "-c", "16",
                              "--spool", str(tmp / f"spool-{run}"), "--shard-max-age", "1"], tmp / f"{run}.log",
                 env={"REDIS_URL": redis_url})
        assert c.wait(180) == 0, c.output()
    finally:
        sim.stop()


def _report(redis_url: str, *args: str) -> str:
    return cli("producer", "drafter-report", *args, env={"REDIS_URL": redis_url}).stdout


@pytest.mark.slow  # 15 s: in the slow tier, which CI runs too
def test_the_candidate_beside_the_previous_drafter_from_the_records_alone(
        tmp_path: Path, redis_url: str, conn) -> None:
    good, weak = _inputs(tmp_path)
    for run, drafter in (("eval-a", "eagle-r1"), ("eval-b", "eagle-r2")):
        _enqueue(tmp_path, redis_url, run, good, "--drafter", drafter)
        _enqueue(tmp_path, redis_url, run, weak)  # the run keeps its drafter: an option left out keeps it
    spec = ("--spec-tokens", str(K), "--per-request-spec-decode-metrics", "summary")
    _serve(tmp_path, redis_url, "eval-a", *spec, "--spec-acceptance", str(OLD))
    _serve(tmp_path, redis_url, "eval-b", *spec, "--spec-acceptance", str(NEW),
           "--spec-acceptance-for", f"text=[weak]:{NEW_WEAK}")
    _enqueue(tmp_path, redis_url, "plain", good)  # the same items, served without speculation
    _serve(tmp_path, redis_url, "plain")

    recs = read_results(tmp_path / "out", "eval-b")
    assert len(recs) == 2 * PER_SOURCE and {r.get("drafter") for r in recs} == {"eagle-r2"}
    assert not any("drafter" in r for r in read_results(tmp_path / "out", "plain"))
    status = cli("producer", "status", "--run", "eval-b", env={"REDIS_URL": redis_url}).stdout
    (row,) = [line for line in status.splitlines() if line.startswith("drafter ")]
    assert row.split(None, 1)[1] == "eagle-r2  (an evaluation of this drafter: producer drafter-report eval-b)", status
    relabel = cli("producer", "enqueue", str(good), "--run", "eval-b", "--output", str(tmp_path / "out"),
                  "--drafter", "other", env={"REDIS_URL": redis_url}, check=False)
    assert relabel.returncode == 2 and "drafter" in relabel.stderr, relabel  # one run, one drafter
    plain_status = cli("producer", "status", "--run", "plain", env={"REDIS_URL": redis_url}).stdout
    assert not [line for line in plain_status.splitlines() if line.startswith("drafter")], plain_status

    r = orjson.loads(_report(redis_url, "eval-b", "--against", "eval-a", "--json"))
    c, b = r["candidate"], r["baseline"]
    assert (c["run"], c["drafter"], b["run"], b["drafter"]) == ("eval-b", "eagle-r2", "eval-a", "eagle-r1")
    assert (r["items_compared"], r["only_candidate"], r["only_baseline"]) == (2 * PER_SOURCE, 0, 0)
    src = {row["category"]: row for row in r["by"]["source"]}
    assert set(src) == {str(good), str(weak)}
    planted = {str(good): (NEW, OLD), str(weak): (NEW_WEAK, OLD)}
    for name, (p_new, p_old) in planted.items():
        row = src[name]
        assert row["candidate"]["answers"] == row["baseline"]["answers"] == PER_SOURCE
        assert row["candidate"]["rate"] == pytest.approx(rate(p_new), rel=0.05), name
        assert row["baseline"]["rate"] == pytest.approx(rate(p_old), rel=0.05), name
        assert row["rate_diff"] == pytest.approx(row["candidate"]["rate"] - row["baseline"]["rate"], abs=1e-4)
        # mean acceptance length: 1 + accepted drafts a step (the step's own bonus token)
        assert row["candidate"]["mean_length"] == pytest.approx(1 + spec_yield(K, p_new), rel=0.05), name
    assert src[str(good)]["rate_diff"] > 0 > src[str(weak)]["rate_diff"]
    w = r["weakest"]
    assert (w["facet"], w["category"]) == ("source", str(weak)) and w["rate"] == pytest.approx(rate(NEW_WEAK), rel=0.05)
    text = _report(redis_url, "eval-b", "--against", "eval-a")
    assert f"drafter weakest on source {weak}: {round(100 * w['rate'])}%" in text
    print(text)  # the table, for the report of the change (pytest -s)

    alone = orjson.loads(_report(redis_url, "eval-b", "--against", "plain", "--json"))
    assert (alone["items_compared"], alone["only_candidate"], alone["only_baseline"]) == (PER_SOURCE, PER_SOURCE, 0)
    assert alone["baseline"]["speculates"] is False and alone["overall"]["baseline"] is None
    none_text = _report(redis_url, "eval-b", "--against", "plain")
    (row,) = [line.split() for line in none_text.splitlines() if line.startswith("source")]
    assert row[-5:] == ["none", "none", "none", "-", "-"], none_text

    # Redis forgets everything: the output alone gives the same report, byte for byte
    conn.flushall()
    out = tmp_path / "out"
    assert _report(NO_REDIS, str(out / "eval-b"), "--against", str(out / "eval-a"), "--json") == \
        orjson.dumps(r).decode() + "\n"
    assert _report(NO_REDIS, str(out / "eval-b"), "--against", str(out / "eval-a")) == text

    # bad input: one line, a non-zero exit, no traceback
    (tmp_path / "out" / "empty").mkdir()
    _enqueue(tmp_path, redis_url, "fresh", good)  # in Redis, nothing shipped yet
    for args, env, says in (
            ((str(out / "nope"),), NO_REDIS, "no such output"),
            ((str(out / "empty"),), NO_REDIS, "no records under"),
            ((str(out / "eval-b"), "--against", str(out / "nope")), NO_REDIS, "no such output"),
            (("nosuchrun",), redis_url, "no run named 'nosuchrun'"),
            (("fresh",), redis_url, "no records under"),
            (("eval-b",), NO_REDIS, "redis")):
        res = cli("producer", "drafter-report", *args, env={"REDIS_URL": env}, check=False)
        assert res.returncode != 0 and res.stdout == "", (args, res)
        lines = res.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error:") and says in lines[0].lower(), (args, res.stderr)
