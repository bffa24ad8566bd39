"""4-bit group-wise weights (weight_dtype "int4"): the one format, its packing, and the ways in.

Per output row and group of 32 consecutive input features: 4-bit unsigned codes q in 0..15 and
two float16 values, a scale d and a min m, w = d * q + m. 16 + 4 bytes per 32 weights: 5 bits
a weight, a third of bf16's bytes, which is what a decode step's time is made of.

Nibble layout (`pack`): byte 16 g + j of a row holds q[32 g + j] in its low nibble and
q[32 g + j + 16] in its high one. One AND unpacks elements 0..15 of a group, a shift and an AND
16..31, for a whole vector of groups at once (csrc/q4.h); it is GGUF's Q4_0 / Q4_1 order too,
so those blocks' code bytes are taken as they are.

Three ways in, all onto the same `Int4Weight`:
  - `quantize` from float weights: asymmetric per group (min / max, as Q4_1), then a few
    narrowed ranges, each refitted by least squares, the one with the least squared error kept;
  - `from_gguf` for Q4_0 (m = -8 d, exact), Q4_1 (exact) and Q4_K (d = d_super * sc,
    m = -dmin * mn per sub-block of 32: exact up to float16's rounding of those products):
    a GGUF's codes are kept, never dequantized and quantized again.
"""

from __future__ import annotations

from dataclasses import dataclass

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as QType

__all__ = ["GGUF_INT4_TYPES", "GROUP", "INT4", "Int4Weight", "cat_rows", "from_gguf", "pack", "quantize", "unpack"]

GROUP = 32
# The marker the resolved precision (models/precision.py) holds for weight_dtype "int4" (no
# tensor has this dtype: the codes are uint8, two a byte, and the (d, m) pairs float16).
INT4 = torch.uint4
GGUF_INT4_TYPES = (QType.Q4_0, QType.Q4_1, QType.Q4_K)
# Narrowings of a group's [min, max] tried by `quantize` (fractions of the range cut from the
# bottom and the top); each is refitted by least squares, so an outlier can be given up.
_RANGE_CUTS = ((0.0, 0.0), (0.0, 0.06), (0.06, 0.0), (0.05, 0.05), (0.1, 0.1))


@dataclass(frozen=True)
class Int4Weight:
    """A [N, K] weight as codes uint8 [N, K / 2] and (d, m) float16 [N, K / 32, 2]."""

    codes: torch.Tensor
    dm: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return (self.codes.shape[0], self.codes.shape[1] * 2)

    def numel(self) -> int:
        return self.shape[0] * self.shape[1]

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.dm.nbytes

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """d * q + m in float32 (as the kernels compute it), then `dtype`."""
        n, k = self.shape
        q = unpack(self.codes).view(n, k // GROUP, GROUP).float()
        dm = self.dm.float()
        return (q * dm[..., :1] + dm[..., 1:]).view(n, k).to(dtype)

    def index_select(self, ids: torch.Tensor) -> Int4Weight:
        """Rows `ids` (an embedding lookup, a row permutation)."""
        return Int4Weight(self.codes.index_select(0, ids), self.dm.index_select(0, ids))

    def to(self, device: torch.device | str) -> Int4Weight:
        return Int4Weight(self.codes.to(device), self.dm.to(device))


def pack(q: torch.Tensor) -> torch.Tensor:
    """Codes q (uint8 [N, K] in 0..15, K a multiple of 32) into [N, K / 2] bytes, the layout above."""
    n, k = q.shape
    g = q.view(n, k // GROUP, 2, GROUP // 2)
    return (g[:, :, 0] | (g[:, :, 1] << 4)).reshape(n, k // 2).contiguous()


def unpack(codes: torch.Tensor) -> torch.Tensor:
    """`pack`'s inverse: uint8 [N, K] codes."""
    n, half = codes.shape
    b = codes.view(n, half // (GROUP // 2), GROUP // 2)
    return torch.stack([b & 15, b >> 4], dim=2).reshape(n, half * 2)


def quantize(weight: torch.Tensor, rows_per_pass: int = 2048) -> Int4Weight:
    """Float weights [N, K] (K a multiple of 32) to 4 bits per group, rows_per_pass rows at a time."""
    n, k = weight.shape
    if k % GROUP:
        raise ValueError(f"int4 weights need in_features a multiple of {GROUP}, got {k}")
    codes, dms = [], []
    for r0 in range(0, n, rows_per_pass):
        q, dm = _quantize_groups(weight[r0 : r0 + rows_per_pass].float().reshape(-1, k // GROUP, GROUP))
        codes.append(pack(q.view(-1, k)))
        dms.append(dm)
    return Int4Weight(torch.cat(codes).contiguous(), torch.cat(dms).contiguous())


def _fit(w: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes for the range [lo, hi], then (d, m) refitted by least squares to those codes and
    rounded to float16, then the codes again for that (d, m): (q, dm [.., 2] float16, error)."""
    d = ((hi - lo) / 15).clamp_min(1e-30)
    q = torch.round((w - lo) / d).clamp_(0, 15)
    n = w.shape[-1]
    sq, sw = q.sum(-1, keepdim=True), w.sum(-1, keepdim=True)
    den = n * (q * q).sum(-1, keepdim=True) - sq * sq
    d_ls = (n * (q * w).sum(-1, keepdim=True) - sq * sw) / den.clamp_min(1e-30)
    ok = (den > 0) & (d_ls > 0)
    d = torch.where(ok, d_ls, d)
    m = torch.where(ok, (sw - d * sq) / n, lo)
    dm = torch.cat([d, m], -1).to(torch.float16)
    d16, m16 = dm[..., :1].float(), dm[..., 1:].float()
    q = torch.round((w - m16) / d16.clamp_min(1e-30)).clamp_(0, 15)
    err = ((q * d16 + m16 - w) ** 2).sum(-1)
    return q, dm, err


def _quantize_groups(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[R, G, 32] float32 -> codes uint8 [R, G, 32] and dm float16 [R, G, 2]: the best of _RANGE_CUTS."""
    lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    best_q, best_dm, best_err = None, None, None
    for a, b in _RANGE_CUTS:
        span = hi - lo
        q, dm, err = _fit(w, lo + a * span, hi - b * span)
        if best_err is None:
            best_q, best_dm, best_err = q, dm, err
            continue
        better = err < best_err
        best_q = torch.where(better[..., None], q, best_q)
        best_dm = torch.where(better[..., None], dm, best_dm)
        best_err = torch.minimum(err, best_err)
    assert best_q is not None and best_dm is not None
    return best_q.to(torch.uint8), best_dm


def cat_rows(parts: list[Int4Weight]) -> Int4Weight:
    """Row-wise concatenation (q/k/v into qkv, gate and up into gate_up)."""
    return Int4Weight(torch.cat([p.codes for p in parts]).contiguous(), torch.cat([p.dm for p in parts]).contiguous())


def _f16(a: np.ndarray) -> np.ndarray:
    return a.copy().view(np.float16).astype(np.float32)


def from_gguf(data: np.ndarray, qtype: QType, rows: int, cols: int) -> Int4Weight:
    """A GGUF Q4_0 / Q4_1 / Q4_K tensor's raw blocks ([rows, cols] in torch's order) as Int4Weight."""
    block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    if cols % block:
        raise ValueError(f"{qtype.name} rows of {cols} values are not whole blocks of {block}")
    blocks = np.ascontiguousarray(data).view(np.uint8).reshape(rows * (cols // block), nbytes)
    if qtype == QType.Q4_0:
        d = _f16(blocks[:, 0:2])
        dm, codes = np.concatenate([d, -8 * d], 1), blocks[:, 2:]
    elif qtype == QType.Q4_1:
        dm, codes = np.concatenate([_f16(blocks[:, 0:2]), _f16(blocks[:, 2:4])], 1), blocks[:, 4:]
    elif qtype == QType.Q4_K:
        dm, q = _q4_k(blocks)
        codes = pack(torch.from_numpy(q.reshape(-1, cols))).numpy()
    else:
        raise ValueError(f"{qtype.name} is not a 4-bit type int4 keeps (those are {', '.join(t.name for t in GGUF_INT4_TYPES)})")
    return Int4Weight(
        torch.from_numpy(np.ascontiguousarray(codes).reshape(rows, cols // 2)).contiguous(),
        torch.from_numpy(dm.astype(np.float16).reshape(rows, cols // GROUP, 2)).contiguous(),
    )


def _q4_k(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K super-blocks (d, dmin, 12 bytes of 6-bit scales and mins for 8 sub-blocks of 32, 128
    bytes of codes: sub-blocks 2i and 2i + 1 are the low and high nibbles of bytes 32 i ..) as
    per-sub-block (d * sc, -dmin * mn) float32 [B * 8, 2] and codes uint8 [B, 256] in order."""
    d, dmin = _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4])
    s = blocks[:, 4:16].astype(np.uint8)
    lo4, hi4 = s[:, 0:4], s[:, 4:8]
    sc = np.concatenate([lo4 & 63, (s[:, 8:12] & 15) | ((lo4 >> 6) << 4)], 1).astype(np.float32)
    mn = np.concatenate([hi4 & 63, (s[:, 8:12] >> 4) | ((hi4 >> 6) << 4)], 1).astype(np.float32)
    dm = np.stack([d * sc, -dmin * mn], -1).reshape(-1, 2)
    qs = blocks[:, 16:].reshape(-1, 4, 1, 32)
    q = np.concatenate([qs & 15, qs >> 4], 2).reshape(-1, 256)
    return dm, q
