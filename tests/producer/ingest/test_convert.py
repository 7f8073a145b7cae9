"""Normalisation rules, reject reasons, item modes and keys."""

from __future__ import annotations

import re
from typing import Any

import orjson
import pytest

from genqueue.common.contracts import Mode
from genqueue.producer.ingest.conversation import Conversation
from genqueue.producer.ingest.convert import normalize
from genqueue.producer.ingest.items import conversation_key, item_key, make_items
from genqueue.producer.ingest.rejects import REJECT_REASONS, Rejected


def sg(*turns: tuple[object, object], **top: object) -> dict[str, Any]:
    """A ShareGPT record from (from, value) pairs."""
    return {"conversations": [{"from": f, "value": v} for f, v in turns], **top}


def msgs(value: object) -> list[dict[str, Any]]:
    return list(normalize(value).messages)


def reason(value: object) -> str:
    with pytest.raises(Rejected) as info:
        normalize(value)
    return info.value.reason


U = {"role": "user", "content": "hi"}
A = {"role": "assistant", "content": "hello"}


# --- roles -----------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["human", "user", "Human", " USER "])
def test_user_roles(name: str) -> None:
    assert msgs(sg((name, "hi"), ("gpt", "hello"))) == [U, A]


@pytest.mark.parametrize("name", ["gpt", "assistant", "chatgpt", "bing", "bard", "model", "GPT"])
def test_assistant_roles(name: str) -> None:
    assert msgs(sg(("human", "hi"), (name, "hello"))) == [U, A]


@pytest.mark.parametrize("name", ["system", "developer"])
def test_system_roles(name: str) -> None:
    assert msgs(sg((name, "be brief"), ("human", "hi"))) == [
        {"role": "system", "content": "be brief"},
        U,
    ]


def test_openai_form_and_mixed_keys() -> None:
    value = {
        "messages": [
            {"role": "system", "content": "s"},
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"},
        ],
        "id": "x",
    }
    assert msgs(value) == [{"role": "system", "content": "s"}, U, A]
    # One message may use the other form's keys: per message, not per record.
    assert msgs({"messages": [{"from": "human", "content": "hi"}, {"role": "gpt", "value": "hello"}]}) == [U, A]


def test_openai_text_parts_joined() -> None:
    value = {
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        ]
    }
    assert msgs(value) == [{"role": "user", "content": "a\nb"}]


def test_extra_keys_ignored() -> None:
    value = sg(("human", "hi"), ("gpt", "hello"), id="1", weight=1.0, loss=True)
    value["conversations"][0]["weight"] = 0
    assert msgs(value) == [U, A]


# --- system, merge ---------------------------------------------------------------------


def test_top_level_system_first_and_empty_systems_dropped() -> None:
    value = sg(("system", ""), ("human", "hi"), ("system", "  "), ("gpt", "hello"), system="top")
    assert msgs(value) == [{"role": "system", "content": "top"}, U, A]
    assert msgs(sg(("human", "hi"), system="")) == [U]
    assert msgs(sg(("human", "hi"), system=None)) == [U]


def test_merge_consecutive_same_role() -> None:
    value = sg(("human", "a"), ("human", "b"), ("gpt", "c"), ("gpt", "d"), ("human", "e"))
    assert msgs(value) == [
        {"role": "user", "content": "a\n\nb"},
        {"role": "assistant", "content": "c\n\nd"},
        {"role": "user", "content": "e"},
    ]


def test_merge_top_level_system_with_leading_system() -> None:
    assert msgs(sg(("system", "b"), ("human", "hi"), system="a"))[0] == {
        "role": "system",
        "content": "a\n\nb",
    }


# --- tools -----------------------------------------------------------------------------


def test_function_call_and_observation() -> None:
    value = sg(
        ("human", "weather?"),
        ("function_call", '{"name": "get_weather", "arguments": {"city": "Paris"}}'),
        ("observation", '{"temp": 20}'),
        ("gpt", "20 degrees"),
        ("human", "and Rome?"),
        ("function_call", '[{"name": "get_weather", "arguments": {"city": "Rome"}}, {"name": "now"}]'),
        ("observation", "21"),
        ("observation", "noon"),
        ("gpt", "21 at noon"),
        tools='[{"name": "get_weather", "parameters": {"type": "object"}}]',
    )
    conv = normalize(value)
    assert list(conv.messages) == [
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "call_0", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}},
            ],
        },
        {"role": "tool", "content": '{"temp": 20}', "tool_call_id": "call_0"},
        {"role": "assistant", "content": "20 degrees"},
        {"role": "user", "content": "and Rome?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city":"Rome"}'}},
                {"id": "call_2", "type": "function", "function": {"name": "now", "arguments": "{}"}},
            ],
        },
        {"role": "tool", "content": "21", "tool_call_id": "call_1"},
        {"role": "tool", "content": "noon", "tool_call_id": "call_2"},
        {"role": "assistant", "content": "21 at noon"},
    ]
    # LLaMA-Factory's bare function specs become OpenAI tools.
    assert conv.tools == [
        {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    ]


def test_assistant_text_then_function_call_merge() -> None:
    value = sg(("human", "q"), ("gpt", "let me look"), ("function_call", '{"name": "f", "arguments": "{}"}'))
    assert msgs(value)[1] == {
        "role": "assistant",
        "content": "let me look",
        "tool_calls": [{"id": "call_0", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
    }
    # Text after a call is a new message: merging would reorder it before the call.
    value = sg(("human", "q"), ("function_call", '{"name": "f"}'), ("gpt", "done"))
    assert [m["role"] for m in msgs(value)] == ["user", "assistant", "assistant"]


def test_tool_without_call_gets_unknown_id() -> None:
    assert msgs(sg(("human", "q"), ("observation", "r")))[1] == {
        "role": "tool",
        "content": "r",
        "tool_call_id": "call_unknown",
    }


def test_openai_tool_calls_keep_ids() -> None:
    value = {
        "messages": [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "abc", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}},
                {"type": "function", "function": {"name": "g", "arguments": {"y": 2}}},
            ]},
            {"role": "tool", "tool_call_id": "abc", "content": "1"},
            {"role": "tool", "content": "2"},
        ],
        "tools": [{"type": "function", "function": {"name": "f"}}],
    }
    out = msgs(value)
    assert out[1]["content"] == ""
    assert [c["id"] for c in out[1]["tool_calls"]] == ["abc", "call_1"]
    assert out[1]["tool_calls"][1]["function"]["arguments"] == '{"y":2}'
    assert out[2]["tool_call_id"] == "abc"
    assert out[3]["tool_call_id"] == "call_1"


@pytest.mark.parametrize("tools", [None, "", "  ", []])
def test_empty_tools_are_none(tools: object) -> None:
    assert normalize(sg(("human", "hi"), tools=tools)).tools is None


# --- rejects ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ([1, 2], "not_object"),
        ("text", "not_object"),
        ({"id": 1}, "no_conversation"),
        ({"conversations": "hi"}, "no_conversation"),
        ({"messages": {"role": "user"}}, "no_conversation"),
        ({"conversations": []}, "empty_conversation"),
        (sg(("robot", "hi")), "unknown_role"),
        (sg((7, "hi")), "unknown_role"),
        ({"conversations": [{"value": "hi"}]}, "missing_role"),
        ({"conversations": ["hi"]}, "missing_role"),
        (sg(("human", "  ")), "empty_message"),
        (sg(("human", None)), "empty_message"),
        (sg(("human", "hi"), ("gpt", ""), ("human", "again")), "empty_message"),
        (sg(("human", 5)), "non_text_message"),
        (sg(("human", {"text": "hi"})), "non_text_message"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "non_text_message"),
        ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "non_text_message"),
        (sg(("human", "hi"), system=["x", 1]), "non_text_message"),
        (sg(("gpt", "hello")), "no_user_turn"),
        (sg(("system", "s")), "no_user_turn"),
        (sg(("human", "hi"), tools="not json"), "invalid_tools"),
        (sg(("human", "hi"), tools='{"name": "f"}'), "invalid_tools"),
        (sg(("human", "hi"), tools=[1]), "invalid_tools"),
        (sg(("human", "hi"), tools=[{"description": "no name"}]), "invalid_tools"),
        (sg(("human", "hi"), tools=[{"name": "f", "big": 2**70}]), "invalid_tools"),
        (sg(("human", "hi"), ("function_call", "not json")), "invalid_tools"),
        (sg(("human", "hi"), ("function_call", '{"arguments": {}}')), "invalid_tools"),
        (sg(("human", "hi"), ("function_call", "[]")), "invalid_tools"),
        ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "tool_calls": "x"}]}, "invalid_tools"),
        (sg(("human", "a\ud800b")), "invalid_unicode"),
        (sg(("human", "hi"), system="\udfff"), "invalid_unicode"),
        (sg(("human", "hi"), ("function_call", {"name": "f", "arguments": {"k": "\ud800"}})), "invalid_unicode"),
        (sg(("human", "hi"), tools=[{"name": "f", "description": "\ud800"}]), "invalid_unicode"),
    ],
)
def test_reject_reasons(value: object, expected: str) -> None:
    assert reason(value) == expected


def test_every_reason_has_a_stable_name() -> None:
    assert len(set(REJECT_REASONS)) == len(REJECT_REASONS)
    assert {"too_long", "tool_turn_first", "record_too_large", "invalid_json"} <= set(REJECT_REASONS)
    assert all(re.fullmatch(r"[a-z_]+", r) for r in REJECT_REASONS)


def test_rejected_carries_reason_and_detail() -> None:
    with pytest.raises(Rejected) as info:
        normalize(sg(("robot", "hi")))
    assert info.value.reason == "unknown_role"
    assert "robot" in info.value.detail


def test_text_chars_counts_contents_and_arguments() -> None:
    conv = normalize(sg(("human", "abc"), ("function_call", '{"name": "f", "arguments": "{}"}'), system="xy"))
    assert conv.text_chars() == 2 + 3 + 0 + 2


# --- items -----------------------------------------------------------------------------

SYS = {"role": "system", "content": "s"}
U1, U2, U3 = ({"role": "user", "content": f"u{i}"} for i in (1, 2, 3))
A1, A2, A3 = ({"role": "assistant", "content": f"a{i}"} for i in (1, 2, 3))


@pytest.fixture
def three_turns() -> Conversation:
    return normalize(sg(("human", "u1"), ("gpt", "a1"), ("human", "u2"), ("gpt", "a2"),
                        ("human", "u3"), ("gpt", "a3"), system="s"))


def test_mode_first(three_turns: Conversation) -> None:
    [item] = make_items(three_turns, Mode.FIRST, 7)
    assert item["messages"] == [SYS, U1]
    assert (item["index"], item["turn"]) == (7, 0)
    assert "tools" not in item and "note" not in item


def test_mode_last(three_turns: Conversation) -> None:
    [item] = make_items(three_turns, Mode.LAST, 7)
    assert item["messages"] == [SYS, U1, A1, U2, A2, U3]
    assert item["turn"] == 2


def test_mode_each(three_turns: Conversation) -> None:
    items = make_items(three_turns, Mode.EACH, 7)
    assert [i["messages"] for i in items] == [
        [SYS, U1],
        [SYS, U1, A1, U2],
        [SYS, U1, A1, U2, A2, U3],
    ]
    assert [i["turn"] for i in items] == [0, 1, 2]
    assert len({i["key"] for i in items}) == 3


def test_mode_regenerate(three_turns: Conversation) -> None:
    [item] = make_items(three_turns, Mode.REGENERATE, 7)
    assert item["messages"] == [SYS, U1, U2, U3]
    assert item["turn"] is None
    assert "note" not in item
    orjson.dumps(item)  # plain JSON


def test_regenerate_keeps_the_recorded_tool_turns() -> None:
    """The item carries each recorded call and its results (the consumer splices them in when
    the target calls the same); the original answers are dropped as ever."""
    conv = normalize(sg(("human", "u1"), ("gpt", "a1"), ("human", "u2"),
                        ("function_call", '{"name": "f"}'), ("observation", "r"), ("gpt", "a2"),
                        ("human", "u3"), ("gpt", "a3"), tools=[{"name": "f"}]))
    [item] = make_items(conv, Mode.REGENERATE, 0)
    call = {"role": "assistant", "content": "",
            "tool_calls": [{"id": "call_0", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}
    assert item["messages"] == [U1, {"role": "user", "content": "u2"}, call,
                                {"role": "tool", "content": "r", "tool_call_id": "call_0"},
                                {"role": "user", "content": "u3"}]
    assert "note" not in item
    assert item["tools"] == [{"type": "function", "function": {"name": "f"}}]


def test_regenerate_parallel_results_in_any_order_are_kept() -> None:
    conv = normalize({"messages": [
        {"role": "user", "content": "u1"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "a", "type": "function", "function": {"name": "f", "arguments": "{}"}},
            {"id": "b", "type": "function", "function": {"name": "g", "arguments": "{}"}}]},
        {"role": "tool", "content": "rb", "tool_call_id": "b"}, {"role": "tool", "content": "ra", "tool_call_id": "a"},
        {"role": "assistant", "content": "done"}]})
    [item] = make_items(conv, Mode.REGENERATE, 0)
    assert [m["role"] for m in item["messages"]] == ["user", "assistant", "tool", "tool"]
    assert "note" not in item


def test_regenerate_stops_at_a_tool_turn_without_its_results() -> None:
    """A call whose results are not all recorded cannot be replayed: cut before it, as before."""
    conv = normalize({"messages": [
        {"role": "user", "content": "u1"}, {"role": "assistant", "content": "a1"},
        {"role": "user", "content": "u2"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "a", "type": "function", "function": {"name": "f", "arguments": "{}"}},
            {"id": "b", "type": "function", "function": {"name": "g", "arguments": "{}"}}]},
        {"role": "tool", "content": "ra", "tool_call_id": "a"},
        {"role": "assistant", "content": "a2"}, {"role": "user", "content": "u3"}]})
    [item] = make_items(conv, Mode.REGENERATE, 0)
    assert item["messages"] == [U1, {"role": "user", "content": "u2"}]
    assert item["note"] == "stopped_at_tool_turn"


def test_regenerate_key_unchanged_without_tool_turns(three_turns: Conversation) -> None:
    """Items of conversations without tool calls keep the keys of earlier runs."""
    [item] = make_items(three_turns, Mode.REGENERATE, 7)
    assert item["key"] == item_key(Mode.REGENERATE, [SYS, U1, U2, U3], None)


def test_regenerate_tool_turn_first() -> None:
    conv = normalize(sg(("system", "s"), ("function_call", '{"name": "f"}'), ("observation", "r"),
                        ("human", "u1"), ("gpt", "a1")))
    with pytest.raises(Rejected) as info:
        make_items(conv, Mode.REGENERATE, 0)
    assert info.value.reason == "tool_turn_first"
    # The other modes keep the original history, tool turns included.
    [item] = make_items(conv, Mode.LAST, 0)
    assert [m["role"] for m in item["messages"]] == ["system", "assistant", "tool", "user"]


def test_unknown_mode() -> None:
    with pytest.raises(ValueError, match="unknown mode"):
        make_items(normalize(sg(("human", "hi"))), "all", 0)  # type: ignore[arg-type]


def test_keys_stable_and_mode_dependent(three_turns: Conversation) -> None:
    same = normalize(sg(("human", "u1"), ("gpt", "a1"), ("human", "u2"), ("gpt", "a2"),
                        ("human", "u3"), ("gpt", "a3"), system="s", id="other"))
    keys = {}
    for mode in Mode:
        a = make_items(three_turns, mode, 0)[-1]
        b = make_items(same, mode, 99)[-1]
        assert a["key"] == b["key"]  # identical items from different records share a key
        assert re.fullmatch(r"[0-9a-f]{32}", a["key"])
        assert a["key"] == item_key(mode, a["messages"], None)
        keys[mode] = a["key"]
    # first and each/last differ in messages; every mode is also part of the key
    assert len(set(keys.values())) == len(Mode)
    assert item_key(Mode.FIRST, [U1], None) != item_key(Mode.EACH, [U1], None)
    assert item_key(Mode.FIRST, [U1], None) != item_key(Mode.FIRST, [U1], [{"type": "function"}])
    # A known value guards against an accidental change of the key recipe, which would
    # orphan every result already produced under the old keys.
    assert item_key(Mode.REGENERATE, [{"role": "user", "content": "hi"}], None) == (
        "0d26507d295a25fca2a5edc8dd29b5db"
    )
    assert item_key(Mode.FIRST, [{"content": "hi", "role": "user"}], None) == item_key(
        Mode.FIRST, [{"role": "user", "content": "hi"}], None
    )


def test_conversation_key(three_turns: Conversation) -> None:
    key = conversation_key(three_turns)
    assert isinstance(key, bytes) and len(key) == 16
    assert key == conversation_key(normalize(sg(("human", "u1"), ("gpt", "a1"), ("human", "u2"),
                                                ("gpt", "a2"), ("human", "u3"), ("gpt", "a3"),
                                                system="s", weight=3)))
    assert key != conversation_key(normalize(sg(("human", "u1"), ("gpt", "a1"))))


def test_trailing_empty_assistant_turn_is_dropped_not_rejected() -> None:
    from genqueue.producer.ingest.convert import normalize

    conv = normalize({"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": ""}]})
    assert [m["role"] for m in conv.messages] == ["user"]


def test_regenerate_first_answer_a_tool_call_is_kept() -> None:
    """As the README says: a first *answer* that calls a tool is not tool_turn_first; the item
    holds that call and its result after the user turn, and the user turns after them."""
    conv = normalize(sg(("human", "u1"), ("function_call", '{"name": "f"}'), ("observation", "r"),
                        ("gpt", "a1"), ("human", "u2"), ("gpt", "a2"), tools=[{"name": "f"}]))
    [item] = make_items(conv, Mode.REGENERATE, 0)
    assert [m["role"] for m in item["messages"]] == ["user", "assistant", "tool", "user"]
    assert "note" not in item
