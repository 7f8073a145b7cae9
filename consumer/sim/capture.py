"""The stand-in's hidden-states capture, as vLLM's KV connector does it (its
`extract_hidden_states` method): a request whose body has `kv_transfer_params` gets a safetensors
file of `hidden_states` bf16 [tokens, layers, hidden] and `token_ids` int64 [tokens], and the
response names it in a top-level `kv_transfer_params.hidden_states_path`. With
`include_output_tokens` the tokens are the prompt's and the generated ones but the last (the
last was never an input); without it, the prompt's alone.

The features are common/features/standin.py's (a fixed function of token id, position, layer,
hidden size and the stand-in's seed), so a test computes what a row must hold without asking
the stand-in. `wrong_ids` plants the misalignment the peers reported (a row's ids not the
answer's): that share of the captures, drawn from the request, saves one id off by one.
"""

from __future__ import annotations

import json
import os
import random
import struct
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from genqueue.common.features.standin import standin_features

#: The draw of a planted wrong capture is its own stream of the request's digest.
_WRONG_STREAM = 0xCA97


@dataclass(frozen=True, slots=True)
class CaptureConfig:
    """Where the stand-in saves hidden states, of which LAYERS (vLLM's
    eagle_aux_hidden_state_layer_ids), how wide (HIDDEN), and the share WRONG_IDS saved with one
    id wrong (a misaligned capture, for tests)."""

    dir: Path
    layers: tuple[int, ...]
    hidden: int
    seed: int = 0
    wrong_ids: float = 0.0


def parse_layers(text: str) -> tuple[int, ...]:
    """"2,4" -> (2, 4), sorted and each once, as vLLM keeps them; ValueError for anything else."""
    ids = sorted({int(piece) for piece in text.replace(" ", "").split(",") if piece})
    if not ids or ids[0] < 0:
        raise ValueError(f"not a list of layer ids (0 and up): {text!r}")
    return tuple(ids)


def captured_ids(prompt: list[int], output: list[int], params: object) -> list[int] | None:
    """The token ids a request's hidden states are saved for (PARAMS: its kv_transfer_params),
    or None when it asked for none."""
    if not isinstance(params, dict):
        return None
    return prompt + output[:-1] if params.get("include_output_tokens") else list(prompt)


def file_stem(body: dict[str, object], header: str | None) -> str:
    """The name vLLM's connector gives a chat request's file: its internal request id,
    `chatcmpl-<X-Request-Id header, else the body's request_id, else a random id>-<8 hex>`."""
    given = header if header is not None else body.get("request_id")
    return f"chatcmpl-{given if isinstance(given, str) and given else uuid.uuid4().hex}-{uuid.uuid4().hex[:8]}"


def save(cfg: CaptureConfig, request_id: str, ids: list[int], digest: int) -> str:
    """Write the capture of request REQUEST_ID over token IDS; its path. Blocking (a thread)."""
    if cfg.wrong_ids and ids and random.Random(digest ^ _WRONG_STREAM).random() < cfg.wrong_ids:
        ids = [*ids[:-1], ids[-1] + 1]
    hidden = standin_features(ids, cfg.layers, cfg.hidden, cfg.seed) if ids else \
        np.zeros((0, len(cfg.layers), cfg.hidden), dtype=np.float32)
    # the features are bf16 values: their bf16 bits are float32's top half, exactly
    bf16 = (np.ascontiguousarray(hidden, dtype=np.float32).view(np.uint32) >> 16).astype("<u2").tobytes()
    tokens = np.asarray(ids, dtype="<i8").tobytes()
    header = {"hidden_states": {"dtype": "BF16", "shape": list(hidden.shape), "data_offsets": [0, len(bf16)]},
              "token_ids": {"dtype": "I64", "shape": [len(ids)], "data_offsets": [len(bf16), len(bf16) + len(tokens)]}}
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    cfg.dir.mkdir(parents=True, exist_ok=True)
    path = cfg.dir / f"{request_id}.safetensors"
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(struct.pack("<Q", len(head)) + head + bf16 + tokens)
    os.replace(tmp, path)  # whole when named: the connector's lock file is not needed
    return str(path)
