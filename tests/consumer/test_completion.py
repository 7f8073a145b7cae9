"""Reading and checking a chat completion (pure: no server)."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from genqueue.common.contracts import Outcome, ReasoningForm
from genqueue.consumer.answer.completion import SNIPPET_CHARS, decode_body, parse_completion, split_inline
from genqueue.consumer.answer.faults import BadResponseError, TransientError


def resp(message: Any, finish: Any = "stop", usage: Any = None) -> dict[str, Any]:
    return {"model": "m", "choices": [{"index": 0, "message": message, "finish_reason": finish}],
            "usage": usage or {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}}


def test_reasoning_field_current_name() -> None:
    t = parse_completion(resp({"role": "assistant", "content": "4", "reasoning": "2+2"}))
    assert (t.content, t.reasoning, t.reasoning_form, t.outcome) == ("4", "2+2", "field", Outcome.FINISHED)


def test_reasoning_content_older_name_is_not_lost() -> None:
    t = parse_completion(resp({"role": "assistant", "content": "4", "reasoning_content": "2+2"}))
    assert t.reasoning == "2+2" and t.reasoning_form == "field"


def test_inline_think_split() -> None:
    t = parse_completion(resp({"role": "assistant", "content": "<think>\nhmm\n</think>\n\nanswer"}))
    assert (t.content, t.reasoning, t.reasoning_form) == ("answer", "hmm", "inline")


def test_inline_unclosed_means_cut_in_thinking() -> None:
    t = parse_completion(resp({"role": "assistant", "content": "<think>still thinking"}, finish="length"))
    assert t.content == "" and t.reasoning == "still thinking" and t.outcome == Outcome.CUT_IN_THINKING


def test_cut_in_answer_and_field_cut_in_thinking() -> None:
    assert parse_completion(resp({"content": "half an answ", "reasoning": "r"}, "length")).outcome == Outcome.CUT_IN_ANSWER
    assert parse_completion(resp({"content": None, "reasoning": "r"}, "length")).outcome == Outcome.CUT_IN_THINKING


def test_no_thinking_at_all() -> None:
    t = parse_completion(resp({"content": "plain", "reasoning": None}))
    assert t.reasoning is None and t.reasoning_form == "none" and t.content == "plain"


def test_closing_tag_only() -> None:
    assert split_inline("thought</think>answer") == ("answer", "thought", True)
    assert split_inline("no tags here") == ("no tags here", None, True)


def test_reasoning_tokens_from_details() -> None:
    t = parse_completion(resp({"content": "x"}, usage={"prompt_tokens": 1, "completion_tokens": 9,
                                                      "completion_tokens_details": {"reasoning_tokens": 7}}))
    assert t.usage == {"prompt_tokens": 1, "completion_tokens": 9, "reasoning_tokens": 7}


def test_template_opened_thinking_cut_by_the_budget() -> None:
    body = resp({"content": "still thinking, no tags", "reasoning": None}, "length")
    assert parse_completion(body).outcome == Outcome.CUT_IN_ANSWER  # without the probe's knowledge
    t = parse_completion(body, think_opened=True)
    assert t.outcome == Outcome.CUT_IN_THINKING and t.reasoning == "still thinking, no tags" and t.content == ""


def test_thinking_with_no_answer_is_not_finished() -> None:
    t = parse_completion(resp({"content": None, "reasoning": "the whole reply"}, "stop"))
    assert t.outcome == Outcome.NO_ANSWER


def test_names_are_the_contract_enums() -> None:
    t = parse_completion(resp({"content": "<think>a</think>b"}))
    assert type(t.outcome) is Outcome and type(t.reasoning_form) is ReasoningForm


def test_every_known_finish_reason_and_tool_calls_are_accepted() -> None:
    for finish in ("stop", "length", "tool_calls", "content_filter", "function_call"):
        assert parse_completion(resp({"content": "x"}, finish)).finish_reason == finish
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    t = parse_completion(resp({"content": None, "tool_calls": [call]}, "tool_calls"))
    assert t.tool_calls == [call] and t.outcome == Outcome.FINISHED and t.content == ""
    bare = parse_completion({"choices": [{"message": {"content": "x"}, "finish_reason": "stop"}]})
    assert bare.usage == {} and bare.model is None  # usage and model are optional


BAD_BODIES: list[tuple[str, Any, str]] = [
    ("empty choices", {"choices": []}, "empty list"),
    ("a list body", [{"choices": []}], "a list, not an object"),
    ("null choices", {"choices": None}, "choices is null"),
    ("no choices", {"id": "x"}, "choices is null"),
    ("choice not an object", {"choices": ["hi"]}, "choices[0] is a string"),
    ("no message", {"choices": [{"finish_reason": "stop"}]}, "message is null"),
    ("numeric content", resp({"content": 123}), "message.content is a number"),
    ("list reasoning", resp({"content": "x", "reasoning": ["a"]}), "message.reasoning is a list"),
    ("object reasoning_content", resp({"content": "x", "reasoning_content": {}}), "reasoning_content is an object"),
    ("tool_calls a string", resp({"content": "x", "tool_calls": "f()"}), "tool_calls is not a list of objects"),
    ("tool_calls of strings", resp({"content": "x", "tool_calls": ["f"]}), "tool_calls is not a list of objects"),
    ("unknown finish", resp({"content": "x"}, "eos"), "unknown finish_reason 'eos'"),
    ("null finish", resp({"content": "x"}, None), "unknown finish_reason None"),
    ("usage a list", resp({"content": "x"}, usage=[1]), "usage is a list"),
    ("string count", resp({"content": "x"}, usage={"prompt_tokens": "3"}), "usage.prompt_tokens is a string"),
    ("negative count", resp({"content": "x"}, usage={"completion_tokens": -1}), "completion_tokens is a number"),
    ("float count", resp({"content": "x"}, usage={"total_tokens": 1.5}), "total_tokens is a number"),
    ("bool count", resp({"content": "x"}, usage={"total_tokens": True}), "total_tokens is a boolean"),
    ("bad details", resp({"content": "x"}, usage={"completion_tokens_details": {"reasoning_tokens": "7"}}),
     "completion_tokens_details"),
    ("model a number", {**resp({"content": "x"}), "model": 7}, "model is a number"),
]


@pytest.mark.parametrize(("body", "reason"), [(b, r) for _, b, r in BAD_BODIES], ids=[n for n, _, _ in BAD_BODIES])
def test_a_body_that_is_not_a_completion_is_a_bad_response(body: Any, reason: str) -> None:
    with pytest.raises(BadResponseError) as err:
        parse_completion(body)
    assert reason in err.value.reason
    assert isinstance(err.value, TransientError)  # retried like any transient fault
    assert 0 < len(err.value.snippet) <= SNIPPET_CHARS and err.value.snippet in str(err.value)


def test_snippet_of_a_large_body_is_capped() -> None:
    body = resp({"content": 5, "reasoning": "x" * 10_000})
    with pytest.raises(BadResponseError) as err:
        parse_completion(body)
    assert len(err.value.snippet) == SNIPPET_CHARS and err.value.snippet.endswith("…")
    assert len(str(err.value)) < 400


@pytest.mark.parametrize(("raw", "reason"), [
    (b"", "empty body"),
    (b"  \n", "empty body"),
    (b"<html>502 Bad Gateway</html>", "not JSON"),
    (b'{"choices": [{"message": {"content": "hel', "not JSON"),
    (b"[1, 2]", "a list, not an object"),
    (b"null", "null, not an object"),
    (b'"text"', "a string, not an object"),
    (b"\xff\xfe garbage", "not JSON"),
])
def test_decode_body_refuses_what_is_not_a_json_object(raw: bytes, reason: str) -> None:
    with pytest.raises(BadResponseError) as err:
        decode_body(raw)
    assert reason in err.value.reason and len(err.value.snippet) <= SNIPPET_CHARS
    if raw.strip():
        assert err.value.snippet and err.value.snippet in str(err.value)


def test_decode_body_passes_an_object_through() -> None:
    body = resp({"content": "x"})
    assert decode_body(orjson.dumps(body)) == body


def test_an_aborted_request_is_transient_not_an_answer() -> None:
    with pytest.raises(TransientError) as err:
        parse_completion(resp({"content": "partial tex"}, "abort"))
    assert not isinstance(err.value, BadResponseError) and "abort" in str(err.value)
