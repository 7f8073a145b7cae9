"""Provenance, OpenAI Batch request lines and several samples per prompt, as items (pure)."""

from __future__ import annotations

from typing import Any

import pytest

from genqueue.common.contracts import Mode, RejectReason
from genqueue.common.settings import Sampling
from genqueue.producer.ingest.convert import normalize
from genqueue.producer.ingest.items import Origin, item_key, make_items, record_id, sample_key
from genqueue.producer.ingest.rejects import Rejected

RUN_PARAMS = Sampling(temperature=0.6, top_p=0.95, max_tokens=256).request_params()


def record(**extra: Any) -> dict[str, Any]:
    return {"conversations": [{"from": "human", "value": "hello"}, {"from": "gpt", "value": "hi"}], **extra}


def items_of(value: dict[str, Any], origin: Origin, mode: Mode = Mode.REGENERATE, index: int = 4) -> list[Any]:
    return make_items(normalize(value), mode, index, origin.of(value))


def test_provenance_rides_along_and_never_changes_the_key() -> None:
    plain = make_items(normalize(record()), Mode.REGENERATE, 4)
    [it] = items_of(record(id="row-9"), Origin(source="a.jsonl", source_seq=2))
    assert it["key"] == plain[0]["key"] == item_key(Mode.REGENERATE, it["messages"], None)
    assert (it["id"], it["source"], it["source_seq"], it["index"]) == ("row-9", "a.jsonl", 2, 4)
    assert "sample" not in it and "seed" not in it


def test_record_ids() -> None:
    assert record_id({"id": "a", "custom_id": "b"}) == "a"
    assert record_id({"custom_id": "b"}) == "b"
    assert record_id({"id": 17}) == "17"
    assert record_id({"id": True}) is None and record_id({"id": {"x": 1}}) is None and record_id({}) is None
    assert record_id({"uuid": "u-1", "id": "a"}, "uuid") == "u-1"
    with pytest.raises(Rejected) as e:
        record_id({"id": "a"}, "uuid")
    assert e.value.reason == RejectReason.MISSING_ID and "'uuid'" in e.value.detail


def test_samples_are_distinct_items_with_their_own_seeds() -> None:
    items = items_of(record(id="q"), Origin(source="a.jsonl", samples=3, base_seed=100), Mode.EACH)
    assert [(it["sample"], it["seed"], it["turn"]) for it in items] == [(0, 100, 0), (1, 101, 0), (2, 102, 0)]
    keys = [it["key"] for it in items]
    assert len(set(keys)) == 3
    # sample 0 keeps the plain key: a run made with one sample per prompt can grow to three
    assert keys[0] == item_key(Mode.EACH, items[0]["messages"], None) == sample_key(Mode.EACH, items[0]["messages"],
                                                                                     None, 0)
    again = items_of(record(id="q"), Origin(source="b.jsonl", samples=3, base_seed=100), Mode.EACH)
    assert [it["key"] for it in again] == keys  # stable: re-enqueueing finds them


def batch_line(**body: Any) -> dict[str, Any]:
    return {"custom_id": "req-1", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}], **body}}


def test_a_batch_request_line_is_its_body_with_custom_id_kept() -> None:
    origin = Origin(source="batch.jsonl", run_params=RUN_PARAMS)
    [it] = items_of(batch_line(max_tokens=256, temperature=0.6), origin, Mode.LAST)
    assert it["id"] == "req-1" and it["messages"] == [{"role": "user", "content": "hi"}]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    [it] = items_of(batch_line(tools=tools, max_completion_tokens=256, n=1, stream=False), origin)
    assert it["tools"] == tools


@pytest.mark.parametrize(("body", "detail"), [
    ({"temperature": 1.0}, "temperature=1.0, the run's is 0.6"),
    ({"max_tokens": 64}, "max_tokens=64, the run's is 256"),
    ({"top_k": 20}, "top_k=20, the run's is unset"),
    ({"n": 4}, "n=4: use --samples 4"),
])
def test_batch_sampling_other_than_the_runs_is_refused(body: dict[str, Any], detail: str) -> None:
    with pytest.raises(Rejected) as e:
        Origin(source="batch.jsonl", run_params=RUN_PARAMS).of(batch_line(**body))
    assert e.value.reason == RejectReason.SAMPLING_DIFFERS and e.value.detail.startswith(detail)


@pytest.mark.parametrize(("line", "reason"), [
    ({"custom_id": "e", "method": "POST", "url": "/v1/embeddings", "body": {"input": "x"}},
     RejectReason.UNSUPPORTED_REQUEST),
    ({"custom_id": "g", "method": "GET", "url": "/v1/chat/completions", "body": {"messages": []}},
     RejectReason.UNSUPPORTED_REQUEST),
    ({"custom_id": "b", "body": "not an object"}, RejectReason.NO_CONVERSATION),
    ({"custom_id": "m", "body": {"model": "x"}}, RejectReason.NO_CONVERSATION),
])
def test_batch_lines_that_are_not_chat_requests(line: dict[str, Any], reason: RejectReason) -> None:
    with pytest.raises(Rejected) as e:
        normalize(line)
    assert e.value.reason == reason
