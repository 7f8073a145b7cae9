"""The parity check's Renderer: a model's tokenizer loaded by transformers (the `parity` extra),
rendering a request as vLLM's chat endpoint does (parity.py says how) and decoding ids."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from genqueue.common.errors import UserError
from genqueue.producer.export.parity import RenderRequest

log = logging.getLogger(__name__)

#: What `pip install` gives the parity check its tokenizer.
EXTRA = "pip install 'genqueue[parity]'"
#: apply_chat_template's own parameters: a request's chat_template_kwargs never reach the
#: template under these names (vLLM refuses or drops them too).
_NOT_TEMPLATE_VARS = frozenset({"conversation", "tools", "documents", "chat_template", "tokenize", "return_dict",
                                "return_tensors", "padding", "truncation", "max_length", "tokenizer_kwargs",
                                "return_assistant_tokens_mask"})


class HfRenderer:
    """The tokenizer in a model's folder; TEMPLATE (the server's --chat-template) replaces its own."""

    def __init__(self, tokenizer: Any, template: str | None = None, where: str = "") -> None:
        self.tokenizer = tokenizer
        self.template = template
        self.where = where

    def render(self, request: RenderRequest) -> list[int]:
        kwargs = {k: v for k, v in request.template_kwargs.items() if k not in _NOT_TEMPLATE_VARS}
        text = self.tokenizer.apply_chat_template(request.conversation, tools=request.tools,
                                                  chat_template=request.chat_template or self.template,
                                                  tokenize=False, **kwargs)
        ids = self.tokenizer(text, add_special_tokens=request.add_special_tokens)["input_ids"]
        return list(ids)

    def decode(self, ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=False))


def load_renderer(tokenizer_dir: str, chat_template: str | None = None) -> HfRenderer:
    """The tokenizer in TOKENIZER_DIR (a model's folder, as the server was given it), with the
    template in the file CHAT_TEMPLATE instead of its own. UserError for a folder that holds
    no tokenizer, a template file that cannot be read, or transformers missing."""
    path = Path(tokenizer_dir)
    if not path.is_dir():
        raise UserError(f"--tokenizer {tokenizer_dir}: no such folder (give the model's folder, as the server "
                        "was given it)")
    template = _read_template(chat_template) if chat_template is not None else None
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # no "PyTorch was not found" banner
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise UserError(f"producer parity needs transformers to render the chat template: {EXTRA}") from None
    try:
        tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as e:  # noqa: BLE001 - transformers raises many kinds for a folder that is no tokenizer
        raise UserError(f"--tokenizer {tokenizer_dir}: transformers cannot load a tokenizer from it "
                        f"({type(e).__name__}: {' '.join(str(e).split())[:200]})") from None
    if template is None and not getattr(tok, "chat_template", None):
        raise UserError(f"--tokenizer {tokenizer_dir} has no chat template: give the server's with --chat-template")
    return HfRenderer(tok, template, str(path))


def _read_template(name: str) -> str:
    """The server's --chat-template: a file (vLLM also takes the template inline)."""
    path = Path(name)
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        if "{" in name:  # vLLM's --chat-template takes the template itself too
            return name
        raise UserError(f"--chat-template {name}: no such file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"--chat-template {name}: cannot be read ({e})") from None
