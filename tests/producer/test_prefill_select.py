"""Which of a source run's answers a capture pass captures (producer/prefill/select.py), the bytes a
budget counts (common/prefill.py), and a pass's item as the contract reads it (pure: no I/O)."""

from __future__ import annotations

from typing import Any

import pytest

from genqueue.common.capture import CaptureDtype
from genqueue.common.contracts import ItemError, parse_item
from genqueue.common.errors import UserError
from genqueue.common.prefill import PrefillChoice, PrefillSettings, bytes_per_token, prefill_key
from genqueue.common.records import share_prompts
from genqueue.producer.prefill.select import choose, one_per_key, source_rows


def rec(key: str, ids: tuple[list[int], list[int]] | None = ([1, 2], [3, 4]), *, outcome: str = "finished",
        attempt: int = 1, spec: tuple[int, int] | None = None, **extra: Any) -> dict[str, Any]:
    r: dict[str, Any] = {"key": key, "index": 0, "turn": None, "outcome": outcome, "attempt": attempt,
                         "content": "x", "messages": [{"role": "user", "content": "q"}], "usage": {}, **extra}
    if ids is not None:
        r["token_ids"] = {"prompt": ids[0], "completion": ids[1]}
    if spec is not None:
        r["spec"] = {"k": 3, "steps": 1, "drafted": spec[0], "accepted": spec[1], "hist": [0, 0, 0, 1]}
    return r


def turn(n: int, prompt: list[int], completion: list[int], outcome: str = "finished", step: int = 0,
         spec: tuple[int, int] | None = None) -> dict[str, Any]:
    t: dict[str, Any] = {"turn": n, "content": "a", "reasoning": None, "outcome": outcome, "usage": {},
                         "token_ids": {"prompt": prompt, "completion": completion}}
    if step:
        t["step"] = step
    if spec is not None:
        t["spec"] = {"k": 3, "steps": 1, "drafted": spec[0], "accepted": spec[1], "hist": [0, 0, 0, 1]}
    return t


def test_one_copy_per_key_is_the_one_export_keeps() -> None:
    a_err = {"key": "a", "error": {"class": "permanent"}}
    a_cut = rec("a", outcome="cut_in_answer")
    a_late = rec("a", attempt=2, ids=([9], [9]))
    a_copy = rec("a", copy=True, ids=([8], [8]))
    a_ok = rec("a", ids=([1], [1]))
    kept = one_per_key([a_err, a_cut, a_late, a_copy, a_ok, rec("b")])
    assert [r["key"] for r in kept] == ["a", "b"] and kept[0] is a_ok


def test_each_finished_answer_with_ids_is_a_row_named_as_generation_capture_names_it() -> None:
    single = source_rows([rec("k1", spec=(10, 2)), rec("k2", outcome="cut_in_answer"), rec("k3", ids=None),
                          {"key": "k4", "error": {"class": "permanent"}}], regenerate=False)
    assert [(r.row, r.token_ids, r.rate) for r in single.rows] == [("k1", [1, 2, 3, 4], 0.2)]
    assert (single.records, single.without_ids) == (4, 1)
    turns = share_prompts([turn(0, [1, 2], [3, 4], spec=(4, 4)), turn(1, [1, 2, 3, 4, 5], [6]),  # type: ignore[list-item]
                           turn(1, [1, 2, 3, 4, 5, 6, 7], [8], step=1), turn(2, [1, 2, 3, 4, 5, 6, 7, 8, 9], [10],
                                                                              outcome="cut_in_answer")])
    msgs = [{"role": "user", "content": "q"}] + [{"role": "assistant", "content": "a"}] * 4
    conv = {"key": "c", "index": 0, "turn": None, "outcome": "finished", "messages": msgs, "turns": turns}
    rows = source_rows([conv], regenerate=True).rows
    assert [(r.row, r.token_ids, r.turn, r.rate) for r in rows] == [
        ("c:0", [1, 2, 3, 4], 0, 1.0), ("c:1", [1, 2, 3, 4, 5, 6], 1, None), ("c:1.1", [1, 2, 3, 4, 5, 6, 7, 8], 1, None)]


def test_acceptance_puts_the_drafters_worst_rows_first_and_a_budget_takes_what_fits() -> None:
    rows = source_rows([rec("a", spec=(10, 9)), rec("b", spec=(10, 1)), rec("c"), rec("d", ([1] * 10, [2]), spec=(10, 5))],
                       regenerate=False).rows
    assert [r.row for r in choose(rows, PrefillChoice.ALL, None, None)] == ["a", "b", "c", "d"]
    assert [r.row for r in choose(rows, PrefillChoice.ACCEPTANCE, None, None)] == ["b", "d", "a", "c"]
    # 4 tokens a row but d's 11, at 10 bytes a token: a budget of 90 takes b (40), skips d (110), takes a (40)
    assert [r.row for r in choose(rows, PrefillChoice.ACCEPTANCE, 90, 10)] == ["b", "a"]
    assert [r.row for r in choose(rows, PrefillChoice.ACCEPTANCE, 39, 10)] == []


def test_bytes_per_token_is_what_a_stored_row_holds_a_token() -> None:
    assert bytes_per_token(4, 5120, CaptureDtype.FP8) == 4 * 5120 + 4 + 8  # fp8 codes, a float32 scale, the id
    assert bytes_per_token(4, 5120, CaptureDtype.BF16) == 4 * 5120 * 2 + 8


def test_a_budget_without_a_hidden_size_is_refused() -> None:
    with pytest.raises(UserError, match="needs the model's hidden size"):
        PrefillSettings(source="s", budget=10)
    with pytest.raises(UserError, match="unknown --capture-by"):
        PrefillSettings(source="s", by="random")  # type: ignore[arg-type]


def test_a_pass_item_is_read_by_the_contract_with_no_messages() -> None:
    item = {"key": prefill_key("k:0"), "index": 0, "turn": 0, "messages": [], "prefill": {"row": "k:0", "token_ids": [1, 2]}}
    assert parse_item(item, max_chars=10) is item
    for bad, said in (({"row": "", "token_ids": [1]}, "row id"), ({"row": "r", "token_ids": []}, "token ids"),
                      ({"row": "r", "token_ids": [1, -2]}, "token ids"), ({"row": "r", "token_ids": [True]}, "token ids")):
        with pytest.raises(ItemError, match=said):
            parse_item({**item, "prefill": bad}, max_chars=10)
    with pytest.raises(ItemError, match="no messages"):
        parse_item({**item, "messages": [{"role": "user", "content": "q"}]}, max_chars=10)
    assert prefill_key("k:0") != prefill_key("k:1") and len(prefill_key("k")) == 32
