"""Token ids kept once per conversation: share_prompts and full_prompts give back every
answer's whole prompt, whatever the histories have in common."""

from __future__ import annotations

from typing import Any

import pytest

from genqueue.common.records import TurnRecord, full_prompts, share_prompts


def turn(k: int, prompt: list[int] | None, **ids: Any) -> TurnRecord:
    t: dict[str, Any] = {"turn": k, "content": "", "reasoning": None, "reasoning_form": "none",
                         "finish_reason": "stop", "outcome": "finished", "usage": {}, "model": "m"}
    if prompt is not None:
        t["token_ids"] = {"prompt": prompt, "completion": [7, 7], **ids}
    return t  # type: ignore[return-value]


@pytest.mark.parametrize("prompts", [
    [[1, 2, 3], [1, 2, 9, 4, 5], [1, 2, 9, 4, 5, 6, 6]],  # each history begins with most of the last
    [[1, 2, 3], [1, 2, 3, 4], [8]],  # a whole prompt kept, then nothing shared
    [[1, 2], None, [1, 2, 3]],  # an answer without ids: the next one shares nothing
    [[5], [5]],
])
def test_shared_prompts_give_back_every_whole_prompt(prompts: list[list[int] | None]) -> None:
    turns = [turn(k, p) for k, p in enumerate(prompts)]
    stored = share_prompts(turns)
    assert full_prompts(stored) == prompts
    assert full_prompts(share_prompts(stored)) == prompts  # sharing what is stored shared is a no-op
    assert [t.get("token_ids", {}).get("completion") for t in stored] == [
        [7, 7] if p is not None else None for p in prompts]
    assert turns[0].get("token_ids", {}).get("prompt") == prompts[0]  # the turns given are not changed


def test_the_history_is_kept_once() -> None:
    history = list(range(1000))
    prompts = [history[:100] + [0], history[:400] + [0], history + [0]]
    stored = share_prompts([turn(k, p) for k, p in enumerate(prompts)])
    assert [t["token_ids"].get("prompt_shared", 0) for t in stored] == [0, 100, 400]
    assert sum(len(t["token_ids"]["prompt"]) for t in stored) == 101 + 301 + 601


def test_a_broken_chain_is_refused() -> None:
    with pytest.raises(ValueError, match="shares 5 prompt ids"):
        full_prompts([turn(0, [1, 2]), turn(1, [3], prompt_shared=5)])
