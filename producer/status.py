"""A run's state, read from Redis: genqueue's bookkeeping, rq's registries, and what every
consumer last reported (rates, in flight, shipping, its engine's own metrics)."""

from __future__ import annotations

import time
from typing import Any

import orjson
import redis

from genqueue.common.eta import eta_seconds, format_duration
from genqueue.common.jobs import queue_for
from genqueue.common.runs import CONSUMERS, RunStore, consumer_key, run_key

#: A consumer that has not reported for this long is flagged as having stopped reporting.
STALE_AFTER = 15.0


def consumers(conn: redis.Redis, now: float) -> list[dict[str, Any]]:
    """Every consumer's last snapshot (the last day's), with `live` set."""
    names = [n.decode() for n in conn.zrangebyscore(CONSUMERS, now - 86400, "+inf")]
    if not names:
        return []
    out = []
    for raw in conn.mget([consumer_key(n) for n in names]):
        if raw is None:
            continue
        snap = orjson.loads(raw)
        snap["age_s"] = max(0.0, now - snap.get("last_seen", 0.0))
        snap["live"] = snap["age_s"] <= STALE_AFTER and not snap.get("exited")
        out.append(snap)
    return out


def run_status(conn: redis.Redis, run: str, now: float | None = None) -> dict[str, Any]:
    """Everything `producer status` shows about RUN, as plain data."""
    now = time.time() if now is None else now
    store = RunStore(conn)
    info = store.require(run)
    q = queue_for(run, conn)
    sources = store.sources(run)
    rejected: dict[str, int] = {}
    records = 0
    for s in sources.values():
        records += s.get("records", 0)
        for reason, n in s.get("rejected_by_reason", {}).items():
            rejected[reason] = rejected.get(reason, 0) + n
    stats = store.stats(run)
    items = store.item_count(run)
    done, failed = stats.get("items_done", 0), stats.get("items_failed", 0)
    started_at = conn.hget(run_key(run), "started_at")

    mine = [c for c in consumers(conn, now) if run in c.get("runs", {})]
    live = [c for c in mine if c["live"]]
    in_flight = sum(c.get("in_flight", 0) + c.get("pending_items", 0) for c in live)
    recent = {
        k: sum(c["runs"][run].get(k, 0.0) for c in live)
        for k in ("completions_per_s", "prompt_tokens_per_s", "completion_tokens_per_s")
    }
    elapsed = now - float(started_at) if started_at else None
    remaining = max(items - done - failed, 0)
    eta = eta_seconds(remaining, done, stats.get("completion_tokens", 0), recent["completion_tokens_per_s"])
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
        "fingerprint": info.fingerprint,
        "version": info.version,
        "settings": info.settings.to_dict(),
        "created_at": info.created_at,
        "started_at": float(started_at) if started_at else None,
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
        "outcomes": {k[len("outcome_"):]: v for k, v in sorted(stats.items()) if k.startswith("outcome_")},
        "failed_by_class": {k[len("failed_"):]: v for k, v in sorted(stats.items()) if k.startswith("failed_")},
        "warnings": {k.decode(): v.decode() for k, v in conn.hgetall(run_key(run, "warnings")).items()},
        # Raw counts: rq's registry.count also cleans the registry, which a status read must not do.
        "jobs": {
            "queued": conn.llen(q.key),
            "dequeuing": conn.llen(q.intermediate_queue_key),
            "started": conn.zcard(q.started_job_registry.key),
            "finished": conn.zcard(q.finished_job_registry.key),
            "failed": conn.zcard(q.failed_job_registry.key),
        },
        "queue": q.name,
        "speed": {
            "last_minute": recent,
            "run_average": {
                "completions_per_s": (done + failed) / elapsed if elapsed else 0.0,
                "completion_tokens_per_s": stats.get("completion_tokens", 0) / elapsed if elapsed else 0.0,
                "prompt_tokens_per_s": stats.get("prompt_tokens", 0) / elapsed if elapsed else 0.0,
            },
        },
        "eta_s": eta,
        "eta_assumes_completion_tokens_per_s": recent["completion_tokens_per_s"],
        "consumers": [_consumer_row(c, run) for c in mine],
        "versions": versions,
        "drift": drift,
    }


def _consumer_row(c: dict[str, Any], run: str) -> dict[str, Any]:
    r = c["runs"][run]
    ship = c.get("shipping", {})
    return {
        "worker": c["worker"], "host": c.get("host"), "gpu": c.get("gpu"), "live": c["live"],
        "exited": bool(c.get("exited")),
        "age_s": round(c["age_s"], 1), "completions_per_s": r.get("completions_per_s", 0.0),
        "completion_tokens_per_s": r.get("completion_tokens_per_s", 0.0), "in_flight": c.get("in_flight", 0),
        "paused": [k for k, v in c.get("paused", {}).items() if v], "version": c.get("version"),
        "engine": {"models": c.get("models"), "max_model_len": c.get("max_model_len"), **c.get("engine", {})},
        "shipping": ship, "reasoning_probe": r.get("reasoning_probe"),
    }


def _bar(frac: float, width: int = 30) -> str:
    n = int(round(frac * width))
    return "[" + "#" * n + "." * (width - n) + "]"


def _f(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x:,.{digits}f}"


def format_status(r: dict[str, Any]) -> str:
    """A human view of run_status(): one screen that answers 'where are we'."""
    jobs, items = r["jobs"], r["items"] or 0
    finished = r["items_done"] + r["items_failed"]
    frac = finished / items if items else 0.0
    last, avg = r["speed"]["last_minute"], r["speed"]["run_average"]
    rows: list[tuple[str, str]] = [
        ("run", f"{r['run']}  (queue {r['queue']}, fingerprint {r['fingerprint']}, genqueue {r['version']})"),
        ("model", str(r["settings"].get("model") or "(whatever the endpoints serve)")),
        ("mode", f"{r['settings'].get('multi_turn')}, truncation {r['settings'].get('truncation')}"),
        ("output", str(r["settings"].get("output"))),
        ("progress", f"{_bar(frac)} {100 * frac:.1f}%"),
        ("records read", f"{r['records']:,}  (rejected {r['rejected']:,})"),
        ("items", f"{items:,}: queued {r['items_queued']:,}, in flight {r['items_in_flight']:,}, "
                  f"done {r['items_done']:,}, failed {r['items_failed']:,}, truncated {r['items_truncated']:,}"),
        ("jobs", f"queued {jobs['queued']:,}, in flight {jobs['started']:,}, "
                 f"finished {jobs['finished']:,}, failed {jobs['failed']:,}"),
        ("speed (1 min)", f"{_f(last['completions_per_s'])} completions/s, "
                          f"{_f(last['completion_tokens_per_s'], 0)} completion tok/s, "
                          f"{_f(last['prompt_tokens_per_s'], 0)} prompt tok/s"),
        ("speed (run)", f"{_f(avg['completions_per_s'])} completions/s, "
                        f"{_f(avg['completion_tokens_per_s'], 0)} completion tok/s"),
        ("ETA", f"{format_duration(r['eta_s'])} (at {_f(r['eta_assumes_completion_tokens_per_s'], 0)} "
                "completion tok/s, the last minute's rate)"),
        ("tokens", f"prompt {r['prompt_tokens']:,}, completion {r['completion_tokens']:,}"),
    ]
    if r["outcomes"]:
        rows.append(("outcomes", ", ".join(f"{k} {v:,}" for k, v in r["outcomes"].items())))
    if r["failed_by_class"]:
        rows.append(("failed by class", ", ".join(f"{k} {v:,}" for k, v in r["failed_by_class"].items())))
    rows += [(f"  rejected: {k}", f"{v:,}") for k, v in r["rejected_by_reason"].items()]
    shards = sum(c["shipping"].get("shards", 0) for c in r["consumers"])
    sbytes = sum(c["shipping"].get("bytes", 0) for c in r["consumers"])
    waiting = sum(c["shipping"].get("waiting_shards", 0) for c in r["consumers"])
    uploads = [c["shipping"].get("last_upload_at") for c in r["consumers"] if c["shipping"].get("last_upload_at")]
    ago = f", last upload {format_duration(r['now'] - max(uploads))} ago" if uploads else ", no upload yet"
    rows.append(("shipping", f"{shards:,} shards, {sbytes / 1e6:,.1f} MB shipped, {waiting} waiting on disk{ago}"))
    width = max(len(k) for k, _ in rows)
    lines = [f"{k.ljust(width)}  {v}" for k, v in rows]
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
        kv = "-" if e.get("kv_cache_usage") is None else f"{100 * e['kv_cache_usage']:.0f}%"
        spec = "off" if not e.get("spec_decode") else _f(e.get("spec_acceptance"), 2)
        run_wait = f"{_f(e.get('running'), 0)}/{_f(e.get('waiting'), 0)}" if e.get("metrics") else "no /metrics"
        models = ", ".join(f"{m} (max len {(e.get('max_model_len') or {}).get(m) or '?'})"
                           for m in (e.get("models") or [])) or "?"
        lines.append(f"  {c['worker']}  gpu {c['gpu'] if c['gpu'] is not None else '-'}  {state}  "
                     f"{c['completions_per_s']:.1f}/s  {c['completion_tokens_per_s']:,.0f} tok/s  "
                     f"in flight {c['in_flight']}  engine {run_wait}  KV {kv}  spec {spec}  model {models}")
    for d in r["drift"]:
        lines.append(f"DRIFT    {d}")
    for msg in sorted(set(r["warnings"].values())):
        lines.append(f"WARNING  {msg}")
    return "\n".join(lines)
