"""One export's section of the dataset card (card.py), in Markdown: what the dataset holds.

Built from the export's summary (plan.ExportResult: every coverage count is the summary's own,
never recounted) and the run's record (model, sampling, fingerprints, version), plus the count
of the rows the export wrote (rowstats.RowStats, the one its summary's rows, items and traces
come from, after any selection): rows, conversations, generations per conversation, the rows'
outcomes, sources, models and fingerprints, acceptance, capture, and the token lengths.

Token lengths are per generation (one answer the target generated), from the answer's own
`usage` as the server reported it: prompt = `prompt_tokens`, thinking = `reasoning_tokens`
where the server reported it, answer = `completion_tokens` - thinking. A row that holds several
answers (a `regenerate` conversation row) carries their summed usage: its answers' lengths are
not in the export, and the card says so and counts them apart, never splitting a sum. Nothing is
estimated: a figure no row holds is "not known".
"""

from __future__ import annotations

import array
import datetime
import os
from collections import Counter
from collections.abc import Iterable, Mapping
from pathlib import Path

from genqueue.common import __version__
from genqueue.common.capture import format_size
from genqueue.common.keepers.captured import CaptureFigures, LogprobsFigures
from genqueue.common.keepers.runs import RunInfo
from genqueue.producer.export.plan import ExportResult
from genqueue.producer.export.rowstats import RowStats

#: The percentiles of each length table.
PERCENTILES = (0, 10, 25, 50, 75, 90, 99, 100)
PLOTS_HINT = "pip install 'genqueue[card]'"


def link(p: Path, folder: Path) -> str:
    """P as the card in FOLDER links it: relative, with forward slashes."""
    try:
        return Path(os.path.relpath(p, folder)).as_posix()
    except ValueError:  # another drive
        return p.as_posix()


def _table(rows: Iterable[tuple[str, object]], head: tuple[str, str] = ("", "")) -> str:
    lines = [f"| {head[0]} | {head[1]} |", "| --- | --- |"]
    lines += [f"| {k} | {_cell(v)} |" for k, v in rows]
    return "\n".join(lines) + "\n\n"


def _cell(v: object) -> str:
    text = f"{v:,}" if isinstance(v, int) and not isinstance(v, bool) else str(v)
    return text.replace("|", "\\|").replace("\n", " ")


def _counter(c: Counter[str], what: str) -> str:
    if not c:
        return f"none named in the rows ({what})\n\n"
    return _table(c.most_common(), (what, "rows"))


def export_section(r: ExportResult, info: RunInfo | None, s: RowStats, links: Mapping[str, str], *, plots: bool,
             folder: Path, incomplete: str = "", capture: CaptureFigures | None = None,
             logprobs: LogprobsFigures | None = None) -> str:
    out = Path(r.output)
    parts = [f"## {out.name}\n\n",
             *([f"> **Incomplete export.** {incomplete}\n\n"] if incomplete else []),
             f"Run `{r.run}`" + (f" (made {_when(info.created_at)})" if info is not None else "")
             + f", `{r.format}` format{' in Parquet' if r.container == 'parquet' else ''}, exported by genqueue "
             f"{__version__}. Outcomes held: "
             f"{', '.join(r.include_outcomes)}"
             + (f"; request variant `{r.variant}` only" if r.variant else "") + ".\n\n"]
    # rows
    per_conv = ", ".join(f"{k}: {v:,}" for k, v in sorted(s.gens_per_conversation.items()))
    rows: list[tuple[str, object]] = [
        ("rows (lines of the dataset file)", s.rows),
        ("conversations (items exported)", s.conversations),
        ("generations (answers the target generated, in the rows)", s.generations),
        ("generations per conversation", per_conv or "-"),
    ]
    if r.groups:
        rows.append(("prompts (--group-samples lines)", r.groups))
    summary = r.to_dict()
    known = [(label, summary[name]) for name, label in _LAYOUT_FIELDS if summary.get(name) not in (None, "")]
    rest = {k: v for k, v in summary.items() if ("generation" in k or "trace" in k) and v not in (None, "", {})
            and k not in dict(_LAYOUT_FIELDS)}
    rows += known + [(k.replace("_", " "), v if not isinstance(v, dict) else _inline(v)) for k, v in sorted(rest.items())]
    parts += ["### Rows\n\n", _table(rows, ("", "count"))]
    if "generations" in links:
        parts.append(f"![generations per conversation]({links['generations']})\n\n")
    # coverage: the summary's own counts
    cov: list[tuple[str, object]] = [("enqueued items", r.enqueued), ("complete (every answer finished)", r.complete),
                                     ("partial (a later turn failed)", r.partial), ("cut", r.cut)]
    cov += [(f"cut: {k}", v) for k, v in sorted(r.cut_by_outcome.items())]
    cov += [("failed for good", r.failed)] + [(f"failed: {k}", v) for k, v in sorted(r.failed_by_class.items())]
    cov += [("missing", r.missing), ("exported", r.exported), ("truncated (to the truncated file)", r.truncated),
            ("duplicates removed", r.duplicates_removed), ("flagged by the quality gates", r.flagged)]
    cov += [(f"flagged: {k}", v) for k, v in sorted(r.flagged_by_reason.items())]
    if r.flagged_dropped:
        cov.append(("flagged rows kept out (to the flagged file)", r.flagged_dropped))
    if r.original_turns:
        cov.append(("rows holding the input's own assistant turns", r.original_turns))
    if r.tool_turns_to_end or r.tool_call_diverged or r.stopped_at_tool_turn:
        cov += [("tool turns regenerated to the end", r.tool_turns_to_end),
                ("stopped at a tool-call divergence", r.tool_call_diverged),
                ("stopped at a tool turn (other reason)", r.stopped_at_tool_turn)]
    parts += ["### Coverage (the export's summary)\n\n", _table(cov, ("", "items"))]
    parts += ["### Outcomes of the dataset's rows\n\n", _counter(s.outcomes, "outcome")]
    if r.by_variant or r.variant:
        by = dict(r.by_variant)
        parts += ["### Request variants\n\n", _table(sorted(by.items()), ("variant", "rows")) if by else "",
                  (f"Only variant `{r.variant}`: {r.other_variants:,} items of the others left out.\n\n"
                   if r.variant else "")]
    parts += ["### Sources\n\n", _counter(s.sources, "source")]
    if r.acceptance:
        parts += ["### Speculative decoding: the drafter's acceptance\n\n", _acceptance(r)]
    parts += ["### Model and sampling\n\n", _recipe(info, s)]
    if capture is not None:
        parts += ["### Hidden states captured (for a drafter's trainer)\n\n", _capture(capture)]
    if logprobs is not None:
        parts += ["### Log-probability tables (for a distillation trainer)\n\n", _logprobs(logprobs)]
    parts += ["### Token lengths per generation\n\n", _lengths(s, links, plots=plots)]
    parts += ["### Files\n\n", _files(r, folder)]
    return "".join(parts)


#: The acceptance tables' facets, in the card's order, with their column heads.
_FACETS = (("source", "source file"), ("variant", "request variant"), ("turn", "user turn"),
           ("length", "answer length (completion tokens)"))


def _acceptance(r: ExportResult) -> str:
    """The answers' speculative-decoding acceptance (the summary's `acceptance`): overall, then a
    table per facet (source first), the weakest category named, and what selection did."""
    acc = r.acceptance
    parts = [(f"The engine's own per-answer figures, summed over the {_cell(acc.get('answers', 0))} answers of "
              "the items exported (each item once, whichever file it went to): rate = accepted / drafted draft "
              "tokens (vLLM's draft_acceptance_rate), mean length = 1 + accepted / verify steps (vLLM's "
              f"mean_acceptance_length). Overall: rate {_pct(acc.get('rate'))}, mean length "
              f"{_num(acc.get('mean_length'))}.\n\n")]
    by = acc.get("by")
    for facet, head in _FACETS:
        cats = by.get(facet) if isinstance(by, dict) else None
        if not isinstance(cats, list) or len(cats) < (1 if facet == "source" else 2):
            continue  # a facet of one category says nothing the overall figures do not
        lines = [f"| {head} | answers | rate | mean length |", "| --- | --- | --- | --- |"]
        lines += [f"| {_cell(c['category'])} | {_cell(c['answers'])} | {_pct(c['rate'])} | {_num(c['mean_length'])} |"
                  for c in cats]
        parts.append("\n".join(lines) + "\n\n")
    if acc.get("weakest"):
        parts.append(f"Weakest category: {acc['weakest']}.\n\n")
    sel = r.selection
    if sel:
        share = sel.get("keep_lowest_acceptance")
        text = f"Selection: {_cell(sel['rows_kept'])} of {_cell(sel['rows_in'])} rows kept"
        if share is not None:
            text += (f", the lowest-acceptance {share:g} of the rows with figures (rates {_pct(sel.get('rate_min'))} "
                     f"to {_pct(sel.get('rate_max'))})")
        if sel.get("weight_by_acceptance"):
            text += (f"; each row's `{sel['weight_column']}` ({_num(sel.get('weight_min'))} to "
                     f"{_num(sel.get('weight_max'))}) is higher where the drafter accepted less")
        parts.append(text + ".\n\n")
    return "".join(parts)


def _pct(x: object) -> str:
    return f"{x:.1%}" if isinstance(x, float | int) else "-"


def _num(x: object) -> str:
    return f"{x:.2f}" if isinstance(x, float | int) else "-"


#: The summary's fields on rows per generation (--rows), where the export has them: shown as they are.
_LAYOUT_FIELDS = (
    ("rows_layout", "rows layout (--rows)"),
    ("rows", "rows (the export's count)"),
    ("generation_rows", "rows one per generation would make"),
    ("conversation_rows", "rows one per conversation would make"),
    ("traces", "thinking traces generated"),
    ("traces_kept_generation", "traces kept by rows per generation"),
    ("traces_kept_conversation", "traces kept by rows per conversation (as Qwen3-style templates render)"),
)


def _capture(c: CaptureFigures) -> str:
    """What the run captured and why: the figures `producer status` shows, of the whole run (not
    only the rows of this export; `producer export-features` writes the features themselves)."""
    budget = c["budget"]
    rows: list[tuple[str, object]] = [
        ("what", c["what"]), ("layers (vLLM's aux layer ids)", ", ".join(map(str, c["layers"]))),
        ("stored as", c["dtype"]), ("answers captured (the choice)", c["chosen"]),
        ("chosen by", ", ".join(c["choice"])),
        ("budget", format_size(budget) + (" (spent: later answers have no features)" if c["budget_spent"] else "")
         if budget is not None else "none"),
        ("rows captured (distinct, shipped)", c["rows"]), ("answers generated (done items)", c["answers"]),
        ("rows captured / answers generated", f"{c['rows'] / c['answers']:.1%}" if c["answers"] else "-"),
        ("bytes shipped", f"{format_size(c['bytes'])} ({c['bytes']:,} bytes)"),
    ]
    pf = c["capture_pass"]
    if pf is not None:
        rows += [("capture pass over run", pf["source"]), ("rows chosen of the source's", (f"{pf['rows']:,} of "
                 f"{pf['source_rows']:,}")), ("tokens chosen", pf["tokens"])]
        if pf["bytes"] is not None:
            rows.append(("bytes the chosen rows come to", f"{format_size(pf['bytes'])} ({pf['bytes']:,} bytes)"))
    elif budget is not None:
        rows.append(("bytes counted against the budget", f"{format_size(c['spent'])} ({c['spent']:,} bytes)"))
    if c["items_left"] and c["projected_bytes"] is not None:
        rows.append(("projected for the run", format_size(c["projected_bytes"])))
    return ("The run's capture as `producer status` shows it (the whole run, not only this export's rows); the "
            "features are written by `producer export-features`, joined to these rows by id.\n\n"
            + _table(rows, ("", "")))


def _logprobs(v: LogprobsFigures) -> str:
    """The run's log-probability tables: the figures `producer status` shows, of the whole run."""
    rows: list[tuple[str, object]] = [
        ("top log-probabilities a token", v["k"]), ("rows shipped", v["rows"]),
        ("rows the done items' results name", v["rows_distinct"]), ("tokens with a table", v["tokens"]),
        ("bytes shipped", f"{format_size(v['bytes'])} ({v['bytes']:,} bytes)"),
        ("bytes a token", f"{v['bytes_per_token']:,.1f}" if v["bytes_per_token"] is not None else "-"),
    ]
    if v["items_left"] and v["projected_bytes"] is not None:
        rows += [("projected for the run", f"{format_size(v['projected_bytes'])} ({v['projected_bytes']:,} bytes)"),
                 ("tokens projected for the run", v["projected_tokens"])]
    return ("The run's log-probability tables as `producer status` shows them (the whole run, not only this "
            "export's rows); the tables are written by `producer export-logprobs`, joined to these rows by id.\n\n"
            + _table(rows, ("", "")))


def _when(epoch: float) -> str:
    return datetime.datetime.fromtimestamp(epoch, datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")


def _inline(d: Mapping[str, object]) -> str:
    return ", ".join(f"{k} {v:,}" if isinstance(v, int) else f"{k} {v}" for k, v in d.items())


def _recipe(info: RunInfo | None, s: RowStats) -> str:
    rows: list[tuple[str, object]] = []
    if info is not None:
        st = info.settings
        rows += [("model (run settings)", st.model or "as served"), ("multi-turn mode", st.multi_turn.value),
                 ("history reasoning", st.history_reasoning.value),
                 ("sampling", ", ".join(f"{k} {v}" for k, v in st.sampling.request_params().items())),
                 ("token ids kept", "yes" if st.token_ids else "no"),
                 ("run fingerprint (current)", f"`{info.fingerprint}`"),
                 ("code version (genqueue that made the run)", info.version)]
        for entry in info.fingerprints:
            rows.append((f"recipe since {_when(entry['since'])}", f"`{entry['fingerprint']}`"))
    rows += [(f"rows by model: {m}", n) for m, n in sorted(s.models.items())]
    rows += [(f"rows by fingerprint: `{f}`", n) for f, n in sorted(s.fingerprints.items())]
    return _table(rows, ("", "")) if rows else "not known (the run's record is gone)\n\n"


def percentiles(values: array.array[int]) -> list[int]:
    """The PERCENTILES of VALUES (nearest rank), empty for none."""
    if not values:
        return []
    ordered = sorted(values)
    n = len(ordered)
    return [ordered[min(n - 1, max(0, -(-p * n // 100) - 1))] for p in PERCENTILES]


def _lengths(s: RowStats, links: Mapping[str, str], *, plots: bool) -> str:
    out = []
    if "lengths" in links:
        out.append(f"![token lengths per generation]({links['lengths']})\n\n")
    elif not plots:
        out.append(f"Pictures of these distributions need matplotlib: `{PLOTS_HINT}`, then export again.\n\n")
    head = "| tokens | generations | mean | " + " | ".join(f"p{p}" for p in PERCENTILES) + " | from |"
    lines = [head, "|" + " --- |" * (len(PERCENTILES) + 4)]
    gens = s.generations - s.summed_generations
    for name, values, source in (
            ("prompt", s.prompt, "each answer's `usage.prompt_tokens` (the whole history the server was sent)"),
            ("thinking", s.thinking, "`usage.reasoning_tokens`, where the server reported it"),
            ("answer", s.answer, "`usage.completion_tokens` - `usage.reasoning_tokens`"),
            ("thinking + answer", s.completion, "`usage.completion_tokens`")):
        if values:
            p = percentiles(values)
            mean = sum(values) / len(values)
            lines.append(f"| {name} | {len(values):,} | {mean:,.0f} | " + " | ".join(f"{v:,}" for v in p)
                         + f" | {source} |")
        else:
            lines.append(f"| {name} | 0 | not known |" + " |" * len(PERCENTILES) + f" {source} |")
    out.append("\n".join(lines) + "\n\n")
    notes = []
    unknown = gens - len(s.thinking)
    if unknown > 0:
        notes.append(f"Thinking and answer lengths are not known for {unknown:,} of {gens:,} generations: the server "
                     "reported no `reasoning_tokens` for them (vLLM reports none by default), and the exported rows "
                     "hold no token ids split between thinking and answer; their thinking + answer is known.")
    if s.no_usage:
        notes.append(f"{s.no_usage:,} generations carry no usage counts at all.")
    if s.summed_rows:
        notes.append(f"{s.summed_rows:,} rows hold several answers each ({s.summed_generations:,} generations): their "
                     "`usage` is the sum over their answers, so these answers' own lengths are not in the export and "
                     "are not in the table. Export one row per generation (or `--format tokens`, for a run made with `--token-ids`) for them. Their "
                     "generated tokens per row:" + _row_sums(s.summed_completion))
    out += [f"{n}\n\n" for n in notes]
    return "".join(out)


def _row_sums(values: array.array[int]) -> str:
    p = percentiles(values)
    if not p:
        return " not known."
    return " " + ", ".join(f"p{q} {v:,}" for q, v in zip(PERCENTILES, p, strict=True)) + "."


def _files(r: ExportResult, folder: Path) -> str:
    rows: list[tuple[str, object]] = [("dataset (loaded as the train split)", link(Path(r.output), folder))]
    for what, p in (("truncated answers", r.truncated_path), ("errors", r.errors_path),
                    ("missing keys", r.missing_path), ("flagged rows", r.flagged_path),
                    ("LLaMA-Factory entry", r.dataset_info_path)):
        if p:
            rows.append((f"{what} (not loaded)", link(Path(p), folder)))
    return _table(rows, ("file", "path"))
