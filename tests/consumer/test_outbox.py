"""The outbox's ship outcomes (consumer/shipping/outbox.py) in-process, on a local store: an explicit outcome per shard."""

from __future__ import annotations

import asyncio
from pathlib import Path

from genqueue.common.keepers.marks import ShardMarks
from genqueue.common.storage import LocalStore
from genqueue.consumer.shipping.outbox import Outbox
from tests.doubles import item, result


# --- outbox: an explicit outcome per shard ------------------------------------------------
def test_a_vanished_shard_is_lost_not_shipped_and_a_gone_run_keeps_its_shard(tmp_path: Path) -> None:
    async def scenario() -> None:
        events: list[tuple[str, str, int]] = []

        async def output_of(run: str) -> str | None:
            return str(tmp_path / "out") if run == "r" else None

        async def shipped(run: str, seq: int | None, marks: ShardMarks) -> None:
            assert marks.done == [bytes.fromhex(item(2)["key"])] and marks.failed == []
            events.append(("shipped", run, seq or 0))

        async def lost(run: str, seq: int) -> None:
            events.append(("lost", run, seq))

        async def no_run(run: str) -> None:
            events.append(("no_run", run, 0))

        ob = Outbox(str(tmp_path / "spool"), "w", max_bytes=1 << 20, max_age=60, spool_limit=1 << 30,
                    store_for=LocalStore, output_of=output_of, on_shipped=shipped, on_lost=lost, on_no_run=no_run)
        ob.append("r", result(item(1)))
        ob.seal_due(set(), force=True)
        ob.queue[0].path.unlink()  # the spool loses the sealed shard
        ob.append("r", result(item(2)))
        ob.seal_due(set(), force=True)
        ob.append("gone", result(item(3)))
        ob.seal_due(set(), force=True)
        gone_path = ob.queue[-1].path
        task = asyncio.create_task(ob.shipper())
        assert await ob.flush(10)
        task.cancel()
        assert events == [("lost", "r", 1), ("shipped", "r", 2), ("no_run", "gone", 0)]
        assert gone_path.exists(), "a shard of a run that is gone stays in the spool"
        assert ob.snapshot().lost == 1
        ob.close()

    asyncio.run(scenario())
