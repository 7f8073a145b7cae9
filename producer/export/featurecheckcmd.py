"""`producer check-features`: a run's stored features recomputed by a reference forward pass
and compared layer by layer (featurecheck.py), and, with --tokens, every stored row's token ids
compared with its row of the tokens export.

A share of the rows (--share) or a number of them (--rows; every row with --share 1) is
sampled by the hash of its id, so a check names the same rows every time. Each mismatch is one
line naming the row, the layer and its first position off; then one summary line. Exits 0 when
everything matches, 1 when a row does not (or cannot be read), 2 for a user's mistake (no model
folder, no Python with torch and transformers, a run without features).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import click
import orjson

from genqueue.common import defaults
from genqueue.common.cli import friendly_errors, redis_option
from genqueue.common.contracts import Mode
from genqueue.common.errors import FeatureCorruptError, UserError
from genqueue.common.features import feature_store_for
from genqueue.common.features.codec import Float32Array
from genqueue.common.features.read import windows
from genqueue.common.settings import check_run_name
from genqueue.producer.export.featurecheck import CheckReport, RowProblem, compare_row, sampled
from genqueue.producer.export.featureforward import ReferenceForward, check_python
from genqueue.producer.export.features import FeatureIndex, Unmatched, read_token_rows, token_row
from genqueue.producer.export.featurescmd import check_paths, run_info, torch_python

#: The reference's features of (token ids, layer ids): [tokens, layers, hidden] float32.
Reference = Callable[[list[int], tuple[int, ...]], Float32Array]


def check_ids(index: FeatureIndex, tokens: Path, report: CheckReport, *, regenerate: bool) -> None:
    """Every row of the tokens export TOKENS joined to its stored features (export-features' join):
    a row whose features hold other token ids (or are unreadable) is a problem; one without
    features, and stored features no row names, are counted (an answer failed has no features,
    and the export leaves out answers of some outcomes)."""
    named: set[str] = set()
    rows = (token_row(raw, regenerate=regenerate, path=tokens) for raw in read_token_rows(tokens))
    for row, got, why, detail in index.joins(rows):
        named.add(row.feature_row)
        if why is Unmatched.NO_FEATURES:
            report.rows_without_features += 1
            continue
        report.ids_checked += 1
        if got is None:
            report.ids_differ += 1
            report.problems.append(RowProblem(row.feature_row, f"token ids are not those of tokens row {row.id}: "
                                                               f"{detail}"))
    report.features_without_rows = len(set(index.by_row) - named)


def check_rows(index: FeatureIndex, rows: list[str], reference: Reference, report: CheckReport,
               tolerance: float) -> None:
    """Each stored copy of ROWS recomputed by REFERENCE over its own token ids and compared (read
    a window of rows at a time, in few large reads)."""
    layers = index.manifest.layer_ids
    for window in windows(rows, lambda name: sum(e.length for e in index.by_row[name])):
        got = index.read_many(e for name in window for e in index.by_row[name])
        for name, entry in [(n, e) for n in window for e in index.by_row[n]]:
            row = got[entry]
            if isinstance(row, FeatureCorruptError):
                report.problems.append(RowProblem(name, f"unreadable: {row.reason} (shard {row.shard}, "
                                                        f"offset {row.offset})"))
                continue
            want = reference(row.token_ids.tolist(), layers)
            try:
                report.add(compare_row(row, entry.shard, want, tolerance), entry.tokens)
            except ValueError as e:
                report.problems.append(RowProblem(name, str(e)))


def model_shape(model_dir: str) -> tuple[int, int]:
    """(layers, hidden size) of the transformers model in MODEL_DIR. Raises UserError."""
    folder = Path(model_dir)
    if not folder.is_dir():
        raise UserError(f"--model-dir {model_dir}: no such folder (the target model's local folder: config.json, "
                        "*.safetensors)")
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"--model-dir {model_dir}: no readable config.json ({e})") from None
    text = config.get("text_config") or config
    layers, hidden = text.get("num_hidden_layers"), text.get("hidden_size")
    if not isinstance(layers, int) or not isinstance(hidden, int):
        raise UserError(f"--model-dir {model_dir}: config.json names no num_hidden_layers and hidden_size")
    return layers, hidden


@click.command("check-features")
@click.option("--run", "run_name", required=True, help="The run whose captured hidden states to check.")
@click.option("--model-dir", "model_dir", required=True,
              help="The target model's local folder (config.json, *.safetensors): the weights the engine served.")
@click.option("--share", type=click.FloatRange(0, 1, min_open=True), default=None,
              help="Check this share of the rows (1: every row), sampled by the hash of each row's id.")
@click.option("--rows", "count", type=click.IntRange(min=1), default=None,
              help=f"Check this many rows, sampled by the hash of each row's id (default: "
                   f"{defaults.CHECK_FEATURES_ROWS}).")
@click.option("--tokens", "tokens", type=click.Path(dir_okay=False), default=None,
              help="The run's tokens export (`producer export --format tokens`): every stored row's token ids "
                   "are compared with its row's (all rows, not only the sample).")
@click.option("--tolerance", type=click.FloatRange(0, min_open=True), default=defaults.CHECK_FEATURES_TOLERANCE,
              show_default=True,
              help="How far the engine's bf16 arithmetic may take a token's vector from the float32 reference, "
                   "relative to its length; the stored dtype's own bound is added.")
@click.option("--torch-python", "torch_python_path", envvar="GENQUEUE_TORCH_PYTHON", default=None,
              metavar="PYTHON",
              help="A Python with torch and transformers, which runs the reference forward pass (default: this "
                   "Python when it has torch); env GENQUEUE_TORCH_PYTHON.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of the lines.")
@redis_option
@friendly_errors
def check_features_command(run_name: str, model_dir: str, share: float | None, count: int | None,
                           tokens: str | None, tolerance: float, torch_python_path: str | None, as_json: bool,
                           redis_url: str) -> None:
    """Recompute a sample of a run's captured hidden states with a transformers forward pass over
    the same weights and compare them layer by layer, within the engine's bf16 arithmetic and the
    stored dtype's bound; with --tokens, check every stored row's token ids against the tokens
    export. Exits 1 naming each row that differs."""
    run = check_run_name(run_name)
    if share is not None and count is not None:
        raise UserError("--share and --rows choose the sample two ways: give one")
    n_layers, hidden = model_shape(model_dir)
    tokens_path = check_paths(run, tokens, None)[0] if tokens else None
    python = torch_python(torch_python_path)
    if python is None:
        raise UserError("the reference forward pass needs torch and transformers: give --torch-python, a Python "
                        "with both (e.g. the trainer's or vLLM's)")
    check_python(python)
    info = run_info(run, redis_url)
    index = FeatureIndex(feature_store_for(info.settings.output), run)
    manifest = index.manifest
    if manifest.hidden_size != hidden or max(manifest.layer_ids) > n_layers:
        raise UserError(f"--model-dir {model_dir}: {n_layers} layers of hidden size {hidden}; the capture holds "
                        f"layers {','.join(map(str, manifest.layer_ids))} of hidden size {manifest.hidden_size} "
                        f"({manifest.model}): another model")
    report = CheckReport(manifest.layer_ids, rows_stored=len(index.by_row))
    if tokens_path is not None:
        check_ids(index, tokens_path, report, regenerate=info.settings.multi_turn == Mode.REGENERATE)
    rows = (sampled(list(index.by_row), share=share) if share is not None
            else sampled(list(index.by_row), count=count or defaults.CHECK_FEATURES_ROWS))
    with ReferenceForward(python, Path(model_dir)) as forward:
        check_rows(index, rows, forward.features, report, tolerance)
    if as_json:
        click.echo(orjson.dumps({"ok": report.ok, "rows_stored": report.rows_stored,
                                 "rows_checked": report.rows_checked, "tokens_checked": report.tokens_checked,
                                 "worst": {str(k): v for k, v in report.worst.items()}, "tolerance": tolerance,
                                 "mismatches": report.lines(), "ids_checked": report.ids_checked,
                                 "ids_differ": report.ids_differ,
                                 "rows_without_features": report.rows_without_features,
                                 "features_without_rows": report.features_without_rows}).decode())
    else:
        for line in report.lines():
            click.echo(line)
        click.echo(report.summary(tolerance))
    if not report.ok:
        raise SystemExit(1)
