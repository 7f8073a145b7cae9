"""The files each drafter trainer reads its target's hidden states from, made without torch
where the format allows (pure, but for the file writes named so).

- speculators 0.9.0: the dataset folder (`save_to_disk`: input_ids, loss_mask, seq_len),
  `token_freq.pt`, and `hidden_states/hs_{i}.safetensors` (`token_ids` I64 [T], `hidden_states`
  bf16 [T, L, H], the last layer before the final norm);
- SpecForge a6b6b023: `rows_{g}-{g+2000}/data_{i}.ckpt`, a `torch.save` of input_ids, loss_mask,
  aux_hidden_state [1, T, n*H] and hidden_state [1, T, H] after the final norm.
What each trainer's code reads, file by file, is docs/export.md's "What the drafter trainers read".
speculators' files and its dataset folder need no torch; `token_freq.pt` and `.ckpt` are pickles
only torch writes, so a Python with torch writes them (TORCH_WRITER, run by features.py).

Alignment: vLLM captures the prompt and the answer's tokens but the last (never an input), so a
row's features cover its input_ids less one token, or all of them for a prefill pass: every
layout writes the row's first `tokens` input_ids and loss_mask, the tokens its features cover.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa

from genqueue.common.errors import UserError
from genqueue.common.features.codec import Float32Array, bf16_dtype

#: speculators: the folder of its hidden-state files, and each file's name.
SPECULATORS_HIDDEN = "hidden_states"
#: The model types whose final norm's gain is 1 + w (speculators' models/utils.py list).
GEMMA_STYLE = frozenset({"gemma", "gemma2", "gemma3", "gemma3_text", "qwen3_5", "qwen3_5_text", "recurrent_gemma"})

#: Where transformers checkpoints keep the final norm's weight (text models, then multimodal ones).
NORM_NAMES = ("model.norm.weight", "model.language_model.norm.weight", "language_model.model.norm.weight")
_ST_DTYPES: dict[str, np.dtype[Any]] = {"I64": np.dtype("<i8"), "F32": np.dtype("<f4"), "BF16": bf16_dtype(),
                                        "F16": np.dtype("<f2"), "I32": np.dtype("<i4")}
_ST_NAMES = {v: k for k, v in _ST_DTYPES.items()}


def speculators_name(i: int) -> str:
    """Sample I's hidden-state file in speculators' data folder."""
    return f"{SPECULATORS_HIDDEN}/hs_{i}.safetensors"


def specforge_name(i: int, group: int = 2000) -> str:
    """Sample I's file in SpecForge's offline folder (prepare_hidden_states.py _get_file_path,
    GROUP files a folder: its file_group_size default)."""
    g = i // group * group
    return f"rows_{g}-{g + group}/data_{i}.ckpt"


def safetensors_bytes(tensors: Mapping[str, npt.NDArray[Any]], metadata: Mapping[str, str] | None = None) -> bytes:
    """TENSORS as one safetensors file (int64, float32, float16, bf16), in the order given."""
    header: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
    at, parts = 0, []
    for name, array in tensors.items():
        a = np.ascontiguousarray(array)
        kind = _ST_NAMES.get(a.dtype.newbyteorder("<") if a.dtype.byteorder == ">" else a.dtype)
        if kind is None:
            raise TypeError(f"no safetensors dtype for {a.dtype}")
        data = a.astype(_ST_DTYPES[kind], copy=False).tobytes()
        header[name] = {"dtype": kind, "shape": list(a.shape), "data_offsets": [at, at + len(data)]}
        parts.append(data)
        at += len(data)
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    return b"".join([struct.pack("<Q", len(head)), head, *parts])


def read_safetensors(data: bytes) -> dict[str, npt.NDArray[Any]]:
    """The tensors of a safetensors file of the dtypes safetensors_bytes writes (bf16 as ml_dtypes')."""
    (size,) = struct.unpack_from("<Q", data)
    header = json.loads(data[8:8 + size])
    header.pop("__metadata__", None)
    body = memoryview(data)[8 + size:]
    out = {}
    for name, spec in header.items():
        start, end = spec["data_offsets"]
        out[name] = np.frombuffer(body[start:end], dtype=_ST_DTYPES[spec["dtype"]]).reshape(spec["shape"])
    return out


def bf16(x: Float32Array) -> npt.NDArray[Any]:
    """X rounded to bfloat16 (to nearest even), as vLLM and the trainers hold hidden states."""
    return x.astype(bf16_dtype())


def speculators_sample(token_ids: npt.NDArray[np.int64], hidden: Float32Array) -> bytes:
    """speculators' hs_{i}.safetensors: what vLLM's connector writes and its trainer loads."""
    return safetensors_bytes({"hidden_states": bf16(hidden), "token_ids": token_ids.astype(np.int64)})


def specforge_sample(input_ids: list[int], loss_mask: list[int], hidden: Float32Array,
                     norm: FinalNorm) -> dict[str, npt.NDArray[Any]]:
    """SpecForge's eagle3 record of one row ([T, L, H] features, the last layer the final one,
    before its norm): the aux layers concatenated, the last one normed, each with a batch axis."""
    t = hidden.shape[0]
    aux = hidden[:, :-1, :].reshape(t, -1)[None]
    return {"input_ids": np.asarray(input_ids, dtype=np.int64), "loss_mask": np.asarray(loss_mask, dtype=np.int64),
            "aux_hidden_state": bf16(aux), "hidden_state": norm.apply(hidden[:, -1, :])[None]}


@dataclass(frozen=True, slots=True)
class FinalNorm:
    """The target's final RMSNorm (model.norm), as transformers computes it: in float32, rounded
    to the model's dtype (bf16), then times the gain (w, or 1 + w for the Gemma family)."""

    weight: Float32Array
    eps: float
    gemma_style: bool
    layers: int  # the model's decoder layer count: the final layer's id in a capture

    def apply(self, x: Float32Array) -> npt.NDArray[Any]:
        """X [T, H] normed, as bf16 (X taken as the model holds it: in bf16)."""
        x32 = bf16(x).astype(np.float32)
        normed = x32 / np.sqrt(np.mean(x32 * x32, axis=-1, keepdims=True) + np.float32(self.eps))
        gain = self.weight + 1 if self.gemma_style else self.weight
        if self.gemma_style:  # Gemma multiplies in float32 and rounds once
            return bf16(normed * gain)
        return bf16(bf16(normed).astype(np.float32) * gain)


def final_norm(model_dir: Path) -> FinalNorm:
    """The final norm of the transformers model in MODEL_DIR (config.json, *.safetensors), read
    without torch. Raises UserError when it is not there."""
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"--model-dir {model_dir}: no readable config.json ({e})") from None
    text = config.get("text_config") or config
    eps = text.get("rms_norm_eps", text.get("layer_norm_eps"))
    layers, hidden = text.get("num_hidden_layers"), text.get("hidden_size")
    if not isinstance(eps, float | int) or not isinstance(layers, int) or not isinstance(hidden, int):
        raise UserError(f"--model-dir {model_dir}: config.json names no rms_norm_eps, num_hidden_layers and "
                        "hidden_size")
    for name in NORM_NAMES:
        weight = _tensor_from(model_dir, name)
        if weight is not None:
            if weight.shape != (hidden,):
                raise UserError(f"--model-dir {model_dir}: {name} has shape {list(weight.shape)}, not [{hidden}]")
            model_type = str(text.get("model_type") or config.get("model_type") or "").lower()
            return FinalNorm(weight.astype(np.float32), float(eps), model_type in GEMMA_STYLE, layers)
    raise UserError(f"--model-dir {model_dir}: no final norm weight (model.norm.weight) in its safetensors files")


def _tensor_from(model_dir: Path, name: str) -> npt.NDArray[Any] | None:
    index = model_dir / "model.safetensors.index.json"
    try:
        files = ([json.loads(index.read_text())["weight_map"][name]] if index.exists()
                 else sorted(p.name for p in model_dir.glob("*.safetensors")))
    except KeyError:
        return None
    except (OSError, ValueError) as e:
        raise UserError(f"--model-dir {model_dir}: unreadable {index.name} ({e})") from None
    for file in files:
        found = _read_one(model_dir / file, name)
        if found is not None:
            return found
    return None


def _read_one(path: Path, name: str) -> npt.NDArray[Any] | None:
    """Tensor NAME of the safetensors file PATH, read alone (None: it has none)."""
    try:
        with open(path, "rb") as fh:
            (size,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(size))
            spec = header.get(name)
            if spec is None:
                return None
            dtype = _ST_DTYPES.get(spec["dtype"])
            if dtype is None:
                raise UserError(f"{path}: {name} is {spec['dtype']}, not a dtype read here")
            start, end = spec["data_offsets"]
            fh.seek(8 + size + start)
            return np.frombuffer(fh.read(end - start), dtype=dtype).reshape(spec["shape"])
    except (OSError, ValueError, struct.error) as e:
        raise UserError(f"cannot read {path}: {e}") from None


# --- speculators' dataset folder, as `datasets` save_to_disk writes it ----------------------------
#: The features of the dataset speculators' prepare-data makes, plus the row's id (the join).
_FEATURES = {"id": {"dtype": "string", "_type": "Value"},
             "input_ids": {"feature": {"dtype": "int64", "_type": "Value"}, "_type": "List"},
             "loss_mask": {"feature": {"dtype": "int64", "_type": "Value"}, "_type": "List"},
             "seq_len": {"dtype": "int64", "_type": "Value"}}
_SCHEMA = pa.schema([("id", pa.string()), ("input_ids", pa.list_(pa.int64())), ("loss_mask", pa.list_(pa.int64())),
                     ("seq_len", pa.int64())],
                    metadata={"huggingface": json.dumps({"info": {"features": _FEATURES}})})
ARROW_FILE = "data-00000-of-00001.arrow"


class ArrowRows:
    """speculators' training rows as `datasets` save_to_disk writes a one-file dataset: an Arrow
    stream, dataset_info.json and state.json, in torch format (as prepare-data saves it, so
    load_from_disk hands the trainer tensors; `datasets` needs torch to set that format, not to
    write it)."""

    BATCH = 1024

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._sink = pa.OSFile(str(folder / ARROW_FILE), "wb")
        self._writer = pa.ipc.new_stream(self._sink, _SCHEMA)
        self._rows: list[tuple[str, list[int], list[int]]] = []
        self._hash = hashlib.sha256()

    def add(self, row_id: str, input_ids: list[int], loss_mask: list[int]) -> None:
        self._rows.append((row_id, input_ids, loss_mask))
        self._hash.update(row_id.encode() + b"\0")
        if len(self._rows) >= self.BATCH:
            self._flush()

    def _flush(self) -> None:
        if not self._rows:
            return
        ids, inputs, masks = zip(*self._rows, strict=True)
        batch = pa.record_batch([pa.array(ids, pa.string()), pa.array(inputs, pa.list_(pa.int64())),
                                 pa.array(masks, pa.list_(pa.int64())),
                                 pa.array([len(x) for x in inputs], pa.int64())], schema=_SCHEMA)
        self._writer.write_batch(batch)
        self._rows = []

    def close(self) -> list[Path]:
        self._flush()
        self._writer.close()
        self._sink.close()
        info: dict[str, object] = {"citation": "", "description": "", "features": _FEATURES, "homepage": "", "license": ""}
        state: dict[str, object] = {"_data_files": [{"filename": ARROW_FILE}], "_fingerprint": self._hash.hexdigest()[:16],
                 "_format_columns": None, "_format_kwargs": {}, "_format_type": "torch",
                 "_output_all_columns": False, "_split": None}
        (self.folder / "dataset_info.json").write_text(json.dumps(info, indent=2))
        (self.folder / "state.json").write_text(json.dumps(state, indent=2))
        return [self.folder / ARROW_FILE, self.folder / "dataset_info.json", self.folder / "state.json"]


def token_freq_json(counts: Mapping[int, int]) -> bytes:
    """{token id: count} as JSON (ids as strings), by id."""
    return json.dumps({str(k): counts[k] for k in sorted(counts)}, separators=(",", ":")).encode()


#: Run by a Python with torch and safetensors (features.TorchWriter): one JSON job a line on
#: stdin, answered by one line each on stdout. {"save": SRC, "to": DST}: SRC's tensors (a
#: safetensors file) torch.save'd to DST as a dict, SRC removed; {"freq": SRC, "to": DST}: the
#: JSON {id: count} at SRC torch.save'd as {int: int}. Imports only torch, safetensors, stdlib.
TORCH_WRITER = r"""
import json, os, sys
import torch
from safetensors.torch import load_file
for line in sys.stdin:
    job = json.loads(line)
    tmp = job["to"] + ".tmp"
    if "save" in job:
        torch.save(load_file(job["save"]), tmp)
        os.remove(job["save"])
    else:
        with open(job["freq"]) as fh:
            torch.save({int(k): int(v) for k, v in json.load(fh).items()}, tmp)
    os.replace(tmp, job["to"])
    print(json.dumps({"done": job["to"]}), flush=True)
"""


__all__ = ["ARROW_FILE", "SPECULATORS_HIDDEN", "TORCH_WRITER", "ArrowRows", "FinalNorm", "bf16",
           "final_norm", "read_safetensors", "safetensors_bytes", "specforge_name", "specforge_sample",
           "speculators_name", "speculators_sample", "token_freq_json"]
