"""Reading a shipped record (pure, no I/O): what it counts as, by the one rule the mark keeper,
`producer status` and `producer export` all count by.

A record is a result or an error record (common/contracts.py) read back as a mapping: these
functions take any mapping and never raise on a field of another type, so a torn or foreign
line counts as nothing rather than stopping a count.
"""

from __future__ import annotations

from collections.abc import Mapping

from genqueue.common.contracts import Note, ToolTurns


def record_kind(rec: Mapping[str, object]) -> str:
    """The outcome of a result record, or the class of an error record ("" when neither)."""
    err = rec.get("error")
    if isinstance(err, dict):
        return str(err.get("class") or "")
    return str(rec.get("outcome") or "")


def record_turns(rec: Mapping[str, object]) -> int:
    """How many user turns a regenerate record answered (0 for any other record): the answers
    after tool results within a user turn (they have a `step`) are not turns of their own, so
    the count stays comparable with the run's user turns."""
    turns = rec.get("turns")
    return sum(1 for t in turns if not (isinstance(t, dict) and "step" in t)) if isinstance(turns, list) else 0


def record_feature_rows(rec: Mapping[str, object]) -> int:
    """How many feature rows (--capture's hidden states, or --logprobs's tables: a run stores one
    kind) a result record names: its answer's, or each regenerated turn's."""
    turns = rec.get("turns")
    answers = turns if isinstance(turns, list) else [rec]
    return sum(1 for a in answers if isinstance(a, Mapping)
               and any(isinstance(ref := a.get(f), Mapping) and "row" in ref for f in ("features", "logprobs")))


def record_tool_turns(rec: Mapping[str, object]) -> ToolTurns | None:
    """What became of a regenerate record's recorded tool turns (None: it had none, it stopped
    elsewhere, or it is no regenerate record): the one rule status and export count by.
    Regenerated to the end: tool results were spliced in and nothing stopped it."""
    turns = rec.get("turns")
    if not isinstance(turns, list):
        return None
    note, stopped = rec.get("note"), rec.get("stopped")
    stopped = stopped if isinstance(stopped, dict) else None
    if note == Note.TOOL_CALL_DIVERGED or (stopped is not None and stopped.get("reason") == Note.TOOL_CALL_DIVERGED):
        return ToolTurns.DIVERGED
    if note == Note.STOPPED_AT_TOOL_TURN or (stopped is not None and stopped.get("step")):
        return ToolTurns.STOPPED  # cut by the producer, or an answer after tool results failed or was cut
    if stopped is None and any(isinstance(t, dict) and t.get("tool_results_spliced") for t in turns):
        return ToolTurns.TO_END
    return None
