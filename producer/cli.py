"""`producer`: enqueue a dataset as a run, show a run's status."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from dataclasses import replace
from typing import TYPE_CHECKING, Any, TypedDict, Unpack

import click
import orjson

from genqueue.common import __version__, defaults
from genqueue.common.capture import CaptureDtype, CaptureKind, parse_capture
from genqueue.common.cli import LazyGroup, friendly_errors, redis_option, setup_logging
from genqueue.common.contracts import HistoryReasoning, Mode, PromptMode, Truncation
from genqueue.common.errors import UserError
from genqueue.common.estimate import CHARS_PER_TOKEN
from genqueue.common.keepers.redisconn import connect
from genqueue.common.settings import RunSettings, Sampling, check_run_name, check_variant_params, run_name_from_path
from genqueue.common.variants import normalised, parse_variant
from genqueue.producer.enqueue.memplan import PromptsAsked

if TYPE_CHECKING:
    from genqueue.producer.enqueue.core import EnqueueOptions
    from genqueue.producer.enqueue.summary import Summary
    from genqueue.producer.ingest.reader import RawRecord

#: A run's priority: any integer in a range no one needs to leave.
PRIORITY = click.IntRange(-1_000_000, 1_000_000)


#: The commands imported only when they run (common.cli.LazyGroup).
_LAZY = {
    "export": "genqueue.producer.export.command:export_command",
    "export-features": "genqueue.producer.export.featurescmd:export_features_command",
    "capture": "genqueue.producer.prefill.command:capture_command",
    "export-logprobs": "genqueue.producer.export.logprobscmd:export_logprobs_command",
    "check-features": "genqueue.producer.export.featurecheckcmd:check_features_command",
    "parity": "genqueue.producer.export.parity_command:parity_command",
    "runs": "genqueue.producer.lifecycle:runs_command",
    "resume": "genqueue.producer.lifecycle:resume_command",
    "delete": "genqueue.producer.lifecycle:delete_command",
    "status": "genqueue.producer.status.command:status_command",
    "drafter-report": "genqueue.producer.drafter.command:drafter_report_command",
}


@click.group(cls=LazyGroup, lazy=_LAZY, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="genqueue producer")
@click.option("-v", "--verbose", count=True, help="More logging on stderr (-vv for debug).")
def main(verbose: int) -> None:
    """Turn ShareGPT/OpenAI chat datasets into genqueue runs on Redis (rq queues)."""
    setup_logging(verbose)


class EnqueueArgs(TypedDict):
    """`producer enqueue`'s options as click parses them (one key per option, by its parameter
    name) but for --json and --redis-url, which are the command's own."""

    run_name: str | None
    multi_turn: str
    batch_size: int | None
    model: str | None
    temperature: float
    top_p: float
    max_tokens: int
    seed: int | None
    sampling_json: str | None
    variants: tuple[str, ...]
    max_prompt_chars: int
    max_record_bytes: int
    history_reasoning: str
    truncation: str
    expect_reasoning: bool
    token_ids: bool
    drafter: str | None
    logprobs: int | None
    capture: str | None
    capture_layers: str | None
    capture_dtype: str | None
    capture_share: float | None
    capture_sources: str | None
    capture_budget: str | None
    output: str
    shared_fs: bool
    no_output_check: bool
    rejects_path: str | None
    id_field: str | None
    samples: int
    longest_first: bool
    tmp_dir: str | None
    retry_failed: bool
    update_settings: bool
    priority: int | None
    dry_run: bool
    prompts: str
    prompts_reference_from: int
    expect_items: int | None


def run_settings(options: EnqueueArgs) -> tuple[RunSettings, list[str]]:
    """The run's recipe that `producer enqueue` OPTIONS ask for, checked (UserError), and a
    warning line for each --sampling-json field genqueue does not know."""
    sampling = Sampling(temperature=options["temperature"], top_p=options["top_p"],
                        max_tokens=options["max_tokens"], seed=options["seed"],
                        extra=_parse_extra(options["sampling_json"]))
    warnings = sampling.check()
    variants = normalised([parse_variant(text) for text in options["variants"]])
    warnings += check_variant_params(sampling, variants)
    settings = RunSettings(
        model=options["model"],
        multi_turn=Mode(options["multi_turn"]),
        sampling=sampling,
        output=_absolute_output(options["output"]),
        max_prompt_chars=options["max_prompt_chars"],
        history_reasoning=HistoryReasoning(options["history_reasoning"]),
        truncation=Truncation(options["truncation"]),
        expect_reasoning=options["expect_reasoning"],
        variants=variants,
        token_ids=options["token_ids"],
        drafter=options["drafter"],
        logprobs=options["logprobs"],
        capture=parse_capture(options["capture"], options["capture_layers"], options["capture_dtype"],
                              options["capture_share"], options["capture_sources"], options["capture_budget"]),
    )
    return settings, warnings


#: The `producer enqueue` options that set a run's setting, by parameter name: the setting's
#: name (common/settings.py's SETTING_NAMES). For an existing run, one left out keeps the run's.
SETTING_OPTIONS: dict[str, str] = {
    "model": "model", "multi_turn": "multi_turn", "temperature": "sampling.temperature",
    "top_p": "sampling.top_p", "max_tokens": "sampling.max_tokens", "seed": "sampling.seed",
    "sampling_json": "sampling.extra", "variants": "variants", "output": "output",
    "max_prompt_chars": "max_prompt_chars", "history_reasoning": "history_reasoning", "truncation": "truncation",
    "expect_reasoning": "expect_reasoning", "token_ids": "token_ids", "drafter": "drafter",
    "logprobs": "logprobs",
    "capture": "capture", "capture_layers": "capture", "capture_dtype": "capture",
    "capture_share": "capture", "capture_sources": "capture", "capture_budget": "capture",
}


def settings_given(ctx: click.Context) -> frozenset[str]:
    """The settings CTX's command line (or environment) gave, not left at their defaults."""
    return frozenset(name for param, name in SETTING_OPTIONS.items()
                     if ctx.get_parameter_source(param) not in (None, click.ParameterSource.DEFAULT))


def enqueue_options(options: EnqueueArgs, run: str) -> EnqueueOptions:
    """How `producer enqueue` OPTIONS ask to queue RUN; the rejects file is <run>.rejects.jsonl
    unless named (none with --dry-run)."""
    from genqueue.producer.enqueue.core import EnqueueOptions
    from genqueue.producer.ingest.items import Origin

    dry_run = options["dry_run"]
    return EnqueueOptions(
        batch_size=options["batch_size"],
        rejects_path=options["rejects_path"] or (None if dry_run else f"{run}.rejects.jsonl"),
        max_record_bytes=options["max_record_bytes"],
        longest_first=options["longest_first"],
        tmp_dir=options["tmp_dir"],
        origin=Origin(id_field=options["id_field"], samples=options["samples"]),
        retry_failed=options["retry_failed"],
        update_settings=options["update_settings"],
        shared_fs=options["shared_fs"],
        priority=options["priority"],
        output_check=not options["no_output_check"],
        prompts=PromptsAsked(options["prompts"]),
        prompts_reference_from=options["prompts_reference_from"],
        expect_items=options["expect_items"],
    )


@main.command()
@click.argument("path")
@click.option("--run", "run_name", help="Run name (default: the file's base name).")
@click.option("--multi-turn", type=click.Choice([m.value for m in Mode]), default=defaults.MULTI_TURN.value,
              show_default=True, help="How multi-turn conversations become items (see README).")
@click.option("--batch-size", type=click.IntRange(1, 100_000), default=None,
              help=f"Items per rq job [default: {defaults.BATCH_SIZE} inline; by reference "
                   f"{defaults.BATCH_SIZE_REFERENCE}, doubled up to {defaults.BATCH_SIZE_REFERENCE_MAX} while the run "
                   f"keeps {defaults.JOBS_PER_RUN_MIN:,} jobs or more].")
@click.option("--model", help="Model to request (default: whatever the consumers' endpoints serve).")
@click.option("--temperature", type=float, default=defaults.TEMPERATURE, show_default=True, help=">= 0.")
@click.option("--top-p", type=float, default=defaults.TOP_P, show_default=True, help="In (0, 1].")
@click.option("--max-tokens", type=int, default=defaults.MAX_TOKENS, show_default=True,
              help="Completion budget per request (thinking included); >= 1.")
@click.option("--seed", type=int, default=None, help="Sampling seed sent with every request.")
@click.option("--sampling-json", default=None,
              help='Extra request fields as JSON, e.g. \'{"top_k": 20, "min_p": 0}\'.')
@click.option("--variant", "variants", multiple=True, metavar="NAME=JSON[:WEIGHT]",
              help="A request variant of the run's mix (repeatable): JSON's fields merged over the sampling of a "
                   "share WEIGHT (default 1) of the items, drawn from each item's key; every record names its "
                   "variant. E.g. --variant think='{\"chat_template_kwargs\":{\"enable_thinking\":true}}':0.7.")
@click.option("--max-prompt-chars", type=click.IntRange(1), default=defaults.MAX_PROMPT_CHARS, show_default=True,
              help="Reject records whose text is longer (reason too_long).")
@click.option("--max-record-bytes", type=click.IntRange(1), default=defaults.MAX_RECORD_BYTES, show_default=True,
              help="Reject input records larger than this without reading them whole.")
@click.option("--history-reasoning", type=click.Choice([h.value for h in HistoryReasoning]),
              default=defaults.HISTORY_REASONING.value, show_default=True,
              help="regenerate: whether a turn's thinking goes back into the next turn's history.")
@click.option("--truncation", type=click.Choice([t.value for t in Truncation]), default=defaults.TRUNCATION.value,
              show_default=True, help="What an item cut by max_tokens becomes.")
@click.option("--expect-reasoning/--no-expect-reasoning", default=False,
              help="The model thinks: consumers warn loudly if their server returns no thinking.")
@click.option("--token-ids/--no-token-ids", default=False,
              help="Keep each answer's prompt and completion token ids as the engine returned them (vLLM's "
                   "return_token_ids), for `producer export --format tokens`; a server that returns none fails "
                   "the consumers' pre-flight.")
@click.option("--drafter", default=None, metavar="NAME",
              help="Declare the run an evaluation of the drafter NAME (e.g. a held-out slice served by engines "
                   "running that candidate): status shows it, every record names it, and `producer "
                   "drafter-report` compares its acceptance with another run's. A label: the requests are "
                   "unchanged (it is in the fingerprint).")
@click.option("--capture", type=click.Choice([k.value for k in CaptureKind]), default=None,
              help="Capture the target's hidden states of every answer, for a drafter's trainer (EAGLE-3, DFlash, "
                   "MTP): stored as feature rows in <output>/<run>/features/, each record naming its row. Needs "
                   "--token-ids and --capture-layers, and engines started to capture (vLLM's "
                   "extract_hidden_states), which then run no drafter.")
@click.option("--capture-layers", default=None, metavar="SPEC",
              help="The layers to capture, as vLLM's eagle_aux_hidden_state_layer_ids (0 the embeddings, k the "
                   "output of decoder layer k), comma-separated and unioned: ids (2,16,29,32), eagle3:L "
                   "(speculators' [2, L//2, L-3, L] on an L-layer target), dflash:L:N (DFlash's N spaced "
                   "layers) or a drafter's config.json (the layers vLLM captures for it; add the last layer "
                   "as an id when the trainer needs it).")
@click.option("--capture-dtype", type=click.Choice([d.value for d in CaptureDtype]), default=None,
              help="How features are stored: fp8 (e4m3, a scale per token: half of bf16) or bf16. [default: fp8]")
@click.option("--capture-share", type=float, default=None, metavar="F",
              help="Capture the answers of a share F in (0, 1] of each source's items, drawn from each item's key "
                   "(a redo makes the same choice); the others ask for nothing and cost nothing. [default: 1]")
@click.option("--capture-sources", default=None, metavar="NAMES",
              help="Capture only the items of these inputs (NAME[=SHARE],...: a name as given to enqueue, its file "
                   "name, or that without .jsonl/.gz...; wildcards allowed), each of its own share (default "
                   "--capture-share): a stratified choice, e.g. code=0.5,chat=0.05.")
@click.option("--capture-budget", default=None, metavar="SIZE",
              help="Stop capturing once the run's features reach SIZE (e.g. 2TB, 500GB, 1.5TiB): later answers are "
                   "generated without features (overshoot: at most one row per consumer).")
@click.option("--logprobs", type=click.IntRange(min=1), default=None, metavar="K",
              help="Record the teacher's distribution for distillation: every generated token's own log-probability "
                   "and the K most likely ids with theirs (vLLM's top_logprobs, asked for K + 1: at most the engines' "
                   "--max-logprobs, checked at each consumer's pre-flight), stored as feature rows in "
                   "<output>/<run>/features/, each record naming its row. Needs --token-ids.")
@click.option("--output", default=defaults.OUTPUT, show_default=True, envvar="GENQUEUE_OUTPUT", show_envvar=True,
              help="Where consumers put results: a directory, or s3://bucket/prefix (credentials from boto3's chain).")
@click.option("--shared-fs", is_flag=True,
              help="The --output directory is one filesystem every node mounts (NFS, Lustre...): consumers on "
                   "any host may ship to it. Without it, a local output belongs to this host alone (named by "
                   "GENQUEUE_HOST, else its hostname).")
@click.option("--no-output-check", is_flag=True,
              help="Queue without first proving the --output can be written and read back (a probe put, read "
                   "and removed): for a host without the output's credentials; each consumer's pre-flight still "
                   "checks it.")
@click.option("--rejects", "rejects_path", default=None,
              help="Rejects file (default: <run>.rejects.jsonl in the current directory; none with --dry-run).")
@click.option("--id-field", default=None, metavar="FIELD",
              help="The record field holding its own id. Given, a record without it is rejected (missing_id); "
                   "by default id, else custom_id, and a record with neither is kept (its line's id is its key).")
@click.option("--samples", type=click.IntRange(1, 1000), default=defaults.SAMPLES, show_default=True,
              help="Answers per prompt: N items each, with their own seeds (the run's --seed, or 0, plus 0..N-1).")
@click.option("--longest-first", is_flag=True,
              help="Queue the costliest items first (by their original answers' length) to shorten the run's tail.")
@click.option("--tmp-dir", type=click.Path(file_okay=False), default=None,
              help="Where --longest-first holds the items until the input is read (default: TMPDIR; needs about "
                   "the items' JSON size free).")
@click.option("--retry-failed", is_flag=True,
              help="Queue again the items that have only an error record (or whose job failed in rq).")
@click.option("--update-settings", is_flag=True,
              help="Give an existing run the settings these options give (a new fingerprint; options left out "
                   "keep the run's) for its items not done yet, instead of refusing them.")
@click.option("--priority", type=PRIORITY, default=None,
              help="The run's share of the fleet: consumers serve higher priorities first, equal ones evenly "
                   "(default 0 for a new run; given on an existing run, sets it; not part of the settings). "
                   "Change it later with `producer priority`.")
@click.option("--prompts", type=click.Choice([m.value for m in PromptsAsked]), default=PromptsAsked.AUTO.value,
              show_default=True,
              help="Where the jobs keep their items: inline, in Redis; or reference, written once into packs in "
                   "the run's output (<output>/<run>/packs/) with each job naming its pack and block, so Redis holds "
                   "no prompt text. auto: the run's mode if an earlier enqueue gave it one, else reference from "
                   "--prompts-reference-from items (estimated from the input's size), inline below it or when "
                   "the size is not known (stdin, a compressed file). The summary says which, and why.")
@click.option("--prompts-reference-from", type=click.IntRange(1), default=defaults.PROMPTS_REFERENCE_FROM,
              show_default=True, metavar="N",
              help="--prompts auto queues a new run by reference from N items (the input's estimate).")
@click.option("--expect-items", type=click.IntRange(1), default=None, metavar="N",
              help="The items the run will hold in all, when it is fed in parts (one enqueue per file): its first "
                   "enqueue sizes the run's item table for N (Redis keeps about 24 bytes an item only while the "
                   "table is sized for its items), and --prompts auto chooses by N instead of this input's size.")
@click.option("--dry-run", is_flag=True, help="Read, convert and count; do not touch Redis.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of the table.")
@redis_option
@friendly_errors
def enqueue(path: str, as_json: bool, redis_url: str, **options: Unpack[EnqueueArgs]) -> None:
    """Read PATH (.jsonl, .json array, .gz/.zst of either, .parquet, or - for stdin) and queue it.

    Re-running it on a run is the reconcile: it queues exactly the items with no shipped result
    that are not queued in rq (lost from rq, or the whole run when Redis lost it: the run is then
    re-created from the run.json its output holds). On an existing run, a setting's option left
    out keeps the run's value; one given with another value is refused, or with --update-settings
    changed."""
    run_name = options["run_name"]
    run = check_run_name(run_name) if run_name else run_name_from_path(path)
    settings, warnings = run_settings(options)  # everything is checked before anything is opened or written
    if settings.capture is not None and (note := settings.capture.source_note(path)) is not None:
        warnings.append(note)
    for line in warnings:
        click.echo(f"warning: {line}", err=True)
    from genqueue.producer.enqueue.core import enqueue_file

    conn = None if options["dry_run"] else connect(redis_url)
    opts = replace(enqueue_options(options, run), settings_given=settings_given(click.get_current_context()))
    summary = enqueue_file(path, run, settings, conn, opts,
                           progress=_progress if sys.stderr.isatty() and not as_json else None,
                           note=lambda line: click.echo(line, err=True))
    if as_json:
        click.echo(orjson.dumps(summary.to_dict()).decode())
    else:
        click.echo(format_summary(summary))


@main.command(context_settings={"ignore_unknown_options": True})  # so that `-5` is a priority, not an option
@click.option("--run", "run_name", required=True, help="The run.")
@click.argument("level", metavar="[N]", required=False, type=PRIORITY)
@redis_option
@friendly_errors
def priority(run_name: str, level: int | None, redis_url: str) -> None:
    """Show the run's priority, or give it priority N (higher first; 0 by default).

    Consumers serve the open runs of the highest priority first and share their slots evenly
    between runs of equal priority; a change takes effect within seconds, for the slots that
    free up from then on (requests in flight finish). The run's settings and fingerprint stay."""
    from genqueue.common.keepers.runs import RunStore
    from genqueue.producer.enqueue.runsetup import keep_priority

    store = RunStore(connect(redis_url))
    run = check_run_name(run_name)
    info = store.require(run)
    old = store.priorities([run])[run]
    if level is None:
        click.echo(f"run {run}: priority {old}")
        return
    store.set_priority(run, level)
    click.echo(f"run {run}: priority {old} -> {level}")
    why = keep_priority(run, info.settings.output, level)
    if why is not None:
        click.echo(f"note: its run.json is not updated ({why}); the next `producer enqueue` of the run writes "
                   "it", err=True)


def _parse_extra(raw: str | None) -> dict[str, Any]:
    if not raw:
        return {}
    try:
        value = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise UserError(f"--sampling-json is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise UserError("--sampling-json must be a JSON object")
    return value


def _absolute_output(output: str) -> str:
    return output if "://" in output else os.path.abspath(output)


def _progress(records: Iterator[RawRecord]) -> Iterator[RawRecord]:
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    with Progress(SpinnerColumn(), TextColumn("{task.completed:,} records read"), TimeElapsedColumn(),
                  transient=True) as bar:
        task = bar.add_task("read", total=None)
        for n, rec in enumerate(records, 1):
            yield rec
            if n % 1000 == 0:
                bar.update(task, completed=n)


def format_summary(s: Summary) -> str:
    """The human summary table printed after an enqueue."""
    rows = [
        ("run", s.run + ("  (dry run: nothing written to Redis)" if s.dry_run else "")),
        ("fingerprint", s.fingerprint),
        *([("priority", str(s.priority))] if s.priority else []),
        *_records_rows(s),
        ("  enqueued", f"{s.enqueued:,}"),
    ]
    if s.retried_failed:
        rows.append(("  retried (had failed)", f"{s.retried_failed:,}"))
    rows.append(("  already queued", f"{s.already_queued:,}"))
    if s.queue_view and s.queue_view.get("claimed_items_held"):  # a claim another producer has not queued yet
        from genqueue.common.keepers.claims import HeldClaims

        held = HeldClaims(int(s.queue_view["claims_held_by_others"]), int(s.queue_view["claimed_items_held"]),
                          int(s.queue_view.get("held_claim_oldest_s", 0)))
        rows.append(("    claimed, in no job", held.line()))
    rows += [
        ("  already failed", f"{s.already_failed:,}" + ("  (--retry-failed queues them again)"
                                                         if s.already_failed else "")),
        ("  already done", f"{s.already_done:,}"),
        ("  duplicates", f"{s.duplicates:,}"),
        ("  rejected", f"{s.rejected:,}"),
    ]
    rows += [(f"    {reason}", f"{n:,}") for reason, n in s.rejected_by_reason.items()]
    queued = f"{s.items:,}"
    if s.requeued or s.retried:
        queued += f"  ({s.requeued:,} lost from the queue, {s.retried:,} retried)"
    rows += [
        ("items queued", queued),
        ("jobs", _jobs_row(s)),
        ("prompts", _prompts_row(s)),
        ("estimated output", f"{s.estimated_output_tokens:,} tokens (the original answers' characters / {CHARS_PER_TOKEN:g})"
         if s.estimated_output_tokens is not None else "- (the input has no original answers)"),
        ("time", f"{s.seconds:.1f} s"),
    ]
    if s.redis_memory:
        rows.append(("Redis memory", s.redis_memory))
    if s.rejects_path:
        rows.append(("rejects file", s.rejects_path))
    if s.queue_view and s.queue_view.get("malformed_jobs"):
        from genqueue.common.keepers.rqjobs import malformed_line

        rows.append(("malformed jobs", malformed_line(s.queue_view["malformed_jobs"])))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k.ljust(width)}  {v}" for k, v in rows)


def _jobs_row(s: Summary) -> str:
    """`40  (128 items a job at most: by reference, ~5,000 items)`."""
    why = f": {s.batch_choice['why']}" if s.batch_choice else ""
    return f"{s.jobs:,}  ({s.batch_size:,} items a job at most{why})"


def _prompts_row(s: Summary) -> str:
    """Where the jobs keep their items, and why: `reference (auto: ~1,200,000 items >= 200,000; ...)`."""
    why = f"{s.prompts_choice['why']}; " if s.prompts_choice else ""
    if s.prompts == PromptMode.INLINE:
        return f"inline ({why}in the jobs, in Redis)"
    return f"{s.prompts} ({why}{s.packs:,} pack(s) written to the run's output; the jobs name them)"


def _records_rows(s: Summary) -> list[tuple[str, str]]:
    """The records line; for an input not read (input_unchanged: enqueue/unchanged.py) it says so,
    and the counts below it are those of the last complete enqueue of the same file."""
    if not s.input_unchanged:
        return [("records read", f"{s.records:,}")]
    if s.items_in_run is None:
        why = "the file is unchanged since its last complete enqueue and every item of the run is done"
        return [("records read", f"0  ({why}: not read again)"), ("records at last read", f"{s.records:,}")]
    why = "the file is unchanged since its last complete enqueue and no item of the run is lost"
    said = f"0  ({why}: not read again; each record's item as the run's item table and queue say)"
    return [("records read", said), ("records at last read", f"{s.records:,}")]
