"""The stand-in's features: one fixed function of (token id, position, layer, hidden size, seed),
the same bits on every machine, so the stand-in server and a test compute the same rows."""

from __future__ import annotations

import zlib

import ml_dtypes
import numpy as np
import pytest

from genqueue.common.features import standin_features, standin_vector


def test_the_same_inputs_give_the_same_bits_everywhere() -> None:
    x = standin_features([1, 2, 3], (0, 1, 2), 128)
    assert x.dtype == np.float32 and x.shape == (3, 3, 128)
    # pinned: a change of the function is a change of every stand-in capture, on purpose or not
    assert zlib.crc32(x.tobytes()) == 0x47346F5E
    assert x[0, 0, :4].tolist() == [0.2109375, -0.66015625, -0.82421875, -0.0576171875]
    assert np.array_equal(x, standin_features(np.array([1, 2, 3]), (0, 1, 2), 128))


def test_each_input_changes_the_vector() -> None:
    base = standin_vector(7, 3, 2, 64, seed=5)
    for other in (standin_vector(8, 3, 2, 64, seed=5), standin_vector(7, 4, 2, 64, seed=5),
                  standin_vector(7, 3, 1, 64, seed=5), standin_vector(7, 3, 2, 64, seed=6),
                  standin_vector(7, 3, 2, 65, seed=5)[:64]):
        assert not np.array_equal(base, other)


def test_a_row_is_its_tokens_vectors_at_their_positions() -> None:
    ids, layers = [5, 9, 5, 0], (0, 3, 8)
    x = standin_features(ids, layers, 48, seed=2)
    for pos, tok in enumerate(ids):
        for li, layer in enumerate(layers):
            assert np.array_equal(x[pos, li], standin_vector(tok, pos, layer, 48, seed=2))
    assert not np.array_equal(x[0], x[2])  # the same token at another position


def test_values_are_bf16_and_scale_with_the_layer() -> None:
    x = standin_features(np.arange(50), (0, 9), 256)
    assert np.array_equal(x, x.astype(ml_dtypes.bfloat16).astype(np.float32))
    assert np.abs(x[:, 0]).max() <= 1.0 and 5.0 < np.abs(x[:, 1]).max() <= 10.0


def test_negative_inputs_are_refused() -> None:
    with pytest.raises(ValueError):
        standin_features([-1], (0,), 8)
    with pytest.raises(ValueError):
        standin_vector(1, -1, 0, 8)
    with pytest.raises(ValueError):
        standin_features([1], (0,), 0)
