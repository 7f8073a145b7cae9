"""Whether an engine can capture a model's hidden states, judged from the model's own config.json
before the engine spends any GPU time on it (`consumer launch`, before it starts vLLM; the
consumer's pre-flight, before its capture probe, where the model's folder is on its node).

vLLM's extract_hidden_states keeps the captured layers in a KV-cache group of their own, whose
spec is a kind of MLA spec: beside an MLA verifier (DeepSeek-V2/V3 style attention, a
`kv_lora_rank` in the config) the connector cannot tell the groups apart and refuses to start
("MLA verifiers are unsupported"). A layer id past the model's layer count L names no layer
(ids run from 0, the embeddings, to L, the last decoder layer before the final norm).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

#: The vLLM flag that starts capture (its method names it).
SPECULATIVE_FLAG = "--speculative-config"
CAPTURE_METHOD = "extract_hidden_states"


def flag_value(argv: Sequence[str], flag: str) -> str | None:
    """The value of FLAG in ARGV (`--flag value` or `--flag=value`; the last one given wins)."""
    found = None
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            found = argv[i + 1]
        elif arg.startswith(flag + "="):
            found = arg[len(flag) + 1:]
    return found


def speculative_config(argv: Sequence[str]) -> dict[str, Any] | None:
    """The --speculative-config ARGV gives vLLM, parsed; None when absent or not a JSON object
    (vLLM itself refuses that at its start)."""
    raw = flag_value(argv, SPECULATIVE_FLAG)
    try:
        parsed = json.loads(raw) if raw is not None else None
    except ValueError:
        return None
    return parsed if isinstance(parsed, dict) else None


def captured_layers(argv: Sequence[str]) -> tuple[int, ...] | None:
    """The layer ids an engine started with ARGV captures; None when it does not capture."""
    spec = speculative_config(argv)
    if spec is None or spec.get("method") != CAPTURE_METHOD:
        return None
    hf = (spec.get("draft_model_config") or {}).get("hf_config") or {}
    ids = hf.get("eagle_aux_hidden_state_layer_ids") if isinstance(hf, dict) else None
    return tuple(i for i in ids if isinstance(i, int)) if isinstance(ids, list) else ()


#: The KV-cache dtypes vLLM's hidden-states cache layer takes (a quantized cache fails its start).
CAPTURE_KV_DTYPES = ("auto", "bfloat16", "float16")


def engine_refusal(argv: Sequence[str]) -> str | None:
    """Why vLLM started with ARGV (an extract_hidden_states engine) would fail once its weights
    are loaded, in one line; None when nothing in ARGV stands in the way."""
    spec = speculative_config(argv) or {}
    kv = flag_value(argv, "--kv-cache-dtype")
    if kv is not None and kv not in CAPTURE_KV_DTYPES:
        return (f"--kv-cache-dtype {kv}: vLLM's hidden-states capture keeps the layers in the KV cache and takes "
                f"no quantized cache ({', '.join(CAPTURE_KV_DTYPES)}); drop it for a capturing engine")
    if spec.get("num_speculative_tokens", 1) != 1:
        return (f"num_speculative_tokens {spec['num_speculative_tokens']} in --speculative-config: "
                f"{CAPTURE_METHOD} takes exactly 1")
    if spec.get("disable_padded_drafter_batch"):
        return f"disable_padded_drafter_batch in --speculative-config: {CAPTURE_METHOD} does not support it"
    return None


def text_config(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """The language model's part of a model's config (a multimodal model nests it)."""
    inner = config.get("text_config")
    return inner if isinstance(inner, Mapping) else config


def refusal(config: Mapping[str, Any], layers: Sequence[int], model: str) -> str | None:
    """Why capturing LAYERS of MODEL (its config.json, CONFIG) cannot work, in one line; None
    when nothing in the config stands in the way."""
    text = text_config(config)
    if text.get("kv_lora_rank") is not None:
        return (f"model {model} uses MLA attention (kv_lora_rank {text['kv_lora_rank']}, model_type "
                f"{text.get('model_type', '?')}): vLLM's hidden-states capture cannot serve an MLA model "
                "(its connector refuses MLA verifiers); capture with a model of standard attention")
    count = text.get("num_hidden_layers")
    if isinstance(count, int) and layers and max(layers) > count:
        return (f"layer id {max(layers)} is past model {model}'s last layer ({count} decoder layers: ids run "
                f"from 0, the embeddings, to {count}, the last layer); fix --capture-layers")
    return None


def hub_cache() -> Path:
    """Where huggingface_hub keeps downloaded models (its own environment variables, in its order)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
    return Path(home).expanduser() / "hub"


def model_config(model: str) -> dict[str, Any] | None:
    """MODEL's config.json, from its folder or, for a hub id ("org/name"), from the hub cache
    (the revision refs/main names, else any snapshot); None when neither is on this node."""
    here = Path(model).expanduser()
    candidates = [here / "config.json"]
    if not here.is_dir() and model.count("/") == 1:
        repo = hub_cache() / f"models--{model.replace('/', '--')}"
        ref = repo / "refs" / "main"
        if ref.is_file():
            candidates.append(repo / "snapshots" / ref.read_text().strip() / "config.json")
        candidates += sorted((repo / "snapshots").glob("*/config.json"))
    for path in candidates:
        try:
            parsed = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(parsed, dict):
            return parsed
    return None


def check_model(model: str, layers: Sequence[int]) -> str | None:
    """refusal() for MODEL as found on this node; None when it can be served or its config is
    not here (the engine's own start, or the capture probe, then has the last word)."""
    config = model_config(model)
    return None if config is None else refusal(config, layers, model)
