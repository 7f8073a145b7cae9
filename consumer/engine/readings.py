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
SPEC_DRAFTS = ("vllm:spec_decode_num_drafts_total",)
PREFIX_QUERIES = ("vllm:prefix_cache_queries_total",)
PREFIX_HITS = ("vllm:prefix_cache_hits_total",)
PROMPT_TOKENS = ("vllm:prompt_tokens_total",)
GENERATION_TOKENS = ("vllm:generation_tokens_total",)
CACHE_CONFIG = "vllm:cache_config_info"
_LABEL = re.compile(r'(\w+)="([^"]*)"')


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


def cache_config(text: str) -> dict[str, str]:
    """The labels of vllm:cache_config_info (block_size, num_gpu_blocks, enable_prefix_caching...)."""
    for line in text.splitlines():
        if line.startswith(CACHE_CONFIG + "{"):
            m = _LINE.match(line)
            if m is not None and m["labels"]:
                return dict(_LABEL.findall(m["labels"]))
    return {}


def _int(v: str | None) -> int | None:
    try:
        return int(v) if v is not None else None
    except ValueError:  # "None" when vLLM has not sized the cache
        return None


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
    cfg = cache_config(text)
    accepted, drafted = _first(m, SPEC_ACCEPTED), _first(m, SPEC_DRAFT)
    return {
        "metrics": True,
        "running": _first(m, RUNNING),
        "waiting": _first(m, WAITING),
        "kv_cache_usage": _first(m, KV_CACHE),
        "preemptions": _first(m, PREEMPTIONS),
        "spec_decode": drafted is not None,
        "spec_acceptance": (accepted / drafted) if accepted is not None and drafted else None,
        "spec_drafts": _first(m, SPEC_DRAFTS),
        "spec_draft_tokens": drafted,
        "spec_accepted_tokens": accepted,
        "prefix_queries": _first(m, PREFIX_QUERIES),
        "prefix_hits": _first(m, PREFIX_HITS),
        "prompt_tokens": _first(m, PROMPT_TOKENS),
        "generation_tokens": _first(m, GENERATION_TOKENS),
        "block_size": _int(cfg.get("block_size")),
        "num_gpu_blocks": _int(cfg.get("num_gpu_blocks")),
        "prefix_caching": (cfg["enable_prefix_caching"].lower() == "true"
                           if "enable_prefix_caching" in cfg else None),
    }
