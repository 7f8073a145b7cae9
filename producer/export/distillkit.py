"""DistillKit's compressed top-k tables, written with numpy as its own torch code writes them
(arcee-ai/DistillKit a61c2e7d25c2e990d45832e12bd8542bdee9c810, distillkit/compression/:
`LogprobCompressor.compress_from_sparse`, `compress_monotonic_logprobs`, `pack_to_bytes`), so
that its trainer's `decompress_to_sparse` reads them back; and read back the same way here, so an
export states the error its tables carry.

One position's table is two byte strings. `compressed_logprobs`: the k log-probabilities
sorted descending (delta-coded when asked: each minus the one before, the first as it is), the
first `exact_k` in `exact_dtype`, then the coefficients of a least-squares fit of the rest over
`polynomial_terms` (powers of t = 0..n-1, or of t in [0, 1], and sqrt/exp) in `term_dtype`, then
each residual bin: its scale in `scale_dtype` and its values quantised to `element_bits`; all
little-endian, bit fields packed most significant bit first. `bytepacked_indices`: the k token
ids in the same order, ceil(log2 d) bits each, packed the same way. The config is the
`DistributionQuantizationConfig` its `sample_logits_vllm.py --compression-config` and its
trainer's `teacher.logprob_compressor` take; the trainer must be given the same one.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import numpy as np
import numpy.typing as npt

from genqueue.common.errors import UserError

F32 = npt.NDArray[np.float32]
F64 = npt.NDArray[np.float64]
U8 = npt.NDArray[np.uint8]
I64 = npt.NDArray[np.int64]

#: DistillKit's commit whose format this module writes.
DISTILLKIT_COMMIT = "a61c2e7d25c2e990d45832e12bd8542bdee9c810"


class Theirs:
    """Numbers of DistillKit's code, not ours to tune."""

    #: its pseudo-inverse drops singular values at or below this (monotonic_logprobs._solve_least_squares)
    SVD_TOL = 1e-5
    #: the label its trainer (and Hugging Face's loss) ignores: `labels >= 0` masks its KL term
    IGNORE = -100


class VocabularyError(UserError):
    """A table names a token id past the config's vocabulary (d)."""


class TermDtype(StrEnum):
    """A float type of DistillKit's config (compression/config.py TermDtype)."""

    FLOAT16 = "float16"
    BFLOAT16 = "bfloat16"
    FLOAT32 = "float32"
    FLOAT64 = "float64"

    @property
    def width(self) -> int:
        return {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}[self.value]


class SpecialTerm(StrEnum):
    SQRT = "sqrt"
    EXP = "exp"


@dataclass(frozen=True, slots=True)
class QuantizationBin:
    scale_dtype: TermDtype
    element_bits: int
    num_elements: int


@dataclass(frozen=True, slots=True)
class DistillKitConfig:
    """DistillKit's DistributionQuantizationConfig (its field names and defaults)."""

    d: int
    k: int
    exact_k: int
    exact_dtype: TermDtype = TermDtype.FLOAT32
    polynomial_terms: tuple[int | SpecialTerm, ...] = ()
    term_dtype: TermDtype = TermDtype.FLOAT32
    residual_bins: tuple[QuantizationBin, ...] = ()
    delta_encoding: bool = True
    error_diffusion: bool = False
    normalize_t: bool = False

    @classmethod
    def from_mapping(cls, raw: Mapping[str, Any], *, where: str) -> DistillKitConfig:
        """The config in RAW (a parsed YAML mapping), checked as DistillKit checks it. Raises UserError."""
        known = {f for f in cls.__dataclass_fields__}
        if not isinstance(raw, Mapping):
            raise UserError(f"{where}: not a mapping of DistillKit's logprob_compressor fields")
        if "teacher" in raw and isinstance(raw["teacher"], Mapping) and "logprob_compressor" in raw["teacher"]:
            raw = raw["teacher"]["logprob_compressor"]  # a whole DistillKit run config
        unknown = sorted(set(raw) - known)
        if unknown:
            raise UserError(f"{where}: {', '.join(unknown)} is no field of DistillKit's logprob_compressor "
                            f"(fields: {', '.join(sorted(known))})")
        missing = [f for f in ("d", "k", "exact_k") if f not in raw]
        if missing:
            raise UserError(f"{where}: {', '.join(missing)} missing (d is the model's vocabulary size)")
        try:
            cfg = cls(
                d=_int(raw["d"]), k=_int(raw["k"]), exact_k=_int(raw["exact_k"]),
                exact_dtype=TermDtype(raw.get("exact_dtype", "float32")),
                polynomial_terms=tuple(SpecialTerm(t) if isinstance(t, str) else _int(t)
                                       for t in (raw.get("polynomial_terms") or ())),
                term_dtype=TermDtype(raw.get("term_dtype", "float32")),
                residual_bins=tuple(QuantizationBin(TermDtype(b["scale_dtype"]), _int(b["element_bits"]),
                                                    _int(b["num_elements"])) for b in (raw.get("residual_bins") or ())),
                delta_encoding=bool(raw.get("delta_encoding", True)),
                error_diffusion=bool(raw.get("error_diffusion", False)),
                normalize_t=bool(raw.get("normalize_t", False)))
        except (ValueError, TypeError, KeyError) as e:
            raise UserError(f"{where}: {e}") from None
        cfg.check(where)
        return cfg

    def check(self, where: str) -> None:
        """DistillKit's own validation (check_valid and the Field bounds), and a vocabulary its
        index packing holds."""
        if self.d < 2 or self.k < 1 or self.exact_k < 0:
            raise UserError(f"{where}: d must be > 1, k > 0 and exact_k >= 0")
        if self.k < self.exact_k:
            raise UserError(f"{where}: k must be >= exact_k")
        if self.k > self.d:
            raise UserError(f"{where}: k = {self.k} is past the vocabulary (d = {self.d})")
        if self.exact_k < self.k and not self.polynomial_terms and not self.residual_bins:
            raise UserError(f"{where}: exact_k < k needs polynomial_terms or residual_bins")
        if sum(b.num_elements for b in self.residual_bins) > self.k - self.exact_k:
            raise UserError(f"{where}: the residual bins hold more than k - exact_k values")
        if any(not 1 <= b.element_bits <= 64 or b.num_elements < 1 for b in self.residual_bins):
            raise UserError(f"{where}: a residual bin needs 1-64 element_bits and num_elements > 0")
        if self.index_bits < (self.d - 1).bit_length():
            raise UserError(f"{where}: d={self.d}: DistillKit packs ids in {self.index_bits} bits, too few for "
                            f"id {self.d - 1}")

    @property
    def index_bits(self) -> int:
        """ceil(log2 d) as DistillKit computes it (in float32)."""
        return int(np.ceil(np.log2(np.float32(self.d))))

    @property
    def logprob_bytes(self) -> int:
        """Bytes of one position's compressed_logprobs (config.logprob_bits() / 8)."""
        bits = self.exact_k * self.exact_dtype.width * 8 + len(self.polynomial_terms) * self.term_dtype.width * 8
        for b in self.residual_bins:
            bits += -(-(b.scale_dtype.width * 8 + b.element_bits * b.num_elements) // 8) * 8
        return -(-bits // 8)

    @property
    def index_bytes(self) -> int:
        """Bytes of one position's bytepacked_indices."""
        return -(-self.k * self.index_bits // 8)

    def to_mapping(self) -> dict[str, Any]:
        """The config as DistillKit's model_dump(mode="json") writes it."""
        return {"d": self.d, "k": self.k, "exact_k": self.exact_k, "exact_dtype": self.exact_dtype.value,
                "polynomial_terms": [t.value if isinstance(t, SpecialTerm) else t for t in self.polynomial_terms]
                or None,
                "term_dtype": self.term_dtype.value,
                "residual_bins": [{"scale_dtype": b.scale_dtype.value, "element_bits": b.element_bits,
                                   "num_elements": b.num_elements} for b in self.residual_bins],
                "delta_encoding": self.delta_encoding, "error_diffusion": self.error_diffusion,
                "normalize_t": self.normalize_t}


def _int(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"{v!r} is not an integer")
    return v


# --- float types, as torch rounds and lays them out ------------------------------------------

def _bf16_bits(x: npt.NDArray[Any]) -> npt.NDArray[np.uint16]:
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)  # round to nearest even


def as_dtype(x: npt.NDArray[Any], dtype: TermDtype) -> F64:
    """X rounded to DTYPE, held in float64."""
    if dtype is TermDtype.BFLOAT16:
        return (_bf16_bits(x).astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return np.asarray(x).astype(_NP[dtype]).astype(np.float64)


_NP: dict[TermDtype, Any] = {TermDtype.FLOAT16: np.float16, TermDtype.FLOAT32: np.float32,
                             TermDtype.FLOAT64: np.float64}


def _to_bytes(x: npt.NDArray[Any], dtype: TermDtype) -> U8:
    """X [N, m] in DTYPE's little-endian bytes, [N, m * width]."""
    raw = _bf16_bits(x) if dtype is TermDtype.BFLOAT16 else np.ascontiguousarray(x, dtype=_NP[dtype])
    return raw.astype(raw.dtype.newbyteorder("<")).view(np.uint8).reshape(x.shape[0], -1)


def _from_bytes(b: U8, dtype: TermDtype, n: int) -> F64:
    b = np.ascontiguousarray(b)
    if dtype is TermDtype.BFLOAT16:
        return (b.view("<u2").astype(np.uint32) << 16).view(np.float32).astype(np.float64).reshape(-1, n)
    out: F64 = b.view(np.dtype(_NP[dtype]).newbyteorder("<")).astype(np.float64).reshape(-1, n)
    return out


# --- bit packing (bitpack.py) -----------------------------------------------------------------

def _word(bits: int) -> np.dtype[Any]:
    return np.dtype(">u4") if bits <= 32 else np.dtype(">u8")


def pack_bits(x: npt.NDArray[Any], bits: int) -> U8:
    """X [N, m] non-negative ints, BITS each, most significant first, into [N, ceil(m*bits/8)] bytes."""
    word = _word(bits)
    n, m = x.shape
    stream = np.unpackbits(np.ascontiguousarray(x, dtype=word).view(np.uint8).reshape(n, m, word.itemsize),
                           axis=-1, bitorder="big")[:, :, word.itemsize * 8 - bits:]  # each value's low BITS
    return np.packbits(stream.reshape(n, m * bits), axis=-1, bitorder="big")


def unpack_bits(b: U8, bits: int, n: int) -> I64:
    """pack_bits undone: [N, n] ints."""
    word = _word(bits)
    rows = b.shape[0]
    stream = np.unpackbits(b, axis=-1, bitorder="big")[:, : n * bits].reshape(rows, n, bits)
    full = np.zeros((rows, n, word.itemsize * 8), np.uint8)
    full[:, :, word.itemsize * 8 - bits:] = stream
    out: I64 = np.packbits(full, axis=-1, bitorder="big").view(word).reshape(rows, n).astype(np.int64)
    return out


# --- the polynomial fit and the quantiser (monotonic_logprobs.py) -----------------------------

def _terms(cfg: DistillKitConfig, t: int) -> F64:
    pts = np.linspace(0, 1, t, dtype=np.float32) if cfg.normalize_t else np.arange(t, dtype=np.float32)
    cols = [pts ** np.float32(i) if isinstance(i, int) else getattr(np, i.value)(pts) for i in cfg.polynomial_terms]
    return np.stack(cols, axis=-1).astype(np.float64)


def _pinv(x: F64) -> F64:
    u, s, vh = np.linalg.svd(x, full_matrices=False)
    sinv = np.where(s > Theirs.SVD_TOL, 1 / np.where(s > Theirs.SVD_TOL, s, 1), 0)
    return np.asarray((vh.T * sinv) @ u.T, dtype=np.float64)


def _fit(cfg: DistillKitConfig, t: int, coeffs: F64) -> F64:
    """The fitted curve [N, t] of COEFFS [N, terms] (in term_dtype, as the decoder sums it)."""
    x = as_dtype(_terms(cfg, t), cfg.term_dtype)
    return as_dtype(coeffs @ x.T, cfg.term_dtype)


def _quantise(values: F64, b: QuantizationBin, err: F64 | None, diffuse: bool) -> tuple[F64, I64, F64 | None]:
    """(scale [N, 1], quantised [N, n] as unsigned, the carried error) as DistillKit's
    quantize_naive / error_diffuse_and_quantize compute them."""
    top = np.abs(values).max(axis=-1, keepdims=True)
    qabs = 1.0 if b.element_bits == 1 else float(2 ** (b.element_bits - 1))
    scale = as_dtype(np.where(top == 0, 1.0, top / qabs).astype(np.float32), b.scale_dtype)
    qmin, qmax = (0.0, 1.0) if b.element_bits == 1 else (-(2.0 ** (b.element_bits - 1)), 2.0 ** (b.element_bits - 1) - 1)
    scaled = values / scale
    if not diffuse:
        return scale, (np.clip(np.round(scaled), qmin, qmax) - qmin).astype(np.int64), None
    carry = np.zeros(values.shape[0]) if err is None else err
    q = np.empty(values.shape, dtype=np.int64)
    for i in range(values.shape[1]):
        cur = scaled[:, i] + carry
        qi = np.clip(np.round(cur), qmin, qmax)
        carry = cur - qi
        q[:, i] = (qi - qmin).astype(np.int64)
    return scale, q, carry


def _dequantise(q: I64, scale: F64, bits: int) -> F64:
    if bits == 1:
        return (q.astype(np.float32) * 2.0 - 1.0) * scale
    return (q - 2.0 ** (bits - 1)).astype(np.float32).astype(np.float64) * scale


# --- one table of positions --------------------------------------------------------------------

def sort_tables(ids: npt.NDArray[Any], logprobs: npt.NDArray[Any], k: int) -> tuple[I64, F32]:
    """The first K entries of each row, sorted by log-probability descending (compress_from_sparse
    sorts before it encodes)."""
    order = np.argsort(-logprobs, axis=-1, kind="stable")[:, :k]
    return (np.take_along_axis(ids, order, axis=-1).astype(np.int64),
            np.take_along_axis(logprobs, order, axis=-1).astype(np.float32))


def encode(cfg: DistillKitConfig, ids: npt.NDArray[Any], logprobs: F32) -> tuple[U8, U8]:
    """(compressed_logprobs [N, logprob_bytes], bytepacked_indices [N, index_bytes]) of N positions'
    top-k tables IDS, LOGPROBS [N, k], sorted descending (sort_tables), finite."""
    n = logprobs.shape[0]
    vals: F64 = logprobs.astype(np.float64)
    if cfg.delta_encoding:
        if cfg.error_diffusion:
            deltas = np.concatenate([vals[:, :1], vals[:, 1:] - vals[:, :-1]], axis=-1)
            carry = np.zeros(n)
            out = np.empty_like(deltas)
            for i in range(deltas.shape[1]):
                cur = deltas[:, i] + carry
                out[:, i] = cur.astype(np.float32)
                carry = cur - out[:, i]
            vals = out
        else:
            lp = logprobs.astype(np.float32)
            vals = np.concatenate([lp[:, :1], lp[:, 1:] - lp[:, :-1]], axis=-1).astype(np.float64)
    chunks: list[U8] = []
    if cfg.exact_k:
        chunks.append(_to_bytes(vals[:, : cfg.exact_k], cfg.exact_dtype))
    rest = vals[:, cfg.exact_k: cfg.k]
    if cfg.polynomial_terms:
        coeffs = as_dtype((rest @ _pinv(_terms(cfg, rest.shape[1])).T).astype(np.float32), cfg.term_dtype)
        chunks.append(_to_bytes(coeffs, cfg.term_dtype))
        rest = rest - _fit(cfg, rest.shape[1], coeffs)
    err: F64 | None = None
    at = 0
    for b in cfg.residual_bins:
        scale, q, err = _quantise(rest[:, at: at + b.num_elements], b, err, cfg.error_diffusion)
        chunks.append(_to_bytes(scale, b.scale_dtype))
        chunks.append(pack_bits(q, b.element_bits))
        at += b.num_elements
    packed = np.concatenate(chunks, axis=-1) if chunks else np.zeros((n, 0), np.uint8)
    return packed.astype(np.uint8), pack_bits(ids, cfg.index_bits)


def decode(cfg: DistillKitConfig, packed: U8, indices: U8) -> tuple[I64, F64]:
    """(ids [N, k], log-probabilities [N, k]) as DistillKit's decompress_to_sparse gives them
    (in exact_dtype, its output type)."""
    n = packed.shape[0]
    at = cfg.exact_k * cfg.exact_dtype.width
    exact = _from_bytes(packed[:, :at], cfg.exact_dtype, cfg.exact_k) if cfg.exact_k else np.zeros((n, 0))
    t = cfg.k - cfg.exact_k
    approx = np.zeros((n, t))
    if cfg.polynomial_terms:
        w = len(cfg.polynomial_terms) * cfg.term_dtype.width
        coeffs = _from_bytes(packed[:, at: at + w], cfg.term_dtype, len(cfg.polynomial_terms))
        approx = _fit(cfg, t, coeffs)
        at += w
    res: list[F64] = []
    for b in cfg.residual_bins:
        scale = _from_bytes(packed[:, at: at + b.scale_dtype.width], b.scale_dtype, 1)
        at += b.scale_dtype.width
        nb = -(-b.num_elements * b.element_bits // 8)
        res.append(_dequantise(unpack_bits(packed[:, at: at + nb], b.element_bits, b.num_elements), scale,
                               b.element_bits))
        at += nb
    if res:
        r = np.concatenate(res, axis=-1)
        approx = approx + as_dtype(np.pad(r, ((0, 0), (0, t - r.shape[1]))), cfg.exact_dtype)
    # torch.cat promotes: the fit's term_dtype widens the output past exact_dtype
    wide = cfg.exact_dtype
    if cfg.polynomial_terms and cfg.term_dtype is not cfg.exact_dtype:
        wide = TermDtype.FLOAT64 if TermDtype.FLOAT64 in (cfg.term_dtype, cfg.exact_dtype) else TermDtype.FLOAT32
    out = np.concatenate([exact, as_dtype(approx, wide)], axis=-1)
    if cfg.delta_encoding:
        out = as_dtype(np.cumsum(out.astype(np.float32), axis=-1, dtype=np.float32), cfg.exact_dtype)
    return unpack_bits(indices, cfg.index_bits, cfg.k), out


def bytes_per_position(cfg: DistillKitConfig) -> int:
    """Both columns' bytes for one position (Parquet's own encoding aside)."""
    return cfg.logprob_bytes + cfg.index_bytes
