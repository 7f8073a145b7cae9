"""--token-ids as a run setting: a new field that leaves the fingerprint of every run made
before it as it was, and changes it when set."""

from __future__ import annotations

import pytest

from genqueue.common.errors import UserError
from genqueue.common.settings import RunSettings, Sampling

#: A run's stored settings from before the field existed, with the fingerprint its results carry.
BEFORE = (b'{"expect_reasoning":false,"history_reasoning":"drop","max_prompt_chars":262144,"model":null,'
          b'"multi_turn":"regenerate","output":"./genqueue-out","sampling":{"extra":{},"max_tokens":4096,'
          b'"seed":null,"temperature":0.6,"top_p":0.95},"truncation":"keep"}')


def test_unset_it_keeps_the_old_json_and_fingerprint() -> None:
    old = RunSettings.from_json(BEFORE)
    assert old.token_ids is False
    assert old.to_json() == BEFORE and old.fingerprint == "0caa1847b8503518"
    assert RunSettings().fingerprint == old.fingerprint


def test_set_it_is_another_recipe_that_round_trips() -> None:
    on = RunSettings(token_ids=True)
    assert b'"token_ids":true' in on.to_json()
    assert on.fingerprint != RunSettings().fingerprint
    assert RunSettings.from_json(on.to_json()) == on
    assert on.differences(RunSettings()) == ["token_ids"]
    assert RunSettings.from_json(on.to_json()).stored_shape_problem() is None
    assert RunSettings(token_ids="yes").stored_shape_problem() == "token_ids has the wrong type"  # type: ignore[arg-type]


def test_sampling_json_may_not_ask_for_ids_itself() -> None:
    with pytest.raises(UserError, match="--token-ids"):
        Sampling(extra={"return_token_ids": True}).check()
