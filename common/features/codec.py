"""Hidden states in and out of their stored dtype (pure: arrays in, arrays out).

A row's hidden states are an array [tokens, layers, hidden]; vLLM hands them over in bf16.
They are stored in one of two dtypes (FeatureDtype):

- FP8_E4M3: float8 e4m3fn (the OCP "FN" variant: no infinities, max 448, NaN = S.1111.111), the
  bytes torch.float8_e4m3fn and safetensors' F8_E4M3 hold, with **one float32 scale per token**,
  shared by all its layers and its whole hidden vector. That is what speculators' fp8 connector
  writes (`hidden_states` fp8 [T, L, H] beside `hidden_states_scales` fp32 [T, 1, 1]), with the
  same arithmetic: scale = max(amax(|x[t]|) / 448, 1e-12), code = RNE(x / scale), all in float32,
  so a row encoded here is bit for bit the row speculators' trainer reads from its own connector.
  (ml_dtypes' cast and torch's differ only past 464 in magnitude, which x / scale never reaches.)
- BF16: bfloat16, round to nearest even; vLLM's own bf16 comes through unchanged.

Decoding gives float32: code x scale in float32 (fp8), or the bf16 value widened (exact).
The error a decoded element may carry is FP8_ERROR's or BF16_ERROR's (`error_bound`): for fp8
at most 1/17 of |x| plus 2**-10 of the token's scale, for bf16 2**-8 of |x|.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from functools import cache
from typing import Any

import numpy as np
import numpy.typing as npt

from genqueue.common.errors import FeatureValueError


@cache
def _ml_dtypes() -> tuple[np.dtype[Any], np.dtype[Any]]:
    """(float8_e4m3fn, bfloat16): ml_dtypes is imported on first use, not with the module, as it
    costs every command that only names a FeatureDtype (status, the consumer's start) ~0.5 s of CPU."""
    import ml_dtypes

    return np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(ml_dtypes.bfloat16)


def f8_dtype() -> np.dtype[Any]:
    return _ml_dtypes()[0]


def bf16_dtype() -> np.dtype[Any]:
    return _ml_dtypes()[1]


#: The largest finite e4m3fn value, code S.1111.110 (448): a token's largest |x| is encoded as this.
FP8_MAX = np.float32(448.0)
#: The scale's floor, as speculators clamps it: an all-zero token keeps a usable scale.
SCALE_FLOOR = np.float32(1e-12)
#: bf16's largest finite value (code 0x7F7F): a float32 above it would round to infinity.
BF16_MAX = np.array([0x7F7F0000], dtype=np.uint32).view(np.float32)[0]

Float32Array = npt.NDArray[np.float32]


class FeatureDtype(StrEnum):
    """How a row's hidden states are stored."""

    FP8_E4M3 = "fp8_e4m3"  # float8 e4m3fn, a float32 scale per token (the default: half of bf16)
    BF16 = "bf16"

    @property
    def itemsize(self) -> int:
        """Bytes per stored element."""
        return 1 if self is FeatureDtype.FP8_E4M3 else 2

    @property
    def scaled(self) -> bool:
        """Whether each token carries a float32 scale."""
        return self is FeatureDtype.FP8_E4M3

    @property
    def numpy(self) -> np.dtype[Any]:
        return f8_dtype() if self is FeatureDtype.FP8_E4M3 else bf16_dtype()

    @property
    def safetensors(self) -> str:
        """The dtype's name in a safetensors header (what torch reads as float8_e4m3fn / bfloat16)."""
        return "F8_E4M3" if self is FeatureDtype.FP8_E4M3 else "BF16"


@dataclass(frozen=True, slots=True)
class ErrorBound:
    """|decoded - x| <= rel * |x| + scaled * s (s: the token's scale; 1 for unscaled dtypes)."""

    rel: float
    scaled: float

    def allows(self, x: Float32Array, decoded: Float32Array, scales: Float32Array) -> bool:
        """Whether DECODED is within the bound of X ([T, L, H]) with the tokens' SCALES ([T])."""
        s = scales.astype(np.float64)[:, None, None]
        err = np.abs(decoded.astype(np.float64) - x.astype(np.float64))
        return bool(np.all(err <= self.rel * np.abs(x.astype(np.float64)) + self.scaled * s))


#: fp8 e4m3: half an ulp of a 3-bit mantissa (at most 1/17 of |x|, reached just above a power of
#: two), half the smallest subnormal (2**-10 of the scale) below 2**-6, and float32's rounding of
#: the division and the product (2**-22).
FP8_ERROR = ErrorBound(rel=1 / 17 + 2.0**-22, scaled=2.0**-10 * (1 + 2.0**-22))
#: bf16: half an ulp of an 8-bit significand, and half its smallest subnormal (2**-134): bf16
#: keeps float32's exponent, so only float32's own subnormals lose more than 2**-8.
BF16_ERROR = ErrorBound(rel=2.0**-8, scaled=2.0**-134)


def error_bound(dtype: FeatureDtype) -> ErrorBound:
    """The largest error a decoded element of DTYPE may carry (the module's docstring)."""
    return FP8_ERROR if dtype is FeatureDtype.FP8_E4M3 else BF16_ERROR


@dataclass(frozen=True, slots=True)
class EncodedFeatures:
    """A row's hidden states as stored: CODES of DTYPE [tokens, layers, hidden], and for fp8 a
    float32 scale per token (SCALES [tokens]; None for bf16)."""

    dtype: FeatureDtype
    codes: npt.NDArray[Any]
    scales: Float32Array | None

    @property
    def tokens(self) -> int:
        return int(self.codes.shape[0])

    @property
    def layers(self) -> int:
        return int(self.codes.shape[1])

    @property
    def hidden(self) -> int:
        return int(self.codes.shape[2])

    def decode(self) -> Float32Array:
        """The hidden states as float32 [tokens, layers, hidden]."""
        wide = self.codes.astype(np.float32)
        if self.scales is None:
            return wide
        return wide * self.scales[:, None, None]


def encode(hidden: npt.ArrayLike, dtype: FeatureDtype) -> EncodedFeatures:
    """HIDDEN ([tokens, layers, hidden], any float dtype: bf16, float16, float32) in DTYPE.
    Raises FeatureValueError for another shape, no tokens, or a value that is not finite."""
    x = _checked(hidden)
    amax = np.abs(x).max(axis=(1, 2))
    bad = np.flatnonzero(~(amax <= np.finfo(np.float32).max))
    if bad.size:
        raise FeatureValueError(f"hidden states of token {int(bad[0])} are not finite (NaN or infinity)")
    if dtype is FeatureDtype.BF16:
        over = np.flatnonzero(amax > BF16_MAX)
        if over.size:
            raise FeatureValueError(f"hidden states of token {int(over[0])} exceed bfloat16's range")
        return EncodedFeatures(dtype, x.astype(bf16_dtype()), None)
    scales = np.maximum(amax / FP8_MAX, SCALE_FLOOR).astype(np.float32)
    codes = (x / scales[:, None, None]).astype(f8_dtype())
    return EncodedFeatures(dtype, codes, scales)


def _checked(hidden: npt.ArrayLike) -> Float32Array:
    x = np.asarray(hidden)
    if x.ndim != 3:
        raise FeatureValueError(f"hidden states must be [tokens, layers, hidden]; got shape {list(x.shape)}")
    if 0 in x.shape:
        raise FeatureValueError(f"hidden states hold no values: shape {list(x.shape)}")
    if x.dtype.kind != "f" and x.dtype not in _ml_dtypes():
        raise FeatureValueError(f"hidden states must be floating point; got {x.dtype}")
    return x.astype(np.float32, copy=False)


def bytes_per_token(layers: int, hidden: int, dtype: FeatureDtype) -> int:
    """Bytes a token of a row takes in a shard: LAYERS x HIDDEN stored elements, its scale (fp8),
    and its token id (int64, as speculators' files hold it). A row adds a fixed overhead on top
    (its safetensors header and frame: shard.row_overhead)."""
    if layers < 1 or hidden < 1:
        raise ValueError(f"layers and hidden size are positive: {layers}, {hidden}")
    return layers * hidden * dtype.itemsize + (4 if dtype.scaled else 0) + 8
