"""Where a run's output lives, and which hosts may ship results to it.

An `s3://` output is one place for every node. A local path is not: `/data/out` on node B is
another directory than `/data/out` on node A, so a consumer on B would ship its results to its
own disk, and export on A would report those items missing. A run whose output is a local path
therefore records the host that created it (`Placement.host`), and a consumer on another host
refuses to serve it, with a message naming the two ways out: an `s3://` output, or `--shared-fs`
(on `producer enqueue`, or on one `consumer run`) to declare the path a filesystem every node
mounts in the same place (NFS, Lustre, a cluster FS).

A host is named by `GENQUEUE_HOST` when it is set, else by its hostname. Containers on one node
get a hostname each (the container's id), so a compose file sets `GENQUEUE_HOST` to the node's
name for all of them (docker-compose.yml).

Runs made before placement was recorded have none (`host` None): nothing is refused for them.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


def this_host() -> str:
    """This machine's name in a run's placement and in a consumer's identity."""
    return os.environ.get("GENQUEUE_HOST", "").strip() or socket.gethostname()


def is_local(output: str) -> bool:
    """Whether OUTPUT is a path on some host's filesystem (not an S3 URL)."""
    return not output.startswith("s3://")


@dataclass(frozen=True, slots=True)
class Placement:
    """Which host's disk holds a run's local output. `host` None: any host may ship (an S3
    output, a path declared shared, or a run older than placements)."""

    host: str | None = None
    shared_fs: bool = False

    @classmethod
    def new(cls, output: str, *, shared_fs: bool, host: str | None = None) -> Placement:
        """The placement of a run created now, on HOST (default: this one)."""
        if not is_local(output):
            return cls()
        if shared_fs:
            return cls(None, True)
        return cls(host or this_host(), False)

    def fields(self) -> dict[str, str]:
        """As the run's hash (and run.json) keeps it."""
        return {"output_host": self.host or "", "shared_fs": "1" if self.shared_fs else ""}

    @classmethod
    def from_fields(cls, data: Mapping[Any, Any]) -> Placement:
        """From `fields()` (keys str or bytes, values str or bytes; missing: no placement)."""
        def get(name: str) -> str:
            v = data.get(name, data.get(name.encode(), ""))
            return v.decode() if isinstance(v, bytes) else str(v or "")
        return cls(get("output_host") or None, bool(get("shared_fs")))

    def refusal(self, run: str, output: str, host: str) -> str | None:
        """Why a consumer (or producer) on HOST may not write RUN's output; None when it may."""
        if self.host is None or self.host == host or not is_local(output):
            return None
        return (f"run {run}'s output {output} is a local path on host {self.host}, not on this host {host} "
                f"(what {host} writes there stays on {host}'s disk, missing from {self.host}'s). Use an "
                "s3://bucket/prefix output, or, if that path is one filesystem every node mounts, declare it: "
                f"`producer enqueue ... --run {run} --shared-fs` (or `consumer run --shared-fs` on this host)")

    def describe(self, output: str) -> str:
        """Where OUTPUT is, in words, for status."""
        if not is_local(output):
            return "S3: one place for every node"
        if self.shared_fs:
            return "a shared filesystem (declared with --shared-fs): any node may ship"
        if self.host is None:
            return "a local path (its host not recorded: the run is older than that record)"
        return f"the local disk of host {self.host}: only consumers on {self.host} ship to it"
