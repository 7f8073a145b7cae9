"""The request a run sends (common/requests.py), pure: its fields, body and recorded sampling."""

from __future__ import annotations

from genqueue.common.requests import RequestShape, item_seed
from genqueue.common.settings import RunSettings, Sampling
from genqueue.common.variants import Variant

SETTINGS = RunSettings(token_ids=True, sampling=Sampling(temperature=0.5, top_p=None, max_tokens=100, seed=3,
                                                         extra={"chat_template_kwargs": {"a": 1}}))
NOTHINK = Variant("nothink", {"chat_template_kwargs": {"enable_thinking": False}, "max_tokens": 50})
MSGS = [{"role": "user", "content": "hi"}]


def test_the_body_is_the_runs_fields_then_the_requests_own_in_a_stable_order() -> None:
    shape = RequestShape.of(SETTINGS)
    assert list(shape.body("m", MSGS)) == ["model", "messages", "max_tokens", "temperature", "seed",
                                           "chat_template_kwargs", "return_token_ids"]
    body = shape.body("m", MSGS, tools=[{"type": "function"}], max_tokens=900, seed=7)
    # a retry's budget and the item's seed take the run's fields' places; tools come last
    assert list(body) == ["model", "messages", "max_tokens", "temperature", "seed", "chat_template_kwargs",
                          "return_token_ids", "tools"]
    assert (body["max_tokens"], body["seed"]) == (900, 7)
    assert "tools" not in shape.body("m", MSGS, tools=[])  # no tools: none sent
    assert shape.sampling == {"max_tokens": 100, "temperature": 0.5, "seed": 3, "chat_template_kwargs": {"a": 1}}


def test_token_ids_are_asked_for_only_by_a_token_ids_run_and_never_recorded_as_sampling() -> None:
    plain = RequestShape.of(RunSettings())
    assert "return_token_ids" not in plain.fields() and "return_token_ids" not in plain.body("m", MSGS)
    shape = RequestShape.of(SETTINGS)
    assert shape.fields()["return_token_ids"] is True and "return_token_ids" not in shape.sampling
    assert shape.sampling_of(9) == {**shape.sampling, "seed": 9} and shape.sampling_of(None) is shape.sampling


def test_a_variant_merges_over_the_runs_fields() -> None:
    shape = RequestShape.of(SETTINGS, NOTHINK)
    assert shape.sampling["chat_template_kwargs"] == {"a": 1, "enable_thinking": False}
    assert shape.max_tokens == 50 and RequestShape.of(SETTINGS).max_tokens == 100
    assert RequestShape.of(SETTINGS).sampling["chat_template_kwargs"] == {"a": 1}  # the run's own untouched


def test_an_items_seed_is_an_integer_it_carries() -> None:
    assert item_seed({"seed": 4}) == 4
    assert item_seed({"seed": True}) is None and item_seed({"seed": "4"}) is None
    assert item_seed({}) is None and item_seed("garbage") is None
