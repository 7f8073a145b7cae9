"""What a consumer can know of the engine a capture was made by, for the capture's manifest:
the vLLM version, the model's revision and its chat template's hash.

- vllm_version: the engine's own `GET /version` (`{"version": ...}`; the stand-in answers it too).
- revision: from the model's `root` in `GET /v1/models` (the folder or hub id vLLM loaded): a
  folder in the hub cache is a snapshot named by its commit; a hub id resolves through the hub
  cache's refs/main on this node. A plain folder has no revision: empty.
- chat_template_hash: sha256 (first 16 hex) of the chat template in the model's folder
  (`chat_template.jinja`, else tokenizer_config.json's `chat_template`, a string or a list of
  named templates), when that folder is on this node; empty when it is not. vLLM does not say
  which template it renders with: an engine started with `--chat-template FILE` is not seen
  here (`producer parity` compares the rendered ids instead).

The manifest's identity includes all three, so consumers of one run whose engines differ in any
make two captures: the output keeps the first one's manifest and refuses the other's
(FeatureManifestConflictError), and readers refuse a shard of another capture (capture_entries).
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import threading
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from genqueue.common.capture_model import hub_cache
from genqueue.consumer.answer.faults import BadCaptureError

log = logging.getLogger(__name__)

#: Seconds a pre-flight probe may take: it asks for a short answer, but a thinking model may think a while.
PROBE_TIMEOUT = 300.0

_COMMIT = re.compile(r"[0-9a-f]{40}")


@dataclass(frozen=True, slots=True)
class EngineFacts:
    """The engine's vLLM version, the model's revision and its chat template's hash ("": unknown)."""

    vllm_version: str = ""
    revision: str = ""
    chat_template_hash: str = ""


def model_folder(root: str) -> Path | None:
    """The folder ROOT (vLLM's model root) names on this node: itself, or for a hub id the
    snapshot refs/main names in the hub cache; None when neither is here."""
    here = Path(root).expanduser()
    if here.is_dir():
        return here
    if root.count("/") == 1:
        repo = hub_cache() / f"models--{root.replace('/', '--')}"
        try:
            commit = (repo / "refs" / "main").read_text().strip()
        except OSError:
            return None
        snapshot = repo / "snapshots" / commit
        return snapshot if snapshot.is_dir() else None
    return None


def revision_of(folder: Path | None) -> str:
    """The commit of a hub cache snapshot FOLDER (its name); "" for any other folder."""
    if folder is not None and folder.parent.name == "snapshots" and _COMMIT.fullmatch(folder.name):
        return folder.name
    return ""


def template_hash(folder: Path | None) -> str:
    """sha256 (16 hex) of the chat template in FOLDER; "" when it holds none."""
    if folder is None:
        return ""
    try:
        text = (folder / "chat_template.jinja").read_text()
    except OSError:
        try:
            config = json.loads((folder / "tokenizer_config.json").read_text())
        except (OSError, ValueError):
            return ""
        template: Any = config.get("chat_template") if isinstance(config, dict) else None
        if not template:
            return ""
        text = template if isinstance(template, str) else json.dumps(template, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


class EngineFactsReader:
    """The facts of ENDPOINT's models, read once per model (blocking: called from the capture
    thread) and kept."""

    def __init__(self, endpoint: str, timeout: float = PROBE_TIMEOUT) -> None:
        self.endpoint = endpoint.rstrip("/")
        self.base = self.endpoint.removesuffix("/v1")
        self.timeout = timeout
        self._known: dict[str, EngineFacts] = {}
        self._lock = threading.Lock()

    def _get(self, url: str) -> Any:
        try:
            with urllib.request.urlopen(url, timeout=self.timeout) as resp:
                return json.loads(resp.read())
        except (OSError, ValueError) as e:
            raise BadCaptureError(f"the engine's {url.rsplit('/', 1)[-1]} could not be read for the capture's "
                                  f"manifest: {e}") from None

    def of(self, model: str) -> EngineFacts:
        """MODEL's facts. Raises BadCaptureError when the engine does not answer /version or
        /v1/models (a manifest of unknown facts would split the capture)."""
        with self._lock:
            known = self._known.get(model)
            if known is not None:
                return known
            version = self._get(f"{self.base}/version")
            models = self._get(f"{self.endpoint}/models")
            roots = [m.get("root") for m in (models.get("data") or []) if isinstance(m, dict) and m.get("id") == model]
            root = roots[0] if roots and isinstance(roots[0], str) else model
            folder = model_folder(root)
            facts = EngineFacts(str(version.get("version") or "") if isinstance(version, dict) else "",
                                revision_of(folder), template_hash(folder))
            log.info("capture of model %s: vLLM %s, revision %s, chat template %s", model, facts.vllm_version or "?",
                     facts.revision or "(a local folder)", facts.chat_template_hash or "(not on this node)")
            self._known[model] = facts
            return facts
