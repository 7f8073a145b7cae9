"""The files of each `--layout` of `producer export-features`, one writer per layout (the
formats are described in featurelayouts.py): every accepted row goes to `add` with its sample
index, and `finish` writes what needs every row (the Arrow dataset's footer, the shards the
generic layout copies, the torch files).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Protocol

import pyarrow as pa
import pyarrow.parquet as pq

from genqueue.common.errors import FeatureError, UserError
from genqueue.common.features.names import FEATURES_DIR, MANIFEST, index_name
from genqueue.producer.export.featurelayouts import (
    TORCH_WRITER,
    ArrowRows,
    FinalNorm,
    safetensors_bytes,
    specforge_name,
    specforge_sample,
    speculators_name,
    speculators_sample,
)
from genqueue.producer.export.features import COPY_CHUNK, ROW_TABLE, FeatureIndex, FeatureLayout, Joined


class LayoutWriter(Protocol):
    """Writes one layout's files into a folder."""

    def add(self, i: int, row: Joined) -> str:
        """Write sample I; the file (relative to the folder) that holds its features."""
        ...

    def finish(self, index: FeatureIndex, torch: TorchWriter | None) -> None:
        """Write what needs every row (TORCH: the torch writer, when there is a Python with torch)."""
        ...


class TorchWriter:
    """torch.save run by a Python with torch (featurelayouts.TORCH_WRITER), jobs gathered first."""

    def __init__(self, python: str) -> None:
        self.python = python
        self.jobs: list[dict[str, str]] = []

    def check(self) -> None:
        """Refuse (UserError) a Python that cannot import torch and safetensors."""
        try:
            proc = subprocess.run([self.python, "-c", "import torch, safetensors.torch"], capture_output=True,
                                  text=True, timeout=300, check=False)
        except OSError as e:
            raise UserError(f"--torch-python {self.python}: cannot run it: {e.strerror or e}") from None
        if proc.returncode != 0:
            last = (proc.stderr.strip().splitlines() or ["no error text"])[-1]
            raise UserError(f"--torch-python {self.python} cannot import torch and safetensors: {last}")

    def save(self, src: Path, dst: Path) -> None:
        self.jobs.append({"save": str(src), "to": str(dst)})

    def freq(self, src: Path, dst: Path) -> None:
        self.jobs.append({"freq": str(src), "to": str(dst)})

    def run(self) -> None:
        if not self.jobs:
            return
        lines = "".join(json.dumps(j) + "\n" for j in self.jobs)
        proc = subprocess.run([self.python, "-c", TORCH_WRITER], input=lines, capture_output=True, text=True,
                              check=False)
        done = sum(1 for line in proc.stdout.splitlines() if line.startswith('{"done"'))
        if proc.returncode != 0 or done != len(self.jobs):
            last = (proc.stderr.strip().splitlines() or ["no error text"])[-1]
            raise FeatureError(f"torch.save by {self.python} stopped after {done} of {len(self.jobs)} files: {last}")
        self.jobs = []


class GenericWriter:
    """genqueue's own layout: the shards as they are (with their index and the manifest) under
    features/, and rows.parquet: one row per sample, where its features are and its tokens."""

    BATCH = 1024
    SCHEMA = pa.schema([("id", pa.string()), ("feature_row", pa.string()), ("shard", pa.string()),
                        ("offset", pa.int64()), ("length", pa.int64()), ("tokens", pa.int64()),
                        ("layers", pa.list_(pa.int64())), ("hidden", pa.int64()), ("dtype", pa.string()),
                        ("crc32", pa.int64()), ("input_ids", pa.list_(pa.int64())),
                        ("loss_mask", pa.list_(pa.int64()))])

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.shards: set[str] = set()
        self._rows: list[dict[str, object]] = []
        self._writer = pq.ParquetWriter(folder / ROW_TABLE, self.SCHEMA)

    def add(self, i: int, row: Joined) -> str:
        e = row.entry
        self.shards.add(e.shard)
        self._rows.append({"id": row.row.id, "feature_row": e.row, "shard": e.shard, "offset": e.offset,
                           "length": e.length, "tokens": e.tokens, "layers": list(row.features.layer_ids),
                           "hidden": e.hidden, "dtype": e.dtype.value, "crc32": e.crc32,
                           "input_ids": row.input_ids, "loss_mask": row.loss_mask})
        if len(self._rows) >= self.BATCH:
            self._flush()
        return f"{FEATURES_DIR}/{e.shard}"

    def _flush(self) -> None:
        if self._rows:
            self._writer.write_table(pa.Table.from_pylist(self._rows, schema=self.SCHEMA))
            self._rows = []

    def finish(self, index: FeatureIndex, torch: TorchWriter | None) -> None:
        self._flush()
        self._writer.close()
        dest = self.folder / FEATURES_DIR
        dest.mkdir()
        (dest / MANIFEST).write_bytes(index.manifest.to_json())
        for shard in sorted(self.shards):
            shard_index = index.store.get_index(index.run, shard)
            chunks = [(at, min(COPY_CHUNK, shard_index.size - at)) for at in range(0, shard_index.size, COPY_CHUNK)]
            with open(dest / shard, "wb") as fh:
                for (at, want), data in zip(chunks, index.store.read_spans(index.run, shard, chunks), strict=True):
                    if len(data) != want:
                        raise FeatureError(f"feature shard {shard}: {len(data)} bytes read at {at} of {want}")
                    fh.write(data)
            (dest / index_name(shard)).write_bytes(shard_index.to_json())


class SpeculatorsWriter:
    """speculators' data folder: its training rows (an Arrow dataset with `id`) and
    hidden_states/hs_{i}.safetensors."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        (folder / "hidden_states").mkdir()
        self.rows = ArrowRows(folder)

    def add(self, i: int, row: Joined) -> str:
        name = speculators_name(i)
        (self.folder / name).write_bytes(speculators_sample(row.features.token_ids, row.features.features()))
        self.rows.add(row.row.id, row.input_ids, row.loss_mask)
        return name

    def finish(self, index: FeatureIndex, torch: TorchWriter | None) -> None:
        self.rows.close()


class SpecForgeWriter:
    """SpecForge's offline folder: rows_*/data_{i}.ckpt, saved by the torch writer from a
    safetensors file of the same tensors written here."""

    def __init__(self, folder: Path, norm: FinalNorm, torch: TorchWriter) -> None:
        self.folder = folder
        self.norm = norm
        self.torch = torch

    def add(self, i: int, row: Joined) -> str:
        name = specforge_name(i)
        path = self.folder / name
        path.parent.mkdir(exist_ok=True)
        src = path.with_name(f".{path.stem}.safetensors")
        src.write_bytes(safetensors_bytes(specforge_sample(row.input_ids, row.loss_mask, row.features.features(),
                                                           self.norm)))
        self.torch.save(src, path)
        return name

    def finish(self, index: FeatureIndex, torch: TorchWriter | None) -> None:
        return None


def writer_for(layout: FeatureLayout, folder: Path, norm: FinalNorm | None, torch: TorchWriter | None) -> LayoutWriter:
    """LAYOUT's writer into FOLDER (SpecForge: NORM and TORCH checked present by the caller)."""
    if layout is FeatureLayout.GENERIC:
        return GenericWriter(folder)
    if layout is FeatureLayout.SPECULATORS:
        return SpeculatorsWriter(folder)
    if norm is None or torch is None:
        raise UserError("--layout specforge needs --model-dir and a Python with torch")
    return SpecForgeWriter(folder, norm, torch)
