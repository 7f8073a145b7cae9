"""What a vLLM engine says about itself in /metrics (pure parsing, no I/O).

What is read, under which names and how, is common.contracts.ENGINE_READINGS: a reading added
there is parsed here, exported by the consumer and shown by `producer status` with no change
to this module."""

from __future__ import annotations

import re
from typing import cast

from genqueue.common.engineview import CACHE_CONFIG_INFO, ENGINE_READINGS, EngineView, ReadingKind

_LINE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>[^}]*)\})?\s+(?P<value>\S+)")
CACHE_CONFIG = CACHE_CONFIG_INFO
_LABEL = re.compile(r'(\w+)="([^"]*)"')


#: Gauges that are fractions per engine: a data-parallel vLLM reports one series per engine
#: replica (engine="0", "1"...), and their sum would exceed 1; the fullest replica is shown.
_MAX_OVER_SERIES = frozenset(n for r in ENGINE_READINGS if r.kind == ReadingKind.FRACTION for n in r.names)
#: EngineView's fields in their declared order: the view is written in it, as before the table
_ORDER = tuple(EngineView.__annotations__)


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


def _label(cfg: dict[str, str], names: tuple[str, ...]) -> str | None:
    return next((cfg[n] for n in names if n in cfg), None)


def engine_view(text: str | None) -> EngineView:
    """The few numbers an operator asks about: is the batch full, is speculation working."""
    if not text:
        return {"metrics": False}
    m = parse_prometheus(text)
    cfg = cache_config(text)
    out: dict[str, object] = {"metrics": True}
    for r in ENGINE_READINGS:
        if r.kind == ReadingKind.CONFIG_INT:
            out[r.key] = _int(_label(cfg, r.names))
        elif r.kind == ReadingKind.CONFIG_BOOL:
            raw = _label(cfg, r.names)
            out[r.key] = raw.lower() == "true" if raw is not None else None
        else:
            out[r.key] = _first(m, r.names)
    # derived: speculation is on when the engine counts draft tokens
    accepted, drafted = out["spec_accepted_tokens"], out["spec_draft_tokens"]
    out["spec_decode"] = drafted is not None
    out["spec_acceptance"] = (accepted / drafted if isinstance(accepted, float) and isinstance(drafted, float)
                              and drafted else None)
    return cast(EngineView, {k: out[k] for k in _ORDER if k in out})
