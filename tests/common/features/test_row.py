"""A row is a complete safetensors file: safetensors' own (Rust) parser reads it, with
speculators' tensor names, dtypes and shapes, and the bytes are the codec's."""

from __future__ import annotations

import json

import numpy as np
import pytest
import safetensors

from genqueue.common.errors import FeatureValueError
from genqueue.common.features import FeatureDtype, bytes_per_token, encode, pack_row, standin_features, unpack_row
from genqueue.common.features.row import RowFormatError

LAYERS = (2, 5, 7)


def make(dtype: FeatureDtype, tokens: int = 11, hidden: int = 16) -> tuple[np.ndarray, np.ndarray, bytes]:
    ids = np.arange(100, 100 + tokens)
    x = standin_features(ids, LAYERS, hidden)
    return ids, x, pack_row("key-1/turn-0", "00112233aabbccdd", LAYERS, ids, encode(x, dtype))


@pytest.mark.parametrize("dtype", list(FeatureDtype))
def test_safetensors_reads_a_row_as_speculators_writes_it(dtype: FeatureDtype, tmp_path) -> None:
    ids, x, blob = make(dtype)
    enc = encode(x, dtype)
    tensors = dict(safetensors.deserialize(blob))
    assert tensors["token_ids"]["dtype"] == "I64" and tensors["token_ids"]["shape"] == [11]
    assert bytes(tensors["token_ids"]["data"]) == ids.astype("<i8").tobytes()
    hs = tensors["hidden_states"]
    assert (hs["dtype"], hs["shape"]) == (dtype.safetensors, [11, 3, 16])
    assert bytes(hs["data"]) == enc.codes.tobytes()
    if dtype is FeatureDtype.FP8_E4M3:
        sc = tensors["hidden_states_scales"]
        assert (sc["dtype"], sc["shape"]) == ("F32", [11, 1, 1])
        assert enc.scales is not None and bytes(sc["data"]) == enc.scales.astype("<f4").tobytes()
    else:
        assert "hidden_states_scales" not in tensors
    path = tmp_path / "row.safetensors"
    path.write_bytes(blob)
    with safetensors.safe_open(str(path), framework="numpy") as f:
        meta = f.metadata()
    assert meta["row"] == "key-1/turn-0" and meta["capture"] == "00112233aabbccdd"
    assert json.loads(meta["layer_ids"]) == list(LAYERS) and meta["dtype"] == dtype.value


@pytest.mark.parametrize("dtype", list(FeatureDtype))
def test_a_row_round_trips(dtype: FeatureDtype) -> None:
    ids, x, blob = make(dtype)
    row = unpack_row(blob)
    assert (row.row, row.capture, row.layer_ids) == ("key-1/turn-0", "00112233aabbccdd", LAYERS)
    assert np.array_equal(row.token_ids, ids)
    assert np.array_equal(row.features(), encode(x, dtype).decode())
    # aligned: the header is padded so the tensors start at a multiple of 8
    (size,) = np.frombuffer(blob[:8], "<u8")
    assert (8 + int(size)) % 8 == 0


@pytest.mark.parametrize("dtype", list(FeatureDtype))
def test_the_tensors_take_bytes_per_token(dtype: FeatureDtype) -> None:
    for tokens in (1, 7, 300):
        _, _, blob = make(dtype, tokens=tokens, hidden=40)
        (size,) = np.frombuffer(blob[:8], "<u8")
        assert len(blob) - 8 - int(size) == tokens * bytes_per_token(3, 40, dtype)


def test_rows_that_do_not_fit_are_refused() -> None:
    x = encode(standin_features([1, 2, 3], LAYERS, 8), FeatureDtype.BF16)
    with pytest.raises(FeatureValueError, match="token ids"):
        pack_row("r", "00" * 8, LAYERS, [1, 2], x)
    with pytest.raises(FeatureValueError, match="token ids"):
        pack_row("r", "00" * 8, LAYERS, np.array([1.0, 2.0, 3.0]), x)
    with pytest.raises(FeatureValueError, match="layer ids"):
        pack_row("r", "00" * 8, (1, 2), [1, 2, 3], x)
    with pytest.raises(FeatureValueError, match="row id"):
        pack_row("", "00" * 8, LAYERS, [1, 2, 3], x)


def test_other_bytes_are_not_a_row() -> None:
    _, _, blob = make(FeatureDtype.FP8_E4M3)
    for bad in (blob[:-1], blob[:20], b"", blob.replace(b"genqueue-features", b"genqueue-featurez"),
                blob + b"\0" * 8):
        with pytest.raises(RowFormatError):
            unpack_row(bad)
