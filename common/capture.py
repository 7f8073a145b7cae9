"""What a run captures besides its answers (`producer enqueue --capture`): a drafter trainer's
hidden states, of which layers, stored how. Part of the run's settings (common/settings.py), so
every consumer captures the same way; the storage itself is common/features/.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import TypeVar

from genqueue.common.capture_layers import resolve_layers
from genqueue.common.errors import UserError

E = TypeVar("E", bound=StrEnum)


class CaptureKind(StrEnum):
    """What a run captures besides its answers (`--capture`)."""

    HIDDEN_STATES = "hidden-states"  # the target's hidden states of the layers named, for a drafter's trainer


class CaptureDtype(StrEnum):
    """How captured hidden states are stored (`--capture-dtype`; common/features/codec.py)."""

    FP8 = "fp8"  # float8 e4m3 with a float32 scale per token: half of bf16, at parity for training
    BF16 = "bf16"  # what vLLM hands over, kept as it is


@dataclass(frozen=True, slots=True)
class CaptureSettings:
    """A run's capture (`--capture`): WHAT, of the engine's LAYERS (vLLM's
    eagle_aux_hidden_state_layer_ids: 0 the embeddings, k the output of decoder layer k; sorted,
    each once, as vLLM stores them), stored as DTYPE."""

    what: CaptureKind
    layers: tuple[int, ...]
    dtype: CaptureDtype = CaptureDtype.FP8

    def __post_init__(self) -> None:
        object.__setattr__(self, "what", _choice(CaptureKind, self.what, "--capture"))
        object.__setattr__(self, "dtype", _choice(CaptureDtype, self.dtype, "--capture-dtype"))
        if not isinstance(self.layers, list | tuple) or not all(_is_int(i) for i in self.layers):
            raise UserError(f"--capture-layers takes layer ids (integers), not {self.layers!r}")
        ids = tuple(sorted(set(self.layers)))
        if not ids:
            raise UserError("--capture-layers names no layer: give the ids, e.g. 2,16,29 (0 = the embeddings)")
        if ids[0] < 0:
            raise UserError(f"--capture-layers: layer id {ids[0]} is negative (ids run from 0, the embeddings, to "
                            "the model's layer count)")
        object.__setattr__(self, "layers", ids)


def parse_capture(what: str | None, layers: str | None, dtype: str | None) -> CaptureSettings | None:
    """`--capture`, `--capture-layers` ("2,16,29") and `--capture-dtype` as one CaptureSettings
    (None: no capture); UserError for a layer list that is not ids, or a layer or dtype option
    without --capture."""
    if what is None:
        if layers is not None or dtype is not None:
            raise UserError(f"{'--capture-layers' if layers is not None else '--capture-dtype'} needs "
                            "--capture hidden-states")
        return None
    if layers is None:
        raise UserError("--capture hidden-states needs --capture-layers (the engine's layer ids, e.g. 2,16,29)")
    return CaptureSettings(_choice(CaptureKind, what, "--capture"), resolve_layers(layers),
                           _choice(CaptureDtype, dtype or CaptureDtype.FP8, "--capture-dtype"))


def _choice(enum: type[E], value: object, option: str) -> E:
    try:
        return enum(str(value))
    except ValueError:
        raise UserError(f"unknown {option} {value!r}; choose one of {', '.join(enum)}") from None


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)
