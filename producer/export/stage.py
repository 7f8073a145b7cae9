"""Selection by acceptance on a streamed export: `--weight-by-acceptance` and
`--keep-lowest-acceptance SHARE`.

Both need every row's acceptance before the first row is written: a weight is normalised over
the whole dataset, and the lowest SHARE is a global threshold. The export's pass 2 decides the
dataset row by row, partition by partition (after dedupe and the quality gates), so with either
option it writes the dataset's rows to a stage file in the work directory instead, each with
its prompt group, and keeps one float per row (its rate: accepted / drafted from the row's own
`acceptance` counts, NaN for a row without figures) and a small source ordinal. Pass 3 reads
the rates once (selection.cut, selection.weight_scale), then streams the stage file into the
real sink (JSONL or Parquet, grouped or not) in the same order, leaving out the rows the rule
does not keep and adding `sample_weight` to each row kept when weighting. Memory: two numbers
per row, and the sort of the rates under --keep-lowest-acceptance; disk: the dataset's size
once more, in --tmp-dir.

The weight's name is `sample_weight`: `weight` is already the per-message field OpenAI
fine-tuning and LLaMA-Factory/OpenHermes-style data read (genrows.py puts it on turns), and a
row-level key of the same name would be read as something else. Rows without figures weigh 1.
A weight is rounded (ACCEPTANCE_DIGITS) like the rates.
"""

from __future__ import annotations

import array
import math
import struct
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import orjson

from genqueue.producer.export import selection
from genqueue.producer.export.formats.lines import ACCEPTANCE, ACCEPTANCE_DIGITS
from genqueue.producer.export.sinks import WRITE_BUFFER, Group, GroupingSink, Sink
from genqueue.producer.outfiles import PARTITIONS, write_failed

#: The per-row sampling weight's name (see the module docstring).
WEIGHT_COLUMN = "sample_weight"
#: Each staged row: its prompt group (source place, position, turn), its length; then the line.
_ROW = struct.Struct("<qqqI")
_NO_SOURCE = "-"


def row_figures(row: Any) -> tuple[float | None, str, int, int]:
    """(rate, source, accepted, drafted) of one dataset row as written (a --group-samples line is
    staged before grouping, so every row is one line of the format)."""
    source = row.get("source") if isinstance(row, dict) else None
    acc = row.get(ACCEPTANCE) if isinstance(row, dict) else None
    name = source if isinstance(source, str) else _NO_SOURCE
    if not isinstance(acc, dict):
        return None, name, 0, 0
    drafted, accepted = int(acc.get("drafted") or 0), int(acc.get("accepted") or 0)
    return (accepted / drafted if drafted else None), name, accepted, drafted


class StageSink:
    """The dataset's rows, staged at PATH for pass 3, with each row's rate and source kept."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            self._fh: IO[bytes] | None = open(path, "wb", buffering=WRITE_BUFFER)  # noqa: SIM115
        except OSError as e:
            raise write_failed(e, path.parent, PARTITIONS) from None
        self.rates = array.array("d")
        self.sources = array.array("I")
        self.source_names: list[str] = []
        self._ordinal: dict[str, int] = {}

    def write(self, line: bytes | memoryview, group: Group | None = None) -> None:
        place, index, turn = group if group is not None else (-1, -1, -1)
        assert self._fh is not None
        for one in bytes(line).splitlines():
            if not one.strip():
                continue
            rate, source, _, _ = row_figures(orjson.loads(one))
            self.rates.append(math.nan if rate is None else rate)
            n = self._ordinal.get(source)
            if n is None:
                n = self._ordinal[source] = len(self.source_names)
                self.source_names.append(source)
            self.sources.append(n)
            try:
                self._fh.write(_ROW.pack(place, index, turn, len(one) + 1))
                self._fh.write(one + b"\n")
            except OSError as e:
                raise write_failed(e, self.path.parent, PARTITIONS) from None

    def close(self) -> None:
        if self._fh is not None:
            try:
                self._fh.close()
            except OSError as e:
                raise write_failed(e, self.path.parent, PARTITIONS) from None
            self._fh = None

    def abort(self) -> None:
        if self._fh is not None:
            try:
                self._fh.close()
            except OSError:
                pass  # the failure being handled is the one reported
            self._fh = None

    def rate(self, i: int) -> float | None:
        r = self.rates[i]
        return None if math.isnan(r) else r

    def write_selected(self, open_sink: Callable[[bool], Sink], *, weigh: bool,
                       share: float | None) -> tuple[dict[str, object], int]:
        """Stream the staged rows into the sink OPEN_SINK(weighted) opens: those SHARE keeps (None:
        all), each with its `sample_weight` when WEIGH. Returns what selection did (the summary's
        `selection`): rows in and kept, the rate range kept, the weights' range, by source; and the
        prompts written (--group-samples lines)."""
        n = len(self.rates)
        rule = selection.cut((self.rate(i) for i in range(n)), share) if share is not None else None
        keep = selection.Keeper(rule)
        scale = selection.weight_scale(self.rate(i) for i in range(n) if keep(self.rate(i)))
        keep = selection.Keeper(rule)
        by: dict[str, dict[str, int]] = {name: {"rows": 0, "with_figures": 0, "kept": 0}
                                         for name in self.source_names}
        kept = with_figures = 0
        lo = hi = w_lo = w_hi = None
        out = open_sink(weigh)
        try:
            with open(self.path, "rb", buffering=WRITE_BUFFER) as fh:
                for i in range(n):
                    head = fh.read(_ROW.size)
                    place, index, turn, length = _ROW.unpack(head)
                    line = fh.read(length)
                    rate = self.rate(i)
                    counts = by[self.source_names[self.sources[i]]]
                    counts["rows"] += 1
                    if rate is not None:
                        counts["with_figures"] += 1
                        with_figures += 1
                    if not keep(rate):
                        continue
                    kept += 1
                    counts["kept"] += 1
                    if rate is not None:
                        lo = rate if lo is None else min(lo, rate)
                        hi = rate if hi is None else max(hi, rate)
                    if weigh:
                        w = round(selection.weight(rate, scale), ACCEPTANCE_DIGITS)
                        w_lo = w if w_lo is None else min(w_lo, w)
                        w_hi = w if w_hi is None else max(w_hi, w)
                        row = orjson.loads(line)
                        row[WEIGHT_COLUMN] = w
                        line = orjson.dumps(row) + b"\n"
                    out.write(line, (place, index, turn))
        except BaseException:
            out.abort()
            raise
        out.close()
        groups = out.groups if isinstance(out, GroupingSink) else 0
        return {"weight_by_acceptance": weigh, "weight_column": WEIGHT_COLUMN if weigh else None,
                "keep_lowest_acceptance": share, "rows_in": n, "rows_with_figures": with_figures,
                "rows_kept": kept, "rows_left_out": n - kept,
                "rate_min": _r(lo), "rate_max": _r(hi), "weight_min": w_lo, "weight_max": w_hi,
                "by_source": by}, groups


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, ACCEPTANCE_DIGITS)
