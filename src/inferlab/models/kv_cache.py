"""One layer's paged K/V cache, and the int8 storage format.

A float cache (float32 / bfloat16 / float16) is just K and V, [kv_heads, slots, head_dim]. An
int8 cache stores the same shape as int8 codes plus one float32 scale per (KV head, slot),
[kv_heads, slots]: symmetric per row, scale = max|x| / 127 over the head_dim values of one
token's one KV head, code = round(x / scale). A row then takes head_dim + 4 bytes instead of
2 * head_dim (68 against 128 at head_dim 64: 1.88x the tokens in the same memory), and decode
attention, which reads every cached row once per step, reads about half the bytes.

Why float32 scales rather than float16 (66 bytes a row, 3% more tokens): code * scale is then
one exact float32 product wherever it is formed (the decode kernel folds the scale into the
score and the probability, torch multiplies it back in), so every path dequantizes to the same
numbers, and no scale can underflow or overflow.

Writers (rope_write_kv, DecoderStep, `write_kv` below) and readers (the decode kernel,
`gather_blocks`, the SDPA fallback) all go through this one format.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from inferlab.models.huge_pages import zeros_huge

INT8_MAX = 127
SCALE_DTYPE = torch.float32  # see the module docstring


@dataclass(frozen=True)
class KVCache:
    """One layer's cache. `k_scale` / `v_scale` are set exactly when K and V are int8 codes."""

    k: torch.Tensor  # [kvH, slots, D]
    v: torch.Tensor
    k_scale: torch.Tensor | None = None  # [kvH, slots] float32, int8 caches only
    v_scale: torch.Tensor | None = None

    def __post_init__(self) -> None:
        quantized = self.k.dtype == torch.int8
        if quantized != (self.k_scale is not None and self.v_scale is not None):
            raise ValueError("an int8 K/V cache needs k_scale and v_scale, and only an int8 one has them")

    @property
    def dtype(self) -> torch.dtype:
        """How K and V are stored (torch.int8 for codes with scales)."""
        return self.k.dtype

    @property
    def quantized(self) -> bool:
        return self.k_scale is not None

    @property
    def nbytes(self) -> int:
        scales = (self.k_scale.nbytes + self.v_scale.nbytes) if self.k_scale is not None and self.v_scale is not None else 0
        return self.k.nbytes + self.v.nbytes + scales


def kv_row_bytes(head_dim: int, dtype: torch.dtype) -> int:
    """Bytes of one token's K (or V) for one KV head: the values, plus the scale of an int8 row."""
    elem = torch.empty((), dtype=dtype).element_size()
    return head_dim * elem + (SCALE_DTYPE.itemsize if dtype == torch.int8 else 0)


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """K and V of one token in every layer, as stored (int8: with their scales)."""
    return 2 * num_layers * num_kv_heads * kv_row_bytes(head_dim, dtype)


def allocate_kv_cache(
    num_layers: int, num_kv_heads: int, head_dim: int, num_slots: int, dtype: torch.dtype, device: str = "cpu"
) -> list[KVCache]:
    """One KVCache per layer. Zero-filled: padded context positions point at real slots
    whose contents are masked out, and masked-out NaNs would still poison the output (0 * NaN).
    On the CPU K and V are on huge pages (models/huge_pages.py): a decode step reads every
    context's rows, from blocks anywhere in the pool."""
    shape = (num_kv_heads, num_slots, head_dim)

    def zeros(*size: int, dtype: torch.dtype) -> torch.Tensor:
        if torch.device(device).type == "cpu":
            return zeros_huge(size, dtype)
        return torch.zeros(size, dtype=dtype, device=device)

    def one() -> KVCache:
        k, v = (zeros(*shape, dtype=dtype) for _ in range(2))
        if dtype != torch.int8:
            return KVCache(k, v)
        ks, vs = (zeros(num_kv_heads, num_slots, dtype=SCALE_DTYPE) for _ in range(2))
        return KVCache(k, v, ks, vs)

    return [one() for _ in range(num_layers)]


def quantize_kv(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] float -> (int8 codes [..., D], float32 scales [...]), one scale per row.

    The same arithmetic as the kernels' quantize_row (rows.h), so every writer stores the same
    codes: scale = max|x| / 127, code = round-half-even(x / scale) (a zero row: scale 0, codes 0)."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1) / INT8_MAX
    codes = torch.round(xf / scale.clamp_min(torch.finfo(torch.float32).tiny).unsqueeze(-1))
    return codes.clamp_(-INT8_MAX, INT8_MAX).to(torch.int8), scale


def dequantize_kv(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(codes [..., D], scales [...]) -> codes * scale in `dtype` (the product in float32)."""
    return (codes.float() * scale.unsqueeze(-1)).to(dtype)


def write_kv(cache: KVCache, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """The torch writer: new rows k, v [T, kvH, D] into `slots` [T], converted or quantized."""
    if cache.k_scale is None or cache.v_scale is None:  # (the cache may be stored narrower than the activations)
        cache.k.index_copy_(1, slots, k.transpose(0, 1).to(cache.k.dtype))
        cache.v.index_copy_(1, slots, v.transpose(0, 1).to(cache.v.dtype))
        return
    for x, codes, scales in ((k, cache.k, cache.k_scale), (v, cache.v, cache.v_scale)):
        c, s = quantize_kv(x.transpose(0, 1))
        codes.index_copy_(1, slots, c)
        scales.index_copy_(1, slots, s)
