"""Rotary position embeddings (Hugging Face's rotate-half layout), with Llama-3 and linear scaling."""

from __future__ import annotations

import math
from typing import Any

import torch


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] in float32, scaled as the model's config says."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    raise ValueError(f"unsupported rope scaling type {kind!r} (supported: default, linear, llama3)")


def _llama3_inv_freq(inv_freq: torch.Tensor, s: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1's frequency-dependent scaling: long wavelengths divided by `factor`, short ones
    kept, a smooth blend between (Meta's reference formula)."""
    factor = float(s["factor"])
    low = float(s.get("low_freq_factor", 1.0))
    high = float(s.get("high_freq_factor", 4.0))
    old_ctx = float(s.get("original_max_position_embeddings", 8192))
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rope_cache(
    head_dim: int, theta: float, scaling: dict[str, Any] | None, max_positions: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables [max_positions, head_dim], computed in float32, stored in `dtype`."""
    inv_freq = rope_inv_freq(head_dim, theta, scaling)
    t = torch.arange(max_positions, dtype=torch.float32)
    freqs = torch.outer(t, inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D]; cos/sin [T, 1, D] (already gathered at the tokens' positions)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    rotated = torch.cat([-x2, x1], dim=-1)
    return x * cos + rotated * sin
