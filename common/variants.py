"""Request variants: a run's mix of request shapes (thinking on and off, several reasoning
efforts...), one of them drawn for each item from its key.

A variant is a name, request fields merged into the run's sampling parameters, and a weight.
The draw is a pure function of the item's key and the run's variants, so every consumer and
every retry of an item sends the same request, and the record says which variant it was
(`variant`). The weights are shares: they are divided by their sum when drawn (and when shown),
so 7:3 and 0.7:0.3 draw alike; `producer enqueue` stores them normalised, so the two also give
one fingerprint. The fields themselves are checked with the run's sampling (settings.py).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from hashlib import blake2b
from typing import Any

import orjson

from genqueue.common.errors import UserError

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
#: Salt of the draw's hash: an item's variant is not correlated with anything else the key picks.
_SALT = b"genqueue-variant\0"


@dataclass(frozen=True, slots=True)
class Variant:
    """One request shape of a run's mix: PARAMS merged into the sampling parameters of the
    items drawn for it (a share WEIGHT of them)."""

    name: str
    params: dict[str, Any] = field(default_factory=dict)
    weight: float = 1.0


def parse_variant(text: str) -> Variant:
    """`--variant NAME=JSON[:WEIGHT]` (weight 1 when absent); UserError saying what is wrong."""
    name, eq, rest = text.partition("=")
    if not eq:
        raise UserError(f"--variant {text!r}: write NAME=JSON[:WEIGHT], e.g. "
                        "nothink='{\"chat_template_kwargs\":{\"enable_thinking\":false}}':0.3")
    end = rest.rfind("}")  # the JSON is an object: it ends at its last brace, the weight follows
    raw, tail = (rest[: end + 1], rest[end + 1:]) if end >= 0 else (rest, "")
    try:
        params = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise UserError(f"--variant {name}: its request fields are not valid JSON: {e}") from None
    if not isinstance(params, dict):
        raise UserError(f"--variant {name}: its request fields must be a JSON object")
    weight = 1.0
    if tail:
        if not tail.startswith(":"):
            raise UserError(f"--variant {name}: unexpected {tail!r} after its JSON (write :WEIGHT)")
        try:
            weight = float(tail[1:])
        except ValueError:
            raise UserError(f"--variant {name}: its weight must be a number, not {tail[1:]!r}") from None
    return Variant(name, params, weight)


def check_variants(variants: Sequence[Variant]) -> None:
    """Names usable in file names and unique, weights positive and finite; UserError else."""
    seen: set[str] = set()
    for v in variants:
        if not _NAME.match(v.name):
            raise UserError(f"--variant name {v.name!r}: use 1-64 letters, digits, '.', '_' or '-', "
                            "starting with a letter or digit")
        if v.name in seen:
            raise UserError(f"--variant {v.name} is given twice")
        seen.add(v.name)
        if not (isinstance(v.weight, int | float) and math.isfinite(v.weight) and v.weight > 0):
            raise UserError(f"--variant {v.name}: its weight must be a number > 0, not {v.weight!r}")


def normalised(variants: Sequence[Variant]) -> tuple[Variant, ...]:
    """VARIANTS with weights that sum to 1 (checked first)."""
    check_variants(variants)
    total = sum(v.weight for v in variants)
    return tuple(Variant(v.name, v.params, v.weight / total) for v in variants)


def key_fraction(key: str) -> float:
    """A number in [0, 1) fixed by KEY alone, evenly spread over keys."""
    digest = blake2b(_SALT + key.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64


def draw(key: str, variants: Sequence[Variant]) -> Variant | None:
    """The variant of the item KEY (None when the run has none): the first whose cumulative
    share passes the key's fraction."""
    if not variants:
        return None
    point = key_fraction(key) * sum(v.weight for v in variants)
    running = 0.0
    for v in variants:
        running += v.weight
        if point < running:
            return v
    return variants[-1]  # float rounding at the top end


def merged(params: Mapping[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    """PARAMS with EXTRA's fields over them; an object field in both (chat_template_kwargs)
    keeps the keys EXTRA does not set."""
    out = dict(params)
    for k, v in extra.items():
        old = out.get(k)
        out[k] = {**old, **v} if isinstance(old, dict) and isinstance(v, dict) else v
    return out


def shares(variants: Sequence[Variant]) -> str:
    """The mix in one line, e.g. `think 70%, nothink 30%`."""
    total = sum(v.weight for v in variants) or 1.0
    return ", ".join(f"{v.name} {100 * v.weight / total:.3g}%" for v in variants)
