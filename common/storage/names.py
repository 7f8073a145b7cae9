"""The naming rule of a run's output, spelled once.

A run's shards live under `<output>/<run>/shards/`: each is `<worker>-<seq:06d>.jsonl`, with
`<worker>-<seq:06d>.manifest.json` beside it once it is stored and verified. Worker names are
unique per process start, so two consumers never write the same name. `<output>/<run>/run.json`
holds what is needed to re-create the run should Redis lose it (its settings, every fingerprint
it has had, its input sources: common/storage/runfile.py); the producer writes it.
`<output>/<run>/.genqueue-probe-<token>` is the probe `producer enqueue` and each consumer's
pre-flight write, read back and remove (ShardStore.probe): beside run.json, where the run writes,
outside `shards/` (a probe left behind is never listed as a shard). The consumer's spool, the local store,
the S3 store and the export all take names from here, so a change of layout is one edit.

Packs (prompts by reference; common/packs.py is their format) live beside the shards,
under `<output>/<run>/packs/`: each is `<writer>-<seq:06d>.gqpack`, WRITER naming one producer
invocation (unique, as a shard's worker is), SEQ its packs in order. A pack is written once, whole,
and never changed: a job that names it reads the items it was enqueued with.
"""

from __future__ import annotations

import re
from typing import NamedTuple

SHARD_SUFFIX = ".jsonl"
MANIFEST_SUFFIX = ".manifest.json"
SHARDS_DIR = "shards"
RUN_SETTINGS = "run.json"
PROBE_PREFIX = ".genqueue-probe-"
PACKS_DIR = "packs"
PACK_SUFFIX = ".gqpack"
#: Characters of a pack's writer a job carries: 24 bits tell packs apart, and the job's meta stays compact.
PACK_TAG_CHARS = 6

# A worker name: anything a file or object name can hold, without a path separator.
_SHARD = re.compile(r"(?P<owner>[^/\\\x00]+)-(?P<seq>[0-9]{6,})" + re.escape(SHARD_SUFFIX))


_PACK = re.compile(r"(?P<owner>[^/\\\x00]+)-(?P<seq>[0-9]{6,})" + re.escape(PACK_SUFFIX))


class ShardName(NamedTuple):
    """What a shard's name says: which worker wrote it, and its sequence number."""

    worker: str
    seq: int


def shard_name(worker: str, seq: int) -> str:
    """The name of WORKER's shard number SEQ (1-based): `<worker>-<seq:06d>.jsonl`."""
    return _numbered(worker, seq, SHARD_SUFFIX, "shard", "worker")


def parse_shard_name(name: str) -> ShardName | None:
    """The worker and sequence number of a shard NAME; None for any name shard_name cannot make
    (a manifest, a temporary file, a stray file someone put there)."""
    found = _parse_numbered(_SHARD, name)
    return None if found is None else ShardName(*found)


def _numbered(owner: str, seq: int, suffix: str, what: str, whose: str) -> str:
    """`<owner>-<seq:06d><suffix>`, the one naming rule of shards and packs (OWNER: a file or
    object name's part without a path separator)."""
    if not owner or "/" in owner or "\\" in owner or "\x00" in owner:
        raise ValueError(f"not a usable {whose} name for a {what}: {owner!r}")
    if seq < 0:
        raise ValueError(f"{what} sequence numbers are not negative: {seq}")
    return f"{owner}-{seq:06d}{suffix}"


def _parse_numbered(pattern: re.Pattern[str], name: str) -> tuple[str, int] | None:
    """(owner, seq) of a NAME _numbered made (PATTERN: its suffix's); None for any other."""
    m = pattern.fullmatch(name)
    if m is None:
        return None
    seq = int(m["seq"])
    if f"{seq:06d}" != m["seq"]:  # 0001234: padded past six digits, not ours
        return None
    return m["owner"], seq


def manifest_name(shard: str) -> str:
    """The manifest's name of the shard named SHARD."""
    if not shard.endswith(SHARD_SUFFIX):
        raise ValueError(f"not a shard name: {shard!r}")
    return shard.removesuffix(SHARD_SUFFIX) + MANIFEST_SUFFIX


def shard_of_manifest(name: str) -> str | None:
    """The shard a manifest NAME belongs to; None when NAME is not a shard's manifest."""
    if not name.endswith(MANIFEST_SUFFIX):
        return None
    shard = name.removesuffix(MANIFEST_SUFFIX) + SHARD_SUFFIX
    return shard if parse_shard_name(shard) is not None else None


def shards_prefix(run: str) -> str:
    """Where RUN's shards go, relative to the output: `<run>/shards`."""
    return f"{run}/{SHARDS_DIR}"


def run_settings_name(run: str) -> str:
    """Where RUN's settings are kept beside its shards, `<run>/run.json` (runfile.py)."""
    return f"{run}/{RUN_SETTINGS}"


def probe_name(run: str, token: str) -> str:
    """Where a probe of RUN's output goes, relative to the output: `<run>/.genqueue-probe-<token>`
    (TOKEN: unique per probe, so two probes at once never meet)."""
    if not token or "/" in token or "\\" in token:
        raise ValueError(f"not a usable probe token: {token!r}")
    return f"{run}/{PROBE_PREFIX}{token}"


class PackName(NamedTuple):
    """What a pack's name says: which producer invocation wrote it, and its sequence number."""

    writer: str
    seq: int


def pack_name(writer: str, seq: int) -> str:
    """The name of WRITER's pack number SEQ: `<writer>-<seq:06d>.gqpack`."""
    return _numbered(writer, seq, PACK_SUFFIX, "pack", "writer")


def pack_tag(name: str) -> str:
    """The first PACK_TAG_CHARS of the writer of pack NAME (a job's META_WRITER); "" for a name
    pack_name cannot make."""
    found = parse_pack_name(name)
    return "" if found is None else found.writer[:PACK_TAG_CHARS]


def parse_pack_name(name: str) -> PackName | None:
    """The writer and sequence number of a pack NAME; None for any name pack_name cannot make."""
    found = _parse_numbered(_PACK, name)
    return None if found is None else PackName(*found)


def packs_prefix(run: str) -> str:
    """Where RUN's packs go, relative to the output: `<run>/packs`, beside `<run>/shards`."""
    return f"{run}/{PACKS_DIR}"
