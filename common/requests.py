"""The request a run sends, built in one place from the run's settings (pure: no I/O).

A run's requests differ only by their messages, tools, the item's own seed and a truncation
retry's budget; everything else comes from the settings: the sampling fields (`--temperature`,
`--sampling-json`...), a request variant's fields merged over them (chat-template kwargs such as
`enable_thinking`, a reasoning effort: common/variants.py), and `return_token_ids` for a
`--token-ids` run, `logprobs`/`top_logprobs`/`return_tokens_as_token_ids` for a `--logprobs K` run
(common/logprobs.py); a `--capture` run's answers also ask the engine for their hidden states
(`kv_transfer_params`, `body(capture=True)`). `RequestShape` holds that part; its `fields` are what the producer checks an
OpenAI Batch line against (producer/ingest/sources.py), its `body` what the generator sends
(consumer/answer/generate.py) and the pre-flight probes (consumer/served.py), and its `sampling`
what a record says it was sent with (consumer/answer/records.py). `n` is never sent (one answer
per item: settings.RESERVED_FIELDS), the model is the one the consumer resolved.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from genqueue.common.logprobs import request_fields
from genqueue.common.settings import RunSettings
from genqueue.common.variants import Variant

__all__ = ["CAPTURE_FIELDS", "RequestShape", "item_seed"]

#: What an answer of a --capture run adds to its request: vLLM's KV connector then saves the
#: hidden states of the prompt and of the generated tokens but the last (which was never an
#: input), and names the file in the response's `kv_transfer_params.hidden_states_path`.
CAPTURE_FIELDS: dict[str, Any] = {"kv_transfer_params": {"include_output_tokens": True}}


@dataclass(frozen=True, slots=True)
class RequestShape:
    """What every chat completion request of one run (of one of its variants) carries besides
    its messages."""

    #: the run's sampling fields with the variant's merged over them (what records name `sampling`)
    sampling: dict[str, Any]
    #: --token-ids: every request asks for its prompt and completion ids (vLLM's return_token_ids)
    token_ids: bool = False
    #: --capture: the run's answers ask for their hidden states (CAPTURE_FIELDS)
    capture: bool = False
    #: --logprobs K: every request asks for each generated token's top-K log-probabilities
    logprobs: int | None = None

    @classmethod
    def of(cls, settings: RunSettings, variant: Variant | None = None) -> RequestShape:
        """The shape of SETTINGS' requests sent with VARIANT (None: the run's own)."""
        return cls(settings.request_params(variant), settings.token_ids, settings.capture is not None,
                   settings.logprobs)

    @property
    def max_tokens(self) -> Any:
        """The completion budget a request of this shape asks for (a variant may set its own)."""
        return self.sampling["max_tokens"]

    def fields(self) -> dict[str, Any]:
        """The body fields beside the model and messages that every request of this shape sends."""
        out = dict(self.sampling)
        if self.token_ids:
            out["return_token_ids"] = True
        if self.logprobs is not None:
            out.update(request_fields(self.logprobs))
        return out

    def sampling_of(self, seed: int | None) -> dict[str, Any]:
        """The sampling a request with the item's own SEED (None: none) is sent with."""
        return self.sampling if seed is None else {**self.sampling, "seed": seed}

    def body(self, model: str, messages: Sequence[Mapping[str, object]], *, tools: object = None,
             max_tokens: int | None = None, seed: int | None = None, capture: bool = False) -> dict[str, object]:
        """The request body for MODEL on MESSAGES: the shape's fields, then what is this
        request's own: a truncation retry's MAX_TOKENS, the item's SEED (one of several samples
        of a prompt), the item's TOOLS (when it has any), and for an answer of a --capture run
        and the pre-flight's capture probe (CAPTURE; not the other probes, whose hidden states
        nobody would read) the fields that ask for its hidden states."""
        body: dict[str, object] = {"model": model, "messages": messages, **self.fields()}
        if capture and self.capture:
            body.update(CAPTURE_FIELDS)
        if max_tokens is not None:
            body["max_tokens"] = max_tokens
        if seed is not None:
            body["seed"] = seed
        if tools:
            body["tools"] = tools
        return body


def item_seed(item: object) -> int | None:
    """The item's own request seed (one of several samples of a prompt), if it has one."""
    seed = item.get("seed") if isinstance(item, dict) else None
    return seed if isinstance(seed, int) and not isinstance(seed, bool) else None
