"""`producer capture`: enqueue a capture pass over a finished run's answers (common/prefill.py):
their hidden states (--capture-layers) or their generated tokens' log-probability tables (--logprobs).

It reads the source run's records from its output (one copy per key, as export keeps it:
select.py), chooses its rows, writes them as the pass's input (one line a row, under the
temporary folder, named by the runs and their outputs, so running the command again reads the
same file) and enqueues that input into the pass's run through `producer enqueue`'s own machinery
(producer/enqueue/core.py, which turns each line into one item: ingest/prefill.py): the claims, jobs
inline or by reference, the item table, rq, status, coverage and the reconcile are the
generation runs' own. Running it again is the reconcile.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Iterator
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import click
import orjson
import redis

from genqueue.common import defaults
from genqueue.common.capture import CaptureDtype, CaptureSettings, parse_capture, parse_size
from genqueue.common.cli import friendly_errors, redis_option
from genqueue.common.contracts import Mode
from genqueue.common.errors import UserError
from genqueue.common.keepers.redisconn import connect
from genqueue.common.keepers.runs import RunStore
from genqueue.common.logprobs import check_logprobs
from genqueue.common.prefill import PrefillChoice, PrefillSettings, bytes_per_token
from genqueue.common.settings import RunSettings, Sampling, check_run_name
from genqueue.common.storage import store_for
from genqueue.common.storage.runfile import read_run_file
from genqueue.producer.enqueue.memplan import PromptsAsked
from genqueue.producer.prefill.select import SourceRow, choose, source_rows
from genqueue.producer.rungone import run_gone


def hidden_size_of(model_dir: str) -> int:
    """The hidden size in MODEL_DIR's config.json (or its text_config's). UserError."""
    path = Path(model_dir) / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"--model-dir {model_dir}: cannot read its config.json ({e})") from None
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    size = text.get("hidden_size") if isinstance(text, dict) else None
    if not isinstance(size, int) or size < 1:
        raise UserError(f"--model-dir {model_dir}: config.json names no hidden_size")
    return size


def read_records(output: str, run: str) -> Iterator[dict[str, Any]]:
    """Every record line of RUN's shards under OUTPUT, in shard order (a line that is no JSON
    object is skipped: the export counts those)."""
    store = store_for(output)
    for shard in store.list_shards(run):
        with store.open(run, shard.name) as fh:
            for line in fh:
                if not line.strip():
                    continue
                try:
                    rec = orjson.loads(line)
                except orjson.JSONDecodeError:
                    continue
                if isinstance(rec, dict):
                    yield rec


def plan_path(src: str, src_output: str, run: str, output: str) -> Path:
    """Where the pass's input is written: the same for the same runs and outputs."""
    tag = hashlib.blake2b(f"{src_output}\x00{src}\x00{output}".encode(), digest_size=6).hexdigest()
    return Path(tempfile.gettempdir()) / f"genqueue-capture-{os.getuid()}" / f"{run}-{tag}.jsonl"


def write_plan(path: Path, rows: list[SourceRow]) -> None:
    """The pass's input, one line a row, written whole before it is named."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    with open(tmp, "wb") as fh:
        for r in rows:
            line: dict[str, Any] = {"prefill": {"row": r.row, "token_ids": r.token_ids, "completion": r.completion},
                                    "turn": r.turn}
            if r.id is not None:
                line["id"] = r.id
            fh.write(orjson.dumps(line) + b"\n")
    os.replace(tmp, path)


def split_location(text: str) -> tuple[str, str]:
    """The output and run of a run's output TEXT (`<output>/<run>`: a folder, or s3://bucket/prefix/run)."""
    head, _, name = (text if text.startswith("s3://") else os.path.abspath(text)).rstrip("/").rpartition("/")
    if not name or head in ("s3:", "s3:/", ""):
        raise UserError(f"--from-run {text}: name a run or its output, <output>/<run>")
    try:
        return head, check_run_name(name)
    except UserError:
        raise UserError(f"--from-run {text}: its last part {name!r} is no run name (name a run's output, "
                        "<output>/<run>)") from None


def source_settings(conn: redis.Redis, src: str, output: str | None) -> RunSettings:
    """The settings of run SRC: from the run.json under OUTPUT when given, else from Redis. UserError."""
    if output is not None:
        rf = read_run_file(store_for(output), src)
        if rf is None:
            raise UserError(f"--from-run {output.rstrip('/')}/{src}: no run.json there (is it a run's output?)")
        return rf.settings
    info = RunStore(conn).get(src)
    if info is None:
        usual = os.environ.get("GENQUEUE_OUTPUT") or defaults.OUTPUT
        raise run_gone(src, usual if "://" in usual else os.path.abspath(usual), conn)
    return info.settings


@click.command("capture")
@click.option("--from-run", "src_name", required=True, metavar="SRC",
              help="The finished run (made with --token-ids) whose answers the pass captures: a run "
                   "in Redis, or its output (<output>/<run>, a folder or s3://...; its run.json gives its settings).")
@click.option("--run", "run_name", required=True, metavar="NAME", help="The pass's own run.")
@click.option("--capture-layers", "layers", default=None, metavar="SPEC",
              help="The layers to capture, as `producer enqueue --capture-layers` reads them: ids (0 = the "
                   "embeddings, e.g. 2,16,29), eagle3:L, dflash:L:N or a drafter's config.json. This or --logprobs.")
@click.option("--logprobs", "logprobs", type=int, default=None, metavar="K",
              help="Instead of hidden states: the top-K log-probability tables of each answer's generated tokens "
                   "(vLLM's prompt_logprobs, K + 1 asked), stored as a `producer enqueue --logprobs K` run stores "
                   "them, so `producer export-logprobs` joins them with the source's tokens export.")
@click.option("--capture-dtype", "dtype", type=click.Choice([d.value for d in CaptureDtype]),
              default=CaptureDtype.FP8.value, show_default=True, help="How the hidden states are stored.")
@click.option("--capture-by", "by", type=click.Choice([c.value for c in PrefillChoice]),
              default=PrefillChoice.ALL.value, show_default=True,
              help="Which rows first: all in the source's order, or acceptance (the drafter's worst first, from "
                   "the acceptance figures the source's records carry).")
@click.option("--capture-budget", "budget", default=None, metavar="BYTES",
              help="Capture rows, in --capture-by's order, while their features fit BYTES (e.g. 40TB, 500GB): "
                   "tokens x bytes per token of the layers, dtype and hidden size. Needs --hidden-size or --model-dir.")
@click.option("--hidden-size", type=click.IntRange(1), default=None, metavar="N", help="The model's hidden size.")
@click.option("--model-dir", default=None, metavar="DIR",
              help="The target model's local folder: its config.json gives the hidden size.")
@click.option("--output", default=None, metavar="DIR|S3",
              help="Where the pass's features and records go (default: the source run's output).")
@click.option("--prompts", type=click.Choice([p.value for p in PromptsAsked]), default=PromptsAsked.AUTO.value,
              show_default=True, help="Where the pass's jobs keep their rows, as `producer enqueue --prompts`.")
@click.option("--batch-size", type=click.IntRange(1), default=None, metavar="N", help="Rows per rq job.")
@click.option("--retry-failed", is_flag=True, help="Queue again the rows whose capture failed.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of the lines.")
@redis_option
@friendly_errors
def capture_command(src_name: str, run_name: str, layers: str | None, logprobs: int | None, dtype: str, by: str,
                    budget: str | None,
                    hidden_size: int | None, model_dir: str | None, output: str | None, prompts: str,
                    batch_size: int | None, retry_failed: bool, as_json: bool, redis_url: str) -> None:
    """Capture a finished run's hidden states (--capture-layers) or its answers' top-K
    log-probability tables (--logprobs K) by a prefill-only pass over the engine's own token ids:
    a run of its own whose items are the source's answers (each turn's its own row), served by
    `consumer run` (on an engine that captures, for hidden states), each row stored under the
    source's row id, so `producer export-features` (or `export-logprobs`) `--run NAME --tokens
    <the source's tokens export>` joins them."""
    run = check_run_name(run_name)
    src_out: str | None = None
    if "/" in src_name or os.sep in src_name:  # a run's output, <output>/<run>: its run.json holds its settings
        src_out, src = split_location(src_name)
    else:
        src = check_run_name(src_name)
    if src == run:
        raise UserError(f"--run {run} is the source run: name the pass's own run")
    if (layers is None) == (logprobs is None):
        raise UserError("a capture pass captures one thing: give --capture-layers (hidden states) or --logprobs K "
                        "(log-probability tables), not both nor neither")
    capture: CaptureSettings | None = parse_capture("hidden-states", layers, dtype) if layers is not None else None
    if logprobs is not None:
        check_logprobs(logprobs, token_ids=True, extra={})
        if budget is not None:
            raise UserError("--capture-budget sizes hidden states; a --logprobs pass makes every chosen row's tables "
                            "(choose fewer rows with --capture-by)")
    choice = PrefillChoice(by)
    size = hidden_size if hidden_size is not None else hidden_size_of(model_dir) if model_dir else None
    limit = parse_size(budget) if budget is not None else None
    if limit is not None and size is None:
        raise UserError("--capture-budget needs the model's hidden size: give --hidden-size, or --model-dir "
                        "(the folder with its config.json)")
    conn = connect(redis_url)
    have = source_settings(conn, src, src_out)
    if not have.token_ids:
        raise UserError(f"run {src} kept no token ids (enqueued without --token-ids): a capture pass prefills the "
                        "engine's own ids; regenerate it with --token-ids")
    reading = source_rows(read_records(have.output, src), regenerate=have.multi_turn == Mode.REGENERATE)
    if not reading.rows:
        raise UserError(f"run {src} has no finished answer with token ids to capture ({reading.records:,} records "
                        f"read from {store_for(have.output).location(src)})")
    if choice is PrefillChoice.ACCEPTANCE and all(r.rate is None for r in reading.rows):
        raise UserError(f"--capture-by acceptance: run {src}'s records carry no acceptance figures (a run served "
                        "by an engine with a drafter and --per-request-spec-decode-metrics)")
    if logprobs is not None:  # a table per generated token: an answer that generated none has nothing to score
        reading = replace(reading, rows=[r for r in reading.rows if r.completion])
    per_token = (bytes_per_token(len(capture.layers), size, capture.dtype)
                 if size is not None and capture is not None else None)
    chosen = choose(reading.rows, choice, limit, per_token)
    if not chosen:
        raise UserError(f"--capture-budget {budget} holds no row of run {src} (the smallest takes "
                        f"{min(len(r.token_ids) for r in reading.rows) * (per_token or 0):,} bytes)")
    tokens = sum(len(r.token_ids) for r in chosen)
    pre = PrefillSettings(source=src, by=choice, budget=limit, hidden_size=size, rows=len(chosen),
                          source_rows=len(reading.rows), tokens=tokens,
                          bytes=tokens * per_token if per_token is not None else None)
    out = output or have.output
    settings = RunSettings(model=have.model, multi_turn=have.multi_turn, sampling=Sampling(max_tokens=1),
                           output=out, token_ids=True, capture=capture, logprobs=logprobs, prefill=pre)
    path = plan_path(src, have.output, run, out)
    write_plan(path, chosen)
    from genqueue.producer.enqueue.core import EnqueueOptions, enqueue_file

    opts = EnqueueOptions(batch_size=batch_size, prompts=PromptsAsked(prompts), retry_failed=retry_failed)
    summary = enqueue_file(str(path), run, settings, conn, opts, note=lambda line: click.echo(line, err=True))
    report = {"run": run, "source": src, "capture": asdict(pre), "logprobs": logprobs, "enqueue": summary.to_dict()}
    if as_json:
        click.echo(orjson.dumps(report).decode())
        return
    what = f"top-{logprobs} log-probability tables" if logprobs is not None else "hidden states"
    click.echo(f"run {run}: a capture pass ({what}) over run {src}: {pre.rows:,} of {pre.source_rows:,} rows "
               f"({choice.value} order), {tokens:,} tokens"
               + (f", {pre.bytes:,} bytes of features" if pre.bytes is not None else "")
               + (f" (budget {limit:,})" if limit is not None else ""))
    click.echo(f"enqueued {summary.items:,} items in {summary.jobs:,} jobs ({summary.prompts}); already done "
               f"{summary.already_done:,}, queued {summary.already_queued:,}, failed {summary.already_failed:,}")
