"""A run's recipe: what every consumer of the run must do the same way.

The settings are stored in Redis with the run. Consumers read them from there, never from
their own command line, so every GPU runs one recipe; each result records the fingerprint.
Also the checks of values more than one command takes: a run's name, --concurrency.
"""

from __future__ import annotations

import hashlib
import math
import re
from dataclasses import asdict, dataclass, field, fields, replace
from enum import StrEnum
from typing import Any, TypedDict, TypeVar

import orjson

from genqueue.common import defaults
from genqueue.common.capture import CaptureSettings
from genqueue.common.contracts import HistoryReasoning, Mode, Truncation
from genqueue.common.errors import UserError
from genqueue.common.logprobs import check_logprobs
from genqueue.common.prefill import PrefillSettings
from genqueue.common.redact import redact
from genqueue.common.variants import Variant, check_variants, draw, merged

E = TypeVar("E", bound=StrEnum)

_RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")


def check_run_name(name: str) -> str:
    """Return NAME if it is a usable run name (it becomes part of Redis keys and file names)."""
    if not _RUN_NAME.match(name):
        raise UserError(
            f"invalid run name {name!r}: use 1-100 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    return name


_DRAFTER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/@+=-]{0,199}$")


def check_drafter_name(name: str) -> str:
    """Return NAME if it is a usable drafter label (`--drafter`: shown by status, kept in every
    record, a column heading of the drafter report)."""
    if not _DRAFTER_NAME.match(name):
        raise UserError(
            f"invalid drafter name {name!r}: use 1-200 letters, digits or '._:/@+=-', starting with a letter "
            "or digit (e.g. eagle3-round2, org/model@rev)"
        )
    return name


def parse_concurrency(text: str) -> int | None:
    """--concurrency (`consumer run`, `consumer launch`): a fixed number of requests in flight
    (at least 1), or None for auto; UserError for anything else."""
    if text.strip().lower() == "auto":
        return None
    try:
        fixed = int(text)
    except ValueError:
        raise UserError(f"--concurrency takes a number or auto, not {text!r}") from None
    if fixed < 1:
        raise UserError(f"--concurrency takes a number or auto, not {text!r}: it must be at least 1")
    return fixed


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


#: Request fields --sampling-json may not set, and why: genqueue sets them itself per request.
RESERVED_FIELDS: dict[str, str] = {
    "model": "use --model (each result records the model that answered)",
    "messages": "the messages are the items' own",
    "stream": "consumers read one JSON answer per request",
    "stream_options": "consumers do not stream",
    "n": "each item gets exactly one answer",
    "tools": "tools are the records' own",
    "return_token_ids": "use --token-ids (the records then keep each turn's prompt and completion ids)",
}

#: Request fields of vLLM's OpenAI-compatible chat completions that --sampling-json may set
#: without a warning (anything else is sent as given, after a warning line naming it).
KNOWN_FIELDS = frozenset({
    # OpenAI chat completions
    "temperature", "top_p", "max_tokens", "max_completion_tokens", "seed", "stop", "presence_penalty",
    "frequency_penalty", "logit_bias", "logprobs", "top_logprobs", "response_format", "tool_choice",
    "parallel_tool_calls", "reasoning_effort", "user",
    # vLLM sampling and chat extras
    "top_k", "min_p", "repetition_penalty", "length_penalty", "min_tokens", "stop_token_ids", "ignore_eos",
    "include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens", "bad_words",
    "allowed_token_ids", "truncate_prompt_tokens", "prompt_logprobs", "use_beam_search", "best_of",
    "chat_template", "chat_template_kwargs", "add_generation_prompt", "continue_final_message",
    "add_special_tokens", "documents", "mm_processor_kwargs", "structured_outputs", "guided_json",
    "guided_regex", "guided_choice", "guided_grammar", "guided_decoding_backend", "guided_whitespace_pattern",
    "priority", "return_tokens_as_token_ids", "cache_salt", "vllm_xargs", "thinking_token_budget",
})


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

    def check(self) -> list[str]:
        """Refuse values no server accepts, before anything is written; return a warning line
        for each --sampling-json field genqueue does not know (sent as given: vLLM grows).

        Called when a run is made, not when one is read: a consumer serves what is stored.
        """
        reserved = sorted(self.extra.keys() & RESERVED_FIELDS.keys())
        if reserved:
            raise UserError(f"--sampling-json may not set {reserved[0]!r}: {RESERVED_FIELDS[reserved[0]]}")
        p = self.request_params()  # what is sent: --sampling-json overrides the options
        temperature, top_p = p.get("temperature"), p.get("top_p")
        if temperature is not None and not (_is_number(temperature) and temperature >= 0):
            raise UserError(f"temperature must be a number >= 0, not {temperature!r}")
        if top_p is not None and not (_is_number(top_p) and 0 < top_p <= 1):
            raise UserError(f"top_p must be a number in (0, 1], not {top_p!r}")
        for name in ("max_tokens", "max_completion_tokens"):
            if name in p and not (_is_int(p[name]) and p[name] >= 1):
                raise UserError(f"{name} must be an integer >= 1, not {p[name]!r}")
        if p.get("seed") is not None and not _is_int(p["seed"]):
            raise UserError(f"seed must be an integer, not {p['seed']!r}")
        return [
            f"--sampling-json: unknown request field {name!r}, sent as given (the server may refuse it)"
            for name in sorted(self.extra.keys() - KNOWN_FIELDS)
        ]


def check_variant_params(sampling: Sampling, variants: tuple[Variant, ...]) -> list[str]:
    """Refuse a --variant whose request fields no server accepts once merged over SAMPLING (the
    same checks as --sampling-json); a warning line for each field genqueue does not know."""
    check_variants(variants)
    warnings: list[str] = []
    for v in variants:
        reserved = sorted(v.params.keys() & RESERVED_FIELDS.keys())
        if reserved:
            raise UserError(f"--variant {v.name} may not set {reserved[0]!r}: {RESERVED_FIELDS[reserved[0]]}")
        try:
            replace(sampling, extra=merged(sampling.extra, v.params)).check()
        except UserError as e:
            raise UserError(f"--variant {v.name}: {e}") from None
        warnings += [f"--variant {v.name}: unknown request field {name!r}, sent as given (the server may refuse it)"
                     for name in sorted(v.params.keys() - KNOWN_FIELDS)]
    return warnings


def _stored_variants(raw: object) -> tuple[Variant, ...]:
    """The variants of settings read back from Redis; a shape genqueue never stored is left for
    stored_shape_problem to name (a field of the wrong type), not raised here."""
    if not isinstance(raw, list):
        return (Variant("", {}, math.nan),)
    return tuple(Variant(**v) if isinstance(v, dict) and v.keys() == {"name", "params", "weight"}
                 else Variant("", {}, math.nan) for v in raw)


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: object) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


@dataclass(frozen=True, slots=True)
class RunSettings:
    """The recipe of one run. Changing any field makes a different fingerprint.

    The names are StrEnums, so the JSON (and the fingerprint) is the one plain strings made
    before they were typed; plain strings given here are turned into the enums.
    """

    model: str | None = None
    multi_turn: Mode = defaults.MULTI_TURN
    sampling: Sampling = field(default_factory=Sampling)
    output: str = defaults.OUTPUT
    max_prompt_chars: int = defaults.MAX_PROMPT_CHARS
    history_reasoning: HistoryReasoning = defaults.HISTORY_REASONING
    truncation: Truncation = defaults.TRUNCATION
    expect_reasoning: bool = False
    #: the run's mix of request variants (common/variants.py); none by default, and then absent
    #: from the JSON, so the runs made before variants keep their fingerprint
    variants: tuple[Variant, ...] = ()
    token_ids: bool = False  # ask for return_token_ids; records keep each turn's ids (a NEW_FIELDS entry)
    #: the candidate drafter this run evaluates (`--drafter`): a label, not a request field. The
    #: engines serving the run run it; every record names it, so a drafter report is read from the
    #: records alone. In the fingerprint (when set): consumers re-read settings only when the
    #: fingerprint changes, so a label outside it would never reach their records after an
    #: update, and records of two drafters in one run are told apart by their fingerprints too.
    drafter: str | None = None
    #: what the run captures besides its answers (`--capture`): a drafter trainer's hidden states.
    #: It needs token_ids: each captured row is checked against the answer's ids, and the
    #: trainer aligns the features with them; it excludes drafter: capture takes the engine's
    #: speculative slot, so an engine that captures runs no drafter.
    capture: CaptureSettings | None = None
    #: the teacher's distribution (`--logprobs K`): every generated token's top-K log-probabilities,
    #: stored as feature rows (common/logprobs.py); needs token_ids, which each table is checked against
    logprobs: int | None = None

    #: a capture pass (`producer capture`): the run whose answers its items capture, and how
    #: they were chosen (common/prefill.py); needs capture or logprobs
    prefill: PrefillSettings | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "variants", tuple(self.variants))
        if isinstance(self.prefill, dict) and self.prefill.keys() <= set(PrefillSettings.__dataclass_fields__):
            # read back from Redis or a run.json; another shape is stored_shape_problem's to name
            object.__setattr__(self, "prefill", PrefillSettings(**self.prefill))
        if self.prefill is not None and self.capture is None and self.logprobs is None:
            raise UserError("a capture pass (producer capture) captures hidden states or log-probability tables: "
                            "it needs --capture-layers or --logprobs")
        # read back from Redis or a run.json; another shape is stored_shape_problem's to name
        object.__setattr__(self, "capture", CaptureSettings.stored(self.capture))
        if self.capture is not None:
            if not self.token_ids:
                raise UserError("--capture needs --token-ids: each captured row is checked against the answer's "
                                "token ids (a row whose ids differ is refused, never stored), and a trainer "
                                "aligns the features with them")
            if self.drafter is not None:
                raise UserError("--capture cannot go with --drafter: capturing takes the engine's speculative "
                                "slot (vLLM's extract_hidden_states), so an engine that captures runs no drafter")
        if _is_int(self.logprobs):  # another type is stored_shape_problem's to name
            check_logprobs(self.logprobs, token_ids=self.token_ids, extra=self.sampling.extra)
            if self.capture is not None:
                raise UserError("--logprobs cannot go with --capture in one run yet: run the tables and the "
                                "hidden states as two runs of the same input")
        object.__setattr__(self, "multi_turn", _choice(Mode, self.multi_turn, "--multi-turn"))
        object.__setattr__(
            self, "history_reasoning", _choice(HistoryReasoning, self.history_reasoning, "--history-reasoning")
        )
        object.__setattr__(self, "truncation", _choice(Truncation, self.truncation, "--truncation"))
        if isinstance(self.drafter, str):  # another type is stored_shape_problem's to name
            check_drafter_name(self.drafter)
        if self.sampling.max_tokens < 1:
            raise UserError("--max-tokens must be at least 1")
        if self.max_prompt_chars < 1:
            raise UserError("--max-prompt-chars must be at least 1")
        check_output(self.output)

    def to_dict(self) -> dict[str, Any]:
        """The stored form: a field added since runs were first stored is left out while it holds
        its default (NEW_FIELDS), so a run made before it existed keeps its fingerprint."""
        data = asdict(self)
        if self.capture is not None:  # its choice's fields only when set (CaptureSettings.to_dict)
            data["capture"] = self.capture.to_dict()
        for name, default in NEW_FIELDS.items():
            if data.get(name) == default:
                del data[name]
        return data

    def to_json(self) -> bytes:
        return orjson.dumps(self.to_dict(), option=orjson.OPT_SORT_KEYS)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunSettings:
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in data.items() if k in known}
        values["sampling"] = Sampling(**data.get("sampling", {}))
        if "variants" in data:
            values["variants"] = _stored_variants(data["variants"])
        return cls(**values)

    @classmethod
    def from_json(cls, raw: bytes | str) -> RunSettings:
        return cls.from_dict(orjson.loads(raw))

    def stored_shape_problem(self) -> str | None:
        """Why settings read back from Redis cannot be what genqueue stored (a field of the wrong
        type), or None. Values are not judged here: a consumer serves what the run holds."""
        sp = self.sampling
        for name, ok in (("output", isinstance(self.output, str)),
                         ("model", self.model is None or isinstance(self.model, str)),
                         ("max_prompt_chars", _is_int(self.max_prompt_chars)),
                         ("expect_reasoning", isinstance(self.expect_reasoning, bool)),
                         ("token_ids", isinstance(self.token_ids, bool)),
                         ("drafter", self.drafter is None or isinstance(self.drafter, str)),
                         ("logprobs", self.logprobs is None or _is_int(self.logprobs)),
                         ("capture", self.capture is None or isinstance(self.capture, CaptureSettings)),
                         ("prefill", self.prefill is None or isinstance(self.prefill, PrefillSettings)),
                         ("sampling.max_tokens", _is_int(sp.max_tokens)),
                         ("sampling.temperature", sp.temperature is None or _is_number(sp.temperature)),
                         ("sampling.top_p", sp.top_p is None or _is_number(sp.top_p)),
                         ("sampling.seed", sp.seed is None or _is_int(sp.seed)),
                         ("sampling.extra", isinstance(sp.extra, dict)),
                         ("variants", all(isinstance(v.name, str) and isinstance(v.params, dict)
                                          and _is_number(v.weight) for v in self.variants))):
            if not ok:
                return f"{name} has the wrong type"
        return None

    def variant_of(self, key: str) -> Variant | None:
        """The request variant the item KEY is sent with (None: the run declares none)."""
        return draw(key, self.variants)

    def request_params(self, variant: Variant | None = None) -> dict[str, Any]:
        """The sampling fields of a request, VARIANT's merged over the run's."""
        params = self.sampling.request_params()
        return params if variant is None else merged(params, variant.params)

    @property
    def fingerprint(self) -> str:
        """16 hex characters that name this exact recipe."""
        return hashlib.blake2b(self.to_json(), digest_size=8).hexdigest()

    def differences(self, other: RunSettings) -> list[str]:
        """Names of the settings that differ from OTHER, for a refusal message."""
        mine, theirs = _flatten(self.to_dict()), _flatten(other.to_dict())
        return sorted(k for k in mine.keys() | theirs.keys() if mine.get(k) != theirs.get(k))

    def keeping(self, stored: RunSettings, given: frozenset[str]) -> RunSettings:
        """These settings where GIVEN names them (SETTING_NAMES: what the command line gave),
        STORED's (an existing run's) everywhere else: an option left out keeps the run's value."""
        unknown = given - SETTING_NAMES
        if unknown:
            raise ValueError(f"not settings: {sorted(unknown)}")
        sampling = replace(stored.sampling, **{name: getattr(self.sampling, name) for name in _SAMPLING_NAMES
                                               if f"sampling.{name}" in given})
        top = {name: getattr(self, name) for name in _TOP_NAMES if name in given}
        return replace(stored, sampling=sampling, **top)


_SAMPLING_NAMES = tuple(f.name for f in fields(Sampling))
# prefill is no option of `producer enqueue`: a capture pass's is `producer capture`'s, given whole
_TOP_NAMES = tuple(f.name for f in fields(RunSettings) if f.name not in ("sampling", "prefill"))
#: Every setting by the name differences() gives it ("sampling.max_tokens"): what
#: RunSettings.keeping takes from the command line.
SETTING_NAMES = frozenset(_TOP_NAMES) | {f"sampling.{name}" for name in _SAMPLING_NAMES}


#: Fields added to RunSettings after runs were first stored, with the default each is left out
#: of the stored form at (RunSettings.to_dict): the fingerprint of a run that never set one is
#: the one it had before the field existed.
NEW_FIELDS: dict[str, object] = {"token_ids": False, "variants": (), "drafter": None, "capture": None,
                               "logprobs": None,
                               "prefill": None}


#: Settings `--update-settings` may not change, and why: a run keeps them for its whole life.
FIXED_SETTINGS: dict[str, str] = {
    "multi_turn": "an item's key is made from the mode, so another mode is another set of items",
    "output": "the results already shipped are under the old output",
    "capture": "the features already shipped are of one capture, named by one manifest",
    "logprobs": "the tables already shipped are of one K, named by one manifest",
}


def check_update(old: RunSettings, new: RunSettings) -> list[str]:
    """The settings that differ between OLD and NEW; UserError when one of them may not change
    on a live run (FIXED_SETTINGS)."""
    changed = new.differences(old)
    fixed = [name.split(".")[0] for name in changed if name.split(".")[0] in FIXED_SETTINGS]
    if fixed:
        raise UserError(f"--update-settings cannot change {fixed[0]} ({FIXED_SETTINGS[fixed[0]]}); "
                        "name a new run with --run")
    return changed


class FingerprintEntry(TypedDict):
    """One recipe a run has had: a run's settings may change (`--update-settings`), and every
    result records the fingerprint that produced it, so the run keeps them all, oldest first."""

    fingerprint: str
    since: float  # epoch seconds: when the run took these settings
    settings: dict[str, Any]


def fingerprint_entry(settings: RunSettings, since: float) -> FingerprintEntry:
    return {"fingerprint": settings.fingerprint, "since": since, "settings": settings.to_dict()}


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict) and k != "extra":
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _choice(enum: type[E], value: object, option: str) -> E:
    try:
        return enum(str(value))
    except ValueError:
        raise UserError(f"unknown {option} {value!r}; choose one of {', '.join(enum)}") from None


def check_output(output: str) -> str:
    """Return OUTPUT if it holds no credentials; a URL with any (user:password@, a token or a
    signature in its query) is refused: the settings are stored in Redis for every consumer to
    read, and shown by status."""
    if redact(output) != output:
        raise UserError(
            f"--output {redact(output)} holds credentials; genqueue takes none in a URL. Give them "
            "through boto3's credential chain: AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, "
            "~/.aws/credentials, or AWS_PROFILE"
        )
    return output
