"""One captured file read back: `{"hidden_states": [tokens, layers, hidden], "token_ids": [tokens]}`
as the connector writes it (safetensors: an 8-byte little-endian header length, a JSON header
naming each tensor's dtype, shape and byte range, then the raw data). Parsed here with numpy, so
genqueue needs no torch; bf16 widens to float32 exactly (its bits are float32's top half).
"""

from __future__ import annotations

import fcntl
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from genqueue.consumer.answer.faults import PermanentError

_DTYPES: dict[str, str] = {"BF16": "<u2", "F16": "<f2", "F32": "<f4", "F64": "<f8", "I64": "<i8", "I32": "<i4",
                           "U8": "u1"}


@dataclass(frozen=True, slots=True)
class Capture:
    """One request's features: TOKEN_IDS [tokens] and HIDDEN_STATES [tokens, layers, hidden] as
    float32; DTYPE is what the engine stored ("BF16")."""

    path: Path
    token_ids: np.ndarray[Any, np.dtype[np.int64]]
    hidden_states: np.ndarray[Any, np.dtype[np.float32]]
    dtype: str


def _bad(path: Path, why: str) -> PermanentError:
    return PermanentError(f"captured hidden states {path}: {why}")


def parse_safetensors(data: bytes, path: Path) -> dict[str, tuple[str, np.ndarray[Any, Any]]]:
    """Every tensor in DATA as (its safetensors dtype, an array; bf16 as float32)."""
    if len(data) < 8:
        raise _bad(path, f"{len(data)} bytes, too short for a safetensors header")
    (size,) = struct.unpack("<Q", data[:8])
    if size > min(100_000_000, len(data) - 8):  # safetensors' own bound on a header
        raise _bad(path, f"header of {size} bytes in a file of {len(data)}")
    try:
        header = json.loads(data[8:8 + size])
    except ValueError as e:
        raise _bad(path, f"header is not JSON ({e})") from e
    if not isinstance(header, dict):
        raise _bad(path, "header is not a JSON object")
    body = memoryview(data)[8 + size:]
    out: dict[str, tuple[str, np.ndarray[Any, Any]]] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (start, end) = info["dtype"], [int(n) for n in info["shape"]], info["data_offsets"]
        except (KeyError, TypeError, ValueError) as e:
            raise _bad(path, f"tensor {name!r} has no dtype, shape and data_offsets") from e
        if dtype not in _DTYPES:
            raise _bad(path, f"tensor {name!r} has dtype {dtype}, not one genqueue reads")
        item = np.dtype(_DTYPES[dtype])
        if not 0 <= start <= end <= len(body) or end - start != int(np.prod(shape)) * item.itemsize:
            raise _bad(path, f"tensor {name!r} of shape {shape} {dtype} does not fit bytes {start}-{end} "
                             f"of {len(body)}")
        array = np.frombuffer(body[start:end], dtype=item).reshape(shape)
        if dtype == "BF16":
            array = (array.astype(np.uint32) << 16).view(np.float32)
        out[name] = (dtype, array)
    return out


def read_capture(path: str | os.PathLike[str]) -> Capture:
    """The file vLLM named in `kv_transfer_params.hidden_states_path`, once whole: while the
    connector writes it, it holds `<path>.lock` exclusively, so a shared lock waits for it."""
    path = Path(path)
    lock = path.with_name(path.name + ".lock")
    try:
        with open(lock, "rb") as fh:
            fcntl.flock(fh, fcntl.LOCK_SH)
            data = path.read_bytes()
    except FileNotFoundError:
        try:  # written without a lock (the connector's use_synchronization_lock off)
            data = path.read_bytes()
        except OSError as e:
            raise _bad(path, f"cannot be read ({e.strerror or e})") from e
    except OSError as e:
        raise _bad(path, f"cannot be read ({e.strerror or e})") from e
    tensors = parse_safetensors(data, path)
    if "hidden_states" not in tensors or "token_ids" not in tensors:
        raise _bad(path, f"holds {sorted(tensors)}, not hidden_states and token_ids")
    dtype, hidden = tensors["hidden_states"]
    _, ids = tensors["token_ids"]
    if hidden.ndim != 3 or ids.ndim != 1 or hidden.shape[0] != ids.shape[0]:
        raise _bad(path, f"hidden_states {list(hidden.shape)} do not match token_ids {list(ids.shape)} "
                         "as [tokens, layers, hidden] and [tokens]")
    return Capture(path=path, token_ids=ids.astype(np.int64), hidden_states=hidden.astype(np.float32, copy=False),
                   dtype=dtype)


def remove_capture(path: str | os.PathLike[str]) -> None:
    """Remove a captured file and its lock once read (the engine writes one per request)."""
    path = Path(path)
    for p in (path.with_name(path.name + ".lock"), path):
        p.unlink(missing_ok=True)
