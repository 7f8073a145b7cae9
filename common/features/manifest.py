"""What a capture is: the one manifest beside a run's feature shards (pure).

Every shard's index and every row names the capture it belongs to by the manifest's digest, so a
reader can refuse features of another model, revision, layer set or dtype mixed into one output.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from typing import Any

from genqueue.common.errors import FeatureError, FeatureManifestConflictError
from genqueue.common.features.codec import FeatureDtype

#: The format of the manifest, the shards' indexes and the rows: its name and version.
FORMAT = "genqueue-features"
FORMAT_VERSION = "1"
#: How fp8 scales are shared: one per token across all its layers and hidden (speculators' way).
SCALE_PER_TOKEN = "token"


@dataclass(frozen=True, slots=True)
class FeatureManifest:
    """One capture's recipe. LAYER_IDS in the engine's numbering (vLLM's
    eagle_aux_hidden_state_layer_ids: k < L is HF's hidden_states[k], 0 the embeddings; L the
    last decoder layer's output before the final norm), in the order rows store them."""

    model: str
    revision: str
    layer_ids: tuple[int, ...]
    dtype: FeatureDtype
    hidden_size: int
    chat_template_hash: str
    vllm_version: str
    genqueue_version: str
    scale: str = SCALE_PER_TOKEN
    format: str = FORMAT
    format_version: str = FORMAT_VERSION

    def __post_init__(self) -> None:
        if not self.layer_ids or any(i < 0 for i in self.layer_ids) or len(set(self.layer_ids)) != len(self.layer_ids):
            raise FeatureError(f"a capture's layer ids are distinct and not negative: {list(self.layer_ids)}")
        if self.hidden_size < 1:
            raise FeatureError(f"a capture's hidden size is positive: {self.hidden_size}")

    @property
    def layers(self) -> int:
        return len(self.layer_ids)

    def to_json(self) -> bytes:
        """Canonical JSON (sorted keys, no spaces): the same manifest gives the same bytes."""
        body: dict[str, Any] = asdict(self)
        body["layer_ids"] = list(self.layer_ids)
        body["dtype"] = self.dtype.value
        return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()

    def identity(self) -> bytes:
        """The canonical JSON less the genqueue version: what makes two captures one. Consumers
        of two genqueue releases capturing one run make one capture (each record names the code
        that made it); the manifest stored keeps the version of the first to store it."""
        return identity_of(self.to_json())

    @property
    def digest(self) -> str:
        """sha256 of the identity, first 16 hex: what indexes and rows name the capture by."""
        return digest_of(self.identity())

    @classmethod
    def from_json(cls, raw: bytes) -> FeatureManifest:
        """A manifest from what to_json wrote. Raises FeatureError for anything else."""
        try:
            body = json.loads(raw)
            if body.get("format") != FORMAT:
                raise ValueError(f"not a {FORMAT} manifest")
            if body.get("format_version") != FORMAT_VERSION:
                raise ValueError(f"format version {body.get('format_version')!r}, this genqueue reads {FORMAT_VERSION}")
            fields = {**body, "layer_ids": tuple(int(i) for i in body["layer_ids"]),
                      "dtype": FeatureDtype(body["dtype"])}
            return cls(**fields)
        except FeatureError:
            raise
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise FeatureError(f"unreadable feature manifest: {e}") from None


def identity_of(manifest_json: bytes) -> bytes:
    """A manifest's canonical JSON less the genqueue version (hidden states' and tables' alike)."""
    body = json.loads(manifest_json)
    body.pop("genqueue_version", None)
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def digest_of(identity: bytes) -> str:
    """sha256 of a manifest's identity, first 16 hex: what shards, indexes and rows name a capture by."""
    return hashlib.sha256(identity).hexdigest()[:16]


def check_manifest(where: str, stored: bytes, manifest: FeatureManifest) -> None:
    """Raise FeatureManifestConflictError when the manifest STORED at WHERE is not MANIFEST."""
    if stored == manifest.to_json():
        return
    try:
        theirs = FeatureManifest.from_json(stored)
        if theirs.identity() == manifest.identity():
            return  # the same capture, stored by another genqueue release
        other = theirs.to_json().decode()
    except FeatureError:
        other = "an unreadable one"
    raise FeatureManifestConflictError(f"{where} holds another capture ({other}); this one is "
                                       f"{manifest.to_json().decode()}: capture into another run or output")
