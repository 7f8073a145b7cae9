"""The line a consumer logs while it waits for its endpoint joins the error text cleanly."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

from genqueue.common.errors import as_clause
from genqueue.consumer.answer.faults import TransientError
from genqueue.consumer.served import ServedRuns


class _SlowStart:
    """/v1/models refused once ("Connection refused."), then served."""

    def __init__(self) -> None:
        self.calls = 0

    async def models(self) -> list[dict[str, Any]]:
        self.calls += 1
        if self.calls == 1:
            raise TransientError("Connection refused.")
        return [{"id": "m", "max_model_len": 4096}]


def test_as_clause_drops_only_the_closing_stop() -> None:
    assert as_clause("Error 111 connecting to 127.0.0.1:1. Connection refused.") == \
        "Error 111 connecting to 127.0.0.1:1. Connection refused"
    assert as_clause(ValueError("no stop")) == "no stop"
    assert as_clause("") == ""


def test_the_endpoint_wait_line_has_no_stop_inside_its_parentheses(caplog: pytest.LogCaptureFixture) -> None:
    served = ServedRuns(None, None, _SlowStart(), None,  # type: ignore[arg-type]
                        endpoint="http://127.0.0.1:1/v1", only_run=None, identity=None,  # type: ignore[arg-type]
                        worker="w", request_timeout=5.0, endpoint_wait=60.0)
    with caplog.at_level(logging.WARNING, logger="genqueue.consumer.served"):
        asyncio.run(served.wait_for_models())
    lines = [r.getMessage() for r in caplog.records if "waiting for endpoint" in r.getMessage()]
    assert lines and "(Connection refused): waited" in lines[0], lines
    assert served.models == ["m"]
