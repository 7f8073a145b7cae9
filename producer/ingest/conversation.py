"""The normalised conversation: what `convert` makes of a record and `items` cuts into work.

Its own module so that both depend on it and neither on the other.
"""

from __future__ import annotations

from dataclasses import dataclass

from genqueue.common.contracts import ChatMessage, ToolSpec


@dataclass(slots=True, frozen=True)
class Conversation:
    """A normalised conversation: OpenAI chat messages, every content a string (convert.py).
    Treat it and its dicts as read-only: items share them."""

    messages: tuple[ChatMessage, ...]
    tools: list[ToolSpec] | None

    def text_chars(self) -> int:
        """Characters of all message contents plus tool call arguments."""
        total = 0
        for m in self.messages:
            total += len(m["content"] or "")
            calls = m.get("tool_calls")
            if calls:
                total += sum(len(c["function"]["arguments"]) for c in calls)
        return total
