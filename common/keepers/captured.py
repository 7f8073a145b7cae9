"""What a --capture run has captured: the budget's count, and the figures every screen shows.

Key: genqueue:run:<run>:stats  field SPENT (with the run's other counters: status reads it in
its one read of them; deleting the run deletes it)

The budget (--capture-budget) is checked, then added to: before an answer asks for its hidden
states, its consumer reads SPENT and asks only while it is below the budget; once the answer's
row is stored on the consumer's spool, the row's bytes are added (featurecounts.py keeps them
under the row's shard too, until the shard is counted). Nothing is reserved ahead (a row's size
is known only after the answer): the budget is overshot by at most the rows in flight when it
was reached, never by rows started after. A redone answer's second row counts too. A run that
Redis lost gets SPENT back from its output (featurecounts.py), so a budget is not spent twice.

`capture_figures` is the one computation of a capture's figures from one read of the run's
counters (a marks.Progress), for `producer status` (text and --json) and the export's card;
`logprobs_figures` is its sibling for a --logprobs run's tables, from the same read.
"""

from __future__ import annotations

from typing import TypedDict

import redis

from genqueue.common.capture import format_size
from genqueue.common.contracts import Mode
from genqueue.common.keepers.featurecounts import SPENT, pending_key
from genqueue.common.keepers.keeper import run_key
from genqueue.common.keepers.marks import Marks, Progress
from genqueue.common.keepers.markscript import SHIPPED_FEATURES, SHIPPED_TURNS
from genqueue.common.keepers.runs import FEATURE_BYTES, FEATURE_ROWS, FEATURE_TOKENS
from genqueue.common.prefill import PrefillChoice
from genqueue.common.settings import RunSettings

__all__ = ["SPENT", "CaptureBudget", "CaptureFigures", "LogprobsFigures", "PassFigures", "capture_figures",
           "logprobs_figures", "read_capture_figures", "read_logprobs_figures"]


class CaptureBudget:
    """A run's captured bytes on CONN: whether another answer may ask, and adding a row's bytes.
    Raises what redis-py raises: the caller decides what a failure costs."""

    def __init__(self, conn: redis.Redis) -> None:
        self.conn = conn

    def spent(self, run: str) -> int:
        """The bytes of RUN's rows captured so far (0 before any)."""
        raw = self.conn.hget(run_key(run, "stats"), SPENT)
        try:
            return int(raw) if raw is not None else 0
        except ValueError:
            return 0

    def allows(self, run: str, budget: int) -> bool:
        """Whether an answer of RUN may still ask for capture under BUDGET bytes."""
        return self.spent(run) < budget

    def add(self, run: str, size: int, shard: str) -> int:
        """A row of SIZE bytes of RUN is stored in feature shard SHARD: the bytes captured after it."""
        with self.conn.pipeline() as p:
            p.hincrby(run_key(run, "stats"), SPENT, size)
            p.hincrby(pending_key(run), shard, size)
            spent, _ = p.execute()
        return int(spent)


class PassFigures(TypedDict):
    """A capture pass's choice (`producer capture`: RunSettings.prefill), as it came to when the
    pass was enqueued: ROWS of its SOURCE run's SOURCE_ROWS, BY which order, under BUDGET."""

    source: str
    by: str  # common.prefill.PrefillChoice
    budget: int | None
    rows: int
    source_rows: int
    tokens: int
    bytes: int | None  # the features' bytes the rows come to (None: the hidden size was not given)


class CaptureFigures(TypedDict):
    """A --capture run's capture: what, which layers, how stored, which answers and why, and what
    of it the consumers have shipped so far and will at this rate."""

    what: str
    layers: list[int]
    dtype: str
    choice: list[str]  # common.capture.CaptureChoice values: what chooses the answers captured
    chosen: str  # the choice in words
    share: float  # of each source's items (when no sources are named)
    sources: list[tuple[str, float]]  # the sources named, each with its share (none: every source)
    rows: int  # distinct rows shipped: what a trainer gets (named by the done items' results)
    rows_written: int  # every row stored (after a Redis loss, recounted from the feature shards' indexes)
    rows_extra: int  # rows_written beyond rows: copies of redone answers, or rows whose results are on the way
    bytes: int  # of every row stored in the output
    answers: int  # answers the done items hold (user turns answered, in regenerate): the rows generated
    budget: int | None  # --capture-budget, bytes (None: no budget)
    spent: int  # bytes captured as the budget counts them (each row as it was stored on a spool)
    budget_spent: bool  # the budget is reached: answers from now on are generated without features
    bytes_per_row: float | None  # shipped so far (None before a row shipped)
    rows_per_item: float | None  # distinct rows per done item so far: the choice's rate
    items_left: int  # items not done nor failed
    projected_bytes: int | None  # the run's features at the end, at the rates so far, the budget aside
    projected_kept: int | None  # what the budget lets of them (projected_bytes without a budget)
    capture_pass: PassFigures | None  # a capture pass's source and choice (None: a capture during generation)


def capture_figures(settings: RunSettings, progress: Progress) -> CaptureFigures | None:
    """The capture figures of a run of SETTINGS from PROGRESS (one read of its marks and counters),
    None for a run that captures nothing. The projection: the bytes shipped, plus the bytes per row
    shipped so far times the rows still to capture (the rows per done item so far, which is the
    choice at work, times the items left)."""
    c = settings.capture
    if c is None:
        return None
    st = progress.stats
    rows, written, size = st.get(SHIPPED_FEATURES, 0), st.get(FEATURE_ROWS, 0), st.get(FEATURE_BYTES, 0)
    spent = st.get(SPENT, 0)
    answers = st.get(SHIPPED_TURNS, 0) if settings.multi_turn == Mode.REGENERATE else progress.done
    left = max(progress.items - progress.done - progress.failed_only, 0)
    per_row = size / written if written else None
    per_item = rows / progress.done if progress.done else None
    projected = None
    if per_row is not None and per_item is not None:
        projected = round(size + per_row * per_item * left)
    elif left == 0 and progress.items:
        projected = size  # over, and nothing shipped: nothing will be
    budget_spent = c.budget is not None and spent >= c.budget
    kept = projected
    if c.budget is not None and projected is not None:
        kept = max(size, min(projected, c.budget)) if not budget_spent else max(size, spent)
    figures: CaptureFigures = {
        "what": c.what.value, "layers": list(c.layers), "dtype": c.dtype.value,
        "choice": [x.value for x in c.choices], "chosen": c.describe(), "share": c.share,
        "sources": [(s.name, s.share) for s in c.sources],
        "rows": rows, "rows_written": written, "rows_extra": max(written - rows, 0), "bytes": size,
        "answers": answers, "budget": c.budget, "spent": spent, "budget_spent": budget_spent,
        "bytes_per_row": per_row, "rows_per_item": per_item, "items_left": left,
        "projected_bytes": projected, "projected_kept": kept, "capture_pass": None}
    pf = settings.prefill
    if pf is not None:  # a pass chose its rows when it was enqueued: its choice, and their bytes exactly
        figures["capture_pass"] = {"source": pf.source, "by": pf.by.value, "budget": pf.budget, "rows": pf.rows,
                                   "source_rows": pf.source_rows, "tokens": pf.tokens, "bytes": pf.bytes}
        figures["choice"] = ["pass", pf.by.value]
        figures["chosen"] = (f"a capture pass over run {pf.source}: {pf.rows:,} of its {pf.source_rows:,} rows, "
                             + ("the drafter's worst first" if pf.by is PrefillChoice.ACCEPTANCE else "in its order")
                             + (f", within {format_size(pf.budget)}" if pf.budget is not None else ""))
        figures["budget"] = pf.budget
        figures["answers"] = progress.done  # a pass's item is one row to capture
        if pf.bytes is not None and left:
            figures["projected_bytes"] = figures["projected_kept"] = max(pf.bytes, size)
    return figures


def read_capture_figures(conn: redis.Redis, run: str, settings: RunSettings) -> CaptureFigures | None:
    """capture_figures of RUN (of SETTINGS) from one read of its marks and counters."""
    if settings.capture is None:
        return None
    return capture_figures(settings, Marks(conn, run).progress())


class LogprobsFigures(TypedDict):
    """A --logprobs run's tables: K, what the consumers have shipped so far, and what the run's
    tables will come to at this rate."""

    k: int
    rows: int  # every table row stored (a redone answer's second row counted)
    rows_distinct: int  # rows the done items' results name, each item once: what a trainer gets
    rows_extra: int  # rows beyond those: copies of redone answers, or rows whose results are on the way
    tokens: int  # generated tokens with a table, of every row stored
    bytes: int  # of every row stored in the output
    answers: int  # answers the done items hold (user turns answered, in regenerate)
    bytes_per_token: float | None  # None before a row shipped
    bytes_per_row: float | None
    rows_per_item: float | None  # distinct rows per done item so far
    items_left: int  # items not done nor failed
    projected_tokens: int | None  # tokens with a table at the run's end, at the rates so far
    projected_bytes: int | None  # the tables' bytes at the run's end: bytes per row x rows still to come, plus what shipped


def logprobs_figures(settings: RunSettings, progress: Progress) -> LogprobsFigures | None:
    """The table figures of a run of SETTINGS from PROGRESS (one read of its marks and counters),
    None for a run without --logprobs. The projection is capture_figures': the bytes (tokens)
    shipped, plus the bytes (tokens) per row stored so far times the rows still to come (the
    distinct rows per done item so far times the items left)."""
    if settings.logprobs is None:
        return None
    st = progress.stats
    written, distinct = st.get(FEATURE_ROWS, 0), st.get(SHIPPED_FEATURES, 0)
    tokens, size = st.get(FEATURE_TOKENS, 0), st.get(FEATURE_BYTES, 0)
    answers = st.get(SHIPPED_TURNS, 0) if settings.multi_turn == Mode.REGENERATE else progress.done
    left = max(progress.items - progress.done - progress.failed_only, 0)
    per_item = distinct / progress.done if progress.done else None
    to_come = per_item * left if per_item is not None and written else None
    projected_bytes = projected_tokens = None
    if to_come is not None:
        projected_bytes = round(size + size / written * to_come)
        projected_tokens = round(tokens + tokens / written * to_come)
    elif left == 0 and progress.items:  # over, and nothing shipped: nothing will be
        projected_bytes, projected_tokens = size, tokens
    return {"k": settings.logprobs, "rows": written, "rows_distinct": distinct, "rows_extra": max(written - distinct, 0),
            "tokens": tokens, "bytes": size, "answers": answers,
            "bytes_per_token": size / tokens if tokens else None, "bytes_per_row": size / written if written else None,
            "rows_per_item": per_item, "items_left": left, "projected_tokens": projected_tokens,
            "projected_bytes": projected_bytes}


def read_logprobs_figures(conn: redis.Redis, run: str, settings: RunSettings) -> LogprobsFigures | None:
    """logprobs_figures of RUN (of SETTINGS) from one read of its marks and counters."""
    if settings.logprobs is None:
        return None
    return logprobs_figures(settings, Marks(conn, run).progress())
