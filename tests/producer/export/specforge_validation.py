"""SpecForge's own validator for regenerated data, copied unchanged but for imports.

From sgl-project/SpecForge @ a6b6b0230009d15ec2a97a57384e6f53f0f96946: scripts/conversation_validation.py
(validate_conversation, has_think_marker) and scripts/validate_regenerated_data.py (validate_row).
MIT License, Copyright (c) 2025 sgl-project.
"""

# ruff: noqa
# mypy: ignore-errors
from typing import Any, Dict

def has_think_marker(content: str) -> bool:
    lowered = content.lower()
    return "<think>" in lowered or "</think>" in lowered


def validate_conversation(
    messages: Any,
    *,
    error_style: str = "validation",
) -> str | None:
    if not isinstance(messages, list) or not messages:
        if error_style == "regeneration":
            return "Missing or empty conversations list"
        return "conversations must be a non-empty list"

    expected_role = "user"
    saw_user = False
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            if error_style == "regeneration":
                return f"Invalid message at position {index}: expected object"
            return f"message {index} must be an object"
        role = message.get("role")
        content = message.get("content")
        if not isinstance(content, str) or not content.strip():
            if error_style == "regeneration":
                return (
                    f"Invalid message content at position {index}: "
                    "expected non-empty string"
                )
            return f"message {index} content must be a non-empty string"

        if role == "system" and not saw_user:
            continue
        if role not in {"user", "assistant"}:
            if error_style == "regeneration":
                return f"Invalid message role: {role}"
            return f"message {index} has unsupported role {role!r}"
        if role != expected_role:
            if error_style == "regeneration":
                if not saw_user and role == "assistant":
                    return "Data starts with an assistant message"
                return (
                    f"Invalid conversation role order at position {index}: "
                    f"expected {expected_role}, got {role}"
                )
            return f"message {index} expected role {expected_role!r}, got {role!r}"

        saw_user = True
        expected_role = "assistant" if role == "user" else "user"

    if not saw_user:
        if error_style == "regeneration":
            return "Data does not contain a user message"
        return "conversation has no user message"
    return None


def validate_row(
    row: Dict[str, Any],
    *,
    expect_non_reasoning: bool,
    expect_reasoning: bool = False,
    strict_think_markers: bool,
) -> int:
    """Validate one generated training row and return its assistant count."""
    row_id = row.get("id")
    if not isinstance(row_id, str) or not row_id.strip():
        raise ValueError("id must be a non-empty string")
    if row.get("status") != "success":
        raise ValueError("status must be 'success'")

    messages = row.get("conversations")
    conversation_error = validate_conversation(messages)
    if conversation_error is not None:
        raise ValueError(conversation_error)

    assistant_count = 0
    for index, message in enumerate(messages):
        role = message.get("role")
        if role != "assistant":
            continue

        content = message["content"]
        assistant_count += 1
        reasoning = message.get("reasoning_content")
        if reasoning is not None and not isinstance(reasoning, str):
            raise ValueError(
                f"assistant message {index} reasoning_content must be a string or null"
            )
        if expect_non_reasoning and reasoning and reasoning.strip():
            raise ValueError(
                f"assistant message {index} has non-empty reasoning_content"
            )
        if expect_reasoning and (
            not isinstance(reasoning, str) or not reasoning.strip()
        ):
            raise ValueError(f"assistant message {index} has empty reasoning_content")
        if strict_think_markers and has_think_marker(content):
            raise ValueError(f"assistant message {index} contains a thinking marker")
        if (
            strict_think_markers
            and isinstance(reasoning, str)
            and has_think_marker(reasoning)
        ):
            raise ValueError(
                f"assistant message {index} reasoning_content contains a thinking marker"
            )

    if assistant_count == 0:
        raise ValueError("conversation has no assistant message")
    if messages[-1].get("role") != "assistant":
        raise ValueError("conversation must end with an assistant message")
    return assistant_count
