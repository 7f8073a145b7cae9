"""A run's state, read from Redis: genqueue's bookkeeping plus rq's own registries."""

from __future__ import annotations

from typing import Any

import redis

from common.jobs import queue_for
from common.runs import RunStore, run_key


def run_status(conn: redis.Redis, run: str) -> dict[str, Any]:
    """Everything `producer status` shows about RUN, as plain data."""
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
    return {
        "run": run,
        "fingerprint": info.fingerprint,
        "settings": info.settings.to_dict(),
        "created_at": info.created_at,
        "records": records,
        "rejected": sum(rejected.values()),
        "rejected_by_reason": dict(sorted(rejected.items())),
        "items": store.item_count(run),
        "items_done": stats.get("items_done", 0),
        "items_failed": stats.get("items_failed", 0),
        "items_truncated": stats.get("items_truncated", 0),
        "completion_tokens": stats.get("completion_tokens", 0),
        "outcomes": {k[len("outcome_"):]: v for k, v in sorted(stats.items()) if k.startswith("outcome_")},
        "failed_by_class": {k[len("failed_"):]: v for k, v in sorted(stats.items()) if k.startswith("failed_")},
        "warnings": {k.decode(): v.decode() for k, v in conn.hgetall(run_key(run, "warnings")).items()},
        "prompt_tokens": stats.get("prompt_tokens", 0),
        # Raw counts: rq's registry.count also cleans the registry, which a status read must not do.
        "jobs": {
            "queued": conn.llen(q.key),
            "started": conn.zcard(q.started_job_registry.key),
            "finished": conn.zcard(q.finished_job_registry.key),
            "failed": conn.zcard(q.failed_job_registry.key),
        },
        "queue": q.name,
    }


def format_status(r: dict[str, Any]) -> str:
    """A human view of run_status()."""
    jobs = r["jobs"]
    items = r["items"] or 0
    done = r["items_done"] + r["items_failed"]
    pct = f"{100.0 * done / items:.1f}%" if items else "-"
    rows = [
        ("run", f"{r['run']}  (queue {r['queue']}, fingerprint {r['fingerprint']})"),
        ("model", r["settings"].get("model") or "(whatever the endpoints serve)"),
        ("mode", r["settings"].get("multi_turn")),
        ("output", r["settings"].get("output")),
        ("records read", f"{r['records']:,}  (rejected {r['rejected']:,})"),
        ("items", f"{items:,}  done {r['items_done']:,}, failed {r['items_failed']:,}  ({pct})"),
        ("jobs", f"queued {jobs['queued']:,}, in flight {jobs['started']:,}, "
                 f"finished {jobs['finished']:,}, failed {jobs['failed']:,}"),
        ("tokens", f"prompt {r['prompt_tokens']:,}, completion {r['completion_tokens']:,}"),
    ]
    if r["outcomes"]:
        rows.append(("outcomes", ", ".join(f"{k} {v:,}" for k, v in r["outcomes"].items())))
    if r["failed_by_class"]:
        rows.append(("failed by class", ", ".join(f"{k} {v:,}" for k, v in r["failed_by_class"].items())))
    rows += [(f"  rejected: {k}", f"{v:,}") for k, v in r["rejected_by_reason"].items()]
    rows += [("WARNING", msg) for msg in sorted(set(r["warnings"].values()))]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k.ljust(width)}  {v}" for k, v in rows)
