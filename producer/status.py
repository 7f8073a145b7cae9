"""A run's state, read from Redis: genqueue's bookkeeping, rq's registries, and what every
consumer last reported (rates, in flight, shipping, its engine's own metrics).

Progress comes from the done marks the consumers write when a shard ships (common/marks.py):
an item is done iff a shipped shard holds its result, failed iff one holds only an error record
for it, of the items in the run's keys set; rates and the tokens per item the ETA assumes come
from the consumers' counters. A paused run (common/pause.py) is said on the first line, in red.
A run whose settings were changed (`producer enqueue --update-settings`) shows every fingerprint
it has had.

Shipping trouble is shown where it is felt: each consumer's last shipping error (its class,
message and age) under the shipping line, and the line turns red (on a terminal) once a shard
has waited longer than defaults.SHIP_WAIT_WARN: results that sit on a GPU node's disk are not
durable yet, and their jobs are not acked. Every free text a consumer or rq reported passes
through genqueue.common.redact before it is shown or printed as JSON.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import click
import orjson
import redis

from genqueue.common import defaults
from genqueue.common.contracts import ErrorClass, Outcome
from genqueue.common.eta import eta_seconds, format_duration
from genqueue.common.marks import done_key, failed_key
from genqueue.common.pause import run_pause
from genqueue.common.redact import redact
from genqueue.common.rqaccess import job_counts, queue_name, refused_jobs
from genqueue.common.rqjobs import malformed_line, refused_line, scan_jobs
from genqueue.common.runs import CONSUMERS, RunStore, consumer_key, run_key

#: A consumer that has not reported for this long is flagged as having stopped reporting.
STALE_AFTER = 15.0


def consumers(conn: redis.Redis, now: float) -> list[dict[str, Any]]:
    """Every consumer's last snapshot (the last day's), with `live` set."""
    names = [_text(n) for n in conn.zrangebyscore(CONSUMERS, now - 86400, "+inf")]
    if not names:
        return []
    out = []
    for raw in conn.mget([consumer_key(n) for n in names]):
        if raw is None:
            continue
        try:
            snap = orjson.loads(raw)
        except orjson.JSONDecodeError:
            continue
        if not _is_snapshot(snap):  # not a consumer's snapshot (garbage under its key): nothing to show
            continue
        snap["age_s"] = max(0.0, now - float(snap.get("last_seen", 0.0)))
        snap["live"] = snap["age_s"] <= STALE_AFTER and not snap.get("exited")
        out.append(snap)
    return out


def _is_snapshot(snap: Any) -> bool:
    """Whether SNAP has the shape of a ConsumerSnapshot where status reads it without a default."""
    if not isinstance(snap, dict) or not isinstance(snap.get("worker"), str):
        return False
    runs, seen = snap.get("runs", {}), snap.get("last_seen", 0.0)
    if not isinstance(runs, dict) or not all(isinstance(r, dict) for r in runs.values()):
        return False
    if not isinstance(seen, int | float) or isinstance(seen, bool):
        return False
    return all(isinstance(snap.get(k, {}), dict) for k in ("engine", "paused", "shipping", "jobs"))


def run_status(conn: redis.Redis, run: str, now: float | None = None) -> dict[str, Any]:
    """Everything `producer status` shows about RUN, as plain data."""
    now = time.time() if now is None else now
    store = RunStore(conn)
    info = store.require(run)
    sources = store.sources(run)
    rejected: dict[str, int] = {}
    records = 0
    for s in sources.values():
        records += s.get("records", 0)
        for reason, n in s.get("rejected_by_reason", {}).items():
            rejected[reason] = rejected.get(reason, 0) + n
    stats = store.stats(run)
    items, done, failed = progress(conn, run)
    pause = run_pause(conn, run)
    scan = scan_jobs(conn, run)  # what rq needs to load each job: no payload is moved at every poll
    refused = {k: redact(v) for k, v in refused_jobs(conn, run).items()}
    raw_started = conn.hget(run_key(run), "started_at")
    started_at = float(_text(raw_started)) if raw_started else None

    everyone = consumers(conn, now)
    mine = [c for c in everyone if run in c.get("runs", {})]
    live = [c for c in mine if c["live"]]
    in_flight = sum(c.get("in_flight", 0) + c.get("pending_items", 0) for c in live)
    recent = {
        k: sum(c["runs"][run].get(k, 0.0) for c in live)
        for k in ("completions_per_s", "prompt_tokens_per_s", "completion_tokens_per_s")
    }
    elapsed = now - started_at if started_at else None
    remaining = max(items - done - failed, 0)
    # tokens per item from the counters that go with the tokens (marks may be rebuilt, counters not)
    eta = eta_seconds(remaining, stats.get("items_done", 0), stats.get("completion_tokens", 0),
                      recent["completion_tokens_per_s"])
    answered = stats.get("items_done", 0) + stats.get("items_failed", 0)
    versions = sorted({c.get("version", "?") for c in live})
    drift = []
    for c in live:
        fp = c["runs"][run].get("fingerprint")
        if fp and fp != info.fingerprint:
            drift.append(f"{c['worker']} runs fingerprint {fp}, the run's is {info.fingerprint}")
        if c.get("version") != info.version:
            drift.append(f"{c['worker']} runs genqueue {c.get('version')}, the run was created by {info.version}")
    return {
        "run": run,
        "now": now,
        "paused": dict(pause) if pause is not None else None,
        "fingerprint": info.fingerprint,
        "fingerprints": [{"fingerprint": e["fingerprint"], "since": e["since"]} for e in info.fingerprints],
        "version": info.version,
        "settings": info.settings.to_dict(),
        "created_at": info.created_at,
        "started_at": started_at,
        "records": records,
        "rejected": sum(rejected.values()),
        "rejected_by_reason": dict(sorted(rejected.items())),
        "items": items,
        "items_done": done,
        "items_failed": failed,
        "items_truncated": stats.get("items_truncated", 0),
        "items_in_flight": in_flight,
        "items_queued": max(remaining - in_flight, 0),
        "completion_tokens": stats.get("completion_tokens", 0),
        "prompt_tokens": stats.get("prompt_tokens", 0),
        "outcomes": _by_name(stats, "outcome_", [o.value for o in Outcome]),
        "failed_by_class": _by_name(stats, "failed_", [c.value for c in ErrorClass]),
        "warnings": {_text(k): redact(_text(v)) for k, v in conn.hgetall(run_key(run, "warnings")).items()},
        "jobs": job_counts(conn, run),
        "malformed_jobs": [{**b, "reason": redact(b["reason"])} for b in scan.to_list()],
        "refused": len(refused),
        "refused_jobs": refused,
        "queue": queue_name(run),
        "speed": {
            "last_minute": recent,
            "run_average": {
                "completions_per_s": answered / elapsed if elapsed else 0.0,
                "completion_tokens_per_s": stats.get("completion_tokens", 0) / elapsed if elapsed else 0.0,
                "prompt_tokens_per_s": stats.get("prompt_tokens", 0) / elapsed if elapsed else 0.0,
            },
        },
        "eta_s": eta,
        "eta_assumes_completion_tokens_per_s": recent["completion_tokens_per_s"],
        "shipping": shipping_view(mine, now),
        "consumers": [_consumer_row(c, run) for c in mine],
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
    }


def hosts_view(snaps: list[dict[str, Any]], run: str) -> dict[str, dict[str, Any]]:
    """Which hosts ship RUN's results, and which refuse it: per host, its live consumers that
    serve the run and those that refuse it (with the first reason), from their snapshots."""
    out: dict[str, dict[str, Any]] = {}
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


def _hosts_line(hosts: dict[str, dict[str, Any]]) -> str:
    if not hosts:
        return "no live consumer serves or refuses this run"
    parts = []
    for host, h in hosts.items():
        bits = [f"{h['serving']} consumer(s) shipping"] if h["serving"] else []
        if h["refusing"]:
            bits.append(f"{h['refusing']} REFUSING: {_clip(h['reason'], 120)}")
        parts.append(f"{host}: " + ", ".join(bits))
    return "; ".join(parts)


def _consumer_row(c: dict[str, Any], run: str) -> dict[str, Any]:
    r = c["runs"][run]
    ship = dict(c.get("shipping") or {})
    if ship.get("last_error"):
        ship["last_error"] = _redact_error(ship["last_error"])
    return {
        "worker": c["worker"], "host": c.get("host"), "gpu": c.get("gpu"), "live": c["live"],
        "exited": bool(c.get("exited")),
        "age_s": round(c["age_s"], 1), "completions_per_s": r.get("completions_per_s", 0.0),
        "completion_tokens_per_s": r.get("completion_tokens_per_s", 0.0), "in_flight": c.get("in_flight", 0),
        "paused": [k for k, v in c.get("paused", {}).items() if v], "version": c.get("version"),
        "paused_detail": {k: redact(str(v)) for k, v in c.get("paused", {}).items() if v},
        "engine": {"models": c.get("models"), "max_model_len": c.get("max_model_len"), **c.get("engine", {})},
        "shipping": ship, "reasoning_probe": r.get("reasoning_probe"), "clock_offset": c.get("clock_offset"),
    }


def _bar(frac: float, width: int = 30) -> str:
    n = round(frac * width)
    return "[" + "#" * n + "." * (width - n) + "]"


def _f(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x:,.{digits}f}"


def format_status(r: dict[str, Any], *, color: bool | None = None) -> str:
    """A human view of run_status(): one screen that answers 'where are we'. COLOR: paint
    alarms red (default: when stdout is a terminal and NO_COLOR is not set)."""
    jobs, items = r["jobs"], r["items"] or 0
    finished = r["items_done"] + r["items_failed"]
    frac = finished / items if items else 0.0
    last, avg = r["speed"]["last_minute"], r["speed"]["run_average"]
    fps = r.get("fingerprints") or []
    rows: list[tuple[str, str]] = [
        ("run", f"{r['run']}  (queue {r['queue']}, fingerprint {r['fingerprint']}, genqueue {r['version']})"),
    ]
    if len(fps) > 1:
        rows.append(("fingerprints", f"{len(fps)} (settings updated): " + " -> ".join(
            f"{e['fingerprint']} ({time.strftime('%m-%d %H:%M', time.localtime(e['since']))})" for e in fps)))
    rows += [
        ("model", str(r["settings"].get("model") or "(whatever the endpoints serve)")),
        ("mode", f"{r['settings'].get('multi_turn')}, truncation {r['settings'].get('truncation')}"),
        ("output", redact(str(r["settings"].get("output")))
         + (f"  ({r['output_placement']['where']})" if r.get("output_placement") else "")),
        ("progress", f"{_bar(frac)} {100 * frac:.1f}%"),
        ("records read", f"{r['records']:,}  (rejected {r['rejected']:,})"),
        ("items", (f"{items:,}: queued {r['items_queued']:,}, in flight {r['items_in_flight']:,}, "
                  f"done {r['items_done']:,}, failed {r['items_failed']:,}, truncated {r['items_truncated']:,}")),
        ("jobs", (f"queued {jobs['queued']:,}, in flight {jobs['started']:,}, "
                 f"finished {jobs['finished']:,}, failed {jobs['failed']:,}")),
        ("priority", f"{r.get('priority', 0)}; share: {r['share']['in_flight']:,} of the {r['share']['of']:,} "
                     f"requests in flight on its {r['share']['consumers']} live consumer(s)"
                     + (f" ({100 * r['share']['in_flight'] / r['share']['of']:.0f}%)" if r['share']['of'] else "")
         if "share" in r else "0"),
        ("speed (1 min)", (f"{_f(last['completions_per_s'])} completions/s, "
                          f"{_f(last['completion_tokens_per_s'], 0)} completion tok/s, "
                          f"{_f(last['prompt_tokens_per_s'], 0)} prompt tok/s")),
        ("speed (run)", (f"{_f(avg['completions_per_s'])} completions/s, "
                        f"{_f(avg['completion_tokens_per_s'], 0)} completion tok/s")),
        ("ETA", (f"{format_duration(r['eta_s'])} (at {_f(r['eta_assumes_completion_tokens_per_s'], 0)} "
                "completion tok/s, the last minute's rate)")),
        ("tokens", f"prompt {r['prompt_tokens']:,}, completion {r['completion_tokens']:,}"),
    ]
    if r["outcomes"]:
        rows.append(("outcomes", ", ".join(f"{k} {v:,}" for k, v in r["outcomes"].items())))
    if r["failed_by_class"]:
        rows.append(("failed by class", ", ".join(f"{k} {v:,}" for k, v in r["failed_by_class"].items())))
    rows += [(f"  rejected: {k}", f"{v:,}") for k, v in r["rejected_by_reason"].items()]
    alarm: set[int] = set()
    if "hosts" in r:
        if any(h["refusing"] for h in r["hosts"].values()):
            alarm.add(len(rows))
        rows.append(("hosts", _hosts_line(r["hosts"])))
    ship = r["shipping"]
    if ship["stalled"]:
        alarm.add(len(rows))
    rows.append(("shipping", _shipping_line(ship, r["now"])))
    for e in ship["errors"]:
        if ship["stalled"]:
            alarm.add(len(rows))
        age = f" ({format_duration(e['age_s'])} ago)" if e["age_s"] is not None else ""
        rows.append((f"  {e['worker']}", f"last shipping error {e['class']}: {_clip(e['message'])}{age}"))
    width = max(len(k) for k, _ in rows)
    paint = _use_color() if color is None else color
    lines = [_red(f"{k.ljust(width)}  {v}", paint and i in alarm) for i, (k, v) in enumerate(rows)]
    if r.get("paused"):
        p = r["paused"]
        lines.insert(0, _red(f"PAUSED   {redact(p['reason'])}  (by {p['by']}, {format_duration(r['now'] - p['at'])} "
                             f"ago; no consumer takes its jobs until `producer resume --run {r['run']}`)", paint))
    lines.append("")
    lines.append("consumers  (worker, gpu, state, completions/s, completion tok/s, in flight, engine running/waiting"
                 ", KV cache, spec-decode acceptance)")
    if not r["consumers"]:
        lines.append("  none has reported for this run")
    for c in r["consumers"]:
        e = c["engine"]
        if c["live"]:
            state = "live"
        elif c["exited"]:
            state = f"exited {format_duration(c['age_s'])} ago"
        else:
            state = f"STOPPED REPORTING {format_duration(c['age_s'])} ago"
        if c["paused"]:
            state += " (paused: " + ", ".join(c["paused"]) + ")"
        if abs(c["clock_offset"] or 0.0) > 1.0:  # leases use Redis's clock; the node's wants fixing
            state += f" (clock {abs(c['clock_offset']):.1f} s {'behind' if c['clock_offset'] > 0 else 'ahead of'} Redis)"
        kv = "-" if e.get("kv_cache_usage") is None else f"{100 * e['kv_cache_usage']:.0f}%"
        spec = "off" if not e.get("spec_decode") else _f(e.get("spec_acceptance"), 2)
        run_wait = f"{_f(e.get('running'), 0)}/{_f(e.get('waiting'), 0)}" if e.get("metrics") else "no /metrics"
        models = ", ".join(f"{m} (max len {(e.get('max_model_len') or {}).get(m) or '?'})"
                           for m in (e.get("models") or [])) or "?"
        lines.append(f"  {c['worker']}  gpu {c['gpu'] if c['gpu'] is not None else '-'}  {state}  "
                     f"{c['completions_per_s']:.1f}/s  {c['completion_tokens_per_s']:,.0f} tok/s  "
                     f"in flight {c['in_flight']}  engine {run_wait}  KV {kv}  spec {spec}  model {models}")
        if e.get("advice"):  # the engine doctor's verdict (consumer/doctor.py), with its notes
            lines.append(f"    engine: {e['advice']}" + "".join(f"; {n}" for n in e.get("notes") or []))
    for d in r["drift"]:
        lines.append(f"DRIFT    {d}")
    if r.get("malformed_jobs"):
        lines.append(f"JOBS     {malformed_line(r['malformed_jobs'], 'in the queue or registries')}")
    if r.get("refused_jobs"):
        lines.append(f"REFUSED  {refused_line(r['refused_jobs'], r['run'])}")
    for msg in sorted(set(r["warnings"].values())):
        lines.append(f"WARNING  {msg}")
    return "\n".join(lines)


# --- shipping ----------------------------------------------------------------------------
def shipping_view(snaps: list[dict[str, Any]], now: float) -> dict[str, Any]:
    """What the consumers of a run say about shipping, summed: shards and bytes shipped, shards
    waiting on local disk and for how long, and each consumer's last error (redacted)."""
    ships = [(c.get("worker", "?"), c.get("shipping") or {}) for c in snaps]
    uploads = [s["last_upload_at"] for _, s in ships if s.get("last_upload_at")]
    oldest = [s["oldest_waiting_at"] for _, s in ships if s.get("oldest_waiting_at") and s.get("waiting_shards")]
    waited = max(0.0, now - min(oldest)) if oldest else None
    errors = []
    for worker, s in ships:
        if not s.get("last_error"):
            continue
        cls, message = _split_error(s["last_error"])
        at = s.get("last_error_at")
        errors.append({"worker": worker, "class": cls, "message": redact(message), "at": at,
                       "age_s": max(0.0, now - at) if at else None})
    return {
        "shards": sum(int(s.get("shards", 0)) for _, s in ships),
        "bytes": sum(int(s.get("bytes", 0)) for _, s in ships),
        "waiting_shards": sum(int(s.get("waiting_shards", 0)) for _, s in ships),
        "last_upload_at": max(uploads) if uploads else None,
        "oldest_waiting_s": waited,
        "warn_after_s": defaults.SHIP_WAIT_WARN,
        "stalled": waited is not None and waited > defaults.SHIP_WAIT_WARN,
        "errors": errors,
    }


def _shipping_line(ship: dict[str, Any], now: float) -> str:
    line = f"{ship['shards']:,} shards, {ship['bytes'] / 1e6:,.1f} MB shipped, {ship['waiting_shards']} waiting on disk"
    if ship["oldest_waiting_s"] is not None:
        line += f" (oldest {format_duration(ship['oldest_waiting_s'])})"
    last = ship["last_upload_at"]
    line += f", last upload {format_duration(now - last)} ago" if last else ", no upload yet"
    if ship["stalled"]:
        line += f"  STALLED: shards waiting over {format_duration(ship['warn_after_s'])}"
    return line


def _split_error(raw: Any) -> tuple[str, str]:
    """(class, message) of a consumer's last shipping error: `{"class"|"type", "message"}`, or
    the text `<ExceptionName>: <message>` that consumers published first."""
    if isinstance(raw, dict):
        return str(raw.get("class") or raw.get("type") or "error"), str(raw.get("message") or "")
    text = str(raw)
    head, sep, tail = text.partition(": ")
    return (head, tail) if sep and head.isidentifier() else ("error", text)


def _redact_error(raw: Any) -> Any:
    """RAW (a text, or a dict with a message) with its secrets masked, in the same shape."""
    if isinstance(raw, dict):
        return {**raw, "message": redact(str(raw.get("message") or ""))}
    return redact(str(raw))


def _clip(text: str, limit: int = 200) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def progress(conn: redis.Redis, run: str) -> tuple[int, int, int]:
    """(items, done, failed) of RUN from its keys set and marks, one round trip: failed counts
    the items with an error record and no result."""
    with conn.pipeline(transaction=False) as p:
        p.scard(run_key(run, "keys"))
        p.scard(done_key(run))
        p.scard(failed_key(run))
        p.sintercard(2, [failed_key(run), done_key(run)])
        items, done, failed, both = p.execute(raise_on_error=False)
    if isinstance(both, Exception):  # Redis before 7.0: no SINTERCARD
        both = 0
    return int(items), int(done), max(int(failed) - int(both), 0)


# --- small helpers -----------------------------------------------------------------------
def _use_color() -> bool:
    return sys.stdout.isatty() and not os.environ.get("NO_COLOR")


def _red(line: str, on: bool) -> str:
    return click.style(line, fg="red") if on else line


def _by_name(stats: dict[str, int], prefix: str, known: list[str]) -> dict[str, int]:
    """Counters named PREFIX<name>: the KNOWN names in their order, then any others sorted."""
    found = {k[len(prefix):]: v for k, v in stats.items() if k.startswith(prefix)}
    ordered = {n: found[n] for n in known if n in found}
    ordered.update(sorted((n, v) for n, v in found.items() if n not in ordered))
    return ordered


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
