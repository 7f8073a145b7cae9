"""A Batch API line asking for return_token_ids goes into a --token-ids run, not into another."""

from __future__ import annotations

import pytest

from genqueue.common.settings import RunSettings
from genqueue.producer.ingest.items import Rejected, check_batch_sampling
from genqueue.producer.ingest.sources import bind


def test_return_token_ids_is_the_runs_own_setting() -> None:
    body = {"model": "m", "messages": [], "max_tokens": 4096, "temperature": 0.6, "top_p": 0.95,
            "return_token_ids": True}
    on = bind(None, "in.jsonl", "s", "r", RunSettings(token_ids=True), None)
    assert on.run_params is not None
    check_batch_sampling(body, on.run_params)
    off = bind(None, "in.jsonl", "s", "r", RunSettings(), None)
    assert off.run_params is not None
    with pytest.raises(Rejected, match="return_token_ids=True"):
        check_batch_sampling(body, off.run_params)
