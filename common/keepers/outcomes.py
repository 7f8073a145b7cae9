"""A run's outcome figures, from the counters the marks keeper bumps with each item it marks
(common/keepers/marks.py: `shipped_outcome_<outcome>`, `shipped_failed_<class>`,
`shipped_tools_<ToolTurns>` in the run's stats): one function, `outcome_view`, for every screen
that shows them (`producer status`, `producer runs`), so both show the same figures.
"""

from __future__ import annotations

from typing import TypedDict

from genqueue.common.contracts import ErrorClass, Outcome, ToolTurns
from genqueue.common.keepers.marks import SHIPPED_FAILED, SHIPPED_OUTCOME, SHIPPED_TOOLS

#: The outcomes export counts as `cut`: the answer did not end on its own.
CUT = (Outcome.CUT_IN_ANSWER.value, Outcome.CUT_IN_THINKING.value, Outcome.NO_ANSWER.value)


class OutcomeView(TypedDict):
    """Items done and failed in export's words."""

    done: int
    complete: int
    partial: int
    cut: int
    cut_by_outcome: dict[str, int]
    outcomes: dict[str, int]
    outcomes_counted: int
    failed: int
    failed_by_class: dict[str, int]
    # regenerate conversations with recorded tool turns (export's keys, contracts.ToolTurns):
    # regenerated to the end, stopped at a divergence, stopped at a tool turn for another reason
    tool_turns_to_end: int
    tool_call_diverged: int
    stopped_at_tool_turn: int



def outcome_view(stats: dict[str, int], done: int, failed: int) -> OutcomeView:
    """DONE and FAILED items in export's words. `outcomes` sums to DONE whenever the marks were
    written by consumers or rebuilt from the shards after a Redis loss (`counted` says how many
    items the counters cover otherwise: records without an outcome are counted by none). The tool-turn counts
    are export's: regenerate conversations with recorded tool turns, by what became of them."""
    outcomes = _by_name(stats, SHIPPED_OUTCOME, [o.value for o in Outcome])
    by_class = _by_name(stats, SHIPPED_FAILED, [c.value for c in ErrorClass])
    cut = {k: v for k, v in outcomes.items() if k in CUT}
    counted = sum(outcomes.values())
    return {
        "done": done,
        "complete": outcomes.get(Outcome.FINISHED.value, 0),
        "partial": outcomes.get(Outcome.PARTIAL.value, 0),
        "cut": sum(cut.values()),
        "cut_by_outcome": cut,
        "outcomes": outcomes,
        "outcomes_counted": counted,
        "failed": failed,
        "failed_by_class": by_class,
        "tool_turns_to_end": stats.get(SHIPPED_TOOLS + ToolTurns.TO_END, 0),
        "tool_call_diverged": stats.get(SHIPPED_TOOLS + ToolTurns.DIVERGED, 0),
        "stopped_at_tool_turn": stats.get(SHIPPED_TOOLS + ToolTurns.STOPPED, 0),
    }


def _by_name(stats: dict[str, int], prefix: str, known: list[str]) -> dict[str, int]:
    """Counters named PREFIX<name>: the KNOWN names in their order, then any others sorted."""
    found = {k[len(prefix):]: v for k, v in stats.items() if k.startswith(prefix) and v}
    ordered = {n: found[n] for n in known if n in found}
    ordered.update(sorted((n, v) for n, v in found.items() if n not in ordered))
    return ordered
