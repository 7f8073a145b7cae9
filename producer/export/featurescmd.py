"""`producer export-features`: the command, its checks, the pass over the tokens rows and the
summary (the join is features.py's, the files featurewriters.py's).

Everything a user can get wrong is refused in one line (exit 2) before anything is read: an
output folder holding a file genqueue did not write, a layout the capture cannot fill (speculators
and SpecForge read the last captured layer as the model's final one), SpecForge without the
model's final norm (--model-dir) or without a Python with torch (--torch-python).
"""

from __future__ import annotations

import importlib.util
import os
import secrets
import shutil
import sys
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import IO

import click
import orjson

from genqueue.common import defaults
from genqueue.common.cli import friendly_errors, redis_option
from genqueue.common.contracts import Mode
from genqueue.common.errors import UserError
from genqueue.common.features import feature_store_for
from genqueue.common.keepers.redisconn import connect
from genqueue.common.keepers.runs import RunInfo, RunStore
from genqueue.common.settings import check_run_name
from genqueue.producer.export.featurelayouts import FinalNorm, final_norm, token_freq_json
from genqueue.producer.export.features import (
    NAMED,
    ROWS_FILE,
    SUMMARY_FILE,
    TOKEN_FREQ_JSON,
    UNMATCHED_FILE,
    FeatureExportResult,
    FeatureIndex,
    FeatureLayout,
    Unmatched,
    read_token_rows,
    token_row,
)
from genqueue.producer.export.featurewriters import TorchWriter, writer_for
from genqueue.producer.outfiles import MANIFEST as FILES_MANIFEST
from genqueue.producer.outfiles import OUTPUT_DIR, Owner, owner, probe, record_written
from genqueue.producer.rungone import run_gone

#: speculators' token frequency file (train/cli.py reads `<data>/token_freq.pt`).
TOKEN_FREQ_PT = "token_freq.pt"


@dataclass(frozen=True, slots=True)
class FeaturePlan:
    """What one export of features writes."""

    run: str
    layout: FeatureLayout
    output: Path
    tokens: Path
    regenerate: bool  # the run's mode names feature rows per turn (features.feature_row_id)
    norm: FinalNorm | None
    torch: TorchWriter | None


def check_folder(out: Path) -> None:
    """Refuse (UserError) an output folder that holds anything genqueue did not write, or that
    was changed since; a missing parent is refused too (outfiles.probe)."""
    if out.exists() and not out.is_dir():
        raise UserError(f"--output {out} is a file: export-features writes a folder")
    if out.is_dir():
        for root, dirs, files in os.walk(out):
            for name in sorted(files):
                path = Path(root) / name
                if name != FILES_MANIFEST and owner(path) is not Owner.GENQUEUE:
                    raise UserError(f"--output {out} holds {path}, which genqueue did not write (or which was "
                                    "changed since): genqueue never writes over your files; name another folder")
            dirs.sort()
    probe(out.parent / f".gq-probe-{os.getpid()}", OUTPUT_DIR, shown=out.parent)


def check_paths(run: str, tokens: str, output: str | None) -> tuple[Path, Path | None]:
    """(--tokens, --output) made absolute; refuses (UserError) a tokens file that is not there
    and an output folder that holds it."""
    tokens_path = Path(os.path.abspath(tokens))
    if not tokens_path.is_file():
        raise UserError(f"--tokens {tokens}: no such file (make it with producer export --run {run} --format tokens)")
    out = Path(os.path.abspath(output)) if output is not None else None
    if out is not None and (out == tokens_path.parent or out in tokens_path.parents):
        raise UserError(f"--output {out} holds the --tokens file: name another folder")
    return tokens_path, out


def run_info(run: str, redis_url: str) -> RunInfo:
    """RUN's record (its settings name its output); a run Redis no longer holds is refused
    (rungone: where its output usually is)."""
    conn = connect(redis_url)
    info = RunStore(conn).get(run)
    if info is None:
        usual = os.environ.get("GENQUEUE_OUTPUT") or defaults.OUTPUT
        raise run_gone(run, usual if "://" in usual else os.path.abspath(usual), conn)
    return info


class UnmatchedLog:
    """An export's genqueue-unmatched.jsonl: a line for each row or stored row left out, with its
    reason; the first NAMED names of each reason kept for the summary."""

    def __init__(self, fh: IO[bytes], reasons: Iterable[StrEnum]) -> None:
        self.fh = fh
        self._named: dict[str, list[str]] = {u.value: [] for u in reasons}

    def note(self, what: StrEnum, name: str, line: dict[str, object]) -> None:
        if len(self._named[what.value]) < NAMED:
            self._named[what.value].append(name)
        self.fh.write(orjson.dumps({"reason": what.value, **line}) + b"\n")

    @property
    def named(self) -> dict[str, list[str]]:
        """The reasons any name was noted for, and those names."""
        return {k: v for k, v in self._named.items() if v}


def names_of(named: dict[str, list[str]], what: StrEnum) -> str:
    """The summary's `(e.g. ...)` of WHAT's names in NAMED."""
    names = named.get(what.value) or []
    return f"  (e.g. {', '.join(names)})" if names else ""


def summary_table(rows: list[tuple[str, str]]) -> str:
    """A human summary: one `key  value` line a row, the values aligned."""
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k.ljust(width)}  {v}" for k, v in rows)


def torch_python(given: str | None) -> str | None:
    """The Python that runs torch.save: --torch-python, else this one when it has torch."""
    if given:
        return given
    return sys.executable if importlib.util.find_spec("torch") is not None else None


def check_layers(layout: FeatureLayout, layer_ids: tuple[int, ...], norm: FinalNorm | None) -> None:
    """speculators and SpecForge read the last captured layer as the model's final layer and the
    others as the aux layers: refuse a capture that is not so."""
    if layout is FeatureLayout.GENERIC:
        return
    ids = ", ".join(map(str, layer_ids))
    if len(layer_ids) < 2:
        raise UserError(f"--layout {layout}: the capture holds layer {ids} alone; {layout} trains on aux layers and "
                        "the final layer (capture them with the final layer last)")
    final = norm.layers if norm is not None else max(layer_ids)
    if layer_ids[-1] != final:
        where = f"the model's {norm.layers} layers" if norm is not None else "the largest id captured"
        raise UserError(f"--layout {layout}: the capture's last layer is {layer_ids[-1]} (layers {ids}), not the "
                        f"final layer ({final}, {where}): {layout} reads the last one as the final hidden state")


def export_features(plan: FeaturePlan, index: FeatureIndex, source: str) -> FeatureExportResult:
    """Write PLAN's folder from the rows of PLAN.tokens joined to INDEX; the folder is renamed
    into place only when complete."""
    t0 = time.monotonic()
    out = plan.output
    result = FeatureExportResult(plan.run, plan.layout.value, str(out), str(plan.tokens), source,
                                 capture=orjson.loads(index.manifest.to_json()),
                                 torch_python=plan.torch.python if plan.torch else "")
    result.duplicate_features = index.duplicates
    stage = out.parent / f".{out.name}.gq-{os.getpid()}-{secrets.token_hex(3)}"
    stage.mkdir()
    try:
        _write(plan, index, stage, result)
        _into_place(stage, out)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    record_written([Path(root) / n for root, _, names in os.walk(out) for n in names if n != FILES_MANIFEST])
    result.seconds = round(time.monotonic() - t0, 3)
    return result


def _write(plan: FeaturePlan, index: FeatureIndex, stage: Path, r: FeatureExportResult) -> None:
    writer = writer_for(plan.layout, stage, plan.norm, plan.torch)
    freq: Counter[int] = Counter()
    joined: set[str] = set()
    asked: set[str] = set()  # the feature rows the tokens rows name

    with open(stage / ROWS_FILE, "wb") as rows, open(stage / UNMATCHED_FILE, "wb") as fh:
        unmatched = UnmatchedLog(fh, Unmatched)
        tokens_rows = (token_row(raw, regenerate=plan.regenerate, path=plan.tokens)
                       for raw in read_token_rows(plan.tokens))
        for row, got, why, detail in index.joins(tokens_rows):
            r.rows_read += 1
            asked.add(row.feature_row)
            if got is None:
                assert why is not None
                unmatched.note(why, row.id, {"id": row.id, "feature_row": row.feature_row, "detail": detail})
                if why is Unmatched.NO_FEATURES:
                    r.rows_without_features += 1
                else:
                    r.rows_tokens_differ += 1
                continue
            i = r.rows_exported
            name = writer.add(i, got)
            rows.write(orjson.dumps({"index": i, "id": row.id, "file": name, "feature_row": got.entry.row,
                                     "shard": got.entry.shard, "tokens": got.tokens}) + b"\n")
            joined.add(got.entry.row)
            r.rows_exported += 1
            r.tokens_exported += got.tokens
            freq.update(t for t, m in zip(got.input_ids, got.loss_mask, strict=True) if m)
        for feature_row in sorted(set(index.by_row) - joined):
            r.features_without_rows += 1
            detail = ("the tokens row naming them has other tokens" if feature_row in asked else
                      "no row of the tokens export names these features")
            unmatched.note(Unmatched.NO_ROW, feature_row,
                           {"feature_row": feature_row, "shard": index.by_row[feature_row][0].shard, "detail": detail})
    r.named = unmatched.named
    r.token_freq_ids, r.token_freq_tokens = len(freq), sum(freq.values())
    (stage / TOKEN_FREQ_JSON).write_bytes(token_freq_json(freq))
    writer.finish(index, plan.torch)
    if plan.layout is FeatureLayout.SPECULATORS:
        if plan.torch is not None:
            plan.torch.freq(stage / TOKEN_FREQ_JSON, stage / TOKEN_FREQ_PT)
        else:
            r.notes.append(f"{TOKEN_FREQ_PT} not written: no Python with torch (--torch-python); "
                           f"{TOKEN_FREQ_JSON} holds the same counts")
    if plan.torch is not None:
        plan.torch.run()
    # counted once, here, so the summary file and the printed summary say the same (the summary
    # file and the ownership manifest aside: the summary cannot count its own bytes)
    data = [Path(root) / n for root, _, names in os.walk(stage) for n in names]
    r.files, r.bytes = len(data), sum(p.stat().st_size for p in data)
    (stage / SUMMARY_FILE).write_bytes(orjson.dumps(r.to_dict(), option=orjson.OPT_INDENT_2) + b"\n")


def _into_place(stage: Path, out: Path) -> None:
    """STAGE renamed to OUT; an OUT already there (genqueue's: check_folder) goes once it has."""
    old = None
    if out.exists():
        old = out.parent / f".{out.name}.gq-old-{os.getpid()}-{secrets.token_hex(3)}"
        os.replace(out, old)
    try:
        os.replace(stage, out)
    except OSError:
        if old is not None:
            os.replace(old, out)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def format_features(r: FeatureExportResult) -> str:
    """The human summary."""
    cap = r.capture
    rows = [
        ("run", f"{r.run}  ({r.layout} layout)"),
        ("capture", (f"{cap.get('model')}, layers {','.join(map(str, cap.get('layer_ids', [])))}, "
                    f"{cap.get('dtype')}, hidden {cap.get('hidden_size')}")),
        ("tokens rows", f"{r.rows_read:,} read from {r.tokens_file}"),
        ("exported", f"{r.rows_exported:,} rows, {r.tokens_exported:,} tokens"),
        ("  without features", f"{r.rows_without_features:,}" + names_of(r.named, Unmatched.NO_FEATURES)),
        ("  other tokens", f"{r.rows_tokens_differ:,}" + names_of(r.named, Unmatched.TOKENS_DIFFER)),
        ("features without rows", f"{r.features_without_rows:,}" + names_of(r.named, Unmatched.NO_ROW)),
        ("stored twice", (f"{r.duplicate_features:,}  (copies of a redone job's row; the one of the row's tokens "
                         "is used)")),
        ("token frequencies", (f"{r.token_freq_ids:,} ids over {r.token_freq_tokens:,} loss-masked tokens "
                              f"({TOKEN_FREQ_JSON})")),
        *[("note", n) for n in r.notes],
        ("read from", r.source),
        ("output", f"{r.output}  ({r.files:,} files, {r.bytes:,} bytes; unmatched in {UNMATCHED_FILE})"),
        ("time", f"{r.seconds:.1f} s"),
    ]
    return summary_table(rows)


@click.command("export-features")
@click.option("--run", "run_name", required=True, help="The run whose captured hidden states to export.")
@click.option("--tokens", "tokens", required=True, type=click.Path(dir_okay=False),
              help="The run's tokens export (`producer export --format tokens`: .jsonl, .gz, .zst or .parquet): "
                   "each of its rows is joined by id to the features of its answer.")
@click.option("--output", "-o", "output", required=True, type=click.Path(file_okay=False),
              help="The folder to write (refused when it holds a file genqueue did not write).")
@click.option("--layout", "layout", type=click.Choice([f.value for f in FeatureLayout]), required=True,
              help="speculators: its data folder (training rows as an Arrow dataset, hidden_states/hs_{i}"
                   ".safetensors in bf16, token_freq.pt); specforge: its offline files (rows_*/data_{i}.ckpt: "
                   "input_ids, loss_mask, aux_hidden_state, hidden_state after the final norm; needs --model-dir "
                   "and torch); generic: the feature shards as they are, their index, and rows.parquet (id, shard, "
                   "offset, length, tokens, layers, dtype, input_ids, loss_mask) that `datasets` reads.")
@click.option("--model-dir", "model_dir", type=click.Path(file_okay=False, exists=True), default=None,
              help="The target model's local folder (config.json, *.safetensors): its final norm, which SpecForge's "
                   "hidden_state has applied, and its layer count, checked against the capture's last layer.")
@click.option("--torch-python", "torch_python_path", envvar="GENQUEUE_TORCH_PYTHON", default=None,
              metavar="PYTHON",
              help="A Python with torch and safetensors (e.g. the trainer's), to write the files only torch "
                   "writes: SpecForge's .ckpt and speculators' token_freq.pt (default: this Python when it has "
                   "torch); env GENQUEUE_TORCH_PYTHON.")
@click.option("--allow-partial", is_flag=True,
              help="Exit 0 even when tokens rows have no features (they are counted, named and listed anyway).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of the table.")
@redis_option
@friendly_errors
def export_features_command(run_name: str, tokens: str, output: str, layout: str, model_dir: str | None,
                            torch_python_path: str | None, allow_partial: bool, as_json: bool,
                            redis_url: str) -> None:
    """Write a run's captured hidden states in the files a drafter trainer reads (speculators,
    SpecForge, or genqueue's own), each joined by id to its row of the run's tokens export, with
    the token frequencies a draft vocabulary is built from."""
    run = check_run_name(run_name)
    kind = FeatureLayout(layout)
    tokens_path, out = check_paths(run, tokens, output)
    assert out is not None
    check_folder(out)
    norm = final_norm(Path(model_dir)) if model_dir else None
    python = torch_python(torch_python_path)
    if kind is FeatureLayout.SPECFORGE and norm is None:
        raise UserError("--layout specforge writes hidden_state after the model's final norm (SpecForge's target "
                        "head is the lm_head alone): give --model-dir, the target model's local folder")
    if kind is FeatureLayout.SPECFORGE and python is None:
        raise UserError("--layout specforge writes torch.save files: give --torch-python, a Python with torch "
                        "and safetensors (e.g. the trainer's)")
    torch = TorchWriter(python) if python is not None and kind is not FeatureLayout.GENERIC else None
    if torch is not None:
        torch.check()
    info = run_info(run, redis_url)
    store = feature_store_for(info.settings.output)
    index = FeatureIndex(store, run)
    check_layers(kind, index.manifest.layer_ids, norm)
    if norm is not None and norm.weight.shape[0] != index.manifest.hidden_size:
        raise UserError(f"--model-dir {model_dir}: hidden size {norm.weight.shape[0]}, the capture's is "
                        f"{index.manifest.hidden_size}: another model")
    plan = FeaturePlan(run, kind, out, tokens_path, info.settings.multi_turn == Mode.REGENERATE, norm, torch)
    result = export_features(plan, index, store.location(run))
    click.echo(orjson.dumps(result.to_dict()).decode() if as_json else format_features(result))
    if result.complete or allow_partial:
        return
    click.echo(f"error: {result.rows_without_features + result.rows_tokens_differ:,} of {result.rows_read:,} tokens "
               f"rows have no features of their tokens (listed in {out / UNMATCHED_FILE}); pass --allow-partial",
               err=True)
    raise SystemExit(1)
