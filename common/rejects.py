"""The stable names of every reason a record can be rejected for, and the exception."""

from __future__ import annotations

from genqueue.common.errors import GenqueueError

REJECT_REASONS: tuple[str, ...] = (
    "invalid_json",  # reader: not JSON
    "invalid_unicode",  # reader or convert: not UTF-8, or a lone UTF-16 surrogate
    "record_too_large",  # reader: longer than max_record_bytes
    "not_object",
    "no_conversation",
    "empty_conversation",
    "unknown_role",
    "missing_role",
    "empty_message",
    "non_text_message",
    "no_user_turn",
    "invalid_tools",
    "too_long",  # producer: over the user's character limit
    "tool_turn_first",  # regenerate mode: a tool call comes before any user turn
)
"""Every reason a record can be rejected for; stable names, written to the rejects file."""


class Rejected(GenqueueError):
    """A record that cannot become work items; ``reason`` is one of REJECT_REASONS."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail
