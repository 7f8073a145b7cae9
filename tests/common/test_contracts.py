"""The contract's typed Item reader: what a job's items must be before a request is made of them
(consumer intake reads every job through it; tests/consumer/test_parts.py covers its refusals)."""

from __future__ import annotations

from typing import Any

import pytest

from genqueue.common.contracts import ItemError, Role, parse_item

ITEM: dict[str, Any] = {"key": "ab" * 16, "index": 0, "turn": None,
                        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
                                     {"role": "assistant", "content": None, "tool_calls": [{"id": "call_0"}]},
                                     {"role": "tool", "content": "4", "tool_call_id": "call_0"}]}


def test_an_item_reads_as_itself() -> None:
    assert parse_item(ITEM, max_chars=100) is ITEM


@pytest.mark.parametrize("role", [r.value for r in Role])
def test_every_role_of_the_contract_is_known(role: str) -> None:
    messages = [{"role": "user", "content": "hi"}, {"role": role, "content": "x"}]
    assert parse_item({**ITEM, "messages": messages}, max_chars=100)["messages"][1]["role"] == role


@pytest.mark.parametrize("value,why", [
    ({**ITEM, "messages": [{"role": "developer", "content": "x"}, {"role": "user", "content": "hi"}]},
     "item 7: message 0 has no known role"),
    ({**ITEM, "messages": [{"role": "user", "content": None}]}, "item 7: message 0 content is not a string"),
    ({**ITEM, "turn": True}, "item 7: turn is not an integer or null"),
    ({**ITEM, "messages": [{"role": "user", "content": "x" * 11}]},
     "item 7: 11 characters of messages, over the limit of 10"),
    ([ITEM], "item 7 is a list, not an object"),
])
def test_a_bad_item_names_where_it_is_and_which_field(value: Any, why: str) -> None:
    with pytest.raises(ItemError) as e:
        parse_item(value, max_chars=10 if "limit" in why else 100, where="item 7")
    assert str(e.value) == why
