"""A run's outcome figures, from the counters the marks keeper bumps with each item it marks
(common/keepers/marks.py: `shipped_outcome_<outcome>`, `shipped_failed_<class>`,
`shipped_tools_<ToolTurns>` in the run's stats): one function, `outcome_view`, for every screen
that shows them (`producer status`, `producer runs`), so both show the same figures. The jobs
rq gave up on, by class (a pack that did not read named), are read and worded once here too
(`read_failed_jobs`, `failed_jobs_line`) for the same screens.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypedDict

import redis

from genqueue.common.contracts import ErrorClass, Outcome, ToolTurns
from genqueue.common.keepers.markscript import SHIPPED_FAILED, SHIPPED_OUTCOME, SHIPPED_TOOLS
from genqueue.common.keepers.packs import PackTable
from genqueue.common.keepers.rqfailed import FailedJob, failed_jobs

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


class FailedClassView(TypedDict):
    """The jobs rq gave up on for one reason class (rqjobs.failure_class), their items, and for
    pack_unreadable the packs they name."""

    jobs: int
    items: int
    packs: list[str]


class FailedJobsView(TypedDict):
    """The run's jobs in rq's failed registry: their items are in no queue (`rq requeue` runs
    them again); export counts the ones no shard holds as failed, by the same classes."""

    jobs: int
    items: int
    by_class: dict[str, FailedClassView]


def failed_jobs_view(jobs: list[FailedJob], names: Mapping[int, str]) -> FailedJobsView:
    """JOBS (rq's failed registry, rqjobs.failed_jobs) by class, with their items; for
    pack_unreadable, the packs they name (NAMES: the run's pack table; a number it lacks is
    shown as one)."""
    by: dict[str, FailedClassView] = {}
    for j in jobs:
        v = by.setdefault(j.cls.value, {"jobs": 0, "items": 0, "packs": []})
        v["jobs"] += 1
        v["items"] += j.items
        if j.cls is ErrorClass.PACK_UNREADABLE and j.ref is not None:
            name = names.get(j.ref.pack, f"number {j.ref.pack}")
            if name not in v["packs"]:
                v["packs"].append(name)
    ordered = dict(sorted(by.items(), key=lambda kv: -kv[1]["items"]))
    return {"jobs": len(jobs), "items": sum(j.items for j in jobs), "by_class": ordered}


def read_failed_jobs(conn: redis.Redis, run: str) -> FailedJobsView:
    """RUN's failed rq jobs by class (failed_jobs_view), from one read of rq's failed registry
    and, when a job names a pack, of the run's pack table."""
    gave_up = failed_jobs(conn, run)
    names = PackTable(conn, run).names() if any(j.ref is not None for j in gave_up) else {}
    return failed_jobs_view(gave_up, names)


def failed_jobs_line(v: FailedJobsView, queue: str) -> str:
    """The jobs rq gave up on: how many and their items, by class (export's for their items),
    the packs that did not read, and the command that runs them again."""
    parts = []
    for cls, c in v["by_class"].items():
        packs = f" (pack{'s' if len(c['packs']) > 1 else ''} {', '.join(c['packs'])})" if c["packs"] else ""
        parts.append(f"{cls} {c['items']:,} items in {c['jobs']:,} jobs{packs}")
    again = "once the pack reads again" if ErrorClass.PACK_UNREADABLE in v["by_class"] else "once the cause is fixed"
    return f"{'; '.join(parts)}; `rq requeue --queue {queue} --all` runs them {again}"
