"""vLLM's logprobs.content read into top-K tables (consumer/capture/tables.py, pure): the list vLLM
0.32 returns holds the sampled token first and then the most likely in rank order, cut at the
top_logprobs asked (K + 1); the table kept is its true top K, sorted, whatever the order, and a
list that cannot hold it is refused."""

from __future__ import annotations

import pytest

from genqueue.common.logprobs import asked, request_fields
from genqueue.consumer.answer.faults import BadLogprobsError
from genqueue.consumer.capture.tables import parse_tables, refused


def _entry(i: int, lp: float, top: list[tuple[int, float]]) -> dict:
    return {"token": f"token_id:{i}", "logprob": lp,
            "top_logprobs": [{"token": f"token_id:{j}", "logprob": v} for j, v in top]}


RANKED = [(10, -0.5), (11, -1.5), (12, -2.0), (13, -3.0)]


def test_the_sampled_token_outside_the_top_k_is_not_kept_and_the_k_th_is() -> None:
    assert request_fields(3)["top_logprobs"] == asked(3) == 4
    # vLLM: the sampled token (id 99, rank 7) first, then ranks 1..3: K + 1 = 4 entries
    t = parse_tables([_entry(99, -6.0, [(99, -6.0), *RANKED[:3]])], 3)
    assert t.sampled_ids.tolist() == [99] and t.topk_ids.tolist() == [[10, 11, 12]]
    assert t.topk_logprobs.tolist() == [[-0.5, -1.5, -2.0]] and t.sampled_logprobs.tolist() == [-6.0]


def test_the_sampled_token_inside_the_top_k_is_put_in_its_place() -> None:
    # sampled id 12 (rank 3) first, then the others by rank, cut at 4
    t = parse_tables([_entry(12, -2.0, [(12, -2.0), (10, -0.5), (11, -1.5), (13, -3.0)])], 3)
    assert t.topk_ids.tolist() == [[10, 11, 12]]


@pytest.mark.parametrize(("entry", "says"), [
    (_entry(99, -6.0, [(99, -6.0), *RANKED[:2]]), "holds 3 entries, the run asks for 4"),
    (_entry(10, -0.5, [(10, -0.5), (10, -0.5), (11, -1.5), (12, -2.0)]), "lists token 10 twice"),
    (_entry(10, -0.7, [(10, -0.5), (11, -1.5), (12, -2.0), (13, -3.0)]), "is listed as -0.5"),
    ({"token": "hello", "logprob": -0.5, "top_logprobs": []}, "not token_id:<id>"),
])
def test_a_list_that_cannot_hold_the_top_k_is_refused(entry: dict, says: str) -> None:
    with pytest.raises(BadLogprobsError, match=says):
        parse_tables([entry], 3)


def test_no_content_is_refused() -> None:
    with pytest.raises(BadLogprobsError, match="no logprobs.content"):
        parse_tables(None, 3)


def test_the_engines_refusal_of_k_names_its_bound_in_one_line() -> None:
    line = refused(30, "http://e/v1", Exception("400: Requested sample logprobs of 31, which is greater than max "
                                                "allowed: 20"))
    assert "\n" not in line and "its --max-logprobs is 20" in line
    assert "start vLLM with --max-logprobs 31 or more, or queue the run with --logprobs 19 or less" in line
