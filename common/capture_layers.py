"""`--capture-layers`: which of the target's layers a run captures, as vLLM numbers them
(`eagle_aux_hidden_state_layer_ids`: 0 the embeddings, k the output of decoder layer k, the
model's layer count L its last decoder layer before the final norm).

The option is a comma-separated list whose pieces are unioned:
- a layer id (`2`, `16`, `32`);
- `eagle3:L`: EAGLE-3's layers on an L-layer target, speculators' default `[2, L//2, L-3, L]`
  (vLLM's default aux layers `(2, L//2, L-3)` and the last, which EAGLE-3 trains on);
- `dflash:L:N`: DFlash's N target layers on an L-layer target, spaced from 1 to L-3 as z-lab's
  `build_target_layer_ids` does (N = 1: the middle one), in vLLM's numbering (DFlash's id + 1);
- a drafter's config (its `config.json`, or the folder holding it): the layers vLLM's
  extract_hidden_states would capture for that drafter, read as vLLM 0.32 reads them
  (`eagle_aux_hidden_state_layer_ids` as they are; `dflash_config.target_layer_ids`,
  `dspark_target_layer_ids` and `target_layer_ids` plus one, a deepseek_v41 DSpark's as they
  are; `dflash_config.layer_ids` or `eagle_config.layer_ids` as they are). Add the last layer
  yourself when the trainer needs it (`drafter/config.json,32`).
Every mistake is a one-line UserError naming the piece.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from typing import Any

from genqueue.common.errors import UserError

OPTION = "--capture-layers"


def resolve_layers(spec: str) -> tuple[int, ...]:
    """SPEC (the option's text) as sorted, distinct layer ids; UserError for a piece that is not
    an id, a preset or a drafter config that names layers."""
    ids: set[int] = set()
    pieces = [p.strip() for p in spec.split(",")]
    for piece in pieces:
        if not piece:
            continue
        ids.update(_piece(piece, spec))
    if not ids:
        raise UserError(f"{OPTION} names no layer: give ids (2,16,29), eagle3:L, dflash:L:N or a drafter's config.json")
    return tuple(sorted(ids))


def _piece(piece: str, spec: str) -> Iterable[int]:
    if piece.lstrip("-").isdigit():
        return (int(piece),)
    head, _, rest = piece.partition(":")
    if head == "eagle3":
        (layers,) = _counts(piece, rest, ("L",))
        if layers < 4:
            raise UserError(f"{OPTION}: {piece!r}: EAGLE-3's layers need a target of 4 layers or more")
        return (2, layers // 2, layers - 3, layers)
    if head == "dflash":
        layers, n = _counts(piece, rest, ("L", "N"))
        return [i + 1 for i in dflash_target_layers(layers, n, piece)]
    if os.path.isdir(piece) or piece.endswith(".json") or os.sep in piece:
        return drafter_layers(piece)
    raise UserError(f"{OPTION}: {piece!r} in {spec!r} is not a layer id, eagle3:L, dflash:L:N or a drafter's "
                    "config.json")


def _counts(piece: str, rest: str, names: tuple[str, ...]) -> list[int]:
    parts = rest.split(":") if rest else []
    if len(parts) != len(names) or not all(p.isdigit() and int(p) > 0 for p in parts):
        form = ":".join((piece.partition(":")[0], *names))
        raise UserError(f"{OPTION}: {piece!r} is not {form} (positive integers: L the target's layer count"
                        + (", N the drafter's target layers)" if "N" in names else ")"))
    return [int(p) for p in parts]


def dflash_target_layers(layers: int, n: int, piece: str = "dflash") -> list[int]:
    """DFlash's N target layer ids (its numbering: hidden_states[i + 1]) on an L-layer target,
    as z-lab's build_target_layer_ids spaces them: from 1 to L-3, rounded; N = 1 the middle one."""
    if n == 1:
        return [layers // 2]
    if layers < 5:
        raise UserError(f"{OPTION}: {piece!r}: DFlash spaces layers from 1 to L-3, which needs L of 5 or more")
    start, end = 1, layers - 3
    return sorted({round(start + i * (end - start) / (n - 1)) for i in range(n)})


def drafter_layers(path: str) -> tuple[int, ...]:
    """The layers vLLM's extract_hidden_states captures for the drafter whose config is PATH (a
    config.json or its folder), read as vLLM 0.32 reads a draft config."""
    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    try:
        with open(file, "rb") as f:
            config = json.loads(f.read())
    except FileNotFoundError:
        raise UserError(f"{OPTION}: {path!r}: no drafter config there ({file} not found)") from None
    except (OSError, ValueError) as e:
        raise UserError(f"{OPTION}: {file}: not a readable JSON config ({type(e).__name__})") from None
    if not isinstance(config, dict):
        raise UserError(f"{OPTION}: {file}: a config is a JSON object")
    ids = _config_ids(config)
    if ids is None:
        raise UserError(f"{OPTION}: {file} names no layers (eagle_aux_hidden_state_layer_ids, "
                        "dflash_config.target_layer_ids, dspark_target_layer_ids or target_layer_ids)")
    return ids


def _config_ids(config: dict[str, Any]) -> tuple[int, ...] | None:
    """vLLM's get_eagle3_aux_layers_from_config over a config as JSON: the first key present wins."""
    plus_one = config.get("model_type") != "deepseek_v41"
    dflash = _section(config, "dflash_config")
    eagle = _section(config, "eagle_config")
    found: list[tuple[Any, int]] = [
        (config.get("eagle_aux_hidden_state_layer_ids"), 0),
        (dflash.get("target_layer_ids"), 1),
        (config.get("dspark_target_layer_ids"), 1 if plus_one else 0),
        (config.get("target_layer_ids"), 1),
        (dflash.get("layer_ids"), 0),
        (eagle.get("layer_ids"), 0),
    ]
    for value, shift in found:
        if value:
            if not isinstance(value, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in value):
                raise UserError(f"{OPTION}: the drafter config's layer ids are not a list of integers: {value!r}")
            return tuple(sorted({i + shift for i in value}))
    return None


def _section(config: dict[str, Any], name: str) -> dict[str, Any]:
    value = config.get(name)
    return value if isinstance(value, dict) else {}
