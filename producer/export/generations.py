"""A result record as the generations that made it (pure, no I/O): one per request the target
answered, each with the history exactly as the run sent it to the server.

A record of a single-turn mode (first, last, each) is one generation: its `messages` are the
prompt, its `content`/`reasoning`/`tool_calls` the answer. A `regenerate` record is one
generation per entry of `turns`: the k-th turn answered the k-th assistant message of
`messages`, and the messages before that one are what the server was sent for it (earlier
answers with or without their thinking as `--history-reasoning` said, tool results as spliced:
the consumer appends to one history and records it, consumer/answer/generate.py). A
tool-calling turn is one generation per request: the call, then each answer after its results.

The answer carries its thinking as `reasoning_content` (the field reasoning models' chat
templates read), whatever went back into the history.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import cast

from genqueue.common.contracts import ChatMessage, Outcome
from genqueue.common.records import ResultRecord, SpecFigures, TokenIds, Usage, full_prompts

#: Outcomes whose answer never ended on its own.
UNCLOSED = frozenset({Outcome.CUT_IN_THINKING, Outcome.NO_ANSWER})


@dataclass(frozen=True, slots=True)
class Generation:
    """One answer the target generated, with the request it answered."""

    index: int  # the record's k-th generation, from 0
    turn: int | None  # the user turn it answers (None: a record that names none)
    step: int  # its place after tool results within the user turn (0: the turn's first answer)
    history: list[ChatMessage]  # the messages the server was sent, as sent
    answer: ChatMessage  # the answer, its thinking as reasoning_content
    outcome: str | None
    usage: Usage
    token_ids: TokenIds | None  # as recorded (a regenerate turn's prompt may be shared)
    prompt_ids: list[int] | None  # the whole prompt the engine rendered, when recorded
    spec: SpecFigures | None = None  # its speculative-decoding figures, when the engine returned them

    @property
    def unclosed(self) -> bool:
        """The answer never ended on its own: no closing think tag may be written for it."""
        return self.outcome in UNCLOSED


def single_answer(rec: ResultRecord) -> ChatMessage:
    """The answer of a record without turns (one generation), as a chat message: its content,
    its thinking as reasoning_content, its tool calls. The one spelling export's conversations
    (formats/) and generations share."""
    answer: ChatMessage = {"role": "assistant", "content": rec.get("content") or ""}
    if rec.get("reasoning") is not None:
        answer["reasoning_content"] = rec["reasoning"]
    if rec.get("tool_calls"):
        answer["tool_calls"] = rec["tool_calls"]
    return answer


def answer_outcomes(rec: ResultRecord, gens: list[Generation]) -> list[str]:
    """Each answer's fate, for GENS = generations(REC): `finished` when it and every answer
    before it finished, else the first outcome that was not (a generation that names none takes
    the record's, `unknown` for a `partial` one). The one rule that decides which answers a
    dataset holds: generation rows (genrows.py), `tokens` rows (tokens.to_tokens) and every
    count of them go by it, so text and token rows hold the same answers under the same ids."""
    outcome = str(rec.get("outcome") or "unknown")
    fallback = outcome if outcome != Outcome.PARTIAL.value else "unknown"
    out: list[str] = []
    first_bad: str | None = None
    for g in gens:
        own = g.outcome or fallback
        out.append(first_bad or own)
        if first_bad is None and own != Outcome.FINISHED.value:
            first_bad = own
    return out


def generations(rec: ResultRecord, *, prompt_ids: bool = True) -> list[Generation]:
    """REC's generations, in the order they were made. Raises ValueError when a regenerate
    record's token ids do not chain (an answer sharing more prompt ids than the one before had).
    Without PROMPT_IDS no whole prompt is rebuilt (each prompt_ids None, nothing raised): the
    text rows need none (genrows.py)."""
    return list(_generations(rec, prompt_ids))


def _generations(rec: ResultRecord, with_ids: bool) -> Iterator[Generation]:
    # The contract types a record's messages as the consumer builds them: OpenAI chat messages.
    messages = cast(list[ChatMessage], rec.get("messages") or [])
    turns = rec.get("turns")
    if turns is None:
        ids = rec.get("token_ids")
        yield Generation(0, rec.get("turn"), 0, list(messages), single_answer(rec), rec.get("outcome"),
                         rec.get("usage") or {},
                         ids, ids["prompt"] if ids is not None and with_ids else None, rec.get("spec"))
        return
    has_ids = with_ids and any(t.get("token_ids") is not None for t in turns)
    prompts = full_prompts(turns) if has_ids else [None] * len(turns)
    k = 0
    for i, msg in enumerate(messages):
        if msg.get("role") != "assistant" or k >= len(turns):
            continue
        entry = turns[k]
        answer = cast(ChatMessage, {n: v for n, v in msg.items() if n != "reasoning_content"})
        if entry.get("reasoning") is not None:
            answer["reasoning_content"] = entry["reasoning"]
        yield Generation(k, entry.get("turn"), entry.get("step", 0), messages[:i], answer, entry.get("outcome"),
                         entry.get("usage") or {}, entry.get("token_ids"), prompts[k], entry.get("spec"))
        k += 1
