"""`producer export-logprobs`: a run's top-k log-probability tables as the Parquet a distillation
trainer reads as it is (the join and the layouts are logprobrows.py's, DistillKit's encoding
distillkit.py's), with the summary every export prints.

The folder: `data/train-NNNNN.parquet` (the `train` split to `datasets.load_dataset(folder)`,
so DistillKit's HfRepoDataset config loads it by its path), and beside it genqueue-rows.jsonl
(row index -> id, table row, tokens), genqueue-unmatched.jsonl (every tokens row or table left
out, with its reason), genqueue-logprobs.json (the summary) and, for DistillKit,
compression_config.yaml (its trainer's `teacher.logprob_compressor`). It is written whole under
a hidden name beside its place and renamed into place; a folder already there is replaced only
when every file in it is one genqueue wrote and no one changed since (export-features' rule),
else refused before anything is read.
"""

from __future__ import annotations

import os
import secrets
import shutil
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

import click
import orjson
import pyarrow.parquet as pq
import yaml

from genqueue.common.cli import friendly_errors, redis_option
from genqueue.common.contracts import Mode
from genqueue.common.errors import FeatureCorruptError, FeatureError, UserError
from genqueue.common.features import feature_store_for
from genqueue.common.features.read import windows
from genqueue.common.settings import check_run_name
from genqueue.producer.export import distillkit as dk
from genqueue.producer.export.features import TokenRow, read_token_rows, token_row
from genqueue.producer.export.featurescmd import (
    UnmatchedLog,
    _into_place,
    check_folder,
    check_paths,
    names_of,
    run_info,
    summary_table,
)
from genqueue.producer.export.logprobrows import (
    DISTILLKIT_SCHEMA,
    PLAIN_SCHEMA,
    Aligned,
    Fidelity,
    Layout,
    Tables,
    Unmatched,
    align,
    distillkit_batch,
    manifest_dict,
    plain_batch,
    table_row_id,
)
from genqueue.producer.outfiles import MANIFEST as FILES_MANIFEST
from genqueue.producer.outfiles import record_written

ROWS_FILE = "genqueue-rows.jsonl"
UNMATCHED_FILE = "genqueue-unmatched.jsonl"
SUMMARY_FILE = "genqueue-logprobs.json"
CONFIG_FILE = "compression_config.yaml"  # where sample_logits_vllm.py writes it
DATA_DIR = "data"
#: Rows per Parquet file (DistillKit's sample_logits_vllm.py writes 256); a new file past it.
ROWS_PER_FILE = 4096
#: Rows per row group: a loader reads a group at once, and 256 rows of 2,000 tokens at K = 128 are ~100 MB.
ROWS_PER_GROUP = 256


class TableSource(Protocol):
    """A run's stored tables (common/features/logprobs.py LogprobsReader)."""

    @property
    def entries(self) -> Any: ...  # row id -> its index entry (shard, tokens)

    duplicates: int
    manifest: Any

    def read_tables(self, rows: Iterable[str]) -> Mapping[str, Tables | FeatureCorruptError]:
        """Each of ROWS' tables, or why they are unreadable, read together; rows without tables
        are not in it."""
        ...


@dataclass(frozen=True, slots=True)
class LogprobPlan:
    """What one export of tables writes."""

    run: str
    layout: Layout
    output: Path
    tokens: Path
    regenerate: bool
    k: int  # entries of each table exported (a DistillKit config's k, else the run's)
    config: dk.DistillKitConfig | None


@dataclass
class LogprobExportResult:
    """What an export of tables did."""

    run: str
    layout: str
    output: str
    tokens_file: str
    source: str
    tables: dict[str, Any] = field(default_factory=dict)
    k: int = 0
    rows_read: int = 0
    rows_exported: int = 0
    tokens_exported: int = 0
    tables_exported: int = 0
    rows_without_tables: int = 0
    rows_tokens_differ: int = 0
    rows_unreadable: int = 0
    tables_without_rows: int = 0
    duplicate_tables: int = 0
    named: dict[str, list[str]] = field(default_factory=dict)
    max_error: float | None = None  # DistillKit: the largest |decompressed - stored| log-probability
    mean_error: float | None = None
    files: int = 0
    bytes: int = 0
    data_bytes: int = 0
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def complete(self) -> bool:
        """Every tokens row has its tables."""
        return not (self.rows_without_tables or self.rows_tokens_differ or self.rows_unreadable)

    @property
    def bytes_per_table(self) -> float:
        return self.data_bytes / self.tables_exported if self.tables_exported else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "bytes_per_table": round(self.bytes_per_table, 1)}


class _Files:
    """The layout's Parquet files under DATA_DIR, a new one every ROWS_PER_FILE rows."""

    def __init__(self, stage: Path, schema: Any) -> None:
        self.dir = stage / DATA_DIR
        self.dir.mkdir()
        self.schema = schema
        self.writer: pq.ParquetWriter | None = None
        self.in_file = 0
        self.n = 0

    def name(self) -> str:
        return f"{DATA_DIR}/train-{self.n:05d}.parquet"

    def write(self, batch: Any) -> None:
        if self.writer is None:
            self.writer = pq.ParquetWriter(self.dir.parent / self.name(), self.schema)
        self.writer.write_batch(batch)
        self.in_file += batch.num_rows
        if self.in_file >= ROWS_PER_FILE:
            self.close()
            self.n += 1

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer, self.in_file = None, 0


def export_logprobs(plan: LogprobPlan, source: TableSource, where: str) -> LogprobExportResult:
    """Write PLAN's folder from the rows of PLAN.tokens joined to SOURCE's tables; the folder is
    renamed into place only when complete."""
    t0 = time.monotonic()
    out = plan.output
    r = LogprobExportResult(plan.run, plan.layout.value, str(out), str(plan.tokens), where,
                            tables=dict(manifest_dict(source.manifest)), k=plan.k)
    r.duplicate_tables = source.duplicates
    r.notes.extend(mode_notes(plan.layout, str(source.manifest.mode), source.manifest.temperature))
    stage = out.parent / f".{out.name}.gq-{os.getpid()}-{secrets.token_hex(3)}"
    stage.mkdir()
    try:
        _write(plan, source, stage, r)
        _into_place(stage, out)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    record_written([Path(root) / n for root, _, names in os.walk(out) for n in names if n != FILES_MANIFEST])
    r.seconds = round(time.monotonic() - t0, 3)
    return r


def mode_notes(layout: Layout, mode: str, temperature: float | None) -> list[str]:
    """What the summary says of the engine's --logprobs-mode, where a trainer could misread it."""
    if not mode.endswith("logprobs"):
        return [f"the tables are {mode} (the engine's --logprobs-mode): topk_logprobs holds logits"]
    if layout is Layout.DISTILLKIT and mode.startswith("processed") and temperature not in (None, 1.0):
        return [(f"the tables are after sampling's processing at temperature {temperature}: DistillKit's offline "
                "teacher reads them as temperature 1")]
    return []


def _write(plan: LogprobPlan, source: TableSource, stage: Path, r: LogprobExportResult) -> None:
    cfg = plan.config
    files = _Files(stage, _schema(plan.layout))
    fidelity = Fidelity()
    pending: list[Aligned] = []
    joined: set[str] = set()

    def flush() -> None:
        if pending:
            files.write(distillkit_batch(pending, cfg, fidelity) if cfg is not None else plain_batch(pending, plan.k))
            pending.clear()

    with open(stage / ROWS_FILE, "wb") as rows, open(stage / UNMATCHED_FILE, "wb") as fh:
        unmatched = UnmatchedLog(fh, Unmatched)
        tokens_rows = (replace(token_row(raw, regenerate=plan.regenerate, path=plan.tokens),
                               feature_row=table_row_id(raw, regenerate=plan.regenerate) or "")
                       for raw in read_token_rows(plan.tokens))
        for row, tables in _with_tables(source, tokens_rows):
            r.rows_read += 1
            if isinstance(tables, FeatureCorruptError):
                r.rows_unreadable += 1
                unmatched.note(Unmatched.UNREADABLE, row.id, {"id": row.id, "table_row": row.feature_row,
                                                               "detail": str(tables)})
                continue
            if tables is None:
                r.rows_without_tables += 1
                unmatched.note(Unmatched.NO_TABLES, row.id, {"id": row.id, "table_row": row.feature_row,
                                                              "detail": f"no stored tables of row "
                                                                        f"{row.feature_row or '(no key)'}"})
                continue
            got, why = align(row, tables)
            if got is None:
                r.rows_tokens_differ += 1
                unmatched.note(Unmatched.TOKENS_DIFFER, row.id, {"id": row.id, "table_row": row.feature_row,
                                                                  "detail": why})
                continue
            rows.write(orjson.dumps({"index": r.rows_exported, "id": row.id, "file": files.name(),
                                     "table_row": row.feature_row, "tokens": got.tokens,
                                     "tables": got.positions}) + b"\n")
            joined.add(row.feature_row)
            r.rows_exported += 1
            r.tokens_exported += got.tokens
            r.tables_exported += got.positions
            pending.append(got)
            if len(pending) >= ROWS_PER_GROUP or files.in_file + len(pending) >= ROWS_PER_FILE:
                flush()
        flush()
        files.close()
        for table_row in sorted(set(source.entries) - joined):
            r.tables_without_rows += 1
            unmatched.note(Unmatched.NO_ROW, table_row,
                 {"table_row": table_row, "detail": "no row of the tokens export names these tables, or its "
                                                    "tokens differ"})
    r.named = unmatched.named
    if cfg is not None:
        (stage / CONFIG_FILE).write_text(yaml.safe_dump(cfg.to_mapping(), sort_keys=False))
        r.max_error, r.mean_error = round(fidelity.max_error, 6), round(fidelity.mean_error, 6)
    data = [p for p in (stage / DATA_DIR).iterdir()]
    r.data_bytes = sum(p.stat().st_size for p in data)
    every = [Path(root) / n for root, _, names in os.walk(stage) for n in names]
    # counted once, here, so the summary file and the printed summary say the same (the summary
    # and the ownership manifest aside: the summary cannot count its own bytes)
    r.files, r.bytes = len(every), sum(p.stat().st_size for p in every)
    (stage / SUMMARY_FILE).write_bytes(orjson.dumps(r.to_dict(), option=orjson.OPT_INDENT_2) + b"\n")


def _with_tables(source: TableSource, rows: Iterable[TokenRow]
                 ) -> Iterator[tuple[TokenRow, Tables | FeatureCorruptError | None]]:
    """Each of ROWS with its tables (None: it has none), read a window of rows at a time (read.windows:
    the rows' stored bytes, as the index says, bound it) in few large reads."""
    def size(row: TokenRow) -> int:
        entry = source.entries.get(row.feature_row)
        return int(getattr(entry, "length", 0) or 0)

    for window in windows(rows, size):
        got = source.read_tables(r.feature_row for r in window if r.feature_row)
        for row in window:
            yield row, got.get(row.feature_row) if row.feature_row else None


def _schema(layout: Layout) -> Any:
    return DISTILLKIT_SCHEMA if layout is Layout.DISTILLKIT else PLAIN_SCHEMA


def format_logprobs(r: LogprobExportResult) -> str:
    """The human summary."""
    t = r.tables
    temp = t.get("temperature")
    rows = [
        ("run", f"{r.run}  ({r.layout} layout)"),
        ("tables", (f"{t.get('model')}, top-{t.get('k')} ({t.get('mode')}"
                    + (f", temperature {temp}" if temp is not None else "") + f"), {r.k} exported a token")),
        ("tokens rows", f"{r.rows_read:,} read from {r.tokens_file}"),
        ("exported", f"{r.rows_exported:,} rows, {r.tokens_exported:,} tokens, {r.tables_exported:,} with tables"),
        ("  without tables", f"{r.rows_without_tables:,}" + names_of(r.named, Unmatched.NO_TABLES)),
        ("  other tokens", f"{r.rows_tokens_differ:,}" + names_of(r.named, Unmatched.TOKENS_DIFFER)),
        ("  unreadable", f"{r.rows_unreadable:,}" + names_of(r.named, Unmatched.UNREADABLE)),
        ("tables without rows", f"{r.tables_without_rows:,}" + names_of(r.named, Unmatched.NO_ROW)),
        ("stored twice", f"{r.duplicate_tables:,}  (a redone job's copy; the first is used)"),
        *([("fidelity", (f"max |decompressed - stored| {r.max_error:.4g}, mean {r.mean_error:.3g} "
                        "(log-probability, as DistillKit's decoder reads them)"))]
          if r.max_error is not None and r.mean_error is not None else []),
        ("size", f"{r.data_bytes:,} bytes of Parquet, {r.bytes_per_table:.1f} a token with a table"),
        *[("note", n) for n in r.notes],
        ("read from", r.source),
        ("output", f"{r.output}  ({r.files:,} files, {r.bytes:,} bytes; unmatched in {UNMATCHED_FILE})"),
        ("time", f"{r.seconds:.1f} s"),
    ]
    return summary_table(rows)


def read_config(path: str) -> dk.DistillKitConfig:
    """The DistillKit config at PATH (its logprob_compressor mapping, or a run config holding
    one). Raises UserError."""
    try:
        raw = yaml.safe_load(Path(path).read_text())
    except OSError as e:
        raise UserError(f"--distillkit-config {path}: cannot read it: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        raise UserError(f"--distillkit-config {path}: not YAML: {str(e).splitlines()[0]}") from None
    return dk.DistillKitConfig.from_mapping(raw, where=f"--distillkit-config {path}")


def plan_k(layout: Layout, cfg: dk.DistillKitConfig | None, manifest: Any) -> int:
    """Entries a token's table exports; refuses (UserError) a layout the tables cannot fill."""
    stored = int(manifest.k)
    if layout is Layout.PLAIN:
        return stored
    assert cfg is not None
    if not str(manifest.mode).endswith("logprobs"):
        raise UserError(f"--layout distillkit: the run's tables are {manifest.mode}, DistillKit's offline teacher "
                        "reads log-probabilities (run with --logprobs-mode raw_logprobs)")
    if cfg.k > stored:
        raise UserError(f"--distillkit-config k = {cfg.k}, the run stored top-{stored}: give k <= {stored}")
    return cfg.k


@click.command("export-logprobs")
@click.option("--run", "run_name", required=True, help="The run whose top-k log-probability tables to export.")
@click.option("--tokens", "tokens", required=True, type=click.Path(dir_okay=False),
              help="The run's tokens export (`producer export --format tokens`: .jsonl, .gz, .zst or .parquet): "
                   "each of its rows is joined by id to the tables of its answer.")
@click.option("--output", "-o", "output", required=True, type=click.Path(file_okay=False),
              help="The folder to write (refused when it holds a file genqueue did not write).")
@click.option("--layout", "layout", type=click.Choice([x.value for x in Layout]), required=True,
              help="plain: id, input_ids, loss_mask, topk_ids, topk_logprobs, sampled_logprobs, one entry per "
                   "token; distillkit: DistillKit's input_ids, labels, compressed_logprobs, bytepacked_indices "
                   "(needs --distillkit-config).")
@click.option("--distillkit-config", "distillkit_config", type=click.Path(dir_okay=False, exists=True), default=None,
              help="DistillKit's compression config (the YAML its sample_logits_vllm.py --compression-config takes, "
                   "or a run config with teacher.logprob_compressor): d the model's vocabulary size, k at most the "
                   "run's --logprobs; copied to compression_config.yaml.")
@click.option("--allow-partial", is_flag=True,
              help="Exit 0 even when tokens rows have no tables (they are counted, named and listed anyway).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of the table.")
@redis_option
@friendly_errors
def export_logprobs_command(run_name: str, tokens: str, output: str, layout: str, distillkit_config: str | None,
                            allow_partial: bool, as_json: bool, redis_url: str) -> None:
    """Write a run's top-k log-probability tables as the Parquet a distillation trainer reads
    (DistillKit's compressed layout, or a plain one), each row joined by id to its row of the
    run's tokens export."""
    from genqueue.common.features.logprobs import LogprobsReader

    run = check_run_name(run_name)
    kind = Layout(layout)
    tokens_path, out = check_paths(run, tokens, output)
    assert out is not None
    if kind is Layout.DISTILLKIT and distillkit_config is None:
        raise UserError("--layout distillkit needs --distillkit-config: DistillKit's trainer decodes the tables "
                        "with the same compression config they were written with")
    if kind is not Layout.DISTILLKIT and distillkit_config is not None:
        raise UserError(f"--distillkit-config is for --layout distillkit, not {kind}")
    cfg = read_config(distillkit_config) if distillkit_config else None
    check_folder(out)
    info = run_info(run, redis_url)
    store = feature_store_for(info.settings.output)
    try:
        reader = LogprobsReader(store, run)
    except FeatureError:
        raise UserError(f"run {run} has no log-probability tables at {store.location(run)}: was it enqueued with "
                        "--logprobs, and have consumers shipped any?") from None
    plan = LogprobPlan(run, kind, out, tokens_path, info.settings.multi_turn == Mode.REGENERATE,
                       plan_k(kind, cfg, reader.manifest), cfg)
    result = export_logprobs(plan, reader, store.location(run))
    click.echo(orjson.dumps(result.to_dict()).decode() if as_json else format_logprobs(result))
    if result.complete or allow_partial:
        return
    missing = result.rows_without_tables + result.rows_tokens_differ + result.rows_unreadable
    click.echo(f"error: {missing:,} of {result.rows_read:,} tokens rows have no tables of their tokens (listed in "
               f"{out / UNMATCHED_FILE}); pass --allow-partial", err=True)
    raise SystemExit(1)
