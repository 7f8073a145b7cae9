"""--token-ids in the generator: each answer keeps the ids the engine returned (stand-in over real
HTTP); an answer without them is not usable."""

from __future__ import annotations

import asyncio
from typing import Any

from genqueue.common.contracts import Item
from genqueue.common.records import ErrorRecord, ResultRecord, full_prompts
from genqueue.common.settings import RunSettings, Sampling
from genqueue.consumer.answer.client import EndpointClient
from genqueue.consumer.answer.generate import NO_TOKEN_IDS, Gate, Generator, RunContext
from genqueue.consumer.sim.server import SimConfig, SimServer
from genqueue.consumer.sim.text import decode_ids, prompt_token_ids

ITEM: Item = {"key": "k" * 32, "index": 0, "turn": None, "messages": [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "one"}, {"role": "user", "content": "two"}, {"role": "user", "content": "three"}]}


def answer(cfg: SimConfig, item: Item, **settings: Any) -> ResultRecord | ErrorRecord:
    ctx = RunContext("r", RunSettings(sampling=Sampling(max_tokens=256), **settings), "sim-model",
                     {"host": "t", "gpu": None, "worker": "w", "endpoint": ""}, max_model_len=8192)

    async def go() -> ResultRecord | ErrorRecord:
        async with SimServer(cfg) as sim, EndpointClient(sim.url) as client:
            return await Generator(client, Gate(client), max_attempts=2, backoff_base=0.01).answer(ctx, item)

    return asyncio.run(go())


def test_regenerate_keeps_each_answers_prompt_and_completion_ids() -> None:
    rec = answer(SimConfig(mean_tokens=20, seed=1), ITEM, token_ids=True)
    assert "error" not in rec
    turns = rec["turns"]
    assert len(turns) == 3
    prompts = full_prompts(turns)
    for k, (t, prompt) in enumerate(zip(turns, prompts, strict=True)):
        ids, usage = t["token_ids"], t["usage"]
        assert prompt == prompt_token_ids(1, rec["messages"][: 2 + 2 * k])  # the history the engine saw
        assert len(prompt) == usage["prompt_tokens"] and len(ids["completion"]) == usage["completion_tokens"]
        assert decode_ids(ids["completion"]) == " ".join(x for x in (t["reasoning"], t["content"]) if x)
    # each later answer keeps only what follows the ids it shares with the previous prompt
    for k in (1, 2):
        shared = turns[k]["token_ids"]["prompt_shared"]
        before, whole = prompts[k - 1], prompts[k]
        assert before is not None and whole is not None
        assert 0 < shared <= len(before) and whole[:shared] == before[:shared]
        assert turns[k]["token_ids"]["prompt"] == whole[shared:]
    assert "token_ids" not in rec  # regenerate: per answer only
    assert "return_token_ids" not in rec["sampling"]


def test_single_turn_modes_keep_the_ids_on_the_record() -> None:
    rec = answer(SimConfig(mean_tokens=20, seed=2), {**ITEM, "turn": 0}, token_ids=True, multi_turn="first")
    assert "error" not in rec
    assert len(rec["token_ids"]["completion"]) == rec["usage"]["completion_tokens"]


def test_without_the_setting_no_ids_are_asked_or_kept() -> None:
    rec = answer(SimConfig(mean_tokens=20, seed=1), ITEM)
    assert "error" not in rec
    assert all("token_ids" not in t for t in rec["turns"])


def test_an_answer_without_ids_is_a_bad_response_not_a_record_without_them() -> None:
    rec = answer(SimConfig(mean_tokens=20, seed=1, token_ids=False), ITEM, token_ids=True)
    assert "error" in rec
    assert rec["error"]["class"] == "bad_response" and NO_TOKEN_IDS in rec["error"]["message"]


def test_answers_after_tool_results_have_their_own_prompt_ids_and_rows() -> None:
    from genqueue.producer.export.formats.tokens import to_tokens
    from tests.consumer.test_tool_regen import agentic, item_of

    rec = answer(SimConfig(mean_tokens=15, seed=3, tool_calls="recorded"), item_of(agentic(1)), token_ids=True)
    assert "error" not in rec
    answered_at = [i for i, m in enumerate(rec["messages"]) if m["role"] == "assistant"]
    assert len(answered_at) == len(rec["turns"]) == 5
    prompts = full_prompts(rec["turns"])
    for at, prompt in zip(answered_at, prompts, strict=True):
        assert prompt == prompt_token_ids(3, rec["messages"][:at])  # the history up to that answer, results too
    rows = to_tokens(rec)
    assert [(r["turn"], r.get("step", 0)) for r in rows] == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0)]
    assert len({r["id"] for r in rows}) == 5
    for row, prompt, t in zip(rows, prompts, rec["turns"], strict=True):
        assert prompt is not None and row["input_ids"] == prompt + t["token_ids"]["completion"]
