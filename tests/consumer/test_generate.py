"""The generator against the stand-in over real HTTP (in-process), checkpoints in real Redis."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

import orjson
import pytest
import redis

from genqueue.common.contracts import Item
from genqueue.common.keepers.checkpoints import checkpoint_key
from genqueue.common.records import ErrorRecord, ResultRecord
from genqueue.common.settings import RunSettings, Sampling
from genqueue.consumer.answer.checkpoints import Checkpoints
from genqueue.consumer.answer.client import EndpointClient
from genqueue.consumer.answer.generate import Gate, Generator, RunContext, retry_budget
from genqueue.consumer.sim.server import SimConfig, SimServer

T = TypeVar("T")
Rec = ResultRecord | ErrorRecord


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


def ctx(**kw: Any) -> RunContext:
    sampling = Sampling(max_tokens=kw.pop("max_tokens", 256))
    return RunContext("r", RunSettings(sampling=sampling, **kw), "sim-model", {"host": "t"}, max_model_len=8192)


async def with_gen(cfg: SimConfig, fn: Callable[[Generator, SimServer], Awaitable[T]],
                   checkpoints: Checkpoints | None = None) -> T:
    async with SimServer(cfg) as sim, EndpointClient(sim.url) as client:
        gen = Generator(client, Gate(client), checkpoints=checkpoints)
        return await fn(gen, sim)


def ok(rec: Rec) -> ResultRecord:
    assert "error" not in rec, rec
    return rec


def failed(rec: Rec) -> ErrorRecord:
    assert "error" in rec, rec
    return rec  # type: ignore[return-value]


ITEM: Item = {"key": "k" * 32, "index": 3, "turn": None, "messages": [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "one"}, {"role": "user", "content": "two"}, {"role": "user", "content": "three"}]}


def test_retry_budget() -> None:
    assert retry_budget(8192, 1000, 512) == 7192
    assert retry_budget(1024, 900, 512) is None
    assert retry_budget(None, 10, 5) is None


def test_regenerate_answers_each_turn_on_its_own_history() -> None:
    async def go(gen: Generator, sim: SimServer) -> Rec:
        return await gen.answer(ctx(), ITEM)

    rec = ok(run(with_gen(SimConfig(mean_tokens=20, seed=1), go)))
    roles = [m["role"] for m in rec["messages"]]
    assert roles == ["system", "user", "assistant", "user", "assistant", "user", "assistant"]
    assert [t["turn"] for t in rec["turns"]] == [0, 1, 2]
    assert rec["messages"][2]["content"] == rec["turns"][0]["content"]
    assert "reasoning_content" not in rec["messages"][2]  # history_reasoning=drop
    assert rec["usage"]["completion_tokens"] == sum(t["usage"]["completion_tokens"] for t in rec["turns"])


def test_history_reasoning_keep() -> None:
    async def go(gen: Generator, sim: SimServer) -> Rec:
        return await gen.answer(ctx(history_reasoning="keep"), ITEM)

    rec = ok(run(with_gen(SimConfig(mean_tokens=30, seed=2), go)))
    assert rec["messages"][2]["reasoning_content"] == rec["turns"][0]["reasoning"]


def test_checkpoint_resumes_at_the_next_turn(redis_url: str, conn: redis.Redis) -> None:
    async def first(gen: Generator, sim: SimServer) -> tuple[Rec, int]:
        rec = await gen.answer(ctx(), ITEM)
        return rec, sim.stats["requests"]

    cps = Checkpoints(redis_url)
    full, n = run(with_gen(SimConfig(mean_tokens=20, seed=3), first, cps))
    assert n == 3
    raw = conn.get(checkpoint_key("r", ITEM["key"]))
    assert isinstance(raw, bytes)
    saved = orjson.loads(raw)
    assert len(saved["turns"]) == 2  # saved after turns 1 and 2; the last needs none

    # A later attempt of the same item (the job was redone after a kill) starts at turn 3.
    async def second(gen: Generator, sim: SimServer) -> tuple[Rec, int]:
        rec = await gen.answer(ctx(), ITEM)
        return rec, sim.stats["requests"]

    resumed, n2 = run(with_gen(SimConfig(mean_tokens=20, seed=3), second, Checkpoints(redis_url)))
    assert n2 == 1 and ok(resumed)["resumed_at_turn"] == 2
    assert ok(resumed)["turns"][:2] == ok(full)["turns"][:2] and len(ok(resumed)["turns"]) == 3


def test_a_checkpoint_that_does_not_fit_is_ignored(redis_url: str, conn: redis.Redis) -> None:
    conn.set(checkpoint_key("r", ITEM["key"]), orjson.dumps({"history": "x", "turns": [], "pos": 99}))

    async def go(gen: Generator, sim: SimServer) -> tuple[Rec, int]:
        rec = await gen.answer(ctx(), ITEM)
        return rec, sim.stats["requests"]

    rec, n = run(with_gen(SimConfig(mean_tokens=20, seed=3), go, Checkpoints(redis_url)))
    assert n == 3 and "resumed_at_turn" not in ok(rec) and len(ok(rec)["turns"]) == 3


def test_truncation_policies() -> None:
    single: Item = {"key": "a" * 32, "index": 0, "turn": 0, "messages": [{"role": "user", "content": "q"}]}

    def go(settings: RunContext) -> Callable[[Generator, SimServer], Awaitable[Rec]]:
        return lambda gen, sim: gen.answer(settings, single)

    cfg = SimConfig(mean_tokens=400, seed=5, think_fraction=0.05)
    kept = run(with_gen(cfg, go(ctx(max_tokens=4, multi_turn="last"))))
    assert ok(kept)["outcome"] in ("cut_in_answer", "cut_in_thinking") and "error" not in kept
    err = failed(run(with_gen(cfg, go(ctx(max_tokens=4, truncation="error", multi_turn="last")))))
    assert err["error"]["class"] == "truncated" and err["partial"]["finish_reason"] == "length"
    retried = ok(run(with_gen(cfg, go(ctx(max_tokens=4, truncation="retry", multi_turn="last")))))
    assert retried["truncation"]["retried"] and retried["truncation"]["max_tokens"] > 4
    assert retried["outcome"] == "finished"
    regen = ok(run(with_gen(cfg, go(ctx(max_tokens=4, truncation="retry")))))
    assert regen["truncation"]["retried"] and regen["turns"][0]["truncation"]["first_outcome"].startswith("cut")


def test_regenerate_stops_at_a_cut_turn_and_keeps_what_came_before() -> None:
    async def go(gen: Generator, sim: SimServer) -> Rec:
        return await gen.answer(ctx(max_tokens=3), ITEM)

    rec = ok(run(with_gen(SimConfig(mean_tokens=500, seed=9), go)))
    assert rec["stopped"]["turn"] == 0 and rec["stopped"]["reason"].startswith("cut_in")
    assert len(rec["turns"]) == 1


def test_permanent_error_in_a_later_turn_ends_the_conversation_there() -> None:
    long_item: Item = {**ITEM, "messages": [{"role": "user", "content": "short"},
                                            {"role": "user", "content": "word " * 3000}]}

    async def go(gen: Generator, sim: SimServer) -> Rec:
        return await gen.answer(ctx(max_tokens=16), long_item)

    rec = ok(run(with_gen(SimConfig(mean_tokens=10, max_model_len=2048), go)))
    assert len(rec["turns"]) == 1 and rec["stopped"]["reason"] == "error"
    assert rec["stopped"]["error"]["class"] == "permanent"
    assert [m["role"] for m in rec["messages"]] == ["user", "assistant"]
    # the conversation is not what the target would have finished: never `finished`
    assert rec["outcome"] == "partial" and rec["turns"][0]["outcome"] == "finished"


def test_a_cut_later_turn_dropped_under_truncation_error_is_partial() -> None:
    item: Item = {**ITEM, "messages": [{"role": "user", "content": "short"},
                                       {"role": "user", "content": "long one [len=400]"}]}

    async def go(gen: Generator, sim: SimServer) -> Rec:
        return await gen.answer(ctx(max_tokens=64, truncation="error"), item)

    rec = ok(run(with_gen(SimConfig(mean_tokens=8, seed=2, length_hints=True), go)))
    assert len(rec["turns"]) == 1 and rec["outcome"] == "partial" and rec["stopped"]["dropped"]
    assert rec["stopped"]["error"]["class"] == "truncated" and rec["stopped"]["reason"].startswith("cut_in")
    assert [m["role"] for m in rec["messages"]] == ["user", "assistant"]


@pytest.mark.parametrize("mode", ["inline", "reasoning_content", "field"])
def test_every_thinking_form_is_read(mode: str) -> None:
    single: Item = {"key": "b" * 32, "index": 0, "turn": 0, "messages": [{"role": "user", "content": "q"}]}

    async def go(gen: Generator, sim: SimServer) -> Rec:
        return await gen.answer(ctx(), single)

    rec = ok(run(with_gen(SimConfig(mean_tokens=60, seed=4, reasoning=mode), go)))
    assert rec["turn"] == 0 and "turns" in rec  # default mode: regenerate
    assert rec["reasoning"] and rec["reasoning_form"] == ("inline" if mode == "inline" else "field")
    assert "<think>" not in rec["content"]


def test_a_record_that_cannot_be_built_is_an_internal_error_not_an_exception(monkeypatch: pytest.MonkeyPatch) -> None:
    """records.record runs inside the generator's guard: a builder that raises (a genqueue bug,
    a checkpoint's turns of another shape) still gives the item a timed record."""
    from genqueue.consumer.answer import records

    def broken(*args: Any, **kw: Any) -> Any:
        raise KeyError("content")

    monkeypatch.setattr(records, "conversation_record", broken)

    async def go(gen: Generator, sim: SimServer) -> Rec:
        return await gen.answer(ctx(), ITEM, attempt=2, enqueued_at=5.0, copy=True)

    rec = failed(run(with_gen(SimConfig(mean_tokens=5, seed=1), go)))
    assert rec["error"]["class"] == "internal" and rec["error"]["message"] == "KeyError: 'content'"
    assert rec["attempt"] == 2 and rec["timings"]["enqueued_at"] == 5.0 and rec["copy"] is True
    assert list(rec)[-2:] == ["timings", "copy"]


def test_a_refused_connection_closes_the_gate_despite_a_healthy_answer_a_moment_ago() -> None:
    """The chaos run's trip: /health answered 200 a moment before the engine died, so with that
    answer trusted for the probe interval every refused retry went straight on, and items spent
    their attempts in 40 ms and tripped the breaker. A refused connection now asks /health at
    once: the gate closes and the request waits, its attempts kept, until the engine is back."""
    async def go() -> None:
        sim = SimServer(SimConfig(step_time=0.001, mean_tokens=4))
        await sim.start()
        try:
            async with EndpointClient(sim.url) as client:
                gate = Gate(client, probe_interval=2.0)  # a healthy answer trusted for 2 s
                gen = Generator(client, gate, max_attempts=3, backoff_base=0.001, backoff_cap=0.001)
                assert await gate.check("warm")  # healthy, now trusted
                await sim.go_down(None)
                task = asyncio.create_task(gen.request(ctx(), ITEM["messages"], None, max_tokens=4))
                for _ in range(200):
                    if gate.paused:
                        break
                    await asyncio.sleep(0.01)
                assert gate.paused and not task.done()  # waiting, not given up
                await sim.come_up()
                turn = await asyncio.wait_for(task, 10)
                assert turn.finish_reason
                assert gen.failures.total() <= 2  # at most the attempts before the gate closed
        finally:
            await sim.stop()

    run(go())
