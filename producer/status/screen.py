"""The rows of `producer status`'s screen, from run_status()'s data (pure, no I/O).

The first rows answer the five questions someone running a long job asks, in this order: what
is read of the input, what the multi-turn rule made of it, which sampling, where the results go
and whether they ship, and where the run is against the estimate. Then the detail: where every
item is, outcomes in export's words, jobs, speed, tokens, hosts. Each row fits 100 columns;
what does not is clipped with `…` (`--wide`: nothing is clipped, every rejected reason and
input file gets its row).
"""

from __future__ import annotations

import re
import textwrap
import time
from typing import Any

import orjson

from genqueue.common.capture import format_size
from genqueue.common.contracts import Mode
from genqueue.common.eta import format_duration
from genqueue.common.keepers.outcomes import failed_jobs_line
from genqueue.common.keepers.runstate import RunState
from genqueue.common.redact import redact
from genqueue.producer.status.cost import CostView
from genqueue.producer.status.report import (
    CaptureView,
    FileView,
    HostView,
    InputView,
    ShippingSummary,
    StatusReport,
)
from genqueue.producer.status.tables import logprobs_rows

#: Columns a screen line may take (`--wide`: no limit).
WIDTH = 100
#: The rows that are cut to the screen's width rather than wrapped: a consumer's last shipping
#: error, whose class and age come first and whose message (whole in --wide and --json) is detail.
DETAIL = "last shipping error"


def screen_rows(r: StatusReport, *, wide: bool = False) -> tuple[list[tuple[str, str]], set[int]]:
    """(rows of (key, value), the indexes of rows to paint red) for run_status() R."""
    s = r["settings"]
    fps = r.get("fingerprints") or []
    rows: list[tuple[str, str]] = [
        ("run", f"{r['run']}  (queue {r['queue']}, fingerprint {r['fingerprint']}, genqueue {r['version']})"),
    ]
    if len(fps) > 1:
        rows.append(("fingerprints", f"{len(fps)} (settings updated): " + " -> ".join(
            f"{e['fingerprint']} ({time.strftime('%m-%d %H:%M', time.localtime(e['since']))})" for e in fps)))
    rows += _input_rows(r["input"], wide, r["now"])
    rows += _multi_turn(r, wide)
    rows.append(("sampling", _sampling(s["sampling"] or {})))
    if s.get("variants"):
        rows.append(("variants", _variants(s["variants"])))
    rows.append(("model", str(s.get("model") or "(whatever the endpoints serve)")))
    if s.get("drafter"):
        rows.append(("drafter", f"{s['drafter']}  (an evaluation of this drafter: producer drafter-report {r['run']})"))
    if lp := r.get("logprobs"):
        rows += logprobs_rows(lp)
    if c := r.get("capture"):
        rows += capture_rows(c)
    rows.append(("output", redact(str(s.get("output")))
                 + (f"  ({r['output_placement']['where']})" if r.get("output_placement") else "")))
    alarm: set[int] = set()
    ship = r["shipping"]
    if ship["stalled"]:
        alarm.add(len(rows))
    if not ship["shards"] and r["items_done"] + r["items_failed"]:
        # done marks are written as a shard ships; the consumer's report of it is seconds behind
        rows.append(("shipping", "results shipped; the consumers have not reported it yet (they do every few s)"))
    else:
        rows.append(("shipping", shipping_line(ship, r["now"])))
    if ship["stalled"]:  # its own row, so that clipping the line never hides it
        alarm.add(len(rows))
        rows.append(("", f"STALLED: shards waiting over {format_duration(ship['warn_after_s'])}"))
    for e in ship["errors"]:
        if ship["stalled"]:
            alarm.add(len(rows))
        # its age first: the message is what clipping may cut
        age = f" ({format_duration(e['age_s'])} ago)" if e["age_s"] is not None else ""
        rows.append((f"  {e['worker']}", f"{DETAIL}{age} {e['class']}: {clip(e['message'])}"))
    rows.append(("progress", _progress(r)))
    if "cost" in r:
        rows += [("estimate", _estimate(r)), *_cost(r["cost"])]
    rows.append(("items", _items(r)))
    if r["claimed"]["items"]:
        rows.append(("  claimed", r["claimed"]["line"]))
    rows.append(("outcomes", _outcomes(r)))
    if r["failed_by_class"] or r["refused"]:
        by = ", ".join(f"{k} {v:,}" for k, v in r["failed_by_class"].items())
        rows.append(("failed", f"{r['failed']:,}" + (f" ({by})" if by else "") + f"; refused {r['refused']:,} jobs"))
    jobs = r["jobs"]
    rows.append(("jobs", (f"queued {jobs['queued']:,}, in flight {jobs['started']:,}, "
                         f"finished {jobs['finished']:,}, failed {jobs['failed']:,}")))
    if (gave_up := r.get("failed_jobs")) and gave_up["jobs"]:
        alarm.add(len(rows))
        rows.append(("  failed jobs", failed_jobs_line(gave_up, r["queue"])))
    if "share" in r:  # runs share the fleet by priority (`producer priority`), then evenly
        share = r["share"]
        pct = f" ({100 * share['in_flight'] / share['of']:.0f}%)" if share["of"] else ""
        rows.append(("priority", (f"{r.get('priority', 0)}; share: {share['in_flight']:,} of the {share['of']:,} "
                                  f"requests in flight on its {share['consumers']} live consumer(s){pct}")))
    rows.append(("speed", _speed(r)))
    rows.append(("tokens", tokens_line(r)))
    if "hosts" in r:
        if any(h["refusing"] for h in r["hosts"].values()):
            alarm.add(len(rows))
        rows.append(("hosts", hosts_line(r["hosts"])))
    return rows, alarm


def _input_rows(inp: InputView, wide: bool, now: float) -> list[tuple[str, str]]:
    files = inp["files"]
    busy = [("", f"{short_name(name, wide)}: still reading (an enqueue began {format_duration(now - at)} ago)")
            for name, at in inp.get("reading", {}).items()]
    if not files:
        if busy:
            return [("input", busy[0][1]), *busy[1:]]
        return [("input", "none recorded yet (`producer enqueue` records each input when it has read it)")]

    def read(f: FileView) -> str:
        how = f"{f['records']:,} of {f['records']:,} records read (complete)" if f["complete"] else \
            f"{f['records']:,} records read, INCOMPLETE (the read stopped early: enqueue it again)"
        return f"{short_name(f['name'], wide)}: {how}, rejected {f['rejected']:,}"

    rows = [("input" if i == 0 else "", read(f)) for i, f in enumerate(files)] + busy
    if len(files) > 1:
        done = "complete" if inp["complete"] else "NOT complete"
        rows.append(("", (f"{len(files)} files: {inp['records']:,} records read ({done}), "
                          f"rejected {inp['rejected']:,}")))
    if wide:
        rows += [(f"  rejected: {k}", f"{v:,}") for k, v in inp["rejected_by_reason"].items()]
    elif inp["rejected_by_reason"]:
        rows.append(("  rejected", ", ".join(f"{k} {v:,}" for k, v in inp["rejected_by_reason"].items())))
    return rows


def _multi_turn(r: StatusReport, wide: bool) -> list[tuple[str, str]]:
    s, inp = r["settings"], r["input"]
    mode = str(s.get("multi_turn"))
    converted = inp["records"] - inp["rejected"]
    met = f"{inp['multi_turn_records']:,} of {converted:,} records have more than one user turn"
    if mode == Mode.REGENERATE:
        # export's words and counts: complete, partial and cut by the last answer's outcome (a
        # conversation stopped at a divergence ends on an answer of its own: complete), then
        # what became of the recorded tool turns, each conversation that had some counted once
        # (--wide: export's whole phrase, with the records' note)
        note, other = (" (tool_call_diverged)", " for another reason") if wide else ("", "")
        return [("multi-turn", f"{mode}, truncation {s.get('truncation')}: {met}"),
                ("  turns", (f"{r['turns_generated']:,} generated; conversations complete {r['complete']:,}, "
                             f"partial {r['partial']:,}, cut {r['cut']:,}")),
                ("  tools", (f"{r['tool_turns_to_end']:,} regenerated to the end, {r['tool_call_diverged']:,} "
                             f"stopped at a divergence{note}, {r['stopped_at_tool_turn']:,} stopped at a tool "
                             f"turn{other}"))]
    if mode == Mode.EACH:
        return [("multi-turn", f"{mode}: {met}"),
                ("  turns", f"{inp['user_turns']:,} user turns, each an item: {r['items']:,} items")]
    return [("multi-turn", f"{mode}: {met}"),
            ("  turns", f"only the {mode} user turn of each record is answered: {r['items']:,} items")]


def _sampling(sp: dict[str, Any]) -> str:
    extra = sp.get("extra") or {}
    bits = [f"{k} {'-' if sp.get(k) is None else sp.get(k)}" for k in ("temperature", "top_p", "max_tokens", "seed")]
    bits.append("extra " + (", ".join(f"{k}={v}" for k, v in extra.items()) if extra else "-"))
    return ", ".join(bits)


def _variants(vs: list[dict[str, Any]]) -> str:
    """The run's mix of request variants: each one's share of the items and its fields."""
    total = sum(v["weight"] for v in vs) or 1.0
    return "; ".join(f"{v['name']} {100 * v['weight'] / total:.3g}% ({orjson.dumps(v['params']).decode()})"
                     for v in vs)


def _progress(r: StatusReport) -> str:
    items = r["items"] or 0
    finished = r["items_done"] + r["items_failed"]
    frac = finished / items if items else 0.0
    rate = r["eta_assumes_completion_tokens_per_s"]
    items_s = r["speed"]["last_minute"]["completions_per_s"]
    if r["state"] in (RunState.DONE, RunState.FAILED):  # the state `producer runs` shows
        # complete only when every item has a result: error records end a run, they do not finish it
        eta = ("run complete" if r["state"] == RunState.DONE
               else f"run over, NOT complete: {r['items_failed']:,} items failed")
    elif r["paused"]:
        eta = "ETA - (paused)"
    elif r["eta_s"] is None:
        eta = f"ETA - ({r['speed']['note'] or 'no rate yet'})"
    elif r.get("eta_basis") == "items" or rate is None:
        eta = f"ETA {format_duration(r['eta_s'])} at {items_s or 0:,.1f} items/s (last minute)"
    else:
        eta = f"ETA {format_duration(r['eta_s'])} at {rate:,.0f} tok/s (last minute)"
    return f"{bar(frac)} {100 * frac:.1f}%: {finished:,} of {items:,} items; {eta}"


def _estimate(r: StatusReport) -> str:
    """The input's estimate of output tokens against the tokens per item generated so far."""
    est, items, done = r["cost"]["estimated_output_tokens"], r["items"], r["items_done"]
    if est is None:
        return "- (the input has no original answers to estimate output tokens from)"
    text = f"{est:,} tokens" + (f" ({est / items:,.0f}/item)" if items else "")
    per = r.get("tokens_per_item")
    if per is None and done and r["completion_tokens"]:
        per = r["completion_tokens"] / done
    if per and est:
        text += f"; so far {per:,.0f}/item ({per * items / est:.2f}x)"
    return text  # the time left is the progress row's ETA alone


def _cost(c: CostView) -> list[tuple[str, str]]:
    """GPU-hours spent and projected; in money on a row of its own at --gpu-hour-price."""
    text = (f"GPU-hours {_amount(c['gpu_hours_spent'])} spent -> {_amount(c['gpu_hours_projected'])} projected "
            f"({c['live_gpus']} live GPUs)")
    if c["price"] is None:
        return [("cost", text + "; money: --gpu-hour-price")]
    return [("cost", text), ("  money", (f"{_amount(c['spent_money'])} spent -> {_amount(c['projected_money'])} "
                                         f"projected at {c['price']:g} a GPU-hour"))]


def _amount(x: float | None) -> str:
    """X in few columns: whole units once they are many, else three digits ("-": not known)."""
    if x is None:
        return "-"
    return f"{x:,.0f}" if x >= 100 else f"{x:.2f}" if x >= 1 else f"{x:.2g}"


def _items(r: StatusReport) -> str:
    text = (f"{r['items']:,}: queued {r['items_queued']:,}, in flight {r['items_in_flight']:,}, "
            f"shipping {r['items_shipping']:,}, done {r['items_done']:,}, failed {r['items_failed']:,}")
    if r["items_elsewhere"]:
        claimed = r["claimed"]["items"]
        gave_up = r.get("failed_jobs", {}).get("items", 0)
        text += f", elsewhere {r['items_elsewhere']:,} " + (
            f"({claimed:,} claimed by a producer: below)" if claimed >= r["items_elsewhere"] else
            f"({claimed:,} claimed by a producer: below; failed jobs, or moved since the last report)" if claimed else
            "(in failed jobs: below)" if gave_up >= r["items_elsewhere"] else
            "(failed jobs, or moved since the last report)")
    return text


def _outcomes(r: StatusReport) -> str:
    cut = ", ".join(f"{k} {v:,}" for k, v in r["cut_by_outcome"].items())
    text = (f"done {r['done']:,} = complete {r['complete']:,} (finished) + partial {r['partial']:,} "
            f"+ cut {r['cut']:,}" + (f" ({cut})" if cut else ""))
    if r["outcomes_counted"] != r["done"]:
        text += f"; outcomes known for {r['outcomes_counted']:,} (marks rebuilt from the shards)"
    return text


def _speed(r: StatusReport) -> str:
    last, avg, note = r["speed"]["last_minute"], r["speed"]["run_average"], r["speed"]["note"]
    ran = r["speed"].get("run_seconds")
    if r["items"] and r["items_done"] + r["items_failed"] >= r["items"]:  # over: what it did, fixed
        if avg["completions_per_s"] is None or ran is None:
            return "run over; its rate - (when it ended is not recorded)"
        took = f"{ran:.1f} s" if ran < 60 else format_duration(ran)
        return (f"run over in {took}: {avg['completions_per_s']:,.1f} items/s, "
                f"{avg['completion_tokens_per_s']:,.0f} completion tok/s (first job to last item)")
    if note:
        head = f"last minute - ({note})"
    else:
        head = (f"last minute {last['completions_per_s']:,.1f} items/s, "
                f"{last['completion_tokens_per_s']:,.0f} completion tok/s, {last['prompt_tokens_per_s']:,.0f} prompt tok/s")
    if avg["completions_per_s"] is None:
        return head + "; run -"
    return head + f"; run {avg['completions_per_s']:,.1f} items/s, {avg['completion_tokens_per_s']:,.0f} completion tok/s"


def tokens_line(r: StatusReport) -> str:
    """Tokens generated (as records are written, not when their jobs are acked), and of them
    those in acked jobs when fewer."""
    text = f"prompt {r['prompt_tokens']:,}, completion {r['completion_tokens']:,} generated"
    acked = r.get("acked_tokens")
    if acked is not None and acked["completion"] < r["completion_tokens"]:
        text += f" ({acked['completion']:,} completion in acked jobs)"
    return text


def shipping_line(ship: ShippingSummary, now: float) -> str:
    line = f"{ship['shards']:,} shards, {ship['bytes'] / 1e6:,.1f} MB shipped, {ship['waiting_shards']} waiting on disk"
    if ship["oldest_waiting_s"] is not None:
        line += f" (oldest {format_duration(ship['oldest_waiting_s'])})"
    last = ship["last_upload_at"]
    line += f", last upload {format_duration(now - last)} ago" if last else ", no upload yet"
    return line


def hosts_line(hosts: dict[str, HostView]) -> str:
    if not hosts:
        return "no live consumer serves or refuses this run"
    parts = []
    for host, h in hosts.items():
        bits = [f"{h['serving']} consumer(s) shipping"] if h["serving"] else []
        if h["refusing"]:
            bits.append(f"{h['refusing']} REFUSING: {clip(h['reason'] or '', 120)}")
        parts.append(f"{host}: " + ", ".join(bits))
    return "; ".join(parts)


def short_name(path: str, wide: bool) -> str:
    """An input's name as shown: its file name (the whole path with --wide)."""
    return path if wide or path == "-" else path.rstrip("/").rsplit("/", 1)[-1]


def bar(frac: float, width: int = 20) -> str:
    n = round(frac * width)
    return "[" + "#" * n + "." * (width - n) + "]"


def clip(text: str, limit: int = 200) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def wrap(line: str, width: int | None, indent: int) -> list[str]:
    """LINE in lines of WIDTH columns at most, broken at spaces, each after the first indented
    by INDENT; never cut (None: LINE as is). A command in backticks is never broken: the reader
    copies it whole from one line."""
    if width is None or len(line) <= width:
        return [line]
    glued = _COMMAND.sub(lambda m: m.group().replace(" ", _GLUE), line)
    lines = textwrap.wrap(glued, width, subsequent_indent=" " * indent, break_on_hyphens=False)
    return [x.replace(_GLUE, " ") for x in lines] or [line]


def wrap_keeping_command(line: str, width: int | None, indent: int) -> list[str]:
    """LINE wrapped as wrap() does; when it does not fit, a command it ends with (as `...; clear
    them with <command>`) goes on a line of its own, indented by INDENT."""
    head, sep, last = line.rpartition("; ")
    if width is None or len(line) <= width or not sep or "`" not in last:
        return wrap(line, width, indent)
    return wrap(head, width, indent) + wrap(" " * indent + last, width, indent)


_COMMAND = re.compile(r"`[^`]+`")
_GLUE = "\x00"  # stands for a space inside a command while textwrap breaks the line


def fit(line: str, width: int | None) -> str:
    """LINE clipped to WIDTH columns with `…` (None: as is)."""
    return line if width is None or len(line) <= width else line[: width - 1] + "…"


def num(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x:,.{digits}f}"


def capture_rows(c: CaptureView) -> list[tuple[str, str]]:
    """The capture's rows: what is captured and shipped, which answers and why, the budget, and the
    projection for the run (common/keepers/captured.py's figures)."""
    extra = (f" ({c['rows_written']:,} written: {c['rows_extra']:,} redone or awaiting their results)"
             if c["rows_extra"] else "")
    rows = [("capture", (f"on: {c['what']}, layers {','.join(map(str, c['layers']))}, {c['dtype']}; "
                         f"{c['rows']:,} rows{extra}, {c['bytes'] / 1e6:,.1f} MB shipped")),
            ("  chosen", f"{c['chosen']}: {c['rows']:,} rows of {c['answers']:,} answers generated")]
    budget, pf = c["budget"], c["capture_pass"]
    if pf is not None:  # a pass: chosen, budget and bytes exactly, when it was enqueued
        size = f", {format_size(pf['bytes'])} of features" if pf["bytes"] is not None else ""
        rows[1] = ("  chosen", (f"{c['chosen']}: {c['rows']:,} rows captured of the {pf['rows']:,} chosen "
                               f"({pf['tokens']:,} tokens{size})"))
        if budget is not None:
            rows.append(("  budget", f"{format_size(budget)}: applied when the pass was enqueued"))
        if c["items_left"] and c["projected_bytes"] is not None:
            rows.append(("  forecast", f"{format_size(c['projected_bytes'])} for the pass (its rows' tokens, exactly)"))
        return rows
    if budget is not None:
        if c["budget_spent"]:
            rows.append(("  budget", (f"{format_size(budget)}: budget spent ({format_size(c['spent'])} captured); "
                                      "answers from now on are generated without features")))
        else:
            rows.append(("  budget", (f"{format_size(budget)}: {format_size(c['spent'])} captured "
                                      f"({c['spent'] / budget:.0%})")))
    projected = c["projected_bytes"]
    if not c["items_left"]:
        return rows  # over: what shipped is what there is
    if projected is None:
        rows.append(("  forecast", "none yet: no row shipped"))
    else:
        how = (f"{format_size(c['bytes_per_row'] or 0)} a row x {c['rows_per_item'] or 0:.2f} rows an item x "
               f"{c['items_left']:,} items left, plus what shipped")
        keeps = ""
        if budget is not None and c["projected_kept"] is not None and projected > 0:
            kept = c["projected_kept"]
            keeps = f"; the budget keeps {format_size(kept)} ({min(kept / projected, 1):.0%})"
        rows.append(("  forecast", f"{format_size(projected)} for the run ({how}){keeps}"))
    return rows
