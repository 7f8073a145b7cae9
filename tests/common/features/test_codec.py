"""The codec: fp8 e4m3fn codes as torch and safetensors define them, rounded as they round, the
error each dtype may carry (measured against the stated bound), and the inputs it refuses."""

from __future__ import annotations

import math
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from genqueue.common.errors import FeatureValueError
from genqueue.common.features import BF16_ERROR, FP8_ERROR, FeatureDtype, bytes_per_token, codec, encode
from genqueue.common.features.codec import EncodedFeatures


def e4m3fn(code: int) -> float:
    """The OCP FP8 E4M3 ("fn": finite, NaN = S.1111.111) value of CODE, from the spec's formula."""
    sign = -1.0 if code & 0x80 else 1.0
    exp, man = (code >> 3) & 0xF, code & 0x7
    if exp == 0xF and man == 0x7:
        return math.nan
    if exp == 0:
        return sign * man / 8 * 2.0**-6
    return sign * (1 + man / 8) * 2.0 ** (exp - 7)


CODES = np.arange(256, dtype=np.uint8)
VALUES = np.array([e4m3fn(int(c)) for c in CODES])
FINITE = ~np.isnan(VALUES)


def nearest_even(y: np.ndarray) -> np.ndarray:
    """The e4m3fn code round-to-nearest-even gives each finite Y within [-448, 448], by brute force."""
    codes, values = CODES[FINITE], VALUES[FINITE]
    dist = np.abs(y.astype(np.float64)[:, None] - values[None, :])
    best = dist.min(axis=1, keepdims=True)
    tied = dist == best
    # among the nearest (a tie: two codes), the even mantissa
    out = codes[(tied.astype(np.int8) + (tied & (codes[None, :] % 2 == 0))).argmax(axis=1)]
    # a zero keeps the sign of what rounded to it (IEEE, and torch's and ml_dtypes' casts)
    return np.where(out & 0x7F == 0, np.where(np.signbit(y), 0x80, 0x00), out).astype(np.uint8)


def test_codes_are_the_spec_values() -> None:
    """Every byte decodes to the spec's value: max 448 at 0x7E, NaN only at 0x7F and 0xFF, the
    smallest subnormal 2**-9 at 0x01 (what torch.float8_e4m3fn and F8_E4M3 hold)."""
    wide = CODES.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    assert np.array_equal(np.isnan(wide), ~FINITE)
    assert np.array_equal(wide[FINITE], VALUES[FINITE].astype(np.float32))
    assert (wide[0x7E], wide[0x01], wide[0x38], wide[0xC0]) == (448.0, 2.0**-9, 1.0, -2.0)
    assert set(np.flatnonzero(~FINITE)) == {0x7F, 0xFF}


tokens = st.integers(1, 5)
layers = st.integers(1, 4)
hidden = st.integers(1, 12)
# magnitudes from tiny (subnormal in fp8 after scaling) to large, so every code range is hit
floats = st.floats(-32768.0, 32768.0, allow_nan=False, allow_infinity=False, width=32)


def arrays(elements: st.SearchStrategy[float] = floats) -> st.SearchStrategy[np.ndarray]:
    return st.tuples(tokens, layers, hidden).flatmap(lambda s: hnp.arrays(np.float32, s, elements=elements))


@settings(max_examples=150, deadline=None)
@given(arrays(st.one_of(floats, st.floats(-2.0**-10, 2.0**-10, width=32))))
def test_fp8_codes_are_speculators_arithmetic_rounded_to_nearest_even(x: np.ndarray) -> None:
    """scale = max(amax(|x[t]|) / 448, 1e-12) per token in float32, code = RNE(x / scale): the
    bytes speculators' fp8 connector (torch) writes for the same float32 input."""
    enc = encode(x, FeatureDtype.FP8_E4M3)
    amax = np.abs(x).max(axis=(1, 2))
    scales = np.maximum(amax / np.float32(448.0), np.float32(1e-12)).astype(np.float32)
    assert enc.scales is not None and np.array_equal(enc.scales, scales)
    y = (x / scales[:, None, None]).astype(np.float32)
    assert np.array_equal(enc.codes.view(np.uint8).reshape(-1), nearest_even(y.reshape(-1)))


@settings(max_examples=200, deadline=None)
@given(arrays())
def test_fp8_error_is_within_its_bound(x: np.ndarray) -> None:
    enc = encode(x, FeatureDtype.FP8_E4M3)
    assert enc.scales is not None
    assert FP8_ERROR.allows(x, enc.decode(), enc.scales)


def test_fp8_bound_is_reached_and_a_coarser_rounding_breaks_it() -> None:
    """The bound is tight (random values come within 1 % of 1/17 of |x|) and can fail: a coarser
    rounding (the mantissa's last bit cleared) is caught."""
    x = np.random.default_rng(7).normal(size=(64, 3, 256)).astype(np.float32)
    enc = encode(x, FeatureDtype.FP8_E4M3)
    assert enc.scales is not None
    big = np.abs(x) >= np.abs(x).max(axis=(1, 2), keepdims=True) / 28672
    rel = np.abs(enc.decode() - x)[big] / np.abs(x)[big]
    assert 0.99 / 17 < rel.max() <= FP8_ERROR.rel
    truncated = EncodedFeatures(enc.dtype, (enc.codes.view(np.uint8) & 0xFE).view(enc.codes.dtype), enc.scales)
    assert not FP8_ERROR.allows(x, truncated.decode(), enc.scales)


@settings(max_examples=150, deadline=None)
@given(arrays(st.floats(-2.0**100, 2.0**100, allow_nan=False, width=32)))
def test_bf16_error_is_within_its_bound(x: np.ndarray) -> None:
    enc = encode(x, FeatureDtype.BF16)
    assert enc.scales is None
    assert BF16_ERROR.allows(x, enc.decode(), np.ones(x.shape[0], np.float32))


def test_bf16_input_comes_through_unchanged() -> None:
    """vLLM's bf16 hidden states are stored as they are: decoded, the very same values."""
    x = np.random.default_rng(3).normal(scale=5, size=(9, 4, 32)).astype(ml_dtypes.bfloat16)
    enc = encode(x, FeatureDtype.BF16)
    assert np.array_equal(enc.codes.view(np.uint16), x.view(np.uint16))
    assert np.array_equal(enc.decode(), x.astype(np.float32))


def test_a_zero_token_keeps_the_floor_scale() -> None:
    x = np.zeros((2, 2, 4), np.float32)
    x[1] = 3.0
    enc = encode(x, FeatureDtype.FP8_E4M3)
    assert enc.scales is not None and enc.scales[0] == np.float32(1e-12)
    assert np.array_equal(enc.decode(), x)


@pytest.mark.parametrize(("bad", "message"), [
    (np.zeros((4, 8), np.float32), "must be \\[tokens, layers, hidden\\]"),
    (np.zeros((0, 2, 8), np.float32), "hold no values"),
    (np.zeros((2, 2, 8), np.int32), "floating point"),
    (np.array([[[1.0, np.nan]], [[0.0, 1.0]]], np.float32), "token 0 are not finite"),
    (np.array([[[1.0, 2.0]], [[np.inf, 1.0]]], np.float32), "token 1 are not finite"),
])
def test_unusable_hidden_states_are_refused(bad: np.ndarray, message: str) -> None:
    for dtype in FeatureDtype:
        with pytest.raises(FeatureValueError, match=message):
            encode(bad, dtype)


def test_bf16_refuses_what_it_cannot_hold() -> None:
    x = np.full((1, 1, 2), 3.4e38, np.float32)
    with pytest.raises(FeatureValueError, match="exceed bfloat16"):
        encode(x, FeatureDtype.BF16)
    assert encode(x, FeatureDtype.FP8_E4M3).decode()[0, 0, 0] == pytest.approx(3.4e38, rel=2**-4)


def test_bytes_per_token() -> None:
    assert bytes_per_token(3, 128, FeatureDtype.FP8_E4M3) == 3 * 128 + 4 + 8
    assert bytes_per_token(4, 5120, FeatureDtype.FP8_E4M3) == 20_492
    assert bytes_per_token(4, 5120, FeatureDtype.BF16) == 40_968
    with pytest.raises(ValueError):
        bytes_per_token(0, 128, FeatureDtype.BF16)


def test_the_range_limits_are_ml_dtypes_own() -> None:
    assert codec.FP8_MAX == np.float32(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)
    assert codec.BF16_MAX == np.float32(ml_dtypes.finfo(ml_dtypes.bfloat16).max)


def test_commands_start_without_ml_dtypes() -> None:
    """ml_dtypes costs ~0.5 s of CPU to import: the CLIs and the consumer load it only when a row
    is encoded or decoded, not at start."""
    code = ("import sys, genqueue.producer.cli, genqueue.producer.status.core, genqueue.consumer.worker, "
            "genqueue.common.features; print(sorted(m for m in ('ml_dtypes',) if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
