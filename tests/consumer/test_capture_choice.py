"""Which answers a capture run captures (--capture-share, --capture-sources, --capture-budget), end
to end: real redis-server, the stand-in capturing as vLLM's connector does, real consumer
processes and a local output. The items chosen are exactly those the pure choice names, on every
attempt and every redo; those not chosen ask for nothing; a budget stops capture within the rows
in flight with two consumers at once; status (text and --json) and the export's card show the same
figures; a bad choice is one line and exit 2."""

from __future__ import annotations

import collections
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import pytest
import redis

from genqueue.common.capture import CaptureDecision, capture_fraction, parse_capture, parse_size
from genqueue.common.errors import UserError
from genqueue.common.features import feature_store_for
from genqueue.common.keepers.captured import SPENT
from genqueue.common.keepers.keeper import run_key
from genqueue.common.settings import RunSettings
from tests.conftest import cli, sharegpt, write_jsonl
from tests.consumer.e2e import Proc, Sim, read_results, run_keys
from tests.consumer.test_capture_e2e import answers, check_features

pytestmark = pytest.mark.integration

HIDDEN = 32
CAPTURE = ("--capture", "hidden-states", "--capture-layers", "2,4", "--token-ids")
#: code: half its items; chat: all of them; other: none (not named)
SOURCES = "code=0.5,chat"


def _sim(tmp: Path, name: str, *args: str) -> Sim:
    return Sim(tmp, "--capture-dir", str(tmp / f"caps-{name}"), "--capture-layers", "2,4", "--hidden-size",
               str(HIDDEN), "--mean-tokens", "16", "--record-requests", str(tmp / f"sent-{name}.jsonl"), *args)


def _consumer(tmp: Path, url: str, sim: Sim, run: str, name: str, *extra: str) -> Proc:
    return Proc("consumer", ["-v", "run", "--run", run, "--endpoint", sim.url, "--burst", "--shard-max-age", "0.5",
                             "--spool", str(tmp / f"spool-{name}"), *extra], tmp / f"{name}.log",
                env={"REDIS_URL": url})


def _first_user(messages: list[dict[str, Any]]) -> str:
    return next(str(m["content"]) for m in messages if m["role"] == "user")


@dataclass
class Picked:
    """A finished run whose capture chose by source and share, and what every screen said of it."""

    tmp: Path
    results: list[dict[str, Any]]
    errors: list[dict[str, Any]]  # error records of the first consumer's attempts (redone after)
    sent: list[dict[str, Any]]  # every item request both stand-ins received
    status: dict[str, Any]
    text: str
    card: str
    rows: int  # feature rows checked against their answers
    url: str  # the module's Redis (tests after the module's ones flush it)


@pytest.fixture(scope="module")
def picked(tmp_path_factory: pytest.TempPathFactory, redis_server: Any) -> Picked:
    """Run `pick` over three inputs with --capture-sources code=0.5,chat: a first consumer on a
    stand-in failing a fifth of the requests, one attempt each (so items end as errors and are
    redone), then `--retry-failed` and a second consumer on a sound stand-in."""
    tmp = tmp_path_factory.mktemp("capchoice")
    url = redis_server.url
    redis.Redis.from_url(url).flushall()
    env = {"REDIS_URL": url}
    out = tmp / "out"
    inputs = {name: write_jsonl(tmp / f"{name}.jsonl", [sharegpt(base + i, turns=1 + i % 2) for i in range(n)])
              for name, base, n in (("code", 0, 40), ("chat", 100, 16), ("other", 200, 12))}

    def enqueue(*extra: str) -> None:
        for path in inputs.values():
            cli("producer", "enqueue", str(path), "--run", "pick", "--output", str(out), "--max-tokens", "32",
                "--batch-size", "4", "--rejects", str(tmp / "rej.jsonl"), *extra, env=env)

    enqueue(*CAPTURE, "--capture-sources", SOURCES)
    flaky = _sim(tmp, "flaky", "--error-rate", "0.2", "--error-after", "6")
    try:
        assert _consumer(tmp, url, flaky, "pick", "first", "--max-attempts", "1").wait(90) is not None
    finally:
        flaky.stop()
    errors = [r for r in read_results(out, "pick") if "error" in r]
    enqueue("--retry-failed")  # the run's settings kept: the options left out
    sound = _sim(tmp, "sound")
    try:
        second = _consumer(tmp, url, sound, "pick", "second")
        assert second.wait(90) == 0, second.output()
    finally:
        sound.stop()
    recs = read_results(out, "pick")
    conn = redis.Redis.from_url(url)
    latest = {r["key"]: r for r in recs if "error" not in r}
    assert set(latest) == run_keys(conn, "pick"), "every item ended in a result"
    sent = []
    for name in ("flaky", "sound"):
        path = tmp / f"sent-{name}.jsonl"
        sent += [b for b in map(orjson.loads, path.read_bytes().splitlines())
                 if any("question" in str(m.get("content")) for m in b["messages"])]
    rows = check_features([r for r in latest.values() if _has_features(r)], feature_store_for(str(out)), "pick")
    status = json.loads(cli("producer", "status", "--run", "pick", "--json", env=env).stdout)
    text = cli("producer", "status", "--run", "pick", "--wide", env=env).stdout
    (tmp / "export").mkdir()
    cli("producer", "export", "--run", "pick", "-o", str(tmp / "export" / "pick.jsonl"), "--allow-partial", env=env)
    card = (tmp / "export" / "README.md").read_text()
    return Picked(tmp, list(latest.values()), errors, sent, status, text, card, rows, url)


def _has_features(rec: dict[str, Any]) -> bool:
    return any("features" in a for a, _ in answers(rec))


def _chosen(rec: dict[str, Any]) -> bool:
    settings = parse_capture("hidden-states", "2,4", None, None, SOURCES)
    assert settings is not None
    return settings.decide(rec["key"], rec["source"]) is CaptureDecision.CAPTURE


def test_share_and_sources_capture_exactly_the_items_the_choice_names(picked: Picked) -> None:
    by_source: dict[str, collections.Counter[bool]] = collections.defaultdict(collections.Counter)
    for rec in picked.results:
        chosen = _chosen(rec)
        by_source[Path(rec["source"]).stem][chosen] += 1
        kept = [a for a, _ in answers(rec)]
        assert all(("features" in a) is chosen for a in kept), (rec["key"], rec["source"], chosen)
    assert by_source["other"] == {False: 12}, "a source not named: none of its items"
    assert by_source["chat"] == {True: 16}, "a source named without a share: every item"
    code = by_source["code"]
    assert code[True] and code[False] and code[True] + code[False] == 40, f"code at 0.5: some of each: {code}"
    assert picked.rows == sum(len(answers(r)) for r in picked.results if _chosen(r))


def test_an_item_not_chosen_asks_for_nothing_and_every_attempt_and_redo_chooses_alike(picked: Picked) -> None:
    """Each request carries kv_transfer_params exactly when its item is chosen: on the first
    consumer's attempts (some failed, their items ended as errors), and on the second consumer's
    redo of those items."""
    key_of = {_first_user(r["messages"]): r for r in picked.results}
    asked: dict[str, set[bool]] = collections.defaultdict(set)
    for body in picked.sent:
        rec = key_of[_first_user(body["messages"])]
        asked[rec["key"]].add("kv_transfer_params" in body)
    assert asked.keys() == {r["key"] for r in picked.results}, asked.keys() ^ {r["key"] for r in picked.results}
    for rec in picked.results:
        assert asked[rec["key"]] == {_chosen(rec)}, (rec["key"], rec["source"], asked[rec["key"]])
    redone = {e["key"] for e in picked.errors} & {r["key"] for r in picked.results}
    kinds = collections.Counter(_chosen(r) for r in picked.results if r["key"] in redone)
    assert kinds[True] and kinds[False], f"items of both kinds were redone: {kinds}"


def test_status_json_text_and_the_card_show_the_same_capture_figures(picked: Picked) -> None:
    c = picked.status["capture"]
    assert c["choice"] == ["sources", "share"] and c["sources"] == [["code", 0.5], ["chat", 1.0]]
    assert c["rows"] == picked.rows and c["rows_written"] >= c["rows"] and c["bytes"] > 0
    assert c["answers"] == sum(len([a for a, _ in answers(r) if "step" not in a]) for r in picked.results)
    assert c["budget"] is None and c["budget_spent"] is False and c["items_left"] == 0
    assert c["projected_bytes"] == c["bytes"], "a run over projects what it shipped"
    line = f"{c['chosen']}: {c['rows']:,} rows of {c['answers']:,} answers generated"
    assert re.search(r"\n  chosen +" + re.escape(line), picked.text), picked.text
    mb = f"{c['bytes'] / 1e6:,.1f} MB shipped"
    assert f"fp8; {c['rows']:,} rows" in picked.text and mb in picked.text, picked.text
    assert "### Hidden states captured (for a drafter's trainer)" in picked.card
    for label, value in (("rows captured (distinct, shipped)", f"{c['rows']:,}"),
                         ("answers generated (done items)", f"{c['answers']:,}"),
                         ("rows captured / answers generated", f"{c['rows'] / c['answers']:.1%}"),
                         ("answers captured (the choice)", c["chosen"]), ("chosen by", "sources, share"),
                         ("layers (vLLM's aux layer ids)", "2, 4"), ("stored as", "fp8"), ("budget", "none")):
        assert f"| {label} | {value} |" in picked.card, (label, value, picked.card)
    assert f"({c['bytes']:,} bytes)" in picked.card


def test_a_capture_pass_over_the_run_shows_its_source_and_choice(picked: Picked) -> None:
    """A pass (`producer capture`) chooses its rows when it is enqueued: status and --json show that
    choice (its source run, the order, the budget, the rows, tokens and bytes), not 'every answer'."""
    env = {"REDIS_URL": picked.url}
    p = cli("producer", "capture", "--from-run", str(picked.tmp / "out" / "pick"), "--run", "pick-hs", "--capture-layers", "2,4", "--output",
            str(picked.tmp / "hs"), "--capture-budget", "100KB", "--hidden-size", str(HIDDEN), "--json", env=env)
    report = orjson.loads(p.stdout)["capture"]
    c = json.loads(cli("producer", "status", "--run", "pick-hs", "--json", env=env).stdout)["capture"]
    assert c["choice"] == ["pass", "all"] and c["budget"] == 100_000 and c["rows"] == 0
    assert c["capture_pass"] == {k: report[k] for k in ("source", "by", "budget", "rows", "source_rows", "tokens",
                                                         "bytes")}, (c["capture_pass"], report)
    assert 0 < report["rows"] < report["source_rows"] and c["projected_bytes"] == report["bytes"] <= 100_000
    text = " ".join(cli("producer", "status", "--run", "pick-hs", env=env).stdout.split())  # lines wrap
    assert "budget 100.0 KB: applied when the pass was enqueued" in text, text
    assert (f"chosen a capture pass over run pick: {report['rows']:,} of its {report['source_rows']:,} rows, in its "
            f"order, within 100.0 KB: 0 rows captured of the {report['rows']:,} chosen ({report['tokens']:,} tokens"
            ) in text, text


def test_a_budget_stops_capture_within_the_rows_in_flight_with_two_consumers(tmp_path, redis_url, conn):
    out = tmp_path / "out"
    data = write_jsonl(tmp_path / "b.jsonl", [sharegpt(i) for i in range(80)])
    budget = 40_000
    cli("producer", "enqueue", str(data), "--run", "bud", "--output", str(out), "--max-tokens", "32",
        "--batch-size", "2", "--rejects", str(tmp_path / "rej.jsonl"), *CAPTURE, "--capture-budget", "40KB",
        env={"REDIS_URL": redis_url})
    sim = _sim(tmp_path, "s", "--step-time", "0.01", "--slots", "16")
    concurrency = 4
    try:
        both = [_consumer(tmp_path, redis_url, sim, "bud", name, "-c", str(concurrency)) for name in ("a", "b")]
        for c in both:
            assert c.wait(90) == 0, c.output()
    finally:
        sim.stop()
    recs = [r for r in read_results(out, "bud") if "error" not in r]
    assert {r["key"] for r in recs} == run_keys(conn, "bud")
    with_rows = [r for r in recs if _has_features(r)]
    check_features(with_rows, feature_store_for(str(out)), "bud")
    store = feature_store_for(str(out))
    lengths = [e.length for shard in {a["features"]["shard"] for r in with_rows for a, _ in answers(r)}
               for e in store.get_index("bud", shard).entries]
    spent = int(conn.hget(run_key("bud", "stats"), SPENT))
    assert spent == sum(lengths), "the budget counted every row stored, by its bytes"
    assert spent >= budget and len(with_rows) < len(recs), (spent, len(with_rows))
    assert spent - budget < 2 * max(lengths), f"overshoot past one row a consumer: {spent} of {budget}"
    assert len(with_rows) <= -(-budget // min(lengths)) + 2
    logs = "".join(c.output() for c in both)
    assert "capture budget (40000 bytes) is spent" in logs
    status = json.loads(cli("producer", "status", "--run", "bud", "--json", env={"REDIS_URL": redis_url}).stdout)
    c = status["capture"]
    assert (c["budget"], c["spent"], c["budget_spent"], c["choice"]) == (budget, spent, True, ["budget"])
    text = cli("producer", "status", "--run", "bud", env={"REDIS_URL": redis_url}).stdout
    print(f"{len(with_rows)} of {len(recs)} answers captured; {spent} bytes of a {budget}-byte budget "
          f"(overshoot {spent - budget}, rows {min(lengths)}-{max(lengths)} bytes)\n{text}")
    assert re.search(r"budget +40\.0 KB: budget spent \(\d+\.\d KB captured\)", text), text


@pytest.mark.parametrize(("args", "said"), [
    (("--capture-share", "0"), "--capture-share must be a share in (0, 1]"),
    (("--capture-share", "1.5"), "--capture-share must be a share in (0, 1]"),
    (("--capture-sources", "code=x"), "'x' in 'code=x' is not a share"),
    (("--capture-sources", "code=2"), "--capture-sources code must be a share in (0, 1]"),
    (("--capture-sources", "code,,chat"), "--capture-sources: an empty name"),
    (("--capture-sources", "code,code"), "--capture-sources names a source twice"),
    (("--capture-budget", "2XB"), "--capture-budget takes a size such as 2TB"),
    (("--capture-budget", "0"), "--capture-budget must be at least 1 byte"),
])
def test_a_bad_capture_choice_is_refused_in_one_line(tmp_path, redis_url, args, said):
    data = write_jsonl(tmp_path / "x.jsonl", [sharegpt(0)])
    p = cli("producer", "enqueue", str(data), "--run", "x", "--output", str(tmp_path / "out"), *CAPTURE, *args,
            env={"REDIS_URL": redis_url}, check=False)
    assert p.returncode == 2 and said in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr


def test_a_choice_without_capture_is_refused_in_one_line(tmp_path, redis_url):
    data = write_jsonl(tmp_path / "x.jsonl", [sharegpt(0)])
    p = cli("producer", "enqueue", str(data), "--run", "x", "--output", str(tmp_path / "out"), "--token-ids",
            "--capture-budget", "2TB", env={"REDIS_URL": redis_url}, check=False)
    assert p.returncode == 2 and p.stderr.strip() == "error: --capture-budget needs --capture hidden-states", p.stderr


def test_the_choice_is_fixed_for_the_runs_life_and_its_fingerprint_kept_without_one() -> None:
    """A capture without a choice stores what it did before the choice existed (its runs keep their
    fingerprint); a choice round-trips through the stored settings and the command line that
    brings a run back; a share draws from the key alone, evenly."""
    plain = RunSettings(token_ids=True, capture=parse_capture("hidden-states", "2,4", None))
    assert orjson.loads(plain.to_json())["capture"] == {"what": "hidden-states", "layers": [2, 4], "dtype": "fp8"}
    chosen = RunSettings(token_ids=True, capture=parse_capture("hidden-states", "2,4", None, 0.3, None, "1.5TiB"))
    back = RunSettings.from_json(chosen.to_json())
    assert back == chosen and back.fingerprint == chosen.fingerprint != plain.fingerprint
    assert chosen.capture is not None and chosen.capture.budget == parse_size("1.5TiB") == int(1.5 * 2**40)
    assert "--capture-share" in chosen.capture.options() and "--capture-budget" in chosen.capture.options()
    keys = [f"{i:032x}" for i in range(4000)]
    drawn = sum(chosen.capture.decide(k, "any.jsonl") is CaptureDecision.CAPTURE for k in keys)
    assert 0.27 < drawn / len(keys) < 0.33 and capture_fraction(keys[7]) == capture_fraction(keys[7])
    with pytest.raises(UserError, match="--capture-share must be a share"):
        parse_capture("hidden-states", "2,4", None, float("nan"))


def test_an_input_the_sources_do_not_name_is_said_at_enqueue(tmp_path, redis_url):
    data = write_jsonl(tmp_path / "other.jsonl", [sharegpt(0)])
    p = cli("producer", "enqueue", str(data), "--run", "x", "--output", str(tmp_path / "out"), *CAPTURE,
            "--capture-sources", "code,chat=0.1", "--rejects", str(tmp_path / "rej.jsonl"), env={"REDIS_URL": redis_url})
    assert (f"warning: --capture-sources names none of '{data}' (code, chat): its items are answered without "
            "capture") in p.stderr, p.stderr

