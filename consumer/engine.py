"""What a vLLM engine says about itself in /metrics (pure parsing, no I/O)."""

from __future__ import annotations

import re

from genqueue.common.contracts import EngineView

_LINE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>[^}]*)\})?\s+(?P<value>\S+)")

#: metric names across vLLM versions (the KV-cache gauge was gpu_cache_usage_perc before v1)
RUNNING = ("vllm:num_requests_running",)
WAITING = ("vllm:num_requests_waiting",)
KV_CACHE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
SPEC_ACCEPTED = ("vllm:spec_decode_num_accepted_tokens_total",)
SPEC_DRAFT = ("vllm:spec_decode_num_draft_tokens_total",)
PREEMPTIONS = ("vllm:num_preemptions_total",)


#: Gauges that are fractions per engine: a data-parallel vLLM reports one series per engine
#: replica (engine="0", "1"...), and their sum would exceed 1; the fullest replica is shown.
_MAX_OVER_SERIES = frozenset(KV_CACHE)


def parse_prometheus(text: str) -> dict[str, float]:
    """Each metric's samples summed over its label sets (requests running and waiting add up
    over a data-parallel engine's replicas), or their max for a fraction such as KV-cache use."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        m = _LINE.match(line)
        if m is None:
            continue
        try:
            v = float(m["value"])
        except ValueError:
            continue
        name = m["name"]
        if name in _MAX_OVER_SERIES:
            out[name] = max(out.get(name, v), v)
        else:
            out[name] = out.get(name, 0.0) + v
    return out


def _first(metrics: dict[str, float], names: tuple[str, ...]) -> float | None:
    for n in names:
        if n in metrics:
            return metrics[n]
    return None


def engine_view(text: str | None) -> EngineView:
    """The few numbers an operator asks about: is the batch full, is speculation working."""
    if not text:
        return {"metrics": False}
    m = parse_prometheus(text)
    accepted, drafted = _first(m, SPEC_ACCEPTED), _first(m, SPEC_DRAFT)
    return {
        "metrics": True,
        "running": _first(m, RUNNING),
        "waiting": _first(m, WAITING),
        "kv_cache_usage": _first(m, KV_CACHE),
        "preemptions": _first(m, PREEMPTIONS),
        "spec_decode": drafted is not None,
        "spec_acceptance": (accepted / drafted) if accepted is not None and drafted else None,
    }
