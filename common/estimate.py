"""The run's output tokens as the input says (pure arithmetic, no I/O): each item's original
assistant answer(s), the ones it regenerates (all of a conversation's in regenerate mode, its own
turn's otherwise), in characters, at CHARS_PER_TOKEN characters a token (the usual figure for
English text with a BPE tokenizer; code and other languages run denser, so it is a rough guide,
shown beside the tokens actually generated). An item with no original answer counts as the mean
of those with one: a dataset of bare prompts has no estimate (None).
"""

from __future__ import annotations

from genqueue.common.contracts import Item

#: Characters a token, for the estimate from the original answers.
CHARS_PER_TOKEN = 4.0


def output_chars(item: Item, answers: list[int]) -> int:
    """Characters of the original answers ITEM regenerates (ANSWERS: per user turn, as
    items.answer_lengths gives them); 0 when the input has none."""
    turn = item.get("turn")
    if turn is None:
        return sum(answers)
    return answers[turn] if 0 <= turn < len(answers) else 0


def estimated_tokens(chars: int, items: int, answered: int) -> int | None:
    """Output tokens of ITEMS items, ANSWERED of which have original answers of CHARS characters
    in all; None when none has one."""
    if not answered:
        return None
    return round(chars / CHARS_PER_TOKEN * items / answered)
