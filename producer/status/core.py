"""A run's state, read from Redis: genqueue's bookkeeping, rq's registries, and what every
consumer last reported (rates, in flight, shipping, its engine's own metrics).

Progress comes from the done marks the consumers write when a shard ships (common/keepers/marks.py):
an item is done iff a shipped shard holds its result, failed iff one holds only an error record
for it, of the items in the run's item table; rates and the tokens per item the ETA assumes come
from the consumers' counters. A paused run (common/keepers/pause.py) is said on the first line, in red.
A run whose settings were changed (`producer enqueue --update-settings`) shows every fingerprint
it has had.

Shipping trouble is shown where it is felt: each consumer's last shipping error (its class,
message and age) under the shipping line, and the line turns red (on a terminal) once a shard
has waited longer than SHIP_WAIT_WARN: results that sit on a GPU node's disk are not
durable yet, and their jobs are not acked. Every free text a consumer or rq reported passes
through genqueue.common.redact before it is shown or printed as JSON.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import click
import redis

from genqueue.common.engineview import ENGINE_READINGS, Shown
from genqueue.common.eta import format_duration
from genqueue.common.keepers.captured import capture_figures, logprobs_figures
from genqueue.common.keepers.claims import Claims, HeldClaims
from genqueue.common.keepers.clock import redis_time
from genqueue.common.keepers.outcomes import outcome_view, read_failed_jobs
from genqueue.common.keepers.rqaccess import queue_name, refused_jobs
from genqueue.common.keepers.rqjobs import malformed_line, refused_line, scan_jobs
from genqueue.common.keepers.runs import RunStore
from genqueue.common.keepers.runsources import RunSources
from genqueue.common.keepers.runstate import read_pulse, settle
from genqueue.common.keepers.snapshots import ConsumerReport, ConsumerState, Snapshots, consumer_state
from genqueue.common.keepers.spectally import SpecTallies
from genqueue.common.redact import redact
from genqueue.common.retryhint import enqueue_again_command, failed_summary, next_steps
from genqueue.producer.status.cost import remaining_tokens, run_cost
from genqueue.producer.status.figures import (
    eta_view,
    input_view,
    placement,
    run_clock,
    run_rates,
    run_share,
    speed_note,
)
from genqueue.producer.status.frame import Block, Rank, joined
from genqueue.producer.status.report import (
    ConsumerRow,
    EngineRow,
    HostView,
    Rates,
    RunShare,
    ShareShipping,
    ShippingError,
    ShippingSummary,
    StartingRow,
    StatusReport,
)
from genqueue.producer.status.screen import DETAIL, WIDTH, fit, num, screen_rows, wrap, wrap_keeping_command
from genqueue.producer.status.speculation import engine_totals, speculation_lines, speculation_view

#: Seconds a consumer's oldest unshipped shard may wait before the shipping line is red: shards seal every
#: --shard-max-age, so minutes mean the store refuses them.
SHIP_WAIT_WARN = 300.0


def run_status(conn: redis.Redis, run: str, now: float | None = None, *,
               gpu_hour_price: float | None = None) -> StatusReport:
    """Everything `producer status` shows about RUN, as plain data; every figure RUN's own.
    GPU_HOUR_PRICE: money a GPU-hour, for the cost in money (None: GPU-hours only)."""
    # Redis's clock: consumers report last_seen in it, and rq's started_at is in it too, so a
    # status host whose clock is off neither calls live consumers dead nor misreads elapsed time
    now = redis_time(conn) if now is None else now
    store = RunStore(conn)
    info = store.require(run)
    sources = store.sources(run)
    inputs = input_view(sources, RunSources(conn, run).reading())
    # one moment: marks, the counters they bump, rq's counts and the pause; the state from them is
    # the one `producer runs` shows (common/keepers/runstate.py)
    pulse = read_pulse(conn, run)
    counted = pulse.progress
    items, done, failed, stats = counted.items, counted.done, counted.failed_only, counted.stats
    pause = pulse.pause
    scan = scan_jobs(conn, run)  # what rq needs to load each job: no payload is moved at every poll
    # why rq gave up on each failed job (a pack that did not read is named): `producer runs`' too
    gave_up = read_failed_jobs(conn, run)
    refused = {k: redact(v) for k, v in refused_jobs(conn, run).items()}
    started_at = store.started_at(run)
    jobs = pulse.jobs
    state, _stalled = settle(conn, run, pulse, sources)
    spent = Snapshots(conn).spent(run)  # what the consumers generated and spent: it never goes down

    everyone = Snapshots(conn).reports(now)
    mine = [c for c in everyone if run in c.get("runs", {})]
    live = [c for c in mine if c["live"]]
    shares = {c["worker"]: run_share(c, run) for c in mine}
    in_flight = sum(shares[c["worker"]]["in_flight"] + shares[c["worker"]]["pending_items"] for c in live)
    unshipped = sum(int(shares[c["worker"]]["shipping"].get("unshipped_records", 0) or 0) for c in live)
    where = placement(items, done, failed, in_flight, unshipped, jobs["queued"])
    # items in no job and in no consumer: a producer's claim not queued yet? (a SCAN: only then)
    held = Claims(conn).held(run) if where["elsewhere"] else HeldClaims()
    note = speed_note(items, done, failed, len(live),
                      answering=sum(c["runs"][run].get("completions_per_s", 0.0) for c in live))
    recent: Rates = {
        "completions_per_s": None if note else sum(c["runs"][run].get("completions_per_s", 0.0) for c in live),
        "prompt_tokens_per_s": None if note else sum(c["runs"][run].get("prompt_tokens_per_s", 0.0) for c in live),
        "completion_tokens_per_s": (None if note else
                                    sum(c["runs"][run].get("completion_tokens_per_s", 0.0) for c in live)),
    }
    remaining = max(items - done - failed, 0)
    # Tokens: what was generated (the spent counters, added as records are written), never less
    # than what the acked jobs counted. Tokens per item from the counters that go with the tokens
    # (marks may be rebuilt, counters not): what was generated, else what was acked.
    prompt_tokens = max(spent.prompt_tokens, stats.get("prompt_tokens", 0))
    completion_tokens = max(spent.completion_tokens, stats.get("completion_tokens", 0))
    answered, answered_tokens = ((spent.completions, spent.completion_tokens) if spent.completions
                                 else (stats.get("items_done", 0), stats.get("completion_tokens", 0)))
    versions = sorted({c.get("version", "?") for c in live})
    drift = []
    for c in live:
        fp = c["runs"][run].get("fingerprint")
        if fp and fp != info.fingerprint:
            drift.append(f"{c['worker']} runs fingerprint {fp}, the run's is {info.fingerprint}")
        if c.get("version") != info.version:
            drift.append(f"{c['worker']} runs genqueue {c.get('version')}, the run was created by {info.version}")
    outcomes = outcome_view(stats, done, failed)
    estimate = _estimate(sources)
    left, left_how = remaining_tokens(items, done, failed, answered_tokens, estimate, answered=answered)
    eta, eta_basis = eta_view(remaining, left, bool(answered and answered_tokens), recent, note)
    over = bool(items) and done + failed >= items
    shipping = shipping_view([(c, shares[c["worker"]]["shipping"]) for c in mine], now,
                             live={c["worker"] for c in live})
    # a run over ended when its last item was marked (consumers before LAST_MARK_AT: its last upload)
    ended_at = (counted.last_mark_at or shipping["last_upload_at"]) if over else None
    ran_s = run_clock(started_at, now, ended_at, over=over)
    cost = run_cost(mine, run, run_started_at=started_at, remaining=left, rate=recent["completion_tokens_per_s"],
                    price=gpu_hour_price, estimate=estimate, remaining_basis=left_how,
                    complete=over, spent_hours=spent.gpu_seconds / 3600.0)

    speculation = speculation_view(SpecTallies(conn).table(run), [
        (c["worker"], c["live"], s) for c in mine if (s := engine_totals(c["runs"][run].get("spec"))) is not None])
    return {
        "run": run,
        "now": now,
        "state": state.value,
        "paused": pause,
        "fingerprint": info.fingerprint,
        "fingerprints": [{"fingerprint": e["fingerprint"], "since": e["since"]} for e in info.fingerprints],
        "version": info.version,
        "settings": info.settings.to_dict(),
        "created_at": info.created_at,
        "started_at": started_at,
        "input": inputs,
        "records": inputs["records"],
        "rejected": inputs["rejected"],
        "rejected_by_reason": inputs["rejected_by_reason"],
        "turns_generated": stats.get("shipped_turns", 0),
        "items": items,
        "items_done": done,
        "items_failed": failed,
        "items_in_flight": where["in_flight"],
        "items_shipping": where["shipping"],
        "items_queued": where["queued"],
        "items_elsewhere": where["elsewhere"],
        "claimed": {"claims": held.claims, "items": held.items, "oldest_s": held.oldest_s, "stale": held.stale,
                    "line": held.line(enqueue_again_command(run, sources)) if held.items else ""},
        "completion_tokens": completion_tokens,
        "prompt_tokens": prompt_tokens,
        "acked_tokens": {"prompt": stats.get("prompt_tokens", 0), "completion": stats.get("completion_tokens", 0)},
        "tokens_per_item": answered_tokens / answered if answered else None,
        **outcomes,
        "warnings": {k: redact(v) for k, v in store.warnings(run).items()},
        "jobs": jobs,
        "malformed_jobs": [{**b, "reason": redact(b["reason"])} for b in scan.to_list()],
        "failed_jobs": gave_up,
        "refused": len(refused),
        "refused_jobs": refused,
        "queue": queue_name(run),
        "next_steps": next_steps(run, paused=pause is not None, failed=failed, sources=sources,
                                 output=redact(info.settings.output), claimed=held.stale > 0),
        "speed": {
            "last_minute": recent,
            "note": note,
            "run_average": run_rates(done + failed, completion_tokens, prompt_tokens, ran_s),
            "run_seconds": ran_s,
            "ended_at": ended_at,
        },
        "eta_s": eta,
        "eta_basis": eta_basis,
        "eta_assumes_completion_tokens_per_s": recent["completion_tokens_per_s"],
        "cost": cost,
        "shipping": shipping,
        "consumers": [_consumer_row(c, run, shares[c["worker"]], where["in_flight"]) for c in mine],
        "starting": starting_rows(everyone, run),
        "output_placement": {"host": info.placement.host, "shared_fs": info.placement.shared_fs,
                             "where": info.placement.describe(info.settings.output)},
        "hosts": hosts_view(everyone, run),
        "versions": versions,
        "drift": drift,
        # Runs share the fleet by priority (`producer priority`), then evenly: this run's part of
        # the requests in flight on the live consumers that serve it.
        "priority": store.priorities([run])[run],
        "share": {"in_flight": sum(c["runs"][run].get("in_flight", 0) for c in live),
                  "of": sum(c.get("in_flight", 0) for c in live), "consumers": len(live)},
        "speculation": speculation,
        "logprobs": logprobs_figures(info.settings, counted),
        "capture": capture_figures(info.settings, counted),
    }


def starting_rows(snaps: list[ConsumerReport], run: str) -> list[StartingRow]:
    """The live consumers still starting (no run of theirs yet) that may serve RUN: each with
    what it waits on and for how long (its time in the phase when it reported, plus its age)."""
    out: list[StartingRow] = []
    for c in snaps:
        phase = c.get("phase")
        if not c["live"] or not phase or run in c["runs"] or c.get("only_run") not in (None, run):
            continue
        out.append({"worker": c["worker"], "host": c.get("host"), "gpu": c.get("gpu"), "phase": redact(str(phase)),
                    "phase_s": round(float(c.get("phase_s") or 0.0) + c["age_s"], 1)})
    return out


def _estimate(sources: dict[str, dict[str, Any]]) -> int | None:
    """The run's estimated output tokens: the sum of its inputs' (common/estimate.py);
    None when no input recorded one."""
    found = [e for s in sources.values()
             if isinstance(e := s.get("estimated_output_tokens"), int) and not isinstance(e, bool)]
    return sum(found) if found else None


def hosts_view(snaps: list[ConsumerReport], run: str) -> dict[str, HostView]:
    """Which hosts ship RUN's results, and which refuse it: per host, its live consumers that
    serve the run and those that refuse it (with the first reason), from their snapshots."""
    out: dict[str, HostView] = {}
    for c in snaps:
        if not c["live"]:
            continue
        why = (c.get("paused") or {}).get(f"run {run}")
        if run not in c.get("runs", {}) and not why:
            continue
        h = out.setdefault(str(c.get("host") or "?"), {"serving": 0, "refusing": 0, "reason": None})
        if why:
            h["refusing"] += 1
            h["reason"] = h["reason"] or redact(str(why))
        else:
            h["serving"] += 1
    return dict(sorted(out.items()))


def _consumer_row(c: ConsumerReport, run: str, share: RunShare, run_in_flight: int) -> ConsumerRow:
    """Consumer C as seen from RUN: the run's rates and SHARE (its in flight, jobs held and
    shipping), never the figures of another run C serves. Its in flight is capped by RUN_IN_FLIGHT,
    the run's: a report seconds old does not show work in flight beside a run that is done."""
    r = c["runs"][run]
    share = {**share, "in_flight": min(share["in_flight"], run_in_flight),
             "pending_items": min(share["pending_items"], max(run_in_flight - share["in_flight"], 0))}
    ship: ShareShipping = {**share["shipping"]}
    shipping = c.get("shipping")
    err = shipping.get("last_error") if shipping else None
    ship["last_error"] = _redact_error(err) if err else None
    # `metrics` is missing only from a snapshot with no engine at all (shown as such, not filled in)
    engine: EngineRow = {"models": c.get("models"), "max_model_len": c.get("max_model_len"),  # type: ignore[typeddict-item]
                         **c.get("engine", {})}
    state = consumer_state(c)
    gone = state is not ConsumerState.LIVE  # its engine's verdict is the last it gave, kept as such
    return {
        "worker": c["worker"], "host": c.get("host"), "gpu": c.get("gpu"), "state": state.value, "gone": gone,
        "live": c["live"], "exited": bool(c.get("exited")),
        "age_s": round(c["age_s"], 1), "completions_per_s": r.get("completions_per_s", 0.0),
        "completion_tokens_per_s": r.get("completion_tokens_per_s", 0.0),
        "in_flight": share["in_flight"], "pending_items": share["pending_items"], "held_jobs": share["held_jobs"],
        "runs_served": len(c.get("runs", {})),
        "paused": [k for k, v in c.get("paused", {}).items() if v], "version": c.get("version"),
        "paused_detail": {k: redact(str(v)) for k, v in c.get("paused", {}).items() if v},
        "engine": None if gone else engine, "last_engine": engine if gone else None,
        "shipping": ship, "reasoning_probe": r.get("reasoning_probe"), "clock_offset": c.get("clock_offset"),
        "copies": dict(c.get("copies") or {}),
        "phase": c.get("phase"),
        "phase_s": round(float(c.get("phase_s") or 0.0) + c["age_s"], 1) if c.get("phase") else None,
    }


def format_status(r: StatusReport, *, color: bool | None = None, width: int | None = WIDTH) -> str:
    """A human view of run_status(): its first lines answer the five questions (the input, the
    multi-turn rule, the sampling, the output and shipping, progress against the estimate).
    WIDTH: the screen's columns, every line wrapped to them, never cut (None: --wide, no line
    wrapped). COLOR: paint alarms red (default: when stdout is a terminal and NO_COLOR is not set)."""
    return joined(status_blocks(r, color=color, width=width))


#: The rows a frame too tall for its terminal keeps first (frame.Rank), by their key.
_ROW_RANKS = {"run": Rank.HEADLINE, "progress": Rank.HEADLINE, "items": Rank.COVERAGE, "  claimed": Rank.COVERAGE,
              "outcomes": Rank.COVERAGE, "failed": Rank.FAILURES, "  failed jobs": Rank.FAILURES}


def status_blocks(r: StatusReport, *, color: bool | None = None, width: int | None = WIDTH) -> list[Block]:
    """format_status()'s screen as blocks of lines, each ranked (frame.py): --watch keeps the
    blocks that fit its terminal's height, by rank."""
    rows, alarm = screen_rows(r, wide=width is None)
    key_w = max(len(k) for k, _ in rows)
    under = key_w + 2 if key_w <= 14 else 4  # a wrapped value goes on under its first line
    paint = _use_color() if color is None else color
    blocks = [Block(Rank.FAILURES if i in alarm else _ROW_RANKS.get(k, Rank.DETAIL),
                    tuple(_red(x, paint and i in alarm) for x in
                          ([fit(f"{k.ljust(key_w)}  {v}", width)] if v.startswith(DETAIL) else
                           wrap(f"{k.ljust(key_w)}  {v}", width, under))))
              for i, (k, v) in enumerate(rows)]
    head: list[list[str]] = []
    p = r["paused"]
    if p:  # the reason wraps onto lines of its own, and the command that clears the pause is whole
        who = f"(by {p['by']}, {format_duration(r['now'] - p['at'])} ago; `producer resume --run {r['run']}`)"
        head.append(wrap(f"PAUSED   {redact(p['reason'])}  {who}", width, 9))
    if r["items_failed"] and (p or r["items_done"] + r["items_failed"] >= r["items"]):
        # a run that cannot go on by itself: what failed, and the command that retries it
        head.append(wrap(f"FAILED   {failed_summary(r['items_failed'], r['failed_by_class'])}; "
                         f"{r.get('next_steps', '')}", width, 9))
    if r["claimed"]["stale"]:  # in no job, and no producer will put them in one: the command that does
        head.append(wrap(f"STALLED  {r['claimed']['line']}", width, 9))
    blocks = [Block(Rank.HEADLINE, tuple(_red(x, paint) for x in h)) for h in head] + blocks
    heading = ["", *wrap("consumers  (this run's share: items/s, tok/s, in flight, jobs held; under each: its engine)",
                     width, 4)]
    if not r["consumers"] and not r.get("starting"):
        heading.append("  none has reported for this run")
    blocks.append(Block(Rank.CONSUMERS, tuple(heading)))
    for st in r.get("starting", []):
        gpu = st["gpu"] if st["gpu"] is not None else "-"
        blocks.append(Block(Rank.CONSUMERS, tuple(wrap(
            f"  {st['worker']}  gpu {gpu}  starting: {st['phase']} for {format_duration(st['phase_s'])}", width, 6))))
    blocks += [Block(Rank.CONSUMERS, tuple(_consumer_lines(c, width))) for c in r["consumers"]]
    if spec := r.get("speculation"):
        blocks.append(Block(Rank.SPECULATION, ("", *(x for line in speculation_lines(spec, width)
                                                     for x in wrap(line, width, 4)))))
    tail = [f"DRIFT    {d}" for d in r["drift"]]
    if r.get("malformed_jobs"):
        tail.append(f"JOBS     {malformed_line(r['malformed_jobs'], 'in the queue or registries')}")
    if r.get("refused_jobs"):
        tail.append(f"REFUSED  {refused_line(r['refused_jobs'], r['run'])}")
    tail += [f"WARNING  {msg}" for msg in sorted(set(r["warnings"].values()))]
    return blocks + [Block(Rank.FAILURES, tuple(wrap_keeping_command(t, width, 9))) for t in tail]


def _consumer_lines(c: ConsumerRow, width: int | None) -> list[str]:
    """Consumer C's line, and under it its engine, the doctor's verdict and its copies (a gone
    consumer: its line and its copies, no engine)."""
    lines = wrap(_consumer_line(c), width, 6)
    e = c["engine"]
    if e is None:  # gone: what it last said of its engine is not the engine now
        if copies := copies_text(c["copies"]):
            lines += wrap("      " + copies, width, 8)
        return lines
    lines += wrap("      " + engine_text(e), width, 8)
    if packs := c["paused_detail"].get("packs_unreachable"):  # why its jobs by reference go back
        lines += wrap("      " + packs, width, 8)
    if copies := copies_text(c["copies"]):
        lines += wrap("      " + copies, width, 8)
    if e.get("advice"):  # the engine doctor's verdict (consumer/engine/doctor.py), with its notes
        lines += wrap("      engine: " + e["advice"] + "".join(f"; {n}" for n in e.get("notes") or []), width, 8)
    return lines


def _consumer_line(c: ConsumerRow) -> str:
    figures = (f"{c['completions_per_s']:.1f}/s  {c['completion_tokens_per_s']:,.0f} tok/s  "
               f"in flight {c['in_flight'] + c.get('pending_items', 0)}  held {c.get('held_jobs', 0)} jobs")
    gpu = c["gpu"] if c["gpu"] is not None else "-"
    served = f" (of {c['runs_served']} runs)" if c.get("runs_served", 1) > 1 else ""
    if c["gone"]:  # what it did, in the past tense, never a present verdict
        if c["state"] == ConsumerState.EXITED:
            return f"  {c['worker']}  gpu {gpu}  exited {format_duration(c['age_s'])} ago{served}"
        return (f"  {c['worker']}  gpu {gpu}  STOPPED REPORTING {format_duration(c['age_s'])} ago{served}; at its "
                f"last report: {figures}")
    if c.get("phase"):
        state = f"starting: {c['phase']} for {format_duration(c.get('phase_s'))}"
    else:
        state = "live"
    if c["paused"]:
        state += " (paused: " + ", ".join(c["paused"]) + ")"
    offset = c["clock_offset"] or 0.0
    if abs(offset) > 1.0:  # leases use Redis's clock; the node's wants fixing
        state += f" (clock {abs(offset):.1f} s {'behind' if offset > 0 else 'ahead of'} Redis)"
    return f"  {c['worker']}  gpu {gpu}  {state}{served}  {figures}"


def copies_text(copies: dict[str, int]) -> str:
    """A consumer's end-of-run copies (consumer/copies.py), or "" when it has made none."""
    sent, ended = copies.get("sent", 0), copies.get("ended_elsewhere", 0)
    if not sent and not ended:
        return ""
    return (f"copies: {sent:,} sent ({copies.get('shipped', 0):,} written, {copies.get('dropped', 0):,} failed, "
            f"{copies.get('yielded', 0):,} gave way), {ended:,} of its own items ended by others")


def engine_text(e: EngineRow) -> str:
    """What a consumer's engine says of itself (its /metrics), on the consumer's line."""
    # without a reading of its /metrics nothing says whether the engine speculates: "-", never
    # "off" beside a speculation section whose figures came from this engine's answers
    # whether it speculates, not a figure: the engine's acceptance is the doctor's note below, the
    # run's and each consumer's the speculation section's (one figure per scope, each named)
    spec = "-" if not e.get("metrics") else "on" if e.get("spec_decode") else "off"
    run_wait = f"{num(e.get('running'), 0)}/{num(e.get('waiting'), 0)}" if e.get("metrics") else "no /metrics"
    models = ", ".join(f"{m} (max len {(e.get('max_model_len') or {}).get(m) or '?'})"
                       for m in (e.get("models") or [])) or "?"
    shown = "".join(f"  {r.status[0]} {_shown(e.get(r.key), r.status[1])}" for r in ENGINE_READINGS if r.status)
    return f"engine {run_wait}{shown}  spec {spec}  model {models}"


def _shown(v: object, form: Shown) -> str:
    """A reading on the engine line (common.contracts.ENGINE_READINGS): "-" without one."""
    if not isinstance(v, int | float) or isinstance(v, bool):
        return "-"
    return f"{100 * v:.0f}%" if form == Shown.PERCENT else f"{v:.0f}"


# --- shipping ----------------------------------------------------------------------------
def shipping_view(shares: list[tuple[ConsumerReport, ShareShipping]], now: float, *,
                  live: set[str] | None = None) -> ShippingSummary:
    """What the consumers of a run say about shipping its shards, summed over each one's share
    of the run (consumer, its run's shipping): shards and bytes shipped, shards waiting on local
    disk and for how long, and each consumer's last error (redacted). LIVE: the workers whose
    spools count (None: all); a consumer that stopped took its spool's figures with it (one
    restarted on the same spool reports what is left of them), while what it shipped stays."""
    ships = [(c.get("worker", "?"), s) for c, s in shares]
    uploads = [t for _, s in ships if (t := s.get("last_upload_at"))]
    spools = [(w, s) for w, s in ships if live is None or w in live]
    oldest = [t for _, s in spools if (t := s.get("oldest_waiting_at")) and s.get("waiting_shards")]
    waited = max(0.0, now - min(oldest)) if oldest else None
    errors: list[ShippingError] = []
    for c, _ in shares:
        s = c.get("shipping")
        if not s or not s.get("last_error"):
            continue
        cls, message = _split_error(s["last_error"])
        at = s.get("last_error_at")
        errors.append({"worker": c.get("worker", "?"), "class": cls, "message": redact(message), "at": at,
                       "age_s": max(0.0, now - at) if at else None})
    return {
        "shards": sum(int(s.get("shards", 0)) for _, s in ships),
        "bytes": sum(int(s.get("bytes", 0)) for _, s in ships),
        "waiting_shards": sum(int(s.get("waiting_shards", 0)) for _, s in spools),
        "unshipped_records": sum(int(s.get("unshipped_records", 0) or 0) for _, s in spools),
        "last_upload_at": max(uploads) if uploads else None,
        "oldest_waiting_s": waited,
        "warn_after_s": SHIP_WAIT_WARN,
        "stalled": waited is not None and waited > SHIP_WAIT_WARN,
        "errors": errors,
    }


def _split_error(raw: object) -> tuple[str, str]:
    """(class, message) of a consumer's last shipping error: `{"class"|"type", "message"}`, or
    the text `<ExceptionName>: <message>` that consumers published first."""
    if isinstance(raw, dict):
        return str(raw.get("class") or raw.get("type") or "error"), str(raw.get("message") or "")
    text = str(raw)
    head, sep, tail = text.partition(": ")
    return (head, tail) if sep and head.isidentifier() else ("error", text)


def _redact_error(raw: object) -> object:
    """RAW (a text, or a dict with a message) with its secrets masked, in the same shape."""
    if isinstance(raw, dict):
        return {**raw, "message": redact(str(raw.get("message") or ""))}
    return redact(str(raw))


# --- small helpers -----------------------------------------------------------------------
def _use_color() -> bool:
    return sys.stdout.isatty() and not os.environ.get("NO_COLOR")


def _red(line: str, on: bool) -> str:
    return click.style(line, fg="red") if on else line
