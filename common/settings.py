"""A run's recipe: what every consumer of the run must do the same way.

The settings are stored in Redis with the run. Consumers read them from there, never from
their own command line, so every GPU runs one recipe; each result records the fingerprint.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import orjson

from genqueue.common import defaults
from genqueue.common.errors import UserError

MODES = ("first", "last", "each", "regenerate")
HISTORY_REASONING = ("drop", "keep")
TRUNCATION = ("keep", "error", "retry")

_RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")


def check_run_name(name: str) -> str:
    """Return NAME if it is a usable run name (it becomes part of Redis keys and file names)."""
    if not _RUN_NAME.match(name):
        raise UserError(
            f"invalid run name {name!r}: use 1-100 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    return name


def run_name_from_path(path: str) -> str:
    """The default run name for an input file: its base name without data extensions."""
    if path == "-":
        return "stdin"
    base = path.replace("\\", "/").rstrip("/").rsplit("/", 1)[-1]
    for ext in (".gz", ".zst", ".zstd", ".jsonl", ".json", ".parquet", ".ndjson"):
        if base.lower().endswith(ext):
            base = base[: -len(ext)]
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", base).strip("-._") or "run"
    return check_run_name(name[:100])


@dataclass(frozen=True, slots=True)
class Sampling:
    """Sampling parameters sent with every request of the run."""

    temperature: float | None = defaults.TEMPERATURE
    top_p: float | None = defaults.TOP_P
    max_tokens: int = defaults.MAX_TOKENS
    seed: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def request_params(self) -> dict[str, Any]:
        """The body fields of a chat completion request that carry these settings."""
        params: dict[str, Any] = {"max_tokens": self.max_tokens}
        if self.temperature is not None:
            params["temperature"] = self.temperature
        if self.top_p is not None:
            params["top_p"] = self.top_p
        if self.seed is not None:
            params["seed"] = self.seed
        params.update(self.extra)
        return params


@dataclass(frozen=True, slots=True)
class RunSettings:
    """The recipe of one run. Changing any field makes a different fingerprint."""

    model: str | None = None
    multi_turn: str = defaults.MULTI_TURN
    sampling: Sampling = field(default_factory=Sampling)
    output: str = defaults.OUTPUT
    max_prompt_chars: int = defaults.MAX_PROMPT_CHARS
    history_reasoning: str = "drop"
    truncation: str = "keep"
    expect_reasoning: bool = False

    def __post_init__(self) -> None:
        if self.multi_turn not in MODES:
            raise UserError(f"unknown --multi-turn {self.multi_turn!r}; choose one of {', '.join(MODES)}")
        if self.history_reasoning not in HISTORY_REASONING:
            raise UserError(f"unknown --history-reasoning {self.history_reasoning!r}")
        if self.truncation not in TRUNCATION:
            raise UserError(f"unknown --truncation {self.truncation!r}")
        if self.sampling.max_tokens < 1:
            raise UserError("--max-tokens must be at least 1")
        if self.max_prompt_chars < 1:
            raise UserError("--max-prompt-chars must be at least 1")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self) -> bytes:
        return orjson.dumps(self.to_dict(), option=orjson.OPT_SORT_KEYS)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunSettings:
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in data.items() if k in known}
        values["sampling"] = Sampling(**data.get("sampling", {}))
        return cls(**values)

    @classmethod
    def from_json(cls, raw: bytes | str) -> RunSettings:
        return cls.from_dict(orjson.loads(raw))

    @property
    def fingerprint(self) -> str:
        """16 hex characters that name this exact recipe."""
        return hashlib.blake2b(self.to_json(), digest_size=8).hexdigest()

    def differences(self, other: RunSettings) -> list[str]:
        """Names of the settings that differ from OTHER, for a refusal message."""
        mine, theirs = _flatten(self.to_dict()), _flatten(other.to_dict())
        return sorted(k for k in mine.keys() | theirs.keys() if mine.get(k) != theirs.get(k))


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict) and k != "extra":
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out
