"""One line of a result shard, read once: the record as the contract types it, and the fields
the export places, deduplicates and orders it by (key digest, source place, position, turn,
sample, attempt, finish time), converted as the partition header holds them.

A line that is not such a record raises one of BAD_LINE; the export counts it and reads on.
"""

from __future__ import annotations

import math

import orjson

from genqueue.common.records import Record

#: What reading (or converting) a line that is no usable record raises.
BAD_LINE = (orjson.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError)


#: A shard line's record and its placing fields: (record, the 16-byte digest of its key, its
#: source's place in the run, its position in that source, turn, sample (-1: none), attempt,
#: finish time (inf: unknown)). A plain tuple: one is made per line, a NamedTuple costs 10x more.
ShardLine = tuple[Record, bytes, int, int, int, int, int, float]


def read_line(line: bytes) -> ShardLine:
    """LINE's record and placing fields; raises one of BAD_LINE when it is none."""
    rec: Record = orjson.loads(line)
    key = bytes.fromhex(rec["key"])
    if len(key) != 16:
        raise ValueError("key is not 16 bytes")
    index = int(rec["index"])
    place = int(rec.get("source_seq") or 0)
    turn, sample, timings = rec.get("turn"), rec.get("sample"), rec.get("timings")
    finished = timings.get("finished_at") if timings else None
    return (rec, key, place, index, -1 if turn is None else int(turn), -1 if sample is None else int(sample),
            int(rec.get("attempt") or 0), float(finished or math.inf))
