"""The export's quality gates, one by one: each flags what it names and nothing else."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import orjson
import pytest

from genqueue.common.records import ResultRecord
from genqueue.producer.export.gates import (
    BIT,
    MIN_REPEATS,
    REASONS,
    Duplicates,
    FlagReason,
    has_thinking_marker,
    is_empty,
    loop_period,
    reasons,
    record_flags,
)

SAMPLE = Path(__file__).resolve().parents[3] / "samples" / "sample.jsonl"


def rec(content: str, reasoning: str | None = None, tool_calls: list[Any] | None = None,
        turns: list[dict[str, Any]] | None = None) -> ResultRecord:
    r: dict[str, Any] = {"key": "00" * 16, "index": 0, "turn": None, "content": content, "reasoning": reasoning,
                         "tool_calls": tool_calls or [], "outcome": "finished"}
    if turns is not None:
        r["turns"] = turns
    return r  # type: ignore[return-value]


def prose(n_words: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    words = ["the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "with", "was", "on", "be", "by", "this", "are", "from", "at", "or", "model", "data"]
    return " ".join(rng.choice(words) for _ in range(n_words))


# --- thinking markers -------------------------------------------------------------------------
@pytest.mark.parametrize("content", ["<think>\nhmm</think>\n\nThe answer is 4.", "The answer is 4.</think>",
                                     "<THINK>x", "<thinking>plan</thinking> done", "<reasoning>r</reasoning>",
                                     "<seed:think>a</seed:think>b", "<|channel|>analysis<|message|>x"])
def test_a_thinking_tag_left_in_the_content_is_flagged(content: str) -> None:
    assert has_thinking_marker(content)
    assert record_flags(rec(content))[0] == BIT[FlagReason.THINKING_MARKER]


@pytest.mark.parametrize("content", ["Use a <div> or <span>.", "I think 3 < 4 and 5 > 2.", "<thinker> is a tag",
                                     "think about </thin> this", ""])
def test_text_that_only_resembles_a_tag_is_not_a_marker(content: str) -> None:
    assert not has_thinking_marker(content)


def test_a_marker_in_the_thinking_itself_is_not_flagged() -> None:
    assert record_flags(rec("4", reasoning="the user wrote <think> in the prompt"))[0] == 0


# --- empty answers ----------------------------------------------------------------------------
def test_a_blank_answer_is_empty_unless_it_called_a_tool() -> None:
    assert is_empty("", []) and is_empty(" \n\t", None)
    assert not is_empty("", [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}])
    assert not is_empty("ok", [])
    flags, digest = record_flags(rec("  ", reasoning="I thought a lot"))
    assert flags == BIT[FlagReason.EMPTY_ANSWER] and digest != 0
    assert record_flags(rec(""))[1] == 0  # nothing generated: not compared for duplicates


def test_every_regenerated_turn_is_gated() -> None:
    turns = [{"turn": 0, "content": "", "reasoning": None}, {"turn": 1, "content": "fine", "reasoning": None}]
    assert record_flags(rec("fine", turns=turns))[0] == BIT[FlagReason.EMPTY_ANSWER]
    ok = [{"turn": 0, "content": "a", "reasoning": None}, {"turn": 1, "content": "b", "reasoning": None}]
    assert record_flags(rec("b", turns=ok))[0] == 0


# --- repetition loops -------------------------------------------------------------------------
@pytest.mark.parametrize("unit", ["!", "the ", "I think ", "No, wait. Let me check again. ",
                                  "The answer depends on the cache size and on the batch. " * 3])
def test_an_answer_ending_in_a_loop_is_flagged(unit: str) -> None:
    text = prose(40) + " " + unit * (2100 // len(unit) + 1)
    assert loop_period(text) == len(unit) or len(unit) % loop_period(text) == 0
    assert record_flags(rec(text))[0] == BIT[FlagReason.REPETITION_LOOP]


def test_a_loop_in_the_thinking_is_flagged_too() -> None:
    assert record_flags(rec("4", reasoning="Hmm, wait. " * 300))[0] == BIT[FlagReason.REPETITION_LOOP]


def test_thresholds_a_short_or_few_times_repeated_tail_is_no_loop() -> None:
    assert loop_period("ha" * 100) == 0  # 200 characters: under the 256 span
    assert loop_period("ha" * 128) == 2
    sentence = "This is one fairly long sentence that a model may well say twice in a row, " * 2
    para = prose(60, seed=3) + " "
    assert len(para) * (MIN_REPEATS - 1) < 2048
    assert loop_period(prose(400) + sentence) == 0
    assert loop_period(prose(400) + para * (MIN_REPEATS - 1)) == 0  # three times is not a loop
    assert loop_period(prose(400) + para * (2048 // len(para) + 1)) == len(para)
    assert loop_period("x" * 255) == 0 and loop_period("") == 0


def test_the_loop_must_reach_the_end() -> None:
    assert loop_period("the " * 200 + prose(100)) == 0


def test_no_loop_in_random_prose_code_or_the_bundled_sample() -> None:
    for seed in range(50):
        assert loop_period(prose(2000, seed)) == 0
    code = "\n".join(f"    x{i} = compute(x{i - 1}, {i})" for i in range(1, 300))
    assert loop_period(code) == 0
    table = "| a | b |\n|---|---|\n" + "".join(f"| {i} | {i * i} |\n" for i in range(200))
    assert loop_period(table) == 0
    texts = []
    for line in SAMPLE.read_bytes().removeprefix(b"\xef\xbb\xbf").splitlines():
        try:
            row = orjson.loads(line)
        except orjson.JSONDecodeError:
            continue  # the sample holds a few lines enqueue rejects
        if not isinstance(row, dict):
            continue
        for m in row.get("messages") or row.get("conversations") or []:
            content = m.get("content", m.get("value"))
            if isinstance(content, str):
                texts.append(content)
    assert texts
    assert [t[:60] for t in texts if loop_period(t) or has_thinking_marker(t)] == []


# --- duplicates -------------------------------------------------------------------------------
def test_the_same_generated_text_has_the_same_digest_and_thinking_counts() -> None:
    a, b = record_flags(rec("4", "2+2")), record_flags(rec("4", "2+2"))
    assert a == b and a[1] != 0
    assert record_flags(rec("4", "two plus two"))[1] != a[1]
    assert record_flags(rec("4"))[1] != a[1]
    # the split between thinking and answer matters: "ab" + "" is not "a" + "b"
    assert record_flags(rec("b", "a"))[1] != record_flags(rec("ab", ""))[1]


def test_duplicates_first_kept_later_flagged_within_and_across_partitions() -> None:
    d = Duplicates()
    assert d.check([1, 2, 1, 0, 0, 3]) == [False, False, True, False, False, False]
    assert d.check([3, 4, 4, 0, 2]) == [True, False, True, False, True]
    assert d.check([]) == []
    assert d.check([0]) == [False]
    assert d.check([5, 2**64 - 1, 2**64 - 1]) == [False, False, True]
    grown = Duplicates(capacity=4)  # grows past its first table, keeping what it held
    assert grown.check(list(range(1, 1000))) == [False] * 999 and len(grown) == 999
    assert grown.check([1, 500, 999, 1000]) == [True, True, True, False]


def test_reasons_read_back_in_order() -> None:
    assert reasons(0) == []
    every = sum(BIT.values())
    assert reasons(every) == [r.value for r in REASONS]
    assert reasons(BIT[FlagReason.DUPLICATE_ANSWER] | BIT[FlagReason.EMPTY_ANSWER]) == [
        "empty_answer", "duplicate_answer"]
    assert max(BIT.values()) < 256  # one byte of the partition header
