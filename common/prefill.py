"""A capture pass (`producer capture`): the target's hidden states of a finished run's answers
(`--capture-layers`), or the top-K log-probability tables of their generated tokens
(`--logprobs K`), made by a second, prefill-only request over the engine's own token ids.

The pass is a run of its own (NEW) whose items each name one feature row of the source run
(SRC): the answer's row id (`<key>`, or `<key>:<turn>[.<step>]` in mode regenerate, the names a
capture during generation gives) and its token ids (the prompt the engine rendered followed by
the ids it generated, as SRC's tokens export holds them). A consumer sends the ids as a
/v1/completions prompt with `max_tokens: 1` and `kv_transfer_params` (prompt only), checks the
captured ids are the ones it sent, and stores the row under that id, so `producer
export-features --run NEW --tokens <SRC's tokens export>` joins every row by id.

A --logprobs pass asks instead for `prompt_logprobs: K + 1` (PROMPT_FIELDS: vLLM's list per
prompt position, None first, each a dict id -> {logprob, rank, decoded_token} holding the
position's own token and the most likely ones; K + 1 as in generation, common/logprobs.py) and
keeps the positions of the answer's generated tokens (the item's `completion` last ids): the
same table rows, under the same row ids, an in-generation --logprobs run stores, so
`producer export-logprobs --run NEW --tokens <SRC's tokens export>` joins every row by id.

NEW's settings hold where the rows come from and how they were chosen (`RunSettings.prefill`).
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from genqueue.common.capture import CaptureDtype
from genqueue.common.errors import UserError
from genqueue.common.logprobs import asked

#: The id bytes a stored row holds beside its hidden states (token_ids, int64 per token).
ID_BYTES = struct.calcsize("<q")
#: The fp8 scale a stored row holds per token (float32).
SCALE_BYTES = struct.calcsize("<f")


#: What a prefill adds to its /v1/completions body: the prompt's hidden states, the prompt's alone
#: (genqueue's connector writes none for a request without kv_transfer_params).
PREFILL_FIELDS: dict[str, Any] = {"kv_transfer_params": {"include_output_tokens": False}}


def prompt_fields(k: int) -> dict[str, Any]:
    """What a --logprobs K pass's prefill adds to its /v1/completions body: the prompt's top
    asked(K) log-probabilities at every position, and the ids the engine scored
    (`prompt_token_ids`), checked to be those sent."""
    return {"prompt_logprobs": asked(k), "return_token_ids": True}


class PrefillChoice(StrEnum):
    """Which of SRC's rows a pass captures, in which order (`--capture-by`)."""

    ALL = "all"  # every finished answer with token ids, in SRC's order
    ACCEPTANCE = "acceptance"  # the answers the drafter handled worst first (lowest acceptance rate)


@dataclass(frozen=True, slots=True)
class PrefillSettings:
    """A capture pass's source and choice: SOURCE, the run whose answers it captures; BY, the
    order rows were chosen in; BUDGET, the bytes of features asked for at most (None: no
    budget); HIDDEN_SIZE, the model's (None: not given, then no budget); and what the choice
    came to when the pass was enqueued: ROWS of SOURCE_ROWS rows, TOKENS tokens, BYTES bytes of
    features (None without a hidden size)."""

    source: str
    by: PrefillChoice = PrefillChoice.ALL
    budget: int | None = None
    hidden_size: int | None = None
    rows: int = 0
    source_rows: int = 0
    tokens: int = 0
    bytes: int | None = None

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "by", PrefillChoice(str(self.by)))
        except ValueError:
            raise UserError(f"unknown --capture-by {self.by!r}; choose one of {', '.join(PrefillChoice)}") from None
        if self.budget is not None and self.hidden_size is None:
            raise UserError("--capture-budget needs the model's hidden size: give --hidden-size, or --model-dir "
                            "(the folder with its config.json)")


def bytes_per_token(layers: int, hidden_size: int, dtype: CaptureDtype) -> int:
    """The bytes one token of a stored row takes: its LAYERS x HIDDEN_SIZE hidden states in
    DTYPE, its fp8 scale, its token id (a row's header, under 1 KB, is not counted)."""
    if dtype is CaptureDtype.FP8:
        return layers * hidden_size + SCALE_BYTES + ID_BYTES
    return layers * hidden_size * 2 + ID_BYTES


def prefill_key(row: str) -> str:
    """The item key (32 hex) of the pass's item for feature row ROW."""
    return hashlib.blake2b(f"prefill\x00{row}".encode(), digest_size=16).hexdigest()
