"""The partition files between the export's two passes: each record as a fixed binary header
and a blob, written by pass 1 (partition.py) and read back by pass 2 (reduce.py).

The header holds what pass 2 ranks, orders and counts a record by without parsing its lines:
its key digest and place, its kind (what it becomes, which is also its rank among the copies of
one key), the tie-break fields, the quality gates' flags, its rows' counts and the lengths of
what follows. The blob is its lines in the output shape (those bound for the dataset first),
then its answers' acceptance trailer.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator

import orjson

from genqueue.common.acceptance import Answer, answers_of
from genqueue.common.contracts import Outcome, ToolTurns
from genqueue.common.records import ResultRecord, record_tool_turns

#: What a kept record becomes; also its rank among copies of one key (lower wins), in the kind
#: byte's bits 0-1. OTHER: a record of another variant than the one exported (written nowhere).
INCLUDED, EXCLUDED, ERROR, OTHER = 0, 1, 2, 3
#: An answer's outcome rides in the kind byte's bits 2-4 (code 0: none known), so pass 2 counts
#: outcomes without parsing lines.
OUTCOME_NAMES = ("unknown", *(o.value for o in Outcome))
OUTCOME_CODE = {name: code for code, name in enumerate(OUTCOME_NAMES)}
#: A regenerate conversation's tool turns, in bits 5-6: 0 none, then regenerated to the end,
#: stopped at a divergence, stopped at a tool turn for another reason.
TOOLS_TO_END, TOOLS_DIVERGED, TOOLS_STOPPED = 1, 2, 3
TOOLS_CODE = {ToolTurns.TO_END: TOOLS_TO_END, ToolTurns.DIVERGED: TOOLS_DIVERGED, ToolTurns.STOPPED: TOOLS_STOPPED}
#: Bit 7: an end-of-run copy's record (it ranks after the original among one key's).
COPY = 1 << 7
if len(OUTCOME_NAMES) > 8:  # pragma: no cover - a new outcome must not spill into the tool bits
    raise RuntimeError("outcome codes need more than 3 bits of the partition header's kind byte")

#: key digest, source place, position, turn (-1: none), sample (-1: none), kind, attempt,
#: finished_at, shard ordinal, line, the quality gates' flags (gates.BIT) and the digest of the
#: generated text (gates.record_flags; 0: none); the rows (genrows.RecordRows): the bytes of the
#: blob bound for the dataset (the rest goes to the truncated file), the rows in each part, the
#: dataset rows under --rows generation and (0/1) conversation, the thinking traces and those
#: each layout keeps; the length of its answers' acceptance trailer (0: no figures), and the
#: length of the blob that follows: the lines in the output shape (or, for an error record, its
#: errors-file line), then the trailer.
HEADER = struct.Struct("<16sIqiiBIdIIBQIIIIBIIIII")
#: The header fields after the flags and digest, zero for a record that is no success record.
NO_ROWS = (0, 0, 0, 0, 0, 0, 0, 0)


def tool_turns_code(rec: ResultRecord) -> int:
    """What became of a regenerate conversation's tool turns, as a TOOLS_ code (0: it had none,
    or it stopped elsewhere): records.record_tool_turns, the rule status counts by too."""
    tools = record_tool_turns(rec)
    return 0 if tools is None else TOOLS_CODE[tools]


def trailer(rec: ResultRecord) -> bytes:
    """REC's answers with figures, compactly, for the acceptance table of the copy pass 2 keeps:
    [source, variant, turn, length, steps, drafted, accepted] each (empty: none)."""
    answers = [[a.source, a.variant, a.turn, a.length, a.spec["steps"], a.spec["drafted"], a.spec["accepted"]]
               for a in answers_of(rec)]
    return orjson.dumps(answers) if answers else b""


def trailer_answers(data: bytes) -> Iterator[Answer]:
    """The answers a trailer holds, as the acceptance table adds them."""
    for source, variant, turn, length, steps, drafted, accepted in orjson.loads(data):
        yield Answer(source, variant, turn, length,
                     {"k": 0, "steps": steps, "drafted": drafted, "accepted": accepted, "hist": []})
