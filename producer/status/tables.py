"""A --logprobs run's tables on `producer status`: K, and the rows, tokens and bytes shipped (pure,
from one read of the run's counters: common/keepers/runs.py's FEATURE_* fields, which a run of
--logprobs fills with its table rows alone, as --capture cannot go with it)."""

from __future__ import annotations

from typing import TypedDict

from genqueue.common.keepers.runs import FEATURE_BYTES, FEATURE_ROWS, FEATURE_TOKENS
from genqueue.common.settings import RunSettings


class LogprobsView(TypedDict):
    """K, and the table rows the consumers have shipped (a redone answer's second row counted)."""

    k: int
    rows: int
    tokens: int  # generated tokens with a table
    bytes: int
    bytes_per_token: float | None  # None before a row shipped


def logprobs_figures(settings: RunSettings, stats: dict[str, int]) -> LogprobsView | None:
    """The tables of a run of SETTINGS from its counters STATS; None for a run without --logprobs."""
    if settings.logprobs is None:
        return None
    tokens, size = stats.get(FEATURE_TOKENS, 0), stats.get(FEATURE_BYTES, 0)
    return {"k": settings.logprobs, "rows": stats.get(FEATURE_ROWS, 0), "tokens": tokens, "bytes": size,
            "bytes_per_token": size / tokens if tokens else None}


def logprobs_line(v: LogprobsView) -> str:
    """The status line of a run's tables."""
    per = "" if v["bytes_per_token"] is None else f" ({v['bytes_per_token']:,.0f} B a token)"
    return f"on: top {v['k']}; {v['rows']:,} rows, {v['tokens']:,} tokens, {v['bytes'] / 1e6:,.1f} MB shipped{per}"
