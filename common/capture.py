"""What a run captures besides its answers (`producer enqueue --capture`): a drafter trainer's
hidden states, of which layers, stored how, and of which answers (the choice). Part of the run's
settings (common/settings.py), so every consumer captures the same way and chooses the same
answers; the storage itself is common/features/.

The choice is pure: an item's answers ask for capture when its source is among
`--capture-sources` (when given) and its key draws under its source's share (`--capture-share`,
or the share given with the source name: stratified). The draw is a hash of the item's key alone,
so a redo of the item, on any consumer, makes the same choice; it is independent of the request
variant's draw. `--capture-budget` is the one choice with run-wide state: the bytes captured so far
(common/keepers/captured.py), checked by the consumer before each answer asks.
"""

from __future__ import annotations

import fnmatch
import math
import re
from dataclasses import dataclass
from enum import StrEnum
from hashlib import blake2b
from typing import Any, TypeVar

from genqueue.common.capture_layers import resolve_layers
from genqueue.common.errors import GenqueueError, UserError

E = TypeVar("E", bound=StrEnum)


class CaptureKind(StrEnum):
    """What a run captures besides its answers (`--capture`)."""

    HIDDEN_STATES = "hidden-states"  # the target's hidden states of the layers named, for a drafter's trainer


class CaptureDtype(StrEnum):
    """How captured hidden states are stored (`--capture-dtype`; common/features/codec.py)."""

    FP8 = "fp8"  # float8 e4m3 with a float32 scale per token: half of bf16, at parity for training
    BF16 = "bf16"  # what vLLM hands over, kept as it is


class CaptureChoice(StrEnum):
    """What chooses the answers a run captures (CaptureSettings.choices: one or more, the card's "why")."""

    ALL = "all"  # every answer
    SHARE = "share"  # a share of the items, drawn from each item's key (per source: stratified)
    SOURCES = "sources"  # the items of the sources named only
    BUDGET = "budget"  # until the bytes captured reach the budget


class CaptureDecision(StrEnum):
    """Whether an item's answers ask for capture (CaptureSettings.decide), and if not, why."""

    CAPTURE = "capture"
    NOT_A_SOURCE = "not_a_source"  # its source is not among --capture-sources
    NOT_DRAWN = "not_drawn"  # its key drew above its source's share


class CaptureBudgetSpent(GenqueueError):
    """A row is not stored: its run's --capture-budget was reached while its answer was generated
    (a FeatureSink's keep raises it; the answer is kept without features)."""


#: Salt of the share's draw: which items are captured is not correlated with their variant.
_SALT = b"genqueue-capture\0"
#: Size units of --capture-budget: decimal (as disks are sold) and binary.
_UNITS = {"": 1, "b": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "p": 10**15,
          "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "pb": 10**15,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "pib": 2**50}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([A-Za-z]*)\s*$")
#: Extensions a source name may be given without (`--capture-sources code` names code.jsonl.gz).
_DATA_EXTS = (".gz", ".zst", ".zstd", ".jsonl", ".json", ".parquet", ".ndjson")


@dataclass(frozen=True, slots=True)
class SourceShare:
    """A source whose items a run captures (`--capture-sources NAME[=SHARE]`), and the share of them.
    NAME matches an item's source as given to `producer enqueue`, its file name, or its file name
    without data extensions; shell wildcards (*, ?, [..]) match as in a shell."""

    name: str
    share: float = 1.0

    def matches(self, source: str) -> bool:
        base = source.replace("\\", "/").rsplit("/", 1)[-1]
        stem = base
        while stem.lower().endswith(_DATA_EXTS):
            stem = stem[: stem.rfind(".")]
        return any(fnmatch.fnmatchcase(s, self.name) for s in (source, base, stem))


@dataclass(frozen=True, slots=True)
class CaptureSettings:
    """A run's capture (`--capture`): WHAT, of the engine's LAYERS (vLLM's
    eagle_aux_hidden_state_layer_ids: 0 the embeddings, k the output of decoder layer k; sorted,
    each once, as vLLM stores them), stored as DTYPE; of the items of SOURCES (none: every
    source), a SHARE of them (a source's own share when it names one), until BUDGET bytes are
    captured (None: no budget)."""

    what: CaptureKind
    layers: tuple[int, ...]
    dtype: CaptureDtype = CaptureDtype.FP8
    share: float = 1.0
    sources: tuple[SourceShare, ...] = ()
    budget: int | None = None

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
        _check_share(self.share, "--capture-share")
        sources = tuple(_source_share(s) for s in (self.sources if isinstance(self.sources, list | tuple) else ()))
        if len({s.name for s in sources}) != len(sources):
            raise UserError("--capture-sources names a source twice")
        object.__setattr__(self, "sources", sources)
        if self.budget is not None and not (_is_int(self.budget) and self.budget >= 1):
            raise UserError(f"--capture-budget must be a size of at least 1 byte, not {self.budget!r}")

    @property
    def choices(self) -> tuple[CaptureChoice, ...]:
        """What chooses the answers captured, in the order they apply (ALL alone when nothing does)."""
        out = [CaptureChoice.SOURCES] if self.sources else []
        if self.share < 1 or any(s.share < 1 for s in self.sources):
            out.append(CaptureChoice.SHARE)
        if self.budget is not None:
            out.append(CaptureChoice.BUDGET)
        return tuple(out) or (CaptureChoice.ALL,)

    def share_of(self, source: str | None) -> float:
        """The share of SOURCE's items captured (0: none; a source of None is an item without one)."""
        if not self.sources:
            return self.share
        if source is None:
            return 0.0
        return next((s.share for s in self.sources if s.matches(source)), 0.0)

    def source_note(self, source: str) -> str | None:
        """A warning for an input SOURCE whose items this capture takes none of (None: it takes some)."""
        if self.sources and self.share_of(source) <= 0:
            return (f"--capture-sources names none of {source!r} ({', '.join(s.name for s in self.sources)}): "
                    "its items are answered without capture")
        return None

    def decide(self, key: str, source: str | None) -> CaptureDecision:
        """Whether the answers of the item KEY, of SOURCE, ask for capture (the budget aside): a
        pure function of the two and the run's choice, the same on every consumer and every redo."""
        share = self.share_of(source)
        if share <= 0:
            return CaptureDecision.NOT_A_SOURCE
        if share >= 1 or capture_fraction(key) < share:
            return CaptureDecision.CAPTURE
        return CaptureDecision.NOT_DRAWN

    def describe(self) -> str:
        """The choice in words (status, the card)."""
        if not self.sources and self.share >= 1 and self.budget is None:
            return "every answer"
        parts = []
        if self.sources:
            parts.append("sources " + ", ".join(s.name + ("" if s.share >= 1 else f" ({s.share:g})")
                                                 for s in self.sources))
        if self.share < 1 and not self.sources:
            parts.append(f"a share {self.share:g} of each source's items, drawn from each item's key")
        elif any(s.share < 1 for s in self.sources):
            parts.append("each source's share drawn from each item's key")
        if self.budget is not None:
            parts.append(f"until {format_size(self.budget)} are captured")
        return "; ".join(parts)

    def options(self) -> list[str]:
        """The `producer enqueue` options that give this capture (a run brought back from its run.json)."""
        out = ["--capture", self.what.value, "--capture-layers", ",".join(map(str, self.layers)),
               "--capture-dtype", self.dtype.value]
        if self.sources:
            out += ["--capture-sources", ",".join(f"{s.name}={s.share!r}" for s in self.sources)]
        elif self.share != 1.0:
            out += ["--capture-share", repr(self.share)]
        if self.budget is not None:
            out += ["--capture-budget", str(self.budget)]
        return out

    def to_dict(self) -> dict[str, Any]:
        """The stored form: the choice's fields only when set, so a capture made before the choice
        existed keeps its run's fingerprint."""
        out: dict[str, Any] = {"what": self.what.value, "layers": list(self.layers), "dtype": self.dtype.value}
        if self.share != 1.0:
            out["share"] = self.share
        if self.sources:
            out["sources"] = [[s.name, s.share] for s in self.sources]
        if self.budget is not None:
            out["budget"] = self.budget
        return out

    @classmethod
    def stored(cls, value: object) -> CaptureSettings | object:
        """VALUE read back from Redis or a run.json as a CaptureSettings; another shape is returned
        as it is, for RunSettings.stored_shape_problem to name."""
        if isinstance(value, dict) and {"what", "layers", "dtype"} <= value.keys() <= _STORED_KEYS:
            return cls(**value)
        return value


_STORED_KEYS = frozenset({"what", "layers", "dtype", "share", "sources", "budget"})


def capture_fraction(key: str) -> float:
    """A number in [0, 1) fixed by the item KEY alone, evenly spread over keys: the item is
    captured when it is below its source's share."""
    return int.from_bytes(blake2b(_SALT + key.encode(), digest_size=8).digest(), "big") / 2**64


def parse_size(text: str, option: str = "--capture-budget") -> int:
    """A size such as 2TB (or 2T), 500GB, 1.5TiB or 1000000 (bytes), as bytes, decimal units as
    disks are sold and binary ones with an i; UserError otherwise. Every --capture-budget's."""
    m = _SIZE.match(text)
    unit = m.group(2).lower() if m else ""
    if m is None or unit not in _UNITS:
        raise UserError(f"{option} takes a size such as 2TB, 500GB or 1.5TiB, not {text!r}")
    size = int(float(m.group(1)) * _UNITS[unit])
    if size < 1:
        raise UserError(f"{option} must be at least 1 byte, not {text!r}")
    return size


def format_size(n: float) -> str:
    """N bytes in decimal units (as --capture-budget takes them): 1.2 TB, 350.0 MB."""
    for unit, size in (("PB", 1e15), ("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:,.1f} {unit}"
    return f"{n:,.0f} B"


def parse_sources(text: str, share: float) -> tuple[SourceShare, ...]:
    """--capture-sources "code,chat=0.2": the sources named, each with its share (SHARE, the
    run's --capture-share, when it names none)."""
    out = []
    for piece in (p.strip() for p in text.split(",")):
        if not piece:
            raise UserError(f"--capture-sources: an empty name in {text!r}")
        name, eq, own = piece.rpartition("=") if "=" in piece else (piece, "", "")
        if eq:
            try:
                value = float(own)
            except ValueError:
                raise UserError(f"--capture-sources: {own!r} in {piece!r} is not a share (a number in (0, 1])") \
                    from None
            out.append(SourceShare(name.strip(), value))
        else:
            out.append(SourceShare(name, share))
    return tuple(out)


def parse_capture(what: str | None, layers: str | None, dtype: str | None, share: float | None = None,
                  sources: str | None = None, budget: str | None = None) -> CaptureSettings | None:
    """`--capture`, `--capture-layers` ("2,16,29"), `--capture-dtype` and the choice
    (`--capture-share`, `--capture-sources`, `--capture-budget`) as one CaptureSettings (None: no
    capture); UserError for a layer list that is not ids, a bad choice, or an option without
    --capture."""
    if what is None:
        given = [name for name, v in (("--capture-layers", layers), ("--capture-dtype", dtype),
                                      ("--capture-share", share), ("--capture-sources", sources),
                                      ("--capture-budget", budget)) if v is not None]
        if given:
            raise UserError(f"{given[0]} needs --capture hidden-states")
        return None
    if layers is None:
        raise UserError("--capture hidden-states needs --capture-layers (the engine's layer ids, e.g. 2,16,29)")
    ids = resolve_layers(layers)
    run_share = 1.0 if share is None else _check_share(share, "--capture-share")
    return CaptureSettings(_choice(CaptureKind, what, "--capture"), ids,
                           _choice(CaptureDtype, dtype or CaptureDtype.FP8, "--capture-dtype"),
                           share=run_share if sources is None else 1.0,
                           sources=parse_sources(sources, run_share) if sources is not None else (),
                           budget=parse_size(budget) if budget is not None else None)


def _check_share(value: object, option: str) -> float:
    if not (isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
            and 0 < value <= 1):
        raise UserError(f"{option} must be a share in (0, 1] (e.g. 0.1 for a tenth), not {value!r}")
    return float(value)


def _source_share(value: object) -> SourceShare:
    """A --capture-sources entry, given or read back ([name, share])."""
    if isinstance(value, SourceShare):
        s = value
    elif isinstance(value, list | tuple) and len(value) == 2 and isinstance(value[0], str):
        s = SourceShare(value[0], value[1])
    else:
        raise UserError(f"--capture-sources: {value!r} is not a source name and share")
    if not s.name:
        raise UserError("--capture-sources: an empty name")
    share = _check_share(s.share, f"--capture-sources {s.name}")
    return s if share == s.share and isinstance(s.share, float) else SourceShare(s.name, share)


def _choice(enum: type[E], value: object, option: str) -> E:
    try:
        return enum(str(value))
    except ValueError:
        raise UserError(f"unknown {option} {value!r}; choose one of {', '.join(enum)}") from None


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)
