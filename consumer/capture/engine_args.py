"""What turns capture on in vLLM: the engine's flags and environment, and a request's field.

The engine runs the `extract_hidden_states` speculative method (it takes the speculative slot:
an engine that captures runs no drafter) with genqueue's connector, which vLLM imports from
connector/ by module path. Layer id 0 is the embeddings, id k the output of decoder layer k
(1-based), id L (the layer count) the last layer's output before the final norm. vLLM keeps the
layers sorted and once each, and so does every file it writes: the ids are normalised here.
"""

from __future__ import annotations

import json
import os
import shlex
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from genqueue.common.errors import UserError

#: The folder vLLM's interpreter gets on its PYTHONPATH: it holds the connector module alone.
CONNECTOR_DIR = Path(__file__).resolve().parent / "connector"
CONNECTOR_MODULE = "genqueue_hidden_states"
CONNECTOR_CLASS = "GenqueueHiddenStatesConnector"
METHOD = "extract_hidden_states"


def check_layers(layers: Iterable[int], num_layers: int | None = None) -> tuple[int, ...]:
    """LAYERS sorted, each once, as vLLM stores them; a UserError for none, a negative id, or
    (given the model's NUM_LAYERS) an id past the last layer."""
    ids = tuple(sorted(set(layers)))
    if not ids:
        raise UserError("capture needs at least one layer id (0 = embeddings, L = the last layer)")
    if ids[0] < 0:
        raise UserError(f"layer id {ids[0]} is negative: ids run from 0 (the embeddings) to the layer count")
    if num_layers is not None and ids[-1] > num_layers:
        raise UserError(f"layer id {ids[-1]} is past the model's last layer ({num_layers})")
    return ids


def parse_layers(text: str, num_layers: int | None = None) -> tuple[int, ...]:
    """"2,16,29,32" -> (2, 16, 29, 32); a UserError naming the piece that is not an id."""
    ids = []
    for piece in text.replace(" ", "").split(","):
        if not piece.lstrip("-").isdigit():
            raise UserError(f"{piece!r} in layer list {text!r} is not a layer id")
        ids.append(int(piece))
    return check_layers(ids, num_layers)


@dataclass(frozen=True, slots=True)
class CaptureEngine:
    """An engine that captures LAYERS of every request into files under STORAGE."""

    layers: tuple[int, ...]
    storage: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", check_layers(self.layers))

    def speculative_config(self) -> dict[str, Any]:
        return {"method": METHOD, "num_speculative_tokens": 1,
                "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": list(self.layers)}}}

    def kv_transfer_config(self) -> dict[str, Any]:
        return {"kv_connector": CONNECTOR_CLASS, "kv_connector_module_path": CONNECTOR_MODULE,
                "kv_role": "kv_producer", "kv_connector_extra_config": {"shared_storage_path": str(self.storage)}}

    def argv(self) -> list[str]:
        """The flags to add to vLLM's command line."""
        return ["--speculative-config", json.dumps(self.speculative_config(), separators=(",", ":")),
                "--kv-transfer-config", json.dumps(self.kv_transfer_config(), separators=(",", ":"))]

    def env(self, base: Mapping[str, str]) -> dict[str, str]:
        """BASE with the connector's folder first on PYTHONPATH (vLLM's workers inherit it)."""
        rest = base.get("PYTHONPATH", "")
        return {**base, "PYTHONPATH": str(CONNECTOR_DIR) + (os.pathsep + rest if rest else "")}


def start_with(layers: Iterable[int]) -> str:
    """What to start vLLM with to capture LAYERS, in words a refusal can end with."""
    engine = CaptureEngine(tuple(layers), Path("DIR"))
    return (f"start vLLM with {shlex.join(engine.argv())} (DIR: a folder this consumer can read) and "
            f"PYTHONPATH={shlex.quote(str(CONNECTOR_DIR))}")


def request_fields(*, with_output: bool) -> dict[str, Any]:
    """The top-level fields a request adds to ask for its hidden states (genqueue's connector
    writes none for a request without them): WITH_OUTPUT keeps the generated tokens' too (all but
    the last, which was never an input); without it, the prompt's alone (a prefill pass)."""
    return {"kv_transfer_params": {"include_output_tokens": with_output}}
