"""What `producer export` shows a person: a progress bar on a terminal while it runs, and the
summary table after (failures first, then coverage, rows, flags, acceptance, the files).

The same figures are printed as one JSON object with --json (plan.ExportResult.to_dict); the
table is their reading in words, one row each.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING

from genqueue.common.keepers.rqjobs import malformed_line, refused_line
from genqueue.producer.export.formats import FORMATS, ExportFormat
from genqueue.producer.export.formats.spec import RowLayout
from genqueue.producer.export.plan import ExportResult
from genqueue.producer.export.sinks import NoProgress, Progress

if TYPE_CHECKING:
    from rich.progress import Progress as RichProgress
    from rich.progress import Task, TaskID


class _Bar:
    """A rich progress bar on stderr: records read of the manifests' total (rate, ETA), then
    partitions written."""

    wants_total = True

    def __init__(self, bar: RichProgress) -> None:
        self.bar = bar
        self.task: TaskID  # set by reading(), the first call

    def reading(self, records: int | None, shards: int) -> None:
        self.task = self.bar.add_task(f"reading {shards:,} shards", total=records)

    def read(self, records: int) -> None:
        self.bar.advance(self.task, records)

    def writing(self, partitions: int) -> None:
        self.bar.update(self.task, total=self.bar.tasks[-1].completed)
        self.task = self.bar.add_task("writing the dataset", total=partitions)

    def wrote(self) -> None:
        self.bar.advance(self.task, 1)


@contextmanager
def progress_bar(*, enabled: bool) -> Iterator[Progress]:
    """A bar on a terminal; nothing with --json or when stderr is not a terminal."""
    if not enabled:
        yield NoProgress()
        return
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        ProgressColumn,
        TaskProgressColumn,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )
    from rich.progress import Progress as RichProgress
    from rich.text import Text

    class Rate(ProgressColumn):
        def render(self, task: Task) -> Text:
            return Text(f"{task.speed:,.0f}/s" if task.speed else "", style="progress.data.speed")

    with RichProgress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TaskProgressColumn(),
                      Rate(), TimeElapsedColumn(), TimeRemainingColumn(),
                      console=Console(stderr=True), transient=True) as bar:
        yield _Bar(bar)


def _side_label(r: ExportResult) -> str:
    side = FORMATS[ExportFormat(r.format)].side_file
    return side.label if side is not None else "side file"


def rows_line(r: ExportResult) -> str:
    """What the conversations became in rows, and the thinking each layout keeps (--rows): the
    rows written (after any selection), and what the other layout would have made before it."""
    other = RowLayout.CONVERSATION if r.rows_layout == RowLayout.GENERATION else RowLayout.GENERATION
    other_rows = r.conversation_rows if other is RowLayout.CONVERSATION else r.generation_rows
    before = " before selection" if r.selection else ""
    gen_before, conv_before = (before, "") if other is RowLayout.GENERATION else ("", before)
    return (f"{r.rows:,} {r.rows_layout} rows from {r.exported:,} items (--rows {other}{before}: {other_rows:,}); "
            f"generated thinking traces kept: {r.traces_kept_generation:,} of {r.traces:,} in generation "
            f"rows{gen_before}, {r.traces_kept_conversation:,} in conversation rows{conv_before} (a chat template "
            "renders thinking only after the last user message)")


def acceptance_rows(r: ExportResult) -> list[tuple[str, str]]:
    """The summary's rows on speculative decoding: the answers' acceptance by source (and the
    weakest category), and what selection by acceptance did. None for a run without figures."""
    rows: list[tuple[str, str]] = []
    acc = r.acceptance
    if acc:
        overall = (f"{_pct(acc.get('rate'))} of draft tokens accepted, mean length {_num(acc.get('mean_length'))}, "
                   f"over {acc.get('answers', 0):,} answers")
        rows.append(("acceptance", overall))
        by = acc.get("by")
        for cat in (by.get("source", []) if isinstance(by, dict) else []):
            # the category in the value: a source is a path, and the key column sets every row's indent
            line = (f"{cat['category']}: {_pct(cat['rate'])}, mean length {_num(cat['mean_length'])}, "
                    f"{cat['answers']:,} answers")
            rows.append(("  by source", line))
        if acc.get("weakest"):
            rows.append(("  weakest", str(acc["weakest"])))
    sel = r.selection
    if sel:
        share = sel.get("keep_lowest_acceptance")
        what = [f"kept {sel['rows_kept']:,} of {sel['rows_in']:,} rows"]
        if share is not None:
            what.append(f"the lowest-acceptance {share:g} of the {sel['rows_with_figures']:,} with figures, rates "
                        f"{_pct(sel.get('rate_min'))}-{_pct(sel.get('rate_max'))}; {sel['rows_left_out']:,} left out "
                        "(not missing: their items are covered)")
        if sel.get("weight_by_acceptance"):
            what.append(f"weighted: `{sel['weight_column']}` {_num(sel.get('weight_min'))}-{_num(sel.get('weight_max'))}")
        rows.append(("selection", "; ".join(what)))
        by_source = sel.get("by_source")
        if share is not None and isinstance(by_source, dict):
            rows += [("  by source", f"{name}: {c['kept']:,} of {c['rows']:,} rows kept") for name, c in by_source.items()]
    return rows


def _pct(x: object) -> str:
    return f"{x:.1%}" if isinstance(x, float | int) else "-"


def _num(x: object) -> str:
    return f"{x:.2f}" if isinstance(x, float | int) else "-"


def format_export(r: ExportResult, extra: Sequence[tuple[str, str]] = ()) -> str:
    """The human summary printed after an export (EXTRA: rows before its time, the card's)."""
    rate = f"{r.records_read / r.seconds:,.0f} records/s" if r.seconds > 0 else "-"
    rows: list[tuple[str, str]] = []
    if r.failed:  # failures first: they are what a reader must see
        rows.append(("FAILED for good", f"{r.failed:,}"))
        rows += [(f"  {cls}", f"{n:,}") for cls, n in sorted(r.failed_by_class.items(), key=lambda kv: -kv[1])]
    container = " in Parquet" if r.container == "parquet" else ""
    rows += [
        ("run", f"{r.run}  ({r.format} format{container})"),
        ("read", f"{r.records_read:,} records in {r.shards:,} shards from {r.source}"),
        ("enqueued items", f"{r.enqueued:,}"),
        ("  complete", f"{r.complete:,}  (every answer finished)"),
        ("  partial", f"{r.partial:,}  (regenerate: a later turn failed; `stopped` says which)"),
        ("  cut", f"{r.cut:,}  (by max_tokens, or no answer)"),
    ]
    rows += [(f"    {outcome}", f"{n:,}") for outcome, n in sorted(r.cut_by_outcome.items())]
    if r.tool_turns_to_end or r.tool_call_diverged or r.stopped_at_tool_turn:
        tools = (f"{r.tool_turns_to_end:,} regenerated to the end, {r.tool_call_diverged:,} stopped at a "
                 f"divergence (tool_call_diverged), {r.stopped_at_tool_turn:,} stopped at a tool turn for another "
                 "reason")
        rows.append(("  tool turns", tools))
    rows += [
        ("  failed for good", f"{r.failed:,}"),
        ("  missing", f"{r.missing:,}"),
        ("exported", f"{r.exported:,}  (outcomes {','.join(r.include_outcomes)})"
         + (f"  ({r.groups:,} prompts)" if r.groups else "")),
        *([("  by variant", ", ".join(f"{name} {n:,}" for name, n in sorted(r.by_variant.items())))]
          if r.by_variant else []),
        *([("variant", f"{r.variant} only  ({r.other_variants:,} items of the other variants left out)")]
          if r.variant else []),
        *([("rows", rows_line(r))] if r.rows_layout else []),
        ("truncated", f"{r.truncated:,}  (the other outcomes, to the truncated file"
         + (f": {r.truncated_rows:,} rows)" if r.rows_layout else ")")),
        ("duplicates removed", f"{r.duplicates_removed:,}"),
        ("flagged", f"{r.flagged:,}  (dataset rows the quality gates flag"
         + (f"; {r.flagged_dropped:,} kept out, to the flagged file)" if r.flagged_path else "; kept: --drop-flagged "
            "keeps them out)")),
    ]
    rows += [(f"  {reason}", f"{n:,}") for reason, n in sorted(r.flagged_by_reason.items())]
    rows += acceptance_rows(r)
    if r.original_turns:
        note = ("(rows holding the input's own assistant turns, marked per turn: LLaMA-Factory mask_history: true; "
                "SpecForge, speculators: --only-target-turns)")
        rows.append(("original turns", f"{r.original_turns:,}  {note}"))
    if r.unexpected:
        rows.append(("not in the run", f"{r.unexpected:,}  (exported anyway)"))
    if r.bad_lines or r.bad_shards:
        rows.append(("unreadable", f"{r.bad_lines:,} lines; {r.bad_shards:,} shards not matching their manifest"))
    if r.malformed_jobs:
        rows.append(("malformed jobs", malformed_line(r.malformed_jobs)))
    if r.refused_jobs:
        rows.append(("refused jobs", refused_line(r.refused_jobs, r.run)))
    rows += [
        ("output", r.output),
        ("truncated file", r.truncated_path),
        ("errors file", r.errors_path),
        ("missing file", r.missing_path),
        *([("flagged file", r.flagged_path)] if r.flagged_path else []),
        *([(_side_label(r), r.dataset_info_path)] if r.dataset_info_path else []),
        *extra,
        ("time", f"{r.seconds:.1f} s ({rate})"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k.ljust(width)}  {v}" for k, v in rows)
