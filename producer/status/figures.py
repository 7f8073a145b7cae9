"""The figures `producer status` shows, made to agree with each other (pure, no I/O).

Every figure is one run's: a consumer serving several runs reports each run's load and shipping
apart (contracts.RunCounters), and only that run's share is counted here. Outcomes use export's
words (complete, partial, cut by outcome, failed) and come from the counters the done marks
bump in the same script (common/keepers/marks.py), so they sum to `done` at every moment. An item is
in exactly one place: queued, in flight (held by a consumer), shipping (written, not shipped),
done, failed, or elsewhere (in a failed rq job, or moved since a consumer last reported); the
failed rq jobs are shown by class (common/keepers/outcomes.py: failed_jobs_view, the function
`producer runs` shows them by too), as export counts their items.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal, cast

from genqueue.common.keepers.snapshots import ConsumerReport
from genqueue.producer.status.report import (
    FileView,
    InputView,
    Rates,
    RunShare,
    ShareShipping,
)


def run_share(c: ConsumerReport, run: str) -> RunShare:
    """Consumer C's figures for RUN: in flight, waiting for a slot, jobs held, shipping. A
    snapshot of the first shape (consumer-wide figures only) counts for RUN only when RUN is
    the one run it serves: never another run's figures under this one."""
    r = c["runs"][run]
    alone = len(c["runs"]) == 1

    def pick(key: Literal["in_flight", "pending_items", "held_jobs"]) -> int:
        v = r.get(key)
        if isinstance(v, int):
            return v
        return int(c.get(key, 0) or 0) if alone else 0

    own = r.get("shipping")
    ship: Mapping[str, object] = own if isinstance(own, dict) else (c.get("shipping") or {}) if alone else {}
    return {"in_flight": pick("in_flight"), "pending_items": pick("pending_items"), "held_jobs": pick("held_jobs"),
            "shipping": share_shipping(ship)}


def share_shipping(ship: Mapping[str, object]) -> ShareShipping:
    """A copy of SHIP, a snapshot's shipping figures (a run's RunShippingView, or the first
    shape's consumer-wide ShippingView): read field by field, any of which may be missing."""
    return cast(ShareShipping, dict(ship))


def placement(items: int, done: int, failed: int, in_flight: int, unshipped: int, jobs_queued: int) -> dict[str, int]:
    """Where each of ITEMS is; the parts sum to ITEMS. Consumers report every few seconds, rq
    now: items queued are zero exactly when no job is queued (at least one per queued job)."""
    remaining = max(items - done - failed, 0)
    shipping = min(unshipped, remaining)
    held = min(in_flight, remaining - shipping)
    queued = remaining - shipping - held
    if jobs_queued == 0:
        queued = 0
    elif queued < jobs_queued:  # a report older than rq's count: what it called in flight moved
        queued = min(jobs_queued, remaining - shipping)
        held = remaining - shipping - queued
    return {"queued": queued, "in_flight": held, "shipping": shipping, "done": done, "failed": failed,
            "elsewhere": remaining - shipping - held - queued}


def input_view(sources: dict[str, dict[str, Any]], reading: dict[str, float] | None = None) -> InputView:
    """What was read of each input: records read, whether the read was complete, rejected by
    reason, and what the multi-turn rule met (records with several user turns); READING: the
    inputs an enqueue is reading now, with when it began."""
    files: list[FileView] = []
    rejected: dict[str, int] = {}
    for name, s in sorted(sources.items(), key=lambda kv: int(kv[1].get("source_seq", 0) or 0)):
        by = {str(k): int(v) for k, v in (s.get("rejected_by_reason") or {}).items()}
        for reason, n in by.items():
            rejected[reason] = rejected.get(reason, 0) + n
        files.append({"name": name, "records": int(s.get("records", 0) or 0), "complete": bool(s.get("complete")),
                      "rejected": sum(by.values()), "rejected_by_reason": by,
                      "multi_turn_records": int(s.get("multi_turn_records", 0) or 0),
                      "user_turns": int(s.get("user_turns", 0) or 0),
                      "stopped_at_tool_turn": int(s.get("stopped_at_tool_turn", 0) or 0)})
    return {
        "files": files,
        "reading": dict(sorted((reading or {}).items())),
        "records": sum(f["records"] for f in files),
        "complete": bool(files) and all(f["complete"] for f in files) and not reading,
        "rejected": sum(rejected.values()),
        "rejected_by_reason": dict(sorted(rejected.items())),
        "multi_turn_records": sum(f["multi_turn_records"] for f in files),
        "user_turns": sum(f["user_turns"] for f in files),
        "stopped_at_tool_turn": sum(f["stopped_at_tool_turn"] for f in files),
    }


def speed_note(items: int, done: int, failed: int, live: int, answering: float | None = None) -> str | None:
    """Why the last minute's rate is blank, or None when it is a rate: nothing shipped yet (a
    rate beside `done 0` would be the spool's, not the run's), the run is over, no consumer,
    or (ANSWERING: the live consumers' items a second) none answered anything for a minute: a
    rate of 0 gives no ETA, and a rate is shown only with its ETA."""
    if items and done + failed >= items:
        return "run over, NOT complete: items ended as errors" if failed else "run complete"
    if not live:
        return "no live consumer"
    if done + failed == 0:
        return "nothing shipped yet"
    if answering is not None and answering <= 0:
        return "nothing answered in the last minute"
    return None


def eta_view(remaining: int, tokens_left: float | None, measured: bool, recent: Rates,
             note: str | None) -> tuple[float | None, str | None]:
    """(seconds left, what they assume): the run's one ETA, REMAINING items at the last minute's
    rates RECENT. Tokens: TOKENS_LEFT (cost.py remaining_tokens, the figure the cost
    projects from too) at the completion-token rate, when MEASURED (from the tokens per item
    answered so far); else, with no token to go by (every item an error), at the items rate.
    None exactly when the rates are blank (NOTE says why); 0 with nothing left."""
    if not remaining:
        return 0.0, None
    if note:
        return None, None
    tok_s, items_s = recent["completion_tokens_per_s"] or 0.0, recent["completions_per_s"] or 0.0
    if measured and tokens_left and tok_s > 0:
        return tokens_left / tok_s, "completion_tokens"
    if items_s > 0:
        return remaining / items_s, "items"
    return None, None


def run_clock(started_at: float | None, now: float, ended_at: float | None, *, over: bool) -> float | None:
    """The seconds the run has run: from its first job's start to NOW while it runs; once OVER,
    to ENDED_AT (when its last item was marked), so that a finished run keeps the rate it ran at
    instead of one that decays as time passes. None: not started, or over with no end recorded."""
    if started_at is None:
        return None
    end = (ended_at if ended_at is not None and ended_at >= started_at else None) if over else now
    return max(end - started_at, 0.0) if end is not None else None


def run_rates(finished: int, completion_tokens: int, prompt_tokens: int, seconds: float | None) -> Rates:
    """The run's own rates: items FINISHED (done or failed) and tokens over the SECONDS it ran
    (run_clock); blank before anything finished or without a clock."""
    def per_s(total: int) -> float | None:
        return total / seconds if seconds and finished else None

    return {"completions_per_s": per_s(finished), "completion_tokens_per_s": per_s(completion_tokens),
            "prompt_tokens_per_s": per_s(prompt_tokens)}
