"""The stand-in's return_token_ids: vLLM's fields, one id per counted token, decodable words."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp

from genqueue.consumer.sim.server import SimConfig, SimServer
from genqueue.consumer.sim.text import WORD_IDS, decode_ids

MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "explain the queue"}]


async def _ask(cfg: SimConfig, body: dict[str, Any]) -> dict[str, Any]:
    async with (SimServer(cfg) as sim, aiohttp.ClientSession() as s,
                s.post(f"{sim.url}/chat/completions", json={"messages": MESSAGES, **body}) as r):
        assert r.status == 200
        reply: dict[str, Any] = await r.json()
        return reply


def ask(cfg: SimConfig, **body: Any) -> dict[str, Any]:
    return asyncio.run(_ask(cfg, body))


def test_ids_count_the_usage_and_decode_to_the_answer() -> None:
    for reasoning in ("field", "none"):
        reply = ask(SimConfig(mean_tokens=40, seed=3, reasoning=reasoning), max_tokens=500, return_token_ids=True)
        choice, usage = reply["choices"][0], reply["usage"]
        prompt, completion = reply["prompt_token_ids"], choice["token_ids"]
        assert len(prompt) == usage["prompt_tokens"] and len(completion) == usage["completion_tokens"] > 0
        assert all(0 <= i < WORD_IDS for i in prompt)
        msg = choice["message"]
        said = " ".join(t for t in (msg.get("reasoning"), msg["content"]) if t)
        assert decode_ids(completion) == said


def test_cut_answers_keep_one_id_per_token_and_the_same_request_the_same_ids() -> None:
    cfg = SimConfig(mean_tokens=200, seed=5)
    a = ask(cfg, max_tokens=7, return_token_ids=True)
    assert a["choices"][0]["finish_reason"] == "length" and len(a["choices"][0]["token_ids"]) == 7
    assert ask(cfg, max_tokens=7, return_token_ids=True)["prompt_token_ids"] == a["prompt_token_ids"]


def test_ids_only_when_asked_and_not_by_an_engine_that_ignores_the_field() -> None:
    plain = ask(SimConfig(mean_tokens=20), max_tokens=50)
    assert "prompt_token_ids" not in plain and "token_ids" not in plain["choices"][0]
    old = ask(SimConfig(mean_tokens=20, token_ids=False), max_tokens=50, return_token_ids=True)
    assert "prompt_token_ids" not in old and "token_ids" not in old["choices"][0]


def test_a_longer_history_begins_with_a_shorter_ones_ids() -> None:
    from genqueue.consumer.sim.text import prompt_token_ids, prompt_tokens

    short = MESSAGES
    long = [*MESSAGES, {"role": "assistant", "content": "the queue holds jobs"}, {"role": "user", "content": "more"}]
    a, b = prompt_token_ids(0, short), prompt_token_ids(0, long)
    assert len(a) == prompt_tokens(short) and len(b) == prompt_tokens(long)
    tail = prompt_tokens(short) - sum(4 + len(m["content"]) // 4 for m in short)  # the generation prompt's
    assert b[: len(a) - tail] == a[: len(a) - tail]
    assert prompt_token_ids(1, short) != a
