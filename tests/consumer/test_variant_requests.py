"""Request variants at the generator: each item's requests (every turn of a conversation,
every attempt) carry its variant's fields, and its record names the variant. Against the
stand-in over real HTTP (in-process), which records every request body it is sent."""

from __future__ import annotations

import asyncio
from pathlib import Path

import orjson
import pytest
import redis

from genqueue.common.contracts import ExitCode, Item
from genqueue.common.records import ErrorRecord, ResultRecord
from genqueue.common.settings import RunSettings, Sampling
from genqueue.common.variants import Variant, normalised
from genqueue.consumer.answer.client import EndpointClient
from genqueue.consumer.answer.generate import Gate, Generator, RunContext
from genqueue.consumer.sim.server import SimConfig, SimServer
from tests.conftest import cli, sharegpt, write_jsonl
from tests.consumer.e2e import Proc, Sim

MIX = normalised([Variant("think", {"chat_template_kwargs": {"enable_thinking": True}}, 0.5),
                  Variant("nothink", {"chat_template_kwargs": {"enable_thinking": False}, "temperature": 0.7}, 0.5)])
SETTINGS = RunSettings(sampling=Sampling(max_tokens=256, extra={"chat_template_kwargs": {"custom": 1}}),
                       variants=MIX)


def item(i: int) -> Item:
    return {"key": f"{i:032x}", "index": i, "turn": None, "messages": [
        {"role": "user", "content": f"one {i}"}, {"role": "user", "content": f"two {i}"},
        {"role": "user", "content": f"three {i}"}]}


def answer_all(cfg: SimConfig, items: list[Item], max_attempts: int = 3) -> list[ResultRecord | ErrorRecord]:
    async def go() -> list[ResultRecord | ErrorRecord]:
        async with SimServer(cfg) as sim, EndpointClient(sim.url) as client:
            gen = Generator(client, Gate(client), max_attempts=max_attempts, backoff_base=0.01, backoff_cap=0.02)
            ctx = RunContext("r", SETTINGS, "sim-model", {"host": "t"}, max_model_len=8192)
            return [await gen.answer(ctx, it) for it in items]

    return asyncio.run(go())


def test_every_turn_of_a_conversation_is_sent_with_its_items_variant(tmp_path: Path) -> None:
    log = tmp_path / "requests.jsonl"
    items = [item(i) for i in range(40)]
    recs = answer_all(SimConfig(mean_tokens=20, seed=3, record_requests=str(log)), items)
    bodies = [orjson.loads(line) for line in log.read_bytes().splitlines()]
    by_item: dict[str, list[dict[str, object]]] = {}
    for body in bodies:
        first = body["messages"][0]["content"]
        by_item.setdefault(first.split()[-1], []).append(body)
    names = set()
    thinking = think_turns = 0
    for it, rec in zip(items, recs, strict=True):
        assert "error" not in rec, rec
        variant = SETTINGS.variant_of(it["key"])
        assert variant is not None and rec["variant"] == variant.name
        names.add(variant.name)
        sent = by_item[str(it["index"])]
        assert len(sent) == 3  # the three turns, each with the variant's fields over the run's
        want = {"custom": 1, "enable_thinking": variant.name == "think"}
        assert all(b["chat_template_kwargs"] == want for b in sent)
        assert all(b["temperature"] == (0.7 if variant.name == "nothink" else 0.6) for b in sent)
        assert rec["sampling"]["chat_template_kwargs"] == want
        # the stand-in thinks unless asked not to, as Qwen3's template does
        if variant.name == "nothink":
            assert all(t["reasoning"] is None for t in rec["turns"])
        else:
            thinking += sum(t["reasoning"] is not None for t in rec["turns"])
            think_turns += len(rec["turns"])
    assert names == {"think", "nothink"}
    assert thinking > 0.9 * think_turns


def test_retries_and_error_records_keep_the_variant(tmp_path: Path) -> None:
    log = tmp_path / "requests.jsonl"
    it = item(7)
    variant = SETTINGS.variant_of(it["key"])
    assert variant is not None
    [rec] = answer_all(SimConfig(error_rate=1.0, record_requests=str(log)), [it], max_attempts=3)
    assert "error" in rec and rec["variant"] == variant.name
    bodies = [orjson.loads(line) for line in log.read_bytes().splitlines()]
    assert len(bodies) == 3  # every attempt, the same variant
    assert {orjson.dumps(b["chat_template_kwargs"]) for b in bodies} == {
        orjson.dumps({"custom": 1, **variant.params["chat_template_kwargs"]})}


def test_a_run_without_variants_records_none(tmp_path: Path) -> None:
    async def go() -> ResultRecord | ErrorRecord:
        async with SimServer(SimConfig(mean_tokens=10)) as sim, EndpointClient(sim.url) as client:
            ctx = RunContext("r", RunSettings(sampling=Sampling(max_tokens=64)), "sim-model", {"host": "t"})
            assert ctx.for_item(item(1)) is ctx
            return await Generator(client, Gate(client)).answer(ctx, item(1))

    rec = asyncio.run(go())
    assert "error" not in rec and "variant" not in rec


@pytest.mark.integration
def test_a_variant_the_engine_refuses_fails_the_runs_pre_flight(tmp_path: Path, redis_url: str,
                                                                 conn: redis.Redis) -> None:
    data = write_jsonl(tmp_path / "v.jsonl", [sharegpt(i) for i in range(16)])
    env = {"REDIS_URL": redis_url}
    cli("producer", "enqueue", str(data), "--run", "vbig", "--output", str(tmp_path / "out"), "--max-tokens", "64",
        "--rejects", str(tmp_path / "rej"), "--variant", "ok={}:1", "--variant", 'huge={"max_tokens":50000}:1',
        env=env)
    sim = Sim(tmp_path, "--max-model-len", "8192", "--mean-tokens", "10")
    try:
        c = Proc("consumer", ["run", "--run", "vbig", "--endpoint", sim.url, "--burst", "--spool",
                              str(tmp_path / "spool")], tmp_path / "c.log", env=env)
        code = c.wait(120)
    finally:
        sim.stop()
    log = c.output()
    assert code == ExitCode.PREFLIGHT, log
    assert "the engine refuses a request of this run's variant huge" in log
    assert conn.llen("rq:queue:genqueue.vbig") == 1, "its jobs wait for the fix"
