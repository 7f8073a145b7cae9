"""One row's features as a safetensors file in bytes (pure).

A row is stored as a complete safetensors file, the one speculators' fp8 connector writes per
request (and its trainer reads), so an exporter copies it byte for byte and a trainer reads it
with `safetensors.torch.load(data)`:

    token_ids             I64      [tokens]
    hidden_states_scales  F32      [tokens, 1, 1]            (fp8 only)
    hidden_states         F8_E4M3  [tokens, layers, hidden]  (or BF16)
    __metadata__          format, version, row (its id), dtype, layer_ids, capture (manifest digest)

The header is padded with spaces to a multiple of 8 bytes, so with the row at an 8-byte offset
every tensor is aligned for a zero-copy view.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from genqueue.common.errors import FeatureValueError
from genqueue.common.features.codec import EncodedFeatures, FeatureDtype, Float32Array
from genqueue.common.features.manifest import FORMAT, FORMAT_VERSION

HIDDEN_KEY = "hidden_states"
#: speculators' name for the fp8 scales (its SCALES_KEY).
SCALES_KEY = "hidden_states_scales"
TOKENS_KEY = "token_ids"
LENGTH = struct.Struct("<Q")


class RowFormatError(ValueError):
    """The bytes are not a row this module wrote (the shard reader names the row and offset)."""


@dataclass(frozen=True, slots=True)
class FeatureRow:
    """A row's features as read back: its id, the capture it belongs to, its layer ids, its
    token ids and its encoded hidden states."""

    row: str
    capture: str
    layer_ids: tuple[int, ...]
    token_ids: npt.NDArray[np.int64]
    encoded: EncodedFeatures

    def features(self) -> Float32Array:
        """The hidden states as float32 [tokens, layers, hidden]."""
        return self.encoded.decode()


def pack_row(row: str, capture: str, layer_ids: tuple[int, ...], token_ids: npt.ArrayLike,
             encoded: EncodedFeatures) -> bytes:
    """The safetensors bytes of ROW (its id) of CAPTURE (a manifest digest). Raises
    FeatureValueError when the token ids or layer ids do not fit the hidden states."""
    if not row:
        raise FeatureValueError("a row id is not empty")
    ids = np.asarray(token_ids)
    if ids.ndim != 1 or ids.dtype.kind not in "iu" or ids.shape[0] != encoded.tokens:
        raise FeatureValueError(f"row {row!r}: {encoded.tokens} tokens of hidden states need as many integer "
                                f"token ids; got shape {list(ids.shape)} of {ids.dtype}")
    if len(layer_ids) != encoded.layers:
        raise FeatureValueError(f"row {row!r}: {encoded.layers} layers of hidden states, {len(layer_ids)} layer ids")
    tensors: list[tuple[str, str, list[int], bytes]] = [
        (TOKENS_KEY, "I64", [encoded.tokens], ids.astype("<i8").tobytes())]
    if encoded.scales is not None:
        tensors.append((SCALES_KEY, "F32", [encoded.tokens, 1, 1], encoded.scales.astype("<f4").tobytes()))
    tensors.append((HIDDEN_KEY, encoded.dtype.safetensors, list(encoded.codes.shape),
                    np.ascontiguousarray(encoded.codes).tobytes()))
    header: dict[str, Any] = {"__metadata__": {
        "format": FORMAT, "version": FORMAT_VERSION, "row": row, "dtype": encoded.dtype.value,
        "layer_ids": json.dumps(list(layer_ids)), "capture": capture}}
    at = 0
    for name, dtype, shape, data in tensors:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [at, at + len(data)]}
        at += len(data)
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-(LENGTH.size + len(head)) % 8)
    return b"".join([LENGTH.pack(len(head)), head, *(t[3] for t in tensors)])


def unpack_row(blob: bytes | memoryview) -> FeatureRow:
    """The row a pack_row made. Raises RowFormatError for any other bytes."""
    view = memoryview(blob)
    try:
        (size,) = LENGTH.unpack_from(view)
        if LENGTH.size + size > len(view):
            raise RowFormatError(f"header of {size} bytes in a row of {len(view)}")
        header = json.loads(bytes(view[LENGTH.size:LENGTH.size + size]))
        meta = header.pop("__metadata__")
        if meta.get("format") != FORMAT or meta.get("version") != FORMAT_VERSION:
            raise RowFormatError(f"not a {FORMAT} {FORMAT_VERSION} row: {meta.get('format')} {meta.get('version')}")
        data = view[LENGTH.size + size:]
        arrays = {name: _tensor(data, spec) for name, spec in header.items()}
        if sum(a.nbytes for a in arrays.values()) != len(data):
            raise RowFormatError(f"tensors of {sum(a.nbytes for a in arrays.values())} bytes in {len(data)}")
        dtype = FeatureDtype(meta["dtype"])
        codes = arrays[HIDDEN_KEY]
        if codes.dtype != dtype.numpy or codes.ndim != 3:
            raise RowFormatError(f"hidden states of {codes.dtype} {list(codes.shape)} in a {dtype.value} row")
        scales = arrays.get(SCALES_KEY)
        if dtype.scaled != (scales is not None) or (scales is not None and scales.size != codes.shape[0]):
            raise RowFormatError("scales do not match the hidden states")
        ids = arrays[TOKENS_KEY]
        if ids.shape != (codes.shape[0],):
            raise RowFormatError(f"{ids.shape[0]} token ids for {codes.shape[0]} tokens")
        layer_ids = tuple(int(i) for i in json.loads(meta["layer_ids"]))
        if len(layer_ids) != codes.shape[1]:
            raise RowFormatError(f"{len(layer_ids)} layer ids for {codes.shape[1]} layers")
        return FeatureRow(str(meta["row"]), str(meta["capture"]), layer_ids, ids.astype(np.int64),
                          EncodedFeatures(dtype, codes, None if scales is None else scales.reshape(-1).astype(np.float32)))
    except RowFormatError:
        raise
    except (struct.error, ValueError, KeyError, TypeError, AttributeError) as e:
        raise RowFormatError(f"not a features row: {e}") from None


_NUMPY: dict[str, np.dtype[Any]] = {"I64": np.dtype("<i8"), "F32": np.dtype("<f4")}
_FEATURE_DTYPES = {d.safetensors: d for d in FeatureDtype}


def _tensor(data: memoryview, spec: dict[str, Any]) -> npt.NDArray[Any]:
    feature = _FEATURE_DTYPES.get(spec["dtype"])
    dtype = feature.numpy if feature is not None else _NUMPY.get(spec["dtype"])
    if dtype is None:
        raise RowFormatError(f"a tensor of dtype {spec['dtype']}")
    start, end = (int(v) for v in spec["data_offsets"])
    shape = tuple(int(n) for n in spec["shape"])
    if not 0 <= start <= end <= len(data) or (end - start) != int(np.prod(shape, dtype=np.int64)) * dtype.itemsize:
        raise RowFormatError(f"a tensor at [{start}, {end}) of {len(data)} bytes does not hold {list(shape)} {spec['dtype']}")
    out: npt.NDArray[Any] = np.frombuffer(data[start:end], dtype=dtype).reshape(shape)
    return out
