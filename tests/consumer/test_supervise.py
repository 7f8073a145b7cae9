"""Supervision of the consumer's loops (consumer/guards/supervise.py)."""

from __future__ import annotations

import asyncio
import time

import pytest

from genqueue.consumer.guards.supervise import LoopFailed, supervised


# --- supervision ---------------------------------------------------------------------------
def test_a_failing_loop_is_restarted_then_stops_the_consumer() -> None:
    async def scenario() -> None:
        runs = 0

        async def flaky() -> None:
            nonlocal runs
            runs += 1
            if runs < 3:
                raise RuntimeError("boom")

        await supervised("flaky", flaky, restarts=5)
        assert runs == 3

        async def broken() -> None:
            raise RuntimeError("always")

        t0 = time.monotonic()
        with pytest.raises(LoopFailed, match="broken failed: RuntimeError: always"):
            await supervised("broken", broken, restarts=2)
        assert time.monotonic() - t0 < 10

    asyncio.run(scenario())
