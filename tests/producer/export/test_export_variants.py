"""A run with a mix of request variants, end to end: `producer enqueue --variant`, a consumer
against the stand-in (which records every request body and, as Qwen3's template does, does not
think when asked `enable_thinking: false`), then `producer status` and `producer export`, whole
and split by variant. Real redis-server, real processes."""

from __future__ import annotations

import collections
from pathlib import Path

import orjson
import pytest

from genqueue.common.variants import draw, normalised, parse_variant
from tests.conftest import cli, sharegpt, write_jsonl
from tests.consumer.e2e import Proc, Sim, read_results

pytestmark = pytest.mark.integration

THINK = 'think={"chat_template_kwargs":{"enable_thinking":true}}:0.7'
NOTHINK = 'nothink={"chat_template_kwargs":{"enable_thinking":false},"temperature":0.2}:0.3'
MIX = normalised([parse_variant(THINK), parse_variant(NOTHINK)])


def export(tmp_path: Path, redis_url: str, name: str, *args: str, check: bool = True) -> tuple[int, dict, list]:
    out = tmp_path / f"{name}.jsonl"
    proc = cli("producer", "export", "--run", "mix", "-o", str(out), "--json", "--rows", "conversation", *args,
               env={"REDIS_URL": redis_url}, check=check)
    if proc.returncode:
        return proc.returncode, {"stderr": proc.stderr}, []
    rows = [orjson.loads(line) for line in out.read_bytes().splitlines()]
    return 0, orjson.loads(proc.stdout), rows


def test_each_item_is_sent_and_recorded_with_its_variant_and_exports_split(tmp_path: Path, redis_url: str) -> None:
    requests = tmp_path / "requests.jsonl"
    sim = Sim(tmp_path, "--slots", "32", "--mean-tokens", "30", "--record-requests", str(requests))
    data = write_jsonl(tmp_path / "mix.jsonl", [sharegpt(i, turns=1 + i % 2) for i in range(120)])
    env = {"REDIS_URL": redis_url}
    try:
        cli("producer", "enqueue", str(data), "--run", "mix", "--output", str(tmp_path / "out"), "--batch-size", "8",
            "--max-tokens", "256", "--samples", "2", "--rejects", str(tmp_path / "rej.jsonl"),
            "--variant", THINK, "--variant", NOTHINK, env=env)
        screen = cli("producer", "status", "--run", "mix", env=env).stdout
        assert "variants" in screen and "think 70%" in screen and "nothink 30%" in screen, screen
        c = Proc("consumer", ["run", "--run", "mix", "--endpoint", sim.url, "--spool", str(tmp_path / "spool"),
                              "--shard-max-age", "1", "--burst", "-c", "32"], tmp_path / "c.log", env=env)
        assert c.wait(120) == 0, c.output()
    finally:
        sim.stop()

    recs = read_results(tmp_path / "out", "mix")
    assert len(recs) == 240 and all("error" not in r for r in recs)
    # the request each item got: by its first user turn and its sample's seed
    sent: dict[tuple[str, int], list[dict]] = collections.defaultdict(list)
    for line in requests.read_bytes().splitlines():
        body = orjson.loads(line)
        if "seed" in body:  # every item has its sample's seed; the consumer's pre-flight probes have none
            sent[(body["messages"][0]["content"], body["seed"])].append(body)
    probes = [orjson.loads(line) for line in requests.read_bytes().splitlines() if b'"stream":true' in line]
    # the pre-flight asks the engine once for each request shape of the run
    assert sorted(orjson.dumps(p.get("chat_template_kwargs")) for p in probes) == [
        b'{"enable_thinking":false}', b'{"enable_thinking":true}']
    counts: collections.Counter[str] = collections.Counter()
    thought: collections.Counter[str] = collections.Counter()  # turns with thinking, by variant
    turns: collections.Counter[str] = collections.Counter()
    for r in recs:
        want = draw(r["key"], MIX)
        assert want is not None and r["variant"] == want.name
        counts[want.name] += 1
        bodies = sent[(r["messages"][0]["content"], r["seed"])]
        assert len(bodies) == len(r["turns"]) >= 1  # every turn of the conversation
        thinks = want.name == "think"
        assert all(b["chat_template_kwargs"] == {"enable_thinking": thinks} for b in bodies)
        assert all(b["temperature"] == (0.6 if thinks else 0.2) for b in bodies)
        assert r["sampling"]["chat_template_kwargs"] == {"enable_thinking": thinks}
        thought[want.name] += sum(t["reasoning"] is not None for t in r["turns"])
        turns[want.name] += len(r["turns"])
    assert set(counts) == {"think", "nothink"}
    # the stand-in thinks unless told not to (an answer of one token has no room to)
    assert thought["nothink"] == 0 and thought["think"] > 0.9 * turns["think"]
    assert 0.55 < counts["think"] / 240 < 0.85  # 0.7 of 240 items: sd 0.03

    code, whole, rows = export(tmp_path, redis_url, "all")
    assert code == 0 and whole["missing"] == 0
    assert whole["by_variant"] == dict(counts) and sum(whole["by_variant"].values()) == whole["exported"] == len(rows)
    assert collections.Counter(row["variant"] for row in rows) == counts

    pq = tmp_path / "all.parquet"  # Parquet has a column for it
    cli("producer", "export", "--run", "mix", "-o", str(pq), "--rows", "conversation", env=env)
    import pyarrow.parquet as pa_pq

    assert collections.Counter(pa_pq.read_table(pq, columns=["variant"]).column("variant").to_pylist()) == counts

    for name in ("think", "nothink"):
        code, part, rows = export(tmp_path, redis_url, name, "--variant", name)
        assert code == 0 and part["missing"] == 0 and part["variant"] == name
        assert part["exported"] == len(rows) == counts[name]
        assert part["other_variants"] == 240 - counts[name]
        assert {row["variant"] for row in rows} == {name}
        answers = [m for row in rows for m in row["messages"] if m["role"] == "assistant"]
        with_thinking = sum("reasoning_content" in m for m in answers)
        assert answers and (with_thinking > 0.9 * len(answers) if name == "think" else with_thinking == 0)

    proc = cli("producer", "export", "--run", "mix", "-o", str(tmp_path / "x.jsonl"), "--variant", "maybe",
               env=env, check=False)
    assert proc.returncode == 2 and "run mix has the variants think, nothink" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr
