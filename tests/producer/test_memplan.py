"""producer/memplan.py: by reference (issue 34) the estimate leaves the prompt text out, which
the jobs no longer hold."""

from __future__ import annotations

from pathlib import Path

from genqueue.common import defaults
from genqueue.common.settings import RunSettings
from genqueue.producer import memplan
from genqueue.producer.ingest.reader import iter_records
from tests.conftest import write_jsonl


def test_by_reference_the_estimate_counts_no_prompt_text(tmp_path: Path) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", [{"conversations": [{"from": "human", "value": f"{i} " + "x" * 3000}]}
                                              for i in range(50)])
    head, _, complete = memplan.sample(iter_records(str(data)))
    settings = RunSettings(output=str(tmp_path / "out"))
    inline = memplan.plan(str(data), head, "r", settings, None, None, complete=complete)
    ref = memplan.plan(str(data), head, "r", settings, None, None, complete=complete, by_reference=True)
    per_item = defaults.REDIS_BYTES_PER_ITEM
    assert inline.items == ref.items == 50
    assert ref.bytes == 50 * per_item and inline.bytes > ref.bytes + 50 * 3000 * defaults.REDIS_BYTES_PER_PROMPT_BYTE - 1
