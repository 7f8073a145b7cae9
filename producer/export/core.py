"""The export engine: every shard of a run in, one deduplicated dataset out, in bounded memory.

Exporter.export runs the phases in turn, and its files appear only when all of them succeed:
- pass 1 (partition.py): every shard line read once, converted to the output shape, and
  written with a small header to one of K partition files by its place in the run's order;
- pass 2 (reduce.py): one partition at a time, one record kept per key, sent to the dataset,
  the truncated file, the flagged file or the errors file, and counted;
- the failed jobs (failedjobs.py): items of jobs rq gave up on that no shard holds, failed;
- pass 3, with --weight-by-acceptance or --keep-lowest-acceptance: the dataset's rows, staged
  by pass 2, selected by acceptance (stage.py); the rows left out are counted, still covered;
- coverage (coverage.py): the keys written, against the run's, in Redis; the rest are missing.

What the dataset holds (`rows`, `exported` items, the traces its layout keeps, `by_variant`) is
counted from the rows as the sink writes them, after dedupe, the gates and selection
(rowstats.RowStats, Exporter.written): one count, which the card reads too. With request
variants (common/variants.py), `by_variant` counts the rows by the variant each key draws under
the run's mix, and `variant` keeps one variant's records only.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import tempfile
import time
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import IO

import redis

from genqueue.common.acceptance import PER_REQUEST_SPEC_FLAG
from genqueue.common.errors import UserError
from genqueue.common.keepers.exportsets import ExportSets, ScratchSet
from genqueue.common.keepers.rqaccess import refused_jobs
from genqueue.common.keepers.rqjobs import ItemsOf, JobScan
from genqueue.producer.export.coverage import coverage
from genqueue.producer.export.failedjobs import FailedJobs
from genqueue.producer.export.formats import ExportFormat
from genqueue.producer.export.formats.spec import RowLayout
from genqueue.producer.export.layout import layout_for
from genqueue.producer.export.partition import Partitioner
from genqueue.producer.export.plan import ExportPlan, ExportResult
from genqueue.producer.export.reduce import Reducer, acceptance_summary
from genqueue.producer.export.rowstats import RowStats
from genqueue.producer.export.sinks import (
    CountingSink,
    GroupingSink,
    JsonlSink,
    NoProgress,
    Progress,
    Sink,
    beside,
    open_writer,
)
from genqueue.producer.export.sources import ShardSource
from genqueue.producer.export.stage import StageSink
from genqueue.producer.export.tempnames import sweep_dead, temp_beside
from genqueue.producer.outfiles import ERRORS, FLAGGED, MISSING, PARTITIONS, TRUNCATED, write_failed

__all__ = ["Exporter"]

log = logging.getLogger(__name__)


class Exporter:
    """Exports one run from SOURCE as PLAN says; see the module docstring. ITEMS_OF reads the
    items of jobs by reference (their packs), for the failed and missing items."""

    def __init__(self, conn: redis.Redis, run: str, source: ShardSource, plan: ExportPlan, *,
                 progress: Progress | None = None, items_of: ItemsOf | None = None) -> None:
        self.conn = conn
        self.items_of = items_of
        self.run = run
        self.source = source
        self.plan = plan
        output = plan.output
        self.shape = ExportFormat(plan.fmt)
        self.layout = plan.layout
        self.progress: Progress = progress or NoProgress()
        truncated = plan.truncated_path or beside(output, ".truncated.jsonl")
        self.paths = {"output": output, "errors": plan.errors_path, "missing": plan.missing_path,
                      "truncated": truncated}
        if plan.drop_flagged or plan.only_target_turns:  # rows kept out of the dataset go to a side file
            self.paths["flagged"] = plan.flagged_path or beside(output, ".flagged.jsonl")
        self.scan = JobScan()
        #: The dataset's rows as written, after dedupe, the gates and selection: the one count of
        #: what the export holds (its rows, items, traces kept, variants), the card's too.
        self.written = RowStats()
        self.result = ExportResult(run, self.shape.value, str(output), str(plan.errors_path), str(plan.missing_path),
                                   source.where, truncated_path=str(truncated),
                                   container="parquet" if plan.parquet else "jsonl",
                                   include_outcomes=sorted(plan.include), variant=plan.variant,
                                   flagged_path=str(self.paths.get("flagged", "")),
                                   rows_layout=self.layout.value if self.layout is not None else "")

    def export(self) -> ExportResult:
        """Run the passes and the coverage check; the files appear only on success."""
        t0 = time.monotonic()
        plan, r = self.plan, self.result
        shards = self.source.list_shards()
        r.shards = len(shards)
        try:
            tmp = Path(tempfile.mkdtemp(prefix=".gq-export-", dir=plan.workdir))
        except OSError as e:
            raise write_failed(e, plan.workdir, PARTITIONS, room_in=plan.workdir) from None
        scratch = ExportSets(self.conn, self.run)
        seen_key, missing_key = scratch.keys
        seen = ScratchSet(self.conn, seen_key)
        sweep_dead(list(self.paths.values()))
        finals = {k: temp_beside(p) for k, p in self.paths.items()}
        try:
            total = self.source.count_records(shards) if self.progress.wants_total else None
            self.progress.reading(total, len(shards))
            pass1 = Partitioner(plan, self.source, r, self.progress)
            parts = pass1.partition(shards, tmp, layout_for(self.conn, self.run))
            if plan.selects and not pass1.figures:
                raise _nothing_to_select(plan, self.run)
            self.progress.writing(len(parts))
            pass2 = Reducer(plan, r, seen)
            out = StageSink(tmp / "stage") if plan.selects else self._sink(finals["output"])
            try:
                flagged_file: AbstractContextManager[IO[bytes] | None] = (
                    open_writer(finals["flagged"], FLAGGED) if "flagged" in finals else nullcontext(None))
                with (open_writer(finals["errors"], ERRORS) as errs,
                      open_writer(finals["truncated"], TRUNCATED) as cut,
                      flagged_file as flagged):
                    for i, part in enumerate(parts):
                        pass2.reduce(part, out, errs, cut, flagged)
                        part.unlink()
                        self.progress.wrote()
                        log.info("partition %d/%d done", i + 1, len(parts))
                    self.items_of = FailedJobs(self.conn, self.run, plan, r, seen, self.scan,
                                               self.items_of).write(errs)
            except BaseException:
                out.abort()
                raise
            out.close()
            if isinstance(out, GroupingSink):
                r.groups = out.groups
            r.acceptance = acceptance_summary(pass2.table)
            if isinstance(out, StageSink):
                self._select(out, finals["output"])
            self._count_written()
            try:
                self._coverage(seen_key, missing_key, finals["missing"])
            except OSError as e:
                raise write_failed(e, finals["missing"], MISSING) from None
            r.malformed_jobs = self.scan.to_list()
            r.refused_jobs = refused_jobs(self.conn, self.run)
            for k, p in self.paths.items():
                os.replace(finals[k], p)
        finally:
            scratch.drop()
            shutil.rmtree(tmp, ignore_errors=True)
            for p in finals.values():
                p.unlink(missing_ok=True)
        r.seconds = round(time.monotonic() - t0, 3)
        return r

    def _select(self, stage: StageSink, path: Path) -> None:
        """Pass 3: the staged rows into the dataset, as --weight-by-acceptance and
        --keep-lowest-acceptance say (stage.py)."""
        plan, r = self.plan, self.result
        if all(math.isnan(x) for x in stage.rates):  # NaN: a row without figures
            stage.path.unlink(missing_ok=True)
            raise _nothing_to_select(plan, self.run, rows=True)
        r.selection, groups = stage.write_selected(lambda weighted: self._sink(path, weighted=weighted),
                                                   weigh=plan.weight_by_acceptance,
                                                   share=plan.keep_lowest_acceptance)
        stage.path.unlink(missing_ok=True)
        r.groups = groups

    def _sink(self, path: Path, *, weighted: bool = False) -> Sink:
        inner: Sink
        if self.plan.parquet:
            from genqueue.producer.export.parquet import ParquetSink, schema_for

            inner = ParquetSink(path, schema_for(self.shape, self.plan.group_samples, weighted=weighted))
        else:
            inner = JsonlSink(path)
        inner = CountingSink(inner, self.written)
        return GroupingSink(inner) if self.plan.group_samples else inner

    def _count_written(self) -> None:
        """The summary's figures of what the dataset holds, from the rows written (self.written):
        its rows, its items, the traces its layout keeps, its items by variant. What the other
        --rows layout would make is pass 2's count, before any selection."""
        r, s = self.result, self.written
        r.rows, r.exported = s.entries, s.conversations
        if self.layout is RowLayout.GENERATION:
            r.generation_rows, r.traces_kept_generation = s.entries, s.traces
        elif self.layout is RowLayout.CONVERSATION:
            r.conversation_rows, r.traces_kept_conversation = s.entries, s.traces
        if self.plan.variants:
            r.by_variant = dict(s.variants)

    def _coverage(self, seen_key: str, missing_key: str, missing_path: Path) -> None:
        r = self.result
        r.enqueued, r.missing, r.unexpected = coverage(self.conn, self.run, seen_key, missing_key, missing_path,
                                                       self.scan, self.items_of)
        if r.unexpected:
            log.warning("%d keys in the shards were never enqueued in run %s (an older run of the same "
                        "name?); they are exported too", r.unexpected, self.run)


def _nothing_to_select(plan: ExportPlan, run: str, *, rows: bool = False) -> UserError:
    what = " and ".join(o for o, on in (("--weight-by-acceptance", plan.weight_by_acceptance),
                                        ("--keep-lowest-acceptance", plan.keep_lowest_acceptance is not None)) if on)
    where = "no row bound for the dataset" if rows else "no record"
    return UserError(f"{what}: {where} of run {run} carries speculative-decoding figures (the engine did not "
                     f"speculate, or was not started with {PER_REQUEST_SPEC_FLAG}): nothing to select by; "
                     "export without it")
