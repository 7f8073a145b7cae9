"""generations(): a record as the requests the target answered, each with the history as sent."""

from __future__ import annotations

from typing import Any, cast

import pytest

from genqueue.common.records import ResultRecord
from genqueue.producer.export.generations import generations


def _rec(**fields: Any) -> ResultRecord:
    return cast(ResultRecord, {"key": "k", "index": 0, "turn": None, "run": "r", "sampling": {}, "fingerprint": "f",
                               **fields})


def test_single_turn_record_is_one_generation() -> None:
    rec = _rec(messages=[{"role": "system", "content": "s"}, {"role": "user", "content": "q"}], content="a",
               reasoning="r", outcome="finished", usage={"completion_tokens": 3},
               token_ids={"prompt": [1, 2], "completion": [3]})
    [g] = generations(rec)
    assert g.history == rec["messages"] and g.index == 0 and g.step == 0
    assert g.answer == {"role": "assistant", "content": "a", "reasoning_content": "r"}
    assert g.prompt_ids == [1, 2] and not g.unclosed


def test_regenerate_record_is_one_generation_per_request_with_the_history_as_sent() -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    messages = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "", "tool_calls": [call]},  # history-reasoning drop: no thinking
        {"role": "tool", "tool_call_id": "c1", "content": "42"},
        {"role": "assistant", "content": "a1"},
        {"role": "user", "content": "q2"},
        {"role": "assistant", "content": "a2"},
    ]
    turns = [
        {"turn": 0, "content": "", "reasoning": "t0", "tool_calls": [call], "tool_results_spliced": True,
         "outcome": "finished", "usage": {}, "token_ids": {"prompt": [1, 2], "completion": [3]}},
        {"turn": 0, "step": 1, "content": "a1", "reasoning": "t1", "outcome": "finished", "usage": {},
         "token_ids": {"prompt": [9], "completion": [4], "prompt_shared": 2}},
        {"turn": 1, "content": "a2", "reasoning": None, "outcome": "cut_in_answer", "usage": {},
         "token_ids": {"prompt": [5], "completion": [6], "prompt_shared": 3}},
    ]
    gens = generations(_rec(messages=messages, turns=turns))
    assert [(g.index, g.turn, g.step) for g in gens] == [(0, 0, 0), (1, 0, 1), (2, 1, 0)]
    assert [len(g.history) for g in gens] == [2, 4, 6]
    assert gens[1].history[2] == messages[2]  # earlier answers exactly as sent: no thinking put back
    assert gens[0].answer["reasoning_content"] == "t0" and gens[0].answer["tool_calls"] == [call]
    assert "reasoning_content" not in gens[2].answer
    assert [g.prompt_ids for g in gens] == [[1, 2], [1, 2, 9], [1, 2, 9, 5]]


def test_kept_thinking_stays_in_the_history() -> None:
    messages = [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1", "reasoning_content": "t1"},
                {"role": "user", "content": "q2"}, {"role": "assistant", "content": "a2", "reasoning_content": "t2"}]
    turns = [{"turn": 0, "content": "a1", "reasoning": "t1", "outcome": "finished", "usage": {}},
             {"turn": 1, "content": "a2", "reasoning": "t2", "outcome": "finished", "usage": {}}]
    gens = generations(_rec(messages=messages, turns=turns, history_reasoning="keep"))
    assert gens[1].history[1]["reasoning_content"] == "t1"
    assert gens[1].prompt_ids is None


def test_ids_that_do_not_chain_are_refused() -> None:
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    turns = [{"turn": 0, "content": "a", "reasoning": None, "outcome": "finished", "usage": {},
              "token_ids": {"prompt": [1], "completion": [2], "prompt_shared": 5}}]
    with pytest.raises(ValueError):
        generations(_rec(messages=messages, turns=turns))
