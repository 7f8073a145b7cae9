"""What a job carries (consumer/work/intake.py): items that do not parse are refused with the reason."""

from __future__ import annotations

from typing import Any

import pytest

from genqueue.consumer.work.intake import InvalidJob, parse_items
from tests.doubles import item


# --- what a job carries ----------------------------------------------------------------------
@pytest.mark.parametrize("args,kwargs,why", [
    ("not a list", {}, "not a list of items"),
    ([[item(0)], [item(1)]], {}, "not a list of items"),
    ([[]], {}, "no items"),
    ([[item(0)]], {"x": 1}, "keyword arguments"),
    ([["a string"]], {}, "not an object"),
    ([[{**item(0), "key": "zz"}]], {}, "key"),
    ([[{**item(0), "index": "7"}]], {}, "index"),
    ([[{**item(0), "index": True}]], {}, "index"),
    ([[{**item(0), "turn": 1.5}]], {}, "turn"),
    ([[{**item(0), "messages": []}]], {}, "messages"),
    ([[{**item(0), "messages": [{"role": "wizard", "content": "x"}]}]], {}, "role"),
    ([[{**item(0), "messages": [{"role": "user", "content": 42}]}]], {}, "content"),
    ([[{**item(0), "messages": [{"role": "system", "content": "x"}]}]], {}, "no user message"),
    ([[{**item(0), "tools": "calculator"}]], {}, "tools"),
    ([[{**item(0), "note": 3}]], {}, "note"),
    ([[item(0, "x" * 101)]], {}, "over the limit"),
])
def test_a_job_whose_items_do_not_parse_is_refused(args: Any, kwargs: Any, why: str) -> None:
    with pytest.raises(InvalidJob, match=why):
        parse_items(args, kwargs, max_chars=100)


def test_valid_items_parse() -> None:
    items = [item(0), {**item(1), "turn": 2, "tools": [{"type": "function"}], "note": "stopped_at_tool_turn"}]
    assert parse_items([items], {}, max_chars=100) == items
    assert parse_items((items,), None, max_chars=100) == items
