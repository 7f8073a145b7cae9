"""Parity with the engine (pure, no I/O): each generation's prompt rendered again with the
model's own tokenizer and chat template, compared id for id with the `prompt_token_ids` the
engine recorded for it (runs made with --token-ids).

What drifts: the template (another revision, the server's --chat-template), a BOS token added
twice, thinking kept or dropped. So each generation is rendered as vLLM 0.32's chat endpoint
renders a request (vllm/renderers/hf.py, vllm/entrypoints/openai/chat_completion/protocol.py):

- the messages as vLLM reads them (`request_conversation`): role, content as a string, the
  name, tool calls with their arguments parsed into objects, a tool result's call id, and the
  thinking under both `reasoning` and `reasoning_content`;
  every other field is dropped;
- the chat template (the request's `chat_template`, else the server's --chat-template, else
  the tokenizer's) applied with the record's `tools`, `add_generation_prompt` (default true),
  `continue_final_message`, and the record's `chat_template_kwargs` over the server's defaults,
  to text;
- the text tokenized with `add_special_tokens` as the request said (vLLM's default: false:
  the template writes the special tokens).

The rendering itself is a Renderer (hf_render.py holds transformers'); this module compares.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from genqueue.common.records import ResultRecord
from genqueue.producer.export.generations import generations

#: Tokens of context shown each side of the first difference.
CONTEXT_TOKENS = 8
#: Mismatches kept with their detail (the rest are counted): a report stays readable.
MAX_SHOWN = 50

Decode = Callable[[Sequence[int]], str]


@dataclass(frozen=True, slots=True)
class RenderRequest:
    """What the server's chat endpoint rendered one generation's prompt from."""

    conversation: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    chat_template: str | None  # the request's own (None: the server's, else the tokenizer's)
    template_kwargs: dict[str, Any]  # add_generation_prompt, continue_final_message, chat_template_kwargs
    add_special_tokens: bool


class Renderer(Protocol):
    """A tokenizer with its chat template: renders a request to ids, and decodes ids to text."""

    def render(self, request: RenderRequest) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


@dataclass(frozen=True, slots=True)
class Mismatch:
    """One generation whose rendered prompt differs from the ids the engine recorded."""

    key: str
    id: str | None  # the input record's own id, when it had one
    generation: int  # the record's k-th generation, from 0
    turn: int | None
    position: int  # the first differing position
    rendered_len: int
    recorded_len: int
    rendered_text: str  # the text around the position, decoded from each side
    recorded_text: str
    hint: str

    def line(self) -> str:
        """One line naming the row, the position and what each side holds there."""
        where = self.id or self.key
        turn = "" if self.turn is None else f" turn {self.turn}"
        return (f"{where} generation {self.generation}{turn}: differs at token {self.position:,} "
                f"(rendered {self.rendered_len:,} ids, recorded {self.recorded_len:,}): "
                f"rendered {self.rendered_text!r}, recorded {self.recorded_text!r}"
                + (f"; {self.hint}" if self.hint else ""))


@dataclass
class ParityReport:
    """What a parity check found over a run's records."""

    run: str = ""
    tokenizer: str = ""
    records: int = 0  # answered records checked (one per key)
    generations: int = 0  # their generations with recorded prompt ids
    matched: int = 0
    mismatched: int = 0
    mismatched_records: int = 0
    without_ids: int = 0  # generations that kept no prompt ids (checked nothing)
    errors: int = 0  # error records (no answer: nothing to check)
    unreadable: int = 0  # records whose rendering failed (the template raised), or whose ids do not chain
    mismatches: list[Mismatch] = field(default_factory=list)  # the first MAX_SHOWN, in the run's order
    problems: list[str] = field(default_factory=list)  # the first MAX_SHOWN unreadable ones, a line each

    def to_dict(self) -> dict[str, object]:
        return asdict(self)

    def add(self, found: RecordParity) -> None:
        self.records += 1
        self.generations += found.checked
        self.matched += found.checked - len(found.mismatches)
        self.mismatched += len(found.mismatches)
        self.mismatched_records += bool(found.mismatches)
        self.without_ids += found.without_ids
        room = MAX_SHOWN - len(self.mismatches)
        self.mismatches += found.mismatches[:max(room, 0)]
        if found.problem is not None:
            self.unreadable += 1
            if len(self.problems) < MAX_SHOWN:
                self.problems.append(found.problem)


@dataclass(frozen=True, slots=True)
class RecordParity:
    """One record's check: generations compared, those that differ, those without ids."""

    checked: int = 0
    mismatches: list[Mismatch] = field(default_factory=list)
    without_ids: int = 0
    problem: str | None = None  # why the record could not be checked


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first position where A and B differ (one ending early counts), or None when equal."""
    n = min(len(a), len(b))
    if list(a[:n]) != list(b[:n]):
        return next(i for i in range(n) if a[i] != b[i])
    return None if len(a) == len(b) else n


#: The markers a thinking span opens and closes with in the prompts a template renders.
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
_THINKING = re.compile(re.escape(THINK_OPEN) + r".*?(?:" + re.escape(THINK_CLOSE) + r"|$)", re.DOTALL)


def hint(rendered: Sequence[int], recorded: Sequence[int], position: int, decode: Decode) -> str:
    """A guess at the cause, from the shape of the difference (empty when none fits). Thinking
    is blamed only when it is what differs: the difference opens at a thinking marker or inside a
    thinking span, or the two prompts are the same text once their thinking is taken out."""
    if position == 0 and len(recorded) == len(rendered) + 1 and list(recorded[1:]) == list(rendered):
        return f"the engine's prompt has one token more at the start ({decode(recorded[:1])!r}): a BOS added twice?"
    if position == 0 and len(rendered) == len(recorded) + 1 and list(rendered[1:]) == list(recorded):
        return f"the rendered prompt has one token more at the start ({decode(rendered[:1])!r}): a BOS added twice?"
    ours, theirs = decode(rendered), decode(recorded)
    if _thinking_differs(rendered, recorded, position, decode, ours, theirs):
        mine, engine = ours.count(THINK_OPEN), theirs.count(THINK_OPEN)
        if mine > engine:
            return "thinking rendered here that the engine's prompt does not hold (enable_thinking, --history-reasoning?)"
        if engine > mine:
            return "the engine's prompt holds thinking not rendered here (enable_thinking, --history-reasoning?)"
        return "the thinking differs, kept on one side and changed on the other (enable_thinking, --history-reasoning?)"
    if ours == theirs:
        return "the same text tokenized into other ids: the tokenizer differs (another revision or model?)"
    if position == min(len(rendered), len(recorded)):
        return "one prompt is the other's beginning (the generation prompt?)"
    return "the chat template or the tokenizer differs (another revision, another model's, or the server's --chat-template?)"


def _thinking_differs(rendered: Sequence[int], recorded: Sequence[int], position: int, decode: Decode,
                      ours: str, theirs: str) -> bool:
    """Whether thinking is what differs between the two prompts (ours and theirs: their text)."""
    for ids in (rendered, recorded):
        if decode(ids[position:]).lstrip().startswith((THINK_OPEN, THINK_CLOSE)):
            return True
        before = decode(ids[:position])
        if before.rfind(THINK_OPEN) > before.rfind(THINK_CLOSE):  # inside a thinking span
            return True
    return ours != theirs and _without_thinking(ours) == _without_thinking(theirs)


def _without_thinking(text: str) -> str:
    return " ".join(_THINKING.sub(" ", text).split())


def around(ids: Sequence[int], position: int, decode: Decode, context: int = CONTEXT_TOKENS) -> str:
    """The text of IDS around POSITION: CONTEXT tokens before it, a `|` at it, CONTEXT after."""
    lo = max(0, position - context)
    return decode(ids[lo:position]) + "|" + decode(ids[position:position + context])


def request_conversation(history: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """HISTORY as vLLM's chat endpoint hands it to the template (see the module docstring)."""
    out: list[dict[str, Any]] = []
    for msg in history:
        m: dict[str, Any] = {"role": msg.get("role"), "content": _text(msg.get("content"))}
        if isinstance(msg.get("name"), str):
            m["name"] = msg["name"]
        if msg.get("role") == "assistant":
            calls = msg.get("tool_calls")
            if isinstance(calls, list) and calls:
                m["tool_calls"] = [_call(c) for c in calls]
            reasoning = msg.get("reasoning")
            if reasoning is None:
                reasoning = msg.get("reasoning_content")
            if reasoning is not None:
                m["reasoning"] = m["reasoning_content"] = reasoning
        elif msg.get("role") == "tool" and "tool_call_id" in msg:
            m["tool_call_id"] = msg["tool_call_id"]
        out.append(m)
    return out


def render_request(history: Iterable[Mapping[str, Any]], tools: list[dict[str, Any]] | None,
                   sampling: Mapping[str, Any], server_kwargs: Mapping[str, Any] | None = None) -> RenderRequest:
    """The request one generation was rendered from: its HISTORY and TOOLS, with the request
    fields the record's SAMPLING says were sent, over the server's default template kwargs."""
    kwargs: dict[str, Any] = dict(server_kwargs or {})
    request_kwargs = sampling.get("chat_template_kwargs")
    if isinstance(request_kwargs, Mapping):
        kwargs.update({k: v for k, v in request_kwargs.items() if v is not None})
    kwargs["add_generation_prompt"] = bool(sampling.get("add_generation_prompt", True))
    kwargs["continue_final_message"] = bool(sampling.get("continue_final_message", False))
    if sampling.get("reasoning_effort") is not None:
        kwargs["reasoning_effort"] = sampling["reasoning_effort"]
        kwargs.setdefault("enable_thinking", sampling["reasoning_effort"] != "none")
    template = sampling.get("chat_template")
    return RenderRequest(request_conversation(history), tools or None, template if isinstance(template, str) else None,
                         kwargs, bool(sampling.get("add_special_tokens", False)))


def check_record(rec: ResultRecord, renderer: Renderer, server_kwargs: Mapping[str, Any] | None = None
                 ) -> RecordParity:
    """REC's generations, each rendered again and compared with the prompt ids it recorded."""
    try:
        gens = generations(rec)
    except ValueError as e:
        return RecordParity(problem=f"{_name(rec)}: {e}")
    tools = rec.get("tools") or None
    sampling = rec.get("sampling") or {}
    checked = without = 0
    found: list[Mismatch] = []
    for gen in gens:
        if gen.prompt_ids is None:
            without += 1
            continue
        try:
            ids = renderer.render(render_request(gen.history, tools, sampling, server_kwargs))
        except Exception as e:  # noqa: BLE001 - a template that raises is this record's finding, not a crash
            return RecordParity(checked, found, without,
                                f"{_name(rec)} generation {gen.index}: the chat template raised "
                                f"{type(e).__name__}: {' '.join(str(e).split())}")
        checked += 1
        pos = first_difference(ids, gen.prompt_ids)
        if pos is None:
            continue
        decode = renderer.decode
        found.append(Mismatch(rec["key"], rec.get("id"), gen.index, gen.turn, pos, len(ids), len(gen.prompt_ids),
                              around(ids, pos, decode), around(gen.prompt_ids, pos, decode),
                              hint(ids, gen.prompt_ids, pos, decode)))
    return RecordParity(checked, found, without)


def _name(rec: ResultRecord) -> str:
    return rec.get("id") or rec["key"]


def _text(content: object) -> object:
    """A message's content as vLLM's string content format gives it: text parts joined by a
    newline; None becomes the empty string."""
    if content is None:
        return ""
    if isinstance(content, list):
        return "\n".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    return content


def _call(call: object) -> object:
    """A tool call with its arguments parsed into an object, as vLLM passes it to templates."""
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        return call
    fn = dict(call["function"])
    args = fn.get("arguments")
    if isinstance(args, str):
        try:
            fn["arguments"] = json.loads(args)
        except ValueError:
            pass  # vLLM refuses such a request; the template gets the string here
    return {**call, "function": fn}
