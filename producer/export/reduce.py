"""Pass 2 of the export: one partition at a time in memory, one record kept per key, sent where
it belongs, and counted.

Which copy of a duplicated item is kept (deterministic, whatever order shards are read in): an
included answer beats an excluded one, which beats an error record; then the original beats an
end-of-run copy (`copy: true`: of two answers racing to one prompt the shorter tends to end
first, so keeping the original keeps lengths unbiased); then the lowest `attempt`; then the
earliest `timings.finished_at`; then the first in shard-name order, then line order.

The kept records, sorted by (source place, position, turn, sample, key), go to the dataset (an
answer whose outcome is included; a row the quality gates flag goes to the flagged file instead
when asked), the truncated file (the rest of its rows), or the errors file (keys with only error
records); a record of another variant goes nowhere. Each kept answered item adds its answers'
acceptance figures to one table, once however many copies it had. Every kept key is added to
the run's seen set, which the coverage check reads.
"""

from __future__ import annotations

from pathlib import Path
from typing import IO

import orjson

from genqueue.common.acceptance import AcceptanceTable, Facet, category_order, figures, weakest_line
from genqueue.common.contracts import Outcome
from genqueue.common.keepers.exportsets import ScratchSet
from genqueue.producer.export.gates import BIT, REASONS, Duplicates, FlagReason, reasons
from genqueue.producer.export.parts import (
    ERROR,
    EXCLUDED,
    HEADER,
    INCLUDED,
    OTHER,
    OUTCOME_NAMES,
    TOOLS_DIVERGED,
    TOOLS_STOPPED,
    TOOLS_TO_END,
    trailer_answers,
)
from genqueue.producer.export.plan import ExportPlan, ExportResult
from genqueue.producer.export.sinks import Sink

#: Digests per SADD when export records what it wrote: ~160 KB a command, so Redis never blocks long.
SADD_BATCH = 10_000


class Reducer:
    """Pass 2 of PLAN's export: each partition's kept records written and counted in RESULT,
    their keys added to SEEN; `table`: the kept answers' acceptance."""

    def __init__(self, plan: ExportPlan, result: ExportResult, seen: ScratchSet) -> None:
        self.result = result
        self.seen = seen
        self.only_target_turns = plan.only_target_turns
        # Flagged rows kept out of the dataset go to a side file, never nowhere.
        self.drop_mask = (sum(BIT.values()) if plan.drop_flagged else 0) | (
            BIT[FlagReason.ORIGINAL_TURNS] if plan.only_target_turns else 0)
        self.duplicates = Duplicates()
        self.table = AcceptanceTable()

    def reduce(self, part: Path, out: Sink, errs: IO[bytes], cut: IO[bytes], flagged: IO[bytes] | None = None) -> None:
        """The records of the partition file PART: one kept per key, each written where it belongs."""
        data = part.read_bytes()
        view = memoryview(data)
        unpack = HEADER.unpack_from
        hsize = HEADER.size
        best: dict[bytes, tuple[tuple[int, int, int, float, int, int], tuple[int, int, int, int], int, int, int,
                                int, int, tuple[int, ...], int]] = {}
        pos = n = 0
        end_all = len(data)
        while pos < end_all:
            (key, place, index, turn, sample, kind, attempt, finished, ordinal, lineno, flags, digest,
             *rows, tlen, blen) = unpack(data, pos)
            start = pos + hsize
            pos = start + blen
            n += 1
            rank = (kind & 3, kind >> 7, attempt, finished, ordinal, lineno)
            cur = best.get(key)
            if cur is None or rank < cur[0]:
                best[key] = (rank, (place, index, turn, sample), start, pos, (kind >> 2) & 31, flags, digest,
                             tuple(rows), tlen)
        self.result.duplicates_removed += n - len(best)
        batch: list[bytes] = []
        r = self.result
        kept = sorted(best.items(), key=lambda kv: (kv[1][1], kv[0]))
        # Duplicates across items, in the dataset's order: the first of a text stays clean.
        dups = iter(self.duplicates.check([v[6] for _, v in kept if v[0][0] == INCLUDED]))
        duplicate, original = BIT[FlagReason.DUPLICATE_ANSWER], BIT[FlagReason.ORIGINAL_TURNS]
        for key, (rank, order, start, end, code, flags, _digest, counts, tlen) in kept:
            split, rows_in, rows_out, gen_rows, conv_row, traces, kept_gen, kept_conv = counts
            stop = end - tlen
            if tlen and rank[0] < ERROR:
                for answer in trailer_answers(bytes(view[stop:end])):
                    self.table.add(answer)
            if rank[0] < ERROR:
                self._count_outcome(OUTCOME_NAMES[code & 7], included=rank[0] == INCLUDED)
                self._count_tool_turns(code >> 3)
                r.traces += traces
                if rows_out:
                    cut.write(view[start + split:stop])
                    r.truncated_rows += rows_out
            if rank[0] == INCLUDED:
                line = view[start:start + split]
                if next(dups):
                    flags |= duplicate
                if flags & original:
                    r.original_turns += 1
                    if not self.only_target_turns:
                        flags &= ~original
                if not (flags and self._flag(flags, line, flagged, rows_in)):
                    out.write(line, order[:3])  # the prompt: the samples of one are grouped on request
                    self._count_layouts(gen_rows, conv_row, kept_gen, kept_conv)
            elif rank[0] == EXCLUDED:  # no row in this layout; the other may have some
                self._count_layouts(gen_rows, conv_row, kept_gen, kept_conv)
            elif rank[0] == OTHER:
                r.other_variants += 1
            elif rank[0] == ERROR:
                line = view[start:stop]
                errs.write(line)
                r.failed += 1
                cls = _error_class(bytes(line))
                r.failed_by_class[cls] = r.failed_by_class.get(cls, 0) + 1
            batch.append(key)
            if len(batch) >= SADD_BATCH:
                self.seen.add(batch)
                batch = []
        if batch:
            self.seen.add(batch)
        view.release()

    def _flag(self, flags: int, line: memoryview, flagged: IO[bytes] | None, rows: int = 1) -> bool:
        """Count a flagged record's dataset ROWS (its LINE: gates judge a conversation, so its
        flags go on every row it becomes); True when they go to the flagged file (each with
        the reasons as `flags`) rather than the dataset."""
        r = self.result
        r.flagged += rows
        by = r.flagged_by_reason
        for reason in REASONS:
            if flags & BIT[reason]:
                by[reason.value] = by.get(reason.value, 0) + rows
        if flagged is None or not flags & self.drop_mask:
            return False
        r.flagged_dropped += rows
        prefix = b'{"flags":' + orjson.dumps(reasons(flags)) + b","
        for one in bytes(line).splitlines():
            flagged.write(prefix + one[1:] + b"\n")
        return True

    def _count_layouts(self, gen_rows: int, conv_row: int, kept_gen: int, kept_conv: int) -> None:
        """The dataset rows and kept traces each --rows layout makes of one item."""
        r = self.result
        r.generation_rows += gen_rows
        r.conversation_rows += conv_row
        r.traces_kept_generation += kept_gen
        r.traces_kept_conversation += kept_conv

    def _count_outcome(self, outcome: str, *, included: bool) -> None:
        """Coverage counts complete, partial and cut apart, whichever file each went to."""
        r = self.result
        if not included:
            r.truncated += 1
            r.truncated_by_outcome[outcome] = r.truncated_by_outcome.get(outcome, 0) + 1
        if outcome == Outcome.FINISHED:
            r.complete += 1
        elif outcome == Outcome.PARTIAL:
            r.partial += 1
        else:
            r.cut += 1
            r.cut_by_outcome[outcome] = r.cut_by_outcome.get(outcome, 0) + 1

    def _count_tool_turns(self, code: int) -> None:
        r = self.result
        if code == TOOLS_TO_END:
            r.tool_turns_to_end += 1
        elif code == TOOLS_DIVERGED:
            r.tool_call_diverged += 1
        elif code == TOOLS_STOPPED:
            r.stopped_at_tool_turn += 1


def acceptance_summary(table: AcceptanceTable) -> dict[str, object]:
    """TABLE as the summary's `acceptance` (empty when no answer had figures): overall, then per
    facet its categories by label, each with its answers, rate, mean length and counts, and the
    weakest category in words (common.acceptance.weakest_line; None: none stands out)."""
    if not table.overall.answers:
        return {}

    return {**figures(table.overall),
            "by": {f.value: [{"category": label, **figures(table.by[f][label])}
                             for label in category_order(f, table.by[f], table)] for f in Facet},
            "weakest": weakest_line(table)}


def _error_class(line: bytes) -> str:
    try:
        rec = orjson.loads(line)
        err = rec.get("error") or {}
        if "class" in err:
            return str(err["class"])
        if "code" in err:  # a Batch error line
            return str(err["code"])
        return str(rec["response"]["body"]["error"]["code"])
    except (orjson.JSONDecodeError, KeyError, TypeError, AttributeError):
        return "unknown"
