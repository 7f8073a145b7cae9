"""A --logprobs run's tables on `producer status`: the line and its forecast, from the figures
common/keepers/captured.py's `logprobs_figures` computes from the one read of the run's marks and
counters (the export's card shows the same)."""

from __future__ import annotations

from genqueue.common.capture import format_size
from genqueue.common.keepers.captured import LogprobsFigures

#: The status report's section (its --json `logprobs`).
LogprobsView = LogprobsFigures


def logprobs_line(v: LogprobsView) -> str:
    """The status line of a run's tables."""
    per = "" if v["bytes_per_token"] is None else f" ({v['bytes_per_token']:,.0f} B a token)"
    extra = (f"; {v['rows_distinct']:,} named by done items' results, {v['rows_extra']:,} redone or awaiting "
             "their results" if v["rows_extra"] else "")
    return (f"on: top {v['k']}; {v['rows']:,} rows, {v['tokens']:,} tokens, {v['bytes'] / 1e6:,.1f} MB shipped"
            f"{per}{extra}")


def logprobs_rows(v: LogprobsView) -> list[tuple[str, str]]:
    """The status rows of a run's tables: the line, and while items are left the forecast."""
    rows = [("logprobs", logprobs_line(v))]
    if not v["items_left"]:
        return rows  # over: what shipped is what there is
    if v["projected_bytes"] is None or v["projected_tokens"] is None:
        rows.append(("  forecast", "none yet: no row shipped"))
    else:
        rows.append(("  forecast", (f"{format_size(v['projected_bytes'])} for the run, {v['projected_tokens']:,} tokens "
                                    f"({format_size(v['bytes_per_row'] or 0)} a row x {v['rows_per_item'] or 0:.2f} "
                                    f"rows an item x {v['items_left']:,} items left, plus what shipped)")))
    return rows
