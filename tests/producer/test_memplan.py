"""producer/enqueue/memplan.py: by reference (issue 34) the estimate leaves the prompt text out, which
the jobs no longer hold."""

from __future__ import annotations

from pathlib import Path

import pytest

from genqueue.common import defaults
from genqueue.common.contracts import PromptMode
from genqueue.common.keepers.redismem import (
    BYTES_PER_ITEM,
    BYTES_PER_PROMPT_BYTE,
    MEMORY_HEADROOM,
    Memory,
    RedisFullError,
)
from genqueue.common.settings import RunSettings
from genqueue.producer.enqueue import memplan
from genqueue.producer.ingest.reader import iter_records
from tests.conftest import write_jsonl


def test_by_reference_the_estimate_counts_no_prompt_text(tmp_path: Path) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", [{"conversations": [{"from": "human", "value": f"{i} " + "x" * 3000}]}
                                              for i in range(50)])
    head, _, complete = memplan.sample(iter_records(str(data)))
    settings = RunSettings(output=str(tmp_path / "out"))
    inline = memplan.plan(str(data), head, "r", settings, None, None, complete=complete)
    ref = memplan.plan(str(data), head, "r", settings, None, None, complete=complete, by_reference=True)
    per_item = BYTES_PER_ITEM
    assert inline.items == ref.items == 50
    assert ref.bytes == 50 * per_item and inline.bytes > ref.bytes + 50 * 3000 * BYTES_PER_PROMPT_BYTE - 1


def test_a_run_that_fits_only_by_reference_is_refused_saying_so(tmp_path: Path) -> None:
    """Inline a run of long prompts does not fit where by reference it would: the refusal says
    `--prompts reference` (given inline: auto would choose by reference, choose_by_room)."""
    data = write_jsonl(tmp_path / "d.jsonl", [{"conversations": [{"from": "human", "value": f"{i} " + "x" * 3000}]}
                                              for i in range(50)])
    head, _, complete = memplan.sample(iter_records(str(data)))
    settings = RunSettings(output=str(tmp_path / "out"))
    inline = memplan.plan(str(data), head, "r", settings, None, None, complete=complete)
    ref = memplan.plan(str(data), head, "r", settings, None, None, complete=complete, by_reference=True)
    mem = Memory(used=0, maxmemory=int((ref.bytes + inline.bytes) / 2 / (1 - MEMORY_HEADROOM)),
                 policy="noeviction")
    fits_by_ref = memplan.MemoryPlan(inline.items, inline.bytes, True, mem)
    with pytest.raises(RedisFullError, match=r"free memory, or queue it by reference \(`--prompts reference`"):
        memplan.refuse_unfit(fits_by_ref, "r")
    memplan.refuse_unfit(memplan.MemoryPlan(ref.items, ref.bytes, True, mem, by_reference=True), "r")
    tight = Memory(used=0, maxmemory=ref.bytes // 2, policy="noeviction")
    with pytest.raises(RedisFullError) as e:
        memplan.refuse_unfit(memplan.MemoryPlan(inline.items, inline.bytes, True, tight), "r")
    assert "--prompts reference" not in str(e.value)


def test_auto_turns_to_reference_only_when_inline_does_not_fit_and_reference_does(tmp_path: Path) -> None:
    est = memplan.Estimate(10_000, 1500.0, True)
    mem = Memory(used=0, maxmemory=4 << 20, policy="noeviction")
    inline = memplan.MemoryPlan(10_000, 10 << 20, True, mem)
    ref = memplan.MemoryPlan(10_000, 1 << 20, True, mem, by_reference=True)
    auto = memplan.choose_prompts(memplan.PromptsAsked.AUTO, est, None)
    choice, plan = memplan.choose_by_room(auto, inline, lambda: ref)
    assert (choice.mode, choice.reason, plan) == (PromptMode.REFERENCE, memplan.PromptsReason.ROOM, ref)
    assert choice.fields()["reason"] == "room" and "more than the" in choice.why()
    # given inline, a run's own mode, a plan that fits, or a reference that fits no better: as chosen
    given = memplan.choose_prompts(memplan.PromptsAsked.INLINE, est, None)
    kept = memplan.choose_prompts(memplan.PromptsAsked.AUTO, est, PromptMode.INLINE)
    fits = memplan.MemoryPlan(10_000, 1 << 20, True, mem)
    too_big = memplan.MemoryPlan(10_000, 5 << 20, True, mem, by_reference=True)
    assert memplan.choose_by_room(given, inline, lambda: ref) == (given, inline)
    assert memplan.choose_by_room(kept, inline, lambda: ref) == (kept, inline)
    assert memplan.choose_by_room(auto, fits, lambda: ref) == (auto, fits)
    assert memplan.choose_by_room(auto, inline, lambda: too_big) == (auto, inline)


@pytest.mark.parametrize("hashes", [False, True], ids=["blobs", "hashes"])
def test_an_enqueue_that_takes_a_run_past_its_tables_size_says_so(conn, caplog: pytest.LogCaptureFixture,
                                                                   hashes: bool) -> None:
    """The item table's buckets are fixed by the run's first enqueue; a later one that takes it
    far past them says so in the log: longer strings to search and copy (a table of strings), or
    more bytes an item than the estimate's (one an earlier genqueue made, past Redis's compact
    hashes)."""
    from genqueue.common.keepers.items import ItemTable
    from genqueue.producer.enqueue.core import _item_table

    ItemTable(conn, "grow").ensure(10, hashes=hashes)
    entries = ItemTable(conn, "grow").listpack_entries()
    with caplog.at_level("WARNING", logger="genqueue"):
        _item_table(conn, "grow", memplan.MemoryPlan(1024 * entries - 1, 0, True, None))
        assert not caplog.records
        _item_table(conn, "grow", memplan.MemoryPlan(1024 * entries + 1, 0, True, None))
    said = "its buckets outgrow Redis's compact hashes" if hashes else "searches and copies longer strings"
    assert len(caplog.records) == 1 and said in caplog.text, caplog.text
    assert ItemTable(conn, "grow").buckets() == 1024  # still as the first enqueue fixed it


def test_expect_items_decides_auto_but_not_a_given_mode_or_a_runs_own() -> None:
    """--expect-items: auto by the run's expected items (or this input's, if it holds more);
    a mode given or the run's own wins; inline by expectation still yields to Redis's room."""
    small, big = memplan.Estimate(100, 1500.0, True), memplan.Estimate(300_000, 1500.0, True)
    auto = memplan.PromptsAsked.AUTO
    c = memplan.choose_prompts(auto, small, None, expected=250_000)
    assert (c.mode, c.reason, c.expected_items) == (PromptMode.REFERENCE, memplan.PromptsReason.EXPECTED, 250_000)
    assert memplan.choose_prompts(auto, small, None, expected=1_000).mode is PromptMode.INLINE
    assert memplan.choose_prompts(auto, big, None, expected=1_000).mode is PromptMode.REFERENCE
    assert memplan.choose_prompts(auto, small, PromptMode.INLINE, expected=250_000).reason is memplan.PromptsReason.RUN
    given = memplan.choose_prompts(memplan.PromptsAsked.INLINE, small, None, expected=250_000)
    assert (given.mode, given.reason) == (PromptMode.INLINE, memplan.PromptsReason.GIVEN)
    mem = Memory(used=0, maxmemory=4 << 20, policy="noeviction")
    inline = memplan.MemoryPlan(1_000, 10 << 20, True, mem)
    ref = memplan.MemoryPlan(1_000, 1 << 20, True, mem, by_reference=True)
    c = memplan.choose_prompts(auto, small, None, expected=1_000)
    assert memplan.choose_by_room(c, inline, lambda: ref)[0].reason is memplan.PromptsReason.ROOM


def test_jobs_by_reference_grow_only_where_the_run_keeps_jobs_enough() -> None:
    """choose_batch: the estimate of a whole input (or --expect-items) doubles the job from
    BATCH_SIZE_REFERENCE up to BATCH_SIZE_REFERENCE_MAX while JOBS_PER_RUN_MIN jobs remain; an input
    of unknown size keeps the base; inline and --batch-size are not touched."""
    ref, base, most = PromptMode.REFERENCE, defaults.BATCH_SIZE_REFERENCE, defaults.BATCH_SIZE_REFERENCE_MAX
    jobs = defaults.JOBS_PER_RUN_MIN
    for items, size in ((0, base), (2 * base * jobs - 1, base), (2 * base * jobs, 2 * base),
                        (most * jobs, most), (100 * most * jobs, most)):
        c = memplan.choose_batch(None, ref, memplan.Estimate(items, 1.0, True))
        assert c.size == size and c.items == items and (items // size >= jobs or size == base), (items, c)
    unknown = memplan.choose_batch(None, ref, memplan.Estimate(10**9, 1.0, False))
    assert (unknown.size, unknown.reason, unknown.items) == (base, memplan.BatchReason.REFERENCE, None)
    assert "the run's size not known" in unknown.why()
    assert memplan.choose_batch(None, ref, memplan.Estimate(10, 1.0, False), expected=most * jobs).size == most
    assert memplan.choose_batch(None, PromptMode.INLINE, memplan.Estimate(10**9, 1.0, True)).size == defaults.BATCH_SIZE
    given = memplan.choose_batch(7, ref, memplan.Estimate(10**9, 1.0, True))
    assert (given.size, given.reason, given.why()) == (7, memplan.BatchReason.GIVEN, "--batch-size 7")
