"""A capture pass of log-probability tables (`producer capture --logprobs K`) end to end: real
redis-server, the stand-in over HTTP (generating, then scoring token-id prompts with
`prompt_logprobs` as vLLM does), real consumer processes, local outputs, both prompt modes.

Two source runs are generated once for the module with --token-ids and no --logprobs (mode each;
mode regenerate), their tokens exports written while Redis holds them; each test reads them from
their outputs (`--from-run <output>/<run>`). After a pass every row of the source is stored once
under its row id, its sampled ids the answer's completion ids and its tables the stand-in's at
those prompt positions; `producer export-logprobs --run PASS --tokens <source tokens>` joins every
row; a consumer SIGKILLed mid-pass costs at most what it had in flight; a K whose K + 1 is above
the engine's --max-logprobs is refused at the pre-flight in one line; tables an engine made of
other ids than those sent are an error record, never a row."""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest
import redis

from genqueue.common.features import feature_store_for
from genqueue.common.features.logprobs import LogprobsMode, LogprobsReader
from genqueue.consumer.sim.logprobs import standin_tables
from tests.conftest import BY_REFERENCE, INLINE, Prompts, both_modes_reference_slow, cli, sharegpt, write_jsonl
from tests.consumer.e2e import Proc, Sim, read_results, run_keys
from tests.consumer.test_capture_faults import busy, made_twice, sent_not_shipped, spooled

pytestmark = pytest.mark.integration

K = 6


@dataclass(frozen=True)
class Source:
    """A generated source run: its output folder, name, tokens export, and its rows (row id ->
    (input_ids, how many of the last are generated)) as the tokens export holds them."""

    out: Path
    run: str
    tokens: Path
    rows: dict[str, tuple[list[int], int]]

    @property
    def where(self) -> str:
        return str(self.out / self.run)


@dataclass(frozen=True)
class Module:
    tmp: Path
    sim: Sim
    plain: Source  # mode each
    regen: Source  # mode regenerate


def _rows(tokens: Path, *, regenerate: bool) -> dict[str, tuple[list[int], int]]:
    rows = {}
    for line in tokens.read_bytes().splitlines():
        r = orjson.loads(line)
        rid = f"{r['key']}:{r['turn']}" + (f".{r['step']}" if r.get("step") else "") if regenerate else r["key"]
        n = sum(r["loss_mask"])
        assert r["loss_mask"][len(r["loss_mask"]) - n:] == [1] * n  # the generated ids are the last
        rows[rid] = (r["input_ids"], n)
    return rows


@pytest.fixture(scope="module")
def module(tmp_path_factory: pytest.TempPathFactory, redis_server: Any) -> Any:
    tmp = tmp_path_factory.mktemp("lppass")
    url = redis_server.url
    redis.Redis.from_url(url).flushall()
    env = {"REDIS_URL": url}
    sim = Sim(tmp, "--slots", "32", "--mean-tokens", "20")
    out = tmp / "src"
    sources = {}
    try:
        for run, n, mode in (("plain", 30, "each"), ("regen", 30, "regenerate")):
            data = write_jsonl(tmp / f"{run}.jsonl", [sharegpt(i, turns=1 + i % 3) for i in range(n)])
            cli("producer", "enqueue", str(data), "--run", run, "--output", str(out), "--token-ids", "--max-tokens",
                "48", "--batch-size", "8", "--multi-turn", mode, env=env)
        c = Proc("consumer", ["run", "--endpoint", sim.url, "--burst", "--shard-max-age", "0.5", "--spool",
                              str(tmp / "spool-gen")], tmp / "gen.log", env=env)
        assert c.wait(120) == 0, c.output()
        for run in ("plain", "regen"):
            tokens = tmp / f"{run}-tokens.jsonl"
            cli("producer", "export", "--run", run, "-o", str(tokens), "--format", "tokens", env=env)
            sources[run] = Source(out, run, tokens, _rows(tokens, regenerate=run == "regen"))
        yield Module(tmp, sim, sources["plain"], sources["regen"])
    finally:
        sim.stop()


def capture(redis_url: str, src: Source, run: str, out: Path, *args: str, k: int = K, check: bool = True) -> Any:
    return cli("producer", "capture", "--from-run", src.where, "--run", run, "--logprobs", str(k),
               "--output", str(out), *args, env={"REDIS_URL": redis_url}, check=check)


def consumer(m: Module, redis_url: str, run: str, name: str, *extra: str, sim: Sim | None = None) -> Proc:
    return Proc("consumer", ["-v", "run", "--run", run, "--endpoint", (sim or m.sim).url, "--shard-max-age", "0.5",
                             "--spool", str(m.tmp / f"spool-{name}"), *extra],
                m.tmp / f"{name}.log", env={"REDIS_URL": redis_url})


def check_pass(recs: list[dict[str, Any]], src: Source, out: Path, run: str) -> LogprobsReader:
    """Every record of the pass is a result naming its row of SRC's; every row of SRC is stored,
    its sampled ids the answer's completion ids and its tables the stand-in's at their positions."""
    assert recs and not [r for r in recs if "error" in r], [r["error"] for r in recs if "error" in r][:3]
    assert {r["logprobs"]["row"] for r in recs} == set(src.rows)
    for r in recs:
        assert r["prefill"] == src.run and r["content"] == "" and r["outcome"] == "finished" and "features" not in r
        ids, n = src.rows[r["logprobs"]["row"]]
        assert (r["logprobs"]["tokens"], r["logprobs"]["k"]) == (n, K)
        assert r["usage"]["prompt_tokens"] == len(ids)
    reader = LogprobsReader(feature_store_for(str(out)), run)
    assert (reader.manifest.k, reader.manifest.mode) == (K, LogprobsMode.RAW_LOGPROBS)
    assert set(reader.entries) == set(src.rows)
    for row, t in reader.rows():
        ids, n = src.rows[row]
        completion = ids[len(ids) - n:]
        assert t.sampled_ids.tolist() == completion, f"row {row} holds another answer's tables"
        assert (np.diff(t.topk_logprobs, axis=1) <= 0).all()
        sampled, top_ids, top_lps = standin_tables(completion, K, start=len(ids) - n)
        assert t.topk_ids.tolist() == top_ids, row
        assert np.allclose(t.topk_logprobs, top_lps, rtol=2.0**-11, atol=0)
        assert np.allclose(t.sampled_logprobs, sampled, rtol=2.0**-11, atol=0)
    return reader


@pytest.mark.parametrize(("prompts", "which"), [(INLINE, "plain"),
                                               pytest.param(BY_REFERENCE, "regen", marks=pytest.mark.slow)], ids=str)
def test_a_logprobs_pass_stores_every_rows_tables_and_export_logprobs_joins_them(module, redis_url, conn, tmp_path,
                                                                                 prompts: Prompts, which: str) -> None:
    src: Source = getattr(module, which)
    run, out = f"lpass-{which}", tmp_path / "out"
    report = orjson.loads(capture(redis_url, src, run, out, *prompts.args, "--json").stdout)
    assert report["logprobs"] == K and report["enqueue"]["prompts"] == prompts.mode.value
    assert report["capture"]["rows"] == report["capture"]["source_rows"] == len(src.rows)
    c = consumer(module, redis_url, run, f"c-{which}", "--burst")
    assert c.wait(90) == 0, c.output()
    recs = read_results(out, run)
    assert {r["key"] for r in recs} == run_keys(conn, run)
    reader = check_pass(recs, src, out, run)
    assert reader.duplicates == 0
    # the join by id, with the source's own tokens export, unchanged
    j = cli("producer", "export-logprobs", "--run", run, "--tokens", str(src.tokens), "-o", str(tmp_path / "plain"),
            "--layout", "plain", "--json", env={"REDIS_URL": redis_url})
    joined = orjson.loads(j.stdout)
    assert joined["rows_read"] == joined["rows_exported"] == len(src.rows), joined
    assert joined["tables_exported"] == sum(n for _, n in src.rows.values()), joined
    assert not (joined["rows_without_tables"] or joined["rows_tokens_differ"] or joined["tables_without_rows"])
    st = orjson.loads(cli("producer", "status", "--run", run, "--json", env={"REDIS_URL": redis_url}).stdout)
    assert st["logprobs"]["rows"] == len(src.rows), st["logprobs"]
    # a pass's records hold no text: no dataset is made of them, and the refusal names the tables' export
    e = cli("producer", "export", "--run", run, "-o", str(tmp_path / "x.jsonl"), env={"REDIS_URL": redis_url},
            check=False)
    assert e.returncode == 2 and f"this run's tables with producer export-logprobs --run {run}" in e.stderr, e.stderr
    # the same command again is the reconcile: nothing queued twice
    again = orjson.loads(capture(redis_url, src, run, out, *prompts.args, "--json").stdout)
    assert again["enqueue"]["items"] == 0 and again["enqueue"]["already_done"] == len(src.rows), again["enqueue"]


@pytest.mark.slow  # 19 s and more, both modes: the hidden-state pass and the generation kill tests cover the path
@both_modes_reference_slow
def test_a_consumer_killed_mid_logprobs_pass_costs_at_most_its_work_in_flight(module, redis_url, conn, tmp_path,
                                                                              prompts_mode: Prompts) -> None:
    src: Source = module.regen
    run, out = f"lpass-kill-{prompts_mode}", tmp_path / "out"
    capture(redis_url, src, run, out, "--batch-size", "4", *prompts_mode.args)
    slow = Sim(tmp_path, "--prefill-time", "0.005")  # a prefill long enough (5 ms a token) to be killed in
    name = f"ka-{prompts_mode}"
    try:
        a = consumer(module, redis_url, run, name, "-c", "4", "--lease", "3", "--burst", sim=slow)
        snap = busy(conn, a, shards=1, in_flight=3)
        a.signal(signal.SIGKILL)
        a.wait(10)
        in_flight = sent_not_shipped(snap, run)
        written = spooled(module.tmp / f"spool-{name}")
        b = consumer(module, redis_url, run, name, "--lease", "3", "--burst")  # a fresh one on the dead one's spool
        assert b.wait(90) == 0, b.output()
    finally:
        slow.stop()
    recs = read_results(out, run)
    twice = made_twice(recs, run_keys(conn, run))
    reader = check_pass(recs, src, out, run)
    print(f"\nkilled mid-pass: sent and not shipped {in_flight}, records made twice {sum(twice.values())}, "
          f"rows stored twice {reader.duplicates}")
    assert sum(twice.values()) <= in_flight, (twice, in_flight)
    assert set(twice) <= written | {r["key"] for r in recs if r["consumer"]["worker"] == snap["worker"]}
    assert reader.duplicates <= in_flight
    st = orjson.loads(cli("producer", "status", "--run", run, "--json", env={"REDIS_URL": redis_url}).stdout)
    assert st["logprobs"]["rows"] == len(src.rows) + reader.duplicates, st["logprobs"]  # a redone row counted


def test_a_k_above_the_engines_max_logprobs_is_refused_at_the_pass_pre_flight(module, redis_url, conn,
                                                                              tmp_path) -> None:
    run = "lpass-big"
    capture(redis_url, module.plain, run, tmp_path / "out", k=20)  # asks 21; the stand-in's bound is vLLM's 20
    sim = Sim(tmp_path)
    c = consumer(module, redis_url, run, "big", sim=sim)
    try:
        deadline = time.monotonic() + 60
        while "pre-flight failed" not in c.output() and time.monotonic() < deadline:
            time.sleep(0.1)
        lines = [line for line in c.output().splitlines() if "pre-flight failed" in line]
        assert len(lines) == 1, c.output()
        assert "--logprobs 20 is more than the engine at" in lines[0], lines[0]
        assert "start vLLM with --max-logprobs 21 or more" in lines[0], lines[0]
    finally:
        c.kill()
        sim.stop()
    assert not read_results(tmp_path / "out", run), "no item was taken"
    assert conn.llen(f"rq:queue:genqueue.{run}") > 0


def test_tables_of_other_ids_than_those_sent_are_an_error_record_never_a_row(module, redis_url, conn,
                                                                              tmp_path) -> None:
    from tests.consumer.test_logprobs_e2e import _seed_whose_probe_is_whole

    src: Source = module.plain
    run, out = "lpass-bad", tmp_path / "out"
    capture(redis_url, src, run, out)
    # an engine that scores one prompt id other than the one sent in 30 % of its prefills (its
    # prompt_token_ids say so); its pre-flight probe whole
    bad = Sim(tmp_path, "--logprobs-garbled", "0.3", "--seed", str(_seed_whose_probe_is_whole(0.3)))
    try:
        # two at a time: a refused row's record is made sooner than a stored one's, so at a high
        # concurrency the first records can all be refusals, and the breaker pauses the run
        c = consumer(module, redis_url, run, "bad", "--burst", "-c", "2", sim=bad)
        c.wait(60)
    finally:
        bad.stop()
    recs = read_results(out, run)
    assert {r["key"] for r in recs} == run_keys(conn, run)
    errors = [r for r in recs if "error" in r]
    assert errors and {r["error"]["class"] for r in errors} == {"bad_logprobs"}, [r["error"] for r in errors][:3]
    assert "the engine scored other ids than those sent (prompt_token_ids differ at position" in \
        errors[0]["error"]["message"], errors[0]["error"]
    good = {r["logprobs"]["row"] for r in recs if "error" not in r}
    assert good and len(good) + len(errors) == len(src.rows)
    reader = LogprobsReader(feature_store_for(str(out)), run)
    assert set(reader.entries) == good, "tables of other ids are never stored"
    for row, t in reader.rows():
        ids, n = src.rows[row]
        assert t.sampled_ids.tolist() == ids[len(ids) - n:]


@pytest.mark.parametrize(("args", "said"), [
    (("--logprobs", "5", "--capture-layers", "2,4"), "give --capture-layers (hidden states) or --logprobs K"),
    ((), "give --capture-layers (hidden states) or --logprobs K"),
    (("--logprobs", "0"), "--logprobs takes the number of top entries"),
    (("--logprobs", "5", "--capture-budget", "1G"), "--capture-budget sizes hidden states"),
])
def test_a_pass_asks_for_one_kind_of_row(module, redis_url, tmp_path, args: tuple[str, ...], said: str) -> None:
    p = cli("producer", "capture", "--from-run", module.plain.where, "--run", "p", "--output", str(tmp_path / "out"),
            *args, env={"REDIS_URL": redis_url}, check=False)
    assert p.returncode == 2 and said in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr
