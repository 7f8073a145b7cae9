"""An answer's speculative-decoding figures (consumer/answer/spec.py): read from vLLM's
`metrics.speculative_decoding`, checked, kept compactly on the record; advisory (pure: no server)."""

from __future__ import annotations

from typing import Any

import pytest

from genqueue.common.contracts import ChatMessage
from genqueue.common.records import SpecFigures, TurnRecord, spec_mean_length, spec_rate, sum_spec
from genqueue.consumer.answer import records
from genqueue.consumer.answer.completion import parse_completion
from genqueue.consumer.answer.spec import read_spec, speculation_note
from tests.consumer.test_records import CTX, ITEM

#: The block vLLM 0.32 returned for one answer (issue 33): 3.75 tokens per step, 11 of 12 accepted.
VLLM_BLOCK = {"mean_acceptance_length": 3.75, "draft_acceptance_rate": 0.9166666666666666,
              "acceptance_histogram": [0, 0, 1, 3], "num_spec_steps": 4, "num_accepted_draft_tokens": 11,
              "num_draft_tokens": 12, "num_spec_tokens": 3, "per_step_accepted": None, "per_step_drafted": None}
FIGURES: SpecFigures = {"k": 3, "steps": 4, "drafted": 12, "accepted": 11, "hist": [0, 0, 1, 3]}


def body(spec: Any = VLLM_BLOCK, **metrics: Any) -> dict[str, Any]:
    return {"model": "m", "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"},
                                       "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8},
            "metrics": {"time_to_first_token_ms": None, "speculative_decoding": spec, **metrics}}


def test_vllms_block_becomes_compact_counts_and_the_rates_are_derived_from_them() -> None:
    turn = parse_completion(body())
    assert turn.spec == FIGURES and turn.spec_ignored is None
    assert spec_mean_length(FIGURES) == pytest.approx(VLLM_BLOCK["mean_acceptance_length"])
    assert spec_rate(FIGURES) == pytest.approx(VLLM_BLOCK["draft_acceptance_rate"])


def test_detailed_level_and_a_request_with_no_step_read_as_counts() -> None:
    detailed = {**VLLM_BLOCK, "per_step_accepted": [2, 3, 3, 3], "per_step_drafted": [3, 3, 3, 3]}
    assert read_spec(body(detailed)) == (FIGURES, None)
    # vLLM answered a request that never reached a verify step so (seen on the tier's tiny model)
    none: dict[str, Any] = {**VLLM_BLOCK, "acceptance_histogram": [0, 0, 0, 0], "num_spec_steps": 0,
                            "num_accepted_draft_tokens": 0, "num_draft_tokens": 0, "mean_acceptance_length": 1.0}
    spec, why = read_spec(body(none))
    assert why is None and spec is not None and spec_mean_length(spec) is None and spec_rate(spec) is None


@pytest.mark.parametrize("resp", [
    {"choices": []},  # no metrics at all: an engine that does not speculate
    {"metrics": None},
    {"metrics": {"time_to_first_token_ms": 3.0}},  # metrics, no speculation
    {"metrics": {"speculative_decoding": None}},  # vLLM's null for n > 1
])
def test_no_figures_is_nothing_recorded_and_nothing_said(resp: dict[str, Any]) -> None:
    assert read_spec(resp) == (None, None)
    assert parse_completion({**body(), **resp} if "choices" not in resp else body(None)).spec is None


@pytest.mark.parametrize(("block", "why"), [
    ("3.75", "not an object"),
    ({**VLLM_BLOCK, "num_spec_tokens": "3"}, "num_spec_tokens is '3', not a count"),
    ({**VLLM_BLOCK, "num_spec_steps": -1}, "num_spec_steps is -1"),
    ({**VLLM_BLOCK, "num_draft_tokens": True}, "num_draft_tokens is True"),
    ({**VLLM_BLOCK, "num_accepted_draft_tokens": 1.5}, "num_accepted_draft_tokens is 1.5"),
    ({**VLLM_BLOCK, "num_spec_tokens": 0}, "not 1 to 64"),
    ({**VLLM_BLOCK, "acceptance_histogram": None}, "not a list of counts"),
    ({**VLLM_BLOCK, "acceptance_histogram": [0, 0, 1, "3"]}, "not a list of counts"),
    ({**VLLM_BLOCK, "acceptance_histogram": [0, 1, 3]}, "3 entries, not num_spec_tokens + 1 = 4"),
    ({**VLLM_BLOCK, "num_spec_steps": 5}, "counts 4 steps, num_spec_steps says 5"),
    ({**VLLM_BLOCK, "num_accepted_draft_tokens": 12}, "accepts 11 drafts, num_accepted_draft_tokens says 12"),
    ({**VLLM_BLOCK, "num_draft_tokens": 10}, "11 is more than num_draft_tokens 10"),
    ({**VLLM_BLOCK, "num_draft_tokens": 13}, "13 is more than num_spec_tokens x num_spec_steps = 12"),
])
def test_a_malformed_block_is_ignored_with_its_reason_and_the_answer_is_kept(block: Any, why: str) -> None:
    turn = parse_completion(body(block))
    assert turn.content == "ok" and turn.spec is None
    assert turn.spec_ignored is not None and why in turn.spec_ignored
    bad_metrics = parse_completion({**body(), "metrics": [1]})
    assert bad_metrics.spec is None and bad_metrics.spec_ignored == "metrics is not an object"


def test_a_result_record_carries_its_answers_figures_and_none_when_there_are_none() -> None:
    base = records.record_base(CTX, ITEM, 1, [{"role": "user", "content": "hi"}])
    rec = records.result_record(base, parse_completion(body()), "m")
    assert rec["spec"] == FIGURES
    assert "spec" not in records.result_record(base, parse_completion(body(None)), "m")


def test_every_regenerated_turn_carries_its_own_and_the_conversation_their_sum() -> None:
    other: dict[str, Any] = {**VLLM_BLOCK, "acceptance_histogram": [2, 1, 0, 0], "num_spec_steps": 3,
                             "num_accepted_draft_tokens": 1, "num_draft_tokens": 7}
    k2: dict[str, Any] = {**VLLM_BLOCK, "num_spec_tokens": 2, "acceptance_histogram": [0, 1, 1],
                          "num_spec_steps": 2, "num_accepted_draft_tokens": 3, "num_draft_tokens": 4}
    turns: list[TurnRecord] = [records.turn_record(parse_completion(body(b)), i, 0, None, "m")
                               for i, b in enumerate((VLLM_BLOCK, other, None, k2))]
    assert turns[0]["spec"] == FIGURES and turns[1]["spec"]["accepted"] == 1 and "spec" not in turns[2]
    history: list[ChatMessage] = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "ok"}]
    rec = records.conversation_record(records.record_base(CTX, ITEM, 1, history), turns, history, None,
                                      history_reasoning="drop", turns_total=4, resumed_at=None)
    # the turns that carry figures, added up; the k=2 turn's histogram padded to k=3
    assert rec["spec"] == {"k": 3, "steps": 9, "drafted": 23, "accepted": 15, "hist": [2, 2, 2, 3]}
    none = [records.turn_record(parse_completion(body(None)), 0, 0, None, "m")]
    assert "spec" not in records.conversation_record(records.record_base(CTX, ITEM, 1, history), none, history,
                                                     None, history_reasoning="drop", turns_total=1,
                                                     resumed_at=None)
    assert sum_spec([]) is None


def test_the_preflight_line_says_whether_the_engine_speculates_and_names_the_missing_flag() -> None:
    warn, line = speculation_note(FIGURES, True, True)
    assert not warn and "speculates, 3 draft tokens per step" in line and "11 of 12 draft tokens accepted" in line
    warn, line = speculation_note(None, True, True)
    assert warn and "--per-request-spec-decode-metrics summary" in line
    assert speculation_note(None, True, False) == (
        False, "the engine does not speculate (no spec_decode counters on its /metrics)")
    warn, line = speculation_note(None, False, False)
    assert not warn and "unknown" in line
    # a capture run's engine counts drafts (extract_hidden_states) but runs no drafter: no advice
    for probe, spec in ((None, True), (FIGURES, True), (None, False)):
        warn, line = speculation_note(probe, True, spec, capturing=True)
        assert not warn and "not a drafter" in line and "--per-request" not in line
