"""`<output>/<run>/run.json`: what the output holds to re-create its run should Redis lose it.

Written by the producer when it creates a run, and again when the run's settings change or an
input source is added; read by the producer when the run is not in Redis. One JSON object:

    {"run": "data", "settings": {...}, "fingerprint": "...", "created_at": 1718000000.0,
     "version": "0.3.0", "fingerprints": [{"fingerprint": ..., "since": ..., "settings": {...}}],
     "sources": {"/data/x.jsonl": {<the summary of its last enqueue>}}, "written_at": ...,
     "output_host": "node-a", "shared_fs": "", "priority": 0}

`settings` and `fingerprint` are the run's current recipe; `fingerprints` every recipe it has
had, oldest first; `output_host` and `shared_fs` where a local output lives
(common/placement.py); `priority` the run's share of the fleet (`producer enqueue --priority`,
`producer priority`: not part of the recipe, so a run re-created from run.json keeps it; a
run.json written before it had one reads 0); `prompts` where the run's jobs keep their items
(`inline`, or `reference` once any enqueue of it used `--prompts reference`: absent reads
inline) and `packs` the packs its jobs by reference name, by pack number (as the run's pack
table in Redis, common/keepers/packs.py), so a run re-created after a Redis loss knows its packs.
The shards beside it hold every record's key, so the done and failed marks
can be rebuilt from them (producer/enqueue/reconcile.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, cast

import orjson

from genqueue.common.contracts import PromptMode
from genqueue.common.placement import Placement
from genqueue.common.settings import FingerprintEntry, RunSettings, fingerprint_entry
from genqueue.common.storage.base import OutputStore, StoreError
from genqueue.common.storage.names import run_settings_name


class RunFileError(StoreError):
    """A run.json that is not one (not JSON, or without the fields a run needs)."""


@dataclass(slots=True)
class RunFile:
    run: str
    settings: RunSettings
    created_at: float
    version: str
    fingerprints: list[FingerprintEntry]
    sources: dict[str, dict[str, Any]] = field(default_factory=dict)
    placement: Placement = field(default_factory=Placement)
    priority: int = 0
    prompts: PromptMode = PromptMode.INLINE
    packs: dict[int, str] = field(default_factory=dict)

    @property
    def fingerprint(self) -> str:
        return self.settings.fingerprint

    def to_json(self) -> bytes:
        return orjson.dumps({
            "run": self.run, "settings": self.settings.to_dict(), "fingerprint": self.fingerprint,
            "created_at": self.created_at, "version": self.version, "fingerprints": self.fingerprints,
            "sources": self.sources, "written_at": time.time(), **self.placement.fields(),
            "priority": self.priority, "prompts": self.prompts.value,
            "packs": {str(n): name for n, name in sorted(self.packs.items())},
        }, option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS)

    @classmethod
    def from_json(cls, raw: bytes, where: str) -> RunFile:
        """Parse run.json; StoreError naming WHERE when it is not one."""
        try:
            data = orjson.loads(raw)
            settings = RunSettings.from_dict(data["settings"])
            fingerprints: list[FingerprintEntry] = [
                cast(FingerprintEntry, e) for e in data.get("fingerprints") or [] if isinstance(e, dict)]
            return cls(run=str(data["run"]), settings=settings, created_at=float(data["created_at"]),
                       version=str(data.get("version", "?")),
                       fingerprints=fingerprints or [fingerprint_entry(settings, float(data["created_at"]))],
                       sources=dict(data.get("sources") or {}), placement=Placement.from_fields(data),
                       priority=_priority(data.get("priority")), prompts=PromptMode(data.get("prompts", "inline")),
                       packs={int(n): str(name) for n, name in dict(data.get("packs") or {}).items()})
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError) as e:
            raise RunFileError(f"{where} is not a genqueue run file ({type(e).__name__}: {e})") from None


def _priority(raw: object) -> int:
    """run.json's priority: an integer, else 0 (absent: written before runs had one)."""
    return raw if isinstance(raw, int) and not isinstance(raw, bool) else 0


def where(store: OutputStore, run: str) -> str:
    """run.json's place, for messages."""
    return store.location(run).rstrip("/").rsplit("/", 1)[0] + "/" + run_settings_name(run).rsplit("/", 1)[-1]


def read_run_file(store: OutputStore, run: str) -> RunFile | None:
    """RUN's run.json in STORE, or None. Raises StoreError when it cannot be read or parsed."""
    raw = store.get_run_file(run)
    return None if raw is None else RunFile.from_json(raw, where(store, run))


def write_run_file(store: OutputStore, rf: RunFile) -> str:
    """Write RF as its run's run.json; returns where it went."""
    return store.put_run_file(rf.run, rf.to_json())
