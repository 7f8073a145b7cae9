"""The request a run sends is built in one place (common/requests.py): the producer's Batch check
(producer/ingest/sources.py), the generator's requests and the pre-flight (consumer/served.py)
send or check the same fields for the same settings, and a changed setting changes all three.
The generator and the pre-flight are read on the wire: the stand-in over real HTTP (in-process)
records each body it is sent."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path
from typing import Any

import orjson
import pytest

from genqueue.common.contracts import Item, Mode
from genqueue.common.requests import RequestShape
from genqueue.common.settings import RunSettings, Sampling
from genqueue.common.variants import Variant, normalised
from genqueue.consumer.answer.client import EndpointClient
from genqueue.consumer.answer.generate import Gate, Generator, RunContext
from genqueue.consumer.served import accepts, preflight_body
from genqueue.consumer.sim.server import SimConfig, SimServer
from genqueue.producer.ingest.sources import bind

MIX = normalised([Variant("think", {"chat_template_kwargs": {"enable_thinking": True}}, 0.5),
                  Variant("nothink", {"chat_template_kwargs": {"enable_thinking": False}, "temperature": 0.7,
                                      "reasoning_effort": "low"}, 0.5)])
BASE = RunSettings(multi_turn=Mode.FIRST, token_ids=True,
                   sampling=Sampling(temperature=0.6, top_p=0.95, max_tokens=64, seed=5,
                                     extra={"chat_template_kwargs": {"custom": 1}, "top_k": 20}))


def item(i: int, **extra: Any) -> Item:
    return {"key": f"{i:032x}", "index": i, "turn": None, "messages": [{"role": "user", "content": f"hi {i}"}],
            **extra}


def sent(settings: RunSettings, tmp: Path, items: list[Item]) -> dict[str, Any]:
    """What each path sends (or checks) for SETTINGS, as JSON on the wire, without model and
    messages: 'producer' (the Batch check's fields), 'preflight' (one per shape the run sends:
    each variant by name, or the run's own as 'run'), 'probe', and each ITEM's request by its key;
    and 'records' (the sampling each item's record says it was sent with)."""
    log = tmp / "requests.jsonl"
    log.unlink(missing_ok=True)
    producer = bind(None, "in.jsonl", "src", "r", settings, None).run_params
    assert producer is not None

    async def go() -> dict[str, Any]:
        async with SimServer(SimConfig(mean_tokens=5, seed=1, record_requests=str(log))) as sim, \
                EndpointClient(sim.url) as client:
            gen = Generator(client, Gate(client), max_attempts=1)
            ctx = RunContext("r", settings, "sim-model", {"host": "t"}, max_model_len=8192)
            for variant in settings.variants or (None,):
                await accepts(client, preflight_body(ctx, variant))
            await gen.request(ctx, [{"role": "user", "content": "probe"}], None, need_ids=False)  # as served._probe
            recs = [await gen.answer(ctx, it) for it in items]
            return {"records": {r["key"]: r["sampling"] for r in recs}, "variants": {r["key"]: r.get("variant")
                                                                                   for r in recs}}

    got = asyncio.run(go())
    bodies = [orjson.loads(line) for line in log.read_bytes().splitlines()]
    for b in bodies:
        assert b.pop("model") == "sim-model"
    shapes = [v.name for v in settings.variants] or ["run"]  # a run with variants sends only theirs
    preflight = {name: b for name, b in zip(shapes, bodies, strict=False)}
    for b in preflight.values():
        assert b.pop("messages") == [{"role": "user", "content": "Say ok."}] and b.pop("stream") is True
    probe, answers = bodies[len(shapes)], bodies[len(shapes) + 1:]
    assert probe.pop("messages")[0]["content"] == "probe"
    by_key = {}
    for it, b in zip(items, answers, strict=True):
        assert b.pop("messages") == it["messages"]
        by_key[it["key"]] = b
    return {"producer": orjson.loads(orjson.dumps(producer)), "preflight": preflight, "probe": probe,
            "items": by_key, **got}


def without_ids(body: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in body.items() if k != "return_token_ids"}


def test_the_three_paths_send_the_same_request_for_the_same_settings(tmp_path: Path) -> None:
    items = [item(0), item(1, seed=99)]
    got = sent(BASE, tmp_path, items)
    fields = RequestShape.of(BASE).fields()
    assert fields == {"max_tokens": 64, "temperature": 0.6, "top_p": 0.95, "seed": 5,
                      "chat_template_kwargs": {"custom": 1}, "top_k": 20, "return_token_ids": True}
    assert got["producer"] == got["preflight"]["run"] == got["probe"] == got["items"][item(0)["key"]] == fields
    # the item's own seed is its request's (and its record's) only difference
    assert got["items"][item(1)["key"]] == {**fields, "seed": 99}
    assert got["records"][item(0)["key"]] == without_ids(fields)
    assert got["records"][item(1)["key"]] == without_ids({**fields, "seed": 99})


@pytest.mark.parametrize("change", [
    {"sampling": replace(BASE.sampling, temperature=0.1)},
    {"sampling": replace(BASE.sampling, max_tokens=32)},
    {"sampling": replace(BASE.sampling, extra={"chat_template_kwargs": {"enable_thinking": False}})},
    {"token_ids": False},
], ids=["temperature", "max_tokens", "thinking", "token_ids"])
def test_a_changed_setting_changes_the_request_on_every_path(tmp_path: Path, change: dict[str, Any]) -> None:
    before = sent(BASE, tmp_path, [item(0)])
    changed = replace(BASE, **change)
    after = sent(changed, tmp_path, [item(0)])
    key = item(0)["key"]
    for path in ("producer", "probe"):
        assert after[path] != before[path], path
    assert after["preflight"]["run"] != before["preflight"]["run"]
    assert after["items"][key] != before["items"][key]
    assert after["producer"] == after["preflight"]["run"] == after["probe"] == after["items"][key] \
        == RequestShape.of(changed).fields()


def test_a_variant_is_probed_as_its_items_are_sent(tmp_path: Path) -> None:
    settings = replace(BASE, variants=MIX)
    items = [item(i) for i in range(12)]
    got = sent(settings, tmp_path, items)
    assert set(got["variants"].values()) == {"think", "nothink"}  # both drawn among these keys
    for key, name in got["variants"].items():
        assert got["items"][key] == got["preflight"][name]  # the pre-flight probed this very shape
        assert got["records"][key] == without_ids(got["preflight"][name])
    assert got["preflight"]["nothink"]["chat_template_kwargs"] == {"custom": 1, "enable_thinking": False}
    assert got["preflight"]["nothink"]["reasoning_effort"] == "low"
    # a Batch line is checked against the run's own fields (its variant is drawn by the consumer)
    assert got["producer"] == RequestShape.of(settings).fields() == RequestShape.of(BASE).fields()
