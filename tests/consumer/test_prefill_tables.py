"""A --logprobs capture pass's prefill answer read (consumer/answer/prefill.py, pure): vLLM's
`prompt_logprobs` at the completion positions put in a chat completion's `logprobs.content` shape,
then parsed and checked as an in-generation table is (consumer/capture/tables.py), and refused
when it is not of the ids sent."""

from __future__ import annotations

import numpy as np
import pytest

from genqueue.common.features.tables import check_table
from genqueue.common.logprobs import RUN_MODE
from genqueue.common.prefill import prompt_fields
from genqueue.consumer.answer.faults import BadLogprobsError, BadResponseError
from genqueue.consumer.answer.prefill import prefill_body, prompt_content, prompt_logprobs
from genqueue.consumer.capture.tables import parse_tables
from genqueue.consumer.sim.logprobs import prompt_tables, standin_tables

K = 4
IDS = [11, 502, 77, 9003, 640, 1201, 5, 88]
COMPLETION = 3


def _listed(ids: list[int]) -> list:
    listed = prompt_tables(prompt_fields(K), ids)
    assert listed is not None
    return listed


def test_the_completion_positions_become_the_same_tables_an_answer_has() -> None:
    start = len(IDS) - COMPLETION
    table = parse_tables(prompt_content(_listed(IDS), IDS, COMPLETION, IDS), K)
    check_table(table, k=K, mode=RUN_MODE, expected_ids=IDS[start:])
    sampled, top_ids, top_lps = standin_tables(IDS[start:], K, start=start)
    assert table.sampled_ids.tolist() == IDS[start:]
    assert table.topk_ids.tolist() == top_ids
    assert np.allclose(table.topk_logprobs, top_lps, rtol=1e-6)
    assert np.allclose(table.sampled_logprobs, sampled, rtol=1e-6)


def test_a_pass_body_asks_k_plus_one_and_the_ids_scored() -> None:
    body = prefill_body("m", IDS, K)
    assert (body["prompt_logprobs"], body["return_token_ids"], body["max_tokens"]) == (K + 1, True, 1)
    assert "kv_transfer_params" not in body
    assert "kv_transfer_params" in prefill_body("m", IDS)  # a hidden-states pass's


@pytest.mark.parametrize(("listed", "scored", "said"), [
    (lambda x: x[:-1], None, "hold 7 positions, the prompt sent 8"),
    (lambda x: x, [*IDS[:3], 4, *IDS[4:]], "prompt_token_ids differ at position 3 of 8"),
    (lambda x: x, IDS[:-1], "prompt_token_ids differ at position 7 of 8"),
    (lambda x: [*x[:6], {"1": {"logprob": -0.1}}, x[7]], None, "prompt_logprobs[6] does not list the position's own"),
    (lambda x: [*x[:6], None, x[7]], None, "prompt_logprobs[6] is no table"),
])
def test_tables_not_of_the_ids_sent_are_refused(listed, scored, said: str) -> None:
    with pytest.raises(BadLogprobsError, match=said.replace("[", r"\[").replace("]", r"\]")):
        prompt_content(listed(_listed(IDS)), IDS, COMPLETION, scored)


def test_a_table_one_position_off_fails_the_checks() -> None:
    shifted = [None, *_listed(IDS)[2:], _listed([*IDS, 3])[-1]]  # every position describes the next one
    with pytest.raises(BadLogprobsError):
        parse_tables(prompt_content(shifted, IDS, COMPLETION), K)


def test_an_answer_without_prompt_logprobs_is_a_bad_response() -> None:
    with pytest.raises(BadResponseError, match="without choices\\[0\\].prompt_logprobs"):
        prompt_logprobs({"choices": [{"text": "x"}]})
    listed, scored = prompt_logprobs({"choices": [{"prompt_logprobs": [None], "prompt_token_ids": [1]}]})
    assert (listed, scored) == ([None], [1])
