"""Reading a chat completion the way every vLLM version writes it (pure, no I/O).

vLLM with a reasoning parser returns the thinking in `message.reasoning` (current) or
`message.reasoning_content` (older); both names are read. Without a parser the thinking
arrives inline as `<think>…</think>` at the start of `content`; an opening tag with no
closing one means the token budget ran out inside the thinking.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

OPEN, CLOSE = "<think>", "</think>"

#: Outcomes recorded per turn. NO_ANSWER: the model stopped by itself with thinking and no
#: answer (a reasoning parser that took a non-thinking model's whole reply as thinking).
FINISHED, CUT_IN_THINKING, CUT_IN_ANSWER, NO_ANSWER = "finished", "cut_in_thinking", "cut_in_answer", "no_answer"


@dataclass(slots=True)
class Turn:
    """One assistant answer, split into its parts."""

    content: str
    reasoning: str | None
    reasoning_form: str  # "field", "inline" or "none"
    tool_calls: list[dict[str, Any]]
    finish_reason: str | None
    usage: dict[str, Any]
    model: str | None
    raw_content: str = ""  # content as the server sent it, before any <think> split

    @property
    def outcome(self) -> str:
        empty = not self.content.strip() and not self.tool_calls
        if self.finish_reason != "length":
            return NO_ANSWER if empty and self.reasoning else FINISHED
        return CUT_IN_THINKING if empty else CUT_IN_ANSWER


def split_inline(content: str) -> tuple[str, str | None, bool]:
    """Split `<think>…</think>answer` into (answer, thinking, closed). Thinking is None when
    there is no tag; closed is False when the tag never closed (cut inside the thinking)."""
    stripped = content.lstrip()
    if stripped.startswith(OPEN):
        body = stripped[len(OPEN):]
        end = body.find(CLOSE)
        if end < 0:
            return "", body.strip("\n"), False
        return body[end + len(CLOSE):].lstrip("\n"), body[:end].strip("\n"), True
    # Some templates open the thinking in the prompt, so only the closing tag comes back.
    end = content.find(CLOSE)
    if end >= 0 and OPEN not in content[:end]:
        return content[end + len(CLOSE):].lstrip("\n"), content[:end].strip("\n"), True
    return content, None, True


def parse_completion(resp: dict[str, Any], *, think_opened: bool = False) -> Turn:
    """Turn a /v1/chat/completions response body into a Turn.

    think_opened: the server's chat template opens `<think>` in the prompt (learned by the
    consumer's probe), so a reply with no tag at all that was cut by the budget is all thinking.
    """
    choices = resp.get("choices") or [{}]
    choice = choices[0]
    msg = choice.get("message") or {}
    content = raw = msg.get("content") or ""
    reasoning = msg.get("reasoning")
    if reasoning is None:
        reasoning = msg.get("reasoning_content")
    form = "field" if reasoning is not None else "none"
    if reasoning is None:
        answer, thinking, _closed = split_inline(content)
        if thinking is not None:
            content, reasoning, form = answer, thinking, "inline"
        elif think_opened and choice.get("finish_reason") == "length" and content:
            content, reasoning, form = "", content, "inline"
    usage = dict(resp.get("usage") or {})
    details = usage.pop("completion_tokens_details", None) or {}
    usage.pop("prompt_tokens_details", None)
    if details.get("reasoning_tokens") is not None:
        usage["reasoning_tokens"] = details["reasoning_tokens"]
    return Turn(
        content=content,
        raw_content=raw,
        reasoning=reasoning,
        reasoning_form=form,
        tool_calls=list(msg.get("tool_calls") or []),
        finish_reason=choice.get("finish_reason"),
        usage=usage,
        model=resp.get("model"),
    )
