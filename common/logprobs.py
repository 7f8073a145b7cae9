"""The teacher's distribution recorded with each answer (`producer enqueue --logprobs K`): part of
the run's settings (common/settings.py), so every consumer asks the same; the tables themselves
are stored as feature rows (common/features/logprobs.py).

Every answer's request asks vLLM for the log-probability of each generated token and the most
likely ones (`logprobs: true, top_logprobs: K + 1`, `request_fields`) with tokens named by id
(`return_tokens_as_token_ids`: `"token_id:123"`), so a table is aligned to the answer's completion
ids exactly. One more than K, because vLLM (0.32) lists the sampled token first and then the
most likely in rank order, cut at top_logprobs: when the sampled token is not among the K most
likely, a list of K would hold it and lose the K-th. A list of K + 1 always holds the true top K
(the top K + 1, or the sampled token and the top K), which the consumer sorts and keeps
(consumer/capture/tables.py). vLLM's `--max-logprobs` (20 by default) bounds K + 1: the
consumer's pre-flight refuses a larger K in one line. The engine's `--logprobs-mode` is not readable from its API, so a run states the mode it
expects (RUN_MODE: vLLM's default, the model's own log-softmax before any sampling processor)
and the pre-flight checks the probe's tables fit it (at most 0, summing to at most 1).
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any

from genqueue.common.errors import UserError


class LogprobsMode(StrEnum):
    """What the engine's values are (vLLM's --logprobs-mode)."""

    RAW_LOGPROBS = "raw_logprobs"  # the model's log-softmax, before any sampling processor (vLLM's default)
    RAW_LOGITS = "raw_logits"
    PROCESSED_LOGPROBS = "processed_logprobs"  # after temperature, penalties, top-k/top-p
    PROCESSED_LOGITS = "processed_logits"

    @property
    def probabilities(self) -> bool:
        """Whether the values are log-probabilities (at most 0, summing to at most 1)."""
        return self in (LogprobsMode.RAW_LOGPROBS, LogprobsMode.PROCESSED_LOGPROBS)


#: The mode a run's tables are stored as (vLLM's --logprobs-mode default).
RUN_MODE = LogprobsMode.RAW_LOGPROBS
#: The request fields --logprobs sets: --sampling-json may not set them too.
FIELDS = ("logprobs", "top_logprobs", "return_tokens_as_token_ids")
#: vLLM's answer naming a K above its --max-logprobs (a 400): "... max_logprobs ..." or
#: "... maximum allowed value ...".
MAX_LOGPROBS_WORDS = ("max_logprobs", "max-logprobs")


def asked(k: int) -> int:
    """The top_logprobs a run of --logprobs K asks for: one more (the module's docstring says why)."""
    return k + 1


def request_fields(k: int) -> dict[str, Any]:
    """What every request of a run of --logprobs K carries."""
    return {"logprobs": True, "top_logprobs": asked(k), "return_tokens_as_token_ids": True}


def check_logprobs(k: object, *, token_ids: bool, extra: dict[str, Any]) -> None:
    """UserError unless K (the run's --logprobs) can be asked: a whole number >= 1, with
    --token-ids (the tables are checked against the answer's ids and aligned to them) and none of
    FIELDS set by --sampling-json (EXTRA)."""
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise UserError(f"--logprobs takes the number of top entries a token's table keeps (>= 1), not {k!r}")
    if not token_ids:
        raise UserError("--logprobs needs --token-ids: each table's sampled ids are checked against the answer's "
                        "completion ids (a table that differs is refused, never stored), and a trainer aligns the "
                        "tables with them")
    clash = sorted(set(FIELDS) & set(extra))
    if clash:
        raise UserError(f"--sampling-json sets {', '.join(clash)}: --logprobs asks for them itself")
