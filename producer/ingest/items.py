"""Cut a normalised conversation into work items, and the keys that name them (pure).

An item is a plain JSON-serialisable dict: ``key``, ``index`` (the record's in the input),
``turn``, ``messages`` (the conversation's own dicts, shared: read-only), ``tools`` (when the
conversation has tools) and ``note`` (when something was cut). Modes (``--multi-turn``):

- ``first``: the system messages before the first user turn, and that turn; turn 0.
- ``last``: the original history up to and including the last user turn; turn = user turns - 1.
- ``each``: one item per user turn k: the original history before it, then that turn.
- ``regenerate`` (the default): one item per conversation holding the system messages, the user
  turns, and each recorded tool call with its results (the consumer splices those in while the
  target makes the same calls); ``turn`` is None. A call whose results are not all there cuts the
  conversation before it (``"note": "stopped_at_tool_turn"``); a call before any user turn
  rejects the record (``tool_turn_first``).

The key hashes mode, messages and tools only, so identical items from different records share
a key (that is how duplicates are found); provenance (the record's id, source, position) rides
along unhashed. With ``--samples N`` each prompt becomes N items: sample 0 keeps the plain key
(so a later ``--samples 4`` adds samples 1-3 to a run of one), sample k > 0 hashes k too, and
each carries its own request seed (the run's seed, or 0, plus k): N answers are N draws.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from hashlib import blake2b
from typing import Any, cast

import orjson

from genqueue.common import defaults
from genqueue.common.contracts import ChatMessage, Item, Mode, Note, RejectReason, ToolSpec
from genqueue.producer.ingest.conversation import Conversation
from genqueue.producer.ingest.rejects import Rejected

STOPPED_AT_TOOL_TURN = Note.STOPPED_AT_TOOL_TURN

_SORT = orjson.OPT_SORT_KEYS


def item_key(mode: Mode, messages: Sequence[Mapping[str, object]], tools: Sequence[ToolSpec] | None) -> str:
    """32 hex characters naming an item: blake2b-128 of its mode, messages and tools."""
    data = orjson.dumps([mode, messages, tools], option=_SORT)
    return blake2b(data, digest_size=16).hexdigest()


def conversation_key(conv: Conversation) -> bytes:
    """16-byte digest of a whole normalised conversation, to find duplicate records."""
    data = orjson.dumps([conv.messages, conv.tools], option=_SORT)
    return blake2b(data, digest_size=16).digest()


def sample_key(mode: Mode, messages: Sequence[Mapping[str, object]], tools: Sequence[ToolSpec] | None,
               sample: int) -> str:
    """The key of sample SAMPLE of an item: the plain key for sample 0, else one that hashes
    the sample number too."""
    if sample == 0:
        return item_key(mode, messages, tools)
    data = orjson.dumps([mode, messages, tools, sample], option=_SORT)
    return blake2b(data, digest_size=16).hexdigest()


@dataclass(frozen=True, slots=True)
class Provenance:
    """What make_items stamps on every item of one record (never hashed into its key)."""

    source: str | None = None
    source_seq: int = 0
    id: str | None = None
    samples: int = defaults.SAMPLES
    base_seed: int = 0


def make_items(conv: Conversation, mode: Mode, index: int, prov: Provenance | None = None) -> list[Item]:
    """Items for one conversation in ``mode``; raises Rejected (no_user_turn, tool_turn_first)."""
    msgs = conv.messages
    users = [i for i, m in enumerate(msgs) if m["role"] == "user"]
    if not users:
        raise Rejected(RejectReason.NO_USER_TURN)
    try:
        mode = Mode(mode)
    except ValueError:
        raise ValueError(f"unknown mode {mode!r}; expected one of {', '.join(Mode)}") from None
    items: list[Item]
    match mode:
        case Mode.REGENERATE:
            items = [_regenerate(conv, index)]
        case Mode.FIRST:
            first = users[0]
            picked = [m for m in msgs[:first] if m["role"] == "system"]
            picked.append(msgs[first])
            items = [_item(Mode.FIRST, index, 0, picked, conv.tools)]
        case Mode.LAST:
            items = [_item(Mode.LAST, index, len(users) - 1, list(msgs[: users[-1] + 1]), conv.tools)]
        case Mode.EACH:
            items = [_item(Mode.EACH, index, k, list(msgs[: u + 1]), conv.tools) for k, u in enumerate(users)]
    return items if prov is None else _stamp(items, mode, prov)


def _stamp(items: list[Item], mode: Mode, prov: Provenance) -> list[Item]:
    for it in items:
        if prov.id is not None:
            it["id"] = prov.id
        if prov.source is not None:
            it["source"] = prov.source
            it["source_seq"] = prov.source_seq
    if prov.samples <= 1:
        return items
    out: list[Item] = []
    for it in items:
        for k in range(prov.samples):
            copy: Item = {**it}  # the messages stay shared: items are read-only
            copy["key"] = sample_key(mode, it["messages"], it.get("tools"), k)
            copy["sample"] = k
            copy["seed"] = prov.base_seed + k
            out.append(copy)
    return out


#: Body fields of a Batch API request line that are not sampling: the conversation itself, the
#: model (the run's model answers; every record names it), and bookkeeping the server ignores.
_BATCH_NOT_SAMPLING = frozenset({"messages", "tools", "model", "user", "metadata", "store"})


@dataclass(frozen=True, slots=True)
class Origin:
    """Where one input's records come from, and what make_items stamps on their items: the
    source's name as given and its place in the run, which field holds a record's own id,
    how many samples each prompt gets, and the run's request parameters (an OpenAI Batch
    request line must ask for the same sampling: a run has one recipe)."""

    source: str | None = None
    source_seq: int = 0
    id_field: str | None = None
    samples: int = defaults.SAMPLES
    base_seed: int = 0
    run_params: Mapping[str, object] | None = None

    def of(self, value: object) -> Provenance:
        """The provenance of the record VALUE; raises Rejected (missing_id, sampling_differs)."""
        if isinstance(value, dict) and isinstance(value.get("body"), dict) and self.run_params is not None:
            check_batch_sampling(value["body"], self.run_params)
        return Provenance(self.source, self.source_seq, record_id(value, self.id_field), self.samples,
                          self.base_seed)


def record_id(value: object, id_field: str | None = None) -> str | None:
    """The record's own identifier, as a string: ID_FIELD when given (Rejected missing_id when
    the record lacks it), else `id`, else `custom_id` (an OpenAI Batch line), else None.
    Integers are written in decimal; anything else is no identifier."""
    if not isinstance(value, dict):
        return None
    if id_field is not None:
        found = _id_text(value.get(id_field))
        if found is None:
            raise Rejected(RejectReason.MISSING_ID, f"no string or integer {id_field!r} field")
        return found
    for name in ("id", "custom_id"):
        found = _id_text(value.get(name))
        if found is not None:
            return found
    return None


#: The longest input id kept: ids are keys for humans and joins; a longer one is a column mistaken for an id.
_MAX_ID_CHARS = 1024


def _id_text(raw: object) -> str | None:
    if isinstance(raw, bool):
        return None
    if isinstance(raw, int):
        return str(raw)
    if isinstance(raw, str) and raw and len(raw) <= _MAX_ID_CHARS:
        return raw
    return None


def check_batch_sampling(body: Mapping[str, object], run_params: Mapping[str, object]) -> None:
    """Refuse an OpenAI Batch request whose sampling differs from the run's (Rejected
    sampling_differs, naming the field and both values): one run, one recipe, one
    fingerprint. A field the line repeats with the run's own value is fine; `n` > 1 asks for
    --samples; the model is not sampling (the run's model answers)."""
    for name, value in body.items():
        if name in _BATCH_NOT_SAMPLING or (name == "stream" and not value):
            continue
        if name == "n":
            if value != 1:
                raise Rejected(RejectReason.SAMPLING_DIFFERS, f"n={value!r}: use --samples {value} on the run")
            continue
        ours = run_params.get(name)
        if name == "max_completion_tokens" and ours is None:
            ours = run_params.get("max_tokens")
        if ours != value:
            shown = "unset" if name not in run_params and ours is None else repr(ours)
            raise Rejected(RejectReason.SAMPLING_DIFFERS,
                           f"{name}={value!r}, the run's is {shown}: enqueue such lines into a run made "
                           f"with that setting")


def _regenerate(conv: Conversation, index: int) -> Item:
    msgs = conv.messages
    picked: list[ChatMessage] = []
    cut = has_user = False
    i = 0
    while i < len(msgs):
        m = msgs[i]
        i += 1
        if m["role"] == "system" or m["role"] == "user":
            picked.append(m)
            has_user = has_user or m["role"] == "user"
        elif m["role"] == "assistant" and "tool_calls" in m:
            if not has_user:
                break  # a call nobody asked for: nothing to regenerate (tool_turn_first below)
            results = _results_of(m, msgs, i)
            if results is None:
                cut = True
                break
            picked.append(m)
            picked.extend(results)
            i += len(results)
    if not has_user:
        raise Rejected(RejectReason.TOOL_TURN_FIRST, "a tool call comes before any user turn")
    item = _item(Mode.REGENERATE, index, None, picked, conv.tools)
    if cut:
        item["note"] = STOPPED_AT_TOOL_TURN
    return item


def _results_of(call: ChatMessage, msgs: tuple[ChatMessage, ...], start: int) -> list[ChatMessage] | None:
    """The tool messages at START answering CALL's tool calls, one each (in any order); None
    when they do not (a result missing, or one answering another call): such a turn cannot be
    replayed, so the conversation is cut before it."""
    want = sorted(c["id"] for c in call["tool_calls"])
    end = start
    while end < len(msgs) and msgs[end]["role"] == "tool":
        end += 1
    results = list(msgs[start:end])
    if sorted(m.get("tool_call_id") or "" for m in results) != want:
        return None
    return results


def _item(mode: Mode, index: int, turn: int | None, messages: list[ChatMessage], tools: list[ToolSpec] | None) -> Item:
    item: Item = {
        "key": item_key(mode, messages, tools),
        "index": index,
        "turn": turn,
        # The contract still types an item's messages as plain dicts, as the consumer reads them.
        "messages": cast(list[dict[str, Any]], messages),
    }
    if tools is not None:
        item["tools"] = tools
    return item


def answer_lengths(conv: Conversation) -> list[int]:
    """Characters of the original assistant answer to each user turn (0 where none)."""
    out: list[int] = []
    for m in conv.messages:
        if m["role"] == "user":
            out.append(0)
        elif m["role"] == "assistant" and out:
            out[-1] += len(m.get("content") or "")
    return out


def estimate_cost(item: Item, answers: list[int]) -> int:
    """How long the item will keep a slot busy, for longest-first ordering: the length of the
    original answers it regenerates (the best predictor a dataset carries of the new ones),
    else its prompt length."""
    turn = item.get("turn")
    est = sum(answers) if turn is None else (answers[turn] if turn < len(answers) else 0)
    if est:
        return est
    return sum(len(m.get("content") or "") for m in item["messages"])
