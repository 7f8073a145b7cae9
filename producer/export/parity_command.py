"""`producer parity`: a --token-ids run's prompts rendered again with the model's tokenizer and
chat template, compared id for id with the prompt ids the engine recorded (parity.py).

The records are the run's shards as export reads them (sources.py, records.py), one per item:
of several copies of a key, the one export keeps by default (a finished answer before another
outcome, the original before an end-of-run copy, the lowest attempt, the earliest finish,
the first in shard order). Error records hold no answer and are counted apart. Clean rows pass
silently; each row that differs is named with its first differing position and the text
around it from both sides. Exits 0 when every generation matches, 1 when one does not (or
none could be checked) unless --allow-mismatch, 2 for a user mistake.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, cast

import click
import orjson

from genqueue.common import defaults
from genqueue.common.cli import friendly_errors, redis_option
from genqueue.common.errors import UserError
from genqueue.common.keepers.redisconn import connect
from genqueue.common.keepers.runs import RunStore
from genqueue.common.placement import this_host
from genqueue.common.records import ResultRecord
from genqueue.common.settings import check_run_name
from genqueue.producer.export.formats.lines import record_outcome
from genqueue.producer.export.parity import MAX_SHOWN, ParityReport, RecordParity, Renderer, check_record
from genqueue.producer.export.plan import DEFAULT_OUTCOMES
from genqueue.producer.export.records import BAD_LINE, read_line
from genqueue.producer.export.sources import ShardSource, source_for
from genqueue.producer.rungone import run_gone

__all__ = ["check_source", "format_parity", "parity_command"]


@dataclass(frozen=True, slots=True)
class _Kept:
    rank: tuple[int, int, int, float, int, int]
    order: tuple[int, int, int, int]
    found: RecordParity | None  # None: an error record


def check_source(source: ShardSource, renderer: Renderer, report: ParityReport, *,
                 server_kwargs: dict[str, Any] | None = None, limit: int | None = None) -> ParityReport:
    """Check the records of SOURCE into REPORT: one per key, the copy export keeps, in the
    run's order. LIMIT: stop after that many items."""
    best: dict[bytes, _Kept] = {}
    for ordinal, shard in enumerate(source.each(source.list_shards())):
        for lineno, line in enumerate(shard.fh):
            if not line.strip():
                continue
            try:
                rec, key, place, index, turn, sample, attempt, finished = read_line(line)
            except BAD_LINE:
                report.unreadable += 1
                if len(report.problems) < MAX_SHOWN:
                    report.problems.append(f"{shard.info.name} line {lineno + 1}: no readable record")
                continue
            answered = "error" not in rec
            result = cast(ResultRecord, rec)
            kind = (0 if record_outcome(result) in DEFAULT_OUTCOMES else 1) if answered else 2
            rank = (kind, int(bool(rec.get("copy"))), attempt, finished, ordinal, lineno)
            cur = best.get(key)
            if cur is not None and cur.rank <= rank:
                continue
            if cur is None and limit is not None and len(best) >= limit:
                continue
            found = check_record(result, renderer, server_kwargs) if answered else None
            best[key] = _Kept(rank, (place, index, turn, sample), found)
    for _key, kept in sorted(best.items(), key=lambda kv: (kv[1].order, kv[0])):
        if kept.found is None:
            report.errors += 1
        else:
            report.add(kept.found)
    return report


def _server_kwargs(text: str | None) -> dict[str, Any] | None:
    if text is None:
        return None
    try:
        value = orjson.loads(text)
    except orjson.JSONDecodeError:
        value = None
    if not isinstance(value, dict):
        raise UserError(f"--default-chat-template-kwargs takes a JSON object, not {text!r}")
    return value


@click.command("parity")
@click.option("--run", "run_name", required=True, help="The run to check (enqueued with --token-ids).")
@click.option("--tokenizer", "tokenizer_dir", required=True, metavar="DIR",
              help="The model's folder (its tokenizer and chat template), as the server was given it.")
@click.option("--chat-template", "chat_template", default=None, metavar="FILE",
              help="The template the server was started with (vLLM's --chat-template), instead of the "
                   "tokenizer's own. A request's own chat_template (--sampling-json) still wins, as in vLLM.")
@click.option("--default-chat-template-kwargs", "server_kwargs", default=None, metavar="JSON",
              help="The server's --default-chat-template-kwargs, under the run's own chat_template_kwargs.")
@click.option("--limit", type=click.IntRange(1), default=None, metavar="N",
              help="Check the first N items only (in shard order).")
@click.option("--allow-mismatch", is_flag=True, help="Exit 0 whatever differs.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of the report.")
@redis_option
@friendly_errors
def parity_command(run_name: str, tokenizer_dir: str, chat_template: str | None, server_kwargs: str | None,
                   limit: int | None, allow_mismatch: bool, as_json: bool, redis_url: str) -> None:
    """Render each generation's prompt with the model's tokenizer and chat template, as vLLM
    does, and compare it id for id with the prompt ids the engine recorded (runs made with
    --token-ids); name each row that differs, where, and the text there."""
    run = check_run_name(run_name)
    kwargs = _server_kwargs(server_kwargs)
    conn = connect(redis_url)
    info = RunStore(conn).get(run)
    if info is None:
        output = os.environ.get("GENQUEUE_OUTPUT") or defaults.OUTPUT
        raise run_gone(run, output if "://" in output else os.path.abspath(output), conn)
    if not info.settings.token_ids:
        raise UserError(f"run {run} kept no token ids, so there is nothing to compare: enqueue it with --token-ids "
                        "(a new run, or --update-settings for the items not done yet)")
    refusal = info.placement.refusal(run, info.settings.output, this_host())
    if refusal is not None:
        raise UserError(refusal)
    from genqueue.producer.export.hf_render import load_renderer

    renderer = load_renderer(tokenizer_dir, chat_template)
    source = source_for(info.settings.output, run)
    report = check_source(source, renderer, ParityReport(run=run, tokenizer=renderer.where),
                          server_kwargs=kwargs, limit=limit)
    click.echo(orjson.dumps(report.to_dict()).decode() if as_json else format_parity(report))
    failing = _failing(report)
    if failing and not allow_mismatch:
        click.echo(f"error: {failing}; pass --allow-mismatch to exit 0 anyway", err=True)
        raise SystemExit(1)


def _failing(r: ParityReport) -> str | None:
    """Why the check fails, or None."""
    if r.mismatched:
        return (f"{r.mismatched:,} of {r.generations:,} generations ({r.mismatched_records:,} records) differ "
                "from the prompt ids the engine recorded")
    if r.unreadable:
        return f"{r.unreadable:,} records could not be checked"
    if not r.generations:
        return f"nothing to check: no generation of run {r.run} recorded its prompt ids"
    return None


def format_parity(r: ParityReport) -> str:
    """The human report: the counts, then a line per row that differs."""
    rate = f"{r.matched / r.generations:.1%}" if r.generations else "-"
    rows = [
        ("run", r.run),
        ("tokenizer", r.tokenizer),
        ("checked", f"{r.records:,} records, {r.generations:,} generations with prompt ids"),
        ("  matched", f"{r.matched:,}  ({rate})"),
        ("  MISMATCHED" if r.mismatched else "  mismatched",
         f"{r.mismatched:,} generations in {r.mismatched_records:,} records"),
    ]
    if r.without_ids:
        rows.append(("  without ids", f"{r.without_ids:,}  (generations that kept none: not checked)"))
    if r.errors:
        rows.append(("error records", f"{r.errors:,}  (no answer: nothing to check)"))
    if r.unreadable:
        rows.append(("UNREADABLE", f"{r.unreadable:,}"))
    width = max(len(k) for k, _ in rows)
    lines = [f"{k.ljust(width)}  {v}" for k, v in rows]
    lines += [m.line() for m in r.mismatches]
    if r.mismatched > len(r.mismatches):
        lines.append(f"... and {r.mismatched - len(r.mismatches):,} more (--json lists the first {MAX_SHOWN})")
    lines += r.problems
    return "\n".join(lines)

