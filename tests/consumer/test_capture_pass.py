"""A capture pass (`producer capture`) end to end: real redis-server, the stand-in over HTTP
(generating, then prefilling token-id prompts and capturing them as vLLM's connector does), real
consumer processes, local outputs, both prompt modes.

Two source runs are generated once for the module (drafter-less in mode each; with a drafter and
its acceptance figures in mode regenerate), their tokens exports written while Redis holds them;
each test then reads them from their outputs (`--from-run <output>/<run>`). After a pass every
chosen row is stored once under the source's row id with exactly the ids the tokens export holds
and the stand-in's features, `producer export-features --run PASS --tokens <source tokens>` joins
every row, and a consumer SIGKILLed mid-pass costs at most what it had in flight."""

from __future__ import annotations

import collections
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import pytest
import redis

from genqueue.common.capture import CaptureDtype
from genqueue.common.features import FP8_ERROR, FeatureReader, feature_store_for, read_row, standin_features
from genqueue.common.prefill import bytes_per_token
from tests.conftest import BY_REFERENCE, INLINE, Prompts, both_modes_reference_slow, cli, sharegpt, write_jsonl
from tests.consumer.e2e import Proc, Sim, read_results, run_keys
from tests.consumer.test_capture_faults import busy, made_twice, sent_not_shipped, spooled

pytestmark = pytest.mark.integration

LAYERS = (2, 4)
HIDDEN = 32


@dataclass(frozen=True)
class Source:
    """A generated source run: its output folder, its name, its tokens export, and its rows
    (feature row id -> input_ids) as the tokens export holds them."""

    out: Path
    run: str
    tokens: Path
    rows: dict[str, list[int]]

    @property
    def where(self) -> str:
        return str(self.out / self.run)


@dataclass(frozen=True)
class Module:
    tmp: Path
    sim: Sim
    plain: Source  # mode each, drafter-less
    drafted: Source  # mode regenerate, with a drafter's acceptance figures


def _rows(tokens: Path, *, regenerate: bool) -> dict[str, list[int]]:
    rows = {}
    for line in tokens.read_bytes().splitlines():
        r = orjson.loads(line)
        rid = f"{r['key']}:{r['turn']}" + (f".{r['step']}" if r.get("step") else "") if regenerate else r["key"]
        rows[rid] = r["input_ids"]
    return rows


@pytest.fixture(scope="module")
def module(tmp_path_factory: pytest.TempPathFactory, redis_server: Any) -> Any:
    tmp = tmp_path_factory.mktemp("cappass")
    url = redis_server.url
    redis.Redis.from_url(url).flushall()
    env = {"REDIS_URL": url}
    # answers accept drafts at 0.9, but those to a first user turn at 0.2: the drafter's weak rows
    sim = Sim(tmp, "--capture-dir", str(tmp / "caps"), "--capture-layers", "2,4", "--hidden-size", str(HIDDEN),
              "--slots", "32", "--mean-tokens", "20", "--spec-tokens", "3",
              "--spec-acceptance", "0.9", "--spec-acceptance-for", "text=turn 1:0.2",
              "--per-request-spec-decode-metrics", "summary")
    out = tmp / "src"
    sources = {}
    try:
        for run, n, extra in (("plain", 30, ("--multi-turn", "each")),
                              ("drafted", 60, ("--multi-turn", "regenerate", "--drafter", "d1"))):
            data = write_jsonl(tmp / f"{run}.jsonl", [sharegpt(i, turns=1 + i % 3) for i in range(n)])
            cli("producer", "enqueue", str(data), "--run", run, "--output", str(out), "--token-ids", "--max-tokens",
                "48", "--batch-size", "8", *extra, env=env)
        c = Proc("consumer", ["run", "--endpoint", sim.url, "--burst", "--shard-max-age", "0.5", "--spool",
                              str(tmp / "spool-gen")], tmp / "gen.log", env=env)
        assert c.wait(120) == 0, c.output()
        for run in ("plain", "drafted"):
            tokens = tmp / f"{run}-tokens.jsonl"
            cli("producer", "export", "--run", run, "-o", str(tokens), "--format", "tokens", env=env)
            sources[run] = Source(out, run, tokens, _rows(tokens, regenerate=run == "drafted"))
        yield Module(tmp, sim, sources["plain"], sources["drafted"])
    finally:
        sim.stop()


def capture(redis_url: str, src: Source, run: str, out: Path, *args: str, check: bool = True) -> Any:
    return cli("producer", "capture", "--from-run", src.where, "--run", run, "--capture-layers", "2,4",
               "--output", str(out), *args, env={"REDIS_URL": redis_url}, check=check)


def consumer(m: Module, redis_url: str, run: str, name: str, *extra: str, sim: Sim | None = None) -> Proc:
    return Proc("consumer", ["-v", "run", "--run", run, "--endpoint", (sim or m.sim).url, "--shard-max-age", "0.5",
                             "--spool", str(m.tmp / f"spool-{name}"), "--pack-cache", str(m.tmp / "packs"), *extra],
                m.tmp / f"{name}.log", env={"REDIS_URL": redis_url})


def stored_rows(out: Path, run: str, seed: int = 0) -> dict[str, list[Any]]:
    """Every stored feature row of RUN by its id (each copy), read back and checked: its ids
    decode, its features are the stand-in's for its ids within fp8's bound."""
    store = feature_store_for(str(out))
    reader = FeatureReader(store, run)
    by_row: dict[str, list[Any]] = collections.defaultdict(list)
    for shard in store.list_shards(run):
        for e in store.get_index(run, shard).entries:
            row = read_row(store.read_range(run, shard), e, capture=reader.manifest.digest)
            ids = row.token_ids.tolist()
            assert row.encoded.scales is not None
            assert FP8_ERROR.allows(standin_features(ids, LAYERS, HIDDEN, seed), row.features(), row.encoded.scales)
            by_row[e.row].append(ids)
    return by_row


def check_pass(recs: list[dict[str, Any]], src: Source, out: Path, run: str, chosen: set[str]) -> dict[str, list[Any]]:
    """Every record of the pass is a result naming its row of SRC's; the rows stored are CHOSEN,
    each holding exactly the ids SRC's tokens export holds for it."""
    assert recs and not [r for r in recs if "error" in r], [r["error"] for r in recs if "error" in r][:3]
    named = {r["features"]["row"] for r in recs}
    assert named == chosen, (len(named), len(chosen))
    for r in recs:
        assert r["prefill"] == src.run and r["content"] == "" and r["outcome"] == "finished" and r["messages"] == []
        assert r["features"]["tokens"] == len(src.rows[r["features"]["row"]])
    rows = stored_rows(out, run)
    assert set(rows) == chosen
    for rid, copies in rows.items():
        assert all(ids == src.rows[rid] for ids in copies), f"row {rid} holds other ids than the tokens export's"
    return rows


@pytest.mark.parametrize(("prompts", "which"), [(INLINE, "plain"),
                                               pytest.param(BY_REFERENCE, "drafted", marks=pytest.mark.slow)], ids=str)
def test_a_pass_captures_every_row_and_export_features_joins_them(module, redis_url, conn, tmp_path,
                                                                   prompts: Prompts, which: str) -> None:
    src: Source = getattr(module, which)
    run, out = f"pass-{which}", tmp_path / "out"
    p = capture(redis_url, src, run, out, *prompts.args, "--json")
    report = orjson.loads(p.stdout)
    assert report["enqueue"]["prompts"] == prompts.mode.value
    assert report["capture"]["rows"] == report["capture"]["source_rows"] == len(src.rows)
    c = consumer(module, redis_url, run, f"c-{which}", "--burst")
    assert c.wait(90) == 0, c.output()
    recs = read_results(out, run)
    assert {r["key"] for r in recs} == run_keys(conn, run)
    rows = check_pass(recs, src, out, run, set(src.rows))
    assert all(len(copies) == 1 for copies in rows.values())
    assert list((module.tmp / "caps").iterdir()) == [], "every capture file is removed once kept"
    # a pass's records hold no text: no dataset is made of them
    e = cli("producer", "export", "--run", run, "-o", str(tmp_path / "x.jsonl"), env={"REDIS_URL": redis_url},
            check=False)
    assert e.returncode == 2 and f"is a capture pass over run {src.run}" in e.stderr, e.stderr
    assert len(e.stderr.strip().splitlines()) == 1 and not (tmp_path / "x.jsonl").exists(), e.stderr
    # the join by id, with the source's own tokens export
    fx = tmp_path / "fx"
    j = cli("producer", "export-features", "--run", run, "--tokens", str(src.tokens), "-o", str(fx), "--layout",
            "generic", "--json", env={"REDIS_URL": redis_url})
    joined = orjson.loads(j.stdout)
    assert joined["rows_read"] == joined["rows_exported"] == len(src.rows), joined
    assert joined["tokens_exported"] == sum(len(ids) for ids in src.rows.values()), joined
    # status reads the pass as a run like any other; the same command again is the reconcile, and
    # brings it back after a Redis loss
    st = orjson.loads(cli("producer", "status", "--run", run, "--json", env={"REDIS_URL": redis_url}).stdout)
    assert st["capture"]["rows"] == len(src.rows), st["capture"]
    again = orjson.loads(capture(redis_url, src, run, out, *prompts.args, "--json").stdout)
    assert again["enqueue"]["items"] == 0 and again["enqueue"]["already_done"] == len(src.rows), again["enqueue"]
    # Redis lost everything (the pass's run, its marks, its counters): the same command brings it back
    conn.flushall()
    p = capture(redis_url, src, run, out, *prompts.args, "--json")
    back = orjson.loads(p.stdout)["enqueue"]
    assert "re-created from" in p.stderr and back["recreated_run"], p.stderr
    assert back["fingerprint"] == report["enqueue"]["fingerprint"]
    assert back["items"] == 0 and back["already_done"] == len(src.rows), back
    st = orjson.loads(cli("producer", "status", "--run", run, "--json", env={"REDIS_URL": redis_url}).stdout)
    assert st["capture"]["rows"] == len(src.rows), st["capture"]


@pytest.mark.slow  # 18-27 s each, both modes: the pass is a run of items as any, whose kill the default suite proves
@both_modes_reference_slow
def test_a_consumer_killed_mid_pass_costs_at_most_its_work_in_flight(module, redis_url, conn, tmp_path,
                                                                     prompts_mode: Prompts) -> None:
    src: Source = module.drafted
    run, out = f"pass-kill-{prompts_mode}", tmp_path / "out"
    capture(redis_url, src, run, out, "--batch-size", "4", *prompts_mode.args)
    # an engine whose prefill takes long enough (5 ms a token) to be killed in
    slow = Sim(tmp_path, "--capture-dir", str(module.tmp / "caps"), "--capture-layers", "2,4", "--hidden-size",
               str(HIDDEN), "--prefill-time", "0.005")
    try:
        a = consumer(module, redis_url, run, f"ka-{prompts_mode}", "-c", "4", "--lease", "3", "--burst", sim=slow)
        snap = busy(conn, a, shards=1, in_flight=3)
        a.signal(signal.SIGKILL)
        a.wait(10)
        in_flight = sent_not_shipped(snap, run)
        written = spooled(module.tmp / f"spool-ka-{prompts_mode}")
        b = consumer(module, redis_url, run, f"ka-{prompts_mode}", "--lease", "3", "--burst")  # a fresh one on the dead one's spool
        assert b.wait(90) == 0, b.output()
    finally:
        slow.stop()
    recs = read_results(out, run)
    twice = made_twice(recs, run_keys(conn, run))
    rows = check_pass(recs, src, out, run, set(src.rows))
    print(f"\nkilled mid-pass: sent and not shipped {in_flight}, records made twice {sum(twice.values())}, rows "
          f"stored twice {sum(len(c) - 1 for c in rows.values())}")
    assert sum(twice.values()) <= in_flight, (twice, in_flight)
    assert set(twice) <= written | {r["key"] for r in recs if r["consumer"]["worker"] == snap["worker"]}
    assert sum(len(c) - 1 for c in rows.values()) <= in_flight
    assert list((module.tmp / "caps").iterdir()) == [], "the dead consumer's capture files are removed by the next"
    st = orjson.loads(cli("producer", "status", "--run", run, "--json", env={"REDIS_URL": redis_url}).stdout)
    assert st["capture"]["rows"] == len(src.rows), st["capture"]  # each row once, however often it was stored


def test_a_capture_of_other_ids_is_a_bad_capture_record_never_a_row(module, redis_url, conn, tmp_path) -> None:
    src: Source = module.plain
    run, out = "pass-bad", tmp_path / "out"
    capture(redis_url, src, run, out)
    seed = _aligned_seed(tmp_path)
    bad = Sim(tmp_path, "--capture-dir", str(tmp_path / "caps"), "--capture-layers", "2,4", "--hidden-size",
              str(HIDDEN), "--capture-wrong-ids", "0.3", "--seed", str(seed))
    try:
        c = Proc("consumer", ["-v", "run", "--run", run, "--endpoint", bad.url, "--burst", "--shard-max-age", "0.5",
                              "--spool", str(tmp_path / "spool")], tmp_path / "c.log", env={"REDIS_URL": redis_url})
        c.wait(60)
    finally:
        bad.stop()
    recs = read_results(out, run)
    errors = [r for r in recs if "error" in r]
    assert errors and {r["error"]["class"] for r in errors} == {"bad_capture"}, [r["error"] for r in errors][:3]
    assert "the captured hidden states are not the answer's: token" in errors[0]["error"]["message"]
    good = {r["features"]["row"] for r in recs if "error" not in r}
    assert set(stored_rows(out, run, seed)) == good, "a misaligned capture is never stored"
    assert list((tmp_path / "caps").iterdir()) == []


def _aligned_seed(tmp_path: Path) -> int:
    from tests.consumer.test_capture_e2e import _seed_whose_probe_is_aligned

    return _seed_whose_probe_is_aligned(tmp_path, 0.3)


def test_acceptance_order_and_a_budget_choose_the_drafters_worst_rows(module, redis_url, tmp_path) -> None:
    src: Source = module.drafted
    per_token = bytes_per_token(len(LAYERS), HIDDEN, CaptureDtype.FP8)
    budget = sum(len(ids) for ids in src.rows.values()) * per_token // 4
    p = capture(redis_url, src, "pass-acc", tmp_path / "out", "--capture-by", "acceptance", "--capture-budget",
                str(budget), "--hidden-size", str(HIDDEN), "--json")
    report = orjson.loads(p.stdout)["capture"]
    assert report["by"] == "acceptance" and report["budget"] == budget and report["hidden_size"] == HIDDEN
    assert 0 < report["rows"] < report["source_rows"] and report["bytes"] <= budget
    assert report["bytes"] == report["tokens"] * per_token
    # the order: by each answer's own acceptance rate (from the source's records), the weakest first,
    # each taken while it fits; the weak ones are the answers to a later user turn (their requests
    # hold "turn 1", accepted at 0.2)
    rates = {}
    for r in read_results(src.out, src.run):
        for t in r["turns"]:
            if t.get("spec", {}).get("drafted"):
                rates[f"{r['key']}:{t['turn']}" + (f".{t['step']}" if t.get("step") else "")] = \
                    t["spec"]["accepted"] / t["spec"]["drafted"]
    expected, left = set(), budget
    for row in sorted(src.rows, key=lambda x: (x not in rates, rates.get(x, 0.0), x)):
        if len(src.rows[row]) * per_token <= left:
            expected.add(row)
            left -= len(src.rows[row]) * per_token
    chosen = _queued_rows(redis_url, "pass-acc", tmp_path / "out")
    assert chosen == expected and len(chosen) == report["rows"]
    weak = [row for row in chosen if row.split(":")[1].split(".")[0] != "0"]
    assert len(weak) >= 0.9 * len(chosen), sorted(set(chosen) - set(weak))
    # all of the run: no budget, every row
    q = orjson.loads(capture(redis_url, src, "pass-all", tmp_path / "out2", "--json").stdout)["capture"]
    assert q["rows"] == q["source_rows"] == len(src.rows) and q["bytes"] is None


def _queued_rows(redis_url: str, run: str, out: Path) -> set[str]:
    """The rows of RUN's queued jobs (inline)."""
    from genqueue.common.keepers.rqaccess import queue_for
    from tests.conftest import items_of_job

    conn = redis.Redis.from_url(redis_url)
    q = queue_for(run, conn)
    rows = set()
    for job in q.get_jobs():
        rows |= {it["prefill"]["row"] for it in items_of_job(conn, run, out, job)}
    return rows


@pytest.mark.parametrize(("args", "said"), [
    (("--from-run", "nosuch"), "nosuch"),
    (("--from-run", "plain", "--capture-budget", "1G"), "--capture-budget needs the model's hidden size"),
    (("--from-run", "plain", "--capture-budget", "lots", "--hidden-size", "32"), "--capture-budget takes a size"),
    (("--from-run", "plain", "--capture-layers", "2,x"), "'x' in '2,x' is not a layer id"),
])
def test_bad_input_is_refused_in_one_line(module, redis_url, tmp_path, args: tuple[str, ...], said: str) -> None:
    full = list(args)
    if "--from-run" in full and full[full.index("--from-run") + 1] == "plain":
        full[full.index("--from-run") + 1] = module.plain.where
    if "--capture-layers" not in full:
        full += ["--capture-layers", "2,4"]
    p = cli("producer", "capture", "--run", "p", "--output", str(tmp_path / "out"), *full,
            env={"REDIS_URL": redis_url}, check=False)
    assert p.returncode == 2 and said in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr


def test_a_source_without_token_ids_is_refused_in_one_line(redis_url, tmp_path) -> None:
    data = write_jsonl(tmp_path / "x.jsonl", [sharegpt(0)])
    cli("producer", "enqueue", str(data), "--run", "noids", "--output", str(tmp_path / "out"),
        env={"REDIS_URL": redis_url})
    p = cli("producer", "capture", "--from-run", "noids", "--run", "p", "--capture-layers", "2,4",
            env={"REDIS_URL": redis_url}, check=False)
    assert p.returncode == 2 and "kept no token ids" in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr

